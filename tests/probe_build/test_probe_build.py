"""Probe build tier: probes/pagecache.c compiles and loads with its -D knobs; the C (probe-build tier)."""

from __future__ import annotations

from common.probe_build import *  # noqa: F401,F403


@pytest.mark.probe_build
@pytest.mark.parametrize("knobs", KNOB_SETS, ids=["files-1MiB", "pool-4KiB", "stream", "no-order"])
def test_pagecache_compiles_loads_and_detaches(live, knobs):
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
