// SPDX-License-Identifier: Apache-2.0
// reclaim: who reclaims (memcg limit / direct / kswapd), how much it scans and
// steals, how often and for how long — aggregated in the kernel.
//
// Reads ONLY tracepoint arguments (layout-safe with mismatched headers):
//   vmscan:mm_vmscan_memcg_reclaim_begin/end    order, gfp_flags / nr_reclaimed
//   vmscan:mm_vmscan_direct_reclaim_begin/end   order, gfp_flags / nr_reclaimed
//   vmscan:mm_vmscan_kswapd_wake/sleep          nid, zid, order / nid
//   vmscan:mm_vmscan_lru_shrink_inactive        nr_scanned, nr_reclaimed, nr_dirty,
//       nr_writeback, nr_congested, nr_immediate, nr_activate0/1, nr_ref_keep,
//       nr_unmap_fail, reclaim_flags (RECLAIM_WB_FILE 0x2 / RECLAIM_WB_ANON 0x1)
//   vmscan:mm_vmscan_lru_shrink_active          nr_taken, nr_active, nr_deactivated,
//       nr_referenced
//   vmscan:mm_vmscan_lru_isolate                nr_requested, nr_scanned, nr_skipped,
//       nr_taken
//
// The reclaimer kind of a shrink/isolate event is the enclosing begin/end pair
// on the same task: begin stores (kind, start time) in `active` keyed by tid,
// end records the invocation's duration and removes it. kswapd's window is
// kswapd_wake -> kswapd_sleep on the kswapd thread (a second wake without a
// sleep closes the previous window and opens the next; the window includes
// kswapd's short HZ/10 naps inside kswapd_try_to_sleep). An event on a task with
// no open window is kswapd when the task's comm starts with "kswapd" (attached
// mid-window), else OTHER (node reclaim, soft limit reclaim, reclaim_pages).
// Nested begins on one task (not expected) keep the outer window and are counted.
//
// shrink_inactive's nr_scanned / nr_reclaimed are exactly what the kernel adds
// to pgscan_{anon,file} / pgsteal_{anon,file} in /proc/vmstat (and to the
// per-reclaimer pgscan_kswapd/direct only for global reclaim: memcg limit
// reclaim is counted there only in the memcg's own v2 memory.stat).
//
// Configured only with -D knobs (toolkit/record/spec.py declares the probe; every
// knob has a default, so the file compiles as is on a kernel with all events):
//   MOE_HAVE_DIRECT          1: compile direct_reclaim_begin/end
//   MOE_HAVE_KSWAPD          1: compile kswapd_wake/sleep
//   MOE_HAVE_SHRINK_ACTIVE   1: compile lru_shrink_active
//   MOE_HAVE_ISOLATE         1: compile lru_isolate
//   MOE_MAX_TASKS            tid -> open window entries
//   MOE_BUCKET_NS            per-time-bucket counters: bucket width (0: off)
//   MOE_MAX_BUCKETS          buckets kept; later events land in the last one
//   MOE_T0_NS                bpf_ktime_get_ns() (CLOCK_MONOTONIC) of bucket 0
//   MOE_MAX_INODES, MOE_MAX_EXPERTS: accepted, unused (nothing per expert here)

#ifndef MOE_HAVE_DIRECT
#define MOE_HAVE_DIRECT 1
#endif
#ifndef MOE_HAVE_KSWAPD
#define MOE_HAVE_KSWAPD 1
#endif
#ifndef MOE_HAVE_SHRINK_ACTIVE
#define MOE_HAVE_SHRINK_ACTIVE 1
#endif
#ifndef MOE_HAVE_ISOLATE
#define MOE_HAVE_ISOLATE 1
#endif
#ifndef MOE_MAX_TASKS
#define MOE_MAX_TASKS 16384
#endif
#ifndef MOE_BUCKET_NS
#define MOE_BUCKET_NS 0
#endif
#ifndef MOE_MAX_BUCKETS
#define MOE_MAX_BUCKETS 4096
#endif
#ifndef MOE_T0_NS
#define MOE_T0_NS 0
#endif
#ifndef MOE_MAX_INODES
#define MOE_MAX_INODES 65536
#endif
#ifndef MOE_MAX_EXPERTS
#define MOE_MAX_EXPERTS 65536
#endif

