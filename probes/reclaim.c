// SPDX-License-Identifier: Apache-2.0
// reclaim: who reclaims (memcg limit / direct / kswapd / kdamond / memory.reclaim), how
// much it scans and steals, how often and for how long — aggregated in the kernel.
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
//   syscalls:sys_enter_write / sys_exit_write   count / -  (a small write(2) in flight)
//
// The reclaimer kind of a shrink/isolate event is the enclosing begin/end pair
// on the same task: begin stores (kind, start time) in `active` keyed by tid,
// end records the invocation's duration and removes it. kswapd's window is
// kswapd_wake -> kswapd_sleep on the kswapd thread (a second wake without a
// sleep closes the previous window and opens the next; the window includes
// kswapd's short HZ/10 naps inside kswapd_try_to_sleep). An event on a task with
// no open window is KSWAPD (attached mid-window) or DAMON (a kdamond thread: DAMOS,
// DAMON_RECLAIM) by the kernel thread's comm (moetrace.h moe_kthread_kind), else
// OTHER (node reclaim, soft limit reclaim, reclaim_pages). Kinds, in KIND_* order:
// memcg, direct, kswapd, damon, proactive, other.
// A memcg window that begins while its task is inside a write(2) of at most
// MOE_SMALL_WRITE bytes is PROACTIVE (memory.reclaim: "1G" written to the cgroup file);
// the write's enter/exit keep that one context bit per task (`task_ctx`), and a memcg
// end closes a memcg or a proactive window alike.
// Nested begins on one task (not expected) keep the outer window and are counted.
//
// MOE_GATED: the windows (begin / end / wake / sleep) and the write context are kept
// while unarmed, so a window opened before arming still names its events and is timed
// in full; what they count is gated (map-full losses excepted), and the shrink /
// isolate programs are gated as a whole.
//
// shrink_inactive's nr_scanned / nr_reclaimed are exactly what the kernel adds
// to pgscan_{anon,file} / pgsteal_{anon,file} in /proc/vmstat (and to the
// per-reclaimer pgscan_kswapd/direct only for global reclaim: memcg limit
// reclaim is counted there only in the memcg's own v2 memory.stat).
//
// Configured only with -D knobs (toolkit/record/probes/reclaim.py declares the probe; every
// knob has a default, so the file compiles as is on a kernel with all events):
//   MOE_HAVE_DIRECT          1: compile direct_reclaim_begin/end
//   MOE_HAVE_KSWAPD          1: compile kswapd_wake/sleep
//   MOE_HAVE_SHRINK_ACTIVE   1: compile lru_shrink_active
//   MOE_HAVE_ISOLATE         1: compile lru_isolate
//   MOE_MAX_TASKS            tid -> open window entries (and tid -> write context entries)
//   MOE_BUCKET_NS            per-time-bucket counters: bucket width (0: off)
//   MOE_MAX_BUCKETS          buckets kept; later events land in the last one
//   MOE_T0_NS                bpf_ktime_get_ns() (CLOCK_MONOTONIC) of bucket 0
//   MOE_CTX_WRITE            1: compile sys_enter/exit_write (memory.reclaim -> PROACTIVE)
//   MOE_GATED                1: count only while armed[0] = 1 (moetrace record arms all at once); 0: always
//   MOE_MAX_INODES, MOE_MAX_EXPERTS: accepted, unused (nothing per expert here)

#include "moetrace.h"

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
#ifndef MOE_CTX_WRITE
#define MOE_CTX_WRITE 1
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
#define KIND_DAMON 3             // a kdamond thread, by comm
#define KIND_PROACTIVE 4         // memory.reclaim: a memcg window opened inside a small write(2)
#define KIND_OTHER 5
#define N_KINDS 6

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
#if MOE_GATED
BPF_ARRAY(armed, u32, 1);
#endif

static __always_inline int moe_armed(void) {
#if MOE_GATED
    u32 z = 0;
    u32 *a = armed.lookup(&z);
    return a && *a;
#else
    return 1;
#endif
}

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
    u32 t = moe_kthread_kind();
    if (t == 1)
        return KIND_KSWAPD;
    if (t == 2)
        return KIND_DAMON;
    return KIND_OTHER;
}

