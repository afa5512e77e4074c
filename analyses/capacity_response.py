"""Capacity response (paper Fig. 2 analogue): iteration time and device traffic vs C.

:func:`compute_capacity_table` aggregates one row per cell (as ``moetrace sweep``
writes them in results.parquet) into one row per capacity, from retained cells
only; :func:`plot_capacity` draws the two panels.

Per-cell columns used: ``capacity_bytes``, ``retained`` (bool), ``reasons``
(str, "" when retained), ``iteration_time_median_ns``,
``device_bytes_per_iteration``, ``miss_bytes_per_iteration``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

CAPACITY_COLUMNS = [
    "capacity_bytes", "cells", "retained", "iteration_time_median_ns", "iteration_time_spread",
    "device_bytes_per_iteration", "device_bytes_per_iteration_spread", "miss_bytes_per_iteration",
    "amplification", "reasons", "effective_capacity_bytes", "lru_hit_rate",
]

#: device traffic below this share of the most any capacity read is negligible (the pool fits,
#: a stray page of another process): the a/C reference is not anchored there
NEGLIGIBLE_SHARE = 0.01


def _spread(x: pd.Series) -> float:
    """(max - min) / median; NA for no values or a zero median."""
    x = x.dropna()
    if x.empty:
        return np.nan
    med = float(x.median())
    return float(x.max() - x.min()) / med if med > 0 else np.nan


def _median(df: pd.DataFrame, col: str) -> float:
    return float(df[col].median()) if col in df and df[col].notna().any() else np.nan


def _first(df: pd.DataFrame, col: str) -> float:
    v = df[col].dropna() if col in df else pd.Series(dtype=float)
    return float(v.iloc[0]) if len(v) else np.nan


#: the host of a cell that does not name one (results written before the host column)
UNKNOWN_HOST = "host unknown"


def cell_hosts(cells: pd.DataFrame) -> dict[str, int]:
    """{host: retained cells} of the hosts the retained cells name (most cells first, then by
    name); {} when the results have no ``host`` column or no retained cell names one."""
    if "host" not in cells or cells.empty:
        return {}
    h = cells.loc[cells["retained"].astype(bool), "host"].dropna().astype(str)
    counts = h[h != ""].value_counts()
    return dict(sorted(((str(k), int(v)) for k, v in counts.items()), key=lambda kv: (-kv[1], kv[0])))


def _host_labels(host: pd.Series) -> pd.Series:
    """Each cell's host name, UNKNOWN_HOST where it names none."""
    known = host.notna() & (host.astype(str) != "")
    return host.astype(object).where(known, UNKNOWN_HOST).astype(str)


def compute_capacity_table(cells: pd.DataFrame) -> pd.DataFrame:
    """:func:`capacity_rows` of the cells; when their retained cells come from more than one host
    (:func:`cell_hosts`: cells as jobs on several machines), per host: a ``host`` column first
    (UNKNOWN_HOST for cells that name none), hosts by name, each host's capacities descending, the
    repeats pooled per host only. With one host (or none named) exactly :func:`capacity_rows`."""
    if len(cell_hosts(cells)) <= 1:
        return capacity_rows(cells)
    host = _host_labels(cells["host"])
    parts = [capacity_rows(cells[host == h]).assign(host=h) for h in sorted(set(host))]
    out = pd.concat(parts, ignore_index=True)
    return out[["host", *CAPACITY_COLUMNS]]


