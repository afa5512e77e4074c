// SPDX-License-Identifier: Apache-2.0
// reclaim: who reclaims (memcg limit / direct / kswapd / kdamond / memory.reclaim), how
// much it scans and steals, how often and for how long — aggregated in the kernel.
// CO-RE (moetrace.bpf.h).
//
// Reads only tracepoint arguments, relocated by name against the running kernel's BTF (the
// event classes' trace_event_raw_* structs; the events without fields take a void ctx):
//   vmscan:mm_vmscan_memcg_reclaim_begin/end    - / nr_reclaimed (class
//       mm_vmscan_direct_reclaim_{begin,end}_template, shared with direct reclaim)
//   vmscan:mm_vmscan_direct_reclaim_begin/end   - / nr_reclaimed
//   vmscan:mm_vmscan_kswapd_wake/sleep          (no field read)
//   vmscan:mm_vmscan_lru_shrink_inactive        nr_scanned, nr_reclaimed, nr_dirty,
//       nr_writeback, nr_congested, nr_immediate, nr_activate0/1, nr_ref_keep,
//       nr_unmap_fail, reclaim_flags (RECLAIM_WB_FILE 0x2 / RECLAIM_WB_ANON 0x1)
//   vmscan:mm_vmscan_lru_shrink_active          nr_taken, nr_active, nr_deactivated,
//       nr_referenced
//   vmscan:mm_vmscan_lru_isolate                nr_requested, nr_scanned, nr_skipped,
//       nr_taken
//   syscalls:sys_enter_write / sys_exit_write   count (args[2]) / -  (a small write(2) in flight)
//
// The reclaimer kind of a shrink/isolate event is the enclosing begin/end pair
// on the same task: begin stores (kind, start time) in `active` keyed by tid,
// end records the invocation's duration and removes it. kswapd's window is
// kswapd_wake -> kswapd_sleep on the kswapd thread (a second wake without a
// sleep closes the previous window and opens the next; the window includes
// kswapd's short HZ/10 naps inside kswapd_try_to_sleep). An event on a task with
// no open window is KSWAPD (attached mid-window) or DAMON (a kdamond thread: DAMOS,
// DAMON_RECLAIM) by the kernel thread's comm (moetrace.bpf.h moe_kthread_kind), else
// OTHER (node reclaim, soft limit reclaim, reclaim_pages). Kinds, in KIND_* order:
// memcg, direct, kswapd, damon, proactive, other.
// A memcg window that begins while its task is inside a write(2) of at most
// SMALL_WRITE bytes is PROACTIVE (memory.reclaim: "1G" written to the cgroup file);
// the write's enter/exit keep that one context bit per task (`task_ctx`), and a memcg
// end closes a memcg or a proactive window alike.
// Nested begins on one task (not expected) keep the outer window and are counted.
//
// gated: the windows (begin / end / wake / sleep) and the write context are kept
// while unarmed, so a window opened before arming still names its events and is timed
// in full; what they count is gated (map-full losses excepted), and the shrink /
// isolate programs are gated as a whole.
//
// shrink_inactive's nr_scanned / nr_reclaimed are exactly what the kernel adds
// to pgscan_{anon,file} / pgsteal_{anon,file} in /proc/vmstat (and to the
// per-reclaimer pgscan_kswapd/direct only for global reclaim: memcg limit
// reclaim is counted there only in the memcg's own v2 memory.stat).
//
// Knobs (read-only globals; toolkit/record/probes/reclaim.py declares them): moe_ctx_write (the
// small-write context is kept: memory.reclaim -> PROACTIVE), moe_bucket_ns (per-time-bucket
// counters: bucket width, 0: off), moe_max_buckets (buckets kept; later events land in the last
// one), moe_t0_ns (bpf_ktime_get_ns(), CLOCK_MONOTONIC, of bucket 0). moe_have_direct /
// moe_have_kswapd / moe_have_shrink_active / moe_have_isolate (and moe_ctx_write) say which
// optional groups the attach plan loads: the programs are all in the object, the plan chooses;
// the globals record the choice. moe_max_tasks sizes `active` and `task_ctx` (the loader does).

#include "moetrace.bpf.h"

const volatile u32 moe_have_direct = 1;
const volatile u32 moe_have_kswapd = 1;
const volatile u32 moe_have_shrink_active = 1;
const volatile u32 moe_have_isolate = 1;
const volatile u32 moe_ctx_write = 1;
const volatile u32 moe_max_tasks = 16384;
const volatile u64 moe_bucket_ns = 0;
const volatile u32 moe_max_buckets = 4096;
const volatile u64 moe_t0_ns = 0;

#define SMALL_WRITE 64  // a write(2) of at most this many bytes: "1G" to memory.reclaim

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
enum moe_stat {  // the `stats` map's slots, in the declaration's order (SPEC.stats)
    STAT_NESTED_BEGINS,          // a begin while the task had an open window
    STAT_UNMATCHED_ENDS,         // an end with no open window (attached mid-way)
    STAT_KIND_MISMATCH,          // an end of another kind than the open window
    STAT_TASK_MAP_FULL,          // window not stored: its events count as OTHER
    STAT_TIMELINE_OVERFLOW,      // events past the last bucket (counted in it)
    N_STATS
};
MOE_STAT_BTF;

