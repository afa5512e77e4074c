"""The replay harness: exact counts, the iteration log, sync-fd, signals, modes (live tier)."""

from __future__ import annotations

from common.replay import *  # noqa: F401,F403


def test_live_pagecache_reads_distinct_once(live, livepool):
    lp = livepool
    paths = lp["pool"].data_paths()
    distinct = np.unique(lp["acc"].expert_id).size
    with io_lock():
        drop_from_cache(paths)
        s0, s1, s2, s, _ = synced_run(lp, ["--mode", "pagecache"])
    warm, measured = (s1 - s0) * 512, (s2 - s1) * 512
    assert near(warm, distinct * lp["eb"]), (warm, distinct)
    assert measured <= 256 * KIB, measured
    assert s["phases"]["measured"]["bytes"] == len(lp["acc"]) * lp["eb"]


def test_live_direct_reads_every_byte_every_pass(live, livepool):
    lp = livepool
    n = len(lp["acc"])
    with io_lock():
        s0, s1, s2, s, _ = synced_run(lp, ["--mode", "direct", "--passes", "2"])
    aligned = -(-lp["eb"] // 4096) * 4096
    assert near((s1 - s0) * 512, n * aligned), (s1 - s0) * 512
    assert near((s2 - s1) * 512, 2 * n * aligned), (s2 - s1) * 512


def test_live_pinned_vmlck_and_hits(live, livepool):
    lp = livepool
    acc, eb = lp["acc"], lp["eb"]
    counts = np.bincount(acc.expert_id, minlength=24)
    top = np.lexsort((np.arange(24), -counts))[:5]

    def probe(pid, line):
        return rp.read_vmlck(pid), line

    with io_lock():
        drop_from_cache(lp["pool"].data_paths())
        s0, s1, s2, s, (vmlck, line) = synced_run(lp, ["--mode", "pinned", "--arena-bytes", str(5 * eb + 12345)],
                                                  probe)
    assert vmlck == 5 * eb  # whole experts, page-rounded (1 MiB experts: exact)
    assert f"vmlck_bytes={vmlck} arena_bytes={5 * eb}" in line
    assert s["phases"]["measured"]["arena_hits"] == int(np.isin(acc.expert_id, top).sum())
    # the preload went to the device outside the measured interval: misses only after loop entry
    distinct_miss = np.setdiff1d(np.unique(acc.expert_id), top).size
    assert near((s1 - s0) * 512, (5 + distinct_miss) * eb)
    assert (s2 - s1) * 512 <= 256 * KIB


def test_live_mmap_touches_every_page(live, livepool):
    lp = livepool
    ids = np.unique(lp["acc"].expert_id)
    paths = lp["pool"].data_paths()
    with io_lock():
        drop_from_cache(paths)
        s0, s1, s2, s, _ = synced_run(lp, ["--mode", "mmap", "--warmup", "1"])
        resident = resident_pages([paths[i] for i in ids])
        untouched = resident_pages([paths[i] for i in np.setdiff1d(np.arange(24), ids)])
    assert resident * 4096 == ids.size * lp["eb"]
    assert untouched == 0
    assert near((s1 - s0) * 512, ids.size * lp["eb"])
    assert s["phases"]["measured"]["bytes"] == len(lp["acc"]) * lp["eb"]
