"""One capacity cell (paper Algorithm 1) and the simulated miss demand it is scored against.

1. remove any stale scope of that name (and every ``moetrace-*`` scope whose owner
   died); sync; drop caches; snapshot ``pre``.
2. start the scope: limit = C + headroom, no swap (``--mechanism cgroup``), or an
   unlimited accounting scope plus an mlocked balloon of MemAvailable - C - headroom
   (``--mechanism balloon``, the balloon in its own scope).
3. start the replay child inside the scope before it execs (preexec_fn writes its
   pid into cgroup.procs and sets PR_SET_PDEATHSIG), warm-up and measured passes in
   that one scope (paper §4: separate scopes miscount reparented file pages).
4. at "loop_entry" (after preload and warm-up): snapshot ``loop_entry``; send "go".
5. at "done" / exit: snapshot ``post``; record peak memory, OOM events, kernel log.
6. retain iff VmLck matches the request, no OOM event, and the scope stayed alive
   (replay exit 0, scope present at the end).
7. remove the scope and the balloon — also on error, SIGINT and SIGTERM (the CLI
   then exits 130 / 143); after a SIGKILL the next cell removes the stale scope.

Headroom (``--headroom``, default 64 MiB) is the memory above C the scope allows
for the replay process's own anonymous memory (interpreter, buffers); the paper
used 6 GiB at hundreds of GB. The replay's anonymous charge at loop entry is
recorded (``anon_at_loop_entry_bytes``) with the file capacity it left.

Device bytes of the measured interval are the pool device's /proc/diskstats
sectors read between the ``loop_entry`` and ``post`` snapshots x 512.
Simulated miss demand: a global LRU of floor(C / extent_bytes) experts over the
plan's accesses repeated warmup + passes times, scoring only the measured part.
"""

from __future__ import annotations

import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from moetrace.atomic import atomic_write
from moetrace.capacity.scope import (PAGE, Balloon, Scope, balloon_size, find_memory_controller, remove_stale_scopes,
                                    safe_reserve_bytes)
from moetrace.kernel.syscalls import set_pdeathsig
from moetrace.errors import CellInterrupted, InputError, MoetraceError, ScopeError, UsageError
from moetrace.kernel.hostfacts import host_facts
from moetrace.kernel.procfs import SECTOR_BYTES, KernelLog, device_of, read_meminfo, take_snapshot
from moetrace.run import metadata
from moetrace.run.documents import CELL_SCHEMA, Cell, MglruState, Simulated
#: machine: no limit inside, the machine's own memory is the capacity (the paper's mem= boot: the
#: lab sizes a guest's RAM for C)
MECHANISMS = ("cgroup", "balloon", "machine")
MODES = ("pagecache", "mmap", "direct", "pinned", "hybrid")
PREFETCH = ("none", "fadvise", "pread")
DEFAULT_HEADROOM = 64 << 20
DEFAULT_ARENA_FRACTION = 0.5
REPLAY_SELF_BYTES = 48 << 20  # the replay process's own memory, measured ~30-40 MiB at loop entry
MIN_MISS_CACHE_BYTES = 32 << 20  # least page cache an arena cell must leave for misses
VMLCK_ZERO_TOLERANCE = 1 << 20  # non-arena modes: VmLck must be below this (≈ 0)


#: the signals :func:`interrupt_handlers` turned into CellInterrupted in the running block. Python
#: swallows an exception raised where it cannot propagate: a signal handler that runs inside an
#: at-fork callback (subprocess.Popen forking the replay; measured: a scancel's SIGTERM printed
#: "Exception ignored in: _releaseLock" and the cell ran on) or a __del__; check_interrupted()
#: raises it again at the next step.
_RAISED: list[int] = []


