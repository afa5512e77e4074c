"""Loading the probes: privilege and tracefs checks, the CO-RE objects (compiled once by
scripts/build-probes.sh, loaded and attached by libbpf: :func:`load_core`), map and program
readers, one bounded ring-buffer consumer with per-interval lost counts, and the detach that
does not make the recorder wait for the kernel (:class:`Releaser`).

Knobs are the objects' read-only globals, set before load; which programs load and attach is
decided by the attach plan (moetrace.record.spec.resolve), never by the kernel's version.
Every kernel met so far has BTF; one without it cannot run the probes (doctor says so).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from moetrace.errors import PrivilegeError, ProbeError

from moetrace.probes import BUILD_SCRIPT, PROBES_DIR  # noqa: E402


def require_privileges(privs: dict[str, bool]) -> None:
    """Raise PrivilegeError unless root or CAP_BPF + CAP_PERFMON are held.

    ``privs`` is :func:`moetrace.kernel.features.privileges` output. The message names
    every missing privilege (tracepoint programs need CAP_BPF to load and
    CAP_PERFMON to attach; root holds both)."""
    if privs.get("root"):
        return
    missing = [name for key, name in (("cap_bpf", "CAP_BPF"), ("cap_perfmon", "CAP_PERFMON"))
               if not privs.get(key)]
    if not missing:
        return
    raise PrivilegeError(
        f"recording needs root or CAP_BPF + CAP_PERFMON; this process is not root and lacks "
        f"{' and '.join(missing)}",
        hint="run as root (sudo moetrace record ...) or grant the capabilities: "
             "sudo setcap cap_bpf,cap_perfmon+ep $(readlink -f $(which python3))")


def require_tracefs(features) -> Path:
    """The tracefs path; mounts it when absent and privileged (the note lands in
    ``features.notes``), else raises naming the mount command."""
    from moetrace.kernel.features import TRACEFS_MOUNT_CMD, ensure_tracefs, tracefs_path

    note = ensure_tracefs()
    if note and note not in features.notes:
        features.notes.append(note)
    if note and hasattr(features, "debugfs"):  # debugfs mounted just now: lru_gen is readable from here on
        from moetrace.kernel.features import debugfs_path, mglru_state

        features.debugfs = debugfs_path(features.root)
        features.mglru = mglru_state(features.root)
    if features.tracefs is None:
        features.tracefs = tracefs_path(features.root)
    if features.tracefs is not None:
        return Path(features.tracefs)
    p = tracefs_path(features.root, mount=True)
    if p is None:
        raise PrivilegeError("tracefs is not mounted (libbpf reads tracepoint ids from it)",
                             hint=f"mount it: {TRACEFS_MOUNT_CMD}")
    from moetrace.kernel.features import mount_notes

    features.tracefs = p
    for n in mount_notes():
        if n not in features.notes:
            features.notes.append(n)
    if not features.notes:
        features.notes.append(f"mounted tracefs at {p}")
    return p


# ---------------------------------------------------------------------------
# CO-RE objects: compiled once (scripts/build-probes.sh), loaded by libbpf


def object_path(name: str) -> Path:
    """probes/build/<name>.bpf.o (``MOETRACE_PROBE_OBJECTS`` overrides the directory)."""
    d = os.environ.get("MOETRACE_PROBE_OBJECTS")
    return (Path(d) if d else PROBES_DIR / "build") / f"{name}.bpf.o"


def probe_objects() -> list[Path]:
    """Every compiled probe object (the directory of :func:`object_path`)."""
    return sorted(object_path("x").parent.glob("*.bpf.o"))


def core_source(name: str) -> Path:
    return PROBES_DIR / f"{name}.bpf.c"


def stale_object(name: str) -> str | None:
    """Why probes/build/<name>.bpf.o cannot be used as it is (missing, older than its sources),
    with the command that builds it; None when it is current."""
    obj = object_path(name)
    fix = ("build it: bash scripts/build-probes.sh (make setup runs it)" if BUILD_SCRIPT else
           "this installation lacks it: reinstall moetrace from a wheel built after the probes were "
           "(scripts/build-probes.sh in a checkout), or set MOETRACE_PROBE_OBJECTS to a directory of objects")
    if not obj.exists():
        return f"no compiled object {obj}; {fix}"
    if os.environ.get("MOETRACE_PROBE_OBJECTS") or BUILD_SCRIPT is None:  # installed: nothing to rebuild
        return None
    t = obj.stat().st_mtime
    for src in (core_source(name), PROBES_DIR / "moetrace.bpf.h"):
        if src.exists() and src.stat().st_mtime > t:
            return f"{obj} is older than {src.name}; re{fix}"
    return None


def _pair_arrays(pairs: list[tuple[bytes, bytes]], key_dtype, value_dtype) -> tuple[np.ndarray, np.ndarray]:
    """Raw (key, value) pairs of a map as two numpy arrays; the dtypes must be the map's sizes."""
    kd, vd = np.dtype(key_dtype), np.dtype(value_dtype)
    if pairs and (len(pairs[0][0]) != kd.itemsize or len(pairs[0][1]) != vd.itemsize):
        raise ValueError(f"map records are {len(pairs[0][0])} / {len(pairs[0][1])} B, the dtypes "
                         f"{kd.itemsize} / {vd.itemsize} B")
    return (np.frombuffer(b"".join(k for k, _v in pairs), kd).copy(),
            np.frombuffer(b"".join(v for _k, v in pairs), vd).copy())


