// SPDX-License-Identifier: Apache-2.0
// stacks: perf cpu-clock sampling of the followed command's processes and of kswapd, with
// kernel and user stacks, counted in the kernel per (tgid, user stack id, kernel stack id,
// comm). CO-RE (moetrace.bpf.h).
//
// Reads only the perf sample's registers (through bpf_get_stackid and the current-task
// helpers) and tracepoint arguments:
//   perf_event software:cpu-clock  one sample per 1e9 / moe_sample_hz ns per CPU (an hrtimer;
//                                  no hardware PMU needed in a VM). The recorder opens one
//                                  event per CPU itself (moetrace/kernel/perf.py) and attaches
//                                  this program to each (a libbpf perf link per event).
//   task:task_newtask              pid, clone_flags (follow forks)
//
// Which tasks are sampled: the tgids map. The recorder puts the command's pid there (value
// TASK_FOLLOWED) and the pids of the kswapd kernel threads, found in user space from
// /proc/*/comm (value TASK_KSWAPD); a followed process's new processes are added by
// task_newtask (threads share their tgid).
//
// Stack ids: bpf_get_stackid returns -EFAULT when a side has no frames (the kernel side of a
// sample taken in user mode; the user side of a kernel thread) and -EEXIST when a different
// stack already holds the hash bucket (the sample is still counted, its stack is lost). Both are
// counted per side in stats; the recorder symbolizes the stack ids in user space (kallsyms, ELF
// symbol tables), so no raw kernel address ever reaches the run directory.
//
// Knobs (read-only globals; declared with their meaning in moetrace/record/probes/stacks.py):
// moe_sample_hz (the perf events' sample_freq, set by the recorder when it opens them),
// moe_stack_entries / moe_max_keys / moe_max_tasks (map sizes, SPEC.map_sizes),
// moe_follow_forks (the newtask group: whether that program loads); globals for the record.
// gated: sample only while armed (moetrace record arms all at once); task_newtask is never gated.

#include "moetrace.bpf.h"

const volatile u32 moe_sample_hz = 99;
const volatile u32 moe_stack_entries = 16384;
const volatile u32 moe_max_keys = 16384;
const volatile u32 moe_max_tasks = 4096;
const volatile u32 moe_follow_forks = 1;

#define TASK_FOLLOWED 1
#define TASK_KSWAPD 2
#define COMM_LEN 16
#define E_FAULT 14
#define E_EXIST 17
#define MOE_STACK_DEPTH 127  // PERF_MAX_STACK_DEPTH: the frames of one stack-trace map value

// stats slots (moetrace/record/probes/stacks.py STACKS.stats names them, in order)
enum moe_stat {  // the `stats` map's slots, in the declaration's order (SPEC.stats)
    STAT_TICKS,
    STAT_IDLE_TICKS,
    STAT_SAMPLES,
    STAT_KSWAPD_SAMPLES,
    STAT_USER_STACK_EEXIST,
    STAT_USER_STACK_EFAULT,
    STAT_USER_STACK_OTHER_ERR,
    STAT_KERNEL_STACK_EEXIST,
    STAT_KERNEL_STACK_EFAULT,
    STAT_KERNEL_STACK_OTHER_ERR,
    STAT_KEYS_FULL,
    STAT_TASKS_FULL,
    N_STATS
};
MOE_STAT_BTF;

struct stack_key {
    u32 tgid;
    s32 user_stack_id;    // < 0: -errno of bpf_get_stackid
    s32 kernel_stack_id;  // < 0: -errno of bpf_get_stackid
    char comm[COMM_LEN];
};

MOE_HASH(tgids, u32, u8);                  // moe_max_tasks
MOE_HASH(counts, struct stack_key, u64);   // moe_max_keys
struct {                                   // moe_stack_entries stacks of MOE_STACK_DEPTH addresses
    __uint(type, BPF_MAP_TYPE_STACK_TRACE);
    __uint(max_entries, 1);
    __type(key, u32);
    __uint(value_size, MOE_STACK_DEPTH * sizeof(u64));
} stack_traces SEC(".maps");
MOE_ARRAY(stats, u64);                     // N_STATS

static __always_inline void stat_add(u32 slot, u64 v) { moe_add(&stats, slot, v); }

// one stack id's error into its side's slots (base: the side's EEXIST slot)
static __always_inline void stack_err(s32 id, u32 base)
{
    if (id >= 0)
        return;
    if (id == -E_EXIST)
        stat_add(base, 1);
    else if (id == -E_FAULT)
        stat_add(base + 1, 1);
    else
        stat_add(base + 2, 1);
}

SEC("perf_event")
int pe_cpu_clock(struct bpf_perf_event_data *ctx)
{
    MOE_GATE();
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = (u32)id;
    u32 tgid = id >> 32;
    stat_add(STAT_TICKS, 1);
    if (pid == 0) {
        stat_add(STAT_IDLE_TICKS, 1);
        return 0;
    }
    u8 *who = bpf_map_lookup_elem(&tgids, &tgid);
    if (!who)
        return 0;
    struct stack_key key = {};
    key.tgid = tgid;
    key.user_stack_id = bpf_get_stackid(ctx, &stack_traces, BPF_F_USER_STACK);
    key.kernel_stack_id = bpf_get_stackid(ctx, &stack_traces, 0);
    bpf_get_current_comm(&key.comm, sizeof(key.comm));
    stack_err(key.user_stack_id, STAT_USER_STACK_EEXIST);
    stack_err(key.kernel_stack_id, STAT_KERNEL_STACK_EEXIST);
    stat_add(STAT_SAMPLES, 1);
    if (*who == TASK_KSWAPD)
        stat_add(STAT_KSWAPD_SAMPLES, 1);
    u64 *c = bpf_map_lookup_elem(&counts, &key);
    if (!c) {
        u64 zero = 0;
        bpf_map_update_elem(&counts, &key, &zero, BPF_NOEXIST);
        c = bpf_map_lookup_elem(&counts, &key);
    }
    if (c)
        __sync_fetch_and_add(c, 1);
    else
        stat_add(STAT_KEYS_FULL, 1);
    return 0;
}

// not gated: a process forked before arming is still followed
SEC("tracepoint/task/task_newtask")
int tp_task_newtask(struct trace_event_raw_task_newtask *ctx)
{
    u32 parent, child;
    if (!moe_new_process(ctx, &parent, &child))
        return 0;
    u8 *who = bpf_map_lookup_elem(&tgids, &parent);
    if (!who || *who != TASK_FOLLOWED)
        return 0;
    u8 one = TASK_FOLLOWED;
    if (bpf_map_update_elem(&tgids, &child, &one, BPF_ANY))
        stat_add(STAT_TASKS_FULL, 1);
    return 0;
}
