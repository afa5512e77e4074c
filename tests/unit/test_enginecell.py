"""Engine cells' figures without a kernel (moetrace.capacity.enginecell, .enginesweep): a routing
trace and a recording's tables written by the test, whose answers are counted by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moetrace.capacity.enginecell import EngineCellSpec, engine_figures, miss_demand
from moetrace.capacity.enginesweep import capacity_table
from moetrace.errors import UsageError
from moetrace.run.handle import engine_cell_as_cell, kind_of

L, E, PPE = 2, 4, 3  # 2 layers x 4 experts, 3 pages each


class _PM:
    n_total, n_experts, extent_bytes = L * E, E, PPE * 4096


def _trace(path: Path, steps: list[list[list[int]]]) -> Path:
    """steps[t][layer] = the experts routed; a prefill record first (skipped)."""
    lines = [{"step": 0, "layer": la, "experts": [0], "request": "r0", "phase": "prefill", "t_ns": 0, "decode_ns": 1}
             for la in range(L)]
    for t, per in enumerate(steps):
        lines += [{"step": t, "layer": la, "experts": ex, "request": "r0", "t_ns": t, "decode_ns": (t + 1) * 10**6}
                  for la, ex in enumerate(per)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_the_routed_miss_demand_is_an_lru_of_c_over_the_engines_routing(tmp_path):
    # layer 0 routes 0 1 0 1 2 0, layer 1 always its expert 0: a global LRU of 3 experts warmed by
    # token 0 misses L0E1 at token 1 (cold), L0E2 at token 4 (evicting L0E0, the least recent) and
    # L0E0 at token 5: 3 misses over the 5 scored tokens
    tr = _trace(tmp_path / "r.jsonl", [[[0], [0]], [[1], [0]], [[0], [0]], [[1], [0]], [[2], [0]], [[0], [0]]])
    m = miss_demand(tr, _PM, 3 * PPE * 4096, 1)
    assert (m["budget_experts"], m["scored_accesses"]) == (3, 10)
    assert m["misses"] == 3 and m["miss_bytes_per_token"] == 3 * PPE * 4096 / 5


def test_figures_count_pages_no_routed_expert_needed_per_token_and_per_expert(tmp_path):
    tr = _trace(tmp_path / "route.jsonl", [[[0], [1]], [[2], [1]], [[0], [3]]])
    run = tmp_path / "run"
    run.mkdir()
    ep = pd.DataFrame({"epoch": [0, 1, 2, 3, 4, 5, 6], "phase": ["setup", "load", "prefill", "warmup", "measured",
                                                                   "measured", "after"],
                       "iteration": pd.array([None, None, None, 0, 1, 2, None], dtype="Int32"),
                       "added_demand_pages": [0, 0, 0, 2, 1, 2, 0], "added_readahead_pages": [0, 0, 0, 7, 8, 4, 0],
                       "added_populate_pages": [0, 24, 0, 0, 0, 0, 0], "added_other_pages": [0] * 7})
    ep.to_parquet(run / "epochs.parquet")
    rows = [  # (epoch, kind, expert_id, added)
        (4, "expert", 2, 3), (4, "expert", 5, 3), (4, "expert", 0, 3), (4, "non_expert", None, 2),  # token 1
        (5, "expert", 0, 3), (5, "expert", 7, 3), (5, "expert", 6, 2),  # token 2: expert 6 (L1E2) unrouted
        (3, "expert", 0, 3)]  # the warm-up token: not measured
    ee = pd.DataFrame(rows, columns=["epoch", "kind", "expert_id", "added_pages"])
    ee["expert_id"] = ee["expert_id"].astype("Int64")
    ee.to_parquet(run / "expert_epochs.parquet")
    pd.DataFrame({"kind": ["expert"] * 8, "expert_id": range(8), "device_read_bytes": pd.array([4096] * 8, "Int64"),
                  **{f"added_{c}_pages": pd.array([i] * 8, "Int64") for i, c in
                     enumerate(("demand", "readahead", "populate", "other"))}}).to_parquet(run / "experts.parquet")
    spec = EngineCellSpec(model=str(tr), capacity_bytes=8 * PPE * 4096, tokens=3, warmup_tokens=1)
    f = engine_figures(run, tr, _PM, spec)
    # token 1 routed L0E2 (2) and L1E1 (5): expert 0 (L0E0) was not; token 2 routed L0E0, L1E3 (7)
    assert f["whole_run_device_bytes"] == 8 * 4096
    assert f["expert_pages_added"] == 17 and f["unneeded_pages"] == 3 + 2
    assert f["unneeded_share"] == pytest.approx(5 / 17)
    assert f["device_bytes_per_token"] == pytest.approx((11 + 8) / 2 * 4096)
    assert f["added_by_cause"] == {"demand": 3, "readahead": 12, "populate": 0, "other": 0}
    assert f["load_populate_pages"] == 24 and f["measured_tokens"] == 2
    assert f["decode_ms_per_token"] == pytest.approx(2.5)
    per = pd.read_parquet(tmp_path / "engine_experts.parquet").set_index("expert_id")
    assert per.loc[0, ["added_pages", "needed_pages", "unneeded_pages", "routed_tokens"]].tolist() == [6, 3, 3, 1]
    assert per.loc[6, "unneeded_share"] == 1.0 and np.isnan(per.loc[1, "unneeded_share"])
    assert per.loc[3, ["run_added_demand_pages", "run_added_populate_pages"]].tolist() == [0, 2]
    tok = pd.read_parquet(tmp_path / "engine_tokens.parquet").set_index("token")
    assert tok.loc[1, ["model_pages_added", "expert_pages_added", "needed_pages"]].tolist() == [11, 9, 6]


def test_the_capacity_table_takes_the_retained_repeats_medians():
    res = pd.DataFrame({"loader": ["stock"] * 3 + ["random"], "capacity_bytes": [1, 1, 1, 1],
                        "retained": [True, True, False, True], "decode_ms_per_token": [10.0, 30.0, 99.0, 5.0],
                        "device_bytes_per_token": [1.0, 3.0, 9.0, 1.0], "miss_bytes_per_token": [1.0] * 4,
                        "amplification": [1.0, 3.0, 9.0, 1.0], "unneeded_share": [0.5] * 4,
                        "readahead_share": [0.9, 1.0, 0.0, 0.0]})
    cap = capacity_table(res).set_index("loader")
    assert cap.loc["stock", "repeats"] == 2 and cap.loc["stock", "decode_ms_per_token"] == 20.0
    assert (cap.loc["stock", "amplification_min"], cap.loc["stock", "amplification_max"]) == (1.0, 3.0)


def test_an_engine_cell_is_a_cell_to_check_and_bad_specs_are_refused(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "engine_cell.json").write_text(json.dumps({
        "inputs": {"capacity_bytes": 5}, "label": "stock mmap", "retained": True, "decode_ms_p50": 2.0,
        "device_bytes_per_token": 7.0, "miss_bytes_per_token": 3.5, "amplification": 2.0, "measured_tokens": 4,
        "host": {"name": "h"}, "kernel": "6.18"}))
    assert kind_of(d) == "engine_cell"
    c = engine_cell_as_cell(d)
    assert (c["iteration_time_median_ns"], c["device_bytes_per_iteration"], c["amplification"], c["mode"]) == \
        (2e6, 7.0, 2.0, "stock mmap")
    m = tmp_path / "m.gguf"
    m.write_bytes(b"x")
    with pytest.raises(UsageError, match="--warmup-tokens 8"):
        EngineCellSpec(model=str(m), capacity_bytes=1, tokens=8, warmup_tokens=8).validate()
    with pytest.raises(UsageError, match="--loader"):
        EngineCellSpec(model=str(m), capacity_bytes=1, loader="fast").validate()
    with pytest.raises(UsageError, match="no such file"):
        EngineCellSpec(model=str(tmp_path / "nope"), capacity_bytes=1).validate()
