"""A model file as an expert pool: each (layer, expert)'s byte extents in a GGUF file or an HF
safetensors checkpoint, the non-expert weights as their own row, and the pages two owners share.

* GGUF (llama.cpp's format, read with the ``gguf`` package's reader): per layer the routed
  experts are three stacked tensors ``blk.L.ffn_{gate,up,down}_exps.weight`` (or a fused
  ``ffn_gate_up_exps``) whose outermost dimension is the expert, so expert e is one contiguous
  slice of ``n_bytes / E`` of each: three extents per (layer, expert).
* safetensors (read here from its header: an 8-byte little-endian length, then JSON naming
  each tensor's dtype, shape and ``data_offsets`` relative to the end of the header): per-expert
  tensors ``...layers.L.<mlp|block_sparse_moe|feed_forward>.experts.E.<name>.weight`` (Qwen3-MoE,
  OLMoE, Mixtral), or fused ones ``...layers.L.mlp.experts.<gate_up_proj|down_proj>`` with the
  expert outermost. A checkpoint is one file, several shards, or a directory of them.

Everything else (attention, norms, embeddings, the router, shared experts) is ``non_expert``.
A page holding bytes of two owners (GGUF's default 32-byte alignment puts tensor starts inside
pages) is never silently given to one: :func:`page_owners` lists each such page with its
owners, and :func:`expert_table` counts an expert's whole pages apart from its shared ones.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moetrace.errors import InputError

PAGE = 4096
#: the extents table: one row per (file, owner, tensor slice); layer / expert -1 for non-expert rows
EXTENT_COLUMNS = ("file", "layer", "expert", "kind", "tensor", "offset", "length")
GGUF_MAGIC = b"GGUF"
_GGUF_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")
_ST_PER_EXPERT = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.experts\.(\d+)\.(\w+)\.weight$")
_ST_FUSED = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|feed_forward)\.experts\.(gate_up_proj|down_proj|gate_proj|up_proj)"
                       r"(?:\.weight)?$")
#: safetensors dtypes and their bytes per element (huggingface/safetensors, Dtype)
ST_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                  "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass
class ModelMap:
    """A model file's experts as extents (EXTENT_COLUMNS), with what the file says of them."""

    format: str  # "gguf" or "safetensors"
    files: list[str]
    layers: int  # layers with routed experts
    experts: int  # experts per layer
    extents: pd.DataFrame
    arch: str | None = None
    experts_per_token: int | None = None
    alignment: int | None = None  # GGUF's general.alignment
    file_bytes: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The figures `pool map` prints: layers, experts, extents and bytes per expert, the
        non-expert bytes, the pages shared between owners."""
        e = self.extents
        ex = e[e["kind"] == "expert"].groupby(["layer", "expert"])
        shared = page_owners(self)
        pair = shared["owners"].map(lambda o: all(x != "non_expert" for x in o.split(",")))
        return {"format": self.format, "arch": self.arch, "files": self.files, "layers": self.layers,
                "experts": self.experts, "experts_per_token": self.experts_per_token, "alignment": self.alignment,
                "file_bytes": sum(self.file_bytes.values()),
                "extents_per_expert": sorted({int(n) for n in ex.size()}),
                "expert_bytes": sorted({int(n) for n in ex["length"].sum()}),
                "expert_pool_bytes": int(e.loc[e["kind"] == "expert", "length"].sum()),
                "non_expert_bytes": int(e.loc[e["kind"] == "non_expert", "length"].sum()),
                "shared_pages": int(len(shared)), "shared_pages_expert_expert": int(pair.sum()),
                "shared_pages_expert_other": int((~pair).sum())}


def _extents(rows: list[tuple]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=list(EXTENT_COLUMNS))
    for c in ("layer", "expert"):
        df[c] = df[c].astype("int32")
    for c in ("offset", "length"):
        df[c] = df[c].astype("int64")
    return df.sort_values(["file", "offset"], kind="stable").reset_index(drop=True)


def _slices(file: str, layer: int, name: str, offset: int, n_bytes: int, experts: int, where: str) -> list[tuple]:
    """Expert e's contiguous slice of a stacked tensor (the expert outermost)."""
    if experts <= 0 or n_bytes % experts:
        raise InputError(f"tensor {name}: {n_bytes} bytes do not split into {experts} experts", path=where)
    step = n_bytes // experts
    return [(file, layer, e, "expert", name, offset + e * step, step) for e in range(experts)]


