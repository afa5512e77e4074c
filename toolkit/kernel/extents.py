"""Where experts live on the block device: FIEMAP extents -> disk sectors -> expert.

* :func:`fiemap`          the extents of one file (ioctl FS_IOC_FIEMAP, looped until
                          FIEMAP_EXTENT_LAST), as :class:`Extent` (logical, physical, length, flags)
* :func:`block_device_of` the disk a file's filesystem sits on: partition start sector,
                          the whole disk's name and the tracepoint device number
* :func:`pool_extents`    per expert of a pool, its physical byte ranges converted to
                          512-byte sectors on the DISK, as an :class:`ExpertExtents` index
* :class:`ExpertExtents`  sorted sector intervals (numpy searchsorted): sector -> expert_id
                          (or -1, unattributed) and bio (sector, nr_sector) -> bytes per expert,
                          split by overlap

Sectors: the block tracepoints (block_bio_queue, block_io_start, block_rq_*) report the
whole disk's device and disk-relative sectors (a bio submitted to a partition is
remapped by blk_partition_remap before block_bio_queue fires; requests always belong to
the disk). FIEMAP's physical offsets are relative to the filesystem's device, i.e. the
partition, so a partition's start (``/sys/class/block/<part>/start``, in 512-byte
sectors) is added. Device numbers use the kernel encoding ``(major << 20) | minor``.
Stacked devices (device-mapper, md, loop) remap sectors again below the filesystem;
they are refused with that reason rather than attributed wrongly.

Extent flags that make a range's device bytes unknowable are reported per expert in
:attr:`ExpertExtents.problems`: delayed allocation (FIEMAP_FLAG_SYNC is passed by
default, which writes dirty data first so this should not remain), unwritten (reads
return zeros without I/O), inline/tail/encoded/not-aligned data, unknown location,
and shared (reflinked) blocks.
"""

from __future__ import annotations

import array
import fcntl
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import numpy as np

from moetrace.errors import InputError

if TYPE_CHECKING:
    from moetrace.inputs.pool import Pool

SECTOR = 512

# include/uapi/linux/fs.h: #define FS_IOC_FIEMAP _IOWR('f', 11, struct fiemap)
FS_IOC_FIEMAP = 0xC020660B
# include/uapi/linux/fiemap.h
FIEMAP_FLAG_SYNC = 0x1
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_UNKNOWN = 0x2
FIEMAP_EXTENT_DELALLOC = 0x4
FIEMAP_EXTENT_ENCODED = 0x8
FIEMAP_EXTENT_DATA_ENCRYPTED = 0x80
FIEMAP_EXTENT_NOT_ALIGNED = 0x100
FIEMAP_EXTENT_DATA_INLINE = 0x200
FIEMAP_EXTENT_DATA_TAIL = 0x400
FIEMAP_EXTENT_UNWRITTEN = 0x800
FIEMAP_EXTENT_MERGED = 0x1000
FIEMAP_EXTENT_SHARED = 0x2000

FLAG_NAMES = {
    FIEMAP_EXTENT_LAST: "last", FIEMAP_EXTENT_UNKNOWN: "unknown", FIEMAP_EXTENT_DELALLOC: "delalloc",
    FIEMAP_EXTENT_ENCODED: "encoded", FIEMAP_EXTENT_DATA_ENCRYPTED: "encrypted",
    FIEMAP_EXTENT_NOT_ALIGNED: "not_aligned", FIEMAP_EXTENT_DATA_INLINE: "inline",
    FIEMAP_EXTENT_DATA_TAIL: "tail", FIEMAP_EXTENT_UNWRITTEN: "unwritten",
    FIEMAP_EXTENT_MERGED: "merged", FIEMAP_EXTENT_SHARED: "shared",
}
# Flags after which the range's device bytes are not where FIEMAP says (or not read).
PROBLEM_FLAGS = (FIEMAP_EXTENT_UNKNOWN | FIEMAP_EXTENT_DELALLOC | FIEMAP_EXTENT_ENCODED
                 | FIEMAP_EXTENT_NOT_ALIGNED | FIEMAP_EXTENT_DATA_INLINE | FIEMAP_EXTENT_DATA_TAIL
                 | FIEMAP_EXTENT_UNWRITTEN | FIEMAP_EXTENT_SHARED)

