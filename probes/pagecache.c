// SPDX-License-Identifier: Apache-2.0
// pagecache: per-expert page-cache additions (misses), deletions (evictions)
// and exact per-page re-additions (re-reads), counted in the kernel.
//
// Reads ONLY tracepoint arguments (layout-safe with mismatched headers):
//   filemap:mm_filemap_add_to_page_cache       pfn, i_ino, index, s_dev, order
//   filemap:mm_filemap_delete_from_page_cache  pfn, i_ino, index, s_dev, order
//   syscalls:sys_exit_{pread64,preadv,preadv2,read}  ret   (tracked tgids only)
//   task:task_newtask                          pid, clone_flags (follow forks)
//   vmscan:mm_vmscan_{direct,memcg}_reclaim_{begin,end}   (evictor context, no fields)
//   syscalls:sys_{enter,exit}_{write,fadvise64,truncate,ftruncate,fallocate,unlink,
//       unlinkat,madvise}   count / behavior               (evictor context)
//
// Who evicted: every deletion is classed by the context that deleted it (moetrace.h
// EVICTOR_*): kswapd and kdamond by the kernel thread's comm; direct and memcg reclaim
// by an open vmscan begin/end window on the task; memory.reclaim (a memcg window opened
// inside a write(2) of at most MOE_SMALL_WRITE bytes) and madvise(MADV_PAGEOUT) as
// proactive; fadvise64, truncate-family syscalls; a write(2) outside reclaim
// (drop_caches); else other. Counted per expert (`evictors`) and per epoch.
//
// Configured only with -D knobs (declared in toolkit/record/probes/pagecache.py PAGECACHE,
// with the attach groups, stats slots and shared structs; tests/*/test_probe_build.py
// checks that both sides agree):
//   POOL_DEV        s_dev of the pool's filesystem, kernel encoding
//                   (major << 20) | minor; 0 = every device
//   N_EXPERTS       experts in the pool (counters has N_EXPERTS + 1 slots:
//                   the last one is "unattributed": pool-device pages that map
//                   to no expert)
//   PPE             pages per expert (the extent, in pages)
//   WPE             64-bit bitmap words per expert = ceil(PPE / 64); each
//                   expert owns whole words, so a word never spans two experts
//   HAVE_ORDER      1 if the add/delete format files carry `order` (folios);
//                   0: every event is one page (older kernels)
//   MAX_FOLIO_PAGES largest folio handled in full (1 << MAX_PAGECACHE_ORDER);
//                   pages beyond it are counted in STAT_UNPROCESSED, never lost
//   MAX_SEGS        expert pieces one folio may span: MAX_FOLIO_PAGES / PPE + 2
//   MAX_WPS         bitmap words one piece may span: min(PPE, MAX_FOLIO_PAGES) / 64 + 2
//   TRACK_READS     1: count read-syscall bytes of the tracked tgids
//   FOLLOW_FORKS    1: a tracked tgid's new processes are tracked too
//   STREAM_EVENTS   1: one ring record per (event, expert piece) (per-page stream)
//   RING_PAGES      ring buffer size in pages (power of two)
//   MOE_GATED       1: count only while armed[0] = 1 (moetrace record arms all probes
//                   at once); 0: always (moetrace.h)
//   MOE_CTX_WRITE   1: compile the write(2) context (drop_caches, memory.reclaim)
//   MOE_CTX_INVALIDATE 1: compile the fadvise64 / truncate-family / madvise contexts
//   MOE_CTX_RECLAIM 1: compile the direct / memcg reclaim windows
//   MOE_MAX_TASKS   task -> context entries (an LRU hash: the oldest idle task goes first)
//   EPOCHS          0: totals only; > 0: also per-epoch counters, EPOCHS x
//                   (N_EXPERTS + 1) slots; the epoch is epoch_now[0], which user
//                   space sets (moetrace record: one epoch per replay iteration,
//                   announced by the replay before the iteration starts)
//
// Re-reads are counted per page exactly: a bitmap with one bit per pool page;
// a deletion sets the bits of its pages, an addition clears them and counts
// the bits that were set. Matching (ino, index) folio pairs would undercount
// because folio boundaries move between a page's eviction and its re-read.

