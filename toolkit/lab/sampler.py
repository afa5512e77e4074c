"""The lab guest's sampler: what the kernel's reclaim did while a cell ran, from /proc and
debugfs, cheaply enough for a guest under TCG (~20x slower than native).

``with Sampler(out_dir): ...`` samples, in one background thread, on a fixed grid of ticks:

* /proc/vmstat at ``vmstat_hz`` (1 Hz): reclaim split kswapd / direct, pgrefill, refaults,
  pageoutrun, allocstall_*, the watermark checks, ... (moetrace.run.sampler.VMSTAT_COUNTERS);
* MemFree and Cached from /proc/meminfo, and each zone's free pages from /proc/buddyinfo, at
  ``memfree_hz`` (10 Hz): the free-memory sawtooth;
* ``<debugfs>/lru_gen`` at ``lru_gen_hz`` (1 Hz): every memcg's generations (debugfs is
  mounted when absent, and unmounted at the end only if the sampler mounted it);

and /proc/zoneinfo with the knobs that size the watermarks once at the start and once at the
end (zoneinfo.json: Σhigh). Files are opened once and read with pread; rows are written as the
kernel prints the numbers (no int conversion for vmstat), no pandas, no subprocess. A tick that
a slow read made late is skipped and counted (``missed_ticks``), never squeezed in. The files
and their columns are declared in :mod:`moetrace.run.sampler` (their one reader beside them).

``moetrace lab sample --out DIR -- COMMAND`` runs COMMAND inside one (:func:`run_sampled`).
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

from moetrace.errors import InputError, UsageError
from moetrace.kernel import features
from moetrace.kernel.lru_gen import parse
from moetrace.kernel.procfs import read_meminfo, read_zoneinfo, watermark_sums
from moetrace.run import documents as D
from moetrace.run import sampler as S
from moetrace.run.metadata import write_sampler_meta, write_zoneinfo_doc

# imported here, not when sampling starts: under TCG an import costs ~20x its native ~50 ms

_MONO = time.CLOCK_MONOTONIC
#: errors kept word for word in sampler.json (the rest are counted)
MAX_ERRORS = 20


def _now_ns() -> int:
    return time.clock_gettime_ns(_MONO)


def pread_all(fd: int, chunk: int = 1 << 16) -> bytes:
    """The whole of a /proc or debugfs file from offset 0 (seq_file regenerates it per read)."""
    parts, off = [], 0
    while True:
        b = os.pread(fd, chunk, off)
        if not b:
            return b"".join(parts)
        parts.append(b)
        off += len(b)


def buddy_free(data: bytes) -> dict[bytes, int]:
    """/proc/buddyinfo -> free pages per zone name, summed over the nodes: "Node 0, zone DMA32
    c0 c1 ... c10", ci free blocks of 2^i pages."""
    out: dict[bytes, int] = {}
    for ln in data.split(b"\n"):
        f = ln.split()
        if len(f) > 4 and f[0] == b"Node":
            out[f[3]] = out.get(f[3], 0) + sum(int(c) << i for i, c in enumerate(f[4:]))
    return out


@dataclass
class Stream:
    """One sampled file: its fd, its CSV, its grid of ticks and what it achieved."""

    name: str
    csv_name: str
    hz: float
    source: str | None = None
    fd: int | None = None
    out: BinaryIO | None = None
    text: io.TextIOWrapper | None = None  # lru_gen's CSV writer over ``out``
    take: Callable[[float], None] | None = None  # reads once, writes its row(s) at t seconds
    next_ns: int = 0
    samples: int = 0  # rows taken: one at the start, one per tick, one at the end
    ticks: int = 0  # of them taken on the grid by the thread
    missed: int = 0
    read_ns: int = 0
    errors: int = 0
    why_not: str | None = None

    @property
    def period_ns(self) -> int:
        return int(1e9 / self.hz)

    @property
    def on(self) -> bool:
        return self.take is not None and self.why_not is None

    def advance(self, now_ns: int) -> None:
        """The next tick on the grid after ``now_ns`` (ticks already passed are missed)."""
        self.next_ns += self.period_ns
        if self.next_ns <= now_ns:
            late = (now_ns - self.next_ns) // self.period_ns + 1
            self.missed += int(late)
            self.next_ns += int(late) * self.period_ns

    def doc(self, wall_s: float | None) -> D.SamplerStream:
        return {"file": self.csv_name, "source": self.source, "requested_hz": self.hz, "samples": self.samples,
                "ticks": self.ticks,
                "achieved_hz": (self.ticks / wall_s) if wall_s else None, "missed_ticks": self.missed,
                "read_s_mean": (self.read_ns / self.samples / 1e9) if self.samples else None,
                "available": self.why_not is None and self.take is not None, "why_not": self.why_not}


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(path: Path) -> int | None:
    t = _text(path)
    try:
        return int(t) if t is not None else None
    except ValueError:
        return None


