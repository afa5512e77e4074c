"""`moetrace trace stats`: routing locality of traces (paper Table 1) or of real counts."""

from __future__ import annotations

import os

import click

from moetrace.inputs.geometry import PRESETS


@click.command("stats")
@click.argument("traces", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--counts", "counts_path", type=click.Path(dir_okay=False), default=None,
              help="Per-domain expert counts JSON ({key: {layer: {expert: count}}}) instead of traces: "
                   "slope fits and top-N Jaccard between the domains of each model (no token order, no W_n).")
@click.option("--top-n", type=int, default=32, show_default=True,
              help="Top-N experts per layer for the cross-domain Jaccard (capped at experts/4).")
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)), default=None,
              help="Geometry of the traces (pool size for coverage); default: inferred from the trace.")
@click.option("--experts", type=int, default=None, help="Experts per layer (pool size for coverage).")
@click.option("--per-layer", is_flag=True, help="Also print the per-layer table.")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
def stats(traces, counts_path, top_n, preset_name, experts, per_layer, as_json):
    """Locality statistics of router traces: Zipf slope, W1/W8/W64 reuse, top-8
    share, coverage growth, cross-domain top-N Jaccard.

    \b
    TRACES are engine JSONL or typed Parquet traces (statistics use accepted
    tokens). With several requests, W_n windows stay within each request and
    the figures pool the requests; "W_n stream" reads all requests as one
    token stream. --json adds W_n per request. Definitions:
    moetrace.analyses.locality. Examples:
      moetrace trace stats kimi.jsonl
      moetrace trace stats kimi_0.jsonl kimi_1.jsonl kimi_2.jsonl --json
      moetrace trace stats --counts olmoe_mixtral_expert_counts.json
    """
    from moetrace.analyses import locality as loc
    from moetrace.errors import UsageError

    if top_n < 1:
        raise UsageError("--top-n must be >= 1")
    if counts_path:
        if traces:
            raise UsageError("give either TRACES or --counts, not both")
        _counts_stats(counts_path, top_n, as_json, loc)
        return
    if not traces:
        raise UsageError("give one or more TRACES, or --counts FILE")

    from moetrace.inputs.geometry import preset

    geo = preset(preset_name) if preset_name else None
    results, counts = [], {}
    for path in traces:
        n_layers = geo.n_layers if geo else None
        n_experts = experts or (geo.n_experts if geo else None)
        name = _unique(os.path.basename(path), counts)
        res = _trace_stats(path, n_layers, n_experts, experts, loc)
        for w in res["accounting"].get("warnings", []):
            click.echo(f"moetrace: warning: {path}: {w}", err=True)
        counts[name] = res.pop("counts")
        summary = res["summary"]
        summary.insert(0, "trace", name)
        res.update(trace=name, path=path, summary=_records(summary)[0])
        results.append(res)
    jac = None
    if len(counts) > 1:
        shapes = {v.shape for v in counts.values()}
        if len(shapes) > 1:
            raise UsageError(f"traces of different geometries cannot be compared: {sorted(shapes)}",
                             hint="give --preset or --experts so every trace uses the same pool")
        jac = loc.compute_jaccard(counts, top_n=top_n)
    if as_json:
        _emit_results(results, jac)
        return
    for r in results:
        _echo_result(r, per_layer, loc)
    if jac is not None:
        n = int(jac["top_n"].iloc[0])
        click.echo(f"\ntop-{n} Jaccard (layer mean) {jac['jaccard'].min():.3f}-{jac['jaccard'].max():.3f}:")
        click.echo(jac.to_string(index=False, float_format=lambda x: f"{x:.3f}"))


def _counts_stats(counts_path, top_n: int, as_json: bool, loc) -> None:
    """--counts: slope fits and top-N Jaccard between the domains of each model."""
    from moetrace.cli.common import emit_json
    from moetrace.inputs.synth import load_counts

    slopes, jac = loc.compute_counts_locality(load_counts(counts_path), top_n=top_n)
    if as_json:
        emit_json({"source": counts_path, "slopes": _records(slopes), "jaccard": _records(jac)})
        return
    overall = slopes[slopes["layer"].isna()]
    click.echo("Zipf slope (layer-averaged fit) and mean top-8 share per model/domain:")
    click.echo(overall[["model", "domain", "zipf_slope", "top8_share"]].to_string(index=False))
    for model, g in jac.groupby("model", sort=False):
        click.echo(f"\n{model}: top-{int(g['top_n'].iloc[0])} Jaccard between domains "
                   f"{g['jaccard'].min():.3f}-{g['jaccard'].max():.3f}")
        click.echo(g[["a", "b", "jaccard"]].to_string(index=False))


