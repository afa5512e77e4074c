"""Importers (llama.cpp, vLLM, SGLang, CSV/Parquet) -> the same typed trace as engine JSONL; warm-up; errors; CLI."""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from moetrace.cli import cli
from moetrace.errors import InputError, UsageError
from moetrace.inputs.importers import detect_format, drop_warmup, find_warmup, import_trace
from moetrace.inputs.trace import Record, parse_jsonl, type_records

DATA = Path(__file__).resolve().parents[1] / "data"
_spec = importlib.util.spec_from_file_location("imp_make", DATA / "imp_make.py")
mk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mk)

REF = mk.reference()


def typed(path, fmt="auto", **kw):
    res = import_trace(path, fmt, **{k: v for k, v in kw.items() if k not in ("n_experts",)})
    return res, type_records(res.records, k=kw.get("k"), n_layers=res.n_layers(kw.get("n_layers")),
                             n_experts=kw.get("n_experts"), path=str(path))


def same_trace(a, b):
    pd.testing.assert_frame_equal(a.table.reset_index(drop=True), b.table.reset_index(drop=True))
    assert (a.k, a.n_layers, a.n_experts) == (b.k, b.n_layers, b.n_experts)
    assert a.accounting["accepted_tokens"] == b.accounting["accepted_tokens"]


@pytest.fixture(scope="module")
def expected():
    return parse_jsonl(DATA / "imp_expected.jsonl")


# ---------------------------------------------------------------- round trips, checked-in fixtures


@pytest.mark.parametrize("name, fmt, kw", [
    ("imp_llamacpp.csv", "auto", {}),
    ("imp_llamacpp.csv", "llamacpp", {}),
    ("imp_eval_callback.log", "auto", {}),
    ("imp_vllm.npy", "auto", {"prompt_tokens": mk.N_PROMPT}),
    ("imp_sglang_per_token.pt", "auto", {}),
])
def test_checked_in_fixtures_round_trip(name, fmt, kw, expected):
    res, tt = typed(DATA / name, fmt, **kw)
    same_trace(tt, expected)
    assert res.stats["warmup"]["steps_dropped"] == 0


def test_fixtures_are_reproducible(tmp_path):
    mk.write_llamacpp_csv(tmp_path / "a.csv", REF)
    mk.write_expected(tmp_path / "e.jsonl", REF)
    assert (tmp_path / "a.csv").read_bytes() == (DATA / "imp_llamacpp.csv").read_bytes()
    assert (tmp_path / "e.jsonl").read_bytes() == (DATA / "imp_expected.jsonl").read_bytes()


def test_detect_format(tmp_path):
    assert detect_format(DATA / "imp_llamacpp.csv") == "csv"
    assert detect_format(DATA / "imp_eval_callback.log") == "llamacpp"
    assert detect_format(DATA / "imp_vllm.npy") == "vllm"
    assert detect_format(DATA / "imp_sglang_per_token.pt") == "sglang"
    mk.write_vllm_json(tmp_path / "r.json", REF)
    assert detect_format(tmp_path / "r.json") == "vllm"


# ---------------------------------------------------------------- round trips, generated


def test_plain_csv_and_parquet(tmp_path, expected):
    rows = [(t - mk.N_PROMPT, lay, int(e)) for t in range(mk.N_PROMPT, REF.shape[0])
            for lay in range(mk.N_LAYERS) for e in REF[t, lay]]
    df = pd.DataFrame(rows, columns=["step", "layer", "expert"])
    df.to_csv(tmp_path / "r.csv", index=False)
    df.to_csv(tmp_path / "r.tsv", index=False, sep="\t")
    df.to_parquet(tmp_path / "r.parquet")
    (tmp_path / "r.txt").write_text("# comment\nPOS IL EXPERT\n\n" + "\n".join(" ".join(map(str, r)) for r in rows))
    for name in ("r.csv", "r.tsv", "r.parquet", "r.txt"):
        same_trace(typed(tmp_path / name)[1], expected)
    # a list column, one record per row
    lst = pd.DataFrame([(t - mk.N_PROMPT, lay, REF[t, lay].tolist()) for t in range(mk.N_PROMPT, REF.shape[0])
                        for lay in range(mk.N_LAYERS)], columns=["step", "layer", "experts"])
    lst.to_parquet(tmp_path / "l.parquet")
    same_trace(typed(tmp_path / "l.parquet")[1], expected)
    lst.assign(experts=lst.experts.map(lambda x: " ".join(map(str, x)))).to_csv(tmp_path / "l.csv", index=False)
    same_trace(typed(tmp_path / "l.csv")[1], expected)


