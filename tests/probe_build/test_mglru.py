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


@pytest.mark.probe_build
def test_layout_constants_read_without_heavy_headers_equal_the_headers_own(live):
    """mglru.c derives LRU_GEN_PGOFF / LRU_GEN_MASK from <linux/page-flags-layout.h> alone and mlock.c
    takes PG_head from BTF, instead of <linux/mmzone.h> and <linux/page-flags.h> (each doubled its
    probe's compile: 18 s of the lab's start-up). Compiled against the installed headers (those of a
    lab kernel), the derived values must be the headers' own, and that kernel's BTF PG_head too."""
    import os
    import re

    from bcc import BPF

    from moetrace.kernel import btf
    from moetrace.kernel.bpf import probe_source

    build = Path(os.path.realpath(f"/lib/modules/{os.uname().release}/build"))
    release = build.name.removeprefix("linux-headers-")
    image = Path(f"/boot/vmlinuz-{release}")
    if not image.is_file():  # the set-up links the 6.1 lab kernel's headers and installs its image
        pytest.fail(f"the installed headers are {build}, but {image} is missing: bash scripts/lab-setup.sh")
    pg_head = btf.load(image).enum_value("PG_head")
    assert pg_head in (6, 16)  # 6.12 / 6.1
    src = probe_source("mglru").read_text()
    derived = re.search(r"^#define MOE_LRU_GEN_PGOFF.*?\n#define MOE_LRU_GEN_MASK[^\n]*\n", src, re.M | re.S)
    assert derived, "mglru.c no longer defines MOE_LRU_GEN_PGOFF / MOE_LRU_GEN_MASK"
    text = ("#include <linux/mmzone.h>\n#include <linux/page-flags.h>\n" + derived.group(0) +
            '_Static_assert(MOE_LRU_GEN_PGOFF == LRU_GEN_PGOFF, "LRU_GEN_PGOFF");\n'
            '_Static_assert(MOE_LRU_GEN_MASK == LRU_GEN_MASK, "LRU_GEN_MASK");\n'
            f'_Static_assert(PG_head == {pg_head}, "PG_head from BTF");\n'
            "BPF_ARRAY(x, u32, 1);\n")
    b = BPF(text=text.encode())  # a failed assertion is a compile error: bcc raises
    b.cleanup()
    # and a wrong value does fail to compile (the assertions are live)
    with pytest.raises(Exception):
        BPF(text=text.replace(f"PG_head == {pg_head}", f"PG_head == {pg_head + 1}").encode())
