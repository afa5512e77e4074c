"""The mglru probe: the lru_gen parser (moetrace.kernel.lru_gen), the sampler (moetrace.record.probes.mglru), (probe-build tier)."""

from __future__ import annotations

from common.mglru import *  # noqa: F401,F403


@pytest.mark.probe_build
def test_mglru_c_compiles_with_kprobes_off_and_its_kprobes_verify(live):
    from bcc import BPF

    from moetrace.kernel import bpf
    from moetrace.kernel.bpf import prog_id_exists, prog_info

    # every knob off (every kernel without kprobes): the stats map, no program at all
    p = bpf.load_probe("mglru", SPEC.knob_values())
    try:
        assert p.tracepoints == [] and len(p.bpf.funcs) == 0
        assert len(p.table("stats")) == len(SPEC.stats)
    finally:
        p.close()
    # every kprobe group compiled in: the installed headers are the 6.1 lab kernel's own, so this is
    # the program the lab loads; each passes this kernel's verifier (loaded, never attached here)
    on = {k: 1 for k in (g.knob for g in SPEC.attach if g.knob)}
    # with the pool eviction records: the offsets 6.12's BTF gives (`lab kernels` reads them; the
    # verifier only needs them to be constants)
    on.update(MOE_EVICT_EVENTS=1, MOE_POOL_DEV=(254 << 20), MOE_OFF_FOLIO_MAPPING=24, MOE_OFF_FOLIO_INDEX=32,
              MOE_OFF_FOLIO_MEMCG=56, MOE_OFF_AS_HOST=0, MOE_OFF_INODE_INO=64, MOE_OFF_INODE_SB=40,
              MOE_OFF_SB_DEV=16, MOE_OFF_MEMCG_ID=208, MOE_OFF_MEMCG_NODEINFO=1712, MOE_OFF_PN_MIN_SEQ_FILE=216)
    p = bpf.load_probe("mglru", SPEC.knob_values(**on))
    ids = []
    try:
        assert p.tracepoints == []  # kprobes are attached by the recorder, by plan, never auto
        fns = [c.fn_name for g in SPEC.attach for c in g.candidates if c.kind == "kprobe"]
        assert len(fns) == 10
        for fn in fns:
            ids.append(prog_info(p.bpf.load_func(fn.encode(), BPF.KPROBE).fd)["id"])
        assert len(p.table("inc_gen_from")) == 5
        p.table("evictions")  # the eviction ring exists
        assert len(p.table("stats")) == len(SPEC.stats)
    finally:
        p.close()
    assert ids and not any(prog_id_exists(i) for i in ids)
