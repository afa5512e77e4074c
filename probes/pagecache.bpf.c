// SPDX-License-Identifier: Apache-2.0
// pagecache: per-expert page-cache additions (misses), deletions (evictions)
// and exact per-page re-additions (re-reads), counted in the kernel. CO-RE (moetrace.bpf.h).
//
// Reads only tracepoint arguments, relocated by name against the running kernel's BTF:
//   filemap:mm_filemap_add_to_page_cache       pfn, i_ino, index, s_dev, order
//   filemap:mm_filemap_delete_from_page_cache  pfn, i_ino, index, s_dev, order
//   syscalls:sys_exit_{pread64,preadv,preadv2,read}  ret   (followed tgids only)
//   task:task_newtask                          pid, clone_flags (follow forks)
//   vmscan:mm_vmscan_{direct,memcg}_reclaim_{begin,end}   (evictor context, no fields)
//   syscalls:sys_{enter,exit}_{write,fadvise64,truncate,ftruncate,fallocate,unlink,
//       unlinkat,madvise}   count / behavior               (evictor context)
// `order` exists since large folios: bpf_core_field_exists decides, else one page per event.
//
// Who evicted: every deletion is classed by the context that deleted it (moetrace.bpf.h
// EVICTOR_*): kswapd and kdamond by the kernel thread's comm; direct and memcg reclaim
// by an open vmscan begin/end window on the task; memory.reclaim (a memcg window opened
// inside a write(2) of at most 64 bytes) and madvise(MADV_PAGEOUT) as proactive; fadvise64,
// truncate-family syscalls; a write(2) outside reclaim (drop_caches); else other. Counted per
// expert (`evictors`) and per epoch.
//
// Knobs (read-only globals; declared with their meaning in moetrace/record/probes/pagecache.py):
// moe_pool_dev, moe_n_experts, moe_ppe (pages per expert), moe_wpe (bitmap words per expert), moe_have_order,
// moe_max_folio_pages, moe_epochs, moe_stream_events. The attach groups' knobs (moe_track_reads, moe_follow_forks,
// moe_ctx_*) decide which programs load; they are globals too, for the record.
//
// Re-reads are counted per page exactly: a bitmap with one bit per pool page; a deletion sets
// the bits of its pages, an addition clears them and counts the bits that were set. Matching
// (ino, index) folio pairs would undercount because folio boundaries move between a page's
// eviction and its re-read.

#include "moetrace.bpf.h"

const volatile u32 moe_pool_dev = 0;         // s_dev of the pool's filesystem, (major << 20) | minor; 0: any
const volatile u32 moe_n_experts = 0;        // counters have moe_n_experts + 1 slots: the last is unattributed
const volatile u32 moe_ppe = 1;              // pages per expert (the extent)
const volatile u32 moe_wpe = 1;              // 64-bit bitmap words per expert = ceil(moe_ppe / 64)
const volatile u32 moe_have_order = 1;       // the plan's reading of the format files (order field)
const volatile u32 moe_max_folio_pages = 512;
// Loop bounds, derived by the loader (the verifier tracks no division): expert pieces one folio
// may span = moe_max_folio_pages / moe_ppe + 2; bitmap words one piece may span = min(moe_ppe,
// moe_max_folio_pages) / 64 + 2 (at most 10: a piece is at most one 512-page folio).
const volatile u32 moe_max_segs = 514;
const volatile u32 moe_max_wps = 10;
const volatile u32 moe_track_reads = 1;
const volatile u32 moe_follow_forks = 1;
const volatile u32 moe_stream_events = 0;
const volatile u32 moe_ring_pages = 256;
const volatile u32 moe_epochs = 0;           // 0: totals only; else per-epoch counters too
const volatile u32 moe_ctx_write = 1;
const volatile u32 moe_ctx_invalidate = 1;
const volatile u32 moe_ctx_reclaim = 1;
const volatile u32 moe_max_tasks = 16384;

#define SMALL_WRITE 64  // a write(2) of at most this many bytes: "1G" to memory.reclaim

