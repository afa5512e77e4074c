"""`replay` (also `moetrace replay`): replay a plan against an expert pool and time it."""

from __future__ import annotations

import os
import sys

import click

from moetrace.cli.common import BYTES, DURATION, emit_json


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("plan", type=click.Path(dir_okay=False))
@click.option("--pool", "pool_dir", required=True, type=click.Path(file_okay=False),
              help="Pool directory (made by `moetrace pool create`).")
@click.option("--mode", type=click.Choice(["pagecache", "mmap", "direct", "pinned", "hybrid"]),
              default="pagecache", show_default=True,
              help="pagecache: pread; mmap: copy from a mapping; direct: O_DIRECT; pinned/hybrid: an "
                   "mlocked arena of the most frequent experts, misses through the page cache.")
@click.option("--threads", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="Reader threads; each layer's experts are split across them.")
@click.option("--warmup", type=click.IntRange(0), default=1, show_default=True,
              help="Warm-up passes over the whole plan (logged, not measured).")
@click.option("--passes", type=click.IntRange(1), default=1, show_default=True,
              help="Measured passes over the whole plan.")
@click.option("--duration", "duration_s", type=DURATION, default=None, metavar="TIME",
              help="A measured window of TIME (90s, 8min): after the --passes whole passes, more measured "
                   "passes until TIME has passed since the first began; the last stops after the iteration "
                   "that ends past it. The iteration log grows by one row (~0.1 KB) per iteration, nothing else.")
@click.option("--arena-bytes", type=BYTES, metavar="SIZE",
              help="pinned/hybrid: arena size; floor(SIZE / expert_bytes) whole experts are mlocked.")
@click.option("--freq-table", default="oracle", show_default=True, metavar="oracle|FILE",
              help="Which experts go in the arena: the plan's own counts (oracle) or counts from a trace "
                   "(.jsonl/.parquet) or plan.bin.")
@click.option("--prefetch", type=click.Choice(["none", "fadvise", "pread"]), default="none", show_default=True,
              help="Prefetch advisor: after each layer, hint the next slot's experts with "
                   "posix_fadvise(WILLNEED) or a blocking pread (the plan needs hints).")
@click.option("--fadvise-random", is_flag=True, help="POSIX_FADV_RANDOM on every pool fd (no readahead).")
@click.option("--read-size", type=BYTES, metavar="SIZE",
              help="Split each expert read into calls of at most SIZE (default: one call per expert).")
@click.option("--run-dir", type=click.Path(file_okay=False), envvar="MOETRACE_RUN_DIR", show_envvar=True,
              help="Write iterations.parquet and replay.json here (default: $MOETRACE_RUN_DIR; "
                   "neither: no files).")
@click.option("--sync-fd", type=click.IntRange(0), metavar="FD",
              help="A connected socket from the parent: 'loop_entry vmlck_bytes=N arena_bytes=M' is "
                   "written after preload and warm-up, then 'go' is awaited; 'done' after the measured passes.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary (replay.json) on stdout.")
@click.pass_context
def replay(ctx, plan, pool_dir, mode, threads, warmup, passes, duration_s, arena_bytes, freq_table, prefetch,
           fadvise_random, read_size, run_dir, sync_fd, as_json):
    """Replay PLAN against the pool: every pass's experts, layer by layer, in plan order.

    \b
    Every layer's reads complete before the next layer starts; each access is
    one copy into a thread's preallocated buffer. Timestamps are
    CLOCK_MONOTONIC ns. The arena preload is timed apart and excluded from
    every iteration. SIGINT/SIGTERM stop after the layer in flight, write the
    run directory with "complete": false and exit 130/143.
    With MOETRACE_PDEATHSIG=1 the replay dies with its parent.

    \b
    Examples:
      replay plan.bin --pool /var/tmp/pool --run-dir runs/pc
      replay plan.bin --pool /var/tmp/pool --mode direct --warmup 0 --passes 3 --json
      replay plan.bin --pool /var/tmp/pool --duration 8min --run-dir runs/long
      replay plan.bin --pool /var/tmp/pool --mode pinned --arena-bytes 512MiB
      replay plan.bin --pool /var/tmp/pool --prefetch fadvise --fadvise-random
    """
    from moetrace.inputs.geometry import format_bytes
    from moetrace.errors import MoetraceError
    from moetrace.kernel.syscalls import set_pdeathsig
    from moetrace.replay.harness import ReplayOptions, run_replay
    from moetrace.cli.common import progress

    if os.environ.get("MOETRACE_PDEATHSIG") == "1":
        try:
            set_pdeathsig(orphan_exits=True)
        except OSError as e:
            raise MoetraceError(f"the replay cannot follow its parent: {e}",
                                hint="unset MOETRACE_PDEATHSIG to run it without") from None
    opts = ReplayOptions(mode=mode, threads=threads, warmup=warmup, passes=passes, duration_s=duration_s,
                         arena_bytes=arena_bytes,
                         freq_table=freq_table, prefetch=prefetch, fadvise_random=fadvise_random,
                         read_size=read_size, run_dir=run_dir or None, sync_fd=sync_fd)
    res = run_replay(plan, pool_dir, opts, handle_signals=True, progress=progress,
                     command=[os.path.basename(sys.argv[0]), *sys.argv[1:]])
    s = res.summary
    if as_json:
        emit_json(s)
        return
    m, ph = s["measured"], s["phases"]["measured"]
    click.echo(f"{plan}: {s['plan']['iterations']} iterations, {s['plan']['reads']} reads per pass, "
               f"mode {mode}, {threads} threads")
    if s["arena_experts"]:
        click.echo(f"arena: {s['arena_experts']} experts, {format_bytes(s['arena_bytes'])} locked "
                   f"(VmLck {format_bytes(s['vmlck_bytes'])}), preload {s['preload_ns'] / 1e9:.3f} s")
    if m["iterations"]:
        click.echo(f"measured: {m['iterations']} iterations, median {m['median_ns'] / 1e6:.3f} ms "
                   f"(min {m['min_ns'] / 1e6:.3f}, max {m['max_ns'] / 1e6:.3f}, spread "
                   f"{(m['spread_rel'] or 0) * 100:.1f}%), {format_bytes(ph['bytes'])} in "
                   f"{ph['reads']} reads, {ph['gbps'] or 0:.2f} GB/s")
    if s["hints"]:
        hh = s["hints"]
        click.echo(f"hints ({hh['kind']}): submitted {hh['submitted']}, overwritten {hh['overwritten']}, "
                   f"completed {hh['completed']}")
    if opts.run_dir:
        click.echo(f"run directory: {opts.run_dir}")


def main() -> None:
    """The `replay` console script."""
    replay.main(prog_name="replay")


if __name__ == "__main__":
    main()
