"""Bounded-memory paths equal the in-memory references exactly.

The streaming typer (moetrace.inputs.stream), the streaming compiler
(plan.PlanWriter via compile_plan) and the streaming simulator
(moetrace.analyses.simstream) run here with tiny chunks, so every state that
crosses a chunk boundary is exercised, and are compared with type_records,
write_plan and compute_sim on the same input.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pandas as pd
import pytest

from moetrace.analyses.sim import compute_sim
from moetrace.analyses.simstream import compute_sim_stream
from moetrace.errors import InputError
from moetrace.inputs import plan as P
from moetrace.inputs import stream as S
from moetrace.inputs.accesses import load_accesses
from moetrace.inputs.trace import parse_jsonl


def gen_trace(path, seed, reqs=3, steps=50, L=3, E=12, k=2, spec=True, named=True, skip_layer=None):
    """Engine JSONL in engine order: requests join and leave steps, spec accepts
    (2k records) and failed speculations (a second, width-k pass of every layer)."""
    rng = random.Random(seed)
    if not named:
        reqs = 1
    out = []
    for s in range(steps):
        active = [r for r in range(reqs) if rng.random() < 0.8] or [0]
        kinds = {r: (rng.choice([0, 0, 1]) if spec else 0) for r in active}
        fb = {r for r in active if kinds[r] == 1 and rng.random() < 0.4}
        for lay in range(L):
            if lay == skip_layer:
                continue
            for r in active:
                d = {"step": s, "layer": lay,
                     "experts": rng.sample(range(E), k) + (rng.sample(range(E), k) if kinds[r] else [])}
                if named:
                    d["request"] = f"r{r}"
                out.append(d)
        for r in sorted(fb):
            for lay in range(L):
                if lay == skip_layer:
                    continue
                d = {"step": s, "layer": lay, "experts": rng.sample(range(E), k)}
                if named:
                    d["request"] = f"r{r}"
                out.append(d)
        if rng.random() < 0.1:
            out.append({"step": s, "layer": 0, "experts": [1, 2], "phase": "prefill"})
    path.write_text("".join(json.dumps(d) + "\n" for d in out))
    return path


def typed_stream(path, block=256):
    reqs: dict = {}
    g = S.scan_geometry(path, block)
    t = S.ChunkTyper(g.k, str(path))
    st: dict = {}
    tabs = []
    for c in S.read_chunks(path, block, reqs, st):
        t.names, t._named = list(reqs), st.get("named", False)
        tabs.append(t.type(c))
    return pd.concat(tabs, ignore_index=True), t, reqs


@pytest.mark.parametrize("seed", range(12))
def test_chunk_typer_equals_type_records(tmp_path, seed):
    p = gen_trace(tmp_path / "t.jsonl", seed, named=seed % 3 != 0, spec=seed % 4 != 1)
    ref = parse_jsonl(p)
    tab, typer, reqs = typed_stream(p)
    a = ref.table
    for c in a.columns:
        if c == "kind":
            assert np.array_equal(a[c].cat.codes, tab[c].cat.codes)
        else:
            assert np.array_equal(a[c].to_numpy(), tab[c].to_numpy()), c
    acc = typer.accounting(len(reqs))
    for key, v in acc.items():
        assert ref.accounting[key] == v, key
    assert list(reqs) == ref.requests


@pytest.mark.parametrize("mutation", ["width", "negative", "duplicate", "backwards", "short", "layer3x"])
def test_chunk_typer_reports_the_reference_error(tmp_path, mutation):
    p = gen_trace(tmp_path / "t.jsonl", 7)
    lines = p.read_text().splitlines()
    i = 97
    d = json.loads(lines[i])
    if mutation == "width":
        d["experts"] = d["experts"] + [11]
    elif mutation == "negative":
        d["experts"][0] = -3
    elif mutation == "duplicate":
        d["experts"][1] = d["experts"][0]
    elif mutation == "backwards":
        d["step"] = 0
    elif mutation == "short":
        d["experts"] = d["experts"][:1]
    else:
        lines.insert(i, json.dumps(d))
        lines.insert(i, json.dumps(d))
    if mutation != "layer3x":
        lines[i] = json.dumps(d)
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError) as ref:
        parse_jsonl(p)
    try:
        typed_stream(p)
    except InputError as e:
        assert str(e) == str(ref.value)
    except S._Fallback:
        pass  # the caller hands the file to the reference parser: the same error
    else:
        pytest.fail("the streaming typer accepted a bad trace")


@pytest.mark.parametrize("seed", range(6))
def test_streaming_compile_is_byte_identical(tmp_path, seed, monkeypatch):
    p = gen_trace(tmp_path / "t.jsonl", seed, named=seed % 2 == 0, skip_layer=1 if seed == 4 else None)
    monkeypatch.setattr(S, "DEFAULT_BLOCK_BYTES", 300)
    monkeypatch.setenv("MOETRACE_STREAM_BYTES", "0")
    adds = []
    orig = P.PlanWriter.add
    monkeypatch.setattr(P.PlanWriter, "add", lambda self, *a, **kw: (adds.append(1), orig(self, *a, **kw)))
    for order in ("rank", "sorted"):
        ref, out = tmp_path / f"ref-{order}.bin", tmp_path / f"s-{order}.bin"
        tt = parse_jsonl(p)
        P.compile_plan([tt], ref, order=order)
        h = P.compile_plan([p], out, order=order)  # one JSONL: the streaming compiler
        assert h.meta["sources"][0]["accounting"] == tt.accounting
        assert out.read_bytes() == ref.read_bytes()
    assert len(adds) > 8  # the streaming compiler wrote chunk by chunk (write_plan is one add)
    if seed % 2 == 0:
        ref, out = tmp_path / "ref-r1.bin", tmp_path / "s-r1.bin"
        P.compile_plan([parse_jsonl(p).select_request("r1")], ref)
        P.compile_plan([p], out, request="r1")
        a, b = P.read_accesses(ref), P.read_accesses(out)
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("iteration", "pass_", "layer", "expert"))
        assert P.read_header(ref).accepted_tokens == P.read_header(out).accepted_tokens
    assert not [f for f in tmp_path.iterdir() if ".tmp-" in f.name or f.name.endswith(".tmp")]


def test_streaming_compile_error_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRACE_STREAM_BYTES", "0")
    p = gen_trace(tmp_path / "t.jsonl", 3)
    lines = p.read_text().splitlines()
    d = json.loads(lines[-5])
    d["experts"] = [1, 2, 3]
    lines[-5] = json.dumps(d)
    p.write_text("\n".join(lines) + "\n")
    out = tmp_path / "p.bin"
    out.write_bytes(b"old plan")
    with pytest.raises(InputError, match=f"line {len(lines) - 4}"):
        P.compile_plan([p], out)
    assert out.read_bytes() == b"old plan"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["p.bin", "t.jsonl"]


@pytest.mark.parametrize("chunk", [97, 1000, 1 << 20])
def test_streaming_sim_equals_compute_sim(tmp_path, chunk):
    p = gen_trace(tmp_path / "t.jsonl", 5, steps=120, E=16)
    plan = tmp_path / "p.bin"
    P.compile_plan([p], plan)
    other = gen_trace(tmp_path / "o.jsonl", 9, steps=60, E=16)
    acc = load_accesses(plan)
    for table in ("oracle", "warm", load_accesses(other)):
        for wf in (0.0, 0.6):
            kw = dict(budgets=(1, 3, 8, 16), scopes=("per_layer", "global"), global_budgets=(2, 9, 40),
                      warm_fraction=wf, expert_bytes=4096, static_table=table)
            a = compute_sim(acc, **kw)
            b = compute_sim_stream(plan, chunk_reads=chunk, **kw)
            pd.testing.assert_frame_equal(a, b)
            assert a.attrs == b.attrs


@pytest.mark.parametrize("seed", range(4))
def test_streaming_stats_equal_the_in_memory_ones(tmp_path, seed, monkeypatch):
    from click.testing import CliRunner

    from moetrace.cli import cli

    from moetrace.analyses import locality as loc

    p = gen_trace(tmp_path / "t.jsonl", seed, steps=160, named=seed != 1, skip_layer=2 if seed == 3 else None)
    calls = []
    orig = loc.LocalityStream.add
    monkeypatch.setattr(loc.LocalityStream, "add", lambda self, t: (calls.append(len(t)), orig(self, t)))
    outs = []
    for limit in (str(1 << 40), "0"):  # in memory, then streamed
        monkeypatch.setenv("MOETRACE_STREAM_BYTES", limit)
        monkeypatch.setattr(S, "DEFAULT_BLOCK_BYTES", 700)
        r = CliRunner().invoke(cli, ["trace", "stats", str(p), "--json"])
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.output))
    assert outs[0] == outs[1]
    assert outs[0]["traces"][0]["summary"]["requests"] == (1 if seed == 1 else 3)
    # the second run did stream, in several chunks
    assert len(calls) > 3


@pytest.mark.parametrize("seed", range(3))
def test_streaming_parse_writes_the_same_typed_trace(tmp_path, seed, monkeypatch):
    from click.testing import CliRunner

    from moetrace.cli import cli
    from moetrace.inputs.trace import load_trace

    p = gen_trace(tmp_path / "t.jsonl", seed, steps=80, named=seed != 0)
    outs = []
    for limit, name in ((str(1 << 40), "mem.parquet"), ("0", "stream.parquet")):
        monkeypatch.setenv("MOETRACE_STREAM_BYTES", limit)
        monkeypatch.setattr(S, "DEFAULT_BLOCK_BYTES", 500)
        r = CliRunner().invoke(cli, ["trace", "parse", str(p), "-o", str(tmp_path / name), "--json"])
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.output))
    outs[0].pop("typed_table"), outs[1].pop("typed_table")
    assert outs[0] == outs[1]
    a, b = load_trace(tmp_path / "mem.parquet"), load_trace(tmp_path / "stream.parquet")
    pd.testing.assert_frame_equal(a.table, b.table)
    assert (a.k, a.n_layers, a.n_experts, a.accounting, a.requests) == (b.k, b.n_layers, b.n_experts,
                                                                        b.accounting, b.requests)
    assert not [f for f in tmp_path.iterdir() if ".tmp-" in f.name or f.name.endswith(".tmp")]


@pytest.mark.parametrize("keep", [False, True])
def test_streaming_import_writes_what_the_in_memory_import_writes(tmp_path, keep, monkeypatch):
    from click.testing import CliRunner

    from moetrace.cli import cli

    p = gen_trace(tmp_path / "t.jsonl", 4)
    lines = p.read_text().splitlines()
    warm = [json.dumps({"step": s, "layer": lay, "experts": [1, 2], "request": "r0"})
            for s in range(-30, -5) for lay in range(3)]
    p.write_text("\n".join(warm + lines) + "\n")
    outs = []
    for limit, name in ((str(1 << 40), "mem.jsonl"), ("0", "stream.jsonl")):
        monkeypatch.setenv("MOETRACE_STREAM_BYTES", limit)
        monkeypatch.setattr(S, "DEFAULT_BLOCK_BYTES", 500)
        args = ["trace", "import", str(p), "-o", str(tmp_path / name), "--json"] + (["--keep-warmup"] if keep else [])
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.output[r.output.index("{"):]))
    assert (tmp_path / "mem.jsonl").read_text() == (tmp_path / "stream.jsonl").read_text()
    a, b = outs
    assert b["source"] == "engine JSONL (streamed)"
    for key in ("records_written", "steps", "requests", "layers", "experts", "k", "warmup_steps_dropped"):
        assert a[key] == b[key], key
    assert a["warmup_steps_dropped"] == (0 if keep else 25)
