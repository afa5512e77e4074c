"""`moetrace cell`: one capacity cell under Algorithm 1 (see moetrace.capacity.cell)."""

from __future__ import annotations

import sys

import click

from moetrace.cli.common import BYTES, DURATION, emit_json
from moetrace.errors import CellInterrupted


def default_cell_dir() -> str:
    """A new cell-<time> directory under $MOETRACE_RUN_ROOT (else /var/tmp/moetrace): a cell
    never writes into the current directory unasked."""
    import os
    import tempfile
    import time

    from moetrace.errors import UsageError

    root = os.environ.get("MOETRACE_RUN_ROOT") or "/var/tmp/moetrace"
    try:
        os.makedirs(root, exist_ok=True)
        return tempfile.mkdtemp(prefix=time.strftime("cell-%Y%m%d-%H%M%S-"), dir=root)
    except OSError as e:
        raise UsageError(f"cannot make a cell directory under {root}: {e.strerror or e}",
                         hint="give --out DIR (a writable place), or set MOETRACE_RUN_ROOT") from None


def cell_options(f):
    """Options shared by `cell` and `sweep`."""
    opts = [
        click.option("--plan", "plan_path", required=True, type=click.Path(exists=True, dir_okay=False),
                     help="The compiled plan (plan.bin) to replay."),
        click.option("--pool", "pool_dir", required=True, type=click.Path(exists=True, file_okay=False),
                     help="The expert pool directory (its geometry must equal the plan's)."),
        click.option("--mechanism", type=click.Choice(["cgroup", "balloon", "machine"]), default="cgroup",
                     show_default=True,
                     help="cgroup: a memory wall of C + headroom (v2 memory.max, else v1 limit_in_bytes); "
                          "balloon: mlocked anonymous memory leaving about C + headroom available; "
                          "machine: no limit, the machine's own memory is C (a lab guest sized for it: "
                          "the paper's mem= boot)."),
        click.option("--mode", type=click.Choice(["pagecache", "mmap", "direct", "pinned", "hybrid"]),
                     default="pagecache", show_default=True, help="The replay's read mode."),
        click.option("--headroom", "headroom", type=BYTES, default="64MiB", show_default=True,
                     help="Memory above C for the replay process's own anonymous memory (interpreter, "
                          "buffers; the paper used 6 GiB at hundreds of GB)."),
        click.option("--threads", type=click.IntRange(1), default=8, show_default=True, help="Replay threads."),
        click.option("--warmup", type=click.IntRange(0), default=1, show_default=True, help="Warm-up passes."),
        click.option("--passes", type=click.IntRange(1), default=1, show_default=True, help="Measured passes."),
        click.option("--arena-fraction", type=float, default=None,
                     help="hybrid: the arena is F x C (default 0.5); pinned: the arena is C."),
        click.option("--prefetch", type=click.Choice(["none", "fadvise", "pread"]), default="none",
                     show_default=True, help="The replay's prefetch advisor."),
        click.option("--fadvise-random", is_flag=True, help="POSIX_FADV_RANDOM on the pool files."),
        click.option("--freq-table", default=None, help="pinned/hybrid: 'oracle' (default) or a table file."),
        click.option("--timeout", "timeout_s", type=float, default=3600.0, show_default=True,
                     help="Seconds a cell may run before it is abandoned (not retained)."),
        click.option("--record", "record", is_flag=True,
                     help="Record the cell's replay (warm-up and measured passes) with `moetrace record` "
                          "into <cell dir>/run; the recorder stays outside the scope."),
        click.option("--stream-events", "stream_events", is_flag=True,
                     help="With --record: stream every page-cache event of the pool (page_events.parquet) "
                          "for exact per-page re-reads within an iteration in `moetrace report` (about 32 "
                          "bytes per event)."),
        click.option("--watch/--no-watch", "watch", default=True, show_default=True,
                     help="Watch the pool's pages for evictions by anyone but the cell's own mechanism "
                          "(DAMON, fadvise, drop_caches, truncation, proactive or global reclaim) with the "
                          "pagecache probe (<cell dir>/watch; --record does it too). Root."),
        click.option("--outside-evictions", type=click.Choice(["flag", "reject"]), default="flag",
                     show_default=True,
                     help="A measured window with outside evictions: flag it in cell.json (flags, "
                          "outside_evictions) and keep it, or reject it (not retained)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def make_spec(plan_path, pool_dir, capacity, mechanism, mode, headroom, threads, warmup, passes,
              arena_fraction, prefetch, fadvise_random, freq_table, timeout_s, name="cell", record=False,
              watch=True, outside_evictions="flag", stream_events=False, **more):
    """A validated CellSpec from CLI values (``more``: `cell`'s own, duration_s, record_probes,
    balloon_thp)."""
    from moetrace.capacity.cell import CellSpec

    spec = CellSpec(plan=plan_path, pool=pool_dir, capacity_bytes=capacity, mechanism=mechanism, mode=mode,
                    headroom_bytes=headroom, threads=threads, warmup=warmup, passes=passes,
                    arena_fraction=arena_fraction, prefetch=prefetch, fadvise_random=fadvise_random,
                    freq_table=freq_table, timeout_s=timeout_s, name=name, record=record, watch=watch,
                    outside_evictions=outside_evictions, stream_events=stream_events, **more)
    spec.validate()
    return spec


SUMMARY_KEYS = ("retained", "reasons", "capacity_bytes", "mechanism", "mode", "device_bytes",
                "device_bytes_per_iteration", "miss_bytes_per_iteration", "amplification",
                "iteration_time_median_ns", "iteration_time_spread", "measured_iterations", "peak_memory_bytes",
                "oom_events", "vmlck_at_loop_entry_bytes", "scope_removed")


@click.command()
@cell_options
@click.option("--capacity", required=True, type=BYTES, help="The capacity C, e.g. 512MiB.")
@click.option("--name", default="cell", show_default=True,
              help="Scope name (the cgroup is moetrace-NAME; a stale one of that name is removed first).")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="The cell directory (cell.json, snapshots/, replay/). Default: a new cell-<time> "
                   "directory under $MOETRACE_RUN_ROOT (else /var/tmp/moetrace), printed.")
