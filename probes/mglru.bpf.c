// SPDX-License-Identifier: Apache-2.0
// mglru: multi-gen LRU activity from function hooks — how often reclaim evicts and
// isolates, how often aging runs (one ring record per aging attempt), which
// generation a folio leaves when it is promoted, look-around and workingset
// eviction / refault counts, and a record per evicted pool folio. CO-RE (moetrace.bpf.h).
//
// The main output of the mglru probe is NOT here: it is the Python sampler of
// <debugfs>/lru_gen (moetrace/record/probes/mglru.py, moetrace/kernel/lru_gen.py), which needs no
// BPF. Every program here hooks a kernel function: an fentry program where the kernel allows
// BPF trampolines, else a kprobe (the attach plan chooses per hook, by asking the kernel); on a
// kernel with neither (this host: no kprobes, fentry refused) no program loads.
//
// Arguments read:
//   try_to_inc_max_seq(lruvec, max_seq, ...)   the second argument: the max_seq it was asked to
//       grow (6.1: (lruvec, max_seq, sc, can_swap, force_scan); 6.12: (lruvec, seq, can_swap,
//       force_scan)) — an aging ATTEMPT: it returns false without aging when another walker
//       got there first
//   inc_max_seq / inc_max_seq.constprop.0      no arguments read (the signature changed in 6.8
//       and the clone's arguments are not trustworthy; a clone has no BTF: kprobe only)
//   folio_inc_gen(lruvec, folio, reclaiming)   folio->flags: the generation it leaves, at the
//       build's LRU_GEN_PGOFF (a macro, not in BTF: the loader derives it from the kernel's
//       config and BTF, moe_lru_gen_pgoff; -1: unknown, the program is not loaded)
//   workingset_eviction(folio, target_memcg)   with moe_evict_events: a ring record per evicted
//       folio of the pool (s_dev = moe_pool_dev): inode, index, its memcg's id and
//       min_seq[file] (the generation eviction takes from, as the kernel's shadow entry records
//       it), read through CO-RE relocations: folio->mapping->host, ->i_sb->s_dev,
//       folio->memcg_data (through its obj_cgroup on 7.x), memcg->id.id (7.x: css.cgroup->kn->id),
//       memcg->nodeinfo[0]->lruvec.lrugen.min_seq[1] (node 0)
// The other hooks only count calls.
//
// Knobs (read-only globals; moetrace/record/probes/mglru.py declares them): moe_evict_events,
// moe_pool_dev, moe_lru_gen_pgoff. The MOE_HAVE_* knobs choose which programs load.

#include "moetrace.bpf.h"

const volatile u32 moe_have_evict_folios = 0;
const volatile u32 moe_have_isolate_folios = 0;
const volatile u32 moe_have_should_run_aging = 0;
const volatile u32 moe_have_inc_max_seq = 0;
const volatile u32 moe_have_folio_inc_gen = 0;
const volatile u32 moe_have_look_around = 0;
const volatile u32 moe_have_ws_eviction = 0;
const volatile u32 moe_have_ws_refault = 0;
const volatile u32 moe_ringbuf_pages = 16;
const volatile u32 moe_lru_gen_period_ms = 1000;  // the Python sampler's; unused here
const volatile u32 moe_lru_gen_full = 0;          // the Python sampler's; unused here
const volatile u32 moe_evict_events = 1;
const volatile u32 moe_evict_ringbuf_pages = 4096;
const volatile u32 moe_pool_dev = 0;
const volatile s32 moe_lru_gen_pgoff = -1;

// aging record kinds (moetrace/record/probes/mglru.py AGING_KINDS names them in this order)
#define AGING_TRY_TO_INC_MAX_SEQ 0
#define AGING_INC_MAX_SEQ 1
#define AGING_INC_MAX_SEQ_CLONE 2
#define SEQ_UNKNOWN 0xffffffffffffffffULL

// stats slots (moetrace/record/probes/mglru.py SPEC.stats names them, in order)
enum moe_stat {  // the `stats` map's slots, in the declaration's order (SPEC.stats)
    STAT_EVICT_FOLIOS,
    STAT_ISOLATE_FOLIOS,
    STAT_SHOULD_RUN_AGING,
    STAT_INC_MAX_SEQ,            // aging attempts (whichever inc_max_seq candidate is attached)
    STAT_FOLIO_INC_GEN,
    STAT_LOOK_AROUND,
    STAT_WORKINGSET_EVICTION,
    STAT_WORKINGSET_REFAULT,
    STAT_RING_LOST,              // aging records the ring had no room for
    STAT_EVICT_LOST,             // pool eviction records the ring had no room for
    STAT_EVICT_POOL,             // pool folios evicted (a record each, or counted lost)
    N_STATS
};
MOE_STAT_BTF;

// MAX_NR_GENS is 4 on every MGLRU kernel so far; slot 0 counts folios not on an MGLRU list
#define GEN_SLOTS 5
#define LRU_GEN_WIDTH 3  // order_base_2(MAX_NR_GENS + 1)

