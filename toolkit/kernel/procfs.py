"""Readers of the kernel's own counters, for cell snapshots (pre / loop entry / post).

Every reader takes ``root=`` ("/" by default): the path under which ``proc/``,
``sys/`` and ``dev/`` are looked up, so tests pass a fake tree (the no-kernel tier, tests/unit).
Values are returned as the kernel states them, converted only where the unit is
explicit (meminfo ``kB`` -> bytes: keys end in ``_bytes``); nothing is clamped.

* :func:`read_diskstats`  /proc/diskstats, per device (sectors are 512 bytes)
* :func:`read_vmstat`     /proc/vmstat (pgpgin/pgpgout are KiB)
* :func:`read_meminfo`    /proc/meminfo -> bytes
* :func:`read_psi`        /proc/pressure/{cpu,memory,io}
* :func:`read_zoneinfo`   /proc/zoneinfo: each zone's watermarks, managed pages, protection
* :func:`read_lru_gen`    <debugfs>/lru_gen when MGLRU is built (debugfs found via /proc/mounts)
* :func:`read_vmlck`      /proc/PID/status VmLck -> bytes
* :class:`KernelLog`      /dev/kmsg records after a mark (``dmesg`` as a fallback)
* :func:`device_of`       the block device (and its whole disk) holding a file
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from moetrace.errors import InputError

SECTOR_BYTES = 512

DISKSTATS_FIELDS = (
    "reads_completed", "reads_merged", "sectors_read", "read_ms",
    "writes_completed", "writes_merged", "sectors_written", "write_ms",
    "ios_in_progress", "io_ms", "weighted_io_ms",
    "discards_completed", "discards_merged", "sectors_discarded", "discard_ms",
    "flushes_completed", "flush_ms",
)


def _p(root: str | os.PathLike, *parts: str) -> Path:
    return Path(root).joinpath(*[p.lstrip("/") for p in parts])


def _read_text(path: Path) -> str:
    with open(path, "r", errors="replace") as fh:
        return fh.read()


# -- /proc/diskstats ---------------------------------------------------------------------------

def parse_diskstats(text: str) -> dict[str, dict[str, int]]:
    """Parse /proc/diskstats text: {device name: {major, minor, field: value}}.

    Older kernels print 11 or 15 counters, newer 17: absent fields are absent
    (never 0)."""
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) < 4:
            continue
        row = {"major": int(f[0]), "minor": int(f[1])}
        for name, val in zip(DISKSTATS_FIELDS, f[3:]):
            row[name] = int(val)
        out[f[2]] = row
    return out


def read_diskstats(root: str | os.PathLike = "/", device: str | None = None) -> dict[str, Any]:
    """/proc/diskstats: every device, or only ``device`` ({field: value})."""
    stats = parse_diskstats(_read_text(_p(root, "proc/diskstats")))
    if device is None:
        return stats
    if device not in stats:
        raise InputError(f"device {device!r} is not in /proc/diskstats", path=str(_p(root, "proc/diskstats")),
                         hint="name a block device as `lsblk -o NAME` lists it (e.g. vda, nvme0n1p1)")
    return stats[device]


# -- /proc/vmstat, /proc/meminfo ---------------------------------------------------------------

def read_vmstat(root: str | os.PathLike = "/", keys: Iterable[str] | None = None,
                refresh: bool = False) -> dict[str, int]:
    """/proc/vmstat as {name: value} (pgpgin/pgpgout are in KiB, the rest mostly pages/events);
    only ``keys`` when given (absent ones are left out). ``refresh`` folds the per-CPU
    node-stat deltas first (/proc/sys/vm/stat_refresh, live root only, when writable):
    workingset_* are node stats that lag by up to a per-CPU batch otherwise."""
    if refresh and Path(root) == Path("/"):
        try:
            Path("/proc/sys/vm/stat_refresh").write_text("1\n")
        except OSError:
            pass
    want = None if keys is None else set(keys)
    out: dict[str, int] = {}
    for line in _read_text(_p(root, "proc/vmstat")).splitlines():
        f = line.split()
        if len(f) == 2 and (want is None or f[0] in want):
            out[f[0]] = int(f[1])
    return out


def read_meminfo(root: str | os.PathLike = "/") -> dict[str, int]:
    """/proc/meminfo: ``<Name>_bytes`` for kB lines, ``<Name>`` for unitless counts (HugePages_*)."""
    out: dict[str, int] = {}
    for line in _read_text(_p(root, "proc/meminfo")).splitlines():
        m = re.match(r"^([^:]+):\s+(\d+)\s*(kB)?\s*$", line)
        if not m:
            continue
        name, val, unit = m.group(1), int(m.group(2)), m.group(3)
        name = name.replace("(", "_").replace(")", "")
        if unit:
            out[f"{name}_bytes"] = val * 1024
        else:
            out[name] = val
    return out


# -- /proc/zoneinfo ---------------------------------------------------------------------------

#: a zone's page counts in /proc/zoneinfo (zoneinfo_show_print: "pages free", then one per line;
#: ``promo`` since 6.2's memory tiering, ``boost`` since 5.0): their names here, as printed
ZONE_FIELDS = ("free", "boost", "min", "low", "high", "promo", "spanned", "present", "managed", "cma")


def parse_zoneinfo(text: str) -> list[dict[str, Any]]:
    """/proc/zoneinfo text -> one dict per zone: ``node``, ``zone`` (DMA, DMA32, Normal, Movable,
    ...), the ZONE_FIELDS it prints (pages; ``min``/``low``/``high`` are the watermarks with any
    boost included, as the kernel's high_wmark_pages() counts them) and ``protection`` (the
    lowmem_reserve list, pages). A zone the kernel prints without a field has no such key; the
    per-CPU pagesets' ``high:`` lines and the node's statistics are skipped."""
    zones: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for line in text.splitlines():
        m = re.match(r"^Node\s+(\d+),\s+zone\s+(\S+)", line)
        if m:
            cur = {"node": int(m.group(1)), "zone": m.group(2)}
            zones.append(cur)
            continue
        if cur is None:
            continue
        f = line.split()
        if len(f) == 3 and f[0] == "pages" and f[1] == "free":
            cur["free"] = int(f[2])
        elif len(f) == 2 and f[0] in ZONE_FIELDS and f[1].isdigit() and f[0] not in cur:
            cur[f[0]] = int(f[1])
        elif f and f[0] == "protection:":
            cur["protection"] = [int(x) for x in re.findall(r"\d+", line.partition(":")[2])]
    return zones


def read_zoneinfo(root: str | os.PathLike = "/") -> list[dict[str, Any]]:
    """/proc/zoneinfo (:func:`parse_zoneinfo`)."""
    return parse_zoneinfo(_read_text(_p(root, "proc/zoneinfo")))


def watermark_sums(zones: list[dict[str, Any]]) -> dict[str, int]:
    """``sum_min_pages``, ``sum_low_pages``, ``sum_high_pages`` over the zones with managed pages
    (the zones kswapd balances: managed_zone()), and ``managed_pages`` summed. Σhigh is what a
    6.8 kswapd pass asks of a node in one go (kswapd_shrink_node's nr_to_reclaim)."""
    live = [z for z in zones if z.get("managed", 0) > 0]
    return {"sum_min_pages": sum(z.get("min", 0) for z in live), "sum_low_pages": sum(z.get("low", 0) for z in live),
            "sum_high_pages": sum(z.get("high", 0) for z in live),
            "managed_pages": sum(z["managed"] for z in live)}


# -- /proc/pressure ----------------------------------------------------------------------------

def read_psi(root: str | os.PathLike = "/") -> dict[str, dict[str, dict[str, float]]] | None:
    """/proc/pressure/{cpu,memory,io}: {resource: {"some"|"full": {avg10, avg60, avg300, total_us}}}.

    None when the kernel has no PSI (no /proc/pressure)."""
    d = _p(root, "proc/pressure")
    if not d.is_dir():
        return None
    out: dict[str, dict[str, dict[str, float]]] = {}
    for res in ("cpu", "memory", "io"):
        f = d / res
        try:
            text = _read_text(f)
        except OSError:
            continue
        out[res] = parse_psi(text)
    return out


def parse_psi(text: str) -> dict[str, dict[str, float]]:
    """One pressure file (/proc/pressure/memory, a cgroup's memory.pressure):
    {"some"|"full": {avg10, avg60, avg300, total_us}}."""
    rows: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        vals: dict[str, float] = {}
        for kv in parts[1:]:
            k, _, v = kv.partition("=")
            if k == "total":
                vals["total_us"] = int(v)
            else:
                vals[k] = float(v)
        rows[parts[0]] = vals
    return rows


# -- mounts, debugfs, MGLRU --------------------------------------------------------------------

@dataclass(frozen=True)
class Mount:
    """One /proc/mounts line."""

    source: str
    target: str
    fstype: str
    options: tuple[str, ...]


def read_mounts(root: str | os.PathLike = "/") -> list[Mount]:
    """/proc/mounts (octal escapes such as \\040 decoded)."""
    out = []
    for line in _read_text(_p(root, "proc/mounts")).splitlines():
        f = line.split()
        if len(f) < 4:
            continue
        dec = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), x) for x in f[:4]]
        out.append(Mount(dec[0], dec[1], dec[2], tuple(dec[3].split(","))))
    return out


