// SPDX-License-Identifier: Apache-2.0
// block: device read bytes (in-kernel totals + one ring record per bio, which
// user space attributes to experts through FIEMAP extents) and request latency
// (issue -> complete, net of requeues) as an in-kernel log2 histogram.
//
// Reads ONLY tracepoint arguments (layout-safe with mismatched headers):
//   bytes:  block:block_io_start (6.5+) or block:block_bio_queue (every kernel):
//           dev, sector, nr_sector, rwbs
//   latency: block:block_rq_issue, block:block_rq_complete, block:block_rq_requeue:
//           dev, sector, nr_sector, rwbs
// Only reads count: 'R' among the rwbs flags (discards are 'D', writes 'W').
// Sectors and dev are the whole disk's: dev is the kernel encoding
// (major << 20) | minor.
//
// Configured only with -D knobs (toolkit/record/probes/block.py declares the probe; the
// knobs below all have defaults, so the file compiles as is):
//   MOE_DEV            tracepoint dev of the pool's disk; 0 = every device
//   MOE_BYTES_TP       1: the bytes group attaches block:block_io_start,
//                      2: block:block_bio_queue (the default: exists on every
//                      kernel; io_start needs its format file at compile time)
//   MOE_RINGBUF_PAGES  ring buffer size in pages (power of two)
//   MOE_MAX_INFLIGHT   (dev, sector) -> issue time entries for latency
//   MOE_STREAM_BIOS    1: one ring record per read bio (sector, nr_sector);
//                      0: in-kernel totals only
//   MOE_MAX_INODES, MOE_MAX_EXPERTS, MOE_MAX_EXTENTS: accepted, unused here
//                      (attribution to experts happens in user space)
//   MOE_GATED          1: count only while armed[0] = 1 (moetrace record arms all at once); 0: always
//
// Completion runs in IRQ context: a completion that fires while another BPF
// program runs on that CPU is dropped by the kernel's recursion protection
// (counted in the program's recursion_misses, which user space reads); the
// issue entry then stays in `inflight` and is counted at close. Bytes are
// counted at the bytes group, never at completion, so none are lost that way.
//
// MOE_GATED: issue, requeue and completion keep `inflight` right while unarmed (an issue
// before arming is timed to its armed completion; an unarmed completion still removes its
// entry); only their counts are gated. The bytes group is gated as a whole.

#include "moetrace.h"

#ifndef MOE_DEV
#define MOE_DEV 0
#endif
#ifndef MOE_BYTES_TP
#define MOE_BYTES_TP 2
#endif
#ifndef MOE_RINGBUF_PAGES
#define MOE_RINGBUF_PAGES 64
#endif
#ifndef MOE_MAX_INFLIGHT
#define MOE_MAX_INFLIGHT 65536
#endif
#ifndef MOE_STREAM_BIOS
#define MOE_STREAM_BIOS 1
#endif
#ifndef MOE_MAX_INODES
#define MOE_MAX_INODES 65536
#endif
#ifndef MOE_MAX_EXPERTS
#define MOE_MAX_EXPERTS 65536
#endif
#ifndef MOE_MAX_EXTENTS
#define MOE_MAX_EXTENTS 1048576
#endif

// stats slots (toolkit/record/probes/block.py STATS names them in this order)
#define STAT_READ_BYTES 0        // bytes group: read bytes on MOE_DEV
#define STAT_READ_BIOS 1         // bytes group: read events on MOE_DEV
#define STAT_RING_LOST 2         // ring reserve failed: bio records lost
#define STAT_ISSUES 3            // rq_issue reads on MOE_DEV
#define STAT_ISSUE_BYTES 4
#define STAT_REQUEUES 5          // rq_requeue reads on MOE_DEV
#define STAT_REQUEUE_BYTES 6
#define STAT_COMPLETES 7         // rq_complete reads on MOE_DEV
#define STAT_COMPLETE_MATCHED 8  // ... that found their issue time
#define STAT_INFLIGHT_FULL 9     // issue entries not stored (map full)
#define STAT_LATENCY_NS 10       // sum of matched issue -> complete ns
#define N_STATS 11
#define HIST_SLOTS 64

struct bio_event {
    u64 sector;
    u32 nr_sector;
    u32 flags;  // bit 0: readahead ('A' in rwbs)
};

struct rq_key {
    u64 sector;
    u32 dev;
    u32 pad;
};

