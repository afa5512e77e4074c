"""`moetrace trace parse`: the canonical typed parser."""

from __future__ import annotations

import click

from moetrace.cli.common import emit_json


@click.command()
@click.argument("trace_file", type=click.Path(dir_okay=False))
@click.option("-o", "--out", type=click.Path(dir_okay=False), help="Write the typed table as Parquet here.")
@click.option("--k", type=int, help="Experts per token (default: the smallest record width seen).")
@click.option("--layers", type=int, help="Routed layers; a record naming another layer is an error.")
@click.option("--experts", type=int, help="Experts per layer; a larger expert id is an error.")
@click.option("--geometry", "geometry_name", metavar="PRESET",
              help="Take k, layers and experts from a preset (kimi-k3, deepseek-v3, qwen3-30b-a3b, olmoe).")
@click.option("--json", "as_json", is_flag=True, help="Print the accounting as JSON.")
def parse(trace_file, out, k, layers, experts, geometry_name, as_json):
    """Type an engine JSONL trace: normal, spec_accept and spec_fallback records.

    \b
    Format: one {"step": S, "layer": L, "experts": [...]} per line, records of a
    step in layer order, "phase": "prefill" lines excluded. A record of width k
    is one position, 2k a speculative accept (two positions), a layer routed
    twice in a step a failed speculation followed by a fallback pass.
    accepted tokens = normal + 2 x spec_accept + spec_fallback steps.

    \b
    Example:
      moetrace trace parse trace.jsonl -o typed.parquet --json
    """
    from moetrace.inputs.stream import parse_trace

    if geometry_name:
        from moetrace.inputs.geometry import preset

        g = preset(geometry_name)
        k = k or g.k
        layers = layers or g.n_layers
        experts = experts or g.n_experts
    acc = parse_trace(trace_file, out, k=k, n_layers=layers, n_experts=experts)
    n_layers, n_experts, kk = acc["n_layers"], acc["n_experts"], acc["k"]
    if out:
        acc["typed_table"] = str(out)
    if as_json:
        emit_json(acc)
        return
    rk, sk = acc["records_by_kind"], acc["steps_by_kind"]
    click.echo(f"{trace_file}: {acc['steps']} steps, {acc['passes']} passes, {acc['records']} records "
               f"({n_layers} layers x {n_experts} experts, k={kk})")
    for kind in ("normal", "spec_accept", "spec_fallback"):
        click.echo(f"  {kind:<14} {sk[kind]:>8} steps {rk[kind]:>10} records")
    click.echo(f"  accepted tokens {acc['accepted_tokens']}  (prefill records excluded: "
               f"{acc['prefill_records_excluded']})")
    if out:
        click.echo(f"  typed table -> {out}")

