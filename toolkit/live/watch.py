"""``moetrace watch``: the counting probes on a running host, read every interval.

The probes are the recorder's own (:mod:`moetrace.record.probes`), loaded ungated (counting from
attach) with no per-page stream: pagecache keeps per-expert added / evicted / re-added pages and
evictions per evictor class in kernel arrays, block its per-expert device bytes (one ring record
per bio, attributed as it arrives). Memory is bounded by the pool's expert count, never by time.
Every interval the watcher reads those cumulative counters and the scope's kernel counters
(:mod:`moetrace.live.host`); :func:`moetrace.live.interval.figures` turns two readings into the
interval. A process given by ``--pid`` (and its children) or every process of ``--cgroup`` is
followed for its read calls; the page-cache counts are the pool's, whoever touches it.

::

    w = Watcher(WatchOptions(pool="/var/tmp/pool", cgroup="/sys/fs/cgroup/memory/serve"))
    w.open()
    try:
        while not w.ended():
            fig = w.step()          # waits one interval, returns its figures
    finally:
        fig = w.finish()            # the last (partial) interval, read after draining; detached
"""

from __future__ import annotations

import os
import select
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from moetrace.errors import UsageError
from moetrace.kernel.syscalls import close_fd
from moetrace.live.host import cgroup_pids, cgroup_version, read_scope
from moetrace.live.interval import Reading, figures

#: the counting probes watch attaches (no per-page stream)
WATCH_PROBES = ("pagecache", "block")


@dataclass
class WatchOptions:
    pool: str | None = None
    pid: int | None = None
    cgroup: str | None = None
    interval: float = 1.0
    count: int | None = None
    top: int = 10
    probes: tuple[str, ...] = WATCH_PROBES
    thresholds: dict[str, float] = field(default_factory=dict)
    #: computed misses: stream the followed processes' read calls (the reads probe, one record
    #: per call) through an LRU stack of the pool's resident size (needs --pool)
    misses: bool = True
    #: how often the rings are drained (and a cgroup's new processes followed) within an interval
    poll_s: float = 0.25
    #: the reads stream's ring, in pages: 8 MiB hold ~80k calls (8 s of 10k calls/s between polls)
    ring_pages: int = 2048


def _knobs(name: str, opts: WatchOptions) -> dict[str, int]:
    """Knobs of watch's probes: no per-epoch counters; the reads stream's ring sized for polls."""
    return {"pagecache": {"MOE_EPOCHS": 0}, "reads": {"MOE_RINGBUF_PAGES": opts.ring_pages}}.get(name, {})


