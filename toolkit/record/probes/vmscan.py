"""The ``vmscan`` probe: page reclaim batch by batch, and who ran each batch.

probes/vmscan.bpf.c (CO-RE) makes one ring record per kswapd wake-up
(``vmscan:mm_vmscan_kswapd_wake``: node, zone, order) and sleep (``mm_vmscan_kswapd_sleep``),
and one per ``mm_vmscan_lru_shrink_inactive`` batch: pages scanned, reclaimed, kept referenced
(``nr_ref_keep``), activated (anon, file), failed to unmap, the scan priority and the list
(file or anon), with who ran it: ``kswapd`` (PF_KSWAPD in current->flags), ``direct`` (inside
the task's ``mm_vmscan_direct_reclaim_begin/end``: global direct reclaim), ``memcg`` (inside
``mm_vmscan_memcg_reclaim_begin/end``: limit, high or memory.reclaim) or ``other``. Two
bounded rings (``wakes``, ``batches``); a record the kernel had no room for, or one beyond
``record --stream-max-records``, is counted lost per interval, never dropped silently.

Machine-wide: every batch of every reclaimer counts, not only the command's (``tgid`` says
whose it was). The summary holds the /proc/vmstat deltas over the armed interval that the
kernel counts on the same lines (``pgsteal_anon + pgsteal_file``: every batch;
``pgsteal_kswapd`` / ``pgsteal_direct``: global reclaim only, so a memcg's own reclaim is in
neither) and the probe's sums beside them. Not in the default set: ``record --probes vmscan``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from moetrace.lazyimport import pandas as pd

from moetrace.errors import ProbeError
from moetrace.record.probe import ProbeRecorder
from moetrace.record.spec import Knob, ProbeSpec, Struct, group, tp_cand
from moetrace.run.tables import Column

#: who ran a batch, in the C file's WHO_* order
WHO = ("kswapd", "direct", "memcg", "other")
#: kswapd record kinds, in the C file's order
WAKE_KINDS = ("wake", "sleep")
#: /proc/vmstat counters the summary compares the batches with (deltas over the armed interval)
VMSTAT_KEYS = ("pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct", "pgscan_anon", "pgscan_file",
               "pgsteal_anon", "pgsteal_file")
_SHRINK_FIELDS = ("nid", "nr_scanned", "nr_reclaimed", "nr_ref_keep", "nr_activate0", "nr_activate1",
                  "nr_unmap_fail", "priority", "reclaim_flags")


def _window(event: str, knob: str, note: str):
    return group(event, tp_cand(f"vmscan:mm_vmscan_{event}", note=note), required=False, knob=knob)


SPEC = ProbeSpec(
    name="vmscan",
    recorder="VmscanRecorder",
    order=90,
    description="page reclaim batch by batch: kswapd wake-ups (node, zone, order) and sleeps, every "
                "shrink_inactive batch (scanned, reclaimed, referenced kept, activated, unmap failures, "
                "priority, file/anon) with who ran it (kswapd, direct, memcg, other); bounded rings, lost counted",
    attach=(
        group("kswapd_wake", tp_cand("vmscan:mm_vmscan_kswapd_wake", fields=("nid", "zid", "order"),
                                     note="on the kswapd thread when it wakes to balance a node")),
        group("kswapd_sleep", tp_cand("vmscan:mm_vmscan_kswapd_sleep", fields=("nid",),
                                      note="kswapd goes to sleep: the node is balanced")),
        group("shrink_inactive", tp_cand("vmscan:mm_vmscan_lru_shrink_inactive", fields=_SHRINK_FIELDS,
                                         note="one batch of shrink_inactive_list that isolated a folio; "
                                              "nr_ref_keep / nr_unmap_fail since the reclaim stats rework (4.16)")),
        _window("direct_reclaim_begin", "MOE_HAVE_DIRECT", "opens a task's global direct-reclaim window"),
        _window("direct_reclaim_end", "MOE_HAVE_DIRECT", "closes it"),
        _window("memcg_reclaim_begin", "MOE_HAVE_MEMCG", "opens a task's memcg reclaim window (limit, high, "
                                                        "memory.reclaim)"),
        _window("memcg_reclaim_end", "MOE_HAVE_MEMCG", "closes it"),
    ),
    knobs=(
        Knob("MOE_HAVE_DIRECT", 1, "1: the direct-reclaim window is kept (set from the attach plan)"),
        Knob("MOE_HAVE_MEMCG", 1, "1: the memcg reclaim window is kept (set from the attach plan)"),
        Knob("MOE_MAX_TASKS", 4096, "tasks inside a reclaim window at once (entries of task_ctx)"),
        Knob("MOE_RINGBUF_PAGES", 64, "each ring's size in pages (power of two)"),
    ),
    default=False,
    enrichment=True,
    table="vmscan_batches",
    schema=(
        Column("time_ns", "int64", "ns", "CLOCK_MONOTONIC at the batch's end", check="n"),
        Column("nid", "int32", "", "the node"),
        Column("who", "string", "", "kswapd (PF_KSWAPD), direct (global direct reclaim), memcg (a memcg's limit, "
                                    "high or memory.reclaim), other", check="s"),
        Column("file", "bool", "", "the file LRU (else anon)", check="b"),
        Column("priority", "int32", "", "the scan priority (12: a first pass, lower: harder)"),
        Column("scanned_pages", "int64", "pages", "nr_scanned", check="n"),
        Column("reclaimed_pages", "int64", "pages", "nr_reclaimed", check="n"),
        Column("ref_keep_pages", "int64", "pages", "nr_ref_keep: referenced, kept on the list"),
        Column("activate_anon_pages", "int64", "pages", "nr_activate0: moved to the active anon list"),
        Column("activate_file_pages", "int64", "pages", "nr_activate1: moved to the active file list"),
        Column("unmap_fail_pages", "int64", "pages", "nr_unmap_fail: mapped pages that could not be unmapped"),
        Column("tgid", "int32", "", "the reclaiming task's process (kswapd: its thread)"),
        Column("pid", "int32", "", "the reclaiming thread"),
    ),
    more_tables=(("vmscan_wakes", (
        Column("time_ns", "int64", "ns", "CLOCK_MONOTONIC of the event", check="n"),
        Column("kind", "string", "", "wake or sleep", check="s"),
        Column("nid", "int32", "", "the node"),
        Column("zid", "int32", "", "wake: the highest zone index asked for (sleep: 0)"),
        Column("order", "int32", "", "wake: the allocation order kswapd reclaims for (sleep: 0)"),
        Column("pid", "int32", "", "the kswapd thread"),
    )),),
    stats=("wake_records", "wake_lost", "batch_records", "batch_lost", "task_map_full"),
    structs=(
        Struct("vmscan_wake", (("ts_ns", "u64"), ("nid", "u32"), ("zid", "u32"), ("order", "u32"), ("kind", "u32"),
                               ("pid", "u32"), ("pad", "u32"))),
        Struct("vmscan_batch", (("ts_ns", "u64"), ("nr_scanned", "u64"), ("nr_reclaimed", "u64"),
                                ("nr_ref_keep", "u64"), ("nr_unmap_fail", "u64"), ("nr_activate_anon", "u32"),
                                ("nr_activate_file", "u32"), ("nid", "u32"), ("priority", "s32"), ("file", "u32"),
                                ("who", "u32"), ("tgid", "u32"), ("pid", "u32"))),
    ),
    map_sizes=lambda k: {"task_ctx": int(k["MOE_MAX_TASKS"]), "stats": len(SPEC.stats),
                         "wakes": 4096 * int(k["MOE_RINGBUF_PAGES"]), "batches": 4096 * int(k["MOE_RINGBUF_PAGES"])},
)

WAKE_DTYPE = SPEC.struct("vmscan_wake").dtype()
BATCH_DTYPE = SPEC.struct("vmscan_batch").dtype()
#: the user-space bound on kept records per ring
MAX_RECORDS = 2_000_000


def _frame(table: str, cols: dict[str, Any]) -> pd.DataFrame:
    decl = dict(SPEC.tables())[table]
    return pd.DataFrame({c.name: pd.array(cols[c.name], dtype=c.dtype) for c in decl})


def batches_table(raw: bytes) -> pd.DataFrame:
    """vmscan_batches from the ring's records."""
    r = np.frombuffer(raw, BATCH_DTYPE)
    return _frame("vmscan_batches", {
        "time_ns": r["ts_ns"].astype(np.int64), "nid": r["nid"].astype(np.int32),
        "who": [WHO[w] if w < len(WHO) else "other" for w in r["who"].tolist()], "file": r["file"] != 0,
        "priority": r["priority"].astype(np.int32), "scanned_pages": r["nr_scanned"].astype(np.int64),
        "reclaimed_pages": r["nr_reclaimed"].astype(np.int64), "ref_keep_pages": r["nr_ref_keep"].astype(np.int64),
        "activate_anon_pages": r["nr_activate_anon"].astype(np.int64),
        "activate_file_pages": r["nr_activate_file"].astype(np.int64),
        "unmap_fail_pages": r["nr_unmap_fail"].astype(np.int64), "tgid": r["tgid"].astype(np.int32),
        "pid": r["pid"].astype(np.int32)})


