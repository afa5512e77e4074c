"""The pagecache probe's recorder (probes/pagecache.bpf.c): per-expert pages added (misses),
evicted (by evictor class) and re-added (exact, per page), per epoch when the replay moves
the epoch, and the per-page event stream with ``--stream-events``.

It feeds the run's ``experts`` table (with block's device bytes: :func:`experts_table`),
``epochs`` / ``expert_epochs`` and ``page_events`` / ``stream_intervals``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
from moetrace.lazyimport import pandas as pd

from moetrace.record.spec import FOLIO_ORDER, AttachGroup, Knob, ProbeSpec, Struct, tp_cand, group
from moetrace.run.tables import EXPERTS_PAGECACHE, named_tables
from moetrace.errors import ProbeError
from moetrace.kernel.syscalls import close_fd
from moetrace.record.probe import ProbeRecorder, schema_doc
from moetrace.record.poolmap import EXTRA_SLOTS
from moetrace.run.evictors import EVICTOR_DOCS, EVICTORS  # noqa: F401  (re-exported: the run tables' vocabulary)

# -- the declaration: attach candidates, knobs, tables (probes/pagecache.bpf.c agrees: tests/probe_build/test_core_objects.py)

_FOLIO_FIELDS = ("i_ino", "index", "s_dev")
_READ_EXITS = ("pread64", "preadv", "preadv2", "read")
_CTX_INVALIDATE = ("fadvise64", "truncate", "ftruncate", "fallocate", "unlink", "unlinkat", "madvise")


def _ctx_groups() -> tuple[AttachGroup, ...]:
    """The evictor-context groups of pagecache: syscall and reclaim-window entry/exit pairs."""
    out = [group(f"ctx_{d}_write", tp_cand(f"syscalls:sys_{d}_write", fields=("count",) if d == "enter" else (),
                                        note="a write(2) in flight: drop_caches, or memory.reclaim when small"),
              required=False, knob="MOE_CTX_WRITE") for d in ("enter", "exit")]
    for sc in _CTX_INVALIDATE:
        for d in ("enter", "exit"):
            fields = {"madvise": ("behavior",), "fadvise64": ("advice",)}.get(sc, ()) if d == "enter" else ()
            out.append(group(f"ctx_{d}_{sc}", tp_cand(f"syscalls:sys_{d}_{sc}", fields=fields,
                                                    note="an invalidating syscall in flight (evictor class)"),
                          required=False, knob="MOE_CTX_INVALIDATE"))
    for d in ("enter", "exit"):
        out.append(group(f"ctx_{d}_mmap", tp_cand(f"syscalls:sys_{d}_mmap", fields=("flags",) if d == "enter" else (),
                                                note="an mmap(MAP_POPULATE) in flight: the pages it adds are populate"),
                         required=False, knob="MOE_CTX_POPULATE"))
    for w in ("direct", "memcg"):
        for d in ("begin", "end"):
            out.append(group(f"ctx_{w}_{d}", tp_cand(f"vmscan:mm_vmscan_{w}_reclaim_{d}",
                                                   note=f"a {w} reclaim window open on the task (evictor class)"),
                          required=False, knob="MOE_CTX_RECLAIM"))
    return tuple(out)

#: probes/pagecache.bpf.c. Reads only tracepoint arguments.
PAGECACHE = ProbeSpec(
    name="pagecache",
    recorder="PagecacheRecorder",
    order=10,
    user_knobs=False,
    experts=True,
    description="per-expert added (miss) / evicted / re-added (exact, per page) pages in the kernel; "
                "requested pages from the replay's accounting, hits = requested - added",
    attach=(
        group("add", tp_cand("filemap:mm_filemap_add_to_page_cache", fields=_FOLIO_FIELDS, field_knobs=FOLIO_ORDER,
                          note="a folio added to the page cache: a miss (readahead included); stable "
                               "tracepoint (pfn, i_ino, index, s_dev); `order` since large folios "
                               "(6.x): pages = 1 << order, else one page per event")),
        group("delete", tp_cand("filemap:mm_filemap_delete_from_page_cache", fields=_FOLIO_FIELDS,
                             field_knobs=FOLIO_ORDER, note="a folio deleted from the page cache: an eviction "
                                                      "(or truncation); carries order like add")),
    ) + tuple(
        group(f"exit_{sc}", tp_cand(f"syscalls:sys_exit_{sc}", fields=("ret",),
                                 note="read bytes of the followed processes (a cross-check of the replay's "
                                      "accounting; fd -> inode would need kernel structs)"),
           required=False, knob="MOE_TRACK_READS")
        for sc in _READ_EXITS
    ) + (
        group("newtask", tp_cand("task:task_newtask", fields=("pid", "clone_flags"),
                              note="follow the command's child processes (threads share the tgid)"),
           required=False, knob="MOE_FOLLOW_FORKS"),
        group("fault", tp_cand("filemap:mm_filemap_fault", fields=("i_ino", "s_dev", "index"),
                            note="a page fault on a file page (6.11+): the page it asks for is demand, the other "
                                 "pages its read adds readahead; without it they count as other"),
           required=False, knob="MOE_HAVE_FAULT"),
    ) + _ctx_groups(),
    knobs=(
        Knob("MOE_POOL_DEV", 0,
             "s_dev of the pool's filesystem, kernel encoding (major << 20) | minor; 0: every device",
             was="POOL_DEV"),
        Knob("MOE_N_EXPERTS", 0, "experts in the pool (counts has MOE_N_EXPERTS + 3 slots: then unattributed, "
                                 "shared, non_expert)", was="N_EXPERTS"),
        Knob("MOE_N_FILES", 0, "mapped files (the inodes map's entries)"),
        Knob("MOE_N_RUNS", 0, "runs of the mapped files (record/poolmap.py: page ranges of one owner)"),
        Knob("MOE_BM_WORDS", 0, "64-bit words of the re-add bitmap (one bit per mapped page)"),
        Knob("MOE_SEARCH_STEPS", 0, "binary-search halvings that find any page's run: ceil(log2(largest window))"),
        Knob("MOE_HAVE_ORDER", 1, "1: the add/delete formats carry the folio order (set from the format files)",
             was="HAVE_ORDER"),
        Knob("MOE_MAX_FOLIO_PAGES", 512, "largest folio handled in full; pages beyond it count as unprocessed",
             was="MAX_FOLIO_PAGES"),
        Knob("MOE_MAX_SEGS", 514, "derived: pieces one folio may be cut into = MOE_MAX_FOLIO_PAGES + 2",
             was="MAX_SEGS"),
        Knob("MOE_MAX_WPS", 10, "derived: bitmap words one piece may span = MOE_MAX_FOLIO_PAGES / 64 + 2",
             was="MAX_WPS"),
        Knob("MOE_TRACK_READS", 1, "1: count read-syscall bytes of the followed tgids (exit_* groups)",
             was="TRACK_READS"),
        Knob("MOE_FOLLOW_FORKS", 1, "1: a followed tgid's new processes are followed too (newtask group)",
             was="FOLLOW_FORKS"),
        Knob("MOE_STREAM_EVENTS", 0, "1: one ring record per (event, expert piece): the per-page stream",
             was="STREAM_EVENTS"),
        Knob("MOE_RING_PAGES", 256, "ring buffer size in pages (power of two) when streaming", was="RING_PAGES"),
        Knob("MOE_EPOCHS", 0, "0: totals only; > 0: per-epoch counters too (MOE_EPOCHS x (MOE_N_EXPERTS + 3) slots; "
                          "the replay writes one epoch per iteration into epoch_now)", was="EPOCHS"),
        Knob("MOE_CTX_WRITE", 1, "1: the write(2) evictor context (drop_caches; memory.reclaim when small)"),
        Knob("MOE_CTX_INVALIDATE", 1, "1: the fadvise64 / truncate-family / madvise evictor contexts"),
        Knob("MOE_CTX_RECLAIM", 1, "1: the direct / memcg reclaim windows (evictor context)"),
        Knob("MOE_MAX_TASKS", 16384, "task -> evictor context entries (LRU hash), and task -> last fault"),
        Knob("MOE_HAVE_FAULT", 1, "1: the fault group (filemap:mm_filemap_fault) tells demand pages from readahead"),
        Knob("MOE_CTX_POPULATE", 1, "1: the mmap group (MAP_POPULATE windows: the populate cause)"),
    ),
    table="experts",
    schema=EXPERTS_PAGECACHE,
    map_sizes=lambda k: _map_sizes(k),
    derived=lambda k: _derived(k),
    more_tables=named_tables("expert_epochs", "epochs"),
    stats=("add_events", "delete_events", "pool_dev_add_events", "pool_dev_delete_events", "unprocessed_pages",
           "read_bytes", "read_calls", "tgid_map_full", "ring_drops", "bitmap_misses", "dev_mismatch_events",
           "add_runs", "run_misses", "fault_events"),
    structs=(
        Struct("expert_counts", (("added_pages", "u64"), ("evicted_pages", "u64"), ("re_added_pages", "u64"))),
        Struct("moe_win", (("first", "u32"), ("count", "u32"), ("bm_base", "u64"), ("pages", "u64"))),
        Struct("moe_run", (("start", "u32"), ("pages", "u32"), ("slot", "u32"), ("epage", "u32"))),
        Struct("page_event", (("ts_ns", "u64"), ("expert_id", "u32"), ("kind", "u32"), ("first_page", "u32"),
                              ("pages", "u32"), ("re_added", "u32"), ("tgid", "u32"), ("evictor", "u32"),
                              ("reserved", "u32"))),
    ),
)

SPEC = PAGECACHE
MAX_TGIDS = 1024
#: why a page was added (probes/pagecache.bpf.c CAUSE_*, in order)
CAUSES = ("demand", "readahead", "populate", "other")
N_ORDERS = 16


def _derived(k: dict) -> dict[str, int]:
    """The loop bounds (the verifier tracks no division, so the loader computes them)."""
    mfp = int(k["MOE_MAX_FOLIO_PAGES"])
    return {"MOE_MAX_SEGS": mfp + 2, "MOE_MAX_WPS": mfp // 64 + 2}


def _map_sizes(k: dict[str, int]) -> dict[str, int]:
    """The CO-RE object's map sizes from its knobs (probes/pagecache.bpf.c names the maps)."""
    n, ev = int(k["MOE_N_EXPERTS"]) + len(EXTRA_SLOTS), 9  # 9: N_EVICTORS (moetrace.bpf.h; EVICTORS here)
    eps = int(k["MOE_EPOCHS"])
    return {"inodes": int(k["MOE_N_FILES"]) + 16, "runs": max(1, int(k["MOE_N_RUNS"])), "counts": n,
            "evicted_bm": max(1, int(k["MOE_BM_WORDS"])), "stats": len(SPEC.stats),
            "tgids": MAX_TGIDS, "evictors": n * ev, "task_ctx": int(k["MOE_MAX_TASKS"]),
            "events": 4096 * (int(k["MOE_RING_PAGES"]) if k["MOE_STREAM_EVENTS"] else 1), "epoch_now": 1,
            "epoch_counts": max(1, eps * n), "epoch_evictors": max(1, eps * ev),
            "faults": int(k["MOE_MAX_TASKS"]), "causes": n * len(CAUSES), "epoch_causes": max(1, eps * len(CAUSES)),
            "orders": len(CAUSES) * N_ORDERS}
