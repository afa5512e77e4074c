// SPDX-License-Identifier: Apache-2.0
// pagecache: per-expert page-cache additions (misses), deletions (evictions)
// and exact per-page re-additions (re-reads), counted in the kernel. CO-RE (moetrace.bpf.h).
//
// Reads only tracepoint arguments, relocated by name against the running kernel's BTF:
//   filemap:mm_filemap_add_to_page_cache       pfn, i_ino, index, s_dev, order
//   filemap:mm_filemap_delete_from_page_cache  pfn, i_ino, index, s_dev, order
//   syscalls:sys_exit_{pread64,preadv,preadv2,read}  ret   (followed tgids only)
//   task:task_newtask                          pid, clone_flags (follow forks)
//   filemap:mm_filemap_fault                   i_ino, s_dev, index  (6.11+; why a page was added)
//   syscalls:sys_{enter,exit}_mmap             flags (MAP_POPULATE: the add's cause)
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
// moe_pool_dev, moe_n_experts, moe_search_steps, moe_have_order, moe_max_folio_pages, moe_epochs,
// moe_stream_events; moe_n_files, moe_n_runs, moe_bm_words size the maps. The attach groups' knobs
// (moe_track_reads, moe_follow_forks, moe_ctx_*) decide which programs load; they are globals too,
// for the record.
//
// Attribution: `inodes` gives a mapped file's window of `runs` (moetrace.bpf.h); a folio's first
// run is found by a bounded binary search in the window, and the folio is cut run by run, one
// bpf_loop step per piece: an expert's pages count in its slot, a page shared by two owners in
// the shared slot, a model file's other pages in non_expert, any other file's in unattributed.
//
// Why a page was added (its cause, CAUSE_*): a thread's last filemap fault on the pool's device
// names the page it asked for (demand); the other pages added while that thread's fault reads
// are readahead (the fault's read-around, or an async readahead a PG_readahead hit started);
// pages added inside mmap(MAP_POPULATE), madvise(WILLNEED) or fadvise(WILLNEED) are populate;
// the rest (read(2) and its readahead, no fault seen) other. Counted per slot, per epoch (the
// experts'), and add events per folio order.
//
// Re-reads are counted per page exactly: a bitmap with one bit per page of every mapped file; a
// deletion sets the bits of its pages, an addition clears them and counts the bits that were set.
// Matching (ino, index) folio pairs would undercount because folio boundaries move between a
// page's eviction and its re-read.

#include "moetrace.bpf.h"

const volatile u32 moe_pool_dev = 0;         // s_dev of the pool's filesystem, (major << 20) | minor; 0: any
const volatile u32 moe_n_experts = 0;        // counters have moe_n_experts + MOE_EXTRA_SLOTS slots
const volatile u32 moe_n_files = 0;          // mapped files (the inodes map)
const volatile u32 moe_n_runs = 0;           // runs of every mapped file (the runs map)
const volatile u32 moe_bm_words = 0;         // u64 words of the re-add bitmap
const volatile u32 moe_search_steps = 0;     // halvings that find a run: ceil(log2(largest window))
const volatile u32 moe_have_order = 1;       // the plan's reading of the format files (order field)
const volatile u32 moe_max_folio_pages = 512;
// Loop bounds, derived by the loader: pieces one folio may be cut into = moe_max_folio_pages + 2
// (a piece is at least one page); bitmap words one piece may span = moe_max_folio_pages / 64 + 2.
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
const volatile u32 moe_have_fault = 1;       // the fault group attached (filemap:mm_filemap_fault, 6.11+)
const volatile u32 moe_ctx_populate = 1;     // the mmap group attached (MAP_POPULATE windows)

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
    STAT_RUN_MISSES,           // a walk that left its file's window (a malformed map: never expected)
    STAT_FAULT_EVENTS,         // filemap faults on the pool's device
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
    u32 expert_id;   // the slot: an expert_id, or moe_n_experts + MOE_SLOT_*
    u32 kind;        // 0 add, 1 delete
    u32 first_page;  // page within the expert (shared, non_expert: the file page)
    u32 pages;
    u32 re_added;    // pages of this piece that were re-added
    u32 tgid;
    u32 evictor;     // delete: EVICTOR_*; add: 0
    u32 reserved;
};

