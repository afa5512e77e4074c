// SPDX-License-Identifier: Apache-2.0
// moetrace.h: what the probes share. Included by probes/<name>.c (the loader passes
// -I<probes dir>). Declarations, constants and map-free helpers only: bcc 0.26 rewrites
// map calls (`m.lookup(&k)`) in the main file alone, so every map and every function
// that touches one stays in the probe's own C file.

#ifndef MOETRACE_H
#define MOETRACE_H

// -- the inode -> expert map (pagecache, lru) -------------------------------------------------
// A pool file's inode maps to the expert id of its first extent and the experts it holds
// (1: files layout; every expert: one pool file). record/probes/*.py declares the same struct.
struct ino_val {
    u32 base;  // expert_id of the file's first extent
    u32 n;     // experts in the file
};

// -- one recording, one interval --------------------------------------------------------------
// MOE_GATED 1: the probe counts only while its one-entry `armed` array holds 1. moetrace
// record attaches every probe first, then arms them all (one map write each, microseconds
// apart), and disarms them all before it reads any: the probes of one recording cover the
// same interval. 0 (standalone loads): always counting. Each probe file defines
//     BPF_ARRAY(armed, u32, 1);  and  moe_armed()
// (a map call cannot live here) and starts its counting programs with MOE_GATE().
#ifndef MOE_GATED
#define MOE_GATED 0
#endif
#define MOE_GATE() do { if (!moe_armed()) return 0; } while (0)

// -- who evicted a page -----------------------------------------------------------------------
// The class of the context that deleted a page-cache folio (pagecache), or that ran a reclaim
// pass (reclaim): record/probes/pagecache.py EVICTORS names them in this order.
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
#define CTX_WRITE_SMALL 0x2    // a write(2) of at most MOE_SMALL_WRITE bytes ("1G" to memory.reclaim)
#define CTX_FADVISE 0x4
#define CTX_TRUNCATE 0x8
#define CTX_PAGEOUT 0x10       // madvise(MADV_PAGEOUT)
#define CTX_DIRECT 0x20
#define CTX_MEMCG 0x40
#define CTX_PROACTIVE 0x80     // a memcg reclaim window opened inside a small write(2)
#ifndef MOE_SMALL_WRITE
#define MOE_SMALL_WRITE 64
#endif
#define MADV_PAGEOUT_ADVICE 21

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

#endif  // MOETRACE_H
