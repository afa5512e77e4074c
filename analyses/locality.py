"""Router locality statistics (paper §3, Table 1): pure functions -> tidy DataFrames.

Every statistic is computed on the accepted-token selections of a typed trace
(``TypedTrace.tokens()``: the rejected first pass of a speculative fallback is
left out, a speculative accept contributes two tokens).

Definitions
-----------
Zipf slope (alpha)
    For one layer: sort the per-expert selection counts in decreasing order,
    keep the ranks r = 1..R whose count c_r is nonzero, and fit
    log c_r = a - alpha * log r by ordinary least squares over a geometric
    grid of ranks (``zipf_fit_ranks``: ~24 ranks from 1 to R, evenly spaced
    in log r, so that the hundreds of tail ranks seen once or twice do not
    outweigh the head); alpha is the slope's negative. Overall: the same fit on the layer-averaged
    rank-frequency curve, f(r) = mean over layers of (c_r / layer total)
    (rank-wise mean of each layer's sorted frequencies, zeros included),
    over the ranks where f(r) > 0. Real counts (no token order) use the same
    fit. On i.i.d. Zipf(s) samples large enough that every rank is observed
    several times the fit returns s; on short traces the finite tail
    steepens it somewhat.
Top-8 share
    Per layer, the fraction of the layer's selections that go to its 8 most
    selected experts.
Reuse W_n
    The fraction of selections (token t, layer l, expert e) for which e was
    also selected at layer l by at least one of the tokens t-n .. t-1. Tokens
    t < n are skipped (their window is incomplete), so W_n estimates the
    steady-state rate; a trace shorter than n+1 tokens gives NA.
Coverage
    Distinct (layer, expert) pairs selected by the first t tokens divided by
    the pool size n_layers * n_experts; per layer, distinct experts / n_experts.
Top-N Jaccard
    Per layer, the N most selected experts of each trace (ties broken by the
    lower expert index), |A & B| / |A | B|, averaged over layers. N is capped
    at n_experts // 4 so that small pools do not give a trivial 1.
"""

from __future__ import annotations

from itertools import combinations
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

REUSE_WINDOWS = (1, 8, 64)


def selection_counts(tokens: pd.DataFrame, n_layers: int, n_experts: int) -> np.ndarray:
    """Counts (n_layers, n_experts) of selections from a tokens frame (token, layer, expert)."""
    key = tokens["layer"].to_numpy(np.int64) * n_experts + tokens["expert"].to_numpy(np.int64)
    return np.bincount(key, minlength=n_layers * n_experts).reshape(n_layers, n_experts).astype(np.float64)


def zipf_fit_ranks(n_ranks: int, points: int = 24) -> np.ndarray:
    """The 1-based ranks a slope fit uses: a geometric grid from 1 to n_ranks
    (about ``points`` per full range, duplicates removed), so every decade of
    rank weighs the same in the fit."""
    if n_ranks < 1:
        return np.zeros(0, np.int64)
    return np.unique(np.round(np.logspace(0.0, np.log10(n_ranks), points)).astype(np.int64))


def fit_zipf_slope(freq: np.ndarray) -> float:
    """Rank-frequency slope alpha of one frequency (or count) vector (module docstring).

    Returns NaN when fewer than two ranks are nonzero.
    """
    f = np.sort(np.asarray(freq, dtype=np.float64))[::-1]
    f = f[f > 0]
    if f.size < 2:
        return float("nan")
    r = zipf_fit_ranks(f.size)
    x = np.log(r.astype(np.float64))
    y = np.log(f[r - 1])
    x -= x.mean()
    return float(-(x @ (y - y.mean())) / (x @ x))


def overall_zipf_slope(counts: np.ndarray) -> float:
    """Zipf slope of the layer-averaged rank-frequency curve of counts (n_layers, n_experts)."""
    c = np.asarray(counts, dtype=np.float64)
    tot = c.sum(axis=1, keepdims=True)
    keep = tot[:, 0] > 0
    if not keep.any():
        return float("nan")
    freq = np.sort(c[keep] / tot[keep], axis=1)[:, ::-1].mean(axis=0)
    return fit_zipf_slope(freq)


def top_share(counts: np.ndarray, n: int = 8) -> np.ndarray:
    """Per layer, the share of selections held by the n most selected experts."""
    c = np.asarray(counts, dtype=np.float64)
    tot = c.sum(axis=1)
    top = -np.sort(-c, axis=1)[:, :n].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tot > 0, top / np.where(tot > 0, tot, 1), np.nan)


def compute_layer_locality(counts: np.ndarray) -> pd.DataFrame:
    """Per layer: selections, distinct experts, coverage, top-8 share, Zipf slope.

    counts: (n_layers, n_experts) selection counts (accepted tokens).
    """
    c = np.asarray(counts, dtype=np.float64)
    L, E = c.shape
    distinct = (c > 0).sum(axis=1)
    return pd.DataFrame({
        "layer": np.arange(L, dtype=np.int64),
        "selections": c.sum(axis=1).astype(np.int64),
        "distinct_experts": distinct.astype(np.int64),
        "coverage": distinct / E,
        "top8_share": top_share(c, 8),
        "zipf_slope": [fit_zipf_slope(row) for row in c],
    })


