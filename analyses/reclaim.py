"""Reclaim: who took the pages back, how hard it scanned, how much the tasks stalled, and
whether the run shows the paper's amplification signature.

* :func:`compute_reclaim_kinds` — per reclaimer kind (memcg, direct, kswapd, ...): invocations,
  pages scanned and reclaimed, scan-to-steal, time spent, share of what was reclaimed.
* :func:`compute_reclaim_timeline` — the same per 100 ms bucket over the recording (scan-to-steal
  over time), when the recording kept the reclaim probe's timeline.
* :func:`compute_psi` — /proc/pressure deltas over the recording (memory, io; some / full)
  as a share of the wall time.
* :func:`compute_refault_windows` — per replay iteration, pages re-added (read again after
  their eviction) per second and as a share of the pages requested, with a thrash state in
  the style of a thrash detector (as AIOS-style memory reclamation describes one: a refault share per window): a window
  is *high* when its refault share reaches ``threshold``; 1-2 consecutive high windows are
  *elevated*, ``sustained`` (3) or more *thrashing*.
* :func:`compute_alarm` — the paper's alarm condition: device bytes above the simulated miss
  demand (amplification > 1 + ``tolerance``) together with scan-to-steal above 2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

SCAN_TO_STEAL_ALARM = 2.0
AMPLIFICATION_TOLERANCE = 0.02


def compute_reclaim_kinds(reclaim: pd.DataFrame) -> pd.DataFrame:
    """reclaim.parquet -> ``kind``, ``invocations``, ``scanned_pages``, ``reclaimed_pages``,
    ``scan_to_steal`` (NA when nothing was reclaimed), ``duration_ns_sum``,
    ``duration_ns_mean``, ``reclaimed_share`` (of all kinds)."""
    cols = ["kind", "invocations", "scanned_pages", "reclaimed_pages", "duration_ns_sum", "duration_ns_mean"]
    out = reclaim[[c for c in cols if c in reclaim]].copy()
    rec = out["reclaimed_pages"].astype("Float64")
    out["scan_to_steal"] = (out["scanned_pages"].astype("Float64") / rec.where(rec > 0)).astype("Float64")
    tot = rec.sum()
    out["reclaimed_share"] = (rec / tot).astype("Float64") if tot else pd.array([pd.NA] * len(out), dtype="Float64")
    return out.reset_index(drop=True)


def scan_to_steal(reclaim: pd.DataFrame | None) -> float | None:
    """Pages scanned / reclaimed over every kind (None when nothing was reclaimed)."""
    if reclaim is None or reclaim.empty:
        return None
    rec = int(reclaim["reclaimed_pages"].sum())
    return int(reclaim["scanned_pages"].sum()) / rec if rec else None


def compute_reclaim_timeline(timeline: pd.DataFrame | None, meta: Mapping[str, Any]) -> pd.DataFrame:
    """reclaim_timeline (per time bucket and reclaimer) -> ``time_ns`` (CLOCK_MONOTONIC of the
    bucket start: the probe's t0 + offset; the offset alone when the manifest lacks t0),
    ``who``, ``scanned_pages``, ``reclaimed_pages``, ``scan_to_steal`` (NA when nothing was
    reclaimed), ``invocations``, ``duration_ns``. Empty without a timeline."""
    cols = ["time_ns", "who", "scanned_pages", "reclaimed_pages", "scan_to_steal", "invocations", "duration_ns"]
    if timeline is None or timeline.empty:
        return pd.DataFrame(columns=cols)
    rs = ((meta.get("summaries") or {}).get("reclaim") or {})
    t0 = int(rs.get("t0_ns") or 0)
    out = pd.DataFrame({"time_ns": timeline["time_ns"].astype("int64") + t0, "who": timeline["who"].astype("string"),
                        "scanned_pages": timeline["nr_scanned_pages"].astype("int64"),
                        "reclaimed_pages": timeline["nr_reclaimed_pages"].astype("int64")})
    rec = out["reclaimed_pages"].astype("Float64")
    out["scan_to_steal"] = (out["scanned_pages"].astype("Float64") / rec.where(rec > 0)).astype("Float64")
    out["invocations"] = timeline["invocations"].astype("int64")
    out["duration_ns"] = timeline["duration_ns"].astype("int64")
    return out.sort_values(["time_ns", "who"]).reset_index(drop=True)


def compute_psi(snapshots: Mapping[str, Any]) -> pd.DataFrame:
    """``resource`` (memory, io, cpu), ``level`` (some, full), ``stall_us`` (total_us delta
    pre -> post), ``wall_us``, ``stall_share`` = stall / wall. Empty without PSI."""
    pre, post = (snapshots or {}).get("pre") or {}, (snapshots or {}).get("post") or {}
    if not pre.get("psi") or not post.get("psi"):
        return pd.DataFrame(columns=["resource", "level", "stall_us", "wall_us", "stall_share"])
    try:
        wall_us: float | None = (int(post["monotonic_ns"]) - int(pre["monotonic_ns"])) / 1e3
    except (KeyError, TypeError, ValueError):  # a snapshot without its clock: the stall has no wall
        wall_us = None
    rows = []
    for res in ("memory", "io", "cpu"):
        for level in ("some", "full"):
            try:
                d = int(post["psi"][res][level]["total_us"]) - int(pre["psi"][res][level]["total_us"])
            except (KeyError, TypeError):
                continue
            rows.append({"resource": res, "level": level, "stall_us": d, "wall_us": wall_us,
                         "stall_share": d / wall_us if wall_us else None})
    return pd.DataFrame(rows)


def compute_refault_windows(iterations: pd.DataFrame, threshold: float = 0.10, sustained: int = 3
                            ) -> pd.DataFrame:
    """From :func:`moetrace.analyses.amplification.compute_amplification_iterations`:
    per iteration ``refault_pages_per_s`` (re-added pages / duration), ``refault_share``
    (re-added / requested pages), ``high`` (share >= threshold), ``run`` (consecutive high
    windows so far) and ``state`` (normal, elevated, thrashing)."""
    if iterations is None or iterations.empty:
        return pd.DataFrame(columns=["epoch", "phase", "repeat", "iteration", "re_added_pages",
                                     "refault_pages_per_s", "refault_share", "high", "run", "state"])
    out = iterations[["epoch", "phase", "repeat", "iteration", "re_added_pages", "requested_pages",
                      "duration_ns"]].copy()
    dur = out["duration_ns"].astype("Float64")
    out["refault_pages_per_s"] = out["re_added_pages"].astype("Float64") / (dur / 1e9).where(dur > 0)
    req = out["requested_pages"].astype("Float64")
    out["refault_share"] = out["re_added_pages"].astype("Float64") / req.where(req > 0)
    high = (out["refault_share"].fillna(0) >= threshold).to_numpy(bool)
    run = np.zeros(len(out), np.int64)
    for i, h in enumerate(high):
        run[i] = (run[i - 1] + 1 if i else 1) if h else 0
    out["high"] = high
    out["run"] = run
    out["state"] = np.where(run >= sustained, "thrashing", np.where(run > 0, "elevated", "normal"))
    return out


def compute_alarm(amplification: float | None, s2s: float | None,
                  tolerance: float = AMPLIFICATION_TOLERANCE) -> dict[str, Any]:
    """The paper's signature: device bytes above miss demand AND scan-to-steal > 2.
    ``alarm`` is None when either figure is missing (not False: unknown)."""
    amp_high = None if amplification is None or pd.isna(amplification) else amplification > 1 + tolerance
    s2s_high = None if s2s is None or pd.isna(s2s) else s2s > SCAN_TO_STEAL_ALARM
    alarm = None if amp_high is None or s2s_high is None else bool(amp_high and s2s_high)
    return {"amplification": amplification, "scan_to_steal": s2s, "amplified": amp_high,
            "scan_to_steal_above_2": s2s_high, "alarm": alarm,
            "rule": f"amplification > {1 + tolerance:g} and scan-to-steal > {SCAN_TO_STEAL_ALARM:g}"}


def _main_reclaimer(reclaim: pd.DataFrame | None) -> str | None:
    """The reclaimer kind that reclaimed the most pages (None when none reclaimed any)."""
    if reclaim is None or reclaim.empty or not int(reclaim["reclaimed_pages"].sum()):
        return None
    return str(reclaim.groupby("kind")["reclaimed_pages"].sum().idxmax())


def compute_sweep_reclaim(cells: list) -> pd.DataFrame:
    """Per recorded cell of a sweep (:class:`moetrace.run.handle.Run` with ``cell``):
    ``cell``, ``capacity_bytes``, ``amplification``, ``scan_to_steal``, ``reclaimed_pages``,
    ``re_added_pages`` (measured pass), ``refault_file_pages`` (the kernel's), ``alarm``, the
    simulated ``lru_hit_rate`` at C, ``outside_evicted_pages`` (pool pages evicted by another
    process: fadvise, madvise, truncation) and ``reclaimer`` (the kind that reclaimed most)."""
    from moetrace.analyses.amplification import measured_epochs

    rows = []
    for run in cells:
        cell = run.cell or {}
        rc = run.tables["reclaim"] if "reclaim" in run.tables else None
        s2s = scan_to_steal(rc)
        me = measured_epochs(run.tables)
        al = compute_alarm(cell.get("amplification"), s2s)
        rows.append({"cell": run.name, "capacity_bytes": cell.get("capacity_bytes"),
                     "amplification": cell.get("amplification"), "scan_to_steal": s2s,
                     "reclaimed_pages": int(rc["reclaimed_pages"].sum()) if rc is not None else None,
                     "re_added_pages": int(me["re_added_pages"].sum()) if me is not None else None,
                     "refault_file_pages": cell.get("refault_file_pages"), "alarm": al["alarm"],
                     "lru_hit_rate": (cell.get("simulated") or {}).get("hit_rate"),
                     "outside_evicted_pages": (cell.get("outside_evictions") or {}).get("pages"),
                     "reclaimer": _main_reclaimer(rc)})
    df = pd.DataFrame(rows)
    if len(df):
        df = df.sort_values("capacity_bytes", ascending=False).reset_index(drop=True)
        for c in ("capacity_bytes", "reclaimed_pages", "re_added_pages", "refault_file_pages",
                  "outside_evicted_pages"):
            df[c] = pd.array(df[c], dtype="Int64")
        for c in ("amplification", "scan_to_steal", "lru_hit_rate"):
            df[c] = pd.array(df[c], dtype="Float64")
        df["alarm"] = pd.array(df["alarm"], dtype="boolean")
    return df