@dataclass
class CoreProbe:
    """A CO-RE object loaded by libbpf and attached; ``close()`` detaches everything."""

    name: str
    obj: Any
    load_attach_s: float
    tracepoints: list[str] = field(default_factory=list)
    closed: bool = False
    load_s: float = 0.0  # open + load (libbpf relocations, verifier): no compiler
    attach_s: float = 0.0
    attached: dict[str, str] = field(default_factory=dict)  # program -> "kind target"
    _rings: list = field(default_factory=list)
    _readers: list = field(default_factory=list)

    def table(self, name: str):
        return self.obj.map(name)

    def put(self, table: str, key: bytes, value: bytes) -> None:
        self.obj.map(table).update(key, value)

    def get(self, table: str, key: bytes) -> bytes | None:
        return self.obj.map(table).lookup(key)

    def delete(self, table: str, key: bytes) -> bool:
        return self.obj.map(table).delete(key)

    def items(self, table: str, key_dtype, value_dtype) -> tuple[np.ndarray, np.ndarray]:
        """Every (key, value) of a hash map (a key walk, then one lookup per key; a key deleted
        in between is left out)."""
        m = self.obj.map(table)
        pairs = [(k, m.lookup(k)) for k in (x.tobytes() for x in m.keys(np.dtype((np.void, m.key_size))))]
        return _pair_arrays([(k, v) for k, v in pairs if v is not None], key_dtype, value_dtype)

    def prog_fds(self) -> dict[str, int]:
        return {} if self.closed else self.obj.prog_fds()

    def open_ring(self, table: str, callback) -> None:
        from moetrace.kernel.libbpf import RingBuffer

        self._rings.append(RingBuffer(self.obj.map(table), lambda data, size: callback(None, data, size)))

    def ring_reader(self, table: str, record_size: int):
        """The ring ``table`` read in place (moetrace.kernel.libbpf.MmapRing), closed with the probe."""
        from moetrace.kernel.libbpf import MmapRing

        r = MmapRing(self.obj.map(table), record_size)
        self._readers.append(r)
        return r

    def ring_poll(self, timeout_ms: int) -> None:
        for i, r in enumerate(self._rings):
            r.poll(timeout_ms if i == 0 else 0)

    def ring_consume(self) -> None:
        for r in self._rings:
            r.consume()

    def arm(self, on: bool = True) -> bool:
        if self.closed:
            return False
        self.obj.store_u32("armed", 1 if on else 0)
        return True

    def close(self) -> None:
        """Detach every link and free the maps (idempotent)."""
        if not self.closed:
            self.closed = True
            for r in self._rings:
                r.free()
            for r in self._readers:
                r.close()
            self._rings, self._readers = [], []
            self.obj.close()

    def __enter__(self) -> "CoreProbe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_CORE_BTF: dict[str, Path | None] = {}
_CORE_BTF_LOCK = threading.Lock()
#: set to 1: libbpf relocates against the kernel's whole BTF (no minimal BTF; to compare the two)
NO_MIN_BTF_ENV = "MOETRACE_NO_MIN_BTF"


