"""What a matrix cell's kernel did in its window, and the matrix summed up (no-kernel tier: the
snapshots and tables a cell brings back, written here in their formats)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from moetrace.reports import matrix as R


def snap(ns: int, vm: dict, gens: list[tuple[str, int, int]], psi_some: int = 0) -> dict:
    return {"monotonic_ns": ns, "vmstat": vm,
            "psi": {"memory": {"some": {"total_us": psi_some}, "full": {"total_us": psi_some // 2}}},
            "lru_gen": [{"memcg_path": p, "memcg_id": 3, "node": 0, "seq": s, "age_ms": a, "nr_anon": 0, "nr_file": 9}
                        for p, s, a in gens]}


VM0 = {"pgscan_kswapd": 100, "pgsteal_kswapd": 50, "pgscan_direct": 10, "pgsteal_direct": 5,
       "workingset_refault_file": 7, "workingset_activate_file": 3, "workingset_restore_file": 0, "pgpgin": 1000}


def test_vmstat_window_deltas_and_scan_to_steal():
    post = {k: v * 3 for k, v in VM0.items()}
    d = R.vmstat_window(snap(0, VM0, [], 10), snap(1, post, [], 40))
    assert d["pgscan_kswapd"] == 200 and d["pgsteal_direct"] == 10 and d["pgpgin"] == 2000
    assert d["scan_to_steal"] == pytest.approx(220 / 110)
    assert d["psi_memory_some_us"] == 30 and d["psi_memory_full_us"] == 15
    assert R.vmstat_window(snap(0, VM0, []), snap(1, VM0, []))["scan_to_steal"] is None  # nothing stolen


def test_generations_window_of_the_replays_memcg():
    pre = snap(0, VM0, [("/moetrace-cell", s, 100) for s in (0, 1, 2, 3)] + [("/", 9, 5)])
    post = snap(1, VM0, [("/moetrace-cell", s, 700 - s) for s in (2, 3, 4, 5, 6)] + [("/", 12, 5)])
    assert R.generations_window(pre, post, "/moetrace-cell") == {
        "generations_born": 3, "generations_left": 2, "oldest_generation_age_ms": 698, "live_generations": 5}
    assert R.generations_window(pre, post, "/other") == {}  # no MGLRU rows for it (or no MGLRU)


def write_cell(d: Path, evictions: list[tuple[int, int, int, int]], births: dict[int, int], iters: int = 4) -> Path:
    """A lab cell directory: cell.json, loop_entry/post snapshots at 1 s and 9 s, and the mglru
    probe's tables (evictions: (time_ns, ino, page_index, seq); births: seq -> birth_ns)."""
    c = d / "cell"
    (c / "snapshots").mkdir(parents=True)
    (c / "run").mkdir()
    (c / "cell.json").write_text(json.dumps({"scope": {"path": "/sys/fs/cgroup/moetrace-cell"},
                                             "measured_iterations": iters}))
    (c / "snapshots" / "loop_entry.json").write_text(json.dumps(snap(10 ** 9, VM0, [("/moetrace-cell", 1, 0)])))
    (c / "snapshots" / "post.json").write_text(json.dumps(snap(9 * 10 ** 9, {k: 2 * v for k, v in VM0.items()},
                                                               [("/moetrace-cell", 1, 0)])))
    pd.DataFrame({"time_ns": [e[0] for e in evictions], "layer": 0, "expert": 0, "expert_id": 0,
                  "ino": [e[1] for e in evictions], "page_index": [e[2] for e in evictions], "memcg_id": 3,
                  "seq": pd.array([e[3] for e in evictions], dtype="Int64"), "tgid": 1}).to_parquet(
        c / "run" / "mglru_evictions.parquet")
    pd.DataFrame({"time_ns": 0, "sample": 0, "memcg_id": 3, "memcg_path": "/moetrace-cell", "node": 0,
                  "seq": list(births), "gen": [s % 4 for s in births], "age_ms": 0, "birth_ns": list(births.values()),
                  "nr_anon_pages": 0, "nr_file_pages": 5, "anon_evicted": False, "file_evicted": False}).to_parquet(
        c / "run" / "lru_gen.parquet")
    return d


