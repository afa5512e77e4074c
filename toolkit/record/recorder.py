"""`moetrace record`: attach probes, run a command under them, write a run directory.

Order of a recording (:func:`record`):

1. refuse without privileges (root, or CAP_BPF + CAP_PERFMON), find tracefs
   (mounting it when absent, and saying so), check the kernel headers;
2. create the run directory (0700) and write a manifest marked incomplete;
3. resolve each probe's attach plan by asking the kernel (tracepoint format
   files), derive its ``-D`` knobs, compile + load + attach it (timed);
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

Probe declarations (one per probe C file: attach groups, knobs, schema) are
:data:`moetrace.record.spec.PROBES`; the attach plan the recorder loads is
:func:`moetrace.record.spec.resolve`'s, the same one ``moetrace doctor`` shows, and
its ``to_dict()`` is written to the manifest's ``attach_plan``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from moetrace.run import directory as rd
from moetrace.errors import MoetraceError, UsageError
from moetrace.record.spec import DEFAULT_PROBES, PROBES, AttachPlan, resolve
from moetrace.kernel.bpf import prog_info as bpf_prog_info
from moetrace.kernel.syscalls import set_pdeathsig

log = logging.getLogger("moetrace.record")

PAGE = os.sysconf("SC_PAGE_SIZE")
#: the recorder's wait loop: milliseconds per round (waitpid once per round). Every poller
#: returns early on its own events (a new fd identity, ring data, the command's exit), so a
#: round only bounds how stale a ring may get; with counters only the rings carry little and
#: fewer wake-ups leave the command its CPUs (0.67 % of one CPU at 100 ms on a 2-CPU VM).
POLL_ROUND_MS = 500
POLL_ROUND_STREAM_MS = 100


# ---------------------------------------------------------------------------
# probes: their one declaration each lives in moetrace.record.spec (knobs, attach
# groups, schema, stats slots, shared C structs); the recorder only derives the
# pool knobs and reads the maps back.

#: Probes this version of the recorder can load (the rest are declared and resolved
#: by doctor, and listed in the manifest's attach plan as not recorded).
BUILTIN = ("pagecache", "block", "reclaim")
from moetrace.record.probe import RecordContext, available as _available_recorders, recorder_class  # noqa: E402

#: the further probes, each a moetrace.record.probe.ProbeRecorder in its own module
EXTRA_RECORDED: tuple[str, ...] = tuple(_available_recorders())
RECORDED = BUILTIN + EXTRA_RECORDED
#: what `record` attaches without --probes: the declared default set, as far as it is recorded
DEFAULT_RECORD: tuple[str, ...] = tuple(p for p in DEFAULT_PROBES if p in RECORDED)
PAGECACHE = PROBES["pagecache"]
BLOCK = PROBES["block"]
RECLAIM = PROBES["reclaim"]
#: struct page_event of probes/pagecache.c (from the declaration)
PAGE_EVENT_DTYPE = PAGECACHE.struct("page_event").dtype()
RING_DROPS_SLOT = PAGECACHE.stats.index("ring_drops")


# ---------------------------------------------------------------------------
# the pool -> BPF map


def kernel_dev(st_dev: int) -> int:
    """A stat() device number in the kernel-internal encoding tracepoints print:
    (major << 20) | minor (what ``inode->i_sb->s_dev`` holds)."""
    return (os.major(st_dev) << 20) | os.minor(st_dev)


@dataclass
class PoolMap:
    """The pool as the pagecache probe sees it."""

    pool: Any
    pool_dev: int  # kernel encoding
    pages_per_expert: int
    words_per_expert: int
    inodes: dict[int, tuple[int, int]]  # ino -> (base expert_id, experts in the file)

    @property
    def n_total(self) -> int:
        return self.pool.n_total


def pool_map(pool) -> PoolMap:
    """inode -> (base, n) for every data file of the pool; all on one filesystem."""
    ppe = -(-pool.extent_bytes // PAGE)
    inodes: dict[int, tuple[int, int]] = {}
    devs = set()
    for i, p in enumerate(pool.data_paths()):
        st = os.stat(p)
        devs.add(st.st_dev)
        base, n = (i, 1) if pool.layout == "files" else (0, pool.n_total)
        if st.st_ino in inodes:
            raise UsageError(f"two pool files share inode {st.st_ino} ({p})", hint="hard links in a pool are not supported")
        inodes[st.st_ino] = (base, n)
    if len(devs) > 1:
        raise UsageError(f"the pool {pool.root} spans {len(devs)} filesystems",
                         hint="keep every expert file of a pool on one filesystem")
    dev = kernel_dev(devs.pop()) if devs else 0
    return PoolMap(pool, dev, ppe, -(-ppe // 64), inodes)


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


# ---------------------------------------------------------------------------
# requested pages from the replay's own accounting


def requested_from_replay(replay_dir: Path, pool) -> tuple[np.ndarray | None, np.ndarray | None, str]:
    """(requested bytes, requested pages) per expert_id from the replay's log, and how.

    Requested bytes per expert cannot be taken from the read syscalls without
    fd -> inode (kernel structs, unsafe with mismatched headers), so they come
    from the replay's plan accounting: every logged iteration row (warm-up and
    measured) contributes the plan's reads of that iteration x expert bytes.
    None (with the reason) when there is no usable log."""
    from moetrace.replay.harness import ITERATIONS_FILE, SUMMARY_FILE, load_flat_plan

    sp, ip = replay_dir / SUMMARY_FILE, replay_dir / ITERATIONS_FILE
    if not sp.exists() or not ip.exists():
        return None, None, "no replay log (the command wrote no replay.json / iterations.parquet)"
    try:
        summary = json.loads(sp.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return None, None, f"replay.json unreadable ({e})"
    mode = summary.get("mode")
    if mode not in ("pagecache", "mmap"):
        return None, None, (f"replay mode {mode}: its reads do not all go through the page cache "
                            "(O_DIRECT or an mlocked arena), requested pages are not derived")
    if summary.get("pool", {}).get("identity") != pool.manifest.get("checksum"):
        return None, None, "the replay used another pool than the recorded one"
    try:
        plan = load_flat_plan(summary["plan"]["path"])
    except (MoetraceError, KeyError, OSError) as e:
        return None, None, f"the replay's plan is unreadable ({e})"
    it = pd.read_parquet(ip, columns=["iteration"])
    n_it = plan.n_iterations
    occ = np.bincount(it["iteration"].to_numpy(np.int64), minlength=n_it)[:n_it]
    reads_per_it = plan.slot_bounds[plan.iter_bounds[1:]] - plan.slot_bounds[plan.iter_bounds[:-1]]
    weight = np.repeat(occ, reads_per_it)
    reads = np.bincount(plan.ids, weights=weight, minlength=pool.n_total).astype(np.int64)
    eb = pool.geometry.expert_bytes
    how = (f"replay plan accounting: {len(it)} logged iteration rows x the plan's reads per iteration x "
           f"{eb} expert bytes ({-(-eb // PAGE)} pages) per read; interrupted iterations are not logged")
    return reads * eb, reads * -(-eb // PAGE), how


def experts_table(pmap: PoolMap | None, counts: list[tuple[int, int, int]] | None,
                  req_bytes: np.ndarray | None, req_pages: np.ndarray | None, block=None) -> pd.DataFrame:
    """experts.parquet: one row per expert (in expert_id order) + the unattributed row.

    Columns: the pagecache declaration's schema (NA when ``counts`` is None: the probe
    was not recorded), then the block declaration's (``block``: a
    :class:`moetrace.record.probes.block.BlockResult`, or None: NA). The unattributed row's
    device_read_bytes is the bytes of no expert (every disk's when no pool was named),
    its bios NA (not counted apart)."""
    n = pmap.n_total if pmap is not None else 0
    if counts is None:
        c = np.full((n + 1, 3), -1, np.int64)
    else:
        c = np.asarray(counts, np.int64).reshape(-1, 3)
    E = pmap.pool.geometry.n_experts if pmap is not None else 1
    eid = np.arange(n, dtype=np.int64)

    def ia(x, dtype="Int64"):
        return pd.array(x, dtype=dtype)

    na = [pd.NA]
    df = pd.DataFrame({
        "kind": pd.array(["expert"] * n + ["unattributed"], dtype="string"),
        "layer": ia(list(eid // E) + na, "Int32"),
        "expert": ia(list(eid % E) + na, "Int32"),
        "expert_id": ia(list(eid) + na),
        "added_pages": ia(c[:, 0].tolist()),
        "evicted_pages": ia(c[:, 1].tolist()),
        "re_added_pages": ia(c[:n, 2].tolist() + na),
        "requested_bytes": ia((req_bytes.tolist() if req_bytes is not None else na * n) + na),
        "requested_pages": ia((req_pages.tolist() if req_pages is not None else na * n) + na),
    })
    if counts is None:
        for col in ("added_pages", "evicted_pages", "re_added_pages"):
            df[col] = pd.array([pd.NA] * (n + 1), dtype="Int64")
    df["hit_pages"] = df["requested_pages"] - df["added_pages"]
    if block is not None:
        per = block.per_expert.set_index("expert_id").reindex(range(n))
        unattr = block.unattributed_bytes if block.index_used else block.kernel_read_bytes
        df["device_read_bytes"] = pd.array(per["device_read_bytes"].tolist() + [unattr], dtype="Int64")
        df["bios"] = pd.array(per["bios"].tolist() + [pd.NA], dtype="Int64")
    else:
        df["device_read_bytes"] = pd.array([pd.NA] * (n + 1), dtype="Int64")
        df["bios"] = pd.array([pd.NA] * (n + 1), dtype="Int64")
    return df[[col.name for col in PAGECACHE.schema + BLOCK.schema]]


def epoch_tables(arr: np.ndarray, epochs: list, pmap: PoolMap) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(expert_epochs, epochs) from the probe's epoch_counts array and the epochs the replay
    assigned (:func:`moetrace.run.epochs.epochs_from_replay`).

    expert_epochs keeps the rows with a nonzero count only (an absent (epoch, expert) is
    zero: the array is read whole, nothing is missing)."""
    n1 = pmap.n_total + 1
    used = len(epochs)
    a = arr[: used * n1]
    tot = a["added_pages"].astype(np.int64) + a["evicted_pages"] + a["re_added_pages"]
    nz = np.flatnonzero(tot)
    ep, eid = nz // n1, nz % n1
    E = pmap.pool.geometry.n_experts
    is_exp = eid < pmap.n_total
    def ia(x, dt="Int64"):
        return pd.array(x, dtype=dt)

    df = pd.DataFrame({
        "epoch": ep.astype(np.int32),
        "kind": pd.array(np.where(is_exp, "expert", "unattributed"), dtype="string"),
        "layer": ia(np.where(is_exp, eid // E, 0), "Int32"),
        "expert": ia(np.where(is_exp, eid % E, 0), "Int32"),
        "expert_id": ia(eid),
        "added_pages": ia(a["added_pages"][nz].astype(np.int64)),
        "evicted_pages": ia(a["evicted_pages"][nz].astype(np.int64)),
        "re_added_pages": ia(a["re_added_pages"][nz].astype(np.int64)),
    })
    for c in ("layer", "expert", "expert_id"):
        df.loc[~is_exp, c] = pd.NA
    meta = pd.DataFrame({
        "epoch": np.array([e.epoch for e in epochs], np.int32),
        "phase": pd.array([e.phase for e in epochs], dtype="string"),
        "repeat": pd.array([e.repeat for e in epochs], dtype="Int32"),
        "iteration": pd.array([e.iteration for e in epochs], dtype="Int32"),
        "start_ns": pd.array([e.start_ns for e in epochs], dtype="Int64"),
        "end_ns": pd.array([e.end_ns for e in epochs], dtype="Int64"),
        "folded": pd.array([e.folded for e in epochs], dtype="boolean"),
    })
    return df, meta


def epoch_phase_totals(df: pd.DataFrame | None, meta: pd.DataFrame | None) -> dict[str, dict[str, int]] | None:
    """{phase: {added_pages, evicted_pages, re_added_pages}} of the experts (unattributed apart)."""
    if df is None or meta is None:
        return None
    m = df.merge(meta[["epoch", "phase"]], on="epoch")
    out: dict[str, dict[str, int]] = {}
    for ph in meta["phase"].unique():
        for kind in ("expert", "unattributed"):
            sub = m[(m["phase"] == ph) & (m["kind"] == kind)]
            key = str(ph) if kind == "expert" else f"{ph}_unattributed"
            out[key] = {c: int(sub[c].sum()) for c in ("added_pages", "evicted_pages", "re_added_pages")}
    return out


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
    #: only the command is limited, never the recorder (bcc + clang would be charged too)
    cgroup: str | None = None


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


def check_can_record(features) -> None:
    """Refuse without privileges (naming the missing one), tracefs or headers."""
    from moetrace.kernel.bpf import require_headers, require_privileges, require_tracefs

    require_privileges(features.privileges)
    require_tracefs(features)
    require_headers(features)


def record(opts: RecordOptions, on_event: Callable[[str], None] | None = None) -> RecordResult:
    """Run ``opts.command`` under the probes; write the run directory; return the result.

    tracefs (or debugfs) mounted by this run because it was absent is unmounted
    at the end, on success, error and Ctrl-C alike."""
    from moetrace.kernel.features import unmount_ours

    try:
        return _record(opts, on_event)
    finally:
        for note in unmount_ours():
            (on_event or log.info)(note)


def _record(opts: RecordOptions, on_event: Callable[[str], None] | None = None) -> RecordResult:
    """Run ``opts.command`` under the probes; write the run directory; return the result.

    The child's exit status is returned (128 + signal when it was killed), never
    raised. ``on_event`` receives short progress lines ("attached ...")."""
    from moetrace.kernel.bpf import EventStream, array_values, load_probe

    say = on_event or (lambda s: None)
    if not opts.command:
        raise UsageError("no command to record", hint="moetrace record -- replay plan.bin --pool DIR")
    if opts.missing_probes not in ("error", "warn"):
        raise UsageError(f"--missing-probes {opts.missing_probes!r}", hint="error or warn")
    notes: list[str] = []
    attach_plan: dict[str, dict[str, Any]] = {}
    wanted = list(dict.fromkeys(opts.probes))
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
            raise UsageError(f"--knob {p}.*: probe {p} is not recorded", hint=f"add it to --probes ({', '.join(wanted)})")
        if p not in EXTRA_RECORDED:
            raise UsageError(f"--knob {p}.*: the {p} probe's knobs are derived from the pool and the kernel",
                             hint=f"--knob applies to {', '.join(EXTRA_RECORDED)}")
    feats = _features()
    check_can_record(feats)
    notes.extend(feats.notes)
    # one resolution per probe, the same doctor shows; its to_dict() is the manifest's attach plan
    plans: dict[str, AttachPlan] = {p: resolve(PROBES[p], feats) for p in wanted}
    for p, plan in plans.items():
        attach_plan[p] = dict(plan.to_dict(), recorded=False, skip_reason=None)
        if p not in RECORDED:
            attach_plan[p]["skip_reason"] = "not recorded by this version of moetrace"
            notes.append(f"probe {p} skipped: not recorded by this version of moetrace")
        elif plan.status == "no":
            attach_plan[p]["skip_reason"] = plan.reason
            if opts.missing_probes == "error" and not PROBES[p].enrichment:
                raise MoetraceError(f"probe {p} cannot attach: {plan.reason}",
                                    hint="moetrace doctor lists what this kernel offers")
            notes.append(f"probe {p} skipped: {plan.reason}")
        elif plan.status == "degraded":
            notes.append(f"probe {p} degraded: {plan.reason}")

    pool_dir = opts.pool or pool_from_command(opts.command)
    pmap = None
    pool_doc = None
    if pool_dir is not None:
        from moetrace.inputs.pool import open_pool

        pool = open_pool(pool_dir)
        pmap = pool_map(pool)
        g = pool.geometry
        pool_doc = {"root": str(Path(pool.root).resolve()), "identity": pool.manifest.get("checksum"),
                    "layout": pool.layout, "geometry": g.to_dict(), "extent_bytes": pool.extent_bytes,
                    "pages_per_expert": pmap.pages_per_expert, "files": len(pool.files),
                    "s_dev": pmap.pool_dev, "s_dev_text": f"{pmap.pool_dev >> 20}:{pmap.pool_dev & ((1 << 20) - 1)}",
                    "source": "--pool" if opts.pool else "the command's --pool"}
    else:
        notes.append("no pool named (--pool, or --pool in the command): every page-cache page is unattributed")

    cgroup_procs = None
    if opts.cgroup is not None:
        cg = Path(opts.cgroup)
        if not (cg / "cgroup.procs").is_file():
            raise UsageError(f"--cgroup {opts.cgroup}: not a cgroup directory (no cgroup.procs)",
                             hint="make one first, e.g. mkdir /sys/fs/cgroup/memory/moetrace-x and set "
                                  "memory.limit_in_bytes")
        cgroup_procs = str(cg.resolve() / "cgroup.procs")

    run_dir = rd.create_run_dir(opts.out or rd.default_run_dir())
    replay_dir = run_dir / rd.REPLAY_SUBDIR
    os.mkdir(replay_dir, rd.DIR_MODE)
    os.chmod(replay_dir, rd.DIR_MODE)
    log_dir = replay_dir  # where the command's replay log lands (its own --run-dir wins over the env)
    named = option_from_command(opts.command, "--run-dir")
    if named is not None:
        log_dir = Path(named)
        notes.append(f"the command writes its replay log to its --run-dir {named}, not {replay_dir}")
    manifest: dict[str, Any] = {
        "command": list(opts.command),
        "record_command": [os.path.basename(sys.argv[0]), *sys.argv[1:]],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "complete": False,
        "exit_status": None,
        "interrupted_by": None,
        "plan": None,
        "pool": pool_doc,
        "replay_dir": str(log_dir.resolve()),
        "cgroup": str(Path(opts.cgroup).resolve()) if opts.cgroup else None,
        "kernel": {"release": feats.osrelease, "headers": feats.headers, "headers_detail": feats.headers_detail,
                   "btf": feats.btf},
        "mglru": feats.mglru,
        "privileges": feats.privileges,
        "probes": wanted,
        "attach_plan": attach_plan,
        "clock": {"probes": "bpf_ktime_get_ns (CLOCK_MONOTONIC)", "replay": "CLOCK_MONOTONIC",
                  "recorder": "time.monotonic_ns (CLOCK_MONOTONIC)"},
        "lost": {},
        "stats": {},
        "timings": {},
        "requested": None,
        "tables": {},
        "notes": notes,
    }
    rd.write_manifest(run_dir, manifest)

    probe = None
    stream = None
    blk = None  # moetrace.record.probes.block.BlockRecorder
    rcl = None  # moetrace.record.probes.reclaim.ReclaimRecorder
    extras: list = []  # moetrace.record.probe.ProbeRecorder of the further probes
    phase_fd: int | None = None  # a dup of the epoch_now map fd, inherited by the command
    stats_fd: int | None = None  # BPF_ENABLE_STATS: run-time statistics on while it is open
    disk = None  # the pool's disk as /proc/diskstats names it
    state = _State()
    old: dict[int, Any] = {}
    result_df = None
    exit_status = 1
    try:
        if opts.bpf_stats:
            from moetrace.kernel.bpf import enable_stats

            try:
                stats_fd = enable_stats()
            except OSError as e:
                notes.append(f"--bpf-stats: run-time statistics unavailable ({e.strerror or e})")
        t_attach0 = time.perf_counter()
        from moetrace.kernel.procfs import read_diskstats

        pool_disk: dict[str, Any] | None = None  # /proc/diskstats of the pool's disk around the block probe
        if "pagecache" in plans and plans["pagecache"].status != "no":
            plan = plans["pagecache"]
            over: dict[str, int] = dict(plan.knobs)
            if pmap is not None:
                from moetrace.run.epochs import epochs_for

                over.update(POOL_DEV=pmap.pool_dev, N_EXPERTS=pmap.n_total, PPE=pmap.pages_per_expert,
                            WPE=pmap.words_per_expert, EPOCHS=epochs_for(pmap.n_total + 1))
            over["STREAM_EVENTS"] = int(opts.stream_events)
            if "reads" in plans and plans["reads"].status != "no" and "reads" in EXTRA_RECORDED:
                over["TRACK_READS"] = 0  # the reads probe counts every read call: not twice
            knobs = {k: int(v) for k, v in PAGECACHE.knob_values(**over).items()}
            if not knobs["HAVE_ORDER"]:
                notes.append("add/delete tracepoints carry no folio order: every event counts one page")
            say("compiling and attaching pagecache ...")
            probe = load_probe("pagecache", knobs)
            off = {g.name for g in PAGECACHE.attach if g.knob is not None and not knobs.get(g.knob, 1)}
            planned = sorted(e.candidate.target for e in plan.attached if e.group not in off)
            if sorted(probe.tracepoints) != planned:
                probe.close()
                raise MoetraceError(f"probe pagecache attached {sorted(probe.tracepoints)}, its attach plan "
                                    f"says {planned}",
                                    hint="probes/pagecache.c and its declaration in moetrace/record/spec.py "
                                         "disagree (tests/test_probe_build.py checks them)")
            attach_plan["pagecache"]["recorded"] = True
            if off:
                attach_plan["pagecache"]["compiled_out"] = {
                    g: "TRACK_READS=0: the reads probe times every read call" for g in sorted(off)}
            manifest["timings"]["pagecache_compile_attach_s"] = round(probe.compile_attach_s, 4)
            manifest["knobs"] = {"pagecache": knobs}
            if pmap is not None:
                t = probe.table("inodes")
                for ino, (base, n) in pmap.inodes.items():
                    t[t.Key(ino)] = t.Leaf(base, n)
            if opts.stream_events:
                stats_t = probe.table("stats")
                stream = EventStream(probe, "events", PAGE_EVENT_DTYPE.itemsize, "ring",
                                     kernel_lost=lambda: stats_t[ctypes.c_int(RING_DROPS_SLOT)].value,
                                     max_records=opts.stream_max_records)
            manifest["bpf_prog_ids"] = sorted(i["id"] for i in (bpf_prog_info(f.fd) for f in probe.bpf.funcs.values())
                                              if i is not None)
            if knobs.get("EPOCHS"):
                # the replay writes the epoch itself (moetrace.run.epochs.EpochWriter): an inherited
                # fd of the one-entry epoch_now map, not a round trip per iteration
                phase_fd = os.dup(probe.table("epoch_now").map_fd)
                os.set_inheritable(phase_fd, True)
            say(f"attached {len(probe.tracepoints)} tracepoints in {probe.compile_attach_s:.2f} s")

        def skip(p: str, why: str) -> None:
            """A probe that could not be loaded: an error under --missing-probes error."""
            if opts.missing_probes == "error":
                raise MoetraceError(f"probe {p} cannot be recorded: {why}",
                                    hint="--missing-probes warn records without it; `moetrace doctor` explains")
            attach_plan[p]["skip_reason"] = why
            notes.append(f"probe {p} skipped: {why}")

        for name in wanted:  # the further probes (moetrace.record.probe), before block
            if name not in EXTRA_RECORDED or plans[name].status == "no":
                continue
            ctx = RecordContext(features=feats, plan=plans[name], pmap=pmap, run_dir=run_dir, log_dir=log_dir,
                                stream=opts.stream_events, t0_ns=time.monotonic_ns(), notes=notes, say=say,
                                stream_max_records=opts.stream_max_records, knobs=dict(opts.knobs.get(name, {})))
            say(f"compiling and attaching {name} ...")
            rec = recorder_class(name)(ctx)
            try:
                rec.open()
            except MoetraceError as e:
                rec.abort()
                skip(name, e.message)
                continue
            extras.append(rec)
            attach_plan[name]["recorded"] = True
            if rec.compile_attach_s is not None:
                manifest["timings"][f"{name}_compile_attach_s"] = round(rec.compile_attach_s, 4)
            manifest.setdefault("knobs", {})[name] = dict(rec.knobs)
            say(f"attached {name}" + (f" in {rec.compile_attach_s:.2f} s" if rec.compile_attach_s else ""))
        # block last: the pool disk's /proc/diskstats is read right after it attaches and right
        # before it detaches, so the two windows match (clang reading headers is outside both)
        if "reclaim" in plans and plans["reclaim"].status != "no":
            from moetrace.record.probes.reclaim import ReclaimRecorder

            say("compiling and attaching reclaim ...")
            rcl = ReclaimRecorder(features=feats, plan=plans["reclaim"]).open()
            attach_plan["reclaim"]["recorded"] = True
            manifest["timings"]["reclaim_compile_attach_s"] = round(rcl.compile_s + rcl.attach_s, 4)
            manifest.setdefault("knobs", {})["reclaim"] = dict(rcl.knobs)
            say(f"attached reclaim ({len(rcl.attach)} tracepoints) in {rcl.compile_s + rcl.attach_s:.2f} s")
        if "block" in plans and plans["block"].status != "no":
            from moetrace.record.probes.block import BlockRecorder
            from moetrace.errors import InputError
            from moetrace.kernel.extents import pool_extents

            idx = None
            try:
                if pmap is not None:
                    idx = pool_extents(pmap.pool)
                    disk = idx.device.disk
                    if idx.problems:
                        notes.append(f"block: {len(idx.problems)} experts have extents whose device bytes are "
                                     f"unknowable (first: {next(iter(idx.problems.items()))})")
                else:
                    notes.append("block: no pool, device reads of every disk are counted, none attributed")
                say("compiling and attaching block ...")
                blk = BlockRecorder(idx, dev=None if idx is not None else 0, stream=idx is not None,
                                    features=feats, plan=plans["block"]).open()
                if disk is not None:
                    pool_disk = {"disk": disk, "pre": read_diskstats(device=disk)}
            except InputError as e:
                skip("block", f"the pool's extents cannot be mapped to a disk: {e.message}")
            else:
                attach_plan["block"]["recorded"] = True
                manifest["timings"]["block_compile_attach_s"] = round(blk.compile_s + blk.attach_s, 4)
                manifest.setdefault("knobs", {})["block"] = dict(blk.knobs)
                if idx is not None:
                    manifest["block_device"] = {"disk": disk, "tp_dev": idx.device.tp_dev,
                                                "tp_dev_text": f"{idx.device.disk_major}:{idx.device.disk_minor}",
                                                "partition": idx.device.fs_name if idx.device.partitioned else None,
                                                "part_start_sector": idx.device.part_start, "extents": len(idx)}
                say(f"attached block ({blk.attach['bytes']}) in {blk.compile_s + blk.attach_s:.2f} s")
        ids = list(manifest.get("bpf_prog_ids") or [])
        for r in (blk, rcl):
            if r is not None:
                ids += [i["id"] for i in (bpf_prog_info(f.fd) for f in r.bpf.funcs.values()) if i is not None]
        for r in extras:
            ids += r.prog_ids()
        manifest["bpf_prog_ids"] = sorted(ids)
        manifest["timings"]["probes_attach_s"] = round(time.perf_counter() - t_attach0, 4)
        rd.write_manifest(run_dir, manifest)
        from moetrace.kernel.procfs import take_snapshot

        snaps = {"pre": take_snapshot("pre")}
        if pool_disk is not None:
            snaps["pool_disk"] = pool_disk

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
            old[s] = signal.signal(s, on_signal)
        env = dict(os.environ)
        env["MOETRACE_RUN_DIR"] = str(replay_dir.resolve())
        if phase_fd is not None:
            from moetrace.run.epochs import EPOCH_MAP_FD_ENV, EPOCHS_ENV

            env[EPOCH_MAP_FD_ENV] = str(phase_fd)
            env[EPOCHS_ENV] = str(knobs["EPOCHS"])
        t_start = time.monotonic_ns()
        import resource

        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        pid, gate = _spawn(list(opts.command), env, cgroup_procs)
        if phase_fd is not None:
            os.close(phase_fd)
            phase_fd = None
        state.child = pid
        if probe is not None:
            tg = probe.table("tgids")
            tg[tg.Key(pid)] = tg.Leaf(1)
        for r in extras:
            r.follow(pid)
        os.write(gate, b"g")
        os.close(gate)
        manifest["child_pid"] = pid
        status = None
        pollers = [r for r in extras if r.needs_poll]
        # one round of the loop waits POLL_ROUND_MS in all, shared by the pollers (each returns
        # early on its own events); per-page streams are drained more often than counters
        round_ms = POLL_ROUND_STREAM_MS if opts.stream_events else POLL_ROUND_MS
        share = round_ms // max(1, len(pollers) + (stream is not None))
        while status is None:
            if stream is not None or pollers:
                if stream is not None:
                    stream.poll(share)
                for r in pollers:
                    r.poll(share)
                p, st = os.waitpid(pid, os.WNOHANG)
            else:
                p, st = os.waitpid(pid, 0)
            if p == pid:
                status = st
        t_end = time.monotonic_ns()
        exit_status = _exit_status(status)
        manifest["exit_status"] = exit_status
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        manifest["timings"].update(command_start_ns=t_start, command_end_ns=t_end,
                                   command_wall_s=round((t_end - t_start) / 1e9, 6),
                                   # the recorder's own CPU while the command ran (polling rings, samplers)
                                   recorder_user_s=round(ru1.ru_utime - ru0.ru_utime, 4),
                                   recorder_system_s=round(ru1.ru_stime - ru0.ru_stime, 4))
        # -- collect, then detach
        if pool_disk is not None:
            pool_disk["post"] = read_diskstats(device=disk)
        manifest["bpf_runtime"] = _runtime(probe, blk, rcl, extras, stats_fd is not None, t_end - t_start)
        for r in extras:
            try:
                r.close()
            except MoetraceError as e:
                notes.append(f"probe {r.name}: collecting failed: {e.message}")
                r.abort()
        bres = rres = None
        if blk is not None:
            bres = blk.close()
        if rcl is not None:
            rres = rcl.close()
        if bres is not None or rres is not None:
            _write_block_reclaim(run_dir, manifest, bres, rres, snaps.get("pool_disk"), disk)
        counts = None
        if probe is not None:
            if stream is not None:
                stream.finish()
            from moetrace.run.epochs import read_array

            ec_dtype = PAGECACHE.struct("expert_counts").dtype()
            cv = read_array(probe.table("counts"), ec_dtype)
            counts = list(zip(cv["added_pages"].tolist(), cv["evicted_pages"].tolist(),
                              cv["re_added_pages"].tolist()))
            epoch_df = epochs_meta = None
            if knobs.get("EPOCHS"):
                from moetrace.run.epochs import epochs_from_replay

                rdoc = None
                try:
                    rdoc = json.loads((log_dir / "replay.json").read_text())
                except (OSError, json.JSONDecodeError):
                    pass
                eps = epochs_from_replay(rdoc, t_start, t_end)
                if eps:
                    arr = read_array(probe.table("epoch_counts"), ec_dtype)
                    epoch_df, epochs_meta = epoch_tables(arr, eps, pmap)
                ep_doc = (rdoc or {}).get("epochs") or {}
                manifest["epochs"] = {"mode": ep_doc.get("mode"), "slots": knobs["EPOCHS"],
                                      "epochs": len(eps) if eps else 0,
                                      "errors": [ep_doc["error"]] if ep_doc.get("error") else [],
                                      "source": "the replay's epoch writes (replay.json epochs.assigned)" if eps
                                      else "no replay wrote epochs: totals only",
                                      "by_phase": epoch_phase_totals(epoch_df, epochs_meta)}
            svals = [int(v.value) for v in array_values(probe.table("stats"))]
            stats = dict(zip(PAGECACHE.stats, svals))
            from moetrace.kernel.bpf import recursion_misses

            misses = recursion_misses(probe.bpf)
            manifest["stats"]["pagecache"] = stats
            manifest["lost"]["pagecache"] = {
                "counters_recursion_misses": misses,
                "counters_lost_events": sum(v for v in misses.values() if v) if misses else None,
                "unprocessed_pages": stats["unprocessed_pages"],
                "stream": None if stream is None else {
                    "records": stream.kept, "lost_kernel": stream.lost_kernel, "lost_user": stream.lost_user,
                    "intervals": len(stream.intervals)},
            }
            if stats.get("dev_mismatch_events"):
                notes.append(f"{stats['dev_mismatch_events']} events hit pool inodes on another device than "
                             f"s_dev {pool_doc and pool_doc['s_dev_text']}: check the pool's filesystem")
            events_raw = stream.records() if stream is not None else None
            intervals = stream.intervals if stream is not None else None
            probe.close()
            manifest["detached"] = True
            snaps["post"] = take_snapshot("post")
            req_b = req_p = None
            if pmap is not None:
                req_b, req_p, how = requested_from_replay(log_dir, pmap.pool)
            else:
                how = "no pool: nothing to attribute requests to"
            manifest["requested"] = {"source": how, "available": req_p is not None}
            result_df = experts_table(pmap, counts, req_b, req_p, bres)
            rd.write_table(run_dir, PAGECACHE.table, result_df)
            manifest["tables"][PAGECACHE.table] = {c.name: {"dtype": c.dtype, "unit": c.unit, "doc": c.doc}
                                                   for c in PAGECACHE.schema + BLOCK.schema}
            e = result_df[result_df["kind"] == "expert"]
            u = result_df[result_df["kind"] == "unattributed"].iloc[0]
            manifest["totals"] = {
                "experts_added_pages": int(e["added_pages"].sum()),
                "experts_evicted_pages": int(e["evicted_pages"].sum()),
                "experts_re_added_pages": int(e["re_added_pages"].sum()),
                "experts_requested_pages": int(e["requested_pages"].sum()) if req_p is not None else None,
                "experts_requested_bytes": int(e["requested_bytes"].sum()) if req_b is not None else None,
                "experts_hit_pages": int(e["hit_pages"].sum()) if req_p is not None else None,
                "unattributed_added_pages": int(u["added_pages"]),
                "unattributed_evicted_pages": int(u["evicted_pages"]),
                "syscall_read_bytes_tracked_all_files": stats["read_bytes"] if knobs.get("TRACK_READS") else None,
            }
            if epoch_df is not None:
                for tname, tdf in (("expert_epochs", epoch_df), ("epochs", epochs_meta)):
                    rd.write_table(run_dir, tname, tdf)
                    manifest["tables"][tname] = {c.name: {"dtype": c.dtype, "unit": c.unit, "doc": c.doc}
                                                 for c in PAGECACHE.tables()[tname]}
            if events_raw is not None:
                ev = pd.DataFrame(np.frombuffer(events_raw, PAGE_EVENT_DTYPE))
                ev["kind"] = ev["kind"].map({0: "add", 1: "delete"}).astype("string")
                ev = ev.rename(columns={"first_page": "first_page_index", "pages": "pages",
                                        "re_added": "re_added_pages"})
                rd.write_table(run_dir, "page_events", ev)
                rd.write_table(run_dir, "stream_intervals", pd.DataFrame(
                    [vars(i) for i in intervals]).rename(columns={"records": "records", "lost_kernel": "lost_kernel_records",
                                                                  "lost_user": "lost_user_records"}))
        else:
            snaps["post"] = take_snapshot("post")
            if bres is not None:  # block without pagecache: the experts table still carries the device bytes
                result_df = experts_table(pmap, None, None, None, bres)
                rd.write_table(run_dir, BLOCK.table, result_df)
                manifest["tables"][BLOCK.table] = {c.name: {"dtype": c.dtype, "unit": c.unit, "doc": c.doc}
                                                   for c in PAGECACHE.schema + BLOCK.schema}
        if bres is not None and result_df is not None:
            e = result_df[result_df["kind"] == "expert"]
            manifest.setdefault("totals", {}).update(
                experts_device_read_bytes=int(e["device_read_bytes"].sum()),
                unattributed_device_read_bytes=int(
                    result_df.loc[result_df["kind"] == "unattributed", "device_read_bytes"].iloc[0]))
        for r in extras:
            if r.collected:
                r.write(run_dir, manifest)
        _write_snapshots(run_dir, snaps)
        rsum = log_dir / "replay.json"
        if rsum.exists():
            try:
                rs = json.loads(rsum.read_text())
                manifest["plan"] = rs.get("plan")
                manifest["replay_complete"] = rs.get("complete")
            except (OSError, json.JSONDecodeError):
                notes.append("replay.json unreadable")
        interrupted = bool(state.signals) or (manifest.get("replay_complete") is False)
        if state.signals:
            manifest["interrupted_by"] = signal.Signals(state.signals[0]).name
        manifest["complete"] = not interrupted
        return RecordResult(run_dir, exit_status, manifest["complete"], manifest, result_df)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if phase_fd is not None:
            os.close(phase_fd)
        if stats_fd is not None:
            os.close(stats_fd)  # run-time statistics off again
        for r in extras:
            r.abort()
        for r in (blk, rcl):  # idempotent; detaches on errors and signals too
            if r is not None and r.bpf is not None:
                try:
                    r.close()
                except MoetraceError as e:
                    notes.append(f"closing a probe: {e.message}")
        if probe is not None and not probe.closed:
            probe.close()
            manifest["detached"] = True
        if state.signals and manifest.get("interrupted_by") is None:
            manifest["interrupted_by"] = signal.Signals(state.signals[0]).name
        rd.write_manifest(run_dir, manifest)


def _runtime(probe, blk, rcl, extras, enabled: bool, wall_ns: int) -> dict[str, Any]:
    """Per probe: its BPF programs' run counts and run time over the recording (the kernel
    counts run time only while statistics are on: ``record --bpf-stats``)."""
    from moetrace.kernel.bpf import prog_runtime

    progs: dict[str, Any] = {}
    if probe is not None and not probe.closed:
        progs["pagecache"] = prog_runtime(probe.bpf)
    for name, r in (("block", blk), ("reclaim", rcl)):
        if r is not None and r.bpf is not None:
            progs[name] = prog_runtime(r.bpf)
    for r in extras:
        if r.probe is not None and not r.probe.closed:
            progs[r.name] = prog_runtime(r.probe.bpf)
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
    rd._atomic(run_dir / "snapshots.json", lambda t: Path(t).write_text(text))


def _write_block_reclaim(run_dir: Path, manifest: dict[str, Any], bres, rres, pool_disk: dict | None,
                         disk: str | None) -> None:
    """block_latency / block_device / reclaim / reclaim_histogram (/ reclaim_timeline) tables,
    the probes' summaries and lost counts into the manifest."""
    def schema(spec, table):
        manifest["tables"][table] = {c.name: {"dtype": c.dtype, "unit": c.unit, "doc": c.doc}
                                     for c in spec.tables()[table]}

    if bres is not None:
        disk_delta = None
        if pool_disk is not None and "post" in pool_disk:
            disk_delta = (pool_disk["post"]["sectors_read"] - pool_disk["pre"]["sectors_read"]) * 512
        name = disk if disk is not None else ("all" if bres.dev == 0 else None)
        lat = bres.latency.copy()
        lat.insert(0, "disk", pd.array([name] * len(lat), dtype="string"))
        lat.insert(0, "dev", np.full(len(lat), bres.dev, dtype=np.int64))
        lat["slot"] = lat["slot"].astype("int32")
        rd.write_table(run_dir, "block_latency", lat[[c.name for c in BLOCK.tables()["block_latency"]]])
        schema(BLOCK, "block_latency")
        st = bres.stats
        dev_row = pd.DataFrame({
            "dev": [bres.dev], "disk": pd.array([name], dtype="string"), "read_bytes": [st["read_bytes"]],
            "bios": [st["read_bios"]], "issues": [st["issues"]], "issue_bytes": [st["issue_bytes"]],
            "requeues": [st["requeues"]], "requeue_bytes": [st["requeue_bytes"]], "completes": [st["completes"]],
            "complete_matched": [st["complete_matched"]], "latency_ns_sum": [st["latency_ns"]],
            "diskstats_read_bytes": pd.array([disk_delta], dtype="Int64")})
        rd.write_table(run_dir, "block_device", dev_row)
        schema(BLOCK, "block_device")
        summ = bres.summary()
        summ["diskstats_read_bytes"] = disk_delta
        summ["device_vs_diskstats_rel"] = (None if not disk_delta else
                                           (summ["attributed_bytes"] + summ["unattributed_bytes"] - disk_delta)
                                           / disk_delta)
        manifest.setdefault("summaries", {})["block"] = summ
        manifest["stats"]["block"] = dict(st)
        manifest["lost"]["block"] = {"ring_lost_bios": bres.lost_events, "recursion_misses": bres.recursion_misses,
                                     "inflight_left": bres.inflight_left, "inflight_full": st["inflight_full"],
                                     "note": "bytes are counted at the bytes tracepoint; recursion misses of "
                                             "rq_complete (IRQ context) only lose latency samples"}
    if rres is not None:
        rd.write_table(run_dir, RECLAIM.table, rres.per_kind)
        schema(RECLAIM, RECLAIM.table)
        rd.write_table(run_dir, "reclaim_histogram", rres.histogram)
        schema(RECLAIM, "reclaim_histogram")
        if rres.bucket_ns > 0:
            rd.write_table(run_dir, "reclaim_timeline", rres.timeline)
            schema(RECLAIM, "reclaim_timeline")
        manifest.setdefault("summaries", {})["reclaim"] = rres.summary()
        manifest["stats"]["reclaim"] = dict(rres.stats)
        manifest["lost"]["reclaim"] = {"lost_events": 0, "recursion_misses": rres.recursion_misses,
                                       "open_windows": rres.open_windows,
                                       "note": "aggregated in the kernel: no stream to lose"}
