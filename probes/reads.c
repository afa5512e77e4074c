// SPDX-License-Identifier: Apache-2.0
// reads: every read call of the followed processes (the replay and its children)
// timed in the kernel, with the page-cache pages added while it was in flight:
// 0 pages added -> hit-only, > 0 -> miss, ret < 0 -> error. Aggregated in the
// kernel per class (calls, bytes, pages, latency log2 histogram) and per
// (tgid, fd, fd generation, extent) so that user space can attribute calls to
// experts; optionally one ring record per call.
//
// Reads ONLY tracepoint arguments, syscall arguments and user memory (the iovec
// array of preadv/preadv2, a UAPI layout) - layout-safe with mismatched headers:
//   syscalls:sys_enter_{pread64,read}       fd, count (, pos)
//   syscalls:sys_enter_{preadv,preadv2}     fd, vec, vlen, pos_l (pos_h is ignored
//                                           by 64-bit kernels: pos_from_hilo)
//   syscalls:sys_exit_*                     ret
//   filemap:mm_filemap_add_to_page_cache    i_ino, index, s_dev, order
//   syscalls:sys_enter_close                fd            (fd generations)
//   syscalls:sys_enter_close_range          -             (tgid epoch)
//   sched:sched_process_exec                -             (tgid epoch: O_CLOEXEC)
//   task:task_newtask                       pid, clone_flags (follow forks)
//
// fd -> inode cannot be read in the kernel (struct file with mismatched headers),
// so calls are aggregated per fd *identity* (tgid, fd, gen, epoch): gen counts
// the close() calls of that fd number in that process and epoch the process's
// close_range() / exec events, so a reused fd number is a new identity. User
// space resolves identities to inodes by scanning /proc/<tgid>/fd while the
// command runs (and reading gen/epoch back from `fdgen` / `epochs`); the first
// page added during a call also records the call's inode here (`ino`, `dev`).
//
// Configured only with -D knobs (declared in toolkit/probespec.py READS, with the
// attach groups, stats slots and shared structs; tests/test_probe_build.py checks
// that both sides agree):
//   MOE_HAVE_PREADV / MOE_HAVE_PREADV2 / MOE_HAVE_READ   compile that syscall's
//                   enter + exit (pread64 is always compiled)
//   MOE_TRACK_CLOSE        1: close() bumps the fd's generation
//   MOE_TRACK_CLOSE_RANGE  1: close_range() bumps the tgid's epoch
//   MOE_TRACK_EXEC         1: exec bumps the tgid's epoch (O_CLOEXEC closes)
//   MOE_FOLLOW_FORKS       1: a followed tgid's new processes are followed too
//   MOE_HAVE_ORDER         1: the add format carries the folio order
//   MOE_EXTENT             bytes per aggregate extent of a file (the pool file's
//                          extent: per-expert split by position); 0 = no split
//   MOE_PAGE_SHIFT         log2 of the page size (call ranges in pages)
//   MOE_MAX_IOV            iovec entries of a preadv summed for `count`
//   MOE_MAX_TASKS / MOE_MAX_TGIDS / MOE_MAX_FDS / MOE_MAX_HIST_KEYS /
//   MOE_MAX_FDGEN          map sizes (full maps are counted, never silent)
//   MOE_STREAM             1: one ring record per call (struct read_call)
//   MOE_RINGBUF_PAGES      ring buffer size in pages (power of two)
//   MOE_IDENT_RING_PAGES   size of the `idents` ring (always on): one record per
//                          new (fd identity, extent) so user space can stat
//                          /proc/<tgid>/fd/<fd> while the fd is still open

