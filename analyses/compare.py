"""Regression checks: the same cell on two kernels (or two settings), metric by metric.

One *unit* is a recorded run or cell; repeats are several units of the same kind (a sweep's
cells of one capacity, or several cell directories). For each metric the base and candidate
medians, their spread, the ratio candidate / base, and where both sides have >= 2 repeats a
Welch t-test (on the logs of positive values) and a bootstrap interval of the ratio of means
(scipy); with one unit a side, a Mann-Whitney U test of the per-iteration samples where the
metric has them (iteration time, as mmtests' compare tests its samples), else the threshold
alone (column ``test`` says which). A metric regressed when it moved the wrong way by more than
its threshold and the test agrees (p < alpha). Within-cell samples do not see the noise between
identical cells (page cache state, the host): with one cell a side a metric regressed only
beyond its spread between identical cells of that mechanism on that machine
(:mod:`moetrace.analyses.spread`); a move past the threshold but within that spread is
*inconclusive*, with the repeats a side that would decide. The geometric mean of the
direction-normalised ratios (> 1: worse) summarises all.

Thresholds (TOML, every key optional)::

    alpha = 0.05                 # significance level of the t-test
    [metrics.iteration_time_ns]
    threshold = 0.10             # relative change that counts (0.10 = 10 %)
    [watch]                      # `moetrace watch`'s alarms (WATCH_THRESHOLDS)
    scan_to_steal = 2.0
    [spread."HOST".cgroup]       # between identical cells (moetrace.analyses.spread;
    iteration_time_ns = { limit = 0.85, cv = 0.2 }   # `moetrace calibrate` writes it)
"""

from __future__ import annotations

import math
import tomllib
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moetrace.analyses.spread import Spread, SpreadEntries, parse_spread, repeats_to_decide
from moetrace.errors import InputError

#: metric -> (unit, lower is better, default threshold, what it is)
METRICS: dict[str, tuple[str, bool, float, str]] = {
    "iteration_time_ns": ("ns", True, 0.10, "median measured iteration time"),
    "device_bytes_per_iteration": ("bytes", True, 0.05, "device bytes read per measured iteration (diskstats)"),
    "amplification": ("", True, 0.05, "device bytes / simulated LRU miss demand"),
    "rereads_per_iteration": ("pages", True, 0.05, "pages re-added (read again after eviction) per measured "
                                                   "iteration"),
    "refaults_per_iteration": ("pages", True, 0.05, "workingset_refault_file per measured iteration"),
    "scan_to_steal": ("", True, 0.10, "pages scanned / reclaimed (reclaim probe)"),
    "hit_only_ns_per_kib": ("ns/KiB", True, 0.10, "hit-only read calls: ns per KiB"),
    "hit_only_p50_ns": ("ns", True, 0.25, "hit-only read-call latency, median (log2 histogram)"),
    "hit_only_p99_ns": ("ns", True, 0.50, "hit-only read-call latency, p99 (log2 histogram)"),
    "age_at_eviction_p50_ns": ("ns", False, 0.25, "insertion-to-eviction dwell, median (lru probe): shorter = "
                                                  "pages evicted younger"),
    "aging_ms_per_increment": ("ms", False, 0.25, "MGLRU: ms between max_seq increments (shorter = faster "
                                                  "aging churn)"),
}


#: `moetrace watch`'s alarm thresholds ([watch] in the same TOML): name -> (default, what it is)
WATCH_THRESHOLDS: dict[str, tuple[float, str]] = {
    "amplification": (1.5, "pool device bytes / computed LRU misses in one interval (with scan_to_steal: the "
                           "paper's signature)"),
    "scan_to_steal": (2.0, "pages scanned / stolen by reclaim in one interval (with amplification)"),
    "rereads_pages": (256.0, "pool pages re-added (read again after their eviction) in one interval"),
    "outside_pages": (1.0, "pool pages evicted in one interval by an evictor other than reclaim (DAMON, "
                           "proactive reclaim, fadvise, drop_caches, truncation, other)"),
    "psi_full_pct": (10.0, "share of the interval in which every task of the scope stalled on memory (PSI full)"),
}


@dataclass(frozen=True)
class Thresholds:
    alpha: float
    per_metric: dict[str, float]
    watch: dict[str, float] = field(default_factory=lambda: {k: v[0] for k, v in WATCH_THRESHOLDS.items()})
    #: the file's [spread] tables (moetrace.analyses.spread): {(host, mechanism): entry}
    spread: SpreadEntries = field(default_factory=dict)

    @classmethod
    def default(cls) -> "Thresholds":
        return cls(0.05, {m: v[2] for m, v in METRICS.items()})


