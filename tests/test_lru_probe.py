"""The lru probe (probes/lru.c + toolkit/record/probes/lru.py): classic LRU placement per expert.

Tiers: the C file and its Python side agree, the tables are built as declared (no kernel);
it compiles, loads and detaches with the knob sets the recorder uses (probe_build); live,
through ``moetrace record --probes pagecache,lru``:

* a cold 2-pass replay of 23 x 1 MiB experts (both layouts): LRU insertions of pool pages
  per expert == the pages the pagecache probe saw added (a different tracepoint), exactly
  5,888 in all; the second pass activates every page once (on the inactive list, or before
  it reached a list), and the pool's activations are within, and almost all of, the
  machine's /proc/vmstat pgactivate delta (counted where mm_lru_activate fires);
* a third pass of the fully cached pool inserts nothing;
* a pool 3x the cache a v1/v2 memory limit leaves: every eviction (evicted_pages == the
  pagecache probe's, per expert) of a page added in the recording has its insertion time,
  the dwell histogram adds up to the dwell counts and brackets the sums.

Live measurements hold the machine-wide I/O lock (conftest.io_lock)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from moetrace.kernel import bpf
from moetrace.record.probes import lru as lrurec
from moetrace.run import directory as rundir
from moetrace.record.probes.lru import FIELDS, HISTOGRAMS, HIST_SLOTS, SPEC, anon_flag_from_format, lru_knobs, lru_tables

from conftest import io_lock  # noqa: E402
from test_record import REPLAY, _drop, _moetrace, _resident_pages  # noqa: E402

SRC = bpf.probe_source("lru").read_text()
N, MIB = 23, 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
PAGES = MIB // PAGE
#: `moetrace record` as a user runs it: the venv's console script
MOETRACE = Path(sys.executable).with_name("moetrace")
RECORD = [str(MOETRACE), "record"] if MOETRACE.exists() else \
    [sys.executable, "-c", "from moetrace.cli import main; main()", "record"]

#: the real 6.18 format file of pagemap:mm_lru_insertion (print fmt line)
INSERTION_FMT = ('print fmt: "folio=%p pfn=0x%lx lru=%d flags=%s%s%s%s%s%s", REC->folio, REC->pfn, REC->lru, '
                 'REC->flags & 0x0001u ? "M" : " ", REC->flags & 0x0002u ? "a" : "f", '
                 'REC->flags & 0x0008u ? "s" : " ", REC->flags & 0x0010u ? "b" : " ", '
                 'REC->flags & 0x0020u ? "d" : " ", REC->flags & 0x0040u ? "B" : " "')


# -- tier 1: no kernel ------------------------------------------------------------------------

def _defines(prefix: str) -> list[tuple[str, int]]:
    return [(n, int(i)) for n, i in re.findall(r"^#define %s(\w+) (\d+)$" % prefix, SRC, re.M)]


def test_c_field_and_histogram_indices_match_python():
    """F_* index struct lru_counts' fields in order; H_* the histogram names; one loop per program."""
    f = _defines("F_")
    assert [n.lower() for n, _ in f] == list(FIELDS)
    assert [i for _, i in f] == list(range(len(FIELDS)))
    assert int(re.search(r"#define N_FIELDS (\d+)", SRC).group(1)) == len(FIELDS)
    h = _defines("H_")
    assert [n.lower() for n, _ in h] == list(HISTOGRAMS) and [i for _, i in h] == list(range(len(HISTOGRAMS)))
    assert int(re.search(r"#define N_HIST (\d+)", SRC).group(1)) == len(HISTOGRAMS)
    assert int(re.search(r"#define HIST_SLOTS (\d+)", SRC).group(1)) == HIST_SLOTS
    assert [n.lower() for n, _ in _defines("STAT_")] == list(SPEC.stats)
    assert "#include <linux/mmzone.h>" in SRC  # environment.md: mm_lru_insertion needs enum lru_list
    assert SRC.count("for (int s = 0; s < MAX_PIECES; s++)") == 1


def test_declaration():
    groups = {g.name: g for g in SPEC.attach}
    assert set(groups) == {"add", "delete", "insertion", "activate"}
    assert groups["activate"].knob == "HAVE_ACTIVATE" and not groups["activate"].required
    assert all(groups[g].required for g in ("add", "delete", "insertion"))
    assert groups["insertion"].candidates[0].fields == ("pfn", "lru", "flags")
    assert SPEC.enrichment and set(SPEC.tables()) == {"lru", "lru_dwell_histogram"}
    from moetrace.record.probe import recorder_class

    assert recorder_class("lru") is lrurec.LruRecorder


