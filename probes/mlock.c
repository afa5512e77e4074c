// SPDX-License-Identifier: Apache-2.0
// mlock: every mlock-family call of the followed processes, one ring record per
// call (enter -> exit on the same thread), so user space can rebuild each
// process's locked ranges exactly (toolkit/record/probes/mlock.py: an interval set per tgid,
// page-rounded as the kernel rounds, overlaps not counted twice).
//
// Reads ONLY syscall tracepoint arguments (layout-safe with mismatched headers):
//   syscalls:sys_enter_mlock / munlock       start, len
//   syscalls:sys_enter_mlock2                start, len, flags (MLOCK_ONFAULT)
//   syscalls:sys_enter_mlockall              flags (MCL_CURRENT / MCL_FUTURE / MCL_ONFAULT)
//   syscalls:sys_enter_munlockall            (none)
//   syscalls:sys_enter_munmap                addr, len        (tgids that locked only)
//   syscalls:sys_enter_mmap                  len, flags       (MAP_LOCKED, or MAP_FIXED in
//                                                              a tgid that locked)
//   syscalls:sys_enter_mremap                addr, old_len, new_len, flags (tgids that locked)
//   syscalls:sys_exit_*                      ret
//   task:task_newtask                        pid, clone_flags (follow the command's children)
//   sched:sched_process_exit                 group_dead where the format has it (6.16+; else
//                                            the leader's exit ends the group)
//   sched:sched_process_exec                 (none): execve gives the process a new mm
// munmap / mmap / mremap matter because they change VmLck without an mlock call
// (unmapping a locked range, MAP_LOCKED, moving or growing a locked mapping), and so do
// exit and execve (the mm and its locks go); they are recorded only for a tgid that has
// locked something, so their volume stays small. A group's exit also forgets its tgid
// (pids are reused).
//
// Optional exact-headers kprobes (compiled only where kprobes exist and the headers
// match the kernel, i.e. in the lab): mlock_folio, mlock_new_folio | mlock_new_page,
// munlock_folio | munlock_page — per-folio events of the followed tgids, counted in
// stats slots (a large folio, PG_head set in folio->flags, counted apart).
//
// Configured only with -D knobs (toolkit/record/probes/mlock.py MLOCK declares them with the
// attach groups, stats slots and the ring struct; tests/*/test_probe_build.py checks
// that both sides agree):
//   MOE_HAVE_MLOCK2       1: compile mlock2 enter/exit
//   MOE_HAVE_MLOCKALL     1: compile mlockall/munlockall enter/exit
//   MOE_TRACK_MUNMAP      1: compile munmap enter/exit
//   MOE_TRACK_MMAP        1: compile mmap enter/exit
//   MOE_TRACK_MREMAP      1: compile mremap enter/exit
//   MOE_FOLLOW_FORKS      1: a followed tgid's new processes are followed too
//   MOE_TRACK_EXIT        1: compile sched_process_exit (a group's end)
//   MOE_EXIT_GROUP_DEAD   1: its format has group_dead (set from the format file)
//   MOE_TRACK_EXEC        1: compile sched_process_exec (a new mm)
//   MOE_KP_MLOCK_FOLIO    1: compile the mlock_folio kprobe (exact headers)
//   MOE_KP_MLOCK_NEW      1: compile the mlock_new_folio / mlock_new_page kprobe
//   MOE_KP_MUNLOCK        1: compile the munlock_folio / munlock_page kprobe
//   MOE_PG_HEAD           PG_head's bit (from the kernel's BTF); -1: from <linux/page-flags.h>
//   MOE_MAX_TASKS         tid -> call in flight entries
//   MOE_MAX_TGIDS         followed tgids
//   MOE_RINGBUF_PAGES     ring buffer size in pages (power of two)
//   MOE_GATED             1: the kprobe counters count only while armed[0] = 1; 0: always
//                         (the call records are never gated: see the programs below)

#include "moetrace.h"

