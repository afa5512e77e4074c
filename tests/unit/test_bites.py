"""The bite analysis (analyses/bites.py) on recorded samples, the sampler's files (run/sampler.py)
read back, and the matrix hook (reports/bites.py). No kernel.

The fixture tests/data/bites/6.12-global is a real lab run cut to t in [38, 64.5] s
(tests/data/bites/make_fixture.py says how it was recorded): Debian 6.12.95, MGLRU on, 512 MiB of
guest RAM under global pressure. Every expected value below was read off its files by hand (the
rows named in each comment), not computed by the code under test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moetrace.analyses import bites as B
from moetrace.errors import InputError
from moetrace.run.sampler import read_samples

FIX = Path(__file__).resolve().parents[1] / "data" / "bites" / "6.12-global"
T0_NS = 14797564187  # sampler.json t0_monotonic_ns
C = 200 << 20
INTERVAL = json.loads((FIX / "interval.json").read_text())
ARMED = ((INTERVAL["armed_ns"] - T0_NS) / 1e9, (INTERVAL["disarmed_ns"] - T0_NS) / 1e9)  # 13.21 .. 44.31 s


@pytest.fixture(scope="module")
def samples():
    return read_samples(FIX / "sampler")


@pytest.fixture(scope="module")
def probe():
    wakes = pd.read_csv(FIX / "vmscan_wakes.csv", dtype={"kind": "string"})
    batches = pd.read_csv(FIX / "vmscan_batches.csv", dtype={"who": "string"})
    return wakes, batches


def test_the_sampler_files_read_back_typed(samples):
    assert samples.t0_ns == T0_NS
    v = samples.vmstat
    assert len(v) == 27 and v["t"].iloc[0] == 38.0033 and v["t"].iloc[-1] == 64.0035
    assert str(v["pgsteal_kswapd"].dtype) == "Int64"
    assert v["pgscan_proactive"].isna().all()  # 6.12 has no proactive split: empty fields, NA, not 0
    assert {"allocstall_dma", "allocstall_dma32", "allocstall_normal", "allocstall_movable"} <= set(v.columns)
    assert list(samples.memfree.columns) == ["t", "memfree_kb", "cached_kb"]
    assert samples.memfree["memfree_kb"].iloc[0] == 5716
    g = samples.lru_gen
    assert list(g.columns) == ["t", "memcg_id", "memcg_path", "node", "seq", "age_ms", "nr_anon", "nr_file"]
    assert len(g) == 27 * 4 and set(g["memcg_path"]) == {"/"}
    assert samples.zoneinfo["start"]["sum_high_pages"] == 1019 == 32 + 987  # DMA high + DMA32 high
    assert samples.meta["streams"]["lru_gen"]["available"] is True


def test_kswapd_share_and_scan_to_steal_over_the_samples(samples):
    # first row (t 38.0033) and last (64.0035) of vmstat.csv:
    # pgscan_kswapd 125879 -> 150903, pgsteal_kswapd 125752 -> 150776 (+25024 each);
    # pgscan_direct 17536 -> 22290, pgsteal_direct 17468 -> 22222 (+4754 each); pgrefill 23594 -> 27610
    d = B.compute_reclaim_split(B.counter_deltas(samples.vmstat))
    assert d["pgsteal_kswapd_pages"] == 25024 and d["pgsteal_direct_pages"] == 4754
    assert d["kswapd_share"] == pytest.approx(25024 / (25024 + 4754))
    assert d["scan_to_steal_kswapd"] == 1.0 and d["scan_to_steal_direct"] == 1.0
    assert d["pgrefill_pages"] == 4016 and d["pageoutrun"] == 114 - 89 and d["allocstall"] == 74


def test_a_counter_the_kernel_lacks_is_none_not_zero(samples):
    d = B.counter_deltas(samples.vmstat)
    assert d["pgscan_proactive"] is None
    assert B.counter_deltas(samples.vmstat.head(1)) == {}


def test_the_oldest_generation_and_f_per_sample(samples):
    pick = B.pick_lruvec(samples.lru_gen)
    assert pick == (1, "/", 0)
    g = B.compute_oldest_generation(samples.lru_gen, 1, 0).set_index("t")
    # t 40.0005: seq 0 (no file pages), 1 (14764 file), 2, 3, 4; all file pages 63473
    assert g.loc[40.0005, "min_seq"] == 1 and g.loc[40.0005, "max_seq"] == 4
    assert g.loc[40.0005, "oldest_file_pages"] == 14764 and g.loc[40.0005, "file_pages"] == 63473
    assert g.loc[40.0005, "oldest_share"] == pytest.approx(14764 / 63473)
    assert g.loc[39.0006, "max_seq"] == 3
    assert g.loc[63.0006, "min_seq"] == 2 and g.loc[63.0006, "oldest_file_pages"] == 24377  # seq 1 gone


def test_generation_lifetimes_and_turnovers(samples):
    gens = B.compute_oldest_generation(samples.lru_gen, 1, 0)
    life = B.compute_generation_lifetimes(gens)
    assert life["seq"].tolist() == [1, 2]
    assert life["first_t"].iloc[0] == 38.0033 and life["left_t"].iloc[0] == 63.0006 and life["at_start"].iloc[0]
    assert life["lifetime_s"].iloc[0] == pytest.approx(63.0006 - 38.0033)
    assert pd.isna(life["left_t"].iloc[1]) and pd.isna(life["lifetime_s"].iloc[1])
    t = B.generation_turnover(gens)
    assert t["min_seq_advances"] == 1 and t["max_seq_advances"] == 1
    assert t["turnovers_per_min"] == pytest.approx(1 / ((64.0035 - 38.0033) / 60))
    # f over the 27 samples: the 14th of them sorted is t 44..58's 9310 / 61769
    assert t["oldest_share_median"] == pytest.approx(9310 / 61769)
    assert t["oldest_file_pages_median"] == 9310


def test_a_generation_that_came_and_went_between_two_samples_has_no_lifetime():
    gens = pd.DataFrame({"t": [0.0, 1.0, 2.0], "min_seq": pd.array([5, 7, 7], dtype="Int64")})
    life = B.compute_generation_lifetimes(gens)
    assert life["seq"].tolist() == [5, 6, 7]
    assert life["left_t"].tolist()[:2] == [1.0, 1.0] and pd.isna(life["first_t"].iloc[1])
    assert life["lifetime_s"].iloc[0] == 1.0 and pd.isna(life["lifetime_s"].iloc[1])


# wakes at these vmscan_wakes.csv rows begin the 10 passes; each ends at the next record
WAKE_ROWS = [0, 2, 4, 5, 7, 9, 11, 13, 15, 17]
FREED = [1024, 1024, 1024, 576, 1024, 1024, 1024, 960, 960, 960]  # kswapd batches summed per pass
OLDEST = [19427, 18204, 18204, 18204, 18204, 14764, 13513, 13513, 11465, 11465]  # lru_gen row at or before


def test_the_probe_passes_and_their_bites(samples, probe):
    p = B.compute_passes(*probe, T0_NS)
    wakes = probe[0]
    assert p["start_s"].tolist() == pytest.approx([(wakes["time_ns"][i] - T0_NS) / 1e9 for i in WAKE_ROWS])
    assert p["freed_pages"].tolist() == FREED and p["scanned_pages"].tolist() == FREED
    assert p["batches"].tolist() == [16, 16, 16, 9, 16, 16, 16, 15, 15, 15]
    assert p["order"].tolist() == [0, 6, 0, 0, 6, 0, 6, 0, 0, 0]
    assert p["ended_by"].tolist() == ["sleep", "sleep", "wake"] + ["sleep"] * 7
    assert p["scan_to_steal"].tolist() == [1.0] * 10 and p["min_priority"].tolist() == [6] * 10
    a = B.attach_oldest(p, B.compute_oldest_generation(samples.lru_gen, 1, 0))
    assert a["oldest_file_pages_at_start"].tolist() == OLDEST
    assert a["bite_over_oldest"].tolist() == pytest.approx([f / o for f, o in zip(FREED, OLDEST)])


def test_the_vmstat_passes_without_the_probe(samples):
    # pageoutrun steps between consecutive vmstat.csv rows, with pgsteal_kswapd / pgscan_kswapd
    p = B.compute_passes_vmstat(samples.vmstat)
    assert p["start_s"].tolist()[:3] == [38.0033, 39.0006, 40.0005]
    assert p["passes"].tolist() == [1, 4, 1, 2, 2, 2, 1, 3, 5, 4]
    assert p["freed_pages"].tolist() == [1024, 3648, 1024, 1984, 1920, 1920, 0, 3392, 2752, 6400]
    assert p["scanned_pages"].iloc[6] == 64 and pd.isna(p["scan_to_steal"].iloc[6])  # 59.0023 -> 60.0008
    assert p["freed_per_pass_pages"].iloc[1] == 3648 / 4


def test_the_memfree_sawtooth(samples, probe):
    # memfree.csv: 5716 (38.0033), 5712 (38.1007: the low), 8172, 9880 (38.3007: the high), 8772 ...;
    # the watermark gap Σhigh - Σlow = (1019 - 850) x 4 KiB = 676 kB separates the turns
    cyc = B.compute_memfree_cycles(samples.memfree, 850 * 4, 1019 * 4)
    c0 = cyc.iloc[0]
    assert (c0["min_t"], c0["free_min_kb"], c0["peak_t"], c0["free_peak_kb"]) == (38.1007, 5712, 38.3007, 9880)
    assert c0["rise_kb"] == 9880 - 5712 and c0["overshoot_kb"] == 9880 - 1019 * 4 and c0["confirmed"]
    marked = B.mark_kswapd_cycles(cyc, B.compute_passes(*probe, T0_NS))
    assert marked["kswapd"].iloc[0]  # the first pass ran 38.166 -> 38.363 s
    assert not marked.loc[marked["min_t"] > 45, "kswapd"].any()  # no probe pass after 42.94 s


def test_zigzag_turns():
    assert B.zigzag([5, 4, 9, 2, 3], 2) == [("trough", 1), ("peak", 2), ("trough?", 3)]
    assert B.zigzag([], 1) == []


def test_the_summary_over_the_recordings_window(samples, probe):
    """The window the probes counted in (manifest interval: t 13.21 -> 44.31 s): vmstat rows 38.0033
    to 44.0010, lru_gen samples 38 .. 44, all ten probe passes."""
    b = B.compute_bites(samples.vmstat, samples.memfree, samples.lru_gen, dict(samples.zoneinfo), C, window=ARMED,
                        probe_passes=B.compute_passes(*probe, T0_NS))
    s = b.summary
    # vmstat t 44.0010: pgsteal_kswapd 135352, pgscan_kswapd 135479, pgsteal_direct 17980, pgscan_direct 18048
    assert (s.pgsteal_kswapd_pages, s.pgsteal_direct_pages) == (135352 - 125752, 17980 - 17468) == (9600, 512)
    assert (s.pgscan_kswapd_pages, s.pgscan_direct_pages) == (135479 - 125879, 18048 - 17536) == (9600, 512)
    assert s.kswapd_share == pytest.approx(9600 / (9600 + 512))
    assert s.scan_to_steal_kswapd == 1.0 and s.scan_to_steal_direct == 1.0
    # f at t 38..44: 19427/66380, 18204/65788, 14764/63473, 13513/63016 (the median), 11465/61474, ...
    assert s.oldest_share_median == pytest.approx(13513 / 63016) and s.oldest_file_pages_median == 13513
    assert s.sum_high_bytes == 1019 * 4096
    assert s.sum_high_over_fC == pytest.approx(1019 * 4096 / (13513 / 63016 * C))
    assert s.sum_high_over_oldest == pytest.approx(1019 / 13513)
    assert (s.min_seq_advances, s.max_seq_advances, s.turnovers_per_min) == (0, 1, 0.0)
    assert s.pass_source == "vmscan" and s.passes == 10 and s.bite_p50_pages == 1024 and s.bite_max_pages == 1024
    assert s.bite_max_over_oldest == pytest.approx(1024 / 13513)  # of the 1024-page passes, the one at 41.03 s
    assert s.bite_over_oldest_p50 == pytest.approx((1024 / 18204 + 1024 / 14764) / 2)
    assert s.pass_scan_to_steal_p50 == 1.0
    assert s.evicted_pages is None and s.evicted_before_read_pages is None
    # f fell from 0.29 to 9310 / 61313 at 44 s; 5 of the 7 samples at or below a quarter
    assert s.oldest_share_min == pytest.approx(9310 / 61313) and s.oldest_share_below_quarter == pytest.approx(5 / 7)
    assert s.reread_burst_ratio is None and b.advances.empty  # no per-iteration recording given
    assert b.columns() == {"kswapd_share": s.kswapd_share, "scan_to_steal_kswapd": 1.0, "scan_to_steal_direct": 1.0, "sum_high_over_fC": s.sum_high_over_fC,
                           "turnovers_per_min": 0.0, "bite_p50_pages": 1024.0,
                           "bite_max_over_oldest": s.bite_max_over_oldest, "evicted_before_read_pages": None,
                           "oldest_share_min": s.oldest_share_min,
                           "oldest_share_below_quarter": s.oldest_share_below_quarter, "reread_burst_ratio": None,
                           "reread_burst_ratio_aging": None}


def test_without_the_probe_the_passes_come_from_pageoutrun(samples):
    b = B.compute_bites(samples.vmstat, samples.memfree, samples.lru_gen, dict(samples.zoneinfo), C)
    s = b.summary
    assert s.pass_source == "vmstat" and s.passes == 25  # pageoutrun 89 -> 114
    assert s.min_seq_advances == 1 and s.generation_lifetime_s_median == pytest.approx(63.0006 - 38.0033)
    # per-pass means: 1024, 912, 1024, 992, 960, 960, 0, 1130.67, 550.4, 1600 -> median (960 + 992) / 2
    assert s.bite_p50_pages == (960 + 992) / 2


def test_without_lru_gen_or_zoneinfo_the_summary_says_so(samples):
    b = B.compute_bites(samples.vmstat, None, None, None, C)
    assert b.summary.sum_high_over_fC is None and b.summary.oldest_share_median is None
    assert any("zoneinfo" in n for n in b.summary.notes) and any("lru_gen" in n for n in b.summary.notes)
    assert b.generations.empty and b.columns()["kswapd_share"] == pytest.approx(25024 / 29778)


# -- pages evicted before a read completed: hand-made streams ------------------------------------

def _events(rows):
    return pd.DataFrame(rows, columns=["ts_ns", "expert_id", "kind", "first_page_index", "pages"])


def _calls(rows):
    df = pd.DataFrame(rows, columns=["ts_ns", "latency_ns", "offset_bytes", "ret", "expert_id"])
    df["offset_bytes"] = df["offset_bytes"].astype("Int64")
    df["expert_id"] = df["expert_id"].astype("Int64")
    return df


def test_evicted_before_read_per_page():
    ev = _events([
        (100, 0, "add", 0, 4),      # expert 0 pages 0-3 (one folio)
        (500, 0, "delete", 0, 2),   # pages 0-1: read (call done at 300) -> not
        (520, 0, "delete", 2, 2),   # pages 2-3: the call read only 0-1 -> evicted before read
        (100, 1, "add", 0, 1),      # expert 1 page 0 ...
        (200, 1, "delete", 0, 1),   # ... deleted while a call was copying it (done at 250)
        (50, 2, "delete", 0, 1),    # expert 2: no add seen (resident before): left out
        (600, 2, "add", 0, 1),      # added, never deleted: not evicted
        (10, 9, "add", 0, 1), (20, 9, "delete", 0, 1),  # the unattributed slot (n_experts_total 3)
    ])
    calls = _calls([
        (150, 150, 0, 8192, 0),     # expert 0, bytes 0-8191 = pages 0-1, done at 300
        (150, 100, 0, 4096, 1),     # expert 1 page 0, done at 250 (after the delete at 200)
        (700, 10, 0, 4096, 2),      # after everything
        (150, 10, 0, 4096, None),   # not an expert
    ])
    out = B.compute_evicted_before_read(ev, calls, None, n_experts_total=3)
    assert out[["expert_id", "page"]].values.tolist() == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0]]
    assert out["evicted_before_read"].tolist() == [False, False, True, True, True]
    assert out["read_done_ns"].tolist()[:2] == [300, 300] and pd.isna(out["read_done_ns"].iloc[2])


def test_evicted_before_read_in_a_pool_file_and_a_page_read_twice():
    # a pool file of 8-page extents: expert 3 starts at byte 3 x 32768; a read at 98304 + 4096
    # covers expert 3's page 1. The page lives twice: read in the first stay, not in the second.
    ev = _events([(0, 3, "add", 1, 1), (100, 3, "delete", 1, 1), (200, 3, "add", 1, 1), (300, 3, "delete", 1, 1)])
    calls = _calls([(10, 20, 3 * 32768 + 4096, 4096, 3)])
    out = B.compute_evicted_before_read(ev, calls, extent_bytes=32768)
    assert out["add_ns"].tolist() == [0, 200]
    assert out["evicted_before_read"].tolist() == [False, True]


def test_rereads_after_each_pass():
    passes = pd.DataFrame({"pass": [0, 1], "start_s": [1.0, 3.0]})
    epochs = pd.DataFrame({"epoch": [0, 1, 2, 3], "start_ns": pd.array([0, 1_500_000_000, 3_000_000_000,
                                                                         3_500_000_000], dtype="Int64")})
    ee = pd.DataFrame({"epoch": [0, 1, 1, 2, 3, 3], "kind": ["expert"] * 5 + ["unattributed"],
                       "layer": [0] * 6, "expert": [1, 1, 2, 1, 2, 0], "expert_id": [1, 1, 2, 1, 2, 99],
                       "re_added_pages": pd.array([7, 5, 0, 3, 4, 9], dtype="Int64")})
    r = B.compute_rereads_after_passes(passes, epochs, ee, t0_ns=0)
    # epoch 0 began before any pass; epoch 1 after pass 0; epochs 2, 3 after pass 1
    assert r.values.tolist() == [[0, 1, 0, 1, 5], [1, 1, 0, 1, 3], [1, 2, 0, 2, 4]]


# -- the matrix hook ---------------------------------------------------------------------------------

def _lab_dir(tmp_path: Path, probe, name: str = "lab") -> Path:
    lab = tmp_path / name
    shutil.copytree(FIX / "sampler", lab / "sampler")
    (lab / "run").mkdir()
    (lab / "run" / "manifest.json").write_text(json.dumps({"interval": INTERVAL}))
    for name, df in zip(("vmscan_wakes", "vmscan_batches"), probe):
        df.to_parquet(lab / "run" / f"{name}.parquet")
    return lab


def test_bite_columns_of_a_lab_directory(tmp_path, probe):
    from moetrace.reports.bites import bite_columns

    cols = bite_columns(_lab_dir(tmp_path, probe), C)
    assert list(cols) == list(B.MATRIX_COLUMNS)
    assert cols["kswapd_share"] == pytest.approx(9600 / (9600 + 512))  # the recording's window: rows 38 .. 44 s
    assert cols["bite_p50_pages"] == 1024 and cols["bite_max_over_oldest"] == pytest.approx(1024 / 13513)
    assert cols["sum_high_over_fC"] == pytest.approx(1019 * 4096 / (13513 / 63016 * C))
    assert bite_columns(tmp_path / "nothing-here", C) == {}


def test_damaged_sampler_files_are_an_error_naming_the_file(tmp_path, probe):
    from moetrace.reports.bites import bite_columns

    lab = _lab_dir(tmp_path, probe)
    (lab / "sampler" / "vmstat.csv").write_text("t,pgscan_kswapd\n1.0,abc\n")
    cols = bite_columns(lab, C)
    assert cols["kswapd_share"] is None and "vmstat.csv" in cols["bites_error"]
    with pytest.raises(InputError, match="vmstat.csv"):
        read_samples(lab / "sampler")
    (lab / "sampler" / "sampler.json").write_text("{}")
    with pytest.raises(InputError, match="sampler.json"):
        read_samples(lab)


def test_the_why_section_per_condition(tmp_path, probe):
    from moetrace.reports.bites import section_why
    from moetrace.reports.document import Report

    m = tmp_path / "m"
    lab = _lab_dir(m, probe, "cells/6.12-mglru-on/vm-memory-200MiB-r0")
    # iterations beginning after pass 0 (t 38.17 s), after pass 6 (41.03 s) and before any pass
    s = lambda t: T0_NS + int(t * 1e9)  # noqa: E731
    pd.DataFrame({"epoch": [0, 1, 2], "start_ns": pd.array([s(30.0), s(38.5), s(41.2)], dtype="Int64")}).to_parquet(
        lab / "run" / "epochs.parquet")
    pd.DataFrame({"epoch": [0, 1, 1, 2], "kind": "expert", "layer": 0, "expert": [4, 4, 7, 7],
                  "expert_id": [4, 4, 7, 7], "re_added_pages": pd.array([9, 10, 20, 30], dtype="Int64")}).to_parquet(
        lab / "run" / "expert_epochs.parquet")
    cells = pd.DataFrame([{"condition": "6.12-mglru-on", "cell_dir": "cells/6.12-mglru-on/vm-memory-200MiB-r0",
                           "capacity_bytes": C, "retained": True},
                          {"condition": "6.1-mglru-off", "cell_dir": "cells/6.1-mglru-off/cgroup-200MiB-r0",
                           "capacity_bytes": C, "retained": True}])
    rep = Report(tmp_path / "r", "t")
    section_why(rep, m, cells)
    assert "why_6_12-mglru-on" in rep.figures and rep.figures["why_6_12-mglru-on"][:4] == b"\x89PNG"
    why = rep.tables["why_cells"]
    assert why["cell"].tolist() == ["vm-memory-200MiB-r0"] and why["bite_p50_pages"].tolist() == [1024.0]
    p = rep.tables["why_6_12-mglru-on_passes"].set_index("pass")
    assert p.loc[0, "re_added_pages_after"] == 30 and p.loc[0, "experts_re_read_after"] == 2
    assert p.loc[6, "re_added_pages_after"] == 30 and p.loc[6, "top_experts_re_read"] == "L0E7 30"
    assert p["re_added_pages_after"].sum() == 60  # epoch 0 began before any pass
    assert any("6.1-mglru-off: not measured" in t for t in rep.md)


def test_matrix_rows_carry_the_bite_columns_only_where_the_sampler_ran(tmp_path, probe):
    from moetrace.lab import matrix as M

    spec_path = tmp_path / "spec.toml"
    spec_path.write_text('kernels = ["6.12"]\nmglru = ["on"]\nmechanisms = ["vm-memory"]\n'
                         'capacities = ["200MiB"]\nrepeats = 2\nplan = "plan.bin"\npool = "/var/tmp/pool"\n')
    spec = M.load_spec(spec_path)
    out = tmp_path / "m"
    M.prepare(out, spec, resume=False)
    a, b = spec.cells()
    _lab_dir(out, probe, a.rel_dir)
    for c in (a, b):
        M.mark_done(out, c, {"lab": {}, "retained": False, "reasons": ["no cell result"], "result": None})
    rows = {r["cell_dir"]: r for r in M.matrix_rows(out)}
    with_sampler, without = rows[a.rel_dir], rows[b.rel_dir]
    assert with_sampler["bite_p50_pages"] == 1024 and with_sampler["kswapd_share"] == pytest.approx(9600 / 10112)
    assert with_sampler["sum_high_over_fC"] == pytest.approx(1019 * 4096 / (13513 / 63016 * (200 << 20)))
    assert not set(B.MATRIX_COLUMNS) & set(without)  # an older cell's row as before


def test_a_lab_directory_with_the_page_and_read_streams_counts_pages_evicted_before_a_read(tmp_path, probe):
    from moetrace.reports.bites import cell_bites

    lab = _lab_dir(tmp_path, probe)
    s = lambda t: T0_NS + int(t * 1e9)  # noqa: E731  inside the recording's window (13.2 .. 44.3 s)
    man = {"interval": INTERVAL, "pool": {"layout": "files", "geometry": {"n_layers": 1, "n_experts": 4}},
           "lost": {"reads": {"stream": {"lost_kernel": 2, "lost_user": 0}}}}
    (lab / "run" / "manifest.json").write_text(json.dumps(man))
    _events([(s(20), 1, "add", 0, 2), (s(21), 1, "delete", 0, 2), (s(50), 2, "add", 0, 1), (s(51), 2, "delete", 0, 1)]
            ).to_parquet(lab / "run" / "page_events.parquet")
    calls = _calls([(s(20.1), 1000, 0, 4096, 1)])  # expert 1 page 0 read; page 1 never
    calls.to_parquet(lab / "run" / "read_calls.parquet")
    b = cell_bites(lab, C)
    assert (b.summary.evicted_pages, b.summary.evicted_before_read_pages) == (2, 1)  # expert 2's stay: after 44.3 s
    assert b.columns()["evicted_before_read_pages"] == 1.0
    assert any("reads stream lost 2 records" in n for n in b.summary.notes)
    _calls([(s(20.1), 1000, 0, 4096, None)]).to_parquet(lab / "run" / "read_calls.parquet")  # no pool read: mmap
    b = cell_bites(lab, C)
    assert b.summary.evicted_before_read_pages is None and any("mmap" in n for n in b.summary.notes)


def test_a_memcg_going_offline_is_followed_only_when_nothing_else_is():
    """Measured on 6.12: after the cell removed its memcg, lru_gen listed it with id 0 (released)."""
    g = pd.DataFrame({"t": [1.0, 1.0, 2.0], "memcg_id": [3, 3, 0], "memcg_path": ["/c", "/c", "/c"], "node": 0,
                      "seq": [1, 2, 1], "age_ms": 0, "nr_anon": 0, "nr_file": [10, 20, 900]})
    assert B.pick_lruvec(g, "/c") == (3, "/c", 0)
    assert B.pick_lruvec(g[g["t"] == 2.0], "/c") == (0, "/c", 0)
    assert B.pick_lruvec(g, "/elsewhere") is None


def test_a_matrix_cells_window_is_its_measured_window(tmp_path, probe):
    """A matrix cell (lab directory with cell/): the window is loop entry -> post of its snapshots;
    its memcg (cell.json scope) followed when lru_gen lists it, else the one with the most file pages."""
    from moetrace.reports.bites import cell_bites

    lab = _lab_dir(tmp_path, probe)
    (lab / "cell" / "snapshots").mkdir(parents=True)
    (lab / "cell" / "cell.json").write_text(json.dumps({"scope": {"path": "/sys/fs/cgroup/moetrace-cell"}}))
    for label, t in (("loop_entry", 39.5), ("post", 43.5)):
        (lab / "cell" / "snapshots" / f"{label}.json").write_text(json.dumps({"monotonic_ns": T0_NS + int(t * 1e9)}))
    s = cell_bites(lab, C).summary
    assert (s.window_start_s, s.window_end_s) == pytest.approx((39.5, 43.5))
    # vmstat rows 40.0005 -> 43.0008: pgsteal_kswapd 130424 -> 135352, pgsteal_direct 17852 -> 17980
    assert s.kswapd_share == pytest.approx((135352 - 130424) / ((135352 - 130424) + (17980 - 17852)))
    assert s.memcg_path == "/"  # /moetrace-cell is not in this run's lru_gen
    # the probe passes starting inside: 39.51, 39.62, 39.88, 40.06, 41.03, 41.77, 42.33, 42.80 s
    assert s.passes == 8 and s.bite_p50_pages == (960 + 1024) / 2  # 1024, 576, 1024, 1024, 1024, 960, 960, 960


def test_the_sawtooth_follows_the_zones_kswapd_balanced(samples):
    """With each zone's free pages (memfree.csv's free_<zone>_pages), the DMA zone, never below its
    low watermark (27 pages), stays out: its 3800 free pages are no overshoot."""
    zones = samples.zoneinfo["start"]["zones"]  # DMA low 27 high 32, DMA32 low 823 high 987
    dma32 = [900, 700, 1200, 1500, 1100, 600, 1000]
    m = pd.DataFrame({"t": [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "memfree_kb": [(3800 + p) * 4 for p in dma32],
                      "free_dma_pages": pd.array([3800] * 7, dtype="Int64"),
                      "free_dma32_pages": pd.array(dma32, dtype="Int64")})
    frame, low_kb, high_kb, of = B.free_series(m, zones, 4096)
    assert (low_kb, high_kb, of) == (823 * 4, 987 * 4, "dma32")
    cyc = B.compute_memfree_cycles(frame, low_kb, high_kb, "free_kb")
    # turns need a move of (987 - 823) x 4 = 656 kB = 164 pages: trough 700 (0.1), peak 1500 (0.3), trough 600
    assert cyc[["min_t", "free_min_kb", "peak_t", "free_peak_kb"]].values.tolist()[0] == [0.1, 2800, 0.3, 6000]
    assert cyc["overshoot_kb"].iloc[0] == (1500 - 987) * 4
    b = B.compute_bites(samples.vmstat, m, None, dict(samples.zoneinfo), C)
    assert b.summary.sawtooth_of == "dma32"
    assert B.free_series(m.drop(columns=["free_dma_pages", "free_dma32_pages"]), zones)[3] == "MemFree"


# -- M2: f's lowest and the re-reads after each advance -------------------------------------------

def test_f_lowest_and_its_time_at_or_below_a_quarter():
    gens = pd.DataFrame({"t": [0.0, 1.0, 2.0, 3.0], "min_seq": pd.array([1, 1, 1, 2], dtype="Int64"),
                         "max_seq": pd.array([3, 3, 4, 4], dtype="Int64"),
                         "oldest_share": pd.array([0.9, 0.25, 0.1, pd.NA], dtype="Float64"),
                         "oldest_file_pages": pd.array([9, 2, 1, pd.NA], dtype="Int64")})
    t = B.generation_turnover(gens)
    assert t["oldest_share_min"] == pytest.approx(0.1)
    assert t["oldest_share_below_quarter"] == pytest.approx(2 / 3)  # 0.25 counts; the NA sample does not


def test_rereads_after_each_min_seq_advance_against_the_other_iterations():
    # iterations every 10 s re-reading 100 pages, but 900 in the one running when min_seq moved
    # (between the samples at 24 and 25 s: [24, 27] overlaps only the iteration of 20..30 s) and
    # 500 in the next; max_seq moved once, between 41 and 42 s; min_seq again at 58..59 s (the
    # last iteration, open-ended, and one 2 s before it: [58, 61])
    gens = pd.DataFrame({"t": np.arange(0.0, 60.0), "min_seq": pd.array([3] * 25 + [4] * 34 + [5], dtype="Int64"),
                         "max_seq": pd.array([5] * 42 + [6] * 18, dtype="Int64")})
    per_epoch = pd.DataFrame({"epoch": range(7), "start_s": [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 56.0],
                              "re_added_pages": [100, 100, 900, 500, 100, 100, 300]})
    adv, fig = B.compute_rereads_after_advances(gens, per_epoch)
    assert adv[["from_t", "to_t", "from_seq", "to_seq", "iterations", "re_added_pages_after"]].values.tolist() == \
        [[24.0, 25.0, 3, 4, 1, 900], [58.0, 59.0, 4, 5, 1, 300]]
    assert fig["advances"] == 2 and fig["iterations_after"] == 2
    assert fig["reread_after_per_iteration"] == 600 and fig["reread_other_per_iteration"] == 180
    assert fig["burst"] == pytest.approx(600 / 180)
    adv, fig = B.compute_rereads_after_advances(gens, per_epoch, "max_seq", follow_s=10.0)
    assert adv["re_added_pages_after"].tolist() == [200]  # [41, 52]: the iterations from 40 and 50 s
    assert fig["burst"] == pytest.approx(100 / 380)  # aging was not followed by re-reads: the others held them


def test_no_advance_or_no_other_rereads_is_no_burst_ratio():
    gens = pd.DataFrame({"t": [0.0, 1.0], "min_seq": pd.array([2, 2], dtype="Int64")})
    per_epoch = pd.DataFrame({"epoch": [0, 1], "start_s": [0.0, 0.5], "re_added_pages": [5, 5]})
    adv, fig = B.compute_rereads_after_advances(gens, per_epoch)
    assert adv.empty and fig["advances"] == 0 and fig["burst"] is None and fig["reread_other_per_iteration"] == 5
    gens = pd.DataFrame({"t": [0.0, 1.0], "min_seq": pd.array([2, 3], dtype="Int64")})
    adv, fig = B.compute_rereads_after_advances(gens, per_epoch)
    assert fig["burst"] is None and fig["reread_other_per_iteration"] is None  # both iterations follow it


def test_epoch_rereads_leaves_out_the_unattributed():
    epochs = pd.DataFrame({"epoch": [0, 1], "start_ns": pd.array([2_000_000_000, 3_000_000_000], dtype="Int64")})
    ee = pd.DataFrame({"epoch": [0, 0, 1], "kind": ["expert", "unattributed", "expert"],
                       "re_added_pages": pd.array([3, 50, 4], dtype="Int64")})
    out = B.epoch_rereads(epochs, ee, t0_ns=1_000_000_000)
    assert out.values.tolist() == [[0, 1.0, 3], [1, 2.0, 4]]
