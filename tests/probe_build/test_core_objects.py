"""Probe build tier: every CO-RE probe (probes/<name>.bpf.c) is built, current, and agrees with its
Python declaration, read from the object itself (its BTF), not from C text:

- every knob is a read-only global of the object (lower-case name) and every global is a knob
  (or the shared ``gated``);
- every struct the declaration shares with Python has the object's layout (names, offsets,
  sizes: the numpy dtypes read map values and ring records with these);
- every program an attach candidate names is in the object, and every program is named by one;
- every map the loader sizes exists;
- the object's ``enum moe_stat`` (its ``stats`` slots) is the declaration's ``stats``, in order;
- with root, the object loads on this kernel with its default knobs and every program the
  attach plan can attach, and detaches (no program left loaded).
"""

from __future__ import annotations

import pytest

from moetrace.kernel import bpf
from moetrace.record.probes import PROBES

CORE = [n for n in PROBES if bpf.core_source(n).exists()]
pytestmark = pytest.mark.probe_build


def _obj(name):
    from moetrace.kernel.libbpf import BpfObject

    why = bpf.stale_object(name)
    assert why is None, why
    return BpfObject(bpf.object_path(name), name)


def test_some_probe_is_core():
    assert "pagecache" in CORE


@pytest.mark.parametrize("name", CORE)
def test_object_agrees_with_the_declaration(name):
    spec = PROBES[name]
    with _obj(name) as o:
        glob = set(o.section_globals(".rodata"))
        knobs = {k.name.lower() for k in spec.knobs}
        assert knobs <= glob, f"knobs without a global in {name}.bpf.c: {sorted(knobs - glob)}"
        assert glob - knobs <= {"gated"}, f"globals of {name}.bpf.c no knob declares: {sorted(glob - knobs - {'gated'})}"
        for st in spec.structs:
            dt = st.dtype()
            want = [(f, dt.fields[f][1], dt.fields[f][0].itemsize) for f in dt.names]
            assert o.struct_layout(st.name) == want, st.name
        named = {c.fn_name for g in spec.attach for c in g.candidates if c.kind != "debugfs"}
        assert named == set(o.programs), (sorted(named - set(o.programs)), sorted(set(o.programs) - named))
        if spec.map_sizes is not None:
            sizes = spec.map_sizes({k: int(v) for k, v in spec.knob_values().items()})
            assert set(sizes) <= set(o.map_names()), sorted(set(sizes) - set(o.map_names()))


@pytest.mark.parametrize("name", CORE)
def test_object_loads_attaches_and_detaches(live, name):
    from moetrace.kernel.bpf import load_core, prog_id_exists, prog_info, require_tracefs
    from moetrace.kernel.features import Features
    from moetrace.record.spec import resolve

    spec = PROBES[name]
    feats = Features("/")
    require_tracefs(feats)
    plan = resolve(spec, feats)
    knobs = {k: int(v) for k, v in spec.knob_values(**plan.knobs).items()}
    attach = [(e.candidate.fn_name, e.candidate.kind, e.candidate.target) for e in plan.attached
              if e.candidate.kind != "debugfs"]
    probe = load_core(name, knobs, attach, spec.map_sizes(knobs) if spec.map_sizes else None, gated=True)
    try:
        assert probe.compile_s < 5  # no compiler: libbpf's relocations and the verifier only
        ids = [prog_info(fd)["id"] for fd in probe.prog_fds().values()]
        assert len(ids) == len(attach) and all(prog_id_exists(i) for i in ids)
        assert sorted(probe.tracepoints) == sorted(t for _p, k, t in attach if k == "tracepoint")
    finally:
        probe.close()
    assert not any(prog_id_exists(i) for i in ids), "programs still loaded after close()"


def _btf_enum(path, name: str) -> list[tuple[str, int]] | None:
    """[(enumerator, value)] of ``enum name`` in an object's BTF, read by bpftool (the build's tool)."""
    import json
    import shutil
    import subprocess

    tool = shutil.which("bpftool")
    if tool is None:
        pytest.skip("no bpftool (the probes' build tool): cannot read the objects' BTF enums")
    out = subprocess.run([tool, "btf", "dump", "file", str(path), "-j"], check=True, capture_output=True, text=True)
    for t in json.loads(out.stdout)["types"]:
        if t["kind"] == "ENUM" and t["name"] == name:
            return [(v["name"], v["val"]) for v in t["values"]]
    return None


@pytest.mark.parametrize("name", CORE)
def test_object_stats_enum_is_the_declarations(name):
    """STAT_* slots as the object's BTF has them (enum moe_stat, kept by MOE_STAT_BTF): the
    declaration's ``stats`` in slot order, N_STATS last; the stats map the loader sizes to it."""
    spec = PROBES[name]
    why = bpf.stale_object(name)
    assert why is None, why
    got = _btf_enum(bpf.object_path(name), "moe_stat")
    assert got is not None, f"{name}.bpf.o: no enum moe_stat in its BTF (MOE_STAT_BTF missing?)"
    want = [(f"STAT_{s.upper()}", i) for i, s in enumerate(spec.stats)] + [("N_STATS", len(spec.stats))]
    assert got == want
    if spec.map_sizes is not None and "stats" in spec.map_sizes({k: int(v) for k, v in spec.knob_values().items()}):
        assert spec.map_sizes({k: int(v) for k, v in spec.knob_values().items()})["stats"] == len(spec.stats)
