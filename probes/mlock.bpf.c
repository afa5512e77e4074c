// SPDX-License-Identifier: Apache-2.0
// mlock: every mlock-family call of the followed processes, one ring record per
// call (enter -> exit on the same thread), so user space can rebuild each
// process's locked ranges exactly (moetrace/record/probes/mlock.py: an interval set per tgid,
// page-rounded as the kernel rounds, overlaps not counted twice). CO-RE (moetrace.bpf.h).
//
// Syscall tracepoint arguments (struct trace_event_raw_sys_enter args[], sys_exit ret):
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
//   sched:sched_process_exit                 group_dead where the kernel has it (6.16+, its own
//                                            event class; bpf_core_field_exists decides; else
//                                            the leader's exit ends the group)
//   sched:sched_process_exec                 (none): execve gives the process a new mm
// munmap / mmap / mremap matter because they change VmLck without an mlock call
// (unmapping a locked range, MAP_LOCKED, moving or growing a locked mapping), and so do
// exit and execve (the mm and its locks go); they are recorded only for a tgid that has
// locked something, so their volume stays small. A group's exit also forgets its tgid
// (pids are reused).
//
// Optional function hooks, per folio of the followed tgids, counted in stats slots (a large
// folio, PG_head set in folio->flags, counted apart): mlock_folio, mlock_new_folio |
// mlock_new_page (6.1), munlock_folio | munlock_page (6.1). Each is an fentry program where the
// kernel allows BPF trampolines (no kprobe machinery, a direct call), else a kprobe: the attach
// plan chooses per hook by asking the kernel. folio->flags is the first word of
// struct folio and struct page on every kernel; PG_head's bit is the running kernel's own
// (bpf_core_enum_value of enum pageflags: 6 on 6.12 and 6.18, 16 on 6.1).
//
// Knobs (read-only globals; moetrace/record/probes/mlock.py declares them): moe_exit_group_dead
// (the plan's reading of the exit format; the C also asks BTF), moe_pg_head (>= 0 overrides the
// kernel's PG_head). The other knobs choose which programs load (the attach groups) or size maps.

#include "moetrace.bpf.h"

const volatile u32 moe_have_mlock2 = 1;
const volatile u32 moe_have_mlockall = 1;
const volatile u32 moe_track_munmap = 1;
const volatile u32 moe_track_mmap = 1;
const volatile u32 moe_track_mremap = 1;
const volatile u32 moe_follow_forks = 1;
const volatile u32 moe_track_exit = 1;
const volatile u32 moe_exit_group_dead = 1;
const volatile u32 moe_track_exec = 1;
const volatile u32 moe_kp_mlock_folio = 0;
const volatile u32 moe_kp_mlock_new = 0;
const volatile u32 moe_kp_munlock = 0;
const volatile s32 moe_pg_head = -1;
const volatile u32 moe_max_tasks = 4096;
const volatile u32 moe_max_tgids = 1024;
const volatile u32 moe_ringbuf_pages = 16;

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
enum moe_stat {  // the `stats` map's slots, in the declaration's order (SPEC.stats)
    STAT_CALLS,                 // ring records submitted
    STAT_RING_LOST,             // records the ring had no room for (lost calls)
    STAT_PENDING_FULL,          // enter not stored (tid map full): the call is lost
    STAT_UNMATCHED_EXITS,       // mlock-family exit of a followed tgid with no stored enter
    STAT_TGID_MAP_FULL,         // a child process not followed (tgids map full)
    STAT_KP_MLOCK_FOLIO,        // mlock_folio events of followed tgids
    STAT_KP_MLOCK_NEW,          // mlock_new_folio / mlock_new_page events
    STAT_KP_MUNLOCK,            // munlock_folio / munlock_page events
    STAT_KP_LARGE,              // ... of those, large folios (PG_head)
    N_STATS
};
MOE_STAT_BTF;

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