def core_btf() -> Path | None:
    """The minimal BTF the probe objects relocate against on this kernel (made once per kernel
    and set of objects, cached: moetrace.kernel.minbtf), None when there is none to be had or
    ``MOETRACE_NO_MIN_BTF=1``. Decided once per process."""
    if os.environ.get(NO_MIN_BTF_ENV, "").strip() not in ("", "0"):
        return None
    with _CORE_BTF_LOCK:
        if "path" not in _CORE_BTF:
            from moetrace.kernel import minbtf

            objs = probe_objects()
            _CORE_BTF["path"] = minbtf.ensure(objs) if objs else None
        return _CORE_BTF["path"]


def _open_and_load(name: str, knobs: dict[str, int | bool], wanted: set[str], map_sizes: dict[str, int] | None,
                   gated: bool, attach_targets: dict[str, str] | None, btf: Path | None):
    """probes/build/<name>.bpf.o opened (relocated against ``btf``, else the kernel's BTF), its
    knobs and map sizes set, only the ``wanted`` programs loaded; closed on failure."""
    from moetrace.kernel.libbpf import BpfObject

    obj = BpfObject(object_path(name), name, btf_custom_path=btf)
    try:
        values = {k.lower(): int(v) for k, v in knobs.items()}
        values["gated"] = int(gated)
        obj.set_globals(values)
        for m, n in (map_sizes or {}).items():
            obj.set_max_entries(m, n)
        for prog in obj.programs:
            obj.set_autoload(prog, prog in wanted)
        for prog, func in (attach_targets or {}).items():
            obj.set_attach_target(prog, func)
        obj.load()
    except BaseException:
        obj.close()
        raise
    return obj


def load_core(name: str, knobs: dict[str, int | bool], attach: list[tuple[str, str, str]],
              map_sizes: dict[str, int] | None = None, gated: bool = False,
              attach_targets: dict[str, str] | None = None) -> CoreProbe:
    """Open probes/build/<name>.bpf.o, set its knobs (read-only globals, lower-case names) and map
    sizes, load only the programs of ``attach`` ((program, kind, target): kind tracepoint
    "cat:event", kprobe / kretprobe symbol, fentry / fexit / tp_btf), attach them in that order;
    a perf_event program is loaded, not attached (its perf events are the caller's to open:
    :func:`moetrace.kernel.perf.attach_cpu_clock`). ``attach_targets``: {program: kernel
    function} of fentry/fexit programs, set before load.
    Everything is detached on failure."""
    why = stale_object(name)
    if why:
        raise ProbeError(f"probe {name}: {why}")
    if any(kind == "tracepoint" for _p, kind, _t in attach):
        # libbpf reads a tracepoint's id from tracefs (/sys/kernel/debug/tracing when it exists, else
        # /sys/kernel/tracing): mounted here when absent (`record` has mounted them in a namespace
        # of its own already; a fresh machine has neither at boot)
        from moetrace.kernel.features import ensure_tracefs

        ensure_tracefs()
    t0 = time.perf_counter()
    custom = core_btf()
    try:
        obj = _open_and_load(name, knobs, {p for p, _k, _t in attach}, map_sizes, gated, attach_targets, custom)
    except ProbeError:
        if custom is None:
            raise
        # a minimal BTF that misses a type (a stale cache file): the kernel's own has them all
        obj = _open_and_load(name, knobs, {p for p, _k, _t in attach}, map_sizes, gated, attach_targets, None)
    try:
        t1 = time.perf_counter()
        done: dict[str, str] = {}
        tps: list[str] = []
        for prog, kind, target in attach:
            if kind == "tracepoint":
                cat, ev = target.split(":", 1)
                obj.attach_tracepoint(prog, cat, ev)
                tps.append(target)
            elif kind in ("kprobe", "kretprobe"):
                obj.attach_kprobe(prog, target, retprobe=kind == "kretprobe")
            elif kind in ("fentry", "fexit", "tp_btf"):
                obj.attach_trace(prog)
            elif kind == "perf_event":
                continue  # loaded only: the caller opens its perf events (one per CPU) and attaches
            else:
                raise ProbeError(f"probe {name}: cannot attach {prog} as {kind}")
            done[prog] = f"{kind} {target}"
    except BaseException:
        obj.close()
        raise
    t2 = time.perf_counter()
    return CoreProbe(name, obj, t2 - t0, sorted(tps), load_s=t1 - t0, attach_s=t2 - t1, attached=done)


