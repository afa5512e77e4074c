"""Engine routing logs (JSON Lines, concurrent requests) and bad trace input.

The logs come from tests/common/engine_log.py, a generator that writes what a
vLLM routing hook writes and keeps the ground truth; every expected figure here
is computed from that ground truth, not by moetrace.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from common.engine_log import reuse, write_engine_log
from moetrace.cli import cli as main
from moetrace.errors import InputError
from moetrace.inputs import plan as P
from moetrace.inputs.importers import import_trace
from moetrace.inputs.trace import load_trace, parse_jsonl, type_records


def run(*args, ok=True):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    if ok:
        assert r.exit_code == 0, r.output
    else:
        assert r.exit_code in (1, 2), r.output
    return r


def _json(r) -> dict:
    out = r.stdout if hasattr(r, "stdout") else r.output
    return json.loads(out[out.index("{"):])


@pytest.fixture
def served(tmp_path):
    """5 concurrent requests of 80 decode tokens, layers 3 and 8 in one file each."""
    log = write_engine_log(tmp_path / "log", requests=5, decode_lens=[80] * 5)
    out = tmp_path / "trace.jsonl"
    r = run("trace", "import", *log.files, "-o", out, "--json")
    return log, out, _json(r)


def test_import_auto_says_what_it_dropped_and_where_requests_come_from(served):
    log, out, s = served
    assert s["format"] == "jsonl"
    assert s["requests"] == 5 and s["requests_from"] == "decode batch slot"
    assert s["steps"] == len(log.decode_passes) == 80
    assert s["layers"] == 2 and s["k"] == 4
    assert s["warmup_steps_dropped"] == log.warmup_passes
    assert s["warmup_rows_dropped"] == log.warmup_rows
    assert [b["reason"].split(" (")[0] for b in s["warmup"]["blocks"]] == [
        "96 rows of one identical route", "the route of an earlier warm-up pass"]
    assert s["prefill_excluded"] == log.prefill_rows
    assert s["accounting"]["accepted_tokens"] == 5 * 80
    assert s["accounting"]["layer_ids"] == [3, 8]
    assert any("req_id is '0' on every row" in n for n in s["notes"])
    assert s["meta"][str(log.files[0])]["model"] == "Qwen/Qwen1.5-MoE-A2.7B"
    # rank order as routed is kept in the canonical records
    first = json.loads(out.read_text().splitlines()[0])
    assert first["request"] == "s0.0" and first["experts"] == log.routes["req-0"][0][3]


def test_per_request_reuse_equals_an_independent_computation(served):
    log, out, _ = served
    s = _json(run("trace", "stats", out, "--json"))["traces"][0]
    summ = s["summary"]
    assert summ["requests"] == 5 and summ["tokens"] == 400
    for n in (1, 8, 64):
        h, sel = reuse(log.routes, n)
        assert summ[f"W{n}"] == pytest.approx(h / sel, abs=1e-12)
        for j, row in enumerate(s["per_request"]):
            assert row["request"] == f"s0.{j}"
            hh, ss = reuse({"x": log.routes[f"req-{j}"]}, n)
            assert row[f"W{n}"] == pytest.approx(hh / ss, abs=1e-12)
            assert row[f"W{n}_selections"] == ss
    # the pooled stream is reported under its own name, and reads the batch as one sequence
    stream = {"x": [tok for p, names in log.decode_passes for tok in
                    (log.routes[nm][log._token_of(p, nm)] for nm in names)]}
    for n in (1, 8, 64):
        h, sel = reuse(stream, n)
        assert summ[f"W{n}_stream"] == pytest.approx(h / sel, abs=1e-12)
    assert summ["W1_stream"] != summ["W1"]
    text = run("trace", "stats", out).output
    assert "of 5 requests" in text and "reuse, stream" in text


def test_plan_is_one_iteration_per_forward_pass_with_batch_unions(served, tmp_path):
    log, out, _ = served
    plan = tmp_path / "p.bin"
    h = _json(run("plan", "compile", out, "-o", plan, "--json"))
    assert h["iterations"] == len(log.decode_passes) and h["order"] == "rank"
    passes = list(P.iter_passes(plan))
    assert [p.step for p in passes] == [p for p, _ in log.decode_passes]
    for i, ps in enumerate(passes):
        want = log.batch_union(i)
        got = ps.by_layer()
        assert [set(x.tolist()) for x in got] == [want[3], want[8]]
        # rank order: an expert some request chose first precedes one chosen only second, ...
        pidx, names = log.decode_passes[i]
        for li, lay in enumerate((3, 8)):
            best = {}
            for nm in names:
                for r, e in enumerate(log.routes[nm][log._token_of(pidx, nm)][lay]):
                    best.setdefault(e, r)
                    best[e] = min(best[e], r)
            assert [best[e] for e in got[li].tolist()] == sorted(best[e] for e in got[li].tolist())
    # one request alone
    one = tmp_path / "one.bin"
    h1 = _json(run("plan", "compile", out, "-o", one, "--request", "s0.2", "--json"))
    assert h1["iterations"] == 80 and h1["accepted_tokens"] == 80 and h1["request"] == "s0.2"
    for t, ps in enumerate(P.iter_passes(one)):
        assert [x.tolist() for x in ps.by_layer()] == [log.routes["req-2"][t][3], log.routes["req-2"][t][8]]
    bad = run("plan", "compile", out, "-o", tmp_path / "x.bin", "--request", "nope", ok=False)
    assert "no request 'nope'" in bad.output and not (tmp_path / "x.bin").exists()


def test_sim_says_which_stream(served):
    _, out, _ = served
    batch = _json(run("sim", out, "--policy", "lru", "--budgets", "4", "--json"))
    assert batch["stream"].startswith("the batch stream") and batch["order"] == "rank"
    one = _json(run("sim", out, "--policy", "lru", "--budgets", "4", "--json", "--request", "s0.1",
                    "--order", "sorted"))
    assert one["stream"].startswith("request s0.1") and one["order"] == "sorted"
    assert one["rows"][0]["accesses"] < batch["rows"][0]["accesses"]


def test_one_file_with_all_layers_reads_like_per_layer_files(served, tmp_path):
    log, out, _ = served
    single = write_engine_log(tmp_path / "one", requests=5, decode_lens=[80] * 5, per_layer_files=False)
    assert len(single.files) == 1
    out2 = tmp_path / "t2.jsonl"
    run("trace", "import", single.files[0], "-o", out2)
    assert out2.read_text() == out.read_text()


def test_request_ids_from_the_log_and_a_late_arrival(tmp_path):
    log = write_engine_log(tmp_path / "log", requests=4, decode_lens=[70, 70, 70, 70], real_ids=True,
                           arrivals={3: 5}, seed=11)
    res = import_trace(log.files)
    assert res.stats["requests_from"] == "req_id"
    tt = type_records(res.records)
    assert sorted(tt.requests) == sorted(log.routes)
    assert tt.accounting["accepted_tokens"] == sum(len(v) for v in log.routes.values())
    tok = tt.tokens()
    from moetrace.analyses import locality as loc

    pr = loc.compute_request_reuse(tok, tt.n_experts, names=tt.requests).set_index("request")
    for name, toks in log.routes.items():
        h, sel = reuse({name: toks}, 8)
        assert pr.loc[name, "W8"] == pytest.approx(h / sel, abs=1e-12)
    # the late request's prompt came in its own prefill pass, excluded
    assert res.stats["prefill_excluded"] == log.prefill_rows


def test_a_batch_that_changes_starts_new_inferred_requests(tmp_path):
    log = write_engine_log(tmp_path / "log", requests=3, decode_lens=[30, 20, 30], seed=5)
    res = import_trace(log.files)
    # 3 slots for 20 passes, then 2 slots for 10: which one left is not in the log
    assert res.stats["segments"] == 2 and res.stats["segment_batch_sizes"] == [3, 2]
    tt = type_records(res.records)
    assert tt.requests == ["s0.0", "s0.1", "s0.2", "s1.0", "s1.1"]


def test_layers_are_the_ones_present(tmp_path):
    log = write_engine_log(tmp_path / "log", layers=(8,), requests=2, decode_lens=[20, 20])
    out = tmp_path / "t.jsonl"
    s = _json(run("trace", "import", *log.files, "-o", out, "--json"))
    assert s["layers"] == 1 and s["accounting"]["layer_ids"] == [8]
    st = _json(run("trace", "stats", out, "--json"))["traces"][0]
    assert st["n_layers"] == 1
    distinct = len({e for toks in log.routes.values() for t in toks for e in t[8]})
    assert st["summary"]["coverage"] == pytest.approx(distinct / 60)
    # --layers keeps the ids as they are
    assert parse_jsonl(out).n_layers == 1  # the canonical records keep the log's id 8
    kept = type_records(import_trace(log.files).records, n_layers=9)
    assert kept.n_layers == 9 and set(kept.table["layer"]) == {8}


def test_json_lines_errors_name_the_line(tmp_path):
    log = write_engine_log(tmp_path / "log", requests=2, decode_lens=[10, 10])
    f = log.files[0]
    lines = f.read_text().splitlines()
    lines[40] = lines[40][:-5]  # a truncated line
    f.write_text("\n".join(lines) + "\n")
    for fmt in ("auto", "vllm", "sglang", "jsonl"):
        r = run("trace", "import", "--format", fmt, *log.files, "-o", tmp_path / "x.jsonl", ok=False)
        assert f"{f}: line 41, offset " in r.output and ": JSON Lines: not a valid JSON line" in r.output, \
            (fmt, r.output)
        assert "Extra data" not in r.output
    assert not (tmp_path / "x.jsonl").exists()
    # a lost row
    log = write_engine_log(tmp_path / "log2", requests=2, decode_lens=[10, 10])
    f = log.files[1]
    lines = f.read_text().splitlines()
    del lines[200]
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"line 200: JSON Lines: forward pass 10 has 1 rows here but 2 rows in"):
        import_trace(log.files)
    # a row index out of sequence (in an intact log)
    log = write_engine_log(tmp_path / "log3", requests=2, decode_lens=[10, 10])
    f = log.files[1]
    lines = f.read_text().splitlines()
    row = json.loads(lines[205])
    row["token_idx"] += 3
    lines[205] = json.dumps(row)
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"line 206: JSON Lines: row \d+ of layer 8 where row \d+ was expected"):
        import_trace(log.files)
    # per-layer files of different runs
    a = write_engine_log(tmp_path / "a", layers=(1,), requests=2, decode_lens=[10, 10])
    b = write_engine_log(tmp_path / "b", layers=(2,), requests=2, decode_lens=[12, 12])
    with pytest.raises(InputError, match="forward passes but .* holds"):
        import_trace(a.files + b.files)


# --- bad input: typed errors with the right line ---------------------------------------------

def _write(p: Path, lines: list[str]) -> Path:
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize("big", ["3000000000", "100000000000000000000000"])
def test_huge_expert_ids_in_jsonl(tmp_path, big):
    p = _write(tmp_path / "t.jsonl", ['{"step": 0, "layer": 0, "experts": [1, 2]}',
                                      '{"step": 1, "layer": 0, "experts": [1, %s]}' % big])
    for args in (("trace", "parse", p), ("trace", "stats", p), ("sim", p), ("plan", "compile", p, "-o",
                                                                            tmp_path / "p.bin")):
        r = run(*args, ok=False)
        assert f"{p}: line 2" in r.output and "out of range" in r.output, (args, r.output)
        assert "OverflowError" not in r.output
    assert not (tmp_path / "p.bin").exists()


@pytest.mark.parametrize("big", ["3e9", "1e23", "3000000000", "100000000000000000000000"])
def test_huge_expert_ids_in_csv(tmp_path, big):
    p = _write(tmp_path / "t.csv", ["step,layer,expert", "0,0,1", "0,0,2", "1,0,1", f"1,0,{big}"])
    r = CliRunner().invoke(main, ["trace", "import", str(p), "-o", str(tmp_path / "o.jsonl")])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert f"{p}: line 5" in r.output and "out of range" in r.output, r.output
    assert "RuntimeWarning" not in r.output and "-9223372036854775808" not in r.output
    assert not (tmp_path / "o.jsonl").exists()


def test_a_stray_expert_id_warns_and_says_how_to_set_the_geometry(tmp_path):
    rows = [{"step": s, "layer": 0, "experts": [s % 7, 10]} for s in range(20)]
    rows[13]["experts"] = [3, 1000000]
    p = _write(tmp_path / "t.jsonl", [json.dumps(r) for r in rows])
    r = run("trace", "stats", p)
    assert "warning" in r.output and "expert id 1000000 (line 14)" in r.output
    assert "--experts N or --geometry PRESET" in r.output
    r = run("trace", "parse", p, "--experts", "60", ok=False)
    assert f"{p}: line 14" in r.output and "unknown expert 1000000 (the geometry has 60" in r.output


def test_experts_bound_names_the_offending_csv_row(tmp_path):
    lines = ["step,layer,expert"]
    for s in range(4):
        for e in (1, 2, 3, 4):
            lines.append(f"{s},0,{e}")
    lines[11] = "2,0,60"  # step 2's third row
    p = _write(tmp_path / "t.csv", lines)
    with pytest.raises(InputError) as ei:
        type_records(import_trace(p).records, n_experts=60, path=str(p))
    assert ei.value.line == 12
    r = run("trace", "import", p, "-o", tmp_path / "o.jsonl", "--experts", "60", ok=False)
    assert f"{p}: line 12" in r.output


def test_non_utf8_byte_deep_in_a_csv(tmp_path):
    p = tmp_path / "t.csv"
    body = ["step,layer,expert"] + [f"{i // 4},{0},{i % 4}" for i in range(40_000)]
    data = ("\n".join(body) + "\n").encode()
    # line 40,001 is the 40,000th row: break its expert digit
    lines = data.split(b"\n")
    lines[40_000] = lines[40_000][:-1] + b"\xff"
    p.write_bytes(b"\n".join(lines))
    r = run("trace", "import", p, "-o", tmp_path / "o.jsonl", ok=False)
    assert f"{p}: line 40001" in r.output and "not UTF-8" in r.output, r.output


def test_old_typed_parquet_still_loads(tmp_path):
    """Schema 1 typed tables (before requests) load as one request."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = _write(tmp_path / "t.jsonl", ['{"step": 0, "layer": 0, "experts": [1, 2]}',
                                      '{"step": 1, "layer": 0, "experts": [3, 1, 2, 4]}'])
    tt = parse_jsonl(p)
    old = tt.table.drop(columns=["request", "token"])
    meta = {"schema": "moetrace.typed_trace/1", "k": 2, "n_layers": 1, "n_experts": 5,
            "accounting": tt.accounting, "source": str(p)}
    tbl = pa.Table.from_pandas(old, preserve_index=False).replace_schema_metadata(
        {b"moetrace": json.dumps(meta).encode()})
    pq.write_table(tbl, tmp_path / "old.parquet")
    back = load_trace(tmp_path / "old.parquet")
    assert back.requests == ["0"]
    assert np.array_equal(back.table["token"].to_numpy(), tt.table["token"].to_numpy())