def wakes_table(raw: bytes) -> pd.DataFrame:
    """vmscan_wakes from the ring's records."""
    r = np.frombuffer(raw, WAKE_DTYPE)
    return _frame("vmscan_wakes", {
        "time_ns": r["ts_ns"].astype(np.int64), "kind": [WAKE_KINDS[min(k, 1)] for k in r["kind"].tolist()],
        "nid": r["nid"].astype(np.int32), "zid": r["zid"].astype(np.int32), "order": r["order"].astype(np.int32),
        "pid": r["pid"].astype(np.int32)})


def summarize(batches: pd.DataFrame, wakes: pd.DataFrame, vmstat: dict[str, int] | None) -> dict[str, Any]:
    """Per reclaimer: batches, scanned, reclaimed (file and anon); kswapd wakes and sleeps; and the
    /proc/vmstat deltas beside the sums the kernel counts on the same lines."""
    by = {w: batches[batches["who"] == w] for w in WHO}
    out: dict[str, Any] = {
        "who": {w: {"batches": int(len(b)), "scanned_pages": int(b["scanned_pages"].sum()),
                    "reclaimed_pages": int(b["reclaimed_pages"].sum()),
                    "reclaimed_file_pages": int(b.loc[b["file"], "reclaimed_pages"].sum())} for w, b in by.items()},
        "kswapd": {"wakes": int((wakes["kind"] == "wake").sum()), "sleeps": int((wakes["kind"] == "sleep").sum()),
                   "max_order": int(wakes["order"].max()) if len(wakes) else None},
    }
    if vmstat is not None:
        s = out["who"]
        out["vmstat_delta"] = dict(vmstat)
        out["vmstat_check"] = {
            "batches_scanned_pages": int(batches["scanned_pages"].sum()),
            "vmstat_pgscan": vmstat.get("pgscan_anon", 0) + vmstat.get("pgscan_file", 0),
            "batches_reclaimed_pages": int(batches["reclaimed_pages"].sum()),
            "vmstat_pgsteal": vmstat.get("pgsteal_anon", 0) + vmstat.get("pgsteal_file", 0),
            "kswapd_reclaimed_pages": s["kswapd"]["reclaimed_pages"], "vmstat_pgsteal_kswapd": vmstat.get("pgsteal_kswapd"),
            "direct_reclaimed_pages": s["direct"]["reclaimed_pages"], "vmstat_pgsteal_direct": vmstat.get("pgsteal_direct"),
            "note": "pgsteal_{anon,file} count every batch; pgsteal_kswapd / _direct global reclaim only (a memcg's "
                    "own reclaim is in its memory.stat); pgscan also counts scans that isolated nothing (no record)",
        }
    return out