def zoneinfo_side(root: str | os.PathLike = "/") -> D.ZoneinfoSide:
    """/proc/zoneinfo's zones, Σmin/Σlow/Σhigh over the managed zones, and the knobs that size
    the watermarks (min_free_kbytes, watermark_scale_factor, watermark_boost_factor), the page
    size, MemTotal, MGLRU's enabled / min_ttl_ms and THP's mode, read now."""
    r = Path(root)
    zones = read_zoneinfo(root)
    keep = ("node", "zone", "managed", "present", "spanned", "free", "min", "low", "high", "boost", "promo", "cma",
            "protection")
    thp = _text(r / "sys/kernel/mm/transparent_hugepage/enabled")
    side: dict[str, Any] = {"monotonic_ns": _now_ns(), "zones": [{k: z[k] for k in keep if k in z} for z in zones],
                            **watermark_sums(zones)}
    side.update(min_free_kbytes=_int(r / "proc/sys/vm/min_free_kbytes"),
                watermark_scale_factor=_int(r / "proc/sys/vm/watermark_scale_factor"),
                watermark_boost_factor=_int(r / "proc/sys/vm/watermark_boost_factor"),
                page_size_bytes=os.sysconf("SC_PAGE_SIZE"),
                mem_total_bytes=read_meminfo(root).get("MemTotal_bytes"),
                lru_gen_enabled=_text(r / "sys/kernel/mm/lru_gen/enabled"),
                min_ttl_ms=_int(r / "sys/kernel/mm/lru_gen/min_ttl_ms"),
                transparent_hugepage=(thp.split("[", 1)[1].split("]", 1)[0] if thp and "[" in thp else thp))
    return side  # type: ignore[return-value]