def capacity_rows(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per capacity C (descending): cells, retained count, and over the retained
    cells the median and spread ((max - min) / median) of the per-cell median
    iteration time, the median device bytes per iteration (and its spread), the
    simulated miss bytes per iteration, amplification = median device bytes per
    iteration / miss bytes per iteration (NA when the miss demand is 0 or NA), and
    the distinct reasons of cells not retained ("; "-joined), the median effective capacity (what
    the pool's pages could occupy at loop entry: under a cgroup wall C + headroom less the scope's
    anonymous memory) and the simulated LRU hit rate at C (both NA when the cells lack them)."""
    rows: list[dict[str, Any]] = []
    for cap, g in cells.groupby("capacity_bytes", sort=False):
        keep = g[g["retained"].astype(bool)]
        reasons = sorted({r for rs in g.loc[~g["retained"].astype(bool), "reasons"].fillna("")
                          for r in str(rs).split("; ") if r})
        dev = float(keep["device_bytes_per_iteration"].median()) if not keep.empty else np.nan
        miss_vals = g["miss_bytes_per_iteration"].dropna()
        miss = float(miss_vals.iloc[0]) if not miss_vals.empty else np.nan
        rows.append({
            "capacity_bytes": int(cap),
            "cells": int(len(g)),
            "retained": int(len(keep)),
            "iteration_time_median_ns": float(keep["iteration_time_median_ns"].median()) if not keep.empty
            else np.nan,
            "iteration_time_spread": _spread(keep["iteration_time_median_ns"]),
            "device_bytes_per_iteration": dev,
            "device_bytes_per_iteration_spread": _spread(keep["device_bytes_per_iteration"]),
            "miss_bytes_per_iteration": miss,
            "amplification": dev / miss if (miss > 0 and not np.isnan(dev)) else np.nan,
            "reasons": "; ".join(reasons),
            "effective_capacity_bytes": _median(keep, "effective_capacity_bytes"),
            "lru_hit_rate": _first(g, "lru_hit_rate"),
        })
    out = pd.DataFrame(rows, columns=CAPACITY_COLUMNS)
    return out.sort_values("capacity_bytes", ascending=False, ignore_index=True)


def reference_curve(table: pd.DataFrame, negligible: float = NEGLIGIBLE_SHARE) -> tuple[float, float] | None:
    """(C0, a) of the a/C reference through the measured device bytes per iteration at the
    largest C whose device traffic is not negligible (at least ``negligible`` x the most any C
    read; a = C0 x device(C0)); None if no C read anything."""
    dev = table["device_bytes_per_iteration"].astype(float)
    if not (dev > 0).any():
        return None
    t = table[dev >= negligible * dev.max()].sort_values("capacity_bytes", ascending=False)
    c0 = float(t["capacity_bytes"].iloc[0])
    return c0, c0 * float(t["device_bytes_per_iteration"].iloc[0])


def compute_table2(capacity: pd.DataFrame) -> pd.DataFrame:
    """The paper's Table 2 from :func:`compute_capacity_table` (a sweep's capacity.parquet): per
    capacity C (descending), cells and retained, effective capacity, the simulated LRU hit rate,
    iteration time (median ms and spread), device and miss MiB per iteration, amplification; per
    host (``host`` first, hosts by name) when the capacity table has a host column."""
    if capacity is None or capacity.empty:
        return pd.DataFrame()
    cap = capacity
    na = pd.Series(np.nan, index=cap.index)
    t = pd.DataFrame({
        "capacity_bytes": cap["capacity_bytes"].astype("int64"),
        "cells": cap["cells"].astype("int64"), "retained": cap["retained"].astype("int64"),
        "effective_capacity_bytes": cap.get("effective_capacity_bytes", na).astype("Float64"),
        "lru_hit_rate": cap.get("lru_hit_rate", na).astype("Float64"),
        "iteration_ms": cap["iteration_time_median_ns"].astype("Float64") / 1e6,
        "iteration_spread": cap["iteration_time_spread"].astype("Float64"),
        "device_mib_per_iteration": cap["device_bytes_per_iteration"].astype("Float64") / 2**20,
        "miss_mib_per_iteration": cap["miss_bytes_per_iteration"].astype("Float64") / 2**20,
        "amplification": cap["amplification"].astype("Float64")})
    if "host" in cap:
        t.insert(0, "host", cap["host"].astype(str))
        return t.sort_values(["host", "capacity_bytes"], ascending=[True, False]).reset_index(drop=True)
    return t.sort_values("capacity_bytes", ascending=False).reset_index(drop=True)


def _capacity_axis(ax, caps: list[float]) -> None:
    """A log-C axis ticked at the sweep's capacities, labelled as a person writes them."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    from moetrace.inputs.geometry import format_bytes

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(caps))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(v)))
    ax.set_xlabel("capacity C")
    if len(caps) > 1:
        lo, hi = min(caps), max(caps)
        ax.set_xlim(lo / 1.25, hi * 1.25)


def _spread_bars(ax, g: pd.DataFrame, y: str, scale: float, color: str) -> None:
    """The spread of the retained repeats at each C: a bar from the lowest to the highest."""
    agg = g.groupby("capacity_bytes")[y].agg(["min", "max", "median"])
    agg = agg[agg["max"] > 0]
    if len(agg):
        ax.errorbar(agg.index.astype(float), agg["median"] / scale,
                    yerr=[(agg["median"] - agg["min"]) / scale, (agg["max"] - agg["median"]) / scale],
                    fmt="none", ecolor=color, elinewidth=1.2, capsize=4, zorder=3, label="range of the repeats")