// stats slots (moetrace/record/probes/pagecache.py SPEC.stats names them, in order)
enum moe_stat {  // the `stats` map's slots, in the declaration's order (SPEC.stats)
    STAT_ADD_EVENTS,
    STAT_DELETE_EVENTS,
    STAT_POOL_DEV_ADD_EVENTS,
    STAT_POOL_DEV_DELETE_EVENTS,
    STAT_UNPROCESSED_PAGES,
    STAT_READ_BYTES,
    STAT_READ_CALLS,
    STAT_TGID_MAP_FULL,
    STAT_RING_DROPS,
    STAT_BITMAP_MISSES,
    STAT_DEV_MISMATCH_EVENTS,
    STAT_ADD_RUNS,             // every run of the add program, armed or not (= its BPF run count)
    N_STATS
};
MOE_STAT_BTF;

struct expert_counts {
    u64 added_pages;
    u64 evicted_pages;
    u64 re_added_pages;
};

struct page_event {
    u64 ts_ns;       // bpf_ktime_get_ns (CLOCK_MONOTONIC)
    u32 expert_id;   // moe_n_experts = unattributed
    u32 kind;        // 0 add, 1 delete
    u32 first_page;  // page within the expert
    u32 pages;
    u32 re_added;    // pages of this piece that were re-added
    u32 tgid;
    u32 evictor;     // delete: EVICTOR_*; add: 0
    u32 reserved;
};

MOE_HASH(inodes, u64, struct ino_val);
MOE_ARRAY(counts, struct expert_counts);        // moe_n_experts + 1
MOE_ARRAY(evicted_bm, u64);                     // moe_n_experts * moe_wpe (at least 1)
MOE_ARRAY(stats, u64);                          // N_STATS
MOE_HASH(tgids, u32, u8);
MOE_ARRAY(evictors, u64);                       // (moe_n_experts + 1) * N_EVICTORS: row moe_n_experts unattributed
MOE_LRU_HASH(task_ctx, u32, u32);
MOE_RINGBUF(events);
MOE_ARRAY(epoch_now, u32);                      // 1: the replay writes the epoch (an inherited fd)
MOE_ARRAY(epoch_counts, struct expert_counts);  // moe_epochs * (moe_n_experts + 1)
MOE_ARRAY(epoch_evictors, u64);                 // moe_epochs * N_EVICTORS: pool pages deleted

// Keep the shared structs in the object's BTF (the declaration test reads them there).
struct page_event _page_event = {};
struct ino_val _ino_val = {};

static __always_inline void stat_add(u32 slot, u64 v) { moe_add(&stats, slot, v); }

// the highest epoch a count landed in: user space reads the epoch arrays that far (a replay's
// moe_epochs only grow, but a second replay in one recording starts again at 0). A plain max: two
// CPUs may race and leave the lower one; user space also takes the replay's last epoch.
volatile u32 epoch_hi = 0;

static __always_inline u32 current_epoch(void)
{
    if (!moe_epochs)
        return 0;
    u32 z = 0;
    u32 *ep = bpf_map_lookup_elem(&epoch_now, &z);
    u32 e = ep ? *ep : 0;
    if (e >= moe_epochs)
        e = moe_epochs - 1;
    if (e > epoch_hi)
        epoch_hi = e;
    return e;
}

// -- evictor context (moetrace.bpf.h: the task's CTX_* bits in task_ctx) ------------------------

static __always_inline u32 ctx_of_current(void) { return moe_ctx_get(&task_ctx); }
static __always_inline int ctx_set(u32 bits, int on) { return moe_ctx_set(&task_ctx, bits, on); }

static __always_inline void evictor_add(u32 eid, u32 ev, u64 pages)
{
    moe_add(&evictors, eid * N_EVICTORS + ev, pages);
    if (moe_epochs && eid < moe_n_experts)
        moe_add(&epoch_evictors, current_epoch() * N_EVICTORS + ev, pages);
}