// Opens the task's window (kept armed or not); counts only while armed.
static __always_inline void window_begin(u32 kind)
{
    u32 tid = tid_of();
    int on = moe_armed();
    if (on)
        tot_add(kind, F_INVOCATIONS, 1);
    struct window *w = active.lookup(&tid);
    if (w) {
        w->depth += 1;
        if (on)
            stat_add(STAT_NESTED_BEGINS, 1);
        return;
    }
    struct window nw = {};
    nw.start_ns = bpf_ktime_get_ns();
    nw.kind = kind;
    if (active.update(&tid, &nw) != 0)
        stat_add(STAT_TASK_MAP_FULL, 1);
}

// Closes the task's window (armed or not); counts only while armed. A memcg end closes a
// memcg or a proactive window, and its nr_reclaimed goes to the proactive kind in the latter.
static __always_inline void window_end(u32 kind, u64 nr_reclaimed)
{
    u32 tid = tid_of();
    u64 now = bpf_ktime_get_ns();
    int on = moe_armed();
    struct window *w = active.lookup(&tid);
    u32 ek = kind;
    if (w && kind == KIND_MEMCG && w->kind == KIND_PROACTIVE)
        ek = KIND_PROACTIVE;
    if (on)
        tot_add(ek, F_END_RECLAIMED, nr_reclaimed);
    if (!w) {
        if (on)
            stat_add(STAT_UNMATCHED_ENDS, 1);
        return;
    }
    if (w->depth > 0) {
        w->depth -= 1;
        return;
    }
    u32 k = w->kind < N_KINDS ? w->kind : KIND_OTHER;
    u64 d = now - w->start_ns;
    active.delete(&tid);
    if (!on)
        return;
    if (k != ek)
        stat_add(STAT_KIND_MISMATCH, 1);
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

// -- the write(2) context: memory.reclaim is a small write to the cgroup's file (not gated) ------
#if MOE_CTX_WRITE
BPF_TABLE("lru_hash", u32, u32, task_ctx, MOE_MAX_TASKS);

// set (on) or clear (off) context bits of the current task, rewriting its entry in place
static __always_inline int ctx_set(u32 bits, int on)
{
    u32 tid = tid_of();
    u32 *c = task_ctx.lookup(&tid);
    if (c) {
        *c = on ? (*c | bits) : (*c & ~bits);
        return 0;
    }
    if (!on)
        return 0;
    u32 v = bits;
    task_ctx.update(&tid, &v);
    return 0;
}

int tp_sys_enter_write(struct tracepoint__syscalls__sys_enter_write *args)
{
    return args->count <= MOE_SMALL_WRITE ? ctx_set(CTX_WRITE_SMALL, 1) : 0;
}

int tp_sys_exit_write(struct tracepoint__syscalls__sys_exit_write *args)
{
    return ctx_set(CTX_WRITE_SMALL, 0);
}
#endif

// 1: the current task is inside a write(2) of at most MOE_SMALL_WRITE bytes
static __always_inline int in_small_write(void)
{
#if MOE_CTX_WRITE
    u32 tid = tid_of();
    u32 *c = task_ctx.lookup(&tid);
    return c && (*c & CTX_WRITE_SMALL);
#else
    return 0;
#endif
}

// -- reclaim windows (not gated: window_begin / window_end gate their counts) ---------------

int tp_mm_vmscan_memcg_reclaim_begin(struct tracepoint__vmscan__mm_vmscan_memcg_reclaim_begin *args)
{
    window_begin(in_small_write() ? KIND_PROACTIVE : KIND_MEMCG);
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

// -- counting programs (gated) ---------------------------------------------------------------

int tp_mm_vmscan_lru_shrink_inactive(struct tracepoint__vmscan__mm_vmscan_lru_shrink_inactive *args)
{
    MOE_GATE();
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
    MOE_GATE();
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
    MOE_GATE();
    u32 k = current_kind();
    tot_add(k, F_ISOLATE_CALLS, 1);
    tot_add(k, F_ISOLATE_REQUESTED, args->nr_requested);
    tot_add(k, F_ISOLATE_SCANNED, args->nr_scanned);
    tot_add(k, F_ISOLATE_SKIPPED, args->nr_skipped);
    tot_add(k, F_ISOLATE_TAKEN, args->nr_taken);
    return 0;
}
#endif
