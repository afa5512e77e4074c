"""The locality statistics of router traces (paper Table 1) or of real expert counts: what
`moetrace trace stats` computes, as ``moetrace.trace_stats(...)`` and ``moetrace.counts_stats(...)``.

    >>> import moetrace
    >>> st = moetrace.trace_stats(["kimi_0.jsonl", "kimi_1.jsonl"])
    >>> st.traces[0]["summary"]["zipf_slope"], st.jaccard      # per trace; top-N Jaccard between them
    >>> st.to_dict()                                           # what `trace stats --json` prints

Each statistic is a ``compute_*`` of :mod:`moetrace.analyses.locality`; a large engine JSONL is
folded in bounded memory (:class:`moetrace.analyses.locality.LocalityStream`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from moetrace.analyses import locality as loc
from moetrace.errors import UsageError


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """DataFrame -> JSON-ready records (NA -> None, numpy scalars -> Python)."""
    rows = []
    for rec in df.to_dict(orient="records"):
        clean = {}
        for k, v in rec.items():
            if v is pd.NA or (isinstance(v, float) and np.isnan(v)):
                v = None
            elif isinstance(v, np.integer):
                v = int(v)
            elif isinstance(v, np.floating):
                v = None if np.isnan(v) else float(v)
            clean[k] = v
        rows.append(clean)
    return rows


@dataclass
class TraceStats:
    """The statistics of each trace (``traces``: a dict per trace with its geometry,
    ``accounting`` (its ``warnings``), ``summary`` (one record), and the ``per_layer``, ``reuse``,
    ``coverage`` and ``per_request`` tables) and, with several traces, their top-N Jaccard."""

    traces: list[dict[str, Any]]
    jaccard: pd.DataFrame | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON document `moetrace trace stats --json` prints."""
        out: dict[str, Any] = {"traces": [
            {**{k: v for k, v in r.items() if not isinstance(v, pd.DataFrame)},
             "per_layer": records(r["per_layer"]),
             "reuse": records(r["reuse"][r["reuse"]["layer"].isna()]),
             "reuse_per_layer": records(r["reuse"][r["reuse"]["layer"].notna()]),
             "coverage": records(r["coverage"]),
             "per_request": records(r["per_request"])} for r in self.traces]}
        if self.jaccard is not None:
            out["jaccard"] = records(self.jaccard)
            out["jaccard_range"] = [float(self.jaccard["jaccard"].min()), float(self.jaccard["jaccard"].max())]
        return out


@dataclass
class CountsStats:
    """Slope fits (``slopes``: per model, domain and layer; the layer-averaged fit where layer
    is NA) and the top-N Jaccard between the domains of each model, from a counts file."""

    source: str
    slopes: pd.DataFrame
    jaccard: pd.DataFrame

    def to_dict(self) -> dict[str, Any]:
        """The JSON document `moetrace trace stats --counts FILE --json` prints."""
        return {"source": self.source, "slopes": records(self.slopes), "jaccard": records(self.jaccard)}


def counts_stats(counts_path: str | os.PathLike, top_n: int = 32) -> CountsStats:
    """Zipf slope fits and top-N Jaccard between the domains of each model, from a per-domain
    expert counts JSON ({key: {layer: {expert: count}}}): no token order, so no W_n."""
    from moetrace.inputs.synth import load_counts

    _check_top_n(top_n)
    slopes, jac = loc.compute_counts_locality(load_counts(counts_path), top_n=top_n)
    return CountsStats(str(counts_path), slopes, jac)


def trace_stats(traces: Sequence[str | os.PathLike], preset: str | None = None, experts: int | None = None,
                top_n: int = 32) -> TraceStats:
    """Locality statistics of router traces (engine JSONL or typed Parquet; accepted tokens):
    Zipf slope, W1/W8/W64 reuse (within each request, pooled; and of the stream), top-8 share,
    coverage growth, per-request reuse, and with several traces their top-N Jaccard
    (``top_n`` capped at experts/4). ``preset`` (a geometry name) or ``experts`` set the pool
    size; default: inferred from each trace."""
    from moetrace.inputs.geometry import preset as geometry

    _check_top_n(top_n)
    if not traces:
        raise UsageError("give one or more TRACES, or --counts FILE")
    geo = geometry(preset) if preset else None
    results, counts = [], {}
    for path in traces:
        n_layers = geo.n_layers if geo else None
        n_experts = experts or (geo.n_experts if geo else None)
        name = _unique(os.path.basename(path), counts)
        res = one_trace_stats(path, n_layers, n_experts, experts)
        counts[name] = res.pop("counts")
        summary = res["summary"]
        summary.insert(0, "trace", name)
        res.update(trace=name, path=str(path), summary=records(summary)[0])
        results.append(res)
    jac = None
    if len(counts) > 1:
        shapes = {v.shape for v in counts.values()}
        if len(shapes) > 1:
            raise UsageError(f"traces of different geometries cannot be compared: {sorted(shapes)}",
                             hint="give --preset or --experts so every trace uses the same pool")
        jac = loc.compute_jaccard(counts, top_n=top_n)
    return TraceStats(results, jac)


def _check_top_n(top_n: int) -> None:
    if top_n < 1:
        raise UsageError("--top-n must be >= 1")


def one_trace_stats(path, n_layers: int | None, n_experts: int | None, experts: int | None) -> dict[str, Any]:
    """The statistics of one trace (its selection ``counts`` too): streamed when it is a large
    engine JSONL, else in memory."""
    from moetrace.inputs.trace import check_dense_pool, load_trace

    res = _streamed(path, n_layers, n_experts)
    if res is not None:
        return res
    tt = load_trace(path, n_layers=n_layers, n_experts=n_experts)
    L, E = tt.n_layers, experts or tt.n_experts
    check_dense_pool(L, E, str(path), "compute statistics", tt.accounting)
    tok = tt.tokens()
    stream = tt.stream_tokens()
    c = loc.selection_counts(tok, L, E)
    return {"n_layers": L, "n_experts": E, "k": tt.k, "accounting": tt.accounting,
            "summary": loc.compute_trace_summary(tok, L, E, stream=stream),
            "per_layer": loc.compute_layer_locality(c), "reuse": loc.compute_reuse(tok, E, n_layers=L),
            "coverage": loc.compute_coverage_growth(stream, L, E),
            "per_request": loc.compute_request_reuse(tok, E, names=tt.requests), "counts": c}


def _streamed(path, n_layers, n_experts):
    """Statistics of a large engine JSONL in bounded memory (moetrace.inputs.stream),
    or None for the in-memory path (a small file, a typed Parquet, or a file the
    fast reader cannot take)."""
    from moetrace.inputs.stream import with_stream
    from moetrace.inputs.trace import check_dense_pool

    def fold(ts) -> dict:
        check_dense_pool(ts.n_layers, ts.n_experts, str(path), "compute statistics", {"warnings": ts.warnings})
        acc = loc.LocalityStream(ts.n_layers, ts.n_experts)
        for t in ts.tables():
            acc.add(t)
        return {"n_layers": ts.n_layers, "n_experts": ts.n_experts, "k": ts.k, "accounting": ts.accounting(),
                **acc.results(ts.names)}

    return with_stream(path, fold, None, n_layers, n_experts)


def _unique(name: str, seen: dict) -> str:
    out, i = name, 2
    while out in seen:
        out, i = f"{name}#{i}", i + 1
    return out