def test_anon_flag_from_the_format_file():
    assert anon_flag_from_format(INSERTION_FMT) == 0x2
    assert anon_flag_from_format(INSERTION_FMT.replace("0x0002u", "0x0004u")) == 0x4
    assert anon_flag_from_format('print fmt: "pfn=0x%lx", REC->pfn') is None
    assert anon_flag_from_format(None) is None


def _pmap(n: int, ppe: int, inodes: dict | None = None):
    return SimpleNamespace(n_total=n, pages_per_expert=ppe, pool_dev=(8 << 20) | 1,
                           inodes=inodes if inodes is not None else {100 + i: (i, 1) for i in range(n)},
                           pool=SimpleNamespace(geometry=SimpleNamespace(n_experts=n)))


def test_knobs_from_plan_and_pool():
    k = lru_knobs({"HAVE_ORDER": 1, "HAVE_ACTIVATE": 0, "MOE_BYTES_TP": 2}, _pmap(96, 256), mem_pages=10 ** 7,
                  ncpus=2, anon_flag=2)
    assert set(k) == {x.name for x in SPEC.knobs}
    assert (k["POOL_DEV"], k["N_EXPERTS"], k["PPE"], k["HAVE_ACTIVATE"]) == ((8 << 20) | 1, 96, 256, 0)
    # one join entry per folio: at most the pool's pages, plus the LRU hash's per-CPU slack
    assert k["MAX_PFNS"] == 96 * 256 + 2 * 256 + 1024 and k["MAX_INODES"] == 96 + 16
    # never more than memory holds
    assert lru_knobs(None, _pmap(10 ** 6, 256), mem_pages=1000, ncpus=1)["MAX_PFNS"] == 1000 + 256 + 1024
    # and never more than the recorder's cap (224 MiB of preallocated entries)
    assert lru_knobs(None, _pmap(10 ** 6, 256), mem_pages=10 ** 9, ncpus=1)["MAX_PFNS"] == lrurec.MAX_PFNS_CAP
    # no pool: the declaration's defaults (every page unattributed)
    k0 = lru_knobs()
    assert k0 == {x.name: x.default for x in SPEC.knobs}


def test_tables_from_kernel_arrays():
    n = 4
    counts = np.zeros((n + 1, len(FIELDS)), np.int64)
    F = {f: i for i, f in enumerate(FIELDS)}
    counts[:n, F["added"]] = 256
    counts[:n, F["inserted"]] = 256
    counts[:n, F["inserted_inactive"]] = 250
    counts[:n, F["inserted_active"]] = 6
    counts[1, F["activated"]] = 10
    counts[1, F["activation_dwell_ns"]] = 10 * 5000
    counts[1, F["activation_dwell_count"]] = 10
    counts[2, F["evicted"]] = 100
    counts[2, F["evicted_joined"]] = 100
    counts[2, F["dwell_ns"]] = 100 * 3000
    counts[2, F["dwell_count"]] = 100
    counts[n, F["added"]] = 7  # unattributed
    hist = np.zeros((len(HISTOGRAMS), HIST_SLOTS), np.int64)
    hist[0, 12] = 100  # insertion_to_eviction: 3000 ns is in [2048, 4096)
    hist[1, 13] = 10
    hist[2, 1] = 5
    df, h = lru_tables(counts, hist, n, experts_per_layer=2)
    assert list(df.columns) == [c.name for c in SPEC.schema]
    assert list(df["kind"]) == ["expert"] * n + ["unattributed"]
    assert list(df["layer"][:n]) == [0, 0, 1, 1] and list(df["expert"][:n]) == [0, 1, 0, 1]
    u = df.iloc[n]
    assert pd.isna(u["layer"]) and pd.isna(u["expert_id"]) and u["added_pages"] == 7
    assert df.loc[2, "dwell_ns_mean"] == 3000.0 and pd.isna(df.loc[0, "dwell_ns_mean"])  # NA, not 0
    assert df.loc[1, "activation_dwell_ns_mean"] == 5000.0
    assert str(df["dwell_ns_mean"].dtype) == "Float64" and str(df["added_pages"].dtype) == "Int64"
    assert list(h["kind"]) == ["insertion_to_eviction", "insertion_to_activation", "add_to_insertion"]
    assert list(h["lo_ns"]) == [2048, 4096, 0] and list(h["hi_ns"]) == [4096, 8192, 2]
    assert list(h.columns) == [c.name for c in SPEC.tables()["lru_dwell_histogram"]]
    # without the activate program: activation columns NA (unknown), never 0
    df2, h2 = lru_tables(counts, hist, n, 2, have_activate=False)
    for c in ("activated_pages", "activation_dwell_ns_sum", "activation_dwell_count", "activation_dwell_ns_mean",
              "evicted_activated_pages"):
        assert df2[c].isna().all(), c
    assert "insertion_to_activation" not in set(h2["kind"])
    s = lrurec.summarize(df, h, {"pgactivate": 12, "workingset_activate_file": 0})
    assert s["experts"]["activated_pages"] == 10 and s["unattributed"]["added_pages"] == 7
    assert s["vmstat_check"]["activated_within_pgactivate"] is True
    assert s["histogram_pages"]["insertion_to_eviction"] == 100
    assert lrurec.summarize(df2, h2, None)["experts"]["activated_pages"] is None