def reuse_gaps(tokens: pd.DataFrame, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """For each selection (sorted by token): its token index and the gap in tokens to
    the previous selection of the same (layer, expert) (a huge value if none)."""
    tok = tokens["token"].to_numpy(np.int64)
    key = tokens["layer"].to_numpy(np.int64) * n_experts + tokens["expert"].to_numpy(np.int64)
    order = np.lexsort((tok, key))
    ks, ts = key[order], tok[order]
    gap = np.full(ts.size, np.iinfo(np.int64).max // 2, dtype=np.int64)
    same = ks[1:] == ks[:-1]
    gap[1:][same] = ts[1:][same] - ts[:-1][same]
    return ts, gap


def compute_reuse(tokens: pd.DataFrame, n_experts: int, windows: Sequence[int] = REUSE_WINDOWS,
                  n_layers: int | None = None) -> pd.DataFrame:
    """W_n reuse for each window n (module docstring), overall and per layer.

    Returns columns layer (NA for the overall row), window, reuse, selections
    (the denominator: selections of tokens t >= n).
    """
    ts, gap = reuse_gaps(tokens, n_experts)
    lay = None
    if n_layers is None or n_layers > 0:
        key = tokens["layer"].to_numpy(np.int64) * n_experts + tokens["expert"].to_numpy(np.int64)
        order = np.lexsort((tokens["token"].to_numpy(np.int64), key))
        lay = key[order] // n_experts
    rows = []
    for n in windows:
        m = ts >= n
        den = int(m.sum())
        rows.append({"layer": pd.NA, "window": int(n), "reuse": (gap[m] <= n).sum() / den if den else np.nan,
                     "selections": den})
        if lay is not None and n_layers:
            hit = np.bincount(lay[m], weights=(gap[m] <= n), minlength=n_layers)
            d = np.bincount(lay[m], minlength=n_layers)
            with np.errstate(invalid="ignore", divide="ignore"):
                r = np.where(d > 0, hit / np.maximum(d, 1), np.nan)
            for li in range(n_layers):
                rows.append({"layer": li, "window": int(n), "reuse": r[li], "selections": int(d[li])})
    df = pd.DataFrame(rows)
    df["layer"] = df["layer"].astype("Int64")
    return df


def default_checkpoints(n_tokens: int) -> list[int]:
    """Coverage checkpoints: 1, 10, 30, 100, 300, 1000, ... below n_tokens, and n_tokens."""
    pts, base = [], 1
    while base < n_tokens:
        for m in (1, 3):
            if base * m < n_tokens and (base * m) not in pts:
                pts.append(base * m)
        base *= 10
    pts = sorted(set(p for p in pts if p != 3))
    return pts + [n_tokens]


def compute_coverage_growth(tokens: pd.DataFrame, n_layers: int, n_experts: int,
                            checkpoints: Sequence[int] | None = None) -> pd.DataFrame:
    """Distinct (layer, expert) pairs touched by the first t tokens, and that over the pool size.

    Columns tokens, distinct_experts, coverage (the last row is the whole trace).
    """
    tok = tokens["token"].to_numpy(np.int64)
    n_tokens = int(tok.max()) + 1 if tok.size else 0
    key = tokens["layer"].to_numpy(np.int64) * n_experts + tokens["expert"].to_numpy(np.int64)
    first = pd.Series(tok).groupby(key).min().to_numpy()
    new_per_token = np.bincount(first, minlength=n_tokens)
    cum = np.cumsum(new_per_token)
    pts = list(checkpoints) if checkpoints is not None else default_checkpoints(n_tokens)
    pts = [p for p in pts if 0 < p <= n_tokens] or ([n_tokens] if n_tokens else [])
    distinct = np.array([cum[p - 1] for p in pts], dtype=np.int64)
    return pd.DataFrame({"tokens": np.array(pts, np.int64), "distinct_experts": distinct,
                         "coverage": distinct / (n_layers * n_experts)})


def top_sets(counts: np.ndarray, n: int) -> np.ndarray:
    """Per layer, the indices of the n most selected experts (ties: lower index first)."""
    c = np.asarray(counts, dtype=np.float64)
    order = np.lexsort((np.broadcast_to(np.arange(c.shape[1]), c.shape), -c), axis=1)
    return order[:, :n]


def effective_top_n(top_n: int, n_experts: int) -> int:
    """The N actually used for top-N sets: min(top_n, n_experts // 4), at least 1."""
    return max(1, min(int(top_n), n_experts // 4))


def layer_jaccard(a: np.ndarray, b: np.ndarray, top_n: int) -> np.ndarray:
    """Per-layer Jaccard of the top-N sets of two count arrays (n_layers, n_experts)."""
    sa, sb = top_sets(a, top_n), top_sets(b, top_n)
    out = np.empty(sa.shape[0])
    for i in range(sa.shape[0]):
        A, B = set(sa[i].tolist()), set(sb[i].tolist())
        out[i] = len(A & B) / len(A | B)
    return out


def compute_jaccard(counts: Mapping[str, np.ndarray], top_n: int = 32) -> pd.DataFrame:
    """Top-N Jaccard for every pair of named count arrays (same geometry), averaged over layers.

    Columns a, b, top_n, jaccard (layer mean), jaccard_min, jaccard_max (over layers).
    Only the layers present in both arrays are compared (rows are layers).
    """
    names = list(counts)
    rows = []
    for x, y in combinations(names, 2):
        a, b = np.asarray(counts[x]), np.asarray(counts[y])
        if a.shape != b.shape:
            raise ValueError(f"{x} and {y} have different shapes {a.shape} vs {b.shape}")
        n = effective_top_n(top_n, a.shape[1])
        j = layer_jaccard(a, b, n)
        rows.append({"a": x, "b": y, "top_n": n, "jaccard": float(j.mean()),
                     "jaccard_min": float(j.min()), "jaccard_max": float(j.max())})
    return pd.DataFrame(rows, columns=["a", "b", "top_n", "jaccard", "jaccard_min", "jaccard_max"])


def compute_trace_summary(tokens: pd.DataFrame, n_layers: int, n_experts: int,
                          windows: Sequence[int] = REUSE_WINDOWS) -> pd.DataFrame:
    """One row of headline figures for one trace: tokens, selections, overall Zipf slope,
    W_n per window, top-8 share (mean/min/max over layers, first and last layer),
    final coverage (pool) and per-layer distinct experts (min/max)."""
    counts = selection_counts(tokens, n_layers, n_experts)
    per = compute_layer_locality(counts)
    reuse = compute_reuse(tokens, n_experts, windows, n_layers=0)
    cov = compute_coverage_growth(tokens, n_layers, n_experts, checkpoints=[])
    row: dict = {
        "tokens": int(tokens["token"].max()) + 1 if len(tokens) else 0,
        "selections": int(len(tokens)),
        "zipf_slope": overall_zipf_slope(counts),
        "zipf_slope_layer_mean": float(np.nanmean(per["zipf_slope"])) if len(per) else np.nan,
    }
    for _, r in reuse.iterrows():
        row[f"W{int(r['window'])}"] = r["reuse"]
    t8 = per["top8_share"].to_numpy()
    row.update({
        "top8_share_mean": float(np.nanmean(t8)), "top8_share_min": float(np.nanmin(t8)),
        "top8_share_max": float(np.nanmax(t8)), "top8_share_first": float(t8[0]),
        "top8_share_last": float(t8[-1]),
        "coverage": float(cov["coverage"].iloc[-1]) if len(cov) else np.nan,
        "layer_distinct_min": int(per["distinct_experts"].min()),
        "layer_distinct_max": int(per["distinct_experts"].max()),
    })
    return pd.DataFrame([row])


def compute_counts_locality(counts: Mapping[str, Mapping[int, np.ndarray]], top_n: int = 32
                            ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Slope fits and cross-domain top-N Jaccard from per-domain expert counts (no token order).

    counts: {"<model>_counts_<domain>": {layer: counts array}} (moetrace.inputs.synth.load_counts).
    Returns (slopes, jaccard): slopes has columns model, domain, layer (NA for
    the layer-averaged fit), zipf_slope, top8_share, selections; jaccard has
    columns model, a, b, top_n, jaccard, jaccard_min, jaccard_max, computed
    between the domains of each model over their common layers.
    """
    models: dict[str, dict[str, Mapping[int, np.ndarray]]] = {}
    for key, layers in counts.items():
        model, _, domain = key.partition("_counts_")
        if not domain:
            model, domain = key, key
        models.setdefault(model, {})[domain] = layers
    srows, jparts = [], []
    for model, doms in models.items():
        for domain, layers in doms.items():
            lays = sorted(layers)
            arr = np.stack([np.asarray(layers[x], dtype=np.float64) for x in lays])
            t8 = top_share(arr, 8)
            for i, x in enumerate(lays):
                srows.append({"model": model, "domain": domain, "layer": x,
                              "zipf_slope": fit_zipf_slope(arr[i]), "top8_share": t8[i],
                              "selections": float(arr[i].sum())})
            srows.append({"model": model, "domain": domain, "layer": pd.NA,
                          "zipf_slope": overall_zipf_slope(arr), "top8_share": float(np.mean(t8)),
                          "selections": float(arr.sum())})
        if len(doms) > 1:
            common = sorted(set.intersection(*(set(v) for v in doms.values())))
            mats = {d: np.stack([np.asarray(v[x], dtype=np.float64) for x in common]) for d, v in doms.items()}
            j = compute_jaccard(mats, top_n)
            j.insert(0, "model", model)
            jparts.append(j)
    slopes = pd.DataFrame(srows)
    slopes["layer"] = slopes["layer"].astype("Int64")
    jac = (pd.concat(jparts, ignore_index=True) if jparts else
           pd.DataFrame(columns=["model", "a", "b", "top_n", "jaccard", "jaccard_min", "jaccard_max"]))
    return slopes, jac
