"""`moetrace sweep`: capacity cells over C x repeats in randomized order, a results table and Fig. 2."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from moetrace.cli.cell import cell_options, make_spec
from moetrace.cli.common import emit_json, executor_options, slurm_params


@click.command()
@cell_options
@click.option("--capacities", required=True,
              help="Comma-separated capacities C, e.g. 2.2GiB,1GiB,512MiB,256MiB.")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True, help="Cells per capacity.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the randomized cell order.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Sweep directory: cells/<C>-r<i>/, results.csv/.parquet, capacity.csv/.parquet, fig2.png.")
@click.option("--json", "as_json", is_flag=True, help="Print the per-capacity table as JSON.")
@executor_options(stage_pool=True)
def sweep(plan_path, pool_dir, mechanism, mode, headroom, threads, warmup, passes, arena_fraction, prefetch,
          fadvise_random, freq_table, timeout_s, record, stream_events, watch, outside_evictions, capacities,
          repeats, seed, out_dir, as_json, executor, slurm_partition, slurm_time, slurm_exclusive, slurm_options,
          stage_pool):
    """Run capacity cells over C x repeats in randomized (seeded) order.

    \b
    Each cell follows Algorithm 1 (see `moetrace cell --help`) in
    OUT/cells/<C>-r<i>/. A cell that fails is recorded as not retained with
    its reason and the sweep goes on. Writes results.csv/.parquet (one row per
    cell: iteration time, device bytes per iteration from diskstats, simulated
    LRU miss bytes per iteration, amplification, retained and why),
    capacity.csv/.parquet (per C: median and spread over retained repeats) and
    fig2.png (iteration time vs C; device bytes vs C log-log with the miss
    demand and an a/C reference). Needs root (on the nodes, with --executor
    slurm). Ctrl-C stops after cancelling the running cells' jobs (each
    cleans up) and writes the results so far (exit 130).

    \b
    Each cell is a job (OUT/jobs/<C>-r<i>.json): --executor local runs the
    jobs one at a time in subprocesses here; --executor slurm submits them
    all to Slurm (one node each, --exclusive by default). Running the same
    command into the same OUT again runs only the cells not yet retained; a
    job that fails is reported with its log and resubmitted once. On a
    terminal a progress bar of cells (pending, running with its phase,
    done) goes to stderr (not with --json or CI=true; MOETRACE_PROGRESS=0/1
    turns it off/on); every failed job and resubmission is said on stderr,
    and with --executor slurm and no bar every cell as it ends.
    Example:
      moetrace sweep --plan plan.bin --pool /var/tmp/pool \\
          --capacities 2.2GiB,1GiB,512MiB,256MiB --repeats 3 --mechanism cgroup --out sweep1
      moetrace sweep --plan /shared/plan.bin --pool /shared/pool --capacities 1GiB,512MiB \\
          --executor slurm --slurm-partition nvme --slurm-time 2:00:00 --stage-pool /local/moetrace \\
          --out /shared/sweep1
    """
    from moetrace.kernel.features import private_mounts

    private_mounts()  # debugfs/tracefs mounted for the probes go with this process, even when SIGKILLed
    from moetrace.capacity.cell import check_privileges, interrupt_handlers
    from moetrace.capacity.dispatch import make_executor
    from moetrace.capacity.sweep import parse_capacities, run_sweep
    from moetrace.progress import bar, progress_enabled

    caps = parse_capacities(capacities)
    specs = {label: make_spec(plan_path, pool_dir, c, mechanism, mode, headroom, threads, warmup, passes,
                              arena_fraction, prefetch, fadvise_random, freq_table, timeout_s, name="sweep",
                              record=record, watch=watch, outside_evictions=outside_evictions,
                              stream_events=stream_events)
             for label, c in caps}
    if executor == "local":
        check_privileges()
    out = Path(out_dir)
    ex = make_executor(executor, out, **slurm_params(slurm_partition, slurm_time, slurm_exclusive, slurm_options,
                                                     timeout_s, executor))
    # cells done of all on a tqdm bar on stderr, pending / running (with the running cell's phase)
    # as the postfix; only on a terminal, never with --json, CI=true or MOETRACE_PROGRESS=0
    enabled = progress_enabled(as_json)
    total = len(caps) * repeats
    with interrupt_handlers(), bar(total, desc="sweep", unit="cell", enabled=enabled) as b:
        on_status, on_event, on_end = _reporters(b, total)
        done = run_sweep(specs, caps, repeats, seed, out, executor=ex, on_status=on_status if enabled else None,
                         on_event=on_event, stage_pool=stage_pool,
                         on_end=on_end if executor == "slurm" and not enabled else None)
    _finish(done, out, as_json)


def _reporters(b, total: int):
    """What the sweep says as it runs: the bar's cells done and its postfix (pending, running with
    the running cell's phase), each event on stderr, and (Slurm without a bar: a batch log) a
    line per cell as it ends."""
    shown = {"done": 0}

    def on_status(st) -> None:
        done = (total - st.total) + st.done + st.failed  # the cells retained before count as done
        b.update(max(0, done - shown["done"]))
        shown["done"] = max(done, shown["done"])
        run = ", ".join(f"C={n} {p}".rstrip() for n, p in st.running.items())
        b.set_postfix_str(f"pending {st.pending}" + (f", running {run}" if run else ""))

    def on_event(text: str) -> None:
        click.echo(f"moetrace sweep: {text}", err=True)

    def on_end(sub) -> None:
        from moetrace.capacity.jobs import last_run

        ran = last_run(sub.job.out, sub.job.name)
        click.echo(f"moetrace sweep: cell {sub.job.name} {sub.state} (job {sub.job_id} on "
                   f"{ran.get('host') or '?'}: {ran.get('outcome') or sub.error})", err=True)

    return on_status, on_event, on_end

def _finish(done, out: Path, as_json: bool) -> None:
    """The results written from the cell directories, the table or JSON printed, the exit."""
    from moetrace.reports.sweep import write_results

    rows, stopped = done.rows, done.stopped
    res = write_results(rows, out)
    kept = sum(bool(r.get("retained")) for r in rows)
    if as_json:
        t = res["table"]
        emit_json({"out": str(out), "cells": len(rows), "retained": kept, "ran": done.ran,
                   "submitted": done.submitted, "failed": done.failed, "files": res["files"],
                   "capacity": [{k: (None if (isinstance(v, float) and v != v) else v) for k, v in row.items()}
                                for row in t.to_dict(orient="records")]})
    else:
        click.echo(res["table"].to_string(index=False))
        click.echo(f"{kept} of {done.jobs} cells retained ({len(done.ran)} run now); "
                   f"wrote {', '.join(res['files'].values())}")
    if stopped is not None:
        click.echo(f"moetrace sweep: {stopped} after {len(rows)} of {done.jobs} cells", err=True)
        sys.exit(stopped.exit_code)