@click.option("--json", "as_json", is_flag=True, help="Print cell.json's summary as JSON.")
@click.option("--miss-curve", "miss_curve", default=None, type=click.Path(exists=True, dir_okay=False),
              help="The simulated miss curve of this plan, warm-up and passes, saved by `lab matrix` "
                   "(its numba kernel compiles anew in every lab guest: ~25 s under TCG); refused for "
                   "another plan.")
@click.option("--duration", "duration_s", type=DURATION, default=None, metavar="TIME",
              help="A measured window of TIME (90s, 8min) instead of a number of passes: after the --passes whole "
                   "passes, the replay repeats the plan until TIME has passed (the last pass may stop after any "
                   "iteration). The miss demand is the plan's per-iteration one after --warmup, scored over "
                   "--passes passes (the same every pass after the first: the plan repeats).")
@click.option("--probes", "record_probes", default=None, metavar="LIST",
              help="With --record: the recording's probes (`record --probes`); '+vmscan' adds vmscan to the "
                   "default set.")
@click.option("--balloon-thp", "balloon_thp", type=click.Choice(["on", "off"]), default=None,
              help="--mechanism balloon: madvise the balloon MADV_HUGEPAGE (on) or MADV_NOHUGEPAGE (off) before "
                   "it is locked.  [default: neither; the system's transparent_hugepage setting decides]")
