"""Reclaim truth: load the reclaim probe and read who reclaimed how much, how often, how long.

::

    with ReclaimRecorder() as rec:
        ...                        # the workload
    res = rec.result               # ReclaimResult (also returned by rec.close())
    res.per_kind                   # one row per reclaimer kind: memcg, direct, kswapd, damon, proactive, other
    res.histogram                  # kind, slot, lo_ns, hi_ns, invocations (log2 ns durations)
    res.timeline                   # per time bucket and kind (bucket_ns > 0 only)
    res.summary()                  # scalars for the run manifest

Everything is aggregated in the kernel (no event stream, so nothing can be lost): per
reclaimer kind the invocations (``*_reclaim_begin`` / ``kswapd_wake``) and their durations
(to the matching end on the same task), the pages ``lru_shrink_inactive`` scanned and
reclaimed (steal), ``lru_shrink_active`` and ``lru_isolate`` counts. The kind of a
shrink event is the open begin/end window of its task; with no window open, kswapd or
damon by the kernel thread's comm (kswapd attached mid-window; a kdamond thread), else
"other" (node/soft-limit reclaim, reclaim_pages). A memcg window that opens inside a
write(2) of at most 64 bytes is "proactive" (memory.reclaim; the probe follows small
writes with sys_enter/exit_write, knob MOE_CTX_WRITE).

Oracle: shrink_inactive's nr_scanned / nr_reclaimed are what the kernel adds to
``pgscan_anon + pgscan_file`` / ``pgsteal_anon + pgsteal_file`` in /proc/vmstat for every
reclaimer. The per-reclaimer ``pgscan_direct`` / ``pgsteal_direct`` / ``*_kswapd`` count
only global reclaim (``if (!cgroup_reclaim(sc))`` in shrink_inactive_list): memcg limit
reclaim lands in the memcg's own v2 memory.stat (v1 memory.stat has no pgscan at all).
The recorder reads /proc/vmstat at open and close and puts the comparison in
:meth:`ReclaimResult.summary` (``vmstat_check``).

The kernel side is probes/reclaim.bpf.c, compiled once and loaded by libbpf. Which tracepoints exist is decided by
:func:`moetrace.record.spec.resolve` on the ``reclaim`` declaration; optional groups that are
unavailable are left out with their ``MOE_HAVE_*`` knobs (the object does not load their
programs). Only tracepoint arguments are read.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from moetrace.lazyimport import pandas as pd

from moetrace.record.spec import Knob, ProbeSpec, group, tp_cand
from moetrace.run.tables import TABLES, named_tables
from moetrace.kernel import procfs
from moetrace.kernel.procfs import delta as vmstat_delta

from moetrace.record.probe import EngineProbe, log2_bounds, schema_doc

#: the one declaration of probes/reclaim.bpf.c (attach groups, knobs, stats
#: slots, schema)
# -- the declaration: attach candidates, knobs, tables (the C agrees: tests/probe_build/test_core_objects.py,
# tests/probe_build/test_core_objects.py)

_SHRINK_INACTIVE_FIELDS = ("nr_scanned", "nr_reclaimed", "nr_dirty", "nr_writeback", "nr_congested", "nr_immediate",
                           "nr_activate0", "nr_activate1", "nr_ref_keep", "nr_unmap_fail", "reclaim_flags")

#: probes/reclaim.bpf.c. Reads only tracepoint arguments; aggregated in the
#: kernel (no stream).
RECLAIM = ProbeSpec(
    name="reclaim",
    recorder="ReclaimProbe",
    order=30,
    user_knobs=False,
    description="who reclaimed (memcg limit, direct, kswapd, damon, proactive = memory.reclaim, other), "
                "scan/steal, shrink_active, isolate, invocation durations; all aggregated in the kernel",
    attach=(
        group("memcg_begin", tp_cand("vmscan:mm_vmscan_memcg_reclaim_begin",
                              note="memcg limit reclaim (try_to_free_mem_cgroup_pages) opens a window; "
                                   "proactive when it opens inside a small write(2): memory.reclaim")),
        group("memcg_end", tp_cand("vmscan:mm_vmscan_memcg_reclaim_end", fields=("nr_reclaimed",))),
        group("direct_begin", tp_cand("vmscan:mm_vmscan_direct_reclaim_begin"), required=False, knob="MOE_HAVE_DIRECT"),
        group("direct_end", tp_cand("vmscan:mm_vmscan_direct_reclaim_end", fields=("nr_reclaimed",)), required=False,
           knob="MOE_HAVE_DIRECT"),
        group("kswapd_wake", tp_cand("vmscan:mm_vmscan_kswapd_wake"), required=False, knob="MOE_HAVE_KSWAPD"),
        group("kswapd_sleep", tp_cand("vmscan:mm_vmscan_kswapd_sleep"), required=False, knob="MOE_HAVE_KSWAPD"),
        group("shrink_inactive", tp_cand("vmscan:mm_vmscan_lru_shrink_inactive", fields=_SHRINK_INACTIVE_FIELDS,
                                  note="does NOT fire with MGLRU on in 6.1 (evict_folios bypasses "
                                       "shrink_inactive_list); fires again in 6.12; nr_scanned/nr_reclaimed "
                                       "are what pgscan/pgsteal_{anon,file} count")),
        group("shrink_active", tp_cand("vmscan:mm_vmscan_lru_shrink_active",
                                fields=("nr_taken", "nr_active", "nr_deactivated", "nr_referenced")),
           required=False, knob="MOE_HAVE_SHRINK_ACTIVE"),
        group("isolate", tp_cand("vmscan:mm_vmscan_lru_isolate",
                          fields=("nr_requested", "nr_scanned", "nr_skipped", "nr_taken")),
           required=False, knob="MOE_HAVE_ISOLATE"),
        group("ctx_enter_write", tp_cand("syscalls:sys_enter_write", fields=("count",),
                                  note="a write(2) of <= 64 bytes in flight: a memcg window it opens is "
                                       "memory.reclaim (proactive)"),
           required=False, knob="MOE_CTX_WRITE"),
        group("ctx_exit_write", tp_cand("syscalls:sys_exit_write"), required=False, knob="MOE_CTX_WRITE"),
    ),
    knobs=(
        Knob("MOE_HAVE_DIRECT", 1, "1: compile direct_reclaim_begin/end (set from the attach plan)"),
        Knob("MOE_HAVE_KSWAPD", 1, "1: compile kswapd_wake/sleep (set from the attach plan)"),
        Knob("MOE_HAVE_SHRINK_ACTIVE", 1, "1: compile lru_shrink_active (set from the attach plan)"),
        Knob("MOE_HAVE_ISOLATE", 1, "1: compile lru_isolate (set from the attach plan)"),
        Knob("MOE_CTX_WRITE", 1, "1: compile sys_enter/exit_write: the small-write context that makes a memcg "
                                 "window proactive (memory.reclaim; set from the attach plan)"),
        Knob("MOE_MAX_TASKS", 16384, "tid -> open reclaim window entries (and tid -> write context entries)"),
        Knob("MOE_BUCKET_NS", 0, "per-time-bucket counters: bucket width in ns (0: off)"),
        Knob("MOE_MAX_BUCKETS", 4096, "time buckets kept; later events land in the last one"),
        Knob("MOE_T0_NS", 0, "bpf_ktime_get_ns() (CLOCK_MONOTONIC) of bucket 0"),
    ),
    table="reclaim",
    schema=TABLES["reclaim"],
    more_tables=named_tables("reclaim_histogram", "reclaim_timeline"),
    stats=("nested_begins", "unmatched_ends", "kind_mismatch", "task_map_full", "timeline_overflow"),
    map_sizes=lambda k: _map_sizes(k),
)

SPEC = RECLAIM
SOURCE = SPEC.source_path
#: reclaimer kinds of the reclaim probe's C, in KIND_* order
KINDS = ("memcg", "direct", "kswapd", "damon", "proactive", "other")
#: per-kind counter fields of the reclaim probe's C, in F_* order (a test checks the two agree)
FIELDS = ("invocations", "completed", "duration_ns", "end_reclaimed", "inactive_calls", "scanned", "reclaimed",
          "scanned_file", "reclaimed_file", "dirty", "writeback", "congested", "immediate", "activate_anon",
          "activate_file", "ref_keep", "unmap_fail", "active_calls", "active_taken", "active_deactivated",
          "active_kept", "active_referenced", "isolate_calls", "isolate_requested", "isolate_scanned",
          "isolate_skipped", "isolate_taken")
#: stats slots of the reclaim probe's C, in STAT_* order
STATS = SPEC.stats
#: timeline fields per (bucket, kind), in T_* order
TIMELINE_FIELDS = ("scanned", "reclaimed", "invocations", "duration_ns")
HIST_SLOTS = 64
#: attach group -> (C function, MOE_HAVE_* knob loading it; None: always loaded), from the declaration
GROUPS = {g.name: (g.candidates[0].fn_name, g.knob) for g in SPEC.attach}
HAVE_KNOBS = tuple(dict.fromkeys(g.knob for g in SPEC.attach if g.knob is not None))
#: /proc/vmstat counters the recorder snapshots around a recording
VMSTAT_KEYS = ("pgscan_kswapd", "pgscan_direct", "pgscan_khugepaged", "pgscan_proactive", "pgscan_anon",
               "pgscan_file", "pgsteal_kswapd", "pgsteal_direct", "pgsteal_khugepaged", "pgsteal_proactive",
               "pgsteal_anon", "pgsteal_file", "pgrefill", "pgdeactivate", "pgactivate",
               "workingset_refault_file", "workingset_refault_anon")


def _map_sizes(k: dict[str, int]) -> dict[str, int]:
    """The CO-RE object's map sizes from its knobs (probes/reclaim.bpf.c names the maps)."""
    nk = len(KINDS)
    tl = int(k["MOE_MAX_BUCKETS"]) * nk * len(TIMELINE_FIELDS) if int(k["MOE_BUCKET_NS"]) > 0 else 1
    return {"totals": nk * len(FIELDS), "dur_hist": nk * HIST_SLOTS, "stats": len(STATS), "timeline": tl,
            "active": int(k["MOE_MAX_TASKS"]), "task_ctx": int(k["MOE_MAX_TASKS"])}


