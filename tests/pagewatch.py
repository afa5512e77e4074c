"""An independent watcher of a pool's page-cache pages for live tests.

The page cache is never quiet here: this machine's DAMON kdamond evicts clean page-cache
folios seconds after they were read, counted nowhere in /proc/vmstat (README.md,
"Tests"). A test that asserts "the second pass adds nothing" must know whether
anybody evicted pool pages in between. :class:`PageWatcher` is a second, ungated instance of
the pagecache probe on the pool's inodes, started before the test drops the pool and stopped
after its final mincore, streaming every add and delete (with its evictor class) through a
ring buffer polled by a thread. From its stream a test gets the pages added / deleted in any
interval (e.g. a recording's armed interval from its manifest) and every page's residency at
any moment, to hold the recordings against.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd


class PageWatcher:
    def __init__(self, pool_dir: Path, ring_pages: int = 1024):
        from moetrace.inputs.pool import open_pool
        from moetrace.kernel.bpf import require_tracefs
        from moetrace.kernel.features import Features
        from moetrace.record.probe import RecordContext
        from moetrace.record.probes import PROBES
        from moetrace.record.probes.pagecache import EVICTORS, PagecacheRecorder
        from moetrace.record.poolmap import pool_map
        from moetrace.record.spec import resolve

        spec = PROBES["pagecache"]
        self.evictors = EVICTORS
        self.pool = open_pool(pool_dir)
        self.pmap = pool_map(self.pool)
        # as record does: tracefs mounted first (when absent), then the plan. Resolved with tracefs
        # absent, every group is "unavailable" and the evictor contexts were switched off: the
        # watcher filed an fadvise from another process under "other" (measured)
        feats = Features("/")
        require_tracefs(feats)
        plan = resolve(spec, feats)
        assert plan.status != "no", plan.reason
        self.plan = plan
        self.dtype = spec.struct("page_event").dtype()
        # the pagecache probe's own recorder, ungated (always counting), streaming every add and
        # delete, following no process, no epochs
        ctx = RecordContext(features=feats, plan=plan, pmap=self.pmap, stream=True, gated=False,
                            stream_max_records=50_000_000,
                            knobs={"MOE_TRACK_READS": 0, "MOE_FOLLOW_FORKS": 0, "MOE_RING_PAGES": ring_pages,
                                   "MOE_EPOCHS": 0})
        self.rec = PagecacheRecorder(ctx).open()
        self.stream = self.rec.stream
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        self.started_ns = time.monotonic_ns()
        self.events: pd.DataFrame | None = None

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.stream.poll(50)

    def stop(self) -> pd.DataFrame:
        """Stop, detach, and return the events (ring order): ts_ns, expert_id, kind (0 add,
        1 delete), first_page, pages, evictor (name, deletes only)."""
        if self.events is not None:
            return self.events
        self._stop.set()
        self._thread.join()
        self.stream.poll(0)
        self.rec.close()  # drains the ring, closes the last interval, detaches
        self.lost = self.stream.lost_kernel + self.stream.lost_user
        raw = self.rec.events_raw or b""
        ev = pd.DataFrame(np.frombuffer(raw, self.dtype))
        if ev.empty:
            ev = pd.DataFrame({c: pd.Series(dtype="int64") for c in self.dtype.names})
        ev["evictor_name"] = [self.evictors[i] if k == 1 else None for i, k in zip(ev["evictor"], ev["kind"])]
        self.events = ev.reset_index(drop=True)
        return self.events

    def pool_events(self) -> pd.DataFrame:
        ev = self.stop()
        return ev[ev["expert_id"] < self.pmap.n_total]

    def pages(self, kind: int, t0: int | None = None, t1: int | None = None) -> np.ndarray:
        """Pages added (kind 0) or deleted (1) per expert with t0 < ts <= t1."""
        ev = self.pool_events()
        ev = ev[ev["kind"] == kind]
        if t0 is not None:
            ev = ev[ev["ts_ns"] > t0]
        if t1 is not None:
            ev = ev[ev["ts_ns"] <= t1]
        return np.bincount(ev["expert_id"].to_numpy(np.int64), weights=ev["pages"].to_numpy(np.int64),
                           minlength=self.pmap.n_total).astype(np.int64)

    def deleted_by(self, t0: int | None = None, t1: int | None = None) -> dict[str, int]:
        """Pool pages deleted per evictor class with t0 < ts <= t1."""
        ev = self.pool_events()
        ev = ev[ev["kind"] == 1]
        if t0 is not None:
            ev = ev[ev["ts_ns"] > t0]
        if t1 is not None:
            ev = ev[ev["ts_ns"] <= t1]
        return {k: int(v) for k, v in ev.groupby("evictor_name")["pages"].sum().items()}

    def resident(self, at_ns: int | None = None, since_ns: int | None = None) -> np.ndarray:
        """Resident pages per expert at ``at_ns`` (default: the end), replaying the stream in
        ring order from ``since_ns`` (default: the start), when every pool page is taken as
        absent (the test dropped the pool right after the watcher started)."""
        ev = self.pool_events()
        if since_ns is not None:
            ev = ev[ev["ts_ns"] > since_ns]
        if at_ns is not None:
            ev = ev[ev["ts_ns"] <= at_ns]
        ppe = self.pmap.pages_per_expert
        bits = np.zeros((self.pmap.n_total, ppe), bool)
        for eid, kind, first, n in zip(ev["expert_id"], ev["kind"], ev["first_page"], ev["pages"]):
            bits[eid, first:first + n] = kind == 0
        return bits.sum(axis=1)


def armed_interval(manifest: dict) -> tuple[tuple[int, int], tuple[int, int]]:
    """A recording's counting interval (CLOCK_MONOTONIC ns) from its manifest: (inner, outer),
    the probes counted at least over inner and at most over outer (arming takes microseconds)."""
    iv = manifest["interval"]
    return ((int(iv["armed_done_ns"]), int(iv["disarm_start_ns"])), (int(iv["armed_ns"]), int(iv["disarmed_ns"])))


def check_recorded(w: PageWatcher, manifest: dict, added, evicted) -> None:
    """A recording's per-expert added / evicted pages lie between what the watcher saw over the
    recording's inner and outer interval (exactly equal unless an event fell into the
    microseconds of arming)."""
    (i0, i1), (o0, o1) = armed_interval(manifest)
    for kind, got in ((0, added), (1, evicted)):
        lo, hi = w.pages(kind, i0, i1), w.pages(kind, o0, o1)
        got = np.asarray(got, np.int64)
        assert ((lo <= got) & (got <= hi)).all(), (kind, got.tolist(), lo.tolist(), hi.tolist())


def check_left_in_cache(w: PageWatcher, manifest: dict, added, evicted, resident, t_drop: int, t_m0: int,
                        t_m1: int) -> None:
    """After a recording: its added / evicted pages agree with the watcher over its armed
    interval, mincore (taken between t_m0 and t_m1) lies within the watcher's residency, and
    what is left per expert is added - evicted less what others evicted after the probes
    stopped counting — exactly added - evicted when nobody did."""
    assert w.lost == 0
    check_recorded(w, manifest, added, evicted)
    res = np.asarray(resident)
    lo_res, hi_res = w.resident(t_m1, t_drop), w.resident(t_m0, t_drop)
    assert ((lo_res <= res) & (res <= hi_res)).all(), (res.tolist(), lo_res.tolist(), hi_res.tolist())
    o1 = armed_interval(manifest)[1][1]
    later = w.pages(1, o1, t_m1)  # pool pages deleted after the probes stopped counting
    print(f"pool pages deleted after the recording by {w.deleted_by(o1, t_m1) or 'nobody'}")
    gap = (np.asarray(added, np.int64) - np.asarray(evicted, np.int64)) - res
    assert ((gap >= 0) & (gap <= later)).all(), (gap.tolist(), later.tolist())
    if not later.any():
        assert gap.tolist() == [0] * len(gap)
