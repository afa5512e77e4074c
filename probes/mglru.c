// SPDX-License-Identifier: Apache-2.0
// mglru: multi-gen LRU activity from kprobes — how often reclaim evicts and
// isolates, how often aging runs (one ring record per aging attempt), which
// generation a folio leaves when it is promoted, look-around and workingset
// eviction / refault counts.
//
// The main output of the mglru probe is NOT here: it is the Python sampler of
// <debugfs>/lru_gen (toolkit/record/probes/mglru.py, toolkit/kernel/lru_gen.py), which needs no BPF.
// Every program of this file is a kprobe: it is compiled only where kprobes exist
// (the kernel lab), each behind its MOE_HAVE_* knob, which the recorder sets from
// the attach plan. With every knob 0 (the defaults, and every kernel without
// kprobes) the file compiles to the stats map alone (and `armed` with MOE_GATED) and loads no program.
//
// Arguments read (x86-64 / arm64 calling convention, scalar registers only):
//   try_to_inc_max_seq(lruvec, max_seq, ...)   PARM2 = the max_seq it was asked to
//       grow (6.1: (lruvec, max_seq, sc, can_swap, force_scan); 6.12: (lruvec, seq,
//       can_swap, force_scan)) — an aging ATTEMPT: it returns false without aging
//       when another walker got there first
//   inc_max_seq / inc_max_seq.constprop.0      no arguments read (the signature changed
//       in 6.8 and the clone's arguments are not trustworthy)
//   folio_inc_gen(lruvec, folio, reclaiming)   PARM2 = folio; reads folio->flags (the
//       first word of struct folio) and needs the build's page-flags layout (LRU_GEN_PGOFF, from the
//       kernel's own headers: exact headers only): the generation it leaves
//   workingset_eviction(folio, target_memcg)   PARM1 = folio; with MOE_EVICT_EVENTS=1 a
//       ring record per evicted folio of the pool (s_dev = MOE_POOL_DEV): inode, index, its
//       memcg's id and min_seq[file] (the generation eviction takes from, as the kernel's
//       shadow entry records it), read at struct offsets the recorder takes from the
//       running kernel's BTF (MOE_OFF_*): no kernel headers needed; node 0 only
// The other kprobes only count calls.
//
// Configured only with -D knobs (toolkit/record/probes/mglru.py MGLRU declares them):
//   MOE_HAVE_EVICT_FOLIOS, MOE_HAVE_ISOLATE_FOLIOS, MOE_HAVE_SHOULD_RUN_AGING,
//   MOE_HAVE_INC_MAX_SEQ, MOE_HAVE_FOLIO_INC_GEN, MOE_HAVE_LOOK_AROUND,
//   MOE_HAVE_WS_EVICTION, MOE_HAVE_WS_REFAULT   1: compile that kprobe group
//   MOE_RINGBUF_PAGES      ring buffer size in pages for aging records (power of two)
//   MOE_LRU_GEN_PERIOD_MS  the lru_gen sampler's period (Python side; unused here)
//   MOE_LRU_GEN_FULL       1: the sampler reads lru_gen_full (Python side; unused here)
//   MOE_GATED              1: count only while armed[0] = 1 (moetrace record arms all at once); 0: always
//   MOE_EVICT_EVENTS       1: the pool eviction records (needs MOE_HAVE_WS_EVICTION, MOE_POOL_DEV, MOE_OFF_*)
//   MOE_EVICT_RINGBUF_PAGES  their ring size in pages (power of two)

#include "moetrace.h"