def read_vmstat(root: str | os.PathLike = "/", keys: tuple[str, ...] = VMSTAT_KEYS) -> dict[str, int]:
    """The reclaim counters of <root>/proc/vmstat (absent ones are left out)."""
    return procfs.read_vmstat(root, keys)


def reclaim_knobs(have: dict[str, int] | None = None, bucket_ns: int = 0, max_buckets: int = 4096,
                  t0_ns: int = 0, max_tasks: int = 16384) -> dict[str, int]:
    """The knobs of the reclaim probe (``have``: MOE_HAVE_* -> 0/1, default all 1), validated."""
    if bucket_ns < 0 or max_buckets <= 0 or max_tasks <= 0 or t0_ns < 0:
        raise ValueError("bucket_ns and t0_ns must be >= 0, max_buckets and max_tasks > 0")
    have = {k: 1 for k in HAVE_KNOBS} | dict(have or {})
    unknown = set(have) - set(HAVE_KNOBS)
    if unknown:
        raise ValueError(f"unknown MOE_HAVE_* knobs {sorted(unknown)}")
    return SPEC.knob_values(**{k: int(bool(v)) for k, v in have.items()}, MOE_MAX_TASKS=int(max_tasks),
                            MOE_BUCKET_NS=int(bucket_ns), MOE_MAX_BUCKETS=int(max_buckets), MOE_T0_NS=int(t0_ns))


