"""`moetrace record`: attach probes, run a command under them, write a run directory.

Order of a recording (:func:`record`):

1. refuse without privileges (root, or CAP_BPF + CAP_PERFMON), find tracefs
   (mounting it when absent, and saying so);
2. create the run directory (0700) and write a manifest marked incomplete;
3. resolve each probe's attach plan by asking the kernel (tracefs entries, the
   kernel's BTF for tracepoint fields; no format file is read where BTF or this
   boot's earlier answers say it), derive its knobs, load its compiled object and
   attach it (timed), earlier recordings' releasers paused meanwhile
   (:class:`moetrace.kernel.bpf.AttachGate`);
4. load the pool's inode -> expert map into the probe;
5. fork the command, which waits on a pipe until its pid is in the probe's
   tracked-tgid map, joins ``--cgroup`` when given (a memory scope: only the
   command is limited, never the recorder), then execs with
   ``MOETRACE_RUN_DIR=<run>/replay`` (so no event of the command is missed; a
   command that names its own ``--run-dir`` keeps it, and the recorder reads
   the replay log from there);
6. wait, forwarding SIGINT/SIGTERM to the child (a second signal escalates to
   SIGTERM, a third to SIGKILL);
7. read the counters, detach, write the tables and the final manifest
   (``complete`` true only when nothing was interrupted), return the child's
   exit status.

Probe declarations (one per probe C file: recorder, attach groups, knobs, tables) are
:data:`moetrace.record.probes.PROBES`; the attach plan the recorder loads is
:func:`moetrace.record.spec.resolve`'s, the same one ``moetrace doctor`` shows, and
its ``to_dict()`` is written to the manifest's ``attach_plan``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from moetrace.lazyimport import pandas as pd

from moetrace.atomic import atomic_write
from moetrace.run import directory as rd
from moetrace.errors import MoetraceError, UsageError
from moetrace.record.probe import ProbeRecorder, RecordContext
from moetrace.record.spec import resolve
from moetrace.record.probes import DEFAULT_PROBES, DERIVED_KNOBS, EXPERTS_PROBES, PROBES, RECORDED, recorder_class
from moetrace.run.replaylog import RUN_DIR_ENV, read_replay_summary, requested_from_replay
from moetrace.kernel.syscalls import set_pdeathsig
from moetrace.record.poolmap import is_model_path, model_pool_map, pool_map

log = logging.getLogger("moetrace.record")

#: the recorder's wait loop: milliseconds per round (waitpid once per round). Every poller
#: returns early on its own events (a new fd identity, ring data, the command's exit), so a
#: round only bounds how stale a ring may get; with counters only the rings carry little and
#: fewer wake-ups leave the command its CPUs (0.67 % of one CPU at 100 ms on a 2-CPU VM).
POLL_ROUND_MS = 500
POLL_ROUND_STREAM_MS = 100


# ---------------------------------------------------------------------------
# probes: one module each (moetrace.record.probes.<name>: its ProbeSpec and its recorder, a
# moetrace.record.probe.ProbeRecorder); RECORDED, DERIVED_KNOBS, EXPERTS_PROBES come from the specs

#: what `record` attaches without --probes: the declared default set, as far as it is recorded
DEFAULT_RECORD: tuple[str, ...] = tuple(p for p in DEFAULT_PROBES if p in RECORDED)
#: struct page_event of probes/pagecache.bpf.c (from the declaration)
PAGE_EVENT_DTYPE = PROBES["pagecache"].struct("page_event").dtype()


def probe_list(text: str | None) -> tuple[str, ...]:
    """`record --probes`: None -> DEFAULT_RECORD; "a,b" -> those; "+a,+b" -> DEFAULT_RECORD and
    those (UsageError for a list that mixes the two forms)."""
    from moetrace.errors import UsageError

    if text is None:
        return DEFAULT_RECORD
    items = [p.strip() for p in text.split(",") if p.strip()]
    added = [p for p in items if p.startswith("+")]
    if not added:
        return tuple(items)
    if len(added) != len(items):
        raise UsageError(f"--probes {text!r} mixes '+NAME' (added to the default set) with plain names",
                         hint="write '+vmscan' (the default set and vmscan) or the whole list ('pagecache,vmscan')")
    return DEFAULT_RECORD + tuple(p[1:] for p in added if p[1:] not in DEFAULT_RECORD)


# ---------------------------------------------------------------------------
# the command line


def option_from_command(cmd: list[str], name: str) -> str | None:
    """The value of ``name`` (``--opt VALUE`` or ``--opt=VALUE``) in a command line, if any."""
    for i, a in enumerate(cmd):
        if a == name and i + 1 < len(cmd):
            return cmd[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def pool_from_command(cmd: list[str]) -> str | None:
    """The value of ``--pool`` (or ``--pool=DIR``) in a command line, if any."""
    return option_from_command(cmd, "--pool")


#: probes that cannot attribute a model file's pages yet, and why
MODEL_SKIPS = {"lru": "a model file's pages (runs of three slices per expert) are attributed by pagecache, "
                      "block and reads; lru's dwell times know one extent per expert only"}


def model_pool_doc(pmap, source: str) -> dict[str, Any]:
    """The manifest's pool section for a model file."""
    m = pmap.model
    s = m.summary()
    return {"root": str(Path(m.files[0]).resolve()), "identity": None, "layout": "model", "kind": "model",
            "format": m.format, "arch": m.arch, "model_files": [str(Path(f).resolve()) for f in m.files],
            "geometry": {"n_layers": pmap.n_total // pmap.n_experts, "n_experts": pmap.n_experts,
                         **({"k": m.experts_per_token} if m.experts_per_token else {}),
                         "expert_bytes": pmap.extent_bytes},
            "extent_bytes": pmap.extent_bytes, "pages_per_expert": pmap.pages_per_expert,
            "files": len(m.files), "s_dev": pmap.dev, "s_dev_text": f"{pmap.dev >> 20}:{pmap.dev & ((1 << 20) - 1)}",
            "runs": len(pmap.runs), "search_steps": pmap.search_steps, "bitmap_words": pmap.bitmap_words,
            "shared_pages": s["shared_pages"], "non_expert_bytes": s["non_expert_bytes"],
            "alignment": m.alignment, "source": source}