#ifndef MOE_HAVE_EVICT_FOLIOS
#define MOE_HAVE_EVICT_FOLIOS 0
#endif
#ifndef MOE_HAVE_ISOLATE_FOLIOS
#define MOE_HAVE_ISOLATE_FOLIOS 0
#endif
#ifndef MOE_HAVE_SHOULD_RUN_AGING
#define MOE_HAVE_SHOULD_RUN_AGING 0
#endif
#ifndef MOE_HAVE_INC_MAX_SEQ
#define MOE_HAVE_INC_MAX_SEQ 0
#endif
#ifndef MOE_HAVE_FOLIO_INC_GEN
#define MOE_HAVE_FOLIO_INC_GEN 0
#endif
#ifndef MOE_HAVE_LOOK_AROUND
#define MOE_HAVE_LOOK_AROUND 0
#endif
#ifndef MOE_HAVE_WS_EVICTION
#define MOE_HAVE_WS_EVICTION 0
#endif
#ifndef MOE_HAVE_WS_REFAULT
#define MOE_HAVE_WS_REFAULT 0
#endif
#ifndef MOE_RINGBUF_PAGES
#define MOE_RINGBUF_PAGES 16
#endif
// eviction records: one per evicted folio of the pool (needs MOE_HAVE_WS_EVICTION); the
// offsets come from the running kernel's BTF (toolkit/record/probes/mglru.py EVICT_OFFSETS)
#ifndef MOE_EVICT_EVENTS
#define MOE_EVICT_EVENTS 0
#endif
#ifndef MOE_EVICT_RINGBUF_PAGES
#define MOE_EVICT_RINGBUF_PAGES 4096
#endif
#ifndef MOE_POOL_DEV
#define MOE_POOL_DEV 0
#endif
#ifndef MOE_OFF_FOLIO_MAPPING
#define MOE_OFF_FOLIO_MAPPING 0
#endif
#ifndef MOE_OFF_FOLIO_INDEX
#define MOE_OFF_FOLIO_INDEX 0
#endif
#ifndef MOE_OFF_FOLIO_MEMCG
#define MOE_OFF_FOLIO_MEMCG 0
#endif
#ifndef MOE_OFF_AS_HOST
#define MOE_OFF_AS_HOST 0
#endif
#ifndef MOE_OFF_INODE_INO
#define MOE_OFF_INODE_INO 0
#endif
#ifndef MOE_OFF_INODE_SB
#define MOE_OFF_INODE_SB 0
#endif
#ifndef MOE_OFF_SB_DEV
#define MOE_OFF_SB_DEV 0
#endif
#ifndef MOE_OFF_MEMCG_ID
#define MOE_OFF_MEMCG_ID 0
#endif
#ifndef MOE_OFF_MEMCG_NODEINFO
#define MOE_OFF_MEMCG_NODEINFO 0
#endif
#ifndef MOE_OFF_PN_MIN_SEQ_FILE
#define MOE_OFF_PN_MIN_SEQ_FILE 0
#endif
#ifndef MOE_LRU_GEN_PERIOD_MS
#define MOE_LRU_GEN_PERIOD_MS 1000
#endif
#ifndef MOE_LRU_GEN_FULL
#define MOE_LRU_GEN_FULL 0
#endif

// aging record kinds (toolkit/record/probes/mglru.py AGING_KINDS names them in this order)
#define AGING_TRY_TO_INC_MAX_SEQ 0
#define AGING_INC_MAX_SEQ 1
#define AGING_INC_MAX_SEQ_CLONE 2
#define SEQ_UNKNOWN 0xffffffffffffffffULL

// stats slots (toolkit/record/probes/mglru.py MGLRU.stats names them, in order)
#define STAT_EVICT_FOLIOS 0
#define STAT_ISOLATE_FOLIOS 1
#define STAT_SHOULD_RUN_AGING 2
#define STAT_INC_MAX_SEQ 3       // aging attempts (whichever inc_max_seq candidate is attached)
#define STAT_FOLIO_INC_GEN 4
#define STAT_LOOK_AROUND 5
#define STAT_WORKINGSET_EVICTION 6
#define STAT_WORKINGSET_REFAULT 7
#define STAT_RING_LOST 8         // aging records the ring had no room for
#define STAT_EVICT_LOST 9        // pool eviction records the ring had no room for
#define STAT_EVICT_POOL 10       // pool folios evicted (a record each, or counted lost)
#define N_STATS 11

#if MOE_HAVE_EVICT_FOLIOS || MOE_HAVE_ISOLATE_FOLIOS || MOE_HAVE_SHOULD_RUN_AGING || MOE_HAVE_INC_MAX_SEQ || \
    MOE_HAVE_FOLIO_INC_GEN || MOE_HAVE_LOOK_AROUND || MOE_HAVE_WS_EVICTION || MOE_HAVE_WS_REFAULT