def test_memory_node_list(tmp_path):
    d = tmp_path / "sys/devices/system/node"
    d.mkdir(parents=True)
    (d / "has_memory").write_text("0-1,3\n")
    assert lrurec._memory_nodes(tmp_path) == [0, 1, 3]
    assert lrurec._memory_nodes(tmp_path / "none") is None
    ok, why = lrurec.drain_lru_batches(tmp_path / "none")
    assert not ok and "CONFIG_NUMA" in why


# -- tier 2: probe build ----------------------------------------------------------------------

KNOB_SETS = [
    dict(POOL_DEV=254 << 20, N_EXPERTS=23, PPE=256, MAX_PFNS=8192),  # files layout, 1 MiB experts
    dict(POOL_DEV=254 << 20, N_EXPERTS=600, PPE=1, MAX_PFNS=4096),  # 4 KiB extents: 512 pieces per folio
    dict(POOL_DEV=0, N_EXPERTS=7, PPE=100, HAVE_ACTIVATE=0, HAVE_ORDER=0),  # older kernel: no activate/order
    dict(),  # no pool: everything unattributed (the declaration's defaults)
]


@pytest.mark.probe_build
@pytest.mark.parametrize("knobs", KNOB_SETS, ids=["files-1MiB", "pool-4KiB", "no-activate", "no-pool"])
def test_lru_compiles_loads_and_detaches(live, knobs):
    from moetrace.kernel.bpf import prog_id_exists, prog_info

    full = {k: int(v) for k, v in SPEC.knob_values(**knobs).items()}
    probe = bpf.load_probe("lru", full)
    try:
        tps = set(probe.tracepoints)
        assert {"filemap:mm_filemap_add_to_page_cache", "filemap:mm_filemap_delete_from_page_cache",
                "pagemap:mm_lru_insertion"} <= tps
        assert ("pagemap:mm_lru_activate" in tps) == bool(full["HAVE_ACTIVATE"])
        assert len(probe.table("counts")) == full["N_EXPERTS"] + 1
        assert len(probe.table("hist")) == len(HISTOGRAMS) * HIST_SLOTS
        assert len(probe.table("stats")) == len(SPEC.stats)
        ids = [prog_info(f.fd)["id"] for f in probe.bpf.funcs.values()]
        assert ids and all(prog_id_exists(i) for i in ids)
    finally:
        probe.close()
    print(f"\nlru {knobs}: compile+load+attach {probe.compile_attach_s:.2f} s")
    assert not any(prog_id_exists(i) for i in ids), "programs still loaded after close()"


@pytest.mark.probe_build
def test_drain_lru_batches(live):
    ok, why = lrurec.drain_lru_batches()
    assert ok, why


# -- tier 3: live -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    from conftest import make_expert_pools

    return make_expert_pools(tmp_path_factory.mktemp("lru"), N)


def _record(out: Path, cmd: list[str], *opts: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*RECORD, "--out", str(out), "--probes", "pagecache,lru", *opts, "--", *cmd],
                          capture_output=True, text=True, timeout=timeout)


