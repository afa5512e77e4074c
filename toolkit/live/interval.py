"""One interval of ``moetrace watch``: the difference of two cumulative readings, as figures.

A reading is what :class:`moetrace.live.watch.Watcher` samples: the pagecache probe's per-slot
counters (experts, then the unattributed slot), the block probe's per-expert device bytes, and
the scope's kernel counters (:func:`moetrace.live.host.read_scope`). Everything here is pure:
numbers in, a JSON-ready dict out, so the figures are tested without a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moetrace.run.evictors import EVICTORS

PAGE = 4096
#: evictor classes that are the kernel reclaiming under pressure; every other class is outside
#: the serving process's own demand (DAMON, proactive reclaim, fadvise, drop_caches, truncation)
RECLAIM_EVICTORS = ("kswapd", "direct", "memcg")
OUTSIDE_EVICTORS = tuple(e for e in EVICTORS if e not in RECLAIM_EVICTORS)


@dataclass
class Reading:
    """Cumulative counts at one instant (CLOCK_MONOTONIC ns)."""

    t_ns: int
    pagecache: dict[str, Any] | None
    block: dict[str, Any] | None
    scope: dict[str, Any]
    #: processes followed so far (the pid, or the cgroup's members)
    followed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _d(cur: dict | None, prev: dict | None, key: str):
    if cur is None or cur.get(key) is None:
        return None
    a = cur[key]
    b = prev.get(key) if prev is not None else None
    if isinstance(a, np.ndarray):
        return a - b if b is not None else a.copy()
    return a - (b or 0)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else float(a) / float(b)


def _pool(dpc: dict | None, dblk: dict | None, n: int, dt: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if dpc is not None:
        out.update({"requested_bytes": int(dpc["read_bytes"]), "read_calls": int(dpc["read_calls"]),
                    "added_pages": int(dpc["added_pages"][:n].sum()),
                    "re_added_pages": int(dpc["re_added_pages"][:n].sum()),
                    "evicted_pages": int(dpc["evicted_pages"][:n].sum()),
                    "evicted_by": {ev: int(dpc["evicted_by"][:n, i].sum()) for i, ev in enumerate(EVICTORS)},
                    "unattributed_added_pages": int(dpc["added_pages"][n:].sum())})
    if dblk is not None:
        dev = int(dblk["device_read_bytes"][:n].sum())
        out.update({"device_read_bytes": dev, "device_read_bytes_per_s": dev / dt if dt > 0 else None,
                    "unattributed_device_read_bytes": int(dblk["unattributed_bytes"]),
                    "lost_bios": int(dblk["lost_events"])})
    return out


def _accesses(prev: Reading | None, cur: Reading, dev: int | None) -> dict[str, Any]:
    """Computed misses (an LRU of the pool's resident size over the observed expert accesses)
    and the amplification of the device bytes over them; hit-only read latency."""
    x, px = cur.extra, (prev.extra if prev is not None else {})
    if "miss_bytes" not in x:
        return {}
    miss = x["miss_bytes"] - px.get("miss_bytes", 0)
    return {"requested_bytes": x["requested_bytes"] - px.get("requested_bytes", 0),
            "expert_accesses": x["accesses"] - px.get("accesses", 0),
            "lost_accesses": x["lost_calls"] - px.get("lost_calls", 0),
            "lru_capacity_experts": x.get("capacity_experts"), "computed_miss_bytes": miss,
            "amplification": (dev / miss) if dev is not None and miss > 0 else None,
            "hit_only_p50_ns": x.get("hit_only_p50_ns"), "hit_only_p99_ns": x.get("hit_only_p99_ns")}


def _experts(dpc: dict | None, dblk: dict | None, n: int, n_per_layer: int, top: int) -> list[dict[str, Any]]:
    """The top experts of the interval by re-added, then added pages, then device bytes."""
    if dpc is None and dblk is None:
        return []
    zero = np.zeros(n, dtype=np.int64)
    add = dpc["added_pages"][:n] if dpc is not None else zero
    re = dpc["re_added_pages"][:n] if dpc is not None else zero
    ev = dpc["evicted_pages"][:n] if dpc is not None else zero
    out_ev = dpc["evicted_by"][:n, [EVICTORS.index(e) for e in OUTSIDE_EVICTORS]].sum(axis=1) if dpc is not None else zero
    dev = dblk["device_read_bytes"][:n] if dblk is not None else zero
    active = np.flatnonzero((add > 0) | (re > 0) | (ev > 0) | (dev > 0))
    order = active[np.lexsort((-dev[active], -add[active], -re[active]))][:top]
    e = max(n_per_layer, 1)
    return [{"layer": int(i // e), "expert": int(i % e), "added_pages": int(add[i]), "re_added_pages": int(re[i]),
             "evicted_pages": int(ev[i]), "outside_evicted_pages": int(out_ev[i]), "device_read_bytes": int(dev[i])}
            for i in order]


def figures(prev: Reading | None, cur: Reading, n_experts: int, n_per_layer: int, top: int = 10) -> dict[str, Any]:
    """The interval (prev, cur]: pool and per-expert page-cache figures, reclaim, PSI, locked
    fraction. ``prev`` None: since the probes attached (counts from zero; scope counters then
    have no interval and are None)."""
    dt = (cur.t_ns - prev.t_ns) / 1e9 if prev is not None else None
    dpc = None
    if cur.pagecache is not None:
        dpc = {k: _d(cur.pagecache, prev.pagecache if prev else None, k)
               for k in ("added_pages", "re_added_pages", "evicted_pages", "evicted_by", "read_bytes", "read_calls")}
    dblk = None
    if cur.block is not None:
        dblk = {k: _d(cur.block, prev.block if prev else None, k)
                for k in ("device_read_bytes", "unattributed_bytes", "lost_events")}
    s, ps = cur.scope, (prev.scope if prev is not None else None)
    ds = {k: (_d(s, ps, k) if ps is not None else None)
          for k in ("scanned_pages", "stolen_pages", "refault_file_pages", "some_us", "full_us")}
    us = dt * 1e6 if dt else None
    pool = _pool(dpc, dblk, n_experts, dt or 0.0)
    pool.update(_accesses(prev, cur, pool.get("device_read_bytes")))
    return {
        "t_s": round(cur.t_ns / 1e9, 3), "interval_s": None if dt is None else round(dt, 3),
        "followed_processes": cur.followed,
        "pool": pool,
        "reclaim": {"scope": s.get("reclaim_scope"), "scanned_pages": ds["scanned_pages"],
                    "stolen_pages": ds["stolen_pages"],
                    "scan_to_steal": _ratio(ds["scanned_pages"], ds["stolen_pages"]),
                    "refault_file_pages": ds["refault_file_pages"]},
        "psi": {"scope": s.get("psi_scope"),
                "some_pct": None if us is None or ds["some_us"] is None else round(100 * ds["some_us"] / us, 2),
                "full_pct": None if us is None or ds["full_us"] is None else round(100 * ds["full_us"] / us, 2),
                "some_avg10": s.get("some_avg10"), "full_avg10": s.get("full_avg10")},
        "locked_fraction": _ratio(s.get("locked_bytes"), s.get("memory_bytes")),
        "experts": _experts(dpc, dblk, n_experts, n_per_layer, top),
    }
