"""The zones' watermarks from min_free_kbytes and watermark_scale_factor, and the two knobs that
reach a target sum of high watermarks (Σhigh): the matrix's ``bite_fraction`` (Σhigh / C).

The model is ``__setup_per_zone_wmarks()`` of mm/page_alloc.c (the same in 6.1 and 6.12; read in
Debian's linux-source-6.12 6.12.95)::

    pages_min = min_free_kbytes >> (PAGE_SHIFT - 10)
    lowmem    = Σ managed of the zones that are neither highmem nor movable
    tmp       = pages_min * managed / lowmem            (per zone)
    min       = tmp, or clamp(managed / 1024, 32, 128) for a highmem / movable zone
    gap       = max(tmp >> 2, managed * watermark_scale_factor / 10000)
    low, high = min + gap, min + 2 * gap

Σhigh is what a 6.8 kswapd pass asks a node for in one go (``kswapd_shrink_node``'s
nr_to_reclaim, issue 34's M1). watermark_boost is not modelled: the setup resets it, the zones
raise it again only after fragmenting allocations; /proc/zoneinfo's ``high`` counts it, and the
guest records what /proc/zoneinfo says after the knobs are written.

Pure: zones are dicts with ``zone`` (its name) and ``managed`` (pages), as
:func:`moetrace.kernel.procfs.parse_zoneinfo` gives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: watermark_scale_factor's range (proc_dointvec_minmax: SYSCTL_ONE .. SYSCTL_THREE_THOUSAND)
WSF_MIN, WSF_MAX = 1, 3000
#: the least min_free_kbytes a target may set (the kernel's own floor for its default is 128 kB;
#: below about 1 MiB atomic allocations in a multi-GiB guest run short)
MIN_FREE_FLOOR_KB = 1024


def _capped(zone: dict[str, Any]) -> bool:
    return zone.get("zone") in ("HighMem", "Movable")


def zone_marks(zones: list[dict[str, Any]], min_free_kbytes: int, wsf: int, page_kb: int = 4) -> list[dict[str, int]]:
    """Each zone's modelled min, low and high (pages) for these knobs."""
    pages_min = min_free_kbytes // page_kb
    lowmem = sum(z.get("managed", 0) for z in zones if not _capped(z)) or 1
    out = []
    for z in zones:
        managed = z.get("managed", 0)
        tmp = pages_min * managed // lowmem
        mn = min(max(managed // 1024, 32), 128) if _capped(z) else tmp
        scaled = (managed // 10000) * wsf + (managed % 10000) * wsf // 10000  # mult_frac()
        gap = max(tmp >> 2, scaled)
        out.append({"min": mn, "low": mn + gap, "high": mn + 2 * gap})
    return out


def sum_high(zones: list[dict[str, Any]], min_free_kbytes: int, wsf: int, page_kb: int = 4) -> int:
    """Σhigh (pages) over the zones with managed pages, for these knobs."""
    return sum(m["high"] for m, z in zip(zone_marks(zones, min_free_kbytes, wsf, page_kb), zones)
               if z.get("managed", 0) > 0)


def _least(lo: int, hi: int, f) -> int:
    """The least x in [lo, hi] with f(x) true (f monotone; hi when none)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if f(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True)
class WatermarkPlan:
    min_free_kbytes: int
    watermark_scale_factor: int
    predicted_sum_high_pages: int
    target_sum_high_pages: int
    reachable: bool  # the prediction is within a page a zone of the target


def plan_watermarks(zones: list[dict[str, Any]], target_pages: int, wsf: int, page_kb: int = 4) -> WatermarkPlan:
    """The knobs whose Σhigh comes closest to ``target_pages``: min_free_kbytes moves (as a
    64 KiB-page THP host raises it; issue 34), watermark_scale_factor stays at ``wsf`` unless the
    target lies below what MIN_FREE_FLOOR_KB gives with it, then the largest factor below that
    lets min_free_kbytes reach it. min_free_kbytes stays at most a quarter of the managed memory."""
    managed = sum(z.get("managed", 0) for z in zones)
    hi = max(MIN_FREE_FLOOR_KB, managed * page_kb // 4)

    def f(mf: int, w: int) -> int:
        return sum_high(zones, mf, w, page_kb)

    if f(MIN_FREE_FLOOR_KB, wsf) > target_pages:  # the floor alone overshoots: a smaller gap
        wsf = max(WSF_MIN, _least(WSF_MIN, wsf, lambda w: f(MIN_FREE_FLOOR_KB, w) > target_pages) - 1)
    mf = _least(MIN_FREE_FLOOR_KB, hi, lambda m: f(m, wsf) >= target_pages)
    if mf > MIN_FREE_FLOOR_KB and abs(f(mf - 1, wsf) - target_pages) < abs(f(mf, wsf) - target_pages):
        mf -= 1
    got = f(mf, wsf)
    return WatermarkPlan(mf, wsf, got, target_pages, abs(got - target_pages) <= max(1, len(zones)))


__all__ = ["MIN_FREE_FLOOR_KB", "WSF_MAX", "WSF_MIN", "WatermarkPlan", "plan_watermarks", "sum_high", "zone_marks"]