@contextmanager
def interrupt_handlers() -> Iterator[None]:
    """Turn SIGINT/SIGTERM into CellInterrupted for the enclosed block (main thread only)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, _frame):
        _RAISED.append(signum)
        raise CellInterrupted(signum)

    old = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}
    _RAISED.clear()
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _RAISED.clear()


def check_interrupted() -> None:
    """Raise CellInterrupted again for a signal of this :func:`interrupt_handlers` block whose
    exception was swallowed where it was raised (see _RAISED); nothing otherwise. Called between
    steps (the cell's phases, the dispatcher's rounds): a block that caught its CellInterrupted
    is cleaning up or leaving and calls it no more."""
    if _RAISED:
        raise CellInterrupted(_RAISED[-1])


@contextmanager
def _signals_deferred() -> Iterator[list[int]]:
    """While cleaning up: remember SIGINT/SIGTERM instead of raising (re-raised after)."""
    import threading

    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    old = {s: signal.signal(s, lambda n, f: got.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@dataclass
class CellSpec:
    """The inputs of one cell."""

    plan: str
    pool: str
    capacity_bytes: int
    mechanism: str = "cgroup"
    mode: str = "pagecache"
    headroom_bytes: int = DEFAULT_HEADROOM
    threads: int = 8
    warmup: int = 1
    passes: int = 1
    arena_fraction: float | None = None
    prefetch: str = "none"
    fadvise_random: bool = False
    freq_table: str | None = None
    name: str = "cell"
    timeout_s: float = 3600.0
    python: str = sys.executable
    replay_argv: list[str] | None = None  # program part of the replay command (tests / development)
    drop_caches: bool = True
    record: bool = False  # wrap the replay in `moetrace record` (run directory <cell dir>/run)
    #: with record: `record --stream-events` (page_events.parquet: exact per-page re-reads within
    #: an iteration in the report; large: about 32 bytes per page-cache event)
    stream_events: bool = False
    #: watch the pool's pages for evictions by anyone but the cell's own capacity mechanism
    #: (DAMON, fadvise, drop_caches, truncate, proactive or global reclaim): the replay runs under
    #: `moetrace record --probes pagecache` (<cell dir>/watch) when not --record
    watch: bool = True
    #: a measured window with outside evictions: "flag" (kept, with the count in flags) or
    #: "reject" (not retained)
    outside_evictions: str = "flag"
    #: a miss curve saved for this plan, warm-up and passes (save_miss_curve): not computed here
    miss_curve: str | None = None
    #: a measured window of this many seconds (the replay's --duration; at least ``passes``)
    duration_s: float | None = None
    #: with record: the probes (`record --probes`; "+vmscan": the default set and vmscan); None: the default
    record_probes: str | None = None
    #: balloon: "on" madvises it MADV_HUGEPAGE, "off" MADV_NOHUGEPAGE; None: the system's THP setting
    balloon_thp: str | None = None

    @property
    def arena_bytes(self) -> int | None:
        """The arena a pinned (= C) or hybrid (= F x C) cell asks for; None otherwise."""
        if self.mode == "pinned":
            return int(self.capacity_bytes)
        if self.mode == "hybrid":
            f = DEFAULT_ARENA_FRACTION if self.arena_fraction is None else self.arena_fraction
            return int(f * self.capacity_bytes)
        return None

    def validate(self) -> None:
        """Reject contradictory inputs (UsageError) before anything is created."""
        if self.stream_events and not self.record:
            raise UsageError("--stream-events streams the recording's page events: it needs --record",
                             hint="add --record")
        if self.mechanism not in MECHANISMS:
            raise UsageError(f"unknown mechanism {self.mechanism!r}", hint="use --mechanism cgroup, balloon or machine")
        if self.mode not in MODES:
            raise UsageError(f"unknown mode {self.mode!r}", hint="use one of " + ", ".join(MODES))
        if self.prefetch not in PREFETCH:
            raise UsageError(f"unknown prefetch {self.prefetch!r}", hint="use none, fadvise or pread")
        if self.capacity_bytes <= 0:
            raise UsageError("--capacity must be > 0")
        if self.headroom_bytes < 0:
            raise UsageError("--headroom must be >= 0")
        if self.warmup < 0 or self.passes < 1:
            raise UsageError("--warmup must be >= 0 and --passes >= 1")
        self._validate_window()
        if self.arena_fraction is not None:
            if self.mode != "hybrid":
                raise UsageError("--arena-fraction applies to --mode hybrid only")
            if not (0.0 < self.arena_fraction < 1.0):
                raise UsageError(f"--arena-fraction must be in (0, 1), got {self.arena_fraction}")
        arena = self.arena_bytes
        if self.mechanism == "cgroup" and arena is not None:
            # The scope holds the arena, the replay's own memory (interpreter, libraries,
            # buffers: ~40 MiB) and the page cache that serves the arena's misses. Measured
            # here: a pinned cell at C=512MiB with 64 MiB headroom (~28 MiB of page cache)
            # thrashed on its own library pages for minutes; 256 MiB ran in 16 s.
            left = self.capacity_bytes + self.headroom_bytes - arena - REPLAY_SELF_BYTES
            if left < MIN_MISS_CACHE_BYTES:
                need = arena + REPLAY_SELF_BYTES + MIN_MISS_CACHE_BYTES - self.capacity_bytes
                raise UsageError(
                    f"--mode {self.mode} at C={self.capacity_bytes} B leaves about {max(left, 0) >> 20} MiB of "
                    "page cache for the arena's misses and the replay's own files: the replay would thrash",
                    hint=f"use --headroom {-(-need // (1 << 20))}MiB or more (the paper used 6 GiB above C)")

    def _validate_window(self) -> None:
        """--duration within the timeout; --probes with --record; --balloon-thp with a balloon."""
        if self.duration_s is not None and not 0 < self.duration_s < self.timeout_s:
            raise UsageError(f"--duration {self.duration_s:g} s must be > 0 and below --timeout {self.timeout_s:g} s",
                             hint="raise --timeout: the warm-up and the recording's start and end come on top")
        if self.record_probes is not None and not self.record:
            raise UsageError("--probes names the recording's probes: it needs --record", hint="add --record")
        if self.balloon_thp not in (None, "on", "off"):
            raise UsageError(f"--balloon-thp {self.balloon_thp!r}", hint="on or off")
        if self.balloon_thp is not None and self.mechanism != "balloon":
            raise UsageError("--balloon-thp applies to --mechanism balloon only")


# -- simulated miss demand ---------------------------------------------------------------------

def repeated_accesses(acc, times: int):
    """The plan's access stream repeated ``times`` times (:func:`moetrace.analyses.stackdist.repeated_accesses`)."""
    from moetrace.analyses.stackdist import repeated_accesses as rep

    return rep(acc, times)


def miss_curve(plan: str | os.PathLike, warmup: int, passes: int):
    """Global LRU StackCurve over warmup + passes repetitions of the plan, scoring the measured part."""
    from moetrace.analyses.stackdist import lru_stack_curve
    from moetrace.inputs.plan import read_accesses

    acc = read_accesses(plan)
    total = warmup + passes
    return lru_stack_curve(repeated_accesses(acc, total), "global", warm_fraction=warmup / total)


def plan_key(plan: str | os.PathLike, warmup: int, passes: int) -> str:
    """What a saved miss curve belongs to: the plan file (its size and a digest of its first and
    last MiB), warm-up and passes."""
    import hashlib

    p = Path(plan)
    size = p.stat().st_size
    h = hashlib.sha256(f"{size}/{warmup}/{passes}".encode())
    with open(p, "rb") as fh:
        h.update(fh.read(1 << 20))
        fh.seek(max(0, size - (1 << 20)))
        h.update(fh.read(1 << 20))
    return h.hexdigest()[:24]


