// SPDX-License-Identifier: Apache-2.0
// block: device read bytes (in-kernel totals + one ring record per bio, which
// user space attributes to experts through FIEMAP extents) and request latency
// (issue -> complete, net of requeues) as an in-kernel log2 histogram. CO-RE (moetrace.bpf.h).
//
// Reads only tracepoint arguments, relocated by name against the running kernel's BTF (the
// event classes' trace_event_raw_* structs):
//   bytes:  block:block_io_start (6.5+, class block_rq) or block:block_bio_queue (every kernel,
//           class block_bio): dev, sector, nr_sector, rwbs
//   latency: block:block_rq_issue (class block_rq), block:block_rq_complete (class
//           block_rq_completion), block:block_rq_requeue (an event of its own): dev, sector,
//           nr_sector, rwbs
// Field offsets differ between kernels (rwbs is char[8] on 6.1 and 6.12, char[10] on 6.18;
// block_rq gained ioprio after 6.1): CO-RE relocates each read.
// Only reads count: 'R' among the rwbs flags (discards are 'D', writes 'W').
// Sectors and dev are the whole disk's: dev is the kernel encoding
// (major << 20) | minor.
//
// Knobs (read-only globals; toolkit/record/probes/block.py declares them): moe_dev (the pool's
// disk, 0: every device), moe_stream_bios (1: one ring record per read bio, needed to attribute
// to experts; 0: in-kernel totals only). moe_bytes_tp records which bytes tracepoint the attach
// plan chose (1 block_io_start, 2 block_bio_queue): both programs are in the object and the plan
// loads one (a program that is not loaded is not relocated, so a kernel without block_io_start
// loads this object too). moe_ringbuf_pages and moe_max_inflight size the maps (the loader does).
//
// Completion runs in IRQ context: a completion that fires while another BPF
// program runs on that CPU is dropped by the kernel's recursion protection
// (counted in the program's recursion_misses, which user space reads); the
// issue entry then stays in `inflight` and is counted at close. Bytes are
// counted at the bytes group, never at completion, so none are lost that way.
//
// gated: issue, requeue and completion keep `inflight` right while unarmed (an issue
// before arming is timed to its armed completion; an unarmed completion still removes its
// entry); only their counts are gated. The bytes group is gated as a whole.

#include "moetrace.bpf.h"

const volatile u32 moe_dev = 0;            // tracepoint dev of the pool's disk; 0: every device
const volatile u32 moe_bytes_tp = 2;       // 1: bytes at block_io_start, 2: at block_bio_queue
const volatile u32 moe_ringbuf_pages = 64; // ring buffer size in pages (the loader sizes `bios`)
const volatile u32 moe_stream_bios = 1;    // 1: one ring record per read bio
const volatile u32 moe_max_inflight = 65536;  // (dev, sector) -> issue time entries (sizes `inflight`)

// stats slots (toolkit/record/probes/block.py STATS names them in this order)
enum moe_stat {  // the `stats` map's slots, in the declaration's order (SPEC.stats)
    STAT_READ_BYTES,             // bytes group: read bytes on moe_dev
    STAT_READ_BIOS,              // bytes group: read events on moe_dev
    STAT_RING_LOST,              // ring reserve failed: bio records lost
    STAT_ISSUES,                 // rq_issue reads on moe_dev
    STAT_ISSUE_BYTES,
    STAT_REQUEUES,               // rq_requeue reads on moe_dev
    STAT_REQUEUE_BYTES,
    STAT_COMPLETES,              // rq_complete reads on moe_dev
    STAT_COMPLETE_MATCHED,       // ... that found their issue time
    STAT_INFLIGHT_FULL,          // issue entries not stored (map full)
    STAT_LATENCY_NS,             // sum of matched issue -> complete ns
    N_STATS
};
MOE_STAT_BTF;

#define HIST_SLOTS 64
#define RWBS_SCAN 8              // rwbs is char[8] (6.1, 6.12) or char[10] (6.18): 8 suffice

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

MOE_PERCPU_ARRAY(stats, u64);     // N_STATS
MOE_PERCPU_ARRAY(lat_hist, u64);  // HIST_SLOTS
MOE_HASH(inflight, struct rq_key, u64);  // moe_max_inflight
MOE_RINGBUF(bios);                // moe_ringbuf_pages pages

// Keep the shared struct in the object's BTF (the declaration test reads it there).
struct bio_event _bio_event = {};

// Per-CPU slots: programs on one CPU never interleave (recursion protection), so += is safe.
static __always_inline void stat_add(u32 slot, u64 v)
{
    u64 *p = bpf_map_lookup_elem(&stats, &slot);
    if (p)
        *p += v;
}