#include "moetrace.h"

#ifndef POOL_DEV
#define POOL_DEV 0
#endif
#ifndef N_EXPERTS
#define N_EXPERTS 1
#endif
#ifndef PPE
#define PPE 1
#endif
#ifndef WPE
#define WPE ((PPE + 63) / 64)
#endif
#ifndef HAVE_ORDER
#define HAVE_ORDER 1
#endif
#ifndef MAX_FOLIO_PAGES
#define MAX_FOLIO_PAGES 512
#endif
#ifndef MAX_SEGS
#define MAX_SEGS (MAX_FOLIO_PAGES / PPE + 2)
#endif
#ifndef MAX_WPS
#define MAX_WPS (((PPE) < (MAX_FOLIO_PAGES) ? (PPE) : (MAX_FOLIO_PAGES)) / 64 + 2)
#endif
#ifndef TRACK_READS
#define TRACK_READS 1
#endif
#ifndef FOLLOW_FORKS
#define FOLLOW_FORKS 1
#endif
#ifndef STREAM_EVENTS
#define STREAM_EVENTS 0
#endif
#ifndef RING_PAGES
#define RING_PAGES 64
#endif
#ifndef EPOCHS
#define EPOCHS 0
#endif
#ifndef MAX_TGIDS
#define MAX_TGIDS 1024
#endif
#ifndef MAX_INODES
#define MAX_INODES (N_EXPERTS + 16)
#endif
#ifndef MOE_CTX_WRITE
#define MOE_CTX_WRITE 1
#endif
#ifndef MOE_CTX_INVALIDATE
#define MOE_CTX_INVALIDATE 1
#endif
#ifndef MOE_CTX_RECLAIM
#define MOE_CTX_RECLAIM 1
#endif
#ifndef MOE_MAX_TASKS
#define MOE_MAX_TASKS 16384
#endif

#define CLONE_THREAD_FLAG 0x00010000UL

// stats slots (toolkit/record/probes/pagecache.py PAGECACHE.stats names them, in order)
#define STAT_ADD_EVENTS 0
#define STAT_DELETE_EVENTS 1
#define STAT_POOL_DEV_ADD_EVENTS 2
#define STAT_POOL_DEV_DELETE_EVENTS 3
#define STAT_UNPROCESSED_PAGES 4
#define STAT_READ_BYTES 5
#define STAT_READ_CALLS 6
#define STAT_TGID_FULL 7
#define STAT_RING_DROPS 8
#define STAT_BITMAP_MISS 9
#define STAT_DEV_MISMATCH 10
#define STAT_ADD_RUNS 11       // every run of the add program, armed or not (= its BPF run count)
#define N_STATS 12

struct expert_counts {
    u64 added_pages;
    u64 evicted_pages;
    u64 re_added_pages;
};

struct page_event {
    u64 ts_ns;       // bpf_ktime_get_ns (CLOCK_MONOTONIC)
    u32 expert_id;   // N_EXPERTS = unattributed
    u32 kind;        // 0 add, 1 delete
    u32 first_page;  // page within the expert
    u32 pages;
    u32 re_added;    // pages of this piece that were re-added
    u32 tgid;
    u32 evictor;     // delete: EVICTOR_* (moetrace.h); add: 0
    u32 reserved;
};

