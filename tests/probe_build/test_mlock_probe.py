"""The mlock probe (probes/mlock.c + moetrace.record.probes.mlock) (probe-build tier)."""

from __future__ import annotations

from common.mlock_probe import *  # noqa: F401,F403


@pytest.mark.probe_build
def test_mlock_compiles_loads_and_detaches(live):
    from bcc import BPF

    from moetrace.kernel import bpf
    from moetrace.record.spec import resolve
    from moetrace.kernel.bpf import prog_id_exists, prog_info

    plan = resolve(SPEC, _features())
    assert plan.status != "no", plan.reason
    ids: list[int] = []
    # 1. what the recorder loads: the plan's knobs (kprobes compiled out here)
    knobs = SPEC.knob_values(**plan.knobs)
    p = bpf.load_probe("mlock", knobs)
    try:
        assert sorted(p.tracepoints) == sorted(e.candidate.target for e in plan.attached
                                               if e.candidate.kind == "tracepoint")
        assert len(p.table("stats")) == len(SPEC.stats)
        ids += [prog_info(f.fd)["id"] for f in p.bpf.funcs.values()]
    finally:
        p.close()
    # 2. every optional group off: only mlock / munlock enter and exit
    off = {k.name: 0 for k in SPEC.knobs if k.name.startswith(("MOE_HAVE_", "MOE_TRACK_", "MOE_FOLLOW_"))}
    p = bpf.load_probe("mlock", SPEC.knob_values(**off))
    try:
        assert sorted(p.tracepoints) == ["syscalls:sys_enter_mlock", "syscalls:sys_enter_munlock",
                                         "syscalls:sys_exit_mlock", "syscalls:sys_exit_munlock"]
        ids += [prog_info(f.fd)["id"] for f in p.bpf.funcs.values()]
    finally:
        p.close()
    # 3. the kprobe groups compiled in (the installed headers are the 6.1 lab kernel's own): each
    #    program passes this kernel's verifier; none can be attached here (no kprobes)
    #    PG_head from <linux/page-flags.h> (-1) or, as the recorder passes it, from BTF (16 on 6.1)
    for pg_head in (-1, 16):
        kp = {k.name: 1 for k in SPEC.knobs if k.name.startswith("MOE_KP_")}
        p = bpf.load_probe("mlock", SPEC.knob_values(**kp, MOE_PG_HEAD=pg_head))
        try:
            fns = [c.fn_name for g in SPEC.attach for c in g.candidates if c.kind == "kprobe"]
            assert len(fns) == 5
            for fn in fns:
                f = p.bpf.load_func(fn.encode(), BPF.KPROBE)
                ids.append(prog_info(f.fd)["id"])
        finally:
            p.close()
    assert ids and not any(prog_id_exists(i) for i in ids), "programs still loaded after close()"
