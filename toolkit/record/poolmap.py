"""The pool as the probes see it: inode -> experts on one device (the one pool-to-inode map).

The recorder builds it once from the pool's files (:func:`pool_map`) or from a model file
(:func:`model_pool_map`: a GGUF file, a safetensors checkpoint); every probe reads it from its
:class:`moetrace.record.probe.RecordContext` (``ctx.pmap``): the pagecache, lru and mglru probes
fill their BPF maps from it and attribute pages, the reads probe attributes calls by byte
position, block by extent.

**Runs.** Every mapped file is tiled, from page 0 to the end of the page index space, by *runs*:
maximal page ranges with one owner, a *slot* (:data:`RUN_DTYPE`). Slots ``[0, n_total)`` are
experts (expert_id = layer x experts + expert); then ``n_total`` unattributed (pages of no mapped
file, and a pool file's pages past its experts), ``n_total + 1`` shared (a page holding bytes of two
owners: never given to either), ``n_total + 2`` non_expert (a model file's header, non-expert
tensors, padding). A file's runs are a contiguous, sorted *window* of the one runs array; the
pagecache probe finds a folio's first run by a bounded binary search in its window and walks on
run by run (probes/pagecache.bpf.c), :meth:`PoolMap.classify` is the same lookup in numpy."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetrace.errors import UsageError
from moetrace.kernel.syscalls import kernel_dev

PAGE = os.sysconf("SC_PAGE_SIZE")
#: one run of a file's pages: [start, start + pages) owned by slot; epage: the page within the
#: owner of the run's first page (experts: dense over the pages it owns, in file order; shared
#: and non_expert: the file page). Declared in probes/moetrace.bpf.h as struct moe_run.
RUN_DTYPE = np.dtype([("start", "<u4"), ("pages", "<u4"), ("slot", "<u4"), ("epage", "<u4")])
#: slots after the experts: unattributed, shared, non_expert (SLOT_* offsets from n_total)
EXTRA_SLOTS = ("unattributed", "shared", "non_expert")
SLOT_UNATTRIBUTED, SLOT_SHARED, SLOT_NON_EXPERT = 0, 1, 2
#: a file's last run reaches the end of the u32 page index space (pages past the file)
PAGE_SPACE = 1 << 32
#: the bounded binary search's steps in the kernel (probes/pagecache.bpf.c run_find): 2^21 runs
#: in one file at most
MAX_SEARCH_STEPS = 21
#: budget caps (README "Model files"): runs and bitmap words in the kernel maps
MAX_RUNS = 1 << 21
MAX_BITMAP_WORDS = 1 << 23


@dataclass(frozen=True)
class PoolMap:
    """inodes: {st_ino: (base expert_id, experts in the file)}; dev: the pool filesystem's
    device in the kernel encoding (:func:`moetrace.kernel.syscalls.kernel_dev`); extent_bytes:
    one expert's extent in a file (expert = base + pos // extent_bytes when a file holds more
    than one); n_total: experts in the pool (layers x experts); n_experts: experts per layer;
    pool: the :class:`moetrace.inputs.pool.Pool` it was built from (None when built by hand);
    kind: "pool" (a moetrace pool) or "model" (a model file: ``model`` its
    :class:`moetrace.inputs.modelmap.ModelMap`, ``tiling`` its (windows, runs)). A pool's runs
    follow from ``inodes`` and extent_bytes."""

    inodes: dict[int, tuple[int, int]]
    dev: int
    extent_bytes: int
    n_total: int
    n_experts: int
    pool: Any = None
    kind: str = "pool"
    model: Any = None
    tiling: Any = None

    @property
    def pages_per_expert(self) -> int:
        return -(-self.extent_bytes // PAGE)

    @property
    def words_per_expert(self) -> int:
        """u64 words of a per-expert page bitmap."""
        return -(-self.pages_per_expert // 64)

    @property
    def split(self) -> bool:
        """True when some file holds several experts (the layers and pool layouts)."""
        return any(n > 1 for _b, n in self.inodes.values())

    @functools.cached_property
    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """(inodes sorted as uint64, their (base, experts in the file) rows as int64): what the
        vectorized lookups search, built once."""
        keys = np.fromiter(self.inodes.keys(), np.uint64, len(self.inodes))
        vals = np.array(list(self.inodes.values()), np.int64).reshape(-1, 2)
        order = np.argsort(keys)
        return keys[order], vals[order]

    @property
    def files(self) -> list[str]:
        """The mapped files' paths (a pool's data files, a model's shards; [] when built by hand)."""
        if self.model is not None:
            return [str(f) for f in self.model.files]
        return [str(f) for f in self.pool.data_paths()] if self.pool is not None else []

    def resident_expert_pages(self) -> int:
        """The experts' pages resident in the page cache now (mincore of every mapped file)."""
        from moetrace.kernel.syscalls import resident_map

        n = 0
        for f in self.files:
            r = resident_map(f)
            slots = self.classify(np.full(len(r), os.stat(f).st_ino), np.arange(len(r)))
            n += int((r & (slots < self.n_total)).sum())
        return n

    @property
    def n_slots(self) -> int:
        """Counter slots: the experts, then EXTRA_SLOTS."""
        return self.n_total + len(EXTRA_SLOTS)

    def slot(self, which: int) -> int:
        """The slot of EXTRA_SLOTS[which] (SLOT_UNATTRIBUTED, SLOT_SHARED, SLOT_NON_EXPERT)."""
        return self.n_total + which

    @functools.cached_property
    def _tiling(self) -> tuple[dict[int, tuple[int, int, int, int]], np.ndarray]:
        if self.tiling is not None:
            return self.tiling
        ppe = self.pages_per_expert
        files = []
        for ino in sorted(self.inodes):
            base, n = self.inodes[ino]
            r = np.zeros(n + 1, RUN_DTYPE)
            r["start"] = np.arange(n + 1) * ppe
            r["pages"][:n] = ppe
            r["slot"][:n] = base + np.arange(n)
            r["start"][n], r["slot"][n] = n * ppe, self.slot(SLOT_UNATTRIBUTED)  # past its experts
            r["pages"][n] = PAGE_SPACE - 1 - n * ppe
            files.append((ino, r, n * ppe))
        return tile_files(files)

    @property
    def windows(self) -> dict[int, tuple[int, int, int, int]]:
        """{ino: (first run, runs, first bit of the re-add bitmap, pages with bitmap bits)}"""
        return self._tiling[0]

    @property
    def runs(self) -> np.ndarray:
        """Every file's runs (RUN_DTYPE), each file's a sorted window (:attr:`windows`)."""
        return self._tiling[1]

    @property
    def search_steps(self) -> int:
        """Halvings that find any page's run: ceil(log2(the largest window))."""
        return max([0] + [int(c - 1).bit_length() for _f, c, _b, _p in self.windows.values()])

    @property
    def bitmap_words(self) -> int:
        """u64 words of the per-page re-add bitmap (one bit per mapped page)."""
        return max([0] + [-(-(b + p) // 64) for _f, _c, b, p in self.windows.values()])

    def classify(self, ino, page) -> np.ndarray:
        """The slot of each (inode, page index): the probe's lookup, vectorized (an inode not
        in the map: unattributed)."""
        ino = np.asarray(ino, np.int64).reshape(-1)
        page = np.asarray(page, np.int64).reshape(-1)
        out = np.full(len(ino), self.slot(SLOT_UNATTRIBUTED), np.int64)
        runs = self.runs
        for i, (first, count, _b, _p) in self.windows.items():
            sel = np.flatnonzero(ino == i)
            if len(sel):
                w = runs[first:first + count]
                k = np.searchsorted(w["start"].astype(np.int64), page[sel], side="right") - 1
                out[sel] = w["slot"][np.clip(k, 0, count - 1)].astype(np.int64)
        return out

    def locate(self, ino: int | None, dev: int | None, pos: int | None) -> tuple[str, int | None]:
        """(source, expert_id) of a call on (ino, dev) at byte position ``pos`` (None: unknown)."""
        if ino is None:
            return "unresolved_fd", None
        v = self.inodes.get(int(ino))
        if v is None or (dev is not None and int(dev) != self.dev):
            return "other_files", None
        base, n = v
        if n <= 1 and self.kind == "pool":
            return "expert", base
        if pos is None:
            return "no_position", None
        slot = int(self.classify([ino], [int(pos) // PAGE])[0])
        if slot >= self.n_total:
            return "pool_tail", None
        return "expert", slot

    def expert_ids(self, ino, page_index) -> np.ndarray:
        """expert_id of each (inode, page index) of the pool (vectorized); -1 outside the experts."""
        s = self.classify(ino, page_index)
        return np.where(s < self.n_total, s, -1)


def tile_files(files: list[tuple[int, np.ndarray, int]]) -> tuple[dict[int, tuple[int, int, int, int]], np.ndarray]:
    """(windows, runs) of files given as (ino, its runs, pages with bitmap bits): windows in the
    order given, each file's bitmap bits starting at a word boundary."""
    windows, parts, first, bit = {}, [], 0, 0
    for ino, r, pages in files:
        windows[int(ino)] = (first, len(r), bit, int(pages))
        parts.append(r)
        first += len(r)
        bit += -(-int(pages) // 64) * 64
    runs = np.concatenate(parts) if parts else np.zeros(0, RUN_DTYPE)
    if len(runs) > MAX_RUNS or bit // 64 > MAX_BITMAP_WORDS:
        raise UsageError(f"the pool needs {len(runs)} runs and {bit // 64} bitmap words: above the kernel-map "
                         f"budget ({MAX_RUNS} runs, {MAX_BITMAP_WORDS} words)",
                         hint="map fewer files (one shard, or the layers you study)")
    return windows, runs


def pool_map(pool) -> PoolMap:
    """The map of a :class:`moetrace.inputs.pool.Pool`: every data file's inode; all on one
    filesystem (UsageError otherwise, as for two files sharing an inode)."""
    inodes: dict[int, tuple[int, int]] = {}
    devs = set()
    for i, p in enumerate(pool.data_paths()):
        st = os.stat(p)
        devs.add(st.st_dev)
        base, n = pool.experts_in_file(i)
        if st.st_ino in inodes:
            raise UsageError(f"two pool files share inode {st.st_ino} ({p})", hint="hard links in a pool are not supported")
        inodes[st.st_ino] = (base, n)
    if len(devs) > 1:
        raise UsageError(f"the pool {pool.root} spans {len(devs)} filesystems",
                         hint="keep every expert file of a pool on one filesystem")
    dev = kernel_dev(devs.pop()) if devs else 0
    return PoolMap(inodes, dev, int(pool.extent_bytes), int(pool.n_total), int(pool.geometry.n_experts), pool)


def file_runs(extents, shared: set[int], file_bytes: int, n_total: int, done: dict[int, int]) -> np.ndarray:
    """The runs of one model file: ``extents`` its experts' (offset, length, slot) rows in file
    order, ``shared`` its pages with two owners, ``done`` each expert's pages so far (the next
    run's epage; updated). Pages of no expert are non_expert, shared pages shared."""
    shared_slot, other = n_total + SLOT_SHARED, n_total + SLOT_NON_EXPERT
    rows: list[list[int]] = []

    def emit(a: int, b: int, slot: int) -> None:
        if b <= a:
            return
        if rows and rows[-1][2] == slot and rows[-1][1] == a:
            rows[-1][1] = b
        else:
            rows.append([a, b, slot])

    cursor = 0
    for off, ln, slot in extents:
        if ln <= 0:
            continue
        a, b = max(off // PAGE, cursor), (off + ln - 1) // PAGE  # b inclusive
        if a > b:
            continue
        emit(cursor, a, other)
        if a in shared:
            emit(a, a + 1, shared_slot)
            a += 1
        if a <= b:
            end = b if b in shared else b + 1
            emit(a, end, slot)
            if end == b:
                emit(b, b + 1, shared_slot)
        cursor = b + 1
    pages = -(-file_bytes // PAGE)
    emit(cursor, max(cursor, pages), other)
    emit(max(cursor, pages), PAGE_SPACE, other)
    r = np.zeros(len(rows), RUN_DTYPE)
    for i, (a, b, slot) in enumerate(rows):
        if slot < n_total:
            ep = done.get(slot, 0)
            done[slot] = ep + b - a
        else:
            ep = a
        r[i] = (a, min(b - a, PAGE_SPACE - 1 - a) if b == PAGE_SPACE else b - a, slot, ep)
    return r


def model_pool_map(model) -> PoolMap:
    """The map of a model file (a path, or a :class:`moetrace.inputs.modelmap.ModelMap`): expert
    (layer, expert) is slot layer x experts + expert; pages shared by two owners and the non-expert
    weights have slots of their own (module docstring)."""
    from moetrace.inputs.modelmap import map_model, page_owners

    m = model if hasattr(model, "extents") else map_model(model)
    ext = m.extents
    ex = ext[ext["kind"] == "expert"]
    E = int(m.experts)
    n_total = (int(ex["layer"].max()) + 1) * E
    owners = page_owners(m)
    files, inodes, devs, done = [], {}, set(), {}
    for f in m.files:
        st = os.stat(f)
        devs.add(st.st_dev)
        if st.st_ino in inodes:
            raise UsageError(f"two model files share inode {st.st_ino} ({f})", hint="hard links are not supported")
        e = ex[ex["file"] == f].sort_values("offset", kind="stable")
        rows = zip(e["offset"].tolist(), e["length"].tolist(), (e["layer"] * E + e["expert"]).tolist())
        shared = set(owners.loc[owners["file"] == f, "page"].tolist())
        r = file_runs(rows, shared, int(m.file_bytes.get(f, st.st_size)), n_total, done)
        files.append((st.st_ino, r, -(-st.st_size // PAGE)))
        inodes[st.st_ino] = (0, n_total)
    if len(devs) > 1:
        raise UsageError(f"the model's {len(m.files)} files span {len(devs)} filesystems",
                         hint="keep every shard of a model on one filesystem")
    per_expert = ex.groupby(["layer", "expert"])["length"].sum()
    return PoolMap(inodes, kernel_dev(devs.pop()), int(per_expert.max()), n_total, E, None, "model", m,
                   tile_files(files))


def open_pool_map(path: str | os.PathLike) -> PoolMap:
    """The map of what ``--pool`` names: a moetrace pool directory, or a model file (GGUF, a
    safetensors file, index or checkpoint directory)."""
    p = Path(path)
    if is_model_path(p):
        return model_pool_map(p)
    from moetrace.inputs.pool import open_pool

    return pool_map(open_pool(p))


def is_model_path(p: Path) -> bool:
    """A model file or checkpoint rather than a moetrace pool directory."""
    if p.is_file():
        return True
    return p.is_dir() and not (p / "pool.json").exists() and any(p.glob("*.safetensors"))


__all__ = ["EXTRA_SLOTS", "PoolMap", "RUN_DTYPE", "is_model_path", "model_pool_map", "open_pool_map", "pool_map",
           "tile_files"]
