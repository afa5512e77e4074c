// SPDX-License-Identifier: Apache-2.0
// reads: every read call of the followed processes (the replay and its children) timed in the
// kernel, with the page-cache pages added while it was in flight: 0 pages added -> hit-only,
// > 0 -> miss, ret < 0 -> error. Aggregated in the kernel per class (calls, bytes, pages,
// latency log2 histogram) and per (tgid, fd, fd generation, extent) so that user space can
// attribute calls to experts; optionally one ring record per call. CO-RE (moetrace.bpf.h).
//
// Cost: a hit-only 1 MiB read evicts the maps from the caches, so each map an exit touches
// costs a few hundred ns; a call does four hash lookups (enter: tgids, inflight; exit:
// inflight, fdgen), plus `fds` when moe_extent > 0. The per-tid `inflight` entry is rewritten in
// place (no allocation per call) and the files layout's positioned calls are counted in the fd's
// `fdgen` entry, which close() retires into `fds` under the identity it ends.
//
// Reads tracepoint arguments, syscall arguments (struct trace_event_raw_sys_enter args[], in the
// syscall's argument order), user memory (the iovec array of preadv/preadv2, a UAPI layout) and,
// once per fd identity, the task's fd table (CO-RE: current->files->fdt->fd[fd]->f_inode):
//   syscalls:sys_enter_{pread64,read}       fd, count (, pos)
//   syscalls:sys_enter_{preadv,preadv2}     fd, vec, vlen, pos_l (pos_h is ignored by 64-bit
//                                           kernels: pos_from_hilo)
//   syscalls:sys_exit_*                     ret
//   filemap:mm_filemap_add_to_page_cache    i_ino, index, s_dev, order
//   syscalls:sys_enter_close                fd            (fd generations)
//   syscalls:sys_enter_close_range          -             (tgid epoch)
//   sched:sched_process_exec                -             (tgid epoch: O_CLOEXEC)
//   task:task_newtask                       pid, clone_flags (follow forks)
// `order` exists since large folios: bpf_core_field_exists decides, else one page per event.
//
// Calls are aggregated per fd *identity* (tgid, fd, gen, epoch): gen counts the close() calls of
// that fd number in that process and epoch the process's close_range() / exec events, so a reused
// fd number is a new identity. The identity's first counted call reads the fd's inode from the
// task's fd table (the call just used the fd: it is open), so every identity knows its file
// without user space racing the close; if that read fails, the first page added during one of its
// calls tells. Each new identity is also pushed into the `idents` ring with that inode, without a
// wake-up: user space drains it every few tens of ms and reads the path of each fd still open
// (the path is for people; attribution needs only the inode).
//
// Knobs (read-only globals; declared with their meaning in moetrace/record/probes/reads.py):
// moe_extent (bytes per aggregated extent of a file; 0: no split), moe_page_shift, moe_max_iov,
// moe_have_order, moe_stream. The attach groups' knobs (moe_have_preadv, moe_have_preadv2,
// moe_have_read, moe_track_close, moe_track_close_range, moe_track_exec, moe_follow_forks) decide
// which programs load, and moe_max_tasks / moe_max_tgids / moe_max_fds / moe_max_fdgen /
// moe_ringbuf_pages / moe_ident_ring_pages size the maps (SPEC.map_sizes); they are globals too,
// for the record. Full maps are counted, never silent; an fds / fdgen entry is ~0.6 KiB.
//
// gated: enters, page adds, close / close_range / exec and forks keep their state while unarmed
// (a call entered before arming is timed in full; fd generations and epochs stay right); what
// they count is gated (map-full losses excepted), the exits count only armed, and an unarmed exit
// still ends its call (no stale in-flight entry).

#include "moetrace.bpf.h"