def load_thresholds(path: str | Path | None) -> Thresholds:
    """Thresholds from a TOML file (see module doc); defaults for what it leaves out."""
    t = Thresholds.default()
    if path is None:
        return t
    p = Path(path)
    try:
        raw = p.read_bytes()
        doc = tomllib.loads(raw.decode("utf-8"))
    except OSError as e:
        raise InputError(f"cannot read thresholds: {e.strerror}", path=str(p)) from None
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text (byte {raw[e.start]:#04x}); TOML is UTF-8", path=str(p),
                         offset=e.start) from None
    except tomllib.TOMLDecodeError as e:
        import re

        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))  # Python < 3.14 has no e.lineno
        line = getattr(e, "lineno", None) or (int(m.group(1)) if m else None)
        raise InputError(f"not valid TOML ({str(e).split(' (at line')[0]})", path=str(p), line=line) from None
    per = dict(t.per_metric)
    metrics = doc.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise InputError("metrics must be a table: [metrics.NAME] threshold = 0.10", path=str(p))
    for name, v in metrics.items():
        if name not in METRICS:
            raise InputError(f"unknown metric {name!r}", path=str(p), hint="metrics: " + ", ".join(METRICS))
        thr = v.get("threshold") if isinstance(v, dict) else None
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0 <= thr <= 1e300:
            raise InputError(f"metrics.{name}.threshold must be a number >= 0", path=str(p))
        per[name] = float(thr)
    alpha = doc.get("alpha", t.alpha)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise InputError("alpha must be a number in (0, 1)", path=str(p))
    spread = parse_spread(doc.get("spread"), METRICS, str(p), f"--thresholds {p}")
    return Thresholds(float(alpha), per, _watch_thresholds(doc.get("watch"), t.watch, p), spread)


def _watch_thresholds(table: Any, base: dict[str, float], p: Path) -> dict[str, float]:
    """The [watch] table: alarm thresholds of `moetrace watch` (WATCH_THRESHOLDS)."""
    out = dict(base)
    if table is None:
        return out
    if not isinstance(table, dict):
        raise InputError("watch must be a table: [watch] scan_to_steal = 2.0", path=str(p))
    for k, v in table.items():
        if k not in WATCH_THRESHOLDS:
            raise InputError(f"unknown watch threshold {k!r}", path=str(p),
                             hint="watch thresholds: " + ", ".join(WATCH_THRESHOLDS))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1e300:
            raise InputError(f"watch.{k} must be a number >= 0", path=str(p))
        out[k] = float(v)
    return out


# -- metrics of one unit ---------------------------------------------------------------------------

