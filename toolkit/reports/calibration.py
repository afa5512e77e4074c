"""`moetrace calibrate DIR`: what `check` says of identical cells on this machine (A/A pairs),
the thresholds that keep them quiet, and how those thresholds fare on pairs they were not fitted
on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moetrace.lazyimport import pandas as pd

from moetrace.errors import InputError
from moetrace.reports.check import load_units

#: (t_{0.975} + t_{0.80}) x sqrt(2 / n) at n = 3 a side (Welch, df ~ 4): the smallest relative change
#: a check of 3 repeats a side detects with 80 % power at alpha 0.05 is this many coefficients of
#: variation of the metric between identical cells
MDE_3 = (2.776 + 0.941) * (2 / 3) ** 0.5


def identical_groups(path: str | os.PathLike, only: list[str] | None = None) -> dict[str, list]:
    """Groups of identical cells (A/A material), {label: [Run, ...]}: a matrix's retained cells by
    kernel, MGLRU, mechanism and C (their repeats); a sweep's by capacity; else load_units.
    ``only``: shell patterns on the labels (``6.12-*``); a group is kept when one matches."""
    import fnmatch

    from moetrace.run.handle import open_run
    from moetrace.run.metadata import retained_matrix_cells

    p = Path(path)
    if (p / "matrix.json").is_file():
        groups: dict[str, list] = {}
        for c in retained_matrix_cells(p)[1]:
            label = f"{c['condition']}/{c['mechanism']}-{c['capacity_label']}"
            groups.setdefault(label, []).append(c["dir"])
        groups = {g: [open_run(p / d / "cell", unrecorded=True) for d in ds] for g, ds in groups.items()
                  if not only or any(fnmatch.fnmatchcase(g, o) for o in only)}
    else:
        groups = {g: rs for g, rs in load_units(p).items()
                  if not only or any(fnmatch.fnmatchcase(g, o) for o in only)}
    if only and not groups:
        raise InputError(f"no group of identical cells matches {', '.join(only)}", path=str(p),
                         hint="the labels are kernel-mglru-STATE/MECHANISM-C in a matrix (6.12-mglru-on/"
                              "cgroup-320MiB), the capacity in a sweep (128MiB)")
    return groups


def _pair_metrics(df) -> dict[str, list]:
    """{metric: [worse ratio, p-value]} of one A/A comparison, what a threshold decides on: worse
    None when infinitely worse (zero a side), p None when there is no test (one value a side)."""
    import math

    from moetrace.analyses import compare as C

    out = {}
    for row in df[df["metric"].isin(list(C.METRICS)) & (df["verdict"] != "incomparable")].itertuples():
        w, p = row.worse_ratio, row.p_value
        if pd.isna(w):
            continue
        w = float(w) if math.isfinite(float(w)) else None
        out[row.metric] = [w, None if pd.isna(p) else float(p)]
    return out


def loud(pm: dict[str, list], thresholds) -> bool:
    """Would check call this A/A comparison ({metric: [worse ratio, p-value]}) a regression by the
    within-cell rule: a metric worse than 1 + its threshold with p < alpha (or no test). Mirrors
    compute_comparison without a spread between cells (what that spread has to cover)."""
    import math

    from moetrace.analyses.compare import past_threshold

    return any(past_threshold(math.inf if w is None else w, p, thresholds.per_metric.get(m, 0.0), thresholds.alpha)
               for m, (w, p) in pm.items())


def quiet_share(pair_metrics: list[dict[str, list]], thresholds) -> float:
    """The share of A/A comparisons ``thresholds`` keep quiet (see loud)."""
    if not pair_metrics:
        return 1.0
    return sum(not loud(pm, thresholds) for pm in pair_metrics) / len(pair_metrics)


def calibrate(path: str | os.PathLike, thresholds=None, only: list[str] | None = None) -> dict[str, Any]:
    """Every A/A pair of identical cells (each pair both ways round) checked as a single cell a
    side: how often `check` says regression (overall and per metric), the A/A ratio's 95th
    percentile per metric (the threshold that would keep 95 % of pairs quiet), and from the
    between-repeat spread the smallest change 3 repeats a side detect. ``pair_metrics`` keeps
    each pair's worse ratios and p-values, to try other thresholds on (quiet_share)."""
    import itertools

    import numpy as np

    from moetrace.analyses import compare as C

    th = thresholds or C.Thresholds.default()
    groups = {g: [C.unit_metrics(r) for r in rs] for g, rs in identical_groups(path, only).items() if len(rs) >= 2}
    if not groups:
        raise InputError("no two identical cells to pair", path=str(path),
                         hint="give a matrix or sweep with repeats >= 2, or a directory of identical cells")
    pair_metrics, pair_cells = [], []
    per = {m: {"pairs": 0, "regressions": 0, "ratios": [], "cvs": []} for m in C.METRICS}
    by_group = {}
    for label, units in groups.items():
        by_group[label] = {"cells": len(units)}
        for m in C.METRICS:
            v = np.array([u[m] for u in units if u.get(m) is not None], dtype=float)
            if len(v) >= 2 and v.mean() > 0:
                per[m]["cvs"].append(float(v.std(ddof=1) / v.mean()))
                if m in ("iteration_time_ns", "device_bytes_per_iteration"):
                    by_group[label][f"{m}_cv"] = float(v.std(ddof=1) / v.mean())
        for i, j in itertools.permutations(range(len(units)), 2):
            df = C.compute_comparison([units[i]], [units[j]], th, spread={})  # the within-cell rule alone
            pair_metrics.append(_pair_metrics(df))
            pair_cells.append([label, i, j])
            for row in df[df["metric"].isin(list(C.METRICS))].itertuples():
                d = per[row.metric]
                d["pairs"] += 1
                d["regressions"] += row.verdict == "regression"
                if row.worse_ratio is not None and np.isfinite(float(row.worse_ratio)):
                    d["ratios"].append(float(row.worse_ratio))
    metrics = {}
    for m, d in per.items():
        if not d["pairs"]:
            continue
        r = np.array(d["ratios"])
        cv = float(np.sqrt(np.mean(np.square(d["cvs"])))) if d["cvs"] else None
        metrics[m] = {"pairs": d["pairs"], "false_regressions": d["regressions"],
                      "false_regression_rate": d["regressions"] / d["pairs"], "threshold": th.per_metric.get(m),
                      "aa_worse_ratio_p95": float(np.percentile(r, 95)) if r.size else None,
                      "aa_worse_ratios": sorted(d["ratios"]),
                      "between_repeat_cv": cv, "mde_3_repeats": MDE_3 * cv if cv is not None else None}
    pairs = len(pair_metrics)
    quiet = round(quiet_share(pair_metrics, th) * pairs)
    return {"schema": "moetrace.calibration/1", "path": str(path), "only": list(only or []),
            "groups": len(groups), "pairs": pairs, "quiet_pairs": quiet, "quiet_share": quiet / pairs,
            "metrics": metrics, "by_group": by_group, "pair_metrics": pair_metrics, "pair_cells": pair_cells,
            "splits": _repeat_splits(groups, th), "spread": spread_doc(groups, path, only)}


