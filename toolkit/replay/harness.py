"""The replay harness: read a plan's experts from a pool, layer by layer, and time it.

For every replayed pass over the plan (``warmup`` warm-up passes, then
``passes`` measured passes) every iteration of the plan is replayed in order:
each of its plan passes, each non-empty layer in layer order, the layer's
experts split dynamically across ``threads`` reader threads; every read of
layer l completes before layer l+1 starts. Each access is one copy into the
reading thread's preallocated, page-aligned buffer (no per-read allocation):

``pagecache``  ``os.preadv`` through the page cache (the GIL is released in
               the syscall, so 8 Python threads keep up with fio).
``mmap``       each pool file mapped once; an access copies the expert's bytes
               from the mapping (every page is touched) with a GIL-free memmove.
``direct``     ``O_DIRECT`` preads of the expert rounded up to the page (the
               stand-in for an engine's F_NOCACHE reader): every pass reads
               every byte from the device.
``pinned``     the top experts by frequency (the plan's own counts, the paper's
               oracle, or another trace's) preloaded into one mlocked anonymous
               arena; a hit is a memmove from the arena, a miss a page-cache
               pread. VmLck is verified after the preload, which is timed
               separately and excluded from every iteration.
``hybrid``     the same mechanism with the arena given by the caller as a
               fraction of a budget (the cell computes it); the label differs.

Prefetch advisor (paper §7): one worker thread with one overwritable slot.
After a layer is read the plan's hint set issued by that layer (the experts
predicted for the next non-empty slot) is put into the slot; putting into a
full slot replaces the waiting set and counts it *overwritten*. The worker
takes a set and issues ``posix_fadvise(WILLNEED)`` per expert (``fadvise``) or
a blocking pread into its own buffer (``pread``); a finished set counts
*completed*. At the end the slot is drained, so submitted = completed +
overwritten. Arena experts are never hinted.

Outputs (when a run directory is given): ``iterations.parquet``, one row per
iteration per replayed pass, and ``replay.json``, the summary (see
:data:`ITERATION_COLUMNS` and :func:`summarize`). Both are written atomically;
an interrupted replay writes what it has with ``"complete": false``.

Clock: ``time.monotonic_ns()`` (CLOCK_MONOTONIC), the clock the recorder uses.
"""

from __future__ import annotations

import array
import ctypes
import errno as _errno
import itertools
import json
import mmap
import os
import resource
import select
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from moetrace import __version__
from moetrace.atomic import atomic_write
from moetrace.jsonutil import json_default
from moetrace.kernel.syscalls import MAP_FAILED, libc
from moetrace.errors import InputError, MoetraceError, ReplayInterrupted, SignalReceived, UsageError
from moetrace.inputs.geometry import format_bytes
from moetrace.inputs.plan import FlatPlan, load_flat_plan  # noqa: F401  (re-exported)

MODES = ("pagecache", "mmap", "direct", "pinned", "hybrid")
PREFETCH = ("none", "fadvise", "pread")
from moetrace.run.replaylog import ITERATIONS_FILE, RUN_DIR_ENV, SUMMARY_FILE  # noqa: E402,F401  (the run directory contract)
from moetrace.run.documents import REPLAY_SCHEMA  # noqa: E402  (declared with replay.json)
from moetrace.run.tables import TABLES  # noqa: E402
PDEATHSIG_ENV = "MOETRACE_PDEATHSIG"
PAGE = mmap.PAGESIZE
ALIGN = 4096  # O_DIRECT alignment: a multiple of every logical block size in use (512, 4096)

#: iterations.parquet columns (name, arrow type), from the table's declaration (moetrace.run.tables)
ITERATION_COLUMNS = tuple((c.name, c.dtype) for c in TABLES["iterations"])

_MADV_RANDOM = 1
_memmove = ctypes.memmove  # a ctypes foreign call: the GIL is released during the copy


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _mlock(addr: int, length: int) -> None:
    """mlock(2) via libc; raises MoetraceError naming the limit that refused it."""
    if libc.mlock(addr, length) == 0:
        return
    err = ctypes.get_errno()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lim = "unlimited" if soft == resource.RLIM_INFINITY else format_bytes(soft)
    what = f"mlock of the {format_bytes(length)} arena failed ({_errno.errorcode.get(err, err)}: {os.strerror(err)})"
    if err == _errno.EPERM:
        raise MoetraceError(f"{what}: RLIMIT_MEMLOCK is {lim} and the process lacks CAP_IPC_LOCK",
                            hint="run as root, or raise the limit (`ulimit -l unlimited`, "
                                 "LimitMEMLOCK= in a systemd unit)")
    if err == _errno.ENOMEM:
        raise MoetraceError(f"{what}: over RLIMIT_MEMLOCK ({lim}) for an unprivileged process, or the memory "
                            f"cgroup limit / free memory cannot hold the arena",
                            hint="raise `ulimit -l`, run as root, or give the memory cgroup more than the arena "
                                 "(memory.max / memory.limit_in_bytes); or use a smaller --arena-bytes")
    raise MoetraceError(f"{what}: some pages could not be locked",
                        hint="free memory, or use a smaller --arena-bytes")


def read_vmlck(pid: int | str = "self") -> int:
    """VmLck of a process in bytes, from /proc/<pid>/status (0 when it has none)."""
    from moetrace.kernel.procfs import read_vmlck as _read

    return _read(pid) or 0