BPF_PERCPU_ARRAY(stats, u64, N_STATS);
BPF_PERCPU_ARRAY(lat_hist, u64, HIST_SLOTS);
BPF_HASH(inflight, struct rq_key, u64, MOE_MAX_INFLIGHT);
BPF_RINGBUF_OUTPUT(bios, MOE_RINGBUF_PAGES);
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

static __always_inline void stat_add(u32 slot, u64 v)
{
    u64 *p = stats.lookup(&slot);
    if (p)
        *p += v;
}

// rwbs: "R", "RA", "RS", "RM", "FWS", "WS", "D", "N" ... ; 'R' only for reads
static __always_inline int rwbs_read(const char *rwbs, u32 *ra)
{
    int read = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        char c = rwbs[i];
        if (c == 0)
            break;
        if (c == 'R')
            read = 1;
        if (c == 'A')
            *ra = 1;
    }
    return read;
}

static __always_inline int dev_ok(u32 dev)
{
    return MOE_DEV == 0 || dev == (u32)MOE_DEV;
}

static __always_inline int count_bio(u32 dev, u64 sector, u32 nr_sector, const char *rwbs)
{
    u32 ra = 0;
    if (!dev_ok(dev) || !rwbs_read(rwbs, &ra) || nr_sector == 0)
        return 0;
    stat_add(STAT_READ_BYTES, (u64)nr_sector << 9);
    stat_add(STAT_READ_BIOS, 1);
#if MOE_STREAM_BIOS
    struct bio_event *e = bios.ringbuf_reserve(sizeof(struct bio_event));
    if (!e) {
        stat_add(STAT_RING_LOST, 1);
        return 0;
    }
    e->sector = sector;
    e->nr_sector = nr_sector;
    e->flags = ra;
    bios.ringbuf_submit(e, 0);
#endif
    return 0;
}

#if MOE_BYTES_TP == 1
int tp_block_io_start(struct tracepoint__block__block_io_start *args)
{
    MOE_GATE();
    return count_bio(args->dev, args->sector, args->nr_sector, args->rwbs);
}
#else
int tp_block_bio_queue(struct tracepoint__block__block_bio_queue *args)
{
    MOE_GATE();
    return count_bio(args->dev, args->sector, args->nr_sector, args->rwbs);
}
#endif

int tp_block_rq_issue(struct tracepoint__block__block_rq_issue *args)
{
    u32 ra = 0;
    if (!dev_ok(args->dev) || !rwbs_read(args->rwbs, &ra))
        return 0;
    if (moe_armed()) {
        stat_add(STAT_ISSUES, 1);
        stat_add(STAT_ISSUE_BYTES, (u64)args->nr_sector << 9);
    }
    struct rq_key k = {};
    k.sector = args->sector;
    k.dev = args->dev;
    u64 ts = bpf_ktime_get_ns();
    if (inflight.update(&k, &ts) != 0)
        stat_add(STAT_INFLIGHT_FULL, 1);
    return 0;
}

int tp_block_rq_requeue(struct tracepoint__block__block_rq_requeue *args)
{
    u32 ra = 0;
    if (!dev_ok(args->dev) || !rwbs_read(args->rwbs, &ra))
        return 0;
    if (moe_armed()) {
        stat_add(STAT_REQUEUES, 1);
        stat_add(STAT_REQUEUE_BYTES, (u64)args->nr_sector << 9);
    }
    struct rq_key k = {};
    k.sector = args->sector;
    k.dev = args->dev;
    inflight.delete(&k);  // it will be issued again: time the final issue
    return 0;
}

int tp_block_rq_complete(struct tracepoint__block__block_rq_complete *args)
{
    u32 ra = 0;
    if (!dev_ok(args->dev) || !rwbs_read(args->rwbs, &ra))
        return 0;
    struct rq_key k = {};
    k.sector = args->sector;
    k.dev = args->dev;
    if (!moe_armed()) {  // not counting: still close the issue's entry (no stale entry)
        inflight.delete(&k);
        return 0;
    }
    stat_add(STAT_COMPLETES, 1);
    u64 *tsp = inflight.lookup(&k);
    if (!tsp)
        return 0;
    u64 delta = bpf_ktime_get_ns() - *tsp;
    inflight.delete(&k);
    stat_add(STAT_COMPLETE_MATCHED, 1);
    stat_add(STAT_LATENCY_NS, delta);
    u32 slot = bpf_log2l(delta);
    if (slot >= HIST_SLOTS)
        slot = HIST_SLOTS - 1;
    u64 *c = lat_hist.lookup(&slot);
    if (c)
        *c += 1;
    return 0;
}