def spread_doc(groups: dict[str, list], path, only: list[str] | None = None) -> list[dict[str, Any]]:
    """The spread between identical cells per host and mechanism (moetrace.analyses.spread.
    measure_spread) of groups of unit metrics, as JSON rows: {"host", "mechanism", "cells",
    "groups", "source", "written" (UTC), "metrics": {metric: {"limit", "cv", "floor"}}}."""
    from moetrace.analyses import compare as C
    from moetrace.analyses.spread import measure_spread

    import datetime

    src = f"`moetrace calibrate {path}" + "".join(f" --only {o}" for o in only or []) + "`"
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for (host, mech), e in sorted(measure_spread(groups, C.METRICS, src).items()):
        rows.append({"host": host, "mechanism": mech, **e["meta"], "written": now,
                     "metrics": {m: {"limit": s.limit, "cv": s.cv, "floor": s.floor} for m, s in e["metrics"].items()}})
    return rows


def spread_entries(cal: dict[str, Any], known_hosts_only: bool = False):
    """The calibration's spread rows (spread_doc) as moetrace.analyses.spread entries, to write;
    ``known_hosts_only``: without the cells that name no host (the per-machine file keys by host)."""
    from moetrace.analyses.spread import UNKNOWN, Spread

    out = {}
    for r in cal.get("spread") or []:
        if known_hosts_only and r["host"] == UNKNOWN:
            continue
        meta = {k: r[k] for k in ("cells", "groups", "source", "written") if k in r}
        out[(r["host"], r["mechanism"])] = {"meta": meta, "metrics": {
            m: Spread(d["limit"], d["cv"], d["floor"], r.get("source", "")) for m, d in r["metrics"].items()}}
    return out


#: repeats a side in the cell-level A/A comparisons (``splits``)
SPLIT_REPEATS = 3


def _repeat_splits(groups: dict[str, list], th) -> list[dict[str, Any]]:
    """A/A comparisons of SPLIT_REPEATS cells against SPLIT_REPEATS others of the same group (the
    cell-level test, as a check of repeats runs it), in groups of >= 2 x SPLIT_REPEATS cells:
    every base triple against the first triple of the cells left, [{"group", "base", "cand",
    "metrics": {metric: [worse ratio, p-value]}}]."""
    import itertools

    from moetrace.analyses import compare as C

    k, out = SPLIT_REPEATS, []
    for label, units in groups.items():
        if len(units) < 2 * k:
            continue
        for base in itertools.combinations(range(len(units)), k):
            cand = [i for i in range(len(units)) if i not in base][:k]
            df = C.compute_comparison([units[i] for i in base], [units[i] for i in cand], th)
            values = {m: [[units[i][m] for i in base], [units[i][m] for i in cand]] for m in C.METRICS
                      if all(units[i].get(m) is not None for i in (*base, *cand))}
            out.append({"group": label, "base": list(base), "cand": cand, "metrics": _pair_metrics(df),
                        "values": values})
    return out