#ifndef MOE_HAVE_PREADV
#define MOE_HAVE_PREADV 1
#endif
#ifndef MOE_HAVE_PREADV2
#define MOE_HAVE_PREADV2 1
#endif
#ifndef MOE_HAVE_READ
#define MOE_HAVE_READ 1
#endif
#ifndef MOE_TRACK_CLOSE
#define MOE_TRACK_CLOSE 1
#endif
#ifndef MOE_TRACK_CLOSE_RANGE
#define MOE_TRACK_CLOSE_RANGE 1
#endif
#ifndef MOE_TRACK_EXEC
#define MOE_TRACK_EXEC 1
#endif
#ifndef MOE_FOLLOW_FORKS
#define MOE_FOLLOW_FORKS 1
#endif
#ifndef MOE_HAVE_ORDER
#define MOE_HAVE_ORDER 1
#endif
#ifndef MOE_EXTENT
#define MOE_EXTENT 0
#endif
#ifndef MOE_PAGE_SHIFT
#define MOE_PAGE_SHIFT 12
#endif
#ifndef MOE_MAX_IOV
#define MOE_MAX_IOV 16
#endif
#ifndef MOE_MAX_TASKS
#define MOE_MAX_TASKS 4096
#endif
#ifndef MOE_MAX_TGIDS
#define MOE_MAX_TGIDS 1024
#endif
#ifndef MOE_MAX_FDS
#define MOE_MAX_FDS 65536
#endif
#ifndef MOE_MAX_HIST_KEYS
#define MOE_MAX_HIST_KEYS 65536
#endif
#ifndef MOE_MAX_FDGEN
#define MOE_MAX_FDGEN 65536
#endif
#ifndef MOE_STREAM
#define MOE_STREAM 0
#endif
#ifndef MOE_RINGBUF_PAGES
#define MOE_RINGBUF_PAGES 256
#endif
#ifndef MOE_IDENT_RING_PAGES
#define MOE_IDENT_RING_PAGES 16
#endif

#if MOE_HAVE_PREADV2
#include <linux/fs.h>  // rwf_t: the type of sys_enter_preadv2's `flags` in bcc's generated args struct
#endif

#define CLONE_THREAD_FLAG 0x00010000UL
#define NOPOS 0xffffffffffffffffULL  // read(): the file position is not an argument
#define EBADF_RET (-9)               // -EBADF (asm-generic/errno-base.h)

// syscalls (toolkit/readsrec.py SYSCALLS names them in this order)
#define SC_PREAD64 0
#define SC_PREADV 1
#define SC_PREADV2 2
#define SC_READ 3

// call classes (toolkit/readsrec.py CLASSES names them in this order)
#define CLASS_HIT_ONLY 0  // no page added while the call was in flight
#define CLASS_MISS 1      // >= 1 page added
#define CLASS_ERROR 2     // ret < 0
#define N_CLASSES 3
#define HIST_SLOTS 64

// stats slots (toolkit/probespec.py READS.stats names them, in order)
#define STAT_CALLS_PREAD64 0
#define STAT_CALLS_PREADV 1
#define STAT_CALLS_PREADV2 2
#define STAT_CALLS_READ 3
#define STAT_NESTED_ENTERS 4            // an enter while the tid had a call in flight (overwritten)
#define STAT_INFLIGHT_FULL 5            // call not timed: the in-flight map was full
#define STAT_EXIT_WITHOUT_ENTER 6       // attached mid-call, or an enter lost
#define STAT_ADD_EVENTS_IN_CALLS 7
#define STAT_PAGES_ADDED_OUTSIDE_CALLS 8  // by followed tasks, not in a read call (faults, fadvise)
#define STAT_FD_MAP_FULL 9              // calls counted in fd_overflow instead of per fd
#define STAT_HIST_MAP_FULL 10           // calls missing from the per-fd histograms
#define STAT_RING_DROPS 11
#define STAT_TGID_FULL 12
#define STAT_IOV_TRUNCATED 13           // preadv with more than MOE_MAX_IOV entries: count partial
#define STAT_IOV_READ_ERRORS 14
#define STAT_CLOSES 15
#define STAT_EPOCH_BUMPS 16
#define STAT_FDGEN_FULL 17              // a close not recorded: later reuse of that fd is ambiguous
#define STAT_IDENT_DROPS 18             // idents ring full: the periodic /proc scan must find the fd
#define N_STATS 19

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
    u64 chunk;  // pos / MOE_EXTENT (0 when MOE_EXTENT is 0; NOPOS for read())
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
    u64 ino;  // inode of the first page added in a call on this identity (0: none)
    u64 dev;  // its s_dev, kernel encoding
};