_HDR = struct.Struct("=QQIIII")          # struct fiemap: start, length, flags, mapped, count, reserved
_EXT = struct.Struct("=QQQQQIIII")       # struct fiemap_extent: logical, physical, length, 2 x res64,
#                                          flags, 3 x res32  (56 bytes)
_BATCH = 256                              # extents per ioctl call


def flag_names(flags: int) -> list[str]:
    """FIEMAP extent flags as names (``["unwritten", "last"]``)."""
    return [n for bit, n in FLAG_NAMES.items() if flags & bit]


@dataclass(frozen=True)
class Extent:
    """One FIEMAP extent: file bytes [logical, logical+length) live at device byte
    ``physical`` of the filesystem's block device (the partition)."""

    logical: int
    physical: int
    length: int
    flags: int

    @property
    def flag_names(self) -> list[str]:
        return flag_names(self.flags)


def fiemap(path: str | os.PathLike, sync: bool = True, start: int = 0,
           length: int = (1 << 64) - 1) -> list[Extent]:
    """The extents of ``path`` covering [start, start+length), via FS_IOC_FIEMAP.

    ``sync``: pass FIEMAP_FLAG_SYNC (write dirty data first, so delayed-allocation
    extents get their blocks). Needs only read access to the file (no root). Raises
    :class:`InputError` when the filesystem does not support FIEMAP."""
    out: list[Extent] = []
    pos, end = start, min(start + length, (1 << 64) - 1)
    flags = FIEMAP_FLAG_SYNC if sync else 0
    buf = bytearray(_HDR.size + _BATCH * _EXT.size)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise InputError(f"cannot open for FIEMAP: {e.strerror}", path=str(path)) from None
    try:
        while pos < end:
            _HDR.pack_into(buf, 0, pos, end - pos, flags, 0, _BATCH, 0)
            abuf = array.array("B", buf)
            try:
                fcntl.ioctl(fd, FS_IOC_FIEMAP, abuf, True)
            except OSError as e:
                raise InputError(f"FIEMAP failed: {e.strerror}", path=str(path),
                                 hint="the filesystem must support FS_IOC_FIEMAP (ext4, xfs, btrfs do)") from None
            mv = abuf.tobytes()
            mapped = _HDR.unpack_from(mv, 0)[3]
            if mapped == 0:
                break
            last = None
            for i in range(mapped):
                lo, ph, ln, _r0, _r1, fl, _a, _b, _c = _EXT.unpack_from(mv, _HDR.size + i * _EXT.size)
                last = Extent(lo, ph, ln, fl)
                out.append(last)
            assert last is not None
            if last.flags & FIEMAP_EXTENT_LAST:
                break
            pos = last.logical + last.length
            flags &= ~FIEMAP_FLAG_SYNC  # synced once is enough
    finally:
        os.close(fd)
    return out


# -- devices ----------------------------------------------------------------------------------

def tp_dev(major: int, minor: int) -> int:
    """The kernel's dev_t encoding used by tracepoints: (major << 20) | minor."""
    return (major << 20) | minor


def tp_dev_split(dev: int) -> tuple[int, int]:
    """(major, minor) of a tracepoint dev_t."""
    return dev >> 20, dev & ((1 << 20) - 1)


@dataclass(frozen=True)
class BlockDevice:
    """The disk under a filesystem, as the block tracepoints see it.

    fs_major/fs_minor: the filesystem's device (st_dev; a partition or the disk);
    disk: the whole disk's name (``vda``), disk_major/disk_minor its numbers;
    part_start: the partition's first sector on the disk (0 for an unpartitioned disk);
    tp_dev: (disk_major << 20) | disk_minor, what the tracepoints' ``dev`` carries."""

    fs_major: int
    fs_minor: int
    fs_name: str
    disk: str
    disk_major: int
    disk_minor: int
    part_start: int

    @property
    def tp_dev(self) -> int:
        return tp_dev(self.disk_major, self.disk_minor)

    @property
    def partitioned(self) -> bool:
        return (self.fs_major, self.fs_minor) != (self.disk_major, self.disk_minor)


