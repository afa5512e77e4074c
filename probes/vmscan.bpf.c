// SPDX-License-Identifier: Apache-2.0
// vmscan: page reclaim batch by batch. kswapd's wake-ups (node, zone, order) and sleeps, and
// every mm_vmscan_lru_shrink_inactive batch (scanned, reclaimed, kept referenced, activated,
// unmap failures, priority, file or anon) with who ran it: one ring record per event, in two
// bounded rings, each failed reserve counted. CO-RE (moetrace.bpf.h).
//
// Reads only tracepoint arguments (the event classes' trace_event_raw_* structs, relocated by
// name against the running kernel's BTF) and current->flags:
//   vmscan:mm_vmscan_kswapd_wake             nid, zid, order (on the kswapd thread itself)
//   vmscan:mm_vmscan_kswapd_sleep            nid
//   vmscan:mm_vmscan_lru_shrink_inactive     nid, nr_scanned, nr_reclaimed, nr_ref_keep,
//       nr_activate0 (anon) / nr_activate1 (file), nr_unmap_fail, priority, reclaim_flags
//       (RECLAIM_WB_FILE 0x2: a file batch, else anon)
//   vmscan:mm_vmscan_direct_reclaim_begin/end   a task's global direct-reclaim window
//   vmscan:mm_vmscan_memcg_reclaim_begin/end    a task's memcg reclaim window (limit, high,
//       memory.reclaim)
//
// Who ran a batch (WHO_*, toolkit/record/probes/vmscan.py WHO names them in this order): kswapd
// when PF_KSWAPD is in current->flags (what the kernel's current_is_kswapd() reads); else direct
// or memcg when the task is inside that window (a context bit per task in `task_ctx`, set at the
// begin, cleared at the end; a begin the full map cannot store is counted); else other (node reclaim, khugepaged, reclaim outside a window).
// The kernel splits its counters the same way: pgscan/pgsteal_kswapd and _direct in /proc/vmstat
// for global reclaim (a memcg's own reclaim is counted only in its memory.stat), pgscan/pgsteal
// _anon/_file for every batch. The shrink tracepoint fires only for a batch that isolated a
// folio: a scan that took none counts in pgscan without a record.
//
// gated: the windows are kept while unarmed (a window opened before arming still names its
// batches); records are made only while armed.
//
// Knobs (read-only globals; toolkit/record/probes/vmscan.py declares them): moe_have_direct /
// moe_have_memcg (the plan attached that window's begin/end), moe_max_tasks (sizes `task_ctx`),
// moe_ringbuf_pages (sizes each ring; the loader does).

#include "moetrace.bpf.h"

const volatile u32 moe_have_direct = 1;
const volatile u32 moe_have_memcg = 1;
const volatile u32 moe_max_tasks = 4096;
const volatile u32 moe_ringbuf_pages = 64;

#define MOE_PF_KSWAPD 0x00020000  // include/linux/sched.h: "I am kswapd" (a #define: not in BTF)
#define RECLAIM_WB_FILE 0x2

// who ran a batch
#define WHO_KSWAPD 0
#define WHO_DIRECT 1
#define WHO_MEMCG 2
#define WHO_OTHER 3

// stats slots (toolkit/record/probes/vmscan.py SPEC.stats names them, in order)
enum moe_stat {  // the `stats` map's slots, in the declaration's order (SPEC.stats)
    STAT_WAKE_RECORDS,        // kswapd wake / sleep records submitted
    STAT_WAKE_LOST,           // ... the `wakes` ring had no room for
    STAT_BATCH_RECORDS,       // shrink_inactive batch records submitted
    STAT_BATCH_LOST,          // ... the `batches` ring had no room for
    STAT_TASK_MAP_FULL,       // a window's begin not stored: its batches count as other
    N_STATS
};
MOE_STAT_BTF;

struct vmscan_wake {
    u64 ts_ns;   // bpf_ktime_get_ns (CLOCK_MONOTONIC)
    u32 nid;     // the node
    u32 zid;     // wake: the highest zone index asked for (sleep: 0)
    u32 order;   // wake: the allocation order kswapd reclaims for (sleep: 0)
    u32 kind;    // 0 wake, 1 sleep
    u32 pid;     // the kswapd thread
    u32 pad;
};

struct vmscan_batch {
    u64 ts_ns;          // bpf_ktime_get_ns at the batch's end (the tracepoint)
    u64 nr_scanned;
    u64 nr_reclaimed;
    u64 nr_ref_keep;
    u64 nr_unmap_fail;
    u32 nr_activate_anon;
    u32 nr_activate_file;
    u32 nid;
    s32 priority;
    u32 file;           // 1: the file LRU, 0: anon
    u32 who;            // WHO_*
    u32 tgid;           // the reclaiming task's process (kswapd: its thread)
    u32 pid;            // the reclaiming thread
};

MOE_ARRAY(stats, u64);
MOE_HASH(task_ctx, u32, u32);
MOE_RINGBUF(wakes);
MOE_RINGBUF(batches);

// Keep the ring records in the object's BTF (the declaration test reads them there).
struct vmscan_wake _vmscan_wake = {};
struct vmscan_batch _vmscan_batch = {};

