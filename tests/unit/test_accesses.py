"""moetrace.inputs.accesses: the one loader of an access stream from a trace or a plan."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moetrace.errors import InputError, UsageError
from moetrace.inputs import plan as P
from moetrace.inputs.accesses import is_plan, load_accesses, plan_expert_bytes, stream_sentence
from moetrace.inputs.trace import write_jsonl


@pytest.fixture
def trace(tmp_path):
    rng = np.random.default_rng(5)
    recs = [(s, layer, rng.choice(6, size=2, replace=False).tolist()) for s in range(9) for layer in range(3)]
    p = tmp_path / "t.jsonl"
    write_jsonl(recs, p)
    return p, recs


def test_a_trace_loads_its_stream_in_rank_order_with_the_stream_named(trace):
    path, recs = trace
    info: dict = {}
    acc = load_accesses(path, info=info)
    assert (acc.n_layers, acc.n_experts, acc.n_iterations, len(acc)) == (3, 6, 9, 54)
    assert acc.order == "rank"
    # rank order keeps each record's experts as routed
    first = [e for _, _, ex in recs[:3] for e in ex]
    assert acc.expert[:6].tolist() == first
    assert info == {"stream": "one request", "order": "rank", "requests": 1}
    srt = load_accesses(path, order="sorted")
    assert srt.expert[:6].tolist() == [e for _, _, ex in recs[:3] for e in sorted(ex)]


def test_a_plan_loads_the_same_stream_and_its_header_facts(trace, tmp_path):
    path, _ = trace
    out = tmp_path / "p.bin"
    P.compile_plan([path], out, expert_bytes=4096, order="rank")
    assert is_plan(out) and not is_plan(path)
    assert plan_expert_bytes(out) == 4096 and plan_expert_bytes(path) is None
    a, b = load_accesses(path), load_accesses(out)
    for col in ("iteration", "layer", "expert"):
        assert getattr(a, col).tolist() == getattr(b, col).tolist()
    info: dict = {}
    load_accesses(out, info=info)
    assert info == {"stream": "the plan's stream (as compiled)", "order": "rank"}
    # a rank plan can be read sorted; a sorted plan cannot give rank order back
    assert load_accesses(out, order="sorted").expert[:2].tolist() == sorted(b.expert[:2].tolist())
    srt = tmp_path / "s.bin"
    P.compile_plan([path], srt, order="sorted")
    with pytest.raises(UsageError, match="--order rank"):
        load_accesses(srt, order="rank")
    with pytest.raises(UsageError, match="needs a trace"):
        load_accesses(out, request="r0")


def test_errors_name_the_file(tmp_path):
    with pytest.raises(InputError, match="no such file") as e:
        load_accesses(tmp_path / "absent.jsonl")
    assert "absent.jsonl" in e.value.format_message()
    with pytest.raises(InputError, match="is a directory"):
        load_accesses(tmp_path)
    with pytest.raises(InputError, match="cannot read"):
        is_plan(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"step": 0, "layer": 0, "experts": [1, 2]}) + "\nnot json\n")
    with pytest.raises(InputError, match="line 2"):
        load_accesses(bad)


def test_stream_sentence():
    assert stream_sentence("r1", 7, 3) == "request r1 alone (7 forward passes)"
    assert stream_sentence(None, 7, 3) == "the batch stream: per forward pass the union of 3 requests' experts"
    assert stream_sentence(None, 7, 1) == "one request"