// timeline fields per (bucket, kind)
#define T_SCANNED 0
#define T_RECLAIMED 1
#define T_INVOCATIONS 2          // invocations that ended in the bucket
#define T_DURATION_NS 3          // ... and their duration
#define N_TL 4

#define HIST_SLOTS 64

struct window {
    u64 start_ns;
    u32 kind;
    u32 depth;  // nested begins beyond the first
};

MOE_PERCPU_ARRAY(totals, u64);    // N_KINDS * N_FIELDS
MOE_PERCPU_ARRAY(dur_hist, u64);  // N_KINDS * HIST_SLOTS
MOE_PERCPU_ARRAY(stats, u64);     // N_STATS
MOE_PERCPU_ARRAY(timeline, u64);  // moe_max_buckets * N_KINDS * N_TL (1 when moe_bucket_ns is 0)
MOE_HASH(active, u32, struct window);   // moe_max_tasks
MOE_LRU_HASH(task_ctx, u32, u32);       // moe_max_tasks

// Per-CPU slots: programs on one CPU never interleave (recursion protection), so += is safe.
static __always_inline void pcpu_add(void *map, u32 slot, u64 v)
{
    u64 *p = bpf_map_lookup_elem(map, &slot);
    if (p)
        *p += v;
}

static __always_inline void stat_add(u32 slot, u64 v) { pcpu_add(&stats, slot, v); }

static __always_inline void tot_add(u32 kind, u32 f, u64 v) { pcpu_add(&totals, kind * N_FIELDS + f, v); }

static __always_inline void tl_add(u64 now, u32 kind, u32 f, u64 v)
{
    if (!moe_bucket_ns)
        return;
    u64 b = 0;
    if (now > moe_t0_ns)
        b = (now - moe_t0_ns) / moe_bucket_ns;
    if (b >= moe_max_buckets) {
        b = moe_max_buckets - 1;
        if (f == T_SCANNED || f == T_INVOCATIONS)
            stat_add(STAT_TIMELINE_OVERFLOW, 1);
    }
    pcpu_add(&timeline, ((u32)b * N_KINDS + kind) * N_TL + f, v);
}

static __always_inline u32 tid_of(void)
{
    return (u32)bpf_get_current_pid_tgid();
}

// the kind of the reclaim the current task is doing
static __always_inline u32 current_kind(void)
{
    u32 tid = tid_of();
    struct window *w = bpf_map_lookup_elem(&active, &tid);
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
    struct window *w = bpf_map_lookup_elem(&active, &tid);
    if (w) {
        w->depth += 1;
        if (on)
            stat_add(STAT_NESTED_BEGINS, 1);
        return;
    }
    struct window nw = {.start_ns = bpf_ktime_get_ns(), .kind = kind};
    if (bpf_map_update_elem(&active, &tid, &nw, BPF_ANY) != 0)
        stat_add(STAT_TASK_MAP_FULL, 1);
}

// The end of a completed window of kind k and duration d (armed only): totals, timeline,
// duration histogram.
static __always_inline void window_done(u32 k, u64 now, u64 d)
{
    tot_add(k, F_COMPLETED, 1);
    tot_add(k, F_DURATION_NS, d);
    tl_add(now, k, T_INVOCATIONS, 1);
    tl_add(now, k, T_DURATION_NS, d);
    u32 slot = moe_log2l(d);
    if (slot >= HIST_SLOTS)
        slot = HIST_SLOTS - 1;
    pcpu_add(&dur_hist, k * HIST_SLOTS + slot, 1);
}

// Closes the task's window (armed or not); counts only while armed. A memcg end closes a
// memcg or a proactive window, and its nr_reclaimed goes to the proactive kind in the latter.
static __always_inline void window_end(u32 kind, u64 nr_reclaimed)
{
    u32 tid = tid_of();
    u64 now = bpf_ktime_get_ns();
    int on = moe_armed();
    struct window *w = bpf_map_lookup_elem(&active, &tid);
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
    bpf_map_delete_elem(&active, &tid);
    if (!on)
        return;
    if (k != ek)
        stat_add(STAT_KIND_MISMATCH, 1);
    window_done(k, now, d);
}

// -- the write(2) context: memory.reclaim is a small write to the cgroup's file (not gated) ------

SEC("tracepoint/syscalls/sys_enter_write")
int tp_sys_enter_write(struct trace_event_raw_sys_enter *ctx)
{
    u64 count = ctx->args[2];
    return count <= SMALL_WRITE ? moe_ctx_set(&task_ctx, CTX_WRITE_SMALL, 1) : 0;
}

SEC("tracepoint/syscalls/sys_exit_write")
int tp_sys_exit_write(void *ctx)
{
    return moe_ctx_set(&task_ctx, CTX_WRITE_SMALL, 0);
}

// 1: the current task is inside a write(2) of at most SMALL_WRITE bytes
static __always_inline int in_small_write(void)
{
    return moe_ctx_write && (moe_ctx_get(&task_ctx) & CTX_WRITE_SMALL);
}