// reclaimer kinds (toolkit/record/probes/reclaim.py KINDS names them in this order)
#define KIND_MEMCG 0
#define KIND_DIRECT 1
#define KIND_KSWAPD 2
#define KIND_OTHER 3
#define N_KINDS 4

// per-kind counter fields (toolkit/record/probes/reclaim.py FIELDS names them in this order)
#define F_INVOCATIONS 0          // begin / kswapd_wake events
#define F_COMPLETED 1            // end / sleep events that closed an open window
#define F_DURATION_NS 2          // sum of begin -> end ns of completed invocations
#define F_END_RECLAIMED 3        // sum of nr_reclaimed at *_reclaim_end
#define F_INACTIVE_CALLS 4       // lru_shrink_inactive events
#define F_SCANNED 5              // nr_scanned (== pgscan_anon + pgscan_file)
#define F_RECLAIMED 6            // nr_reclaimed (== pgsteal_anon + pgsteal_file)
#define F_SCANNED_FILE 7         // ... of the file LRU
#define F_RECLAIMED_FILE 8
#define F_DIRTY 9
#define F_WRITEBACK 10
#define F_CONGESTED 11
#define F_IMMEDIATE 12
#define F_ACTIVATE_ANON 13       // nr_activate0: pages moved back to the active list
#define F_ACTIVATE_FILE 14       // nr_activate1
#define F_REF_KEEP 15
#define F_UNMAP_FAIL 16
#define F_ACTIVE_CALLS 17        // lru_shrink_active events
#define F_ACTIVE_TAKEN 18        // nr_taken (== pgrefill)
#define F_ACTIVE_DEACTIVATED 19  // nr_deactivated
#define F_ACTIVE_KEPT 20         // nr_active: kept on the active list
#define F_ACTIVE_REFERENCED 21
#define F_ISOLATE_CALLS 22       // lru_isolate events
#define F_ISOLATE_REQUESTED 23
#define F_ISOLATE_SCANNED 24
#define F_ISOLATE_SKIPPED 25
#define F_ISOLATE_TAKEN 26
#define N_FIELDS 27

// stats slots (toolkit/record/probes/reclaim.py STATS names them in this order)
#define STAT_NESTED_BEGINS 0     // a begin while the task had an open window
#define STAT_UNMATCHED_ENDS 1    // an end with no open window (attached mid-way)
#define STAT_KIND_MISMATCH 2     // an end of another kind than the open window
#define STAT_TASK_MAP_FULL 3     // window not stored: its events count as OTHER
#define STAT_TIMELINE_OVERFLOW 4 // events past the last bucket (counted in it)
#define N_STATS 5

// timeline fields per (bucket, kind)
#define T_SCANNED 0
#define T_RECLAIMED 1
#define T_INVOCATIONS 2          // invocations that ended in the bucket
#define T_DURATION_NS 3          // ... and their duration
#define N_TL 4

#define HIST_SLOTS 64

#if MOE_BUCKET_NS > 0
#define TL_ENTRIES (MOE_MAX_BUCKETS * N_KINDS * N_TL)
#else
#define TL_ENTRIES 1
#endif

struct window {
    u64 start_ns;
    u32 kind;
    u32 depth;  // nested begins beyond the first
};

BPF_PERCPU_ARRAY(totals, u64, N_KINDS * N_FIELDS);
BPF_PERCPU_ARRAY(dur_hist, u64, N_KINDS * HIST_SLOTS);
BPF_PERCPU_ARRAY(stats, u64, N_STATS);
BPF_PERCPU_ARRAY(timeline, u64, TL_ENTRIES);
BPF_HASH(active, u32, struct window, MOE_MAX_TASKS);

