// SPDX-License-Identifier: Apache-2.0
// lru: classic (two-list) LRU placement of the pool's pages, per expert, counted in the kernel:
// list at LRU insertion, activations, and the dwell from LRU insertion to activation and to
// eviction. CO-RE (moetrace.bpf.h).
//
// Reads only tracepoint arguments, relocated by name against the running kernel's BTF:
//   filemap:mm_filemap_add_to_page_cache       pfn, i_ino, index, s_dev, order
//   filemap:mm_filemap_delete_from_page_cache  pfn, i_ino, index, s_dev, order
//   pagemap:mm_lru_insertion                   pfn, lru, flags
//   pagemap:mm_lru_activate                    pfn
// `order` exists since large folios: bpf_core_field_exists decides, else one page per event.
// The pagemap events name a folio since the folio conversion (5.16; a page before): the probe
// never reads that pointer, only pfn / lru / flags, whose names did not change (6.1 = 6.18).
//
// The join: mm_lru_insertion / mm_lru_activate name a folio only by its pfn (and the folio
// pointer, never read). mm_filemap_add_to_page_cache gives the same pfn with the file page
// (i_ino, index) and the folio order, so an add creates a pfn -> (expert, first page, folio
// pages, add time) entry; insertion and activation look it up; mm_filemap_delete_from_page_cache
// closes it (dwell = delete time - insertion time). Entries live in LRU hash maps (never "full":
// the least recently used entry is dropped, and the map is sized by the recorder to hold the
// whole pool).
// Coverage: only pages added while the probe counts (attached; with gated, armed) are joined:
// like pagecache's re-read bitmap, the join is part of what is counted. Activations of pages
// cached before count in STAT_ACTIVATE_EVENTS only (not per expert); their evictions count per
// expert in F_EVICTED (by inode and index) without a dwell (STAT_DELETE_UNJOINED). A page
// migrated by compaction leaves a stale entry at its old pfn (no tracepoint): an add or an
// anonymous insertion at that pfn drops it.
//
// Pages: every count is in pages. The add event carries the folio order (pages = 1 << order);
// mm_lru_insertion and mm_lru_activate fire once per folio and carry no size, so they are
// charged with the pages of the joined folio. A folio may span two or more experts (a 2 MiB
// folio over 1 MiB extents of a pool file): it is split into per-expert pieces, each expert
// charged with its own pages (dwell sums weighted by the piece's pages). Pieces beyond the
// file's experts go to the unattributed slot.
//
// Where the kernel fires them (mm/swap.c, 6.x): mm_lru_insertion in lru_add(), when a per-CPU
// lru_add batch moves new folios onto their list (folio_add_lru); `lru` is the list (enum
// lru_list: 0 inactive anon, 1 active anon, 2 inactive file, 3 active file, 4 unevictable) -
// active file at insertion means the folio was activated before it reached the list (a
// workingset refault, or a second access while still batched). mm_lru_activate in
// lru_activate() (folio_activate batches), exactly where the kernel counts PGACTIVATE
// (nr_pages). Reclaim's own activations (shrink_folio_list activate_locked, counted in
// PGACTIVATE too) and shrink_inactive_list's putbacks (move_folios_to_lru) fire neither
// tracepoint. folio_putback_lru does (it is folio_add_lru): a folio isolated and not freed -
// reclaim_pages (DAMON's pageout, MADV_PAGEOUT) of a page in use, a failed migration - is
// inserted again without a new add. The probe counts that as reinserted, apart from inserted
// (first insertions: inserted = added, exactly), and keeps the dwell from the first insertion.
// Measured on the CI host with no pressure: 3 of 5,891 insertions of a cold 2-pass replay.
//
// Knobs (read-only globals; declared with their meaning in moetrace/record/probes/lru.py):
// pool_dev, n_experts, ppe (pages per expert), have_order, max_folio_pages, anon_flag (the
// anonymous bit of mm_lru_insertion's flags, read from its format). have_activate (the activate
// group) decides whether that program loads; max_inodes, max_pfns, max_unattr_pfns size the maps
// (SPEC.map_sizes); they are globals too, for the record.

#include "moetrace.bpf.h"