MOE_HASH(inodes, u64, struct moe_win);         // moe_n_files (+ slack)
MOE_ARRAY(runs, struct moe_run);                // moe_n_runs
MOE_ARRAY(counts, struct expert_counts);        // moe_n_experts + MOE_EXTRA_SLOTS
MOE_ARRAY(evicted_bm, u64);                     // moe_bm_words (at least 1)
MOE_ARRAY(stats, u64);                          // N_STATS
MOE_HASH(tgids, u32, u8);
MOE_ARRAY(evictors, u64);                       // (moe_n_experts + MOE_EXTRA_SLOTS) * N_EVICTORS
MOE_LRU_HASH(task_ctx, u32, u32);
MOE_RINGBUF(events);
MOE_ARRAY(epoch_now, u32);                      // 1: the replay writes the epoch (an inherited fd)
MOE_ARRAY(epoch_counts, struct expert_counts);  // moe_epochs * (moe_n_experts + MOE_EXTRA_SLOTS)
MOE_ARRAY(epoch_evictors, u64);                 // moe_epochs * N_EVICTORS: pool pages deleted

#define CAUSE_DEMAND 0     // the page a fault asked for
#define CAUSE_READAHEAD 1  // the other pages a fault's read added (read-around, async readahead)
#define CAUSE_POPULATE 2   // inside mmap(MAP_POPULATE), madvise / fadvise (WILLNEED)
#define CAUSE_OTHER 3      // read(2) and its readahead; any add with no fault or populate context
#define N_CAUSES 4
#define N_ORDERS 16
struct fault_at {
    u64 ino;
    u64 index;
};
MOE_LRU_HASH(faults, u32, struct fault_at);    // thread -> its last filemap fault on the pool's device
MOE_ARRAY(causes, u64);                         // (moe_n_experts + MOE_EXTRA_SLOTS) * N_CAUSES: pages added
MOE_ARRAY(epoch_causes, u64);                   // moe_epochs * N_CAUSES: expert pages added
MOE_ARRAY(orders, u64);                         // N_CAUSES * N_ORDERS: mapped-file add events per folio order

// Keep the shared structs in the object's BTF (the declaration test reads them there).
struct page_event _page_event = {};
struct moe_win _moe_win = {};
struct moe_run _moe_run = {};

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
    u32 k = current_epoch() * (moe_n_experts + MOE_EXTRA_SLOTS) + eid;
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

// One piece [first, first + pages) of slot `slot` (first: the page within the owner): added
// (kind 0, re of them re-added) or deleted (kind 1, by evictor class ev).
static __always_inline void count_piece(u32 slot, u32 kind, u64 first, u64 pages, u64 re, u32 ev)
{
    struct expert_counts *c = bpf_map_lookup_elem(&counts, &slot);
    if (c) {
        if (kind == 0) {
            __sync_fetch_and_add(&c->added_pages, pages);
            if (re)
                __sync_fetch_and_add(&c->re_added_pages, re);
        } else {
            __sync_fetch_and_add(&c->evicted_pages, pages);
        }
    }
    if (kind)
        evictor_add(slot, ev, pages);
    epoch_add(slot, kind, pages);
    if (re)
        epoch_add(slot, 2, re);
    emit(slot, kind, first, pages, re, ev);
}

