"""`moetrace sim`: cache-policy simulations (LRU, LFU, static, Belady) under fair windows."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

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
    from moetrace.analyses.sim import compute_sim, parse_budgets, parse_policies
    from moetrace.inputs.accesses import load_accesses, plan_expert_bytes
    from moetrace.errors import UsageError

    policies = parse_policies(policy_text)
    budgets = parse_budgets(budget_text)
    gbudgets = parse_budgets(global_text, "--global-budgets") if global_text else None
    if scope is None:
        scopes = ["per_layer", "global"] if gbudgets else ["per_layer"]
    elif scope == "both":
        scopes = ["per_layer", "global"]
    else:
        scopes = [scope.replace("-", "_")]
    if gbudgets and "global" not in scopes:
        raise UsageError("--global-budgets needs --scope global or both")
    geo = None
    if geometry_name:
        from moetrace.inputs.geometry import preset

        geo = preset(geometry_name)
    if expert_bytes is None and geo is not None:
        expert_bytes = geo.expert_bytes or None
    kw = dict(k=geo.k, n_layers=geo.n_layers, n_experts=geo.n_experts) if geo else {}
    info: dict = {}
    table, table_name = static_table, static_table
    if "static" in policies and static_table not in ("oracle", "warm"):
        table = load_accesses(static_table, **kw)
    with _streamable(trace_or_plan, order, request, kw, info) as plan_path:
        if plan_path is not None:
            from moetrace.analyses.simstream import compute_sim_stream
            from moetrace.inputs.plan import read_header

            h = read_header(plan_path)
            if expert_bytes is None:
                expert_bytes = h.expert_bytes or None
            if geo is not None and (h.n_layers, h.n_experts) != (geo.n_layers, geo.n_experts):
                raise UsageError(f"{trace_or_plan} is {h.n_layers}x{h.n_experts} but --geometry {geo.name} "
                                 f"is {geo.n_layers}x{geo.n_experts}")
            if h.n_reads == 0:
                raise UsageError(f"{trace_or_plan} holds no accesses to simulate")
            df = compute_sim_stream(plan_path, policies, budgets, scopes, gbudgets, warm_fraction, expert_bytes,
                                    table if "static" in policies else "oracle", table_name)
            info.setdefault("order", h.order)
        else:
            acc = load_accesses(trace_or_plan, order=order, request=request, info=info, **kw)
            if expert_bytes is None:
                expert_bytes = plan_expert_bytes(trace_or_plan)
            if geo is not None and (acc.n_layers, acc.n_experts) != (geo.n_layers, geo.n_experts):
                raise UsageError(f"{trace_or_plan} is {acc.n_layers}x{acc.n_experts} but --geometry {geo.name} "
                                 f"is {geo.n_layers}x{geo.n_experts}")
            if len(acc) == 0:
                raise UsageError(f"{trace_or_plan} holds no accesses to simulate")
            df = compute_sim(acc, policies, budgets, scopes, gbudgets, warm_fraction, expert_bytes,
                             table if "static" in policies else "oracle", table_name)
            info.setdefault("order", acc.order)
    if plot_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from moetrace.analyses.sim import plot_sim

        fig, ax = plt.subplots(figsize=(7, 4.5))
        plot_sim(df, ax)
        fig.tight_layout()
        fig.savefig(plot_path, dpi=120)
        plt.close(fig)
    if as_json:
        rows = df.astype(object).where(df.notna(), None).to_dict(orient="records")
        emit_json({"input": str(trace_or_plan), **df.attrs, **info, "static_table": table_name, "rows": rows})
        return
    click.echo(f"stream: {info.get('stream', 'as given')}; experts of a step in {info['order']} order")
    _print_table(df, str(trace_or_plan), policies, table_name, plot_path)


@contextlib.contextmanager
def _streamable(path: str, order, request, kw: dict, info: dict):
    """The plan to simulate in bounded memory, or None for the in-memory path.

    A plan is streamed as it is (unless it must be re-ordered or split by
    request, which a plan cannot); an engine JSONL trace larger than
    MOETRACE_STREAM_BYTES (default 8 MiB) is compiled to a temporary plan first."""
    from moetrace.inputs.accesses import is_plan

    if not os.path.isfile(path):
        yield None
        return
    if is_plan(path):
        from moetrace.inputs.plan import read_header
        from moetrace.inputs.trace import check_dense_pool

        h = read_header(path)
        # the simulators keep state per (layer, expert): a plan compiled from a trace with a stray id
        # can name a pool of billions (its header says so; nothing is allocated before this)
        check_dense_pool(h.n_layers, h.n_experts, path, "simulate")
        if request is None and (order is None or order == h.order):
            req = h.meta.get("request")
            info.update(stream=f"the plan's stream ({'request ' + str(req) if req else 'as compiled'})",
                        order=h.order)
            yield path
            return
        yield None
        return
    from moetrace.inputs.stream import is_streamable

    if not is_streamable(path):
        yield None
        return
    from moetrace.inputs.plan import compile_plan

    tmp = tempfile.mkdtemp(prefix="moetrace-sim-")
    try:
        out = os.path.join(tmp, "plan.bin")
        h = compile_plan([path], out, k=kw.get("k"), n_layers=kw.get("n_layers"), n_experts=kw.get("n_experts"),
                         request=request, order=order or "rank")
        from moetrace.inputs.accesses import stream_sentence

        n_req = (h.meta.get("requests") or [1])[0]
        stream = stream_sentence(request, h.n_iterations, n_req)
        info.update(stream=stream + " (compiled to a temporary plan, simulated in bounded memory)",
                    order=h.order, requests=n_req)
        yield out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
