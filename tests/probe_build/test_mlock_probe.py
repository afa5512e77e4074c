"""The mlock probe (probes/mlock.bpf.c + moetrace.record.probes.mlock) (probe-build tier)."""

from __future__ import annotations

from common.backends import loaded_object
from common.mlock_probe import *  # noqa: F401,F403


@pytest.mark.probe_build
def test_mlock_loads_its_groups_and_every_function_hook(live):
    """Every optional group off: only mlock / munlock enter and exit attach. Every function hook
    on: each kprobe program passes this kernel's verifier (loaded, not attached: no kprobes here),
    with PG_head from the kernel's own enum (-1) or given (16, as on 6.1); nothing stays loaded."""
    from moetrace.kernel.bpf import load_core, prog_id_exists, prog_info

    ids: list[int] = []
    off = {k.name: 0 for k in SPEC.knobs if k.name.startswith(("MOE_HAVE_", "MOE_TRACK_", "MOE_FOLLOW_"))}
    knobs = {k: int(v) for k, v in SPEC.knob_values(**off).items()}
    attach = [(g.candidates[0].fn_name, "tracepoint", g.candidates[0].target) for g in SPEC.attach if g.required]
    _features()
    p = load_core("mlock", knobs, attach, SPEC.map_sizes(knobs))
    try:
        assert sorted(p.tracepoints) == ["syscalls:sys_enter_mlock", "syscalls:sys_enter_munlock",
                                         "syscalls:sys_exit_mlock", "syscalls:sys_exit_munlock"]
        assert len(p.table("stats")) == len(SPEC.stats)
        ids += [prog_info(fd)["id"] for fd in p.prog_fds().values()]
    finally:
        p.close()
    kps = [c.fn_name for g in SPEC.attach for c in g.candidates if c.kind == "kprobe"]
    assert len(kps) == 5
    for pg_head in (-1, 16):
        kp = {k.name: 1 for k in SPEC.knobs if k.name.startswith("MOE_KP_")}
        knobs = {k: int(v) for k, v in SPEC.knob_values(**kp, MOE_PG_HEAD=pg_head).items()}
        with loaded_object(SPEC, knobs, kps) as o:
            got = [prog_info(fd)["id"] for fd in o.prog_fds().values()]
            assert len(got) == len(kps)
            ids += got
    assert ids and not any(prog_id_exists(i) for i in ids), "programs still loaded after close()"
