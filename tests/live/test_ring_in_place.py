"""Live: the probes' rings are read in place (moetrace.kernel.libbpf.MmapRing), and nothing the
kernel wrote is lost without being counted."""

from __future__ import annotations

import numpy as np
import pytest

from common.record import MIB, N, _drop, pools  # noqa: F401
from conftest import io_lock

pytestmark = pytest.mark.live


def _read_all(files, which) -> None:
    for i in which:
        with open(files[i], "rb", buffering=0) as f:
            while f.read(MIB):
                pass


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
    from moetrace.record.poolmap import pool_map
    from moetrace.record.spec import resolve

    pool = pools["files"]
    feats = Features("/")
    require_tracefs(feats)
    ctx = RecordContext(features=feats, plan=resolve(PROBES["pagecache"], feats), pmap=pool_map(open_pool(pool)),
                        stream=True, gated=True,
                        knobs={"MOE_TRACK_READS": 0, "MOE_FOLLOW_FORKS": 0, "MOE_RING_PAGES": 1})
    files = sorted(pool.rglob("*.bin"))
    with io_lock():
        rec = PagecacheRecorder(ctx).open()
        try:
            assert rec.stream._reader is not None
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