#ifndef MOE_HAVE_MLOCK2
#define MOE_HAVE_MLOCK2 1
#endif
#ifndef MOE_HAVE_MLOCKALL
#define MOE_HAVE_MLOCKALL 1
#endif
#ifndef MOE_TRACK_MUNMAP
#define MOE_TRACK_MUNMAP 1
#endif
#ifndef MOE_TRACK_MMAP
#define MOE_TRACK_MMAP 1
#endif
#ifndef MOE_TRACK_MREMAP
#define MOE_TRACK_MREMAP 1
#endif
#ifndef MOE_FOLLOW_FORKS
#define MOE_FOLLOW_FORKS 1
#endif
#ifndef MOE_TRACK_EXIT
#define MOE_TRACK_EXIT 1
#endif
#ifndef MOE_EXIT_GROUP_DEAD
#define MOE_EXIT_GROUP_DEAD 1
#endif
#ifndef MOE_TRACK_EXEC
#define MOE_TRACK_EXEC 1
#endif
#ifndef MOE_KP_MLOCK_FOLIO
#define MOE_KP_MLOCK_FOLIO 0
#endif
#ifndef MOE_KP_MLOCK_NEW
#define MOE_KP_MLOCK_NEW 0
#endif
#ifndef MOE_KP_MUNLOCK
#define MOE_KP_MUNLOCK 0
#endif
#ifndef MOE_PG_HEAD
#define MOE_PG_HEAD -1
#endif
#ifndef MOE_MAX_TASKS
#define MOE_MAX_TASKS 4096
#endif
#ifndef MOE_MAX_TGIDS
#define MOE_MAX_TGIDS 1024
#endif
#ifndef MOE_RINGBUF_PAGES
#define MOE_RINGBUF_PAGES 16
#endif

#define CLONE_THREAD_FLAG 0x00010000UL
// asm-generic/mman*.h values (x86-64 and arm64 use them)
#define MOE_MAP_FIXED 0x10UL
#define MOE_MAP_LOCKED 0x2000UL

// call codes (toolkit/record/probes/mlock.py CALLS names them in this order)
#define CALL_MLOCK 0
#define CALL_MLOCK2 1
#define CALL_MUNLOCK 2
#define CALL_MLOCKALL 3
#define CALL_MUNLOCKALL 4
#define CALL_MUNMAP 5
#define CALL_MMAP 6
#define CALL_MREMAP 7
#define CALL_EXIT 8    // not a call: the process (thread group) ended
#define CALL_EXEC 9    // not a call: execve replaced its mm

// tgids map values: bit 0 followed, bit 1 has locked something (munmap/mmap/mremap
// are recorded only then)
#define TG_FOLLOWED 1
#define TG_LOCKED 2

// stats slots (toolkit/record/probes/mlock.py MLOCK.stats names them, in order)
#define STAT_CALLS 0            // ring records submitted
#define STAT_RING_LOST 1        // records the ring had no room for (lost calls)
#define STAT_PENDING_FULL 2     // enter not stored (tid map full): the call is lost
#define STAT_UNMATCHED_EXITS 3  // mlock-family exit of a followed tgid with no stored enter
#define STAT_TGID_MAP_FULL 4    // a child process not followed (tgids map full)
#define STAT_KP_MLOCK_FOLIO 5   // mlock_folio events of followed tgids
#define STAT_KP_MLOCK_NEW 6     // mlock_new_folio / mlock_new_page events
#define STAT_KP_MUNLOCK 7       // munlock_folio / munlock_page events
#define STAT_KP_LARGE 8         // ... of those, large folios (PG_head)
#define N_STATS 9

struct pending {
    u64 ts_ns;
    u64 start;
    u64 len;
    u64 len2;
    u32 call;
    u32 flags;
};

struct mlock_event {
    u64 ts_ns;       // bpf_ktime_get_ns (CLOCK_MONOTONIC) at the call's exit
    u32 tgid;
    u32 tid;
    u32 call;        // CALL_*
    u32 flags;       // mlock2 / mlockall / mmap / mremap flags (low 32 bits)
    u64 start;       // start (mlock family), addr (munmap, mmap hint, mremap old address)
    u64 len;         // len (mremap: old_len)
    u64 len2;        // mremap: new_len; 0 otherwise
    s64 ret;         // the syscall's return value (mmap / mremap: the mapping's address)
    u64 latency_ns;  // enter -> exit
};

BPF_HASH(pending_calls, u32, struct pending, MOE_MAX_TASKS);
BPF_HASH(tgids, u32, u8, MOE_MAX_TGIDS);
BPF_ARRAY(stats, u64, N_STATS);
BPF_RINGBUF_OUTPUT(events, MOE_RINGBUF_PAGES);
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

// 0: not followed, else the tgids value (TG_* bits)
static __always_inline u8 followed(u32 tgid) {
    u8 *v = tgids.lookup(&tgid);
    return v ? *v : 0;
}