class VmscanRecorder(ProbeRecorder):
    """``record --probes vmscan``: attach probes/vmscan.bpf.c, drain its two rings while the
    command runs, write ``vmscan_batches`` and ``vmscan_wakes`` (machine-wide: ``follow`` is a no-op)."""

    name = "vmscan"
    spec = SPEC
    error = ProbeError
    needs_poll = True
    vmstat_keys = VMSTAT_KEYS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.wakes = self.batches = None
        self.stats: dict[str, int] = {}
        self.misses: dict[str, int | None] = {}
        self.tables: dict[str, pd.DataFrame] = {}

    def open(self) -> "VmscanRecorder":
        from moetrace.kernel.bpf import EventStream

        plan = self.require_plan()
        self.knobs = self.with_user_knobs({k: int(v) for k, v in SPEC.knob_values(**plan.knobs).items()})
        self.load_planned(self.knobs)
        bound = min(self.ctx.stream_max_records, MAX_RECORDS)
        self.wakes = EventStream(self.probe, "wakes", WAKE_DTYPE.itemsize, kernel_lost=self.stat_reader("wake_lost"),
                                 max_records=bound)
        self.batches = EventStream(self.probe, "batches", BATCH_DTYPE.itemsize,
                                   kernel_lost=self.stat_reader("batch_lost"), max_records=bound)
        for e in plan.entries:
            if not e.attached:
                self.ctx.notes.append(f"vmscan: {e.group} unavailable ({e.reason}): its batches count as other")
        self.mark_vmstat(0)
        return self

    def poll(self, timeout_ms: int = 0) -> None:
        if self.batches is not None and not self.closed:
            self.batches.poll(max(0, int(timeout_ms)))
            self.wakes.poll(0)

    def close(self) -> None:
        """Drain both rings, read the stats slots and recursion misses, detach (idempotent)."""
        got: dict[str, bytes] = {}

        def read() -> None:
            for s in (self.wakes, self.batches):
                s.finish()
            got.update(wakes=self.wakes.records(), batches=self.batches.records())
            self.stats = self.read_stats()
            self.misses = self.recursion_misses()

        if not self.collect(read):
            return
        self.tables = {"vmscan_batches": batches_table(got["batches"]), "vmscan_wakes": wakes_table(got["wakes"])}
        self.collected = True

    def lost(self) -> dict[str, Any]:
        """The manifest's ``lost["vmscan"]``: records lost per ring (kernel: ring full; user: beyond the bound)."""
        return {ring: {"records": s.kept, "lost_kernel": s.lost_kernel, "lost_user": s.lost_user,
                       "intervals": [vars(i) for i in s.intervals]}
                for ring, s in (("batches", self.batches), ("wakes", self.wakes))} | {
            "lost_events": self.batches.lost_kernel + self.batches.lost_user + self.wakes.lost_kernel
            + self.wakes.lost_user,
            "task_map_full": self.stats.get("task_map_full", 0),
            "recursion_misses": dict(self.misses),
            "note": "a lost batch is missing from vmscan_batches (its pages still in /proc/vmstat); a window begin "
                    "the full task map could not keep leaves its batches as other"}

    def write(self, run_dir: Path, manifest: dict[str, Any]) -> None:
        """vmscan_batches.parquet, vmscan_wakes.parquet and this probe's manifest sections."""
        self.write_tables(run_dir, manifest, self.tables)
        summary = summarize(self.tables["vmscan_batches"], self.tables["vmscan_wakes"], self.vmstat_delta())
        summary["knobs"] = dict(self.knobs)
        self.write_sections(manifest, self.stats, self.lost(), summary)
