"""Locked memory of the recorded command: probes/mlock.bpf.c and the exact locked-range model.

The probe streams one ring record per mlock-family call of the followed processes
(mlock, mlock2, munlock, mlockall, munlockall, and munmap / mmap / mremap of a process
that has locked something: they change VmLck without an mlock call). Calls are rare, so
the stream is always on; it is bounded and what it loses is counted (ring full in the
kernel, the in-memory bound in user space, calls whose enter could not be stored).

From the records :func:`apply_calls` rebuilds, per process (tgid: threads share one mm),
the set of locked byte ranges exactly as the kernel accounts them in ``mm->locked_vm``
(VmLck in /proc/<pid>/status):

* ranges are page-rounded as do_mlock() rounds them: ``start & PAGE_MASK`` to
  ``PAGE_ALIGN(start + len)``; munmap / mmap / mremap lengths are ``PAGE_ALIGN``-ed;
* an interval set per tgid, so locking a range twice, or overlapping ranges, count once,
  and munlock of a range never locked changes nothing (what mlock_fixup() does);
* munmap of a locked range unlocks it; mmap(MAP_LOCKED) locks the new mapping;
  mmap(MAP_FIXED) first removes what it replaces; mremap of a locked mapping moves (and
  grows or shrinks) its locked range, MREMAP_FIXED removes the target range first;
* mlockall(MCL_CURRENT or MCL_FUTURE) locks mappings the probe cannot see from the
  arguments: the process's locked bytes are NA (unknowable) until munlockall, which
  empties the set and makes them known (0) again;
* failed calls (negative errno) change nothing;

* a process's exit (sched_process_exit with group_dead; on kernels whose format lacks
  group_dead, 6.12 and older, the leader's exit) and execve() (a new mm) empty its set: the
  ``mlock`` table has ``exit`` / ``exec`` rows for them (events, not calls);
* a new child process starts with nothing locked (fork does not inherit VM_LOCKED).

Not modelled (documented limits): mappings mlock_fixup() skips (VM_IO / VM_PFNMAP /
hugetlb / DAX / secretmem VMAs are never counted in VmLck), an mlock that fails with
ENOMEM after locking a prefix of the range (a hole in the range), and where group_dead
is missing, a leader that exits before its other threads.

Tables (declared in moetrace.record.spec MLOCK): ``mlock`` (one row per call, with the
process's locked bytes after it) and ``mlock_timeline`` (one row per change of a
process's locked bytes, with the total over all followed processes).
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from moetrace.lazyimport import pandas as pd

from moetrace.record.spec import Knob, ProbeSpec, Struct, named_tp, group, fn_cands
from moetrace.run.tables import TABLES, named_tables
from moetrace.errors import ProbeError
from moetrace.record.probe import ProbeRecorder

# -- the declaration: attach candidates, knobs, tables (probes/mlock.bpf.c agrees: tests/probe_build/test_core_objects.py)

#: (syscall, enter fields read, group knob or None: required); probes/mlock.bpf.c
_MLOCK_CALLS = (
    ("mlock", ("start", "len"), None),
    ("munlock", ("start", "len"), None),
    ("mlock2", ("start", "len", "flags"), "MOE_HAVE_MLOCK2"),
    ("mlockall", ("flags",), "MOE_HAVE_MLOCKALL"),
    ("munlockall", (), "MOE_HAVE_MLOCKALL"),
    ("munmap", ("addr", "len"), "MOE_TRACK_MUNMAP"),
    ("mmap", ("len", "flags"), "MOE_TRACK_MMAP"),
    ("mremap", ("addr", "old_len", "new_len", "flags"), "MOE_TRACK_MREMAP"),
)
_MLOCK_NOTES = {
    "mlock2": "since 4.4 (MLOCK_ONFAULT); locks like mlock",
    "mlockall": "MCL_CURRENT locks every mapping: the locked bytes are unknowable from arguments (NA until "
                "munlockall)",
    "munmap": "unmapping a locked range unlocks it; recorded only for a tgid that has locked something",
    "mmap": "MAP_LOCKED maps locked; MAP_FIXED may replace a locked range (recorded only for a tgid that "
            "locked)",
    "mremap": "moving / growing a locked mapping moves / grows its locked pages (tgids that locked only)",
}

#: probes/mlock.bpf.c. Reads only syscall arguments; one ring record per call of the followed tgids
#: (calls are rare), locked ranges rebuilt exactly in user space (moetrace.record.probes.mlock).
MLOCK = ProbeSpec(
    name="mlock",
    recorder="MlockRecorder",
    order=40,
    description="every mlock-family call of the command (ring, bounded, lost counted); locked bytes over "
                "time per process, exact (an interval set per tgid, page-rounded like the kernel)",
    attach=tuple(
        group(f"{sc}_{side}",
           named_tp(f"syscalls:sys_{side}_{sc}", fields=fields if side == "enter" else ("ret",),
                   note=_MLOCK_NOTES.get(sc, "")),
           required=knob is None, knob=knob)
        for sc, fields, knob in _MLOCK_CALLS for side in ("enter", "exit")
    ) + (
        group("newtask", named_tp("task:task_newtask", fields=("pid", "clone_flags"),
                              note="follow the command's child processes (VM_LOCKED is not inherited)"),
           required=False, knob="MOE_FOLLOW_FORKS"),
        group("exit", named_tp("sched:sched_process_exit", field_knobs=(("group_dead", "MOE_EXIT_GROUP_DEAD"),),
                           note="a process's end releases its locks; group_dead is newer than 6.12 (without "
                                "it the leader's exit stands for the group's)"),
           required=False, knob="MOE_TRACK_EXIT"),
        group("exec", named_tp("sched:sched_process_exec", note="execve gives the process a new mm: nothing locked"),
           required=False, knob="MOE_TRACK_EXEC"),
        group("kp_mlock_folio", *fn_cands("mlock_folio",
                                          note="a folio mlocked (reads folio->flags for PG_head); mlock_page "
                                               "before the mlock folio conversion (6.1 already has mlock_folio)"),
              required=False, knob="MOE_KP_MLOCK_FOLIO"),
        group("kp_mlock_new", *fn_cands("mlock_new_folio",
                                        note="renamed from mlock_new_page by the mlock folio conversion (6.3)"),
              *fn_cands("mlock_new_page", note="6.1 name"), required=False,
              knob="MOE_KP_MLOCK_NEW"),
        group("kp_munlock", *fn_cands("munlock_folio", note="6.3+ name"),
              *fn_cands("munlock_page", note="6.1 name"), required=False,
              knob="MOE_KP_MUNLOCK"),
    ),
    knobs=(
        Knob("MOE_HAVE_MLOCK2", 1, "1: compile mlock2 enter/exit (set from the attach plan)"),
        Knob("MOE_HAVE_MLOCKALL", 1, "1: compile mlockall/munlockall enter/exit (set from the attach plan)"),
        Knob("MOE_TRACK_MUNMAP", 1, "1: compile munmap enter/exit (a locked range unmapped)"),
        Knob("MOE_TRACK_MMAP", 1, "1: compile mmap enter/exit (MAP_LOCKED, MAP_FIXED over a locked range)"),
        Knob("MOE_TRACK_MREMAP", 1, "1: compile mremap enter/exit (a locked mapping moved or resized)"),
        Knob("MOE_FOLLOW_FORKS", 1, "1: a followed tgid's new processes are followed too (newtask group)"),
        Knob("MOE_TRACK_EXIT", 1, "1: compile sched_process_exit (a process's end releases its locks)"),
        Knob("MOE_EXIT_GROUP_DEAD", 1, "1: sched_process_exit carries group_dead (set from the format file)"),
        Knob("MOE_TRACK_EXEC", 1, "1: compile sched_process_exec (execve: a new mm, nothing locked)"),
        Knob("MOE_KP_MLOCK_FOLIO", 0, "1: compile the mlock_folio kprobe (set from the plan)"),
        Knob("MOE_KP_MLOCK_NEW", 0, "1: compile the mlock_new_folio / mlock_new_page kprobe"),
        Knob("MOE_KP_MUNLOCK", 0, "1: compile the munlock_folio / munlock_page kprobe"),
        Knob("MOE_PG_HEAD", -1, "PG_head's bit in folio->flags (6 on 6.12, 16 on 6.1); -1: the running "
                                "kernel's own (its enum pageflags, through BTF)"),
        Knob("MOE_MAX_TASKS", 4096, "tid -> call in flight entries"),
        Knob("MOE_MAX_TGIDS", 1024, "followed processes"),
        Knob("MOE_RINGBUF_PAGES", 16, "ring buffer size in pages (power of two)"),
    ),
    table="mlock",
    schema=TABLES["mlock"],
    more_tables=named_tables("mlock_timeline"),
    stats=("calls", "ring_lost", "pending_full", "unmatched_exits", "tgid_map_full", "kp_mlock_folio",
           "kp_mlock_new", "kp_munlock", "kp_large"),
    structs=(Struct("mlock_event", (("ts_ns", "u64"), ("tgid", "u32"), ("tid", "u32"), ("call", "u32"),
                                    ("flags", "u32"), ("start", "u64"), ("len", "u64"), ("len2", "u64"),
                                    ("ret", "s64"), ("latency_ns", "u64"))),),
    enrichment=True,
    map_sizes=lambda k: {"pending_calls": int(k["MOE_MAX_TASKS"]), "tgids": int(k["MOE_MAX_TGIDS"]),
                         "stats": 9, "events": 4096 * int(k["MOE_RINGBUF_PAGES"])},
)

SPEC = MLOCK
#: call codes of probes/mlock.bpf.c, in CALL_* order
CALLS = ("mlock", "mlock2", "munlock", "mlockall", "munlockall", "munmap", "mmap", "mremap", "exit", "exec")
EVENT_DTYPE = SPEC.struct("mlock_event").dtype()
STATS = SPEC.stats
PAGE = os.sysconf("SC_PAGE_SIZE")
MCL_CURRENT, MCL_FUTURE = 1, 2
MAP_FIXED, MAP_LOCKED = 0x10, 0x2000
MREMAP_FIXED = 2
#: the user-space bound on kept call records (64 bytes each)
MAX_RECORDS = 1_000_000


# ---------------------------------------------------------------------------
# the locked-range model (no kernel)


class RangeSet:
    """Disjoint half-open byte ranges [start, end), kept sorted; sizes in bytes.

    ``add`` / ``remove`` return the change of :attr:`total` they caused."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.total = 0

    def __len__(self) -> int:
        return len(self.starts)

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.starts, self.ends))

    def overlap(self, a: int, b: int) -> int:
        """Bytes of [a, b) inside the set."""
        if b <= a:
            return 0
        i = bisect.bisect_right(self.ends, a)
        n = 0
        while i < len(self.starts) and self.starts[i] < b:
            n += min(b, self.ends[i]) - max(a, self.starts[i])
            i += 1
        return n

    def remove(self, a: int, b: int) -> int:
        if b <= a:
            return 0
        i = bisect.bisect_right(self.ends, a)  # first range ending after a
        j = i
        keep_s: list[int] = []
        keep_e: list[int] = []
        removed = 0
        while j < len(self.starts) and self.starts[j] < b:
            s, e = self.starts[j], self.ends[j]
            removed += min(b, e) - max(a, s)
            if s < a:
                keep_s.append(s)
                keep_e.append(a)
            if e > b:
                keep_s.append(b)
                keep_e.append(e)
            j += 1
        self.starts[i:j] = keep_s
        self.ends[i:j] = keep_e
        self.total -= removed
        return -removed

    def add(self, a: int, b: int) -> int:
        if b <= a:
            return 0
        before = self.total
        i = bisect.bisect_left(self.ends, a)  # first range ending at or after a (touching merges)
        j = i
        s, e = a, b
        covered = 0
        while j < len(self.starts) and self.starts[j] <= b:
            s, e = min(s, self.starts[j]), max(e, self.ends[j])
            covered += self.ends[j] - self.starts[j]
            j += 1
        self.starts[i:j] = [s]
        self.ends[i:j] = [e]
        self.total += (e - s) - covered
        return self.total - before

    def clear(self) -> int:
        d = -self.total
        self.starts, self.ends, self.total = [], [], 0
        return d