BPF_HASH(inodes, u64, struct ino_val, MAX_INODES);
BPF_ARRAY(counts, struct expert_counts, N_EXPERTS + 1);
// at least one word: a map may not be empty (no pool: N_EXPERTS = 0)
#define BM_WORDS ((N_EXPERTS) * (WPE) > 0 ? (N_EXPERTS) * (WPE) : 1)
BPF_ARRAY(evicted_bm, u64, BM_WORDS);
BPF_ARRAY(stats, u64, N_STATS);
BPF_HASH(tgids, u32, u8, MAX_TGIDS);
// pages deleted per (expert, evictor class): row N_EXPERTS is unattributed
BPF_ARRAY(evictors, u64, (N_EXPERTS + 1) * N_EVICTORS);
#if MOE_CTX_WRITE || MOE_CTX_INVALIDATE || MOE_CTX_RECLAIM
BPF_TABLE("lru_hash", u32, u32, task_ctx, MOE_MAX_TASKS);
#endif
#if MOE_GATED
BPF_ARRAY(armed, u32, 1);
#endif
#if STREAM_EVENTS
BPF_RINGBUF_OUTPUT(events, RING_PAGES);
#endif
#if EPOCHS
BPF_ARRAY(epoch_now, u32, 1);
BPF_ARRAY(epoch_counts, struct expert_counts, EPOCHS * (N_EXPERTS + 1));
// pool pages (attributed experts) deleted per (epoch, evictor class)
BPF_ARRAY(epoch_evictors, u64, EPOCHS * N_EVICTORS);
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

static __always_inline u32 current_epoch(void) {
#if EPOCHS
    u32 z = 0;
    u32 *ep = epoch_now.lookup(&z);
    u32 e = ep ? *ep : 0;
    return e < EPOCHS ? e : EPOCHS - 1;
#else
    return 0;
#endif
}

// -- evictor context --------------------------------------------------------------------------

static __always_inline u32 ctx_of_current(void) {
#if MOE_CTX_WRITE || MOE_CTX_INVALIDATE || MOE_CTX_RECLAIM
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u32 *c = task_ctx.lookup(&tid);
    return c ? *c : 0;
#else
    return 0;
#endif
}

#if MOE_CTX_WRITE || MOE_CTX_INVALIDATE || MOE_CTX_RECLAIM
// set (on) or clear (off) bits of the current task's context, rewriting its entry in place
static __always_inline int ctx_set(u32 bits, int on) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
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
#endif

static __always_inline void evictor_add(u32 eid, u32 ev, u64 pages) {
    u32 k = eid * N_EVICTORS + ev;
    u64 *p = evictors.lookup(&k);
    if (p)
        __sync_fetch_and_add(p, pages);
#if EPOCHS
    if (eid < N_EXPERTS) {
        u32 ek = current_epoch() * N_EVICTORS + ev;
        u64 *q = epoch_evictors.lookup(&ek);
        if (q)
            __sync_fetch_and_add(q, pages);
    }
#endif
}

// The per-epoch copy of one count: slot (epoch, eid) of epoch_counts; what = 0 added,
// 1 evicted, 2 re-added. An epoch beyond the array lands in the last one.
static __always_inline void epoch_add(u32 eid, u32 what, u64 v) {
#if EPOCHS
    u32 k = current_epoch() * (N_EXPERTS + 1) + eid;
    struct expert_counts *c = epoch_counts.lookup(&k);
    if (!c)
        return;
    if (what == 0)
        __sync_fetch_and_add(&c->added_pages, v);
    else if (what == 1)
        __sync_fetch_and_add(&c->evicted_pages, v);
    else
        __sync_fetch_and_add(&c->re_added_pages, v);
#endif
}

static __always_inline void stat_add(u32 slot, u64 v) {
    u64 *p = stats.lookup(&slot);
    if (p)
        __sync_fetch_and_add(p, v);
}

static __always_inline void emit(u32 eid, u32 kind, u64 first, u64 pages, u64 re, u32 ev) {
#if STREAM_EVENTS
    struct page_event *e = events.ringbuf_reserve(sizeof(struct page_event));
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
    events.ringbuf_submit(e, 0);
#endif
}

static __always_inline void unattributed(u32 kind, u64 pages, u32 ev) {
    u32 k = N_EXPERTS;
    struct expert_counts *c = counts.lookup(&k);
    if (!c)
        return;
    if (kind == 0)
        __sync_fetch_and_add(&c->added_pages, pages);
    else
        __sync_fetch_and_add(&c->evicted_pages, pages);
    if (kind)
        evictor_add(N_EXPERTS, ev, pages);
    epoch_add(N_EXPERTS, kind, pages);
    emit(N_EXPERTS, kind, 0, pages, 0, ev);
}

