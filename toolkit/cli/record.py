"""`moetrace record`: run a command with probes attached and write a run directory."""

from __future__ import annotations

import click

from moetrace.cli.common import emit_json, exit_now


@click.command(context_settings={"help_option_names": ["-h", "--help"], "ignore_unknown_options": True})
@click.option("--probes", default=None, metavar="LIST",
              help="Comma-separated probes to attach (default: pagecache, lru, reclaim, mlock, block, reads, "
                   "stacks, mglru; '+vmscan,+...' adds to that set; `moetrace doctor` lists every probe); one this "
                   "kernel cannot attach is skipped with "
                   "the reason it gives, or is an error for pagecache, reclaim, block, reads under "
                   "--missing-probes error.")
@click.option("--knob", "knob_items", multiple=True, metavar="PROBE.NAME=V",
              help="Set a knob of lru, mlock, reads, stacks or mglru, e.g. stacks.MOE_SAMPLE_HZ=999 "
                   "(repeatable; `moetrace doctor --json` lists each probe's knobs).")
@click.option("--out", type=click.Path(file_okay=False), metavar="RUN_DIR",
              help="Run directory to create, owner-only (default: runs/<UTC time>-<pid>).")
@click.option("--pool", "pool_dir", type=click.Path(),
              help="Pool to attribute pages to: a pool directory, or a model file (GGUF; safetensors file, "
                   "index or directory) mapped as `moetrace pool map` does (default: the --pool of the "
                   "recorded command).")
@click.option("--missing-probes", type=click.Choice(["error", "warn"]), default="error", show_default=True,
              help="A probe that cannot attach (or does not exist yet): stop, or record without it "
                   "(the manifest's attach plan says why).")
@click.option("--stream-events", is_flag=True,
              help="Also stream one record per (page-cache event, expert) through the ring buffer "
                   "(page_events.parquet; lost records counted per interval).")
@click.option("--cgroup", "cgroup", type=click.Path(file_okay=False, exists=True), metavar="DIR",
              help="A cgroup (v1 or v2 directory) COMMAND joins before it execs, e.g. a memory scope; "
                   "the recorder itself stays outside it.")
@click.option("--bpf-stats", is_flag=True,
              help="Count the probes' own cost: BPF run-time statistics on while recording (off again at the "
                   "end); manifest bpf_runtime gives each probe's run count and kernel CPU time.")
@click.option("--wait-detach", is_flag=True,
              help="Return only once the kernel has released every probe. Without it record returns when the "
                   "probes are disarmed, read and dropped, and a releaser process finishes the kernel's part "
                   "(~44 ms of RCU grace periods per tracepoint, ~2.5 s for the default set) on its own; "
                   "the manifest's detach.releaser_pid names it.")