@pytest.mark.parametrize("real_ids", [False, True])
def test_streamed_import_of_engine_logs_equals_the_in_memory_one(tmp_path, monkeypatch, real_ids):
    """Above MOETRACE_STREAM_BYTES the logs are read twice, one forward pass at a time
    (first the warm-up, sizes and request fields, then the records), written as they
    come and validated chunk by chunk: the same output and summary as in memory."""
    log = write_engine_log(tmp_path / "log", requests=4, decode_lens=[30, 30, 20, 30], real_ids=real_ids,
                           arrivals={3: 4}, seed=2)
    outs = []
    for limit, name in ((str(1 << 40), "mem.jsonl"), ("0", "stream.jsonl")):
        monkeypatch.setenv("MOETRACE_STREAM_BYTES", limit)
        r = run("trace", "import", *log.files, "-o", tmp_path / name, "--json")
        outs.append(_json(r))
    assert (tmp_path / "mem.jsonl").read_text() == (tmp_path / "stream.jsonl").read_text()
    a, b = outs
    assert b["source"].endswith("streamed") and not a["source"].endswith("streamed")
    for key in ("records_written", "steps", "requests", "layers", "experts", "k", "warmup", "prefill_excluded",
                "rows_read", "requests_from", "segments", "max_batch", "forward_passes", "decode_passes"):
        assert a.get(key) == b.get(key), key
    acc_a = {k: v for k, v in a["accounting"].items() if k != "prefill_records_excluded"}
    assert acc_a == b["accounting"]
    assert not [f for f in tmp_path.iterdir() if ".tmp-" in f.name or f.name.endswith(".tmp")]


def test_a_plan_of_a_stray_id_is_refused_by_sim_before_it_allocates(tmp_path):
    """A stray expert id compiles to a plan of a huge pool; sim says so instead of allocating it."""
    rows = [{"step": s, "layer": 0, "experts": [s % 7, 10]} for s in range(20)]
    rows[13]["experts"] = [3, 2_000_000_000]
    p = _write(tmp_path / "t.jsonl", [json.dumps(r) for r in rows])
    run("plan", "compile", p, "-o", tmp_path / "p.bin")
    for args in (("sim", tmp_path / "p.bin"), ("sim", tmp_path / "p.bin", "--order", "sorted")):
        r = run(*args, ok=False)
        assert "too large to simulate" in r.output and "2,000,000,001 experts" in r.output, r.output