def unit_metrics(run) -> dict[str, float | None]:
    """The metrics of one recorded run or cell (:class:`moetrace.run.handle.Run`); None where the
    recording cannot say (a probe not recorded, not a cell, not an MGLRU kernel)."""
    from moetrace.analyses import age as G
    from moetrace.analyses import hitpath as H
    from moetrace.analyses import reclaim as R
    from moetrace.analyses.amplification import measured_epochs

    cell = run.cell or {}
    t = run.tables
    out: dict[str, float | None] = {m: None for m in METRICS}
    n_meas = cell.get("measured_iterations")
    it = t["iterations"] if "iterations" in t else None
    if it is not None and len(it):
        meas = it[it["phase"] == "measured"]
        if len(meas):
            out["iteration_time_ns"] = float(meas["duration_ns"].median())
            n_meas = n_meas or len(meas)
    if cell.get("iteration_time_median_ns") is not None:
        out["iteration_time_ns"] = float(cell["iteration_time_median_ns"])
    for k in ("device_bytes_per_iteration", "amplification"):
        if cell.get(k) is not None:
            out[k] = float(cell[k])
    me = measured_epochs(t)
    if me is not None and n_meas:
        out["rereads_per_iteration"] = float(me["re_added_pages"].sum()) / float(n_meas)
    if cell.get("refault_file_pages") is not None and n_meas:
        out["refaults_per_iteration"] = float(cell["refault_file_pages"]) / float(n_meas)
    if "reclaim" in t:
        out["scan_to_steal"] = R.scan_to_steal(t["reclaim"])
    if "reads" in t:
        out["hit_only_ns_per_kib"] = H.compute_hitpath_summary(t["reads"])["hit_only_ns_per_kib"]
    if "reads_latency" in t:
        q = H.compute_latency_quantiles(t["reads_latency"])
        row = q[(q["scope"] == "pool") & (q["class"] == "hit_only")]
        if len(row):
            for c, m in (("p50_ns", "hit_only_p50_ns"), ("p99_ns", "hit_only_p99_ns")):
                v = row[c].iloc[0]
                out[m] = None if pd.isna(v) else float(v)
    if "lru_dwell_histogram" in t:
        q = G.compute_dwell_quantiles(t["lru_dwell_histogram"])
        row = q[q["kind"] == "insertion_to_eviction"]
        if len(row) and row["p50_ns"].notna().iloc[0]:
            out["age_at_eviction_p50_ns"] = float(row["p50_ns"].iloc[0])
    if "lru_gen" in t and len(t["lru_gen"]):
        cad = G.compute_aging_cadence(t["lru_gen"])
        v = cad["ms_per_increment"].dropna() if "ms_per_increment" in cad else pd.Series(dtype=float)
        if len(v):
            out["aging_ms_per_increment"] = float(v.median())
    res: dict[str, Any] = {k: (None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v))
                           for k, v in out.items()}
    res["refault_counting"] = refault_counting(run)  # not a metric: what refaults_per_iteration counted
    # not metrics: whose spread between identical cells applies (moetrace.analyses.spread), and the
    # miss demand amplification divides device bytes by (its floor is device bytes' over it)
    res["host"], res["mechanism"] = host_of(run), cell.get("mechanism")
    miss = cell.get("miss_bytes_per_iteration")
    res["miss_bytes_per_iteration"] = float(miss) if isinstance(miss, (int, float)) and miss > 0 else None
    # not a metric: per-iteration samples, tested when one unit stands on each side
    res["samples"] = {"iteration_time_ns": meas["duration_ns"].to_numpy(float)} \
        if it is not None and len(it) and len(it[it["phase"] == "measured"]) else {}
    return res


#: how workingset_refault_file counts, by kernel: Linux 6.1-6.4 with MGLRU on adds a refault only
#: when the folio's shadow entry is from its memcg's current oldest generation (lru_gen_refault);
#: 6.5 counts every one ("Multi-gen LRU: fix workingset accounting"), as classic LRU always did
REFAULTS_ALL = "every refault"
REFAULTS_OLDEST_GEN = "MGLRU before 6.5: only refaults of the oldest generation"


def _version(release: str) -> tuple[int, int] | None:
    parts = release.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "x")
    except (IndexError, ValueError):
        return None


def refault_counting(run) -> str | None:
    """What the run's workingset_refault_file counted (REFAULTS_ALL / REFAULTS_OLDEST_GEN), from
    its kernel's release and MGLRU state; None when the run does not say."""
    m = run.manifest or {}
    k = (run.cell or {}).get("kernel") or m.get("kernel") or {}
    release = k.get("release") if isinstance(k, dict) else k
    mg = k.get("mglru") if isinstance(k, dict) else None
    on = mg.get("on") if isinstance(mg, dict) else None
    if on is None and isinstance(m.get("mglru"), dict):
        on = m["mglru"].get("on")
    ver = _version(str(release)) if release else None
    if ver is None or on is None:
        return None
    return REFAULTS_OLDEST_GEN if on and ver < (6, 5) else REFAULTS_ALL


def host_of(run) -> str | None:
    """The host a unit ran on: its cell.json ``host.name``, else its run manifest's host name;
    None when neither says (a unit of unknown host, which never conflicts with another)."""
    for doc in (run.cell or {}, run.manifest or {}):
        h = doc.get("host")
        name = h.get("name") if isinstance(h, dict) else h
        if isinstance(name, str) and name:
            return name
    return None


def identity(run) -> dict[str, Any]:
    """What must match for two units to be comparable: the plan and the pool's geometry.
    Capacity, mode, kernel and host may differ (that is what a check compares), but one set of
    repeats comes from one host (``moetrace check`` refuses to pool hosts unless told to)."""
    m = run.manifest
    plan, pool = m.get("plan") or {}, m.get("pool") or {}
    return {"plan": plan.get("identity"), "geometry": pool.get("geometry"),
            "capacity_bytes": (run.cell or {}).get("capacity_bytes"), "mode": (run.cell or {}).get("mode"),
            "kernel": (m.get("kernel") or {}).get("release") if isinstance(m.get("kernel"), dict) else m.get("kernel"),
            "host": host_of(run)}


