"""plan.bin: compile, round-trip, merge, hints, inspect, corruption, CLI (no-kernel tier)."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moetrace.inputs import plan as P
from moetrace.cli import cli
from moetrace.errors import InputError, PlanFormatError, UsageError
from moetrace.inputs.geometry import Geometry
from moetrace.inputs.trace import Accesses, merge_accesses, parse_jsonl, write_jsonl

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "plan_v1_small.bin"

# 3 layers x 8 experts, k=2; steps 10 normal, 11 spec_accept, 12 failed speculation + fallback, 13 normal
SMALL = [
    (10, 0, [1, 2]), (10, 1, [3, 4]), (10, 2, [0, 5]),
    (11, 0, [1, 2, 2, 6]), (11, 1, [7, 3, 3, 0]), (11, 2, [5, 4, 1, 2]),
    (12, 0, [0, 1, 2, 3]), (12, 1, [4, 5, 6, 7]), (12, 2, [1, 3, 5, 7]),
    (12, 0, [6, 7]), (12, 1, [2, 3]), (12, 2, [0, 4]),
    (13, 0, [3, 5]), (13, 1, [1, 6]), (13, 2, [2, 7]),
]
SMALL_ACCEPTED = 1 + 2 + 1 + 1


def eq_accesses(a: Accesses, b: Accesses) -> bool:
    return (a.n_layers, a.n_experts, a.n_iterations) == (b.n_layers, b.n_experts, b.n_iterations) and all(
        np.array_equal(getattr(a, f), getattr(b, f)) for f in ("iteration", "pass_", "layer", "expert"))


@pytest.fixture
def small(tmp_path) -> Path:
    p = tmp_path / "small.jsonl"
    write_jsonl(SMALL, p)
    return p


@pytest.fixture
def small_plan(tmp_path, small) -> Path:
    out = tmp_path / "small.bin"
    P.compile_plan([small], out, hints="oracle", expert_bytes=1000)
    return out


# --- round trip ------------------------------------------------------------------

def test_round_trip_small(tmp_path, small):
    out = tmp_path / "p.bin"
    h = P.compile_plan([small], out)
    tt = parse_jsonl(small)
    assert eq_accesses(P.read_accesses(out), tt.accesses())
    assert (h.n_layers, h.n_experts, h.k, h.n_iterations, h.n_passes) == (3, 8, 2, 4, 5)
    assert h.accepted_tokens == SMALL_ACCEPTED == tt.accounting["accepted_tokens"]
    assert not h.has_hints and h.n_hints == 0
    steps = [ps.step for ps in P.iter_passes(out)]
    assert steps == [10, 11, 12, 12, 13]


def test_round_trip_request_300(tmp_path):
    out = tmp_path / "p.bin"
    h = P.compile_plan([DATA / "request_300.jsonl"], out)
    assert h.accepted_tokens == 299
    assert eq_accesses(P.read_accesses(out), parse_jsonl(DATA / "request_300.jsonl").accesses())


def test_iter_passes_layout(small_plan):
    passes = list(P.iter_passes(small_plan))
    assert [(p.iteration, p.pass_index) for p in passes] == [(0, 0), (1, 0), (2, 0), (2, 1), (3, 0)]
    assert [sorted(x.tolist()) for x in passes[1].by_layer()] == [[1, 2, 6], [0, 3, 7], [1, 2, 4, 5]]
    assert passes[3].counts.tolist() == [2, 2, 2]
    assert passes[0].experts.dtype == np.dtype("<u2")


def test_streaming_small_spans_matches(monkeypatch, tmp_path):
    """Force tiny read spans and index chunks: the streamed result must not change."""
    out = tmp_path / "p.bin"
    P.compile_plan([DATA / "request_300.jsonl"], out, hints="oracle")
    ref = P.inspect_plan(out)
    full = P.read_accesses(out)
    monkeypatch.setattr(P, "_SPAN_BYTES", 64)
    monkeypatch.setattr(P, "_INDEX_CHUNK", 7)
    assert eq_accesses(P.read_accesses(out), full)
    assert P.inspect_plan(out) == ref


def test_read_iteration_random_access(tmp_path):
    out = tmp_path / "p.bin"
    P.compile_plan([DATA / "request_300.jsonl"], out)
    allp = list(P.iter_passes(out))
    with P.open_plan(out) as r:
        for i in (0, 17, r.header.n_iterations - 1):
            got = r.read_iteration(i)
            want = [p for p in allp if p.iteration == i]
            assert [g.experts.tolist() for g in got] == [w.experts.tolist() for w in want]
        with pytest.raises(UsageError):
            r.read_iteration(r.header.n_iterations)


def test_write_plan_uint32_ids_and_empty_iterations(tmp_path):
    E = 70_000
    acc = Accesses(np.array([0, 0, 2, 2], np.int32), np.zeros(4, np.int8), np.array([0, 1, 0, 1], np.int16),
                   np.array([5, 69_999, 0, 65_536], np.int32), 2, E, 4)
    out = tmp_path / "big.bin"
    h = P.write_plan(out, acc, Geometry(2, E, 1, 0))
    assert h.id_bytes == 4 and h.n_iterations == 4 and h.n_passes == 2
    assert eq_accesses(P.read_accesses(out), acc)


def test_write_plan_rejects_non_canonical(tmp_path):
    acc = Accesses(np.array([0, 0], np.int32), np.zeros(2, np.int8), np.zeros(2, np.int16),
                   np.array([3, 1], np.int32), 1, 8, 1)
    with pytest.raises(UsageError, match="canonical"):
        P.write_plan(tmp_path / "x.bin", acc, Geometry(1, 8, 1))
    assert not list(tmp_path.iterdir())


# --- merged traces -----------------------------------------------------------------

def test_merged_truncates_to_shortest(tmp_path, small):
    other = tmp_path / "other.jsonl"
    # 3 steps: normal, spec_accept, normal -> merged window = 3 iterations
    write_jsonl([(0, 0, [7, 6]), (0, 1, [5, 4]), (0, 2, [3, 2]),
                 (1, 0, [0, 1, 2, 3]), (1, 1, [0, 1, 2, 3]), (1, 2, [6, 7, 0, 1]),
                 (2, 0, [1, 2]), (2, 1, [1, 2]), (2, 2, [1, 2])], other)
    out = tmp_path / "m.bin"
    h = P.compile_plan([small, other], out)
    want = merge_accesses([parse_jsonl(small).accesses(), parse_jsonl(other).accesses()])
    assert want.n_iterations == 3
    assert eq_accesses(P.read_accesses(out), want)
    # small's first 3 steps: 1 + 2 + 1; other: 1 + 2 + 1
    assert h.accepted_tokens == 8
    assert h.n_inputs == 2
    assert [p.step for p in P.iter_passes(out)] == [10, 11, 12, 12]  # step numbers of the first input
    # iteration 0, layer 0: {1, 2} | {6, 7}, in rank order: the first choices of both, then the second
    first = next(iter(P.iter_passes(out)))
    assert first.by_layer()[0].tolist() == [1, 7, 2, 6]


# --- hints -------------------------------------------------------------------------

def test_oracle_hints_semantics_and_recall(small_plan):
    passes = list(P.iter_passes(small_plan))
    for a, p in enumerate(passes):
        sets = p.by_layer()
        hints = p.hints_by_layer()
        assert [h.tolist() for h in hints[:-1]] == [s.tolist() for s in sets[1:]]
        # the last layer hints the first layer of the next pass (nothing after the last pass)
        nxt = passes[a + 1].by_layer()[0].tolist() if a + 1 < len(passes) else []
        assert hints[-1].tolist() == nxt
    s = P.inspect_plan(small_plan)
    assert s["hint_recall"] == 1.0 and s["hint_precision"] == 1.0
    assert s["hint_source"] == "oracle"
    # every read except the first slot's is hinted
    assert s["hint_count"] == s["reads"] - 2


def test_oracle_recall_request_300(tmp_path):
    out = tmp_path / "p.bin"
    P.compile_plan([DATA / "request_300.jsonl"], out, hints="oracle")
    s = P.inspect_plan(out)
    assert s["hint_recall"] == 1.0 and s["fallback_passes"] == 19


def test_predictor_hints(tmp_path, small):
    pred = tmp_path / "pred.jsonl"
    # predictions for step 10 layer 1 (2 of actual {3,4} + a wrong one), step 11 layer 0 (all of {1,2,6}),
    # a layer-0 prediction for step 10 (no issuer: dropped), one for an unknown step (counted)
    write_jsonl([(10, 0, [1]), (10, 1, [3, 4, 0]), (11, 0, [1, 2, 6]), (99, 0, [1])], pred)
    out = tmp_path / "h.bin"
    h = P.compile_plan([small], out, hints_from=pred)
    assert h.hint_source == "predictor" and h.n_hints == 6
    st = h.meta["hints"]
    assert st["records_unmatched_step"] == 1 and st["dropped"] == 1
    first = next(iter(P.iter_passes(out)))
    assert [x.tolist() for x in first.hints_by_layer()] == [[0, 3, 4], [], [1, 2, 6]]
    s = P.inspect_plan(out)
    hits = 2 + 3
    assert s["hint_recall"] == pytest.approx(hits / (s["reads"] - 2))
    assert s["hint_precision"] == pytest.approx(hits / 6)


def test_predictor_bad_expert_names_line(tmp_path, small):
    pred = tmp_path / "pred.jsonl"
    write_jsonl([(10, 1, [3]), (10, 2, [8])], pred)
    with pytest.raises(InputError, match="line 2"):
        P.compile_plan([small], tmp_path / "h.bin", hints_from=pred)
    assert not (tmp_path / "h.bin").exists()


def _random_accesses(rng, L, E, n_it):
    """Random canonical accesses with partial fallback passes and empty layers."""
    its, pss, lays, exs = [], [], [], []
    for i in range(n_it):
        for p in ((0, 1) if rng.random() < 0.3 else (0,)):
            for lay in range(L):
                if rng.random() < (0.2 if p else 0.1):
                    continue
                ex = np.sort(rng.choice(E, size=int(rng.integers(1, E + 1)), replace=False))
                its += [i] * ex.size
                pss += [p] * ex.size
                lays += [lay] * ex.size
                exs += ex.tolist()
    return Accesses(np.array(its, np.int32), np.array(pss, np.int8), np.array(lays, np.int16),
                    np.array(exs, np.int32), L, E, n_it)


def _brute_recall(acc, pred):
    """Reference: slots in replay order; hint of slot s = prediction for the next non-empty slot."""
    sets, preds = {}, {}
    for i, p, lay, e in zip(acc.iteration, acc.pass_, acc.layer, acc.expert):
        sets.setdefault((int(i), int(p), int(lay)), set()).add(int(e))
    for i, p, lay, e in zip(pred.iteration, pred.pass_, pred.layer, pred.expert):
        preds.setdefault((int(i), int(p), int(lay)), set()).add(int(e))
    order = sorted(sets)
    hits = sum(len(preds.get(t, set()) & sets[t]) for t in order[1:])
    hinted = sum(len(preds.get(t, set())) for t in order[1:])
    targets = sum(len(sets[t]) for t in order[1:])
    return hits, hinted, targets


@pytest.mark.parametrize("seed", range(6))
def test_random_round_trip_and_recall(tmp_path, seed):
    rng = np.random.default_rng(seed)
    L, E, n_it = int(rng.integers(1, 5)), int(rng.integers(2, 9)), int(rng.integers(1, 12))
    acc = _random_accesses(rng, L, E, n_it)
    pred = _random_accesses(rng, L, E, n_it)
    geo = Geometry(L, E, 1)
    out = tmp_path / "r.bin"
    P.write_plan(out, acc, geo, hints=acc, hint_source="oracle")
    assert eq_accesses(P.read_accesses(out), acc)
    s = P.inspect_plan(out)
    if len(acc) > 0 and s["hint_count"]:
        assert s["hint_recall"] == 1.0 and s["hint_precision"] == 1.0
    h = P.write_plan(out, acc, geo, hints=pred)
    hits, hinted, targets = _brute_recall(acc, pred)
    s = P.inspect_plan(out)
    assert h.n_hints == hinted == s["hint_count"]
    assert s["hint_recall"] == (hits / targets if targets else None)
    assert s["hint_precision"] == (hits / hinted if hinted else None)


# --- inspect -----------------------------------------------------------------------

def test_inspect_json_fields(small_plan):
    r = CliRunner().invoke(cli, ["plan", "inspect", str(small_plan), "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert s["geometry"] == {"name": "custom", "n_layers": 3, "n_experts": 8, "k": 2, "expert_bytes": 1000}
    tt = parse_jsonl_small()
    n = len(tt.accesses())
    assert (s["iterations"], s["passes"], s["fallback_passes"], s["reads"]) == (4, 5, 1, n)
    assert s["logical_bytes"] == n * 1000
    assert s["accepted_tokens"] == SMALL_ACCEPTED
    assert s["hint_count"] == n - 2 and s["hint_recall"] == 1.0
    assert s["format_version"] == "1.1" and s["verified"] is True
    assert s["file_bytes"] == os.path.getsize(small_plan)


def parse_jsonl_small():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "s.jsonl"
        write_jsonl(SMALL, p)
        return parse_jsonl(p)


def test_inspect_text_no_hints(tmp_path, small):
    out = tmp_path / "p.bin"
    P.compile_plan([small], out)
    r = CliRunner().invoke(cli, ["plan", "inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "hints            none" in r.output or "none" in r.output.splitlines()[-2]
    assert "unknown (no expert bytes)" in r.output
    s = P.inspect_plan(out)
    assert s["hint_count"] is None and s["hint_recall"] is None and s["logical_bytes"] is None


# --- corruption --------------------------------------------------------------------

def _corrupt(path: Path, offset: int) -> None:
    b = bytearray(path.read_bytes())
    b[offset] ^= 0x5A
    path.write_bytes(bytes(b))


@pytest.fixture
def big_plan(tmp_path) -> Path:
    out = tmp_path / "r.bin"
    P.compile_plan([DATA / "request_300.jsonl"], out, hints="oracle")
    return out


def test_flip_byte_in_middle_is_checksum_error_with_offset(big_plan):
    h = P.read_header(big_plan)
    mid = os.path.getsize(big_plan) // 2
    assert mid > h.blocks_offset
    block_starts = [p.offset for p in P.iter_passes(big_plan)]
    _corrupt(big_plan, mid)
    P.read_header(big_plan)  # header and index are intact
    with pytest.raises(PlanFormatError, match="checksum mismatch") as e:
        P.verify_plan(big_plan)
    off = e.value.offset
    assert off is not None and off <= mid and f"offset {off}" in str(e.value.message)
    # the named block is the one holding the flipped byte
    assert off == max(b for b in block_starts if b <= mid)
    with pytest.raises(PlanFormatError):
        P.read_accesses(big_plan)
    r = CliRunner().invoke(cli, ["plan", "inspect", str(big_plan)])
    assert r.exit_code == 1 and "checksum mismatch" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("where", ["header", "meta", "index"])
def test_flip_byte_in_header_meta_index(big_plan, where):
    h = P.read_header(big_plan)
    off = {"header": 50, "meta": h.meta_offset + 3, "index": h.index_offset + 40}[where]
    _corrupt(big_plan, off)
    with pytest.raises(PlanFormatError, match="checksum mismatch") as e:
        P.read_header(big_plan)
    assert e.value.offset is not None


@pytest.mark.parametrize("frac", [0.3, 0.999])
def test_truncated_blocks(big_plan, frac):
    size = os.path.getsize(big_plan)
    cut = int(size * frac)
    with open(big_plan, "r+b") as fh:
        fh.truncate(cut)
    with pytest.raises(PlanFormatError, match="truncated") as e:
        list(P.iter_passes(big_plan))
    assert e.value.offset == cut and f"offset {cut}" in e.value.message


@pytest.mark.parametrize("cut", [0, 5, 100, 170])
def test_truncated_header_and_meta(big_plan, cut):
    with open(big_plan, "r+b") as fh:
        fh.truncate(cut)
    with pytest.raises(PlanFormatError, match="truncated") as e:
        P.read_header(big_plan)
    assert e.value.offset == cut


def test_bad_magic(big_plan):
    b = bytearray(big_plan.read_bytes())
    b[:8] = b"NOTAPLAN"
    big_plan.write_bytes(bytes(b))
    with pytest.raises(PlanFormatError, match="bad magic") as e:
        P.read_header(big_plan)
    assert e.value.offset == 0


def test_jsonl_is_not_a_plan():
    with pytest.raises(PlanFormatError, match="bad magic"):
        P.read_header(DATA / "request_300.jsonl")


def test_future_major_version(big_plan):
    b = bytearray(big_plan.read_bytes())
    struct.pack_into("<HH", b, 8, 2, 0)
    big_plan.write_bytes(bytes(b))
    with pytest.raises(PlanFormatError, match="unknown plan format version 2.0") as e:
        P.read_header(big_plan)
    assert e.value.offset == 8


def test_future_minor_version_is_read(big_plan):
    b = bytearray(big_plan.read_bytes())
    struct.pack_into("<HH", b, 8, 1, 7)
    struct.pack_into("<I", b, 156, zlib.crc32(bytes(b[:156])))
    big_plan.write_bytes(bytes(b))
    assert P.read_header(big_plan).version == (1, 7)
    P.verify_plan(big_plan)


def test_trailing_garbage(big_plan):
    with open(big_plan, "ab") as fh:
        fh.write(b"xx")
    with pytest.raises(PlanFormatError, match="unexpected bytes"):
        P.read_header(big_plan)


def test_golden_v1_plan_still_reads():
    """A plan written by format 1.0 (tests/data/plan_v1_small.bin) must stay readable."""
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN} is missing: regenerate with `python tests/unit/test_plan.py`")
    s = P.inspect_plan(GOLDEN)
    assert (s["iterations"], s["passes"], s["reads"], s["hint_recall"], s["accepted_tokens"]) == \
        (4, 5, len(parse_jsonl_small().accesses()), 1.0, SMALL_ACCEPTED)
    assert eq_accesses(P.read_accesses(GOLDEN), parse_jsonl_small().accesses(order="sorted"))


# --- atomic writes -----------------------------------------------------------------

def test_failed_write_leaves_old_plan_and_no_temp(tmp_path, small, monkeypatch):
    out = tmp_path / "plan.bin"
    P.compile_plan([small], out)
    before = out.read_bytes()

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(P.os, "fsync", boom)
    with pytest.raises(InputError, match="No space left"):
        P.compile_plan([small], out, hints="oracle")
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.bin", "small.jsonl"]


# --- CLI ---------------------------------------------------------------------------

def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_cli_compile_and_inspect(tmp_path, small):
    out = tmp_path / "p.bin"
    r = run("plan", "compile", small, "-o", out, "--hints", "oracle", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert s["reads"] == len(parse_jsonl(small).accesses()) and s["hint_source"] == "oracle"
    r = run("plan", "inspect", out)
    assert r.exit_code == 0 and "recall 1.000" in r.output


def test_cli_preset_k_mismatch_is_clean_error(tmp_path, small):
    r = run("plan", "compile", small, "-o", tmp_path / "p.bin", "--geometry", "olmoe")
    assert r.exit_code == 1, r.output
    assert "neither k=8" in r.output and "line 1" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "p.bin").exists()


def test_cli_preset_with_overrides(tmp_path, small):
    out = tmp_path / "p.bin"
    r = run("plan", "compile", small, "-o", out, "--geometry", "olmoe", "--k", "2", "--layers", "3",
            "--experts", "8")
    assert r.exit_code == 0, r.output
    h = P.read_header(out)
    assert (h.n_layers, h.n_experts, h.k, h.expert_bytes) == (3, 8, 2, 12_582_912)
    out2 = tmp_path / "q.bin"
    r = run("plan", "compile", small, "-o", out2, "--geometry", "olmoe", "--k", "2", "--expert-bytes", "4KiB")
    assert r.exit_code == 0, r.output
    h = P.read_header(out2)
    assert (h.n_layers, h.n_experts, h.expert_bytes) == (16, 64, 4096)
    assert h.geometry.name == "custom"


@pytest.mark.parametrize("args, code, text", [
    (["--k", "0"], 2, "--k"),
    (["--layers", "0"], 2, "--layers"),
    (["--k", "3"], 1, "neither k=3"),
    (["--layers", "2"], 1, "unknown layer 2"),
    (["--experts", "6"], 1, "unknown expert"),
    (["--k", "9", "--experts", "8"], 2, "exceeds"),
    (["--geometry", "nope"], 2, "unknown geometry preset"),
    (["--hints", "oracle", "--hints-from", "x.jsonl"], 2, "exclusive"),
    (["--expert-bytes", "lots"], 2, "cannot read a size"),
])
def test_cli_validation_errors_are_clean(tmp_path, small, args, code, text):
    r = run("plan", "compile", small, "-o", tmp_path / "p.bin", *args)
    assert r.exit_code == code, r.output
    assert text in r.output and "Traceback" not in r.output
    assert not (tmp_path / "p.bin").exists()


def test_cli_k_larger_than_experts_is_usage_error(tmp_path):
    t = tmp_path / "w.jsonl"
    write_jsonl([(0, 0, [0, 1, 2])], t)
    r = run("plan", "compile", t, "-o", tmp_path / "p.bin", "--experts", "2", "--k", "3")
    assert r.exit_code in (1, 2) and "Traceback" not in r.output, r.output
    assert isinstance(r.exception, SystemExit)


def test_cli_parquet_input(tmp_path, small):
    pq = tmp_path / "typed.parquet"
    tt = parse_jsonl(small)
    tt.save(pq)
    out = tmp_path / "p.bin"
    r = run("plan", "compile", pq, "-o", out)
    assert r.exit_code == 0, r.output
    assert eq_accesses(P.read_accesses(out), tt.accesses())
    assert P.read_header(out).accepted_tokens == SMALL_ACCEPTED
    r = run("plan", "compile", pq, "-o", out, "--k", "3")
    assert r.exit_code == 1 and "k=2" in r.output
    r = run("plan", "compile", pq, "-o", out, "--layers", "2")
    assert r.exit_code == 1 and "unknown layer 2" in r.output


def test_cli_missing_input_and_corrupt_plan(tmp_path):
    r = run("plan", "compile", tmp_path / "nope.jsonl", "-o", tmp_path / "p.bin")
    assert r.exit_code == 1 and "no such file" in r.output
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"MOETPLAN")
    r = run("plan", "inspect", bad)
    assert r.exit_code == 1 and "truncated header" in r.output


@pytest.mark.parametrize("cmd", [["plan"], ["plan", "compile"], ["plan", "inspect"]])
def test_help(cmd):
    r = run(*cmd, "--help")
    assert r.exit_code == 0 and "Usage:" in r.output


if __name__ == "__main__":  # regenerate the golden plan (format 1.0)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "small.jsonl"
        write_jsonl(SMALL, src)
        P.compile_plan([src], GOLDEN, hints="oracle", expert_bytes=1000)
    print(f"wrote {GOLDEN}")
