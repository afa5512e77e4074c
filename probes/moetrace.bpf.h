// SPDX-License-Identifier: Apache-2.0
// moetrace.bpf.h: what the CO-RE probes (probes/<name>.bpf.c) share. Built once by
// scripts/build-probes.sh (clang -target bpf -g -O2 against a vmlinux.h made from BTF); libbpf
// relocates every field read against the running kernel's BTF at load time.
//
// Knobs are read-only globals (`const volatile`, in .rodata), set by the loader before load
// (moetrace/kernel/libbpf.py BpfObject.set_globals): the verifier sees them as constants, so a
// branch on a knob costs nothing and a loop bounded by one is a bounded loop. A knob's global is
// its declared name in lower case (record/probes/<name>.py SPEC.knobs). Map sizes are set by the
// loader too (SPEC.map_sizes); the sizes written here are placeholders.

#ifndef MOETRACE_BPF_H
#define MOETRACE_BPF_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

char LICENSE[] SEC("license") = "GPL";

// -- maps, the libbpf way ---------------------------------------------------------------------
#define MOE_ARRAY(name, vtype) \
    struct { __uint(type, BPF_MAP_TYPE_ARRAY); __uint(max_entries, 1); \
             __type(key, u32); __type(value, vtype); } name SEC(".maps")
#define MOE_PERCPU_ARRAY(name, vtype) \
    struct { __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY); __uint(max_entries, 1); \
             __type(key, u32); __type(value, vtype); } name SEC(".maps")
#define MOE_HASH(name, ktype, vtype) \
    struct { __uint(type, BPF_MAP_TYPE_HASH); __uint(max_entries, 1); \
             __type(key, ktype); __type(value, vtype); } name SEC(".maps")
#define MOE_LRU_HASH(name, ktype, vtype) \
    struct { __uint(type, BPF_MAP_TYPE_LRU_HASH); __uint(max_entries, 1); \
             __type(key, ktype); __type(value, vtype); } name SEC(".maps")
#define MOE_RINGBUF(name) \
    struct { __uint(type, BPF_MAP_TYPE_RINGBUF); __uint(max_entries, 4096); } name SEC(".maps")

// -- the probe's own counters ------------------------------------------------------------------
// Each probe counts its events and failures in a u64 array map `stats`, one slot per
// `enum moe_stat { STAT_..., N_STATS }` enumerator, in the order of its declaration's SPEC.stats
// (the manifest's `stats`). Enumerators alone leave no trace in the object's BTF: MOE_STAT_BTF, a
// .bss variable of the enum's type, keeps the type there, where tests/probe_build compares it with
// the declaration.
#define MOE_STAT_BTF enum moe_stat moe_stat_btf

// -- one recording, one interval --------------------------------------------------------------
// gated = 1 (moetrace record): a probe counts only while `armed` holds 1. The recorder attaches
// every probe first, then arms them all (one store each into the mmapped .bss, no syscall) and
// disarms them all before it reads any: the probes of one recording cover the same interval.
// gated = 0 (standalone loads): always counting.
const volatile u32 gated = 0;
volatile u32 armed = 0;
#define MOE_GATE() do { if (gated && !armed) return 0; } while (0)

// 1 while the probe counts (ungated, or armed): for programs that must keep their state while
// unarmed and gate only what they count (reads: a call entered before arming is timed in full).
static __always_inline int moe_armed(void) { return !gated || armed; }

// -- the inode -> expert map (lru) -------------------------------------------------------------
// A pool file's inode maps to the expert id of its first extent and the experts it holds
// (1: files layout; every expert: one pool file). record/probes/*.py declares the same struct.
struct ino_val {
    u32 base;  // expert_id of the file's first extent
    u32 n;     // experts in the file
};