def resolve_attach(features=None, plan=None) -> tuple[dict[str, str], dict[str, str], dict[str, int]]:
    """(attached {group: "category:event"}, unavailable {group: reason}, MOE_HAVE_* knobs)
    from the ``reclaim`` declaration on this kernel. Raises :class:`ProbeError` when
    a required group is unavailable. An optional group sharing a knob with an unavailable
    one is compiled out with it (begin without end would only leave windows open)."""
    from moetrace.record import spec as probespec

    if plan is None:
        plan = probespec.resolve(SPEC, features)
    attached: dict[str, str] = {}
    missing: dict[str, str] = {}
    for e in plan.entries:
        if e.attached:
            attached[e.group] = e.candidate.target
        elif e.required:
            raise ProbeError(f"reclaim probe: {e.group} unavailable: {e.reason}",
                                    hint="`moetrace doctor` lists every attach point")
        else:
            missing[e.group] = e.reason
    unknown = set(attached) - set(GROUPS)
    if unknown:
        raise ProbeError(f"reclaim declaration names groups the reclaim probe's C lacks: {sorted(unknown)}")
    have = {k: 1 for k in HAVE_KNOBS}
    for g, (_fn, knob) in GROUPS.items():
        if knob is not None and g not in attached:
            have[knob] = 0
    for k in HAVE_KNOBS:  # a declaration knob of the same name wins when stricter
        if k in plan.knobs:
            have[k] = min(have[k], int(plan.knobs[k]))
    for g, (_fn, knob) in GROUPS.items():
        if knob is not None and have[knob] == 0 and g in attached:
            missing[g] = f"compiled out ({knob}=0)"
            del attached[g]
    return attached, missing, have


