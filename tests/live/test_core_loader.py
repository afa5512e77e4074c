"""Live: the CO-RE objects loaded by libbpf count exactly what the bcc programs count.

One deterministic workload (drop the pool, read every expert, drop every other expert, read
them all again) recorded by both paths of a probe at once: the bcc compile of probes/<name>.c
and the compiled probes/build/<name>.bpf.o, the two armed together (two stores microseconds
apart) and disarmed together. Their per-expert tables are equal, entry by entry, and the
workload's own figures hold (every page added once, the dropped half re-added once), held
against mincore. Runs while both paths exist (issue 18: the bcc path is measured, then goes)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from common.record import MIB, N, PAGES, _drop, _resident_pages, pools  # noqa: F401
from conftest import io_lock

pytestmark = pytest.mark.live


def _open(backend: str, monkeypatch, feats, plan, pmap):
    from moetrace.record.probe import RecordContext
    from moetrace.record.probes.pagecache import PagecacheRecorder

    monkeypatch.setenv("MOETRACE_BPF_BACKEND", backend)
    ctx = RecordContext(features=feats, plan=plan, pmap=pmap, gated=True,
                        knobs={"TRACK_READS": 0, "FOLLOW_FORKS": 0})
    rec = PagecacheRecorder(ctx).open()
    assert rec.probe.backend == backend
    return rec


def _read_all(files, which) -> None:
    for i in which:
        with open(files[i], "rb", buffering=0) as f:
            while f.read(MIB):
                pass


def test_pagecache_core_equals_bcc_on_one_workload(live, pools, monkeypatch):
    from moetrace.inputs.pool import open_pool
    from moetrace.kernel.bpf import backend_for, require_tracefs
    from moetrace.kernel.features import Features
    from moetrace.record.probes import PROBES
    from moetrace.record.recorder import pool_map
    from moetrace.record.spec import resolve

    if not (backend_for("pagecache") == "core" and os.path.exists(f"{PROBES['pagecache'].source_path}")):
        pytest.fail("both paths are needed: probes/pagecache.c and probes/pagecache.bpf.c")
    pool = pools["files"]
    pmap = pool_map(open_pool(pool))
    feats = Features("/")
    require_tracefs(feats)
    plan = resolve(PROBES["pagecache"], feats)
    files = sorted(pool.rglob("*.bin"))
    assert len(files) == N
    with io_lock():
        recs = [_open("bcc", monkeypatch, feats, plan, pmap), _open("core", monkeypatch, feats, plan, pmap)]
        try:
            _drop(pool)
            for r in recs:
                r.arm(True)
            _read_all(files, range(N))
            for i in range(0, N, 2):
                fd = os.open(files[i], os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            _read_all(files, range(N))
            resident = [_resident_pages(p) for p in files]
            for r in reversed(recs):
                r.arm(False)
            for r in recs:
                r.close()
        finally:
            for r in recs:
                r.abort()
    bcc, core = recs
    for field in ("added_pages", "evicted_pages", "re_added_pages"):
        assert np.array_equal(bcc.counts[field], core.counts[field]), (field, bcc.counts[field], core.counts[field])
    assert np.array_equal(bcc.evictors, core.evictors)
    for k in ("pool_dev_add_events", "pool_dev_delete_events", "unprocessed_pages", "bitmap_misses",
              "dev_mismatch_events"):
        assert bcc.stats[k] == core.stats[k], k
    c = core.counts[:N]
    # the workload itself: each page added once, the dropped half deleted by fadvise and re-added
    # once (beyond that only what someone else evicted meanwhile: DAMON; then mincore says so)
    from moetrace.run.evictors import EVICTORS

    fadv = core.evictors[:N, EVICTORS.index("fadvise")]
    dropped = np.array([PAGES if i % 2 == 0 else 0 for i in range(N)])
    assert (fadv == dropped).all(), fadv
    assert (c["re_added_pages"] >= dropped).all() and (c["added_pages"] - c["re_added_pages"] == PAGES).all()
    if sum(resident) == N * PAGES and (c["evicted_pages"] == dropped).all():
        assert (c["re_added_pages"] == dropped).all()
    assert core.compile_attach_s < bcc.compile_attach_s