def cell(plan_path, pool_dir, mechanism, mode, headroom, threads, warmup, passes, arena_fraction, prefetch,
         fadvise_random, freq_table, timeout_s, record, stream_events, watch, outside_evictions, capacity, name,
         out_dir, as_json, miss_curve, duration_s, record_probes, balloon_thp):
    """Measure one capacity cell (paper Algorithm 1) into a cell directory.

    \b
    Drops caches, starts a memory scope (limit C + headroom, no swap) or a
    balloon, runs the warm-up and measured replay in that one scope, snapshots
    diskstats/vmstat/meminfo/PSI/lru_gen/VmLck at loop entry and after, and
    retains the cell iff VmLck matches the request, no OOM event occurred and
    the scope stayed alive. Everything it creates is removed, also on Ctrl-C
    (exit 130) and SIGTERM (exit 143); a scope left by a SIGKILLed cell is
    removed by the next one. Needs root. Exit status 0 when retained, 3 when
    the cell ran but was not retained. On a terminal the running phase is
    shown on stderr (not with --json or CI=true; MOETRACE_PROGRESS=0/1
    turns it off/on).
    Example:
      moetrace cell --plan plan.bin --pool /var/tmp/pool --capacity 512MiB \\
          --mechanism cgroup --out cells/512MiB --json
      moetrace cell --plan plan.bin --pool /var/tmp/pool --capacity 512MiB --record --out cells/r
      moetrace cell --plan plan.bin --pool /var/tmp/pool --capacity 512MiB --mechanism balloon \\
          --duration 8min --record --probes +vmscan --out cells/long
    """
    from moetrace.kernel.features import private_mounts

    private_mounts()  # debugfs/tracefs mounted for the probes go with this process, even when SIGKILLed
    from moetrace.capacity.cell import interrupt_handlers, run_cell
    from moetrace.progress import bar, progress_enabled

    spec = make_spec(plan_path, pool_dir, capacity, mechanism, mode, headroom, threads, warmup, passes,
                     arena_fraction, prefetch, fadvise_random, freq_table, timeout_s, name, record, watch,
                     outside_evictions, stream_events, duration_s=duration_s, record_probes=record_probes,
                     balloon_thp=balloon_thp)
    if miss_curve is not None:
        import dataclasses

        from moetrace.capacity.cell import check_miss_curve

        check_miss_curve(miss_curve, plan_path, warmup, passes)  # refused now, not after the replay
        spec = dataclasses.replace(spec, miss_curve=str(miss_curve))
    if out_dir is None:
        out_dir = default_cell_dir()
        click.echo(f"moetrace cell: writing {out_dir} (--out names the directory)", err=True)
    # the running phase as a one-line tqdm status on stderr ("cell: warmup"), erased at the end; only
    # on a terminal, never with --json, CI=true or MOETRACE_PROGRESS=0 (moetrace.progress)
    enabled = progress_enabled(as_json)
    try:
        with interrupt_handlers(), bar(None, desc="cell", unit="phase", enabled=enabled, leave=False,
                                       bar_format="{desc}") as b:
            res = run_cell(spec, out_dir,
                           on_phase=(lambda p: b.set_description_str(f"cell: {p}")) if enabled else None)
    except CellInterrupted as e:
        click.echo(f"moetrace cell: {e}; the scope and balloon were removed", err=True)
        sys.exit(e.exit_code)
    if as_json:
        emit_json({k: res.get(k) for k in SUMMARY_KEYS} | {"cell_dir": out_dir})
    else:
        _print_summary(res, out_dir)
    sys.exit(0 if res["retained"] else 3)


def _print_summary(res: dict, out_dir: str) -> None:
    from moetrace.inputs.geometry import format_bytes

    def b(x):
        return "NA" if x is None else format_bytes(x)

    med = res.get("iteration_time_median_ns")
    amp = res.get("amplification")
    click.echo(f"cell {out_dir}: C={b(res['capacity_bytes'])} {res['mechanism']}/{res['mode']} "
               f"{'retained' if res['retained'] else 'NOT retained'}")
    click.echo(f"  iteration median {('NA' if med is None else f'{med / 1e6:.2f} ms')}, "
               f"device {b(res.get('device_bytes_per_iteration'))}/it, "
               f"simulated miss {b(res.get('miss_bytes_per_iteration'))}/it, "
               f"amplification {('NA' if amp is None else f'{amp:.2f}')}")
    for r in res["reasons"]:
        click.echo(f"  reason: {r}")
    for f in res.get("flags", []):
        click.echo(f"  flag: {f}")
    for n in res.get("notes", []):
        click.echo(f"  note: {n}")