def prog_fdinfo(fd: int) -> dict[str, int]:
    """Integer fields of /proc/self/fdinfo/<fd> of a BPF program (prog_id, run_cnt,
    run_time_ns, recursion_misses, ...)."""
    out: dict[str, int] = {}
    try:
        text = Path(f"/proc/self/fdinfo/{fd}").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        k, _, v = line.partition(":")
        v = v.strip()
        if v.lstrip("-").isdigit():
            out[k.strip()] = int(v)
    return out


def recursion_misses(progs: dict[str, int], default: int | None = None) -> dict[str, int | None]:
    """{program: runs the kernel skipped to BPF recursion protection} of loaded programs
    ({program: fd}) from fdinfo ``recursion_misses`` (5.12+; ``default`` where it is absent):
    the only loss of in-kernel counters."""
    return {n: prog_fdinfo(fd).get("recursion_misses", default) for n, fd in progs.items()}


def prog_runtime(progs: dict[str, int]) -> dict[str, dict[str, int | None]]:
    """{program: {"run_cnt", "run_time_ns"}} of loaded programs ({program: fd}). The kernel
    counts them only while run-time statistics are on (:func:`enable_stats`)."""
    out: dict[str, dict[str, int | None]] = {}
    for name, fd in progs.items():
        info = prog_fdinfo(fd)
        out[name] = {"run_cnt": info.get("run_cnt"), "run_time_ns": info.get("run_time_ns")}
    return out


_BPF_ENABLE_STATS = 32
_BPF_STATS_RUN_TIME = 0


def enable_stats() -> int:
    """Turn BPF run-time statistics on (BPF_ENABLE_STATS, 5.8+): returns an fd; the
    statistics stay on while it is open and go off by themselves when it is closed (also
    when this process dies), so nothing is left changed. Raises OSError when refused."""
    from moetrace.kernel.syscalls import sys_bpf

    fd = sys_bpf(_BPF_ENABLE_STATS, (ctypes.c_uint32 * 4)(_BPF_STATS_RUN_TIME, 0, 0, 0))
    if fd < 0:
        raise OSError(-fd, f"BPF_ENABLE_STATS: {os.strerror(-fd)}")
    return fd


def entry_count(table) -> int:
    """Entries in a hash map (a :class:`moetrace.kernel.libbpf.Map`)."""
    return len(table.keys(np.dtype((np.void, table.key_size))))


# ---------------------------------------------------------------------------
# per-event streams


@dataclass
class IntervalLoss:
    """One polling interval of an event stream."""

    start_ns: int
    end_ns: int
    records: int
    lost_kernel: int  # records the kernel could not queue (ring full / perf lost)
    lost_user: int  # records received but dropped because the in-memory bound was hit


