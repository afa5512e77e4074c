"""Analyses and reports (no-kernel tier).

Golden files: tests/data/reports holds a sweep, a pinned cell and a plain run recorded on this
machine (make_golden.py says how); expected/ holds their report tables as CSV, so a change that
alters a figure shows as a diff. The rest: small inline tables with values worked out by hand,
the run handle, the CLI, the timeline and the differential flame graph.
"""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from common.reports import DATA, MG, PLAN, ROOT  # noqa: F401


# -- golden tables -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MG.INPUTS)
def test_report_tables_equal_the_golden_files(name, tmp_path):
    tables = MG.report_tables(name, tmp_path)
    exp = DATA / "expected" / name
    assert sorted(tables) == sorted(p.stem for p in exp.glob("*.csv"))
    for t, df in sorted(tables.items()):
        got, want = MG.golden_csv(df), (exp / f"{t}.csv").read_text()
        if got != want:
            diff = list(difflib.unified_diff(want.splitlines(), got.splitlines(), f"expected/{name}/{t}.csv",
                                             "now", lineterm="", n=1))
            pytest.fail(f"{name}/{t}: a figure changed (if intended: python tests/data/reports/make_golden.py "
                        "golden)\n" + "\n".join(diff[:40]))


# -- acceptance: the sweep report --------------------------------------------------------------------

@pytest.fixture(scope="module")
def sweep_report(tmp_path_factory):
    from moetrace.reports.report import build_report

    out = tmp_path_factory.mktemp("sweep-report") / "report"
    doc = build_report(DATA / "sweep", out)
    return doc, out


def test_sweep_report_shows_amplification_rereads_and_observed_vs_simulated(sweep_report):
    doc, out = sweep_report
    s = doc["summary"]
    # pool 128 MiB, C = 128 / 48 / 32 MiB: the detail is the retained cell with the highest amplification
    t2 = pd.DataFrame(s["table2"])
    assert t2["capacity_bytes"].tolist() == [128 << 20, 48 << 20, 32 << 20]
    best = t2.dropna(subset=["amplification"]).sort_values("amplification").iloc[-1]
    assert s["detail_cell"] == f"{int(best['capacity_bytes']) >> 20}MiB-r0" == "48MiB-r0"
    # speculative fallbacks read a layer twice in an iteration: the wall makes some of it re-reads
    assert s["in_iteration_re_added_pages"] > 0 and s["in_iteration_exact"] is False
    page = (out / "report.html").read_text()
    for text in ("Capacity sweep (the paper&#x27;s Table 2 and Fig. 2)", "Re-read amplification",
                 "The experts carrying most re-reads", "re-reads within one iteration (at least)",
                 "Per layer: observed vs simulated hit rate", "Totals against the kernel&#x27;s own counters",
                 "<section id='findings'><h2>Findings</h2>",
                 "Paper's alarm condition (amplification &gt; 1.02 and scan-to-steal &gt; 2)"):
        assert text in page, text
    md = (out / "REPORT.md").read_text()
    assert "![Layers x experts: re-reads and amplification](figures/heatmap_amp.png)" in md
    ex = pd.read_parquet(out / "tables" / "amp_experts.parquet")
    assert len(ex) == 8 * 16 and ex["amplification"].notna().all()  # every expert missed in the simulation
    top = ex.sort_values("re_added_pages", ascending=False)
    assert int(top["re_added_pages"].iloc[0]) == int(ex["re_added_pages"].max()) > 0
    # per expert: device bytes = pages added x 4 KiB (block probe through FIEMAP = pagecache probe)
    assert (ex["device_read_bytes"] == ex["added_pages"] * 4096).all()
    ovs = pd.read_parquet(out / "tables" / "observed_vs_sim.parquet")
    assert len(ovs) == 8 and ovs["sim_hit_rate"].between(0, 1).all()


def test_findings_come_first_and_quote_their_tables(sweep_report):
    doc, out = sweep_report
    page = (out / "report.html").read_text()
    body = page[page.index("<body>"):]
    # the findings panel is the first section, the recording (notices) folded right below it
    assert body.index("<section id='findings'>") < body.index("<section id='recording'>") < body.index("<h2 id='sweep'>")
    f = doc["findings"]
    assert f[0].startswith("Capacity response: 3 capacities from C = 32 MiB to 128 MiB")
    assert f[1].startswith("No capacity amplifies: device reads / LRU miss demand stay between 0.75 (C = 32 MiB) "
                           "and 0.828 (C = 48 MiB)")
    assert any(x.startswith("Alarm (amplification > 1.02 and scan-to-steal > 2): not raised") for x in f)
    assert (out / "REPORT.md").read_text().split("\n")[2] == "## Findings"