struct aging_event {
    u64 ts_ns;   // bpf_ktime_get_ns (CLOCK_MONOTONIC)
    u64 seq;     // try_to_inc_max_seq's max_seq argument; SEQ_UNKNOWN for the other kinds
    u32 tgid;    // who aged (kswapd, a direct reclaimer, a writer of lru_gen)
    u32 kind;    // AGING_*
};

struct evict_event {
    u64 ts_ns;     // bpf_ktime_get_ns (CLOCK_MONOTONIC)
    u64 ino;       // folio->mapping->host->i_ino
    u64 index;     // folio->index (first page of the folio)
    u64 min_seq;   // folio's memcg: nodeinfo[0]->lruvec.lrugen.min_seq[LRU_GEN_FILE]; SEQ_UNKNOWN without
    u32 memcg_id;  // the lru_gen file's memcg id: id.id, 7.x cgroup_id() (low 32 bits); 0 without memcg
    u32 tgid;      // who evicted
};

// The MGLRU part of a memcg's per-node lruvec, as this probe reads it. A kernel built without
// MGLRU (this host) has no lrugen in its BTF: these flavors let the object build anyway, and
// libbpf matches them by field name on the running kernel (6.1 calls the struct lru_gen_struct,
// 6.3+ lru_gen_folio: names of nested structs do not matter to CO-RE).
struct lru_gen_folio___moe {
    unsigned long max_seq;
    unsigned long min_seq[2];
} __attribute__((preserve_access_index));
struct lruvec___moe {
    struct lru_gen_folio___moe lrugen;
} __attribute__((preserve_access_index));
struct mem_cgroup_per_node___moe {
    struct lruvec___moe lruvec;
} __attribute__((preserve_access_index));
struct mem_cgroup___moe {
    struct cgroup_subsys_state css;
    struct mem_cgroup_id id;  // 7.x: struct mem_cgroup_private_id, the same int id
    struct mem_cgroup_per_node___moe *nodeinfo[];
} __attribute__((preserve_access_index));
// Since "memcg: ... use the public cgroup IDs" (7.x), id.id is the memcg's private id (swap and
// workingset records), and lru_gen (debugfs) names a memcg by its cgroup id, cgroup_id(): the
// kernfs node's id. The type's presence says which one lru_gen prints.
struct mem_cgroup_private_id___moe {
    int id;
};
// Since "mm: memcontrol: eliminate the problem of dying memory cgroup for LRU folios" (7.x),
// folio->memcg_data of an LRU folio points to an obj_cgroup, whose memcg is the folio's (the same
// series added is_root: its presence says which one memcg_data holds). Before, it pointed to the
// mem_cgroup itself, and to an obj_cgroup only for kmem folios (MEMCG_DATA_KMEM).
struct obj_cgroup___moe {
    struct mem_cgroup___moe *memcg;
    bool is_root;
} __attribute__((preserve_access_index));
#define MEMCG_DATA_KMEM___moe 2UL

MOE_ARRAY(stats, u64);          // N_STATS: the one map every load has
MOE_ARRAY(inc_gen_from, u64);   // GEN_SLOTS
MOE_RINGBUF(aging);
MOE_RINGBUF(evictions);

// Keep the shared structs in the object's BTF (the declaration test reads them there).
struct aging_event _aging_event = {};
struct evict_event _evict_event = {};

static __always_inline void stat_add(u32 slot, u64 v) { moe_add(&stats, slot, v); }

