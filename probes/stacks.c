// SPDX-License-Identifier: Apache-2.0
// stacks: perf cpu-clock sampling of the followed command's processes and of
// kswapd, with kernel and user stacks, counted in the kernel per
// (tgid, user stack id, kernel stack id, comm).
//
// Reads ONLY the perf sample's registers (through bpf_get_stackid and the
// current-task helpers) and tracepoint arguments (layout-safe with mismatched
// headers):
//   perf_event software:cpu-clock  one sample per MOE_SAMPLE_HZ period per CPU
//                                  (an hrtimer; no hardware PMU needed in a VM)
//   task:task_newtask              pid, clone_flags (follow forks)
//
// Which tasks are sampled: the tgids map. The recorder puts the command's pid
// there (value TASK_FOLLOWED) and the pids of the kswapd kernel threads, found in
// user space from /proc/*/comm (value TASK_KSWAPD); a followed process's new
// processes are added by task_newtask (threads share their tgid).
//
// Stack ids: bpf_get_stackid returns -EFAULT when a side has no frames (the
// kernel side of a sample taken in user mode; the user side of a kernel thread)
// and -EEXIST when a different stack already holds the hash bucket (the sample
// is still counted, its stack is lost). Both are counted per side in stats; the
// recorder symbolizes the stack ids in user space (kallsyms, ELF symbol tables),
// so no raw kernel address ever reaches the run directory.
//
// Configured only with -D knobs (declared in toolkit/record/probes/stacks.py STACKS, with
// the attach groups and stats slots; tests/*/test_probe_build.py checks both sides):
//   MOE_SAMPLE_HZ      samples per second per CPU; the recorder passes it to
//                      perf_event_open as sample_freq (cpu-clock turns it into a
//                      fixed period of 1e9 / MOE_SAMPLE_HZ ns)
//   MOE_STACK_ENTRIES  stack-trace map entries (distinct stacks, both sides)
//   MOE_MAX_KEYS       (tgid, user stack, kernel stack, comm) counters
//   MOE_MAX_TASKS      followed tgids + kswapd threads
//   MOE_FOLLOW_FORKS   1: a followed tgid's new processes are followed too
//   MOE_GATED          1: sample only while armed[0] = 1 (moetrace record arms all at once); 0: always

#include "moetrace.h"
// The perf-event program's context; never dereferenced (bpf_get_stackid takes it whole), so a
// declaration does: <uapi/linux/bpf_perf_event.h> cost 0.8 s of compile (1.04 -> 0.20 s).
struct bpf_perf_event_data;

#ifndef MOE_SAMPLE_HZ
#define MOE_SAMPLE_HZ 99
#endif
#ifndef MOE_STACK_ENTRIES
#define MOE_STACK_ENTRIES 16384
#endif
#ifndef MOE_MAX_KEYS
#define MOE_MAX_KEYS 16384
#endif
#ifndef MOE_MAX_TASKS
#define MOE_MAX_TASKS 4096
#endif
#ifndef MOE_FOLLOW_FORKS
#define MOE_FOLLOW_FORKS 1
#endif

#if MOE_SAMPLE_HZ <= 0
#error "MOE_SAMPLE_HZ must be positive"
#endif

#define CLONE_THREAD_FLAG 0x00010000UL
#define TASK_FOLLOWED 1
#define TASK_KSWAPD 2
#define COMM_LEN 16
#define E_FAULT 14
#define E_EXIST 17

// stats slots (toolkit/record/probes/stacks.py STACKS.stats names them, in order)
#define STAT_TICKS 0
#define STAT_IDLE_TICKS 1
#define STAT_SAMPLES 2
#define STAT_KSWAPD_SAMPLES 3
#define STAT_USER_STACK_EEXIST 4
#define STAT_USER_STACK_EFAULT 5
#define STAT_USER_STACK_OTHER_ERR 6
#define STAT_KERNEL_STACK_EEXIST 7
#define STAT_KERNEL_STACK_EFAULT 8
#define STAT_KERNEL_STACK_OTHER_ERR 9
#define STAT_KEYS_FULL 10
#define STAT_TASKS_FULL 11
#define N_STATS 12

struct stack_key {
    u32 tgid;
    s32 user_stack_id;    // < 0: -errno of bpf_get_stackid
    s32 kernel_stack_id;  // < 0: -errno of bpf_get_stackid
    char comm[COMM_LEN];
};

BPF_HASH(tgids, u32, u8, MOE_MAX_TASKS);
BPF_HASH(counts, struct stack_key, u64, MOE_MAX_KEYS);
BPF_STACK_TRACE(stack_traces, MOE_STACK_ENTRIES);
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

// one stack id's error into its side's slots (base: the side's EEXIST slot)
static __always_inline void stack_err(s32 id, u32 base) {
    if (id >= 0)
        return;
    if (id == -E_EXIST)
        stat_add(base, 1);
    else if (id == -E_FAULT)
        stat_add(base + 1, 1);
    else
        stat_add(base + 2, 1);
}

int on_cpu_clock(struct bpf_perf_event_data *ctx) {
    MOE_GATE();
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = (u32)id;
    u32 tgid = id >> 32;
    stat_add(STAT_TICKS, 1);
    if (pid == 0) {
        stat_add(STAT_IDLE_TICKS, 1);
        return 0;
    }
    u8 *who = tgids.lookup(&tgid);
    if (!who)
        return 0;
    struct stack_key key = {};
    key.tgid = tgid;
    key.user_stack_id = stack_traces.get_stackid(ctx, BPF_F_USER_STACK);
    key.kernel_stack_id = stack_traces.get_stackid(ctx, 0);
    bpf_get_current_comm(&key.comm, sizeof(key.comm));
    stack_err(key.user_stack_id, STAT_USER_STACK_EEXIST);
    stack_err(key.kernel_stack_id, STAT_KERNEL_STACK_EEXIST);
    stat_add(STAT_SAMPLES, 1);
    if (*who == TASK_KSWAPD)
        stat_add(STAT_KSWAPD_SAMPLES, 1);
    u64 zero = 0;
    u64 *c = counts.lookup_or_try_init(&key, &zero);
    if (c)
        __sync_fetch_and_add(c, 1);
    else
        stat_add(STAT_KEYS_FULL, 1);
    return 0;
}

#if MOE_FOLLOW_FORKS
// not gated: a process forked before arming is still followed
TRACEPOINT_PROBE(task, task_newtask) {
    if (args->clone_flags & CLONE_THREAD_FLAG)
        return 0;  // a thread shares its tgid
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    u8 *who = tgids.lookup(&parent);
    if (!who || *who != TASK_FOLLOWED)
        return 0;
    u32 child = args->pid;
    u8 one = TASK_FOLLOWED;
    if (tgids.update(&child, &one))
        stat_add(STAT_TASKS_FULL, 1);
    return 0;
}
#endif
