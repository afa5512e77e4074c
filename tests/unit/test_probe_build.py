"""The probes' C sources and their declarations agree where only the text can say (unit tier;
the objects' layouts and programs: tests/probe_build/test_core_objects.py)."""

from __future__ import annotations

from common.probe_build import *  # noqa: F401,F403


def test_every_declared_probe_has_its_source():
    assert set(WITH_SOURCE) == set(PROBES)


@pytest.mark.parametrize("name", WITH_SOURCE)
def test_declaration_matches_c_source(name):
    """Knobs are the file's read-only globals with the declared defaults (no -D, no #if on a
    knob: one object serves every configuration); STAT_* slots in the declaration's order; the
    tables' units in their column names."""
    spec = PROBES[name]
    src = bpf.core_source(name).read_text()
    glob = globals_of(src)
    for k in spec.knobs:
        assert k.name.lower() in glob, f"knob {k.name} has no global in {name}.bpf.c"
        if isinstance(k.default, int):
            assert glob[k.name.lower()] == k.default, (k.name, glob[k.name.lower()], k.default)
    assert set(glob) <= {k.name.lower() for k in spec.knobs}, sorted(set(glob) - {k.name.lower() for k in spec.knobs})
    assert not any(re.search(r"^#if(def|ndef)? %s\b" % k.name, src, re.M) for k in spec.knobs)
    assert stat_enum(src) == [f"STAT_{s.upper()}" for s in spec.stats] + ["N_STATS"], "enum moe_stat"
    assert not re.search(r"^#define (STAT_\w+|N_STATS)\b", src, re.M), "STAT_* slots are the enum's, not #defines"
    assert re.search(r"^MOE_STAT_BTF;", src, re.M), "MOE_STAT_BTF keeps enum moe_stat in the object's BTF"
    for g in spec.attach:  # a chosen candidate's `sets` name declared knobs
        for c in g.candidates:
            assert {k for k, _v in c.sets} <= {k.name for k in spec.knobs}, c
    for tname, cols in spec.tables().items():
        for col in cols:
            if col.unit in ("ns", "bytes", "pages"):
                assert col.name.endswith(col.unit) or col.name.endswith(f"{col.unit}_sum") \
                    or col.name.endswith(f"{col.unit}_mean") or f"_{col.unit}" in col.name, (tname, col.name)
    assert "{" + "{" not in src and "%s" not in src  # no templates


def test_pagecache_specifics():
    slots = stat_enum(SRC)
    assert [n.lower() for n in slots][:4] == ["stat_add_events", "stat_delete_events", "stat_pool_dev_add_events",
                                               "stat_pool_dev_delete_events"]
    assert slots[PAGECACHE.stats.index("ring_drops")] == "STAT_RING_DROPS"
    assert PAGE_EVENT_DTYPE == PAGECACHE.struct("page_event").dtype() and PAGE_EVENT_DTYPE.itemsize == 40
    counted = {f for f, _t in PAGECACHE.struct("expert_counts").fields}
    assert counted <= {c.name for c in PAGECACHE.schema}