const volatile u32 moe_have_preadv = 1;
const volatile u32 moe_have_preadv2 = 1;
const volatile u32 moe_have_read = 1;
const volatile u32 moe_track_close = 1;
const volatile u32 moe_track_close_range = 1;
const volatile u32 moe_track_exec = 1;
const volatile u32 moe_follow_forks = 1;
const volatile u32 moe_have_order = 1;
const volatile u64 moe_extent = 0;        // bytes per aggregated extent (the pool file's); 0: no split
const volatile u32 moe_page_shift = 12;   // log2 of the page size (call ranges in pages)
const volatile u32 moe_max_iov = 16;      // iovec entries of a preadv summed for `count`
const volatile u32 moe_max_tasks = 4096;
const volatile u32 moe_max_tgids = 1024;
const volatile u32 moe_max_fds = 16384;
const volatile u32 moe_max_fdgen = 8192;
const volatile u32 moe_stream = 0;        // 1: one `calls` ring record per call (struct read_call)
const volatile u32 moe_ringbuf_pages = 256;
const volatile u32 moe_ident_ring_pages = 16;

#define NOPOS 0xffffffffffffffffULL  // read(): the file position is not an argument
#define EBADF_RET (-9)               // -EBADF (asm-generic/errno-base.h)

// syscalls (moetrace/record/probes/reads.py SYSCALLS names them in this order)
#define SC_PREAD64 0
#define SC_PREADV 1
#define SC_PREADV2 2
#define SC_READ 3

// call classes (moetrace/record/probes/reads.py CLASSES names them in this order)
#define CLASS_HIT_ONLY 0  // no page added while the call was in flight
#define CLASS_MISS 1      // >= 1 page added
#define CLASS_ERROR 2     // ret < 0
#define N_CLASSES 3
// log2 latency slots (moe_log2l: slot s holds [2^(s-1), 2^s) ns); the last slot also holds every
// longer call (2^38 ns is over 4 minutes)
#define HIST_SLOTS 40

// stats slots (moetrace/record/probes/reads.py READS.stats names them, in order)
enum moe_stat {  // the `stats` map's slots, in the declaration's order (SPEC.stats)
    STAT_CALLS_PREAD64,
    STAT_CALLS_PREADV,
    STAT_CALLS_PREADV2,
    STAT_CALLS_READ,
    STAT_NESTED_ENTERS,                 // an enter while the tid had a call in flight (overwritten)
    STAT_INFLIGHT_FULL,                 // call not timed: the in-flight map was full
    STAT_EXIT_WITHOUT_ENTER,            // attached mid-call, or an enter lost
    STAT_ADD_EVENTS_IN_CALLS,
    STAT_PAGES_ADDED_OUTSIDE_CALLS,       // by followed tasks, not in a read call (faults, fadvise)
    STAT_FD_MAP_FULL,                   // calls counted in fd_overflow instead of per fd
    STAT_RING_DROPS,
    STAT_TGID_FULL,
    STAT_IOV_TRUNCATED,                 // preadv with more than moe_max_iov entries: count partial
    STAT_IOV_READ_ERRORS,
    STAT_CLOSES,
    STAT_EPOCH_BUMPS,
    STAT_FDGEN_FULL,                    // (tgid, fd) not tracked: a reuse of that fd number is ambiguous
    STAT_IDENT_DROPS,                   // idents ring full: the periodic /proc scan must find the fd
    STAT_RETIRE_FAILED,                 // a closed identity's counters could not move to `fds` (full):
                                        // its counters land in the fd_map_full row, its histogram is lost
    STAT_FD_INODE_UNREAD,               // an identity's file could not be read from the task's fd table
                                        // (closed by another thread meanwhile): its first added page tells
    N_STATS
};
MOE_STAT_BTF;

struct class_counts {
    u64 calls;
    u64 bytes;           // sum of ret > 0
    u64 requested_bytes; // sum of count
    u64 added_pages;     // pages of the call's file added during the call
    u64 beyond_pages;    // ... of them outside [pos, pos + count) (readahead ahead)
    u64 other_pages;     // pages of other inodes added during the call
    u64 latency_ns;
};

struct fd_key {
    u32 tgid;
    u32 fd;
    u32 gen;
    u32 epoch;
    u64 chunk;  // pos / moe_extent (0 when moe_extent is 0; NOPOS for read())
};

struct fd_counts {
    u64 calls;
    u64 bytes;
    u64 requested_bytes;
    u64 hit_calls;
    u64 hit_bytes;
    u64 hit_latency_ns;
    u64 miss_calls;
    u64 miss_bytes;
    u64 miss_latency_ns;
    u64 error_calls;
    u64 error_latency_ns;
    u64 added_pages;
    u64 beyond_pages;
    u64 other_pages;
    u64 ino;     // the identity's inode (0: unknown), read as ino_by says
    u64 dev;     // its s_dev, kernel encoding
    u64 ino_by;  // INO_BY_FD: the task's fd table at the identity's first call; INO_BY_ADD: the
                 // first page added in one of its calls (the fd table could not be read)
};

