// SPDX-License-Identifier: Apache-2.0
// lru: classic (two-list) LRU placement of the pool's pages, per expert, counted in
// the kernel: list at LRU insertion, activations, and the dwell from LRU insertion to
// activation and to eviction.
//
// Reads ONLY tracepoint arguments (layout-safe with mismatched headers):
//   filemap:mm_filemap_add_to_page_cache       pfn, i_ino, index, s_dev, order
//   filemap:mm_filemap_delete_from_page_cache  pfn, i_ino, index, s_dev, order
//   pagemap:mm_lru_insertion                   pfn, lru, flags
//   pagemap:mm_lru_activate                    pfn
//
// The join: mm_lru_insertion / mm_lru_activate name a folio only by its pfn (and the
// folio pointer, never read). mm_filemap_add_to_page_cache gives the same pfn with the
// file page (i_ino, index) and the folio order, so an add creates a pfn -> (expert,
// first page, folio pages, add time) entry; insertion and activation look it up;
// mm_filemap_delete_from_page_cache closes it (dwell = delete time - insertion time).
// Entries live in LRU hash maps (never "full": the least recently used entry is
// dropped, and the map is sized by the recorder to hold the whole pool).
// Coverage: only pages added while the probe counts (attached; with MOE_GATED, armed) are
// joined: like pagecache's re-read bitmap, the join is part of what is counted. Activations of
// pages cached before count in STAT_ACTIVATE_EVENTS only (not per expert); their
// evictions count per expert in F_EVICTED (by inode and index) without a dwell
// (STAT_DELETE_UNJOINED). A page migrated by compaction leaves a stale entry at its
// old pfn (no tracepoint): an add or an anonymous insertion at that pfn drops it.
//
// Pages: every count is in pages. The add event carries the folio order (pages =
// 1 << order); mm_lru_insertion and mm_lru_activate fire once per folio and carry no
// size, so they are charged with the pages of the joined folio. A folio may span two
// or more experts (a 2 MiB folio over 1 MiB extents of a pool file): it is split into
// per-expert pieces, each expert charged with its own pages (dwell sums weighted by
// the piece's pages). Pieces beyond the file's experts go to the unattributed slot.
//
// Where the kernel fires them (mm/swap.c, 6.x): mm_lru_insertion in lru_add(), when a
// per-CPU lru_add batch moves new folios onto their list (folio_add_lru); `lru` is the
// list (enum lru_list: 0 inactive anon, 1 active anon, 2 inactive file, 3 active file,
// 4 unevictable) - active file at insertion means the folio was activated before it
// reached the list (a workingset refault, or a second access while still batched).
// mm_lru_activate in lru_activate() (folio_activate batches), exactly where the
// kernel counts PGACTIVATE (nr_pages). Reclaim's own activations (shrink_folio_list
// activate_locked, counted in PGACTIVATE too) and putbacks after isolation fire
// neither tracepoint.
//
// Configured only with -D knobs (declared in toolkit/record/probes/lru.py LRU):
//   POOL_DEV         s_dev of the pool's filesystem, (major << 20) | minor; 0 = every device
//   N_EXPERTS        experts in the pool; counters have N_EXPERTS + 1 slots (the last:
//                    unattributed = pool-device pages that belong to no expert)
//   PPE              pages per expert (the extent, in pages)
//   HAVE_ORDER       1: add/delete carry the folio order; 0: one page per event
//   HAVE_ACTIVATE    1: compile the mm_lru_activate program
//   MAX_FOLIO_PAGES  largest folio split in full (pages beyond: STAT_UNPROCESSED_PAGES)
//   MAX_INODES       entries of the inode -> expert map
//   MAX_PFNS         pfn -> entry map of expert pages (LRU hash)
//   MAX_UNATTR_PFNS  pfn -> entry map of unattributed pool-device pages (LRU hash)
//   ANON_FLAG        the anonymous bit of mm_lru_insertion's flags (PAGEMAP_ANONYMOUS)
//   MOE_GATED        1: count only while armed[0] = 1 (moetrace record arms all at once); 0: always

