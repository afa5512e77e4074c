"""Probe build tier: probes/pagecache.c compiles and loads with its -D knobs; the C
side and the Python declaration agree."""

from __future__ import annotations

import re

import pytest

from moetrace import bpf
from moetrace.probespec import PROBES
from moetrace.recorder import PAGE_EVENT_DTYPE, prog_id_exists, prog_info

PAGECACHE = PROBES["pagecache"]
SRC = bpf.probe_source("pagecache").read_text()


def _struct_fields(name: str) -> list[tuple[str, str]]:
    body = re.search(r"struct %s \{(.*?)\};" % name, SRC, re.S).group(1)
    return re.findall(r"^\s*(u\d+|s\d+)\s+(\w+);", body, re.M)  # [(type, field)]


def _tracepoint_bodies() -> dict[str, tuple[str, str | None]]:
    """{"cat:event": (body text up to the next probe, innermost enclosing `#if KNOB` or None)}."""
    out = {}
    for m in re.finditer(r"TRACEPOINT_PROBE\((\w+),\s*(\w+)\)", SRC):
        before = SRC[:m.start()]
        stack = []
        for d in re.finditer(r"^#(if|ifdef|ifndef|endif)\b\s*(\w*)", before, re.M):
            if d.group(1) == "endif":
                stack.pop()
            else:
                stack.append(d.group(2) if d.group(1) == "if" else None)
        nxt = SRC.find("TRACEPOINT_PROBE(", m.end())
        body = SRC[m.end(): nxt if nxt != -1 else len(SRC)]
        out[f"{m.group(1)}:{m.group(2)}"] = (body, next((k for k in reversed(stack) if k), None))
    return out


def test_declaration_matches_c_source():
    """The one declaration (moetrace.probespec PAGECACHE) and probes/pagecache.c agree."""
    # every knob has a default in the C file (compilable as is), and the C file knows no other -D knob
    declared = {k.name for k in PAGECACHE.knobs}
    for knob in declared:
        assert f"#ifndef {knob}" in SRC, knob
    internal = {"MAX_SEGS", "MAX_WPS", "MAX_TGIDS", "MAX_INODES"}  # derived in the C file from the knobs
    assert set(re.findall(r"#ifndef (\w+)", SRC)) == declared | internal
    # stats slots: names in the declaration = STAT_* defines, same order
    slots = re.findall(r"#define STAT_(\w+) (\d+)", SRC)
    assert [int(i) for _, i in slots] == list(range(len(slots)))
    assert int(re.search(r"#define N_STATS (\d+)", SRC).group(1)) == len(PAGECACHE.stats) == len(slots)
    assert [n.lower() for n, _ in slots][:4] == ["add_events", "delete_events", "pool_dev_add_events",
                                                  "pool_dev_delete_events"]
    assert slots[PAGECACHE.stats.index("ring_drops")][0] == "RING_DROPS"
    # shared structs: same fields, same widths, same order
    for st in PAGECACHE.structs:
        assert _struct_fields(st.name) == [(t, f) for f, t in st.fields], st.name
    assert PAGE_EVENT_DTYPE == PAGECACHE.struct("page_event").dtype() and PAGE_EVENT_DTYPE.itemsize == 32
    counted = {f for f, _t in PAGECACHE.struct("expert_counts").fields}
    assert counted <= {c.name for c in PAGECACHE.schema}
    # attach groups <-> TRACEPOINT_PROBEs: the same set, each behind its group's knob, reading only
    # the format fields the declaration names (what resolve() checks against the kernel)
    tps = _tracepoint_bodies()
    cands = {c.target: (g, c) for g in PAGECACHE.attach for c in g.candidates}
    assert set(tps) == set(cands)
    for target, (body, knob) in tps.items():
        g, c = cands[target]
        assert c.kind == "tracepoint" and c.fn_name == "tracepoint__" + target.replace(":", "__")
        assert knob == g.knob, (target, knob, g.knob)
        read = set(re.findall(r"args->(\w+)", body))
        allowed = set(c.fields) | {f for f, _k in c.field_knobs}
        assert read and read <= allowed, (target, read - allowed)
        for fld, k in c.field_knobs:  # an optional field is read only under its knob
            assert f"#if {k}" in body
    # configured by -D only: no template placeholders
    assert "{" + "{" not in SRC and "$" not in SRC and "%s" not in SRC


def test_knob_cflags_are_integers_only():
    assert bpf.knob_cflags({"PPE": 256, "HAVE_ORDER": True}) == ["-DPPE=256", "-DHAVE_ORDER=1"]
    with pytest.raises(bpf.ProbeLoadError):
        bpf.knob_cflags({"PPE": "256; evil"})
    with pytest.raises(bpf.ProbeLoadError):
        bpf.knob_cflags({"bad name": 1})


KNOB_SETS = [
    # files layout, 1 MiB experts
    dict(POOL_DEV=254 << 20, N_EXPERTS=23, PPE=256, WPE=4),
    # pool file of 4 KiB extents: one folio spans up to 512 experts
    dict(POOL_DEV=254 << 20, N_EXPERTS=600, PPE=1, WPE=1),
    # odd extent, per-page stream on
    dict(POOL_DEV=0, N_EXPERTS=7, PPE=100, WPE=2, STREAM_EVENTS=1),
    # an older kernel: no folio order, no read tracking, no fork following
    dict(POOL_DEV=0, N_EXPERTS=1, PPE=4096, WPE=64, HAVE_ORDER=0, TRACK_READS=0, FOLLOW_FORKS=0),
]


@pytest.mark.probe_build
@pytest.mark.parametrize("knobs", KNOB_SETS, ids=["files-1MiB", "pool-4KiB", "stream", "no-order"])
def test_pagecache_compiles_loads_and_detaches(live, knobs):
    pytest.importorskip("bcc", reason="bcc (python3-bpfcc) not importable")
    full = PAGECACHE.knob_values(**knobs)
    probe = bpf.load_probe("pagecache", full)
    try:
        tps = set(probe.tracepoints)
        assert {"filemap:mm_filemap_add_to_page_cache", "filemap:mm_filemap_delete_from_page_cache"} <= tps
        assert ("syscalls:sys_exit_preadv" in tps) == bool(full["TRACK_READS"])
        assert ("task:task_newtask" in tps) == bool(full["FOLLOW_FORKS"])
        assert len(probe.table("counts")) == full["N_EXPERTS"] + 1
        assert len(probe.table("evicted_bm")) == full["N_EXPERTS"] * full["WPE"]
        assert len(probe.table("stats")) == len(PAGECACHE.stats)
        ids = [prog_info(f.fd)["id"] for f in probe.bpf.funcs.values()]
        assert ids and all(prog_id_exists(i) for i in ids)
    finally:
        probe.close()
    assert not any(prog_id_exists(i) for i in ids), "programs still loaded after close()"