const volatile u32 pool_dev = 0;         // s_dev of the pool's filesystem, (major << 20) | minor; 0: any
const volatile u32 n_experts = 0;        // counters have n_experts + 1 slots: the last is unattributed
const volatile u32 ppe = 1;              // pages per expert (the extent)
const volatile u32 have_order = 1;       // the plan's reading of the format files (order field)
const volatile u32 have_activate = 1;
const volatile u32 max_folio_pages = 512;
const volatile u32 max_inodes = 65536;
const volatile u32 max_pfns = 65536;
const volatile u32 max_unattr_pfns = 16384;
const volatile u32 anon_flag = 2;        // PAGEMAP_ANONYMOUS

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
#define F_REINSERTED 14
#define N_FIELDS 15

// pool-wide log2 histograms, in pages (moetrace/record/probes/lru.py HISTOGRAMS names them)
#define H_INSERTION_TO_EVICTION 0
#define H_INSERTION_TO_ACTIVATION 1
#define H_ADD_TO_INSERTION 2
#define N_HIST 3
#define HIST_SLOTS 64

// stats slots (moetrace/record/probes/lru.py LRU.stats names them, in order)
enum moe_stat {  // the `stats` map's slots, in the declaration's order (SPEC.stats)
    STAT_ADD_EVENTS,
    STAT_POOL_DEV_ADD_EVENTS,
    STAT_INSERT_EVENTS,
    STAT_INSERT_JOINED,
    STAT_INSERT_REPEATED,
    STAT_INSERT_ANON_STALE,
    STAT_ACTIVATE_EVENTS,
    STAT_ACTIVATE_JOINED,
    STAT_ACTIVATE_UNINSERTED,
    STAT_DELETE_EVENTS,
    STAT_POOL_DEV_DELETE_EVENTS,
    STAT_DELETE_JOINED,
    STAT_DELETE_UNJOINED,
    STAT_DELETE_STALE,
    STAT_ADD_STALE,
    STAT_UNPROCESSED_PAGES,
    STAT_JOIN_UPDATE_FAILED,
    N_STATS
};
MOE_STAT_BTF;

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
    u64 reinserted;
};

struct pfn_val {
    u64 add_ns;       // bpf_ktime_get_ns at mm_filemap_add_to_page_cache
    u64 insert_ns;    // at mm_lru_insertion; 0 until then
    u32 eid;          // expert of the folio's first page; n_experts: unattributed
    u32 pstart;       // that page's offset within its expert
    u32 elast;        // the file's last expert (pieces beyond it are unattributed)
    u32 pages;        // folio pages (1 << order at add)
    u32 lru;          // list at insertion (LRU_LIST_NONE before)
    u32 activations;  // mm_lru_activate events while cached
};

// One folio's charge: each piece's pages x k[i] to field f[i] (k = 0: nothing), piece by piece.
// bpf_loop runs charge_step once per piece (514 at one page per expert). The charge is staged in
// a per-CPU scratch slot and the step reads it from there: map memory is unknown to the verifier,
// so the step's states converge after one pass. A charge on the stack (bpf_loop's context) made
// the verifier follow every value per iteration, and the delete program failed to load (ENOMEM)
// at one page per expert. A tracepoint program is not re-entered on its CPU (bpf_prog_active),
// so the slot is private while it runs.
struct charge_ctx {
    u64 left;   // pages still to charge
    u64 off;    // the next piece's first page within its expert
    u64 k[5];   // multiplier of each piece's pages for field f[i]
    u32 f[5];   // struct lru_counts fields (F_*)
    u32 e;      // expert of the next piece (n_experts: unattributed)
    u32 elast;  // the file's last expert: pieces beyond it are unattributed
};

MOE_HASH(inodes, u64, struct ino_val);          // max_inodes
MOE_LRU_HASH(pfns, u64, struct pfn_val);        // max_pfns
MOE_LRU_HASH(upfns, u64, struct pfn_val);       // max_unattr_pfns
MOE_ARRAY(counts, struct lru_counts);           // n_experts + 1
MOE_ARRAY(hist, u64);                           // N_HIST * HIST_SLOTS
MOE_ARRAY(stats, u64);                          // N_STATS
MOE_PERCPU_ARRAY(scratch, struct charge_ctx);   // 1: the charge being applied

static __always_inline void stat_add(u32 slot, u64 v) { moe_add(&stats, slot, v); }

