"""`moetrace plan`: compile typed traces into plan.bin, and inspect a plan."""

from __future__ import annotations

import click

from moetrace.cli.common import BYTES, emit_json

_GEOMETRY_HELP = "pool geometry preset (kimi-k3, deepseek-v3, qwen3-30b-a3b, olmoe)"


@click.group()
def plan() -> None:
    """Compiled replay plans (plan.bin): compile from traces, inspect.

    A plan holds the pool geometry, then each engine iteration's passes, each
    pass the per-layer expert sets to read, plus optional prefetch hints.
    The format is documented in docs/plan-format.md.
    """


@plan.command("compile")
@click.argument("traces", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--output", default="plan.bin", show_default=True, type=click.Path(dir_okay=False),
              help="plan file to write (atomically)")
@click.option("--geometry", "geometry", metavar="PRESET", help=_GEOMETRY_HELP)
@click.option("--layers", type=click.IntRange(min=1), help="routed layers (default: preset, else the trace)")
@click.option("--experts", type=click.IntRange(min=1), help="experts per layer (default: preset, else the trace)")
@click.option("--k", "k", type=click.IntRange(min=1), help="experts per token (default: preset, else inferred)")
@click.option("--expert-bytes", type=BYTES, help="bytes per expert, e.g. 17.55MB (default: preset, else unknown)")
@click.option("--hints", type=click.Choice(["none", "oracle"]), default="none", show_default=True,
              help="oracle: hint after each layer the actual next-layer set")
@click.option("--hints-from", type=click.Path(dir_okay=False), metavar="PREDICTOR.jsonl",
              help="a recorded predictor plan (engine JSONL; (step, layer) = predicted experts of that layer)")
@click.option("--request", metavar="ID", help="compile one request alone (its forward passes only)")
@click.option("--order", type=click.Choice(["rank", "sorted"]), default="rank", show_default=True,
              help="order of a layer's experts within a step: as routed (rank) or ascending")
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")
def compile_(traces, output, geometry, layers, experts, k, expert_bytes, hints, hints_from, request, order,
             as_json) -> None:
    """Compile TRACES (engine .jsonl or typed .parquet) into a replay plan.

    One iteration = one forward pass: per layer it reads the union of the
    experts its requests selected (what the engine reads), in rank order
    unless --order sorted; --request ID compiles one request alone. Several
    traces are merged iteration by iteration (the batch union) and truncated
    to the shortest. Geometry: explicit options win, then --geometry, then the
    trace.

    \b
    Examples:
      moetrace plan compile trace.jsonl -o plan.bin --geometry kimi-k3
      moetrace plan compile served.jsonl --request s0.3 -o one.bin
    """
    from moetrace.errors import UsageError
    from moetrace.inputs.geometry import format_bytes
    from moetrace.inputs.plan import compile_plan

    if hints == "oracle" and hints_from:
        raise UsageError("--hints oracle and --hints-from are exclusive")
    h = compile_plan(list(traces), output, geometry=geometry, n_layers=layers, n_experts=experts, k=k,
                     expert_bytes=expert_bytes, hints=None if hints == "none" else hints, hints_from=hints_from,
                     request=request, order=order)
    summary = _header_summary(output, h)
    if as_json:
        emit_json(summary)
        return
    lb = format_bytes(h.logical_bytes) if h.logical_bytes is not None else "unknown (no expert bytes)"
    click.echo(f"wrote {output}: {h.n_iterations} iterations, {h.n_passes} passes, {h.n_reads} reads "
               f"({lb}), geometry {h.n_layers}x{h.n_experts} k={h.k}, "
               f"{h.accepted_tokens if h.accepted_tokens is not None else 'unknown'} accepted tokens")
    if h.has_hints:
        st = h.meta.get("hints", {})
        extra = ""
        if st.get("dropped") and h.hint_source == "predictor":
            extra = f", {st['dropped']} predictions without an issuing slot dropped"
        if st.get("records_unmatched_step"):
            extra += f", {st['records_unmatched_step']} predictor records name steps outside the trace"
        click.echo(f"hints: {h.n_hints} ({h.hint_source}){extra}")


def _header_summary(path, h) -> dict:
    return {
        "path": str(path),
        "format_version": f"{h.version[0]}.{h.version[1]}",
        "file_bytes": h.file_size,
        "geometry": {"name": h.meta.get("geometry_name", "custom"), "n_layers": h.n_layers,
                     "n_experts": h.n_experts, "k": h.k, "expert_bytes": h.expert_bytes},
        "iterations": h.n_iterations,
        "passes": h.n_passes,
        "reads": h.n_reads,
        "logical_bytes": h.logical_bytes,
        "accepted_tokens": h.accepted_tokens,
        "hint_source": h.hint_source,
        "hint_count": h.n_hints if h.has_hints else None,
        "hint_stats": h.meta.get("hints") if h.has_hints else None,
        "inputs": h.n_inputs,
        "order": h.order,
        "requests": h.meta.get("requests"),
        "request": h.meta.get("request"),
    }


@plan.command("inspect")
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")
def inspect(plan_path, as_json) -> None:
    """Verify every checksum of PLAN and print its geometry, size and hints.

    Shows iterations, passes, reads, logical bytes (reads x expert bytes),
    accepted tokens, and with hints their count, recall and precision against
    the reads that follow them.
    """
    from moetrace.inputs.geometry import format_bytes
    from moetrace.inputs.plan import inspect_plan

    s = inspect_plan(plan_path)
    if as_json:
        emit_json(s)
        return
    g = s["geometry"]
    eb = format_bytes(g["expert_bytes"]) if g["expert_bytes"] else "unknown"
    lb = f"{s['logical_bytes']:,} B ({format_bytes(s['logical_bytes'])})" if s["logical_bytes"] is not None \
        else "unknown (no expert bytes)"
    rows = [
        ("plan", f"{s['path']} (format {s['format_version']}, {format_bytes(s['file_bytes'])}, checksums ok)"),
        ("geometry", f"{g['name']}: {g['n_layers']} layers x {g['n_experts']} experts, k={g['k']}, "
                     f"expert {eb}"),
        ("iterations", f"{s['iterations']:,}"),
        ("passes", f"{s['passes']:,} ({s['fallback_passes']:,} fallback)"),
        ("reads", f"{s['reads']:,}" + (f" ({s['reads_per_iteration']:.1f} per iteration" if s["iterations"] else "")
         + (f", {s['reads_per_accepted_token']:.1f} per accepted token)" if s["reads_per_accepted_token"]
            else (")" if s["iterations"] else ""))),
        ("logical bytes", lb),
        ("accepted tokens", f"{s['accepted_tokens']:,}" if s["accepted_tokens"] is not None else "unknown"),
    ]
    if s["hint_count"] is not None:
        rec = f"{s['hint_recall']:.3f}" if s["hint_recall"] is not None else "n/a"
        prec = f"{s['hint_precision']:.3f}" if s["hint_precision"] is not None else "n/a"
        rows.append(("hints", f"{s['hint_count']:,} ({s['hint_source']}), recall {rec}, precision {prec}"))
    else:
        rows.append(("hints", "none"))
    sources = [x for x in s["sources"] if x is not None]
    if sources:
        rows.append(("sources", ", ".join(sources)))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{w}}  {v}")
