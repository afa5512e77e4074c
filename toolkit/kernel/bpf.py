"""Loading bcc probes: privilege and kernel-header checks, -D knobs, attach, detach,
and one bounded ring/perf-buffer wrapper with per-interval lost counts.

Probe C sources live in ``probes/`` and are configured only with ``-D`` cflags
(:func:`knob_cflags`), never by string substitution, so every probe file stays
compilable as it is. bcc attaches each ``TRACEPOINT_PROBE`` when the program
loads; which tracepoints a probe uses is therefore decided before compiling,
by knobs the recorder derives from the attach plan (a probe whose optional
tracepoint is absent is compiled with that knob off).

bcc itself is imported lazily (only ``record`` and the probe-build tests need it):
Debian's python3-bpfcc is importable from /usr/bin/python3 and venvs made with
``--system-site-packages``.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from moetrace.errors import PrivilegeError, ProbeError

from moetrace.probes import PROBES_DIR  # noqa: E402
_KNOB = re.compile(r"^[A-Z][A-Z0-9_]*$")
#: Warnings some header versions raise under bcc's clang; harmless for tracepoint-only probes.
QUIET_CFLAGS = ("-Wno-ignored-attributes", "-Wno-duplicate-decl-specifier", "-Wno-unused-function")


def probe_source(name: str) -> Path:
    """Path of probes/<name>.c (the installed package's copy when not in a checkout)."""
    p = PROBES_DIR / f"{name}.c"
    if p.exists():
        return p
    try:
        from importlib.resources import files

        q = Path(str(files("moetrace.probes") / f"{name}.c"))
        if q.exists():
            return q
    except (ModuleNotFoundError, TypeError):
        pass
    raise ProbeError(f"no probe source {name}.c", hint=f"expected it in {PROBES_DIR}")


def knob_cflags(knobs: dict[str, int | bool]) -> list[str]:
    """``-DNAME=<int>`` for every knob; names are C macros, values integers only."""
    out = []
    for k, v in knobs.items():
        if not _KNOB.match(k):
            raise ProbeError(f"bad probe knob name {k!r} (C macro names: A-Z, 0-9, _)")
        if isinstance(v, bool):
            v = int(v)
        if not isinstance(v, int):
            raise ProbeError(f"probe knob {k} must be an integer, not {type(v).__name__}")
        out.append(f"-D{k}={v}")
    return out


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
    from moetrace.kernel.features import TRACEFS_MOUNT_CMD, ensure_bcc_tracefs, tracefs_path

    note = ensure_bcc_tracefs()
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
        raise PrivilegeError("tracefs is not mounted (bcc reads tracepoint formats from it)",
                             hint=f"mount it: {TRACEFS_MOUNT_CMD}")
    from moetrace.kernel.features import mount_notes

    features.tracefs = p
    for n in mount_notes():
        if n not in features.notes:
            features.notes.append(n)
    if not features.notes:
        features.notes.append(f"mounted tracefs at {p}")
    return p


def require_headers(features) -> str:
    """"exact" or "mismatched" (tracepoint args only); raise with the fix when "none"."""
    if features.headers == "none":
        raise ProbeError("bcc needs kernel headers and none were found", hint=features.headers_detail)
    return features.headers


def import_bcc():
    """The bcc module, or a ProbeError saying how to get it."""
    try:
        import bcc  # noqa: F401
    except ImportError as e:
        raise ProbeError(f"bcc is not importable from this Python ({e})",
                             hint="apt-get install python3-bpfcc and use /usr/bin/python3 or a venv made "
                                  "with `/usr/bin/python3 -m venv --system-site-packages`") from None
    from moetrace.kernel.features import ensure_bcc_tracefs

    ensure_bcc_tracefs()  # bcc 0.26 reads tracepoint formats only under /sys/kernel/debug/tracing
    return bcc


@dataclass
class LoadedProbe:
    """A compiled, loaded and attached bcc program; ``close()`` detaches everything."""

    name: str
    bpf: Any
    cflags: list[str]
    compile_attach_s: float
    tracepoints: list[str] = field(default_factory=list)
    closed: bool = False
    #: compile + load (BPF(): clang, verifier, bcc's automatic TRACEPOINT_PROBE attaches) and the
    #: explicit attaches of ``load_probe(attach=...)``
    compile_s: float = 0.0
    attach_s: float = 0.0

    backend = "bcc"

    def table(self, name: str):
        return self.bpf[name.encode()]

    def put(self, table: str, key: bytes, value: bytes) -> None:
        """One map element from raw bytes (the same call on either backend)."""
        t = self.table(table)
        t[t.Key.from_buffer_copy(key)] = t.Leaf.from_buffer_copy(value)

    def get(self, table: str, key: bytes) -> bytes | None:
        """One map element's raw value, None when absent (the same call on either backend)."""
        t = self.table(table)
        try:
            return bytes(t[t.Key.from_buffer_copy(key)])
        except KeyError:
            return None

    def delete(self, table: str, key: bytes) -> bool:
        """Remove one map element; False when it was not there."""
        t = self.table(table)
        try:
            del t[t.Key.from_buffer_copy(key)]
        except KeyError:
            return False
        return True

    def items(self, table: str, key_dtype, value_dtype) -> tuple[np.ndarray, np.ndarray]:
        """Every (key, value) of a hash map as two numpy arrays of the given record dtypes."""
        return _pair_arrays([(bytes(k), bytes(v)) for k, v in self.table(table).items()], key_dtype, value_dtype)

    def prog_fds(self) -> dict[str, int]:
        return prog_fds_of(self.bpf)

    def open_ring(self, table: str, callback) -> None:
        self.table(table).open_ring_buffer(callback)

    def open_perf(self, table: str, callback, page_cnt: int, lost_cb) -> None:
        self.table(table).open_perf_buffer(callback, page_cnt=page_cnt, lost_cb=lost_cb)

    def ring_poll(self, timeout_ms: int) -> None:
        self.bpf.ring_buffer_poll(timeout_ms)

    def ring_consume(self) -> None:
        self.bpf.ring_buffer_consume()

    def perf_poll(self, timeout_ms: int) -> None:
        self.bpf.perf_buffer_poll(timeout_ms)

    def arm(self, on: bool = True) -> bool:
        """Start (or stop) counting: a probe compiled with MOE_GATED=1 counts only while
        armed (probes/moetrace.h). False when the probe has no gate."""
        return arm(self.bpf, on)

    def close(self) -> None:
        """Detach every tracepoint and free the maps (idempotent)."""
        if not self.closed:
            self.closed = True
            self.bpf.cleanup()

    def __enter__(self) -> "LoadedProbe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def arm(bpf, on: bool = True) -> bool:
    """Set the one-entry ``armed`` array of a gated probe (MOE_GATED=1); False when absent."""
    import ctypes as ct

    try:
        t = bpf[b"armed"]
    except KeyError:
        return False
    t[ct.c_int(0)] = ct.c_uint32(1 if on else 0)
    return True


def probe_cflags(knobs: dict[str, int | bool], extra_cflags: tuple[str, ...] = QUIET_CFLAGS,
                 gated: bool = False) -> list[str]:
    """The cflags of a probe compile: ``-D`` knobs, probes/ on the include path (moetrace.h),
    MOE_GATED=1 when the recorder arms the probe after every probe attached."""
    out = knob_cflags(knobs) + [f"-I{PROBES_DIR}"] + list(extra_cflags)
    if gated and "MOE_GATED" not in knobs:
        out.append("-DMOE_GATED=1")
    return out


def load_probe(name: str, knobs: dict[str, int | bool], extra_cflags: tuple[str, ...] = QUIET_CFLAGS,
               src: str | os.PathLike | None = None, gated: bool = False,
               attach: list[tuple[str, str]] | None = None) -> LoadedProbe:
    """Compile probes/<name>.c with ``-D`` knobs, load it and attach its tracepoints.

    Returns a LoadedProbe whose ``compile_attach_s`` is the wall time of the
    whole BPF() construction (clang compile, verifier, perf_event_open/attach).
    ``gated``: compiled with MOE_GATED=1, the probe counts nothing until :meth:`LoadedProbe.arm`.
    ``attach``: (category:event, C function) pairs attached explicitly after the load (programs
    that are plain functions, not bcc TRACEPOINT_PROBEs); everything is detached on failure.
    """
    bcc = import_bcc()
    path = Path(src) if src is not None else probe_source(name)
    cflags = probe_cflags(knobs, extra_cflags, gated)
    t0 = time.perf_counter()
    try:
        b = bcc.BPF(src_file=str(path).encode(), cflags=cflags)
    except Exception as e:  # bcc raises bare Exception with the compiler or verifier text
        msg = str(e).strip().splitlines()
        raise ProbeError(f"probe {name} failed to load: {msg[-1] if msg else type(e).__name__}",
                             hint=f"compile by hand to see the log: python3 -c \"from bcc import BPF; "
                                  f"BPF(src_file='{path}', cflags={cflags!r})\"") from None
    t1 = time.perf_counter()
    try:
        for tp, fn in attach or ():
            b.attach_tracepoint(tp=tp.encode(), fn_name=fn.encode())
    except Exception as e:  # noqa: BLE001 - bcc raises bare Exception
        b.cleanup()
        raise ProbeError(f"cannot attach the {name} probe: {e}") from None
    t2 = time.perf_counter()
    tps = sorted(k.decode() if isinstance(k, bytes) else str(k) for k in b.tracepoint_fds)
    return LoadedProbe(name, b, cflags, t2 - t0, tps, compile_s=t1 - t0, attach_s=t2 - t1)


# ---------------------------------------------------------------------------
# CO-RE objects: compiled once (scripts/build-probes.sh), loaded by libbpf


def object_path(name: str) -> Path:
    """probes/build/<name>.bpf.o (``MOETRACE_PROBE_OBJECTS`` overrides the directory)."""
    d = os.environ.get("MOETRACE_PROBE_OBJECTS")
    return (Path(d) if d else PROBES_DIR / "build") / f"{name}.bpf.o"


def core_source(name: str) -> Path:
    return PROBES_DIR / f"{name}.bpf.c"


def backend_for(name: str) -> str:
    """"core" (the CO-RE object through libbpf) where probes/<name>.bpf.c exists, else "bcc";
    ``MOETRACE_BPF_BACKEND=bcc`` keeps the compile-per-run path (measured against in
    tests/bench/bench_record.py while both exist)."""
    want = os.environ.get("MOETRACE_BPF_BACKEND", "").strip().lower()
    if want == "bcc" and (PROBES_DIR / f"{name}.c").exists():
        return "bcc"
    return "core" if core_source(name).exists() else "bcc"


def stale_object(name: str) -> str | None:
    """Why probes/build/<name>.bpf.o cannot be used as it is (missing, older than its sources),
    with the command that builds it; None when it is current."""
    obj = object_path(name)
    fix = "build it: bash scripts/build-probes.sh (make setup runs it)"
    if not obj.exists():
        return f"no compiled object {obj}; {fix}"
    if os.environ.get("MOETRACE_PROBE_OBJECTS"):
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
    """A CO-RE object loaded by libbpf and attached: the same calls as :class:`LoadedProbe`."""

    name: str
    obj: Any
    compile_attach_s: float
    tracepoints: list[str] = field(default_factory=list)
    closed: bool = False
    compile_s: float = 0.0  # open + load (libbpf relocations, verifier): no compiler
    attach_s: float = 0.0
    attached: dict[str, str] = field(default_factory=dict)  # program -> "kind target"
    _rings: list = field(default_factory=list)
    _readers: list = field(default_factory=list)
    backend = "core"

    @property
    def bpf(self):  # the bcc object of a LoadedProbe; a CoreProbe has none
        return None

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

    def open_perf(self, table: str, callback, page_cnt: int, lost_cb) -> None:
        raise ProbeError(f"probe {self.name}: perf buffers are not used by CO-RE probes (ring buffers are)")

    def ring_poll(self, timeout_ms: int) -> None:
        for i, r in enumerate(self._rings):
            r.poll(timeout_ms if i == 0 else 0)

    def ring_consume(self) -> None:
        for r in self._rings:
            r.consume()

    def perf_poll(self, timeout_ms: int) -> None:
        pass

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
    from moetrace.kernel.libbpf import BpfObject

    why = stale_object(name)
    if why:
        raise ProbeError(f"probe {name}: {why}")
    if any(kind == "tracepoint" for _p, kind, _t in attach):
        # libbpf reads a tracepoint's id from tracefs (/sys/kernel/debug/tracing when it exists, else
        # /sys/kernel/tracing): mounted here when absent, as bcc's import did (`record` has mounted
        # them in a namespace of its own already; a fresh machine has neither at boot)
        from moetrace.kernel.features import ensure_bcc_tracefs

        ensure_bcc_tracefs()
    t0 = time.perf_counter()
    obj = BpfObject(object_path(name), name)
    try:
        values = {k.lower(): int(v) for k, v in knobs.items()}
        values["gated"] = int(gated)
        obj.set_globals(values)
        for m, n in (map_sizes or {}).items():
            obj.set_max_entries(m, n)
        wanted = {prog for prog, _k, _t in attach}
        for prog in obj.programs:
            obj.set_autoload(prog, prog in wanted)
        for prog, func in (attach_targets or {}).items():
            obj.set_attach_target(prog, func)
        obj.load()
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
    return CoreProbe(name, obj, t2 - t0, sorted(tps), compile_s=t1 - t0, attach_s=t2 - t1, attached=done)


def load_either(name: str, knobs: dict[str, int | bool], attach: list[tuple[str, str, str]],
                map_sizes: dict[str, int] | None = None, gated: bool = False,
                extra_cflags: tuple[str, ...] = QUIET_CFLAGS) -> "LoadedProbe | CoreProbe":
    """Load probe ``name`` by the loader :func:`backend_for` picks and attach ``attach``
    ((program, kind, target), as :func:`load_core` takes it): the CO-RE object (``map_sizes``
    apply), or bcc's compile of probes/<name>.c whose programs are plain C functions attached
    explicitly (tracepoints only: bcc attaches a TRACEPOINT_PROBE by itself). For probes whose
    recorder runs outside :class:`moetrace.record.probe.ProbeRecorder` (block, reclaim)."""
    if backend_for(name) == "core":
        return load_core(name, knobs, attach, map_sizes, gated=gated)
    other = [f"{kind} {target}" for _p, kind, target in attach if kind != "tracepoint"]
    if other:
        raise ProbeError(f"probe {name}: the bcc loader attaches tracepoints only, not {', '.join(other)}")
    return load_probe(name, knobs, extra_cflags, gated=gated, attach=[(t, p) for p, _k, t in attach])


def prog_fds_of(bpf) -> dict[str, int]:
    """{program: fd} of a bcc BPF object's loaded programs."""
    if bpf is None:
        return {}
    return {(n.decode() if isinstance(n, bytes) else str(n)): f.fd for n, f in bpf.funcs.items()}


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


def _fds(progs) -> dict[str, int]:
    return dict(progs) if isinstance(progs, dict) else prog_fds_of(progs)


def recursion_misses(progs, default: int | None = None) -> dict[str, int | None]:
    """{program: runs the kernel skipped to BPF recursion protection} of loaded programs
    (``progs``: {program: fd}, or a bcc BPF object) from fdinfo ``recursion_misses`` (5.12+;
    ``default`` where it is absent): the only loss of in-kernel counters."""
    return {n: prog_fdinfo(fd).get("recursion_misses", default) for n, fd in _fds(progs).items()}


def percpu_sums(table):
    """Per-index sums over CPUs of a per-CPU array of u64 (a bcc table or a CO-RE map), as an
    int64 numpy array: one
    BPF_MAP_LOOKUP_BATCH (each value is one u64 per possible CPU) instead of bcc's lookup per
    entry and Python sum per CPU (0.75 s for the reclaim probe's 4 arrays here, ~14 s under
    the lab's TCG)."""
    import numpy as np

    if hasattr(table, "percpu_sums"):  # a CO-RE object's map (moetrace.kernel.libbpf.Map)
        return table.percpu_sums()
    ncpu = getattr(table, "total_cpu", None)  # bcc's per-CPU tables: Leaf is sLeaf x total_cpu
    if ncpu and ctypes.sizeof(getattr(table, "sLeaf", table.Leaf)) == 8:
        per_cpu = read_array(table, np.dtype((np.uint64, (ncpu,))), value_size=8 * ncpu)
        return per_cpu.sum(axis=1, dtype=np.uint64).astype(np.int64)
    out = np.zeros(len(table), dtype=np.int64)
    for k, v in table.items():
        out[k.value] = sum(int(x) for x in v)
    return out


def prog_runtime(progs) -> dict[str, dict[str, int | None]]:
    """{program: {"run_cnt", "run_time_ns"}} of loaded programs ({program: fd}, or a bcc BPF
    object). The kernel counts them only while run-time statistics are on (:func:`enable_stats`)."""
    out: dict[str, dict[str, int | None]] = {}
    for name, fd in _fds(progs).items():
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
    """Entries in a hash map (a bcc table or a CO-RE map)."""
    if hasattr(table, "keys") and hasattr(table, "key_size"):  # moetrace.kernel.libbpf.Map
        return len(table.keys(np.dtype((np.void, table.key_size))))
    return len(table.items())


def array_values(table) -> list:
    """Every value of a BPF_ARRAY in index order (one syscall per entry batch)."""
    n = len(table)
    return [table[ctypes.c_int(i)] for i in range(n)]


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
    """The one bounded ring/perf-buffer consumer every per-event probe uses.

    ``kind``: "ring" (BPF_RINGBUF_OUTPUT; the probe counts failed reserves in a
    stats slot, read through ``kernel_lost``) or "perf" (BPF_PERF_OUTPUT; bcc's
    lost callback counts). Records are copied as raw bytes; at most
    ``max_records`` are kept and the rest are counted lost (user side), so
    memory stays bounded. ``poll(timeout_ms)`` consumes what is ready and
    closes an interval every ``interval_s``; ``intervals`` holds one
    :class:`IntervalLoss` per interval, so lost events are recorded per interval,
    never only logged.
    """

    def __init__(self, probe: LoadedProbe, table: str, record_size: int, kind: str = "ring",
                 kernel_lost: Callable[[], int] | None = None, max_records: int = 5_000_000,
                 interval_s: float = 1.0, page_cnt: int = 64):
        if kind not in ("ring", "perf"):
            raise ValueError("kind must be 'ring' or 'perf'")
        self.probe, self.kind, self.record_size = probe, kind, record_size
        self.max_records, self.interval_ns = max_records, int(interval_s * 1e9)
        self._kernel_lost = kernel_lost
        self.chunks: list[bytes] = []
        self.kept = 0
        self._n = 0
        self._lost_user = 0
        self._perf_lost = 0
        self._kl0 = self._kernel_lost_now()
        self.intervals: list[IntervalLoss] = []
        self._t0 = time.monotonic_ns()
        self._mark = (0, 0, self._kl0)  # records, lost_user, kernel lost at interval start
        #: a CO-RE probe's ring is read in place, every ready record at once (no call per record)
        self._reader = probe.ring_reader(table, record_size) if kind == "ring" and hasattr(probe, "ring_reader") \
            else None
        if self._reader is None and kind == "ring":
            probe.open_ring(table, self._on_record)
        elif self._reader is None:
            probe.open_perf(table, self._on_record, page_cnt, self._on_lost)

    def _kernel_lost_now(self) -> int:
        if self.kind == "perf":
            return self._perf_lost
        return int(self._kernel_lost()) if self._kernel_lost is not None else 0

    def _on_record(self, *args) -> int:
        # ring: (ctx, data, size); perf: (cpu, data, size)
        data, size = args[1], args[2]
        self._n += 1
        if self.kept >= self.max_records:
            self._lost_user += 1
            return 0
        self.chunks.append(ctypes.string_at(data, min(size, self.record_size)))
        self.kept += 1
        return 0

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

    def _on_lost(self, n: int) -> None:
        self._perf_lost += int(n)

    def poll(self, timeout_ms: int = 100) -> None:
        """Consume ready records (waiting at most ``timeout_ms``); close intervals on time."""
        if self._reader is not None:
            self._reader.wait(timeout_ms)
            self._take(self._reader.read())
        elif self.kind == "ring":
            self.probe.ring_poll(timeout_ms)
        else:
            self.probe.perf_poll(timeout_ms)
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
        if self._reader is not None:
            self._take(self._reader.read())
        elif self.kind == "ring":
            self.probe.ring_consume()
        else:
            self.probe.perf_poll(0)
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


def read_array(table, dtype: np.dtype, value_size: int | None = None) -> np.ndarray:
    """Every value of an array map (a bcc table or a :class:`moetrace.kernel.libbpf.Map`) as a
    numpy structured array, by BPF_MAP_LOOKUP_BATCH (one syscall per 64 Ki entries instead of
    one per entry; per-entry lookups where the kernel lacks batch ops). ``value_size``: what the
    kernel copies per entry when it is not the map's value size (a per-CPU array: the
    8-byte-rounded value x possible CPUs)."""
    from moetrace.kernel.libbpf import read_array_fd

    if value_size is None:
        value_size = getattr(table, "value_size", None) or ctypes.sizeof(table.Leaf)
    return read_array_fd(table.map_fd, len(table), np.dtype(dtype), value_size)


# ---------------------------------------------------------------------------
# detaching fast: the kernel's slow part in a child


class Releaser:
    """Takes the slow part of detaching off the recorder's path.

    Closing a tracepoint's perf event waits for RCU grace periods under the kernel's
    event_mutex (measured here: 53 tracepoints 4.4 s closed one by one, 2.3 s from 64
    threads; ~44 ms per tracepoint at best). A releasing process holds a reference to every
    open file of the recorder; while it does, the recorder's own detach (bcc's cleanup) only
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


def _close_all_in_parallel(threads: int = 16) -> None:
    """Close every fd of this (child) process from several threads: each perf event's release
    waits for RCU grace periods, and those of different tracepoints overlap (measured: 11
    tracepoints 1.06 s closed one by one, 0.40 s from 11 threads)."""
    import threading

    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        return
    fds = [fd for fd in fds if fd > 2]
    chunks = [fds[i::threads] for i in range(threads)]

    def close(chunk: list[int]) -> None:
        for fd in chunk:
            try:
                os.close(fd)
            except OSError:
                pass

    ts = [threading.Thread(target=close, args=(c,)) for c in chunks if c]
    for th in ts:
        th.start()
    for th in ts:
        th.join()


def release_in_child() -> Releaser:
    return Releaser()