def frequency_table(source: str, plan: FlatPlan, n_layers: int, n_experts: int) -> np.ndarray:
    """Accesses per expert_id: 'oracle' = the plan's own counts, else counted from a
    trace (.jsonl / .parquet) or a plan.bin of the same geometry."""
    n_total = n_layers * n_experts
    if source == "oracle":
        return plan.counts(n_total)
    if not os.path.isfile(source):
        raise InputError("no such frequency-table file", path=source,
                         hint="pass --freq-table oracle, or a trace (.jsonl/.parquet) or plan.bin")
    from moetrace.inputs.accesses import load_accesses

    acc = load_accesses(source, k=plan.header.k, n_layers=n_layers, n_experts=n_experts)
    if (acc.n_layers, acc.n_experts) != (n_layers, n_experts):
        raise UsageError(f"--freq-table {source} is {acc.n_layers}x{acc.n_experts}, the plan "
                         f"{n_layers}x{n_experts}", hint="count from a trace of the same geometry")
    return np.bincount(acc.expert_id.astype(np.int64), minlength=n_total)


def choose_arena(counts: np.ndarray, n_arena: int) -> np.ndarray:
    """The n_arena expert ids with the highest counts (ties by lower id), sorted by id."""
    order = np.lexsort((np.arange(counts.size), -counts.astype(np.int64)))
    return np.sort(order[:n_arena])


# ---------------------------------------------------------------------------
# threads


class _Worker:
    """A reader thread's state: its page-aligned buffer and counters."""

    __slots__ = ("buf", "mv", "addr", "iov", "chunks", "reads", "bytes", "hits")

    def __init__(self, size: int, read_len: int, read_size: int | None):
        self.buf = mmap.mmap(-1, max(size, PAGE))
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.mv = memoryview(self.buf)
        self.iov = [self.mv[:read_len]]
        self.chunks = None
        if read_size and read_size < read_len:
            self.chunks = [(self.mv[o:min(o + read_size, read_len)], o) for o in range(0, read_len, read_size)]
        self.reads = self.bytes = self.hits = 0

    def close(self) -> None:
        self.iov = self.chunks = None
        self.mv.release()
        # the ctypes export from from_buffer keeps the mapping alive until collected
        try:
            self.buf.close()
        except BufferError:
            pass


class _ThreadPool:
    """T reader threads: the calling (main) thread and T-1 workers woken per layer
    through per-thread locks (the cheapest handoff in CPython). Items of a layer
    are taken dynamically with an atomic counter; the caller reads too, so a
    layer costs T-1 wake-ups and at most one wait."""

    def __init__(self, workers: list[_Worker]):
        self.workers = workers
        self._go = [threading.Lock() for _ in workers[1:]]
        for g in self._go:
            g.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._items: list = []
        self._fn: Callable = None
        self._next = itertools.count()
        self._fin = itertools.count(1)
        self._k = 0
        self._stop = False
        self.abort = False
        self.error: BaseException | None = None
        self._threads = [threading.Thread(target=self._loop, args=(i,), name=f"replay-{i + 1}", daemon=True)
                         for i in range(len(self._go))]
        for t in self._threads:
            t.start()

    def run(self, items: list, fn: Callable[[_Worker, int], None]) -> None:
        """Run fn(worker, item) for every item across the threads; return when all are done."""
        n = len(items)
        if n == 0 or self.abort:
            return
        k = min(n, len(self.workers)) - 1  # workers to wake besides the caller
        self._items, self._fn, self._k = items, fn, k
        nxt = self._next = itertools.count()
        self._fin = itertools.count(1)
        go = self._go
        for i in range(k):
            go[i].release()
        self._drain(self.workers[0], items, fn, nxt)
        if k:
            self._done.acquire()
        if self.error is not None:
            raise self.error

    def _drain(self, w: "_Worker", items: list, fn: Callable[["_Worker", int], None], nxt) -> None:
        """Take items off the shared counter until none is left or a thread failed; the first
        error is kept for run() to raise in the calling thread."""
        n = len(items)
        try:
            while not self.abort:
                j = next(nxt)
                if j >= n:
                    break
                fn(w, items[j])
        except BaseException as e:
            if self.error is None:
                self.error = e
            self.abort = True

    def _loop(self, i: int) -> None:
        go, w = self._go[i], self.workers[i + 1]
        while True:
            go.acquire()
            if self._stop:
                return
            self._drain(w, self._items, self._fn, self._next)
            if next(self._fin) == self._k:
                self._done.release()

    def close(self) -> None:
        self._stop = True
        for g in self._go:
            try:
                g.release()
            except RuntimeError:
                pass
        for t in self._threads:
            t.join(timeout=30)


class PrefetchAdvisor:
    """One bounded worker with one overwritable slot (paper §7).

    put() replaces a waiting hint set (counted overwritten); the worker issues
    posix_fadvise(WILLNEED) per expert ('fadvise') or a blocking pread into its
    own buffer ('pread'), and counts the set completed. close() drains the slot.
    """

    def __init__(self, kind: str, locate: Callable[[int], tuple[int, int]], expert_bytes: int,
                 buffer_bytes: int, skip: Callable[[int], bool] | None = None):
        if kind not in ("fadvise", "pread"):
            raise UsageError(f"unknown prefetch kind {kind!r}")
        self.kind = kind
        self._locate = locate
        self._eb = expert_bytes
        self._skip = skip
        self._cv = threading.Condition()
        self._slot: list[int] | None = None
        self._closing = False
        self._closed = False
        self.submitted = self.overwritten = self.completed = 0
        self.experts_issued = 0
        self.error: BaseException | None = None
        self._buf = mmap.mmap(-1, max(buffer_bytes, PAGE)) if kind == "pread" else None
        self._iov = [memoryview(self._buf)[:expert_bytes]] if self._buf is not None else None
        self._thread = threading.Thread(target=self._run, name="replay-prefetch", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Hint sets waiting in the slot or being worked on."""
        return self.submitted - self.completed - self.overwritten

    def put(self, ids: list[int]) -> None:
        """Put a hint set into the slot, overwriting a set still waiting there."""
        with self._cv:
            self.submitted += 1
            if self._slot is not None:
                self.overwritten += 1
            self._slot = ids
            self._cv.notify()

    def _run(self) -> None:
        fadv = os.posix_fadvise
        willneed = os.POSIX_FADV_WILLNEED
        while True:
            with self._cv:
                while self._slot is None and not self._closing:
                    self._cv.wait()
                if self._slot is None:
                    return
                ids, self._slot = self._slot, None
            try:
                for eid in ids:
                    if self._skip is not None and self._skip(eid):
                        continue
                    fd, off = self._locate(eid)
                    if self.kind == "fadvise":
                        fadv(fd, off, self._eb, willneed)
                    else:
                        os.preadv(fd, self._iov, off)
                    self.experts_issued += 1
            except OSError as e:
                if self.error is None:
                    self.error = e
            with self._cv:
                self.completed += 1

    def close(self) -> None:
        """Let the worker finish the set in the slot, then stop it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout=120)
        if self._iov:
            self._iov[0].release()
            self._iov = None
        if self._buf is not None:
            self._buf.close()