def incomparable(base: Sequence, cand: Sequence) -> str | None:
    """Why the two sets of units cannot be compared (None: they can)."""
    ids = [identity(r) for r in (*base, *cand)]
    plans = {str(i["plan"]) for i in ids}
    if len(plans) > 1:
        return "different plans: " + ", ".join(sorted(plans)) + " (a check compares the same replay)"
    geos = {str(i["geometry"]) for i in ids}
    if len(geos) > 1:
        return "different pool geometries: " + "; ".join(sorted(geos))
    return None


# -- the comparison --------------------------------------------------------------------------------

def _spread(x: np.ndarray) -> float | None:
    if len(x) < 2:
        return None
    med = float(np.median(x))
    return float((x.max() - x.min()) / med) if med else None


def compute_comparison(base: Sequence[Mapping[str, float | None]], cand: Sequence[Mapping[str, float | None]],
                       thresholds: Thresholds | None = None, seed: int = 0,
                       spread: Mapping[str, Spread] | None = None) -> pd.DataFrame:
    """One row per metric with values on both sides, then a ``geomean`` row: ``metric``,
    ``unit``, ``lower_is_better``, ``base_n``, ``base_median``, ``base_spread``, ``cand_n``,
    ``cand_median``, ``cand_spread``, ``ratio`` (cand / base medians), ``worse_ratio`` (> 1:
    worse, whichever the direction), ``p_value`` (Welch; with one value a side Mann-Whitney U of
    the per-iteration samples, or NA), ``ratio_ci_low`` / ``ratio_ci_high`` (bootstrap 95 % of
    mean(cand) / mean(base); NA below 2 repeats), ``threshold``, ``spread_limit`` (the spread
    between identical cells a move must pass with one value a side; NA with repeats), ``test``,
    ``verdict`` (:func:`verdict_of`: regression, inconclusive, improvement, same, or incomparable:
    refaults counted differently on the two sides, see :func:`refault_counting`; such a row counts
    in neither the verdict nor the geomean, and ``df.attrs["notes"]`` says why),
    ``repeats_to_decide`` (inconclusive rows: the cells a side that would decide).

    ``spread``: {metric: Spread} between identical cells, applied where a side has one value;
    None: the shipped defaults of the units' mechanisms (moetrace.analyses.spread.default_spread);
    {}: none, the within-cell rule alone (what `calibrate` measures A/A pairs with)."""
    from moetrace.analyses.spread import combine, default_spread

    th = thresholds or Thresholds.default()
    if spread is None:
        spread = combine(default_spread(u.get("mechanism")) for u in (*base, *cand))
    rows = []
    notes: list[str] = []
    counting = {side: sorted({u.get("refault_counting") for u in units} - {None})
                for side, units in (("base", base), ("candidate", cand))}
    refaults_differ = len(set(counting["base"]) | set(counting["candidate"])) > 1
    for m, (unit, lower, _d, _doc) in METRICS.items():
        b = np.array([u[m] for u in base if u.get(m) is not None], dtype=float)
        c = np.array([u[m] for u in cand if u.get(m) is not None], dtype=float)
        if not len(b) or not len(c):
            continue
        bs, cs = _one_unit_samples(base, m), _one_unit_samples(cand, m)
        ratio, worse, p, test = compare_values(b, c, lower, bs, cs)
        bm, cm = float(np.median(b)), float(np.median(c))
        lo, hi = _bootstrap(b, c, seed)
        thr = th.per_metric.get(m, 0.0)
        sp = amplification_floor(spread.get(m), spread, m, (*base, *cand)) if len(b) < 2 or len(c) < 2 else None
        n_decide = None
        if m == "refaults_per_iteration" and refaults_differ:
            verdict = "incomparable"
            notes.append(f"refaults_per_iteration not compared: workingset_refault_file counted differently "
                         f"(base: {'; '.join(counting['base']) or 'unknown'}; candidate: "
                         f"{'; '.join(counting['candidate']) or 'unknown'}). Linux 6.1-6.4 with MGLRU on "
                         f"counts a refault only when its shadow entry is from the oldest generation; 6.5 "
                         f"counts every one (\"Multi-gen LRU: fix workingset accounting\"). Compare "
                         f"rereads_per_iteration (the pagecache probe) or device bytes instead.")
        else:
            verdict, n_decide = verdict_of(bm, cm, worse, p, thr, th.alpha, lower, sp)
        rows.append({"metric": m, "unit": unit, "lower_is_better": lower, "base_n": len(b), "base_median": bm,
                     "base_spread": _spread(b), "cand_n": len(c), "cand_median": cm, "cand_spread": _spread(c),
                     "ratio": ratio, "worse_ratio": worse, "p_value": p, "ratio_ci_low": lo, "ratio_ci_high": hi,
                     "threshold": thr, "spread_limit": sp.limit if sp else None, "test": test, "verdict": verdict,
                     "repeats_to_decide": n_decide})
    return _finish_comparison(rows, notes)