#define INO_BY_FD 1
#define INO_BY_ADD 2

// one fd identity (and extent): its counters and its calls per (class, log2 latency slot)
struct fd_agg {
    struct fd_counts c;
    u32 hist[N_CLASSES * HIST_SLOTS];
};

// (tgid, fd) -> the fd number's current identity. With moe_extent 0 (files layout) the
// positioned calls of the current identity are counted right here (`a`: one lookup per call);
// close() moves them to `fds` under their identity (it "retires" them), and so does the first
// call after the process's epoch changed.
struct live {
    u32 gen;    // close() calls of this fd number in the process so far
    u32 epoch;  // the tgid's epoch `a` belongs to
    struct fd_agg a;
};

struct inflight {
    u64 start_ns;
    u64 pos;
    u64 count;
    u64 ino;
    u64 added;
    u64 beyond;
    u64 other;
    u32 fd;
    u32 gen;
    u32 epoch;
    u32 sc;
    u32 dev;
    u32 pad;
};

struct read_call {
    u64 ts_ns;       // bpf_ktime_get_ns at enter (CLOCK_MONOTONIC)
    u64 pos;         // NOPOS for read()
    u64 count;
    s64 ret;
    u64 latency_ns;
    u64 ino;         // first page added during the call (0: none added)
    u32 tid;
    u32 tgid;
    u32 fd;
    u32 gen;
    u32 epoch;
    u32 syscall;
    u32 added_pages;
    u32 beyond_pages;
    u32 other_pages;
    u32 dev;
};

struct ident {
    u32 tgid;
    u32 fd;
    u32 gen;
    u32 epoch;
    u64 ino;  // the fd's inode read in the kernel (0: could not be read)
    u64 dev;  // its s_dev, kernel encoding
};

struct user_iov {
    u64 base;
    u64 len;
};

// followed tgid -> its epoch (close_range / exec events): one lookup answers both
MOE_HASH(tgids, u32, u32);                       // moe_max_tgids
// tid -> its call; an entry stays for the tid's next call (start_ns == 0: none in flight),
// rewritten in place: no allocation or bucket lock per call. LRU: exited threads age out.
MOE_LRU_HASH(inflight, u32, struct inflight);    // moe_max_tasks
MOE_HASH(fdgen, u64, struct live);               // (tgid << 32) | fd -> its current identity; moe_max_fdgen
// retired identities, and every identity's calls when moe_extent > 0 (per extent) or without a
// position (read()); moe_max_fds
MOE_HASH(fds, struct fd_key, struct fd_agg);
// slot 0: calls that found `fds` (or fdgen) full; slot 1: calls that failed with EBADF (the fd
// was not open: no identity - counting them per fd would merge them with the fd's next open file)
MOE_ARRAY(fd_overflow, struct fd_agg);           // 2
MOE_ARRAY(zeros, struct live);                   // 1, never written: the source of new entries (too big for the stack)
MOE_PERCPU_ARRAY(classes, struct class_counts);  // N_CLASSES
MOE_PERCPU_ARRAY(hist, u64);                     // N_CLASSES * HIST_SLOTS
MOE_PERCPU_ARRAY(stats, u64);                    // N_STATS
MOE_RINGBUF(idents);                             // moe_ident_ring_pages
MOE_RINGBUF(calls);                              // moe_ringbuf_pages when streaming, else one page

// Keep the ring records' structs in the object's BTF (the declaration test reads them there).
struct read_call _read_call = {};
struct ident _ident = {};

// per-CPU: a tracepoint program is not re-entered on its CPU, so a plain add is exact
static __always_inline void stat_add(u32 slot, u64 v)
{
    u64 *p = bpf_map_lookup_elem(&stats, &slot);
    if (p)
        *p += v;
}

static __always_inline u32 *followed(u32 tgid)
{
    return bpf_map_lookup_elem(&tgids, &tgid);
}