# ---------------------------------------------------------------------------
# the replay


@dataclass
class ReplayOptions:
    """What `replay` does; the CLI options one to one."""

    mode: str = "pagecache"
    threads: int = 8
    warmup: int = 1
    passes: int = 1
    arena_bytes: int | None = None
    freq_table: str = "oracle"
    prefetch: str = "none"
    fadvise_random: bool = False
    read_size: int | None = None  # bytes per read call; None = the whole expert in one call
    run_dir: str | None = None
    sync_fd: int | None = None
    #: a measured window of this many seconds: after the ``passes`` whole measured passes, more
    #: measured passes until the time is up (the last one stops after the iteration that passes it)
    duration_s: float | None = None

    def check(self) -> None:
        """Raise UsageError for contradictory options."""
        if self.mode not in MODES:
            raise UsageError(f"unknown mode {self.mode!r}", hint=f"one of {', '.join(MODES)}")
        if self.prefetch not in PREFETCH:
            raise UsageError(f"unknown prefetch {self.prefetch!r}", hint=f"one of {', '.join(PREFETCH)}")
        if self.threads < 1:
            raise UsageError("--threads must be >= 1")
        if self.warmup < 0 or self.passes < 1:
            raise UsageError("--warmup must be >= 0 and --passes >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise UsageError(f"--duration must be > 0 seconds, not {self.duration_s}")
        if self.mode in ("pinned", "hybrid"):
            if self.arena_bytes is None:
                raise UsageError(f"--mode {self.mode} needs --arena-bytes SIZE",
                                 hint="e.g. --arena-bytes 512MiB (whole experts are locked)")
        elif self.arena_bytes is not None:
            raise UsageError("--arena-bytes applies to --mode pinned or hybrid only")
        if self.mode == "direct" and self.prefetch != "none":
            raise UsageError("--prefetch fills the page cache, which --mode direct bypasses",
                             hint="use --mode pagecache (or mmap, pinned, hybrid) with --prefetch")
        if self.read_size is not None:
            if self.read_size <= 0 or (self.mode == "direct" and self.read_size % ALIGN):
                raise UsageError(f"--read-size must be > 0 (a multiple of {ALIGN} with --mode direct)")


@dataclass
class ReplayResult:
    """What a replay produced: the summary (replay.json) and the iteration log columns."""

    summary: dict
    rows: dict = field(default_factory=dict)


class Replayer:
    """One replay of a FlatPlan against an opened Pool (see the module docstring).

    Use as a context manager: opening pool files, mapping, arena allocation and
    preload happen in prepare(); close() releases everything (fds, mappings,
    the arena, threads) on every path.
    """

    def __init__(self, plan: FlatPlan, pool, opts: ReplayOptions):
        opts.check()
        self.plan, self.pool, self.opts = plan, pool, opts
        g = pool.geometry
        h = plan.header
        if (h.n_layers, h.n_experts) != (g.n_layers, g.n_experts):
            raise UsageError(f"the plan is {h.n_layers} layers x {h.n_experts} experts but the pool {pool.root} "
                             f"is {g.n_layers} x {g.n_experts}",
                             hint="compile the plan with the pool's geometry (`moetrace plan compile --geometry "
                                  "... --experts ...`) or use the matching pool")
        if h.expert_bytes and h.expert_bytes != g.expert_bytes:
            raise UsageError(f"the plan's expert_bytes {h.expert_bytes} differ from the pool's {g.expert_bytes}",
                             hint="compile the plan with --expert-bytes equal to the pool's")
        if opts.prefetch != "none" and not h.has_hints:
            raise UsageError(f"--prefetch {opts.prefetch} needs a plan with hints; {plan.path} has none",
                             hint="compile it with `moetrace plan compile ... --hints oracle` (or a predictor)")
        self.eb = g.expert_bytes
        self.n_total = g.n_total
        self.read_len = _round_up(self.eb, ALIGN) if opts.mode == "direct" else self.eb
        self.fds: list[int] = []
        self._fd_of: list[int] = []
        self._off_of: list[int] = []
        self._maps: list[tuple[int, int]] = []  # (addr, length)
        self._map_addr: list[int] = []
        self.arena = None
        self.arena_addr = 0
        self.arena_len = 0
        self.arena_ids = np.zeros(0, np.int64)
        self._arena_off: list[int] | None = None
        self.pool_threads: _ThreadPool | None = None
        self.advisor: PrefetchAdvisor | None = None
        self.preload_ns = 0
        self.preload_method: str | None = None
        self.vmlck_bytes = 0
        self.fd_mode = "kept"
        self.interrupted: int | None = None
        #: the iteration log, a column each: 8 bytes per integer per iteration (array('q'), not a
        #: list of int objects: an 8-10 minute window of small iterations stays a few MB)
        self.rows: dict[str, Any] = {c: ([] if t == "string" else array.array("q")) for c, t in ITERATION_COLUMNS}
        self.phase_wall: dict[str, list[tuple[int, int]]] = {"warmup": [], "measured": []}
        #: moetrace.run.epochs.EpochWriter when run under `moetrace record` (per-iteration epochs)
        self.phase_channel = None
        self.loop_entry_ns: int | None = None

    # -- setup ---------------------------------------------------------------
    def __enter__(self) -> "Replayer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prepare(self) -> None:
        """Open the pool, start the threads, build and verify the arena (preload timed)."""
        self._open_pool()
        buf = max(self.pool.extent_bytes, _round_up(self.eb, ALIGN))
        workers = [_Worker(buf, self.read_len, self.opts.read_size) for _ in range(self.opts.threads)]
        self.pool_threads = _ThreadPool(workers)
        if self.opts.mode in ("pinned", "hybrid"):
            self._build_arena()
        self.vmlck_bytes = read_vmlck()
        if self.arena_len and self.vmlck_bytes < self.arena_len:
            raise MoetraceError(f"VmLck is {self.vmlck_bytes} bytes after the preload, below the "
                                f"{self.arena_len}-byte arena: the kernel did not lock it",
                                hint="check RLIMIT_MEMLOCK and the memory cgroup limit")
        if self.opts.prefetch != "none":
            skip = None
            if self._arena_off is not None:
                ao = self._arena_off
                skip = lambda eid: ao[eid] >= 0  # noqa: E731
            self.advisor = PrefetchAdvisor(self.opts.prefetch, self._locate, self.eb, buf, skip)

    def _data_path(self, i: int) -> str:
        return str(self.pool.root / self.pool.files[i])

    def _open_pool(self) -> None:
        pool, g = self.pool, self.pool.geometry
        mode = self.opts.mode
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        if mode == "direct":
            flags |= os.O_DIRECT
        paths = [self._data_path(i) for i in range(len(pool.files))]
        need = len(paths) + 64 + (self.opts.threads if mode in ("pinned", "hybrid") else 0)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if need > soft:
            new = need if hard == resource.RLIM_INFINITY else min(need, hard)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError):
                pass
        if need > soft:
            if mode == "mmap":
                raise UsageError(f"--mode mmap keeps {len(paths)} files open, RLIMIT_NOFILE allows {soft}",
                                 hint="raise `ulimit -n`, or use a pool with --layout pool")
            self.fd_mode = "per-access"  # open/close around each read (reported in the summary)
        need_size = pool.file_min_bytes()
        want = "expert_bytes" if pool.layout == "files" else "the file's extents"
        if mode == "mmap" and len(paths) > _max_map_count() - 1024:
            raise UsageError(f"--mode mmap maps {len(paths)} files, vm.max_map_count is {_max_map_count()}",
                             hint="raise vm.max_map_count, or use a pool with --layout pool")
        for i, p in enumerate(paths):
            try:
                fd = os.open(p, flags)
            except OSError as e:
                if e.errno == _errno.EINVAL and mode == "direct":
                    raise InputError("the pool's filesystem does not support O_DIRECT", path=p,
                                     hint="put the pool on a block-device filesystem (ext4, xfs), not tmpfs") from None
                raise InputError(f"cannot open pool file: {e.strerror}", path=p,
                                 hint=f"check the pool with `moetrace pool verify {pool.root}`") from None
            try:
                size = os.fstat(fd).st_size
                if size < need_size:
                    raise InputError(f"pool file is {size} bytes, too short for {want} ({need_size})", path=p,
                                     hint=f"recreate the pool (`moetrace pool create --force`), or run "
                                          f"`moetrace pool verify {pool.root}`")
                if self.opts.fadvise_random:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                if mode == "mmap":
                    length = g.expert_bytes if pool.layout == "files" else size
                    addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                    if addr in (None, MAP_FAILED):
                        err = ctypes.get_errno()
                        raise InputError(f"cannot mmap pool file: {os.strerror(err)}", path=p)
                    self._maps.append((addr, length))
                    if self.opts.fadvise_random:
                        libc.madvise(addr, length, _MADV_RANDOM)
            except BaseException:
                os.close(fd)
                raise
            if self.fd_mode == "per-access":
                os.close(fd)
            else:
                self.fds.append(fd)
        # per expert: its file's fd (or mapping) and its offset there, in every layout
        file_of = [pool.file_of(e) for e in range(g.n_total)]
        self._off_of = [pool.offset_of(e) for e in range(g.n_total)]
        self._fd_of = [self.fds[f] for f in file_of] if self.fds else []
        if self._maps:
            self._map_addr = [self._maps[f][0] + o for f, o in zip(file_of, self._off_of)]

    def _locate(self, eid: int) -> tuple[int, int]:
        """(fd, offset) of an expert for the prefetch advisor (page-cache fds)."""
        if self.fd_mode == "kept" and self.opts.mode != "direct":
            return self._fd_of[eid], self._off_of[eid]
        raise MoetraceError("the prefetch advisor needs the pool files kept open",
                            hint="raise `ulimit -n` above the pool's file count")

    def _build_arena(self) -> None:
        eb = self.eb
        n_arena = min(self.opts.arena_bytes // eb, self.n_total)
        counts = frequency_table(self.opts.freq_table, self.plan, self.pool.geometry.n_layers,
                                 self.pool.geometry.n_experts)
        self.freq_counts = counts
        self.arena_ids = choose_arena(counts, n_arena)
        arena_off = [-1] * self.n_total
        for slot, eid in enumerate(self.arena_ids.tolist()):
            arena_off[eid] = slot * eb
        self._arena_off = arena_off
        if n_arena == 0:
            return
        self.arena_len = _round_up(n_arena * eb, PAGE)
        self.arena = mmap.mmap(-1, self.arena_len)
        self.arena_addr = ctypes.addressof(ctypes.c_char.from_buffer(self.arena))
        _mlock(self.arena_addr, self.arena_len)
        # preload with O_DIRECT into the thread buffers, then one copy into the arena, so
        # the preload leaves no page-cache copy behind (buffered + DONTNEED where O_DIRECT fails)
        t0 = time.monotonic_ns()
        dfds: dict[int, int] = {}
        method = "direct"
        pool = self.pool
        paths = {}
        for eid in self.arena_ids.tolist():
            fi = pool.file_of(eid)
            if fi not in dfds:
                p = self._data_path(fi)
                try:
                    dfds[fi] = os.open(p, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
                except OSError as e:
                    if e.errno != _errno.EINVAL:
                        for fd in dfds.values():
                            os.close(fd)
                        raise InputError(f"cannot open pool file: {e.strerror}", path=p) from None
                    method = "buffered"
                    dfds[fi] = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                paths[fi] = p
        plen = _round_up(eb, ALIGN) if method == "direct" else eb
        arena_addr = self.arena_addr

        def preload(w: _Worker, eid: int) -> None:
            fd = dfds[pool.file_of(eid)]
            off = pool.offset_of(eid)
            n = os.preadv(fd, [w.mv[:plen]], off)
            if n < eb:
                raise InputError(f"short read of expert {eid} during preload ({n} of {eb} bytes)",
                                 path=paths[pool.file_of(eid)])
            _memmove(arena_addr + arena_off[eid], w.addr, eb)
            if method == "buffered":
                os.posix_fadvise(fd, off, eb, os.POSIX_FADV_DONTNEED)

        try:
            self.pool_threads.run(self.arena_ids.tolist(), preload)
        finally:
            for fd in dfds.values():
                os.close(fd)
        self.preload_ns = time.monotonic_ns() - t0
        self.preload_method = method
        if self.interrupted:
            raise SignalReceived(self.interrupted)

    # -- the read functions (hot path) ----------------------------------------
    def _reader(self) -> Callable[[_Worker, int], None]:
        eb = self.eb
        fd_of, off_of = self._fd_of, self._off_of
        preadv = os.preadv
        arena_off = self._arena_off
        arena_addr = self.arena_addr
        chunked = self.opts.read_size is not None and self.opts.read_size < self.read_len
        memmove = _memmove

        def short(eid: int, n: int):
            return InputError(f"short read of expert {eid}: {n} of {eb} bytes", path=str(self.pool.path_of(eid)),
                              hint=f"the pool changed under the replay; run `moetrace pool verify {self.pool.root}`")

        if self.opts.mode == "mmap":
            maddr = self._map_addr

            def read_mmap(w: _Worker, eid: int) -> None:
                memmove(w.addr, maddr[eid], eb)
                w.reads += 1
                w.bytes += eb
            return read_mmap

        if self.fd_mode == "per-access":
            flags = os.O_RDONLY | (os.O_DIRECT if self.opts.mode == "direct" else 0)

            def read_open(w: _Worker, eid: int) -> None:
                if arena_off is not None and arena_off[eid] >= 0:
                    memmove(w.addr, arena_addr + arena_off[eid], eb)
                    w.hits += 1
                else:
                    fd = os.open(self._data_path(self.pool.file_of(eid)), flags)
                    try:
                        n = preadv(fd, w.iov, off_of[eid])
                    finally:
                        os.close(fd)
                    if n < eb:
                        raise short(eid, n)
                w.reads += 1
                w.bytes += eb
            return read_open

        if chunked:
            def read_chunks(w: _Worker, eid: int) -> None:
                if arena_off is not None and arena_off[eid] >= 0:
                    memmove(w.addr, arena_addr + arena_off[eid], eb)
                    w.hits += 1
                else:
                    fd, base = fd_of[eid], off_of[eid]
                    n = 0
                    for v, rel in w.chunks:
                        n += preadv(fd, [v], base + rel)
                    if n < eb:
                        raise short(eid, n)
                w.reads += 1
                w.bytes += eb
            return read_chunks

        def read_plain(w: _Worker, eid: int) -> None:
            n = preadv(fd_of[eid], w.iov, off_of[eid])
            if n < eb:
                raise short(eid, n)
            w.reads += 1
            w.bytes += eb
        if arena_off is None:
            return read_plain

        def read_arena(w: _Worker, eid: int) -> None:
            a = arena_off[eid]
            if a < 0:  # not in the arena: read from the pool
                read_plain(w, eid)
                return
            memmove(w.addr, arena_addr + a, eb)
            w.hits += 1
            w.reads += 1
            w.bytes += eb
        return read_arena

    # -- the loop ---------------------------------------------------------------
    def _totals(self) -> tuple[int, int, int]:
        ws = self.pool_threads.workers
        return (sum(w.reads for w in ws), sum(w.bytes for w in ws), sum(w.hits for w in ws))

    def _hint_totals(self) -> tuple[int, int, int]:
        a = self.advisor
        return (a.submitted, a.overwritten, a.completed) if a is not None else (0, 0, 0)

    def replay_pass(self, phase: str, repeat: int, tick: Callable[[int], None] | None = None,
                    stop_ns: int | None = None) -> bool:
        """Replay every iteration of the plan once, appending one row per iteration; with
        ``stop_ns`` (CLOCK_MONOTONIC), stop after the first iteration that ends past it. True when
        the whole pass ran."""
        plan, pool, adv = self.plan, self.pool_threads, self.advisor
        fn = self._reader()
        ids, sb, hb, ib = plan.ids, plan.slot_bounds, plan.hint_bounds, plan.iter_bounds
        hint_ids = plan.hint_ids
        rows = self.rows
        now = time.monotonic_ns
        put = adv.put if adv is not None else None
        p0 = now()
        for it in range(plan.n_iterations):
            s_lo, s_hi = int(ib[it]), int(ib[it + 1])
            # convert the iteration's ids to Python lists outside the timed interval
            a, b = int(sb[s_lo]), int(sb[s_hi])
            flat = ids[a:b].tolist()
            cuts = (sb[s_lo:s_hi + 1] - a).tolist()
            slots = [flat[cuts[j]:cuts[j + 1]] for j in range(s_hi - s_lo)]
            hints = None
            if put is not None:
                ha = int(hb[s_lo])
                hflat = hint_ids[ha:int(hb[s_hi])].tolist()
                hc = (hb[s_lo:s_hi + 1] - ha).tolist()
                hints = [hflat[hc[j]:hc[j + 1]] for j in range(s_hi - s_lo)]
            if self.phase_channel is not None:  # the recorder's epoch switch, outside the timed interval
                self.phase_channel.iteration(phase, repeat, it)
            r0, b0, a0 = self._totals()
            h0 = self._hint_totals()
            t0 = now()
            for j, items in enumerate(slots):
                pool.run(items, fn)
                if self.interrupted:
                    break
                if hints is not None and hints[j]:
                    put(hints[j])
            t1 = now()
            if self.interrupted:
                self.phase_wall[phase].append((p0, t1))
                raise SignalReceived(self.interrupted)
            r1, b1, a1 = self._totals()
            h1 = self._hint_totals()
            rows["phase"].append(phase)
            rows["repeat"].append(repeat)
            rows["iteration"].append(it)
            rows["step"].append(int(plan.steps[it]))
            rows["plan_passes"].append(int(plan.plan_passes[it]))
            rows["start_ns"].append(t0)
            rows["end_ns"].append(t1)
            rows["duration_ns"].append(t1 - t0)
            rows["bytes"].append(b1 - b0)
            rows["reads"].append(r1 - r0)
            rows["arena_hits"].append(a1 - a0)
            rows["hints_submitted"].append(h1[0] - h0[0])
            rows["hints_overwritten"].append(h1[1] - h0[1])
            rows["hints_completed"].append(h1[2] - h0[2])
            if tick is not None:
                tick(1)
            if stop_ns is not None and t1 >= stop_ns and it + 1 < plan.n_iterations:
                self.phase_wall[phase].append((p0, now()))
                return False
        self.phase_wall[phase].append((p0, now()))
        return True

    def sync_loop_entry(self, fd: int) -> None:
        """Tell the parent we reached loop entry; block until it answers 'go'."""
        line = f"loop_entry vmlck_bytes={read_vmlck()} arena_bytes={self.arena_len}\n"
        try:
            os.write(fd, line.encode())
        except OSError as e:
            raise MoetraceError(f"cannot write to --sync-fd {fd}: {e.strerror}",
                                hint="pass a connected socket (socketpair) inherited from the parent") from None
        buf = b""
        while b"\n" not in buf:
            if self.interrupted:
                raise SignalReceived(self.interrupted)
            r, _, _ = select.select([fd], [], [], 0.1)
            if not r:
                continue
            chunk = os.read(fd, 256)
            if not chunk:
                raise MoetraceError(f"the parent closed --sync-fd {fd} before sending 'go'")
            buf += chunk
        word = buf.split(b"\n", 1)[0].strip()
        if word != b"go":
            raise MoetraceError(f"--sync-fd {fd}: expected 'go', got {word[:40]!r}")

    def sync_done(self, fd: int) -> None:
        try:
            os.write(fd, b"done\n")
        except OSError:
            pass  # the parent is gone; the run directory still has everything

    def close(self) -> None:
        """Stop the threads and release fds, mappings and the arena (idempotent)."""
        if self.advisor is not None:
            self.advisor.close()
        if self.pool_threads is not None:
            self.pool_threads.close()
            for w in self.pool_threads.workers:
                w.close()
            self.pool_threads = None
        for addr, length in self._maps:
            libc.munmap(addr, length)
        self._maps = []
        self._map_addr = []
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        if self.arena is not None:
            libc.munlock(self.arena_addr, self.arena_len)
            try:
                self.arena.close()
            except BufferError:
                pass
            self.arena = None


def _max_map_count() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530


# ---------------------------------------------------------------------------
# summary and outputs


def _stats(durations: list[int]) -> dict:
    if not durations:
        return {"iterations": 0, "median_ns": None, "min_ns": None, "max_ns": None, "mean_ns": None,
                "p10_ns": None, "p90_ns": None, "spread_ns": None, "spread_rel": None}
    d = np.asarray(durations, np.int64)
    med = float(np.median(d))
    return {"iterations": int(d.size), "median_ns": med, "min_ns": int(d.min()), "max_ns": int(d.max()),
            "mean_ns": float(d.mean()), "p10_ns": float(np.percentile(d, 10)),
            "p90_ns": float(np.percentile(d, 90)), "spread_ns": int(d.max() - d.min()),
            "spread_rel": float((d.max() - d.min()) / med) if med else None}


def summarize(rep: Replayer, complete: bool, exit_status: int, error: str | None = None,
              command: list[str] | None = None) -> dict:
    """The replay.json document.

    phases.<phase>: repeats, iterations, duration_ns (sum of iteration times),
    wall_ns per repeat, bytes, reads, arena_hits, hints_*, gbps (bytes / sum of
    repeat walls). measured: median/min/max/p10/p90/spread of iteration time
    over every measured iteration, and per_iteration_ns (one list per repeat).
    """
    rows, plan, pool, o = rep.rows, rep.plan, rep.pool, rep.opts
    h = plan.header
    phase = np.asarray(rows["phase"], object)
    phases = {}
    for ph in ("warmup", "measured"):
        m = phase == ph
        walls = [b - a for a, b in rep.phase_wall[ph]]

        def tot(c):
            return int(np.asarray(rows[c], np.int64)[m].sum()) if m.any() else 0
        by = tot("bytes")
        phases[ph] = {"repeats": len(walls), "iterations": int(m.sum()), "duration_ns": tot("duration_ns"),
                      "wall_ns": walls, "bytes": by, "reads": tot("reads"), "arena_hits": tot("arena_hits"),
                      "hints_submitted": tot("hints_submitted"), "hints_overwritten": tot("hints_overwritten"),
                      "hints_completed": tot("hints_completed"),
                      "gbps": by / sum(walls) if walls and sum(walls) else None}
    mm = phase == "measured"
    dur = np.asarray(rows["duration_ns"], np.int64)
    rep_col = np.asarray(rows["repeat"], np.int64)
    # the measured rows are in repeat order: split where the repeat changes (one pass over them, an
    # 8-minute window of many passes included)
    per_rep = [a.tolist() for a in np.split(dur[mm], np.flatnonzero(np.diff(rep_col[mm])) + 1)] if mm.any() else []
    measured = _stats(dur[mm].tolist())
    measured["per_iteration_ns"] = per_rep
    mstart = [a for a, _ in rep.phase_wall["measured"]]
    mend = [b for _, b in rep.phase_wall["measured"]]
    adv = rep.advisor
    hints = None
    if adv is not None:
        hints = {"kind": adv.kind, "submitted": adv.submitted, "overwritten": adv.overwritten,
                 "completed": adv.completed, "pending": adv.pending, "experts_issued": adv.experts_issued,
                 "hint_sets_per_pass": plan.n_hint_sets,
                 "error": None if adv.error is None else str(adv.error)}
    g = pool.geometry
    return {
        "schema": REPLAY_SCHEMA,
        "toolkit_version": __version__,
        "command": command,
        "complete": complete,
        "exit_status": exit_status,
        "error": error,
        "clock": "CLOCK_MONOTONIC",
        "pid": os.getpid(),
        "plan": {"path": os.path.abspath(plan.path), "file_bytes": h.file_size,
                 "identity": f"crc32:{h.meta_crc32:08x}:{h.index_crc32:08x}:{h.file_size}",
                 "n_layers": h.n_layers, "n_experts": h.n_experts, "k": h.k, "expert_bytes": h.expert_bytes,
                 "iterations": h.n_iterations, "passes": h.n_passes, "reads": h.n_reads,
                 "hint_source": h.hint_source, "distinct_experts": int(np.unique(plan.ids).size)},
        "pool": {"root": str(Path(pool.root).resolve()), "layout": pool.layout,
                 "identity": pool.manifest.get("checksum"), "geometry": g.to_dict(),
                 "extent_bytes": pool.extent_bytes, "data_bytes": pool.data_bytes, "files": len(pool.files)},
        "mode": o.mode, "threads": o.threads, "warmup": o.warmup, "passes": o.passes, "duration_s": o.duration_s,
        "read_bytes_per_call": o.read_size or rep.read_len, "read_len_bytes": rep.read_len,
        "prefetch": o.prefetch, "fadvise_random": o.fadvise_random, "fd_mode": rep.fd_mode,
        "arena": {"requested_bytes": o.arena_bytes, "experts": int(rep.arena_ids.size), "bytes": rep.arena_len,
                  "freq_table": o.freq_table if o.mode in ("pinned", "hybrid") else None,
                  "preload_method": rep.preload_method,
                  "preload_bytes": int(rep.arena_ids.size) * rep.eb,
                  "accesses_per_pass": (int(np.isin(plan.ids, rep.arena_ids).sum())
                                        if rep.arena_ids.size else 0)},
        "arena_experts": int(rep.arena_ids.size),
        "arena_bytes": rep.arena_len,
        "vmlck_bytes": rep.vmlck_bytes,
        "preload_ns": rep.preload_ns,
        "loop_entry_ns": rep.loop_entry_ns,
        "measured_start_ns": min(mstart) if mstart else None,
        "measured_end_ns": max(mend) if mend else None,
        "phases": phases,
        "measured": measured,
        "hints": hints,
        "epochs": None if rep.phase_channel is None else rep.phase_channel.summary(),
        "interrupted_by": signal.Signals(rep.interrupted).name if rep.interrupted else None,
    }


def write_outputs(run_dir: str | os.PathLike, rows: dict, summary: dict) -> None:
    """Write iterations.parquet and replay.json into run_dir, each atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = Path(run_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create the run directory: {e.strerror}", path=str(d)) from None
    # an array('q') column goes to Arrow through its buffer (no Python int per value: a long window's
    # log is hundreds of thousands of rows)
    table = pa.table({c: pa.array(np.frombuffer(rows[c], np.int64) if isinstance(rows[c], array.array) else rows[c])
                      .cast(getattr(pa, t)()) for c, t in ITERATION_COLUMNS})
    table = table.replace_schema_metadata({"schema": REPLAY_SCHEMA, "clock": "CLOCK_MONOTONIC"})
    with atomic_write(d / ITERATIONS_FILE) as tmp:
        pq.write_table(table, str(tmp))
    with atomic_write(d / SUMMARY_FILE, fsync=True) as tmp:
        tmp.write_text(json.dumps(summary, indent=1, default=json_default) + "\n")


def run_replay(plan_path: str | os.PathLike, pool_dir: str | os.PathLike, opts: ReplayOptions, *,
               handle_signals: bool = False, progress: Callable | None = None,
               command: list[str] | None = None) -> ReplayResult:
    """Replay a plan against a pool; write the run directory when opts.run_dir is set.

    handle_signals=True (the CLI) turns SIGINT/SIGTERM into a clean stop: the
    layer in flight finishes, outputs are written with complete=false and
    ReplayInterrupted (exit status 128 + signal) is raised. progress, when
    given, is a factory ``progress(length=, label=)`` of a context manager with
    update(n) (click.progressbar). Errors after setup are written into the run
    directory too (complete=false, exit_status 1) before they propagate.
    """
    from moetrace.inputs.pool import open_pool

    opts.check()
    if opts.run_dir:
        # Load the writer's libraries now: imported only after the measured
        # pass, their memory would be charged to the cell's scope at the end
        # and can OOM-kill the replay under a tight limit, losing the log.
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    holder: list[Replayer] = []
    old_handlers = _stop_on_signals(holder) if handle_signals else {}
    try:
        plan = load_flat_plan(plan_path)
        pool = open_pool(pool_dir)
        rep = Replayer(plan, pool, opts)
    except SignalReceived as e:
        _restore_handlers(old_handlers)
        raise ReplayInterrupted(e.signum, None) from None
    except BaseException:
        _restore_handlers(old_handlers)
        raise
    holder.append(rep)
    complete, status, err = False, 1, None
    try:
        try:
            _replay_phases(rep, plan, opts, progress)
            complete, status = True, 0
        except SignalReceived as e:
            status = 128 + e.signum
        except MoetraceError as e:
            err = e.format_message()
            raise
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
            raise MoetraceError(f"replay failed: {e}") from None
        finally:
            if rep.interrupted and status == 1 and err is None:
                status = 128 + rep.interrupted
            if rep.advisor is not None:
                rep.advisor.close()
            summary = summarize(rep, complete, status, err, command)
            if opts.run_dir:
                write_outputs(opts.run_dir, rep.rows, summary)
    finally:
        rep.close()
        if rep.phase_channel is not None:
            rep.phase_channel.close()
        _restore_handlers(old_handlers)
    if not complete:
        raise ReplayInterrupted(rep.interrupted or signal.SIGINT, opts.run_dir)
    return ReplayResult(summary, rep.rows)


def _stop_on_signals(holder: list[Replayer]) -> dict[int, Any]:
    """SIGINT/SIGTERM become a clean stop of the replayer in ``holder`` (the layer in flight
    finishes), or SignalReceived while it is still loading. Returns the handlers they replaced
    (none off the main thread, where Python takes no handler)."""
    def on_signal(signum, frame):
        if not holder:  # still loading: nothing to write or release yet
            raise SignalReceived(signum)
        rep = holder[0]
        if rep.interrupted is None:
            rep.interrupted = signum
        if rep.pool_threads is not None:
            rep.pool_threads.abort = True  # the layer in flight stops; the loop sees rep.interrupted

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}


def _restore_handlers(old: dict[int, Any]) -> None:
    for s, hnd in old.items():
        signal.signal(s, hnd)


def _replay_phases(rep: Replayer, plan: FlatPlan, opts: ReplayOptions, progress: Callable | None) -> None:
    """Prepare, the warm-up passes, loop entry (told through sync_fd, when given), the measured
    passes, and done (the advisor drained, the epoch channel closed, sync_fd told)."""
    rep.prepare()
    from moetrace.replay.epochs import EpochWriter

    rep.phase_channel = EpochWriter.from_env()
    if rep.phase_channel is not None:
        rep.phase_channel.start(opts.warmup, opts.passes, plan.n_iterations, open_ended=opts.duration_s is not None)
    total = plan.n_iterations * (opts.warmup + opts.passes)
    bar_cm = progress(length=total, label=f"replay {opts.mode}") if progress and opts.duration_s is None else None
    bar = bar_cm.__enter__() if bar_cm else None
    try:
        tick = bar.update if bar is not None else None
        for r in range(opts.warmup):
            rep.replay_pass("warmup", r, tick)
        rep.loop_entry_ns = time.monotonic_ns()
        if opts.sync_fd is not None:
            rep.sync_loop_entry(opts.sync_fd)
        _measured_passes(rep, opts, tick)
    finally:
        if bar_cm:
            bar_cm.__exit__(None, None, None)
    if rep.advisor is not None:
        rep.advisor.close()  # drain the slot: submitted = completed + overwritten
    if rep.phase_channel is not None:
        rep.phase_channel.done()
    if opts.sync_fd is not None:
        rep.sync_done(opts.sync_fd)


def _measured_passes(rep: Replayer, opts: ReplayOptions, tick: Callable | None) -> None:
    """The measured passes: ``opts.passes`` whole ones; with ``opts.duration_s``, then more until
    that many seconds have passed since the first began (the last stops after the iteration that
    ends past the deadline). Memory stays flat but for one iteration-log row per iteration."""
    start = time.monotonic_ns()
    deadline = None if opts.duration_s is None else start + int(opts.duration_s * 1e9)
    r = 0
    while r < opts.passes or (deadline is not None and time.monotonic_ns() < deadline):
        whole = rep.replay_pass("measured", r, tick, stop_ns=deadline if r >= opts.passes else None)
        r += 1
        if not whole:
            break


__all__ = ["MODES", "PREFETCH", "REPLAY_SCHEMA", "ITERATIONS_FILE", "SUMMARY_FILE", "ITERATION_COLUMNS",
           "FlatPlan", "load_flat_plan", "frequency_table", "choose_arena", "PrefetchAdvisor", "ReplayOptions",
           "ReplayResult", "ReplayInterrupted", "Replayer", "run_replay", "summarize", "write_outputs",
           "read_vmlck"]
