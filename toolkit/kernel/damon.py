"""DAMON's sysfs interface, read only: which kdamonds run which schemes, and what they will
do to a page-cache measurement.

A DAMOS ``pageout`` (or ``lru_deprio``, ``stat`` aside) scheme over physical memory evicts
clean, unmapped page-cache folios that DAMON sees as idle, from the ``kdamond.N`` kernel
thread, with nothing counted in /proc/vmstat. DAMON samples one page per region, so folios
read seconds ago inherit a long-cold region's age and go too. moetrace never writes these
files (it does not refresh the schemes' stats either: that needs a write to ``state``).

Layout read (``<root>/sys/kernel/mm/damon/admin``)::

    kdamonds/<k>/{state,pid,refresh_ms}
    kdamonds/<k>/contexts/<c>/{operations,addr_unit}
    kdamonds/<k>/contexts/<c>/monitoring_attrs/intervals/{sample_us,aggr_us,update_us}
    kdamonds/<k>/contexts/<c>/targets/<t>/{pid_target,regions/<r>/{start,end}}
    kdamonds/<k>/contexts/<c>/schemes/<s>/{action,apply_interval_us,target_nid}
    .../schemes/<s>/access_pattern/{sz,nr_accesses,age}/{min,max}
    .../schemes/<s>/quotas/{bytes,ms,reset_interval_ms}
    .../schemes/<s>/{filters,ops_filters,core_filters}/<f>/{type,matching,allow,memcg_path,min,max}
    .../schemes/<s>/stats/{nr_tried,sz_tried,nr_applied,sz_applied,qt_exceeds}

Files a kernel version lacks are None (``allow`` and ``ops_filters`` are 6.14+).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ADMIN = "sys/kernel/mm/damon/admin"
#: actions that take page-cache folios out of memory (or off the LRU's hot end)
EVICTING_ACTIONS = ("pageout", "lru_deprio", "migrate_cold", "migrate_hot")
U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1


def _read(p: Path) -> str | None:
    try:
        return p.read_text().strip()
    except OSError:
        return None


def _int(p: Path) -> int | None:
    v = _read(p)
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _numbered(d: Path) -> list[Path]:
    try:
        return sorted((c for c in d.iterdir() if c.name.isdigit()), key=lambda c: int(c.name))
    except OSError:
        return []


def _range(d: Path) -> dict[str, int | None]:
    return {"min": _int(d / "min"), "max": _int(d / "max")}


def _filters(d: Path) -> list[dict[str, Any]]:
    out = []
    for f in _numbered(d):
        allow = _read(f / "allow")
        out.append({"type": _read(f / "type"), "matching": _read(f / "matching") == "Y",
                    "allow": None if allow is None else allow == "Y",
                    "memcg_path": _read(f / "memcg_path") or None,
                    "addr_start": _int(f / "addr_start"), "addr_end": _int(f / "addr_end"),
                    "min": _int(f / "min"), "max": _int(f / "max")})
    return out


def _scheme(s: Path, aggr_us: int | None) -> dict[str, Any]:
    ap = s / "access_pattern"
    age = _range(ap / "age")
    doc: dict[str, Any] = {
        "index": int(s.name), "action": _read(s / "action"),
        "apply_interval_us": _int(s / "apply_interval_us"), "target_nid": _int(s / "target_nid"),
        "access_pattern": {"sz_bytes": _range(ap / "sz"), "nr_accesses": _range(ap / "nr_accesses"),
                           "age_aggr_intervals": age},
        "min_idle_s": (age["min"] * aggr_us / 1e6) if age["min"] is not None and aggr_us else None,
        "quotas": {"bytes": _int(s / "quotas/bytes"), "ms": _int(s / "quotas/ms"),
                   "reset_interval_ms": _int(s / "quotas/reset_interval_ms")},
        "filters": [dict(f, layer=layer) for layer in ("filters", "core_filters", "ops_filters")
                    for f in _filters(s / layer)],
        "stats": {k: _int(s / "stats" / k) for k in ("nr_tried", "sz_tried", "nr_applied", "sz_applied",
                                                     "qt_exceeds")},
    }
    doc["evicts_page_cache"] = evicts_page_cache(doc)
    doc["effect"] = describe_scheme(doc)
    return doc


def read_damon(root: str | os.PathLike = "/") -> dict[str, Any]:
    """Every kdamond with its contexts and schemes: {"available", "kdamonds", "active_schemes",
    "note"}. Read only; nothing is refreshed or written."""
    admin = Path(root) / ADMIN
    if not admin.is_dir():
        return {"available": False, "kdamonds": [], "active_schemes": [],
                "note": f"no {admin} (DAMON sysfs interface not built, or sysfs not mounted)"}
    kds = []
    active = []
    for k in _numbered(admin / "kdamonds"):
        state = _read(k / "state")
        kd: dict[str, Any] = {"index": int(k.name), "state": state, "pid": _int(k / "pid"),
                              "refresh_ms": _int(k / "refresh_ms"), "contexts": []}
        for c in _numbered(k / "contexts"):
            iv = c / "monitoring_attrs/intervals"
            aggr = _int(iv / "aggr_us")
            ctx: dict[str, Any] = {
                "index": int(c.name), "operations": _read(c / "operations"),
                "intervals_us": {"sample": _int(iv / "sample_us"), "aggr": aggr, "update": _int(iv / "update_us")},
                "targets": [{"pid": _int(t / "pid_target"),
                             "regions": [{"start": _int(r / "start"), "end": _int(r / "end")}
                                         for r in _numbered(t / "regions")]}
                            for t in _numbered(c / "targets")],
                "schemes": [_scheme(s, aggr) for s in _numbered(c / "schemes")],
            }
            kd["contexts"].append(ctx)
            if state == "on":
                for s in ctx["schemes"]:
                    active.append({"kdamond": kd["index"], "thread": f"kdamond.{kd['index']}", "pid": kd["pid"],
                                   "context": ctx["index"], "operations": ctx["operations"],
                                   "regions": [r for t in ctx["targets"] for r in t["regions"]], **s})
        kds.append(kd)
    return {"available": True, "kdamonds": kds, "active_schemes": active,
            "note": "read only: moetrace never writes DAMON's files (stats are as the kernel last refreshed them)"}


def evicts_page_cache(scheme: dict[str, Any]) -> bool:
    """Whether a scheme can take page-cache folios away: an evicting action whose filters do
    not reject every file-backed folio (a filter that rejects anon pages still lets file pages
    through; one that allows only anon pages does not)."""
    if scheme.get("action") not in EVICTING_ACTIONS:
        return False
    for f in scheme.get("filters") or []:
        allow = f.get("allow")
        if f.get("type") == "anon" and f.get("matching") is False and allow is False:
            return False  # rejects non-anon (= file) folios
        if f.get("type") == "anon" and f.get("matching") is True and allow is True and len(scheme["filters"]) == 1:
            return False  # allows anon only
    return True


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= U64_MAX:
        return "unlimited"
    for unit, s in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{n / unit:.3g} {s}"
    return f"{n} B"


def describe_scheme(s: dict[str, Any]) -> str:
    """One line: what the scheme does and what it will do to a measurement."""
    ap = s["access_pattern"]
    acc = ap["nr_accesses"]
    idle = s.get("min_idle_s")
    flt = ", ".join(
        f"{'allow' if f.get('allow') in (True, None) else 'reject'} "
        f"{'' if f.get('matching') else 'non-'}{f.get('type')}" for f in s.get("filters") or [])
    q = s["quotas"]
    quota = f"quota {_bytes(q['bytes'])}/{q['reset_interval_ms']} ms" if q.get("bytes") else "no size quota"
    what = (f"{s.get('action')} regions with {acc['min']}-{acc['max']} accesses per aggregation, idle >= "
            f"{idle:g} s" if idle is not None else f"{s.get('action')} regions matching its access pattern")
    what += f"; filters: {flt}" if flt else ""
    what += f"; {quota}"
    if s.get("evicts_page_cache", evicts_page_cache(s)):
        what += (" -> evicts page-cache pages (the pool's too) from the kdamond thread, counted nowhere in "
                 "/proc/vmstat; DAMON samples one page per region, so freshly read folios can inherit a cold "
                 "region's age. moetrace record attributes those evictions to 'damon'")
    else:
        what += " -> does not evict page-cache pages"
    return what