static __always_inline void hist_add(u32 h, u64 ns, u64 pages)
{
    if (pages == 0)
        return;
    u32 s = moe_log2l(ns);  // floor(log2(ns)) + 1; 0 and 1 ns both land in slot 1
    if (s >= HIST_SLOTS)
        s = HIST_SLOTS - 1;
    moe_add(&hist, h * HIST_SLOTS + s, pages);
}

static __always_inline struct charge_ctx *staged(void)
{
    u32 z = 0;
    return bpf_map_lookup_elem(&scratch, &z);
}

static long charge_step(u32 i, void *unused)
{
    struct charge_ctx *c = staged();
    if (!c)
        return 1;
    u64 left = c->left;
    if (left == 0)
        return 1;
    u32 e = c->e;
    u32 slot = n_experts;
    u64 len = left;
    if (e < n_experts && e <= c->elast) {
        slot = e;
        len = ppe > c->off ? ppe - c->off : 1;
        if (len > left)
            len = left;
    }
    struct lru_counts *cnt = bpf_map_lookup_elem(&counts, &slot);
    if (cnt) {  // one lookup per piece
        u64 *fld = (u64 *)cnt;
        for (int j = 0; j < 5; j++) {
            u32 f = c->f[j];
            u64 k = c->k[j];
            if (k && f < N_FIELDS)
                __sync_fetch_and_add(fld + f, len * k);
        }
    }
    c->left = left - len;
    c->e = e + 1;
    c->off = 0;
    return 0;
}

// Stage and apply one charge; pages beyond max_folio_pages / ppe + 2 pieces count as unprocessed.
static __always_inline void charge(struct charge_ctx *in)
{
    struct charge_ctx *c = staged();
    if (!c)
        return;
    *c = *in;
    bpf_loop(max_folio_pages / ppe + 2, charge_step, 0, 0);
    if (c->left)
        stat_add(STAT_UNPROCESSED_PAGES, c->left);
}

// Pages of a folio [eid:pstart, + pages) that belong to experts (the rest: unattributed).
static __always_inline u64 expert_pages(u32 eid, u32 pstart, u32 elast, u64 pages)
{
    if (eid >= n_experts || eid > elast)
        return 0;
    u32 last = elast < n_experts ? elast : n_experts - 1;
    u64 room = (u64)(last - eid + 1) * ppe - pstart;
    return pages < room ? pages : room;
}

// Where page `index` of inode `ino` belongs: fills eid/pstart/elast; 1 = an expert's page.
static __always_inline int locate(u64 ino, u64 index, struct pfn_val *v)
{
    struct ino_val *iv = bpf_map_lookup_elem(&inodes, &ino);
    if (iv) {
        u64 limit = (u64)iv->n * ppe;
        if (index < limit) {
            v->eid = iv->base + (u32)(index / ppe);
            v->pstart = (u32)(index % ppe);
            v->elast = iv->base + iv->n - 1;
            return 1;
        }
    }
    v->eid = n_experts;
    v->pstart = 0;
    v->elast = 0;
    return 0;
}

static __always_inline struct pfn_val *find(u64 *pfn)
{
    struct pfn_val *v = bpf_map_lookup_elem(&pfns, pfn);
    if (!v)
        v = bpf_map_lookup_elem(&upfns, pfn);
    return v;
}

static __always_inline void forget(u64 *pfn)
{
    bpf_map_delete_elem(&pfns, pfn);
    bpf_map_delete_elem(&upfns, pfn);
}

static __always_inline int on_add(u64 pfn, u64 ino, u64 index, u64 pages)
{
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
    int err = expert ? bpf_map_update_elem(&pfns, &pfn, &v, BPF_ANY) : bpf_map_update_elem(&upfns, &pfn, &v, BPF_ANY);
    if (err)
        stat_add(STAT_JOIN_UPDATE_FAILED, 1);
    struct charge_ctx c = {.left = pages, .off = v.pstart, .e = v.eid, .elast = v.elast,
                           .f = {F_ADDED}, .k = {1}};
    charge(&c);
    return 0;
}

