"""The stacks probe (probes/stacks.bpf.c + toolkit/record/probes/stacks.py +
toolkit/kernel/symbolize.py) (probe-build tier)."""

from __future__ import annotations

import time

import numpy as np

from common.backends import *  # noqa: F401,F403
from common.stacks_probe import *  # noqa: F401,F403


@pytest.mark.probe_build
@pytest.mark.parametrize("knobs", [{}, {"MOE_FOLLOW_FORKS": 0, "MOE_SAMPLE_HZ": 49, "MOE_STACK_ENTRIES": 1024}],
                         ids=["recorder-defaults", "no-forks-small"])
def test_stacks_loads_attaches_and_detaches(live, knobs):
    """The recorder's open : one cpu-clock perf event per online CPU with the
    program attached, the kswapd threads in the task map; close() leaves no program and no perf
    event behind (libbpf's perf links own their events and close them)."""
    from moetrace.kernel.bpf import prog_id_exists
    from moetrace.kernel.perf import online_cpus

    before = _perf_fds()
    rec = stacksrec.StacksRecorder(_ctx(), knobs=knobs)
    rec.open()
    try:
        assert rec.knobs == SPEC.knob_values(**knobs)
        assert ("task:task_newtask" in rec.probe.tracepoints) == bool(rec.knobs["MOE_FOLLOW_FORKS"])
        tps = len(rec.probe.tracepoints)  # a tracepoint is attached through a perf event too
        assert _perf_fds() - before == len(online_cpus()) + tps  # one cpu-clock event per CPU
        pids, who = rec.probe.items("tgids", np.uint32, np.uint8)
        k = stacksrec.find_kswapd()
        assert k and sorted(int(x) for x in pids) == k  # kswapd threads, read only
        assert (who == stacksrec.TASK_KSWAPD).all()
        assert len(rec.probe.table("stats")) == len(SPEC.stats)
        ids = rec.prog_ids()
        assert ids and all(prog_id_exists(i) for i in ids)
    finally:
        rec.close()
        rec.abort()
    assert rec.collected and rec.df is not None
    assert not any(prog_id_exists(i) for i in ids), "programs still loaded after close()"
    assert _perf_fds() == before, "perf events still open after close()"


@pytest.mark.probe_build
def test_samples_of_a_busy_loop_are_counted_and_symbolized(live):
    """This very process, followed and spinning for 0.3 s at 499 Hz: samples counted under its
    tgid, with user frames symbolized (the recorder's whole close path)."""
    ctx = _ctx()
    ctx.gated = True  # as moetrace record runs it: counting stops before the maps are read
    rec = stacksrec.StacksRecorder(ctx, knobs={"MOE_SAMPLE_HZ": 499}, kswapd=False)
    rec.open()
    try:
        rec.follow(os.getpid())
        rec.arm(True)
        t_end = time.monotonic() + 0.3
        while time.monotonic() < t_end:
            pass
        rec.arm(False)
        rec.close()
    finally:
        rec.abort()
    st, df = rec.stats, rec.df
    mine = df[df["tgid"] == os.getpid()]
    assert st["samples"] == int(df["samples"].sum()) and int(mine["samples"].sum()) >= 0.5 * 0.3 * 499, st
    assert (mine["user_stack"] == "ok").any() and (mine["user_frames"] > 0).any()
    assert st["keys_full"] == 0 and st["user_stack_other_err"] == 0 and st["kernel_stack_other_err"] == 0


@pytest.mark.probe_build
def test_stack_key_matches_the_object():
    """struct stack_key (its comm is a char array: no Struct declares it) has the layout the
    recorder reads it with: the object's BTF says so."""
    from moetrace.kernel.bpf import object_path, stale_object
    from moetrace.kernel.libbpf import BpfObject

    assert stale_object("stacks") is None, stale_object("stacks")
    dt = stacksrec.STACK_KEY_DTYPE
    with BpfObject(object_path("stacks")) as o:
        assert o.struct_layout("stack_key") == [(f, dt.fields[f][1], dt.fields[f][0].itemsize) for f in dt.names]