def _load(run: Path):
    doc, tables = rundir.load_run(run)
    pc, lru = tables["experts"], tables["lru"]
    return (doc, pc[pc["kind"] == "expert"].reset_index(drop=True),
            lru[lru["kind"] == "expert"].reset_index(drop=True), lru[lru["kind"] == "unattributed"].iloc[0],
            tables["lru_dwell_histogram"])


def _common_checks(doc: dict) -> None:
    assert doc["complete"] is True and doc["exit_status"] == 0
    assert doc["attach_plan"]["lru"]["recorded"] is True and doc["attach_plan"]["lru"]["status"] == "yes"
    lost = doc["lost"]["lru"]
    assert lost["lost_events"] == 0 and lost["unprocessed_pages"] == 0 and lost["join_update_failed"] == 0, lost
    assert doc["summaries"]["lru"]["drain"]["ok"] is True, doc["summaries"]["lru"]["drain"]
    assert set(doc["tables"]) >= {"lru", "lru_dwell_histogram"}
    assert doc["knobs"]["lru"]["HAVE_ACTIVATE"] == 1


@pytest.mark.live
@pytest.mark.parametrize("layout", ["files", "pool"])
def test_insertions_equal_additions_then_activations_then_nothing(live, pools, layout, tmp_path):
    """Cold 2-pass replay, then one more pass of the cached pool, each recorded end to end."""
    pool, plan = pools[layout], pools["plan"]
    replay = [*REPLAY, str(plan), "--pool", str(pool), "--warmup", "0", "--threads", "4"]
    from pagewatch import PageWatcher, armed_interval, check_recorded

    with io_lock():
        w = PageWatcher(pool)  # outside evictions (this machine's DAMON), from the drop to the last mincore
        try:
            _drop(pool)
            t_drop = time.monotonic_ns()
            cold = _record(tmp_path / "cold", [*replay, "--passes", "2"])
            hot = _record(tmp_path / "hot", [*replay, "--passes", "1"], "--pool", str(pool))
            t_m0 = time.monotonic_ns()
            resident = sum(_resident_pages(p) for p in sorted(pool.rglob("*.bin")))
            t_m1 = time.monotonic_ns()
        finally:
            w.stop()
    assert cold.returncode == 0, cold.stderr
    assert hot.returncode == 0, hot.stderr
    assert w.lost == 0
    doc, pc, e, u, hist = _load(tmp_path / "cold")
    _common_checks(doc)
    doc2, pc2, e2, u2, _h2 = _load(tmp_path / "hot")
    check_recorded(w, doc, pc["added_pages"], pc["evicted_pages"])
    check_recorded(w, doc2, pc2["added_pages"], pc2["evicted_pages"])
    outside = w.deleted_by(t_drop)
    print(f"\n[{layout}] pool pages deleted after the drop, by evictor: {outside or 'none'}")
    s = doc["summaries"]["lru"]
    chk = s["vmstat_check"]
    print(f"\n[{layout}] cold: inserted {int(e['inserted_pages'].sum())} (inactive "
          f"{int(e['inserted_inactive_pages'].sum())}, active {int(e['inserted_active_pages'].sum())}), activated "
          f"{int(e['activated_pages'].sum())}, pagecache added {int(pc['added_pages'].sum())}; {chk}; "
          f"join {s['join']}; drain {s['drain']['detail']}; stats {doc['stats']['lru']}")
    print(hist.to_string())
    # the join: LRU insertions (mm_lru_insertion) of pool pages = pages the pagecache probe saw added
    assert e["inserted_pages"].tolist() == pc["added_pages"].tolist()
    assert (pc["added_pages"] - pc["re_added_pages"]).tolist() == [PAGES] * N  # re-adds: outside evictions
    cold_out = w.deleted_by(*armed_interval(doc)[1])
    if not cold_out:
        assert e["inserted_pages"].tolist() == [PAGES] * N and int(e["inserted_pages"].sum()) == N * PAGES == 5888
    assert (e["inserted_pages"] == e["inserted_inactive_pages"] + e["inserted_active_pages"]).all()
    assert int(e["inserted_unevictable_pages"].sum()) == 0 and int(e["inserted_other_pages"].sum()) == 0
    # the second pass activates each page at most once: on the list (mm_lru_activate), or while
    # still in this CPU's lru_add batch (then it reaches the active list directly). A page still in
    # another CPU's batch is not activated at all (__lru_cache_activate_folio searches the local
    # batch only, and folio_mark_accessed clears its referenced bit anyway): measured 0-11 of 5,888
    once = e["activated_pages"] + e["inserted_active_pages"]
    assert (once <= e["inserted_pages"]).all(), once.tolist()
    if not cold_out:
        assert int(once.sum()) >= 0.98 * N * PAGES, once.tolist()
    assert (e["activation_dwell_count"] == e["activated_pages"]).all()  # every activated page's insertion was seen
    assert int(hist.loc[hist["kind"] == "insertion_to_activation", "pages"].sum()) == int(e["activated_pages"].sum())
    assert int(hist.loc[hist["kind"] == "add_to_insertion", "pages"].sum()) == int(pc["added_pages"].sum())
    # the oracle: PGACTIVATE counts every lru_activate() machine-wide in pages, over the same
    # armed interval as the probes. The probe sees every activation as one event per folio and
    # counts the pool's in pages (joined); the others' folios (of any order) count >= 1 page each
    # in pgactivate, so pool pages + other folios <= pgactivate <= pool pages + 512 x other folios
    act, pga = int(e["activated_pages"].sum()), chk["vmstat_pgactivate"]
    st = doc["stats"]["lru"]
    others = st["activate_events"] - st["activate_joined"]
    print(f"[{layout}] activations: pool pages {act}, other folios {others}, pgactivate {pga}")
    assert act + others <= pga, (act, others, chk)
    if not cold_out:  # reclaim (DAMON's pageout too) activates folios without mm_lru_activate
        assert pga <= act + 512 * others, (act, others, chk)
    assert int(e["evicted_pages"].sum()) == int(pc["evicted_pages"].sum())
    # a pass over the fully cached pool: nothing added, nothing inserted, nothing evicted, and
    # (already active) nothing activated
    _common_checks(doc2)
    print(f"[{layout}] hot: stats {doc2['stats']['lru']} vmstat {doc2['summaries']['lru']['vmstat_check']}")
    assert e2["inserted_pages"].tolist() == pc2["added_pages"].tolist() == e2["added_pages"].tolist()
    (h0, _h1), outer = armed_interval(doc2)
    missing = PAGES - w.resident(at_ns=h0, since_ns=t_drop)  # pages the hot pass had to read again
    assert (missing <= pc2["added_pages"].to_numpy()).all()
    assert (pc2["added_pages"].to_numpy() <= missing + w.pages(1, *outer)).all()
    assert int(w.resident(t_m1, t_drop).sum()) <= resident <= int(w.resident(t_m0, t_drop).sum())
    if not outside:  # nobody else evicted a pool page: the strict figures
        for c in ("added_pages", "inserted_pages", "activated_pages", "evicted_pages"):
            assert e2[c].tolist() == [0] * N, c
        assert pc2["added_pages"].tolist() == [0] * N
        assert resident == N * PAGES