#: bytes per entry of the maps a pool sizes: the value (arrays), key + value + the hash table's
#: ~48-byte element header (inodes)
MAP_ENTRY_BYTES = {"inodes": 8 + 24 + 48, "runs": 16, "evicted_bm": 8, "counts": 24, "evictors": 8,
                   "epoch_counts": 24, "epoch_evictors": 8}


def map_budget(knobs: dict[str, int]) -> dict[str, int]:
    """Kernel bytes of the maps the pool sizes (README "Model files": the budget), per map."""
    sizes = _map_sizes(knobs)
    return {m: sizes[m] * b for m, b in MAP_ENTRY_BYTES.items()}


PAGE_EVENT_DTYPE = SPEC.struct("page_event").dtype()
WIN_DTYPE = SPEC.struct("moe_win").dtype()
EXPERT_COUNTS_DTYPE = SPEC.struct("expert_counts").dtype()
U64 = np.dtype("<u8")


def pagecache_knobs(plan_knobs: dict[str, int], pmap, stream: bool, reads_recorded: bool,
                    user: dict[str, int] | None = None) -> dict[str, int]:
    """Every knob: the declaration's defaults, the attach plan's, the pool's, then ``user``'s
    (``record --knob``, already checked), then the derived ones."""
    from moetrace.run.epochs import epochs_for

    over: dict[str, int] = dict(plan_knobs)
    if pmap is not None:
        over.update(MOE_POOL_DEV=pmap.dev, MOE_N_EXPERTS=pmap.n_total, MOE_N_FILES=len(pmap.windows),
                    MOE_N_RUNS=len(pmap.runs), MOE_BM_WORDS=pmap.bitmap_words, MOE_SEARCH_STEPS=pmap.search_steps,
                    MOE_EPOCHS=epochs_for(pmap.n_slots))
    over["MOE_STREAM_EVENTS"] = int(stream)
    if reads_recorded:
        over["MOE_TRACK_READS"] = 0  # the reads probe counts every read call: not twice
    over.update(user or {})
    return {k: int(v) for k, v in SPEC.knob_values(**over).items()}


