"""Live: the CO-RE objects loaded by libbpf count exactly what the bcc programs count.

One deterministic workload (drop the pool, read every expert, drop every other expert, read
them all again) recorded by both paths of a probe at once: the bcc compile of probes/<name>.c
and the compiled probes/build/<name>.bpf.o, the two armed together (two stores microseconds
apart) and disarmed together. Their per-expert tables are equal, entry by entry, and the
workload's own figures hold (every page added once, the dropped half re-added once), held
against mincore. Runs while both paths exist (issue 18: the bcc path is measured, then goes).

block and reclaim likewise: one read workload of the pool (per expert device bytes and bios),
one memcg limit reclaim under a 64 MiB memory scope (the memcg reclaimer's counts)."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

from common.record import MIB, N, PAGES, _drop, _resident_pages, pools  # noqa: F401
from common.reclaim_probe import file_set  # noqa: F401  (fixture)
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


# -- block: both loaders over one read workload of the pool ----------------------------------

def _open_block(backend: str, monkeypatch, idx, feats, plan):
    from moetrace.record.probes.block import BlockRecorder

    monkeypatch.setenv("MOETRACE_BPF_BACKEND", backend)
    rec = BlockRecorder(idx, features=feats, plan=plan, gated=True, arm_at_open=False).open()
    assert rec.probe.backend == backend
    return rec


def test_block_core_equals_bcc_on_one_workload(live, pools, monkeypatch):
    """The pool file (one file, 23 extents): dropped, read once buffered (readahead runs ahead
    across extents) and once with O_DIRECT (one 1 MiB read per expert). Both loaders see the
    same bios: per expert the same device bytes and bio counts, the same in-kernel totals of
    the bytes tracepoint; the O_DIRECT pass alone reads each expert's sectors once."""
    from common.block_probe import _read_each_once
    from moetrace.inputs.pool import open_pool
    from moetrace.kernel.bpf import require_tracefs
    from moetrace.kernel.extents import pool_extents
    from moetrace.kernel.features import Features
    from moetrace.record.probes import PROBES
    from moetrace.record.spec import resolve

    pool = open_pool(pools["pool"])
    idx = pool_extents(pool)
    assert idx.problems == {}
    feats = Features("/")
    require_tracefs(feats)
    plan = resolve(PROBES["block"], feats)
    with io_lock(), contextlib.ExitStack() as stack:
        recs = []
        for backend in ("bcc", "core"):
            recs.append(_open_block(backend, monkeypatch, idx, feats, plan))
            stack.callback(recs[-1].close)  # idempotent: detaches also when a read fails
        _drop(pools["pool"])
        for r in recs:
            r.arm(True)
        _read_each_once(pool, direct=False)
        _read_each_once(pool, direct=True)
        for r in reversed(recs):
            r.arm(False)
        bcc, core = [r.close() for r in recs]
    print(f"\nblock: bcc load {bcc.compile_s:.3f} s, core load {core.compile_s:.3f} s; attributed "
          f"{core.attributed_bytes} B, bios {int(core.per_expert['bios'].sum())}")
    for col in ("device_read_bytes", "bios"):
        assert np.array_equal(bcc.per_expert[col], core.per_expert[col]), (col, bcc.per_expert[col].tolist(),
                                                                           core.per_expert[col].tolist())
    assert bcc.lost_events == core.lost_events == 0
    assert bcc.streamed_bios == bcc.kernel_bios and core.streamed_bios == core.kernel_bios
    # the interval's other bios (the disk is shared) are counted alike unless one fell between the
    # two arming stores: the pool's are not
    assert bcc.attributed_bytes == core.attributed_bytes
    assert (core.per_expert["device_read_bytes"] >= MIB).all() and (core.per_expert["bios"] >= 2).all()
    assert core.compile_s < bcc.compile_s


# -- reclaim: both loaders over one memcg limit reclaim ---------------------------------------