// -- the (inode, page) -> slot map by runs (pagecache) ------------------------------------------
// Every mapped file is tiled by runs, page ranges of one owner (moetrace/record/poolmap.py):
// slots [0, moe_n_experts) experts, then MOE_SLOT_UNATTRIBUTED, _SHARED, _NON_EXPERT. A file's
// runs are a sorted window of the `runs` array, the first starting at page 0, the last reaching
// the end of the page index space.
#define MOE_SLOT_UNATTRIBUTED 0  // + moe_n_experts: no mapped file; a pool file past its experts
#define MOE_SLOT_SHARED 1        // a page holding bytes of two owners
#define MOE_SLOT_NON_EXPERT 2    // a model file's header, non-expert tensors, padding
#define MOE_EXTRA_SLOTS 3
struct moe_win {
    u32 first;    // its runs: [first, first + count) of `runs`
    u32 count;
    u64 bm_base;  // the re-add bitmap's bit of the file's page 0
    u64 pages;    // pages with bitmap bits (pages past them have none)
};
struct moe_run {
    u32 start;    // first page
    u32 pages;
    u32 slot;
    u32 epage;    // the page within the owner of the first page (the stream's first_page)
};

// -- who evicted a page -----------------------------------------------------------------------
// The class of the context that deleted a page-cache folio (pagecache), or that ran a reclaim
// pass (reclaim): moetrace/run/evictors.py EVICTORS names them in this order.
#define EVICTOR_KSWAPD 0       // the kswapd kernel thread (global background reclaim)
#define EVICTOR_DIRECT 1       // direct reclaim in an allocating task (global)
#define EVICTOR_MEMCG 2        // memcg limit / high reclaim in a charging task
#define EVICTOR_PROACTIVE 3    // memory.reclaim (memcg reclaim inside a small write(2)), MADV_PAGEOUT
#define EVICTOR_DAMON 4        // a kdamond thread (DAMOS pageout, DAMON_RECLAIM)
#define EVICTOR_FADVISE 5      // fadvise64(2) (POSIX_FADV_DONTNEED) of any process
#define EVICTOR_TRUNCATE 6     // truncate / ftruncate / fallocate / unlink / unlinkat
#define EVICTOR_DROP_CACHES 7  // a write(2) outside reclaim: drop_caches (or an O_DIRECT write's invalidation)
#define EVICTOR_OTHER 8        // anything else (inode eviction at the last close, umount, migration ...)
#define N_EVICTORS 9

// Task-context bits (one u32 per task, in the probe's `task_ctx` map): set at a syscall's
// or a reclaim window's entry, cleared at its exit.
#define CTX_WRITE 0x1
#define CTX_WRITE_SMALL 0x2    // a write(2) of at most moe_small_write bytes ("1G" to memory.reclaim)
#define CTX_FADVISE 0x4
#define CTX_TRUNCATE 0x8
#define CTX_PAGEOUT 0x10       // madvise(MADV_PAGEOUT)
#define CTX_DIRECT 0x20
#define CTX_MEMCG 0x40
#define CTX_PROACTIVE 0x80     // a memcg reclaim window opened inside a small write(2)
#define CTX_POPULATE 0x100     // mmap(MAP_POPULATE), madvise(MADV_WILLNEED), fadvise64(POSIX_FADV_WILLNEED)
#define MADV_PAGEOUT_ADVICE 21
#define MADV_WILLNEED_ADVICE 3
#define FADV_WILLNEED_ADVICE 3
#define MAP_POPULATE_FLAG 0x8000
#define CLONE_THREAD_FLAG 0x00010000UL

// task:task_newtask: true when the new task is a process (a thread shares its tgid), with the
// forking process's tgid in *parent and the new process's in *child (the probes that follow a
// command's forks add *child when they follow *parent)
static __always_inline bool moe_new_process(struct trace_event_raw_task_newtask *ctx, u32 *parent,
                                            u32 *child)
{
    if (ctx->clone_flags & CLONE_THREAD_FLAG)
        return false;
    *parent = bpf_get_current_pid_tgid() >> 32;
    *child = ctx->pid;
    return true;
}

// 1: the current task is a kswapd thread, 2: a kdamond thread, 0: neither. Kernel threads
// cannot rename themselves, so the comm is the thread's identity.
static __always_inline u32 moe_kthread_kind(void)
{
    char c[8] = {};
    bpf_get_current_comm(&c, sizeof(c));
    if (c[0] == 'k' && c[1] == 's' && c[2] == 'w' && c[3] == 'a' && c[4] == 'p' && c[5] == 'd')
        return 1;
    if (c[0] == 'k' && c[1] == 'd' && c[2] == 'a' && c[3] == 'm' && c[4] == 'o' && c[5] == 'n' && c[6] == 'd')
        return 2;
    return 0;
}