// One call entered: remember (fd, pos, count, start) of the tid. `ep` is the tgid's tgids entry
// (the caller checked that the tgid is followed).
static __always_inline int enter(u32 sc, u32 *ep, u32 tid, u64 fd, u64 pos, u64 count)
{
    int on = moe_armed();  // the call is stored either way (its exit may come after arming)
    if (on)
        stat_add(sc, 1);  // STAT_CALLS_* == SC_*
    u32 epoch = *ep;  // the fd's generation is taken at exit, with its counters (one lookup)
    struct inflight *f = bpf_map_lookup_elem(&inflight, &tid);
    if (f) {  // the tid's entry from its last call: rewrite it in place
        if (f->start_ns && on)
            stat_add(STAT_NESTED_ENTERS, 1);
        f->pos = pos;
        f->count = count;
        f->ino = 0;
        f->added = 0;
        f->beyond = 0;
        f->other = 0;
        f->fd = (u32)fd;
        f->gen = 0;
        f->epoch = epoch;
        f->sc = sc;
        f->dev = 0;
        f->start_ns = bpf_ktime_get_ns();  // last: a nonzero start marks the call in flight
        return 0;
    }
    struct inflight n = {};
    n.pos = pos;
    n.count = count;
    n.fd = (u32)fd;
    n.epoch = epoch;
    n.sc = sc;
    n.start_ns = bpf_ktime_get_ns();
    if (bpf_map_update_elem(&inflight, &tid, &n, BPF_ANY))
        stat_add(STAT_INFLIGHT_FULL, 1);  // a loss, counted armed or not (the exit may be armed)
    return 0;
}

static __always_inline int enter_pos(u32 sc, u64 fd, u64 pos, u64 count)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 *ep = followed(id >> 32);
    if (!ep)
        return 0;
    return enter(sc, ep, (u32)id, fd, pos, count);
}

// Sum of iov_len over the first moe_max_iov entries of a user iovec array (the bound is a
// read-only global: a constant to the verifier).
static __always_inline u64 iov_bytes(u64 vec, u64 vlen)
{
    u64 n = 0;
    for (u32 i = 0; i < moe_max_iov; i++) {
        if (i >= vlen)
            break;
        struct user_iov v = {};
        if (bpf_probe_read_user(&v, sizeof(v), (void *)(vec + i * sizeof(struct user_iov)))) {
            stat_add(STAT_IOV_READ_ERRORS, 1);
            break;
        }
        n += v.len;
    }
    if (vlen > moe_max_iov)
        stat_add(STAT_IOV_TRUNCATED, 1);
    return n;
}

static __always_inline int enter_vec(u32 sc, u64 fd, u64 vec, u64 vlen, u64 pos)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 *ep = followed(id >> 32);
    if (!ep)
        return 0;
    return enter(sc, ep, (u32)id, fd, pos, iov_bytes(vec, vlen));
}

// a new identity (or extent) was counted: tell user space now, while the fd is open (for its
// path: the inode is the kernel's own answer)
static __always_inline void announce(u32 tgid, u32 fd, u32 gen, u32 epoch, struct fd_counts *c)
{
    struct ident *r = bpf_ringbuf_reserve(&idents, sizeof(struct ident), 0);
    if (!r) {
        stat_add(STAT_IDENT_DROPS, 1);
        return;
    }
    r->tgid = tgid;
    r->fd = fd;
    r->gen = gen;
    r->epoch = epoch;
    r->ino = c->ino_by == INO_BY_FD ? c->ino : 0;
    r->dev = c->ino_by == INO_BY_FD ? c->dev : 0;
    // no wake-up: user space drains the ring every IDENT_DRAIN_S (a wake-up per identity cost the
    // recorder a context switch each: ~900 for one replay's Python imports)
    bpf_ringbuf_submit(r, BPF_RB_NO_WAKEUP);
}