# ---------------------------------------------------------------------------
# the recording


@dataclass
class RecordOptions:
    command: list[str]
    out: str | None = None
    probes: tuple[str, ...] = DEFAULT_RECORD
    pool: str | None = None
    missing_probes: str = "error"  # error | warn
    stream_events: bool = False
    stream_max_records: int = 5_000_000
    #: turn BPF run-time statistics on while recording (BPF_ENABLE_STATS; off again at the end):
    #: the manifest's bpf_runtime then says how much CPU time each probe's programs took
    bpf_stats: bool = False
    #: ``--knob PROBE.NAME=V``: {probe: {NAME: V}} for the further probes (probe_recorder)
    knobs: dict[str, dict[str, int]] = field(default_factory=dict)
    #: a cgroup directory (v1 or v2) the command joins after the fork, before it execs:
    #: only the command is limited, never the recorder (its loads and readers would be charged too)
    cgroup: str | None = None
    #: wait until the kernel has released every probe (the releaser exited) before returning;
    #: without it record returns once the probes are disarmed, read and dropped
    wait_detach: bool = False


@dataclass
class RecordResult:
    run_dir: Path
    exit_status: int
    complete: bool
    manifest: dict[str, Any]
    experts: pd.DataFrame | None = None


@dataclass
class _State:
    child: int | None = None
    signals: list[int] = field(default_factory=list)


def _exit_status(status: int) -> int:
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return 1


def _spawn(cmd: list[str], env: dict[str, str], cgroup_procs: str | None = None) -> tuple[int, int]:
    """Fork a child that waits for one byte on a pipe, then execs ``cmd``.

    Returns (pid, write end of the gate). The child's umask is 077 so what it
    writes into the run directory is owner-only too. With ``cgroup_procs`` the
    child writes its pid there first (joins that cgroup before reading a page)."""
    procs = cgroup_procs.encode() if cgroup_procs else None  # no allocation-heavy work after fork
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, ever
        try:
            os.close(w)
            os.umask(0o077)
            try:
                set_pdeathsig(signal.SIGTERM)  # the command ends with the recorder, even a SIGKILLed one
            except OSError:
                pass
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, signal.SIG_DFL)
            if os.read(r, 1) != b"g":
                os._exit(125)
            os.close(r)
            if procs is not None:
                try:
                    fd = os.open(procs, os.O_WRONLY)
                    os.write(fd, str(os.getpid()).encode())
                    os.close(fd)
                except OSError as e:
                    os.write(2, f"moetrace record: cannot join cgroup {procs.decode()}: {e.strerror}\n".encode())
                    os._exit(126)
            os.execvpe(cmd[0], cmd, env)
        except OSError as e:
            os.write(2, f"moetrace record: cannot run {cmd[0]}: {e.strerror}\n".encode())
            os._exit(127)
        except BaseException:
            os._exit(127)
    os.close(r)
    return pid, w


def _features(mount: bool = False):
    from moetrace.kernel.features import Features

    return Features("/", mount=mount)


