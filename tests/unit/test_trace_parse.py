"""The canonical typed parser: exact accounting and located errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from moetrace.cli import cli
from moetrace.errors import InputError
from moetrace.inputs.trace import load_trace, merge_accesses, parse_jsonl, write_jsonl


def write(tmp_path, lines, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines if isinstance(lines[0], str) else map(json.dumps, lines)) + "\n")
    return p


def test_request_300_gives_299_accepted_tokens(data_dir):
    tt = parse_jsonl(data_dir / "request_300.jsonl")
    a = tt.accounting
    assert a["accepted_tokens"] == 299
    assert a["steps_by_kind"] == {"normal": 200, "spec_accept": 40, "spec_fallback": 19}
    assert a["records_by_kind"] == {"normal": 800, "spec_accept": 160, "spec_fallback": 19 * 8}
    assert a["prefill_records_excluded"] == 4
    assert a["steps"] == 259 and a["passes"] == 259 + 19
    assert tt.k == 8 and tt.n_layers == 4
    # every accepted token has exactly one k-set per layer
    tok = tt.tokens()
    assert tok["token"].nunique() == 299
    assert (tok.groupby(["token", "layer"]).size() == 8).all()


def test_kinds_positions_passes(tmp_path):
    recs = [
        {"step": 0, "layer": 0, "experts": [1, 2]},
        {"step": 0, "layer": 1, "experts": [3, 4]},
        {"step": 1, "layer": 0, "experts": [1, 2, 5, 6]},  # spec accept: two positions
        {"step": 1, "layer": 1, "experts": [3, 4, 4, 7]},
        {"step": 2, "layer": 0, "experts": [1, 2, 3, 4]},  # failed speculation ...
        {"step": 2, "layer": 1, "experts": [5, 6, 7, 0]},
        {"step": 2, "layer": 0, "experts": [2, 3]},  # ... and its fallback pass
        {"step": 2, "layer": 1, "experts": [6, 0]},
    ]
    tt = parse_jsonl(write(tmp_path, recs))
    t = tt.table
    assert tt.k == 2
    assert tt.accounting["accepted_tokens"] == 1 + 2 + 1
    s1 = t[t.step == 1]
    assert list(s1.position) == [0, 0, 1, 1, 0, 0, 1, 1]
    assert set(s1.kind) == {"spec_accept"}
    s2 = t[t.step == 2]
    assert set(s2.kind) == {"spec_fallback"}
    assert list(s2["pass"]) == [0] * 8 + [1] * 4
    assert list(s2.accepted) == [False] * 8 + [True] * 4
    acc = tt.accesses()
    # step 1 layer 1 reads the union {3,4,7} once; step 2 reads both passes
    sel = (acc.iteration == 1) & (acc.layer == 1)
    assert list(acc.expert[sel]) == [3, 4, 7]
    assert len(acc) == 4 + 4 + 3 + 8 + 4
    assert acc.n_iterations == 3
    tok = tt.tokens()
    assert tok.token.nunique() == 4


@pytest.mark.parametrize(
    "lines, line, needle",
    [
        (['{"step": 0, "layer": 0, "experts": [1, 2]}', '{"step": 0, "layer": 1, "experts": [1, 2'], 2,
         "not valid JSON"),
        (['{"step": 0, "layer": 0, "experts": [1, 2]}', '{"step": 0, "layer": 1, "experts": [1, 2, 3]}'], 2,
         "neither k=2 nor 2k=4"),
        (['{"step": 0, "layer": 0, "experts": [1, 2]}', '{"step": 0, "layer": 9, "experts": [1, 2]}'], 2,
         "unknown layer 9"),
        (['{"step": 5, "layer": 0, "experts": [1, 2]}', '{"step": 4, "layer": 0, "experts": [1, 2]}'], 2,
         "step goes backwards"),
        (['{"step": 0, "layer": 0, "experts": [1, 99]}'], 1, "unknown expert 99"),
        (['{"step": 0, "layer": 0, "experts": [1, 1]}'], 1, "appears twice"),
        (['{"step": 0, "layer": 0}'], 1, "lacks the field 'experts'"),
        (['{"step": "a", "layer": 0, "experts": [1]}'], 1, "must be integers"),
        (['[1, 2]'], 1, "JSON object"),
        (['{"step": 0, "layer": 0, "experts": [1, 2]}'] * 3, 3, "three times"),
        (['{"step": 0, "layer": 0, "experts": [1, 2]}', '{"step": 0, "layer": 1, "experts": [1, 2, 3, 4]}'], 2,
         "mixes record widths"),
    ],
)
def test_malformed_input_names_file_and_line(tmp_path, lines, line, needle):
    p = write(tmp_path, lines)
    with pytest.raises(InputError) as ei:
        parse_jsonl(p, k=2 if "neither" in needle else None, n_layers=4, n_experts=8)
    msg = ei.value.format_message()
    assert needle in msg
    assert str(p) in msg and f"line {line}" in msg
    assert ei.value.line == line


def test_empty_and_prefill_only(tmp_path):
    p = write(tmp_path, ['{"step": 0, "layer": 0, "phase": "prefill", "experts": [1]}'])
    with pytest.raises(InputError, match="no decode records"):
        parse_jsonl(p)


def test_cli_errors_are_one_line_no_traceback(tmp_path):
    p = write(tmp_path, ['{"step": 0, "layer": 0, "experts": [1, 2]}', "garbage"])
    r = CliRunner().invoke(cli, ["trace", "parse", str(p)])
    assert r.exit_code == 1
    assert "Traceback" not in r.output
    assert "line 2" in r.output and "not valid JSON" in r.output


def test_cli_parse_json_and_parquet_roundtrip(tmp_path, data_dir):
    out = tmp_path / "typed.parquet"
    r = CliRunner().invoke(cli, ["trace", "parse", str(data_dir / "request_300.jsonl"), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    acc = json.loads(r.output)
    assert acc["accepted_tokens"] == 299
    tt = load_trace(out)
    assert tt.accounting["accepted_tokens"] == 299
    orig = parse_jsonl(data_dir / "request_300.jsonl")
    assert tt.table.equals(orig.table)
    a, b = tt.accesses(), orig.accesses()
    assert np.array_equal(a.expert_id, b.expert_id)


def test_write_jsonl_roundtrip(tmp_path):
    p = tmp_path / "w.jsonl"
    n = write_jsonl([(0, 0, [3, 1]), (0, 1, [2, 0]), (1, 0, [1, 3])], p)
    assert n == 3
    tt = parse_jsonl(p)
    assert tt.accounting["accepted_tokens"] == 2
    assert not list(tmp_path.glob("*.tmp-*")) and not list(tmp_path.glob(".*.tmp"))


def test_merge_union_truncates_to_shortest(tmp_path):
    a = parse_jsonl(write(tmp_path, [{"step": s, "layer": 0, "experts": [s % 4, 4]} for s in range(5)], "a.jsonl"), n_experts=8)
    b = parse_jsonl(write(tmp_path, [{"step": s, "layer": 0, "experts": [4, 5]} for s in range(3)], "b.jsonl"), n_experts=8)
    m = merge_accesses([a.accesses(), b.accesses()])
    assert m.n_iterations == 3
    assert [list(m.expert[m.iteration == i]) for i in range(3)] == [[0, 4, 5], [1, 4, 5], [2, 4, 5]]


def test_typed_parquet_checked_against_geometry(tmp_path, data_dir):
    out = tmp_path / "typed.parquet"
    parse_jsonl(data_dir / "request_300.jsonl").save(out)
    assert load_trace(out, n_layers=8, n_experts=64).n_layers == 8
    with pytest.raises(InputError, match="unknown layer 3"):
        load_trace(out, n_layers=3)
    with pytest.raises(InputError, match="k=8"):
        load_trace(out, k=4)