def save_miss_curve(curve, path: str | os.PathLike, plan: str | os.PathLike, warmup: int, passes: int) -> Path:
    """A :func:`miss_curve` saved for cells elsewhere (a lab guest, where numba compiles its kernel
    anew at every boot: ~25 s under TCG), with the key of what it was computed from."""
    w = curve.window
    path = Path(path)
    with atomic_write(path) as tmp, open(tmp, "wb") as fh:  # a file object: savez adds no ".npz"
        np.savez(fh, cum_hits=curve.cum_hits, accesses=curve.accesses, cold=curve.cold, scope=curve.scope,
                 window=np.array([w.n_iterations, w.warm_iterations, w.cut, w.n_accesses], np.int64),
                 key=plan_key(plan, warmup, passes))
    return path


def check_miss_curve(path: str | os.PathLike, plan: str | os.PathLike, warmup: int, passes: int) -> None:
    """InputError unless ``path`` is a :func:`save_miss_curve` of this plan, warm-up and passes. Reads
    the key alone, with numpy: a cell checks its curve before the replay without importing the
    simulators (numba and pandas: ~140 MB that a small guest's page cache would lose)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            key = str(z["key"])
    except (OSError, KeyError, ValueError) as e:
        raise InputError(f"not a saved miss curve: {e}", path=str(path)) from None
    if key != plan_key(plan, warmup, passes):
        raise InputError("this miss curve belongs to another plan, warm-up or passes", path=str(path),
                         hint="drop --miss-curve: the cell computes its own")


def load_miss_curve(path: str | os.PathLike, plan: str | os.PathLike, warmup: int, passes: int):
    """:func:`save_miss_curve`'s curve; InputError when it belongs to another plan, warm-up or passes."""
    from moetrace.analyses.stackdist import StackCurve, Window

    check_miss_curve(path, plan, warmup, passes)
    try:
        with np.load(path, allow_pickle=False) as z:
            w = [int(v) for v in z["window"]]
            return StackCurve(str(z["scope"]), z["cum_hits"].astype(np.int64), int(z["accesses"]), Window(*w),
                              int(z["cold"]))
    except (OSError, KeyError, ValueError) as e:
        raise InputError(f"not a saved miss curve: {e}", path=str(path)) from None


def ensure_miss_curve(path: str | os.PathLike, plan: str | os.PathLike, warmup: int, passes: int) -> Path:
    """``path`` (made absolute: a job or guest runs elsewhere) holding the plan's simulated miss
    curve, computed once for all the cells that load it; kept while it matches the plan."""
    path = Path(path).resolve()
    if path.exists():
        try:
            check_miss_curve(path, plan, warmup, passes)
            return path
        except InputError:
            pass
    return save_miss_curve(miss_curve(plan, warmup, passes), path, plan, warmup, passes)