@click.option("--json", "as_json", is_flag=True, help="Print the final manifest on stdout.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def record(ctx, probes, knob_items, out, pool_dir, missing_probes, stream_events, cgroup, bpf_stats, wait_detach,
           as_json, command):
    """Run COMMAND with probes attached; write a run directory; exit with COMMAND's status.

    \b
    Probes are loaded and attached first, then COMMAND starts (no event of it
    is missed) with MOETRACE_RUN_DIR=<RUN_DIR>/replay, so a replay's iteration
    log lands beside the probe tables. The pagecache probe counts, per expert
    and in the kernel, pages added (misses), evicted and re-added (exact, per
    page); requested pages come from the replay's own accounting, hits =
    requested - added. The block probe adds each expert's device read bytes
    and bios (bios mapped to experts through the pool's FIEMAP extents on its
    disk; the rest is the unattributed row) and request latency
    (block_latency.parquet); the reclaim probe says who reclaimed how much
    (reclaim.parquet, reclaim_histogram.parquet). lru: LRU insertions,
    activations and dwell per expert (lru.parquet); reads: every read call's
    latency and hit-only / miss class (reads.parquet); mlock: locked bytes over
    time (mlock.parquet); stacks: cpu-clock samples folded and symbolized
    (stacks.folded); mglru: lru_gen generations (lru_gen.parquet) where MGLRU
    exists. A replay writes its iteration into the probe, so page-cache counts are kept
    per iteration too (epochs.parquet, expert_epochs.parquet).
    Ctrl-C is forwarded to COMMAND; the run is then marked
    "complete": false and still loads. Needs root (or CAP_BPF + CAP_PERFMON).

    \b
    Examples:
      moetrace record --out runs/cold -- replay plan.bin --pool /var/tmp/pool --warmup 0
      moetrace record --pool /var/tmp/pool -- dd if=/var/tmp/pool/pool.bin of=/dev/null bs=1M
      moetrace record --json --out runs/x -- replay plan.bin --pool /var/tmp/pool --passes 3
      moetrace record --probes pagecache --out runs/pc -- replay plan.bin --pool /var/tmp/pool
      moetrace record --probes pagecache,stacks --knob stacks.MOE_SAMPLE_HZ=999 -- replay plan.bin --pool P
      moetrace record --cgroup /sys/fs/cgroup/memory/moetrace-c1 -- replay plan.bin --pool /var/tmp/pool
      moetrace record --pool tiny.gguf --probes pagecache,block -- moetrace model route tiny.gguf -o t.jsonl
    """
    from moetrace.kernel.features import private_mounts

    private_mounts()  # debugfs/tracefs mounted for the probes go with this process, even when SIGKILLed
    from moetrace.record.recorder import RecordOptions, record as do_record

    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    from moetrace.record.recorder import probe_list

    plist = probe_list(probes)
    opts = RecordOptions(command=cmd, out=out, probes=plist, pool=pool_dir, missing_probes=missing_probes,
                         stream_events=stream_events, cgroup=cgroup, knobs=_knobs(knob_items), bpf_stats=bpf_stats,
                         wait_detach=wait_detach)
    res = do_record(opts, on_event=lambda s: click.echo(f"moetrace record: {s}", err=True))
    if as_json:
        emit_json(res.manifest)
    else:
        _echo_totals(res)
    exit_now(ctx, res.exit_status)


def _knobs(items) -> dict[str, dict[str, int]]:
    """--knob PROBE.NAME=V items as {probe: {knob: value}}."""
    knobs: dict[str, dict[str, int]] = {}
    for item in items:
        name, eq, val = item.partition("=")
        probe, dot, knob = name.partition(".")
        try:
            if not (eq and dot and probe and knob):
                raise ValueError
            knobs.setdefault(probe.strip(), {})[knob.strip()] = int(val, 0)
        except ValueError:
            raise click.BadParameter(f"{item!r}: expected PROBE.NAME=INTEGER, e.g. stacks.MOE_SAMPLE_HZ=999",
                                     param_hint="--knob") from None
    return knobs


def _echo_totals(res) -> None:
    """The run directory, the command's status and the recording's totals, on stderr."""
    t = res.manifest.get("totals") or {}
    tail = "" if res.complete else " (incomplete)"
    click.echo(f"moetrace record: run directory {res.run_dir}{tail}; command exit status {res.exit_status}",
               err=True)
    if "experts_added_pages" in t:
        req = t["experts_requested_pages"]
        if req is None:
            why = (res.manifest.get("requested") or {}).get("source") or "no replay log"
            req = f"NA ({why})"
        click.echo(f"moetrace record: experts added {t['experts_added_pages']} pages, evicted "
                   f"{t['experts_evicted_pages']}, re-added {t['experts_re_added_pages']}, requested "
                   f"{req}; unattributed added {t['unattributed_added_pages']}", err=True)
        by = {k: v for k, v in (t.get("experts_evicted_by") or {}).items() if v}
        if by:
            click.echo("moetrace record: pool pages evicted by " +
                       ", ".join(f"{k} {v}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])), err=True)
    if "experts_device_read_bytes" in t:
        click.echo(f"moetrace record: device read bytes: experts {t['experts_device_read_bytes']}, "
                   f"unattributed {t['unattributed_device_read_bytes']}", err=True)
    rs = (res.manifest.get("summaries") or {}).get("reclaim")
    if rs:
        click.echo(f"moetrace record: reclaim scanned {rs['scanned_pages']} pages, reclaimed "
                   f"{rs['reclaimed_pages']}", err=True)


if __name__ == "__main__":  # `python -m moetrace.cli.record` (what `moetrace cell --record` runs)
    record(prog_name="moetrace record")