// The evictor class of the current task, given its context bits (0 when it has none).
static __always_inline u32 moe_evictor(u32 ctx)
{
    u32 k = moe_kthread_kind();
    if (k == 1)
        return EVICTOR_KSWAPD;
    if (k == 2)
        return EVICTOR_DAMON;
    if (ctx & CTX_DIRECT)
        return EVICTOR_DIRECT;
    if (ctx & CTX_PROACTIVE)
        return EVICTOR_PROACTIVE;
    if (ctx & CTX_MEMCG)
        return EVICTOR_MEMCG;
    if (ctx & CTX_PAGEOUT)
        return EVICTOR_PROACTIVE;
    if (ctx & CTX_FADVISE)
        return EVICTOR_FADVISE;
    if (ctx & CTX_TRUNCATE)
        return EVICTOR_TRUNCATE;
    if (ctx & CTX_WRITE)
        return EVICTOR_DROP_CACHES;
    return EVICTOR_OTHER;
}

static __always_inline u64 moe_popcount64(u64 x)
{
    x = x - ((x >> 1) & 0x5555555555555555ULL);
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
    return (x * 0x0101010101010101ULL) >> 56;
}

// 1 when v > c, for v and c below 2^63, without a branch: the sign bit of c - v (barrier_var
// keeps the compiler from turning it back into a compare and branch).
static __always_inline u64 moe_above(u64 v, u64 c)
{
    barrier_var(v);
    return (c - v) >> 63;
}

// bcc's bpf_log2l: floor(log2(v)) + 1, with 0 and 1 both 1 (slot s of a log2 histogram holds
// [2^(s-1), 2^s), slot 1 also 0): the convention every recorder's histogram tables decode.
// Branch-free: a branch per halving step splits the verifier's state into one path per slot,
// each a constant it then tracks exactly as a map key or offset; that multiplied the
// verification of reads' exit programs (~100k instructions each with branches).
static __always_inline u32 moe_log2l(u64 v)
{
    u64 r = moe_above(v >> 1, 0x7FFFFFFF) << 5;  // v >= 2^32 (v >> 1: below 2^63)
    v >>= r;
    u64 s = moe_above(v, 0xFFFF) << 4;
    v >>= s;
    r |= s;
    s = moe_above(v, 0xFF) << 3;
    v >>= s;
    r |= s;
    s = moe_above(v, 0xF) << 2;
    v >>= s;
    r |= s;
    s = moe_above(v, 0x3) << 1;
    v >>= s;
    r |= s;
    return (u32)(r | (v >> 1)) + 1;
}

// Pages of the folio a filemap add/delete event names: 1 << order where the format carries the
// order (since large folios; have_order: the plan's reading of the format file), else 1.
static __always_inline u64 moe_folio_pages(struct trace_event_raw_mm_filemap_op_page_cache *ctx, u32 have_order)
{
    if (have_order && bpf_core_field_exists(ctx->order))
        return 1ULL << (ctx->order & 31);
    return 1;
}

// One u64 slot of an array map += v (stats, per-class counters).
static __always_inline void moe_add(void *map, u32 slot, u64 v)
{
    u64 *p = bpf_map_lookup_elem(map, &slot);
    if (p)
        __sync_fetch_and_add(p, v);
}

// The task-context bits (CTX_*) of the current thread in a u32 -> u32 map (each probe's
// `task_ctx`, an LRU hash: the oldest idle task goes first); 0 when it has none.
static __always_inline u32 moe_ctx_get(void *map)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u32 *c = bpf_map_lookup_elem(map, &tid);
    return c ? *c : 0;
}

// Set (on) or clear (off) context bits of the current thread, rewriting its entry in place.
static __always_inline int moe_ctx_set(void *map, u32 bits, int on)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u32 *c = bpf_map_lookup_elem(map, &tid);
    if (c) {
        *c = on ? (*c | bits) : (*c & ~bits);
        return 0;
    }
    if (!on)
        return 0;
    u32 v = bits;
    bpf_map_update_elem(map, &tid, &v, BPF_ANY);
    return 0;
}

#endif  // MOETRACE_BPF_H