def test_reclaim_core_equals_bcc_on_memcg_reclaim(live, monkeypatch, file_set):
    """A reader in a 64 MiB memory scope (cgroup v1 memory.limit_in_bytes here) reads 256 MiB
    twice: memcg limit reclaim, on the reader's task only, inside the armed interval. Both
    loaders see the same windows and the same shrink events: the memcg row is equal column by
    column (durations are each program's own clock readings: their sums differ by nanoseconds,
    so only the invocation counts of the histogram are compared)."""
    import subprocess
    import sys

    from common.reclaim_probe import READER, _mounted
    from moetrace.capacity.scope import Scope
    from moetrace.record.probes.reclaim import ReclaimRecorder

    feats = _mounted()
    scope = Scope(f"core-loader-{os.getpid()}")
    scope.create(64 * MIB)
    try:
        with io_lock(), contextlib.ExitStack() as stack:
            recs = []
            for backend in ("bcc", "core"):
                monkeypatch.setenv("MOETRACE_BPF_BACKEND", backend)
                recs.append(ReclaimRecorder(features=feats, gated=True).open())
                stack.callback(recs[-1].close)  # idempotent: detaches also when the reader fails
                assert recs[-1].probe.backend == backend
            for r in recs:
                r.arm(True)
            out = subprocess.run([sys.executable, "-c", READER, "2", *map(str, file_set)],
                                 preexec_fn=scope.preexec(), capture_output=True, text=True, timeout=300)
            for r in reversed(recs):
                r.arm(False)
            bcc, core = [r.close() for r in recs]
    finally:
        scope.remove(kill=True)
    assert out.returncode == 0, out.stderr
    assert not scope.exists()
    b, c = bcc.kind("memcg"), core.kind("memcg")
    print(f"\nreclaim: bcc load {bcc.compile_s:.3f} s, core load {core.compile_s:.3f} s; memcg invocations "
          f"{int(c['invocations'])} scanned {int(c['scanned_pages'])} reclaimed {int(c['reclaimed_pages'])}")
    assert c["reclaimed_pages"] > 0 and c["invocations"] > 0
    for col in ("invocations", "completed", "scanned_pages", "reclaimed_pages", "end_reclaimed_pages",
                "scanned_file_pages", "reclaimed_file_pages", "inactive_calls", "active_calls",
                "active_taken_pages", "isolate_calls", "isolate_taken_pages", "dirty_pages", "ref_keep_pages"):
        assert b[col] == c[col], (col, b[col], c[col])
    assert sum(b["histogram"].values()) == sum(c["histogram"].values()) == c["completed"]
    assert bcc.stats == core.stats and core.stats["task_map_full"] == 0
    assert core.compile_s < bcc.compile_s


def test_ring_read_in_place_wraps_and_accounts_for_every_record(live, pools):
    """The CO-RE probes' rings are read in place (moetrace.kernel.libbpf.MmapRing: every ready
    record in one numpy step, no Python call per record). A one-page ring (85 page records)
    wraps around hundreds of times while the pool is read: every record the kernel made is
    either kept or counted as dropped, exactly. In the files layout a folio lies in one expert's
    file, so each pool-device event makes exactly one record."""
    import threading

    from moetrace.inputs.pool import open_pool
    from moetrace.kernel.bpf import require_tracefs
    from moetrace.kernel.features import Features
    from moetrace.record.probe import RecordContext
    from moetrace.record.probes import PROBES
    from moetrace.record.probes.pagecache import PAGE_EVENT_DTYPE, PagecacheRecorder
    from moetrace.record.recorder import pool_map
    from moetrace.record.spec import resolve

    pool = pools["files"]
    feats = Features("/")
    require_tracefs(feats)
    ctx = RecordContext(features=feats, plan=resolve(PROBES["pagecache"], feats), pmap=pool_map(open_pool(pool)),
                        stream=True, gated=True, knobs={"TRACK_READS": 0, "FOLLOW_FORKS": 0, "RING_PAGES": 1})
    files = sorted(pool.rglob("*.bin"))
    with io_lock():
        rec = PagecacheRecorder(ctx).open()
        try:
            assert rec.probe.backend == "core" and rec.stream._reader is not None
            stop = threading.Event()
            t = threading.Thread(target=lambda: [rec.poll(5) for _ in iter(stop.is_set, True)])
            _drop(pool)
            rec.arm(True)
            t.start()
            for _ in range(3):
                _read_all(files, range(N))
                _drop(pool)
            rec.arm(False)
            stop.set()
            t.join()
            rec.close()
        finally:
            rec.abort()
    kept = len(rec.events_raw) // PAGE_EVENT_DTYPE.itemsize
    st = rec.stats
    assert kept + st["ring_drops"] == st["pool_dev_add_events"] + st["pool_dev_delete_events"]
    assert rec.stream.lost_kernel == st["ring_drops"] and kept > 85 * 4  # wrapped, and was drained meanwhile
    ev = np.frombuffer(rec.events_raw, PAGE_EVENT_DTYPE)
    assert (ev["pages"] > 0).all() and set(np.unique(ev["kind"])) <= {0, 1}