// One folio event: [index, index + npages) of inode ino; kind 0 add, 1 delete (by
// evictor class ev).
static __always_inline int account(u64 ino, u64 index, u64 npages, u32 kind, u32 ev) {
    struct ino_val *v = inodes.lookup(&ino);
    if (!v) {
        unattributed(kind, npages, ev);
        return 0;
    }
    u64 base = v->base;
    u64 limit = (u64)v->n * PPE;  // pages of the file that belong to experts
    u64 idx = index;
    u64 end = index + npages;
    for (int s = 0; s < MAX_SEGS; s++) {
        if (idx >= end)
            break;
        if (idx >= limit) {
            unattributed(kind, end - idx, ev);
            idx = end;
            break;
        }
        u64 off_e = idx / PPE;
        u64 e0 = off_e * PPE;
        u32 eid = (u32)(base + off_e);
        u64 pstart = idx - e0;
        u64 pend = end - e0;
        if (pend > PPE)
            pend = PPE;
        u64 len = pend - pstart;
        u64 re = 0;
        u64 wfirst = pstart >> 6;
        u64 wlast = (pend - 1) >> 6;
        for (int j = 0; j < MAX_WPS; j++) {
            u64 wi = wfirst + j;
            if (wi > wlast)
                break;
            u64 lo = wi << 6;
            u64 a = pstart > lo ? pstart - lo : 0;
            u64 b = pend < lo + 64 ? pend - lo : 64;
            u64 width = b - a;
            u64 mask = width >= 64 ? ~0ULL : (((1ULL << (width & 63)) - 1) << (a & 63));
            u32 key = eid * WPE + (u32)wi;
            u64 *w = evicted_bm.lookup(&key);
            if (!w) {
                stat_add(STAT_BITMAP_MISS, 1);
                continue;
            }
            if (kind == 0) {
                u64 old = __sync_fetch_and_and(w, ~mask);
                re += moe_popcount64(old & mask);
            } else {
                __sync_fetch_and_or(w, mask);
            }
        }
        struct expert_counts *c = counts.lookup(&eid);
        if (c) {
            if (kind == 0) {
                __sync_fetch_and_add(&c->added_pages, len);
                if (re)
                    __sync_fetch_and_add(&c->re_added_pages, re);
            } else {
                __sync_fetch_and_add(&c->evicted_pages, len);
            }
        }
        if (kind)
            evictor_add(eid, ev, len);
        epoch_add(eid, kind, len);
        if (re)
            epoch_add(eid, 2, re);
        emit(eid, kind, pstart, len, re, ev);
        idx = e0 + pend;
    }
    if (idx < end)
        stat_add(STAT_UNPROCESSED_PAGES, end - idx);
    return 0;
}

// An event of another filesystem: ignored, but one whose inode number is a pool
// inode is counted, so a wrong s_dev (e.g. a filesystem whose stat() st_dev is
// not the superblock's s_dev) shows up in the manifest instead of silent zeros.
static __always_inline int other_dev(u64 ino) {
    if (inodes.lookup(&ino))
        stat_add(STAT_DEV_MISMATCH, 1);
    return 0;
}

TRACEPOINT_PROBE(filemap, mm_filemap_add_to_page_cache) {
    stat_add(STAT_ADD_RUNS, 1);
    MOE_GATE();
    stat_add(STAT_ADD_EVENTS, 1);
    if (POOL_DEV && args->s_dev != POOL_DEV)
        return other_dev(args->i_ino);
    stat_add(STAT_POOL_DEV_ADD_EVENTS, 1);
#if HAVE_ORDER
    u64 n = 1ULL << (args->order & 31);
#else
    u64 n = 1;
#endif
    return account(args->i_ino, args->index, n, 0, 0);
}