def check_can_record(features, probes: tuple[str, ...] | list[str] = ()) -> None:
    """Refuse without privileges (naming the missing one) or tracefs. (A kernel without BTF is
    each probe's attach plan's "no", with the reason.)"""
    from moetrace.kernel.bpf import require_privileges, require_tracefs

    require_privileges(features.privileges)
    require_tracefs(features)


def record(opts: RecordOptions, on_event: Callable[[str], None] | None = None) -> RecordResult:
    """Run ``opts.command`` under the probes; write the run directory; return the result.

    tracefs (or debugfs) mounted by this run because it was absent is unmounted at the end,
    on success, error and Ctrl-C alike (`moetrace record` mounts in a mount namespace of its
    own, :func:`moetrace.kernel.features.private_mounts`: a SIGKILL takes those along too)."""
    from moetrace.kernel.features import unmount_ours

    try:
        return _record(opts, on_event)
    finally:
        for note in unmount_ours():
            (on_event or log.info)(note)


class _Recording:
    """One `moetrace record`: the steps of :func:`record`, each a method, sharing the state
    (options, features, attach plans, the pool map, the run directory and manifest, the
    probe recorders, the child)."""

    def __init__(self, opts: RecordOptions, say: Callable[[str], None]):
        self.opts, self.say = opts, say
        self.notes: list[str] = []
        self.attach_plan: dict[str, dict[str, Any]] = {}
        self.recorders: list[ProbeRecorder] = []
        self.state = _State()
        self.old_handlers: dict[int, Any] = {}
        self.stats_fd: int | None = None
        self.snaps: dict[str, Any] = {}
        self.pmap = None
        self.pool_doc = None
        self.cgroup_procs: str | None = None
        self.exit_status = 1
        self.written: set[str] = set()

    # -- 1. what to record ----------------------------------------------------------------------
    def resolve(self) -> None:
        """Options, privileges, and one attach plan per probe (the same doctor shows)."""
        opts, notes = self.opts, self.notes
        if not opts.command:
            raise UsageError("no command to record", hint="moetrace record -- replay plan.bin --pool DIR")
        if opts.missing_probes not in ("error", "warn"):
            raise UsageError(f"--missing-probes {opts.missing_probes!r}", hint="error or warn")
        self.wanted = wanted = list(dict.fromkeys(opts.probes))
        unknown = [p for p in wanted if p not in PROBES]
        if unknown:
            raise UsageError(f"no such probe: {', '.join(unknown)}", hint=f"probes: {', '.join(PROBES)}")
        for p in wanted:
            if p not in RECORDED and opts.missing_probes == "error":
                raise UsageError(f"probe {p}: not recorded by this version of moetrace (declared, see "
                                 f"`moetrace doctor`)",
                                 hint=f"recorded: {', '.join(RECORDED)}; or pass --missing-probes warn")
        for p in opts.knobs:
            if p not in wanted:
                raise UsageError(f"--knob {p}.*: probe {p} is not recorded",
                                 hint=f"add it to --probes ({', '.join(wanted)})")
            if p in DERIVED_KNOBS:
                raise UsageError(f"--knob {p}.*: the {p} probe's knobs are derived from the pool and the kernel",
                                 hint=f"--knob applies to {', '.join(p for p in RECORDED if p not in DERIVED_KNOBS)}")
        self.feats = feats = _features()
        check_can_record(feats, wanted)
        notes.extend(feats.notes)
        self.plans = {p: resolve(PROBES[p], feats) for p in wanted}
        for p, plan in self.plans.items():
            self.attach_plan[p] = dict(plan.to_dict(), recorded=False, skip_reason=None)
            if p not in RECORDED:
                self.attach_plan[p]["skip_reason"] = "not recorded by this version of moetrace"
                notes.append(f"probe {p} skipped: not recorded by this version of moetrace")
            elif plan.status == "no":
                self.attach_plan[p]["skip_reason"] = plan.reason
                if opts.missing_probes == "error" and not PROBES[p].enrichment:
                    raise MoetraceError(f"probe {p} cannot attach: {plan.reason}",
                                        hint="moetrace doctor lists what this kernel offers")
                notes.append(f"probe {p} skipped: {plan.reason}")
            elif plan.status == "degraded":
                notes.append(f"probe {p} degraded: {plan.reason}")

    def open_pool(self) -> None:
        """The pool's inode -> expert map, and the cgroup the command joins."""
        opts = self.opts
        pool_dir = opts.pool or pool_from_command(opts.command)
        if pool_dir is not None and is_model_path(Path(pool_dir)):
            self.pmap = pmap = model_pool_map(pool_dir)
            self.pool_doc = model_pool_doc(pmap, "--pool" if opts.pool else "the command's --pool")
            self._skip_for_model()
        elif pool_dir is not None:
            from moetrace.inputs.pool import open_pool

            pool = open_pool(pool_dir)
            self.pmap = pmap = pool_map(pool)
            self.pool_doc = {"root": str(Path(pool.root).resolve()), "identity": pool.manifest.get("checksum"),
                             "layout": pool.layout, "geometry": pool.geometry.to_dict(),
                             "extent_bytes": pool.extent_bytes, "pages_per_expert": pmap.pages_per_expert,
                             "files": len(pool.files), "s_dev": pmap.dev,
                             "s_dev_text": f"{pmap.dev >> 20}:{pmap.dev & ((1 << 20) - 1)}",
                             "source": "--pool" if opts.pool else "the command's --pool"}
        else:
            self.notes.append("no pool named (--pool, or --pool in the command): every page-cache page is "
                              "unattributed")
        if opts.cgroup is not None:
            cg = Path(opts.cgroup)
            if not (cg / "cgroup.procs").is_file():
                raise UsageError(f"--cgroup {opts.cgroup}: not a cgroup directory (no cgroup.procs)",
                                 hint="make one first, e.g. mkdir /sys/fs/cgroup/memory/moetrace-x and set "
                                      "memory.limit_in_bytes")
            self.cgroup_procs = str(cg.resolve() / "cgroup.procs")

    def _skip_for_model(self) -> None:
        """Probes that attribute by one extent per expert only: skipped on a model file, said why."""
        for p, why in MODEL_SKIPS.items():
            plan = self.plans.get(p)
            if plan is not None and plan.status != "no":
                self.plans[p] = replace(plan, status="no", reason=why)
                self.attach_plan[p].update(status="no", skip_reason=why)
                self.notes.append(f"probe {p} skipped: {why}")

    def create_run(self) -> None:
        """The run directory (0700) and its manifest, marked incomplete until the end."""
        from moetrace.kernel.damon import read_damon

        opts, feats = self.opts, self.feats
        self.run_dir = run_dir = rd.create_run_dir(opts.out or rd.default_run_dir())
        self.replay_dir = run_dir / rd.REPLAY_SUBDIR
        os.mkdir(self.replay_dir, rd.DIR_MODE)
        os.chmod(self.replay_dir, rd.DIR_MODE)
        self.log_dir = self.replay_dir  # where the replay log lands (its own --run-dir wins over the env)
        named = option_from_command(opts.command, "--run-dir")
        if named is not None:
            self.log_dir = Path(named)
            self.notes.append(f"the command writes its replay log to its --run-dir {named}, not {self.replay_dir}")
        damon = read_damon()
        self.manifest = {
            "command": list(opts.command),
            "record_command": [os.path.basename(sys.argv[0]), *sys.argv[1:]],
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "complete": False, "exit_status": None, "interrupted_by": None, "plan": None,
            "pool": self.pool_doc, "replay_dir": str(self.log_dir.resolve()),
            "cgroup": str(Path(opts.cgroup).resolve()) if opts.cgroup else None,
            "kernel": {"release": feats.osrelease, "btf": feats.btf},
            "mglru": feats.mglru, "privileges": feats.privileges,
            # reclaimers that evict behind the measurement's back (read only): evictions by them are
            # in the experts table's evicted_by_damon_pages
            "background_reclaimers": {"damon": [
                {k: s.get(k) for k in ("thread", "pid", "operations", "action", "regions", "min_idle_s", "quotas",
                                       "filters", "evicts_page_cache", "effect")}
                for s in damon["active_schemes"]], "damon_available": damon["available"]},
            "probes": self.wanted, "attach_plan": self.attach_plan,
            "clock": {"probes": "bpf_ktime_get_ns (CLOCK_MONOTONIC)", "replay": "CLOCK_MONOTONIC",
                      "recorder": "time.monotonic_ns (CLOCK_MONOTONIC)"},
            "lost": {}, "stats": {}, "timings": {}, "requested": None, "tables": {}, "notes": self.notes,
        }
        rd.write_manifest(run_dir, self.manifest)

    # -- 2. attach every probe, then arm them together ---------------------------------------------
    def open_probes(self) -> None:
        opts, manifest = self.opts, self.manifest
        if opts.bpf_stats:
            from moetrace.kernel.bpf import enable_stats

            try:
                self.stats_fd = enable_stats()
            except OSError as e:
                self.notes.append(f"--bpf-stats: run-time statistics unavailable ({e.strerror or e})")
        t0 = time.perf_counter()
        from moetrace.lazyimport import warm, warm_names

        warming = warm(warm_names(joins_cgroup=opts.cgroup is not None))
        try:
            self._open_each()
        finally:
            warming.join()  # before any fork (the command, the releaser)
        manifest["bpf_prog_ids"] = sorted(i for r in self.recorders for i in r.prog_ids())
        manifest["timings"]["probes_attach_s"] = round(time.perf_counter() - t0, 4)
        rd.write_manifest(self.run_dir, manifest)

    def _open_each(self) -> None:
        """Load and attach each probe, in threads (libbpf is thread-safe and ctypes releases the
        GIL: the verifier of one runs beside another's). Results are taken in the probes' order."""
        from concurrent.futures import ThreadPoolExecutor

        opts = self.opts
        recording = tuple(p for p in self.wanted if p in RECORDED and self.plans[p].status != "no")
        recs = [(name, recorder_class(name)(self._context(name, recording))) for name in recording]
        workers = min(4, os.cpu_count() or 1)

        def open_one(item) -> MoetraceError | None:
            name, rec = item
            self.say(f"loading and attaching {name} ...")
            try:
                rec.open()
            except MoetraceError as e:
                rec.abort()
                return e
            return None

        try:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moetrace-load") as ex:
                errors = list(ex.map(open_one, recs))
        except BaseException:
            for _n, rec in recs:
                rec.abort()
            raise
        for i, ((name, rec), err) in enumerate(zip(recs, errors)):
            if err is not None and opts.missing_probes == "error":
                for _n, other in recs[i:]:
                    other.abort()
                raise MoetraceError(f"probe {name} cannot be recorded: {err.message}",
                                    hint="--missing-probes warn records without it; `moetrace doctor` "
                                         "explains") from None
            if err is not None:
                self.attach_plan[name]["skip_reason"] = err.message
                self.notes.append(f"probe {name} skipped: {err.message}")
                continue
            self._opened(name, rec)

    def _context(self, name: str, recording: tuple[str, ...]) -> RecordContext:
        opts = self.opts
        return RecordContext(features=self.feats, plan=self.plans[name], pmap=self.pmap, run_dir=self.run_dir,
                             log_dir=self.log_dir, stream=opts.stream_events, t0_ns=time.monotonic_ns(),
                             notes=self.notes, say=self.say, stream_max_records=opts.stream_max_records,
                             knobs=dict(opts.knobs.get(name, {})), gated=True, recording=recording)

    def _opened(self, name: str, rec) -> None:
        """A probe attached: into the recording and its manifest sections."""
        manifest = self.manifest
        self.recorders.append(rec)
        self.attach_plan[name]["recorded"] = True
        if getattr(rec, "switched_off", None):
            self.attach_plan[name]["switched_off"] = dict(rec.switched_off)
        if rec.load_attach_s is not None:
            manifest["timings"][f"{name}_load_attach_s"] = round(rec.load_attach_s, 4)
        core = getattr(rec, "probe", None)  # the object's own split: load (verifier, JIT) and attach
        if getattr(core, "attach_s", None) is not None and getattr(core, "load_s", None) is not None:
            manifest["timings"][f"{name}_load_s"] = round(core.load_s, 4)
            manifest["timings"][f"{name}_attach_s"] = round(core.attach_s, 4)
        manifest.setdefault("knobs", {})[name] = dict(rec.knobs)
        self.attach_plan[name]["loader"] = _loader_of(rec)
        rec.describe(manifest)
        self.say(f"attached {name}" + (f" in {rec.load_attach_s:.2f} s" if rec.load_attach_s else ""))

    def arm_all(self, on: bool) -> None:
        """Every probe at once, microseconds apart: the probes of one recording count over the
        same interval (and the oracles' snapshots are taken right inside it)."""
        iv = self.manifest.setdefault("interval", {
            "note": "every probe counts from armed_ns to disarmed_ns (armed together after all attached, "
                    "disarmed together before any is read); armed_done_ns / disarm_start_ns bound the "
                    "microseconds the (dis)arming took"})
        iv["armed_ns" if on else "disarm_start_ns"] = time.monotonic_ns()
        for r in self.recorders:
            r.arm(on)
        iv["armed_done_ns" if on else "disarmed_ns"] = time.monotonic_ns()
        iv["gated"] = {r.name: r.gated() for r in self.recorders}

    # -- 3. the command ------------------------------------------------------------------------
    def run_command(self) -> None:
        import resource

        from moetrace.kernel.procfs import take_snapshot

        opts, manifest, state = self.opts, self.manifest, self.state
        self.arm_all(True)
        self.snaps["pre"] = take_snapshot("pre")

        def on_signal(signum, frame):
            state.signals.append(signum)
            if state.child is not None:
                n = len(state.signals)
                sig = signum if n == 1 else (signal.SIGTERM if n == 2 else signal.SIGKILL)
                try:
                    os.kill(state.child, sig)
                except ProcessLookupError:
                    pass

        for s in (signal.SIGINT, signal.SIGTERM):
            self.old_handlers[s] = signal.signal(s, on_signal)
        env = dict(os.environ)
        env[RUN_DIR_ENV] = str(self.replay_dir.resolve())
        for r in self.recorders:
            env.update(r.child_env())
        self.t_start = time.monotonic_ns()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        pid, gate = _spawn(list(opts.command), env, self.cgroup_procs)
        state.child = pid
        pidfd = os.pidfd_open(pid)  # readable once the command has ended: pollers return at once
        try:
            for r in self.recorders:
                r.child_started()
                r.follow(pid)
                r.wake_on(pidfd)
            os.write(gate, b"g")
            os.close(gate)
            manifest["child_pid"] = pid
            status = self._wait(pid)
        finally:
            os.close(pidfd)
        self.t_end = time.monotonic_ns()
        self.exit_status = manifest["exit_status"] = _exit_status(status)
        if os.WIFSIGNALED(status):  # killed (the OOM killer's SIGKILL, a crash): the run is not complete
            manifest["command_signal"] = signal.Signals(os.WTERMSIG(status)).name
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        manifest["timings"].update(command_start_ns=self.t_start, command_end_ns=self.t_end,
                                   command_wall_s=round((self.t_end - self.t_start) / 1e9, 6),
                                   # the recorder's own CPU while the command ran (polling rings, samplers)
                                   recorder_user_s=round(ru1.ru_utime - ru0.ru_utime, 4),
                                   recorder_system_s=round(ru1.ru_stime - ru0.ru_stime, 4),
                                   recorder_maxrss_bytes=_peak_rss())
        for r in self.recorders:
            r.settle()
        self.arm_all(False)
        self.snaps["post"] = take_snapshot("post")  # the oracles' window: [pre after arming, post after disarming]
        _write_snapshots(self.run_dir, self.snaps)  # on disk before any probe is read
        rd.write_manifest(self.run_dir, manifest, pretty=False)

    def _wait(self, pid: int) -> int:
        """waitpid, draining the pollers meanwhile; one round waits POLL_ROUND_MS in all, shared
        by the pollers (each returns early on its own events); per-page streams more often."""
        pollers = [r for r in self.recorders if r.needs_poll]
        round_ms = POLL_ROUND_STREAM_MS if self.opts.stream_events else POLL_ROUND_MS
        share = round_ms // max(1, len(pollers))
        exited: list[int] = []
        if pollers:
            # SIGCHLD interrupts a poller's epoll_wait (EINTR), so the command's end is seen at once,
            # not at the end of a round (a `true` took 0.34 s of command wall before)
            self.old_handlers.setdefault(signal.SIGCHLD, signal.getsignal(signal.SIGCHLD))
            signal.signal(signal.SIGCHLD, lambda signum, frame: exited.append(signum))
        while True:
            if pollers:
                for r in pollers:
                    if exited:
                        break
                    r.poll(share)
                exited.clear()
                p, st = os.waitpid(pid, os.WNOHANG)
            else:
                p, st = os.waitpid(pid, 0)
            if p == pid:
                return st

    # -- 4. read everything, then detach --------------------------------------------------------
    def collect(self) -> None:
        """Read every probe's data, then detach: a forked child holds every fd meanwhile, so
        the detaches only drop references, and the kernel's slow part (RCU grace periods per
        tracepoint) runs when the child exits, while the tables are written."""
        from moetrace.kernel.bpf import release_in_child

        # the programs stay attached (system-wide) until the child below lets go, so other processes'
        # events still run them while the maps are read: run counts are read before and after the
        # probes' own counters, through duplicates of the program fds (the probes close their own)
        dups = _prog_fd_dups(self.recorders) if self.stats_fd is not None else {}
        self.manifest["bpf_runtime"] = _runtime(self.recorders, self.stats_fd is not None,
                                                self.t_end - self.t_start)
        t0 = time.perf_counter()
        self.releaser = release_in_child()
        for r in self.recorders:
            r.ctx.command_start_ns, r.ctx.command_end_ns = self.t_start, self.t_end
            t1 = time.perf_counter()
            try:
                r.close()
            except Exception as e:  # noqa: BLE001 - one probe's failure must not lose the others' tables
                self._failed(r, "collect", e)
                r.abort()
                continue
            if r.collected and r.name not in EXPERTS_PROBES:
                self._write_probe(r)  # on disk as soon as drained: a later crash cannot lose them
            self.manifest["timings"][f"{r.name}_collect_s"] = round(time.perf_counter() - t1, 4)
        _runs_after(dups, self.manifest["bpf_runtime"])
        self.releaser.release()
        self.manifest["detached"] = True
        self.manifest["timings"]["collect_detach_s"] = round(time.perf_counter() - t0, 4)

    def _failed(self, r: ProbeRecorder, stage: str, e: Exception) -> None:
        msg = e.message if isinstance(e, MoetraceError) else f"{type(e).__name__}: {e}"
        self.notes.append(f"probe {r.name}: {stage} failed: {msg}")
        self.manifest.setdefault("failed_probes", {})[r.name] = {"stage": stage, "error": msg}
        self.attach_plan[r.name]["failed"] = {"stage": stage, "error": msg}

    def _write_probe(self, r: ProbeRecorder) -> None:
        try:
            r.write(self.run_dir, self.manifest)
        except Exception as e:  # noqa: BLE001
            self._failed(r, "write", e)
        self.written.add(r.name)
        rd.write_manifest(self.run_dir, self.manifest, pretty=False)

    # -- 5. the run directory -----------------------------------------------------------------
    def write(self) -> RecordResult:
        manifest, run_dir = self.manifest, self.run_dir
        by = {r.name: r for r in self.recorders if r.collected}
        pc, blk = by.get("pagecache"), by.get("block")
        result_df = None
        if pc is not None or blk is not None:
            req_b = req_p = None
            if self.pmap is not None and self.pmap.kind == "model":
                how = "a model file: no replay plan; the engine's routing log is the request (moetrace model route)"
            elif self.pmap is not None and pc is not None:
                req_b, req_p, how = requested_from_replay(self.log_dir, self.pmap.pool)
            else:
                how = "no pool: nothing to attribute requests to" if self.pmap is None else "pagecache not recorded"
            manifest["requested"] = {"source": how, "available": req_p is not None}
            from moetrace.record.probes.pagecache import experts_table, experts_totals

            result_df = experts_table(self.pmap, pc.expert_counts() if pc else None, req_b, req_p,
                                      blk.result if blk else None, pc.evictors if pc else None,
                                      pc.cause_array(pc.causes) if pc else None)
            rd.write_table(run_dir, "experts", result_df)
            manifest["tables"]["experts"] = {c.name: {"dtype": c.dtype, "unit": c.unit, "doc": c.doc}
                                             for c in PROBES["pagecache"].schema + PROBES["block"].schema}
            if pc is not None:
                manifest["totals"] = experts_totals(result_df, req_p is not None,
                                                    pc.stats["read_bytes"] if pc.knobs.get("MOE_TRACK_READS") else None)
            if blk is not None:
                e = result_df[result_df["kind"] == "expert"]
                u = result_df[result_df["kind"] == "unattributed"].iloc[0]
                manifest.setdefault("totals", {}).update(
                    experts_device_read_bytes=int(e["device_read_bytes"].sum()),
                    unattributed_device_read_bytes=int(u["device_read_bytes"]))
        for r in self.recorders:
            if r.collected and r.name not in self.written:
                self._write_probe(r)
        if blk is not None and blk.pool_disk is not None:
            self.snaps["pool_disk"] = blk.pool_disk
        _write_snapshots(run_dir, self.snaps)
        rs = read_replay_summary(self.log_dir)
        if rs is not None:
            manifest["plan"] = rs.get("plan")
            manifest["replay_complete"] = rs.get("complete")
        elif (self.log_dir / "replay.json").exists():
            self.notes.append("replay.json unreadable")
        interrupted = bool(self.state.signals) or (manifest.get("replay_complete") is False)
        if self.state.signals:
            manifest["interrupted_by"] = signal.Signals(self.state.signals[0]).name
        manifest["complete"] = not interrupted and "command_signal" not in manifest and "failed_probes" not in manifest
        return RecordResult(run_dir, self.exit_status, manifest["complete"], manifest, result_df)

    def cleanup(self) -> None:
        """Always: handlers back, fds closed, every probe detached, the manifest written, the
        detaching child reaped."""
        for s, h in self.old_handlers.items():
            signal.signal(s, h)
        if self.stats_fd is not None:
            os.close(self.stats_fd)  # run-time statistics off again
        for r in self.recorders:
            r.abort()
        if self.state.signals and self.manifest.get("interrupted_by") is None:
            self.manifest["interrupted_by"] = signal.Signals(self.state.signals[0]).name
        rd.write_manifest(self.run_dir, self.manifest, pretty=getattr(self, "releaser", None) is None)
        rel = getattr(self, "releaser", None)
        if rel is not None:
            self.manifest["detach"] = {
                "releaser_pid": rel.pid, "waited": bool(self.opts.wait_detach),
                "note": "the probes were disarmed, read and dropped by the recorder; the kernel's release of "
                        "their tracepoints (RCU grace periods, ~44 ms each) runs in the releaser process, which "
                        "exits when every program, map and perf event is gone"
                        + ("" if self.opts.wait_detach else " (record did not wait for it: --wait-detach does)")}
            if self.opts.wait_detach:
                t0 = time.perf_counter()
                rel.wait()
                self.manifest["timings"]["detach_release_wait_s"] = round(time.perf_counter() - t0, 4)
            else:
                rel.forget()
            rd.write_manifest(self.run_dir, self.manifest)