# -- reads: both loaders over one deterministic pread workload of this process ---------------

def _pread_workload(path, chunk: int) -> tuple[int, int]:
    """Cold then hot preads of ``path`` in ``chunk`` calls, a preadv2 of two iovecs, read() of a
    fresh fd to the end, and one pread on a closed fd (EBADF): (read calls, bytes read)."""
    calls = nbytes = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        for _pass in range(2):
            for off in range(0, size, chunk):
                nbytes += len(os.pread(fd, chunk, off))
                calls += 1
        nbytes += os.preadv(fd, [bytearray(chunk), bytearray(chunk)], 0)
        calls += 1
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            calls += 1
            got = len(os.read(fd, chunk))
            nbytes += got
            if not got:
                break
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        os.pread(fd, 16, 0)
    return calls + 1, nbytes


def test_reads_core_equals_bcc_on_one_workload(live, tmp_path, monkeypatch):
    """This process, followed by both loaders at once (armed together): a 4 MiB file dropped
    from the cache, read twice with 256 KiB preads (cold: misses or readahead hits; hot: hits),
    one preadv2, read() to the end and one EBADF. Per class both count the same calls, bytes,
    requested bytes and pages, and per syscall the same calls; the workload's own figures hold
    (every call and byte of it counted, one error)."""
    from moetrace.kernel.bpf import require_tracefs
    from moetrace.kernel.features import Features
    from moetrace.record.probe import RecordContext
    from moetrace.record.probes import PROBES
    from moetrace.record.probes.reads import CLASSES, ReadsRecorder
    from moetrace.record.spec import resolve

    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(4 * MIB))
    feats = Features("/")
    require_tracefs(feats)
    plan = resolve(PROBES["reads"], feats)
    with io_lock():
        recs = []
        try:
            for backend in ("bcc", "core"):
                monkeypatch.setenv("MOETRACE_BPF_BACKEND", backend)
                ctx = RecordContext(features=feats, plan=plan, gated=True, log_dir=tmp_path)
                recs.append(ReadsRecorder(ctx).open())
                assert recs[-1].probe.backend == backend
                recs[-1].follow(os.getpid())
            _drop(tmp_path)
            for r in recs:
                r.arm(True)
            calls, nbytes = _pread_workload(f, 256 << 10)
            for r in reversed(recs):
                r.arm(False)
            for r in recs:
                r.close()
        finally:
            for r in recs:
                r.abort()
    bcc, core = (r.col for r in recs)
    print(f"\nreads: bcc load {recs[0].compile_attach_s:.3f} s, core {recs[1].compile_attach_s:.3f} s; "
          f"classes {core.classes}")
    for cls in CLASSES:
        for fld in ("calls", "bytes", "requested_bytes", "added_pages", "beyond_pages", "other_pages"):
            assert bcc.classes[cls][fld] == core.classes[cls][fld], (cls, fld, bcc.classes[cls], core.classes[cls])
    assert bcc.hist.sum(axis=1).tolist() == core.hist.sum(axis=1).tolist()  # calls per class; slots: own clocks
    for k in ("calls_pread64", "calls_preadv", "calls_preadv2", "calls_read", "closes", "exit_without_enter"):
        assert bcc.stats[k] == core.stats[k], k
    assert sum(c["calls"] for c in core.classes.values()) >= calls  # the test's own reads: no other thread
    assert core.classes["error"]["calls"] >= 1 and core.bad_fd["error_calls"] == bcc.bad_fd["error_calls"] == 1
    assert sum(c["bytes"] for c in core.classes.values()) >= nbytes
    assert core.classes["miss"]["calls"] >= 1 and core.classes["hit_only"]["calls"] >= 16
    assert recs[1].compile_attach_s < recs[0].compile_attach_s