def simulated_miss(curve, capacity_bytes: int, extent_bytes: int, expert_bytes: int) -> Simulated:
    """Miss demand at C from a :func:`miss_curve`: budget = floor(C / extent_bytes) experts."""
    budget = int(capacity_bytes // extent_bytes)
    hits = int(curve.hits_at(budget))
    return {"budget_experts": budget, "scored_accesses": int(curve.accesses), "hits": hits,
            "misses": int(curve.accesses - hits), "hit_rate": curve.hit_rate_at(budget),
            "scored_iterations": int(curve.window.scored_iterations),
            "miss_bytes_per_iteration": float(curve.miss_bytes_per_iteration(budget, expert_bytes))}


# -- the cell ----------------------------------------------------------------------------------

def _replay_argv(spec: CellSpec, run_dir: Path, sync_fd: int) -> list[str]:
    prog = spec.replay_argv or [spec.python, "-m", "moetrace.cli.replay"]
    argv = list(prog) + [str(spec.plan), "--pool", str(spec.pool), "--mode", spec.mode,
                         "--threads", str(spec.threads), "--warmup", str(spec.warmup),
                         "--passes", str(spec.passes), "--prefetch", spec.prefetch,
                         "--run-dir", str(run_dir), "--sync-fd", str(sync_fd)]
    if spec.duration_s is not None:
        argv += ["--duration", repr(float(spec.duration_s))]
    if spec.arena_bytes is not None:
        argv += ["--arena-bytes", str(spec.arena_bytes)]
    if spec.freq_table:
        argv += ["--freq-table", spec.freq_table]
    if spec.fadvise_random:
        argv.append("--fadvise-random")
    return argv


def _record_argv(spec: CellSpec, run: Path, scope_path: Path, probes: str | None = None) -> list[str]:
    """`moetrace record` in front of the replay: the recorder stays outside the scope and
    the replay joins it (``--cgroup``) after the probes are attached, before it execs."""
    stream = ["--stream-events"] if spec.stream_events and probes is None else []
    probes = probes if probes is not None or not spec.record else spec.record_probes
    return [spec.python, "-m", "moetrace.cli.record", "--out", str(run), "--pool", str(spec.pool),
            "--cgroup", str(scope_path), *(["--probes", probes] if probes else []), *stream, "--"]


#: the evictor classes a capacity mechanism itself causes (record/probes/pagecache.py EVICTORS)
OWN_EVICTORS = {"cgroup": ("memcg",), "balloon": ("kswapd", "direct"), "machine": ("kswapd", "direct")}


def watch_unavailable() -> str | None:
    """Why the pool's evictions cannot be watched here (None: they can)."""
    from moetrace.kernel.bpf import stale_object

    return stale_object("pagecache")


def drop_caches(root: str = "/") -> None:
    """sync; echo 3 > /proc/sys/vm/drop_caches."""
    os.sync()
    with open(os.path.join(root, "proc/sys/vm/drop_caches"), "w") as fh:
        fh.write("3")


def check_privileges() -> None:
    """Cells create cgroups, drop caches and mlock: they need root."""
    if os.geteuid() != 0:
        raise UsageError("a capacity cell needs root (it creates memory cgroups and drops caches)",
                         hint="run it as root, e.g. `sudo moetrace cell ...`")


class _Child:
    """The replay child and the parent's end of its sync socket."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket):
        self.proc, self.sock, self.buf = proc, sock, b""

    def next_line(self, deadline: float) -> str | None:
        """The next line from the child, or None when it closed the socket / exited."""
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            r, _, _ = select.select([self.sock], [], [], min(left, 0.5))
            if not r:
                if self.proc.poll() is not None:
                    # exited: drain what is left
                    try:
                        self.sock.setblocking(False)
                        b = self.sock.recv(4096)
                    except (BlockingIOError, OSError):
                        b = b""
                    if not b:
                        return None
                    self.buf += b
                continue
            b = self.sock.recv(4096)
            if not b:
                return None
            self.buf += b
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode(errors="replace").strip()

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.terminate()
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


def _parse_kv(line: str) -> dict[str, int]:
    out = {}
    for tok in line.split()[1:]:
        k, _, v = tok.partition("=")
        try:
            out[k] = int(v)
        except ValueError:
            pass
    return out


def iteration_stats(durations_ns: np.ndarray) -> dict[str, Any]:
    """median, min, max and spread = (max - min) / median of iteration times (ns)."""
    d = np.asarray(durations_ns, dtype=np.float64)
    if d.size == 0:
        return {"iteration_time_median_ns": None, "iteration_time_min_ns": None,
                "iteration_time_max_ns": None, "iteration_time_spread": None, "measured_iterations": 0}
    med = float(np.median(d))
    return {"iteration_time_median_ns": med, "iteration_time_min_ns": float(d.min()),
            "iteration_time_max_ns": float(d.max()),
            "iteration_time_spread": (float(d.max() - d.min()) / med) if med > 0 else None,
            "measured_iterations": int(d.size)}


def _mglru_now() -> MglruState | None:
    from moetrace.kernel.features import mglru_state

    try:
        return mglru_state("/")
    except OSError:
        return None


#: what a balloon leaves beside C + headroom while a recorder starts (its Python, tables and maps:
#: MemAvailable fell by 256 MiB from the balloon to loop entry in a 6.12 guest under TCG, measured);
#: topped up at loop entry
RECORDER_ALLOWANCE = 320 << 20
#: a top-up smaller than this is not made
TOP_UP_MIN = 4 << 20


def _top_up_balloon(spec: CellSpec, scope: Scope, bscope: Scope, result: Cell) -> Balloon | None:
    """At loop entry, with the recorder and the replay settled: lock what is available beyond
    C + headroom - the replay's anonymous memory (the file capacity a cgroup wall of C + headroom
    would leave) in a second balloon, so that the recorder's own memory does not come out of C;
    never below the safe reserve (noted). Short (the recorder took more than its allowance):
    noted, no top-up."""
    mi = read_meminfo("/")
    avail = mi["MemAvailable_bytes"]
    st = scope.counters().get("stat", {}) if scope.exists() else {}
    anon = int(st.get("rss", st.get("anon")) or 0)
    target = spec.capacity_bytes + spec.headroom_bytes - anon
    reserve = safe_reserve_bytes(mi["MemTotal_bytes"])
    info: dict[str, Any] = {"mem_available_bytes": avail, "anon_bytes": anon, "target_bytes": target,
                            "reserve_bytes": reserve}
    if target < reserve:  # never lock below the reserve (the recorder and the cell must finish)
        result["notes"].append(f"the balloon's top-up stops at the safe reserve ({reserve} B), above C + headroom "
                               f"- the replay's anon ({target} B): the file tier had more than C")
        target = reserve
    extra = (avail - target) // PAGE * PAGE
    info["bytes"] = extra if extra >= TOP_UP_MIN else 0
    result["balloon"]["top_up"] = info
    if extra < TOP_UP_MIN:
        if extra < 0:
            result["notes"].append(f"the recorder took more than its allowance: MemAvailable at loop entry "
                                   f"is {-extra} B below C + headroom - the replay's anonymous memory")
        info["verified"] = True
        return None
    b = Balloon(extra, bscope, python=spec.python, thp=spec.balloon_thp).start()
    # read again once locked: what the machine freed or took meanwhile (other processes, the
    # kernel) moves MemAvailable away from the target, and the loop-entry snapshot sees it
    info.update(pid=b.pid, vmlck_bytes=b.vmlck_bytes, verified=b.verified(),
                mem_available_after_bytes=read_meminfo("/")["MemAvailable_bytes"])
    return b


def run_cell(spec: CellSpec, out_dir: str | os.PathLike, curve=None,
             on_phase: Callable[[str], None] | None = None) -> Cell:
    """Run one cell (Algorithm 1) into ``out_dir`` and return what cell.json holds.

    Bad inputs raise UsageError/InputError before anything is created. Failures
    while the cell runs are recorded (retained = false, with the reason) rather
    than raised; SIGINT/SIGTERM (inside :func:`interrupt_handlers`) raise
    CellInterrupted after the scope, balloon and child are gone. ``curve`` is a
    :func:`miss_curve` to reuse across cells of one plan. ``on_phase(name)``, when given,
    is told each phase as it starts (clean, drop caches, scope or balloon, warmup,
    measured, cleanup, results: for a progress display); None: nothing is reported."""
    return _Cell(spec, out_dir, on_phase).run(curve)


class _Cell:
    """One capacity cell: the steps of :func:`run_cell`, each a method, sharing the state (the
    spec, the scopes, the balloons, the replay child, the snapshots and the ``result`` that
    cell.json holds)."""

    def __init__(self, spec: CellSpec, out_dir: str | os.PathLike, on_phase: Callable[[str], None] | None):
        """The inputs, checked before anything is created, and the result's first keys."""
        from moetrace.inputs.plan import read_header
        from moetrace.inputs.pool import open_pool

        spec.validate()
        check_privileges()
        self.spec, self.on_phase = spec, on_phase
        self.pool = pool = open_pool(spec.pool)
        hdr = read_header(spec.plan)
        if (hdr.n_layers, hdr.n_experts) != (pool.geometry.n_layers, pool.geometry.n_experts):
            raise InputError(f"the plan's geometry ({hdr.n_layers} layers x {hdr.n_experts} experts) is not the "
                             f"pool's ({pool.geometry.n_layers} x {pool.geometry.n_experts})", path=str(spec.plan),
                             hint="compile the plan with the pool's --geometry and --experts")
        self.dev = dev = device_of(pool.data_paths()[0])
        self.controller = controller = find_memory_controller()
        self.out = out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "snapshots").mkdir(exist_ok=True)
        self.run_dir = out / "replay"
        self.scope = scope = Scope(spec.name, controller)
        self.bscope = Scope(f"{spec.name}.balloon", controller)
        self.result: Cell = {
            "schema": CELL_SCHEMA, "complete": False,
            "inputs": {k: v for k, v in asdict(spec).items() if k not in ("replay_argv",)},
            "capacity_bytes": int(spec.capacity_bytes), "mechanism": spec.mechanism, "mode": spec.mode,
            "headroom_bytes": int(spec.headroom_bytes), "arena_request_bytes": spec.arena_bytes,
            # what a check across kernels names (the kernel lab: 6.1 vs 6.12, MGLRU on vs off)
            "kernel": {"release": os.uname().release, "mglru": _mglru_now()},
            # the host's facts: check refuses to pool repeats from different hosts (cells as jobs)
            "host": host_facts(pool.root),
            "scope": {"path": str(scope.path), "cgroup_version": controller.version, "limit_bytes": None},
            "device": asdict(dev), "plan": {"n_iterations": hdr.n_iterations, "n_passes": hdr.n_passes,
                                            "n_reads": hdr.n_reads},
            "pool": {"root": str(pool.root), "layout": pool.layout, "extent_bytes": pool.extent_bytes,
                     "expert_bytes": pool.geometry.expert_bytes, "data_bytes": pool.data_bytes},
            "retained": False, "reasons": [], "notes": [],
        }
        self.reasons: list[str] = self.result["reasons"]
        self.snaps: dict[str, dict] = {}
        self.child: _Child | None = None
        self.proc: subprocess.Popen | None = None
        self.balloon: Balloon | None = None
        self.top_up: Balloon | None = None
        self.slack = 0
        self.klog: KernelLog | None = None
        self.interrupted: CellInterrupted | None = None
        self.watch: Path | None = None  # the recording's (or watch's) run directory
        self.pids: dict[str, int] = {}
        self.deadline = 0.0

    def run(self, curve) -> Cell:
        """The steps in order; a failure becomes a reason, the clean-up always runs."""
        try:
            try:
                self.clean()
                self.make_scope()
                self.start_replay()
                if self.reach_loop_entry():
                    self.measured_window()
                self.wait_replay()
            except CellInterrupted as e:
                self.interrupted = e
                self.reasons.append(str(e))
            except TimeoutError:
                self.reasons.append(f"timed out after {self.spec.timeout_s:.0f} s")
            except subprocess.TimeoutExpired:
                self.reasons.append(f"replay did not exit within {self.spec.timeout_s:.0f} s")
            except (MoetraceError, OSError, subprocess.SubprocessError) as e:
                msg = e.format_message() if isinstance(e, MoetraceError) else f"{type(e).__name__}: {e}"
                self.reasons.append(f"error: {msg}")
            self.read_scopes()
        finally:
            self.clean_up()
        self.results(curve)
        if self.interrupted is not None:
            raise self.interrupted
        return self.result

    def phase(self, name: str) -> None:
        """Report a phase to on_phase; a failing display never fails the cell (CellInterrupted,
        a BaseException, still passes). A step's phase first raises a signal swallowed before it
        (check_interrupted); the clean-up's do not (it runs to the end)."""
        if name not in ("cleanup", "results") and self.interrupted is None:
            check_interrupted()
        if self.on_phase is not None:
            try:
                self.on_phase(name)
            except Exception:  # noqa: BLE001
                pass

    def snap(self, label: str, pids: dict[str, int]) -> dict:
        """A /proc snapshot with both scopes' counters, kept and written to snapshots/<label>.json."""
        scope, bscope = self.scope, self.bscope
        s = take_snapshot(label, device=self.dev.name, pids=pids,
                          extra={"scope": scope.counters() if scope.exists() else None,
                                 "balloon_scope": bscope.counters() if bscope.exists() else None})
        self.snaps[label] = s
        metadata.write_snapshot(self.out / "snapshots" / f"{label}.json", s)
        return s

    # -- 1. a clean machine --------------------------------------------------------------------
    def clean(self) -> None:
        """Stale scopes of this cell's name removed, the kernel log marked, caches dropped."""
        spec, controller = self.spec, self.controller
        self.phase("clean")
        self.result["stale_scopes_removed"] = remove_stale_scopes(spec.name, controller) + \
            remove_stale_scopes(self.bscope.name, controller)
        self.klog = KernelLog()
        if spec.drop_caches:
            self.phase("drop caches")
            drop_caches()
        self.snap("pre", {})

    # -- 2. the scope ----------------------------------------------------------------------------
    def make_scope(self) -> None:
        """The capacity: a memory cgroup's limit, a balloon beside an unlimited scope, or the
        machine itself (an accounting scope without a limit)."""
        spec, scope, bscope, result = self.spec, self.scope, self.bscope, self.result
        if spec.mechanism == "cgroup":
            self.phase("scope")
            limit = int(spec.capacity_bytes + spec.headroom_bytes)
            scope.create(limit)
            result["scope"]["limit_bytes"] = limit
        elif spec.mechanism == "balloon":
            self.slack = slack = RECORDER_ALLOWANCE if (spec.record or spec.watch) else 0
            size, facts = balloon_size(spec.capacity_bytes, spec.headroom_bytes + slack)
            result["balloon"] = dict(facts, scope=str(bscope.path), recorder_allowance_bytes=slack)
            self.phase("balloon")
            bscope.create(None)
            self.balloon = balloon = Balloon(size, bscope, python=spec.python, thp=spec.balloon_thp).start()
            result["balloon"].update(pid=balloon.pid, vmlck_bytes=balloon.vmlck_bytes, verified=balloon.verified())
            scope.create(None)
        else:
            self.phase("scope")
            scope.create(None)

    # -- 3. the replay, inside the scope before it execs -----------------------------------------
    def start_replay(self) -> None:
        """The replay (under the recorder or the watch when asked: those stay outside the scope),
        its output files and the sync socket it waits on."""
        spec, result, out = self.spec, self.result, self.out
        self.phase("warmup")
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ, MOETRACE_PDEATHSIG="1")
        argv = _replay_argv(spec, self.run_dir, child_sock.fileno())
        result["replay_argv"] = argv
        preexec = self.scope.preexec()
        if spec.record:
            self.watch = out / "run"
            argv = _record_argv(spec, self.watch, self.scope.path) + argv
            result["record"] = {"run_dir": str(self.watch), "argv": argv[:argv.index("--") + 1]}
            preexec = lambda: set_pdeathsig(signal.SIGKILL)  # noqa: E731  (outside the scope)
        elif spec.watch:
            why = watch_unavailable()
            if why is None:
                self.watch = out / "watch"
                argv = _record_argv(spec, self.watch, self.scope.path, probes="pagecache") + argv
                result["watch"] = {"run_dir": str(self.watch), "argv": argv[:argv.index("--") + 1]}
                preexec = lambda: set_pdeathsig(signal.SIGKILL)  # noqa: E731  (outside the scope)
            else:
                result["notes"].append(f"outside evictions not watched: {why}")
        with open(out / "replay.stdout", "wb") as so, open(out / "replay.stderr", "wb") as se:
            self.proc = proc = subprocess.Popen(argv, stdout=so, stderr=se, stdin=subprocess.DEVNULL,
                                                pass_fds=(child_sock.fileno(),), preexec_fn=preexec, env=env)
        child_sock.close()
        self.child = _Child(proc, parent_sock)
        result["replay_pid"] = proc.pid
        self.pids = {"replay": proc.pid}
        if self.balloon:
            self.pids["balloon"] = self.balloon.pid
        self.deadline = time.monotonic() + spec.timeout_s

    # -- 4. loop entry ---------------------------------------------------------------------------
    def reach_loop_entry(self) -> bool:
        """Wait for the replay's loop_entry line; then the balloon's top-up and the loop-entry
        snapshot with what the page cache could still grow into. False: the replay ended first."""
        spec, result, scope = self.spec, self.result, self.scope
        line = self.child.next_line(self.deadline)
        while line is not None and not line.startswith("loop_entry"):
            check_interrupted()
            line = self.child.next_line(self.deadline)
        if line is None:
            self.reasons.append("replay ended before loop entry")
            return False
        result["loop_entry"] = _parse_kv(line)
        if self.watch is not None:  # proc is the recorder; the replay is the one task in the scope
            inside = scope.pids()
            if inside:
                self.pids["replay"] = inside[0]
                self.pids["recorder"] = self.proc.pid
                result["record" if spec.record else "watch"]["replay_pid"] = inside[0]
        if self.balloon is not None and self.slack:
            self.top_up = _top_up_balloon(spec, scope, self.bscope, result)
        s = self.snap("loop_entry", self.pids)
        # what the page cache could still grow into, whatever the mechanism (the effective
        # capacity beside nominal C: a guest's RAM or a balloon is never exactly C)
        result["mem_available_at_loop_entry_bytes"] = s["meminfo"].get("MemAvailable_bytes")
        st = (s.get("scope") or {}).get("stat", {})
        anon = st.get("rss", st.get("anon"))
        result["anon_at_loop_entry_bytes"] = anon
        if spec.mechanism == "cgroup" and anon is not None:
            lim = result["scope"]["limit_bytes"]
            locked = s["vmlck_bytes"].get("replay") or 0
            result["file_capacity_at_loop_entry_bytes"] = lim - anon
            if anon - locked > spec.headroom_bytes:
                result["notes"].append(
                    f"the replay's unlocked anonymous memory ({anon - locked} B) exceeds the headroom "
                    f"({spec.headroom_bytes} B): the file tier had less than C; raise --headroom")
        return True

    # -- 5. the measured window ------------------------------------------------------------------
    def measured_window(self) -> None:
        """`go` to the replay, wait for its `done`, the post snapshot; the balloons released."""
        self.phase("measured")
        self.child.sock.sendall(b"go\n")
        line = self.child.next_line(self.deadline)
        while line is not None and line != "done":
            line = self.child.next_line(self.deadline)
        self.snap("post", self.pids)
        if self.balloon is not None:  # the measured window is over: the recorder's tear-down and
            for b in (self.top_up, self.balloon):  # the results need the memory (measured: a guest
                if b is not None:  # left with none livelocked in reclaim)
                    b.stop()
            self.result["balloon"]["released_at"] = "post"
        if line is None:
            self.reasons.append("replay ended before done")

    def wait_replay(self) -> None:
        """The replay's (or its recorder's) exit status; a failing one is a reason."""
        rc = self.proc.wait(max(1.0, self.deadline - time.monotonic()))
        self.result["replay_exit"] = rc
        if "post" not in self.snaps:
            self.snap("post", {})
        if rc != 0:
            self.reasons.append(f"replay exited with status {rc}" + (
                f" (signal {signal.Signals(-rc).name})" if rc < 0 and -rc in signal.Signals._value2member_map_
                else ""))

    # -- 6. what the scopes saw, then clean-up (scopes still present while read) -------------------
    def read_scopes(self) -> None:
        """Peak memory and OOM events of the scope and the balloon's scope."""
        scope, bscope, result, reasons = self.scope, self.bscope, self.result, self.reasons
        try:
            result["scope_alive_at_end"] = scope.exists()
            if scope.exists():
                result["peak_memory_bytes"] = scope.peak_bytes()
                result["oom_events"] = scope.oom_events()
                if scope.oom_killed():
                    reasons.append(f"OOM event in the scope ({result['oom_events']})")
            elif self.spec.mechanism == "cgroup" or "replay_pid" in result:
                reasons.append("the scope vanished")
            if bscope.exists():
                result.setdefault("balloon", {})["oom_events"] = bscope.oom_events()
                if bscope.oom_killed():
                    reasons.append("OOM event in the balloon's scope")
        except OSError as e:
            reasons.append(f"error reading the scope: {e}")

    def clean_up(self) -> None:
        """The child, the balloons and both scopes gone, signals deferred meanwhile (one that came
        is raised after, as CellInterrupted)."""
        with _signals_deferred() as late:
            self.phase("cleanup")
            if self.child is not None:
                self.child.stop()
            for b in (self.top_up, self.balloon):
                if b is not None:
                    b.stop()
            removed = []
            for s in (self.scope, self.bscope):
                try:
                    removed.append(s.remove(kill=True) if s.exists() else True)
                except ScopeError as e:
                    removed.append(False)
                    self.reasons.append(str(e))
            self.result["scope_removed"] = all(removed)
        if late and self.interrupted is None:
            self.interrupted = CellInterrupted(late[0])
            self.reasons.append(str(self.interrupted))

    # -- 7. results ------------------------------------------------------------------------------
    def results(self, curve) -> None:
        """The kernel log, the recording's counts, outside evictions, the derived figures and
        retention; cell.json written."""
        spec, result, reasons, out = self.spec, self.result, self.reasons, self.out
        self.phase("results")
        if self.klog is not None:
            result["kernel_log"] = self.klog.since()
            result["kernel_log_source"] = self.klog.source
            if any("oom" in t.lower() or "out of memory" in t.lower() for t in result["kernel_log"]) \
                    and not any(r.startswith("OOM") for r in reasons):
                reasons.append("OOM in the kernel log during the cell")
        if spec.record:
            _recorded(result, out / "run")
        elif "watch" in result:
            _recorded(result, out / "watch", key="watch")
        _outside_evictions(result, spec)
        _finish(result, spec, self.snaps, self.run_dir, self.pool, curve, self.balloon)
        metadata.write_cell(out / "cell.json", result)


