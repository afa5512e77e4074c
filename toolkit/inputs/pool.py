"""Expert pools on disk: one file per (layer, expert), one file per layer of page-aligned
fixed-size extents, or one pool file of such extents, with a manifest.

Manifest (``pool.json`` in the pool directory, schema ``moetrace.pool/1``)::

    {"schema": "moetrace.pool/1",
     "geometry": {"n_layers", "n_experts", "k", "expert_bytes", "name"},
     "scaled_from": null | {"preset", "n_experts", "expert_bytes"},
     "layout": "files" | "layers" | "pool",
     "page_size": 4096, "extent_bytes": <expert_bytes rounded up to pages>,
     "files": [relative paths],           # files: one per expert; layers: one per layer
                                          # (L000.bin ...); pool: ["pool.bin"]
     "seed": <int>, "created": <iso time>,
     "derived_from": {"root", "checksum"}  # only in a pool relayout_pool() made
     "checksum": "sha256:<hex of the canonical JSON without this field>"}

Expert e = layer * n_experts + expert lives in ``files[e]`` at offset 0 (files layout), in
``files[layer]`` at offset ``expert * extent_bytes`` (layers layout: an engine's per-layer tensor
file read at offsets, where readahead runs on into the next expert instead of stopping at the
end of a 1 MiB file), or in ``files[0]`` at offset ``e * extent_bytes`` (pool layout), length
``expert_bytes``. Paths are relative and may not leave the pool directory.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from moetrace.errors import InputError, UsageError
from moetrace.inputs.geometry import Geometry

POOL_SCHEMA = "moetrace.pool/1"
MANIFEST = "pool.json"
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
LAYOUTS = ("files", "layers", "pool")
_CHUNK = 8 << 20


def _checksum(doc: dict) -> str:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def expert_relpath(layer: int, expert: int) -> str:
    return f"L{layer:03d}/E{expert:04d}.bin"


@dataclass
class Pool:
    """An opened pool: its directory, manifest and per-expert locations."""

    root: Path
    geometry: Geometry
    layout: str
    extent_bytes: int
    files: list[str]
    manifest: dict

    @property
    def n_total(self) -> int:
        return self.geometry.n_total

    def experts_per_file(self) -> int:
        """Experts in each data file: 1 (files), n_experts (layers), every one (pool)."""
        return {"files": 1, "layers": self.geometry.n_experts}.get(self.layout, self.geometry.n_total)

    def file_of(self, expert_id: int) -> int:
        """The index in ``files`` of the file holding the expert."""
        return expert_id // self.experts_per_file()

    def path_of(self, expert_id: int) -> Path:
        return self.root / self.files[self.file_of(expert_id)]

    def offset_of(self, expert_id: int) -> int:
        return (expert_id % self.experts_per_file()) * self.extent_bytes

    def experts_in_file(self, index: int) -> tuple[int, int]:
        """(the first expert_id, how many experts) of ``files[index]``."""
        n = self.experts_per_file()
        return index * n, n

    def file_min_bytes(self) -> int:
        """The least size of a data file: its last expert's offset plus expert_bytes."""
        return (self.experts_per_file() - 1) * self.extent_bytes + self.geometry.expert_bytes

    def data_paths(self) -> list[Path]:
        return [self.root / f for f in self.files]

    @property
    def data_bytes(self) -> int:
        return self.geometry.n_total * self.geometry.expert_bytes


