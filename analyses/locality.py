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
    also selected at layer l by at least one of the tokens t-n .. t-1 of the
    same request. Windows never cross a request: t counts the tokens of its
    request, and each request's first n tokens are skipped (their window is
    incomplete), so W_n estimates the steady-state rate; the figure pools
    every request's selections (a trace with no request longer than n tokens
    gives NA). ``W_n stream`` is the same on the pooled stream: every request's
    tokens read as one sequence in forward-pass order (what a trace without
    requests would say; with concurrent requests it is wrong either way: a
    short window compares other requests' tokens, a long one pools them).
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


def _reuse_key(tokens: pd.DataFrame, n_experts: int) -> np.ndarray:
    """(request, layer, expert) as one int64 (request 0 when the frame has none)."""
    key = tokens["layer"].to_numpy(np.int64) * n_experts + tokens["expert"].to_numpy(np.int64)
    if "request" in tokens.columns:
        n_lay = int(tokens["layer"].max()) + 1 if len(tokens) else 1
        key = key + tokens["request"].to_numpy(np.int64) * (n_lay * n_experts)
    return key


def reuse_gaps(tokens: pd.DataFrame, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """For each selection (sorted by request, layer, expert, token): its token index
    and the gap in tokens to the previous selection of the same (request, layer,
    expert) (a huge value if none)."""
    tok = tokens["token"].to_numpy(np.int64)
    key = _reuse_key(tokens, n_experts)
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
        key = _reuse_key(tokens, n_experts)
        order = np.lexsort((tokens["token"].to_numpy(np.int64), key))
        lay = tokens["layer"].to_numpy(np.int64)[order]
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


def compute_request_reuse(tokens: pd.DataFrame, n_experts: int, windows: Sequence[int] = REUSE_WINDOWS,
                          names: Sequence[str] | None = None) -> pd.DataFrame:
    """W_n per request: columns request, tokens, then W<n> and W<n>_selections per window
    (NA where the request has no more than n tokens)."""
    ts, gap = reuse_gaps(tokens, n_experts)
    key = _reuse_key(tokens, n_experts)
    order = np.lexsort((tokens["token"].to_numpy(np.int64), key))
    req = tokens["request"].to_numpy(np.int64)[order] if "request" in tokens.columns else np.zeros(ts.size, np.int64)
    n_req = int(req.max()) + 1 if req.size else 0
    length = np.zeros(n_req, np.int64)
    np.maximum.at(length, req, ts + 1)
    out = pd.DataFrame({"request": [str(names[i]) if names is not None else str(i) for i in range(n_req)],
                        "tokens": length})
    for n in windows:
        m = ts >= n
        d = np.bincount(req[m], minlength=n_req)
        h = np.bincount(req[m], weights=(gap[m] <= n), minlength=n_req)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[f"W{n}"] = np.where(d > 0, h / np.maximum(d, 1), np.nan)
        out[f"W{n}_selections"] = d
    return out


def compute_trace_summary(tokens: pd.DataFrame, n_layers: int, n_experts: int,
                          windows: Sequence[int] = REUSE_WINDOWS, stream: pd.DataFrame | None = None
                          ) -> pd.DataFrame:
    """One row of headline figures for one trace: tokens, requests, selections,
    overall Zipf slope, W_n per window (per request, pooled) and W_n_stream (the
    pooled stream, given as ``stream``: token, layer, expert; default: tokens
    without their requests), top-8 share (mean/min/max over layers, first and
    last layer), final coverage (pool, in stream order) and per-layer distinct
    experts (min/max)."""
    if stream is None:
        stream = tokens.drop(columns=["request"], errors="ignore")
    counts = selection_counts(tokens, n_layers, n_experts)
    reuse = compute_reuse(tokens, n_experts, windows, n_layers=0)
    reuse_stream = compute_reuse(stream, n_experts, windows, n_layers=0)
    cov = compute_coverage_growth(stream, n_layers, n_experts, checkpoints=[])
    n_req = int(tokens["request"].nunique()) if "request" in tokens.columns and len(tokens) else 1
    return _summary_row(counts, reuse, reuse_stream, cov, int(stream["token"].max()) + 1 if len(stream) else 0,
                        n_req, int(len(tokens)))


def _summary_row(counts: np.ndarray, reuse: pd.DataFrame, reuse_stream: pd.DataFrame, cov: pd.DataFrame,
                 n_tokens: int, n_req: int, selections: int) -> pd.DataFrame:
    per = compute_layer_locality(counts)
    row: dict = {
        "tokens": n_tokens,
        "requests": n_req,
        "selections": selections,
        "zipf_slope": overall_zipf_slope(counts),
        "zipf_slope_layer_mean": float(np.nanmean(per["zipf_slope"])) if len(per) else np.nan,
    }
    for _, r in reuse.iterrows():
        row[f"W{int(r['window'])}"] = r["reuse"]
    for _, r in reuse_stream.iterrows():
        row[f"W{int(r['window'])}_stream"] = r["reuse"]
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


class LocalityStream:
    """The locality statistics of a trace fed in chunks of whole steps, in bounded memory.

    ``add(table)`` takes a typed table chunk (TypedTrace.table columns; steps do
    not span chunks); ``results(names)`` returns what the in-memory functions
    return for the whole trace: summary (compute_trace_summary), per_layer
    (compute_layer_locality), reuse (compute_reuse with per-layer rows),
    coverage (compute_coverage_growth on the stream) and per_request
    (compute_request_reuse) -- equal to them exactly. State: per (request,
    layer, expert) the last token seen (sorted arrays, merged per chunk), per
    (layer, expert) the last and first stream token, counts.
    """

    def __init__(self, n_layers: int, n_experts: int, windows: Sequence[int] = REUSE_WINDOWS):
        self.L, self.E = int(n_layers), int(n_experts)
        self.N = self.L * self.E
        self.windows = tuple(int(w) for w in windows)
        nw = len(self.windows)
        self.counts = np.zeros(self.N, np.int64)
        self.keys = np.zeros(0, np.int64)  # (request, layer, expert), sorted
        self.last = np.zeros(0, np.int64)  # their last token
        self.hit_l = np.zeros((nw, self.L), np.int64)  # per-request windows, per layer
        self.den_l = np.zeros((nw, self.L), np.int64)
        self.hit_r = np.zeros((nw, 0), np.int64)
        self.den_r = np.zeros((nw, 0), np.int64)
        self.req_len = np.zeros(0, np.int64)
        self.s_last = np.full(self.N, -(2**40), np.int64)  # stream: last token per (layer, expert)
        self.s_first = np.full(self.N, -1, np.int64)
        self.s_hit = np.zeros(nw, np.int64)
        self.s_den = np.zeros(nw, np.int64)
        self.s_tokens = 0
        self.selections = 0

    def _grow(self, n_req: int) -> None:
        if n_req > self.req_len.size:
            add = n_req - self.req_len.size
            self.req_len = np.concatenate([self.req_len, np.zeros(add, np.int64)])
            z = np.zeros((len(self.windows), add), np.int64)
            self.hit_r = np.concatenate([self.hit_r, z], axis=1)
            self.den_r = np.concatenate([self.den_r, z], axis=1)

    def add(self, table: pd.DataFrame) -> None:
        t = table[table["accepted"].to_numpy(bool)]
        if not len(t):
            return
        E, N = self.E, self.N
        req = t["request"].to_numpy(np.int64)
        tok = t["token"].to_numpy(np.int64)
        lay = t["layer"].to_numpy(np.int64)
        eid = lay * E + t["expert"].to_numpy(np.int64)
        self.selections += eid.size
        self.counts += np.bincount(eid, minlength=N)
        self._grow(int(req.max()) + 1)
        np.maximum.at(self.req_len, req, tok + 1)
        # per-request windows
        key = req * N + eid
        o = np.lexsort((tok, key))
        ks, ts, ls, rs = key[o], tok[o], lay[o], req[o]
        gap = np.full(ks.size, 2**40, np.int64)
        same = ks[1:] == ks[:-1]
        gap[1:][same] = ts[1:][same] - ts[:-1][same]
        first = np.ones(ks.size, bool)
        first[1:] = ~same
        fk = ks[first]
        pos = np.searchsorted(self.keys, fk)
        found = (pos < self.keys.size) & (self.keys[np.minimum(pos, max(self.keys.size - 1, 0))] == fk) \
            if self.keys.size else np.zeros(fk.size, bool)
        fi = np.flatnonzero(first)
        gap[fi[found]] = ts[fi[found]] - self.last[pos[found]]
        lastpos = np.append(fi[1:] - 1, ks.size - 1)
        self.last[pos[found]] = ts[lastpos[found]]
        if (~found).any():
            newk, newv = fk[~found], ts[lastpos[~found]]
            ins = pos[~found]
            self.keys = np.insert(self.keys, ins, newk)
            self.last = np.insert(self.last, ins, newv)
        for w, n in enumerate(self.windows):
            m = ts >= n
            h = m & (gap <= n)
            self.hit_l[w] += np.bincount(ls[h], minlength=self.L)
            self.den_l[w] += np.bincount(ls[m], minlength=self.L)
            nr = self.req_len.size
            self.hit_r[w] += np.bincount(rs[h], minlength=nr)
            self.den_r[w] += np.bincount(rs[m], minlength=nr)
        # the pooled stream: tokens in (step, request, token) order, continuing the previous chunks
        step = t["step"].to_numpy(np.int64)
        o2 = np.lexsort((tok, req, step))
        new = np.ones(o2.size, bool)
        new[1:] = (step[o2][1:] != step[o2][:-1]) | (req[o2][1:] != req[o2][:-1]) | (tok[o2][1:] != tok[o2][:-1])
        stok = np.empty(o2.size, np.int64)
        stok[o2] = np.cumsum(new) - 1 + self.s_tokens
        self.s_tokens += int(new.sum())
        o3 = np.lexsort((stok, eid))
        ke, ts2 = eid[o3], stok[o3]
        gap2 = np.empty(ke.size, np.int64)
        same2 = np.zeros(ke.size, bool)
        same2[1:] = ke[1:] == ke[:-1]
        gap2[same2] = ts2[same2] - ts2[np.flatnonzero(same2) - 1]
        gap2[~same2] = ts2[~same2] - self.s_last[ke[~same2]]
        unseen = self.s_first[ke] < 0
        self.s_first[ke[~same2 & unseen]] = ts2[~same2 & unseen]
        lastmask = np.append(ke[1:] != ke[:-1], True)
        self.s_last[ke[lastmask]] = ts2[lastmask]
        for w, n in enumerate(self.windows):
            m = ts2 >= n
            self.s_hit[w] += int((m & (gap2 <= n)).sum())
            self.s_den[w] += int(m.sum())

    def results(self, names: Sequence[str] | None = None) -> dict:
        L, E = self.L, self.E
        counts = self.counts.reshape(L, E).astype(np.float64)
        rows = []
        for w, n in enumerate(self.windows):
            den = int(self.den_l[w].sum())
            rows.append({"layer": pd.NA, "window": n, "reuse": self.hit_l[w].sum() / den if den else np.nan,
                         "selections": den})
            d = self.den_l[w]
            with np.errstate(invalid="ignore", divide="ignore"):
                r = np.where(d > 0, self.hit_l[w].astype(np.float64) / np.maximum(d, 1), np.nan)
            for li in range(L):
                rows.append({"layer": li, "window": n, "reuse": r[li], "selections": int(d[li])})
        reuse = pd.DataFrame(rows)
        reuse["layer"] = reuse["layer"].astype("Int64")
        s_rows = [{"layer": pd.NA, "window": n, "reuse": self.s_hit[w] / self.s_den[w] if self.s_den[w] else np.nan,
                   "selections": int(self.s_den[w])} for w, n in enumerate(self.windows)]
        reuse_stream = pd.DataFrame(s_rows)
        n_tok = self.s_tokens
        firsts = self.s_first[self.s_first >= 0]
        cum = np.cumsum(np.bincount(firsts, minlength=n_tok))
        pts = [p for p in default_checkpoints(n_tok) if 0 < p <= n_tok] or ([n_tok] if n_tok else [])
        distinct = np.array([cum[p - 1] for p in pts], dtype=np.int64)
        cov = pd.DataFrame({"tokens": np.array(pts, np.int64), "distinct_experts": distinct,
                            "coverage": distinct / (L * E)})
        n_req = int((self.req_len > 0).sum())
        summary = _summary_row(counts, reuse[reuse["layer"].isna()].reset_index(drop=True), reuse_stream,
                               cov.iloc[-1:] if len(cov) else cov, n_tok, n_req, self.selections)
        nr = self.req_len.size
        per_req = pd.DataFrame({"request": [str(names[i]) if names is not None else str(i) for i in range(nr)],
                                "tokens": self.req_len.copy()})
        for w, n in enumerate(self.windows):
            d = self.den_r[w]
            with np.errstate(invalid="ignore", divide="ignore"):
                per_req[f"W{n}"] = np.where(d > 0, self.hit_r[w] / np.maximum(d, 1), np.nan)
            per_req[f"W{n}_selections"] = d
        return {"summary": summary, "per_layer": compute_layer_locality(counts), "reuse": reuse,
                "coverage": cov, "per_request": per_req, "counts": counts}


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