#: the changes (in %) detectable() makes worse on one side of the cell-level A/A comparisons
CHANGES = (1, 2, 3, 5, 7, 10, 15, 20, 30, 50, 70, 100, 150, 200, 300)
#: the share of comparisons that must name a change for it to count as detected
POWER = 0.8


def detectable(splits: list[dict[str, Any]], thresholds=None) -> dict[str, int | None]:
    """Measured, not modelled: per metric, the smallest change of CHANGES (in %) that check names a
    regression in >= POWER of the cell-level A/A comparisons when the candidate side is made that
    much worse (x (1 + change) where lower is better, / (1 + change) where higher is), with its
    thresholds; None when no change of CHANGES is; no entry where the base is 0 (nothing to scale).
    The noise is this machine's, between real cells."""
    import numpy as np

    from moetrace.analyses import compare as C

    th = thresholds or C.Thresholds.default()
    out: dict[str, int | None] = {}
    for m, (_unit, lower, _d, _doc) in C.METRICS.items():
        vals = [s["values"][m] for s in splits if m in s.get("values", {}) and np.median(s["values"][m][0]) > 0]
        if not vals:
            continue
        out[m] = None
        for pct in CHANGES:
            f = 1 + pct / 100
            named = 0
            for b, c in vals:
                c = np.asarray(c, dtype=float) * (f if lower else 1 / f)
                _r, worse, p, _t = C.compare_values(np.asarray(b, dtype=float), c, lower)
                named += C.past_threshold(worse, p, th.per_metric.get(m, 0.0), th.alpha)
            if named >= POWER * len(vals):
                out[m] = pct
                break
    return out


#: the A/A quantiles suggested_thresholds tries, lowest first
QUANTILES = (0.95, 0.975, 0.99, 1.0)
#: the share of the calibration's own A/A pairs suggested thresholds keep quiet (above the 95 %
#: asked of new pairs: a threshold fitted to its sample is optimistic about the next)
TARGET_QUIET = 0.975


def suggest(cal: dict[str, Any], thresholds=None) -> tuple[Any, float, float]:
    """(Thresholds, quantile, in-sample quiet share): each metric's threshold raised to the lowest
    A/A quantile of QUANTILES (rounded up to the next percent) at which the pairs together are
    >= TARGET_QUIET quiet; a metric is one of several a pair can fail on, so its 95th
    percentile alone keeps fewer than 95 % of pairs quiet."""
    import math

    import numpy as np

    from moetrace.analyses import compare as C

    th = thresholds or C.Thresholds.default()
    for q in QUANTILES:
        per = dict(th.per_metric)
        for m, d in cal["metrics"].items():
            r = d.get("aa_worse_ratios") or []
            if r:
                per[m] = max(per.get(m, 0.0), math.ceil((float(np.quantile(r, q)) - 1) * 100 - 1e-9) / 100)
        cand = C.Thresholds(th.alpha, per, th.watch, th.spread)
        share = quiet_share(cal["pair_metrics"], cand)
        if share >= TARGET_QUIET or q == QUANTILES[-1]:
            return cand, q, share
    raise AssertionError("unreachable")


def suggested_thresholds(cal: dict[str, Any], thresholds=None) -> str:
    """A thresholds TOML from a calibration (see suggest)."""
    th, q, share = suggest(cal, thresholds)
    only = f" --only {' --only '.join(cal['only'])}" if cal.get("only") else ""
    lines = [f"# from `moetrace calibrate {cal['path']}{only}`: {cal['pairs']} A/A pairs in {cal['groups']} groups;",
             f"# each metric at its A/A {100 * q:g}th percentile (or check's default, if higher): "
             f"{100 * share:.1f} % of these pairs quiet",
             f"alpha = {th.alpha}"]
    for m in cal["metrics"]:
        lines += ["", f"[metrics.{m}]", f"threshold = {th.per_metric[m]:g}"]
    entries = spread_entries(cal)
    if entries:
        from moetrace.analyses.spread import spread_toml

        lines += ["", "# between identical cells, per host and mechanism: with one cell a side check calls a move",
                  "# a regression only beyond `limit` (and `floor`); `cv` sizes the repeats that would decide"]
        lines += spread_toml(entries).rstrip("\n").split("\n")
    return "\n".join(lines) + "\n"