struct hist_key {
    u32 tgid;
    u32 fd;
    u32 gen;
    u32 epoch;
    u32 cls;
    u32 slot;
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
};

struct user_iov {
    u64 base;
    u64 len;
};

BPF_HASH(tgids, u32, u8, MOE_MAX_TGIDS);
BPF_HASH(inflight, u32, struct inflight, MOE_MAX_TASKS);
BPF_HASH(fdgen, u64, u32, MOE_MAX_FDGEN);     // (tgid << 32) | fd -> closes of that fd
BPF_HASH(epochs, u32, u32, MOE_MAX_TGIDS);    // tgid -> close_range / exec events
BPF_HASH(fds, struct fd_key, struct fd_counts, MOE_MAX_FDS);
BPF_HASH(fd_hist, struct hist_key, u64, MOE_MAX_HIST_KEYS);
// slot 0: calls that found `fds` full; slot 1: calls that failed with EBADF (the fd was not
// open: no identity - counting them per fd would merge them with the fd's next open file)
BPF_ARRAY(fd_overflow, struct fd_counts, 2);
BPF_PERCPU_ARRAY(classes, struct class_counts, N_CLASSES);
BPF_PERCPU_ARRAY(hist, u64, N_CLASSES * HIST_SLOTS);
BPF_PERCPU_ARRAY(stats, u64, N_STATS);
BPF_RINGBUF_OUTPUT(idents, MOE_IDENT_RING_PAGES);
#if MOE_STREAM
BPF_RINGBUF_OUTPUT(calls, MOE_RINGBUF_PAGES);
#endif

static __always_inline void stat_add(u32 slot, u64 v) {
    u64 *p = stats.lookup(&slot);
    if (p)
        *p += v;
}

static __always_inline int followed(u32 tgid) {
    return tgids.lookup(&tgid) != 0;
}

// One call entered: remember (fd, pos, count, start) of the tid.
static __always_inline int enter(u32 sc, u64 fd, u64 pos, u64 count) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 tid = (u32)id;
    if (!followed(tgid))
        return 0;
    stat_add(sc, 1);  // STAT_CALLS_* == SC_*
    struct inflight f = {};
    f.start_ns = bpf_ktime_get_ns();
    f.pos = pos;
    f.count = count;
    f.fd = (u32)fd;
    f.sc = sc;
    u64 gk = ((u64)tgid << 32) | (u32)fd;
    u32 *g = fdgen.lookup(&gk);
    if (g)
        f.gen = *g;
    u32 *e = epochs.lookup(&tgid);
    if (e)
        f.epoch = *e;
    if (inflight.lookup(&tid))
        stat_add(STAT_NESTED_ENTERS, 1);
    if (inflight.update(&tid, &f))
        stat_add(STAT_INFLIGHT_FULL, 1);
    return 0;
}

// Sum of iov_len over the first MOE_MAX_IOV entries of a user iovec array.
static __always_inline u64 iov_bytes(u64 vec, u64 vlen) {
    u64 n = 0;
#pragma unroll
    for (int i = 0; i < MOE_MAX_IOV; i++) {
        if (i >= vlen)
            break;
        struct user_iov v = {};
        if (bpf_probe_read_user(&v, sizeof(v), (void *)(vec + i * sizeof(struct user_iov)))) {
            stat_add(STAT_IOV_READ_ERRORS, 1);
            break;
        }
        n += v.len;
    }
    if (vlen > MOE_MAX_IOV)
        stat_add(STAT_IOV_TRUNCATED, 1);
    return n;
}