#include <uapi/linux/ptrace.h>  // struct pt_regs for PT_REGS_PARM*
#endif

// MAX_NR_GENS is 4 on every MGLRU kernel so far; slot 0 counts folios not on an MGLRU list
#define GEN_SLOTS 5

struct aging_event {
    u64 ts_ns;   // bpf_ktime_get_ns (CLOCK_MONOTONIC)
    u64 seq;     // try_to_inc_max_seq's max_seq argument; SEQ_UNKNOWN for the other kinds
    u32 tgid;    // who aged (kswapd, a direct reclaimer, a writer of lru_gen)
    u32 kind;    // AGING_*
};

// always compiled: the one map every build has (a probe-build test checks it)
BPF_ARRAY(stats, u64, N_STATS);
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

#if MOE_HAVE_INC_MAX_SEQ
BPF_RINGBUF_OUTPUT(aging, MOE_RINGBUF_PAGES);

static __always_inline int aging_event(u32 kind, u64 seq) {
    stat_add(STAT_INC_MAX_SEQ, 1);
    struct aging_event *e = aging.ringbuf_reserve(sizeof(struct aging_event));
    if (!e) {
        stat_add(STAT_RING_LOST, 1);
        return 0;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->seq = seq;
    e->tgid = bpf_get_current_pid_tgid() >> 32;
    e->kind = kind;
    aging.ringbuf_submit(e, 0);
    return 0;
}

int kp_try_to_inc_max_seq(struct pt_regs *ctx) {
    MOE_GATE();
    return aging_event(AGING_TRY_TO_INC_MAX_SEQ, PT_REGS_PARM2(ctx));
}
int kp_inc_max_seq(struct pt_regs *ctx) {
    MOE_GATE();
    return aging_event(AGING_INC_MAX_SEQ, SEQ_UNKNOWN);
}
int kp_inc_max_seq_constprop_0(struct pt_regs *ctx) {
    MOE_GATE();
    return aging_event(AGING_INC_MAX_SEQ_CLONE, SEQ_UNKNOWN);
}
#endif

#if MOE_HAVE_EVICT_FOLIOS
int kp_evict_folios(struct pt_regs *ctx) {
    MOE_GATE();
    stat_add(STAT_EVICT_FOLIOS, 1);
    return 0;
}
#endif

#if MOE_HAVE_ISOLATE_FOLIOS
int kp_isolate_folios(struct pt_regs *ctx) {
    MOE_GATE();
    stat_add(STAT_ISOLATE_FOLIOS, 1);
    return 0;
}
#endif

#if MOE_HAVE_SHOULD_RUN_AGING
int kp_should_run_aging(struct pt_regs *ctx) {
    MOE_GATE();
    stat_add(STAT_SHOULD_RUN_AGING, 1);
    return 0;
}
#endif

#if MOE_HAVE_FOLIO_INC_GEN
// The build's page-flags layout (exact headers): the field widths from <linux/page-flags-layout.h>
// and bounds.h, the offsets chained as mmzone.h chains them (6.1 .. 6.12: SECTIONS, NODES, ZONES,
// LAST_CPUPID, KASAN_TAG, LRU_GEN from the top bit down). <linux/mmzone.h> itself would double
// this probe's compile (18 s under the lab's TCG); tests/probe_build checks the two agree.
#include <linux/page-flags-layout.h>
#define MOE_LRU_GEN_PGOFF ((sizeof(unsigned long) * 8) - SECTIONS_WIDTH - NODES_WIDTH - ZONES_WIDTH - \
                           LAST_CPUPID_WIDTH - KASAN_TAG_WIDTH - LRU_GEN_WIDTH)
#define MOE_LRU_GEN_MASK (((1UL << LRU_GEN_WIDTH) - 1) << MOE_LRU_GEN_PGOFF)
BPF_ARRAY(inc_gen_from, u64, GEN_SLOTS);