MOE_HASH(pending_calls, u32, struct pending);
MOE_HASH(tgids, u32, u8);
MOE_ARRAY(stats, u64);
MOE_RINGBUF(events);

// Keep the ring record in the object's BTF (the declaration test reads it there).
struct mlock_event _mlock_event = {};

static __always_inline void stat_add(u32 slot, u64 v) { moe_add(&stats, slot, v); }

// 0: not followed, else the tgids value (TG_* bits)
static __always_inline u8 followed(u32 tgid)
{
    u8 *v = bpf_map_lookup_elem(&tgids, &tgid);
    return v ? *v : 0;
}

static __always_inline int enter(u32 call, u64 start, u64 len, u64 len2, u64 flags, int need_locked)
{
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
    if (bpf_map_update_elem(&pending_calls, &tid, &p, BPF_ANY))
        stat_add(STAT_PENDING_FULL, 1);
    return 0;
}

static __always_inline int is_error(s64 ret) { return ret < 0 && ret >= -4095; }

// filtered: the enter side may have skipped the call on purpose (munmap / mmap / mremap
// that cannot touch a locked range), so a missing enter is not counted as unmatched
static __always_inline int leave(s64 ret, int filtered)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 tid = (u32)id;
    struct pending *p = bpf_map_lookup_elem(&pending_calls, &tid);
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
        bpf_map_update_elem(&tgids, &tgid, &v, BPF_ANY);
    }
    struct mlock_event *e = bpf_ringbuf_reserve(&events, sizeof(struct mlock_event), 0);
    if (!e) {
        stat_add(STAT_RING_LOST, 1);
        bpf_map_delete_elem(&pending_calls, &tid);
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
    bpf_ringbuf_submit(e, 0);
    stat_add(STAT_CALLS, 1);
    bpf_map_delete_elem(&pending_calls, &tid);
    return 0;
}

// an event with no enter/exit pair (exit, exec)
static __always_inline void emit_now(u32 call, u32 tgid, u32 tid)
{
    struct mlock_event *e = bpf_ringbuf_reserve(&events, sizeof(struct mlock_event), 0);
    if (!e) {
        stat_add(STAT_RING_LOST, 1);
        return;
    }
    __builtin_memset(e, 0, sizeof(*e));
    e->ts_ns = bpf_ktime_get_ns();
    e->tgid = tgid;
    e->tid = tid;
    e->call = call;
    bpf_ringbuf_submit(e, 0);
    stat_add(STAT_CALLS, 1);
}

static __always_inline int mmap_enter(u64 len, u64 flags)
{
    if (flags & MOE_MAP_LOCKED)
        return enter(CALL_MMAP, 0, len, 0, flags, 0);
    if (flags & MOE_MAP_FIXED)  // may replace a locked range
        return enter(CALL_MMAP, 0, len, 0, flags, 1);
    return 0;
}

// A folio event of a function hook: counted for the followed tgids, large folios apart.
static __always_inline int fn_count(u32 slot, void *folio)
{
    MOE_GATE();  // the first statement of every function-hook program
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!followed(tgid))
        return 0;
    stat_add(slot, 1);
    unsigned long flags = 0;
    bpf_probe_read_kernel(&flags, sizeof(flags), folio);
    s32 bit = moe_pg_head >= 0 ? moe_pg_head : (s32)bpf_core_enum_value(enum pageflags, PG_head);
    if (flags & (1UL << (bit & 63)))
        stat_add(STAT_KP_LARGE, 1);
    return 0;
}

// -- programs (each body reads only its own tracepoint's arguments) ----------------
// Tracepoints never gated: locked ranges are rebuilt from every call; one dropped unarmed corrupts them.