def _host_curves(cells: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame, pd.DataFrame]]:
    """(label suffix, colour, capacity rows, retained cells) per curve of Fig. 2: one curve, or one
    per host when :func:`compute_capacity_table` is per host."""
    table = compute_capacity_table(cells)
    ret = cells[cells["retained"].astype(bool)]
    if "host" not in table:
        return [("", "tab:blue", table, ret)]
    host = _host_labels(ret["host"])
    return [(f" ({h})", f"C{i}", table[table["host"] == h], ret[host == h])
            for i, h in enumerate(dict.fromkeys(table["host"]))]


def plot_capacity(cells: pd.DataFrame, axes) -> Any:
    """Fig. 2 as in the paper, two panels on the same log-C axis ticked at the sweep's capacities:
    (left) iteration time vs C, the median over retained repeats as a line, their range as bars,
    cells not retained as crosses; (right) device MiB per iteration vs C, log-log, the median
    and range of the repeats, the simulated LRU miss demand, and an a/C reference anchored at the
    largest C whose device traffic is not negligible (:func:`reference_curve`; the legend says
    which). Zeros cannot sit on a log axis: they are counted in the legend. Cells from several
    hosts: a median line and range per host (:func:`compute_capacity_table`)."""
    from moetrace.inputs.geometry import format_bytes

    ax_t, ax_d = axes
    table = capacity_rows(cells)  # pooled: the capacities, the miss demand and the a/C reference
    by_host = _host_curves(cells)
    mib = 1024 ** 2
    ret = cells[cells["retained"].astype(bool)]
    bad = cells[~cells["retained"].astype(bool)]
    caps = sorted(float(c) for c in table["capacity_bytes"] if c > 0)
    for suffix, color, t, r in by_host:
        ax_t.plot(t["capacity_bytes"], t["iteration_time_median_ns"] / 1e6, "o-", color=color,
                  label="median of the repeats" + suffix)
        _spread_bars(ax_t, r, "iteration_time_median_ns", 1e6, color)
    if not bad.empty:
        ax_t.scatter(bad["capacity_bytes"], bad["iteration_time_median_ns"] / 1e6, marker="x",
                     color="tab:red", label="not retained")
    _capacity_axis(ax_t, caps)
    ax_t.set_ylabel("iteration time (ms)")
    ax_t.set_title("iteration time vs C")
    ax_t.legend(fontsize=8)

    zeros = int((ret["device_bytes_per_iteration"] == 0).sum())
    for i, (suffix, color, t, r) in enumerate(by_host):
        tm = t[t["device_bytes_per_iteration"] > 0]
        ax_d.plot(tm["capacity_bytes"], tm["device_bytes_per_iteration"] / mib, "o-", color=color, zorder=4,
                  label="device reads (diskstats), median" + suffix
                  + (f"; {zeros} cell(s) at 0 B not shown" if zeros and i == len(by_host) - 1 else ""))
        _spread_bars(ax_d, r, "device_bytes_per_iteration", mib, color)
    t = table[table["miss_bytes_per_iteration"] > 0]
    ax_d.plot(t["capacity_bytes"], t["miss_bytes_per_iteration"] / mib, "s--", color="tab:green",
              mfc="none", ms=8, zorder=5, label="simulated LRU miss demand")
    ref = reference_curve(table)
    if ref is not None:
        c0, a = ref
        cs = np.array(caps)
        ax_d.plot(cs, a / cs / mib, ":", color="gray",
                  label=f"a/C through C = {format_bytes(c0)} (largest C reading >= "
                        f"{NEGLIGIBLE_SHARE:.0%} of the most)")
    ax_d.set_yscale("log")
    from matplotlib.ticker import FuncFormatter

    for axis in (ax_d.yaxis.set_major_formatter, ax_d.yaxis.set_minor_formatter):
        axis(FuncFormatter(lambda v, _: f"{v:g}"))
    _capacity_axis(ax_d, caps)
    ax_d.set_ylabel("device MiB per iteration")
    ax_d.set_title("device bytes vs C")
    ax_d.legend(fontsize=7)
    return axes
