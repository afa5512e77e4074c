"""`moetrace trace stats`: routing locality of traces (paper Table 1) or of real counts."""

from __future__ import annotations

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
    from moetrace.analyses import tracestats
    from moetrace.cli.common import emit_json
    from moetrace.errors import UsageError

    if counts_path:
        if traces:
            raise UsageError("give either TRACES or --counts, not both")
        cs = tracestats.counts_stats(counts_path, top_n=top_n)
        if as_json:
            emit_json(cs.to_dict())
        else:
            _echo_counts(cs)
        return
    st = tracestats.trace_stats(traces, preset=preset_name, experts=experts, top_n=top_n)
    for r in st.traces:
        for w in r["accounting"].get("warnings", []):
            click.echo(f"moetrace: warning: {r['path']}: {w}", err=True)
    if as_json:
        emit_json(st.to_dict())
        return
    for r in st.traces:
        _echo_result(r, per_layer)
    jac = st.jaccard
    if jac is not None:
        n = int(jac["top_n"].iloc[0])
        click.echo(f"\ntop-{n} Jaccard (layer mean) {jac['jaccard'].min():.3f}-{jac['jaccard'].max():.3f}:")
        click.echo(jac.to_string(index=False, float_format=lambda x: f"{x:.3f}"))


def _echo_counts(cs) -> None:
    """--counts: slope fits and top-N Jaccard between the domains of each model, as text."""
    slopes, jac = cs.slopes, cs.jaccard
    overall = slopes[slopes["layer"].isna()]
    click.echo("Zipf slope (layer-averaged fit) and mean top-8 share per model/domain:")
    click.echo(overall[["model", "domain", "zipf_slope", "top8_share"]].to_string(index=False))
    for model, g in jac.groupby("model", sort=False):
        click.echo(f"\n{model}: top-{int(g['top_n'].iloc[0])} Jaccard between domains "
                   f"{g['jaccard'].min():.3f}-{g['jaccard'].max():.3f}")
        click.echo(g[["a", "b", "jaccard"]].to_string(index=False))


def _echo_result(r: dict, per_layer: bool) -> None:
    from moetrace.analyses.locality import REUSE_WINDOWS

    s = r["summary"]
    nreq = s["requests"]
    click.echo(f"{r['trace']}: {r['n_layers']} layers x {r['n_experts']} experts, k={r['k']}, "
               f"{s['tokens']} accepted tokens" + (f" of {nreq} requests" if nreq > 1 else " (one request)")
               + f", {s['selections']} selections")
    click.echo(f"  Zipf slope      {s['zipf_slope']:.3f} (layer-averaged curve; mean of per-layer fits "
               f"{s['zipf_slope_layer_mean']:.3f})")
    click.echo("  reuse           " + "  ".join(
        f"W{w} {_pct(s.get(f'W{w}'))}" for w in REUSE_WINDOWS)
        + ("  (windows within each request, pooled over requests)" if nreq > 1 else ""))
    if nreq > 1:
        click.echo("  reuse, stream   " + "  ".join(
            f"W{w} {_pct(s.get(f'W{w}_stream'))}" for w in REUSE_WINDOWS)
            + "  (all requests read as one token stream, as a tool without requests reads them)")
        pr = r["per_request"]
        click.echo(f"  requests        {nreq}: {int(pr['tokens'].min())}-{int(pr['tokens'].max())} tokens; "
                   + "  ".join(f"W{w} median {_pct(pr[f'W{w}'].median())}" for w in REUSE_WINDOWS))
    click.echo(f"  top-8 share     mean {_pct(s['top8_share_mean'])}, min {_pct(s['top8_share_min'])}, "
               f"max {_pct(s['top8_share_max'])}, first layer {_pct(s['top8_share_first'])}, "
               f"last {_pct(s['top8_share_last'])}")
    cov = r["coverage"]
    click.echo("  coverage        " + ", ".join(
        f"{int(t)} tok {_pct(c)}" for t, c in zip(cov["tokens"], cov["coverage"])) +
        f"; per layer {s['layer_distinct_min']}-{s['layer_distinct_max']} of {r['n_experts']}")
    if per_layer:
        click.echo(r["per_layer"].to_string(index=False))


def _pct(x) -> str:
    return "NA" if x is None or x != x else f"{100 * x:.1f}%"