// rwbs: "R", "RA", "RS", "RM", "FWS", "WS", "D", "N" ... ; 'R' only for reads. Copied from the
// tracepoint's record first: its bytes are reached through ctx + the relocated offset of rwbs,
// and the verifier loads only at a constant offset from the unmodified ctx pointer ("dereference
// of modified ctx ptr"), which an array walk is not.
static __always_inline int rwbs_read(const char *rwbs, u32 *ra)
{
    char r[RWBS_SCAN] = {};
    if (bpf_probe_read_kernel(r, sizeof(r), rwbs))
        return 0;
    int read = 0;
#pragma unroll
    for (int i = 0; i < RWBS_SCAN; i++) {
        char c = r[i];
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
    return moe_dev == 0 || dev == moe_dev;
}

static __always_inline int count_bio(u32 dev, u64 sector, u32 nr_sector, const char *rwbs)
{
    u32 ra = 0;
    if (!dev_ok(dev) || !rwbs_read(rwbs, &ra) || nr_sector == 0)
        return 0;
    stat_add(STAT_READ_BYTES, (u64)nr_sector << 9);
    stat_add(STAT_READ_BIOS, 1);
    if (!moe_stream_bios)
        return 0;
    struct bio_event *e = bpf_ringbuf_reserve(&bios, sizeof(struct bio_event), 0);
    if (!e) {
        stat_add(STAT_RING_LOST, 1);
        return 0;
    }
    e->sector = sector;
    e->nr_sector = nr_sector;
    e->flags = ra;
    bpf_ringbuf_submit(e, 0);
    return 0;
}

// -- bytes (one of the two is loaded: the attach plan's bytes candidate) ---------------------

SEC("tracepoint/block/block_io_start")
int tp_block_io_start(struct trace_event_raw_block_rq *ctx)
{
    MOE_GATE();
    return count_bio(ctx->dev, ctx->sector, ctx->nr_sector, ctx->rwbs);
}

SEC("tracepoint/block/block_bio_queue")
int tp_block_bio_queue(struct trace_event_raw_block_bio *ctx)
{
    MOE_GATE();
    return count_bio(ctx->dev, ctx->sector, ctx->nr_sector, ctx->rwbs);
}

// -- latency: issue -> complete, requeued requests re-timed from their last issue ------------

SEC("tracepoint/block/block_rq_issue")
int tp_block_rq_issue(struct trace_event_raw_block_rq *ctx)
{
    u32 ra = 0;
    u32 dev = ctx->dev;
    if (!dev_ok(dev) || !rwbs_read(ctx->rwbs, &ra))
        return 0;
    if (moe_armed()) {
        stat_add(STAT_ISSUES, 1);
        stat_add(STAT_ISSUE_BYTES, (u64)ctx->nr_sector << 9);
    }
    struct rq_key k = {.sector = ctx->sector, .dev = dev};
    u64 ts = bpf_ktime_get_ns();
    if (bpf_map_update_elem(&inflight, &k, &ts, BPF_ANY) != 0)
        stat_add(STAT_INFLIGHT_FULL, 1);
    return 0;
}

SEC("tracepoint/block/block_rq_requeue")
int tp_block_rq_requeue(struct trace_event_raw_block_rq_requeue *ctx)
{
    u32 ra = 0;
    u32 dev = ctx->dev;
    if (!dev_ok(dev) || !rwbs_read(ctx->rwbs, &ra))
        return 0;
    if (moe_armed()) {
        stat_add(STAT_REQUEUES, 1);
        stat_add(STAT_REQUEUE_BYTES, (u64)ctx->nr_sector << 9);
    }
    struct rq_key k = {.sector = ctx->sector, .dev = dev};
    bpf_map_delete_elem(&inflight, &k);  // it will be issued again: time the final issue
    return 0;
}

SEC("tracepoint/block/block_rq_complete")
int tp_block_rq_complete(struct trace_event_raw_block_rq_completion *ctx)
{
    u32 ra = 0;
    u32 dev = ctx->dev;
    if (!dev_ok(dev) || !rwbs_read(ctx->rwbs, &ra))
        return 0;
    struct rq_key k = {.sector = ctx->sector, .dev = dev};
    if (!moe_armed()) {  // not counting: still close the issue's entry (no stale entry)
        bpf_map_delete_elem(&inflight, &k);
        return 0;
    }
    stat_add(STAT_COMPLETES, 1);
    u64 *tsp = bpf_map_lookup_elem(&inflight, &k);
    if (!tsp)
        return 0;
    u64 delta = bpf_ktime_get_ns() - *tsp;
    bpf_map_delete_elem(&inflight, &k);
    stat_add(STAT_COMPLETE_MATCHED, 1);
    stat_add(STAT_LATENCY_NS, delta);
    u32 slot = moe_log2l(delta);
    if (slot >= HIST_SLOTS)
        slot = HIST_SLOTS - 1;
    u64 *c = bpf_map_lookup_elem(&lat_hist, &slot);
    if (c)
        *c += 1;
    return 0;
}