static __always_inline int on_delete(u64 pfn, u64 ino, u64 index, u64 pages)
{
    struct pfn_val at = {};
    locate(ino, index, &at);
    u64 joined = 0, known = 0, activated = 0, dwell = 0;
    struct pfn_val *v = find(&pfn);
    if (!v) {
        if (at.eid < n_experts)
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
    struct charge_ctx c = {.left = pages, .off = at.pstart, .e = at.eid, .elast = at.elast,
                           .f = {F_EVICTED, F_EVICTED_JOINED, F_DWELL_COUNT, F_EVICTED_ACTIVATED, F_DWELL_NS},
                           .k = {1, joined, known, activated, dwell}};
    charge(&c);
    return 0;
}

SEC("tracepoint/filemap/mm_filemap_add_to_page_cache")
int tracepoint__filemap__mm_filemap_add_to_page_cache(struct trace_event_raw_mm_filemap_op_page_cache *ctx)
{
    MOE_GATE();
    stat_add(STAT_ADD_EVENTS, 1);
    if (pool_dev && ctx->s_dev != pool_dev)
        return 0;
    stat_add(STAT_POOL_DEV_ADD_EVENTS, 1);
    return on_add(ctx->pfn, ctx->i_ino, ctx->index, moe_folio_pages(ctx, have_order));
}

SEC("tracepoint/filemap/mm_filemap_delete_from_page_cache")
int tracepoint__filemap__mm_filemap_delete_from_page_cache(struct trace_event_raw_mm_filemap_op_page_cache *ctx)
{
    MOE_GATE();
    stat_add(STAT_DELETE_EVENTS, 1);
    if (pool_dev && ctx->s_dev != pool_dev)
        return 0;
    stat_add(STAT_POOL_DEV_DELETE_EVENTS, 1);
    return on_delete(ctx->pfn, ctx->i_ino, ctx->index, moe_folio_pages(ctx, have_order));
}

SEC("tracepoint/pagemap/mm_lru_insertion")
int tracepoint__pagemap__mm_lru_insertion(struct trace_event_raw_mm_lru_insertion *ctx)
{
    MOE_GATE();
    stat_add(STAT_INSERT_EVENTS, 1);
    u64 pfn = ctx->pfn;
    struct pfn_val *v = find(&pfn);
    if (!v)
        return 0;
    if (ctx->flags & anon_flag) {  // the pfn now holds an anonymous folio: the entry is stale
        stat_add(STAT_INSERT_ANON_STALE, 1);
        forget(&pfn);
        return 0;
    }
    stat_add(STAT_INSERT_JOINED, 1);
    u32 lru = ctx->lru;
    if (v->insert_ns) {  // a putback: the folio was on a list already; its dwell runs from the first
        stat_add(STAT_INSERT_REPEATED, 1);
        v->lru = lru;
        struct charge_ctx r = {.left = v->pages, .off = v->pstart, .e = v->eid, .elast = v->elast,
                               .f = {F_REINSERTED}, .k = {1}};
        charge(&r);
        return 0;
    }
    u64 now = bpf_ktime_get_ns();
    v->insert_ns = now;
    v->lru = lru;
    u64 since_add = now > v->add_ns ? now - v->add_ns : 0;
    u64 ina = lru == LRU_LIST_INACTIVE_FILE, act = lru == LRU_LIST_ACTIVE_FILE, unev = lru == LRU_LIST_UNEVICTABLE;
    hist_add(H_ADD_TO_INSERTION, since_add, expert_pages(v->eid, v->pstart, v->elast, v->pages));
    struct charge_ctx c = {.left = v->pages, .off = v->pstart, .e = v->eid, .elast = v->elast,
                           .f = {F_INSERTED, F_INSERTED_INACTIVE, F_INSERTED_ACTIVE, F_INSERTED_UNEVICTABLE,
                                 F_INSERTED_OTHER},
                           .k = {1, ina, act, unev, !(ina | act | unev)}};
    charge(&c);
    return 0;
}

SEC("tracepoint/pagemap/mm_lru_activate")
int tracepoint__pagemap__mm_lru_activate(struct trace_event_raw_mm_lru_activate *ctx)
{
    MOE_GATE();
    stat_add(STAT_ACTIVATE_EVENTS, 1);
    u64 pfn = ctx->pfn;
    struct pfn_val *v = find(&pfn);
    if (!v)
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
    struct charge_ctx c = {.left = v->pages, .off = v->pstart, .e = v->eid, .elast = v->elast,
                           .f = {F_ACTIVATED, F_ACTIVATION_DWELL_COUNT, F_ACTIVATION_DWELL_NS},
                           .k = {1, known, dwell}};
    charge(&c);
    return 0;
}