// The inode (and its s_dev) of the current task's fd `fd`, read from the task's fd table
// (current->files->fdt->fd[fd]->f_inode: CO-RE relocated; the fd was just used by the call that
// exits). Returns 0 when read. Another thread's close() between the call and this read gives
// the next file of that fd number or nothing: the identity's gen/epoch are kept by the caller.
static __always_inline int fd_inode(u32 fd, u64 *ino, u64 *dev)
{
    struct task_struct *t = (struct task_struct *)bpf_get_current_task();
    struct fdtable *fdt = BPF_CORE_READ(t, files, fdt);
    if (!fdt || fd >= BPF_CORE_READ(fdt, max_fds))
        return -1;
    struct file **slots = BPF_CORE_READ(fdt, fd);
    struct file *file = 0;
    if (!slots || bpf_probe_read_kernel(&file, sizeof(file), &slots[fd]) || !file)
        return -1;
    struct inode *in = BPF_CORE_READ(file, f_inode);
    if (!in)
        return -1;
    *ino = BPF_CORE_READ(in, i_ino);
    *dev = BPF_CORE_READ(in, i_sb, s_dev);
    return 0;
}

// Every counter of `from` into the fd_overflow slot `to` (a full `fds`: nothing is dropped).
static __always_inline void overflow_add(struct fd_agg *to, struct fd_counts *from)
{
    __sync_fetch_and_add(&to->c.calls, from->calls);
    __sync_fetch_and_add(&to->c.bytes, from->bytes);
    __sync_fetch_and_add(&to->c.requested_bytes, from->requested_bytes);
    __sync_fetch_and_add(&to->c.hit_calls, from->hit_calls);
    __sync_fetch_and_add(&to->c.hit_bytes, from->hit_bytes);
    __sync_fetch_and_add(&to->c.hit_latency_ns, from->hit_latency_ns);
    __sync_fetch_and_add(&to->c.miss_calls, from->miss_calls);
    __sync_fetch_and_add(&to->c.miss_bytes, from->miss_bytes);
    __sync_fetch_and_add(&to->c.miss_latency_ns, from->miss_latency_ns);
    __sync_fetch_and_add(&to->c.error_calls, from->error_calls);
    __sync_fetch_and_add(&to->c.error_latency_ns, from->error_latency_ns);
    __sync_fetch_and_add(&to->c.added_pages, from->added_pages);
    __sync_fetch_and_add(&to->c.beyond_pages, from->beyond_pages);
    __sync_fetch_and_add(&to->c.other_pages, from->other_pages);
}

// Move the live identity's counters to `fds` under its key and zero them (close(), or the
// process's epoch changed). A read racing with close() on the same fd number may be lost.
static __always_inline void retire(u32 tgid, u32 fd, struct live *l)
{
    if (!l->a.c.calls)
        return;
    struct fd_key k = {};
    k.tgid = tgid;
    k.fd = fd;
    k.gen = l->gen;
    k.epoch = l->epoch;
    if (bpf_map_update_elem(&fds, &k, &l->a, BPF_ANY)) {
        stat_add(STAT_RETIRE_FAILED, 1);
        u32 z = 0;
        struct fd_agg *o = bpf_map_lookup_elem(&fd_overflow, &z);
        if (o)
            overflow_add(o, &l->a.c);
    }
    __builtin_memset(&l->a, 0, sizeof(l->a));
}

// The fdgen entry of (tgid, fd), created (gen 0, nothing counted) at the fd number's first call
// or close; 0 (counted in fdgen_full) when the map is full.
static __always_inline struct live *live_of(u32 tgid, u32 fd)
{
    u64 gk = ((u64)tgid << 32) | fd;
    struct live *l = bpf_map_lookup_elem(&fdgen, &gk);
    if (l)
        return l;
    u32 z = 0;
    struct live *zero = bpf_map_lookup_elem(&zeros, &z);
    if (zero)
        bpf_map_update_elem(&fdgen, &gk, zero, BPF_NOEXIST);
    l = bpf_map_lookup_elem(&fdgen, &gk);
    if (!l)
        stat_add(STAT_FDGEN_FULL, 1);
    return l;
}

// The `fds` aggregate of the call's (identity, extent), created empty when new (*first = 1);
// the fd_overflow slot 0 when the map is full.
static __always_inline struct fd_agg *fds_entry(struct inflight *f, u32 tgid, u32 gen, int *first)
{
    struct fd_key k = {};
    k.tgid = tgid;
    k.fd = f->fd;
    k.gen = gen;
    k.epoch = f->epoch;
    if (f->pos == NOPOS)
        k.chunk = NOPOS;
    else
        k.chunk = moe_extent ? f->pos / moe_extent : 0;
    struct fd_agg *a = bpf_map_lookup_elem(&fds, &k);
    if (!a) {
        u32 z = 0;
        struct live *zero = bpf_map_lookup_elem(&zeros, &z);
        if (zero && bpf_map_update_elem(&fds, &k, &zero->a, BPF_NOEXIST) == 0)
            *first = 1;
        a = bpf_map_lookup_elem(&fds, &k);
    }
    if (!a) {
        u32 z = 0;
        a = bpf_map_lookup_elem(&fd_overflow, &z);
        stat_add(STAT_FD_MAP_FULL, 1);
    }
    return a;
}