def _read_int(p: Path) -> int | None:
    try:
        return int(p.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_dev(p: Path) -> tuple[int, int] | None:
    try:
        a, b = p.read_text().strip().split(":")
        return int(a), int(b)
    except (OSError, ValueError):
        return None


def block_device_for(major: int, minor: int, root: str | os.PathLike = "/") -> BlockDevice:
    """Resolve a filesystem device number to its disk via ``<root>/sys/dev/block/M:m``."""
    sysdev = Path(root) / "sys/dev/block" / f"{major}:{minor}"
    try:
        real = Path(os.path.realpath(sysdev))
    except OSError:
        real = sysdev
    if not (real / "dev").exists():
        raise InputError(f"device {major}:{minor} is not a block device in /sys/dev/block",
                         hint="the pool must sit on a disk-backed filesystem (not tmpfs, overlay or btrfs "
                              "anonymous devices)")
    name = real.name
    if (real / "partition").exists():
        start = _read_int(real / "start")
        disk_dir = real.parent
        dd = _read_dev(disk_dir / "dev")
        if start is None or dd is None:
            raise InputError(f"cannot read the partition start of {name} ({real}/start)")
        disk, (dmaj, dmin) = disk_dir.name, dd
    else:
        start, disk, (dmaj, dmin) = 0, name, (major, minor)
        disk_dir = real
    slaves = disk_dir / "slaves"
    try:
        stacked = slaves.is_dir() and any(slaves.iterdir())
    except OSError:
        stacked = False
    if stacked or name.startswith(("dm-", "md", "loop")):
        raise InputError(f"{name} is a stacked device (device-mapper/md/loop): its sectors are remapped "
                         "below the filesystem, so FIEMAP offsets do not match the disk's tracepoint sectors",
                         hint="put the pool on a filesystem directly on a disk or partition")
    return BlockDevice(major, minor, name, disk, dmaj, dmin, start)


def block_device_of(path: str | os.PathLike, root: str | os.PathLike = "/") -> BlockDevice:
    """The :class:`BlockDevice` under the filesystem holding ``path``."""
    st = os.stat(path)
    return block_device_for(os.major(st.st_dev), os.minor(st.st_dev), root)


# -- the sector -> expert index ---------------------------------------------------------------

@dataclass
class ExpertExtents:
    """Sorted, non-overlapping disk sector intervals [start, end) -> expert_id.

    ``device``: the disk (tracepoint dev in ``device.tp_dev``); ``n_experts`` (experts per
    layer) splits expert_id into (layer, expert); ``problems``: expert_id -> extent-flag
    problems found while building (see the module docstring)."""

    starts: np.ndarray  # uint64 sectors, sorted
    ends: np.ndarray    # uint64 sectors, exclusive
    experts: np.ndarray  # int32 expert ids
    n_total: int
    n_experts: int = 0
    device: BlockDevice | None = None
    problems: dict[int, list[str]] = field(default_factory=dict)

    @classmethod
    def from_ranges(cls, ranges: Iterable[tuple[int, int, int]], n_total: int, n_experts: int = 0,
                    device: BlockDevice | None = None,
                    problems: dict[int, list[str]] | None = None) -> "ExpertExtents":
        """Build from (start_sector, n_sectors, expert_id); adjacent ranges of one expert are
        merged; overlapping ranges of different experts raise :class:`InputError`."""
        rows = sorted((int(s), int(s) + int(n), int(e)) for s, n, e in ranges if int(n) > 0)
        merged: list[list[int]] = []
        for s, t, e in rows:
            if merged and s < merged[-1][1]:
                if merged[-1][2] == e:
                    merged[-1][1] = max(merged[-1][1], t)
                    continue
                raise InputError(f"sectors {s}..{t} of expert {e} overlap expert {merged[-1][2]} "
                                 "(shared/reflinked blocks cannot be attributed)")
            if merged and s == merged[-1][1] and merged[-1][2] == e:
                merged[-1][1] = t
            else:
                merged.append([s, t, e])
        arr = np.array(merged, dtype=np.int64).reshape(-1, 3)
        return cls(arr[:, 0].astype(np.uint64), arr[:, 1].astype(np.uint64), arr[:, 2].astype(np.int32),
                   n_total, n_experts, device, dict(problems or {}))

    def __len__(self) -> int:
        return len(self.starts)

    def sectors_of(self, expert_id: int) -> int:
        """Sectors mapped to ``expert_id``."""
        m = self.experts == expert_id
        return int((self.ends[m] - self.starts[m]).sum())

    def bytes_per_expert(self) -> np.ndarray:
        """Mapped bytes per expert id (length n_total)."""
        return np.bincount(self.experts, weights=(self.ends - self.starts).astype(np.float64),
                           minlength=self.n_total).astype(np.int64) * SECTOR

    def lookup(self, sectors: np.ndarray | int) -> np.ndarray:
        """expert_id for each sector, -1 where no expert lives."""
        s = np.atleast_1d(np.asarray(sectors, dtype=np.uint64))
        i = np.searchsorted(self.starts, s, side="right").astype(np.int64) - 1
        ok = i >= 0
        ic = np.where(ok, i, 0)
        ok &= s < self.ends[ic] if len(self) else False
        return np.where(ok, self.experts[ic] if len(self) else -1, -1).astype(np.int32)

    def attribute(self, sector: np.ndarray, nr_sector: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Split bios [sector, sector + nr_sector) over the experts they overlap.

        Returns (bytes per expert id, bios touching each expert, unattributed bytes)."""
        s = np.asarray(sector, dtype=np.uint64)
        n = np.asarray(nr_sector, dtype=np.uint64)
        by = np.zeros(self.n_total, dtype=np.int64)
        bios = np.zeros(self.n_total, dtype=np.int64)
        total = int(n.sum()) * SECTOR
        if len(s) == 0 or len(self) == 0:
            return by, bios, total
        e = s + n
        i0 = np.searchsorted(self.ends, s, side="right")  # first interval ending after s
        i1 = np.searchsorted(self.starts, e, side="left")  # intervals starting before e: < i1
        span = (i1 - i0).astype(np.int64)
        attributed = 0
        rows = np.arange(len(s), dtype=np.int64)
        pairs = []
        for k in range(int(span.max(initial=0))):
            m = span > k
            idx = (i0[m] + k).astype(np.int64)
            lo = np.maximum(self.starts[idx], s[m])
            hi = np.minimum(self.ends[idx], e[m])
            ov = (hi - lo).astype(np.int64)
            ex = self.experts[idx].astype(np.int64)
            by += np.bincount(ex, weights=ov.astype(np.float64), minlength=self.n_total).astype(np.int64) * SECTOR
            pairs.append(rows[m] * self.n_total + ex)
            attributed += int(ov.sum()) * SECTOR
        if pairs:
            # a bio counts once per expert, even when it spans several extents of that expert
            uniq = np.unique(np.concatenate(pairs))
            bios += np.bincount(uniq % self.n_total, minlength=self.n_total)
        return by, bios, total - attributed

    def to_frame(self):
        """The index as a DataFrame (start_sector, end_sector, expert_id, layer, expert)."""
        import pandas as pd
        df = pd.DataFrame({"start_sector": self.starts, "end_sector": self.ends, "expert_id": self.experts})
        if self.n_experts:
            df["layer"] = (df["expert_id"] // self.n_experts).astype("int32")
            df["expert"] = (df["expert_id"] % self.n_experts).astype("int32")
        return df


def _clip(extents: list[Extent], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(physical byte, length, flags) of the parts of ``extents`` inside logical [lo, hi)."""
    out = []
    for x in extents:
        a, b = max(x.logical, lo), min(x.logical + x.length, hi)
        if a < b:
            out.append((x.physical + (a - x.logical), b - a, x.flags))
    return out


def _ranges_adder(dev: "BlockDevice", ranges: list, problems: dict[int, list[str]]):
    """add(eid, pieces, want): an expert's (physical, length, flags) pieces as whole-sector ranges
    on ``dev``, with what makes their device bytes unknowable."""
    def add(eid: int, pieces: list[tuple[int, int, int]], want: int) -> None:
        got = 0
        for ph, ln, fl in pieces:
            bad = fl & PROBLEM_FLAGS
            if bad:
                problems.setdefault(eid, []).append(
                    f"{ln} bytes at physical {ph}: {','.join(flag_names(bad))}")
                if fl & (FIEMAP_EXTENT_UNKNOWN | FIEMAP_EXTENT_DELALLOC | FIEMAP_EXTENT_DATA_INLINE):
                    continue  # no meaningful physical location
            s0 = ph // SECTOR
            s1 = -(-(ph + ln) // SECTOR)
            ranges.append((dev.part_start + s0, s1 - s0, eid))
            got += ln
        if got < want:
            problems.setdefault(eid, []).append(f"{want - got} of {want} bytes have no extent (hole)")
    return add


def model_extents(pmap, sync: bool = True, root: str | os.PathLike = "/",
                  device: BlockDevice | None = None) -> ExpertExtents:
    """Per expert of a model file's map (:func:`moetrace.record.poolmap.model_pool_map`) the
    sectors of the pages it alone owns (its runs); shared and non-expert pages belong to none."""
    files = pmap.model.files
    dev = device or block_device_of(files[0], root)
    ranges: list[tuple[int, int, int]] = []
    problems: dict[int, list[str]] = {}
    add = _ranges_adder(dev, ranges, problems)
    page = os.sysconf("SC_PAGE_SIZE")
    for f in files:
        st = os.stat(f)
        first, count, _b, _p = pmap.windows[st.st_ino]
        ext = fiemap(f, sync=sync)
        for r in pmap.runs[first:first + count]:
            slot = int(r["slot"])
            if slot < pmap.n_total:
                lo, hi = int(r["start"]) * page, min(st.st_size, (int(r["start"]) + int(r["pages"])) * page)
                add(slot, _clip(ext, lo, hi), hi - lo)
    return ExpertExtents.from_ranges(ranges, pmap.n_total, pmap.n_experts, dev, problems)


def pool_extents(pool: "Pool", sync: bool = True, root: str | os.PathLike = "/",
                 device: BlockDevice | None = None) -> ExpertExtents:
    """Per expert of ``pool`` its disk sector ranges, as an :class:`ExpertExtents`.

    files layout: expert e's file's extents up to its size rounded up to the filesystem
    block (the tail block belongs to that file alone); layers and pool layouts: the slice
    [offset_of(e), offset_of(e) + expert_bytes) of its file's extents, rounded out to
    whole sectors. Physical offsets are shifted by the partition start (sectors)."""
    g = pool.geometry
    dev = device or block_device_of(pool.data_paths()[0], root)
    ranges: list[tuple[int, int, int]] = []
    problems: dict[int, list[str]] = {}
    add = _ranges_adder(dev, ranges, problems)

    if pool.layout == "files":
        for eid in range(g.n_total):
            p = pool.path_of(eid)
            st = os.stat(p)
            blk = st.st_blksize or 4096
            hi = -(-st.st_size // blk) * blk
            add(eid, _clip(fiemap(p, sync=sync), 0, hi), st.st_size)
    else:  # layers, pool: each file's extents once, sliced per expert
        ext: dict[int, list] = {}
        for eid in range(g.n_total):
            f = pool.file_of(eid)
            if f not in ext:
                ext[f] = fiemap(pool.path_of(eid), sync=sync)
            lo = pool.offset_of(eid)
            add(eid, _clip(ext[f], lo, lo + g.expert_bytes), g.expert_bytes)
    return ExpertExtents.from_ranges(ranges, g.n_total, g.n_experts, dev, problems)
