"""Live: the pagecache probe's (inode, page) -> slot map at the paper's size (record/poolmap.py
runs; probes/pagecache.bpf.c run_find): 92 layers x 896 experts, 1.45 TB in 200 files, three
slices per expert (~248 k runs, a re-add bitmap of ~44 MiB). 199 of the files are inodes no file
has here; one is a real 16 MiB file on the test's block-backed filesystem whose window, in the
middle of the runs array, cuts it into ~1,000 runs of 1-8 pages owned by random experts (of the
whole range), shared and non-expert.

Oracles: mincore of the real file before and after, and the map's own lookup in numpy
(PoolMap.classify): per slot, the pages the probe counts added minus evicted equal the slot's
pages that became resident — whatever DAMON evicted meanwhile — over single-page reads with
readahead off and a sequential pass whose readahead builds large folios (ext4, 6.16+) that
span many runs. The maps' kernel memory (fdinfo memlock) stays within the stated budget."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from conftest import io_lock
from moetrace.kernel.syscalls import kernel_dev, resident_map
from moetrace.record.poolmap import PAGE_SPACE, RUN_DTYPE, PoolMap, tile_files

L, E = 92, 896
N = L * E
EXPERT_PAGES = 1_450_000_000_000 // N // 4096 // 3  # one slice: ~1,432 pages
REAL_PAGES = 4096
BUDGET = 100 << 20  # README "Model files": the kernel-map budget at the paper's size


def _fake_file(experts: np.ndarray) -> tuple[np.ndarray, int]:
    """A GGUF-like file: a header page, then three tensors of one slice per expert, a tail."""
    n = 3 * len(experts)
    r = np.zeros(n + 2, RUN_DTYPE)
    r["pages"][0], r["slot"][0] = 1, N + 2
    r["pages"][1:n + 1] = EXPERT_PAGES
    r["slot"][1:n + 1] = np.tile(experts, 3)
    r["epage"][1:n + 1] = np.repeat(np.arange(3), len(experts)) * EXPERT_PAGES
    r["start"] = np.concatenate([[0], np.cumsum(r["pages"][:-1].astype(np.int64))])
    pages = int(r["start"][-1])
    r["slot"][-1], r["pages"][-1] = N + 2, PAGE_SPACE - 1 - pages
    return r, pages


def _real_file(rng) -> np.ndarray:
    """~1,000 runs of 1-8 pages: random experts, shared, non-expert; tiled to the page space."""
    lens = rng.integers(1, 9, size=2 * REAL_PAGES // 4)
    lens = lens[: np.searchsorted(np.cumsum(lens), REAL_PAGES)]
    lens = np.append(lens, REAL_PAGES - lens.sum())
    slots = rng.integers(0, N, size=len(lens))
    kind = rng.random(len(lens))
    slots[kind < 0.15] = N + 1
    slots[(kind >= 0.15) & (kind < 0.25)] = N + 2
    slots[1:][slots[1:] == slots[:-1]] = N + 2  # (neighbours never merge in what the test checks)
    r = np.zeros(len(lens) + 1, RUN_DTYPE)
    r["pages"][:-1], r["slot"][:-1] = lens, slots
    r["start"] = np.concatenate([[0], np.cumsum(lens)])
    r["pages"][-1], r["slot"][-1] = PAGE_SPACE - 1 - REAL_PAGES, N + 2
    return r


def _paper_map(real, rng) -> PoolMap:
    st = os.stat(real)
    files, inodes = [], {}
    per_file = np.array_split(np.arange(N, dtype=np.uint32), 199)
    for i, ex in enumerate(per_file):
        if i == 100:
            files.append((st.st_ino, _real_file(rng), REAL_PAGES))
        ino = 10**12 + i  # no file has these inodes
        r, pages = _fake_file(ex)
        files.append((ino, r, pages))
    for ino, _r, _p in files:
        inodes[int(ino)] = (0, N)
    return PoolMap(inodes, kernel_dev(st.st_dev), 3 * EXPERT_PAGES * 4096, N, E, None, "model", None,
                   tile_files(files))


def _memlock(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("memlock:"):
                return int(line.split()[1])
    raise AssertionError("no memlock in fdinfo")


def _net(rec, pm):
    """Per slot, pages added minus evicted so far."""
    c = rec.counters()
    return c["added_pages"][: pm.n_slots] - c["evicted_pages"][: pm.n_slots]


@pytest.mark.live
def test_the_paper_sized_map_loads_within_budget_and_attributes_every_page(live, tmp_path):
    from moetrace.kernel.bpf import require_tracefs
    from moetrace.kernel.features import Features
    from moetrace.record.probe import RecordContext
    from moetrace.record.probes import PROBES, recorder_class
    from moetrace.record.probes.pagecache import map_budget
    from moetrace.record.spec import resolve
    from conftest import drop_pages

    rng = np.random.default_rng(35)
    real = tmp_path / "real.bin"
    real.write_bytes(rng.integers(0, 256, REAL_PAGES * 4096, dtype=np.uint8).tobytes())
    pm = _paper_map(real, rng)
    assert len(pm.runs) > 240_000 and pm.bitmap_words > 5_000_000
    feats = Features("/")
    require_tracefs(feats)
    feats = Features("/")
    ctx = RecordContext(features=feats, plan=resolve(PROBES["pagecache"], feats), pmap=pm, gated=False,
                        recording=("pagecache",))
    rec = recorder_class("pagecache")(ctx)
    t0 = time.perf_counter()
    rec.open()
    load_s = time.perf_counter() - t0
    try:
        budget = map_budget(rec.knobs)
        mem = {m: _memlock(rec.probe.table(m).fd) for m in budget}
        print(f"\nruns {len(pm.runs)}, bitmap words {pm.bitmap_words}, search steps {pm.search_steps}, load + fill "
              f"{load_s:.2f} s; kernel maps {sum(mem.values()) / 2**20:.1f} MiB (budget stated "
              f"{sum(budget.values()) / 2**20:.1f} MiB): {mem}")
        assert sum(mem.values()) <= BUDGET and sum(budget.values()) <= BUDGET
        for m in ("runs", "evicted_bm", "counts"):
            assert mem[m] >= budget[m]  # the maps are the sizes the budget states
        with io_lock():
            drop_pages([real], lambda ps: int(sum(resident_map(p).sum() for p in ps)))
            before, base = resident_map(real), _net(rec, pm)  # the write's and the drop's counts: not ours
            fd = os.open(real, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # single pages: exactly what is read
                for pg in rng.choice(REAL_PAGES // 2, size=300, replace=False):
                    os.pread(fd, 4096, int(pg) * 4096)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # readahead: large folios
                for off in range(REAL_PAGES // 2 * 4096, REAL_PAGES * 4096, 1 << 20):
                    os.pread(fd, 1 << 20, off)
            finally:
                os.close(fd)
            after = resident_map(real)
            got = _net(rec, pm) - base
        st = rec.read_stats()
    finally:
        rec.close()
    ino = os.stat(real).st_ino
    slot = pm.classify(np.full(REAL_PAGES, ino), np.arange(REAL_PAGES))
    want = np.bincount(slot, weights=after.astype(np.int64) - before.astype(np.int64), minlength=pm.n_slots)
    assert after[REAL_PAGES // 2:].all()  # the sequential half read whole
    got[N] = want[N] = 0  # unattributed: every other file of the device, not this test's
    bad = np.flatnonzero(got != want)
    assert not len(bad), [(int(s), int(got[s]), int(want[s])) for s in bad[:10]]
    assert got[: N].sum() > 0 and got[N + 1] > 0 and got[N + 2] > 0
    assert st["run_misses"] == 0 and st["unprocessed_pages"] == 0 and st["bitmap_misses"] == 0
    print(f"pages added {int((after & ~before).sum())} in {st['pool_dev_add_events']} add events on the device")