// Count one exited call on its identity; returns the fd's generation.
static __always_inline u32 fd_account(struct inflight *f, u32 tgid, u32 cls, u64 bytes, u64 lat, u32 slot)
{
    struct live *l = live_of(tgid, f->fd);
    u32 gen = l ? l->gen : 0;
    struct fd_agg *a = 0;
    int first = 0;
    if (l && moe_extent == 0 && f->pos != NOPOS && f->epoch >= l->epoch) {
        if (f->epoch != l->epoch) {  // the process's epoch changed since these counters began
            retire(tgid, f->fd, l);
            l->epoch = f->epoch;
        }
        a = &l->a;
        first = a->c.calls == 0;
    } else {
        a = fds_entry(f, tgid, gen, &first);
        if (!a)
            return gen;
    }
    struct fd_counts *c = &a->c;
    if (first) {  // the identity's (or extent's) first call: its file, then tell user space
        u64 ino = 0, dev = 0;
        if (fd_inode(f->fd, &ino, &dev) == 0) {
            c->ino = ino;
            c->dev = dev;
            c->ino_by = INO_BY_FD;
        } else {
            stat_add(STAT_FD_INODE_UNREAD, 1);
        }
        announce(tgid, f->fd, gen, f->epoch, c);
    }
    __sync_fetch_and_add(&c->calls, 1);
    __sync_fetch_and_add(&c->bytes, bytes);
    __sync_fetch_and_add(&c->requested_bytes, f->count);
    if (cls == CLASS_HIT_ONLY) {
        __sync_fetch_and_add(&c->hit_calls, 1);
        __sync_fetch_and_add(&c->hit_bytes, bytes);
        __sync_fetch_and_add(&c->hit_latency_ns, lat);
    } else if (cls == CLASS_MISS) {
        __sync_fetch_and_add(&c->miss_calls, 1);
        __sync_fetch_and_add(&c->miss_bytes, bytes);
        __sync_fetch_and_add(&c->miss_latency_ns, lat);
    } else {
        __sync_fetch_and_add(&c->error_calls, 1);
        __sync_fetch_and_add(&c->error_latency_ns, lat);
    }
    if (f->added)
        __sync_fetch_and_add(&c->added_pages, f->added);
    if (f->beyond)
        __sync_fetch_and_add(&c->beyond_pages, f->beyond);
    if (f->other)
        __sync_fetch_and_add(&c->other_pages, f->other);
    if (f->ino && !c->ino) {
        c->ino = f->ino;
        c->dev = f->dev;
        c->ino_by = INO_BY_ADD;
    }
    u32 hi = cls * HIST_SLOTS + slot;
    if (hi < N_CLASSES * HIST_SLOTS)
        __sync_fetch_and_add(&a->hist[hi], 1);
    return gen;
}

static __always_inline void bad_fd_account(struct inflight *f, u64 lat)
{
    u32 one = 1;
    struct fd_agg *a = bpf_map_lookup_elem(&fd_overflow, &one);
    if (!a)
        return;
    __sync_fetch_and_add(&a->c.calls, 1);
    __sync_fetch_and_add(&a->c.requested_bytes, f->count);
    __sync_fetch_and_add(&a->c.error_calls, 1);
    __sync_fetch_and_add(&a->c.error_latency_ns, lat);
}