def _record(opts: RecordOptions, on_event: Callable[[str], None] | None = None) -> RecordResult:
    """Run ``opts.command`` under the probes; write the run directory; return the result.

    The child's exit status is returned (128 + signal when it was killed), never
    raised. ``on_event`` receives short progress lines ("attached ...")."""
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable()  # a crash in native code (libbpf, libc) still says where, on stderr
    from moetrace.kernel.bpf import AttachGate

    rec = _Recording(opts, on_event or (lambda s: None))
    gate = AttachGate()  # held until attached: earlier recordings' releasers pause (see AttachGate)
    try:
        rec.resolve()
        rec.open_pool()
        rec.create_run()
    except BaseException:
        gate.release()
        raise
    try:
        rec.open_probes()
        gate.release()  # before the command and the releaser are forked
        rec.run_command()
        rec.collect()
        return rec.write()
    finally:
        gate.release()
        rec.cleanup()


def _loader_of(rec) -> dict[str, Any]:
    """How a probe was loaded: its compiled object through libbpf (no compiler at record time),
    relocated against the minimal BTF of the probes (moetrace.kernel.minbtf) or the kernel's own."""
    from moetrace.kernel.bpf import core_btf, object_path

    btf = core_btf()
    return {"backend": "core", "object": str(object_path(rec.name)),
            "core_btf": str(btf) if btf is not None else "/sys/kernel/btf/vmlinux"}