// The per-epoch copy of one count: slot (epoch, eid) of epoch_counts; what = 0 added,
// 1 evicted, 2 re-added. An epoch beyond the array lands in the last one.
static __always_inline void epoch_add(u32 eid, u32 what, u64 v)
{
    if (!moe_epochs)
        return;
    u32 k = current_epoch() * (moe_n_experts + 1) + eid;
    struct expert_counts *c = bpf_map_lookup_elem(&epoch_counts, &k);
    if (!c)
        return;
    if (what == 0)
        __sync_fetch_and_add(&c->added_pages, v);
    else if (what == 1)
        __sync_fetch_and_add(&c->evicted_pages, v);
    else
        __sync_fetch_and_add(&c->re_added_pages, v);
}

static __always_inline void emit(u32 eid, u32 kind, u64 first, u64 pages, u64 re, u32 ev)
{
    if (!moe_stream_events)
        return;
    struct page_event *e = bpf_ringbuf_reserve(&events, sizeof(struct page_event), 0);
    if (!e) {
        stat_add(STAT_RING_DROPS, 1);
        return;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->expert_id = eid;
    e->kind = kind;
    e->first_page = (u32)first;
    e->pages = (u32)pages;
    e->re_added = (u32)re;
    e->tgid = bpf_get_current_pid_tgid() >> 32;
    e->evictor = ev;
    e->reserved = 0;
    bpf_ringbuf_submit(e, 0);
}

static __always_inline void unattributed(u32 kind, u64 pages, u32 ev)
{
    u32 k = moe_n_experts;
    struct expert_counts *c = bpf_map_lookup_elem(&counts, &k);
    if (!c)
        return;
    if (kind == 0)
        __sync_fetch_and_add(&c->added_pages, pages);
    else
        __sync_fetch_and_add(&c->evicted_pages, pages);
    if (kind)
        evictor_add(moe_n_experts, ev, pages);
    epoch_add(moe_n_experts, kind, pages);
    emit(moe_n_experts, kind, 0, pages, 0, ev);
}

// The bitmap words [pstart, pend) of expert eid: set them (delete) or clear them and count the
// bits that were set (add). Returns the re-added pages.
static __always_inline u64 bitmap_update(u32 eid, u64 pstart, u64 pend, u32 kind)
{
    u64 re = 0;
    u64 wfirst = pstart >> 6;
    u64 wlast = (pend - 1) >> 6;
    for (u32 j = 0; j < moe_max_wps; j++) {
        u64 wi = wfirst + j;
        if (wi > wlast)
            break;
        u64 lo = wi << 6;
        u64 a = pstart > lo ? pstart - lo : 0;
        u64 b = pend < lo + 64 ? pend - lo : 64;
        u64 width = b - a;
        u64 mask = width >= 64 ? ~0ULL : (((1ULL << (width & 63)) - 1) << (a & 63));
        u32 key = eid * moe_wpe + (u32)wi;
        u64 *w = bpf_map_lookup_elem(&evicted_bm, &key);
        if (!w) {
            stat_add(STAT_BITMAP_MISSES, 1);
            continue;
        }
        if (kind == 0) {
            u64 old = __sync_fetch_and_and(w, ~mask);
            re += moe_popcount64(old & mask);
        } else {
            __sync_fetch_and_or(w, mask);
        }
    }
    return re;
}

// One folio event, cut into expert pieces: bpf_loop runs seg_step once per piece (the verifier
// checks the step once, whatever the number of pieces: an unrolled or bounded loop of up to 514
// pieces at one page per expert came within reach of its 1 M instruction budget).
struct seg_ctx {
    u64 base;   // expert id of the file's first extent
    u64 limit;  // pages of the file that belong to experts
    u64 idx;    // next page of the folio
    u64 end;
    u32 kind;
    u32 ev;
};

static long seg_step(u32 s, struct seg_ctx *c)
{
    u64 idx = c->idx, end = c->end;
    if (idx >= end)
        return 1;
    if (idx >= c->limit) {
        unattributed(c->kind, end - idx, c->ev);
        c->idx = end;
        return 1;
    }
    u32 kind = c->kind;
    u64 off_e = idx / moe_ppe;
    u64 e0 = off_e * moe_ppe;
    u32 eid = (u32)(c->base + off_e);
    u64 pstart = idx - e0;
    u64 pend = end - e0;
    if (pend > moe_ppe)
        pend = moe_ppe;
    u64 len = pend - pstart;
    u64 re = bitmap_update(eid, pstart, pend, kind);
    struct expert_counts *cnt = bpf_map_lookup_elem(&counts, &eid);
    if (cnt) {
        if (kind == 0) {
            __sync_fetch_and_add(&cnt->added_pages, len);
            if (re)
                __sync_fetch_and_add(&cnt->re_added_pages, re);
        } else {
            __sync_fetch_and_add(&cnt->evicted_pages, len);
        }
    }
    if (kind)
        evictor_add(eid, c->ev, len);
    epoch_add(eid, kind, len);
    if (re)
        epoch_add(eid, 2, re);
    emit(eid, kind, pstart, len, re, c->ev);
    c->idx = e0 + pend;
    return 0;
}

// One folio event: [index, index + npages) of inode ino; kind 0 add, 1 delete (by
// evictor class ev).
static __always_inline int account(u64 ino, u64 index, u64 npages, u32 kind, u32 ev)
{
    struct ino_val *v = bpf_map_lookup_elem(&inodes, &ino);
    if (!v) {
        unattributed(kind, npages, ev);
        return 0;
    }
    struct seg_ctx c = {.base = v->base, .limit = (u64)v->n * moe_ppe, .idx = index, .end = index + npages,
                        .kind = kind, .ev = ev};
    bpf_loop(moe_max_segs, seg_step, &c, 0);
    if (c.idx < c.end)
        stat_add(STAT_UNPROCESSED_PAGES, c.end - c.idx);
    return 0;
}

// An event of another filesystem: ignored, but one whose inode number is a pool
// inode is counted, so a wrong s_dev (e.g. a filesystem whose stat() st_dev is
// not the superblock's s_dev) shows up in the manifest instead of silent zeros.
static __always_inline int other_dev(u64 ino)
{
    if (bpf_map_lookup_elem(&inodes, &ino))
        stat_add(STAT_DEV_MISMATCH_EVENTS, 1);
    return 0;
}

SEC("tracepoint/filemap/mm_filemap_add_to_page_cache")
int tp_mm_filemap_add_to_page_cache(struct trace_event_raw_mm_filemap_op_page_cache *ctx)
{
    stat_add(STAT_ADD_RUNS, 1);
    MOE_GATE();
    stat_add(STAT_ADD_EVENTS, 1);
    u64 ino = ctx->i_ino;
    if (moe_pool_dev && ctx->s_dev != moe_pool_dev)
        return other_dev(ino);
    stat_add(STAT_POOL_DEV_ADD_EVENTS, 1);
    return account(ino, ctx->index, moe_folio_pages(ctx, moe_have_order), 0, 0);
}

SEC("tracepoint/filemap/mm_filemap_delete_from_page_cache")
int tp_mm_filemap_delete_from_page_cache(struct trace_event_raw_mm_filemap_op_page_cache *ctx)
{
    MOE_GATE();
    stat_add(STAT_DELETE_EVENTS, 1);
    u64 ino = ctx->i_ino;
    if (moe_pool_dev && ctx->s_dev != moe_pool_dev)
        return other_dev(ino);
    stat_add(STAT_POOL_DEV_DELETE_EVENTS, 1);
    return account(ino, ctx->index, moe_folio_pages(ctx, moe_have_order), 1, moe_evictor(ctx_of_current()));
}

// -- read bytes of the followed processes (group exit_*, knob moe_track_reads) ---------------------

static __always_inline int read_exit(long ret)
{
    MOE_GATE();
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!bpf_map_lookup_elem(&tgids, &tgid))
        return 0;
    if (ret > 0) {
        stat_add(STAT_READ_BYTES, (u64)ret);
        stat_add(STAT_READ_CALLS, 1);
    }
    return 0;
}

