"""The commands' library functions, reachable as ``moetrace.<name>`` the way ``open_run`` is: each
gives what its command prints (--json), so an API user needs no command (no kernel)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import moetrace
from moetrace.cli import cli
from moetrace.inputs.trace import write_jsonl

from conftest import COUNTS_FILE
from unit.test_features import make_tree

EXPORTS = ("open_run", "open_sweep", "sim", "trace_stats", "counts_stats", "doctor")


def command_json(*args) -> dict:
    r = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def same(doc) -> dict:
    """A document as the command prints it (numpy scalars and NaN the way --json writes them)."""
    from moetrace.jsonutil import json_default

    return json.loads(json.dumps(doc, default=json_default))


@pytest.fixture
def traces(tmp_path):
    out = []
    for seed in (3, 4):
        rng = np.random.default_rng(seed)
        recs = [(s, layer, sorted(rng.choice(8, size=2, replace=False).tolist()))
                for s in range(30) for layer in range(2)]
        p = tmp_path / f"t{seed}.jsonl"
        write_jsonl(recs, p)
        out.append(p)
    return out


def test_every_export_is_documented_and_import_moetrace_stays_light():
    for name in EXPORTS:
        f = getattr(moetrace, name)
        assert callable(f) and f.__doc__, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        moetrace.nope  # noqa: B018
    code = "import sys, moetrace; print(sorted(m for m in ('pandas', 'numpy', 'click') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


def test_sim_is_what_the_command_prints(traces, tmp_path):
    t = traces[0]
    res = moetrace.sim(t, policies="lru,static,belady", budgets=[2, 4], scope="both", static_table=str(traces[1]))
    assert same(res.to_dict()) == command_json("sim", t, "--policy", "lru,static,belady", "--budgets", "2,4",
                                               "--scope", "both", "--static-table", traces[1], "--json")
    assert list(res.table["policy"].unique()) == ["lru", "static", "belady"]
    # a plan is streamed: the same rows as the command, and as the trace it was compiled from
    from moetrace.inputs.plan import compile_plan

    plan = tmp_path / "p.bin"
    compile_plan([str(t)], str(plan))
    doc = same(moetrace.sim(plan, budgets="2,4").to_dict())
    assert doc == command_json("sim", plan, "--budgets", "2,4", "--json")
    assert [r["hit_rate"] for r in doc["rows"]] == [r["hit_rate"] for r in
                                                    same(moetrace.sim(t, budgets="2,4").to_dict())["rows"]]


def test_sim_refuses_what_the_command_refuses(traces, tmp_path):
    from moetrace.errors import UsageError
    from moetrace.inputs.plan import compile_plan

    with pytest.raises(UsageError, match="--global-budgets needs --scope global or both"):
        moetrace.sim(traces[0], global_budgets=[4], scope="per-layer")
    plan = tmp_path / "p.bin"
    compile_plan([str(traces[0])], str(plan))
    for order in (None, "sorted"):  # the plan streamed, or re-ordered in memory: one check
        with pytest.raises(UsageError, match="is 2x8 but --geometry olmoe is 16x64"):
            moetrace.sim(plan, geometry="olmoe", order=order)


def test_trace_stats_is_what_the_command_prints(traces):
    st = moetrace.trace_stats(traces, top_n=2)
    assert same(st.to_dict()) == command_json("trace", "stats", *traces, "--top-n", 2, "--json")
    assert [r["trace"] for r in st.traces] == ["t3.jsonl", "t4.jsonl"] and len(st.jaccard) == 1  # one pair
    cs = moetrace.counts_stats(COUNTS_FILE)
    assert same(cs.to_dict()) == command_json("trace", "stats", "--counts", COUNTS_FILE, "--json")


def test_doctor_is_what_the_command_prints(tmp_path):
    root = str(make_tree(tmp_path))
    assert same(moetrace.doctor(root)) == command_json("doctor", "--json", "--root", root)
    probes = moetrace.doctor(root, probes_only=True)
    assert probes == command_json("doctor", "--json", "--root", root, "--probes-only")
    assert {r["section"] for r in probes["rows"]} <= {"probe", "attach", "background"}