def test_table2_and_fig2_speak_human_units(sweep_report):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moetrace.analyses.capacity_response import plot_capacity
    from moetrace.reports.report import shown_table2, sweep_table2
    from moetrace.run.handle import open_sweep

    t2, cells = sweep_table2(open_sweep(DATA / "sweep"))
    shown = shown_table2(t2)
    assert shown["C"].tolist() == ["128 MiB", "48 MiB", "32 MiB"]
    assert shown["effective C"].tolist() == ["143 MiB", "62.6 MiB", "46.6 MiB"]
    assert shown["LRU hit rate"].tolist() == ["100 %", "42.2 %", "11.6 %"]
    assert shown["iteration"].tolist() == ["2.86 ms", "23.8 ms", "33 ms"]
    assert shown["device / iteration"].tolist()[1:] == ["25.2 MiB", "34.9 MiB"]
    fig, axes = plt.subplots(1, 2)
    plot_capacity(cells, axes)
    fig.canvas.draw()
    for ax in axes:  # both panels: the same log-C axis, ticked at the capacities, in MiB
        assert ax.get_xscale() == "log"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["32 MiB", "48 MiB", "128 MiB"]
    legend = [t.get_text() for t in axes[1].get_legend().get_texts()]
    # the 128 MiB cell read nothing: the a/C reference goes through the largest C that read
    assert any(x.startswith("a/C through C = 48 MiB") for x in legend), legend
    plt.close(fig)


def test_a_sweep_from_two_hosts_is_reported_per_host(tmp_path):
    """The golden sweep with its results rows given two hosts (as cells run as jobs would be): Table 2
    and capacity.csv per host (host first), the findings name the hosts and their cells; the golden
    sweep itself (no host column) keeps its one table (test_report_tables_equal_the_golden_files)."""
    import shutil

    from moetrace.reports.report import build_report
    from moetrace.reports.sweep import write_results

    d = tmp_path / "sweep"
    shutil.copytree(DATA / "sweep", d)
    res = pd.read_parquet(d / "results.parquet")
    res["host"] = ["node-b" if c == "32MiB" else "node-a" for c in res["capacity"]]
    res.to_parquet(d / "results.parquet")
    doc = build_report(d, tmp_path / "report", cell_reports=False)
    t2 = doc["summary"]["table2"]
    assert [(r["host"], r["capacity_bytes"]) for r in t2] == [("node-a", 128 << 20), ("node-a", 48 << 20),
                                                                ("node-b", 32 << 20)]
    assert doc["findings"][0] == ("Cells from 2 hosts: node-a (2 cells), node-b (1 cell); repeats pooled per host "
                                  "(Table 2 and Fig. 2 per host).")
    assert doc["findings"][1].startswith("Capacity response on node-a: 2 capacities from C = 48 MiB to 128 MiB "
                                         "(2 cells retained).")
    assert doc["findings"][2].startswith("Capacity response on node-b: 1 capacity: C = 32 MiB (1 cell retained).")
    assert "(C = 32 MiB on node-b)" in doc["findings"][3]
    # the sweep's own capacity table, as the sweep writes it from the rows
    rows = [{c: (None if pd.isna(v) else v) for c, v in r.items()} for r in res.to_dict("records")]
    cap = write_results(rows, tmp_path, plot=False)["table"]
    assert list(cap.columns[:2]) == ["host", "capacity_bytes"] and list(cap["host"]) == ["node-a", "node-a", "node-b"]
    assert pd.read_csv(tmp_path / "capacity.csv")["host"].tolist() == ["node-a", "node-a", "node-b"]


