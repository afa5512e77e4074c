"""The mglru probe (probe-build tier): its CO-RE object loads its hooks on this kernel, and the
page-flags layout it needs (a build macro, not in BTF) is derived as the kernel's own headers
define it."""

from __future__ import annotations

from common.backends import loaded_object
from common.mglru import *  # noqa: F401,F403


@pytest.mark.probe_build
def test_mglru_object_loads_every_kprobe_program(live):
    """Every group on, the pool eviction records too: each kprobe program passes this kernel's
    verifier (loaded, never attached: no kprobes here). The eviction record's MGLRU fields are
    absent from this kernel's BTF (no MGLRU): bpf_core_field_exists turns them off and the program
    still loads. The fentry programs are the lab's (this kernel refuses fentry: doctor says why)."""
    from moetrace.kernel.bpf import prog_id_exists, prog_info

    on = {k: 1 for k in (g.knob for g in SPEC.attach if g.knob)}
    on.update(MOE_EVICT_EVENTS=1, MOE_POOL_DEV=(254 << 20), MOE_LRU_GEN_PGOFF=27)
    knobs = {k: int(v) for k, v in SPEC.knob_values(**on).items()}
    kps = [c.fn_name for g in SPEC.attach for c in g.candidates if c.kind == "kprobe"]
    assert len(kps) == 10
    with loaded_object(SPEC, knobs, kps) as o:
        ids = [prog_info(fd)["id"] for fd in o.prog_fds().values()]
        assert len(ids) == len(kps) and all(prog_id_exists(i) for i in ids)
        assert o.map("inc_gen_from").max_entries == 5 and o.map("stats").max_entries == len(SPEC.stats)
    assert not any(prog_id_exists(i) for i in ids)


def _headers_assert(release: str, expr: str) -> subprocess.CompletedProcess:
    """clang -fsyntax-only of ``_Static_assert(expr)`` after <linux/mm.h> from the Debian headers of
    ``release`` (/usr/src/linux-headers-RELEASE and its -common tree, as kbuild includes them)."""
    h = Path(f"/usr/src/linux-headers-{release}")
    c = Path(str(h).removesuffix("-amd64") + "-common")
    res = subprocess.run(["clang", "-print-resource-dir"], capture_output=True, text=True, check=True).stdout.strip()
    inc = [f"-I{c}/arch/x86/include", f"-I{h}/arch/x86/include/generated", f"-I{c}/include", f"-I{h}/include",
           f"-I{c}/arch/x86/include/uapi", f"-I{h}/arch/x86/include/generated/uapi", f"-I{c}/include/uapi",
           f"-I{h}/include/generated/uapi"]
    src = f'#include <linux/mmzone.h>\n#include <linux/mm.h>\n_Static_assert({expr}, "{expr}");\n'
    return subprocess.run(["clang", "-fsyntax-only", "-target", "x86_64-linux-gnu", "-nostdinc", "-isystem",
                           f"{res}/include", "-D__KERNEL__", "-Wno-everything", *inc, "-include",
                           f"{c}/include/linux/kconfig.h", "-x", "c", "-"], input=src, capture_output=True, text=True)


@pytest.mark.probe_build
@pytest.mark.parametrize("release", ["6.1.0-47-amd64", "6.12.95+deb12-amd64"])
def test_lru_gen_pgoff_from_config_and_btf_equals_the_headers_own(live, release):
    """folio_inc_gen reads the generation at LRU_GEN_PGOFF, a macro of the build: the recorder
    derives it from the kernel's config and two BTF enumerators (moetrace.kernel.kconfig). Against
    each lab kernel's own headers (clang checks a static assertion: an oracle only, nothing of it
    reaches a probe), the derived value must be the headers' own; and a wrong value does fail the
    check (the assertion is live)."""
    from moetrace.kernel import btf
    from moetrace.kernel.kconfig import lru_gen_pgoff, parse_config

    image, config = Path(f"/boot/vmlinuz-{release}"), Path(f"/boot/config-{release}")
    if not image.is_file() or not config.is_file() or not Path(f"/usr/src/linux-headers-{release}").is_dir():
        pytest.fail(f"lab kernel {release} (image, config, headers) not installed: bash scripts/lab-setup.sh")
    b = btf.load(image)
    pgoff, why = lru_gen_pgoff(parse_config(config.read_text()), b.enum_value("__NR_PAGEFLAGS"),
                               b.enum_value("__MAX_NR_ZONES"))
    assert why == "" and pgoff == 27  # Debian 6.1 / 6.12: 64 - NODES 10 - ZONES 3 - LAST_CPUPID 21 - LRU_GEN 3
    ok = _headers_assert(release, f"LRU_GEN_PGOFF == {pgoff}")
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = _headers_assert(release, f"LRU_GEN_PGOFF == {pgoff + 1}")
    assert bad.returncode != 0 and "LRU_GEN_PGOFF" in bad.stderr