def test_layerless_table_split_by_layers_and_k(tmp_path, expected):
    rows = [(t - mk.N_PROMPT, int(e)) for t in range(mk.N_PROMPT, REF.shape[0])
            for lay in range(mk.N_LAYERS) for e in REF[t, lay]]
    pd.DataFrame(rows, columns=["token", "expert_id"]).to_csv(tmp_path / "r.csv", index=False)
    same_trace(typed(tmp_path / "r.csv", n_layers=mk.N_LAYERS, k=mk.K)[1], expected)
    with pytest.raises(InputError, match="no layer column"):
        import_trace(tmp_path / "r.csv")
    with pytest.raises(InputError, match="not divisible into 5 layers") as ei:
        import_trace(tmp_path / "r.csv", n_layers=5, k=mk.K)
    assert ei.value.line == 2


def test_rank_column_orders_experts_and_spec_accept_width(tmp_path):
    (tmp_path / "r.csv").write_text("step,layer,expert,rank\n0,0,9,1\n0,0,4,0\n1,0,1,0\n1,0,2,1\n1,0,3,2\n1,0,5,3\n")
    res, tt = typed(tmp_path / "r.csv")
    assert res.records[0].experts == [4, 9]
    assert tt.accounting["steps_by_kind"]["spec_accept"] == 1


def test_vllm_npz_json_2d_and_prefill(tmp_path, expected):
    full = np.zeros((REF.shape[0], mk.N_LAYERS + 2, mk.K), np.int32)
    full[:, 2:] = REF
    np.savez(tmp_path / "a.npz", routed_experts=full, num_prompt_tokens=np.int64(mk.N_PROMPT),
             token_ids=np.arange(5, dtype=np.int64))
    res, tt = typed(tmp_path / "a.npz")
    same_trace(tt, expected)
    assert res.stats["placeholder_layers_dropped"] == [0, 1]
    np.savez(tmp_path / "b.npz", x=REF, y=REF)
    with pytest.raises(InputError, match="--key"):
        import_trace(tmp_path / "b.npz")
    same_trace(typed(tmp_path / "b.npz", key="y", prompt_tokens=mk.N_PROMPT)[1], expected)
    mk.write_vllm_json(tmp_path / "r.json", REF)
    same_trace(typed(tmp_path / "r.json")[1], expected)
    np.save(tmp_path / "flat2d.npy", REF.reshape(-1, mk.K))
    same_trace(typed(tmp_path / "flat2d.npy", n_layers=mk.N_LAYERS, prompt_tokens=mk.N_PROMPT)[1], expected)
    # no prompt length: every row is a step, and a note says so
    res = import_trace(DATA / "imp_vllm.npy")
    assert len({r.step for r in res.records}) == REF.shape[0]
    assert any("prompt" in n for n in res.stats["notes"])
    res = import_trace(DATA / "imp_vllm.npy", prompt_tokens=mk.N_PROMPT, include_prefill=True)
    assert len({r.step for r in res.records}) == REF.shape[0]


def test_sglang_json_and_counts_dumps(tmp_path, expected):
    flat = np.concatenate([np.full((REF.shape[0], 1, mk.K), -1, np.int32), REF], axis=1)
    (tmp_path / "s.json").write_text(json.dumps({"text": "..", "meta_info": {
        "prompt_tokens": mk.N_PROMPT, "routed_experts": base64.b64encode(flat.tobytes()).decode()}}))
    assert detect_format(tmp_path / "s.json") == "sglang"
    same_trace(typed(tmp_path / "s.json", n_layers=mk.N_LAYERS + 1, k=mk.K)[1], expected)
    with pytest.raises(InputError, match="--layers N and --k K"):
        import_trace(tmp_path / "s.json")
    mk.write_sglang_stat(tmp_path / "stat.pt")
    with pytest.raises(InputError, match="no token order") as ei:
        import_trace(tmp_path / "stat.pt")
    assert "trace stats --counts" in str(ei.value.message)
    mk.torch_save_like({"records": [{"forward_pass_id": 0, "global_physical_count": mk._FakeTensor(
        np.zeros((2, 4), np.int32), "0")}], "last_physical_to_logical_map": None}, tmp_path / "pp.pt")
    with pytest.raises(InputError, match="per_pass"):
        import_trace(tmp_path / "pp.pt")
    mk.write_sglang_per_token(tmp_path / "b.pt", REF, batch_decode=True)
    with pytest.raises(InputError, match=r"records\[7\] is a decode pass of 2 tokens"):
        import_trace(tmp_path / "b.pt")


