"""Probe build tier: probes/pagecache.bpf.c's object loads with each knob set the recorder uses,
its maps sized from the knobs, and detaches."""

from __future__ import annotations

from common.backends import *  # noqa: F401,F403
from common.probe_build import *  # noqa: F401,F403


@pytest.mark.probe_build
@pytest.mark.parametrize("knobs", KNOB_SETS, ids=["files-1MiB", "pool-4KiB", "model-stream", "no-order"])
def test_pagecache_loads_and_detaches(live, knobs):
    from moetrace.kernel.bpf import require_tracefs
    from moetrace.kernel.features import Features

    require_tracefs(Features("/"))
    full = {k: int(v) for k, v in PAGECACHE.knob_values(**knobs).items()}
    probe = load_first(PAGECACHE, full)
    try:
        tps = set(probe.tracepoints)
        assert {"filemap:mm_filemap_add_to_page_cache", "filemap:mm_filemap_delete_from_page_cache"} <= tps
        assert ("syscalls:sys_exit_preadv" in tps) == bool(full["MOE_TRACK_READS"])
        assert ("task:task_newtask" in tps) == bool(full["MOE_FOLLOW_FORKS"])
        assert len(probe.table("counts")) == full["MOE_N_EXPERTS"] + 3
        assert len(probe.table("runs")) == full["MOE_N_RUNS"]
        assert len(probe.table("evicted_bm")) == full["MOE_BM_WORDS"]
        assert len(probe.table("stats")) == len(PAGECACHE.stats)
        ids = [prog_info(fd)["id"] for fd in probe.prog_fds().values()]
        assert ids and all(prog_id_exists(i) for i in ids)
    finally:
        probe.close()
    assert not any(prog_id_exists(i) for i in ids), "programs still loaded after close()"
