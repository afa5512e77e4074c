"""Model files as expert pools (inputs/modelmap.py, inputs/modelsynth.py; `moetrace pool map`,
`moetrace model synth`), no kernel. The oracles are the bytes themselves: a GGUF whose every
expert slice holds its own constant, read back at the extents the map gives and scanned page
by page for whose values share a page; safetensors checkpoints laid out by the test."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from moetrace.cli import cli
from moetrace.errors import InputError
from moetrace.inputs.modelmap import expert_table, map_model, page_owners
from moetrace.inputs.modelsynth import ModelSpec, synth_model

gguf = pytest.importorskip("gguf")
L, E, F, D = 2, 6, 24, 40  # a slice: 24 x 40 F32 = 3840 bytes, under a page: pages must be shared at 32


def _code(layer: int, expert: int) -> float:
    return 1000.0 + 100 * layer + expert


def _coded_gguf(path: Path, alignment: int, f: int = F, d: int = D) -> None:
    """A MoE-shaped GGUF: a non-expert tensor of 7.0, and per layer the three stacked expert
    tensors of f x d F32 slices, expert e's slice of each filled with _code(layer, e)."""
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_custom_alignment(alignment)
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.full((3, d), 7.0, dtype=np.float32))
    for layer in range(L):
        stack = np.stack([np.full((f, d), _code(layer, e), dtype=np.float32) for e in range(E)])
        for name in ("gate", "up", "down"):
            w.add_tensor(f"blk.{layer}.ffn_{name}_exps.weight", stack if name != "down" else stack.swapaxes(1, 2).copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [4096, 32])
def test_every_gguf_extent_holds_its_experts_bytes(tmp_path, alignment):
    p = tmp_path / "m.gguf"
    _coded_gguf(p, alignment)
    m = map_model(p)
    assert (m.format, m.arch, m.layers, m.experts, m.experts_per_token, m.alignment) == \
        ("gguf", "qwen3moe", L, E, 2, alignment)
    raw = p.read_bytes()
    ex = m.extents[m.extents["kind"] == "expert"]
    assert len(ex) == 3 * L * E and (ex["length"] == F * D * 4).all()
    for r in ex.itertuples():
        vals = np.frombuffer(raw[r.offset:r.offset + r.length], dtype=np.float32)
        assert (vals == _code(r.layer, r.expert)).all(), (r.tensor, r.expert)
    ne = m.extents[m.extents["kind"] == "non_expert"]
    assert ne["tensor"].tolist() == ["token_embd.weight"] and ne["layer"].tolist() == [-1]
    assert (np.frombuffer(raw[ne["offset"].iloc[0]:][:3 * D * 4], dtype=np.float32) == 7.0).all()