def _trace_stats(path, n_layers, n_experts, experts, loc) -> dict:
    """The statistics of one trace: streamed when it is a large engine JSONL, else in memory."""
    from moetrace.inputs.trace import check_dense_pool, load_trace

    res = _streamed(path, n_layers, n_experts, loc, check_dense_pool)
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


def _emit_results(results: list, jac) -> None:
    import pandas as pd

    from moetrace.cli.common import emit_json

    out = {"traces": [{**{k: v for k, v in r.items() if not isinstance(v, pd.DataFrame)},
                       "per_layer": _records(r["per_layer"]),
                       "reuse": _records(r["reuse"][r["reuse"]["layer"].isna()]),
                       "reuse_per_layer": _records(r["reuse"][r["reuse"]["layer"].notna()]),
                       "coverage": _records(r["coverage"]),
                       "per_request": _records(r["per_request"])} for r in results]}
    if jac is not None:
        out["jaccard"] = _records(jac)
        out["jaccard_range"] = [float(jac["jaccard"].min()), float(jac["jaccard"].max())]
    emit_json(out)


def _echo_result(r: dict, per_layer: bool, loc) -> None:
    s = r["summary"]
    nreq = s["requests"]
    click.echo(f"{r['trace']}: {r['n_layers']} layers x {r['n_experts']} experts, k={r['k']}, "
               f"{s['tokens']} accepted tokens" + (f" of {nreq} requests" if nreq > 1 else " (one request)")
               + f", {s['selections']} selections")
    click.echo(f"  Zipf slope      {s['zipf_slope']:.3f} (layer-averaged curve; mean of per-layer fits "
               f"{s['zipf_slope_layer_mean']:.3f})")
    click.echo("  reuse           " + "  ".join(
        f"W{w} {_pct(s.get(f'W{w}'))}" for w in loc.REUSE_WINDOWS)
        + ("  (windows within each request, pooled over requests)" if nreq > 1 else ""))
    if nreq > 1:
        click.echo("  reuse, stream   " + "  ".join(
            f"W{w} {_pct(s.get(f'W{w}_stream'))}" for w in loc.REUSE_WINDOWS)
            + "  (all requests read as one token stream, as a tool without requests reads them)")
        pr = r["per_request"]
        click.echo(f"  requests        {nreq}: {int(pr['tokens'].min())}-{int(pr['tokens'].max())} tokens; "
                   + "  ".join(f"W{w} median {_pct(pr[f'W{w}'].median())}" for w in loc.REUSE_WINDOWS))
    click.echo(f"  top-8 share     mean {_pct(s['top8_share_mean'])}, min {_pct(s['top8_share_min'])}, "
               f"max {_pct(s['top8_share_max'])}, first layer {_pct(s['top8_share_first'])}, "
               f"last {_pct(s['top8_share_last'])}")
    cov = r["coverage"]
    click.echo("  coverage        " + ", ".join(
        f"{int(t)} tok {_pct(c)}" for t, c in zip(cov["tokens"], cov["coverage"])) +
        f"; per layer {s['layer_distinct_min']}-{s['layer_distinct_max']} of {r['n_experts']}")
    if per_layer:
        click.echo(r["per_layer"].to_string(index=False))


def _streamed(path, n_layers, n_experts, loc, check_dense_pool):
    """Statistics of a large engine JSONL in bounded memory (moetrace.inputs.stream),
    or None for the in-memory path (a small file, a typed Parquet, or a file the
    fast reader cannot take)."""
    from moetrace.inputs.stream import with_stream

    def fold(ts) -> dict:
        check_dense_pool(ts.n_layers, ts.n_experts, str(path), "compute statistics", {"warnings": ts.warnings})
        acc = loc.LocalityStream(ts.n_layers, ts.n_experts)
        for t in ts.tables():
            acc.add(t)
        return {"n_layers": ts.n_layers, "n_experts": ts.n_experts, "k": ts.k, "accounting": ts.accounting(),
                **acc.results(ts.names)}

    return with_stream(path, fold, None, n_layers, n_experts)


def _pct(x) -> str:
    return "NA" if x is None or x != x else f"{100 * x:.1f}%"


def _unique(name: str, seen: dict) -> str:
    out, i = name, 2
    while out in seen:
        out, i = f"{name}#{i}", i + 1
    return out


def _records(df) -> list[dict]:
    """DataFrame -> JSON-ready records (NA -> None, numpy scalars -> Python)."""
    import numpy as np
    import pandas as pd

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