COMPARISON_COLUMNS = ["metric", "unit", "lower_is_better", "base_n", "base_median", "base_spread", "cand_n",
                      "cand_median", "cand_spread", "ratio", "worse_ratio", "p_value", "ratio_ci_low", "ratio_ci_high",
                      "threshold", "spread_limit", "test", "verdict", "repeats_to_decide"]


def _bootstrap(b: np.ndarray, c: np.ndarray, seed: int) -> tuple[float | None, float | None]:
    """The bootstrap 95 % interval of mean(c) / mean(b), (None, None) below 2 values a side."""
    from scipy import stats

    if len(b) < 2 or len(c) < 2 or b.mean() <= 0:
        return None, None
    res = stats.bootstrap((c, b), lambda x, y, axis=-1: np.mean(x, axis=axis) / np.mean(y, axis=axis),
                          vectorized=True, paired=False, n_resamples=2000, confidence_level=0.95,
                          method="percentile", random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _finish_comparison(rows: list[dict[str, Any]], notes: list[str]) -> pd.DataFrame:
    """The comparison's rows as a typed DataFrame with its geomean row and notes."""
    df = pd.DataFrame(rows, columns=COMPARISON_COLUMNS)
    counted = df[df["verdict"] != "incomparable"]
    finite = counted["worse_ratio"][np.isfinite(counted["worse_ratio"].astype(float)) & (counted["worse_ratio"] > 0)]
    if len(finite):
        g = float(np.exp(np.log(finite.astype(float)).mean()))
        geo = {c: None for c in df.columns}
        geo.update(metric="geomean", unit="", worse_ratio=g, verdict="(summary)")
        df = pd.concat([df, pd.DataFrame([geo])], ignore_index=True)
    for c in ("base_median", "base_spread", "cand_median", "cand_spread", "ratio", "worse_ratio", "p_value",
              "ratio_ci_low", "ratio_ci_high", "threshold", "spread_limit"):
        df[c] = pd.array(df[c], dtype="Float64")
    for c in ("base_n", "cand_n", "repeats_to_decide"):
        df[c] = pd.array(df[c], dtype="Int64")
    df["lower_is_better"] = pd.array(df["lower_is_better"], dtype="boolean")
    df.attrs["notes"] = notes
    return df


def amplification_floor(sp: Spread | None, spread: Mapping[str, Spread], metric: str,
                        units: Sequence[Mapping[str, Any]]) -> Spread | None:
    """``sp``, and for amplification (device bytes / the simulated miss demand) a floor no lower
    than device bytes' floor over the units' median miss demand per iteration: the device's noise
    that adds (other processes' reads) moves amplification by that much (measured: two identical
    cells at 64 MiB, 1.73 against 0.98 MB per iteration, amplification 0.75 against 0.42)."""
    import dataclasses

    dev = spread.get("device_bytes_per_iteration")
    miss = [u["miss_bytes_per_iteration"] for u in units if u.get("miss_bytes_per_iteration")]
    if sp is None or metric != "amplification" or dev is None or not miss:
        return sp
    return dataclasses.replace(sp, floor=max(sp.floor, dev.floor / float(np.median(miss))))


def verdict_of(base: float, cand: float, worse: float, p: float | None, threshold: float, alpha: float,
               lower: bool, spread: Spread | None = None) -> tuple[str, int | None]:
    """(verdict, repeats a side that would decide it) of one metric: base and candidate values,
    ``worse`` (> 1: worse), the test's ``p`` (None: no test), the metric's ``threshold``. A move
    the wrong way past the threshold (:func:`past_threshold`) is a regression, and the other way
    an improvement; else same. With one value a side (``spread`` given: the metric's spread
    between identical cells, moetrace.analyses.spread) a move of at most ``spread.floor`` (the
    metric's unit) is the same, and a move past the threshold is a regression or an improvement only
    beyond ``spread.limit``: within it, a regression is *inconclusive* (with the repeats a side
    that would decide, repeats_to_decide) and an improvement the same."""
    if spread is not None and abs(cand - base) <= spread.floor:
        return "same", None
    if past_threshold(worse, p, threshold, alpha):
        if spread is None or worse > 1 + spread.limit:
            return "regression", None
        return "inconclusive", repeats_to_decide(worse, spread.cv, threshold, alpha)
    better = 1 / worse if worse else math.inf
    if past_threshold(better, p, threshold, alpha) and (spread is None or better > 1 + spread.limit):
        return "improvement", None
    return "same", None


def compare_values(b: np.ndarray, c: np.ndarray, lower: bool, bs: np.ndarray | None = None,
                   cs: np.ndarray | None = None) -> tuple[float, float, float | None, str]:
    """(ratio of the medians cand / base, worse ratio (> 1: worse, whichever the direction),
    p-value or None, the test's name) of one metric's values, base ``b`` and candidate ``c``:
    Welch t over the cells with two or more a side (:func:`welch`); with one a side, Mann-Whitney U
    over the per-iteration samples ``bs`` / ``cs`` where both are given; else no test."""
    from scipy import stats

    bm, cm = float(np.median(b)), float(np.median(c))
    if bm == 0 and cm == 0:
        ratio = 1.0
    elif bm == 0:
        ratio = math.inf
    else:
        ratio = cm / bm
    worse = ratio if lower else (1 / ratio if ratio else math.inf)
    p, test = None, "threshold only (one value a side)"
    if len(b) < 2 or len(c) < 2:
        if bs is not None and cs is not None:
            p = float(stats.mannwhitneyu(cs, bs, alternative="two-sided").pvalue)
            test = f"per-iteration samples: Mann-Whitney U ({len(bs)} / {len(cs)})"
    else:
        p, test = welch(b, c)
    return ratio, worse, p, test


def welch(b: np.ndarray, c: np.ndarray) -> tuple[float, str]:
    """(p-value, the test's name) of Welch's t between the cells ``b`` and ``c`` (>= 2 a side): on
    the logs of the values where every one is positive (a move is a ratio; the spread between
    identical cells is log-normal, moetrace.analyses.spread), else on the values. On raw values one
    noisy side dominates Welch's variance and leaves ~1-2 degrees of freedom at 3 a side:
    measured, an engine loader 99x worse (3 cells at 0.81 against 3 at 40-112) had p = 0.0505."""
    from scipy import stats

    logs = bool((b > 0).all() and (c > 0).all())
    x, y = (np.log(b), np.log(c)) if logs else (b, c)
    test = f"cells: Welch t{' on logs' if logs else ''} ({len(b)} / {len(c)})"
    if np.ptp(x) == 0 and np.ptp(y) == 0:
        return (1.0 if x[0] == y[0] else 0.0), test
    with warnings.catch_warnings():  # nearly identical cells: scipy warns of precision (the move is ~1x)
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.ttest_ind(y, x, equal_var=False).pvalue), test