#: pressure: 3 layers x 32 experts x 1 MiB = 96 MiB through a cache of ~32 MiB (test_record_pressure)
PL, PE = 3, 32
POOL_PAGES = PL * PE * PAGES
CACHE_BYTES = 32 * MIB
HEADROOM_BYTES = 72 * MIB


@pytest.fixture(scope="module")
def pressure_pool(tmp_path_factory):
    from conftest import make_layered_pool

    return make_layered_pool(tmp_path_factory.mktemp("lrupressure"), PL, PE)


@pytest.mark.live
def test_dwell_under_a_memory_limit(live, pressure_pool, tmp_path):
    """3 passes of a pool 3x the cache: every eviction of a page added in the recording has
    its insertion time; evictions equal the pagecache probe's per expert."""
    from moetrace.capacity.scope import Scope, ScopeError, find_memory_controller, remove_stale_scopes

    try:
        ctrl = find_memory_controller()
    except ScopeError as e:
        pytest.skip(str(e))
    pool, plan = pressure_pool / "pool", pressure_pool / "plan.bin"
    files = sorted(pool.rglob("*.bin"))
    run = tmp_path / "run"
    replay = [*REPLAY, str(plan), "--pool", str(pool), "--warmup", "0", "--passes", "3", "--threads", "4"]
    from pagewatch import PageWatcher, armed_interval, check_recorded

    with io_lock():
        remove_stale_scopes("lrupressure", ctrl)
        scope = Scope("lrupressure", ctrl).create(HEADROOM_BYTES + CACHE_BYTES)
        w = PageWatcher(pool)  # outside evictions (this machine's DAMON), from the drop to the mincore
        try:
            _drop(pool)
            t_drop = time.monotonic_ns()
            r = _record(run, replay, "--cgroup", str(scope.path), timeout=300)
            oom = scope.oom_killed()
            t_m0 = time.monotonic_ns()
            resident = [_resident_pages(p) for p in files]
            t_m1 = time.monotonic_ns()
        finally:
            w.stop()
            assert scope.remove(kill=True), f"scope {scope.path} not removed"
    assert r.returncode == 0, r.stderr
    assert oom == 0, "OOM in the scope: raise HEADROOM_BYTES"
    doc, pc, e, u, hist = _load(run)
    _common_checks(doc)
    s = doc["summaries"]["lru"]
    ev = hist[hist["kind"] == "insertion_to_eviction"]
    tot = {c: int(e[c].sum()) for c in ("added_pages", "inserted_pages", "inserted_inactive_pages",
                                        "inserted_active_pages", "activated_pages", "evicted_pages",
                                        "evicted_joined_pages", "evicted_activated_pages", "dwell_count",
                                        "dwell_ns_sum", "activation_dwell_count")}
    print("\nlru under pressure:", json.dumps({"totals": tot, "pagecache_added": int(pc["added_pages"].sum()),
                                               "pagecache_evicted": int(pc["evicted_pages"].sum()),
                                               "vmstat_check": s["vmstat_check"], "join": s["join"],
                                               "mean_dwell_ms": tot["dwell_ns_sum"] / max(tot["dwell_count"], 1) / 1e6,
                                               "stats": doc["stats"]["lru"]}, indent=1))
    print(hist.to_string())
    # the limit forced eviction: (almost) every page read 3 times
    assert tot["added_pages"] >= 3 * POOL_PAGES * 0.9, tot
    # same tracepoints, another program: additions and evictions equal the pagecache probe's, per expert
    assert e["added_pages"].tolist() == pc["added_pages"].tolist()
    assert e["evicted_pages"].tolist() == pc["evicted_pages"].tolist()
    # every added page was inserted (batches drained at close); the pool was dropped before the
    # recording, so every eviction is of a page added in it, and reclaim only takes listed pages
    assert e["inserted_pages"].tolist() == e["added_pages"].tolist()
    assert e["evicted_joined_pages"].tolist() == e["evicted_pages"].tolist()
    assert e["dwell_count"].tolist() == e["evicted_pages"].tolist()
    # what is left = added - evicted, less what others evicted after the probes stopped counting
    # (the watcher: recording and watcher agree over the armed interval, watcher and mincore after)
    assert w.lost == 0
    check_recorded(w, doc, pc["added_pages"], pc["evicted_pages"])
    res = np.asarray(resident)
    assert ((w.resident(t_m1, t_drop) <= res) & (res <= w.resident(t_m0, t_drop))).all()
    later = w.pages(1, armed_interval(doc)[1][1], t_m1)
    gap = (e["added_pages"] - e["evicted_pages"]).to_numpy() - res
    assert ((gap >= 0) & (gap <= later)).all(), (gap.tolist(), later.tolist())
    if not later.any():
        assert (e["added_pages"] - e["evicted_pages"]).tolist() == resident
    st = doc["stats"]["lru"]
    assert st["delete_unjoined"] == 0 and st["delete_stale"] == 0 and st["insert_repeated"] == 0
    # the histogram holds every dwell and brackets the sums
    assert int(ev["pages"].sum()) == tot["dwell_count"]
    lo = int((ev["lo_ns"].astype("int64") * ev["pages"]).sum())
    hi = int((ev["hi_ns"].astype("int64") * ev["pages"]).sum())
    assert lo <= tot["dwell_ns_sum"] <= hi
    # activations of pool pages are within the machine's pgactivate
    assert tot["activated_pages"] <= s["vmstat_check"]["vmstat_pgactivate"]
    assert tot["evicted_activated_pages"] <= tot["evicted_pages"]
