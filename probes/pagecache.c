// SPDX-License-Identifier: Apache-2.0
// pagecache: per-expert page-cache additions (misses), deletions (evictions)
// and exact per-page re-additions (re-reads), counted in the kernel.
//
// Reads ONLY tracepoint arguments (layout-safe with mismatched headers):
//   filemap:mm_filemap_add_to_page_cache       pfn, i_ino, index, s_dev, order
//   filemap:mm_filemap_delete_from_page_cache  pfn, i_ino, index, s_dev, order
//   syscalls:sys_exit_{pread64,preadv,preadv2,read}  ret   (tracked tgids only)
//   task:task_newtask                          pid, clone_flags (follow forks)
//
// Configured only with -D knobs (declared in toolkit/record/spec.py PAGECACHE,
// with the attach groups, stats slots and shared structs; tests/test_probe_build.py
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
//   EPOCHS          0: totals only; > 0: also per-epoch counters, EPOCHS x
//                   (N_EXPERTS + 1) slots; the epoch is epoch_now[0], which user
//                   space sets (moetrace record: one epoch per replay iteration,
//                   announced by the replay before the iteration starts)
//
// Re-reads are counted per page exactly: a bitmap with one bit per pool page;
// a deletion sets the bits of its pages, an addition clears them and counts
// the bits that were set. Matching (ino, index) folio pairs would undercount
// because folio boundaries move between a page's eviction and its re-read.

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

#define CLONE_THREAD_FLAG 0x00010000UL

// stats slots (toolkit/record/spec.py PAGECACHE.stats names them, in order)
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
#define N_STATS 11

struct ino_val {
    u32 base;  // expert_id of the file's first extent
    u32 n;     // experts in the file (1: files layout; N_EXPERTS: pool file)
};

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
};

BPF_HASH(inodes, u64, struct ino_val, MAX_INODES);
BPF_ARRAY(counts, struct expert_counts, N_EXPERTS + 1);
// at least one word: a map may not be empty (no pool: N_EXPERTS = 0)
#define BM_WORDS ((N_EXPERTS) * (WPE) > 0 ? (N_EXPERTS) * (WPE) : 1)
BPF_ARRAY(evicted_bm, u64, BM_WORDS);
BPF_ARRAY(stats, u64, N_STATS);
BPF_HASH(tgids, u32, u8, MAX_TGIDS);
#if STREAM_EVENTS
BPF_RINGBUF_OUTPUT(events, RING_PAGES);
#endif
#if EPOCHS
BPF_ARRAY(epoch_now, u32, 1);
BPF_ARRAY(epoch_counts, struct expert_counts, EPOCHS * (N_EXPERTS + 1));
#endif

// The per-epoch copy of one count: slot (epoch, eid) of epoch_counts; what = 0 added,
// 1 evicted, 2 re-added. An epoch beyond the array lands in the last one.
static __always_inline void epoch_add(u32 eid, u32 what, u64 v) {
#if EPOCHS
    u32 z = 0;
    u32 *ep = epoch_now.lookup(&z);
    u32 e = ep ? *ep : 0;
    if (e >= EPOCHS)
        e = EPOCHS - 1;
    u32 k = e * (N_EXPERTS + 1) + eid;
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

static __always_inline u64 popcount64(u64 x) {
    x = x - ((x >> 1) & 0x5555555555555555ULL);
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
    return (x * 0x0101010101010101ULL) >> 56;
}

static __always_inline void emit(u32 eid, u32 kind, u64 first, u64 pages, u64 re) {
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
    events.ringbuf_submit(e, 0);
#endif
}

static __always_inline void unattributed(u32 kind, u64 pages) {
    u32 k = N_EXPERTS;
    struct expert_counts *c = counts.lookup(&k);
    if (!c)
        return;
    if (kind == 0)
        __sync_fetch_and_add(&c->added_pages, pages);
    else
        __sync_fetch_and_add(&c->evicted_pages, pages);
    epoch_add(N_EXPERTS, kind, pages);
    emit(N_EXPERTS, kind, 0, pages, 0);
}

// One folio event: [index, index + npages) of inode ino; kind 0 add, 1 delete.
static __always_inline int account(u64 ino, u64 index, u64 npages, u32 kind) {
    struct ino_val *v = inodes.lookup(&ino);
    if (!v) {
        unattributed(kind, npages);
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
            unattributed(kind, end - idx);
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
                re += popcount64(old & mask);
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
        epoch_add(eid, kind, len);
        if (re)
            epoch_add(eid, 2, re);
        emit(eid, kind, pstart, len, re);
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
    stat_add(STAT_ADD_EVENTS, 1);
    if (POOL_DEV && args->s_dev != POOL_DEV)
        return other_dev(args->i_ino);
    stat_add(STAT_POOL_DEV_ADD_EVENTS, 1);
#if HAVE_ORDER
    u64 n = 1ULL << (args->order & 31);
#else
    u64 n = 1;
#endif
    return account(args->i_ino, args->index, n, 0);
}

TRACEPOINT_PROBE(filemap, mm_filemap_delete_from_page_cache) {
    stat_add(STAT_DELETE_EVENTS, 1);
    if (POOL_DEV && args->s_dev != POOL_DEV)
        return other_dev(args->i_ino);
    stat_add(STAT_POOL_DEV_DELETE_EVENTS, 1);
#if HAVE_ORDER
    u64 n = 1ULL << (args->order & 31);
#else
    u64 n = 1;
#endif
    return account(args->i_ino, args->index, n, 1);
}

#if TRACK_READS
static __always_inline int read_exit(long ret) {
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