def find_mount(fstype: str, root: str | os.PathLike = "/") -> str | None:
    """The first mount point of a filesystem type (e.g. "debugfs", "tracefs"), or None."""
    for m in read_mounts(root):
        if m.fstype == fstype:
            return m.target
    return None


def parse_lru_gen(text: str) -> list[dict[str, Any]]:
    """Parse <debugfs>/lru_gen (or lru_gen_full): one row per (memcg, node, generation).

    Columns: memcg_id, memcg_path, node, seq, age_ms, nr_anon, nr_file (pages). The one
    parser is :func:`moetrace.kernel.lru_gen.parse`; a snapshot is best effort, so text it
    refuses gives no rows here (the mglru probe reports the line)."""
    from moetrace.errors import InputError
    from moetrace.kernel.lru_gen import parse

    try:
        sample = parse(text)
    except InputError:
        return []
    return [{"memcg_id": g["memcg_id"], "memcg_path": g["memcg_path"], "node": g["node"], "seq": g["seq"],
             "age_ms": g["age_ms"], "nr_anon": g["nr_anon_pages"], "nr_file": g["nr_file_pages"]}
            for g in sample.generations]


def read_lru_gen(root: str | os.PathLike = "/") -> list[dict[str, Any]] | None:
    """MGLRU generations from <debugfs>/lru_gen, or None when debugfs is not mounted or
    the kernel has no MGLRU (``mount -t debugfs none /sys/kernel/debug`` mounts it)."""
    dbg = find_mount("debugfs", root)
    if dbg is None:
        return None
    f = _p(root, dbg, "lru_gen")
    try:
        return parse_lru_gen(_read_text(f))
    except OSError:
        return None


