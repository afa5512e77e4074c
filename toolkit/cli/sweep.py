"""`moetrace sweep`: capacity cells over C x repeats in randomized order, a results table and Fig. 2."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import click

from moetrace.cli.cell import cell_options, make_spec
from moetrace.cli.common import emit_json
from moetrace.errors import CellInterrupted

CELL_COLUMNS = ["capacity", "capacity_bytes", "repeat", "order", "cell_dir", "mechanism", "mode", "retained",
                "reasons", "iteration_time_median_ns", "iteration_time_spread", "measured_iterations",
                "device_bytes", "device_bytes_per_iteration", "miss_bytes_per_iteration", "amplification",
                "budget_experts", "peak_memory_bytes", "oom_kill", "vmlck_at_loop_entry_bytes",
                "anon_at_loop_entry_bytes", "measured_hints_submitted", "measured_hints_completed",
                "outside_evicted_pages", "flags"]


def parse_capacities(text: str) -> list[tuple[str, int]]:
    """'2.2GiB,1GiB,512MiB' -> [(label, bytes), ...] (labels as written, for directory names)."""
    from moetrace.errors import UsageError
    from moetrace.inputs.geometry import parse_bytes

    out = []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        out.append((re.sub(r"[^A-Za-z0-9.]+", "_", part), parse_bytes(part)))
    if not out:
        raise UsageError("--capacities is empty", hint="e.g. --capacities 2.2GiB,1GiB,512MiB,256MiB")
    if len({b for _, b in out}) != len(out):
        raise UsageError(f"--capacities repeats a capacity: {text}")
    return out


def cell_row(res: dict, label: str, repeat: int, order: int, cell_dir: str) -> dict:
    """One results row from a cell's result (cell.json)."""
    sim = res.get("simulated") or {}
    return {
        "capacity": label, "capacity_bytes": res.get("capacity_bytes"), "repeat": repeat, "order": order,
        "cell_dir": cell_dir, "mechanism": res.get("mechanism"), "mode": res.get("mode"),
        "retained": bool(res.get("retained")), "reasons": "; ".join(res.get("reasons", [])),
        "iteration_time_median_ns": res.get("iteration_time_median_ns"),
        "iteration_time_spread": res.get("iteration_time_spread"),
        "measured_iterations": res.get("measured_iterations"),
        "device_bytes": res.get("device_bytes"),
        "device_bytes_per_iteration": res.get("device_bytes_per_iteration"),
        "miss_bytes_per_iteration": res.get("miss_bytes_per_iteration"),
        "amplification": res.get("amplification"), "budget_experts": sim.get("budget_experts"),
        "peak_memory_bytes": res.get("peak_memory_bytes"),
        "oom_kill": (res.get("oom_events") or {}).get("oom_kill"),
        "vmlck_at_loop_entry_bytes": res.get("vmlck_at_loop_entry_bytes"),
        "anon_at_loop_entry_bytes": res.get("anon_at_loop_entry_bytes"),
        "measured_hints_submitted": res.get("measured_hints_submitted"),
        "measured_hints_completed": res.get("measured_hints_completed"),
        "outside_evicted_pages": (res.get("outside_evictions") or {}).get("pages"),
        "flags": "; ".join(res.get("flags", [])),
    }


def write_results(rows: list[dict], out: Path, plot: bool = True) -> dict:
    """results.csv/.parquet (one row per cell), capacity.csv/.parquet (one per C), fig2.png."""
    import pandas as pd

    from moetrace.analyses.capacity_response import compute_capacity_table, plot_capacity

    cells = pd.DataFrame(rows, columns=CELL_COLUMNS)
    for c in CELL_COLUMNS:
        if c not in ("capacity", "cell_dir", "mechanism", "mode", "reasons", "retained"):
            cells[c] = pd.to_numeric(cells[c], errors="coerce").astype("Float64" if c not in (
                "capacity_bytes", "repeat", "order") else "Int64")
    cells["retained"] = cells["retained"].astype(bool)
    cells.to_csv(out / "results.csv", index=False)
    cells.to_parquet(out / "results.parquet", index=False)
    num = cells.copy()
    for c in num.columns:
        if str(num[c].dtype) in ("Float64", "Int64"):
            num[c] = num[c].astype("float64")
    table = compute_capacity_table(num)
    table.to_csv(out / "capacity.csv", index=False)
    table.to_parquet(out / "capacity.parquet", index=False)
    files = {"results": str(out / "results.csv"), "capacity": str(out / "capacity.csv")}
    if plot and not num.empty:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        plot_capacity(num, axes)
        fig.tight_layout()
        fig.savefig(out / "fig2.png", dpi=120)
        plt.close(fig)
        files["figure"] = str(out / "fig2.png")
    return {"files": files, "table": table}


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
          fadvise_random, freq_table, timeout_s, record, watch, outside_evictions, capacities, repeats, seed,
          out_dir, as_json):
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
    the running cell and writes the results so far (exit 130).
    Example:
      moetrace sweep --plan plan.bin --pool /var/tmp/pool \\
          --capacities 2.2GiB,1GiB,512MiB,256MiB --repeats 3 --mechanism cgroup --out sweep1
    """
    from moetrace.capacity.cell import check_privileges, interrupt_handlers, miss_curve, run_cell
    from moetrace.cli.common import progress

    caps = parse_capacities(capacities)
    specs = {label: make_spec(plan_path, pool_dir, c, mechanism, mode, headroom, threads, warmup, passes,
                              arena_fraction, prefetch, fadvise_random, freq_table, timeout_s, name="sweep",
                              record=record, watch=watch, outside_evictions=outside_evictions)
             for label, c in caps}
    check_privileges()
    out = Path(out_dir)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    jobs = [(label, r) for label, _ in caps for r in range(repeats)]
    random.Random(seed).shuffle(jobs)
    curve = miss_curve(plan_path, warmup, passes)
    rows: list[dict] = []
    stopped = None
    with interrupt_handlers():
        try:
            with progress(jobs, label="sweep cells") as bar:
                for order, (label, r) in enumerate(bar):
                    cdir = out / "cells" / f"{label}-r{r}"
                    try:
                        res = run_cell(specs[label], cdir, curve=curve)
                    except CellInterrupted:
                        raise
                    except click.ClickException as e:  # setup failed for this cell: record it, go on
                        res = {"capacity_bytes": specs[label].capacity_bytes, "mechanism": mechanism,
                               "mode": mode, "retained": False, "reasons": [f"error: {e.format_message()}"]}
                    rows.append(cell_row(res, label, r, order, str(cdir)))
        except CellInterrupted as e:
            stopped = e
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
        click.echo(f"moetrace sweep: {stopped} after {len(rows)} of {len(jobs)} cells", err=True)
        sys.exit(stopped.exit_code)