static __always_inline void fd_account(struct inflight *f, u32 tgid, u32 cls, u64 bytes, u64 lat, u32 slot,
                                       long ret) {
    struct fd_key k = {};
    k.tgid = tgid;
    k.fd = f->fd;
    k.gen = f->gen;
    k.epoch = f->epoch;
#if MOE_EXTENT > 0
    k.chunk = f->pos == NOPOS ? NOPOS : f->pos / MOE_EXTENT;
#else
    k.chunk = f->pos == NOPOS ? NOPOS : 0;
#endif
    struct fd_counts *c = 0;
    if (ret == EBADF_RET) {
        u32 one = 1;
        c = fd_overflow.lookup(&one);
        if (!c)
            return;
        __sync_fetch_and_add(&c->calls, 1);
        __sync_fetch_and_add(&c->requested_bytes, f->count);
        __sync_fetch_and_add(&c->error_calls, 1);
        __sync_fetch_and_add(&c->error_latency_ns, lat);
        return;
    }
    c = fds.lookup(&k);
    if (!c) {
        struct fd_counts zero = {};
        if (fds.insert(&k, &zero) == 0) {  // a new identity (or extent): tell user space now
            struct ident *r = idents.ringbuf_reserve(sizeof(struct ident));
            if (r) {
                r->tgid = tgid;
                r->fd = f->fd;
                r->gen = f->gen;
                r->epoch = f->epoch;
                idents.ringbuf_submit(r, 0);
            } else {
                stat_add(STAT_IDENT_DROPS, 1);
            }
        }
        c = fds.lookup(&k);
    }
    if (!c) {
        u32 z = 0;
        c = fd_overflow.lookup(&z);
        stat_add(STAT_FD_MAP_FULL, 1);
        if (!c)
            return;
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
    }
    struct hist_key hk = {};
    hk.tgid = tgid;
    hk.fd = f->fd;
    hk.gen = f->gen;
    hk.epoch = f->epoch;
    hk.cls = cls;
    hk.slot = slot;
    u64 *h = fd_hist.lookup(&hk);
    if (!h) {
        u64 zero = 0;
        fd_hist.insert(&hk, &zero);
        h = fd_hist.lookup(&hk);
    }
    if (h)
        __sync_fetch_and_add(h, 1);
    else
        stat_add(STAT_HIST_MAP_FULL, 1);
}

// One call exited: classify, aggregate, stream.
static __always_inline int leave(u32 sc, long ret) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 tid = (u32)id;
    struct inflight *f = inflight.lookup(&tid);
    if (!f) {
        if (followed(tgid))
            stat_add(STAT_EXIT_WITHOUT_ENTER, 1);
        return 0;
    }
    if (f->sc != sc) {  // an enter of another syscall was lost: drop it
        stat_add(STAT_EXIT_WITHOUT_ENTER, 1);
        inflight.delete(&tid);
        return 0;
    }
    u64 now = bpf_ktime_get_ns();
    u64 lat = now - f->start_ns;
    u32 cls = ret < 0 ? CLASS_ERROR : ((f->added + f->other) ? CLASS_MISS : CLASS_HIT_ONLY);
    u64 bytes = ret > 0 ? (u64)ret : 0;
    u32 slot = bpf_log2l(lat);
    if (slot >= HIST_SLOTS)
        slot = HIST_SLOTS - 1;
    struct class_counts *cc = classes.lookup(&cls);
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
    u64 *hv = hist.lookup(&hi);
    if (hv)
        *hv += 1;
    fd_account(f, tgid, cls, bytes, lat, slot, ret);
#if MOE_STREAM
    struct read_call *r = calls.ringbuf_reserve(sizeof(struct read_call));
    if (r) {
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
        calls.ringbuf_submit(r, 0);
    } else {
        stat_add(STAT_RING_DROPS, 1);
    }
#endif
    inflight.delete(&tid);
    return 0;
}

// A folio of npages added at page `index` of (ino, dev) by the current task.
static __always_inline int added(u64 ino, u64 index, u32 dev, u64 npages) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct inflight *f = inflight.lookup(&tid);
    if (!f) {
        u32 tgid = id >> 32;
        if (followed(tgid))
            stat_add(STAT_PAGES_ADDED_OUTSIDE_CALLS, npages);
        return 0;
    }
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
        u64 lo = f->pos >> MOE_PAGE_SHIFT;
        u64 hi = (f->pos + f->count + (1ULL << MOE_PAGE_SHIFT) - 1) >> MOE_PAGE_SHIFT;
        u64 a = index > lo ? index : lo;
        u64 b = index + npages < hi ? index + npages : hi;
        u64 inside = b > a ? b - a : 0;
        f->beyond += npages - inside;
    }
    return 0;
}