def fill_pool_maps(probe, pmap) -> None:
    """The pool map's windows and runs into the probe's inodes and runs maps."""
    from moetrace.record.poolmap import RUN_DTYPE

    w = pmap.windows
    keys = np.array(list(w), np.uint64)
    vals = np.array([tuple(v) for v in w.values()], WIN_DTYPE)
    probe.table("inodes").update_batch(keys, vals)
    runs = np.ascontiguousarray(pmap.runs, RUN_DTYPE)
    probe.table("runs").update_batch(np.arange(len(runs), dtype=np.uint32), runs)


class PagecacheRecorder(ProbeRecorder):
    name = "pagecache"
    spec = SPEC
    error = ProbeError

    def __init__(self, ctx):
        super().__init__(ctx)
        self.stream = None
        self.epoch_fd: int | None = None
        self.counts = self.evictors = self.causes = self.orders = None
        self.epoch_counts = self.epoch_evictors = self.epoch_causes = None
        self.stats: dict[str, int] = {}
        self.misses: dict[str, int | None] = {}
        self.events_raw: bytes | None = None
        self.intervals = None

    @property
    def needs_poll(self) -> bool:  # type: ignore[override]
        return self.stream is not None

    def open(self) -> "PagecacheRecorder":
        from moetrace.kernel.bpf import EventStream

        plan = self.require_plan()
        knobs = pagecache_knobs(plan.knobs, self.ctx.pmap, self.ctx.stream,
                                reads_recorded="reads" in self.ctx.recording, user=self.with_user_knobs({}))
        self.knobs = knobs
        if not knobs["MOE_HAVE_ORDER"]:
            self.ctx.notes.append("add/delete tracepoints carry no folio order: every event counts one page")
        self.load_planned(knobs)
        off = {g.name for g in SPEC.attach if g.knob is not None and not knobs.get(g.knob, 1)}
        if off and not knobs["MOE_TRACK_READS"]:
            self.switched_off = {g: "MOE_TRACK_READS=0: the reads probe times every read call"
                                 for g in sorted(off) if g.startswith("exit_")}
        pmap = self.ctx.pmap
        if pmap is not None:
            fill_pool_maps(self.probe, pmap)
        if self.ctx.stream:
            self.stream = EventStream(self.probe, "events", PAGE_EVENT_DTYPE.itemsize,
                                      kernel_lost=self.stat_reader("ring_drops"),
                                      max_records=self.ctx.stream_max_records)
        if knobs.get("MOE_EPOCHS"):
            # the replay writes the epoch itself (moetrace.replay.epochs.EpochWriter): an inherited
            # fd of the one-entry epoch_now map, not a round trip per iteration
            self.epoch_fd = os.dup(self.probe.table("epoch_now").fd)
            os.set_inheritable(self.epoch_fd, True)
        return self

    def child_env(self) -> dict[str, str]:
        """What the command inherits: the epoch map's fd and slots."""
        if self.epoch_fd is None:
            return {}
        from moetrace.run.epochs import EPOCH_MAP_FD_ENV, EPOCHS_ENV

        return {EPOCH_MAP_FD_ENV: str(self.epoch_fd), EPOCHS_ENV: str(self.knobs["MOE_EPOCHS"])}

    def child_started(self) -> None:
        """The command has the epoch fd; ours is not needed any more."""
        if self.epoch_fd is not None:
            os.close(self.epoch_fd)
            self.epoch_fd = None

    def follow(self, pid: int) -> None:
        self.probe.put("tgids", struct.pack("<I", pid), b"\x01")

    def poll(self, timeout_ms: int = 0) -> None:
        if self.stream is not None:
            self.stream.poll(timeout_ms)

    def counters(self) -> dict[str, Any] | None:
        """Cumulative per-slot counts (experts + the unattributed slot last): added, evicted and
        re-added pages, pages evicted per evictor class (columns in EVICTORS order), and the
        followed tasks' read calls and bytes. Once closed, what close() read."""
        from moetrace.kernel.bpf import read_array

        if self.collected:
            c, ev, st = self.counts, self.evictors, self.stats
        elif self.probe is None or self.probe.closed:
            return None
        else:
            c = read_array(self.probe.table("counts"), EXPERT_COUNTS_DTYPE)
            ev = read_array(self.probe.table("evictors"), U64).astype(np.int64).reshape(-1, len(EVICTORS))
            st = self.read_stats()
        return {"added_pages": c["added_pages"].astype(np.int64), "evicted_pages": c["evicted_pages"].astype(np.int64),
                "re_added_pages": c["re_added_pages"].astype(np.int64), "evicted_by": ev.copy(),
                "read_bytes": int(st["read_bytes"]), "read_calls": int(st["read_calls"])}

    def close(self) -> None:
        """Read the counters (totals, evictors, epochs, stats), finish the stream, detach."""
        from moetrace.kernel.bpf import read_array

        if self.closed:
            return
        if self.probe is None or self.probe.closed:
            self.closed = True
            return
        try:
            if self.stream is not None:
                self.stream.finish()
                self.events_raw = self.stream.records()
                self.intervals = self.stream.intervals
            self.counts = read_array(self.probe.table("counts"), EXPERT_COUNTS_DTYPE)
            self.evictors = read_array(self.probe.table("evictors"), U64).astype(np.int64).reshape(-1, len(EVICTORS))
            self.causes = read_array(self.probe.table("causes"), U64).astype(np.int64).reshape(-1, len(CAUSES))
            self.orders = read_array(self.probe.table("orders"), U64).astype(np.int64).reshape(len(CAUSES), N_ORDERS)
            if self.knobs.get("MOE_EPOCHS"):  # as far as the counts reached (~100 MB for every slot)
                # epoch_hi is a plain max from every CPU (a raise can lose a race to a lower one):
                # the replay's last epoch bounds it too
                last = int(read_array(self.probe.table("epoch_now"), np.uint32)[0])
                reached = max(self.probe.obj.load_u32("epoch_hi"), min(last, int(self.knobs["MOE_EPOCHS"]) - 1)) + 1
                slots = int(self.knobs["MOE_N_EXPERTS"]) + len(EXTRA_SLOTS)
                self.epoch_counts = read_array(self.probe.table("epoch_counts"), EXPERT_COUNTS_DTYPE,
                                               n=reached * slots)
                self.epoch_evictors = read_array(self.probe.table("epoch_evictors"), U64,
                                                 n=reached * len(EVICTORS)).astype(np.int64).reshape(-1, len(EVICTORS))
                self.epoch_causes = read_array(self.probe.table("epoch_causes"), U64,
                                               n=reached * len(CAUSES)).astype(np.int64).reshape(-1, len(CAUSES))
            self.stats = self.read_stats()
            self.misses = self.recursion_misses()
        except Exception as e:  # noqa: BLE001 - a read failure must still detach
            self.abort()
            raise ProbeError(f"reading the pagecache probe's maps failed: {e}") from None
        self.abort()
        self.collected = True

    def abort(self) -> None:
        close_fd(self.epoch_fd)
        self.epoch_fd = None
        super().abort()

    def cause_array(self, a: np.ndarray | None) -> np.ndarray | None:
        """``a`` (rows x CAUSES) with demand and readahead NA (-1) when no fault was seen."""
        if a is None or self.knobs.get("MOE_HAVE_FAULT"):
            return a
        out = a.copy()
        out[:, :2] = -1
        return out

    # -- tables -------------------------------------------------------------------------------
    def expert_counts(self) -> list[tuple[int, int, int]] | None:
        if self.counts is None:
            return None
        c = self.counts
        return list(zip(c["added_pages"].tolist(), c["evicted_pages"].tolist(), c["re_added_pages"].tolist()))

    def write(self, run_dir: Path, manifest: dict[str, Any]) -> None:
        """epochs / expert_epochs / page_events tables and the manifest's stats, lost and epochs
        sections (the experts table is the recorder's: it joins block's columns)."""
        from moetrace.run import directory as rd
        from moetrace.run.epochs import epochs_from_replay
        from moetrace.run.replaylog import read_replay_summary

        st = self.stats
        manifest.setdefault("stats", {})[self.name] = st
        if self.orders is not None:
            have = bool(self.knobs.get("MOE_HAVE_FAULT"))
            manifest["add_causes"] = {
                "fault_tracepoint": have,
                "note": None if have else "no filemap:mm_filemap_fault on this kernel (6.11+): a fault's pages "
                                          "count as other, demand and readahead are NA",
                "folio_orders": {c: {str(o): int(n) for o, n in enumerate(row) if n}
                                 for c, row in zip(CAUSES, self.orders)},
            }
        budget = map_budget(self.knobs)
        manifest.setdefault("kernel_maps", {})[self.name] = {"bytes": sum(budget.values()), "by_map": budget}
        misses = self.misses
        s = self.stream
        manifest.setdefault("lost", {})[self.name] = {
            "counters_recursion_misses": misses,
            "counters_lost_events": sum(v for v in misses.values() if v) if misses else None,
            "unprocessed_pages": st["unprocessed_pages"],
            "stream": None if s is None else {"records": s.kept, "lost_kernel": s.lost_kernel,
                                              "lost_user": s.lost_user, "intervals": len(s.intervals)},
        }
        if st.get("dev_mismatch_events"):
            pool = manifest.get("pool") or {}
            self.ctx.notes.append(f"{st['dev_mismatch_events']} events hit pool inodes on another device than "
                                  f"s_dev {pool.get('s_dev_text')}: check the pool's filesystem")
        tables = manifest.setdefault("tables", {})
        if self.knobs.get("MOE_EPOCHS") and self.ctx.pmap is not None:
            rdoc = read_replay_summary(self.ctx.log_dir)
            eps = epochs_from_replay(rdoc, self.ctx.command_start_ns, self.ctx.command_end_ns)
            epoch_df = meta = None
            if eps:
                epoch_df, meta = epoch_tables(self.epoch_counts, eps, self.ctx.pmap, self.epoch_evictors,
                                              self.cause_array(self.epoch_causes))
                for tname, tdf in (("expert_epochs", epoch_df), ("epochs", meta)):
                    rd.write_table(run_dir, tname, tdf)
                    tables[tname] = schema_doc(SPEC, tname)
            ep_doc = (rdoc or {}).get("epochs") or {}
            manifest["epochs"] = {"mode": ep_doc.get("mode"), "slots": self.knobs["MOE_EPOCHS"],
                                  "epochs": len(eps) if eps else 0,
                                  "errors": [ep_doc["error"]] if ep_doc.get("error") else [],
                                  "source": "the replay's epoch writes (replay.json epochs.assigned)" if eps
                                  else "no replay wrote epochs: totals only",
                                  "by_phase": epoch_phase_totals(epoch_df, meta)}
        if self.events_raw is not None:
            ev = pd.DataFrame(np.frombuffer(self.events_raw, PAGE_EVENT_DTYPE))
            ev["kind"] = ev["kind"].map({0: "add", 1: "delete"}).astype("string")
            ev["evictor"] = pd.Categorical.from_codes(ev["evictor"].astype(np.int64), EVICTORS).astype("string")
            ev.loc[ev["kind"] == "add", "evictor"] = pd.NA
            ev = ev.drop(columns=["reserved"]).rename(columns={"first_page": "first_page_index",
                                                               "re_added": "re_added_pages"})
            rd.write_table(run_dir, "page_events", ev)
            rd.write_table(run_dir, "stream_intervals", pd.DataFrame([vars(i) for i in self.intervals]).rename(
                columns={"lost_kernel": "lost_kernel_records", "lost_user": "lost_user_records"}))


