"""The replay harness: exact counts, the iteration log, sync-fd, signals, modes (live tier)."""

from __future__ import annotations

from common.replay import *  # noqa: F401,F403


PAGES = MIB // 4096  # pages per expert of the live pool (1 MiB experts)


def _watched_run(lp, args, probe=None, after=None):
    """synced_run under a PageWatcher (tests/pagewatch.py) from the drop to ``after`` (a
    callable run before the watcher stops, e.g. mincore): the page cache is never quiet here
    (this machine's DAMON evicts pool pages seconds after they were read, and the replay reads
    them again). Returns (s0, s1, s2, summary, probe result, marks, watcher, after's result)."""
    from pagewatch import PageWatcher

    marks: dict = {}
    with io_lock():
        w = PageWatcher(lp["pool"].root)
        try:
            drop_from_cache(lp["pool"].data_paths())
            marks["drop"] = time.monotonic_ns()
            s0, s1, s2, s, got = synced_run(lp, args, probe, marks)
            marks["m0"] = time.monotonic_ns()
            later = after() if after else None
            marks["m1"] = time.monotonic_ns()
        finally:
            w.stop()
    assert w.lost == 0
    outside = w.deleted_by(marks["drop"], marks["m1"])
    print(f"\npool pages deleted from the drop to the end, by evictor: {outside or 'none'}")
    return s0, s1, s2, s, got, marks, w, later


def test_live_pagecache_reads_distinct_once(live, livepool):
    lp = livepool
    ids = np.unique(lp["acc"].expert_id)
    s0, s1, s2, s, _, m, w, _ = _watched_run(lp, ["--mode", "pagecache"])
    warm, measured = (s1 - s0) * 512, (s2 - s1) * 512
    added_warm, added_measured = w.pages(0, m["s0"], m["s1"]), w.pages(0, m["s1"], m["s2"])
    deleted = w.pages(1, m["drop"], m["s2"])
    others = np.setdiff1d(np.arange(24), ids)
    # the warm-up reads every distinct expert in full, nothing else, and again only what someone
    # else evicted meanwhile; the device bytes are those pages (+ others' reads on the disk)
    assert (added_warm[ids] >= PAGES).all() and not added_warm[others].any() and not added_measured[others].any()
    assert added_warm.sum() + added_measured.sum() <= ids.size * PAGES + deleted.sum()
    assert near(warm, int(added_warm.sum()) * 4096), (warm, added_warm.tolist())
    assert measured <= 256 * KIB + int(added_measured.sum()) * 4096, (measured, added_measured.tolist())
    if not deleted.any():  # nobody evicted a pool page: the strict figures
        assert added_warm.sum() == ids.size * PAGES and added_measured.sum() == 0
        assert near(warm, ids.size * lp["eb"]), (warm, ids.size)
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

    s0, s1, s2, s, (vmlck, line), m, w, _ = _watched_run(
        lp, ["--mode", "pinned", "--arena-bytes", str(5 * eb + 12345)], probe)
    assert vmlck == 5 * eb  # whole experts, page-rounded (1 MiB experts: exact)
    assert f"vmlck_bytes={vmlck} arena_bytes={5 * eb}" in line
    assert s["phases"]["measured"]["arena_hits"] == int(np.isin(acc.expert_id, top).sum())
    # the preload went to the device outside the measured interval: misses only after loop entry
    distinct_miss = np.setdiff1d(np.unique(acc.expert_id), top).size
    added_warm, added_measured = w.pages(0, m["s0"], m["s1"]), w.pages(0, m["s1"], m["s2"])
    deleted = w.pages(1, m["drop"], m["s2"])
    # the arena's experts were read with O_DIRECT (no page-cache copy), the misses through the
    # page cache (again only what someone else evicted meanwhile)
    assert not (added_warm[top].any() or added_measured[top].any()), added_warm.tolist()
    assert added_warm.sum() >= distinct_miss * PAGES
    assert added_warm.sum() + added_measured.sum() <= distinct_miss * PAGES + deleted.sum()
    assert near((s1 - s0) * 512, 5 * eb + int(added_warm.sum()) * 4096), ((s1 - s0) * 512, added_warm.tolist())
    assert (s2 - s1) * 512 <= 256 * KIB + int(added_measured.sum()) * 4096
    if not deleted.any():  # nobody evicted a pool page: the strict figures
        assert near((s1 - s0) * 512, (5 + distinct_miss) * eb) and added_measured.sum() == 0


def test_live_mmap_touches_every_page(live, livepool):
    lp = livepool
    ids = np.unique(lp["acc"].expert_id)
    others = np.setdiff1d(np.arange(24), ids)
    paths = lp["pool"].data_paths()

    def mincore():
        return resident_pages([paths[i] for i in ids]), resident_pages([paths[i] for i in others])

    s0, s1, s2, s, _, m, w, (resident, untouched) = _watched_run(lp, ["--mode", "mmap", "--warmup", "1"],
                                                                 after=mincore)
    added = w.pages(0, m["drop"], m["m0"])
    deleted = w.pages(1, m["drop"], m["m1"])
    # every page of every touched expert was faulted in, no page of another; mincore lies within
    # the watcher's residency (a deletion while fincore ran may fall either side)
    assert (added[ids] >= PAGES).all() and not added[others].any(), added.tolist()
    assert untouched == 0
    lo, hi = int(w.resident(m["m1"], m["drop"])[ids].sum()), int(w.resident(m["m0"], m["drop"])[ids].sum())
    assert lo <= resident <= hi, (resident, lo, hi)
    assert near((s1 - s0) * 512, int(w.pages(0, m["s0"], m["s1"]).sum()) * 4096)
    if not deleted.any():  # nobody evicted a pool page: the strict figures
        assert resident * 4096 == ids.size * lp["eb"]
        assert near((s1 - s0) * 512, ids.size * lp["eb"])
    assert s["phases"]["measured"]["bytes"] == len(lp["acc"]) * lp["eb"]