class Watcher:
    """Attach, follow, read every interval, detach (see the module doc)."""

    def __init__(self, opts: WatchOptions, say: Callable[[str], None] = lambda s: None):
        self.opts, self.say = opts, say
        self.recs: list[Any] = []
        self.notes: list[str] = []
        self.followed: set[int] = set()
        self.pmap = None
        self.prev: Reading | None = None
        self.pidfd: int | None = None
        self.end_reason: str | None = None
        #: set by a signal handler (the CLI's): the loop ends after the step in flight
        self.stop_reason: str | None = None
        self.n_experts = self.n_per_layer = 0
        self.stack = None  # moetrace.analyses.stackdist.LiveStack when computing misses
        self.extent_bytes = self.ppe = self.resident0 = 0
        self.cum = {"accesses": 0, "miss_bytes": 0, "lost_calls": 0, "requested_bytes": 0}

    # -- attach ---------------------------------------------------------------------------------
    def _check_scope(self) -> None:
        o = self.opts
        if o.pid is not None and o.cgroup is not None:
            raise UsageError("--pid and --cgroup name the same thing twice", hint="give one of them")
        if o.pid is not None:
            try:
                self.pidfd = os.pidfd_open(o.pid)
            except ProcessLookupError:
                raise UsageError(f"--pid {o.pid}: no such process", hint="ps -e lists the running ones") from None
        if o.cgroup is not None and cgroup_version(o.cgroup) is None:
            raise UsageError(f"--cgroup {o.cgroup}: not a memory cgroup directory (no memory.stat)",
                             hint="e.g. /sys/fs/cgroup/<name> (v2) or /sys/fs/cgroup/memory/<name> (v1)")
        if o.interval <= 0:
            raise UsageError(f"interval {o.interval}: must be > 0 seconds")

    def open(self) -> "Watcher":
        """Check the scope, map the pool, load and attach every probe, take the first reading."""
        from moetrace.kernel.features import Features
        from moetrace.record.probe import RecordContext
        from moetrace.record.probes import PROBES, recorder_class
        from moetrace.record.poolmap import open_pool_map
        from moetrace.record.recorder import check_can_record
        from moetrace.record.spec import resolve

        self._check_scope()
        if self.opts.pool is not None:
            self.pmap = pm = open_pool_map(self.opts.pool)  # a pool directory or a model file
            self.n_experts, self.n_per_layer = pm.n_total, pm.n_experts
            self.extent_bytes, self.ppe = pm.extent_bytes, pm.pages_per_expert
        else:
            self.notes.append("no --pool: every page-cache page is unattributed, no per-expert figures")
        probes = tuple(self.opts.probes)
        if self.opts.misses and self.pmap is not None and "reads" not in probes:
            probes += ("reads",)
        feats = Features("/")
        check_can_record(feats, probes)
        try:
            for name in probes:
                plan = resolve(PROBES[name], feats)
                ctx = RecordContext(features=feats, plan=plan, pmap=self.pmap, notes=self.notes, say=self.say,
                                    gated=False, recording=probes, stream=name == "reads",
                                    stream_max_records=1_000_000,
                                    knobs=_knobs(name, self.opts))
                self.say(f"loading and attaching {name} ...")
                rec = recorder_class(name)(ctx)
                self.recs.append(rec)
                rec.open()
            self.follow_new()
            if self._rec("reads") is not None:
                self._start_stack()
            self.prev = self.read()
        except BaseException:
            self.abort()
            raise
        return self

    def follow_new(self) -> None:
        """Follow the process, or the cgroup's processes not followed yet (children of a
        followed process are followed by the probe itself)."""
        pids = [self.opts.pid] if self.opts.pid is not None else (
            cgroup_pids(self.opts.cgroup) if self.opts.cgroup is not None else [])
        for pid in pids:
            if pid not in self.followed:
                for r in self.recs:
                    r.follow(pid)
                self.followed.add(pid)

    def _start_stack(self) -> None:
        """The LRU stack of computed misses, and the experts' pages resident now (mincore): the
        resident size is that plus what the probes see added, less what they see evicted."""
        from moetrace.analyses.stackdist import LiveStack

        self.stack = LiveStack(self.n_experts)
        LiveStack(1).feed([0])  # numba's kernel loaded now, while attaching, not in the first busy interval
        self.resident0 = self.pmap.resident_expert_pages()

    # -- read -----------------------------------------------------------------------------------
    def _rec(self, name: str):
        return next((r for r in self.recs if r.name == name), None)

    def read(self, extra: dict[str, Any] | None = None) -> Reading:
        """A reading now; ``extra``: the accesses already taken (finish takes them before the
        reads probe detaches)."""
        pc, blk = self._rec("pagecache"), self._rec("block")
        pcc = pc.counters() if pc else None
        if extra is None and self.stack is not None:
            extra = self._accesses(pcc)
        cg = self.opts.cgroup
        if cg is not None and not Path(cg).is_dir() and self.prev is not None:
            scope = self.prev.scope  # removed meanwhile: nothing more to say (never the host's instead)
        else:
            scope = read_scope(cg)
        return Reading(t_ns=time.monotonic_ns(), pagecache=pcc, block=blk.counters() if blk else None, scope=scope,
                       followed=len(self.followed), extra=extra or {})

    def capacity_experts(self, pc: dict[str, Any] | None) -> int:
        """Experts the pool's resident pages hold now (the computed LRU's capacity), from the
        pagecache probe's counters ``pc`` read now."""
        pages = self.resident0
        if pc is not None:
            n = self.n_experts
            pages += int(pc["added_pages"][:n].sum()) - int(pc["evicted_pages"][:n].sum())
        return max(pages, 0) // max(self.ppe, 1)

    def _accesses(self, pc: dict[str, Any] | None) -> dict[str, Any]:
        """Feed the calls streamed since the last reading through the LRU stack: cumulative
        accesses, computed miss bytes and lost calls; this interval's hit-only latency."""
        import numpy as np

        from moetrace.analyses.stackdist import lru_misses

        c, lost = self._rec("reads").take_calls()
        order = np.argsort(c["ts_ns"], kind="stable")
        ok = order[(c["expert_id"][order] >= 0) & (c["ret"][order] > 0)]
        cap = self.capacity_experts(pc)
        d = self.stack.feed(c["expert_id"][ok])
        self.cum["accesses"] += len(ok)
        self.cum["requested_bytes"] += int(c["ret"][ok].sum())
        self.cum["miss_bytes"] += int(lru_misses(d, cap).sum()) * self.extent_bytes
        self.cum["lost_calls"] += lost
        hit = c["latency_ns"][c["hit_only"]]
        q = np.percentile(hit, [50, 99]) if len(hit) else (None, None)
        return dict(self.cum, capacity_experts=cap, hit_only_p50_ns=None if q[0] is None else float(q[0]),
                    hit_only_p99_ns=None if q[1] is None else float(q[1]))

    def _figures(self, cur: Reading) -> dict[str, Any]:
        from moetrace.live.alarms import judge

        fig = figures(self.prev, cur, self.n_experts, self.n_per_layer, self.opts.top)
        fig["alarms"] = judge(fig, self.opts.thresholds)
        self.prev = cur
        return fig

    def wait(self, seconds: float) -> None:
        """Wait one interval, draining the probes' rings every ``poll_s``; less when the watched
        process ends."""
        t_end = time.monotonic() + max(seconds, 0.0)
        pollers = [r for r in self.recs if r.needs_poll]
        drained = time.monotonic()
        while (left := t_end - time.monotonic()) > 0 and self.stop_reason is None:
            # a cgroup's newcomers are looked for every 50 ms (a replay reads ~0.3 s after it joins)
            step = min(left, 0.05 if self.opts.cgroup is not None else self.opts.poll_s)
            if self.pidfd is not None and select.select([self.pidfd], [], [], step)[0]:
                self.end_reason = f"process {self.opts.pid} exited"
                return
            if self.pidfd is None:
                time.sleep(step)
            if time.monotonic() - drained >= self.opts.poll_s - 1e-3:
                drained = time.monotonic()
                for r in pollers:
                    r.poll(0)
            if self.opts.cgroup is not None:  # a process that joined since: followed within poll_s
                self.follow_new()

    def ended(self) -> bool:
        """The watched process exited, the cgroup was removed, or a stop was asked for."""
        if self.stop_reason is not None:
            return True
        if self.end_reason is None and self.opts.cgroup is not None and not Path(self.opts.cgroup).is_dir():
            self.end_reason = f"cgroup {self.opts.cgroup} was removed"
        return self.end_reason is not None

    def step(self) -> dict[str, Any]:
        """Wait one interval and return its figures (alarms judged)."""
        self.wait(self.opts.interval)
        if self.opts.cgroup is not None:
            self.follow_new()
        return self._figures(self.read())

    # -- detach ---------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any] | None:
        """The last interval, read once every probe drained and collected; then detached."""
        if not self.recs or self.prev is None:
            self.abort()
            return None
        try:
            pc = self._rec("pagecache")
            extra = self._accesses(pc.counters() if pc else None) if self.stack is not None else None
            for r in self.recs:
                r.close()
            return self._figures(self.read(extra))
        finally:
            self.abort()

    def abort(self) -> None:
        """Detach everything, and unmount the debugfs / tracefs this process mounted for the
        probes, as record does (never raises; a no-op in the CLI's own mount namespace)."""
        from moetrace.kernel.features import unmount_ours

        for r in self.recs:
            r.abort()
        try:
            for note in unmount_ours():
                self.say(note)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        close_fd(self.pidfd)
        self.pidfd = None