# -- GGUF ------------------------------------------------------------------------------------------

def _gguf_field(reader, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    v = f.parts[f.data[0]]
    return bytes(v).decode() if v.dtype == np.uint8 else v[0].item()


def map_gguf(path: str | os.PathLike) -> ModelMap:
    """The experts of a GGUF file (three extents per (layer, expert), one per stacked tensor)."""
    from gguf import GGUFReader

    p = str(path)
    try:
        r = GGUFReader(p)
    except (ValueError, OSError, struct.error, IndexError) as e:
        raise InputError(f"not a readable GGUF file: {e}", path=p,
                         hint="a llama.cpp model file (moetrace model synth writes one)") from None
    arch = _gguf_field(r, "general.architecture")
    n_exp = _gguf_field(r, f"{arch}.expert_count") if arch else None
    rows: list[tuple] = []
    layers = set()
    for t in r.tensors:
        off, n = int(t.data_offset), int(t.n_bytes)
        m = _GGUF_EXPERTS.match(t.name)
        if m is None:
            rows.append((p, -1, -1, "non_expert", t.name, off, n))
            continue
        outer = int(t.shape[-1])  # ggml order: the expert dimension is the last
        if n_exp is not None and outer != n_exp:
            raise InputError(f"tensor {t.name} stacks {outer} experts, {arch}.expert_count says {n_exp}", path=p)
        layers.add(int(m.group(1)))
        rows.extend(_slices(p, int(m.group(1)), t.name, off, n, outer, p))
    if not layers:
        raise InputError("no routed-expert tensors (blk.L.ffn_*_exps.weight) in this GGUF file", path=p,
                         hint="a Mixture-of-Experts model: its expert weights are what the pool maps")
    ext = _extents(rows)
    experts = int(ext.loc[ext["kind"] == "expert", "expert"].max()) + 1
    return ModelMap("gguf", [p], len(layers), experts, ext, arch=arch,
                    experts_per_token=_gguf_field(r, f"{arch}.expert_used_count") if arch else None,
                    alignment=int(r.alignment), file_bytes={p: os.path.getsize(p)})


# -- safetensors -----------------------------------------------------------------------------------

def safetensors_header(path: str) -> tuple[int, dict[str, Any]]:
    """(the data's start in the file, the header's tensors) of one safetensors file, checked:
    every tensor's byte range inside the file and as long as its dtype x shape."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise InputError("shorter than a safetensors header (8 bytes)", path=path)
        n = struct.unpack("<Q", raw)[0]
        if n > min(size - 8, 100 << 20):
            raise InputError(f"header length {n} does not fit the file ({size} bytes)", path=path, offset=0)
        try:
            doc = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputError(f"header is not JSON: {e}", path=path, offset=8) from None
    if not isinstance(doc, dict):
        raise InputError("header is not a JSON object", path=path, offset=8)
    base = 8 + n
    tensors = {k: v for k, v in doc.items() if k != "__metadata__"}
    for name, v in tensors.items():
        try:
            lo, hi = (int(x) for x in v["data_offsets"])
            want = int(np.prod(v["shape"], dtype=np.int64)) * ST_DTYPE_BYTES[v["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise InputError(f"tensor {name!r}: no dtype, shape and data_offsets", path=path, offset=8) from None
        if not (0 <= lo <= hi and base + hi <= size) or hi - lo != want:
            raise InputError(f"tensor {name!r}: data_offsets [{lo}, {hi}) do not hold {want} bytes inside the file",
                             path=path, offset=8)
    return base, tensors


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise InputError("no *.safetensors files in this directory", path=str(path))
        return files
    if path.name.endswith(".index.json"):
        try:
            names = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise InputError(f"not a safetensors index (weight_map): {e}", path=str(path)) from None
        return [path.parent / n for n in names]
    return [path]


def map_safetensors(path: str | os.PathLike) -> ModelMap:
    """The experts of an HF checkpoint: a .safetensors file, its shards' index.json, or a
    directory of shards; per-expert tensors or fused ones (expert outermost)."""
    files = _safetensors_files(Path(path))
    rows: list[tuple] = []
    fused_experts = set()
    for fp in files:
        f = str(fp)
        base, tensors = safetensors_header(f)
        for name, v in tensors.items():
            lo, hi = (int(x) for x in v["data_offsets"])
            m, fm = _ST_PER_EXPERT.search(name), _ST_FUSED.search(name)
            if m is not None:
                rows.append((f, int(m.group(1)), int(m.group(2)), "expert", name, base + lo, hi - lo))
            elif fm is not None and len(v["shape"]) >= 3:
                fused_experts.add(int(v["shape"][0]))
                rows.extend(_slices(f, int(fm.group(1)), name, base + lo, hi - lo, int(v["shape"][0]), f))
            else:
                rows.append((f, -1, -1, "non_expert", name, base + lo, hi - lo))
    ext = _extents(rows)
    ex = ext[ext["kind"] == "expert"]
    if ex.empty:
        raise InputError("no routed-expert tensors (layers.L.*.experts.*) in this checkpoint", path=str(path),
                         hint="a Mixture-of-Experts model: its expert weights are what the pool maps")
    layers = int(ex["layer"].nunique())
    return ModelMap("safetensors", [str(f) for f in files], layers, int(ex["expert"].max()) + 1, ext,
                    file_bytes={str(f): os.path.getsize(f) for f in files})


def map_model(path: str | os.PathLike) -> ModelMap:
    """A GGUF file (by its magic) or an HF safetensors checkpoint (file, index.json, directory)."""
    p = Path(path)
    if not p.exists():
        raise InputError("no such file or directory", path=str(p))
    if p.is_file():
        with open(p, "rb") as f:
            if f.read(4) == GGUF_MAGIC:
                return map_gguf(p)
        if not p.name.endswith((".safetensors", ".index.json")):
            raise InputError("neither a GGUF file (no GGUF magic) nor a safetensors checkpoint (*.safetensors, "
                             "*.safetensors.index.json)", path=str(p),
                             hint="a llama.cpp model file, an HF checkpoint's shard or index, or its directory")
    return map_safetensors(p)


# -- pages -----------------------------------------------------------------------------------------

def _owner(layer: int, expert: int, kind: str) -> str:
    return f"L{layer}E{expert}" if kind == "expert" else "non_expert"


def page_owners(m: ModelMap, page_bytes: int = PAGE) -> pd.DataFrame:
    """The pages holding bytes of more than one owner (an expert, or the non-expert weights):
    ``file``, ``page``, ``owners`` (comma-separated, in file order)."""
    out = []
    for f, e in m.extents.groupby("file", sort=False):
        e = e[e["length"] > 0]
        first = (e["offset"] // page_bytes).to_numpy()
        last = ((e["offset"] + e["length"] - 1) // page_bytes).to_numpy()
        owners = [_owner(r.layer, r.expert, r.kind) for r in e.itertuples()]
        # only a page at an extent's edge can be shared: collect each edge page's owners
        edges: dict[int, list[str]] = {}
        for a, b, o in zip(first, last, owners):
            for pg in {int(a), int(b)}:
                lst = edges.setdefault(pg, [])
                if o not in lst:
                    lst.append(o)
        out += [(f, pg, ",".join(o)) for pg, o in sorted(edges.items()) if len(o) > 1]
    return pd.DataFrame(out, columns=["file", "page", "owners"]).astype({"page": "int64"})


def expert_table(m: ModelMap, page_bytes: int = PAGE) -> pd.DataFrame:
    """Per (layer, expert): ``extents``, ``bytes``, ``pages`` (the pages it alone owns) and
    ``shared_pages`` (those it shares with another owner: in page_owners, not in ``pages``)."""
    shared = page_owners(m, page_bytes)
    shared_by = {}
    for f, pg, owners in shared.itertuples(index=False):
        for o in owners.split(","):
            shared_by.setdefault(o, set()).add((f, int(pg)))
    rows = []
    for (layer, expert), e in m.extents[m.extents["kind"] == "expert"].groupby(["layer", "expert"]):
        pages = 0
        for f, g in e.groupby("file"):  # the pages its extents touch, merged (two may share one)
            a = (g["offset"] // page_bytes).to_numpy()
            b = ((g["offset"] + g["length"] - 1) // page_bytes).to_numpy()
            order = np.argsort(a)
            hi = -1
            for lo, up in zip(a[order], b[order]):
                pages += max(0, int(up) - max(int(lo), hi + 1) + 1)
                hi = max(hi, int(up))
        sh = len(shared_by.get(_owner(int(layer), int(expert), "expert"), ()))
        rows.append((int(layer), int(expert), len(e), int(e["length"].sum()), pages - sh, sh))
    return pd.DataFrame(rows, columns=["layer", "expert", "extents", "bytes", "pages", "shared_pages"])