static __always_inline void bump_epoch(void) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!followed(tgid))
        return;
    stat_add(STAT_EPOCH_BUMPS, 1);
    u32 *e = epochs.lookup(&tgid);
    if (e) {
        __sync_fetch_and_add(e, 1);
        return;
    }
    u32 one = 1;
    epochs.update(&tgid, &one);
}

// ---------------------------------------------------------------------------
// programs (each reads only its own args->fields; helpers above take values)

TRACEPOINT_PROBE(syscalls, sys_enter_pread64) {
    return enter(SC_PREAD64, args->fd, (u64)args->pos, args->count);
}

TRACEPOINT_PROBE(syscalls, sys_exit_pread64) {
    return leave(SC_PREAD64, args->ret);
}

#if MOE_HAVE_PREADV
TRACEPOINT_PROBE(syscalls, sys_enter_preadv) {
    u64 vec = (u64)args->vec;
    u64 vlen = args->vlen;
    u64 pos = args->pos_l;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!followed(tgid))
        return 0;
    return enter(SC_PREADV, args->fd, pos, iov_bytes(vec, vlen));
}

TRACEPOINT_PROBE(syscalls, sys_exit_preadv) {
    return leave(SC_PREADV, args->ret);
}
#endif

#if MOE_HAVE_PREADV2
TRACEPOINT_PROBE(syscalls, sys_enter_preadv2) {
    u64 vec = (u64)args->vec;
    u64 vlen = args->vlen;
    u64 pos = args->pos_l;  // (u64)-1: the file position, like read()
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!followed(tgid))
        return 0;
    return enter(SC_PREADV2, args->fd, pos, iov_bytes(vec, vlen));
}

TRACEPOINT_PROBE(syscalls, sys_exit_preadv2) {
    return leave(SC_PREADV2, args->ret);
}
#endif

#if MOE_HAVE_READ
TRACEPOINT_PROBE(syscalls, sys_enter_read) {
    return enter(SC_READ, args->fd, NOPOS, args->count);
}

TRACEPOINT_PROBE(syscalls, sys_exit_read) {
    return leave(SC_READ, args->ret);
}
#endif

TRACEPOINT_PROBE(filemap, mm_filemap_add_to_page_cache) {
#if MOE_HAVE_ORDER
    u64 n = 1ULL << (args->order & 31);
#else
    u64 n = 1;
#endif
    return added(args->i_ino, args->index, args->s_dev, n);
}

#if MOE_TRACK_CLOSE
TRACEPOINT_PROBE(syscalls, sys_enter_close) {
    u32 fd = args->fd;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!followed(tgid))
        return 0;
    stat_add(STAT_CLOSES, 1);
    u64 gk = ((u64)tgid << 32) | fd;
    u32 *g = fdgen.lookup(&gk);
    if (g) {
        __sync_fetch_and_add(g, 1);
        return 0;
    }
    u32 one = 1;
    if (fdgen.update(&gk, &one))
        stat_add(STAT_FDGEN_FULL, 1);
    return 0;
}
#endif

#if MOE_TRACK_CLOSE_RANGE
TRACEPOINT_PROBE(syscalls, sys_enter_close_range) {
    bump_epoch();  // every fd of the process may have changed: a new epoch
    return 0;
}
#endif

#if MOE_TRACK_EXEC
TRACEPOINT_PROBE(sched, sched_process_exec) {
    bump_epoch();  // exec closed the O_CLOEXEC fds without close()
    return 0;
}
#endif

#if MOE_FOLLOW_FORKS
TRACEPOINT_PROBE(task, task_newtask) {
    if (args->clone_flags & CLONE_THREAD_FLAG)
        return 0;  // a thread shares its tgid
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    if (!followed(parent))
        return 0;
    u32 child = args->pid;
    u8 one = 1;
    if (tgids.update(&child, &one))
        stat_add(STAT_TGID_FULL, 1);
    return 0;
}
#endif
