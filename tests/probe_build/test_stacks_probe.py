"""The stacks probe (probes/stacks.c + toolkit/record/probes/stacks.py + toolkit/kernel/symbolize.py) (probe-build tier)."""

from __future__ import annotations

from common.stacks_probe import *  # noqa: F401,F403


@pytest.mark.probe_build
@pytest.mark.parametrize("knobs", [{}, {"MOE_FOLLOW_FORKS": 0, "MOE_SAMPLE_HZ": 49, "MOE_STACK_ENTRIES": 1024}],
                         ids=["recorder-defaults", "no-forks-small"])
def test_stacks_compiles_loads_and_detaches(live, knobs):
    from moetrace.kernel.bpf import prog_id_exists

    before = _perf_fds()
    rec = stacksrec.StacksRecorder(_ctx(), knobs=knobs)
    rec.open()
    try:
        assert rec.knobs == SPEC.knob_values(**knobs)
        assert ("task:task_newtask" in rec.probe.tracepoints) == bool(rec.knobs["MOE_FOLLOW_FORKS"])
        tps = len(rec.probe.tracepoints)  # bcc attaches a tracepoint through a perf event too
        assert _perf_fds() - before == os.cpu_count() + tps  # one cpu-clock event per CPU
        tg = rec.probe.table("tgids")
        k = stacksrec.find_kswapd()
        assert k and sorted(int(x.value) for x in tg.keys()) == k  # kswapd threads, read only
        assert all(v.value == stacksrec.TASK_KSWAPD for v in tg.values())
        assert len(rec.probe.table("stats")) == len(SPEC.stats)
        ids = rec.prog_ids()
        assert ids and all(prog_id_exists(i) for i in ids)
    finally:
        rec.close()
        rec.abort()
    assert rec.collected and rec.df is not None
    assert not any(prog_id_exists(i) for i in ids), "programs still loaded after close()"
    assert _perf_fds() == before, "perf events still open after close()"