def test_sweep_report_totals_reconcile_with_the_runs_own_proc_deltas(sweep_report):
    from moetrace.run.handle import open_run

    doc, out = sweep_report
    rec = pd.read_parquet(out / "tables" / "reconciliation.parquet").set_index("quantity")
    whole = rec.loc["device bytes, whole recording (experts + unattributed)"]
    assert whole["moetrace"] == whole["kernel"] > 0  # block probe == /proc/diskstats, to the byte
    experts = rec.iloc[[i for i, q in enumerate(rec.index) if "expert pages added" in q]].iloc[0]
    every = rec.iloc[[i for i, q in enumerate(rec.index) if "every page added" in q]].iloc[0]
    # measured pass: the pages the pagecache probe saw added to the experts, x 4 KiB, are the
    # diskstats delta of the window to the byte (in this recording; where the wall also evicts
    # the replay's own libraries, "every page added on the pool's device" is the row that
    # closes, less metadata reads: seen in an earlier recording, 147 pages of 852,039)
    assert experts["moetrace"] == experts["kernel"] > 0
    assert every["moetrace"] >= experts["moetrace"]
    cell = open_run(DATA / "sweep" / "cells" / doc["summary"]["detail_cell"])
    assert experts["kernel"] == cell.cell["device_bytes"]
    # the pages re-added in the measured pass are the cell's own figure; the kernel's
    # workingset_refault_file undercounts them by at most 64 pages per shadow node it reclaimed
    # during the cell (a refault whose shadow entry is gone is not counted: mm/workingset.c)
    re = rec.loc["re-reads, measured pass (pages re-added)"]
    assert re["moetrace"] == cell.cell["record"]["measured_pages"]["re_added_pages"] == doc["summary"][
        "measured_re_added_pages"]
    assert re["kernel"] == cell.cell["refault_file_pages"]
    assert 0 <= int(re["moetrace"]) - int(re["kernel"]) <= 64 * cell.cell["shadow_nodes_reclaimed"]["cell"]
    # amplification per expert sums back to the cell's: measured pages added / simulated misses
    ex = pd.read_parquet(out / "tables" / "amp_experts.parquet")
    assert int(ex["measured_sim_miss_pages"].sum()) * 4096 == pytest.approx(
        cell.cell["miss_bytes_per_iteration"] * cell.cell["measured_iterations"])


