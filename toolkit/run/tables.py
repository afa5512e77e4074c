"""The run directory's tables: every table's columns (name, dtype, unit, doc), declared once.

This is the contract between the writers and the readers of a run: the probes' recorders
(:mod:`moetrace.record.probes`: each probe's declaration names the tables it writes and takes
their columns from here), the replay's iteration log (:mod:`moetrace.replay.harness`), and the
readers that check a table before an analysis indexes it (:func:`moetrace.run.validate.check_table`).
It lives in run/ because the arrows point down the flow (record and replay import run, never
the reverse; docs/architecture.md).

``check``: what the readers rely on, checked when a table is read: ``n`` a number (integer or
float, nullable), ``i`` an integer, ``s`` a string, ``b`` a boolean; a trailing ``?`` makes the
column optional (checked when present: the analyses test for it first). A column without
``check`` is written and documented but no reader indexes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrace.run.evictors import EVICTOR_DOCS


@dataclass(frozen=True)
class Column:
    """One column of a run table; units also in the name (``_ns``, ``_pages``)."""

    name: str
    dtype: str
    unit: str = ""
    doc: str = ""
    check: str = ""


I64 = "int64"
EXPERT_COLS = (Column("layer", "int32"), Column("expert", "int32"), Column("expert_id", "int32"))


def _evictor_cols() -> tuple[Column, ...]:
    return tuple(Column(f"evicted_by_{e}_pages", "Int64", "pages", f"pages deleted by {d}")
                 for e, d in EVICTOR_DOCS.items())


#: why pages were added (probes/pagecache.bpf.c CAUSE_*): the add columns' names and meaning
CAUSE_DOCS = {
    "demand": "the page a page fault asked for",
    "readahead": "the other pages a fault's read added (read-around, async readahead); NA without the "
                 "filemap:mm_filemap_fault tracepoint (6.11+)",
    "populate": "inside mmap(MAP_POPULATE), madvise(MADV_WILLNEED) or fadvise(POSIX_FADV_WILLNEED)",
    "other": "read(2) and its readahead, and any add with no fault or populate context",
}


def _cause_cols() -> tuple[Column, ...]:
    return tuple(Column(f"added_{c}_pages", "Int64", "pages", f"pages added: {d}", check="n?")
                 for c, d in CAUSE_DOCS.items())


def _lru_pages(name: str, doc: str, check: str = "") -> Column:
    return Column(name, "Int64", "pages", doc, check)


def _pages(name: str, doc: str = "", check: str = "") -> Column:
    return Column(name, I64, "pages", doc, check)


def _calls(name: str, doc: str = "", check: str = "") -> Column:
    return Column(name, "Int64", "", doc, check)


_FD_ID_DOC = "fd identity (tgid, fd, gen, epoch): gen counts close() of the fd, epoch close_range()/exec"


_MLOCK_INT = "int64"


_GEN_COLS = (Column("time_ns", "int64", "ns", "CLOCK_MONOTONIC when the sample was read"),
             Column("sample", "int32", "", "sample index (0: at open, the last: at close)"),
             Column("memcg_id", "int64"), Column("node", "int32"))


#: experts.parquet, one row per expert + one unattributed row: the pagecache probe's columns ...
EXPERTS_PAGECACHE = (
    Column("kind", "string", "", "'expert', 'unattributed' (pages of no mapped file; a pool file's past its experts), "
           "and for a model file 'shared' (a page two owners share) and 'non_expert' (header, other tensors)", check="s"),
    Column("layer", "Int32", "", "layer of the expert (NA for unattributed)", check="i"),
    Column("expert", "Int32", "", "expert index within the layer", check="i"),
    Column("expert_id", "Int64", "", "layer * n_experts + expert", check="i"),
    Column("added_pages", "Int64", "pages", "pages added to the page cache (misses, readahead included)", check="n?"),
    Column("evicted_pages", "Int64", "pages", "pages deleted from the page cache", check="n?"),
    Column("re_added_pages", "Int64", "pages", "pages added again after their eviction (exact, per page)", check="n?"),
    Column("requested_bytes", "Int64", "bytes",
           "bytes the replay read (its plan accounting; NA without a replay log)"),
    Column("requested_pages", "Int64", "pages", "pages the replay's reads cover (NA without a replay log)", check="n?"),
    Column("hit_pages", "Int64", "pages", "requested_pages - added_pages (negative: readahead charged here)",
           check="n?"),
) + _evictor_cols() + _cause_cols()

#: ... and the block probe's, merged into the same rows
EXPERTS_BLOCK = (
    Column("device_read_bytes", "Int64", "bytes",
           "read bytes of bios overlapping the expert's extents (unattributed row: bytes of no expert)", check="n?"),
    Column("bios", "Int64", "", "read bios touching the expert (one spanning two experts counts for both)"),
)

#: every table of a run directory: {name: columns}
TABLES: dict[str, tuple[Column, ...]] = {
    "experts": EXPERTS_PAGECACHE + EXPERTS_BLOCK,
    # -- pagecache (probes/pagecache.bpf.c, moetrace.record.probes.pagecache)
    "expert_epochs": (
        Column("epoch", "int32", "", "epochs.parquet row: one per replay iteration (or per phase)", check="i"),
        Column("kind", "string", "", "'expert' or 'unattributed'", check="s"),
        Column("layer", "Int32", check="i"), Column("expert", "Int32", check="i"),
        Column("expert_id", "Int64", check="i"),
        Column("added_pages", "Int64", "pages", check="n"), Column("evicted_pages", "Int64", "pages", check="n"),
        Column("re_added_pages", "Int64", "pages", check="n")),
    "epochs": (
        Column("epoch", "int32", check="i"),
        Column("phase", "string", "", "setup (before the first iteration), warmup, measured, after", check="s"),
        Column("repeat", "Int32", "", "pass of the phase (NA for setup/after, and per-phase epochs)", check="n"),
        Column("iteration", "Int32", "", "plan iteration (NA for setup/after and per-phase epochs)", check="n"),
        Column("start_ns", "Int64", "ns", "CLOCK_MONOTONIC when the epoch began", check="n"),
        Column("end_ns", "Int64", "ns", "when the next began (or the recording ended)", check="n"),
        Column("folded", "boolean", "", "later epochs beyond the array were counted here too"))
        + tuple(Column(c.name, c.dtype, c.unit, c.doc + " (pool experts, this epoch)")
                for c in _evictor_cols() + _cause_cols()),
    # -- block (probes/block.bpf.c, moetrace.record.probes.block)
    "block_latency": (Column("dev", I64, "", "tracepoint dev (major << 20) | minor"),
        Column("disk", "string"), Column("slot", "int32"), Column("lo_ns", "uint64", "ns"),
        Column("hi_ns", "uint64", "ns"),
        Column("requests", I64, "", "read requests issue -> complete in [lo_ns, hi_ns), "
                                 "requeued ones timed from their last issue")),
    "block_device": (Column("dev", I64), Column("disk", "string"),
        Column("read_bytes", I64, "bytes", "at the bytes tracepoint"),
        Column("bios", I64), Column("issues", I64), Column("issue_bytes", I64, "bytes"),
        Column("requeues", I64), Column("requeue_bytes", I64, "bytes"),
        Column("completes", I64), Column("complete_matched", I64),
        Column("latency_ns_sum", I64, "ns"),
        Column("diskstats_read_bytes", "Int64", "bytes", "/proc/diskstats sectors read delta x 512", check="n")),
    # -- lru (probes/lru.bpf.c, moetrace.record.probes.lru)
    "lru": (
        Column("kind", "string", "", "'expert' or 'unattributed' (pool-filesystem pages of no expert)", check="s"),
        Column("layer", "Int32", "", "layer of the expert (NA for unattributed)", check="i"),
        Column("expert", "Int32", "", "expert index within the layer", check="i"),
        Column("expert_id", "Int64", "", "layer * n_experts + expert", check="i"),
        _lru_pages("added_pages", "pages added to the page cache during the recording (the join's entries)"),
        _lru_pages("inserted_pages", "first LRU insertions of those pages (mm_lru_insertion, any list)",
                   check="n?"),
        _lru_pages("inserted_inactive_pages", "... onto the inactive file list"),
        _lru_pages("inserted_active_pages", "... onto the active file list (activated before reaching the list: a "
                                            "workingset refault, or a second access while batched)"),
        _lru_pages("inserted_unevictable_pages", "... onto the unevictable list (mlocked)"),
        _lru_pages("inserted_other_pages", "... onto another list (anon lists: swap-backed file pages)"),
        _lru_pages("reinserted_pages", "insertions again without a new add: putbacks (folio_putback_lru) of "
                                       "isolated pages that were not freed (reclaim_pages, failed migration)"),
        _lru_pages("activated_pages", "inactive -> active moves (mm_lru_activate; NA when not loaded)",
                   check="n?"),
        Column("activation_dwell_ns_sum", "Int64", "ns",
               "LRU insertion -> activation, summed over activated pages whose insertion was seen"),
        Column("activation_dwell_count", "Int64", "", "pages activation_dwell_ns_sum is over"),
        Column("activation_dwell_ns_mean", "Float64", "ns", "activation_dwell_ns_sum / activation_dwell_count"),
        _lru_pages("evicted_pages", "pages deleted from the page cache (by inode and index: every deletion)",
                   check="n?"),
        _lru_pages("evicted_joined_pages", "... of them added during the recording (their pfn was joined)"),
        _lru_pages("evicted_activated_pages", "... of those activated (or inserted active) while cached"),
        Column("dwell_ns_sum", "Int64", "ns", "LRU insertion -> eviction, summed over evicted pages whose "
                                              "insertion was seen (page-weighted)"),
        Column("dwell_count", "Int64", "", "pages dwell_ns_sum is over (evicted with a known insertion time)"),
        Column("dwell_ns_mean", "Float64", "ns", "dwell_ns_sum / dwell_count", check="n?"),
    ),
    "lru_dwell_histogram": (
        Column("kind", "string", "", "insertion_to_eviction, insertion_to_activation, add_to_insertion "
                                 "(page-cache add -> LRU insertion: time in the per-CPU batch)", check="s"),
        Column("slot", "int32"), Column("lo_ns", "uint64", "ns", check="n"), Column("hi_ns", "uint64", "ns", check="n"),
        _lru_pages("pages", "expert pages (pool-wide) whose interval is in [lo_ns, hi_ns)", check="n")),
    # -- reclaim (probes/reclaim.bpf.c, moetrace.record.probes.reclaim)
    "reclaim": (
        Column("kind", "string", "", "reclaimer: memcg (limit reclaim), direct, kswapd, damon (a kdamond thread), "
                                     "proactive (memory.reclaim: memcg reclaim inside a write(2) of <= 64 bytes), "
                                     "other (no open window)", check="s"),
        Column("invocations", I64, "", "*_reclaim_begin / kswapd_wake events", check="n"),
        Column("completed", I64, "", "invocations closed by their end / sleep"),
        _pages("scanned_pages", "shrink_inactive nr_scanned (== pgscan_anon + pgscan_file)", check="n"),
        _pages("reclaimed_pages", "shrink_inactive nr_reclaimed (== pgsteal_anon + pgsteal_file)", check="n"),
        Column("scan_to_steal", "float64", "", "scanned / reclaimed (NaN without steal)"),
        Column("duration_ns_sum", I64, "ns", "begin -> end of completed invocations", check="n"),
        Column("duration_ns_mean", "float64", "ns"),
        _pages("end_reclaimed_pages", "sum of nr_reclaimed at *_reclaim_end"),
        _pages("scanned_file_pages"), _pages("reclaimed_file_pages"),
        Column("inactive_calls", I64, "", "lru_shrink_inactive events"),
        _pages("dirty_pages"), _pages("writeback_pages"), _pages("congested_pages"), _pages("immediate_pages"),
        _pages("activate_anon_pages", "nr_activate0"), _pages("activate_file_pages", "nr_activate1"),
        _pages("ref_keep_pages"), _pages("unmap_fail_pages"),
        Column("active_calls", I64, "", "lru_shrink_active events"),
        _pages("active_taken_pages", "nr_taken (== pgrefill)"), _pages("active_deactivated_pages"),
        _pages("active_kept_pages", "nr_active"), _pages("active_referenced_pages"),
        Column("isolate_calls", I64, "", "lru_isolate events"),
        _pages("isolate_requested_pages"), _pages("isolate_scanned_pages"), _pages("isolate_skipped_pages"),
        _pages("isolate_taken_pages"),
    ),
    "reclaim_histogram": (Column("kind", "string", check="s"), Column("slot", "int32"),
        Column("lo_ns", "uint64", "ns", check="n"), Column("hi_ns", "uint64", "ns", check="n"),
        Column("invocations", I64, "", "completed invocations of [lo_ns, hi_ns)", check="n")),
    "reclaim_timeline": (Column("time_ns", I64, "ns", "bucket start since the recording's t0", check="n"),
        Column("who", "string", check="s"), _pages("nr_scanned_pages", check="n"),
        _pages("nr_reclaimed_pages", check="n"),
        Column("invocations", I64, check="n"), Column("duration_ns", I64, "ns", check="n")),
    # -- mlock (probes/mlock.bpf.c, moetrace.record.probes.mlock)
    "mlock": (
        Column("time_ns", _MLOCK_INT, "ns", "CLOCK_MONOTONIC at the call's exit (the replay's clock)"),
        Column("tgid", "int32"), Column("tid", "int32"),
        Column("call", "string", "", "mlock, mlock2, munlock, mlockall, munlockall, munmap, mmap, mremap; "
                                     "exit / exec: the process ended / exec'd (not calls: its locks went)"),
        Column("start", "uint64", "", "the call's start / addr argument (a user-space address)"),
        Column("len_bytes", _MLOCK_INT, "bytes", "the len argument (mremap: old_len)"),
        Column("new_len_bytes", "Int64", "bytes", "mremap's new_len (NA for the other calls)"),
        Column("flags", "int64", "", "mlock2 / mlockall / mmap / mremap flags (0 for the others)"),
        Column("ret", "int64", "", "the return value (negative errno; mmap / mremap: the mapping's address)"),
        Column("latency_ns", _MLOCK_INT, "ns", "enter -> exit"),
        Column("delta_bytes", "Int64", "bytes",
               "change of the process's locked bytes by this call (NA while unknowable, after mlockall)"),
        Column("locked_bytes", "Int64", "bytes",
               "the process's locked bytes after the call (== VmLck; NA while unknowable)"),
    ),
    "mlock_timeline": (
        Column("time_ns", _MLOCK_INT, "ns", "CLOCK_MONOTONIC of a change", check="n"),
        Column("tgid", "int32"),
        Column("call", "string"),
        Column("locked_bytes", "Int64", "bytes", "this process's locked bytes from time_ns on (NA: unknowable)"),
        Column("total_locked_bytes", "Int64", "bytes",
               "all followed processes' locked bytes from time_ns on (NA when one is unknowable)", check="n"),
    ),
    # -- reads (probes/reads.bpf.c, moetrace.record.probes.reads)
    "reads": (
        Column("kind", "string", "", "'expert' or 'unattributed'", check="s"),
        Column("source", "string", "", "'expert', or why unattributed: other_files (fd of a non-pool file), "
                                       "unresolved_fd (neither the fd table nor an added page told the inode), "
                                       "no_position (read() of a pool file), pool_tail (past the pool's extents), "
                                       "bad_fd (failed with EBADF: no open file), fd_map_full"),
        Column("layer", "Int32", check="i"), Column("expert", "Int32", check="i"),
        Column("expert_id", "Int64", check="i"),
        _calls("calls", "read calls (exited)", check="n"),
        Column("bytes", "Int64", "bytes", "sum of ret > 0", check="n"),
        Column("requested_bytes", "Int64", "bytes", "sum of the calls' count (iovec lengths for preadv)"),
        _calls("hit_only_calls", "calls with no page added while in flight", check="n"),
        Column("hit_only_bytes", "Int64", "bytes", check="n"),
        Column("hit_only_latency_ns_sum", "Int64", "ns", check="n"),
        _calls("miss_calls", "calls with >= 1 page added while in flight", check="n"),
        Column("miss_bytes", "Int64", "bytes", check="n"),
        Column("miss_latency_ns_sum", "Int64", "ns", check="n"),
        _calls("error_calls", "ret < 0"),
        Column("error_latency_ns_sum", "Int64", "ns"),
        Column("latency_ns_sum", "Int64", "ns", "enter -> exit of every call"),
        Column("added_pages", "Int64", "pages", "pages of the call's file added during its calls"),
        Column("beyond_pages", "Int64", "pages", "... of them outside the call's [pos, pos + count) (readahead)"),
        Column("other_added_pages", "Int64", "pages", "pages of other inodes added during the calls"),
        _calls("fd_identities", _FD_ID_DOC),
        Column("hit_only_ns_per_kib", "float64", "ns/KiB", "hit-path cost: hit-only latency per KiB read"),
    ),
    "reads_latency": (Column("scope", "string", "", "all (every followed call), pool (calls on pool-file "
                                      "fds), not_pool (all - pool)", check="s"),
        Column("class", "string", "", "hit_only, miss, error", check="s"),
        Column("slot", "int32"), Column("lo_ns", "uint64", "ns", check="n"), Column("hi_ns", "uint64", "ns", check="n"),
        Column("calls", I64, "", "calls whose latency is in [lo_ns, hi_ns)", check="n")),
    "reads_files": (Column("tgid", "int32"), Column("fd", "int32"), Column("gen", "int32"),
        Column("epoch", "int32"),
        Column("extent", "Int64", "", "pos // MOE_EXTENT (0 without split; NA: read())"),
        Column("ino", "UInt64", "", "NA: unresolved"), Column("dev", "Int64", "", "kernel s_dev"),
        Column("path", "string", "", "readlink of /proc/<tgid>/fd/<fd> when the kernel announced "
                                     "the identity (NA: closed or reused before the look)"),
        Column("resolved_by", "string", "", "fd (the task's fd table, read in the kernel at the "
                                            "identity's first call), add (first added page), or NA"),
        Column("source", "string"), Column("expert_id", "Int64"),
        Column("calls", I64), Column("bytes", I64, "bytes"), Column("hit_only_calls", I64),
        Column("miss_calls", I64), Column("error_calls", I64),
        Column("added_pages", I64, "pages"), Column("latency_ns_sum", I64, "ns")),
    "read_calls": (Column("ts_ns", I64, "ns", "call entry, CLOCK_MONOTONIC"), Column("tid", "int32"),
        Column("tgid", "int32"), Column("fd", "int32"), Column("gen", "int32"),
        Column("epoch", "int32"), Column("syscall", "string"),
        Column("offset_bytes", "Int64", "bytes", "file position (NA: read(), preadv2 pos -1)"),
        Column("count_bytes", I64, "bytes"), Column("ret", I64, "", "bytes read or -errno"),
        Column("latency_ns", I64, "ns"), Column("added_pages", I64, "pages"),
        Column("beyond_pages", I64, "pages"), Column("other_added_pages", I64, "pages"),
        Column("ino", "UInt64", "", "inode of the first page added (NA: none added)"),
        Column("class", "string"), Column("expert_id", "Int64"), Column("source", "string")),
    "read_calls_intervals": (Column("start_ns", I64, "ns"), Column("end_ns", I64, "ns"),
        Column("records", I64), Column("lost_kernel_records", I64),
        Column("lost_user_records", I64)),
    # -- stacks (probes/stacks.bpf.c, moetrace.record.probes.stacks)
    "stacks": (
        Column("stack", "string", "", "folded frames: comm;user frames (root first);kernel frames_[k]"),
        Column("samples", "int64", "", "cpu-clock samples of this stack (one per 1e9 / sample_hz ns on CPU)",
               check="n"),
        Column("comm", "string", "", "the sampled thread's comm"),
        Column("tgid", "int64", "", "process id (kswapd: the thread's pid)"),
        Column("who", "string", "", "command (the followed processes) or kswapd", check="s"),
        Column("user_frames", "int32", "", "user frames in the stack (0: none, lost or a kernel thread)"),
        Column("kernel_frames", "int32", "", "kernel frames in the stack (0: sampled in user mode, or lost)"),
        Column("user_stack", "string", "", "ok | none (no user frames: a kernel thread) | lost (stack-map "
                                           "collision) | error"),
        Column("kernel_stack", "string", "", "ok | none (sampled in user mode) | lost | error"),
    ),
    # -- mglru (probes/mglru.bpf.c, moetrace.record.probes.mglru)
    "lru_gen": _GEN_COLS[:3] + (
            Column("memcg_path", "string", "", "the memcg's cgroup path ('' without memcg)"),
            Column("node", "int32"),
            Column("seq", "int64", "", "generation number (min_seq .. max_seq); a new one is born by aging"),
            Column("gen", "int32", "", "seq % MAX_NR_GENS (the folio flags' generation slot)"),
            Column("age_ms", "int64", "ms", "ms since the generation's birth (jiffies resolution)"),
            Column("birth_ns", "int64", "ns", "time_ns - age_ms: CLOCK_MONOTONIC of the generation's birth"),
            Column("nr_anon_pages", "int64", "pages"), Column("nr_file_pages", "int64", "pages"),
            Column("anon_evicted", "bool", "", "lru_gen_full's 'x': seq < min_seq[anon] (False in lru_gen)"),
            Column("file_evicted", "bool", "", "lru_gen_full's 'x': seq < min_seq[file]"),
        ),
    "lru_gen_tiers": _GEN_COLS + (
        Column("seq", "int64"), Column("tier", "int32"), Column("type", "string", "", "anon or file"),
        Column("avg_refaulted_pages", "Int64", "pages", "max_seq only ('R')"),
        Column("avg_total_pages", "Int64", "pages", "max_seq only ('T')"),
        Column("refaulted_pages", "Int64", "pages", "history generations ('r')"),
        Column("evicted_pages", "Int64", "pages", "('e')"),
        Column("protected_pages", "Int64", "pages", "('p')")),
    "lru_gen_walk": _GEN_COLS + (
        Column("seq", "int64"), Column("leaf_total", "Int64"), Column("leaf_old", "Int64", "", "6.1 only"),
        Column("leaf_young", "Int64"), Column("nonleaf_total", "Int64", "", "6.1 only"),
        Column("nonleaf_found", "Int64"), Column("nonleaf_added", "Int64")),
    "mglru_aging": (Column("time_ns", "int64", "ns", "CLOCK_MONOTONIC of the aging attempt"),
        Column("tgid", "int32", "", "who aged: kswapd, a reclaimer, a writer of lru_gen"),
        Column("kind", "string", "", "try_to_inc_max_seq, inc_max_seq, inc_max_seq.constprop.0"),
        Column("seq", "Int64", "", "the max_seq it was asked to grow (NA: not read)")),
    "mglru_inc_gen": (Column("from_gen", "Int32", "", "generation slot a promoted folio left (NA: off MGLRU)"),
        Column("folios", "int64")),
    "mglru_evictions": (Column("time_ns", "int64", "ns", "CLOCK_MONOTONIC of the eviction"),
        *EXPERT_COLS,
        Column("ino", "int64"), Column("page_index", "int64", "", "the folio's first page in its file"),
        Column("memcg_id", "int64", "", "the folio's memcg (lru_gen's id); 0: none"),
        Column("seq", "Int64", "", "its memcg's min_seq[file] at eviction: the generation "
                                   "eviction took from, as the kernel's shadow entry records "
                                   "it (the folio's own is this or one less when its "
                                   "generation emptied while isolating); NA without memcg"),
        Column("tgid", "int32", "", "who evicted")),
    # -- the pagecache probe's per-page stream (record --stream)
    "page_events": (
        Column("ts_ns", "uint64", "ns", "CLOCK_MONOTONIC of the event", check="n"),
        Column("expert_id", "uint32", "", "the expert piece's expert_id (n_total: no expert)", check="n"),
        Column("kind", "string", "", "add or delete", check="s"),
        Column("first_page_index", "uint32", "", "the piece's first page within the expert"),
        Column("pages", "uint32", "pages", "pages of the piece", check="n"),
        Column("re_added_pages", "uint32", "pages", "of them added again after their eviction"),
        Column("tgid", "uint32", "", "the process in whose context the event happened"),
        Column("evictor", "string", "", "who deleted (moetrace.run.evictors.EVICTORS; NA for add)")),
    # -- the replay's iteration log (replay/iterations.parquet, moetrace.replay.harness)
    "iterations": (
        Column("phase", "string", "", "'warmup' | 'measured'", check="s"),
        Column("repeat", "int32", "", "0-based replayed pass within the phase", check="i"),
        Column("iteration", "int64", "", "plan iteration", check="i"),
        Column("step", "int64", "", "engine step of the iteration (plan index)"),
        Column("plan_passes", "int32", "", "plan passes in the iteration (2 = a failed speculation)"),
        Column("start_ns", "int64", "ns", "CLOCK_MONOTONIC", check="n"),
        Column("end_ns", "int64", "ns", check="n"),
        Column("duration_ns", "int64", "ns", check="n"),
        Column("bytes", "int64", "bytes", "logical expert bytes delivered into the buffers", check="n"),
        Column("reads", "int64", "", "expert accesses"),
        Column("arena_hits", "int64", "", "accesses served from the mlocked arena"),
        Column("hints_submitted", "int64", "", "hint sets put into the advisor's slot"),
        Column("hints_overwritten", "int64", "", "... replaced in the slot before the worker took them"),
        Column("hints_completed", "int64", "", "... finished by the worker during the iteration")),
}


def named_tables(*names: str) -> tuple[tuple[str, tuple[Column, ...]], ...]:
    """(name, columns) pairs of ``names``: a probe declaration's ``more_tables``."""
    return tuple((n, TABLES[n]) for n in names)


def checks(name: str) -> dict[str, str]:
    """{column: check} of a table's columns that readers rely on (empty: an unchecked table)."""
    return {c.name: c.check for c in TABLES.get(name, ()) if c.check}