def _prog_fd_dups(recorders) -> dict[str, dict[str, int]]:
    """{probe: {program: a duplicate of its fd}}, to read run counts after the loader closed its fds."""
    out: dict[str, dict[str, int]] = {}
    for r in recorders:
        for name, fd in r.prog_fds().items():
            try:
                out.setdefault(r.name, {})[name] = os.dup(fd)
            except OSError:
                pass
    return out


def _runs_after(dups: dict[str, dict[str, int]], runtime: dict[str, Any]) -> None:
    """Add run_cnt_after (read after every probe's counters) to each program of runtime, close the dups."""
    from moetrace.kernel.bpf import prog_fdinfo

    progs = runtime.get("programs") or {}
    for probe, fds in dups.items():
        for name, fd in fds.items():
            try:
                if probe in progs and name in progs[probe]:
                    progs[probe][name]["run_cnt_after"] = prog_fdinfo(fd).get("run_cnt")
            finally:
                os.close(fd)


def _peak_rss() -> int | None:
    """This process's peak resident set (VmHWM: its own address space's, where ru_maxrss keeps
    the parent's from before the exec)."""
    from moetrace.kernel.procfs import read_status

    v = read_status(os.getpid()).get("VmHWM", "")
    return int(v.split()[0]) * 1024 if v.split() and v.split()[0].isdigit() else None