#define READ_EXIT(sc) \
    SEC("tracepoint/syscalls/sys_exit_" #sc) \
    int tp_sys_exit_##sc(struct trace_event_raw_sys_exit *ctx) \
    { return read_exit(ctx->ret); }
READ_EXIT(pread64)
READ_EXIT(preadv)
READ_EXIT(preadv2)
READ_EXIT(read)

// -- follow forks (group newtask, knob moe_follow_forks) -------------------------------------------

SEC("tracepoint/task/task_newtask")
int tp_task_newtask(struct trace_event_raw_task_newtask *ctx)
{
    u32 parent, child;
    u8 one = 1;
    if (!moe_new_process(ctx, &parent, &child) || !bpf_map_lookup_elem(&tgids, &parent))
        return 0;
    if (bpf_map_update_elem(&tgids, &child, &one, BPF_ANY))
        stat_add(STAT_TGID_MAP_FULL, 1);
    return 0;
}

// -- evictor context: syscalls and reclaim windows (never gated: a window opened before the
// probes were armed still names the evictions inside it) -------------------------------------

SEC("tracepoint/syscalls/sys_enter_write")
int tp_sys_enter_write(struct trace_event_raw_sys_enter *ctx)
{
    u64 count = ctx->args[2];
    return ctx_set(count <= SMALL_WRITE ? CTX_WRITE | CTX_WRITE_SMALL : CTX_WRITE, 1);
}

SEC("tracepoint/syscalls/sys_exit_write")
int tp_sys_exit_write(void *ctx) { return ctx_set(CTX_WRITE | CTX_WRITE_SMALL, 0); }

#define CTX_PAIR(sc, bits) \
    SEC("tracepoint/syscalls/sys_enter_" #sc) \
    int tp_sys_enter_##sc(void *ctx) { return ctx_set(bits, 1); } \
    SEC("tracepoint/syscalls/sys_exit_" #sc) \
    int tp_sys_exit_##sc(void *ctx) { return ctx_set(bits, 0); }
CTX_PAIR(fadvise64, CTX_FADVISE)
CTX_PAIR(truncate, CTX_TRUNCATE)
CTX_PAIR(ftruncate, CTX_TRUNCATE)
CTX_PAIR(fallocate, CTX_TRUNCATE)
CTX_PAIR(unlink, CTX_TRUNCATE)
CTX_PAIR(unlinkat, CTX_TRUNCATE)

SEC("tracepoint/syscalls/sys_enter_madvise")
int tp_sys_enter_madvise(struct trace_event_raw_sys_enter *ctx)
{
    return ctx->args[2] == MADV_PAGEOUT_ADVICE ? ctx_set(CTX_PAGEOUT, 1) : 0;
}

SEC("tracepoint/syscalls/sys_exit_madvise")
int tp_sys_exit_madvise(void *ctx) { return ctx_set(CTX_PAGEOUT, 0); }

SEC("tracepoint/vmscan/mm_vmscan_direct_reclaim_begin")
int tp_mm_vmscan_direct_reclaim_begin(void *ctx) { return ctx_set(CTX_DIRECT, 1); }

SEC("tracepoint/vmscan/mm_vmscan_direct_reclaim_end")
int tp_mm_vmscan_direct_reclaim_end(void *ctx) { return ctx_set(CTX_DIRECT, 0); }

SEC("tracepoint/vmscan/mm_vmscan_memcg_reclaim_begin")
int tp_mm_vmscan_memcg_reclaim_begin(void *ctx)
{
    u32 c = ctx_of_current();
    return ctx_set((c & CTX_WRITE_SMALL) ? CTX_PROACTIVE : CTX_MEMCG, 1);
}

SEC("tracepoint/vmscan/mm_vmscan_memcg_reclaim_end")
int tp_mm_vmscan_memcg_reclaim_end(void *ctx) { return ctx_set(CTX_MEMCG | CTX_PROACTIVE, 0); }
