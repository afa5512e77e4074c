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
    "amplification", "reasons",
]


def _spread(x: pd.Series) -> float:
    """(max - min) / median; NA for no values or a zero median."""
    x = x.dropna()
    if x.empty:
        return np.nan
    med = float(x.median())
    return float(x.max() - x.min()) / med if med > 0 else np.nan


def compute_capacity_table(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per capacity C (descending): cells, retained count, and over the retained
    cells the median and spread ((max - min) / median) of the per-cell median
    iteration time, the median device bytes per iteration (and its spread), the
    simulated miss bytes per iteration, amplification = median device bytes per
    iteration / miss bytes per iteration (NA when the miss demand is 0 or NA), and
    the distinct reasons of cells not retained ("; "-joined)."""
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
        })
    out = pd.DataFrame(rows, columns=CAPACITY_COLUMNS)
    return out.sort_values("capacity_bytes", ascending=False, ignore_index=True)


def reference_curve(table: pd.DataFrame) -> tuple[float, float] | None:
    """(C0, a) of the a/C reference through the measured device bytes per iteration at
    the largest C where it is positive (a = C0 x device(C0)); None if none is."""
    t = table[(table["device_bytes_per_iteration"] > 0)].sort_values("capacity_bytes", ascending=False)
    if t.empty:
        return None
    c0 = float(t["capacity_bytes"].iloc[0])
    return c0, c0 * float(t["device_bytes_per_iteration"].iloc[0])


def plot_capacity(cells: pd.DataFrame, axes) -> Any:
    """Fig. 2 analogue on two matplotlib axes: (left) iteration time vs C, every
    retained repeat as a point and the median as a line, cells not retained as
    crosses; (right) device bytes per iteration vs C, log-log, with the simulated
    miss demand and an a/C reference anchored at the largest C with device bytes
    (zeros cannot sit on a log axis: they are counted in the legend)."""
    ax_t, ax_d = axes
    table = compute_capacity_table(cells)
    gib = 1024 ** 3
    ret = cells[cells["retained"].astype(bool)]
    bad = cells[~cells["retained"].astype(bool)]
    ax_t.scatter(ret["capacity_bytes"] / gib, ret["iteration_time_median_ns"] / 1e6, s=18, alpha=0.7,
                 label="retained repeats")
    if not bad.empty:
        ax_t.scatter(bad["capacity_bytes"] / gib, bad["iteration_time_median_ns"] / 1e6, marker="x",
                     color="tab:red", label="not retained")
    ax_t.plot(table["capacity_bytes"] / gib, table["iteration_time_median_ns"] / 1e6, "-", color="tab:blue",
              label="median")
    ax_t.set_xlabel("capacity C (GiB)")
    ax_t.set_ylabel("iteration time (ms)")
    ax_t.set_title("iteration time vs C")
    ax_t.legend(fontsize=8)

    pos = ret[ret["device_bytes_per_iteration"] > 0]
    zeros = int((ret["device_bytes_per_iteration"] == 0).sum())
    # paper Fig. 2 right: measured device reads as circles on a solid line (repeats faint),
    # simulated miss demand as squares on a dashed line, a/C dotted
    ax_d.scatter(pos["capacity_bytes"] / gib, pos["device_bytes_per_iteration"] / 1024 ** 2, s=14, alpha=0.35,
                 color="tab:blue", zorder=3)
    tm = table[table["device_bytes_per_iteration"] > 0]
    ax_d.plot(tm["capacity_bytes"] / gib, tm["device_bytes_per_iteration"] / 1024 ** 2, "o-", color="tab:blue",
              zorder=4, label="device (diskstats), median" + (f"; {zeros} cell(s) at 0 B not shown" if zeros else ""))
    t = table[table["miss_bytes_per_iteration"] > 0]
    ax_d.plot(t["capacity_bytes"] / gib, t["miss_bytes_per_iteration"] / 1024 ** 2, "s--", color="tab:green",
              mfc="none", ms=8, zorder=5, label="simulated LRU miss demand")
    ref = reference_curve(table)
    if ref is not None:
        c0, a = ref
        cs = np.array(sorted(table["capacity_bytes"].astype(float)))
        cs = cs[cs > 0]
        ax_d.plot(cs / gib, a / cs / 1024 ** 2, ":", color="gray", label=f"a/C (anchored at {c0 / gib:.2f} GiB)")
    ax_d.set_xscale("log")
    ax_d.set_yscale("log")
    caps = sorted(table["capacity_bytes"].astype(float) / gib)
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax_d.xaxis.set_major_locator(FixedLocator(caps))
    ax_d.xaxis.set_minor_locator(NullLocator())
    ax_d.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_d.set_xlabel("capacity C (GiB)")
    ax_d.set_ylabel("device MiB per iteration")
    ax_d.set_title("device bytes vs C")
    ax_d.legend(fontsize=8)
    return axes
