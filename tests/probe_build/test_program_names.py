"""Probe build tier: every program of every probe object (probes/build/*.bpf.o, read with
pyelftools from the ELF symbols, not from C text) follows the one naming scheme,
:func:`moetrace.record.spec.program_name`: the prefix of its kind (tp_, raw_, kp_, kret_, fe_,
fx_, pe_; the kind from its ELF section) then its event or kernel symbol ("." as "_")."""

from __future__ import annotations

import pytest

from moetrace.kernel import bpf
from moetrace.record.probes import PROBES
from moetrace.record.spec import PROGRAM_PREFIX, program_name

pytestmark = pytest.mark.probe_build

#: libbpf's section prefixes (SEC("...")) -> attach kind
SECTION_KIND = {"tracepoint": "tracepoint", "tp": "tracepoint", "raw_tracepoint": "raw_tracepoint",
                "raw_tp": "raw_tracepoint", "kprobe": "kprobe", "kretprobe": "kretprobe", "fentry": "fentry",
                "fexit": "fexit", "perf_event": "perf_event"}


def elf_programs(path) -> dict[str, str]:
    """{program: its ELF section}: the global functions outside .text (BPF programs)."""
    from elftools.elf.elffile import ELFFile

    out = {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for sym in elf.get_section_by_name(".symtab").iter_symbols():
            info = sym["st_info"]
            if info["type"] != "STT_FUNC" or info["bind"] != "STB_GLOBAL" or not isinstance(sym["st_shndx"], int):
                continue
            section = elf.get_section(sym["st_shndx"]).name
            if section != ".text":
                out[sym.name] = section
    return out


def section_target(section: str) -> tuple[str, str]:
    """(kind, target as the declarations write it) of a program's ELF section:
    "tracepoint/cat/ev" -> ("tracepoint", "cat:ev"), "kprobe/sym" -> ("kprobe", "sym"),
    "perf_event" -> ("perf_event", "")."""
    head, _, rest = section.partition("/")
    assert head in SECTION_KIND, f"section {section!r}: a kind the naming scheme does not know"
    return SECTION_KIND[head], rest.replace("/", ":")


def test_every_object_is_read():
    names = {p.name.removesuffix(".bpf.o") for p in bpf.probe_objects()}
    assert names >= {n for n in PROBES if bpf.core_source(n).exists()}, "objects missing: build-probes.sh"


@pytest.mark.parametrize("path", bpf.probe_objects(), ids=lambda p: p.name)
def test_every_program_follows_the_naming_scheme(path):
    progs = elf_programs(path)
    assert progs, f"{path.name}: no program found"
    bad = []
    for prog, section in sorted(progs.items()):
        kind, target = section_target(section)
        if target:
            want = program_name(kind, target)  # type: ignore[arg-type]
        else:  # perf_event: the section names no event; the prefix at least
            want = prog if prog.startswith(PROGRAM_PREFIX[kind]) else PROGRAM_PREFIX[kind] + "<event>"
        if prog != want:
            bad.append(f"{prog} (section {section}): want {want}")
    assert not bad, f"{path.name}: programs off the naming scheme:\n" + "\n".join(bad)


def test_the_scheme_rejects_the_old_forms():
    """What the scheme replaced: bcc's tracepoint__<cat>__<event> and a free name."""
    kind, target = section_target("tracepoint/filemap/mm_filemap_add_to_page_cache")
    assert program_name(kind, target) == "tp_mm_filemap_add_to_page_cache"
    assert program_name(*section_target("kprobe/inc_max_seq.constprop.0")) == "kp_inc_max_seq_constprop_0"
    assert program_name("perf_event", "software:cpu-clock") == "pe_cpu_clock"