class EventStream:
    """The one bounded ring-buffer consumer every per-event probe uses.

    The ring (BPF_MAP_TYPE_RINGBUF) is read in place, every ready record in one step
    (:class:`moetrace.kernel.libbpf.MmapRing`: no Python call per record); the probe counts
    its failed reserves in a stats slot, read through ``kernel_lost``. Records are kept as raw
    bytes; at most ``max_records`` are kept and the rest are counted lost (user side), so
    memory stays bounded. ``poll(timeout_ms)`` consumes what is ready and closes an interval
    every ``interval_s``; ``intervals`` holds one :class:`IntervalLoss` per interval, so lost
    events are recorded per interval, never only logged.
    """

    def __init__(self, probe: CoreProbe, table: str, record_size: int,
                 kernel_lost: Callable[[], int] | None = None, max_records: int = 5_000_000,
                 interval_s: float = 1.0):
        self.probe, self.record_size = probe, record_size
        self.max_records, self.interval_ns = max_records, int(interval_s * 1e9)
        self._kernel_lost = kernel_lost
        self.chunks: list[bytes] = []
        self.kept = 0
        self._n = 0
        self._lost_user = 0
        self._kl0 = self._kernel_lost_now()
        self.intervals: list[IntervalLoss] = []
        self._t0 = time.monotonic_ns()
        self._mark = (0, 0, self._kl0)  # records, lost_user, kernel lost at interval start
        self._reader = probe.ring_reader(table, record_size)

    def _kernel_lost_now(self) -> int:
        return int(self._kernel_lost()) if self._kernel_lost is not None else 0

    def wake_on(self, fd: int) -> None:
        """:meth:`poll` also returns when ``fd`` turns readable (the recorded command's pidfd)."""
        self._reader.wake_on(fd)

    def _take(self, data: bytes) -> None:
        """Records read in one batch: kept up to ``max_records``, the rest counted lost (user side)."""
        n = len(data) // self.record_size
        self._n += n
        room = max(0, self.max_records - self.kept)
        if n > room:
            self._lost_user += n - room
            data = data[:room * self.record_size]
            n = room
        if n:
            self.chunks.append(data)
            self.kept += n

    def poll(self, timeout_ms: int = 100) -> None:
        """Consume ready records (waiting at most ``timeout_ms``); close intervals on time."""
        self._reader.wait(timeout_ms)
        self._take(self._reader.read())
        now = time.monotonic_ns()
        if now - self._t0 >= self.interval_ns:
            self._close_interval(now)

    def _close_interval(self, now: int) -> None:
        n0, u0, k0 = self._mark
        k = self._kernel_lost_now()
        self.intervals.append(IntervalLoss(self._t0, now, self._n - n0, k - k0, self._lost_user - u0))
        self._mark = (self._n, self._lost_user, k)
        self._t0 = now

    def finish(self) -> None:
        """Drain what is left and close the last interval."""
        self._take(self._reader.read())
        self._close_interval(time.monotonic_ns())

    @property
    def lost_kernel(self) -> int:
        return sum(i.lost_kernel for i in self.intervals)

    @property
    def lost_user(self) -> int:
        return sum(i.lost_user for i in self.intervals)

    def records(self) -> bytes:
        """The kept records, concatenated (``record_size`` bytes each)."""
        return b"".join(self.chunks)

    def take(self) -> tuple[bytes, int, int]:
        """A consumer that reads as it goes (``moetrace watch``): the records kept since the last
        take, handed over and forgotten, with the records lost meanwhile (kernel, user side).
        Memory stays bounded by what one take brings (``max_records`` at most), and the
        per-interval losses are folded into the totals instead of kept."""
        self._take(self._reader.read())
        out, self.chunks, self.kept = b"".join(self.chunks), [], 0
        k = self._kernel_lost_now()
        n0, u0, k0 = self._mark
        lost = (k - k0, self._lost_user - u0)
        self._mark = (self._n, self._lost_user, k)
        self.intervals.clear()
        self._t0 = time.monotonic_ns()
        return out, lost[0], lost[1]


# ---------------------------------------------------------------------------
# BPF program info (UAPI struct bpf_prog_info: append-only, layout-stable)

_BPF_OBJ_GET_INFO_BY_FD = 15
_INFO_RECURSION_MISSES = 208  # offsetof(struct bpf_prog_info, recursion_misses), since 5.12
_INFO_LEN = 256


class _InfoAttr(ctypes.Structure):
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32), ("info", ctypes.c_uint64)]


def prog_info(fd: int) -> dict[str, int] | None:
    """{"id", "recursion_misses"} of a loaded BPF program (kernel-counted events it
    missed to recursion protection: the counters' only loss), or None."""
    from moetrace.kernel.syscalls import sys_bpf

    buf = ctypes.create_string_buffer(_INFO_LEN)
    attr = _InfoAttr(fd, _INFO_LEN, ctypes.addressof(buf))
    if sys_bpf(_BPF_OBJ_GET_INFO_BY_FD, attr) != 0:
        return None
    out = {"id": int.from_bytes(buf.raw[4:8], "little"), "recursion_misses": None}
    if attr.info_len >= _INFO_RECURSION_MISSES + 8:
        out["recursion_misses"] = int.from_bytes(buf.raw[_INFO_RECURSION_MISSES:_INFO_RECURSION_MISSES + 8],
                                                 "little")
    return out


_BPF_PROG_GET_FD_BY_ID = 13


class _IdAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("next_id", ctypes.c_uint32), ("open_flags", ctypes.c_uint32)]


def prog_id_exists(prog_id: int) -> bool:
    """True while a BPF program with this id is loaded (BPF_PROG_GET_FD_BY_ID)."""
    from moetrace.kernel.syscalls import sys_bpf

    fd = sys_bpf(_BPF_PROG_GET_FD_BY_ID, _IdAttr(prog_id, 0, 0))
    if fd >= 0:
        os.close(fd)
        return True
    return False


# ---------------------------------------------------------------------------
# reading a BPF array fast


