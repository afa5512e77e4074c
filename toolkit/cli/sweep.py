"""`moetrace sweep`: capacity cells over C x repeats in randomized order, a results table and Fig. 2."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from moetrace.cli.cell import cell_options, make_spec
from moetrace.cli.common import emit_json


@click.command()
@cell_options
@click.option("--capacities", required=True,
              help="Comma-separated capacities C, e.g. 2.2GiB,1GiB,512MiB,256MiB.")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True, help="Cells per capacity.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the randomized cell order.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Sweep directory: cells/<C>-r<i>/, results.csv/.parquet, capacity.csv/.parquet, fig2.png.")
@click.option("--json", "as_json", is_flag=True, help="Print the per-capacity table as JSON.")
def sweep(plan_path, pool_dir, mechanism, mode, headroom, threads, warmup, passes, arena_fraction, prefetch,
          fadvise_random, freq_table, timeout_s, record, stream_events, watch, outside_evictions, capacities,
          repeats, seed, out_dir, as_json):
    """Run capacity cells over C x repeats in randomized (seeded) order.

    \b
    Each cell follows Algorithm 1 (see `moetrace cell --help`) in
    OUT/cells/<C>-r<i>/. A cell that fails is recorded as not retained with
    its reason and the sweep goes on. Writes results.csv/.parquet (one row per
    cell: iteration time, device bytes per iteration from diskstats, simulated
    LRU miss bytes per iteration, amplification, retained and why),
    capacity.csv/.parquet (per C: median and spread over retained repeats) and
    fig2.png (iteration time vs C; device bytes vs C log-log with the miss
    demand and an a/C reference). Needs root. Ctrl-C stops after cleaning up
    the running cell and writes the results so far (exit 130). On a
    terminal a progress bar of cells (the running one and its phase after
    it) goes to stderr (not with --json or CI=true; MOETRACE_PROGRESS=0/1
    turns it off/on).
    Example:
      moetrace sweep --plan plan.bin --pool /var/tmp/pool \\
          --capacities 2.2GiB,1GiB,512MiB,256MiB --repeats 3 --mechanism cgroup --out sweep1
    """
    from moetrace.kernel.features import private_mounts

    private_mounts()  # debugfs/tracefs mounted for the probes go with this process, even when SIGKILLed
    from moetrace.capacity.cell import check_privileges, interrupt_handlers
    from moetrace.capacity.sweep import parse_capacities, run_sweep
    from moetrace.progress import bar, progress_enabled
    from moetrace.reports.sweep import write_results

    caps = parse_capacities(capacities)
    specs = {label: make_spec(plan_path, pool_dir, c, mechanism, mode, headroom, threads, warmup, passes,
                              arena_fraction, prefetch, fadvise_random, freq_table, timeout_s, name="sweep",
                              record=record, watch=watch, outside_evictions=outside_evictions,
                              stream_events=stream_events)
             for label, c in caps}
    check_privileges()
    out = Path(out_dir)
    # cells done of all on a tqdm bar on stderr, the running cell (<C>-r<i>) and its phase as the
    # postfix; only on a terminal, never with --json, CI=true or MOETRACE_PROGRESS=0 (moetrace.progress)
    enabled = progress_enabled(as_json)
    with interrupt_handlers(), bar(len(caps) * repeats, desc="sweep", unit="cell", enabled=enabled) as b:
        shown = {"done": 0, "cell": ""}

        def on_progress(n_done: int, total: int, current: str | None) -> None:
            b.update(n_done - shown["done"])
            shown["done"], shown["cell"] = n_done, current or ""
            b.set_postfix_str(f"C={current}" if current else "")

        def on_phase(phase: str) -> None:
            b.set_postfix_str(f"C={shown['cell']} {phase}")

        done = run_sweep(specs, caps, repeats, seed, out, plan_path, warmup, passes,
                         progress=on_progress if enabled else None, on_phase=on_phase if enabled else None)
    rows, stopped = done.rows, done.stopped
    res = write_results(rows, out)
    if as_json:
        t = res["table"]
        emit_json({"out": str(out), "cells": len(rows), "files": res["files"],
                   "capacity": [{k: (None if (isinstance(v, float) and v != v) else v) for k, v in row.items()}
                                for row in t.to_dict(orient="records")]})
    else:
        click.echo(res["table"].to_string(index=False))
        click.echo(f"wrote {', '.join(res['files'].values())}")
    if stopped is not None:
        click.echo(f"moetrace sweep: {stopped} after {len(rows)} of {done.jobs} cells", err=True)
        sys.exit(stopped.exit_code)