static __always_inline int enter(u32 call, u64 start, u64 len, u64 len2, u64 flags, int need_locked) {
    u64 id = bpf_get_current_pid_tgid();
    u8 tg = followed(id >> 32);
    if (!tg)
        return 0;
    if (need_locked && !(tg & TG_LOCKED))
        return 0;
    struct pending p = {};
    p.ts_ns = bpf_ktime_get_ns();
    p.start = start;
    p.len = len;
    p.len2 = len2;
    p.call = call;
    p.flags = (u32)flags;
    u32 tid = (u32)id;
    if (pending_calls.update(&tid, &p))
        stat_add(STAT_PENDING_FULL, 1);
    return 0;
}

static __always_inline int is_error(s64 ret) {
    return ret < 0 && ret >= -4095;
}

// filtered: the enter side may have skipped the call on purpose (munmap / mmap / mremap
// that cannot touch a locked range), so a missing enter is not counted as unmatched
static __always_inline int leave(s64 ret, int filtered) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 tid = (u32)id;
    struct pending *p = pending_calls.lookup(&tid);
    if (!p) {
        if (!filtered && followed(tgid))
            stat_add(STAT_UNMATCHED_EXITS, 1);
        return 0;
    }
    u64 now = bpf_ktime_get_ns();
    u32 call = p->call;
    if (!is_error(ret) && (call == CALL_MLOCK || call == CALL_MLOCK2 || call == CALL_MLOCKALL ||
                           (call == CALL_MMAP && (p->flags & MOE_MAP_LOCKED)))) {
        u8 v = TG_FOLLOWED | TG_LOCKED;
        tgids.update(&tgid, &v);
    }
    struct mlock_event *e = events.ringbuf_reserve(sizeof(struct mlock_event));
    if (!e) {
        stat_add(STAT_RING_LOST, 1);
        pending_calls.delete(&tid);
        return 0;
    }
    e->ts_ns = now;
    e->tgid = tgid;
    e->tid = tid;
    e->call = call;
    e->flags = p->flags;
    e->start = p->start;
    e->len = p->len;
    e->len2 = p->len2;
    e->ret = ret;
    e->latency_ns = now - p->ts_ns;
    events.ringbuf_submit(e, 0);
    stat_add(STAT_CALLS, 1);
    pending_calls.delete(&tid);
    return 0;
}

// an event with no enter/exit pair (exit, exec)
static __always_inline void emit_now(u32 call, u32 tgid, u32 tid) {
    struct mlock_event *e = events.ringbuf_reserve(sizeof(struct mlock_event));
    if (!e) {
        stat_add(STAT_RING_LOST, 1);
        return;
    }
    __builtin_memset(e, 0, sizeof(*e));
    e->ts_ns = bpf_ktime_get_ns();
    e->tgid = tgid;
    e->tid = tid;
    e->call = call;
    events.ringbuf_submit(e, 0);
    stat_add(STAT_CALLS, 1);
}

static __always_inline int mmap_enter(u64 len, u64 flags) {
    if (flags & MOE_MAP_LOCKED)
        return enter(CALL_MMAP, 0, len, 0, flags, 0);
    if (flags & MOE_MAP_FIXED)  // may replace a locked range
        return enter(CALL_MMAP, 0, len, 0, flags, 1);
    return 0;
}

#if MOE_KP_MLOCK_FOLIO || MOE_KP_MLOCK_NEW || MOE_KP_MUNLOCK
#include <uapi/linux/ptrace.h>  // struct pt_regs for PT_REGS_PARM*
#if MOE_PG_HEAD < 0
#include <linux/page-flags.h>  // PG_head from the exact headers (a heavy include: ~2x the compile)
#define MOE_PG_HEAD_BIT PG_head
#else
#define MOE_PG_HEAD_BIT MOE_PG_HEAD  // PG_head read from the running kernel's BTF (enum pageflags)
#endif

// folio->flags is the first word of struct folio / struct page on every kernel
static __always_inline int kp_count(u32 slot, void *folio) {
    MOE_GATE();  // the first statement of every kprobe program
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!followed(tgid))
        return 0;
    stat_add(slot, 1);
    unsigned long flags = 0;
    bpf_probe_read_kernel(&flags, sizeof(flags), folio);
    if (flags & (1UL << MOE_PG_HEAD_BIT))
        stat_add(STAT_KP_LARGE, 1);
    return 0;
}
#endif

// -- programs (each body reads only its own tracepoint's arguments) ----------------
// Tracepoints never gated: locked ranges are rebuilt from every call; one dropped unarmed corrupts them.