// -- reclaim windows (not gated: window_begin / window_end gate their counts) ---------------

SEC("tracepoint/vmscan/mm_vmscan_memcg_reclaim_begin")
int tp_mm_vmscan_memcg_reclaim_begin(void *ctx)
{
    window_begin(in_small_write() ? KIND_PROACTIVE : KIND_MEMCG);
    return 0;
}

SEC("tracepoint/vmscan/mm_vmscan_memcg_reclaim_end")
int tp_mm_vmscan_memcg_reclaim_end(struct trace_event_raw_mm_vmscan_direct_reclaim_end_template *ctx)
{
    window_end(KIND_MEMCG, ctx->nr_reclaimed);
    return 0;
}

SEC("tracepoint/vmscan/mm_vmscan_direct_reclaim_begin")
int tp_mm_vmscan_direct_reclaim_begin(void *ctx)
{
    window_begin(KIND_DIRECT);
    return 0;
}

SEC("tracepoint/vmscan/mm_vmscan_direct_reclaim_end")
int tp_mm_vmscan_direct_reclaim_end(struct trace_event_raw_mm_vmscan_direct_reclaim_end_template *ctx)
{
    window_end(KIND_DIRECT, ctx->nr_reclaimed);
    return 0;
}

SEC("tracepoint/vmscan/mm_vmscan_kswapd_wake")
int tp_mm_vmscan_kswapd_wake(void *ctx)
{
    u32 tid = tid_of();
    if (bpf_map_lookup_elem(&active, &tid))  // woke again without sleeping: close the previous window
        window_end(KIND_KSWAPD, 0);
    window_begin(KIND_KSWAPD);
    return 0;
}

SEC("tracepoint/vmscan/mm_vmscan_kswapd_sleep")
int tp_mm_vmscan_kswapd_sleep(void *ctx)
{
    window_end(KIND_KSWAPD, 0);
    return 0;
}

// -- counting programs (gated) ---------------------------------------------------------------

SEC("tracepoint/vmscan/mm_vmscan_lru_shrink_inactive")
int tp_mm_vmscan_lru_shrink_inactive(struct trace_event_raw_mm_vmscan_lru_shrink_inactive *ctx)
{
    MOE_GATE();
    u32 k = current_kind();
    u64 scanned = ctx->nr_scanned, reclaimed = ctx->nr_reclaimed;
    tot_add(k, F_INACTIVE_CALLS, 1);
    tot_add(k, F_SCANNED, scanned);
    tot_add(k, F_RECLAIMED, reclaimed);
    if (ctx->reclaim_flags & 0x2) {  // RECLAIM_WB_FILE
        tot_add(k, F_SCANNED_FILE, scanned);
        tot_add(k, F_RECLAIMED_FILE, reclaimed);
    }
    tot_add(k, F_DIRTY, ctx->nr_dirty);
    tot_add(k, F_WRITEBACK, ctx->nr_writeback);
    tot_add(k, F_CONGESTED, ctx->nr_congested);
    tot_add(k, F_IMMEDIATE, ctx->nr_immediate);
    tot_add(k, F_ACTIVATE_ANON, ctx->nr_activate0);
    tot_add(k, F_ACTIVATE_FILE, ctx->nr_activate1);
    tot_add(k, F_REF_KEEP, ctx->nr_ref_keep);
    tot_add(k, F_UNMAP_FAIL, ctx->nr_unmap_fail);
    if (moe_bucket_ns) {
        u64 now = bpf_ktime_get_ns();
        tl_add(now, k, T_SCANNED, scanned);
        tl_add(now, k, T_RECLAIMED, reclaimed);
    }
    return 0;
}

SEC("tracepoint/vmscan/mm_vmscan_lru_shrink_active")
int tp_mm_vmscan_lru_shrink_active(struct trace_event_raw_mm_vmscan_lru_shrink_active *ctx)
{
    MOE_GATE();
    u32 k = current_kind();
    tot_add(k, F_ACTIVE_CALLS, 1);
    tot_add(k, F_ACTIVE_TAKEN, ctx->nr_taken);
    tot_add(k, F_ACTIVE_DEACTIVATED, ctx->nr_deactivated);
    tot_add(k, F_ACTIVE_KEPT, ctx->nr_active);
    tot_add(k, F_ACTIVE_REFERENCED, ctx->nr_referenced);
    return 0;
}

SEC("tracepoint/vmscan/mm_vmscan_lru_isolate")
int tp_mm_vmscan_lru_isolate(struct trace_event_raw_mm_vmscan_lru_isolate *ctx)
{
    MOE_GATE();
    u32 k = current_kind();
    tot_add(k, F_ISOLATE_CALLS, 1);
    tot_add(k, F_ISOLATE_REQUESTED, ctx->nr_requested);
    tot_add(k, F_ISOLATE_SCANNED, ctx->nr_scanned);
    tot_add(k, F_ISOLATE_SKIPPED, ctx->nr_skipped);
    tot_add(k, F_ISOLATE_TAKEN, ctx->nr_taken);
    return 0;
}