int kp_folio_inc_gen(struct pt_regs *ctx) {
    MOE_GATE();
    stat_add(STAT_FOLIO_INC_GEN, 1);
    unsigned long flags = 0;
    bpf_probe_read_kernel(&flags, sizeof(flags), (void *)PT_REGS_PARM2(ctx));
    // ((flags & LRU_GEN_MASK) >> LRU_GEN_PGOFF) - 1 is the generation (folio_lru_gen); 0 here: not on MGLRU
    u32 slot = (u32)((flags & MOE_LRU_GEN_MASK) >> MOE_LRU_GEN_PGOFF);
    if (slot >= GEN_SLOTS)
        slot = 0;
    u64 *c = inc_gen_from.lookup(&slot);
    if (c)
        __sync_fetch_and_add(c, 1);
    return 0;
}
#endif

#if MOE_HAVE_LOOK_AROUND
int kp_lru_gen_look_around(struct pt_regs *ctx) {
    MOE_GATE();
    stat_add(STAT_LOOK_AROUND, 1);
    return 0;
}
#endif

#if MOE_HAVE_WS_EVICTION
#if MOE_EVICT_EVENTS
// workingset_eviction(folio, target_memcg): the folio leaves the page cache; with MGLRU the
// kernel's shadow entry records its memcg's min_seq[file] at this moment (lru_gen_eviction),
// the generation eviction is taking from. Read with BTF offsets, no kernel headers.
struct evict_event {
    u64 ts_ns;     // bpf_ktime_get_ns (CLOCK_MONOTONIC)
    u64 ino;       // folio->mapping->host->i_ino
    u64 index;     // folio->index (first page of the folio)
    u64 min_seq;   // folio's memcg: nodeinfo[0]->lruvec.lrugen.min_seq[LRU_GEN_FILE]; SEQ_UNKNOWN without memcg
    u32 memcg_id;  // mem_cgroup->id.id (the lru_gen file's memcg id); 0 without memcg
    u32 tgid;      // who evicted
};
BPF_RINGBUF_OUTPUT(evictions, MOE_EVICT_RINGBUF_PAGES);

static __always_inline u64 rd64(u64 addr) {
    u64 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), (void *)addr);
    return v;
}
static __always_inline u32 rd32(u64 addr) {
    u32 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), (void *)addr);
    return v;
}
#endif

int kp_workingset_eviction(struct pt_regs *ctx) {
    MOE_GATE();
    stat_add(STAT_WORKINGSET_EVICTION, 1);
#if MOE_EVICT_EVENTS
    u64 folio = PT_REGS_PARM1(ctx);
    u64 mapping = rd64(folio + MOE_OFF_FOLIO_MAPPING);
    if (!mapping || (mapping & 1))  // none, or anonymous (PAGE_MAPPING_ANON)
        return 0;
    u64 host = rd64(mapping + MOE_OFF_AS_HOST);
    if (!host)
        return 0;
    if (rd32(rd64(host + MOE_OFF_INODE_SB) + MOE_OFF_SB_DEV) != MOE_POOL_DEV)
        return 0;
    stat_add(STAT_EVICT_POOL, 1);
    struct evict_event *e = evictions.ringbuf_reserve(sizeof(struct evict_event));
    if (!e) {
        stat_add(STAT_EVICT_LOST, 1);
        return 0;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->ino = rd64(host + MOE_OFF_INODE_INO);
    e->index = rd64(folio + MOE_OFF_FOLIO_INDEX);
    e->tgid = bpf_get_current_pid_tgid() >> 32;
    u64 memcg = rd64(folio + MOE_OFF_FOLIO_MEMCG) & ~7ULL;  // memcg_data: low bits are flags
    e->memcg_id = 0;
    e->min_seq = SEQ_UNKNOWN;
    if (memcg) {
        e->memcg_id = rd32(memcg + MOE_OFF_MEMCG_ID);
        u64 pn = rd64(memcg + MOE_OFF_MEMCG_NODEINFO);  // node 0 (the lab guests have one node)
        if (pn)
            e->min_seq = rd64(pn + MOE_OFF_PN_MIN_SEQ_FILE);
    }
    evictions.ringbuf_submit(e, 0);
#endif
    return 0;
}
#endif

#if MOE_HAVE_WS_REFAULT
int kp_workingset_refault(struct pt_regs *ctx) {
    MOE_GATE();
    stat_add(STAT_WORKINGSET_REFAULT, 1);
    return 0;
}
#endif