def _recorded(result: Cell, run: Path, key: str = "record") -> None:
    """The recording's per-phase page-cache counts (epochs): what the measured pass alone did."""
    rec = result.setdefault(key, {"run_dir": str(run)})
    try:
        from moetrace.run.directory import read_manifest

        doc = read_manifest(run)
    except Exception as e:  # noqa: BLE001 - a failed recording is reported, not fatal
        rec["error"] = f"run directory unreadable: {e}"
        return
    ep = doc.get("epochs") or {}
    by = ep.get("by_phase") or {}
    rec.update(complete=doc.get("complete"), epochs_mode=ep.get("mode"),
               measured_pages=by.get("measured"), warmup_pages=by.get("warmup"),
               totals=doc.get("totals"), lost=doc.get("lost"))
    m = by.get("measured")
    if m is not None and result.get("measured_iterations"):
        n = result["measured_iterations"]
        rec["measured_re_added_pages_per_iteration"] = m["re_added_pages"] / n
        rec["measured_added_pages_per_iteration"] = m["added_pages"] / n


def _outside_evictions(result: Cell, spec: CellSpec) -> None:
    """Pool pages evicted during the measured window by anyone but the cell's own capacity
    mechanism (from the recording's per-epoch evictor counts); a flag, or a reason to reject."""
    rec = result.get("record") or result.get("watch")
    own = OWN_EVICTORS.get(spec.mechanism, ())
    doc: dict[str, Any] = {"pages": None, "by": None, "own_mechanism": list(own), "window": "measured",
                           "policy": spec.outside_evictions}
    result["outside_evictions"] = doc
    m = (rec or {}).get("measured_pages")
    if not rec or rec.get("error") or m is None or "evicted_by" not in m:
        doc["why_na"] = ((rec or {}).get("error") or ("not watched (--no-watch, or the pagecache probe cannot run)"
                         if not rec else "the recording kept no per-epoch evictor counts"))
        return
    by = {k: v for k, v in m["evicted_by"].items() if k not in own and v}
    doc["pages"] = sum(by.values())
    doc["by"] = by
    doc["own_pages"] = {k: m["evicted_by"].get(k, 0) for k in own}
    if doc["pages"]:
        text = (f"{doc['pages']} pool pages evicted by others during the measured window ("
                + ", ".join(f"{k} {v}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])) + ")")
        result.setdefault("flags", []).append(text)
        if spec.outside_evictions == "reject":
            result["reasons"].append(text)


def _finish(result: Cell, spec: CellSpec, snaps: dict, run_dir: Path, pool, curve, balloon) -> None:
    """Derived figures (device bytes, iteration times, miss demand, amplification) and retention."""
    reasons = result["reasons"]
    # the replay's own files
    summary = None
    try:
        summary = metadata.read_replay(run_dir / "replay.json")
    except InputError:  # none (the replay did not start), or unreadable: the cell says so below
        pass
    result["replay_summary"] = summary
    durs = np.zeros(0)
    try:
        import pandas as pd

        it = pd.read_parquet(run_dir / "iterations.parquet")
        m = it[it["phase"] == "measured"]
        durs = m["duration_ns"].to_numpy(np.float64)
        result["measured_logical_bytes"] = int(m["bytes"].sum())
        for c in ("arena_hits", "hints_submitted", "hints_overwritten", "hints_completed"):
            if c in m:
                result[f"measured_{c}"] = int(m[c].sum())
    except Exception:  # noqa: BLE001 - absent or unreadable log: NA figures, reason below
        if "loop_entry" in snaps:
            reasons.append("no readable iterations.parquet from the replay")
    result.update(iteration_stats(durs))
    n_meas = result["measured_iterations"] or None
    # device bytes over the measured interval
    le, post = snaps.get("loop_entry"), snaps.get("post")
    if le and post:
        d = post["diskstats"]["sectors_read"] - le["diskstats"]["sectors_read"]
        result["device_bytes"] = d * SECTOR_BYTES
        result["measured_interval_ns"] = post["monotonic_ns"] - le["monotonic_ns"]
        result["vmstat_pgpgin_bytes"] = (post["vmstat"].get("pgpgin", 0) - le["vmstat"].get("pgpgin", 0)) * 1024
        result["refault_file_pages"] = (post["vmstat"].get("workingset_refault_file", 0)
                                        - le["vmstat"].get("workingset_refault_file", 0))
        # shadow entries the kernel dropped (the workingset shadow-node shrinker, up to 64 a node):
        # a page evicted with its shadow gone is re-read without a refault, so the kernel's
        # refault count undercounts re-reads by up to 64 x this (the recording's re-adds do not)
        pre = snaps.get("pre") or le
        result["shadow_nodes_reclaimed"] = {
            "cell": post["vmstat"].get("workingset_nodereclaim", 0) - pre["vmstat"].get("workingset_nodereclaim", 0),
            "measured": post["vmstat"].get("workingset_nodereclaim", 0) - le["vmstat"].get("workingset_nodereclaim", 0)}
        if result["shadow_nodes_reclaimed"]["cell"]:
            result["notes"].append(
                f"the kernel reclaimed {result['shadow_nodes_reclaimed']['cell']} workingset shadow nodes during the "
                f"cell: refault_file_pages undercounts re-reads by up to 64 pages a node")
        a, b = (le.get("scope") or {}).get("stat", {}), (post.get("scope") or {}).get("stat", {})
        if "pgpgin" in a and "pgpgin" in b:
            result["memcg_pgpgin_pages"] = b["pgpgin"] - a["pgpgin"]
        result["vmlck_at_loop_entry_bytes"] = le["vmlck_bytes"].get("replay")
    else:
        result["device_bytes"] = None
    dev_b = result.get("device_bytes")
    result["device_bytes_per_iteration"] = (dev_b / n_meas) if (dev_b is not None and n_meas) else None
    # simulated miss demand
    try:
        if curve is not None:
            cv = curve
        elif spec.miss_curve:
            cv = load_miss_curve(spec.miss_curve, spec.plan, spec.warmup, spec.passes)
        else:
            cv = miss_curve(spec.plan, spec.warmup, spec.passes)
        sim = simulated_miss(cv, spec.capacity_bytes, pool.extent_bytes, pool.geometry.expert_bytes)
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        sim = None
        result["notes"].append(f"simulation failed: {e}")
    result["simulated"] = sim
    miss = sim["miss_bytes_per_iteration"] if sim else None
    result["miss_bytes_per_iteration"] = miss
    dpi = result["device_bytes_per_iteration"]
    result["amplification"] = (dpi / miss) if (dpi is not None and miss) else None
    # retention: VmLck matches the request
    vm = result.get("vmlck_at_loop_entry_bytes")
    if "loop_entry" in snaps:
        arena = spec.arena_bytes
        if arena is not None:
            want = -(-arena // PAGE) * PAGE
            reported = (result.get("loop_entry") or {}).get("arena_bytes")
            tol = max(PAGE, pool.extent_bytes)
            result["vmlck_expected_bytes"] = want
            if vm is None or abs(vm - want) > tol:
                reasons.append(f"VmLck {vm} B does not match the requested arena {want} B (tolerance {tol} B)")
            elif reported is not None and abs(vm - (-(-reported // PAGE) * PAGE)) > PAGE:
                reasons.append(f"VmLck {vm} B does not match the replay's arena {reported} B")
        else:
            result["vmlck_expected_bytes"] = 0
            if vm is None or vm > VMLCK_ZERO_TOLERANCE:
                reasons.append(f"VmLck {vm} B where the mode locks nothing")
    if spec.mechanism == "balloon":
        b = result.get("balloon") or {}
        if not b.get("verified"):
            reasons.append(f"balloon VmLck {b.get('vmlck_bytes')} B does not match its size {b.get('balloon_bytes')} B")
        t = b.get("top_up") or {}
        if t and not t.get("verified"):
            reasons.append(f"the balloon's top-up VmLck {t.get('vmlck_bytes')} B does not match its size "
                           f"{t.get('bytes')} B")
    if summary is not None and summary.get("complete") is False:
        reasons.append("the replay marked its run incomplete")
    result["retained"] = not reasons
    result["complete"] = "post" in snaps and "loop_entry" in snaps