# -- /proc/PID/status --------------------------------------------------------------------------

def read_status(pid: int, root: str | os.PathLike = "/") -> dict[str, str]:
    """/proc/PID/status as {field: raw value text}."""
    out = {}
    for line in _read_text(_p(root, f"proc/{pid}/status")).splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def read_vmlck(pid: int, root: str | os.PathLike = "/") -> int | None:
    """VmLck of a process in bytes; None if the process is gone (kernel threads have none)."""
    try:
        st = read_status(pid, root)
    except (FileNotFoundError, ProcessLookupError):
        return None
    v = st.get("VmLck")
    if v is None:
        return None
    num, _, unit = v.partition(" ")
    return int(num) * (1024 if unit.strip() == "kB" else 1)


# -- kernel log --------------------------------------------------------------------------------

_KMSG = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;(.*)$")


@dataclass(frozen=True)
class KmsgRecord:
    """One kernel log record: priority/facility, sequence number, µs since boot, text."""

    prio: int
    seq: int
    usec: int
    text: str


def parse_kmsg(data: bytes | str) -> list[KmsgRecord]:
    """Parse /dev/kmsg records ("prio,seq,usec,flags;text"); continuation lines
    (" KEY=value") are skipped."""
    if isinstance(data, bytes):
        data = data.decode("utf-8", "replace")
    out = []
    for line in data.splitlines():
        m = _KMSG.match(line)
        if m:
            out.append(KmsgRecord(int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)))
    return out


def read_kmsg(root: str | os.PathLike = "/") -> list[KmsgRecord] | None:
    """Every record /dev/kmsg still holds (non-blocking), or None if it cannot be read."""
    path = _p(root, "dev/kmsg")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    chunks: list[bytes] = []
    try:
        while True:
            try:
                b = os.read(fd, 65536)
            except BlockingIOError:
                break
            except BrokenPipeError:  # a record was overwritten while we read: go on
                continue
            except OSError:
                break
            if not b:
                break
            chunks.append(b if b.endswith(b"\n") else b + b"\n")
    finally:
        os.close(fd)
    return parse_kmsg(b"".join(chunks))