def past_threshold(worse: float, p: float | None, threshold: float, alpha: float) -> bool:
    """A move check names: ``worse`` (> 1: worse) beyond 1 + ``threshold``, and significant (p <
    alpha, or no test: one value a side)."""
    return worse > 1 + threshold and (p is None or p < alpha)


#: the fewest per-iteration samples a side for the per-iteration test
MIN_SAMPLES = 8


def _one_unit_samples(units: Sequence[Mapping[str, Any]], metric: str) -> np.ndarray | None:
    """The per-iteration samples of ``metric`` when ``units`` is one unit that has >= MIN_SAMPLES."""
    if len(units) != 1:
        return None
    s = (units[0].get("samples") or {}).get(metric)
    return None if s is None or len(s) < MIN_SAMPLES else np.asarray(s, dtype=float)


def regressed(df: pd.DataFrame) -> list[str]:
    """The metrics whose verdict is a regression."""
    return df.loc[df["verdict"] == "regression", "metric"].tolist()


def inconclusive(df: pd.DataFrame) -> dict[str, int | None]:
    """{metric: repeats a side that would decide (None: more than MAX_REPEATS)} of the metrics whose
    verdict is inconclusive (one value a side: past the threshold, within the spread between cells)."""
    rows = df[df["verdict"] == "inconclusive"]
    return {m: (None if pd.isna(n) else int(n)) for m, n in zip(rows["metric"], rows["repeats_to_decide"])}