// One ring record per call (moe_stream).
static __always_inline void emit(struct inflight *f, u32 tid, u32 tgid, u32 sc, long ret, u64 lat)
{
    struct read_call *r = bpf_ringbuf_reserve(&calls, sizeof(struct read_call), 0);
    if (!r) {
        stat_add(STAT_RING_DROPS, 1);
        return;
    }
    r->ts_ns = f->start_ns;
    r->pos = f->pos;
    r->count = f->count;
    r->ret = ret;
    r->latency_ns = lat;
    r->ino = f->ino;
    r->tid = tid;
    r->tgid = tgid;
    r->fd = f->fd;
    r->gen = f->gen;
    r->epoch = f->epoch;
    r->syscall = sc;
    r->added_pages = (u32)f->added;
    r->beyond_pages = (u32)f->beyond;
    r->other_pages = (u32)f->other;
    r->dev = f->dev;
    bpf_ringbuf_submit(r, 0);
}

// The per-class counters and the all-calls histogram (per-CPU: plain adds).
static __always_inline void class_account(struct inflight *f, u32 cls, u64 bytes, u64 lat, u32 slot)
{
    struct class_counts *cc = bpf_map_lookup_elem(&classes, &cls);
    if (cc) {
        cc->calls += 1;
        cc->bytes += bytes;
        cc->requested_bytes += f->count;
        cc->added_pages += f->added;
        cc->beyond_pages += f->beyond;
        cc->other_pages += f->other;
        cc->latency_ns += lat;
    }
    u32 hi = cls * HIST_SLOTS + slot;
    u64 *hv = bpf_map_lookup_elem(&hist, &hi);
    if (hv)
        *hv += 1;
}

// One call exited: classify, aggregate, stream.
static __always_inline int leave(u32 sc, long ret)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 tid = (u32)id;
    struct inflight *f = bpf_map_lookup_elem(&inflight, &tid);
    if (!f || !f->start_ns) {
        if (moe_armed() && followed(tgid))
            stat_add(STAT_EXIT_WITHOUT_ENTER, 1);
        return 0;
    }
    if (f->sc != sc) {  // an enter of another syscall was lost: drop it
        if (moe_armed())
            stat_add(STAT_EXIT_WITHOUT_ENTER, 1);
        f->start_ns = 0;
        return 0;
    }
    if (!moe_armed()) {  // not counting: end the call uncounted (no stale in-flight entry)
        f->start_ns = 0;
        return 0;
    }
    u64 lat = bpf_ktime_get_ns() - f->start_ns;
    u32 cls = ret < 0 ? CLASS_ERROR : ((f->added + f->other) ? CLASS_MISS : CLASS_HIT_ONLY);
    u64 bytes = ret > 0 ? (u64)ret : 0;
    u32 slot = moe_log2l(lat);
    if (slot >= HIST_SLOTS)
        slot = HIST_SLOTS - 1;
    class_account(f, cls, bytes, lat, slot);
    if (ret == EBADF_RET)
        bad_fd_account(f, lat);
    else
        f->gen = fd_account(f, tgid, cls, bytes, lat, slot);
    if (moe_stream)
        emit(f, tid, tgid, sc, ret, lat);
    f->start_ns = 0;  // no call in flight; the entry stays for the tid's next call
    return 0;
}

// A folio of npages added at page `index` of (ino, dev) by the current task.
static __always_inline int added(u64 ino, u64 index, u32 dev, u64 npages)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct inflight *f = bpf_map_lookup_elem(&inflight, &tid);
    if (!f || !f->start_ns) {
        u32 tgid = id >> 32;
        if (moe_armed() && followed(tgid))
            stat_add(STAT_PAGES_ADDED_OUTSIDE_CALLS, npages);
        return 0;
    }
    if (moe_armed())  // the pages are the call's either way: its exit may be armed
        stat_add(STAT_ADD_EVENTS_IN_CALLS, 1);
    if (!f->ino) {  // the first page added tells the call's inode
        f->ino = ino;
        f->dev = dev;
    }
    if (f->ino != ino || f->dev != dev) {
        f->other += npages;
        return 0;
    }
    f->added += npages;
    if (f->pos != NOPOS) {
        u64 lo = f->pos >> moe_page_shift;
        u64 hi = (f->pos + f->count + (1ULL << moe_page_shift) - 1) >> moe_page_shift;
        u64 a = index > lo ? index : lo;
        u64 b = index + npages < hi ? index + npages : hi;
        u64 inside = b > a ? b - a : 0;
        f->beyond += npages - inside;
    }
    return 0;
}

