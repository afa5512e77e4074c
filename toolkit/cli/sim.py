"""`moetrace sim`: cache-policy simulations (LRU, LFU, static, Belady) under fair windows."""

from __future__ import annotations

from pathlib import Path

import click

from moetrace.cli.common import BYTES, emit_json


@click.command()
@click.argument("trace_or_plan", type=click.Path(dir_okay=False))
@click.option("--policy", "policy_text", default="lru,lfu,static,belady", show_default=True,
              help="Comma-separated policies: lru, lfu, static, belady.")
@click.option("--budgets", "budget_text", default="8,16,32,64", show_default=True,
              help="Cache sizes in experts per layer (per-layer scope; global scope uses B x layers "
                   "unless --global-budgets).")
@click.option("--scope", type=click.Choice(["per-layer", "global", "both"]),
              help="per-layer: an independent cache of B experts per layer; global: one pool of N "
                   "experts keyed by expert_id. Default per-layer, or both with --global-budgets.")
@click.option("--global-budgets", "global_text", metavar="N,...",
              help="Global pool sizes in experts (in all).")
@click.option("--static-table", default="oracle", show_default=True, metavar="oracle|warm|FILE",
              help="Static table: counts over the whole trace (oracle), over the warm window (warm), "
                   "or over another trace or plan (domain shift).")
@click.option("--warm-fraction", type=float, default=0.6, show_default=True,
              help="Every policy warms on this fraction of iterations; the rest is scored.")
@click.option("--expert-bytes", type=BYTES, metavar="SIZE",
              help="Bytes per expert for miss demand (default: the --geometry preset's, else the "
                   "plan's; else NA).")
@click.option("--geometry", "geometry_name", metavar="PRESET",
              help="Preset (kimi-k3, deepseek-v3, qwen3-30b-a3b, olmoe): layers, experts and k for a "
                   "JSONL trace, and the expert size.")
@click.option("--json", "as_json", is_flag=True, help="Print the window and one row per policy x scope x budget.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), metavar="OUT.png",
              help="Also write hit rate vs budget per policy.")
@click.option("--request", "request", metavar="ID",
              help="Simulate one request's own stream (default: the batch stream, per forward pass the union "
                   "of every request's experts: what the engine reads).")
@click.option("--order", type=click.Choice(["rank", "sorted"]), default=None,
              help="Order of a layer's experts within a step: rank (as routed; default for traces) or sorted "
                   "(ascending). It moves LRU at small budgets.")
def sim(trace_or_plan, policy_text, budget_text, scope, global_text, static_table, warm_fraction,
        expert_bytes, geometry_name, as_json, plot_path, request, order):
    """Simulate expert caches on a router trace or a compiled plan.

    \b
    Fair windows (paper §3): every policy runs over the whole access stream,
    warming on the first --warm-fraction of iterations, and only the remaining
    iterations are scored. Policies admit every miss (no bypass) except static:
      lru     least recently used; every budget from one stack-distance pass
      lfu     least frequently used, ties by least recent; counts from the
              start of the stream (perfect LFU)
      static  the top-B experts by count (per layer, or top-N globally), fixed;
              hit iff the expert is in the table; nothing else is admitted
      belady  Belady's MIN (evict the farthest next use) from the best state a
              demand-paging cache can hold after the warm window: the optimum
              of lru/lfu-like policies; it does not bound static (preloaded)
    miss demand = misses x expert bytes per scored iteration.

    \b
    Examples:
      moetrace sim trace.jsonl --geometry kimi-k3
      moetrace sim plan.bin --policy lru,belady --budgets 8,16,32,64,128 --json
      moetrace sim prose.parquet --scope both --static-table code.parquet --plot fig1.png
    """
    from moetrace.analyses.simrun import sim as simulate

    res = simulate(trace_or_plan, policies=policy_text, budgets=budget_text, scope=scope, global_budgets=global_text,
                   static_table=static_table, warm_fraction=warm_fraction, expert_bytes=expert_bytes,
                   geometry=geometry_name, request=request, order=order)
    if plot_path:
        from moetrace.reports.figures import sim_png

        Path(plot_path).write_bytes(sim_png(res.table))
    if as_json:
        emit_json(res.to_dict())
        return
    click.echo(f"stream: {res.info.get('stream', 'as given')}; experts of a step in {res.info['order']} order")
    _print_table(res.table, res.source, res.policies, res.static_table, plot_path)


def _print_table(df, source, policies, table_name, plot_path) -> None:
    from moetrace.inputs.geometry import format_bytes

    a = df.attrs
    click.echo(f"{source}: {a['n_iterations']} iterations ({a['warm_iterations']} warm, "
               f"{a['scored_iterations']} scored), {a['n_layers']} layers x {a['n_experts']} experts, "
               f"{int(df['accesses'].iloc[0]):,} scored accesses")
    if "static" in policies:
        click.echo(f"static table: {table_name}")
    eb = a.get("expert_bytes")
    head = f"{'scope':<10} {'budget':>7} {'total':>7}" + "".join(f" {p:>8}" for p in policies)
    click.echo("\nhit rate (%) in the scored window")
    click.echo(head)
    wide = df.pivot_table(index=["scope", "budget", "budget_total"], columns="policy", values="hit_rate",
                          sort=False)
    for (scope, b, tot), row in wide.iterrows():
        cells = "".join(f" {row[p] * 100:8.1f}" if row[p] == row[p] else f" {'NA':>8}" for p in policies)
        click.echo(f"{scope.replace('_', '-'):<10} {b:>7} {tot:>7}{cells}")
    if eb is not None:
        click.echo(f"\nmiss demand per scored iteration (expert = {format_bytes(eb)})")
        click.echo(f"{'scope':<10} {'budget':>7} {'total':>7}" + "".join(f" {p:>11}" for p in policies))
        wide = df.pivot_table(index=["scope", "budget", "budget_total"], columns="policy",
                              values="misses", sort=False)
        it = a["scored_iterations"]
        for (scope, b, tot), row in wide.iterrows():
            cells = "".join(f" {format_bytes(row[p] * eb / it):>11}" if it else f" {'NA':>11}"
                            for p in policies)
            click.echo(f"{scope.replace('_', '-'):<10} {b:>7} {tot:>7}{cells}")
    if plot_path:
        click.echo(f"\nplot -> {plot_path}")
