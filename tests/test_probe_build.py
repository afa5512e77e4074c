"""Probe build tier: probes/pagecache.c compiles and loads with its -D knobs; the C
side and the Python declaration agree."""

from __future__ import annotations

import re

import pytest

from moetrace import bpf
from moetrace.recorder import PAGE_EVENT_DTYPE, PAGECACHE, prog_id_exists, prog_info

SRC = bpf.probe_source("pagecache").read_text()


def _struct_fields(name: str) -> list[tuple[str, str]]:
    body = re.search(r"struct %s \{(.*?)\};" % name, SRC, re.S).group(1)
    return re.findall(r"^\s*(u\d+)\s+(\w+);", body, re.M)


def test_declaration_matches_c_source():
    # every knob the recorder may set has a default in the C file (compilable as is)
    for knob in PAGECACHE.knobs:
        assert f"#ifndef {knob}" in SRC, knob
    # stats slots: names in the declaration = STAT_* defines, same order
    slots = re.findall(r"#define STAT_(\w+) (\d+)", SRC)
    assert [int(i) for _, i in slots] == list(range(len(slots)))
    assert int(re.search(r"#define N_STATS (\d+)", SRC).group(1)) == len(PAGECACHE.stats) == len(slots)
    assert [n.lower() for n, _ in slots][:4] == ["add_events", "delete_events", "pool_dev_add_events",
                                                  "pool_dev_delete_events"]
    # counters struct <-> table columns
    assert [f for _, f in _struct_fields("expert_counts")] == ["added_pages", "evicted_pages", "re_added_pages"]
    assert {c.name for c in PAGECACHE.columns} >= {"added_pages", "evicted_pages", "re_added_pages"}
    # ring record struct <-> numpy dtype
    fields = _struct_fields("page_event")
    assert [f for _, f in fields] == list(PAGE_EVENT_DTYPE.names)
    assert [int(t[1:]) // 8 for t, _ in fields] == [PAGE_EVENT_DTYPE[n].itemsize for n in PAGE_EVENT_DTYPE.names]
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
    full = dict(PAGECACHE.knobs)
    full.update(knobs)
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