TRACEPOINT_PROBE(filemap, mm_filemap_delete_from_page_cache) {
    MOE_GATE();
    stat_add(STAT_DELETE_EVENTS, 1);
    if (POOL_DEV && args->s_dev != POOL_DEV)
        return other_dev(args->i_ino);
    stat_add(STAT_POOL_DEV_DELETE_EVENTS, 1);
#if HAVE_ORDER
    u64 n = 1ULL << (args->order & 31);
#else
    u64 n = 1;
#endif
    return account(args->i_ino, args->index, n, 1, moe_evictor(ctx_of_current()));
}

#if TRACK_READS
static __always_inline int read_exit(long ret) {
    MOE_GATE();
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!tgids.lookup(&tgid))
        return 0;
    if (ret > 0) {
        stat_add(STAT_READ_BYTES, (u64)ret);
        stat_add(STAT_READ_CALLS, 1);
    }
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_pread64) { return read_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_preadv) { return read_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_preadv2) { return read_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_read) { return read_exit(args->ret); }
#endif

#if FOLLOW_FORKS
TRACEPOINT_PROBE(task, task_newtask) {
    if (args->clone_flags & CLONE_THREAD_FLAG)
        return 0;  // a thread shares its tgid
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    if (!tgids.lookup(&parent))
        return 0;
    u32 child = args->pid;
    u8 one = 1;
    if (tgids.update(&child, &one))
        stat_add(STAT_TGID_FULL, 1);
    return 0;
}
#endif

// -- evictor context: syscalls and reclaim windows (never gated: a window opened before the
// probes were armed still names the evictions inside it) -------------------------------------

#if MOE_CTX_WRITE
TRACEPOINT_PROBE(syscalls, sys_enter_write) {
    return ctx_set(args->count <= MOE_SMALL_WRITE ? CTX_WRITE | CTX_WRITE_SMALL : CTX_WRITE, 1);
}
TRACEPOINT_PROBE(syscalls, sys_exit_write) { return ctx_set(CTX_WRITE | CTX_WRITE_SMALL, 0); }
#endif

#if MOE_CTX_INVALIDATE
TRACEPOINT_PROBE(syscalls, sys_enter_fadvise64) { return ctx_set(CTX_FADVISE, 1); }
TRACEPOINT_PROBE(syscalls, sys_exit_fadvise64) { return ctx_set(CTX_FADVISE, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_truncate) { return ctx_set(CTX_TRUNCATE, 1); }
TRACEPOINT_PROBE(syscalls, sys_exit_truncate) { return ctx_set(CTX_TRUNCATE, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_ftruncate) { return ctx_set(CTX_TRUNCATE, 1); }
TRACEPOINT_PROBE(syscalls, sys_exit_ftruncate) { return ctx_set(CTX_TRUNCATE, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_fallocate) { return ctx_set(CTX_TRUNCATE, 1); }
TRACEPOINT_PROBE(syscalls, sys_exit_fallocate) { return ctx_set(CTX_TRUNCATE, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_unlink) { return ctx_set(CTX_TRUNCATE, 1); }
TRACEPOINT_PROBE(syscalls, sys_exit_unlink) { return ctx_set(CTX_TRUNCATE, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_unlinkat) { return ctx_set(CTX_TRUNCATE, 1); }
TRACEPOINT_PROBE(syscalls, sys_exit_unlinkat) { return ctx_set(CTX_TRUNCATE, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_madvise) {
    return args->behavior == MADV_PAGEOUT_ADVICE ? ctx_set(CTX_PAGEOUT, 1) : 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_madvise) { return ctx_set(CTX_PAGEOUT, 0); }
#endif

#if MOE_CTX_RECLAIM
TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_begin) { return ctx_set(CTX_DIRECT, 1); }
TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_end) { return ctx_set(CTX_DIRECT, 0); }
TRACEPOINT_PROBE(vmscan, mm_vmscan_memcg_reclaim_begin) {
    u32 c = ctx_of_current();
    return ctx_set((c & CTX_WRITE_SMALL) ? CTX_PROACTIVE : CTX_MEMCG, 1);
}
TRACEPOINT_PROBE(vmscan, mm_vmscan_memcg_reclaim_end) { return ctx_set(CTX_MEMCG | CTX_PROACTIVE, 0); }
#endif