static __always_inline void stat_add(u32 slot, u64 v) { moe_add(&stats, slot, v); }

static __always_inline u32 who_now(void)
{
    struct task_struct *t = (struct task_struct *)bpf_get_current_task();
    if (BPF_CORE_READ(t, flags) & MOE_PF_KSWAPD)
        return WHO_KSWAPD;
    u32 c = moe_ctx_get(&task_ctx);
    if (c & CTX_DIRECT)
        return WHO_DIRECT;
    if (c & CTX_MEMCG)
        return WHO_MEMCG;
    return WHO_OTHER;
}

// Open (on) or close a window on the current task: its bit in `task_ctx` (a hash: a task's entry
// goes when its last window closes, so the map holds the tasks inside a window now).
static __always_inline void window(u32 bit, int on)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u32 *c = bpf_map_lookup_elem(&task_ctx, &tid);
    if (!on) {
        if (c && !(*c &= ~bit))
            bpf_map_delete_elem(&task_ctx, &tid);
        return;
    }
    if (c) {
        *c |= bit;
        return;
    }
    u32 v = bit;
    if (bpf_map_update_elem(&task_ctx, &tid, &v, BPF_ANY) && moe_armed())
        stat_add(STAT_TASK_MAP_FULL, 1);
}

static __always_inline void wake_record(u32 nid, u32 zid, u32 order, u32 kind)
{
    struct vmscan_wake *e = bpf_ringbuf_reserve(&wakes, sizeof(struct vmscan_wake), 0);
    if (!e) {
        stat_add(STAT_WAKE_LOST, 1);
        return;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->nid = nid;
    e->zid = zid;
    e->order = order;
    e->kind = kind;
    e->pid = (u32)bpf_get_current_pid_tgid();
    e->pad = 0;
    bpf_ringbuf_submit(e, 0);
    stat_add(STAT_WAKE_RECORDS, 1);
}

// -- kswapd ------------------------------------------------------------------------------------

SEC("tracepoint/vmscan/mm_vmscan_kswapd_wake")
int tp_mm_vmscan_kswapd_wake(struct trace_event_raw_mm_vmscan_kswapd_wake *ctx)
{
    MOE_GATE();
    wake_record(ctx->nid, ctx->zid, ctx->order, 0);
    return 0;
}

SEC("tracepoint/vmscan/mm_vmscan_kswapd_sleep")
int tp_mm_vmscan_kswapd_sleep(struct trace_event_raw_mm_vmscan_kswapd_sleep *ctx)
{
    MOE_GATE();
    wake_record(ctx->nid, 0, 0, 1);
    return 0;
}

// -- reclaim windows (not gated) ---------------------------------------------------------------

SEC("tracepoint/vmscan/mm_vmscan_direct_reclaim_begin")
int tp_mm_vmscan_direct_reclaim_begin(void *ctx)
{
    window(CTX_DIRECT, 1);
    return 0;
}

SEC("tracepoint/vmscan/mm_vmscan_direct_reclaim_end")
int tp_mm_vmscan_direct_reclaim_end(void *ctx)
{
    window(CTX_DIRECT, 0);
    return 0;
}

SEC("tracepoint/vmscan/mm_vmscan_memcg_reclaim_begin")
int tp_mm_vmscan_memcg_reclaim_begin(void *ctx)
{
    window(CTX_MEMCG, 1);
    return 0;
}

SEC("tracepoint/vmscan/mm_vmscan_memcg_reclaim_end")
int tp_mm_vmscan_memcg_reclaim_end(void *ctx)
{
    window(CTX_MEMCG, 0);
    return 0;
}

// -- the batches -------------------------------------------------------------------------------

SEC("tracepoint/vmscan/mm_vmscan_lru_shrink_inactive")
int tp_mm_vmscan_lru_shrink_inactive(struct trace_event_raw_mm_vmscan_lru_shrink_inactive *ctx)
{
    MOE_GATE();
    struct vmscan_batch *e = bpf_ringbuf_reserve(&batches, sizeof(struct vmscan_batch), 0);
    if (!e) {
        stat_add(STAT_BATCH_LOST, 1);
        return 0;
    }
    u64 id = bpf_get_current_pid_tgid();
    e->ts_ns = bpf_ktime_get_ns();
    e->nr_scanned = ctx->nr_scanned;
    e->nr_reclaimed = ctx->nr_reclaimed;
    e->nr_ref_keep = ctx->nr_ref_keep;
    e->nr_unmap_fail = ctx->nr_unmap_fail;
    e->nr_activate_anon = ctx->nr_activate0;
    e->nr_activate_file = ctx->nr_activate1;
    e->nid = ctx->nid;
    e->priority = ctx->priority;
    e->file = (ctx->reclaim_flags & RECLAIM_WB_FILE) ? 1 : 0;
    e->who = who_now();
    e->tgid = id >> 32;
    e->pid = (u32)id;
    bpf_ringbuf_submit(e, 0);
    stat_add(STAT_BATCH_RECORDS, 1);
    return 0;
}