def _runtime(recorders, enabled: bool, wall_ns: int) -> dict[str, Any]:
    """Per probe: its BPF programs' run counts and run time over the recording (the kernel
    counts run time only while statistics are on: ``record --bpf-stats``)."""
    from moetrace.kernel.bpf import prog_runtime

    progs: dict[str, Any] = {}
    for r in recorders:
        fds = r.prog_fds()
        if fds:
            progs[r.name] = prog_runtime(fds)
    per = {p: sum(v["run_time_ns"] or 0 for v in fns.values()) for p, fns in progs.items()}
    runs = {p: sum(v["run_cnt"] or 0 for v in fns.values()) for p, fns in progs.items()}
    total = sum(per.values())
    return {"stats_enabled": enabled, "command_wall_ns": wall_ns,
            "per_probe_run_time_ns": per if enabled else None, "per_probe_runs": runs if enabled else None,
            "total_run_time_ns": total if enabled else None,
            "cpu_fraction_of_wall": (total / wall_ns) if enabled and wall_ns else None,
            "programs": progs if enabled else None,
            "note": "run time of the probes' BPF programs in the kernel (all CPUs), not the recorder's user-space "
                    "time; counted only with --bpf-stats"}


def _write_snapshots(run_dir: Path, snaps: dict[str, Any]) -> None:
    from moetrace.jsonutil import json_default

    text = json.dumps(snaps, default=json_default) + "\n"
    with atomic_write(run_dir / "snapshots.json", mode=rd.FILE_MODE) as tmp:
        tmp.write_text(text)