def test_sglang_unpickler_refuses_code(tmp_path):
    import pickle
    import zipfile

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with zipfile.ZipFile(tmp_path / "e.pt", "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"records": [Evil()]}, protocol=2))
    with pytest.raises(InputError, match=r"builtins\.print, which this reader does not load"):
        import_trace(tmp_path / "e.pt", "sglang")


# ---------------------------------------------------------------- warm-up


def _recs(routes):
    """routes: list of steps, each a list of per-layer expert lists."""
    return [Record(s, lay, list(ex), s + 1, None) for s, step in enumerate(routes) for lay, ex in enumerate(step)]


def test_warmup_block_dropped_and_short_repeats_kept():
    junk = [[[0, 1], [0, 1]]] * 40
    real = [[[2, 3], [4, 5]], [[6, 7], [1, 3]], [[6, 7], [1, 3]], [[6, 7], [1, 3]], [[0, 5], [2, 4]]]
    recs = _recs(junk + real)
    out, rows, info = drop_warmup(recs, [1] * len(recs), 16)
    assert info["steps_dropped"] == 40 and info["rows_dropped"] == 80 and info["blocks"] == [[0, 40]]
    assert [r.step for r in out][:2] == [40, 40] and len(out) == 10
    # a real 3-step repeat at the start is not warm-up
    recs = _recs(real[1:] + real)
    assert find_warmup(recs, 16) == []
    # two consecutive junk blocks; the repeat later on is kept
    recs = _recs([[[0, 1]]] * 20 + [[[2, 3]]] * 17 + [[[4, 5]]] + [[[6, 7]]] * 30)
    assert find_warmup(recs, 16) == [(0, 20), (20, 17)]
    assert len(drop_warmup(recs, [1] * len(recs), 16)[0]) == 31
    # the threshold is configurable: 15 identical steps are kept at 16, dropped at 8
    recs = _recs([[[0, 1]]] * 15 + real)
    assert find_warmup(recs, 16) == [] and find_warmup(recs, 8) == [(0, 15)]
    with pytest.raises(InputError, match="keep-warmup"):
        drop_warmup(_recs([[[0, 1]]] * 20), [1] * 20, 16)
    with pytest.raises(UsageError):
        find_warmup(recs, 1)


def test_warmup_in_an_import(tmp_path, expected):
    junk = np.repeat(REF[:1], 100, axis=0)
    np.save(tmp_path / "w.npy", np.concatenate([junk, REF]))
    res = import_trace(tmp_path / "w.npy", prompt_tokens=0)
    assert res.stats["warmup"]["steps_dropped"] == 101  # the first real row equals the junk route
    assert res.stats["warmup"]["rows_dropped"] == 101
    kept = import_trace(tmp_path / "w.npy", keep_warmup=True)
    assert len(kept.records) == (100 + REF.shape[0]) * mk.N_LAYERS and kept.stats["warmup"]["candidates"]


# ---------------------------------------------------------------- malformed input


@pytest.mark.parametrize("text, match, line", [
    ("layer,expert\n0,1\n", "missing a step column", 1),
    ("step,layer\n0,1\n", "missing an expert column", 1),
    ("token,layer,expert\n0,0,1\n0,0,x\n", "'x' is not an integer", 3),
    ("token,layer,expert\n0,0,1\n\n0,0,2.5\n", "is not an integer", 4),
    ("token,layer,expert\n0,0,1\n0,0,-3\n", "negative value -3", 3),
    ("step,layer,expert\n0,0,1\n0,0,1\n", "an expert appears twice", 2),
    ("step,layer,experts\n0,0,\"1 -2\"\n", "negative expert", 2),
])
def test_csv_errors_name_file_and_line(tmp_path, text, match, line):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(InputError, match=match) as ei:
        res = import_trace(p)
        type_records(res.records, path=str(p))
    assert ei.value.line == line and str(p) in ei.value.message


def test_parquet_error_names_row(tmp_path):
    pd.DataFrame({"step": [0, 0, 1], "layer": [0, 0, 0], "expert": [1, 2, -1]}).to_parquet(tmp_path / "b.parquet")
    with pytest.raises(InputError, match="Parquet row 2"):
        import_trace(tmp_path / "b.parquet")


def test_array_errors_name_index(tmp_path):
    bad = REF.copy()
    bad[4, 1, 2] = -5
    np.save(tmp_path / "neg.npy", bad)
    with pytest.raises(InputError, match=r"\[4, 1, 2\]"):
        import_trace(tmp_path / "neg.npy")
    dup = REF.copy()
    dup[5, 2, :2] = 7
    np.save(tmp_path / "dup.npy", dup)
    with pytest.raises(InputError, match=r"twice at array\[5, 2\]"):
        import_trace(tmp_path / "dup.npy")
    np.save(tmp_path / "r4.npy", REF[None])
    with pytest.raises(InputError, match="rank 4"):
        import_trace(tmp_path / "r4.npy")
    np.save(tmp_path / "r2.npy", REF.reshape(-1, mk.K))
    with pytest.raises(InputError, match="rank 2"):
        import_trace(tmp_path / "r2.npy")
    with pytest.raises(InputError, match="not divisible into 4 layers"):
        import_trace(tmp_path / "r2.npy", n_layers=4)
    np.save(tmp_path / "f.npy", REF.astype(np.float32) + 0.5)
    with pytest.raises(InputError, match="not an integer"):
        import_trace(tmp_path / "f.npy")


def test_llamacpp_log_elided_tensor(tmp_path):
    text = (DATA / "imp_eval_callback.log").read_text().splitlines()
    i = next(j for j, ln in enumerate(text) if "ffn_moe_topk-1" in ln)
    text[i + 3] = text[i + 3].replace("],", ", ...],")
    (tmp_path / "e.log").write_text("\n".join(text))
    with pytest.raises(InputError, match="elided") as ei:
        import_trace(tmp_path / "e.log")
    assert ei.value.line == i + 4


# ---------------------------------------------------------------- CLI


def test_cli_import_json_summary(tmp_path, expected):
    junk = "\n".join(f"{s},{lay},{e}" for s in range(20) for lay in range(mk.N_LAYERS) for e in (0, 1, 2, 3))
    body = (DATA / "imp_llamacpp.csv").read_text().splitlines()
    shifted = [body[0]] + [",".join([c.split(",")[0], str(int(c.split(",")[1]) + 20)] + c.split(",")[2:])
                           for c in body[1:]]
    (tmp_path / "w.csv").write_text("IL,Token,Expert_ID,rank,weight\n"
                                    + "\n".join(f"{row.split(',')[1]},{row.split(',')[0]},{row.split(',')[2]},0,1"
                                                for row in junk.splitlines()) + "\n"
                                    + "\n".join(shifted[1:]) + "\n")
    out = tmp_path / "o.jsonl"
    r = CliRunner().invoke(cli, ["trace", "import", str(tmp_path / "w.csv"), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    summ = json.loads(r.stdout)
    assert summ["warmup_steps_dropped"] == 20 and summ["warmup_rows_dropped"] == 20 * mk.N_LAYERS * 4
    assert (summ["steps"], summ["layers"], summ["k"], summ["records_written"]) == (6, 3, 4, 18)
    assert "dropped warm-up: 20 leading steps" in r.stderr
    tt = parse_jsonl(out)
    assert tt.accounting["accepted_tokens"] == 6
    assert sorted(tt.table["step"].unique()) == list(range(20, 26))
    r = CliRunner().invoke(cli, ["trace", "import", str(tmp_path / "w.csv"), "-o", str(out), "--keep-warmup"])
    assert r.exit_code == 0 and "26 steps" in r.stdout and "kept a leading block" in r.stderr


def test_cli_formats_and_errors(tmp_path, expected):
    out = tmp_path / "o.jsonl"
    run = CliRunner().invoke
    r = run(cli, ["trace", "import", "--format", "vllm", str(DATA / "imp_vllm.npy"), "--prompt-tokens", "3",
                  "-o", str(out), "--geometry", "olmoe"])
    assert r.exit_code == 1 and "unknown layer" not in r.output and "k=4" in r.output  # olmoe k=8 != 4
    r = run(cli, ["trace", "import", "--format", "vllm", str(DATA / "imp_vllm.npy"), "--prompt-tokens", "3",
                  "-o", str(out), "--experts", "16", "--layers", "3"])
    assert r.exit_code == 0, r.output
    same_trace(parse_jsonl(out), expected)
    r = run(cli, ["trace", "import", str(DATA / "imp_vllm.npy"), "-o", str(out), "--experts", "8"])
    assert r.exit_code == 1 and "unknown expert" in r.output and "Traceback" not in r.output
    bad = tmp_path / "bad.csv"
    bad.write_text("token,layer,expert\n0,0,zz\n")
    before = out.read_bytes()
    r = run(cli, ["trace", "import", str(bad), "-o", str(out)])
    assert r.exit_code == 1 and f"{bad}: line 2" in r.output
    assert out.read_bytes() == before  # nothing written on error
    r = run(cli, ["trace", "import", str(tmp_path / "missing.csv"), "-o", str(out)])
    assert r.exit_code == 1 and "no such file" in r.output
    assert run(cli, ["trace", "import", "--help"]).exit_code == 0
