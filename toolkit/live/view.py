"""How ``moetrace watch`` shows an interval: plain lines (not a terminal, or ``-C``), a table
refreshed in place (rich, on a terminal), or one JSON object per line (``--json``)."""

from __future__ import annotations

import json
import time
from typing import Any

from moetrace.jsonutil import json_default
from moetrace.live.alarms import raised


def _mb(b: int | float | None) -> str:
    return "NA" if b is None else f"{b / 1e6:.1f} MB"


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "NA" if x is None else fmt.format(x)


def _us(ns: float | None) -> str:
    return "NA" if ns is None else f"{ns / 1e3:.0f}"


def _evictors(by: dict[str, int] | None) -> str:
    items = [f"{k} {v}" for k, v in sorted((by or {}).items(), key=lambda kv: -kv[1]) if v]
    return ", ".join(items) or "none"


def pool_line(fig: dict[str, Any]) -> str:
    """The interval's pool, reclaim and PSI figures on one line."""
    p, r, s = fig["pool"], fig["reclaim"], fig["psi"]
    clock = time.strftime("%H:%M:%S")
    rate = p.get("device_read_bytes_per_s")
    misses = ""
    if "computed_miss_bytes" in p:
        misses = (f" computed misses {_mb(p['computed_miss_bytes'])} (amp {_f(p.get('amplification'))}) hit "
                  f"p50/p99 {_us(p.get('hit_only_p50_ns'))}/{_us(p.get('hit_only_p99_ns'))} us")
    return (f"{clock} device {_mb(p.get('device_read_bytes'))} ({_mb(rate)}/s){misses} requested "
            f"{_mb(p.get('requested_bytes'))} added {p.get('added_pages', 'NA')} re-added "
            f"{p.get('re_added_pages', 'NA')} evicted {p.get('evicted_pages', 'NA')} "
            f"({_evictors(p.get('evicted_by'))}) scan/steal {_f(r.get('scan_to_steal'))} refaults "
            f"{r.get('refault_file_pages', 'NA')} psi some {_f(s.get('some_pct'), '{:.1f}')} % full "
            f"{_f(s.get('full_pct'), '{:.1f}')} % locked {_f(fig.get('locked_fraction'), '{:.1%}')}")


def expert_line(e: dict[str, Any]) -> str:
    return (f"  L{e['layer']:<3} E{e['expert']:<4} added {e['added_pages']:>7} re-added {e['re_added_pages']:>7} "
            f"evicted {e['evicted_pages']:>7} (outside {e['outside_evicted_pages']}) device "
            f"{_mb(e['device_read_bytes'])}")


def plain_lines(fig: dict[str, Any], rows: int) -> list[str]:
    """The pool line, up to ``rows`` expert lines, then one line per raised alarm."""
    return [pool_line(fig), *(expert_line(e) for e in fig["experts"][:rows]), *raised(fig.get("alarms") or {})]


def json_line(fig: dict[str, Any]) -> str:
    return json.dumps(fig, default=json_default, separators=(",", ":"))


def table(fig: dict[str, Any], rows: int, header: str = ""):
    """A rich renderable of the interval: the pool, the top experts, the alarms."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    p = fig["pool"]
    head = Text(header + pool_line(fig))
    t = Table(box=None, pad_edge=False, header_style="bold")
    for c in ("layer", "expert", "added", "re-added", "evicted", "outside", "device MB"):
        t.add_column(c, justify="right")
    for e in fig["experts"][:rows]:
        t.add_row(str(e["layer"]), str(e["expert"]), str(e["added_pages"]), str(e["re_added_pages"]),
                  str(e["evicted_pages"]), str(e["outside_evicted_pages"]), f"{e['device_read_bytes'] / 1e6:.2f}")
    alarms = [Text(line, style="bold red") for line in raised(fig.get("alarms") or {})]
    if not p:
        alarms.append(Text("no pool counters (no --pool?)", style="yellow"))
    return Group(head, t, *alarms)