def read_array(table, dtype: np.dtype, value_size: int | None = None, n: int | None = None) -> np.ndarray:
    """Every value of an array map (a :class:`moetrace.kernel.libbpf.Map`) as a
    numpy structured array, by BPF_MAP_LOOKUP_BATCH (one syscall per 64 Ki entries instead of
    one per entry; per-entry lookups where the kernel lacks batch ops). ``value_size``: what the
    kernel copies per entry when it is not the map's value size (a per-CPU array: the
    8-byte-rounded value x possible CPUs). ``n``: read only the first ``n`` entries (the rest
    known to be zero), still returning the whole array."""
    from moetrace.kernel.libbpf import read_array_fd

    if value_size is None:
        value_size = table.value_size
    total = len(table)
    if n is None or n >= total:
        return read_array_fd(table.fd, total, np.dtype(dtype), value_size)
    out = np.zeros(total, np.dtype(dtype))
    out[:max(n, 0)] = read_array_fd(table.fd, max(n, 0), np.dtype(dtype), value_size)
    return out


# ---------------------------------------------------------------------------
# detaching fast: the kernel's slow part in a child


class Releaser:
    """Takes the slow part of detaching off the recorder's path.

    Closing a tracepoint's perf event waits for RCU grace periods under the kernel's
    event_mutex (measured here: 53 tracepoints 4.4 s closed one by one, 2.3 s from 64
    threads; ~44 ms per tracepoint at best). A releasing process holds a reference to every
    open file of the recorder; while it does, the recorder's own detach (libbpf's close) only
    drops references and returns at once. :meth:`release` lets it go: it closes everything
    from several threads and exits, and its last close of each perf event is the kernel's
    release of that tracepoint, program and map.

    The releaser is a grandchild in a session of its own (double fork): nobody has to reap
    it, Ctrl-C at the terminal does not reach it, and its standard streams are /dev/null
    from the start (a caller reading the recorder's output sees EOF when the recorder
    exits). So the recorder need not wait for the kernel: ``wait()`` is for callers that
    must see every program gone (``record --wait-detach``; tests). Use only after every
    probe is disarmed: the programs stay attached, counting nothing, until it is done.
    """

    def __init__(self) -> None:
        r, w = os.pipe()
        pr, pw = os.pipe()
        mid = os.fork()
        if mid == 0:  # the intermediate child: fork the releaser, report its pid, exit
            try:
                os.close(w)
                os.close(pr)
                pid = os.fork()
                if pid == 0:  # the releaser
                    try:
                        os.close(pw)
                        _become_releaser(r)
                        os.read(r, 1)  # EOF once the recorder has let go
                        _close_all_in_parallel()
                    finally:
                        os._exit(0)
                os.write(pw, pid.to_bytes(4, "little"))
            finally:
                os._exit(0)
        os.close(r)
        os.close(pw)
        try:
            raw = os.read(pr, 4)
        finally:
            os.close(pr)
            os.waitpid(mid, 0)
        self.pid: int | None = int.from_bytes(raw, "little") if len(raw) == 4 else None
        self._pidfd: int | None = None
        if self.pid is not None:
            try:  # pinned at once: it cannot exit before release(), so this is the releaser
                self._pidfd = os.pidfd_open(self.pid)
            except OSError:
                self._pidfd = None
        self._w: int | None = w
        self.released_at: float | None = None

    def release(self) -> None:
        """The recorder has closed its copies: let the releaser close everything (idempotent)."""
        if self._w is not None:
            os.close(self._w)
            self._w = None
            self.released_at = time.perf_counter()

    def wait(self, timeout: float | None = None) -> float:
        """Release, then wait until the releaser has exited (every program, map and perf event
        it held is gone); seconds the kernel needed after release(). Raises TimeoutError."""
        self.release()
        if self._pidfd is not None:
            try:
                wait_pidfd(self._pidfd, timeout)
            finally:
                os.close(self._pidfd)
                self._pidfd = None
        return time.perf_counter() - (self.released_at or time.perf_counter())

    def forget(self) -> None:
        """Release and stop following the releaser (it finishes on its own)."""
        self.release()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def _become_releaser(gate: int) -> None:
    """In the releaser: a session of its own, no terminal signals, standard streams on
    /dev/null, and every file but ``gate`` that is not a BPF object or perf event closed at
    once (pipes a caller reads to EOF, the run directory's files)."""
    os.setsid()
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # forked from a thread other than the main one: the session suffices
        pass
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd <= 2 or fd == gate:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("anon_inode:") and ("bpf" in target or "perf_event" in target):
            continue
        try:
            os.close(fd)
        except OSError:
            pass