class KernelLog:
    """Kernel log lines since a mark: ``log = KernelLog(); ...; log.since(pattern)``.

    Reads /dev/kmsg (sequence numbers mark the position); where it cannot be read,
    falls back to ``dmesg`` (monotonic timestamps mark the position) and finally
    reports ``source = None``."""

    def __init__(self, root: str | os.PathLike = "/"):
        self.root = root
        recs = read_kmsg(root)
        if recs is not None:
            self.source: str | None = "kmsg"
            self.mark = recs[-1].seq if recs else -1
        elif str(root) == "/" and self._dmesg() is not None:
            self.source = "dmesg"
            self.mark = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        else:
            self.source, self.mark = None, -1

    @staticmethod
    def _dmesg() -> list[KmsgRecord] | None:
        try:
            r = subprocess.run(["dmesg", "-r", "--time-format", "raw"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        if r.returncode != 0:
            return None
        out = []
        for line in r.stdout.splitlines():
            m = re.match(r"^<(\d+)>\[\s*([0-9.]+)\]\s?(.*)$", line)
            if m:
                out.append(KmsgRecord(int(m.group(1)), -1, int(float(m.group(2)) * 1e6), m.group(3)))
        return out

    def records(self) -> list[KmsgRecord]:
        """Records logged after the mark."""
        if self.source == "kmsg":
            return [r for r in (read_kmsg(self.root) or []) if r.seq > self.mark]
        if self.source == "dmesg":
            return [r for r in (self._dmesg() or []) if r.usec > self.mark]
        return []

    def since(self, pattern: str = r"oom|out of memory|memory cgroup|killed process|mlock") -> list[str]:
        """Texts of records after the mark that match ``pattern`` (case-insensitive)."""
        rx = re.compile(pattern, re.I)
        return [r.text for r in self.records() if rx.search(r.text)]


# -- block device of a file --------------------------------------------------------------------

@dataclass(frozen=True)
class BlockDevice:
    """The block device holding a file: ``name`` as /proc/diskstats lists it, and
    ``disk``, its whole-disk parent (== name when it is not a partition)."""

    name: str
    disk: str
    major: int
    minor: int


def block_device(major: int, minor: int, root: str | os.PathLike = "/") -> BlockDevice:
    """Resolve MAJ:MIN through /sys/dev/block to a device name and its whole disk."""
    link = _p(root, f"sys/dev/block/{major}:{minor}")
    if not os.path.lexists(link):
        raise InputError(f"no block device {major}:{minor} in /sys/dev/block",
                         hint="the file lives on a filesystem without a block device (tmpfs, overlay, "
                              "a network or btrfs subvolume); put the pool on a disk-backed filesystem")
    target = Path(os.path.normpath(os.path.join(os.path.dirname(link), os.readlink(link)))) \
        if os.path.islink(link) else Path(link)
    name = target.name
    disk = target.parent.name if (target / "partition").exists() else name
    return BlockDevice(name, disk, major, minor)


def device_of(path: str | os.PathLike, root: str | os.PathLike = "/") -> BlockDevice:
    """The block device holding ``path`` (via st_dev -> /sys/dev/block/MAJ:MIN)."""
    st = os.stat(path)
    return block_device(os.major(st.st_dev), os.minor(st.st_dev), root)


# -- one snapshot ------------------------------------------------------------------------------

def take_snapshot(label: str, root: str | os.PathLike = "/", device: str | None = None,
                  pids: dict[str, int] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One JSON-able snapshot: monotonic/realtime clocks, diskstats (``device`` only
    when given), vmstat, meminfo, PSI, lru_gen (None when absent), VmLck of each
    named pid, plus ``extra`` (e.g. the memory scope's counters)."""
    snap: dict[str, Any] = {
        "label": label,
        "monotonic_ns": time.clock_gettime_ns(time.CLOCK_MONOTONIC),
        "realtime_ns": time.time_ns(),
        "diskstats": read_diskstats(root, device) if device else read_diskstats(root),
        "vmstat": read_vmstat(root, refresh=True),
        "meminfo": read_meminfo(root),
        "psi": read_psi(root),
        "lru_gen": read_lru_gen(root),
        "vmlck_bytes": {k: read_vmlck(p, root) for k, p in (pids or {}).items()},
    }
    if extra:
        snap.update(extra)
    return snap


def delta(a: dict[str, int], b: dict[str, int], keys: Iterable[str] | None = None) -> dict[str, int]:
    """b - a for numeric counters present in both (absent stays absent)."""
    ks = keys if keys is not None else [k for k in b if k in a]
    return {k: b[k] - a[k] for k in ks if k in a and k in b
            and isinstance(a[k], (int, float)) and isinstance(b[k], (int, float))}
