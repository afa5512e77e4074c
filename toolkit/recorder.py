"""`moetrace record`: attach probes, run a command under them, write a run directory.

Order of a recording (:func:`record`):

1. refuse without privileges (root, or CAP_BPF + CAP_PERFMON), find tracefs
   (mounting it when absent, and saying so), check the kernel headers;
2. create the run directory (0700) and write a manifest marked incomplete;
3. resolve each probe's attach plan by asking the kernel (tracepoint format
   files), derive its ``-D`` knobs, compile + load + attach it (timed);
4. load the pool's inode -> expert map into the probe;
5. fork the command, which waits on a pipe until its pid is in the probe's
   tracked-tgid map, then execs with ``MOETRACE_RUN_DIR=<run>/replay`` (so no
   event of the command is missed);
6. wait, forwarding SIGINT/SIGTERM to the child (a second signal escalates to
   SIGTERM, a third to SIGKILL);
7. read the counters, detach, write the tables and the final manifest
   (``complete`` true only when nothing was interrupted), return the child's
   exit status.

Probe declarations (one per probe C file; the C side reads only tracepoint
arguments, so they are layout-safe with mismatched headers) live here:
:data:`PAGECACHE`.
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

from . import rundir as rd
from .errors import MoetraceError, UsageError

log = logging.getLogger("moetrace.record")

PAGE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------
# probe declarations


@dataclass(frozen=True)
class TracepointCandidate:
    """One attach point of a probe. ``knob``: the -D knob that compiles it in
    (None: required, the probe cannot run without it); ``fields``: the format
    fields the C code reads; ``optional_fields``: fields whose presence sets a
    knob to 1 (else 0)."""

    category: str
    event: str
    knob: str | None = None
    fields: tuple[str, ...] = ()
    optional_fields: tuple[tuple[str, str], ...] = ()  # (field, knob)
    why: str = ""

    @property
    def name(self) -> str:
        return f"{self.category}:{self.event}"


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str
    unit: str
    doc: str


@dataclass(frozen=True)
class ProbeDecl:
    """A probe: its C source, attach candidates, knobs (defaults) and output schema."""

    name: str
    source: str
    attach: tuple[TracepointCandidate, ...]
    knobs: dict[str, int]
    table: str
    columns: tuple[Column, ...]
    stats: tuple[str, ...]
    needs: str = "tracepoint arguments only"


_FOLIO = (("order", "HAVE_ORDER"),)

PAGECACHE = ProbeDecl(
    name="pagecache",
    source="pagecache.c",
    attach=(
        TracepointCandidate("filemap", "mm_filemap_add_to_page_cache", None, ("i_ino", "index", "s_dev"), _FOLIO,
                            "a page (folio) added to the page cache: a miss"),
        TracepointCandidate("filemap", "mm_filemap_delete_from_page_cache", None, ("i_ino", "index", "s_dev"),
                            _FOLIO, "a page (folio) deleted from the page cache: an eviction"),
        TracepointCandidate("syscalls", "sys_exit_pread64", "TRACK_READS", ("ret",), (), "read bytes (cross-check)"),
        TracepointCandidate("syscalls", "sys_exit_preadv", "TRACK_READS", ("ret",), (), "read bytes (cross-check)"),
        TracepointCandidate("syscalls", "sys_exit_preadv2", "TRACK_READS", ("ret",), (), "read bytes (cross-check)"),
        TracepointCandidate("syscalls", "sys_exit_read", "TRACK_READS", ("ret",), (), "read bytes (cross-check)"),
        TracepointCandidate("task", "task_newtask", "FOLLOW_FORKS", ("pid", "clone_flags"), (),
                            "follow the command's child processes"),
    ),
    knobs={"POOL_DEV": 0, "N_EXPERTS": 0, "PPE": 1, "WPE": 1, "HAVE_ORDER": 1, "MAX_FOLIO_PAGES": 512,
           "TRACK_READS": 1, "FOLLOW_FORKS": 1, "STREAM_EVENTS": 0, "RING_PAGES": 256},
    table="experts",
    columns=(
        Column("kind", "string", "", "'expert' or 'unattributed' (pool-filesystem pages of no expert)"),
        Column("layer", "Int32", "", "layer of the expert (NA for unattributed)"),
        Column("expert", "Int32", "", "expert index within the layer"),
        Column("expert_id", "Int64", "", "layer * n_experts + expert"),
        Column("added_pages", "Int64", "pages", "pages added to the page cache (misses, readahead included)"),
        Column("evicted_pages", "Int64", "pages", "pages deleted from the page cache"),
        Column("re_added_pages", "Int64", "pages", "pages added again after their eviction (exact, per page)"),
        Column("requested_bytes", "Int64", "bytes", "bytes the replay read (its plan accounting; NA without a replay log)"),
        Column("requested_pages", "Int64", "pages", "pages the replay's reads cover (NA without a replay log)"),
        Column("hit_pages", "Int64", "pages", "requested_pages - added_pages (negative: readahead charged here)"),
    ),
    stats=("add_events", "delete_events", "pool_dev_add_events", "pool_dev_delete_events", "unprocessed_pages",
           "read_bytes", "read_calls", "tgid_map_full", "ring_drops", "bitmap_misses", "dev_mismatch_events"),
)

PROBES: dict[str, ProbeDecl] = {"pagecache": PAGECACHE}
#: Probes of the issue not in this version yet: listed, never silently ignored.
PLANNED = ("lru", "reclaim", "mlock", "block", "reads", "stacks", "mglru")

#: struct page_event in probes/pagecache.c
PAGE_EVENT_DTYPE = np.dtype([("ts_ns", "<u8"), ("expert_id", "<u4"), ("kind", "<u4"), ("first_page", "<u4"),
                             ("pages", "<u4"), ("re_added", "<u4"), ("tgid", "<u4")])


def resolve_attach(decl: ProbeDecl, features) -> tuple[list[dict[str, Any]], dict[str, int], str | None]:
    """(attach plan rows, knobs derived from it, reason the probe cannot run or None).

    Each row: {"probe", "attach": "category:event", "status": "attached" |
    "unavailable", "reason", "knob"}. An optional candidate that is absent turns
    its knob to 0 (every candidate sharing that knob is then skipped, and said)."""
    rows: list[dict[str, Any]] = []
    knobs: dict[str, int] = {}
    fatal = None
    off: set[str] = set()
    fmt_cache: dict[str, dict | None] = {}
    for c in decl.attach:
        reason = features.tracepoint_reason(c.category, c.event)
        fmt = features.tracepoint_format(c.category, c.event) if reason is None else None
        fmt_cache[c.name] = fmt
        if reason is None and fmt is not None:
            missing = [f for f in c.fields if f not in fmt]
            if missing:
                reason = f"format of {c.name} lacks {', '.join(missing)}"
        if reason is None:
            for fld, knob in c.optional_fields:
                have = int(fmt is not None and fld in fmt)
                knobs[knob] = min(knobs.get(knob, 1), have)
        if reason is not None:
            if c.knob is None:
                fatal = fatal or f"{c.name}: {reason}"
            else:
                off.add(c.knob)
        rows.append({"probe": decl.name, "attach": c.name, "status": "attached" if reason is None else "unavailable",
                     "reason": reason, "knob": c.knob, "why": c.why})
    for k in off:
        knobs[k] = 0
    for r in rows:  # candidates compiled out because a sibling of their knob is absent
        if r["status"] == "attached" and r["knob"] in off:
            r["status"] = "unavailable"
            r["reason"] = f"compiled out ({r['knob']}=0: another attach point of that knob is absent)"
    if fatal:
        for r in rows:
            if r["status"] == "attached":
                r["status"] = "unavailable"
                r["reason"] = f"probe skipped ({fatal})"
    return rows, knobs, fatal


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


def pool_from_command(cmd: list[str]) -> str | None:
    """The value of ``--pool`` (or ``--pool=DIR``) in a command line, if any."""
    for i, a in enumerate(cmd):
        if a == "--pool" and i + 1 < len(cmd):
            return cmd[i + 1]
        if a.startswith("--pool="):
            return a.split("=", 1)[1]
    return None


# ---------------------------------------------------------------------------
# BPF program info (UAPI struct bpf_prog_info: append-only, layout-stable)

_SYS_BPF = {"x86_64": 321, "aarch64": 280}
_BPF_OBJ_GET_INFO_BY_FD = 15
_INFO_RECURSION_MISSES = 208  # offsetof(struct bpf_prog_info, recursion_misses), since 5.12
_INFO_LEN = 256


class _InfoAttr(ctypes.Structure):
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32), ("info", ctypes.c_uint64)]


def prog_info(fd: int) -> dict[str, int] | None:
    """{"id", "recursion_misses"} of a loaded BPF program (kernel-counted events it
    missed to recursion protection: the counters' only loss), or None."""
    nr = _SYS_BPF.get(os.uname().machine)
    if nr is None:
        return None
    buf = ctypes.create_string_buffer(_INFO_LEN)
    attr = _InfoAttr(fd, _INFO_LEN, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(nr), ctypes.c_int(_BPF_OBJ_GET_INFO_BY_FD), ctypes.byref(attr),
                    ctypes.c_uint(ctypes.sizeof(attr))) != 0:
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
    nr = _SYS_BPF[os.uname().machine]
    attr = _IdAttr(prog_id, 0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(ctypes.c_long(nr), ctypes.c_int(_BPF_PROG_GET_FD_BY_ID), ctypes.byref(attr),
                      ctypes.c_uint(ctypes.sizeof(attr)))
    if fd >= 0:
        os.close(fd)
        return True
    return False


# ---------------------------------------------------------------------------
# requested pages from the replay's own accounting


def requested_from_replay(replay_dir: Path, pool) -> tuple[np.ndarray | None, np.ndarray | None, str]:
    """(requested bytes, requested pages) per expert_id from the replay's log, and how.

    Requested bytes per expert cannot be taken from the read syscalls without
    fd -> inode (kernel structs, unsafe with mismatched headers), so they come
    from the replay's plan accounting: every logged iteration row (warm-up and
    measured) contributes the plan's reads of that iteration x expert bytes.
    None (with the reason) when there is no usable log."""
    from .replay import ITERATIONS_FILE, SUMMARY_FILE, load_flat_plan

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


def experts_table(pmap: PoolMap | None, counts: list[tuple[int, int, int]],
                  req_bytes: np.ndarray | None, req_pages: np.ndarray | None) -> pd.DataFrame:
    """experts.parquet: one row per expert (in expert_id order) + the unattributed row."""
    n = pmap.n_total if pmap is not None else 0
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
    df["hit_pages"] = df["requested_pages"] - df["added_pages"]
    return df[[col.name for col in PAGECACHE.columns]]


# ---------------------------------------------------------------------------
# the recording


@dataclass
class RecordOptions:
    command: list[str]
    out: str | None = None
    probes: tuple[str, ...] = ("pagecache",)
    pool: str | None = None
    missing_probes: str = "error"  # error | warn
    stream_events: bool = False
    stream_max_records: int = 5_000_000


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


def _set_pdeathsig(sig: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _spawn(cmd: list[str], env: dict[str, str]) -> tuple[int, int]:
    """Fork a child that waits for one byte on a pipe, then execs ``cmd``.

    Returns (pid, write end of the gate). The child's umask is 077 so what it
    writes into the run directory is owner-only too."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, ever
        try:
            os.close(w)
            os.umask(0o077)
            _set_pdeathsig(signal.SIGTERM)  # the command ends with the recorder, even a SIGKILLed one
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, signal.SIG_DFL)
            if os.read(r, 1) != b"g":
                os._exit(125)
            os.close(r)
            os.execvpe(cmd[0], cmd, env)
        except OSError as e:
            os.write(2, f"moetrace record: cannot run {cmd[0]}: {e.strerror}\n".encode())
            os._exit(127)
        except BaseException:
            os._exit(127)
    os.close(r)
    return pid, w


def _features(mount: bool = False):
    from .features import Features

    return Features("/", mount=mount)


def check_can_record(features) -> None:
    """Refuse without privileges (naming the missing one), tracefs or headers."""
    from .bpf import require_headers, require_privileges, require_tracefs

    require_privileges(features.privileges)
    require_tracefs(features)
    require_headers(features)


def record(opts: RecordOptions, on_event: Callable[[str], None] | None = None) -> RecordResult:
    """Run ``opts.command`` under the probes; write the run directory; return the result.

    The child's exit status is returned (128 + signal when it was killed), never
    raised. ``on_event`` receives short progress lines ("attached ...")."""
    from .bpf import EventStream, array_values, load_probe

    say = on_event or (lambda s: None)
    if not opts.command:
        raise UsageError("no command to record", hint="moetrace record -- replay plan.bin --pool DIR")
    if opts.missing_probes not in ("error", "warn"):
        raise UsageError(f"--missing-probes {opts.missing_probes!r}", hint="error or warn")
    notes: list[str] = []
    attach_plan: list[dict[str, Any]] = []
    wanted = list(dict.fromkeys(opts.probes))
    for p in wanted:
        if p not in PROBES:
            why = ("not implemented in this version of moetrace" if p in PLANNED else "no such probe")
            if opts.missing_probes == "error":
                raise UsageError(f"probe {p}: {why}",
                                 hint=f"available: {', '.join(PROBES)}; or pass --missing-probes warn")
            attach_plan.append({"probe": p, "attach": None, "status": "unavailable", "reason": why})
            notes.append(f"probe {p} skipped: {why}")
    feats = _features()
    check_can_record(feats)
    notes.extend(feats.notes)

    pool_dir = opts.pool or pool_from_command(opts.command)
    pmap = None
    pool_doc = None
    if pool_dir is not None:
        from .pool import open_pool

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

    run_dir = rd.create_run_dir(opts.out or rd.default_run_dir())
    replay_dir = run_dir / rd.REPLAY_SUBDIR
    os.mkdir(replay_dir, rd.DIR_MODE)
    os.chmod(replay_dir, rd.DIR_MODE)
    manifest: dict[str, Any] = {
        "command": list(opts.command),
        "record_command": [os.path.basename(sys.argv[0]), *sys.argv[1:]],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "complete": False,
        "exit_status": None,
        "interrupted_by": None,
        "plan": None,
        "pool": pool_doc,
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
    state = _State()
    old: dict[int, Any] = {}
    result_df = None
    exit_status = 1
    try:
        if "pagecache" in wanted:
            rows, knobs_from_kernel, fatal = resolve_attach(PAGECACHE, feats)
            attach_plan.extend(rows)
            if fatal:
                if opts.missing_probes == "error":
                    raise MoetraceError(f"probe pagecache cannot attach: {fatal}",
                                        hint="moetrace doctor lists what this kernel offers")
                notes.append(f"probe pagecache skipped: {fatal}")
            else:
                knobs = dict(PAGECACHE.knobs)
                knobs.update(knobs_from_kernel)
                if pmap is not None:
                    knobs.update(POOL_DEV=pmap.pool_dev, N_EXPERTS=pmap.n_total, PPE=pmap.pages_per_expert,
                                 WPE=pmap.words_per_expert)
                knobs["STREAM_EVENTS"] = int(opts.stream_events)
                if not knobs.get("HAVE_ORDER", 1):
                    notes.append("add/delete tracepoints carry no folio order: every event counts one page")
                say("compiling and attaching pagecache ...")
                probe = load_probe("pagecache", knobs)
                manifest["timings"]["pagecache_compile_attach_s"] = round(probe.compile_attach_s, 4)
                manifest["knobs"] = {"pagecache": knobs}
                if pmap is not None:
                    t = probe.table("inodes")
                    for ino, (base, n) in pmap.inodes.items():
                        t[t.Key(ino)] = t.Leaf(base, n)
                if opts.stream_events:
                    stats_t = probe.table("stats")
                    stream = EventStream(probe, "events", PAGE_EVENT_DTYPE.itemsize, "ring",
                                         kernel_lost=lambda: stats_t[ctypes.c_int(8)].value,
                                         max_records=opts.stream_max_records)
                manifest["bpf_prog_ids"] = sorted(i["id"] for i in (prog_info(f.fd) for f in probe.bpf.funcs.values())
                                                  if i is not None)
                say(f"attached {len(probe.tracepoints)} tracepoints in {probe.compile_attach_s:.2f} s")
        rd.write_manifest(run_dir, manifest)
        from .snapshot import take_snapshot

        snaps = {"pre": take_snapshot("pre")}

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
        t_start = time.monotonic_ns()
        pid, gate = _spawn(list(opts.command), env)
        state.child = pid
        if probe is not None:
            tg = probe.table("tgids")
            tg[tg.Key(pid)] = tg.Leaf(1)
        os.write(gate, b"g")
        os.close(gate)
        manifest["child_pid"] = pid
        status = None
        while status is None:
            if stream is not None:
                stream.poll(100)
                p, st = os.waitpid(pid, os.WNOHANG)
            else:
                p, st = os.waitpid(pid, 0)
            if p == pid:
                status = st
        t_end = time.monotonic_ns()
        exit_status = _exit_status(status)
        manifest["exit_status"] = exit_status
        manifest["timings"].update(command_start_ns=t_start, command_end_ns=t_end,
                                   command_wall_s=round((t_end - t_start) / 1e9, 6))
        # -- collect, then detach
        counts = None
        if probe is not None:
            if stream is not None:
                stream.finish()
            cvals = array_values(probe.table("counts"))
            counts = [(v.added_pages, v.evicted_pages, v.re_added_pages) for v in cvals]
            svals = [int(v.value) for v in array_values(probe.table("stats"))]
            stats = dict(zip(PAGECACHE.stats, svals))
            misses = {}
            for fname, fn in probe.bpf.funcs.items():
                info = prog_info(fn.fd)
                misses[fname.decode() if isinstance(fname, bytes) else str(fname)] = \
                    info["recursion_misses"] if info else None
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
                req_b, req_p, how = requested_from_replay(replay_dir, pmap.pool)
            else:
                how = "no pool: nothing to attribute requests to"
            manifest["requested"] = {"source": how, "available": req_p is not None}
            result_df = experts_table(pmap, counts, req_b, req_p)
            rd.write_table(run_dir, "experts", result_df)
            manifest["tables"]["experts"] = {c.name: {"dtype": c.dtype, "unit": c.unit, "doc": c.doc}
                                             for c in PAGECACHE.columns}
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
        _write_snapshots(run_dir, snaps)
        rsum = replay_dir / "replay.json"
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
        if probe is not None and not probe.closed:
            probe.close()
            manifest["detached"] = True
        if state.signals and manifest.get("interrupted_by") is None:
            manifest["interrupted_by"] = signal.Signals(state.signals[0]).name
        rd.write_manifest(run_dir, manifest)


def _write_snapshots(run_dir: Path, snaps: dict[str, Any]) -> None:
    from .jsonutil import json_default

    text = json.dumps(snaps, default=json_default) + "\n"
    rd._atomic(run_dir / "snapshots.json", lambda t: Path(t).write_text(text))