def wait_pidfd(pidfd: int, timeout: float | None = None) -> None:
    """Block until the process behind ``pidfd`` has exited; TimeoutError after ``timeout`` s."""
    import select

    p = select.poll()
    p.register(pidfd, select.POLLIN)
    if not p.poll(None if timeout is None else int(timeout * 1000)):
        raise TimeoutError(f"process still running after {timeout} s")


def wait_pid_exit(pid: int, timeout: float = 60.0) -> bool:
    """Wait until process ``pid`` (any, not only a child) has exited; True when it has (or
    never existed), False after ``timeout`` s. For a recording's releaser: the manifest's
    ``detach.releaser_pid``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        wait_pidfd(fd, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        os.close(fd)


def _close_all_in_parallel(threads: int = 2) -> None:
    """Close every fd of this (child) process from several threads: each perf event's release
    waits for RCU grace periods, and those of different tracepoints overlap (measured: 11
    tracepoints 1.06 s closed one by one, 0.40 s from 11 threads). Two threads, not more, and
    before each close a thread waits while another process attaches probes (:class:`AttachGate`):
    a recording started meanwhile then waits for at most one close per thread (16 threads made
    the next recording's start-up 2.8 s instead of 1.1 s back to back)."""
    import threading

    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        return
    gate = _open_gate()  # after the listing (whose own directory fd it may reuse): never closed below
    fds = [fd for fd in fds if fd > 2 and fd != gate]
    chunks = [fds[i::threads] for i in range(threads)]
    deadline = time.monotonic() + GATE_YIELD_MAX_S

    def close(chunk: list[int]) -> None:
        for fd in chunk:
            _wait_gate_free(gate, deadline)
            try:
                os.close(fd)
            except OSError:
                pass

    ts = [threading.Thread(target=close, args=(c,)) for c in chunks if c]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    if gate is not None:
        os.close(gate)


def release_in_child() -> Releaser:
    return Releaser()


# ---------------------------------------------------------------------------
# attaching beside a releaser: the kernel's event_mutex
#
# A perf event's last close on a tracepoint (perf_trace_destroy) holds the kernel's event_mutex
# across tracepoint_synchronize_unregister() (an RCU-tasks-trace and an RCU grace period); so does
# every kprobe perf event's. Everything a recording does at start-up on tracepoints takes the same
# mutex: perf_event_open of a tracepoint or kprobe (perf_trace_init, perf_kprobe_init), reading a
# tracefs ``format`` file (f_start). A recording started while the previous one's releaser still
# closes (seconds for the default set) queued each of those behind its closes: 3.0 s to start
# instead of 0.5 s. So a recording holds the gate (shared) from its first look at the kernel until
# its probes are attached, and a releaser closes nothing while any holds it: the recording then
# waits for the closes in flight only, and the releaser's later closes of the tracepoints the new
# recording also attached are cheap (the kernel synchronizes only when a tracepoint's last perf
# event goes).

#: a file whose flock is the gate (in /run: root's; a process that cannot open it neither holds
#: nor waits: only a non-root recorder with capabilities, whose releaser then closes at once)
ATTACH_GATE = "/run/moetrace/attach.lock"
#: a releaser waits for attachers this long at most in all (a stuck recorder cannot keep it)
GATE_YIELD_MAX_S = 30.0


def _open_gate() -> int | None:
    try:
        os.makedirs(os.path.dirname(ATTACH_GATE), mode=0o700, exist_ok=True)
        return os.open(ATTACH_GATE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None


def _wait_gate_free(gate: int | None, deadline: float) -> None:
    """Return once no process holds the gate (polled: a releaser never holds it itself beyond
    the test), or at ``deadline``."""
    import fcntl

    while gate is not None and time.monotonic() < deadline:
        try:
            fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        except OSError:
            return
        fcntl.flock(gate, fcntl.LOCK_UN)
        return


class AttachGate:
    """Held (a shared flock on :data:`ATTACH_GATE`) while this process looks at the kernel and
    attaches its probes: releasers of earlier recordings close nothing meanwhile. Release it
    (idempotent) before forking anything that outlives the start-up: the command, a releaser."""

    def __init__(self) -> None:
        import fcntl

        self._fd = _open_gate()
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_SH)
            except OSError:
                self.release()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
