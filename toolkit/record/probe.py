"""The one interface every probe of ``moetrace record`` implements.

One probe = one C file in probes/ (sharing probes/moetrace.bpf.h) + one module in
moetrace/record/probes/ holding its declaration ``SPEC`` (a :class:`moetrace.record.spec.ProbeSpec`:
attach groups, knobs, tables, and the name of its recorder) and its recorder, a
:class:`ProbeRecorder` subclass (:func:`moetrace.record.probes.recorder_class` finds it). The recorder (:mod:`moetrace.record.recorder`) drives every
one the same way::

    rec = cls(ctx)            # ctx: RecordContext (features, attach plan, pool map, ...)
    rec.open()                # compile (MOE_GATED=1), load, attach: counts nothing yet
    rec.describe(manifest)    # manifest sections known at attach time
    ... every probe open ...
    rec.arm(True)             # all probes, microseconds apart: counting starts
    env.update(rec.child_env()); spawn; rec.child_started(); rec.follow(pid)
    while command runs:
        rec.poll(timeout_ms)  # only when rec.needs_poll: drain rings, sample files
    rec.settle()              # last work that must still be counted (lru: drain LRU batches)
    rec.arm(False)            # all probes: counting stops
    rec.close()               # collect the kernel's aggregates, then detach (idempotent)
    rec.write(run_dir, manifest)  # tables + manifest sections of this probe
    ...
    rec.abort()               # in the recorder's finally: detach if still attached

``close`` sets ``collected`` once it has read the kernel's data; it must be idempotent and safe after a failed or partial ``open``; ``abort`` must
never raise. ``write`` fills ``manifest["stats"][name]``, ``manifest["lost"][name]`` (lost
events, 0 or counted, never omitted), ``manifest["summaries"][name]`` and
``manifest["tables"][table]`` (column -> dtype/unit/doc, use :func:`schema_doc`) for every
table it writes with :func:`moetrace.run.directory.write_table`. Nothing written may contain a
raw kernel address (the KASLR offset): symbolize, or drop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from moetrace.errors import MoetraceError, ProbeError
from moetrace.record.spec import AttachPlan, ProbeSpec


@dataclass
class RecordContext:
    """What a probe recorder may use.

    features: :class:`moetrace.kernel.features.Features` of the live kernel. plan: this probe's
    resolved :class:`AttachPlan` (attach what it says, compile out what it does not).
    pmap: :class:`moetrace.record.poolmap.PoolMap` (inode -> expert, pool device, pages per
    expert) or None when no pool was named. run_dir: the run directory (0700).
    log_dir: where the command's replay log lands (replay.json, iterations.parquet).
    stream: ``record --stream`` (per-event streams on). t0_ns: CLOCK_MONOTONIC ns when
    recording began (bpf_ktime_get_ns is the same clock). notes: append one-line
    notes for the manifest. say: progress lines for the terminal."""

    features: Any
    plan: AttachPlan
    pmap: Any = None
    run_dir: Path | None = None
    log_dir: Path | None = None
    stream: bool = False
    t0_ns: int = field(default_factory=time.monotonic_ns)
    notes: list[str] = field(default_factory=list)
    say: Callable[[str], None] = lambda s: None
    stream_max_records: int = 5_000_000
    #: ``record --knob PROBE.NAME=V`` for this probe: {NAME: V}
    knobs: dict[str, int] = field(default_factory=dict)
    #: compile with MOE_GATED=1: count nothing until :meth:`ProbeRecorder.arm` (the recorder
    #: arms every probe at once after all attached, and disarms them together)
    gated: bool = False
    #: every probe of this recording (e.g. pagecache leaves read calls to reads when both run)
    recording: tuple[str, ...] = ()
    #: CLOCK_MONOTONIC ns when the command started / ended (set before close())
    command_start_ns: int = 0
    command_end_ns: int = 0


class ProbeRecorder:
    """Base class: one instance per recording of one probe. Subclasses set ``name``."""

    name: str = ""
    #: the probe's declaration (its module's SPEC)
    spec: ProbeSpec
    #: True when poll() must be called while the command runs (rings, samplers)
    needs_poll: bool = False
    #: /proc/vmstat counters this probe's oracle compares with, read when counting starts and
    #: stops (:meth:`arm`): :meth:`vmstat_delta` is over the same interval as the probe's counts
    vmstat_keys: tuple[str, ...] = ()

    def __init__(self, ctx: RecordContext):
        self.ctx = ctx
        self.compiled_out: dict[str, str] = {}
        self.probe = None  # moetrace.kernel.bpf.CoreProbe, when BPF is used
        self.knobs: dict[str, int] = {}
        self.compile_attach_s: float | None = None
        self.closed = False
        self.armed = False
        #: set by close() once the kernel's data was read: write() runs only then
        self.collected = False
        self._vmstat: list[dict[str, int] | None] = [None, None]

    # -- lifecycle --------------------------------------------------------------------------
    def open(self) -> "ProbeRecorder":
        raise NotImplementedError

    def follow(self, pid: int) -> None:
        """Follow this process (and, in the kernel, its descendants)."""

    def poll(self, timeout_ms: int = 0) -> None:
        """Consume what is ready; never block longer than ``timeout_ms``."""

    def describe(self, manifest: dict[str, Any]) -> None:
        """Manifest sections known once the probe is attached (e.g. block's device)."""

    def child_env(self) -> dict[str, str]:
        """Environment the recorded command inherits (e.g. pagecache's epoch map fd)."""
        return {}

    def child_started(self) -> None:
        """The command was forked (what it inherits is its own now)."""

    def wake_on(self, fd: int) -> None:
        """Let :meth:`poll` return as soon as ``fd`` (the command's pidfd) turns readable: the
        command's end is seen at once. Every event stream of the probe waits on it too."""
        from moetrace.kernel.bpf import EventStream

        self._wake_fd = fd
        for v in list(vars(self).values()):
            if isinstance(v, EventStream):
                v.wake_on(fd)

    def wait_command(self, seconds: float) -> bool:
        """Wait up to ``seconds``, or less when the command ends (its pidfd, given to
        :meth:`wake_on`, turns readable): True when it has ended. Without a pidfd, sleep."""
        import select

        fd = getattr(self, "_wake_fd", None)
        if fd is not None:
            try:
                return bool(select.select([fd], [], [], max(seconds, 0.0))[0])
            except (OSError, ValueError):  # closed meanwhile: the command has ended
                return True
        time.sleep(max(seconds, 0.0))
        return False

    def gated(self) -> bool:
        """Whether the probe counts only while armed (compiled with MOE_GATED=1)."""
        return bool(self.ctx.gated)

    def arm(self, on: bool = True) -> None:
        """Start (on) or stop counting; the recorder arms every probe at once after all are
        attached and disarms them together before reading any (the same interval). The
        :attr:`vmstat_keys` are read just before counting starts and just after it stops."""
        if on:
            self.mark_vmstat(0)
        if self.probe is not None and not self.probe.closed:
            self.probe.arm(on)
        self.armed = on
        if not on:
            self.mark_vmstat(1)

    def mark_vmstat(self, end: int) -> None:
        """Read :attr:`vmstat_keys` as the oracle's start (0) or end (1); a probe used ungated marks
        its start at open."""
        if self.vmstat_keys:
            from moetrace.kernel.procfs import read_vmstat

            self._vmstat[end] = read_vmstat("/", self.vmstat_keys, refresh=True)

    def vmstat_delta(self) -> dict[str, int] | None:
        """{counter: end - start} of :attr:`vmstat_keys` (the end read now when counting never
        stopped); None without keys or a start."""
        v0 = self._vmstat[0]
        if not self.vmstat_keys or v0 is None:
            return None
        if self._vmstat[1] is None:
            self.mark_vmstat(1)
        v1 = self._vmstat[1] or {}
        return {k: v1[k] - v0[k] for k in v1 if k in v0}

    def counters(self) -> dict[str, Any] | None:
        """The probe's cumulative counts so far, read while it stays attached (``moetrace watch``
        samples them every interval; differences of two readings are the interval's counts).
        None: this probe has nothing to give live."""
        return None

    def settle(self) -> None:
        """Last work that must still be counted, just before the probes are disarmed
        (e.g. lru flushes the per-CPU LRU batches)."""

    def close(self) -> None:
        raise NotImplementedError

    def write(self, run_dir: Path, manifest: dict[str, Any]) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Detach without collecting (errors, signals); never raises."""
        try:
            if self.probe is not None:
                self.probe.close()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        self.closed = True

    # -- helpers ----------------------------------------------------------------------------
    #: the MoetraceError subclass this probe raises (set by subclasses)
    error: type = MoetraceError

    def read_stats(self) -> dict[str, int]:
        """{slot name: count} of the probe's ``stats`` array map (the C file's ``enum moe_stat``,
        named by the declaration's ``stats`` in slot order)."""
        import numpy as np

        from moetrace.kernel.bpf import read_array

        vals = read_array(self.probe.table("stats"), np.dtype("<u8")).astype(np.int64).tolist()
        return dict(zip(self.spec.stats, vals))

    def stat_reader(self, slot: str) -> Callable[[], int]:
        """A reader of one ``stats`` slot while the probe runs (an event stream's kernel-lost count)."""
        import numpy as np

        from moetrace.kernel.bpf import read_array

        i, table = self.spec.stats.index(slot), self.probe.table("stats")
        return lambda: int(read_array(table, np.dtype("<u8"))[i])

    def collect(self, read: Callable[[], None]) -> bool:
        """The close guard: run ``read`` (the kernel's data, once), then detach whatever happened,
        and mark the probe closed. False when there was nothing to read (closed already, or never
        opened). A failure to read is this probe's error, naming it (the probe is detached)."""
        if self.closed:
            return False
        if self.probe is None or self.probe.closed:
            self.closed = True
            return False
        try:
            read()
        except MoetraceError:
            raise
        except Exception as e:  # noqa: BLE001 - a read failure must still detach
            raise self.error(f"reading the {self.name} probe's maps failed: {type(e).__name__}: {e}") from None
        finally:
            self.probe.close()
            self.closed = True
        return True

    def write_tables(self, run_dir: Path, manifest: dict[str, Any], tables: dict[str, Any]) -> None:
        """Each of ``tables`` ({declared table: DataFrame}) into the run directory, and its manifest
        ``tables`` entry from the declaration; refuses before close() collected anything."""
        from moetrace.run import directory as rd

        if not self.collected:
            raise self.error(f"{self.name}: nothing collected (close() did not read the kernel's data)")
        for name, df in tables.items():
            rd.write_table(run_dir, name, df)
            manifest.setdefault("tables", {})[name] = schema_doc(self.spec, name)

    def write_sections(self, manifest: dict[str, Any], stats: dict[str, int], lost: dict[str, Any],
                       summary: dict[str, Any]) -> None:
        """The probe's manifest sections: ``stats``, ``lost`` (never omitted) and ``summaries``."""
        manifest.setdefault("stats", {})[self.name] = dict(stats)
        manifest.setdefault("lost", {})[self.name] = lost
        manifest.setdefault("summaries", {})[self.name] = summary

    def require_plan(self) -> AttachPlan:
        """The attach plan, or this probe's error when the kernel cannot run it."""
        plan = self.ctx.plan
        if plan.status == "no":
            raise self.error(f"probe {self.name} cannot attach: {plan.reason}",
                             hint="`moetrace doctor` lists what this kernel offers")
        return plan

    def load_planned(self, knobs: dict[str, int]):
        """Load the probe's CO-RE object with ``knobs`` and attach what its plan says (groups
        whose knob is on). Sets ``probe`` and ``compile_attach_s``; detaches everything on
        failure."""
        from moetrace.kernel.bpf import load_core

        off = {g.name for g in self.spec.attach if g.knob is not None and not knobs.get(g.knob, 1)}
        self.kprobes: dict[str, str] = {}
        attach = [(e.candidate.fn_name, e.candidate.kind, e.candidate.target) for e in self.ctx.plan.attached
                  if e.candidate.kind != "debugfs" and e.group not in off]
        sizes = self.spec.map_sizes(knobs) if self.spec.map_sizes is not None else None
        try:
            self.probe = load_core(self.name, knobs, attach, sizes, gated=self.ctx.gated)
        except ProbeError as e:
            raise self.error(e.message) from None
        self.compile_attach_s = self.probe.compile_attach_s
        for e in self.ctx.plan.attached:
            if e.candidate.kind in ("kprobe", "kretprobe", "fentry", "fexit") and e.group not in off:
                self.kprobes[e.group] = e.candidate.target
        return self.probe

    def with_user_knobs(self, knobs: dict[str, int]) -> dict[str, int]:
        """``knobs`` with ``record --knob`` values on top. Only declared knobs; a knob the
        attach plan turned off (an unavailable group) cannot be turned on."""
        from moetrace.errors import UsageError

        declared = {k.name for k in self.spec.knobs}
        out = dict(knobs)
        for k, v in self.ctx.knobs.items():
            if k not in declared:
                raise UsageError(f"--knob {self.name}.{k}: probe {self.name} has no knob {k}",
                                 hint=f"its knobs: {', '.join(sorted(declared))} (moetrace doctor --json lists them)")
            if self.ctx.plan.knobs.get(k) == 0 and int(v) != 0:
                raise UsageError(f"--knob {self.name}.{k}={v}: this kernel compiles it out "
                                 f"({self.ctx.plan.reason or 'its attach group is unavailable'})")
            out[k] = int(v)
        return out

    def prog_fds(self) -> dict[str, int]:
        """{program: fd} of the loaded BPF programs ({} once detached)."""
        if self.probe is not None and not self.probe.closed:
            return self.probe.prog_fds()
        return {}

    def prog_ids(self) -> list[int]:
        """Ids of the loaded BPF programs (the kill tests check they are gone)."""
        from moetrace.kernel.bpf import prog_info as bpf_prog_info

        return [i["id"] for i in (bpf_prog_info(fd) for fd in self.prog_fds().values()) if i is not None]

    def recursion_misses(self) -> dict[str, int | None]:
        from moetrace.kernel.bpf import recursion_misses

        return recursion_misses(self.prog_fds())


class EngineProbe(ProbeRecorder):
    """A probe whose BPF object and readers live in an engine object that also runs on its own
    (block's BlockRecorder, reclaim's ReclaimRecorder): the interface delegates to it."""

    def __init__(self, ctx: RecordContext):
        super().__init__(ctx)
        self.engine: Any = None
        self.result: Any = None

    def arm(self, on: bool = True) -> None:
        if self.engine is not None:
            self.engine.arm(on)
        self.armed = on

    def gated(self) -> bool:
        return self.engine is not None and bool(self.engine.gated)

    def counters(self) -> dict[str, Any] | None:
        """The engine's running totals (its ``live_totals``), once closed its result's."""
        live = getattr(self.engine, "live_totals", None)
        if live is None or (self.engine.probe is None and self.engine.result is None):
            return None
        return live()

    def close(self) -> None:
        """The engine reads the kernel's data and detaches (idempotent)."""
        if self.engine is not None and self.result is None:
            self.result = self.engine.close()
            self.collected = self.result is not None
        self.closed = True

    def abort(self) -> None:
        try:
            if self.engine is not None and self.engine.probe is not None:
                stop = getattr(self.engine, "_stop", None)
                if stop is not None:
                    stop.set()
                self.engine._cleanup()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        self.closed = True


def schema_doc(spec, table: str) -> dict[str, dict[str, str]]:
    """The manifest's ``tables[table]`` entry from a declaration's columns: dtype, unit, doc and,
    for a column its readers rely on, the ``check`` run/ validates the table with."""
    return {c.name: {"dtype": c.dtype, "unit": c.unit, "doc": c.doc, **({"check": c.check} if c.check else {})}
            for c in spec.tables()[table]}


def log2_bounds(slots) -> tuple["np.ndarray", "np.ndarray"]:
    """(lo, hi) in the histogram's unit of the log2 slots ``slots``, as uint64 arrays: the decode of
    probes/moetrace.bpf.h ``moe_log2l`` (bcc's bpf_log2l, floor(log2(v)) + 1, 0 and 1 both 1): slot
    s holds [2^(s-1), 2^s), slot 1 also 0 (lo 0), slot 0 none ([0, 1)). The one decode of every
    probe's log2 histogram (tests/probe_build/test_log2.py evaluates the C macro at these bounds)."""
    import numpy as np

    s = np.asarray(slots, dtype=np.int64)
    if s.size and (s.min() < 0 or s.max() > 63):
        raise ValueError(f"log2 slot out of [0, 63]: {int(s.min())}..{int(s.max())}")
    hi = np.left_shift(np.uint64(1), s.astype(np.uint64))
    lo = np.where(s <= 1, np.uint64(0), hi // np.uint64(2)).astype(np.uint64)
    return lo, hi.astype(np.uint64)