// The bitmap's bits [bstart, bend): set them (delete) or clear them and count the bits that were
// set (add). Returns the re-added pages. A global function: the verifier checks it once, on its
// own, not once per path of its caller; its masks are computed without a branch.
__noinline u64 bitmap_update(u64 bstart, u64 bend, u32 kind)
{
    u64 re = 0;
    u64 wfirst = bstart >> 6;
    u64 wlast = (bend - 1) >> 6;
    for (u32 j = 0; j < moe_max_wps; j++) {
        u64 wi = wfirst + j;
        if (wi > wlast)
            break;
        u64 a = j == 0 ? (bstart & 63) : 0;                  // j: the loop's counter, a constant
        u64 last = 1 - moe_above(wlast, wi);                  // wi == wlast
        u64 b = 64 - last * (63 - ((bend - 1) & 63));         // 1..64
        u64 mask = (~0ULL >> ((64 - (b - a)) & 63)) << (a & 63);
        u32 key = (u32)wi;
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

// The run of a window holding page idx: the last of [first, first + count) whose start <= idx
// (a window's first run starts at page 0). A branch-free binary search (a branch per step would
// split the verifier's state): moe_search_steps halvings narrow any window to one run.
static __always_inline u32 run_find(const struct moe_win *w, u64 idx)
{
    u32 base = w->first, n = w->count;
    for (u32 i = 0; i < moe_search_steps; i++) {
        u32 half = n >> 1;
        u32 mid = base + half;
        struct moe_run *m = bpf_map_lookup_elem(&runs, &mid);
        if (!m)
            break;
        u64 take = moe_above(idx + 1, m->start);  // start <= idx
        base += half & (u32)(0 - take);
        n -= half;
    }
    return base;
}

// `v` pages of slot `slot` added for cause `c`
static __always_inline void cause_add(u32 slot, u32 c, u64 v)
{
    if (!v)
        return;
    moe_add(&causes, slot * N_CAUSES + c, v);
    if (moe_epochs && slot < moe_n_experts)
        moe_add(&epoch_causes, current_epoch() * N_CAUSES + c, v);
}

// One folio event, cut into pieces of one run each: bpf_loop runs seg_step once per piece (the
// verifier checks the step once, whatever the number of pieces: up to one per page).
struct seg_ctx {
    u64 idx;      // next page of the folio
    u64 end;
    u64 bm_base;  // the window's
    u64 bm_pages;
    u32 r;        // the run holding idx
    u32 rlast;    // the window's end
    u32 kind;
    u32 ev;
    u32 cause;    // add: CAUSE_* of the event (CAUSE_READAHEAD: a fault's, fidx its page)
    u32 _pad;
    u64 fidx;
};

static long seg_step(u32 s, struct seg_ctx *c)
{
    u64 idx = c->idx, end = c->end;
    if (idx >= end)
        return 1;
    u32 r = c->r;
    struct moe_run *run = bpf_map_lookup_elem(&runs, &r);
    u64 rend = run ? (u64)run->start + run->pages : 0;
    if (!run || r >= c->rlast || idx < run->start || rend <= idx) {
        stat_add(STAT_RUN_MISSES, 1);
        return 1;
    }
    u64 pend = end < rend ? end : rend;
    u64 re = 0;
    if (idx < c->bm_pages) {
        u64 bend = pend < c->bm_pages ? pend : c->bm_pages;
        re = bitmap_update(c->bm_base + idx, c->bm_base + bend, c->kind);
    }
    u32 slot = run->slot;
    count_piece(slot, c->kind, (u64)run->epage + (idx - run->start), pend - idx, re, c->ev);
    if (c->kind == 0) {
        u64 dem = c->cause == CAUSE_READAHEAD && c->fidx >= idx && c->fidx < pend;
        cause_add(slot, CAUSE_DEMAND, dem);
        cause_add(slot, c->cause, pend - idx - dem);
    }
    c->idx = pend;
    if (pend >= rend)
        c->r = r + 1;
    return 0;
}

// Why the current thread adds a page of inode ino: CAUSE_POPULATE inside a populate window,
// CAUSE_READAHEAD (with *fidx the page it asked for: that one is CAUSE_DEMAND) after a fault of
// this thread on ino, else CAUSE_OTHER.
static __always_inline u32 add_cause(u64 ino, u64 *fidx)
{
    if (ctx_of_current() & CTX_POPULATE)
        return CAUSE_POPULATE;
    if (!moe_have_fault)
        return CAUSE_OTHER;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct fault_at *f = bpf_map_lookup_elem(&faults, &tid);
    if (!f || f->ino != ino)
        return CAUSE_OTHER;
    *fidx = f->index;
    return CAUSE_READAHEAD;
}

// One folio event: [index, index + npages) of inode ino; kind 0 add, 1 delete (by
// evictor class ev).
static __always_inline int account(u64 ino, u64 index, u64 npages, u32 kind, u32 ev)
{
    struct moe_win *w = bpf_map_lookup_elem(&inodes, &ino);
    if (!w) {
        count_piece(moe_n_experts + MOE_SLOT_UNATTRIBUTED, kind, 0, npages, 0, ev);
        return 0;
    }
    struct seg_ctx c = {.idx = index, .end = index + npages, .bm_base = w->bm_base, .bm_pages = w->pages,
                        .r = run_find(w, index), .rlast = w->first + w->count, .kind = kind, .ev = ev,
                        .cause = CAUSE_OTHER, .fidx = ~0ULL};
    if (kind == 0) {
        u32 ev_cause = add_cause(ino, &c.fidx);
        c.cause = ev_cause;
        if (ev_cause == CAUSE_READAHEAD && c.fidx >= index && c.fidx < index + npages)
            ev_cause = CAUSE_DEMAND;  // the folio holding the page the fault asked for
        moe_add(&orders, ev_cause * N_ORDERS + ((moe_log2l(npages) - 1) & (N_ORDERS - 1)), 1);
    }
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
SEC("tracepoint/syscalls/sys_enter_fadvise64")
int tp_sys_enter_fadvise64(struct trace_event_raw_sys_enter *ctx)
{
    return ctx_set(ctx->args[3] == FADV_WILLNEED_ADVICE ? CTX_FADVISE | CTX_POPULATE : CTX_FADVISE, 1);
}

SEC("tracepoint/syscalls/sys_exit_fadvise64")
int tp_sys_exit_fadvise64(void *ctx) { return ctx_set(CTX_FADVISE | CTX_POPULATE, 0); }
CTX_PAIR(truncate, CTX_TRUNCATE)
CTX_PAIR(ftruncate, CTX_TRUNCATE)
CTX_PAIR(fallocate, CTX_TRUNCATE)
CTX_PAIR(unlink, CTX_TRUNCATE)
CTX_PAIR(unlinkat, CTX_TRUNCATE)

SEC("tracepoint/syscalls/sys_enter_madvise")
int tp_sys_enter_madvise(struct trace_event_raw_sys_enter *ctx)
{
    u64 advice = ctx->args[2];
    if (advice == MADV_PAGEOUT_ADVICE)
        return ctx_set(CTX_PAGEOUT, 1);
    return advice == MADV_WILLNEED_ADVICE ? ctx_set(CTX_POPULATE, 1) : 0;
}

SEC("tracepoint/syscalls/sys_exit_madvise")
int tp_sys_exit_madvise(void *ctx) { return ctx_set(CTX_PAGEOUT | CTX_POPULATE, 0); }

// -- why pages are added: faults and populate windows (groups fault, ctx_*_mmap) --------------------

SEC("tracepoint/filemap/mm_filemap_fault")
int tp_mm_filemap_fault(struct trace_event_raw_mm_filemap_fault *ctx)
{
    if (moe_pool_dev && ctx->s_dev != moe_pool_dev)
        return 0;
    stat_add(STAT_FAULT_EVENTS, 1);
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct fault_at f = {.ino = ctx->i_ino, .index = ctx->index};
    bpf_map_update_elem(&faults, &tid, &f, BPF_ANY);
    return 0;
}

SEC("tracepoint/syscalls/sys_enter_mmap")
int tp_sys_enter_mmap(struct trace_event_raw_sys_enter *ctx)
{
    return (ctx->args[3] & MAP_POPULATE_FLAG) ? ctx_set(CTX_POPULATE, 1) : 0;
}

SEC("tracepoint/syscalls/sys_exit_mmap")
int tp_sys_exit_mmap(void *ctx) { return ctx_set(CTX_POPULATE, 0); }

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