def _fitted(pair_metrics: list[dict[str, list]], thresholds):
    """The thresholds suggest() fits to these A/A pairs alone."""
    ratios: dict[str, list[float]] = {}
    for pm in pair_metrics:
        for m, (w, _p) in pm.items():
            if w is not None:
                ratios.setdefault(m, []).append(w)
    sub = {"pair_metrics": pair_metrics, "metrics": {m: {"aa_worse_ratios": sorted(r)} for m, r in ratios.items()}}
    return suggest(sub, thresholds)[0]


def _tally(comparisons: list[tuple[str, bool]]) -> dict[str, Any]:
    """{"pairs", "quiet", "share", "loud_by_group"} of [(group, loud?)]."""
    n, noisy = len(comparisons), [g for g, is_loud in comparisons if is_loud]
    by: dict[str, int] = {}
    for g in noisy:
        by[g] = by.get(g, 0) + 1
    return {"pairs": n, "quiet": n - len(noisy), "share": (n - len(noisy)) / n if n else None, "loud_by_group": by}


def held_out(cal: dict[str, Any], thresholds=None) -> dict[str, Any]:
    """How thresholds fitted to A/A pairs (suggest) fare on pairs they were not fitted on, which
    is what a new pair of identical cells can expect (in-sample shares are optimistic):

    - ``halves``: each group's cells split by run order into a first and a second half (groups
      of >= 4 cells); fitted on the pairs within one half of every group, tried on the pairs
      within the other half, and the other way round;
    - ``groups``: leave one group out: fitted on every other group's pairs, tried on its pairs
      (a condition the thresholds never saw: another kernel, MGLRU state or mechanism), in
      calibrations of two or more groups;
    - ``splits``: the same leave-one-group-out thresholds tried on the group's cell-level A/A
      comparisons (SPLIT_REPEATS cells a side; groups of >= 2 x SPLIT_REPEATS cells)."""
    from moetrace.analyses import compare as C

    th = thresholds or C.Thresholds.default()
    pms, cells = cal["pair_metrics"], cal["pair_cells"]
    sizes = {g: d["cells"] for g, d in cal["by_group"].items()}

    def half(g, i):
        return None if sizes[g] < 4 else int(i >= sizes[g] // 2)

    halves = []
    for h in (0, 1):
        fit = _fitted([pm for pm, (g, i, j) in zip(pms, cells) if half(g, i) == h == half(g, j)], th)
        halves += [(g, loud(pm, fit)) for pm, (g, i, j) in zip(pms, cells)
                   if half(g, i) == 1 - h == half(g, j)]
    groups, splits = [], []
    for g in sizes:
        others = [pm for pm, c in zip(pms, cells) if c[0] != g]
        if not others:
            continue
        fit = _fitted(others, th)
        groups += [(g, loud(pm, fit)) for pm, c in zip(pms, cells) if c[0] == g]
        splits += [(g, loud(s["metrics"], fit)) for s in cal.get("splits", []) if s["group"] == g]
    return {"halves": _tally(halves), "groups": _tally(groups), "splits": _tally(splits)}


def split_summary(cal: dict[str, Any], thresholds=None) -> dict[str, Any]:
    """The cell-level A/A comparisons (``splits``) under ``thresholds``, overall and per group:
    {"comparisons", "quiet", "detectable_pct", "by_group": {label: {"comparisons", "quiet",
    "detectable_pct"}}}; the noise, and so what 3 repeats detect, differs by mechanism."""
    def one(splits):
        return {"comparisons": len(splits), "quiet": sum(not loud(s["metrics"], thresholds) for s in splits),
                "detectable_pct": detectable(splits, thresholds)}

    from moetrace.analyses import compare as C

    thresholds = thresholds or C.Thresholds.default()
    splits = cal.get("splits") or []
    out = one(splits)
    out["by_group"] = {g: one([s for s in splits if s["group"] == g]) for g in cal["by_group"]
                       if any(s["group"] == g for s in splits)}
    return out


def save_machine_spread(cal: dict[str, Any]) -> dict[str, Any]:
    """Merge the calibration's spread of cells that name their host into the per-machine file
    (moetrace.analyses.spread.machine_write_path): {"path", "entries": ["host/mechanism", ...],
    "why": why nothing was written, or None}."""
    from moetrace.analyses import compare as C
    from moetrace.reports.machine_thresholds import machine_write_path, write_machine_file

    path = machine_write_path()
    entries = spread_entries(cal, known_hosts_only=True)
    if path is None:
        return {"path": None, "entries": [], "why": "MOETRACE_MACHINE_THRESHOLDS is empty"}
    if not entries:
        return {"path": str(path), "entries": [], "why": "no cell names its host (cell.json host)"}
    write_machine_file(path, entries, C.METRICS)
    return {"path": str(path), "entries": [f"{h}/{m}" for h, m in entries], "why": None}