def test_cell_window_ages_the_evictions_inside_the_window_and_caches(tmp_path):
    s = 10 ** 9
    ev = [(0.5 * s, 1, 0, 1),  # before loop entry: not counted
          (2 * s, 1, 0, 1), (3 * s, 1, 1, 1), (4 * s, 1, 0, 2), (5 * s, 2, 0, 2),
          (9.5 * s, 1, 0, 2)]  # after post: not counted
    d = write_cell(tmp_path / "c", [(int(t), i, p, q) for t, i, p, q in ev], {1: 0, 2: 3 * s})
    w = R.cell_window(d)
    assert w["evicted_pages"] == 4 and w["distinct_evicted_pages"] == 3
    assert w["evictions_per_page"] == pytest.approx(4 / 3)
    assert w["evicted_bytes_per_iteration"] == 4 * 4096 / 4
    # ages: 2000, 3000 (seq 1 born at 0), 1000, 2000 (seq 2 born at 3 s)
    assert w["eviction_age_ms_median"] == pytest.approx(2000) and w["eviction_age_birth_known_share"] == 1.0
    assert w["pgpgin"] == 1000 and w["generations_born"] == 0
    assert json.loads((d / "cell" / "window.json").read_text()) == {**w, "window_version": R.WINDOW_VERSION}
    (d / "cell" / "run" / "mglru_evictions.parquet").unlink()
    assert R.cell_window(d) == w  # from the cache
    assert R.cell_window(tmp_path / "none") == {}  # a cell that brought nothing back


def test_cell_window_leaves_generation_figures_out_with_mglru_off(tmp_path):
    """With MGLRU off lru_gen still lists generations and folios keep stale generation bits: their
    ages at eviction and the generations born mean nothing, and are left out."""
    s = 10 ** 9
    d = write_cell(tmp_path / "c", [(2 * s, 1, 0, 1), (3 * s, 1, 0, 1)], {1: 0})
    totals = {"experts_added_pages": 250, "experts_device_read_bytes": 250 * 4096, "unattributed_device_read_bytes": 0}
    (d / "cell" / "run" / "manifest.json").write_text(json.dumps({"mglru": {"on": False}, "totals": totals}))
    (d / "cell" / "run" / "snapshots.json").write_text(json.dumps({"pre": {"vmstat": {"pgpgin": 10}},
                                                                   "post": {"vmstat": {"pgpgin": 1010}}}))
    w = R.cell_window(d)
    assert (w["experts_added_pages"], w["recording_pgpgin_kib"], w["added_pages_equal_pgpgin"]) == (250, 1000, True)
    assert w["added_pages_within_skipped_runs"] is True and w["skipped_add_runs"] == 0
    assert w["evicted_pages"] == 2 and w["evictions_per_page"] == 2.0 and w["pgpgin"] == 1000
    assert not {k for k in w if k.startswith(("eviction_age", "generations_", "live_gen", "oldest_gen"))}
    (d / "cell" / "window.json").write_text(json.dumps({**w, "eviction_age_ms_median": 1.0}))  # an older cache
    assert R.cell_window(d) == w


def row(mglru: str, mech: str, dev: float, retained=True, **kw) -> dict:
    return {"kernel": "6.12", "release": "6.12.9", "mglru": mglru, "mechanism_spec": mech, "capacity": "320MiB",
            "retained": retained, "device_bytes_per_iteration": dev, "miss_bytes_per_iteration": 4e6,
            "amplification": dev / 4e6, "scan_to_steal": kw.get("sts", 1.0), "pool_fits": False, **kw}