@dataclass
class ReclaimResult:
    """What one recording saw of reclaim, system-wide.

    per_kind: one row per kind (KINDS): invocations, completed, scanned_pages,
    reclaimed_pages, scan_to_steal (scanned / reclaimed; NaN without steal),
    duration_ns_sum, duration_ns_mean, end_reclaimed_pages (sum of nr_reclaimed at
    ``*_reclaim_end``), scanned_file_pages, reclaimed_file_pages, inactive_calls, then the
    other shrink_inactive / shrink_active / isolate counters. histogram: kind, slot, lo_ns,
    hi_ns, invocations (log2 buckets of completed invocations, nonzero rows only).
    timeline: time_ns (bucket start, ns since the recording's t0), who, nr_scanned_pages,
    nr_reclaimed_pages, invocations, duration_ns (nonzero rows; empty when bucket_ns is 0).
    open_windows: begin without end at close (still reclaiming, or a missed end).
    vmstat: /proc/vmstat deltas over the recording (VMSTAT_KEYS)."""

    per_kind: pd.DataFrame
    histogram: pd.DataFrame
    timeline: pd.DataFrame
    stats: dict[str, int]
    open_windows: int
    recursion_misses: dict[str, int]
    attach: dict[str, str]
    unavailable: dict[str, str]
    knobs: dict[str, int]
    vmstat: dict[str, int]
    bucket_ns: int
    compile_s: float
    attach_s: float
    start_s: float
    duration_s: float
    t0_ns: int = 0  # CLOCK_MONOTONIC of the timeline's bucket 0

    @property
    def scanned_pages(self) -> int:
        return int(self.per_kind["scanned_pages"].sum())

    @property
    def reclaimed_pages(self) -> int:
        return int(self.per_kind["reclaimed_pages"].sum())

    def kind(self, name: str) -> dict[str, Any]:
        """One kind's row as a dict, with its duration histogram ({slot: invocations})."""
        if name not in KINDS:
            raise KeyError(f"unknown reclaimer kind {name!r}; kinds: {KINDS}")
        row = self.per_kind.set_index("kind").loc[name].to_dict()
        h = self.histogram[self.histogram["kind"] == name]
        row["histogram"] = dict(zip(h["slot"].astype(int), h["invocations"].astype(int)))
        return row

    def vmstat_check(self) -> dict[str, Any]:
        """The probe's totals against /proc/vmstat deltas (every reclaimer)."""
        v = self.vmstat
        scan_v = v.get("pgscan_anon", 0) + v.get("pgscan_file", 0)
        steal_v = v.get("pgsteal_anon", 0) + v.get("pgsteal_file", 0)

        def rel(a: int, b: int) -> float | None:
            return None if b == 0 else (a - b) / b

        return {"probe_scanned": self.scanned_pages, "vmstat_pgscan": scan_v,
                "scanned_rel_err": rel(self.scanned_pages, scan_v),
                "probe_reclaimed": self.reclaimed_pages, "vmstat_pgsteal": steal_v,
                "reclaimed_rel_err": rel(self.reclaimed_pages, steal_v)}

    def summary(self) -> dict[str, Any]:
        """Scalars for a run manifest / --json."""
        kinds = {}
        for r in self.per_kind.to_dict("records"):
            s2s = r["scan_to_steal"]
            kinds[r["kind"]] = {"invocations": int(r["invocations"]), "completed": int(r["completed"]),
                                "scanned_pages": int(r["scanned_pages"]),
                                "reclaimed_pages": int(r["reclaimed_pages"]),
                                "scan_to_steal": None if s2s is None or math.isnan(s2s) else float(s2s),
                                "duration_ns_sum": int(r["duration_ns_sum"]),
                                "end_reclaimed_pages": int(r["end_reclaimed_pages"]),
                                "inactive_calls": int(r["inactive_calls"])}
        tot_s, tot_r = self.scanned_pages, self.reclaimed_pages
        end_r = int(self.per_kind["end_reclaimed_pages"].sum())
        silent = int(self.per_kind["inactive_calls"].sum()) == 0 and end_r > 0
        return {"kinds": kinds, "scanned_pages": tot_s, "reclaimed_pages": tot_r,
                "scan_to_steal": (tot_s / tot_r) if tot_r else None,
                "end_reclaimed_pages": end_r, "shrink_inactive_fired": not silent,
                "shrink_inactive_note": ("reclaim windows reclaimed pages but mm_vmscan_lru_shrink_inactive never "
                                         "fired (MGLRU on 6.1 evicts without it): scanned / reclaimed pages and "
                                         "scan-to-steal are unknown here, end_reclaimed_pages is the windows' "
                                         "own count") if silent else None,
                "open_windows": self.open_windows, "lost_events": 0,
                "recursion_misses": dict(self.recursion_misses), "stats": dict(self.stats),
                "attach": dict(self.attach), "unavailable": dict(self.unavailable), "knobs": dict(self.knobs),
                "bucket_ns": self.bucket_ns, "t0_ns": self.t0_ns, "vmstat_delta": dict(self.vmstat),
                "vmstat_check": self.vmstat_check(), "compile_s": self.compile_s, "attach_s": self.attach_s,
                "start_s": self.start_s, "duration_s": self.duration_s}


