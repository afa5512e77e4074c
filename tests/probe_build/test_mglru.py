"""The mglru probe (probe-build tier): its CO-RE object loads its hooks on this kernel, and the
page-flags layout it needs (a build macro, not in BTF) is derived as the kernel's own headers
define it."""

from __future__ import annotations

from common.mglru import *  # noqa: F401,F403


@pytest.mark.probe_build
def test_mglru_object_loads_every_kprobe_program(live):
    """Every group on, the pool eviction records too: each kprobe program passes this kernel's
    verifier (loaded, never attached: no kprobes here). The eviction record's MGLRU fields are
    absent from this kernel's BTF (no MGLRU): bpf_core_field_exists turns them off and the program
    still loads. The fentry programs are the lab's (this kernel refuses fentry: doctor says why)."""
    from moetrace.kernel.bpf import object_path, prog_id_exists, prog_info
    from moetrace.kernel.libbpf import BpfObject

    on = {k: 1 for k in (g.knob for g in SPEC.attach if g.knob)}
    on.update(MOE_EVICT_EVENTS=1, MOE_POOL_DEV=(254 << 20), MOE_LRU_GEN_PGOFF=27)
    knobs = {k: int(v) for k, v in SPEC.knob_values(**on).items()}
    kps = [c.fn_name for g in SPEC.attach for c in g.candidates if c.kind == "kprobe"]
    assert len(kps) == 10
    with BpfObject(object_path("mglru")) as o:
        o.set_globals({k.lower(): v for k, v in knobs.items()} | {"gated": 1})
        for m, n in SPEC.map_sizes(knobs).items():
            o.set_max_entries(m, n)
        for prog in o.programs:
            o.set_autoload(prog, prog in kps)
        o.load()
        ids = [prog_info(fd)["id"] for fd in o.prog_fds().values()]
        assert len(ids) == len(kps) and all(prog_id_exists(i) for i in ids)
        assert o.map("inc_gen_from").max_entries == 5 and o.map("stats").max_entries == len(SPEC.stats)
    assert not any(prog_id_exists(i) for i in ids)


@pytest.mark.probe_build
def test_lru_gen_pgoff_from_config_and_btf_equals_the_headers_own(live):
    """folio_inc_gen reads the generation at LRU_GEN_PGOFF, a macro of the build: the recorder
    derives it from the kernel's config and two BTF enumerators (moetrace.kernel.kconfig). Against
    the installed headers (a lab kernel's: bcc compiles them here, as an oracle only), the derived
    value must be the headers' own; and a wrong value does fail the check (the assertion is live)."""
    import os

    from bcc import BPF

    from moetrace.kernel import btf
    from moetrace.kernel.kconfig import lru_gen_pgoff, parse_config

    build = Path(os.path.realpath(f"/lib/modules/{os.uname().release}/build"))
    release = build.name.removeprefix("linux-headers-")
    image, config = Path(f"/boot/vmlinuz-{release}"), Path(f"/boot/config-{release}")
    if not image.is_file() or not config.is_file():  # the set-up links the 6.1 lab kernel's headers
        pytest.fail(f"the installed headers are {build}, but {image} / {config} is missing: bash scripts/lab-setup.sh")
    b = btf.load(image)
    pgoff, why = lru_gen_pgoff(parse_config(config.read_text()), b.enum_value("__NR_PAGEFLAGS"),
                               b.enum_value("__MAX_NR_ZONES"))
    assert why == "" and pgoff == 27  # Debian 6.1 / 6.12: 64 - NODES 10 - ZONES 3 - LAST_CPUPID 21 - LRU_GEN 3
    text = ("#include <linux/mmzone.h>\n#include <linux/mm.h>\n"
            f'_Static_assert(LRU_GEN_PGOFF == {pgoff}, "LRU_GEN_PGOFF");\nBPF_ARRAY(x, u32, 1);\n')
    BPF(text=text.encode(), cflags=["-Wno-ignored-attributes", "-Wno-duplicate-decl-specifier"]).cleanup()
    with pytest.raises(Exception):
        BPF(text=text.replace(f"== {pgoff}", f"== {pgoff + 1}").encode())