#include "moetrace.h"
// enum lru_list: bcc's generated args struct of mm_lru_insertion names the type. Declared here,
// not by including <linux/mmzone.h>, which costs 0.4 s of compile (0.63 -> 0.24 s) on every
// recording; the probe reads the value as a number (LRU_* below), so only its size matters.
#ifndef _LINUX_MMZONE_H
enum lru_list { MOE_LRU_LIST_INT = 0 };
#endif

#ifndef POOL_DEV
#define POOL_DEV 0
#endif
#ifndef N_EXPERTS
#define N_EXPERTS 0
#endif
#ifndef PPE
#define PPE 1
#endif
#ifndef HAVE_ORDER
#define HAVE_ORDER 1
#endif
#ifndef HAVE_ACTIVATE
#define HAVE_ACTIVATE 1
#endif
#ifndef MAX_FOLIO_PAGES
#define MAX_FOLIO_PAGES 512
#endif
#ifndef MAX_INODES
#define MAX_INODES 65536
#endif
#ifndef MAX_PFNS
#define MAX_PFNS 65536
#endif
#ifndef MAX_UNATTR_PFNS
#define MAX_UNATTR_PFNS 16384
#endif
#ifndef ANON_FLAG
#define ANON_FLAG 2
#endif

// expert pieces one folio may span
#define MAX_PIECES (MAX_FOLIO_PAGES / PPE + 2)
#define N_SLOTS (N_EXPERTS + 1)

// enum lru_list values (unchanged since 2.6.28; the tracepoint prints them as numbers)
#define LRU_LIST_INACTIVE_FILE 2
#define LRU_LIST_ACTIVE_FILE 3
#define LRU_LIST_UNEVICTABLE 4
#define LRU_LIST_NONE 0xffffffffU

// fields of struct lru_counts, in declaration order
#define F_ADDED 0
#define F_INSERTED 1
#define F_INSERTED_INACTIVE 2
#define F_INSERTED_ACTIVE 3
#define F_INSERTED_UNEVICTABLE 4
#define F_INSERTED_OTHER 5
#define F_ACTIVATED 6
#define F_ACTIVATION_DWELL_NS 7
#define F_ACTIVATION_DWELL_COUNT 8
#define F_EVICTED 9
#define F_EVICTED_JOINED 10
#define F_EVICTED_ACTIVATED 11
#define F_DWELL_NS 12
#define F_DWELL_COUNT 13
#define N_FIELDS 14

// pool-wide log2 histograms, in pages (toolkit/record/probes/lru.py HISTOGRAMS names them)
#define H_INSERTION_TO_EVICTION 0
#define H_INSERTION_TO_ACTIVATION 1
#define H_ADD_TO_INSERTION 2
#define N_HIST 3
#define HIST_SLOTS 64

// stats slots (toolkit/record/probes/lru.py LRU.stats names them, in order)
#define STAT_ADD_EVENTS 0
#define STAT_POOL_DEV_ADD_EVENTS 1
#define STAT_INSERT_EVENTS 2
#define STAT_INSERT_JOINED 3
#define STAT_INSERT_REPEATED 4
#define STAT_INSERT_ANON_STALE 5
#define STAT_ACTIVATE_EVENTS 6
#define STAT_ACTIVATE_JOINED 7
#define STAT_ACTIVATE_UNINSERTED 8
#define STAT_DELETE_EVENTS 9
#define STAT_POOL_DEV_DELETE_EVENTS 10
#define STAT_DELETE_JOINED 11
#define STAT_DELETE_UNJOINED 12
#define STAT_DELETE_STALE 13
#define STAT_ADD_STALE 14
#define STAT_UNPROCESSED_PAGES 15
#define STAT_JOIN_UPDATE_FAILED 16
#define N_STATS 17

// per-slot counters, in pages (ns for the *_ns sums): F_* index these fields
struct lru_counts {
    u64 added;
    u64 inserted;
    u64 inserted_inactive;
    u64 inserted_active;
    u64 inserted_unevictable;
    u64 inserted_other;
    u64 activated;
    u64 activation_dwell_ns;
    u64 activation_dwell_count;
    u64 evicted;
    u64 evicted_joined;
    u64 evicted_activated;
    u64 dwell_ns;
    u64 dwell_count;
};