class Sampler:
    """Sample /proc/vmstat, MemFree and lru_gen into ``out_dir`` while the ``with`` block runs
    (module docstring). A rate of 0 switches that stream off. ``root``: a fake /proc and /sys
    tree for tests (debugfs is then never mounted). Never raises for a file the kernel lacks:
    sampler.json says what was not sampled and why."""

    def __init__(self, out_dir: os.PathLike | str, *, vmstat_hz: float = 1.0, memfree_hz: float = 10.0,
                 lru_gen_hz: float = 1.0, root: os.PathLike | str = "/"):
        for name, hz in (("vmstat_hz", vmstat_hz), ("memfree_hz", memfree_hz), ("lru_gen_hz", lru_gen_hz)):
            if not isinstance(hz, (int, float)) or hz < 0 or hz > 1000:
                raise UsageError(f"{name} must be between 0 (off) and 1000 samples per second, not {hz!r}")
        self.out = Path(out_dir)
        self.root = Path(root)
        self.streams = [Stream("vmstat", S.VMSTAT_CSV, float(vmstat_hz)),
                        Stream("memfree", S.MEMFREE_CSV, float(memfree_hz)),
                        Stream("lru_gen", S.LRU_GEN_CSV, float(lru_gen_hz))]
        self.t0_ns = 0
        self.errors: list[str] = []
        self.command: list[str] | None = None
        self.exit_status: int | None = None
        self.vmstat_columns: list[str] = []
        self.vmstat_absent: list[str] = []
        self.debugfs: D.SamplerDebugfs = {"path": None, "mounted_by_sampler": False, "note": None,
                                          "unmount_note": None}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cpu_s: float | None = None
        self._zone_start: D.ZoneinfoSide | None = None
        self._end_ns: int | None = None
        self._buddy_fd: int | None = None

    # -- the streams -------------------------------------------------------------------------

    def _error(self, s: Stream | None, text: str) -> None:
        if s is not None:
            s.errors += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(text)

    def _open(self, s: Stream, path: Path) -> bool:
        """Open ``path`` for ``s`` and its CSV; False (why_not set) when the file cannot be read."""
        s.source = str(path)
        try:
            s.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            s.why_not = f"cannot open {path}: {e.strerror}"
            return False
        s.out = open(self.out / s.csv_name, "wb")
        return True

    def _open_vmstat(self, s: Stream) -> None:
        if not self._open(s, self.root / "proc/vmstat"):
            return
        fd, out = s.fd, s.out
        names = [ln.split(b" ", 1)[0] for ln in pread_all(fd).split(b"\n") if ln]
        have = set(names)
        cols = [c.encode() for c in S.VMSTAT_COUNTERS]
        cols += [n for n in names if n.startswith(tuple(p.encode() for p in S.VMSTAT_PREFIXES))]
        self.vmstat_columns = [c.decode() for c in cols]
        self.vmstat_absent = [c.decode() for c in cols if c not in have]
        want = set(cols)
        out.write(b"t," + b",".join(cols) + b"\n")

        def take(t: float) -> None:
            vals = {}
            for ln in pread_all(fd).split(b"\n"):
                k, _, v = ln.partition(b" ")
                if k in want:
                    vals[k] = v
            out.write(b"%.4f," % t + b",".join(vals.get(c, b"") for c in cols) + b"\n")
        s.take = take

    def _open_memfree(self, s: Stream) -> None:
        if not self._open(s, self.root / "proc/meminfo"):
            return
        fd, out = s.fd, s.out
        try:  # each zone's free pages beside MemFree: kswapd balances zones, MemFree sums them all
            bfd: int | None = os.open(self.root / "proc/buddyinfo", os.O_RDONLY | os.O_CLOEXEC)
            zones = list(buddy_free(pread_all(bfd)))
        except OSError as e:
            bfd, zones = None, []
            self._error(s, f"no per-zone free pages: cannot read /proc/buddyinfo: {e.strerror}")
        self._buddy_fd = bfd
        out.write(",".join(S.MEMFREE_COLUMNS).encode() + b"".join(b",free_%s_pages" % z.lower() for z in zones)
                  + b"\n")

        def take(t: float) -> None:
            free = cached = b""
            for ln in os.pread(fd, 4096, 0).split(b"\n"):  # MemFree is line 2, Cached line 5
                if ln.startswith(b"MemFree:"):
                    free = ln.split()[1]
                elif ln.startswith(b"Cached:"):
                    cached = ln.split()[1]
                    break
            per = buddy_free(pread_all(bfd)) if bfd is not None else {}
            out.write(b"%.4f,%s,%s" % (t, free, cached) + b"".join(b",%d" % per[z] if z in per else b"," for z in zones)
                      + b"\n")
        s.take = take

    def _open_lru_gen(self, s: Stream) -> None:
        live = self.root == Path("/")
        before = len(features.mount_notes())
        dbg = features.debugfs_path(self.root, mount=live)
        if dbg is None:
            s.why_not = ("debugfs is not mounted and could not be mounted (not root?): "
                         f"`{features.DEBUGFS_MOUNT_CMD}`")
            return
        self.debugfs["path"] = str(dbg)
        if live and len(features.mount_notes()) > before:
            self.debugfs.update(mounted_by_sampler=True, note=features.mount_notes()[-1])
        if not (dbg / "lru_gen").exists():
            s.source = str(dbg / "lru_gen")
            s.why_not = "no lru_gen in debugfs: this kernel has no MGLRU (CONFIG_LRU_GEN)"
            return
        if not self._open(s, dbg / "lru_gen"):
            return
        fd, out, path = s.fd, s.out, s.source
        text = io.TextIOWrapper(out, encoding="utf-8", newline="", write_through=True)
        w = csv.writer(text, lineterminator="\n")
        w.writerow(S.LRU_GEN_COLUMNS)

        def take(t: float) -> None:
            try:
                gens = parse(pread_all(fd).decode("utf-8", "replace"), path).generations
            except InputError as e:  # a line the parser does not know: said, the sampling goes on
                self._error(s, f"lru_gen at t={t:.1f}: {e}")
                return
            ts = f"{t:.4f}"
            w.writerows([ts, g["memcg_id"], g["memcg_path"], g["node"], g["seq"], g["age_ms"], g["nr_anon_pages"],
                          g["nr_file_pages"]] for g in gens)
        s.take, s.text = take, text

    def _sample(self, s: Stream, now_ns: int) -> None:
        try:
            s.take((now_ns - self.t0_ns) / 1e9)
        except OSError as e:
            self._error(s, f"{s.name}: read failed: {e.strerror or e}")
            return
        s.samples += 1
        s.read_ns += _now_ns() - now_ns

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        cpu0 = time.thread_time()
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 (the thread's end is said in sampler.json, not lost)
            self._error(None, f"the sampling thread stopped: {type(e).__name__}: {e}")
        self._cpu_s = time.thread_time() - cpu0

    def _loop(self) -> None:
        live = [s for s in self.streams if s.on]
        flush_at = _now_ns() + 2_000_000_000
        while live and not self._stop.is_set():
            now = _now_ns()
            for s in live:
                if now >= s.next_ns:
                    self._sample(s, now)
                    s.ticks += 1
                    s.advance(_now_ns())
            if now >= flush_at:
                self._flush()
                flush_at = now + 2_000_000_000
            wait = (min(s.next_ns for s in live) - _now_ns()) / 1e9
            if wait > 0:
                self._stop.wait(wait)

    def _flush(self) -> None:
        for s in self.streams:
            if s.out is not None and not s.out.closed:
                try:
                    s.out.flush()
                except OSError as e:
                    self._error(s, f"{s.name}: write failed: {e.strerror or e}")

    def __enter__(self) -> "Sampler":
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / S.SAMPLER_JSON).touch()
        except OSError as e:
            raise UsageError(f"cannot write the sampler directory {self.out}: {e.strerror or e}",
                             hint="give --out a writable directory (in a lab guest: under /tmp/lab)") from None
        self.t0_ns = _now_ns()
        try:
            self._zone_start = zoneinfo_side(self.root)
        except OSError as e:
            self._error(None, f"zoneinfo at the start: {e}")
        self._write_zoneinfo(None)
        opens = {"vmstat": self._open_vmstat, "memfree": self._open_memfree, "lru_gen": self._open_lru_gen}
        for s in self.streams:
            if s.hz <= 0:
                s.why_not = "switched off (rate 0)"
                continue
            opens[s.name](s)
            if s.on:
                now = _now_ns()
                self._sample(s, now)  # a row at t ~ 0, before the work starts
                s.next_ns = self.t0_ns + s.period_ns
        self._flush()
        self.write_meta(complete=False)
        self._thread = threading.Thread(target=self._run, name="moetrace-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for s in self.streams:
            if s.on:
                self._sample(s, _now_ns())  # a row at the end, after the work
        self._end_ns = _now_ns()
        for s in self.streams:
            if s.out is not None:
                try:
                    (s.text or s.out).close()
                except OSError as e:
                    self._error(s, f"{s.name}: write failed: {e.strerror or e}")
            if s.fd is not None:
                os.close(s.fd)
                s.fd = None
        if self._buddy_fd is not None:
            os.close(self._buddy_fd)
            self._buddy_fd = None
        end = None
        try:
            end = zoneinfo_side(self.root)
        except OSError as e:
            self._error(None, f"zoneinfo at the end: {e}")
        self._write_zoneinfo(end)
        if self.debugfs["mounted_by_sampler"]:
            self.debugfs["unmount_note"] = "; ".join(features.unmount_ours(only=self.debugfs["path"]))
        self.write_meta(complete=True)

    # -- the documents ----------------------------------------------------------------------

    def _write_zoneinfo(self, end: D.ZoneinfoSide | None) -> None:
        if self._zone_start is None:
            return
        doc: D.ZoneinfoDoc = {"schema": D.SAMPLER_SCHEMA, "start": self._zone_start, "end": end}
        write_zoneinfo_doc(self.out / S.ZONEINFO_JSON, doc)

    def write_meta(self, complete: bool) -> None:
        """sampler.json as things stand (written at the start, complete=False, and at the end)."""
        wall = (self._end_ns - self.t0_ns) / 1e9 if self._end_ns else None
        doc: D.SamplerMeta = {
            "schema": D.SAMPLER_SCHEMA, "t0_monotonic_ns": self.t0_ns, "end_monotonic_ns": self._end_ns,
            "wall_s": wall, "complete": complete, "kernel_release": os.uname().release,
            "streams": {s.name: s.doc(wall) for s in self.streams}, "vmstat_columns": self.vmstat_columns,
            "vmstat_absent": self.vmstat_absent, "debugfs": self.debugfs, "cpu_s": self._cpu_s,
            "cpu_share": (self._cpu_s / wall) if (self._cpu_s is not None and wall) else None,
            "errors": list(self.errors)}
        if self.command is not None:
            doc.update(command=self.command, exit_status=self.exit_status)
        write_sampler_meta(self.out / S.SAMPLER_JSON, doc)


def run_sampled(out_dir: os.PathLike | str, argv: list[str], **rates: float) -> int:
    """`moetrace lab sample`: run ``argv`` inside a :class:`Sampler` writing ``out_dir``; its
    exit status (127: not found, 126: not executable; -N as 128 + N for a signal)."""
    if not argv:
        raise UsageError("no command to run", hint="moetrace lab sample --out DIR -- COMMAND [ARGS...]")
    with Sampler(out_dir, **rates) as smp:
        smp.command = list(argv)
        try:
            rc = subprocess.run(argv).returncode
        except FileNotFoundError:
            rc = 127
        except PermissionError:
            rc = 126
        smp.exit_status = rc if rc >= 0 else 128 - rc
    return smp.exit_status


__all__ = ["Sampler", "run_sampled", "zoneinfo_side", "pread_all", "buddy_free"]
