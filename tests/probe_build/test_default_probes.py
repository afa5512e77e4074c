"""Acceptance 3: every probe in record's default set attaches on this kernel or is listed by (probe-build tier)."""

from __future__ import annotations

from common.default_probes import *  # noqa: F401,F403


@pytest.mark.probe_build
@pytest.mark.parametrize("name", WITH_SOURCE)
def test_probe_compiles_loads_and_detaches_with_its_plan_knobs(plans, name):
    """Compile + load + attach with the knobs the kernel decides (unavailable groups compiled
    out); a probe the kernel cannot run at all still compiles with every group compiled out."""
    from moetrace.kernel.bpf import prog_id_exists, prog_info

    spec, plan = PROBES[name], plans[name]
    knobs = spec.knob_values(**{k: v for k, v in plan.knobs.items() if k in {kn.name for kn in spec.knobs}})
    probe = bpf.load_probe(name, {k: int(v) for k, v in knobs.items()})
    try:
        b = probe.bpf
        # bcc attaches every TRACEPOINT_PROBE it compiles; named programs are attached as record does
        for e in plan.attached:
            c = e.candidate
            if c.kind == "tracepoint" and not c.fn_name.startswith("tracepoint__"):
                b.attach_tracepoint(tp=c.target.encode(), fn_name=c.fn_name.encode())
            elif c.kind == "perf_event":
                b.load_func(c.fn_name.encode(), type(b).PERF_EVENT)
        tps = {k.decode() if isinstance(k, bytes) else str(k) for k in b.tracepoint_fds}
        attached = {e.candidate.target for e in plan.attached if e.candidate.kind == "tracepoint"}
        assert tps == attached, (name, tps ^ attached)
        ids = [prog_info(f.fd)["id"] for f in b.funcs.values()]
        bpf_groups = [e for e in plan.attached if e.candidate.kind != "debugfs"]
        # a probe whose BPF groups are all unavailable here (mglru without kprobes) loads no program
        assert bool(ids) == bool(bpf_groups), (name, ids, [e.group for e in bpf_groups])
        assert all(prog_id_exists(i) for i in ids)
    finally:
        probe.close()
    assert not any(prog_id_exists(i) for i in ids)


@pytest.mark.probe_build
def test_percpu_sums_by_batch_equal_bccs_per_entry_sums(live):
    """percpu_sums reads a per-CPU array in one BPF_MAP_LOOKUP_BATCH (reclaim's timeline has ~100k
    entries: 0.3 s through bcc's per-entry lookups here, ~14 s under the lab's TCG); its sums equal
    bcc's own per-entry, per-CPU values, with a different value on every CPU."""
    import ctypes

    import numpy as np
    from bcc import BPF

    from moetrace.kernel.bpf import percpu_sums

    b = BPF(text=b"BPF_PERCPU_ARRAY(a, u64, 20000);")
    try:
        t = b[b"a"]
        ncpu = t.total_cpu
        for i in range(0, 20000, 37):
            t[ctypes.c_int(i)] = (t.sLeaf * ncpu)(*[i * 10 + c + 1 for c in range(ncpu)])
        want = np.zeros(len(t), np.int64)
        for k, v in t.items():
            want[k.value] = sum(int(x) for x in v)
        got = percpu_sums(t)
        assert got.dtype == np.int64 and got.tolist() == want.tolist()
        assert got[37] == sum(370 + c + 1 for c in range(ncpu)) and got[1] == 0
    finally:
        b.cleanup()