struct pfn_val {
    u64 add_ns;       // bpf_ktime_get_ns at mm_filemap_add_to_page_cache
    u64 insert_ns;    // at mm_lru_insertion; 0 until then
    u32 eid;          // expert of the folio's first page; N_EXPERTS: unattributed
    u32 pstart;       // that page's offset within its expert
    u32 elast;        // the file's last expert (pieces beyond it are unattributed)
    u32 pages;        // folio pages (1 << order at add)
    u32 lru;          // list at insertion (LRU_LIST_NONE before)
    u32 activations;  // mm_lru_activate events while cached
};

// One folio's charge, staged in a per-CPU scratch slot and applied by the piece loop
// as the program's last step: the loop reads its inputs from map memory (the states of
// the branches taken before it converge) and no code follows it (code after a loop is
// verified once per possible exit). Measured with 4 KiB experts (PPE=1, 514 pieces
// per order-9 folio): 112k-171k verified instructions per program, where a loop
// followed by post-processing exceeded the verifier's 1M. A tracepoint program is not
// re-entered on its CPU (bpf_prog_active), so the slot is private while it runs.
struct charge_args {
    u64 pages;   // folio pages
    u64 k[5];    // multiplier of each piece's pages for the call's fields f1..f5
    u32 eid;     // expert of the first page (N_EXPERTS: unattributed)
    u32 pstart;  // first page's offset within that expert
    u32 elast;   // the file's last expert
    u32 pad;
};

BPF_HASH(inodes, u64, struct ino_val, MAX_INODES);
BPF_TABLE("lru_hash", u64, struct pfn_val, pfns, MAX_PFNS);
BPF_TABLE("lru_hash", u64, struct pfn_val, upfns, MAX_UNATTR_PFNS);
BPF_ARRAY(counts, struct lru_counts, N_SLOTS);
BPF_ARRAY(hist, u64, N_HIST * HIST_SLOTS);
BPF_ARRAY(stats, u64, N_STATS);
BPF_PERCPU_ARRAY(scratch, struct charge_args, 1);
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

static __always_inline void stat_add(u32 slot, u64 v) {
    u64 *p = stats.lookup(&slot);
    if (p)
        __sync_fetch_and_add(p, v);
}

static __always_inline void hist_add(u32 h, u64 ns, u64 pages) {
    if (pages == 0)
        return;
    u32 s = bpf_log2l(ns);  // floor(log2(ns)) + 1; 0 and 1 ns both land in slot 1
    if (s >= HIST_SLOTS)
        s = HIST_SLOTS - 1;
    u32 k = h * HIST_SLOTS + s;
    u64 *p = hist.lookup(&k);
    if (p)
        __sync_fetch_and_add(p, pages);
}

static __always_inline struct charge_args *staged(void) {
    u32 z = 0;
    return scratch.lookup(&z);
}

// Charge the staged folio piece by piece: each piece's pages x k[i] to field f<i+1>
// (constant fields; 0/1 multipliers for what is conditional). Pieces past the file's
// last expert go to the unattributed slot. Call it last: code after the loop would be
// verified once per loop exit.
static __always_inline void charge(u32 f1, u32 f2, u32 f3, u32 f4, u32 f5) {
    struct charge_args *c = staged();
    if (!c)
        return;
    u64 left = c->pages;
    u64 off = c->pstart;
    u32 e = c->eid;
    u32 elast = c->elast;
    u64 k1 = c->k[0], k2 = c->k[1], k3 = c->k[2], k4 = c->k[3], k5 = c->k[4];
    for (int s = 0; s < MAX_PIECES; s++) {
        if (left == 0)
            break;
        u32 slot = N_EXPERTS;
        u64 len = left;
        if (e < N_EXPERTS && e <= elast) {
            slot = e;
            len = PPE > off ? PPE - off : 1;
            if (len > left)
                len = left;
        }
        struct lru_counts *cnt = counts.lookup(&slot);
        if (cnt) {  // one lookup per piece; constant field offsets
            u64 *fld = (u64 *)cnt;
            __sync_fetch_and_add(fld + f1, len * k1);
            __sync_fetch_and_add(fld + f2, len * k2);
            __sync_fetch_and_add(fld + f3, len * k3);
            __sync_fetch_and_add(fld + f4, len * k4);
            __sync_fetch_and_add(fld + f5, len * k5);
        }
        left -= len;
        e++;
        off = 0;
    }
    if (left)
        stat_add(STAT_UNPROCESSED_PAGES, left);
}