def test_every_figure_is_embedded_and_written(sweep_report):
    doc, out = sweep_report
    page = (out / "report.html").read_text()
    assert page.count("src='data:image/png;base64,") == len(doc["figures"]) >= 8
    for f in doc["figures"]:
        assert (out / "figures" / f"{f}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for t in doc["tables"]:
        assert (out / "tables" / f"{t}.parquet").is_file() and json.loads((out / "tables" / f"{t}.json").read_text()) \
            is not None
    assert "<svg" in page and (out / "flame.svg").is_file() and (out / "timeline.json").is_file()
    assert "http://" not in page.replace("http://www.w3.org", "")  # nothing fetched: opens offline


# -- the run handle --------------------------------------------------------------------------------

def test_open_run_cell_and_sweep():
    import moetrace
    from moetrace.errors import InputError
    from moetrace.run.handle import kind_of

    run = moetrace.open_run(DATA / "run")
    assert run.cell is None and "experts" in run.tables and "iterations" in run.tables
    assert "page_events" in run.tables and run.replay["complete"] is True
    cell = moetrace.open_run(DATA / "sweep" / "cells" / "48MiB-r0")
    assert cell.name == "48MiB-r0" and cell.cell["capacity_bytes"] == 48 << 20
    assert cell.plan_path() is not None  # moved directory: found beside the sweep
    sw = moetrace.open_sweep(DATA / "sweep")
    assert [c.name for c in sw.cells] == ["128MiB-r0", "48MiB-r0", "32MiB-r0"] or \
        sorted(c.name for c in sw.cells) == ["128MiB-r0", "32MiB-r0", "48MiB-r0"]
    assert [kind_of(DATA / p) for p in ("run", "pinned", "sweep")] == ["run", "cell", "sweep"]
    with pytest.raises(InputError, match="sweep directory"):
        moetrace.open_run(DATA / "sweep")
    with pytest.raises(InputError, match="not a sweep directory"):
        moetrace.open_sweep(DATA / "run")
    with pytest.raises(InputError, match="not a moetrace run"):
        kind_of(DATA)


# -- analyses on inline tables --------------------------------------------------------------------

def _tiny():
    """2 layers x 2 experts, 4 pages each; one warm-up and one measured iteration."""
    experts = pd.DataFrame({
        "kind": ["expert"] * 4 + ["unattributed"], "layer": pd.array([0, 0, 1, 1, None], dtype="Int32"),
        "expert": pd.array([0, 1, 0, 1, None], dtype="Int32"), "expert_id": pd.array([0, 1, 2, 3, None], dtype="Int64"),
        "requested_pages": pd.array([8, 8, 4, 0, None], dtype="Int64"),
        "hit_pages": pd.array([0, 4, 0, 0, None], dtype="Int64"),
        "added_pages": pd.array([8, 4, 4, 0, 3], dtype="Int64"),
        "evicted_pages": pd.array([4, 0, 0, 0, 0], dtype="Int64"),
        "re_added_pages": pd.array([4, 0, 0, 0, 0], dtype="Int64"),
        "device_read_bytes": pd.array([8 * 4096, 4 * 4096, 4 * 4096, 0, 4096], dtype="Int64")})
    epochs = pd.DataFrame({"epoch": np.array([0, 1, 2, 3], np.int32), "phase": ["setup", "warmup", "measured", "after"],
                           "repeat": pd.array([None, 0, 0, None], dtype="Int32"),
                           "iteration": pd.array([None, 0, 0, None], dtype="Int32"),
                           "start_ns": pd.array([0, 100, 200, 300], dtype="Int64"),
                           "end_ns": pd.array([100, 200, 300, 400], dtype="Int64")})
    ee = pd.DataFrame({"epoch": np.array([1, 1, 1, 2, 2], np.int32), "kind": ["expert"] * 5,
                       "layer": pd.array([0, 0, 1, 0, 0], dtype="Int32"), "expert": pd.array([0, 1, 0, 0, 0], dtype="Int32"),
                       "expert_id": pd.array([0, 1, 2, 0, 0], dtype="Int64"),
                       "added_pages": pd.array([4, 4, 4, 4, 0], dtype="Int64"),
                       "evicted_pages": pd.array([4, 0, 0, 0, 0], dtype="Int64"),
                       "re_added_pages": pd.array([0, 0, 0, 4, 0], dtype="Int64")})
    its = pd.DataFrame({"phase": ["warmup", "measured"], "repeat": [0, 0], "iteration": [0, 0],
                        "duration_ns": [1000, 2000], "bytes": [3 * 16384, 2 * 16384]})
    meta = {"pool": {"geometry": {"n_layers": 2, "n_experts": 2, "expert_bytes": 16384}, "pages_per_expert": 4,
                     "extent_bytes": 16384},
            "cell": {"capacity_bytes": 16384}, "replay": {"warmup": 1, "passes": 1}}
    # simulated: accesses per (iteration over warm-up + measured): expert 0 twice, 1 once, 2 once
    sim = {"expert_id": np.array([0, 1, 2, 0]), "iteration": np.array([0, 0, 0, 1]),
           "miss": np.array([True, True, True, False]), "measured": np.array([False, False, False, True]),
           "budget_experts": np.int64(1), "n_iterations": np.int64(1)}
    return {"experts": experts, "epochs": epochs, "expert_epochs": ee, "iterations": its}, meta, sim


def test_amplification_per_expert_and_iteration_by_hand():
    from moetrace.analyses import amplification as A

    tables, meta, sim = _tiny()
    ex = A.compute_amplification_experts(tables, meta, sim=sim)
    assert ex["expert_id"].tolist() == [0, 1, 2, 3]
    assert ex["sim_accesses"].tolist() == [2, 1, 1, 0]
    assert ex["sim_miss_pages"].tolist() == [4, 4, 4, 0]
    # device 8 pages over 4 simulated miss pages: 2.0; the expert nobody read: NA
    assert ex["amplification"].tolist()[:3] == [2.0, 1.0, 1.0] and ex["amplification"].isna().tolist()[3]
    assert ex["observed_hit_rate"].tolist()[:3] == [0.0, 0.5, 0.0] and pd.isna(ex["observed_hit_rate"][3])
    assert ex["sim_hit_rate"].tolist()[:3] == [0.5, 0.0, 0.0]
    assert ex["measured_added_pages"].tolist() == [4, 0, 0, 0]
    assert ex["measured_re_added_pages"].tolist() == [4, 0, 0, 0]
    assert ex["measured_sim_miss_pages"].tolist() == [0, 0, 0, 0] and ex["measured_amplification"].isna().all()
    it = A.compute_amplification_iterations(tables, meta, sim=sim)
    assert it["phase"].tolist() == ["warmup", "measured"]
    assert it["added_pages"].tolist() == [12, 4] and it["re_added_pages"].tolist() == [0, 4]
    assert it["in_iteration_re_added_pages_min"].tolist() == [0, 0]
    assert it["requested_pages"].tolist() == [12, 8] and it["duration_ns"].tolist() == [1000, 2000]
    assert it["sim_miss_pages"].tolist() == [12, 0]
    lay = A.compute_layers(ex)
    assert lay["re_added_pages"].tolist() == [4, 0] and lay["re_added_share"].tolist() == [1.0, 0.0]
    top = A.top_experts(ex, "re_added_pages", 2)
    assert top["expert_id"].tolist() == [0, 1] and top["re_added_pages_share"].tolist() == [1.0, 0.0]


def test_rereads_within_one_iteration():
    from moetrace.analyses import amplification as A

    tables, meta, sim = _tiny()
    # without the stream: an expert added 6 times over its 4 pages in one epoch re-read >= 2 within it
    ee = tables["expert_epochs"].copy()
    ee.loc[3, "added_pages"] = 6
    tables = {**tables, "expert_epochs": ee}
    it = A.compute_amplification_iterations(tables, meta, sim=sim)
    assert it["in_iteration_re_added_pages_min"].tolist() == [0, 2]
    # with the stream: exact per page: added, deleted and added again inside one epoch counts; a
    # page added in an earlier epoch and evicted and re-read in this one does not
    pe = pd.DataFrame({"ts_ns": [150, 160, 170, 210, 220, 250, 260], "expert_id": [0] * 7,
                       "kind": ["add", "delete", "add", "delete", "add", "delete", "add"],
                       "first_page_index": [0, 0, 0, 0, 0, 0, 0], "pages": [4, 3, 3, 4, 4, 2, 2],
                       "re_added_pages": [0, 0, 3, 0, 4, 0, 2]})
    it = A.compute_amplification_iterations({**tables, "page_events": pe}, meta, sim=sim)
    assert it["in_iteration_re_added_pages"].tolist() == [3, 2]


def test_hit_path_quantiles_and_stack_categories():
    from moetrace.analyses import hitpath as H

    lo, hi = np.array([1024, 2048, 4096]), np.array([2048, 4096, 8192])
    assert H.hist_quantile(lo, hi, np.array([0, 10, 0]), 0.5) == pytest.approx(2048 * 2 ** 0.5)
    assert H.hist_quantile(lo, hi, np.array([1, 0, 1]), 1.0) == pytest.approx(8192)
    assert H.hist_quantile(lo, hi, np.zeros(3), 0.5) is None
    k = "_[k]"
    assert H.categorize(f"python;libc`preadv2;do_preadv{k};filemap_read{k};filemap_get_pages{k};"
                        f"filemap_get_read_batch{k};xas_load{k}") == "page-cache lookup"
    assert H.categorize(f"python;filemap_read{k};copy_page_to_iter{k};rep_movs_alternative{k}") == "copy to user"
    assert H.categorize(f"python;filemap_read{k};try_to_free_mem_cgroup_pages{k};shrink_node{k}") == \
        "reclaim in the reader"
    assert H.categorize("python;libc`memcpy") == "user space"
    st = pd.DataFrame({"stack": [f"a;filemap_get_read_batch{k}", f"a;copy_page_to_iter{k}", f"b;x{k}"],
                       "samples": [3, 1, 4], "who": ["command", "command", "kswapd"]})
    b = H.compute_stack_breakdown(st)
    assert b["category"].tolist() == ["page-cache lookup", "copy to user"] and b["share"].tolist() == [0.75, 0.25]


def test_reclaim_windows_alarm_and_psi():
    from moetrace.analyses import reclaim as R

    it = pd.DataFrame({"epoch": range(6), "phase": ["measured"] * 6, "repeat": [0] * 6, "iteration": range(6),
                       "re_added_pages": pd.array([0, 5, 5, 5, 5, 0], dtype="Int64"),
                       "requested_pages": pd.array([10] * 6, dtype="Int64"),
                       "duration_ns": pd.array([10**9] * 6, dtype="Int64")})
    w = R.compute_refault_windows(it, threshold=0.5)
    assert w["state"].tolist() == ["normal", "elevated", "elevated", "thrashing", "thrashing", "normal"]
    assert w["refault_pages_per_s"].tolist()[1] == 5.0
    assert R.compute_alarm(1.5, 2.5)["alarm"] is True
    assert R.compute_alarm(1.5, 1.5)["alarm"] is False and R.compute_alarm(1.01, 3.0)["alarm"] is False
    assert R.compute_alarm(None, 3.0)["alarm"] is None
    snaps = {"pre": {"monotonic_ns": 0, "psi": {"memory": {"some": {"total_us": 100}, "full": {"total_us": 0}}}},
             "post": {"monotonic_ns": 2_000_000, "psi": {"memory": {"some": {"total_us": 600}, "full": {"total_us": 0}}}}}
    p = R.compute_psi(snaps)
    assert p.loc[p["level"] == "some", "stall_share"].tolist() == [0.25]
    rc = pd.DataFrame({"kind": ["memcg", "kswapd"], "invocations": [2, 0], "scanned_pages": [30, 0],
                       "reclaimed_pages": [10, 0], "duration_ns_sum": [5, 0], "duration_ns_mean": [2.5, None]})
    k = R.compute_reclaim_kinds(rc)
    assert k["scan_to_steal"].tolist()[0] == 3.0 and pd.isna(k["scan_to_steal"][1])
    assert R.scan_to_steal(rc) == 3.0


@pytest.mark.parametrize("release", ["6.1", "6.12"])
def test_generation_age_on_the_lru_gen_formats(release):
    """Two samples of a real lru_gen (kernel lab) one second apart; in the second, aging made a new
    youngest generation and eviction retired the oldest: the cadence, the births and the age at
    eviction follow."""
    from moetrace.analyses import age as G
    from moetrace.kernel import lru_gen

    s1 = lru_gen.parse((ROOT / "tests" / "data" / "lru_gen" / f"{release}_lru_gen.txt").read_text())
    memcg = max({g["memcg_id"] for g in s1.generations})
    gens = [g for g in s1.generations if g["memcg_id"] == memcg]
    lo, hi = min(g["seq"] for g in gens), max(g["seq"] for g in gens)
    s2 = lru_gen.LruGenSample(generations=[
        {**g, "age_ms": g["age_ms"] + 1000} for g in gens if g["seq"] != lo] + [
        {**gens[-1], "seq": hi + 1, "gen": (hi + 1) % 4, "age_ms": 200, "nr_file_pages": 77}])
    t0 = 50 * 10**9
    df = lru_gen.generations_frame([(0, t0, lru_gen.LruGenSample(generations=gens)), (1, t0 + 10**9, s2)])
    g = G.compute_generations(df)
    assert g["max_seq"].tolist() == [hi, hi + 1] and g["min_seq"].tolist() == [lo, lo + 1]
    cad = G.compute_aging_cadence(df)
    assert cad["seq_increments"].tolist() == [1] and cad["ms_per_increment"].tolist() == [1000.0]
    assert cad["births"].tolist() == [1]
    # the aging kprobe's events as the lab kernels name them (6.1 and 6.12: try_to_inc_max_seq)
    aging = pd.DataFrame({"time_ns": [t0 + 1, t0 + 3_000_001, t0 + 5_000_001, t0 + 6_000_001],
                          "tgid": [1, 1, 1, 1],
                          "kind": pd.array(["try_to_inc_max_seq", "try_to_inc_max_seq", "evict", "inc_max_seq"],
                                           dtype="string"), "seq": pd.array([hi, hi, pd.NA, hi], dtype="Int64")})
    cad = G.compute_aging_cadence(df, aging)
    assert cad["aging_events_all_memcgs"].tolist() == [3]
    assert cad["aging_interval_ms_median_all_memcgs"].tolist() == [3.0]  # gaps 3 ms and 3 ms
    # eviction records: generation lo (seen in the samples) and hi + 2 (never seen: born by the
    # aging attempt on seq hi + 1), and one without a memcg
    evs = pd.DataFrame({"time_ns": [t0 + 500_000_000, t0 + 9 * 10**9, t0 + 9 * 10**9], "layer": [0, 0, 0],
                        "expert": [1, 2, 2], "expert_id": [1, 2, 2], "ino": [5, 6, 6], "page_index": [0, 0, 4],
                        "memcg_id": [memcg, memcg, 0], "seq": pd.array([lo, hi + 2, pd.NA], dtype="Int64"),
                        "tgid": [9, 9, 9]})
    aging2 = pd.DataFrame({"time_ns": [t0 + 8 * 10**9], "tgid": [9],
                           "kind": pd.array(["try_to_inc_max_seq"], dtype="string"),
                           "seq": pd.array([hi + 1], dtype="Int64")})
    ages = G.compute_eviction_ages(evs, df, aging2)
    lo_birth = int(df.loc[df["seq"] == lo, "birth_ns"].min())
    assert ages["birth_source"].tolist()[:2] == ["lru_gen", "aging"] and pd.isna(ages["birth_source"].iloc[2])
    assert ages["age_ms"].tolist()[:2] == [(t0 + 500_000_000 - lo_birth) / 1e6, 1000.0]
    per = G.compute_eviction_age_experts(ages)
    assert per["evicted_folios"].tolist() == [1, 2] and per["birth_known_share"].tolist() == [1.0, 0.5]
    assert per.loc[per["expert"] == 2, "age_ms_median"].tolist() == [1000.0]
    ev = G.compute_age_at_eviction(df)
    oldest = next(x for x in gens if x["seq"] == lo)
    assert ev["seq"].tolist() == [lo] and ev["age_ms"].tolist() == [oldest["age_ms"]]
    b = G.compute_generation_births(df)
    assert b.loc[b["seq"] == hi + 1, "birth_ns"].tolist() == [t0 + 10**9 - 200 * 10**6]


# -- timeline, flame, CLI --------------------------------------------------------------------------

def test_timeline_has_every_iteration_and_counters():
    from moetrace.analyses.timeline import compute_timeline
    from moetrace.run.handle import open_run

    run = open_run(DATA / "sweep" / "cells" / "48MiB-r0")
    doc = compute_timeline(run.tables, run.meta)
    json.dumps(doc)
    ev = doc["traceEvents"]
    slices = [e for e in ev if e["ph"] == "X" and e.get("cat") == "iteration"]
    assert len(slices) == len(run.tables["iterations"]) == 30 * 6
    assert all(e["ts"] >= 0 and e["dur"] > 0 for e in slices)
    counters = [e for e in ev if e["ph"] == "C" and e["name"] == "pool pages per iteration"]
    assert sum(e["args"]["re_added_pages"] for e in counters) == int(
        run.tables["expert_epochs"].query("kind == 'expert'")["re_added_pages"].sum())
    ts = [e["ts"] for e in ev if "ts" in e]
    assert ts == sorted(ts)


def test_differential_flame_pagecache_vs_pinned_shows_lookup_on_one_side_only(tmp_path):
    """Same plan, same C (128 MiB): the pagecache replay's preadv2 reaches the page-cache lookup
    (filemap_get_read_batch); the pinned replay serves the arena from memory and never does."""
    r = subprocess.run([sys.executable, "-m", "moetrace.cli", "flame", str(DATA / "sweep" / "cells" / "128MiB-r0"),
                        "--diff", str(DATA / "pinned"), "-o", str(tmp_path / "d.svg"), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    frames = pd.DataFrame(json.loads(r.stdout)["frames"])
    look = frames[frames["path"].str.contains("preadv2") & frames["frame"].str.startswith("filemap_get_read_batch")]
    assert len(look) >= 1 and (look["only_in"] == "b").all() and (look["samples_a"] == 0).all()
    assert int(look["samples_b"].sum()) > 0
    svg = (tmp_path / "d.svg").read_text()
    assert 'data-name="filemap_get_read_batch_[k]"' in svg and 'data-only="b"' in svg


def test_report_cli_json_and_errors(tmp_path):
    def mt(*a):
        return subprocess.run([sys.executable, "-m", "moetrace.cli", *map(str, a)], capture_output=True, text=True)

    r = mt("report", DATA / "pinned", "--out", tmp_path / "r", "--only", "amp,reclaim", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["summary"]["kind"] == "cell" and "reconciliation" in doc["tables"] and "flame" not in doc["files"]
    r = mt("report", DATA / "pinned", "--out", tmp_path / "r2", "--only", "amp,bogus")
    assert r.returncode == 2 and "unknown report section(s): bogus" in r.stderr and "Traceback" not in r.stderr
    r = mt("report", tmp_path, "--out", tmp_path / "r3")
    assert r.returncode == 1 and "not a moetrace run, cell or sweep directory" in r.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "precious.txt").write_text("keep")
    r = mt("report", DATA / "pinned", "--out", tmp_path / "full", "--only", "amp")
    assert r.returncode == 2 and "holds no earlier report" in r.stderr
    assert (tmp_path / "full" / "precious.txt").read_text() == "keep"


def test_timeline_streams_the_page_event_counter():
    from moetrace.analyses.timeline import compute_timeline
    from moetrace.run.handle import open_run

    run = open_run(DATA / "run")
    pe = run.tables["page_events"]
    net = int((pe["pages"].astype("int64") * pe["kind"].map({"add": 1, "delete": -1})).sum())
    for tables in (run.tables, dict(run.tables)):  # streamed from the file, and from a frame
        c = [e for e in compute_timeline(tables, run.meta)["traceEvents"]
             if e["name"] == "pool pages added - deleted (stream)"]
        assert c and c[-1]["args"]["pages"] <= net and c[0]["args"]["pages"] == int(pe["pages"].iloc[0])


def test_reclaim_timeline_by_hand_and_recorded():
    from moetrace.analyses import reclaim as R
    from moetrace.run.handle import open_run

    tl = pd.DataFrame({"time_ns": [0, 10**8, 10**8], "who": ["memcg", "memcg", "kswapd"],
                       "nr_scanned_pages": [30, 0, 8], "nr_reclaimed_pages": [10, 0, 8], "invocations": [2, 1, 1],
                       "duration_ns": [5, 1, 2]})
    out = R.compute_reclaim_timeline(tl, {"summaries": {"reclaim": {"t0_ns": 1000}}})
    assert out["time_ns"].tolist() == [1000, 1000 + 10**8, 1000 + 10**8]
    assert out["who"].tolist() == ["memcg", "kswapd", "memcg"]
    assert out["scan_to_steal"].tolist()[:2] == [3.0, 1.0] and pd.isna(out["scan_to_steal"][2])
    # a recorded cell: the buckets sum to the per-kind totals, and lie inside the recording
    run = open_run(DATA / "sweep" / "cells" / "32MiB-r0")
    t = R.compute_reclaim_timeline(run.tables["reclaim_timeline"], run.meta)
    per = run.tables["reclaim"].set_index("kind")
    for who, g in t.groupby("who"):
        assert int(g["reclaimed_pages"].sum()) == int(per.loc[who, "reclaimed_pages"])
        assert int(g["scanned_pages"].sum()) == int(per.loc[who, "scanned_pages"])
    iv = run.manifest["interval"]
    assert iv["armed_ns"] - 10**8 <= t["time_ns"].min() and t["time_ns"].max() <= iv["disarmed_ns"]


def test_report_of_a_run_with_few_tables_or_no_pool(tmp_path):
    """A recording with the pagecache probe alone, and one made without a pool (`record -- true`):
    the report says what it left out and why, and never raises."""
    import shutil

    from moetrace.reports.report import build_report

    few = tmp_path / "few"
    shutil.copytree(DATA / "run", few)
    for p in few.glob("*.parquet"):
        if p.stem not in ("experts", "epochs", "expert_epochs"):
            p.unlink()
    doc = build_report(few, tmp_path / "r1")
    page = (tmp_path / "r1" / "report.html").read_text()
    for missing in ("The reads probe was not recorded", "The lru probe was not recorded",
                    "The reclaim probe was not recorded", "The stacks probe was not recorded"):
        assert missing in page
    assert "amp_experts" in doc["tables"]
    nopool = tmp_path / "nopool"
    shutil.copytree(DATA / "run", nopool)
    m = json.loads((nopool / "manifest.json").read_text())
    m["pool"], m["plan"] = None, None
    (nopool / "manifest.json").write_text(json.dumps(m))
    doc = build_report(nopool, tmp_path / "r2")
    assert "recorded without a pool" in (tmp_path / "r2" / "report.html").read_text()
    assert not any(t.startswith(("amp_", "hitpath_", "age_")) for t in doc["tables"])