static __always_inline void stat_add(u32 slot, u64 v)
{
    u64 *p = stats.lookup(&slot);
    if (p)
        *p += v;
}

static __always_inline void tot_add(u32 kind, u32 f, u64 v)
{
    u32 i = kind * N_FIELDS + f;
    u64 *p = totals.lookup(&i);
    if (p)
        *p += v;
}

static __always_inline void tl_add(u64 now, u32 kind, u32 f, u64 v)
{
#if MOE_BUCKET_NS > 0
    u64 b = 0;
    if (now > (u64)MOE_T0_NS)
        b = (now - (u64)MOE_T0_NS) / (u64)MOE_BUCKET_NS;
    if (b >= MOE_MAX_BUCKETS) {
        b = MOE_MAX_BUCKETS - 1;
        if (f == T_SCANNED || f == T_INVOCATIONS)
            stat_add(STAT_TIMELINE_OVERFLOW, 1);
    }
    u32 i = ((u32)b * N_KINDS + kind) * N_TL + f;
    u64 *p = timeline.lookup(&i);
    if (p)
        *p += v;
#endif
}

static __always_inline u32 tid_of(void)
{
    return (u32)bpf_get_current_pid_tgid();
}

// the kind of the reclaim the current task is doing
static __always_inline u32 current_kind(void)
{
    u32 tid = tid_of();
    struct window *w = active.lookup(&tid);
    if (w)
        return w->kind < N_KINDS ? w->kind : KIND_OTHER;
    char comm[16] = {};
    bpf_get_current_comm(&comm, sizeof(comm));
    if (comm[0] == 'k' && comm[1] == 's' && comm[2] == 'w' && comm[3] == 'a' && comm[4] == 'p' &&
        comm[5] == 'd')
        return KIND_KSWAPD;
    return KIND_OTHER;
}

static __always_inline void window_begin(u32 kind)
{
    u32 tid = tid_of();
    tot_add(kind, F_INVOCATIONS, 1);
    struct window *w = active.lookup(&tid);
    if (w) {
        w->depth += 1;
        stat_add(STAT_NESTED_BEGINS, 1);
        return;
    }
    struct window nw = {};
    nw.start_ns = bpf_ktime_get_ns();
    nw.kind = kind;
    if (active.update(&tid, &nw) != 0)
        stat_add(STAT_TASK_MAP_FULL, 1);
}

static __always_inline void window_end(u32 kind, u64 nr_reclaimed)
{
    u32 tid = tid_of();
    u64 now = bpf_ktime_get_ns();
    tot_add(kind, F_END_RECLAIMED, nr_reclaimed);
    struct window *w = active.lookup(&tid);
    if (!w) {
        stat_add(STAT_UNMATCHED_ENDS, 1);
        return;
    }
    if (w->depth > 0) {
        w->depth -= 1;
        return;
    }
    u32 k = w->kind < N_KINDS ? w->kind : KIND_OTHER;
    if (k != kind)
        stat_add(STAT_KIND_MISMATCH, 1);
    u64 d = now - w->start_ns;
    active.delete(&tid);
    tot_add(k, F_COMPLETED, 1);
    tot_add(k, F_DURATION_NS, d);
    tl_add(now, k, T_INVOCATIONS, 1);
    tl_add(now, k, T_DURATION_NS, d);
    u32 slot = bpf_log2l(d);
    if (slot >= HIST_SLOTS)
        slot = HIST_SLOTS - 1;
    u32 hi = k * HIST_SLOTS + slot;
    u64 *c = dur_hist.lookup(&hi);
    if (c)
        *c += 1;
}

int tp_mm_vmscan_memcg_reclaim_begin(struct tracepoint__vmscan__mm_vmscan_memcg_reclaim_begin *args)
{
    window_begin(KIND_MEMCG);
    return 0;
}

int tp_mm_vmscan_memcg_reclaim_end(struct tracepoint__vmscan__mm_vmscan_memcg_reclaim_end *args)
{
    window_end(KIND_MEMCG, args->nr_reclaimed);
    return 0;
}