def test_summary_takes_medians_over_retained_repeats_and_draws_fig3(tmp_path):
    rows = [row("on", "balloon0.81", 9e6, sts=2.5), row("on", "balloon0.81", 8e6, sts=2.4),
            row("on", "balloon0.81", 1e9, retained=False), row("off", "balloon0.81", 4.2e6),
            row("on", "cgroup", 4.1e6), row("off", "cgroup", 4.0e6, added_pages_equal_pgpgin=True)]
    summ = {(s["mglru"], s["mechanism"]): s for s in R.summarize(rows)}
    b = summ[("on", "balloon0.81")]
    assert (b["cells"], b["retained"]) == (3, 2)
    assert b["device_bytes_per_iteration_median"] == 8.5e6 and b["device_bytes_per_iteration_max"] == 9e6
    assert b["scan_to_steal_median"] == pytest.approx(2.45) and b["eviction_age_ms_median_median"] is None
    assert b["added_pages_equal_pgpgin"] == 0 and summ[("off", "cgroup")]["added_pages_equal_pgpgin"] == 1
    md = R.summary_markdown(R.summarize(rows))
    assert len({line.count("|") for line in md.splitlines()}) == 1  # every row has the header's columns
    assert md.count("\n") == 2 + 4 and "| 6.12 | on | balloon0.81 | - | - | - | 2/3 | 8.50 (8.00-9.00) | 4.00 | 2.12" in md
    paths = R.write_tables(tmp_path, rows)
    assert paths["fig3"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(pd.read_csv(paths["csv"])) == 4 and not list(tmp_path.glob("*.tmp*"))
    assert len(pd.read_csv(paths["cells"])) == len(rows)
    (tmp_path / "empty").mkdir()
    assert "fig3" not in R.write_tables(tmp_path / "empty", [])  # nothing finished yet: tables, no figure


def test_cell_window_says_why_pages_were_read_again_from_the_plan_and_the_log(tmp_path):
    """With the cell's plan, its replay log and its LRU budget (cell.json), the window's evictions
    are set against the accesses around them (analyses.eviction_reuse)."""
    import numpy as np

    from moetrace.inputs.geometry import Geometry
    from moetrace.inputs.plan import write_plan
    from moetrace.inputs.trace import Accesses

    s = 10 ** 9
    # plan: iteration i reads expert i % 4 (1 layer x 4 experts); the log: 8 iterations 1 s apart
    acc = Accesses(np.arange(4, dtype=np.int32), np.zeros(4, np.int8), np.zeros(4, np.int16),
                   np.arange(4, dtype=np.int32), 1, 4, 4)
    write_plan(tmp_path / "plan.bin", acc, Geometry(1, 4, 1, 1 << 20, "t"))
    # expert 1 evicted at 2.5 s (iteration 2, read in 1, again in 5: {2, 3, 0} between)
    d = write_cell(tmp_path / "c", [(int(2.5 * s), 7, 0, 1), (int(2.5 * s), 7, 1, 1)], {1: 0})
    ev = pd.read_parquet(d / "cell" / "run" / "mglru_evictions.parquet")
    ev.assign(expert_id=1).to_parquet(d / "cell" / "run" / "mglru_evictions.parquet")
    (d / "cell" / "replay").mkdir()
    pd.DataFrame({"phase": "measured", "step": [i % 4 for i in range(8)],
                  "start_ns": [i * s for i in range(8)]}).to_parquet(d / "cell" / "replay" / "iterations.parquet")
    cell = json.loads((d / "cell" / "cell.json").read_text())
    cell.update(inputs={"plan": str(tmp_path / "plan.bin")}, simulated={"budget_experts": 4})
    (d / "cell" / "cell.json").write_text(json.dumps(cell))
    w = R.cell_window(d)
    assert (w["evicted_pages"], w["reread_pages"], w["excess_pages"]) == (2, 2, 2)  # 3 others < 4: LRU keeps it
    assert w["excess_share_of_rereads"] == 1.0 and w["reread_iterations_since_access_median"] == 1.0
    assert w["evicted_from_oldest_share"] == 1.0


def test_pool_resident_sums_added_less_evicted_from_the_recordings_start(tmp_path):
    """Epoch 0 setup, 1-2 warm-up, 3-5 measured, 6 after: resident at the end of 3, 4, 5 is
    300, 250, 260 pages (one expert row per epoch and a file row that does not count)."""
    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame({"epoch": range(7), "phase": ["setup", "warmup", "warmup", "measured", "measured", "measured",
                                               "after"]}).to_parquet(run / "epochs.parquet")
    rows = [(1, 200, 0), (2, 150, 50), (3, 0, 0), (4, 10, 60), (5, 20, 10), (6, 0, 260)]
    df = pd.DataFrame({"epoch": [r[0] for r in rows], "kind": "expert", "added_pages": [r[1] for r in rows],
                       "evicted_pages": [r[2] for r in rows]})
    other = pd.DataFrame({"epoch": [3], "kind": "file", "added_pages": [999], "evicted_pages": [0]})
    pd.concat([df, other]).to_parquet(run / "expert_epochs.parquet")
    r = R.pool_resident(run)
    assert r == {"pool_resident_bytes": 260 * 4096.0, "pool_resident_bytes_min": 250 * 4096,
                 "pool_resident_bytes_max": 300 * 4096}
    df.loc[0, "added_pages"] = 0  # evicted before it was added: resident at the start, unknown
    df.to_parquet(run / "expert_epochs.parquet")
    assert R.pool_resident(run) == {} and R.pool_resident(tmp_path / "none") == {}


def test_oldest_file_generation_share_is_the_median_over_the_windows_samples():
    rows = []
    for sample, t, files in ((0, 1, (0, 10, 30)), (1, 5, (0, 40, 60)), (2, 6, (0, 50, 50)), (3, 20, (0, 1, 99))):
        rows += [{"time_ns": t, "sample": sample, "memcg_id": 3, "node": 0, "seq": s, "nr_file_pages": f}
                 for s, f in enumerate(files)]
    rows.append({"time_ns": 5, "sample": 1, "memcg_id": 1, "node": 0, "seq": 0, "nr_file_pages": 7})
    g = pd.DataFrame(rows)
    # inside [2, 10]: samples 1 and 2, oldest generation holding file pages (seq 1): 0.4 and 0.5
    assert R.oldest_file_generation_share(g, 3, 2, 10) == pytest.approx(0.45)
    assert R.oldest_file_generation_share(g, 1, 0, 10) == 1.0
    assert R.oldest_file_generation_share(g, 3, 30, 40) is None


def test_generation_findings_say_where_the_file_pages_sat():
    on = {"mglru": "on", "generations_born_median": 0, "evicted_from_oldest_share_median": 1.0,
          "file_pages_in_oldest_generation_share_median": 0.4}
    on2 = {**on, "file_pages_in_oldest_generation_share_median": 0.85}
    off = {"mglru": "off", "generations_born_median": None}
    (text,) = R.generation_findings("6.12", [on, on2, off])
    assert text == ("6.12, MGLRU on: 0 generations born in the measured windows (2 mechanisms); 100 % of "
                    "evictions from the oldest generation; the oldest generation held 40-85 % of the memcg's file "
                    "pages, the rest sat in younger generations that no eviction reached.")
    assert R.generation_findings("6.12", [off]) == []


def test_lru_dwell_reads_the_lru_probes_histogram(tmp_path):
    pd.DataFrame({"kind": ["insertion_to_eviction"] * 2 + ["insertion_to_activation"],
                  "slot": [30, 31, 20], "lo_ns": [2 ** 30, 2 ** 31, 2 ** 20], "hi_ns": [2 ** 31, 2 ** 32, 2 ** 21],
                  "pages": [10, 30, 7]}).to_parquet(tmp_path / "lru_dwell_histogram.parquet")
    d = R.lru_dwell(tmp_path)
    assert d["activated_pages"] == 7 and 2 ** 31 / 1e6 <= d["dwell_at_eviction_ms_p50"] <= 2 ** 32 / 1e6
    assert R.lru_dwell(tmp_path / "none") == {}


def test_mechanisms_in_the_order_of_their_pressure():
    from moetrace.reports.figures import mechanism_order

    mechs = ["vm-memory", "balloon0.9", "other", "cgroup", "balloon0.74"]
    assert sorted(mechs, key=mechanism_order) == ["cgroup", "balloon0.74", "balloon0.9", "vm-memory", "other"]
    rows = [row("off", "vm-memory", 1e6), row("on", "balloon0.9", 1e6), row("off", "cgroup", 1e6),
            row("on", "cgroup", 1e6)]
    assert [(s["mechanism"], s["mglru"]) for s in R.summarize(rows)] == [
        ("cgroup", "on"), ("cgroup", "off"), ("balloon0.9", "on"), ("vm-memory", "off")]


def test_the_pgpgin_oracle_allows_the_probe_runs_the_kernel_skipped_and_counted(tmp_path):
    """Measured on 7.2: 60 skipped adds, the device bytes 57 pages above the added pages, pgpgin =
    the block probe's bytes: not exact, within the skipped runs' bound; the same gap with no
    skipped run is a failure."""
    def run(add_miss, prog="tp_mm_filemap_add_to_page_cache"):
        d = tmp_path / f"r{add_miss}{prog[:2]}"
        d.mkdir()
        (d / "manifest.json").write_text(json.dumps({
            "totals": {"experts_added_pages": 1000, "experts_device_read_bytes": 1057 * 4096,
                       "unattributed_device_read_bytes": 0},
            "lost": {"pagecache": {"counters_recursion_misses": {prog: add_miss}},
                "block": {"recursion_misses": {"bytes": 0}}}}))
        (d / "snapshots.json").write_text(json.dumps({"pre": {"vmstat": {"pgpgin": 0}},
                                                      "post": {"vmstat": {"pgpgin": 1057 * 4}}}))
        return R.added_pages_oracle(d)
    o = run(60)
    assert o["added_pages_equal_pgpgin"] is False and o["added_pages_within_skipped_runs"] is True
    # merged into a matrix row: none of its keys may shadow the row's own (the measured device_bytes)
    assert o["recording_device_bytes"] == 1057 * 4096 and "device_bytes" not in o
    assert run(0)["added_pages_within_skipped_runs"] is False
    old = run(60, "tracepoint__filemap__mm_filemap_add_to_page_cache")  # an older run: bcc's program name
    assert old["skipped_add_runs"] == 60 and old["added_pages_within_skipped_runs"] is True
    s = R.summarize([row("on", "cgroup", 1e6, added_pages_equal_pgpgin=True),
                     row("on", "cgroup", 1e6, added_pages_equal_pgpgin=False, added_pages_within_skipped_runs=True)])
    assert "| 1/2 (+1 within skipped runs) |" in R.summary_markdown(s)


def test_the_cells_memcg_by_path_where_the_eviction_records_carry_none(tmp_path):
    """7.2's eviction records have memcg_id 0 and no generation: the spread of the file pages is
    still the cell's memcg's, found in lru_gen by the scope's path."""
    s = 10 ** 9
    d = write_cell(tmp_path / "c", [(2 * s, 1, 0, 1), (3 * s, 1, 1, 1)], {1: 0})
    run = d / "cell" / "run"
    ev = pd.read_parquet(run / "mglru_evictions.parquet")
    ev["memcg_id"] = 0
    ev["seq"] = pd.array([None, None], dtype="Int64")
    ev.to_parquet(run / "mglru_evictions.parquet")
    pd.DataFrame({"time_ns": 2 * s, "sample": 0, "memcg_id": 3, "memcg_path": "/moetrace-cell", "node": 0,
                  "seq": [1, 2], "gen": [1, 2], "age_ms": 0, "birth_ns": [0, s], "nr_anon_pages": 0,
                  "nr_file_pages": [30, 70], "anon_evicted": False, "file_evicted": False}).to_parquet(
        run / "lru_gen.parquet")
    w = R.cell_window(d)
    assert w["file_pages_in_oldest_generation_share"] == pytest.approx(0.3)
    # records that name another memcg than the cell's are not trusted for generations
    assert w["eviction_records_memcg_unmatched"] is True and w["evicted_pages"] == 2
    assert not {k for k in w if k.startswith("eviction_age") or k == "evicted_from_oldest_share"}


def test_readahead_beyond_counts_the_pool_reads_pages_outside_their_requests(tmp_path):
    """E5's figure: pages added outside the pool read calls' byte ranges over what they asked
    (the reads probe's expert rows only: other files' reads are not the pool's readahead)."""
    d = write_cell(tmp_path / "c", [], {1: 0})
    run = d / "cell" / "run"
    pd.DataFrame({"kind": ["expert", "expert", "other"], "requested_bytes": [1 << 20, 1 << 20, 4096],
                  "beyond_pages": [64, 0, 1000]}).to_parquet(run / "reads.parquet")
    assert R.readahead_beyond(run) == {"read_requested_bytes": 2 << 20, "readahead_beyond_pages": 64,
                                       "readahead_beyond_share": 64 * 4096 / (2 << 20)}
    assert R.cell_window(d)["readahead_beyond_share"] == pytest.approx(0.125)
    (run / "reads.parquet").unlink()
    assert R.readahead_beyond(run) == {}
    pd.DataFrame({"kind": ["other"], "requested_bytes": [4096], "beyond_pages": [1]}).to_parquet(run / "reads.parquet")
    assert R.readahead_beyond(run) == {}  # no pool read: nothing to say


def test_mechanism_findings_name_the_papers_amplification_and_m1s_regime():
    """Issue 34's answer in words: groups above 1.5x with scan-to-steal above 2, and groups whose
    pass (the controller's bite, or Σhigh with kswapd doing half the reclaim) covered f x C."""
    def grp(mech, amp, share, s2s_k, s2s_d, high_fc, bite_fc=None):
        return {"kernel": "6.12", "release": "6.12.95", "mglru": "on", "mechanism": mech, "capacity": "320MiB",
                "amplification_median": amp, "kswapd_share_median": share, "scan_to_steal_kswapd_median": s2s_k,
                "scan_to_steal_direct_median": s2s_d, "sum_high_over_fC_median": high_fc,
                "controller_bite_over_fC_median": bite_fc}

    calm = [grp("balloon0.81", 0.8, 0.9, 1.0, None, 0.3), grp("balloon0.81+bites0.26", 0.9, 0.1, 1.0, 1.0, 2.0, 0.29)]
    f = R.mechanism_findings(calm)
    assert "in none of the 2 measured groups (the highest 0.90x, scan-to-steal up to 1.00)" in f[0]
    assert f[1].startswith("No group reached M1's regime") and "kswapd share 10-90 %" in f[1]  # 2.0 ignored: kswapd 10 %
    hot = calm + [grp("balloon0.81+bites320MiB", 2.4, 0.0, None, 3.1, 0.4, 1.1), grp("cgroup", 1.6, 0.7, 1.2, 1.0, 1.3)]
    f = R.mechanism_findings(hot)
    assert f[0].count("MGLRU on") == 1 and "balloon0.81+bites320MiB 320MiB (2.40x, scan-to-steal 3.10)" in f[0]
    assert "bites320MiB 320MiB: pass 1.10 f x C" in f[1] and "cgroup 320MiB: pass 1.30 f x C, 1.60x" in f[1]
    assert "bites0.26" not in f[1]
    both = R.mechanism_findings([grp("balloon0.81+bites5MiB", 0.6, 0.66, 1.5, 2.1, 1.66, 0.08)])
    assert "pass 1.66 f x C, 0.60x, scan-to-steal 2.10" in both[1]  # kswapd's Σhigh: the larger pass
    assert R.mechanism_findings([{**calm[0], "kswapd_share_median": None}]) == []  # no sampler: nothing said


def test_m2_findings_ask_for_f_at_a_quarter_and_rereads_after_the_advances():
    def grp(mech, amp, f_min, quarter, burst):
        return {"kernel": "6.12", "release": "6.12.95", "mglru": "on", "mechanism": mech, "capacity": "320MiB",
                "amplification_median": amp, "oldest_share_min_min": f_min,
                "oldest_share_below_quarter_median": quarter, "reread_burst_ratio_median": burst}

    head = ("M2 (f at or below 0.25 in 10% of the samples or more, then re-reads per iteration after a min_seq "
            "advance above 2x the other iterations'): ")
    # f at a quarter only at the window's start (1 % of the samples) is not M2's pile-up
    calm = [grp("cgroup", 0.78, 0.85, 0.0, None), grp("balloon0.81", 0.84, 0.006, 0.01, 0.67),
            grp("balloon0.81+bites1.0", 0.44, 0.003, 0.84, 1.2)]
    assert R.m2_findings(calm) == [
        head + "in none of the 3 groups with lru_gen samples: f stayed at or below a quarter in 84 % of the samples "
        "in 1 (6.12.95 MGLRU on balloon0.81+bites1.0 320MiB), with re-reads after an advance 1.20x the others' and "
        "0.44x the miss demand; in the other 2 f was at or below a quarter in at most 1 % of the samples (its lowest "
        "0.01)."]
    hot = calm + [grp("vm-memory", 2.1, 0.2, 0.5, 3.5), grp("balloon0.74", 2.0, 0.3, 0.0, 9.0)]  # 0.74: f never low
    assert R.m2_findings(hot) == [head + "6.12.95 MGLRU on vm-memory 320MiB: f at or below a quarter in 50% of the "
                                         "samples, bursts 3.50x, 2.10x the miss demand."]
    assert R.m2_findings(calm[:1])[0].endswith(
        "in all of them f never fell to a quarter (its lowest 0.85).")
    old = {**calm[2], "oldest_share_below_quarter_median": None}  # rows from before the figure: f's lowest
    assert "in 100 % of the samples" in R.m2_findings([old])[0]
    assert R.m2_findings([{**calm[0], "oldest_share_min_min": None}]) == []  # no lru_gen (MGLRU off): nothing said
    assert R.mechanism_findings([{**calm[0], "kswapd_share_median": 0.9}])[-1].startswith("M2 ")