#define ENTER(sc, expr) \
    SEC("tracepoint/syscalls/sys_enter_" #sc) \
    int tp_sys_enter_##sc(struct trace_event_raw_sys_enter *ctx) { return expr; }
#define EXIT(sc, filtered) \
    SEC("tracepoint/syscalls/sys_exit_" #sc) \
    int tp_sys_exit_##sc(struct trace_event_raw_sys_exit *ctx) { return leave(ctx->ret, filtered); }

ENTER(mlock, enter(CALL_MLOCK, ctx->args[0], ctx->args[1], 0, 0, 0))
EXIT(mlock, 0)
ENTER(munlock, enter(CALL_MUNLOCK, ctx->args[0], ctx->args[1], 0, 0, 0))
EXIT(munlock, 0)
ENTER(mlock2, enter(CALL_MLOCK2, ctx->args[0], ctx->args[1], 0, ctx->args[2], 0))
EXIT(mlock2, 0)
ENTER(mlockall, enter(CALL_MLOCKALL, 0, 0, 0, ctx->args[0], 0))
EXIT(mlockall, 0)
ENTER(munlockall, enter(CALL_MUNLOCKALL, 0, 0, 0, 0, 0))
EXIT(munlockall, 0)
ENTER(munmap, enter(CALL_MUNMAP, ctx->args[0], ctx->args[1], 0, 0, 1))
EXIT(munmap, 1)
ENTER(mmap, mmap_enter(ctx->args[1], ctx->args[3]))  // mmap(addr, len, prot, flags, fd, off)
EXIT(mmap, 1)
ENTER(mremap, enter(CALL_MREMAP, ctx->args[0], ctx->args[1], ctx->args[2], ctx->args[3], 1))
EXIT(mremap, 1)

SEC("tracepoint/task/task_newtask")
int tp_task_newtask(struct trace_event_raw_task_newtask *ctx)
{
    u32 parent, child;
    u8 v = TG_FOLLOWED;  // a child's mm starts with nothing locked (VM_LOCKED is not inherited)
    if (!moe_new_process(ctx, &parent, &child) || !followed(parent))
        return 0;
    if (bpf_map_update_elem(&tgids, &child, &v, BPF_ANY))
        stat_add(STAT_TGID_MAP_FULL, 1);
    return 0;
}

SEC("tracepoint/sched/sched_process_exit")
int tp_sched_process_exit(struct trace_event_raw_sched_process_exit *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u8 tg = followed(tgid);
    if (!tg)
        return 0;
    if (moe_exit_group_dead && bpf_core_field_exists(ctx->group_dead)) {
        if (!ctx->group_dead)
            return 0;  // another thread of the group is still alive
    } else if ((u32)id != tgid) {
        return 0;  // no group_dead in this kernel: the leader's exit stands for the group's
    }
    if (tg & TG_LOCKED)
        emit_now(CALL_EXIT, tgid, (u32)id);
    bpf_map_delete_elem(&tgids, &tgid);
    return 0;
}

SEC("tracepoint/sched/sched_process_exec")
int tp_sched_process_exec(void *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!(followed(tgid) & TG_LOCKED))
        return 0;
    emit_now(CALL_EXEC, tgid, (u32)id);
    u8 v = TG_FOLLOWED;  // a new mm: nothing locked
    bpf_map_update_elem(&tgids, &tgid, &v, BPF_ANY);
    return 0;
}

// -- function hooks: fentry where the kernel allows trampolines, else kprobes -------------------
// One pair per kernel function name (6.1 names the new-folio and munlock hooks after pages); the
// attach plan loads at most one program of each hook.

#define FN_HOOK(fn, slot) \
    SEC("fentry/" #fn) int BPF_PROG(fe_##fn, void *folio) { return fn_count(slot, folio); } \
    SEC("kprobe/" #fn) int BPF_KPROBE(kp_##fn, void *folio) { return fn_count(slot, folio); }
FN_HOOK(mlock_folio, STAT_KP_MLOCK_FOLIO)
FN_HOOK(mlock_new_folio, STAT_KP_MLOCK_NEW)
FN_HOOK(mlock_new_page, STAT_KP_MLOCK_NEW)
FN_HOOK(munlock_folio, STAT_KP_MUNLOCK)
FN_HOOK(munlock_page, STAT_KP_MUNLOCK)