# -- lru: both loaders over the pagecache workload ---------------------------------------------

def test_lru_core_equals_bcc_on_one_workload(live, pools, monkeypatch):
    """The pagecache workload (drop the pool, read every expert, drop every other expert, read
    them all again) under both lru loaders armed together, the LRU batches drained while both
    count: per expert the same pages added, inserted (by list), activated and evicted (dwell and
    activation counts too; the ns sums are each program's own clock readings). Insertions equal
    additions (the join), every page of the first pass added once."""
    from moetrace.inputs.pool import open_pool
    from moetrace.kernel.bpf import require_tracefs
    from moetrace.kernel.features import Features
    from moetrace.record.probe import RecordContext
    from moetrace.record.probes import PROBES
    from moetrace.record.probes.lru import LruRecorder
    from moetrace.record.recorder import pool_map
    from moetrace.record.spec import resolve

    pool = pools["files"]
    pmap = pool_map(open_pool(pool))
    feats = Features("/")
    require_tracefs(feats)
    plan = resolve(PROBES["lru"], feats)
    files = sorted(pool.rglob("*.bin"))
    with io_lock():
        recs = []
        try:
            for backend in ("bcc", "core"):
                monkeypatch.setenv("MOETRACE_BPF_BACKEND", backend)
                recs.append(LruRecorder(RecordContext(features=feats, plan=plan, pmap=pmap, gated=True)).open())
                assert recs[-1].probe.backend == backend
            _drop(pool)
            for r in recs:
                r.arm(True)
            _read_all(files, range(N))
            for i in range(0, N, 2):
                fd = os.open(files[i], os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            _read_all(files, range(N))
            recs[0].settle()  # drains every CPU's LRU batches: both are still counting
            for r in reversed(recs):
                r.arm(False)
            for r in recs:
                r.close()
        finally:
            for r in recs:
                r.abort()
    bcc, core = (r.table[r.table["kind"] == "expert"] for r in recs)
    print(f"\nlru: bcc load {recs[0].compile_attach_s:.3f} s, core {recs[1].compile_attach_s:.3f} s; core stats "
          f"{recs[1].stats}")
    for col in ("added_pages", "inserted_pages", "inserted_inactive_pages", "inserted_active_pages",
                "inserted_unevictable_pages", "inserted_other_pages", "activated_pages", "activation_dwell_count",
                "evicted_pages", "evicted_joined_pages", "evicted_activated_pages", "dwell_count"):
        assert bcc[col].tolist() == core[col].tolist(), (col, bcc[col].tolist(), core[col].tolist())
    # the pool's device is shared: its other pages' events between the two arming stores count for
    # bcc only (armed first, disarmed last), never the other way round
    for k in ("pool_dev_add_events", "pool_dev_delete_events"):
        assert recs[0].stats[k] >= recs[1].stats[k], k
    for k in ("unprocessed_pages", "join_update_failed"):
        assert recs[0].stats[k] == recs[1].stats[k] == 0, k
    assert core["inserted_pages"].tolist() == core["added_pages"].tolist()
    dropped = np.array([PAGES if i % 2 == 0 else 0 for i in range(N)])
    assert (core["evicted_pages"].to_numpy() >= dropped).all() and (core["added_pages"].to_numpy() >= PAGES).all()
    assert recs[1].compile_attach_s < recs[0].compile_attach_s