def create_pool(
    root: str | os.PathLike,
    geometry: Geometry,
    layout: str = "files",
    scaled_from: dict | None = None,
    seed: int = 0,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    source: Pool | None = None,
) -> Pool:
    """Create a pool of incompressible bytes and its manifest (``source``: a pool of this
    geometry whose experts' bytes are copied instead, :func:`relayout_pool`).

    Writes go to ``root/.creating`` first and are renamed into place at the
    end, so an interrupted creation leaves no half-made pool behind (the
    partial directory is removed). ``progress``, when given, is called with the number of
    expert bytes just written (a chunk of at most 8 MiB; page padding not counted, so the
    calls sum to ``geometry.pool_bytes``); None: nothing is reported.
    """
    if layout not in LAYOUTS:
        raise UsageError(f"unknown layout {layout!r}", hint="use --layout files, layers or pool")
    if geometry.expert_bytes <= 0:
        raise UsageError("a pool needs --expert-bytes > 0")
    root = Path(root)
    if (root / MANIFEST).exists() and not force:
        raise UsageError(f"{root} already holds a pool", hint="pass --force to replace it, or choose another directory")
    if root.exists() and any(p for p in root.iterdir() if p.name not in (MANIFEST, ".creating")) and not force:
        raise UsageError(f"{root} exists and is not empty", hint="choose an empty or new directory")
    need = geometry.n_total * -(-geometry.expert_bytes // PAGE) * PAGE
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if need > free * 0.95:
        raise UsageError(f"the pool needs {need} bytes but {root} has {free} free",
                         hint="use a smaller --expert-bytes or fewer --experts")
    work = root / ".creating"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    extent = -(-geometry.expert_bytes // PAGE) * PAGE
    rng = np.random.SFC64(seed)  # fastest numpy bit generator: ~1 GB/s of incompressible bytes
    write = (lambda fh, n: _write_stream(fh, n, rng, progress)) if source is None else _copier(source, progress)
    try:
        files = _write_data(work, geometry, layout, extent, write)
        doc = {
            "schema": POOL_SCHEMA,
            "geometry": geometry.to_dict(),
            "scaled_from": scaled_from,
            "layout": layout,
            "page_size": PAGE,
            "extent_bytes": extent,
            "files": files,
            "seed": seed,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        if source is not None:
            doc["derived_from"] = {"root": str(source.root.resolve()), "checksum": source.manifest.get("checksum")}
        doc["checksum"] = _checksum(doc)
        _remove_old_pool(root)
        for name in os.listdir(work):
            dst = root / name
            if dst.exists():
                shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
            os.replace(work / name, dst)
        tmp = root / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, root / MANIFEST)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return open_pool(root)


def layer_relpath(layer: int) -> str:
    return f"L{layer:03d}.bin"


def _write_data(work: Path, g: Geometry, layout: str, extent: int, write_expert) -> list[str]:
    """The data files of ``layout`` in ``work``, each expert's bytes from ``write_expert(fh, n)``
    in expert_id order (the same bytes per expert in every layout for one source), page-padded
    where a file holds several. Returns the files' relative paths."""
    if layout == "files":
        files = []
        for layer in range(g.n_layers):
            (work / f"L{layer:03d}").mkdir()
            for ex in range(g.n_experts):
                rel = expert_relpath(layer, ex)
                with open(work / rel, "wb", buffering=0) as fh:
                    write_expert(fh, g.expert_bytes)
                files.append(rel)
        return files
    files = [layer_relpath(layer) for layer in range(g.n_layers)] if layout == "layers" else ["pool.bin"]
    per_file = g.n_total // len(files)
    for rel in files:
        with open(work / rel, "wb", buffering=0) as fh:
            for _ in range(per_file):
                write_expert(fh, g.expert_bytes)
                if extent > g.expert_bytes:
                    fh.write(bytes(extent - g.expert_bytes))
            os.fsync(fh.fileno())
    return files


def relayout_pool(src: str | os.PathLike, dest: str | os.PathLike, layout: str) -> Pool:
    """``src``'s experts, byte for byte, as a pool of ``layout`` in ``dest`` (its manifest's
    ``derived_from`` names the source's checksum); a pool already there derived from this source in
    this layout is kept as it is. For a dimension of experiments (the lab matrix's pool_layout)."""
    source = open_pool(src)
    dest = Path(dest)
    want = {"root": str(source.root.resolve()), "checksum": source.manifest.get("checksum")}
    try:
        old = open_pool(dest)
        if old.layout == layout and old.manifest.get("derived_from") == want and not verify_pool(old):
            return old
    except InputError:
        pass
    if dest.exists():
        shutil.rmtree(dest)
    return create_pool(dest, source.geometry, layout=layout, scaled_from=source.manifest.get("scaled_from"),
                       seed=source.manifest.get("seed", 0), source=source)


def _remove_old_pool(root: Path) -> None:
    """With --force: delete the files an existing manifest lists (and nothing else)."""
    try:
        old = open_pool(root)
    except InputError:
        return
    for rel in old.files:
        (root / rel).unlink(missing_ok=True)
        parent = (root / rel).parent
        if parent != root:
            try:
                parent.rmdir()
            except OSError:
                pass
    (root / MANIFEST).unlink(missing_ok=True)


def _copier(source: Pool, progress):
    """write_expert(fh, n) copying ``source``'s experts in expert_id order."""
    nxt = iter(range(source.n_total))

    def write(fh, n: int) -> None:
        eid = next(nxt)
        with open(source.path_of(eid), "rb") as src:
            src.seek(source.offset_of(eid))
            left = n
            while left:
                chunk = src.read(min(left, _CHUNK))
                if not chunk:
                    raise InputError(f"expert {eid} is short in the source pool", path=str(source.path_of(eid)),
                                     hint=f"moetrace pool verify {source.root}")
                fh.write(chunk)
                left -= len(chunk)
                if progress:
                    progress(len(chunk))
    return write


def _write_stream(fh, n: int, rng: np.random.SFC64, progress) -> None:
    left = n
    while left:
        m = min(left, _CHUNK)
        fh.write(memoryview(rng.random_raw(-(-m // 8))).cast("B")[:m])
        left -= m
        if progress:
            progress(m)


def open_pool(root: str | os.PathLike) -> Pool:
    """Open a pool directory and validate its manifest (schema, checksum, paths)."""
    root = Path(root)
    mpath = root / MANIFEST
    try:
        text = mpath.read_bytes().decode("utf-8")
    except OSError as e:
        raise InputError(f"cannot read the pool manifest: {e.strerror}", path=str(mpath),
                         hint="create a pool with `moetrace pool create`") from None
    except UnicodeDecodeError as e:
        raise InputError(f"manifest is not UTF-8 text (byte {e.object[e.start]:#04x})", path=str(mpath),
                         offset=e.start) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"manifest is not valid JSON ({e.msg})", path=str(mpath), line=e.lineno) from None
    if not isinstance(doc, dict) or doc.get("schema") != POOL_SCHEMA:
        raise InputError(f"not a moetrace pool manifest (schema {doc.get('schema') if isinstance(doc, dict) else None!r})",
                         path=str(mpath))
    if doc.get("checksum") != _checksum(doc):
        raise InputError("manifest checksum mismatch: it was edited or damaged", path=str(mpath),
                         hint="recreate the pool with `moetrace pool create --force`")
    g = _manifest_geometry(doc, str(mpath))
    layout = doc.get("layout")
    extent = _manifest_int(doc, "extent_bytes", str(mpath), 1)
    page = _manifest_int(doc, "page_size", str(mpath), 1, default=PAGE)
    files = doc.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
        raise InputError(f"manifest key 'files' must be a list of relative paths, not {_short(files)}",
                         path=str(mpath))
    if layout not in LAYOUTS:
        raise InputError(f"unknown layout {layout!r}", path=str(mpath))
    want = {"files": g.n_total, "layers": g.n_layers}.get(layout, 1)
    if len(files) != want:
        raise InputError(f"manifest lists {len(files)} files, the layout needs {want}", path=str(mpath))
    real_root = os.path.realpath(root)
    for f in files:
        if os.path.isabs(f) or ".." in Path(f).parts or "\0" in f:
            raise InputError(f"manifest names a file outside the pool directory: {f!r}", path=str(mpath))
        if not os.path.realpath(root / f).startswith(real_root + os.sep):
            raise InputError(f"manifest path {f!r} resolves outside the pool directory", path=str(mpath))
    if extent < g.expert_bytes or extent % page:
        raise InputError("extent_bytes must be page-aligned and hold one expert", path=str(mpath))
    return Pool(root, g, layout, extent, files, doc)


#: the largest integer a manifest field may hold (sizes and counts beyond it are damage)
_MAX_INT = 1 << 53


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _manifest_int(doc: dict, key: str, path: str, lo: int, default: int | None = None, where: str = "") -> int:
    """doc[key] as an integer in [lo, 2**53]; InputError naming the key otherwise."""
    if key not in doc and default is not None:
        return default
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= _MAX_INT:
        raise InputError(f"manifest key {where + key!r} must be an integer in [{lo}, 2**53], not {_short(v)}",
                         path=path)
    return v


def _manifest_geometry(doc: dict, path: str) -> Geometry:
    g = doc.get("geometry")
    if not isinstance(g, dict):
        raise InputError(f"manifest key 'geometry' must be an object, not {_short(g)}", path=path)
    vals = {k: _manifest_int(g, k, path, 1, where="geometry.") for k in ("n_layers", "n_experts", "k")}
    vals["expert_bytes"] = _manifest_int(g, "expert_bytes", path, 0, where="geometry.")
    name = g.get("name", "custom")
    if not isinstance(name, str):
        raise InputError(f"manifest key 'geometry.name' must be a string, not {_short(name)}", path=path)
    if vals["k"] > vals["n_experts"]:
        raise InputError(f"manifest geometry has k={vals['k']} > n_experts={vals['n_experts']}", path=path)
    if vals["n_layers"] * vals["n_experts"] > 1 << 31:
        raise InputError(f"manifest geometry {vals['n_layers']} x {vals['n_experts']} experts is beyond any pool",
                         path=path)
    unknown = set(g) - {"n_layers", "n_experts", "k", "expert_bytes", "name"}
    if unknown:
        raise InputError(f"manifest key 'geometry' holds unknown fields: {', '.join(sorted(map(str, unknown)))}",
                         path=path)
    return Geometry(vals["n_layers"], vals["n_experts"], vals["k"], vals["expert_bytes"], name)


def verify_pool(pool: Pool) -> list[str]:
    """Check that every data file exists with the size the manifest implies.

    Returns a list of problems (empty when the pool is sound).
    """
    problems = []
    g = pool.geometry
    want = pool.file_min_bytes()
    for rel in pool.files:
        try:
            size = (pool.root / rel).stat().st_size
        except OSError:
            problems.append(f"{rel}: missing")
            continue
        if pool.layout == "files" and size != g.expert_bytes:
            problems.append(f"{rel}: {size} bytes, expected {g.expert_bytes}")
        elif pool.layout != "files" and size < want:
            problems.append(f"{rel}: {size} bytes, expected at least {want}")
    return problems