static __always_inline void bump_epoch(void)
{
    u32 *e = followed(bpf_get_current_pid_tgid() >> 32);
    if (!e)
        return;
    if (moe_armed())
        stat_add(STAT_EPOCH_BUMPS, 1);
    __sync_fetch_and_add(e, 1);
}

// ---------------------------------------------------------------------------------------------
// programs (each reads only its own ctx fields; helpers above take values). Syscall arguments
// are args[i] in the syscall's order: pread64(fd, buf, count, pos), preadv/preadv2(fd, vec,
// vlen, pos_l, pos_h[, flags]), read(fd, buf, count), close(fd).

SEC("tracepoint/syscalls/sys_enter_pread64")
int tp_sys_enter_pread64(struct trace_event_raw_sys_enter *ctx)
{
    return enter_pos(SC_PREAD64, ctx->args[0], ctx->args[3], ctx->args[2]);
}

SEC("tracepoint/syscalls/sys_exit_pread64")
int tp_sys_exit_pread64(struct trace_event_raw_sys_exit *ctx)
{
    return leave(SC_PREAD64, ctx->ret);
}

SEC("tracepoint/syscalls/sys_enter_preadv")
int tp_sys_enter_preadv(struct trace_event_raw_sys_enter *ctx)
{
    return enter_vec(SC_PREADV, ctx->args[0], ctx->args[1], ctx->args[2], ctx->args[3]);
}

SEC("tracepoint/syscalls/sys_exit_preadv")
int tp_sys_exit_preadv(struct trace_event_raw_sys_exit *ctx)
{
    return leave(SC_PREADV, ctx->ret);
}

SEC("tracepoint/syscalls/sys_enter_preadv2")
int tp_sys_enter_preadv2(struct trace_event_raw_sys_enter *ctx)
{
    // pos_l (u64)-1: the file position, like read()
    return enter_vec(SC_PREADV2, ctx->args[0], ctx->args[1], ctx->args[2], ctx->args[3]);
}

SEC("tracepoint/syscalls/sys_exit_preadv2")
int tp_sys_exit_preadv2(struct trace_event_raw_sys_exit *ctx)
{
    return leave(SC_PREADV2, ctx->ret);
}

SEC("tracepoint/syscalls/sys_enter_read")
int tp_sys_enter_read(struct trace_event_raw_sys_enter *ctx)
{
    return enter_pos(SC_READ, ctx->args[0], NOPOS, ctx->args[2]);
}

SEC("tracepoint/syscalls/sys_exit_read")
int tp_sys_exit_read(struct trace_event_raw_sys_exit *ctx)
{
    return leave(SC_READ, ctx->ret);
}

SEC("tracepoint/filemap/mm_filemap_add_to_page_cache")
int tp_mm_filemap_add_to_page_cache(struct trace_event_raw_mm_filemap_op_page_cache *ctx)
{
    return added(ctx->i_ino, ctx->index, ctx->s_dev, moe_folio_pages(ctx, moe_have_order));
}

SEC("tracepoint/syscalls/sys_enter_close")
int tp_sys_enter_close(struct trace_event_raw_sys_enter *ctx)
{
    u32 fd = (u32)ctx->args[0];
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!followed(tgid))
        return 0;
    if (moe_armed())
        stat_add(STAT_CLOSES, 1);
    struct live *l = live_of(tgid, fd);
    if (!l)
        return 0;
    retire(tgid, fd, l);
    __sync_fetch_and_add(&l->gen, 1);
    return 0;
}

SEC("tracepoint/syscalls/sys_enter_close_range")
int tp_sys_enter_close_range(void *ctx)
{
    bump_epoch();  // every fd of the process may have changed: a new epoch
    return 0;
}

SEC("tracepoint/sched/sched_process_exec")
int tp_sched_process_exec(void *ctx)
{
    bump_epoch();  // exec closed the O_CLOEXEC fds without close()
    return 0;
}

SEC("tracepoint/task/task_newtask")
int tp_task_newtask(struct trace_event_raw_task_newtask *ctx)
{
    u32 parent, child;
    u32 zero = 0;  // epoch 0 of the new process
    if (!moe_new_process(ctx, &parent, &child) || !followed(parent))
        return 0;
    if (bpf_map_update_elem(&tgids, &child, &zero, BPF_ANY))
        stat_add(STAT_TGID_FULL, 1);
    return 0;
}