// Pages of a folio [eid:pstart, + pages) that belong to experts (the rest: unattributed).
static __always_inline u64 expert_pages(u32 eid, u32 pstart, u32 elast, u64 pages) {
    if (eid >= N_EXPERTS || eid > elast)
        return 0;
    u32 last = elast < N_EXPERTS ? elast : N_EXPERTS - 1;
    u64 room = (u64)(last - eid + 1) * PPE - pstart;
    return pages < room ? pages : room;
}

static __always_inline void stage(struct charge_args *c, u32 eid, u32 pstart, u32 elast, u64 pages, u64 k1,
                                  u64 k2, u64 k3, u64 k4, u64 k5) {
    c->pages = pages;
    c->eid = eid;
    c->pstart = pstart;
    c->elast = elast;
    c->k[0] = k1;
    c->k[1] = k2;
    c->k[2] = k3;
    c->k[3] = k4;
    c->k[4] = k5;
}

// Where page `index` of inode `ino` belongs: fills eid/pstart/elast; 1 = an expert's page.
static __always_inline int locate(u64 ino, u64 index, struct pfn_val *v) {
    struct ino_val *iv = inodes.lookup(&ino);
    if (iv) {
        u64 limit = (u64)iv->n * PPE;
        if (index < limit) {
            v->eid = iv->base + (u32)(index / PPE);
            v->pstart = (u32)(index % PPE);
            v->elast = iv->base + iv->n - 1;
            return 1;
        }
    }
    v->eid = N_EXPERTS;
    v->pstart = 0;
    v->elast = 0;
    return 0;
}

static __always_inline struct pfn_val *find(u64 *pfn) {
    struct pfn_val *v = pfns.lookup(pfn);
    if (!v)
        v = upfns.lookup(pfn);
    return v;
}

static __always_inline void forget(u64 *pfn) {
    pfns.delete(pfn);
    upfns.delete(pfn);
}

static __always_inline int on_add(u64 pfn, u64 ino, u64 index, u64 pages) {
    struct charge_args *c = staged();
    if (!c)
        return 0;
    struct pfn_val v = {};
    v.add_ns = bpf_ktime_get_ns();
    v.pages = (u32)pages;
    v.lru = LRU_LIST_NONE;
    int expert = locate(ino, index, &v);
    // an entry for this pfn is stale: its folio left without a delete event (migrated)
    if (find(&pfn)) {
        stat_add(STAT_ADD_STALE, 1);
        forget(&pfn);
    }
    int err = expert ? pfns.update(&pfn, &v) : upfns.update(&pfn, &v);
    if (err)
        stat_add(STAT_JOIN_UPDATE_FAILED, 1);
    stage(c, v.eid, v.pstart, v.elast, pages, 1, 0, 0, 0, 0);
    charge(F_ADDED, F_ADDED, F_ADDED, F_ADDED, F_ADDED);
    return 0;
}

static __always_inline int on_delete(u64 pfn, u64 ino, u64 index, u64 pages) {
    struct charge_args *c = staged();
    if (!c)
        return 0;
    struct pfn_val at = {};
    locate(ino, index, &at);
    u64 joined = 0, known = 0, activated = 0, dwell = 0;
    struct pfn_val *v = find(&pfn);
    if (!v) {
        if (at.eid < N_EXPERTS)
            stat_add(STAT_DELETE_UNJOINED, 1);
    } else if (v->eid != at.eid || v->pstart != at.pstart || v->pages != pages) {
        stat_add(STAT_DELETE_STALE, 1);  // another page's entry: that folio left without a delete (migrated)
        forget(&pfn);
    } else {
        stat_add(STAT_DELETE_JOINED, 1);
        joined = 1;
        u64 ins = v->insert_ns;
        if (ins) {
            u64 now = bpf_ktime_get_ns();
            known = 1;
            dwell = now > ins ? now - ins : 0;
        }
        activated = v->activations > 0 || v->lru == LRU_LIST_ACTIVE_FILE;
    }
    if (known)
        hist_add(H_INSERTION_TO_EVICTION, dwell, expert_pages(at.eid, at.pstart, at.elast, pages));
    if (joined)
        forget(&pfn);
    // every deletion by (inode, index); the joined ones with their dwell
    stage(c, at.eid, at.pstart, at.elast, pages, 1, joined, known, activated, dwell);
    charge(F_EVICTED, F_EVICTED_JOINED, F_DWELL_COUNT, F_EVICTED_ACTIVATED, F_DWELL_NS);
    return 0;
}

