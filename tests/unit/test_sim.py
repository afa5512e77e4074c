"""Cache simulators: hand-computed tiny traces, properties, windows, the `sim` command."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetrace.analyses import sim
from moetrace.analyses.stackdist import lru_curve, lru_stack_curve, stack_distances, window
from moetrace.cli import cli
from moetrace.errors import InputError, UsageError
from moetrace.inputs.accesses import is_plan, load_accesses
from moetrace.inputs.trace import Accesses, accesses_from_table, write_jsonl


def mk(sets: list[list[list[int]]], n_experts: int) -> Accesses:
    """sets[iteration][layer] = experts read; canonical order via the trace module."""
    rows = [(it, 0, layer, e) for it, per in enumerate(sets) for layer, es in enumerate(per) for e in es]
    n_layers = max(len(per) for per in sets)
    df = pd.DataFrame(rows, columns=["step", "pass", "layer", "expert"])
    return accesses_from_table(df, n_layers, n_experts)


def single(seq: list[int], n_experts: int) -> Accesses:
    """One layer, one access per iteration."""
    return mk([[[e]] for e in seq], n_experts)


# Stream A (one layer, 4 experts, one access per iteration). With warm 0.6, the
# first 6 iterations warm and the last 4 (accesses 0 1 2 3) are scored.
A = [0, 1, 2, 0, 1, 3, 0, 1, 2, 3]


# ---------------------------------------------------------------------------
# hand-computed values


def test_window_split():
    acc = single(A, 4)
    w = window(acc, 0.6)
    assert (w.warm_iterations, w.scored_iterations, w.cut, w.scored_accesses) == (6, 4, 6, 4)
    assert window(acc, 0.0).cut == 0
    assert window(acc, 0.55).warm_iterations == 5  # floor(5.5)
    assert window(single(list(range(100)) * 1, 100), 0.29).warm_iterations == 29  # no float fuzz
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(UsageError):
            window(acc, bad)


def test_window_cut_counts_whole_iterations():
    # 3 iterations of 2 layers x 2 experts: cut falls on an iteration boundary
    acc = mk([[[0, 1], [1]], [[0], [0, 1]], [[1], [0]]], 2)
    w = window(acc, 0.5)  # floor(1.5) = 1 warm iteration = 3 accesses
    assert (w.warm_iterations, w.cut, w.scored_accesses) == (1, 3, 5)


def test_lru_stack_distances_by_hand():
    # i3: {1,2} since i0 -> 3; i4: {2,0} -> 3; i6: {1,3} -> 3; i7: {3,0} -> 3;
    # i8: {0,1,3} since i2 -> 4; i9: {0,1,2} since i5 -> 4
    assert stack_distances(single(A, 4)).tolist() == [0, 0, 0, 3, 3, 0, 3, 3, 4, 4]


def test_lru_by_hand():
    acc = single(A, 4)
    # scored distances 3, 3, 4, 4
    expect = {1: 0, 2: 0, 3: 2, 4: 4, 9: 4}
    c = lru_stack_curve(acc, "per_layer", 0.6)
    for b, h in expect.items():
        assert c.hits_at(b) == h
        assert sim.lru_hits(acc, b) == h
    b, r = lru_curve(acc)
    assert b.tolist() == [1, 2, 3, 4] and r.tolist() == [0.0, 0.0, 0.5, 1.0]
    assert c.miss_bytes_per_iteration(3, 100) == pytest.approx(2 * 100 / 4)


def test_lfu_by_hand():
    # B=2, (freq, last) min evicted; frequencies count from the stream start:
    # i2 evicts 0 (1,t0) over 1 (1,t1); i3 evicts 1; i4 evicts 2; i5 evicts 0 (2,t3);
    # i6 0 miss, evicts 3 (1,t5); i7 1 HIT; i8 evicts 0 (3,t6); i9 evicts 2 (2,t8).
    acc = single(A, 4)
    assert sim.lfu_hits(acc, 2) == 1
    assert sim.lfu_hits(acc, 1) == 0
    assert sim.lfu_hits(acc, 4) == 4


def test_static_by_hand():
    acc = single(A, 4)
    # oracle counts 0:3 1:3 2:2 3:2 -> tables {0}, {0,1}, {0,1,2}; scored 0 1 2 3
    assert [sim.static_hits(acc, b) for b in (1, 2, 3, 4)] == [1, 2, 3, 4]
    # warm counts (0 1 2 0 1 3): 0:2 1:2 2:1 3:1 -> same order here
    assert [sim.static_hits(acc, b, table="warm") for b in (1, 2, 3)] == [1, 2, 3]
    # a warm table that differs: warm 3 3 3 0 0 2, scored 0 1 2 3 (warm 0.6)
    acc2 = single([3, 3, 3, 0, 0, 2, 0, 1, 2, 3], 4)
    assert [sim.static_hits(acc2, b, table="warm") for b in (1, 2, 3, 4)] == [1, 2, 3, 3]
    # oracle counts 3:4 0:3 2:2 1:1 -> {3}, {0,3}, {0,2,3}, all
    assert [sim.static_hits(acc2, b) for b in (1, 2, 3, 4)] == [1, 2, 3, 4]
    # a table from another stream (domain shift): only expert 1 is ever read there
    other = single([1, 1, 1], 4)
    assert sim.static_hits(acc2, 1, table=other) == 1
    assert sim.static_hits(acc2, 4, table=other) == 1  # zero-count experts are never in the table
    with pytest.raises(UsageError):
        sim.static_hits(acc2, 1, table=single([1], 5))


def test_belady_by_hand():
    acc = single(A, 4)
    # at the cut: forced 3 (read last) + the warm-seen experts with the soonest next
    # use: 0 (i6), 1 (i7), 2 (i8). B=1 {3}: 0 1 2 miss, 3 misses (evicted) -> 0.
    # B=2 {3,0}: 0 hit, 1 and 2 evict the never-again ones, 3 hit -> 2.
    # B=3 {3,0,1}: 0 hit, 1 hit, 2 miss, 3 hit -> 3.
    assert [sim.belady_hits(acc, b) for b in (1, 2, 3, 4)] == [0, 2, 3, 4]
    # warm 0: plain MIN from an empty cache, B=2 over 0 1 2 0 1 3 0 1 2 3:
    # 0m 1m 2m(evict 1? next 0@3, 1@4 -> evict 1) 0h 1m(evict 2@8 vs 0@6 -> 2) 3m(evict 1@7 vs 0@6 -> 1)
    # 0h 1m(evict 0 never again... 0 none, 3@9 -> evict 0) 2m(evict 1) 3h -> 3 hits
    assert sim.belady_hits(acc, 2, warm_fraction=0.0) == 3


def test_belady_uses_the_best_warm_state():
    # 9 iterations, warm 5 (1 1 4 2 4), scored 1 4 4 4, B=2. Plain MIN over the whole
    # stream evicts 1 at the 2 (4 is needed sooner), misses the scored 1: 3 hits.
    # LFU keeps 1 (freq 2) and evicts 2 at the second 4: 4 hits. Belady starts the
    # scored window from {4 (read last), 1 (next use soonest)}: 4 hits.
    acc = single([1, 1, 4, 2, 4, 1, 4, 4, 4], 5)
    assert sim.lfu_hits(acc, 2) == 4
    assert sim.lru_hits(acc, 2) == 3
    assert sim.belady_hits(acc, 2) == 4


def test_static_is_not_bounded_by_belady():
    # documented: B=1 on a b a b ... a static {a} hits every a, demand paging nothing
    acc = single([0, 1] * 5, 2)
    assert sim.static_hits(acc, 1) == 2
    assert sim.belady_hits(acc, 1) == 0


def test_per_layer_vs_global_by_hand():
    # layer 0 alternates 0 1 0 1 0, layer 1 always reads 0; scored iterations 3, 4
    acc = mk([[[0], [0]], [[1], [0]], [[0], [0]], [[1], [0]], [[0], [0]]], 2)
    assert sim.lru_hits(acc, 1, "per_layer") == 2  # layer 1 hits twice
    assert sim.lru_hits(acc, 1, "global") == 0  # the pool alternates 0, 2, 1, 2, ...
    assert sim.lru_hits(acc, 2, "global") == 2
    assert sim.lru_hits(acc, 3, "global") == 4
    df = sim.compute_sim(acc, ["lru"], [1], ["per_layer", "global"], expert_bytes=100)
    pl = df[df.scope == "per_layer"].iloc[0]
    gl = df[df.scope == "global"].iloc[0]
    assert (pl.budget, pl.budget_total, pl.hits, pl.accesses, pl.misses) == (1, 2, 2, 4, 2)
    assert pl.miss_bytes_per_iteration == pytest.approx(2 * 100 / 2)
    # global default budget = B x layers = 2 experts in all
    assert (gl.budget, gl.budget_total, gl.hits) == (2, 2, 2)


def test_compute_sim_table():
    acc = single(A, 4)
    df = sim.compute_sim(acc, budgets=[2, 3], scopes=["per_layer", "global"], global_budgets=[2])
    assert list(df.columns) == sim.COLUMNS
    got = {(r.policy, r.scope, r.budget): r.hits for r in df.itertuples()}
    assert got[("lru", "per_layer", 2)] == 0 and got[("lru", "per_layer", 3)] == 2
    assert got[("lfu", "per_layer", 2)] == 1
    assert got[("static", "per_layer", 3)] == 3
    assert got[("belady", "per_layer", 3)] == 3
    assert got[("belady", "global", 2)] == 2
    assert df["miss_bytes_per_iteration"].isna().all()  # no expert size: NA, not 0
    assert set(df.loc[df.policy == "static", "static_table"]) == {"oracle"}
    assert df.loc[df.policy != "static", "static_table"].isna().all()
    assert df.attrs["warm_iterations"] == 6


def test_bad_budgets():
    for bad in ("8,x", "0", "8,,16", "-4", "2.5", ""):
        with pytest.raises(UsageError):
            sim.parse_budgets(bad)
    assert sim.parse_budgets("64, 8,16,8") == [8, 16, 64]
    with pytest.raises(UsageError):
        sim.lru_hits(single(A, 4), 0)
    with pytest.raises(UsageError):
        sim.parse_policies("lru,fifo")


# ---------------------------------------------------------------------------
# properties


@st.composite
def streams(draw, max_layers=3):
    n_layers = draw(st.integers(1, max_layers))
    n_experts = draw(st.integers(1, 6))
    n_it = draw(st.integers(1, 14))
    sets = [[sorted(draw(st.sets(st.integers(0, n_experts - 1), min_size=1, max_size=n_experts)))
             for _ in range(n_layers)] for _ in range(n_it)]
    wf = draw(st.sampled_from([0.0, 0.3, 0.6, 0.9]))
    return mk(sets, n_experts), wf


PROP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(streams())
def test_curve_equals_direct_lru_and_is_monotone(s):
    acc, wf = s
    for scope in ("per_layer", "global"):
        c = lru_stack_curve(acc, scope, wf)
        direct = [sim.lru_hits(acc, b, scope, wf) for b in range(1, c.n_items + 2)]
        assert direct == [c.hits_at(b) for b in range(1, c.n_items + 2)]
        assert np.all(np.diff(c.cum_hits) >= 0)


@PROP
@given(streams())
def test_belady_bounds_demand_policies(s):
    acc, wf = s
    nxt = sim.next_use(acc)
    for scope in ("per_layer", "global"):
        c = lru_stack_curve(acc, scope, wf)
        for b in range(1, c.n_items + 1):
            bel = sim.belady_hits(acc, b, scope, wf, nxt=nxt)
            assert bel >= c.hits_at(b)
            assert bel >= sim.lfu_hits(acc, b, scope, wf)
            assert bel <= window(acc, wf).scored_accesses


@PROP
@given(streams(max_layers=1))
def test_one_layer_scopes_agree(s):
    acc, wf = s
    for b in range(1, acc.n_experts + 1):
        for policy in sim.POLICIES:
            assert sim.simulate(acc, policy, b, "per_layer", wf) == sim.simulate(acc, policy, b, "global", wf)


def _naive_distances(items: list[int]) -> list[int]:
    out = []
    for i, x in enumerate(items):
        prev = [j for j in range(i) if items[j] == x]
        out.append(len(set(items[prev[-1] + 1:i])) + 1 if prev else 0)
    return out


@PROP
@given(streams())
def test_stack_distances_match_definition(s):
    acc, _ = s
    gid = (acc.layer.astype(int) * acc.n_experts + acc.expert).tolist()
    assert stack_distances(acc, "global").tolist() == _naive_distances(gid)
    d = stack_distances(acc, "per_layer")
    for layer in range(acc.n_layers):
        m = acc.layer == layer
        assert d[m].tolist() == _naive_distances(acc.expert[m].tolist())


def _opt_scored_hits(items: list[int], cut: int, budget: int) -> int:
    """Brute force: the most scored hits any demand-paging cache of `budget` gets."""
    best = {frozenset(): 0}
    for i, x in enumerate(items):
        nxt: dict[frozenset, int] = {}
        for state, h in best.items():
            if x in state:
                cands = [(state, h + (i >= cut))]
            elif len(state) < budget:
                cands = [(state | {x}, h)]
            else:
                cands = [((state - {y}) | {x}, h) for y in state]
            for st_, hh in cands:
                if nxt.get(st_, -1) < hh:
                    nxt[st_] = hh
        best = nxt
    return max(best.values())


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=14), st.sampled_from([0.0, 0.4, 0.6]),
       st.integers(1, 3))
def test_belady_is_the_demand_paging_optimum(seq, wf, b):
    acc = single(seq, 5)
    w = window(acc, wf)
    assert sim.belady_hits(acc, b, "global", wf) == _opt_scored_hits(seq, w.cut, b)


def test_static_full_table_hits_all_seen():
    acc = single(A, 4)
    assert sim.static_hits(acc, 99) == 4
    cum = sim.static_hits_curve(acc)
    assert cum.tolist() == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------------
# the command


@pytest.fixture
def tiny_trace(tmp_path):
    rng = np.random.default_rng(3)
    recs = [(s, layer, sorted(rng.choice(8, size=2, replace=False).tolist()))
            for s in range(20) for layer in range(2)]
    p = tmp_path / "t.jsonl"
    write_jsonl(recs, p)
    return p


def test_cli_json(tiny_trace):
    r = CliRunner().invoke(cli, ["sim", str(tiny_trace), "--budgets", "2,4", "--scope", "both",
                                 "--expert-bytes", "1KiB", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["warm_iterations"] == 12 and doc["scored_iterations"] == 8
    rows = doc["rows"]
    assert len(rows) == 4 * 2 * 2
    assert {row["scope"] for row in rows} == {"per_layer", "global"}
    lru = {(row["scope"], row["budget"]): row for row in rows if row["policy"] == "lru"}
    acc = load_accesses(tiny_trace)
    assert lru[("per_layer", 2)]["hits"] == sim.lru_hits(acc, 2)
    assert lru[("global", 8)]["hits"] == sim.lru_hits(acc, 8, "global")
    row = lru[("per_layer", 2)]
    assert row["miss_bytes_per_iteration"] == pytest.approx(row["misses"] * 1024 / 8)


def test_cli_human_plot_and_static_file(tiny_trace, tmp_path):
    out = tmp_path / "p.png"
    r = CliRunner().invoke(cli, ["sim", str(tiny_trace), "--static-table", str(tiny_trace),
                                 "--global-budgets", "3,5", "--plot", str(out)])
    assert r.exit_code == 0, r.output
    assert "hit rate (%)" in r.output and "belady" in r.output and "global" in r.output
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"


def test_cli_errors(tiny_trace, tmp_path):
    run = CliRunner().invoke
    for args in (["--budgets", "8,x"], ["--budgets", "0"], ["--policy", "fifo"],
                 ["--warm-fraction", "1.5"], ["--global-budgets", "4", "--scope", "per-layer"]):
        r = run(cli, ["sim", str(tiny_trace), *args])
        assert r.exit_code == 2, (args, r.output)
        assert "Error" in r.output and "Traceback" not in r.output
    r = run(cli, ["sim", str(tiny_trace), "--geometry", "olmoe"])  # k=8, the trace has 2
    assert r.exit_code == 1 and "line 1" in r.output
    r = run(cli, ["sim", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 1 and "no such file" in r.output
    bad = tmp_path / "bad.plan"
    bad.write_bytes(b"MOEPLAN" + b"\x00" * 3)
    r = run(cli, ["sim", str(bad)])
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit), r.output


def test_load_accesses_routes_plans(tmp_path, monkeypatch):
    import types
    import sys

    fake = types.ModuleType("moetrace.inputs.plan")
    want = single(A, 4)
    fake.read_accesses = lambda path: want
    monkeypatch.setitem(sys.modules, "moetrace.inputs.plan", fake)
    p = tmp_path / "x.bin"
    p.write_bytes(b"MOEPLAN\x01rest")
    assert load_accesses(p) is want
    with pytest.raises(InputError):
        load_accesses(tmp_path)


def test_help_lists_options():
    r = CliRunner().invoke(cli, ["sim", "--help"])
    assert r.exit_code == 0
    for opt in ("--policy", "--budgets", "--scope", "--global-budgets", "--static-table", "--warm-fraction",
                "--expert-bytes", "--geometry", "--json", "--plot"):
        assert opt in r.output


def test_plan_input_matches_trace(tiny_trace, tmp_path):
    plan = pytest.importorskip("moetrace.inputs.plan")
    if not hasattr(plan, "compile_plan"):
        pytest.skip("moetrace.inputs.plan has no compile_plan")
    out = tmp_path / "p.bin"
    plan.compile_plan([tiny_trace], out, expert_bytes=4096)
    assert is_plan(out) and not is_plan(tiny_trace)
    a, b = load_accesses(tiny_trace), load_accesses(out)
    assert sim.compute_sim(a, budgets=[2, 4])["hits"].tolist() == sim.compute_sim(b, budgets=[2, 4])["hits"].tolist()
    r = CliRunner().invoke(cli, ["sim", str(out), "--budgets", "2", "--policy", "lru", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["expert_bytes"] == 4096  # from the plan header