static __always_inline int aging_event(u32 kind, u64 seq)
{
    MOE_GATE();
    stat_add(STAT_INC_MAX_SEQ, 1);
    struct aging_event *e = bpf_ringbuf_reserve(&aging, sizeof(struct aging_event), 0);
    if (!e) {
        stat_add(STAT_RING_LOST, 1);
        return 0;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->seq = seq;
    e->tgid = bpf_get_current_pid_tgid() >> 32;
    e->kind = kind;
    bpf_ringbuf_submit(e, 0);
    return 0;
}

static __always_inline int count(u32 slot)
{
    MOE_GATE();
    stat_add(slot, 1);
    return 0;
}

// The generation a promoted folio leaves: ((flags & LRU_GEN_MASK) >> LRU_GEN_PGOFF) - 1, counted
// in slot gen + 1 (slot 0: not on an MGLRU list).
static __always_inline int inc_gen(void *folio)
{
    MOE_GATE();
    stat_add(STAT_FOLIO_INC_GEN, 1);
    if (moe_lru_gen_pgoff < 0)
        return 0;
    unsigned long flags = 0;
    bpf_probe_read_kernel(&flags, sizeof(flags), folio);  // folio->flags: the first word
    u32 slot = (u32)((flags >> (moe_lru_gen_pgoff & 63)) & ((1UL << LRU_GEN_WIDTH) - 1));
    if (slot >= GEN_SLOTS)
        slot = 0;
    moe_add(&inc_gen_from, slot, 1);
    return 0;
}

// The memcg's min_seq[file] on node 0, or SEQ_UNKNOWN.
static __always_inline u64 memcg_min_seq(struct mem_cgroup___moe *memcg)
{
    if (!bpf_core_field_exists(struct lru_gen_folio___moe, min_seq))
        return SEQ_UNKNOWN;
    struct mem_cgroup_per_node___moe *pn = BPF_CORE_READ(memcg, nodeinfo[0]);
    return pn ? BPF_CORE_READ(pn, lruvec.lrugen.min_seq[1]) : SEQ_UNKNOWN;
}

static __always_inline int ws_eviction(struct folio *folio)
{
    MOE_GATE();
    stat_add(STAT_WORKINGSET_EVICTION, 1);
    if (!moe_evict_events)
        return 0;
    struct address_space *mapping = BPF_CORE_READ(folio, mapping);
    if (!mapping || ((unsigned long)mapping & 1))  // none, or anonymous (PAGE_MAPPING_ANON)
        return 0;
    struct inode *host = BPF_CORE_READ(mapping, host);
    if (!host || BPF_CORE_READ(host, i_sb, s_dev) != moe_pool_dev)
        return 0;
    stat_add(STAT_EVICT_POOL, 1);
    struct evict_event *e = bpf_ringbuf_reserve(&evictions, sizeof(struct evict_event), 0);
    if (!e) {
        stat_add(STAT_EVICT_LOST, 1);
        return 0;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->ino = BPF_CORE_READ(host, i_ino);
    e->index = BPF_CORE_READ(folio, index);
    e->tgid = bpf_get_current_pid_tgid() >> 32;
    e->memcg_id = 0;
    e->min_seq = SEQ_UNKNOWN;
    unsigned long data = 0;
    if (bpf_core_field_exists(folio->memcg_data))
        data = BPF_CORE_READ(folio, memcg_data);
    struct mem_cgroup___moe *memcg = (void *)(data & ~7UL);  // memcg_data: low bits are flags
    if (memcg && (bpf_core_field_exists(struct obj_cgroup___moe, is_root) || (data & MEMCG_DATA_KMEM___moe)))
        memcg = BPF_CORE_READ((struct obj_cgroup___moe *)memcg, memcg);
    if (memcg) {
        if (bpf_core_type_exists(struct mem_cgroup_private_id___moe))
            e->memcg_id = (u32)BPF_CORE_READ(memcg, css.cgroup, kn, id);  // lru_gen's id: cgroup_id()
        else
            e->memcg_id = BPF_CORE_READ(memcg, id.id);
        e->min_seq = memcg_min_seq(memcg);
    }
    bpf_ringbuf_submit(e, 0);
    return 0;
}

// -- the hooks: one fentry and one kprobe program per kernel function --------------------------

#define HOOK0(fn, body) \
    SEC("fentry/" #fn) int BPF_PROG(fe_##fn) { return body; } \
    SEC("kprobe/" #fn) int BPF_KPROBE(kp_##fn) { return body; }

HOOK0(evict_folios, count(STAT_EVICT_FOLIOS))
HOOK0(isolate_folios, count(STAT_ISOLATE_FOLIOS))
HOOK0(should_run_aging, count(STAT_SHOULD_RUN_AGING))
HOOK0(inc_max_seq, aging_event(AGING_INC_MAX_SEQ, SEQ_UNKNOWN))
HOOK0(lru_gen_look_around, count(STAT_LOOK_AROUND))
HOOK0(workingset_refault, count(STAT_WORKINGSET_REFAULT))

SEC("fentry/try_to_inc_max_seq")
int BPF_PROG(fe_try_to_inc_max_seq, void *lruvec, u64 max_seq) { return aging_event(AGING_TRY_TO_INC_MAX_SEQ, max_seq); }
SEC("kprobe/try_to_inc_max_seq")
int BPF_KPROBE(kp_try_to_inc_max_seq, void *lruvec, u64 max_seq) { return aging_event(AGING_TRY_TO_INC_MAX_SEQ, max_seq); }

// a compiler clone (6.12): no BTF, so a kprobe only; its arguments are not read
SEC("kprobe/inc_max_seq.constprop.0")
int BPF_KPROBE(kp_inc_max_seq_constprop_0) { return aging_event(AGING_INC_MAX_SEQ_CLONE, SEQ_UNKNOWN); }

SEC("fentry/folio_inc_gen")
int BPF_PROG(fe_folio_inc_gen, void *lruvec, void *folio) { return inc_gen(folio); }
SEC("kprobe/folio_inc_gen")
int BPF_KPROBE(kp_folio_inc_gen, void *lruvec, void *folio) { return inc_gen(folio); }

SEC("fentry/workingset_eviction")
int BPF_PROG(fe_workingset_eviction, struct folio *folio) { return ws_eviction(folio); }
SEC("kprobe/workingset_eviction")
int BPF_KPROBE(kp_workingset_eviction, struct folio *folio) { return ws_eviction(folio); }
