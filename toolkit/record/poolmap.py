"""The pool as the probes see it: inode -> experts on one device (the one pool-to-inode map).

The recorder builds it once from the pool's files (:func:`pool_map`); every probe reads it from
its :class:`moetrace.record.probe.RecordContext` (``ctx.pmap``): the pagecache, lru and mglru
probes fill their BPF maps from it and attribute pages, the reads probe attributes calls by
byte position, block by extent."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from moetrace.errors import UsageError
from moetrace.kernel.syscalls import kernel_dev

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class PoolMap:
    """inodes: {st_ino: (base expert_id, experts in the file)}; dev: the pool filesystem's
    device in the kernel encoding (:func:`moetrace.kernel.syscalls.kernel_dev`); extent_bytes:
    one expert's extent in a file (expert = base + pos // extent_bytes when a file holds more
    than one); n_total: experts in the pool (layers x experts); n_experts: experts per layer;
    pool: the :class:`moetrace.inputs.pool.Pool` it was built from (None when built by hand)."""

    inodes: dict[int, tuple[int, int]]
    dev: int
    extent_bytes: int
    n_total: int
    n_experts: int
    pool: Any = None

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

    def locate(self, ino: int | None, dev: int | None, pos: int | None) -> tuple[str, int | None]:
        """(source, expert_id) of a call on (ino, dev) at byte position ``pos`` (None: unknown)."""
        if ino is None:
            return "unresolved_fd", None
        v = self.inodes.get(int(ino))
        if v is None or (dev is not None and int(dev) != self.dev):
            return "other_files", None
        base, n = v
        if n <= 1:
            return "expert", base
        if pos is None:
            return "no_position", None
        off = int(pos) // self.extent_bytes
        if off >= n:
            return "pool_tail", None
        return "expert", base + off

    def expert_ids(self, ino, page_index) -> np.ndarray:
        """expert_id of each (inode, page index) of the pool (vectorized); -1 outside the pool."""
        ino = np.asarray(ino, np.int64)
        keys, vals = self.table
        if not len(keys):
            return np.full(len(ino), -1, np.int64)
        i = np.clip(np.searchsorted(keys, ino.astype(np.uint64)), 0, len(keys) - 1)
        hit = keys[i] == ino.astype(np.uint64)
        base, nfile = vals[i, 0], vals[i, 1]
        eid = np.where(nfile > 1, base + np.asarray(page_index, np.int64) // max(1, self.pages_per_expert), base)
        return np.where(hit, eid, -1)


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


__all__ = ["PoolMap", "pool_map"]
