"""Probe build tier: probes/pagecache.c compiles and loads with its -D knobs; the C (unit tier)."""

from __future__ import annotations

from common.probe_build import *  # noqa: F401,F403


def test_core_probes_have_sources():
    assert {"pagecache", "block", "reclaim"} <= set(WITH_SOURCE)


@pytest.mark.parametrize("name", WITH_SOURCE)
def test_declaration_matches_c_source(name):
    """The one declaration (moetrace.record.spec) and probes/<name>.c agree: knobs, stats slots,
    shared structs, attach candidates (function, enclosing knob, format fields read)."""
    spec = PROBES[name]
    src = bpf.probe_source(name).read_text()
    shared = (bpf.probe_source(name).parent / "moetrace.h").read_text()  # structs the probes share
    # every knob has a default in the C file (compilable as is), and the C file knows no other -D knob
    declared = {k.name for k in spec.knobs}
    for knob in declared:
        assert f"#ifndef {knob}" in src, knob
    # (kernel headers' include guards are not knobs: a type declared unless its header came in)
    assert set(re.findall(r"#ifndef (\w+)", src)) - {"_LINUX_FS_H", "_LINUX_MMZONE_H"} == \
        declared | UNDECLARED_OK.get(name, set())
    # stats slots: names in the declaration = STAT_* defines, same order
    slots = re.findall(r"#define STAT_(\w+) (\d+)", src)
    assert [int(i) for _, i in slots] == list(range(len(slots)))
    assert int(re.search(r"#define N_STATS (\d+)", src).group(1)) == len(spec.stats) == len(slots)
    if name in EXACT_STAT_NAMES:
        assert [n.lower() for n, _ in slots] == list(spec.stats)
    # shared structs: same fields, same widths, same order
    for st in spec.structs:
        own = re.search(r"struct %s \{" % st.name, src)
        assert _struct_fields(src if own else shared, st.name) == [(t, f) for f, t in st.fields], st.name
    # attach candidates <-> tracepoint programs: the same set, each behind its group's knob (or the
    # knob its `sets` choose), reading exactly the format fields the declaration names (what
    # resolve() checks against the kernel)
    tps = _tracepoint_bodies(src)
    cands = {c.target: (g, c) for g in spec.attach for c in g.candidates
             if c.kind in ("tracepoint", "raw_tracepoint")}
    assert set(tps) == set(cands)
    for g in spec.attach:  # kprobes / perf events: the named C function exists, behind the group's knob
        for c in g.candidates:
            if c.kind in ("kprobe", "kretprobe", "perf_event"):
                m = re.search(r"^int %s\(" % re.escape(c.fn_name), src, re.M)
                assert m, (c.describe(), c.fn_name)
                if g.knob is not None:
                    enclosing = [d.group(2) for d in re.finditer(r"^#(if)\b\s*(\w*)", src[:m.start()], re.M)]
                    assert g.knob in enclosing, (c.fn_name, g.knob)
    for target, (fn, body, knobs) in tps.items():
        g, c = cands[target]
        assert c.kind == "tracepoint" and c.fn_name == fn, (target, c.fn_name, fn)
        allowed_knobs = {g.knob} - {None} | {k for k, _v in c.sets}
        assert set(knobs) <= allowed_knobs and (g.knob is None or g.knob in knobs), (target, knobs, g.knob)
        read = set(re.findall(r"args->(\w+)", body))
        declared_fields = set(c.fields) | {f for f, _k in c.field_knobs}
        assert read == declared_fields, (target, read ^ declared_fields)
        for fld, k in c.field_knobs:  # an optional field is read only under its knob
            assert f"#if {k}" in body
    for g in spec.attach:  # a chosen candidate's `sets` name declared knobs
        for c in g.candidates:
            assert {k for k, _v in c.sets} <= declared, c
    # the declared tables: units in the column names
    for tname, cols in spec.tables().items():
        for col in cols:
            if col.unit in ("ns", "bytes", "pages"):
                assert col.name.endswith(col.unit) or col.name.endswith(f"{col.unit}_sum") \
                    or col.name.endswith(f"{col.unit}_mean") or f"_{col.unit}" in col.name, (tname, col.name)
    # configured by -D only: no template placeholders
    assert "{" + "{" not in src and "$" not in src and "%s" not in src


def test_pagecache_specifics():
    slots = re.findall(r"#define STAT_(\w+) (\d+)", SRC)
    assert [n.lower() for n, _ in slots][:4] == ["add_events", "delete_events", "pool_dev_add_events",
                                                  "pool_dev_delete_events"]
    assert slots[PAGECACHE.stats.index("ring_drops")][0] == "RING_DROPS"
    assert PAGE_EVENT_DTYPE == PAGECACHE.struct("page_event").dtype() and PAGE_EVENT_DTYPE.itemsize == 40
    counted = {f for f, _t in PAGECACHE.struct("expert_counts").fields}
    assert counted <= {c.name for c in PAGECACHE.schema}


def test_knob_cflags_are_integers_only():
    assert bpf.knob_cflags({"PPE": 256, "HAVE_ORDER": True}) == ["-DPPE=256", "-DHAVE_ORDER=1"]
    with pytest.raises(bpf.ProbeError):
        bpf.knob_cflags({"PPE": "256; evil"})
    with pytest.raises(bpf.ProbeError):
        bpf.knob_cflags({"bad name": 1})