TRACEPOINT_PROBE(filemap, mm_filemap_add_to_page_cache) {
    MOE_GATE();
    stat_add(STAT_ADD_EVENTS, 1);
    if (POOL_DEV && args->s_dev != POOL_DEV)
        return 0;
    stat_add(STAT_POOL_DEV_ADD_EVENTS, 1);
#if HAVE_ORDER
    u64 n = 1ULL << (args->order & 31);
#else
    u64 n = 1;
#endif
    return on_add(args->pfn, args->i_ino, args->index, n);
}

TRACEPOINT_PROBE(filemap, mm_filemap_delete_from_page_cache) {
    MOE_GATE();
    stat_add(STAT_DELETE_EVENTS, 1);
    if (POOL_DEV && args->s_dev != POOL_DEV)
        return 0;
    stat_add(STAT_POOL_DEV_DELETE_EVENTS, 1);
#if HAVE_ORDER
    u64 n = 1ULL << (args->order & 31);
#else
    u64 n = 1;
#endif
    return on_delete(args->pfn, args->i_ino, args->index, n);
}

TRACEPOINT_PROBE(pagemap, mm_lru_insertion) {
    MOE_GATE();
    stat_add(STAT_INSERT_EVENTS, 1);
    u64 pfn = args->pfn;
    struct pfn_val *v = find(&pfn);
    if (!v)
        return 0;
    if (args->flags & ANON_FLAG) {  // the pfn now holds an anonymous folio: the entry is stale
        stat_add(STAT_INSERT_ANON_STALE, 1);
        forget(&pfn);
        return 0;
    }
    struct charge_args *c = staged();
    if (!c)
        return 0;
    stat_add(STAT_INSERT_JOINED, 1);
    if (v->insert_ns)
        stat_add(STAT_INSERT_REPEATED, 1);
    u64 now = bpf_ktime_get_ns();
    u32 lru = args->lru;
    v->insert_ns = now;
    v->lru = lru;
    u64 since_add = now > v->add_ns ? now - v->add_ns : 0;
    u64 ina = lru == LRU_LIST_INACTIVE_FILE, act = lru == LRU_LIST_ACTIVE_FILE, unev = lru == LRU_LIST_UNEVICTABLE;
    hist_add(H_ADD_TO_INSERTION, since_add, expert_pages(v->eid, v->pstart, v->elast, v->pages));
    stage(c, v->eid, v->pstart, v->elast, v->pages, 1, ina, act, unev, !(ina | act | unev));
    charge(F_INSERTED, F_INSERTED_INACTIVE, F_INSERTED_ACTIVE, F_INSERTED_UNEVICTABLE, F_INSERTED_OTHER);
    return 0;
}

#if HAVE_ACTIVATE
TRACEPOINT_PROBE(pagemap, mm_lru_activate) {
    MOE_GATE();
    stat_add(STAT_ACTIVATE_EVENTS, 1);
    u64 pfn = args->pfn;
    struct pfn_val *v = find(&pfn);
    if (!v)
        return 0;
    struct charge_args *c = staged();
    if (!c)
        return 0;
    stat_add(STAT_ACTIVATE_JOINED, 1);
    __sync_fetch_and_add(&v->activations, 1);
    u64 ins = v->insert_ns;
    u64 known = 0, dwell = 0;
    if (ins) {
        u64 now = bpf_ktime_get_ns();
        known = 1;
        dwell = now > ins ? now - ins : 0;
    } else {
        stat_add(STAT_ACTIVATE_UNINSERTED, 1);
    }
    if (known)
        hist_add(H_INSERTION_TO_ACTIVATION, dwell, expert_pages(v->eid, v->pstart, v->elast, v->pages));
    stage(c, v->eid, v->pstart, v->elast, v->pages, 1, known, dwell, 0, 0);
    charge(F_ACTIVATED, F_ACTIVATION_DWELL_COUNT, F_ACTIVATION_DWELL_NS, F_ACTIVATED, F_ACTIVATED);
    return 0;
}
#endif