from moetrace.kernel.bpf import entry_count, recursion_misses  # noqa: E402
from moetrace.errors import ProbeError


class ReclaimRecorder:
    """Load and attach the reclaim probe; on close read its in-kernel aggregates and detach.

    bucket_ns > 0 also keeps per-time-bucket counters (``max_buckets`` buckets from the
    moment of open(); later events land in the last bucket and are counted in
    ``stats["timeline_overflow"]``). features: a :class:`moetrace.kernel.features.Features`
    (default: the live kernel). gated: load gated, so that nothing is counted until
    :meth:`arm` (``moetrace record`` arms every probe at once).
    Use as a context manager: probes detach on exit, also on exceptions; :attr:`result`
    holds the :class:`ReclaimResult`."""

    def __init__(self, bucket_ns: int = 0, max_buckets: int = 4096, max_tasks: int = 16384, features=None,
                 vmstat_root: str | os.PathLike = "/", plan=None,
                 gated: bool = False):
        reclaim_knobs(bucket_ns=bucket_ns, max_buckets=max_buckets, max_tasks=max_tasks)  # validate
        self.bucket_ns = int(bucket_ns)
        self.max_buckets = int(max_buckets)
        self.max_tasks = int(max_tasks)
        self.features = features
        self._plan = plan
        self.vmstat_root = vmstat_root
        self.gated = gated  # counts nothing until armed (:meth:`arm`)
        self.attach: dict[str, str] = {}
        self.unavailable: dict[str, str] = {}
        self.knobs: dict[str, int] = {}
        #: the loaded probe (moetrace.kernel.bpf.CoreProbe) while attached, else None
        self.probe = None
        self.result: ReclaimResult | None = None
        self.compile_s = 0.0
        self.attach_s = 0.0
        self._t0_ns = 0
        self._t0 = 0.0
        self._vm0: dict[str, int] = {}

    # -- lifecycle ----------------------------------------------------------------------------
    def open(self) -> "ReclaimRecorder":
        """Resolve, load the CO-RE object and attach."""
        from moetrace.kernel.bpf import load_core

        if self.features is not None and self.features.tracefs is None:
            from moetrace.kernel.features import tracefs_path

            self.features.tracefs = tracefs_path(self.features.root)
        self.attach, self.unavailable, have = resolve_attach(self.features, self._plan)
        self._t0_ns = time.monotonic_ns()  # bpf_ktime_get_ns() is CLOCK_MONOTONIC
        self.knobs = reclaim_knobs(have, self.bucket_ns, self.max_buckets, self._t0_ns, self.max_tasks)
        attach = [(c.fn_name, c.kind, c.target) for g, target in self.attach.items()
                  for c in SPEC.group(g).candidates if c.target == target]
        self.probe = load_core("reclaim", self.knobs, attach, _map_sizes(self.knobs), gated=self.gated)
        self.compile_s, self.attach_s = self.probe.compile_s, self.probe.attach_s
        self._vm0 = read_vmstat(self.vmstat_root)
        self._vm1 = None
        self._t0 = time.time()
        return self

    def arm(self, on: bool = True) -> None:
        """Start / stop counting (a gated load); the vmstat oracle's window is the same interval."""
        if self.probe is None:
            return
        if on:
            self._vm0 = read_vmstat(self.vmstat_root)
            self.probe.arm(True)
        else:
            self.probe.arm(False)
            self._vm1 = read_vmstat(self.vmstat_root)

    def __enter__(self) -> "ReclaimRecorder":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def _cleanup(self) -> None:
        if self.probe is not None:
            try:
                self.probe.close()
            finally:
                self.probe = None

    def close(self) -> ReclaimResult | None:
        """Read the kernel's aggregates, detach. Idempotent."""
        if self.probe is None:
            return self.result
        try:
            vm1 = self._vm1 if getattr(self, "_vm1", None) is not None else read_vmstat(self.vmstat_root)
            self.result = self._collect(vmstat_delta(self._vm0, vm1))
        finally:
            self._cleanup()
        return self.result

    def snapshot(self) -> ReclaimResult:
        """The aggregates so far, without detaching."""
        if self.probe is None:
            raise ProbeError("the reclaim probe is not attached")
        return self._collect(vmstat_delta(self._vm0, read_vmstat(self.vmstat_root)))

    # -- reading the kernel's side ------------------------------------------------------------
    def _percpu_array(self, name: str) -> np.ndarray:
        return self.probe.table(name).percpu_sums()

    def _timeline_counts(self) -> np.ndarray:
        """The timeline's per-CPU sums, reading only the buckets time has reached since open
        (bucket-major: ``(now - t0) // bucket_ns + 1`` of them) and the last one (where later
        events land); the rest are zero (a recording of `true` reads 1 bucket of 4096)."""
        t = self.probe.table("timeline")
        per = len(KINDS) * len(TIMELINE_FIELDS)
        used = min(self.max_buckets, (time.monotonic_ns() - self._t0_ns) // self.bucket_ns + 1)
        out = np.zeros(self.max_buckets * per, np.int64)
        out[:used * per] = t.percpu_sums(0, used * per)
        if used < self.max_buckets:
            out[-per:] = t.percpu_sums((self.max_buckets - 1) * per, per)
        return out

    def _collect(self, vm: dict[str, int]) -> ReclaimResult:
        nk, nf = len(KINDS), len(FIELDS)
        tot = self._percpu_array("totals").reshape(nk, nf)
        st = dict(zip(STATS, (int(x) for x in self._percpu_array("stats"))))
        hist = self._percpu_array("dur_hist").reshape(nk, HIST_SLOTS)
        open_windows = entry_count(self.probe.table("active"))
        by_fn = recursion_misses(self.probe.prog_fds(), 0)
        misses = {g: by_fn[GROUPS[g][0]] for g in self.attach if GROUPS[g][0] in by_fn}
        t = {f: tot[:, i] for i, f in enumerate(FIELDS)}
        with np.errstate(divide="ignore", invalid="ignore"):
            s2s = np.where(t["reclaimed"] > 0, t["scanned"] / np.maximum(t["reclaimed"], 1), np.nan)
            dmean = np.where(t["completed"] > 0, t["duration_ns"] / np.maximum(t["completed"], 1), np.nan)
        cols: dict[str, Any] = {
            "kind": pd.array(KINDS, dtype="string"),
            "invocations": t["invocations"], "completed": t["completed"],
            "scanned_pages": t["scanned"], "reclaimed_pages": t["reclaimed"], "scan_to_steal": s2s,
            "duration_ns_sum": t["duration_ns"], "duration_ns_mean": dmean,
            "end_reclaimed_pages": t["end_reclaimed"],
            "scanned_file_pages": t["scanned_file"], "reclaimed_file_pages": t["reclaimed_file"],
            "inactive_calls": t["inactive_calls"],
        }
        for f in ("dirty", "writeback", "congested", "immediate", "activate_anon", "activate_file", "ref_keep",
                  "unmap_fail"):
            cols[f + "_pages"] = t[f]
        cols["active_calls"] = t["active_calls"]
        for f in ("active_taken", "active_deactivated", "active_kept", "active_referenced"):
            cols[f + "_pages"] = t[f]
        cols["isolate_calls"] = t["isolate_calls"]
        for f in ("isolate_requested", "isolate_scanned", "isolate_skipped", "isolate_taken"):
            cols[f + "_pages"] = t[f]
        per_kind = pd.DataFrame(cols)[[c.name for c in SPEC.schema]]  # the declared table, in order

        ki, sl = np.nonzero(hist)
        lo, hi = log2_bounds(sl)  # the slot is moe_log2l(d) (moetrace.bpf.h)
        histogram = pd.DataFrame({
            "kind": pd.array([KINDS[i] for i in ki], dtype="string"),
            "slot": sl.astype("int32"),
            "lo_ns": lo,
            "hi_ns": hi,
            "invocations": hist[ki, sl].astype("int64"),
        })

        timeline = self._timeline()
        return ReclaimResult(per_kind=per_kind, histogram=histogram, timeline=timeline, stats=st,
                             open_windows=open_windows, recursion_misses=misses, attach=dict(self.attach),
                             unavailable=dict(self.unavailable), knobs=dict(self.knobs), vmstat=vm,
                             bucket_ns=self.bucket_ns, compile_s=self.compile_s, attach_s=self.attach_s,
                             start_s=self._t0, duration_s=time.time() - self._t0, t0_ns=self._t0_ns)

    def _timeline(self) -> pd.DataFrame:
        cols = ["time_ns", "who", "nr_scanned_pages", "nr_reclaimed_pages", "invocations", "duration_ns"]
        if self.bucket_ns <= 0:
            return pd.DataFrame({c: pd.Series(dtype="string" if c == "who" else "int64") for c in cols})
        nk, ntl = len(KINDS), len(TIMELINE_FIELDS)
        tl = self._timeline_counts().reshape(self.max_buckets, nk, ntl)
        b, k = np.nonzero(tl.any(axis=2))
        return pd.DataFrame({
            "time_ns": (b.astype(np.int64) * self.bucket_ns),
            "who": pd.array([KINDS[i] for i in k], dtype="string"),
            "nr_scanned_pages": tl[b, k, 0], "nr_reclaimed_pages": tl[b, k, 1],
            "invocations": tl[b, k, 2], "duration_ns": tl[b, k, 3],
        })


# -- the probe interface (moetrace record) -----------------------------------------------------

#: the timeline's bucket width in a recording (ns)
RECORD_BUCKET_NS = 100_000_000


class ReclaimProbe(EngineProbe):
    """The reclaim probe in a recording: :class:`ReclaimRecorder` (the BPF programs, aggregated
    in the kernel), armed with the others; the reclaim / reclaim_histogram (/ reclaim_timeline)
    tables and the vmstat cross-check over the same interval."""

    name = "reclaim"
    spec = SPEC
    error = ProbeError

    def open(self) -> "ReclaimProbe":
        self.require_plan()
        # per-100-ms buckets: the reports' scan-to-steal over time (4096 buckets = 6.8 min; later
        # events land in the last one)
        self.engine = ReclaimRecorder(bucket_ns=RECORD_BUCKET_NS, features=self.ctx.features, plan=self.ctx.plan,
                                      gated=self.ctx.gated).open()
        self.probe = self.engine.probe  # the handle: prog_fds / prog_ids and the manifest's loader
        self.knobs = dict(self.engine.knobs)
        self.compile_attach_s = self.engine.compile_s + self.engine.attach_s
        return self

    def write(self, run_dir: Path, manifest: dict[str, Any]) -> None:
        from moetrace.run import directory as rd

        rres = self.result
        tables = manifest.setdefault("tables", {})
        rd.write_table(run_dir, SPEC.table, rres.per_kind)
        tables[SPEC.table] = schema_doc(SPEC, SPEC.table)
        rd.write_table(run_dir, "reclaim_histogram", rres.histogram)
        tables["reclaim_histogram"] = schema_doc(SPEC, "reclaim_histogram")
        if rres.bucket_ns > 0:
            rd.write_table(run_dir, "reclaim_timeline", rres.timeline)
            tables["reclaim_timeline"] = schema_doc(SPEC, "reclaim_timeline")
        manifest.setdefault("summaries", {})["reclaim"] = rres.summary()
        manifest.setdefault("stats", {})["reclaim"] = dict(rres.stats)
        manifest.setdefault("lost", {})["reclaim"] = {"lost_events": 0, "recursion_misses": rres.recursion_misses,
                                                      "open_windows": rres.open_windows,
                                                      "note": "aggregated in the kernel: no stream to lose"}