def _owners_by_scan(raw: bytes, data_offset: int) -> dict[int, set[str]]:
    """Per page from the tensor data on, whose constants it holds (padding is zeros)."""
    codes = {_code(la, e): f"L{la}E{e}" for la in range(L) for e in range(E)}
    codes[7.0] = "non_expert"
    out = {}
    start = data_offset // 4096
    vals = np.frombuffer(raw[: len(raw) // 4 * 4], dtype=np.float32)  # data_offset and tensors: 32-aligned
    for page in range(start, -(-len(raw) // 4096)):
        v = vals[max(page * 1024, data_offset // 4): (page + 1) * 1024]
        out[page] = {codes[x] for x in np.unique(v) if x in codes}
    return out


def test_pages_two_owners_share_are_listed_and_never_given_to_one(tmp_path):
    p = tmp_path / "m.gguf"
    _coded_gguf(p, 32)
    m = map_model(p)
    scan = _owners_by_scan(p.read_bytes(), gguf.GGUFReader(str(p)).data_offset)
    shared = page_owners(m)
    want = {pg: o for pg, o in scan.items() if len(o) > 1}
    assert len(want) > 10 and {int(pg): set(o.split(",")) for pg, o in zip(shared["page"], shared["owners"])} == want
    t = expert_table(m).set_index(["layer", "expert"])
    for (layer, e), r in t.iterrows():
        owner = f"L{layer}E{e}"
        assert r["shared_pages"] == sum(owner in o for o in want.values())
        assert r["pages"] == sum(o == {owner} for o in scan.values())  # the pages it alone owns
    s = m.summary()
    assert s["shared_pages"] == len(want)
    assert s["shared_pages_expert_other"] == sum("non_expert" in o for o in want.values())


def test_page_alignment_shares_no_page_only_when_the_slices_are_whole_pages(tmp_path):
    p = tmp_path / "m.gguf"
    _coded_gguf(p, 4096, f=32, d=32)  # slices of 4096 bytes, tensors on pages
    m = map_model(p)
    assert page_owners(m).empty
    t = expert_table(m)
    assert (t["shared_pages"] == 0).all() and (t["pages"] == 3).all()
    _coded_gguf(p, 4096)  # slices of 3840 bytes: neighbours in a tensor share a page all the same
    m = map_model(p)
    scan = _owners_by_scan(p.read_bytes(), gguf.GGUFReader(str(p)).data_offset)
    assert len(page_owners(m)) == sum(len(o) > 1 for o in scan.values()) > 0


def test_synth_writes_the_same_file_twice_and_its_map_has_the_models_shape(tmp_path):
    spec = ModelSpec(layers=2, experts=8, k=2, n_embd=64, n_ff_exp=128, head_dim=16, seed=3)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert synth_model(a, spec) == synth_model(b, spec)
    assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()
    r = gguf.GGUFReader(str(a))
    names = {t.name for t in r.tensors}
    assert {"token_embd.weight", "output.weight", "blk.1.attn_q_norm.weight", "blk.1.ffn_gate_inp.weight"} <= names
    m = map_model(a)
    assert (m.layers, m.experts, m.experts_per_token, m.alignment) == (2, 8, 2, 4096)
    assert m.summary()["expert_bytes"] == [spec.expert_bytes] == [3 * 64 * 128 * 2]
    assert (m.extents["offset"] % 4096 == 0).all()  # every tensor on a page, so every slice of 16 KiB
    assert len(r.fields["tokenizer.ggml.tokens"].data) == spec.vocab


def test_synth_refuses_a_shape_it_cannot_write(tmp_path):
    with pytest.raises(InputError, match="--k 9 is out of range"):
        synth_model(tmp_path / "x.gguf", ModelSpec(experts=8, k=9))
    assert not list(tmp_path.iterdir())  # nothing half-written


# -- safetensors ----------------------------------------------------------------------------------

def _write_st(path: Path, tensors: dict[str, np.ndarray], pad: int = 0) -> dict[str, tuple[int, int]]:
    """A safetensors file laid out here (header padded by ``pad`` spaces); each tensor's
    absolute [start, end) in it."""
    header, blobs, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors.items():
        b = a.tobytes()
        header[name] = {"dtype": {np.float16: "F16", np.float32: "F32"}[a.dtype.type], "shape": list(a.shape),
                        "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header).encode() + b" " * pad
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    base = 8 + len(h)
    return {n: (base + v["data_offsets"][0], base + v["data_offsets"][1]) for n, v in header.items()
            if n != "__metadata__"}


def test_per_expert_hf_shards_through_their_index(tmp_path):
    """Qwen3-MoE naming in two shards, read through model.safetensors.index.json."""
    rng = np.random.default_rng(0)
    want, weight_map = {}, {}
    for shard, layers in (("model-00001-of-00002.safetensors", [0]), ("model-00002-of-00002.safetensors", [1])):
        t = {f"model.layers.{la}.self_attn.q_proj.weight": rng.standard_normal((8, 8)).astype(np.float16)
             for la in layers}
        for la in layers:
            t[f"model.layers.{la}.mlp.gate.weight"] = rng.standard_normal((4, 8)).astype(np.float32)
            for e in range(4):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    t[f"model.layers.{la}.mlp.experts.{e}.{proj}.weight"] = \
                        rng.standard_normal((6, 8)).astype(np.float16)
        ext = _write_st(tmp_path / shard, t, pad=5)
        want.update({(shard, n): x for n, x in ext.items()})
        weight_map.update({n: shard for n in t})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for target in (tmp_path / "model.safetensors.index.json", tmp_path):
        m = map_model(target)
        assert (m.format, m.layers, m.experts) == ("safetensors", 2, 4)
        got = {(Path(r.file).name, r.tensor): (r.offset, r.offset + r.length) for r in m.extents.itertuples()}
        assert got == want
        ex = m.extents[m.extents["kind"] == "expert"]
        assert ex.groupby(["layer", "expert"]).size().tolist() == [3] * 8
        assert set(m.extents.loc[m.extents["kind"] == "non_expert", "tensor"].str.split(".").str[-2]) == \
            {"q_proj", "gate"}


def test_fused_expert_tensors_are_sliced_per_expert(tmp_path):
    gu = np.arange(3 * 10 * 4, dtype=np.float32).reshape(3, 10, 4)  # [E, 2I, H]
    dn = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5)  # [E, H, I]
    ext = _write_st(tmp_path / "m.safetensors", {"model.layers.0.mlp.experts.gate_up_proj": gu,
                                                 "model.layers.0.mlp.experts.down_proj": dn,
                                                 "model.embed_tokens.weight": np.zeros((2, 4), np.float32)})
    m = map_model(tmp_path / "m.safetensors")
    raw = (tmp_path / "m.safetensors").read_bytes()
    ex = m.extents[m.extents["kind"] == "expert"]
    assert (m.layers, m.experts, len(ex)) == (1, 3, 6)
    for r in ex.itertuples():
        src = gu if r.tensor.endswith("gate_up_proj") else dn
        assert raw[r.offset:r.offset + r.length] == src[r.expert].tobytes()
        assert ext[r.tensor][0] <= r.offset and r.offset + r.length <= ext[r.tensor][1]


def test_a_damaged_safetensors_header_names_the_file_and_where(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(InputError, match=r"bad.safetensors: offset 0: header length .* does not fit"):
        map_model(p)
    _write_st(p, {"model.layers.0.mlp.experts.0.up_proj.weight": np.zeros((2, 2), np.float32)})
    raw = p.read_bytes()
    p.write_bytes(raw.replace(b'"shape": [2, 2]', b'"shape": [9, 2]'))
    with pytest.raises(InputError, match=r"offset 8: tensor .* do not hold 72 bytes"):
        map_model(p)
    dense = tmp_path / "dense.safetensors"
    _write_st(dense, {"model.layers.0.mlp.up_proj.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(InputError, match="no routed-expert tensors"):
        map_model(dense)


# -- the commands ---------------------------------------------------------------------------------

def test_model_synth_and_pool_map_commands(tmp_path):
    r = CliRunner()
    out = tmp_path / "t.gguf"
    args = ["model", "synth", str(out), "--layers", "2", "--experts", "8", "--k", "2", "--n-embd", "64",
            "--n-ff-exp", "128", "--head-dim", "16", "--alignment", "32", "--json"]
    res = r.invoke(cli, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["bytes"] == out.stat().st_size and doc["layers"] == 2 and doc["shared_pages"] > 0
    res = r.invoke(cli, args)
    assert res.exit_code == 2 and "exists" in res.output and "--force" in res.output  # a usage error
    res = r.invoke(cli, ["pool", "map", str(out), "--out", str(tmp_path / "x.parquet"),
                         "--experts-out", str(tmp_path / "e.parquet"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["shared_pages"] == len(doc["shared"]) > 0
    x, e = pd.read_parquet(tmp_path / "x.parquet"), pd.read_parquet(tmp_path / "e.parquet")
    assert len(x[x["kind"] == "expert"]) == 48 and len(e) == 16 and e["shared_pages"].sum() > 0
    res = r.invoke(cli, ["pool", "map", str(out)])
    assert res.exit_code == 0 and "2 layers x 8 experts, top-2, alignment 32" in res.output
    res = r.invoke(cli, ["pool", "map", str(tmp_path / "x.parquet")])
    assert res.exit_code == 1 and "neither a GGUF file" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("alignment", [4096, 32])
def test_the_probes_runs_give_every_page_the_owner_its_bytes_name(tmp_path, alignment):
    """record/poolmap.py's runs (what the pagecache probe searches) against the bytes: a page of
    one expert's constant is that expert's slot, a page of two owners' the shared slot, the rest
    (header, token_embd, padding) non_expert; the runs tile the page space."""
    from moetrace.record.poolmap import PAGE_SPACE, model_pool_map

    p = tmp_path / "m.gguf"
    _coded_gguf(p, alignment)
    pm = model_pool_map(p)
    n = pm.n_total
    assert (pm.kind, n, pm.n_experts, pm.n_slots) == ("model", L * E, E, L * E + 3)
    (ino, (first, count, bm_base, pages)), = pm.windows.items()
    raw = p.read_bytes()
    assert (ino, first, count, bm_base, pages) == (p.stat().st_ino, 0, len(pm.runs), 0, -(-len(raw) // 4096))
    r = pm.runs
    start = r["start"].astype(np.int64)
    assert start[0] == 0 and (start[1:] == start[:-1] + r["pages"][:-1]).all()
    assert start[-1] + r["pages"][-1] == PAGE_SPACE - 1 and (r["pages"] > 0).all()
    scan = _owners_by_scan(raw, gguf.GGUFReader(str(p)).data_offset)
    slots = {f"L{la}E{e}": la * E + e for la in range(L) for e in range(E)}
    want = {pg: (n + 1 if len(o) > 1 else slots[next(iter(o))] if o and o != {"non_expert"} else n + 2)
            for pg, o in scan.items()}
    want.update({pg: n + 2 for pg in range(min(scan))})  # the header's pages
    got = pm.classify(np.full(pages + 3, ino), np.arange(pages + 3))
    assert dict(enumerate(got[:pages].tolist())) == want
    assert (got[pages:] == n + 2).all()  # past the end: the file's, never another's
    assert (pm.classify([ino + 1], [0]) == n).all()  # another inode: unattributed
    assert int((got[:pages] == n + 1).sum()) == len(page_owners(pm.model))
    for s in range(n):  # epage: dense over the pages an expert owns, in file order
        ep = np.concatenate([[]] + [np.arange(x["epage"], x["epage"] + x["pages"]) for x in r[r["slot"] == s]])
        assert ep.tolist() == list(range(len(ep)))
    assert pm.search_steps == (count - 1).bit_length() and pm.bitmap_words == -(-pages // 64)