#if MOE_HAVE_DIRECT
int tp_mm_vmscan_direct_reclaim_begin(struct tracepoint__vmscan__mm_vmscan_direct_reclaim_begin *args)
{
    window_begin(KIND_DIRECT);
    return 0;
}

int tp_mm_vmscan_direct_reclaim_end(struct tracepoint__vmscan__mm_vmscan_direct_reclaim_end *args)
{
    window_end(KIND_DIRECT, args->nr_reclaimed);
    return 0;
}
#endif

#if MOE_HAVE_KSWAPD
int tp_mm_vmscan_kswapd_wake(struct tracepoint__vmscan__mm_vmscan_kswapd_wake *args)
{
    u32 tid = tid_of();
    struct window *w = active.lookup(&tid);
    if (w)  // woke again without sleeping: close the previous window
        window_end(KIND_KSWAPD, 0);
    window_begin(KIND_KSWAPD);
    return 0;
}

int tp_mm_vmscan_kswapd_sleep(struct tracepoint__vmscan__mm_vmscan_kswapd_sleep *args)
{
    window_end(KIND_KSWAPD, 0);
    return 0;
}
#endif

int tp_mm_vmscan_lru_shrink_inactive(struct tracepoint__vmscan__mm_vmscan_lru_shrink_inactive *args)
{
    u32 k = current_kind();
    u64 scanned = args->nr_scanned, reclaimed = args->nr_reclaimed;
    tot_add(k, F_INACTIVE_CALLS, 1);
    tot_add(k, F_SCANNED, scanned);
    tot_add(k, F_RECLAIMED, reclaimed);
    if (args->reclaim_flags & 0x2) {  // RECLAIM_WB_FILE
        tot_add(k, F_SCANNED_FILE, scanned);
        tot_add(k, F_RECLAIMED_FILE, reclaimed);
    }
    tot_add(k, F_DIRTY, args->nr_dirty);
    tot_add(k, F_WRITEBACK, args->nr_writeback);
    tot_add(k, F_CONGESTED, args->nr_congested);
    tot_add(k, F_IMMEDIATE, args->nr_immediate);
    tot_add(k, F_ACTIVATE_ANON, args->nr_activate0);
    tot_add(k, F_ACTIVATE_FILE, args->nr_activate1);
    tot_add(k, F_REF_KEEP, args->nr_ref_keep);
    tot_add(k, F_UNMAP_FAIL, args->nr_unmap_fail);
#if MOE_BUCKET_NS > 0
    u64 now = bpf_ktime_get_ns();
    tl_add(now, k, T_SCANNED, scanned);
    tl_add(now, k, T_RECLAIMED, reclaimed);
#endif
    return 0;
}

#if MOE_HAVE_SHRINK_ACTIVE
int tp_mm_vmscan_lru_shrink_active(struct tracepoint__vmscan__mm_vmscan_lru_shrink_active *args)
{
    u32 k = current_kind();
    tot_add(k, F_ACTIVE_CALLS, 1);
    tot_add(k, F_ACTIVE_TAKEN, args->nr_taken);
    tot_add(k, F_ACTIVE_DEACTIVATED, args->nr_deactivated);
    tot_add(k, F_ACTIVE_KEPT, args->nr_active);
    tot_add(k, F_ACTIVE_REFERENCED, args->nr_referenced);
    return 0;
}
#endif

#if MOE_HAVE_ISOLATE
int tp_mm_vmscan_lru_isolate(struct tracepoint__vmscan__mm_vmscan_lru_isolate *args)
{
    u32 k = current_kind();
    tot_add(k, F_ISOLATE_CALLS, 1);
    tot_add(k, F_ISOLATE_REQUESTED, args->nr_requested);
    tot_add(k, F_ISOLATE_SCANNED, args->nr_scanned);
    tot_add(k, F_ISOLATE_SKIPPED, args->nr_skipped);
    tot_add(k, F_ISOLATE_TAKEN, args->nr_taken);
    return 0;
}
#endif
