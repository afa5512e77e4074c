"""Why an evicted page was read again (analyses.eviction_reuse) on a plan small enough to count
by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from moetrace.analyses.eviction_reuse import (add_generation_position, compute_eviction_reuse,
                                              summarize_eviction_reuse)

# plan iteration -> experts read: 0: {0, 1}, 1: {2}, 2: {0, 3}, 3: {1}
PLAN_IT = np.array([0, 0, 1, 2, 2, 3])
PLAN_E = np.array([0, 1, 2, 0, 3, 1])
LOG = pd.DataFrame({"step": [0, 1, 2, 3], "start_ns": [0, 10, 20, 30]})
EV = pd.DataFrame({"time_ns": [15, 16, 25, 5], "expert_id": [1, 1, 0, 3], "memcg_id": 3,
                   "seq": pd.array([5, 5, 5, 5], dtype="Int64")})


def test_each_eviction_against_the_accesses_around_it():
    r = compute_eviction_reuse(EV, LOG, PLAN_IT, PLAN_E, budget=4).set_index("expert_id")
    one = r.loc[1]  # evicted in iteration 1 (2 pages), read in 0 and again in 3: {2, 0, 3} between
    assert (one["pages"], one["last_access"], one["iterations_since_access"], one["next_access"]) == (2, 0, 1, 3)
    assert one["distance"] == 3 and bool(one["lru_keeps"]) and one["ms_since_access"] == pytest.approx(15e-6)
    zero = r.loc[0]  # evicted in the iteration that read it, never read again
    assert zero["iterations_since_access"] == 0 and pd.isna(zero["next_access"]) and pd.isna(zero["lru_keeps"])
    three = r.loc[3]  # evicted before its first read: no last access, no distance
    assert pd.isna(three["last_access"]) and three["next_access"] == 2 and pd.isna(three["distance"])
    tight = compute_eviction_reuse(EV, LOG, PLAN_IT, PLAN_E, budget=3).set_index("expert_id")
    assert not bool(tight.loc[1, "lru_keeps"])  # 3 other experts between: an LRU of 3 loses it too


def test_summary_weights_pages_and_places_generations():
    r = compute_eviction_reuse(EV, LOG, PLAN_IT, PLAN_E, budget=4)
    gen = pd.DataFrame({"time_ns": 0, "sample": 0, "memcg_id": 3, "seq": [4, 5, 7], "nr_file_pages": [0, 10, 1]})
    r = add_generation_position(r, gen, 3)
    assert set(r["gens_above_oldest"]) == {0} and set(r["gens_below_youngest"]) == {2}  # seq 4 holds anon only
    s = summarize_eviction_reuse(r)
    assert (s["evicted_pages"], s["reread_pages"], s["excess_pages"]) == (4, 3, 2)
    assert s["excess_share_of_rereads"] == pytest.approx(2 / 3)
    assert s["rereads_evicted_within_one_iteration_share"] == pytest.approx(2 / 3)
    assert s["reread_iterations_since_access_median"] == 1.0 and s["evicted_from_oldest_share"] == 1.0
    assert summarize_eviction_reuse(r.iloc[:0]) == {"evicted_pages": 0}
    none = add_generation_position(r.drop(columns=["gens_above_oldest", "gens_below_youngest"]), gen, 9)
    assert none["gens_above_oldest"].isna().all() and "evicted_from_oldest_share" not in summarize_eviction_reuse(none)


def test_the_cell_report_says_why_evicted_pages_were_read_again(tmp_path):
    """The age section of a recorded cell's report, on the golden pinned cell given a plan (8 layers
    x 16 experts, iteration i reads expert i % 16 of every layer) and mglru tables in its formats."""
    import json
    import shutil

    from common.reports import DATA

    from moetrace.inputs.geometry import Geometry
    from moetrace.inputs.plan import write_plan
    from moetrace.inputs.trace import Accesses
    from moetrace.reports.report import build_report

    cell = tmp_path / "cell"
    shutil.copytree(DATA / "pinned", cell)
    n_it, L = 30, 8
    acc = Accesses(np.repeat(np.arange(n_it, dtype=np.int32), L), np.zeros(n_it * L, np.int8),
                   np.tile(np.arange(L, dtype=np.int16), n_it), np.repeat(np.arange(n_it, dtype=np.int32) % 16, L),
                   L, 16, n_it)
    write_plan(tmp_path / "plan.bin", acc, Geometry(L, 16, 4, 1 << 20, "t"))
    man = json.loads((cell / "run" / "manifest.json").read_text())
    man["plan"]["path"] = str(tmp_path / "plan.bin")
    (cell / "run" / "manifest.json").write_text(json.dumps(man))
    it = pd.read_parquet(cell / "replay" / "iterations.parquet").reset_index(drop=True)
    g = int(np.flatnonzero((it["phase"] == "measured").to_numpy())[2])
    step = int(it.loc[g, "step"])
    # expert 0 of layer 0 evicted (3 pages) in a measured iteration, after its last read
    t = int(it.loc[g, "start_ns"]) + 1
    pd.DataFrame({"time_ns": [t, t, t], "layer": 0, "expert": step % 16, "expert_id": step % 16, "ino": 5,
                  "page_index": [0, 1, 2], "memcg_id": 3, "seq": pd.array([7, 7, 7], dtype="Int64"),
                  "tgid": 1}).to_parquet(cell / "run" / "mglru_evictions.parquet")
    pd.DataFrame({"time_ns": t - 10, "sample": 0, "memcg_id": 3, "memcg_path": "/moetrace-cell", "node": 0,
                  "seq": [7, 8], "gen": [3, 0], "age_ms": [900, 100], "birth_ns": [t - 10 ** 9, t - 10 ** 8],
                  "nr_anon_pages": 0, "nr_file_pages": [10, 5], "anon_evicted": False,
                  "file_evicted": False}).to_parquet(cell / "run" / "lru_gen.parquet")
    doc = build_report(cell, tmp_path / "rep", sections=["age"])
    s = doc["summary"]["eviction_reuse"]
    assert s["evicted_pages"] == 3 and s["evicted_from_oldest_share"] == 1.0
    # the expert is read again 16 iterations later with 15 other experts of each layer between:
    # within the 128-expert budget, so a global LRU would have kept it
    assert (s["reread_pages"], s["excess_pages"]) == (3, 3)
    assert s["rereads_evicted_within_one_iteration_share"] == 1.0  # evicted in the iteration that read it
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "Why evicted pages were read again" in page and "pool pages" in page