def _page_range(start: int, length: int, page: int) -> tuple[int, int]:
    """do_mlock()'s rounding: [start & PAGE_MASK, PAGE_ALIGN(start + len))."""
    a = start - start % page
    b = -(-(start + length) // page) * page
    return a, b


def _align(n: int, page: int) -> int:
    return -(-n // page) * page


@dataclass
class _Proc:
    ranges: RangeSet = field(default_factory=RangeSet)
    unknown: bool = False  # after mlockall, until munlockall
    inexact: int = 0  # calls the model could not apply exactly (set to unknown)


def apply_calls(calls: pd.DataFrame, page: int = PAGE) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """Replay call records through the locked-range model.

    ``calls``: columns time_ns, tgid, tid, call (name), start, len_bytes, new_len_bytes,
    flags, ret, latency_ns — in time order (re-sorted stably here). Returns (calls with
    delta_bytes / locked_bytes added, the timeline, a per-tgid summary). NA marks a
    process whose locked bytes are unknowable (after mlockall, or an mremap that only
    partly overlapped the model's locked ranges)."""
    df = calls.sort_values("time_ns", kind="stable").reset_index(drop=True)
    procs: dict[int, _Proc] = {}
    deltas: list[Any] = []
    locked: list[Any] = []
    changed: list[bool] = []
    tl_rows: list[tuple[int, int, str, Any]] = []
    summary: dict[int, dict[str, Any]] = {}
    for r in df.itertuples(index=False):
        tg = int(r.tgid)
        p = procs.setdefault(tg, _Proc())
        s = summary.setdefault(tg, {"calls": 0, "failed_calls": 0, "max_locked_bytes": 0, "inexact_calls": 0,
                                    "exited": False, "locked_bytes_at_exit": None})
        s["calls"] += 1
        ret = int(r.ret)
        call = str(r.call)
        was_unknown, before = p.unknown, p.ranges.total
        if -4095 <= ret < 0:
            s["failed_calls"] += 1
        else:
            start, ln, flags = int(r.start), int(r.len_bytes), int(r.flags)
            if call in ("mlock", "mlock2"):
                p.ranges.add(*_page_range(start, ln, page))
            elif call == "munlock":
                p.ranges.remove(*_page_range(start, ln, page))
            elif call == "mlockall":
                if flags & (MCL_CURRENT | MCL_FUTURE):
                    p.unknown = True
            elif call in ("munlockall", "exit", "exec"):  # exit / exec: the mm and its locks are gone
                if call == "exit":
                    s["exited"] = True
                    s["locked_bytes_at_exit"] = None if p.unknown else p.ranges.total
                p.ranges.clear()
                p.unknown = False
            elif call == "munmap":
                p.ranges.remove(start, start + _align(ln, page))
            elif call == "mmap":
                a = ret & ((1 << 64) - 1)
                b = a + _align(ln, page)
                if flags & MAP_FIXED:
                    p.ranges.remove(a, b)
                if flags & MAP_LOCKED:
                    p.ranges.add(a, b)
            elif call == "mremap":
                old_a, old_b = start, start + _align(ln, page)
                new_a = ret & ((1 << 64) - 1)
                new_b = new_a + _align(int(r.new_len_bytes), page)
                ov = p.ranges.overlap(old_a, old_b)
                if ov == old_b - old_a and ov > 0:  # a locked mapping: its lock moves / resizes with it
                    p.ranges.remove(old_a, old_b)
                    if flags & MREMAP_FIXED:
                        p.ranges.remove(new_a, new_b)
                    p.ranges.add(new_a, new_b)
                elif ov == 0:
                    if flags & MREMAP_FIXED:
                        p.ranges.remove(new_a, new_b)
                else:  # one VMA is locked as a whole: a partial overlap means the model is off
                    p.unknown = True
                    p.inexact += 1
                    s["inexact_calls"] += 1
        if p.unknown:
            deltas.append(pd.NA)
            locked.append(pd.NA)
        else:
            deltas.append(pd.NA if was_unknown else p.ranges.total - before)
            locked.append(p.ranges.total)
            s["max_locked_bytes"] = max(s["max_locked_bytes"], p.ranges.total)
        changed.append(p.unknown != was_unknown or (not p.unknown and p.ranges.total != before))
        if changed[-1]:
            tl_rows.append((int(r.time_ns), tg, call, pd.NA if p.unknown else p.ranges.total))
    df["delta_bytes"] = pd.array(deltas, dtype="Int64")
    df["locked_bytes"] = pd.array(locked, dtype="Int64")
    df["changed"] = np.array(changed, dtype=bool)
    for tg, p in procs.items():
        summary[tg]["locked_bytes_end"] = None if p.unknown else p.ranges.total
        summary[tg]["unknown_at_end"] = p.unknown
    tl = _timeline(tl_rows)
    return df, tl, {str(k): v for k, v in summary.items()}


#: calls recorded only because they may touch a locked range
MAPPING_CALLS = ("munmap", "mmap", "mremap")


def table_rows(calls: pd.DataFrame) -> pd.DataFrame:
    """The ``mlock`` table from :func:`apply_calls`'s frame: every mlock-family call and
    exit / exec event, and the munmap / mmap / mremap calls that changed the locked bytes
    (the others, e.g. a locked process's ld.so MAP_FIXED mappings, are counted in the
    summary, not listed)."""
    keep = ~calls["call"].isin(MAPPING_CALLS) | calls["changed"]
    return calls[keep].drop(columns=["changed"]).reset_index(drop=True)


def _timeline(rows: list[tuple[int, int, str, Any]]) -> pd.DataFrame:
    """mlock_timeline: per change, the process's and all processes' locked bytes."""
    cur: dict[int, Any] = {}
    totals: list[Any] = []
    for _t, tg, _c, v in rows:
        cur[tg] = v
        vals = list(cur.values())
        totals.append(pd.NA if any(x is pd.NA for x in vals) else int(sum(vals)))
    return pd.DataFrame({
        "time_ns": np.array([r[0] for r in rows], dtype=np.int64),
        "tgid": np.array([r[1] for r in rows], dtype=np.int32),
        "call": pd.array([r[2] for r in rows], dtype="string"),
        "locked_bytes": pd.array([r[3] for r in rows], dtype="Int64"),
        "total_locked_bytes": pd.array(totals, dtype="Int64"),
    })


def locked_bytes_at(timeline: pd.DataFrame, tgid: int, t_ns: int) -> int | None:
    """A process's locked bytes at CLOCK_MONOTONIC ``t_ns`` (0 before its first change,
    None when unknowable then)."""
    rows = timeline[(timeline["tgid"] == tgid) & (timeline["time_ns"] <= t_ns)]
    if rows.empty:
        return 0
    v = rows["locked_bytes"].iloc[-1]
    return None if v is pd.NA else int(v)


def records_to_calls(raw: bytes) -> pd.DataFrame:
    """Ring records (struct mlock_event) -> the call columns of the ``mlock`` table."""
    ev = np.frombuffer(raw, EVENT_DTYPE)
    codes = ev["call"].astype(np.int64)
    bad = codes >= len(CALLS)
    if bad.any():
        raise ProbeError(f"mlock probe: {int(bad.sum())} records carry an unknown call code",
                              hint="probes/mlock.bpf.c CALL_* and moetrace.record.probes.mlock.CALLS disagree")
    is_mremap = codes == CALLS.index("mremap")
    return pd.DataFrame({
        "time_ns": ev["ts_ns"].astype(np.int64),
        "tgid": ev["tgid"].astype(np.int32),
        "tid": ev["tid"].astype(np.int32),
        "call": pd.array([CALLS[c] for c in codes], dtype="string"),
        "start": ev["start"].astype(np.uint64),
        "len_bytes": ev["len"].astype(np.int64),
        "new_len_bytes": pd.array([int(v) if m else pd.NA for v, m in zip(ev["len2"], is_mremap)], dtype="Int64"),
        "flags": ev["flags"].astype(np.int64),
        "ret": ev["ret"].astype(np.int64),
        "latency_ns": ev["latency_ns"].astype(np.int64),
    })


def empty_calls() -> pd.DataFrame:
    return records_to_calls(b"")


# ---------------------------------------------------------------------------
# the recorder


class MlockRecorder(ProbeRecorder):
    """``record --probes mlock``: attach probes/mlock.bpf.c, follow the command, stream its calls.

    open() compiles with the attach plan's knobs (optional groups the kernel lacks are
    compiled out; the function hooks only where fentry or kprobes exist), poll()
    drains the ring, close() drains the rest, reads the stats slots and detaches, then
    rebuilds the locked ranges (:func:`apply_calls`)."""

    name = "mlock"
    spec = SPEC
    error = ProbeError
    needs_poll = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.stream = None
        self.stats: dict[str, int] = {}
        self.calls: pd.DataFrame | None = None
        self.timeline: pd.DataFrame | None = None
        self.per_tgid: dict[str, Any] = {}
        self.followed: list[int] = []
        self.kprobes: dict[str, str] = {}
        self.pending_left = 0

    def open(self) -> "MlockRecorder":
        from moetrace.kernel.bpf import EventStream

        plan = self.require_plan()
        knobs = {k: int(v) for k, v in SPEC.knob_values(**plan.knobs).items()}
        self.knobs = self.with_user_knobs(knobs)
        self.load_planned(self.knobs)
        self.stream = EventStream(self.probe, "events", EVENT_DTYPE.itemsize, kernel_lost=self.stat_reader("ring_lost"),
                                  max_records=min(self.ctx.stream_max_records, MAX_RECORDS))
        return self

    def follow(self, pid: int) -> None:
        if self.probe is None:
            return
        self.probe.put("tgids", int(pid).to_bytes(4, "little"), b"\x01")
        self.followed.append(int(pid))

    def poll(self, timeout_ms: int = 0) -> None:
        if self.stream is not None and not self.closed:
            self.stream.poll(max(0, int(timeout_ms)))

    def close(self) -> None:
        from moetrace.kernel.bpf import entry_count

        got: dict[str, Any] = {}

        def read() -> None:
            self.stream.finish()
            self.stats = self.read_stats()
            self.pending_left = entry_count(self.probe.table("pending_calls"))
            got["raw"] = self.stream.records()

        if not self.collect(read):
            return
        calls = records_to_calls(got["raw"])
        self.calls, self.timeline, self.per_tgid = apply_calls(calls)
        self.collected = True

    def abort(self) -> None:
        super().abort()

    # -- output ----------------------------------------------------------------------------
    def function_hooks(self) -> dict[str, str]:
        """{hook group: "fentry <function>" | "kprobe <function>"} of the function hooks attached
        (fentry where the kernel allows trampolines; the plan says why not where it does not)."""
        out = {}
        for e in self.ctx.plan.attached:
            if e.candidate.kind in ("fentry", "fexit", "kprobe", "kretprobe") and e.group in self.kprobes:
                out[e.group] = f"{e.candidate.kind} {e.candidate.target}"
        return out

    def replay_check(self) -> dict[str, Any] | None:
        """The probe's locked bytes at the replay's loop entry against the replay's own VmLck
        (replay.json), or None without a replay log."""
        log_dir = self.ctx.log_dir
        if log_dir is None or self.timeline is None:
            return None
        p = Path(log_dir) / "replay.json"
        if not p.exists():
            return None
        try:
            rs = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            return {"error": f"replay.json unreadable ({e})"}
        pid, t = rs.get("pid"), rs.get("loop_entry_ns")
        if pid is None or t is None:
            return {"error": "replay.json has no pid / loop_entry_ns (the replay did not reach its loop)"}
        probe = locked_bytes_at(self.timeline, int(pid), int(t))
        vm = rs.get("vmlck_bytes")
        return {"replay_pid": pid, "loop_entry_ns": t, "replay_vmlck_bytes": vm,
                "replay_arena_bytes": rs.get("arena_bytes"), "probe_locked_bytes_at_loop_entry": probe,
                "match": probe is not None and vm is not None and probe == vm}

    def summary(self) -> dict[str, Any]:
        tl = self.timeline if self.timeline is not None else pd.DataFrame()
        total_end = None
        if not tl.empty:
            v = tl["total_locked_bytes"].iloc[-1]
            total_end = None if v is pd.NA else int(v)
        elif self.collected:
            total_end = 0
        tot = tl["total_locked_bytes"].dropna() if not tl.empty else pd.Series([], dtype="Int64")
        return {
            "followed_pids": list(self.followed),
            "calls": int(len(self.calls)) if self.calls is not None else 0,
            "calls_by_kind": ({str(k): int(v) for k, v in self.calls["call"].value_counts().items()}
                              if self.calls is not None else {}),
            "mapping_calls_changing_locks": (int((self.calls["call"].isin(MAPPING_CALLS)
                                                  & self.calls["changed"]).sum())
                                             if self.calls is not None else 0),
            "per_tgid": self.per_tgid,
            "total_locked_bytes_end": total_end,
            "max_total_locked_bytes": int(tot.max()) if len(tot) else 0,
            "kprobes": dict(self.kprobes),
            "function_hooks": self.function_hooks(),
            "replay_check": self.replay_check(),
            "page_bytes": PAGE,
            "note": "locked bytes per process from its calls (an exact interval set, page-rounded like "
                    "do_mlock); exit / exec rows empty a process's set",
        }

    def write(self, run_dir: Path, manifest: dict[str, Any]) -> None:
        cols = [c.name for c in SPEC.schema]
        calls = self.calls if self.calls is not None else apply_calls(empty_calls())[0]
        tl = self.timeline if self.timeline is not None else _timeline([])
        self.write_tables(run_dir, manifest, {SPEC.table: table_rows(calls)[cols], "mlock_timeline": tl})
        st = self.stream
        self.write_sections(manifest, self.stats, {
            "ring_lost_calls": int(st.lost_kernel) if st else 0,
            "user_lost_calls": int(st.lost_user) if st else 0,
            "pending_full_calls": int(self.stats.get("pending_full", 0)),
            "unmatched_exits": int(self.stats.get("unmatched_exits", 0)),
            "in_flight_at_close": int(self.pending_left),
            "intervals": [vars(i) for i in st.intervals] if st else [],
            "note": "a lost call makes the locked bytes of its process inexact from then on",
        }, self.summary())


__all__ = ["RangeSet", "apply_calls", "table_rows", "locked_bytes_at", "records_to_calls", "MlockRecorder", "CALLS"]