TRACEPOINT_PROBE(syscalls, sys_enter_mlock) { return enter(CALL_MLOCK, args->start, args->len, 0, 0, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_mlock) { return leave(args->ret, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_munlock) { return enter(CALL_MUNLOCK, args->start, args->len, 0, 0, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_munlock) { return leave(args->ret, 0); }

#if MOE_HAVE_MLOCK2
TRACEPOINT_PROBE(syscalls, sys_enter_mlock2) {
    return enter(CALL_MLOCK2, args->start, args->len, 0, args->flags, 0);
}
TRACEPOINT_PROBE(syscalls, sys_exit_mlock2) { return leave(args->ret, 0); }
#endif

#if MOE_HAVE_MLOCKALL
TRACEPOINT_PROBE(syscalls, sys_enter_mlockall) { return enter(CALL_MLOCKALL, 0, 0, 0, args->flags, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_mlockall) { return leave(args->ret, 0); }
TRACEPOINT_PROBE(syscalls, sys_enter_munlockall) { return enter(CALL_MUNLOCKALL, 0, 0, 0, 0, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_munlockall) { return leave(args->ret, 0); }
#endif

#if MOE_TRACK_MUNMAP
TRACEPOINT_PROBE(syscalls, sys_enter_munmap) { return enter(CALL_MUNMAP, args->addr, args->len, 0, 0, 1); }
TRACEPOINT_PROBE(syscalls, sys_exit_munmap) { return leave(args->ret, 1); }
#endif

#if MOE_TRACK_MMAP
TRACEPOINT_PROBE(syscalls, sys_enter_mmap) { return mmap_enter(args->len, args->flags); }
TRACEPOINT_PROBE(syscalls, sys_exit_mmap) { return leave(args->ret, 1); }
#endif

#if MOE_TRACK_MREMAP
TRACEPOINT_PROBE(syscalls, sys_enter_mremap) {
    return enter(CALL_MREMAP, args->addr, args->old_len, args->new_len, args->flags, 1);
}
TRACEPOINT_PROBE(syscalls, sys_exit_mremap) { return leave(args->ret, 1); }
#endif

#if MOE_FOLLOW_FORKS
TRACEPOINT_PROBE(task, task_newtask) {
    if (args->clone_flags & CLONE_THREAD_FLAG)
        return 0;  // a thread shares its tgid (and its mm)
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    if (!followed(parent))
        return 0;
    u32 child = args->pid;
    u8 v = TG_FOLLOWED;  // a child's mm starts with nothing locked (VM_LOCKED is not inherited)
    if (tgids.update(&child, &v))
        stat_add(STAT_TGID_MAP_FULL, 1);
    return 0;
}
#endif

#if MOE_TRACK_EXIT
TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u8 tg = followed(tgid);
    if (!tg)
        return 0;
#if MOE_EXIT_GROUP_DEAD
    if (!args->group_dead)
        return 0;  // another thread of the group is still alive
#else
    if ((u32)id != tgid)
        return 0;  // no group_dead in this format: the leader's exit stands for the group's
#endif
    if (tg & TG_LOCKED)
        emit_now(CALL_EXIT, tgid, (u32)id);
    tgids.delete(&tgid);
    return 0;
}
#endif

#if MOE_TRACK_EXEC
TRACEPOINT_PROBE(sched, sched_process_exec) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!(followed(tgid) & TG_LOCKED))
        return 0;
    emit_now(CALL_EXEC, tgid, (u32)id);
    u8 v = TG_FOLLOWED;  // a new mm: nothing locked
    tgids.update(&tgid, &v);
    return 0;
}
#endif

#if MOE_KP_MLOCK_FOLIO
int kp_mlock_folio(struct pt_regs *ctx) { return kp_count(STAT_KP_MLOCK_FOLIO, (void *)PT_REGS_PARM1(ctx)); }
#endif

#if MOE_KP_MLOCK_NEW
int kp_mlock_new_folio(struct pt_regs *ctx) { return kp_count(STAT_KP_MLOCK_NEW, (void *)PT_REGS_PARM1(ctx)); }
int kp_mlock_new_page(struct pt_regs *ctx) { return kp_count(STAT_KP_MLOCK_NEW, (void *)PT_REGS_PARM1(ctx)); }
#endif

#if MOE_KP_MUNLOCK
int kp_munlock_folio(struct pt_regs *ctx) { return kp_count(STAT_KP_MUNLOCK, (void *)PT_REGS_PARM1(ctx)); }
int kp_munlock_page(struct pt_regs *ctx) { return kp_count(STAT_KP_MUNLOCK, (void *)PT_REGS_PARM1(ctx)); }
#endif
