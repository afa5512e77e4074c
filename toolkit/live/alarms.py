"""The alarms of ``moetrace watch`` (the paper's Algorithm 2, step 6), judged per interval.

Each alarm is raised by one interval's figures (:func:`moetrace.live.interval.figures`) against
the thresholds of the [watch] table of `check`'s TOML (:data:`moetrace.analyses.compare.
WATCH_THRESHOLDS`), and carries its evidence: the figures that tripped it, the evictor classes,
the top experts. Every alarm is judged every interval, so each is 1 or 0 (or None when the
interval cannot say, e.g. no computed misses yet) - what Prometheus's ``moetrace_alarm`` shows.
"""

from __future__ import annotations

from typing import Any

from moetrace.live.interval import OUTSIDE_EVICTORS

#: alarm name -> what it means (the order of the terminal view and of the metrics)
ALARMS: dict[str, str] = {
    "amplification": "the pool's device bytes exceed the misses an LRU of its resident size would have "
                     "(computed from the observed accesses) while reclaim scans more than it steals",
    "rereads": "expert pages read again after their eviction",
    "outside_evictor": "pool pages evicted by something other than reclaim (DAMON, proactive reclaim, "
                       "fadvise, drop_caches, truncation)",
    "psi_full": "every task of the scope stalled on memory for a share of the interval",
}


def _top(experts: list[dict[str, Any]], key: str, n: int = 3) -> list[str]:
    rows = sorted((e for e in experts if e.get(key)), key=lambda e: -e[key])[:n]
    return [f"L{e['layer']}E{e['expert']}:{e[key]}" for e in rows]


def judge(fig: dict[str, Any], th: dict[str, float]) -> dict[str, dict[str, Any]]:
    """{alarm: {"on": 1 | 0 | None, "evidence": str}} for one interval."""
    pool, rec, psi, ex = fig.get("pool") or {}, fig.get("reclaim") or {}, fig.get("psi") or {}, fig.get("experts") or []
    out: dict[str, dict[str, Any]] = {}

    amp, sts = pool.get("amplification"), rec.get("scan_to_steal")
    if amp is None:
        out["amplification"] = {"on": None, "evidence": "no computed misses in this interval"}
    else:
        on = amp > th["amplification"] and sts is not None and sts > th["scan_to_steal"]
        out["amplification"] = {"on": int(on), "evidence": (
            f"device {pool.get('device_read_bytes')} B vs computed misses {pool.get('computed_miss_bytes')} B "
            f"(x{amp:.2f}), scan/steal {'NA' if sts is None else f'{sts:.2f}'}; top re-read "
            f"{', '.join(_top(ex, 're_added_pages')) or 'none'}")}

    re = pool.get("re_added_pages")
    out["rereads"] = {"on": None if re is None else int(re >= max(th["rereads_pages"], 1)),
                      "evidence": f"{re} pages re-added; top {', '.join(_top(ex, 're_added_pages')) or 'none'}"}

    by = pool.get("evicted_by")
    if by is None:
        out["outside_evictor"] = {"on": None, "evidence": "no evictor classes (pagecache probe not attached)"}
    else:
        outside = {k: v for k, v in by.items() if k in OUTSIDE_EVICTORS and v}
        n = sum(outside.values())
        named = ", ".join(f"{k} {v}" for k, v in sorted(outside.items(), key=lambda kv: -kv[1]))
        out["outside_evictor"] = {"on": int(n >= max(th["outside_pages"], 1)), "evidence": (
            f"{n} pool pages evicted by {named or 'no outside evictor'}; top "
            f"{', '.join(_top(ex, 'outside_evicted_pages')) or 'none'}")}

    full = psi.get("full_pct")
    out["psi_full"] = {"on": None if full is None else int(full > th["psi_full_pct"]),
                       "evidence": f"memory full {full} % of the interval ({psi.get('scope')})"}
    return out


def raised(alarms: dict[str, dict[str, Any]]) -> list[str]:
    """One line per alarm that is on: 'ALARM name: evidence'."""
    return [f"ALARM {k}: {v['evidence']}" for k, v in alarms.items() if v["on"]]