# -- the experts table (pagecache + block columns) -------------------------------------------------

def extra_kinds(pmap) -> tuple[str, ...]:
    """The rows after the experts: unattributed; a model file's shared and non_expert too."""
    return EXTRA_SLOTS if pmap is not None and pmap.kind == "model" else EXTRA_SLOTS[:1]


def experts_table(pmap, counts: list[tuple[int, int, int]] | None, req_bytes: np.ndarray | None,
                  req_pages: np.ndarray | None, block=None, evictors: np.ndarray | None = None,
                  causes: np.ndarray | None = None) -> pd.DataFrame:
    """experts.parquet: one row per expert (in expert_id order), then the unattributed row (and a
    model file's shared and non_expert rows: :func:`extra_kinds`).

    Columns: the pagecache declaration's schema (NA when ``counts`` is None: the probe
    was not recorded), then the block declaration's (``block``: a
    :class:`moetrace.record.probes.block.BlockResult`, or None: NA). The unattributed row's
    device_read_bytes is the bytes of no expert (every disk's when no pool was named),
    its bios NA (not counted apart). ``evictors``: the probe's slots x EVICTORS
    array of pages deleted per evictor class (NA columns when None); ``causes``: slots x CAUSES
    pages added per cause (-1 or None: NA)."""
    from moetrace.record.probes.block import SPEC as block_spec

    n = pmap.n_total if pmap is not None else 0
    kinds = extra_kinds(pmap)
    rows = n + len(kinds)
    c = (np.full((rows, 3), -1, np.int64) if counts is None
         else np.asarray(counts, np.int64).reshape(-1, 3)[:rows])
    E = pmap.n_experts if pmap is not None else 1
    eid = np.arange(n, dtype=np.int64)

    def ia(x, dtype="Int64"):
        return pd.array(x, dtype=dtype)

    na = [pd.NA] * len(kinds)
    re_extra = [pd.NA] + c[n + 1:rows, 2].tolist()  # the unattributed row has no bitmap
    df = pd.DataFrame({
        "kind": pd.array(["expert"] * n + list(kinds), dtype="string"),
        "layer": ia(list(eid // E) + na, "Int32"),
        "expert": ia(list(eid % E) + na, "Int32"),
        "expert_id": ia(list(eid) + na),
        "added_pages": ia(c[:, 0].tolist()),
        "evicted_pages": ia(c[:, 1].tolist()),
        "re_added_pages": ia(c[:n, 2].tolist() + re_extra),
        "requested_bytes": ia((req_bytes.tolist() if req_bytes is not None else [pd.NA] * n) + na),
        "requested_pages": ia((req_pages.tolist() if req_pages is not None else [pd.NA] * n) + na),
    })
    if counts is None:
        for col in ("added_pages", "evicted_pages", "re_added_pages"):
            df[col] = pd.array([pd.NA] * rows, dtype="Int64")
    df["hit_pages"] = df["requested_pages"] - df["added_pages"]
    for i, ev in enumerate(EVICTORS):
        df[f"evicted_by_{ev}_pages"] = pd.array(
            evictors[:rows, i].tolist() if evictors is not None else [pd.NA] * rows, dtype="Int64")
    for i, cause in enumerate(CAUSES):
        v = causes[:rows, i].tolist() if causes is not None else [pd.NA] * rows
        df[f"added_{cause}_pages"] = pd.array([pd.NA if x == -1 else x for x in v], dtype="Int64")
    if block is not None:
        per = block.per_expert.set_index("expert_id").reindex(range(n))
        unattr = block.unattributed_bytes if block.index_used else block.kernel_read_bytes
        df["device_read_bytes"] = pd.array(per["device_read_bytes"].tolist() + [unattr] + na[1:], dtype="Int64")
        df["bios"] = pd.array(per["bios"].tolist() + na, dtype="Int64")
    else:
        df["device_read_bytes"] = pd.array([pd.NA] * rows, dtype="Int64")
        df["bios"] = pd.array([pd.NA] * rows, dtype="Int64")
    return df[[col.name for col in SPEC.schema + block_spec.schema]]


def experts_totals(df: pd.DataFrame, requested: bool, read_bytes: int | None) -> dict[str, Any]:
    """The manifest's totals of an experts table."""
    e = df[df["kind"] == "expert"]
    u = df[df["kind"] == "unattributed"].iloc[0]
    return {
        "experts_added_pages": int(e["added_pages"].sum()),
        "experts_evicted_pages": int(e["evicted_pages"].sum()),
        "experts_re_added_pages": int(e["re_added_pages"].sum()),
        "experts_requested_pages": int(e["requested_pages"].sum()) if requested else None,
        "experts_requested_bytes": int(e["requested_bytes"].sum()) if requested else None,
        "experts_hit_pages": int(e["hit_pages"].sum()) if requested else None,
        "unattributed_added_pages": int(u["added_pages"]),
        "unattributed_evicted_pages": int(u["evicted_pages"]),
        "experts_evicted_by": {ev: int(e[f"evicted_by_{ev}_pages"].sum()) for ev in EVICTORS},
        "unattributed_evicted_by": {ev: int(u[f"evicted_by_{ev}_pages"]) for ev in EVICTORS},
        "syscall_read_bytes_tracked_all_files": read_bytes,
        **{f"{k}_{c}": int(df.loc[df["kind"] == k, c].sum()) for k in EXTRA_SLOTS[1:] if (df["kind"] == k).any()
           for c in ("added_pages", "evicted_pages", "re_added_pages")},
    }


def epoch_tables(arr: np.ndarray, epochs: list, pmap, evictors: np.ndarray | None = None,
                 causes: np.ndarray | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(expert_epochs, epochs) from the probe's epoch_counts array and the epochs the replay
    assigned (:func:`moetrace.run.epochs.epochs_from_replay`).

    expert_epochs keeps the rows with a nonzero count only (an absent (epoch, expert) is
    zero: the array is read whole, nothing is missing)."""
    n1 = pmap.n_slots
    used = len(epochs)
    a = arr[: used * n1]
    tot = a["added_pages"].astype(np.int64) + a["evicted_pages"] + a["re_added_pages"]
    nz = np.flatnonzero(tot)
    ep, eid = nz // n1, nz % n1
    E = pmap.n_experts
    is_exp = eid < pmap.n_total
    kind = np.array(("expert",) + EXTRA_SLOTS, dtype=object)[np.where(is_exp, 0, eid - pmap.n_total + 1)]

    def ia(x, dt="Int64"):
        return pd.array(x, dtype=dt)

    df = pd.DataFrame({
        "epoch": ep.astype(np.int32),
        "kind": pd.array(kind, dtype="string"),
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
    for i, ev in enumerate(EVICTORS):  # pool pages deleted in the epoch, by evictor class
        meta[f"evicted_by_{ev}_pages"] = pd.array(
            evictors[: used, i].tolist() if evictors is not None else [pd.NA] * used, dtype="Int64")
    for i, cause in enumerate(CAUSES):  # expert pages added in the epoch, by cause
        v = causes[: used, i].tolist() if causes is not None else [pd.NA] * used
        meta[f"added_{cause}_pages"] = pd.array([pd.NA if x == -1 else x for x in v], dtype="Int64")
    return df, meta


def epoch_phase_totals(df: pd.DataFrame | None, meta: pd.DataFrame | None) -> dict[str, dict[str, Any]] | None:
    """{phase: {added_pages, evicted_pages, re_added_pages, evicted_by}} of the experts
    (unattributed apart, as ``<phase>_unattributed``)."""
    if df is None or meta is None:
        return None
    m = df.merge(meta[["epoch", "phase"]], on="epoch")
    out: dict[str, dict[str, Any]] = {}
    for ph in meta["phase"].unique():
        for kind in ("expert", "unattributed"):
            sub = m[(m["phase"] == ph) & (m["kind"] == kind)]
            key = str(ph) if kind == "expert" else f"{ph}_unattributed"
            out[key] = {c: int(sub[c].sum()) for c in ("added_pages", "evicted_pages", "re_added_pages")}
        if f"evicted_by_{EVICTORS[0]}_pages" in meta:
            rows = meta[meta["phase"] == ph]
            out[str(ph)]["evicted_by"] = {ev: int(rows[f"evicted_by_{ev}_pages"].fillna(0).sum()) for ev in EVICTORS}
    return out
