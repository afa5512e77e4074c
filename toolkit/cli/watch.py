"""`moetrace watch`: the expert pool's page-cache figures on a live host, every interval."""

from __future__ import annotations

import signal
import sys

import click

from moetrace.cli.common import exit_now


class _Stop(Exception):
    """SIGINT / SIGTERM while attaching: stop at once (open() detaches what it attached)."""


class _Signals:
    """SIGINT and SIGTERM: while attaching they stop at once; once watching they ask the loop to
    end after the step in flight (never in the middle of a reading: nothing counted is lost),
    and the last partial interval is still shown before the probes detach."""

    def __init__(self, w):
        self.w, self.watching = w, False
        self.old = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}

    def __call__(self, signum, frame):
        self.w.stop_reason = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
        if not self.watching:
            raise _Stop()

    def restore(self) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)


def _show(fig, opts, live, w=None) -> None:
    from moetrace.live import view

    ex = opts.get("exposition")
    if ex is not None and w is not None:
        ex.update(w.prev, fig)
        if opts.get("textfile"):
            ex.write_textfile(opts["textfile"])
    if opts["json"]:
        click.echo(view.json_line(fig))
    elif live is not None:
        live.update(view.table(fig, opts["rows"]))
    else:
        for line in view.plain_lines(fig, opts["rows"]):
            click.echo(line)
    sys.stdout.flush()


def _loop(w, opts, live) -> str:
    """Show intervals until COUNT, the watched process's end, the cgroup's removal, Ctrl-C or
    SIGTERM; then the last partial interval. Returns why it ended."""
    n, why = 0, None
    while not w.ended() and (opts["count"] is None or n < opts["count"]):
        fig = w.step()
        n += 1
        _show(fig, opts, live, w)
    why = w.stop_reason or w.end_reason or f"{n} intervals"
    last = w.finish()  # what the probes counted since the last interval: shown when anything was
    if last is not None and _counted(last):
        last["final"] = True
        _show(last, opts, live, w)
    return why or "stopped"


def _counted(fig) -> bool:
    p = fig.get("pool") or {}
    return any(p.get(k) for k in ("added_pages", "re_added_pages", "evicted_pages", "device_read_bytes",
                                  "requested_bytes"))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--pool", "pool_dir", type=click.Path(), metavar="DIR|MODEL",
              help="The expert pool to attribute pages to (per-expert figures; without it everything is "
                   "unattributed).")
@click.option("--pid", type=int, metavar="PID",
              help="Follow this process (and its children) for its read calls; watch ends when it exits.")
@click.option("--cgroup", type=click.Path(file_okay=False), metavar="PATH",
              help="Follow every process of this cgroup; reclaim, refaults, PSI and locked bytes are the "
                   "cgroup's (v2; v1 has only refaults and unevictable bytes per cgroup). Ends when removed.")
@click.option("-C", "--noclear", is_flag=True, help="Do not refresh a table in place: print plain lines.")
@click.option("-r", "--maxrows", "rows", type=click.IntRange(0), default=10, show_default=True,
              help="Top experts to show per interval.")
@click.option("--thresholds", type=click.Path(dir_okay=False, exists=True), metavar="FILE",
              help="check's TOML; its [watch] table sets the alarm thresholds: amplification, scan_to_steal, "
                   "rereads_pages, outside_pages, psi_full_pct (README: Watching a live host).")
@click.option("--misses/--no-misses", default=True, show_default=True,
              help="Computed misses (and the amplification alarm): stream the followed processes' read calls "
                   "(the reads probe, one record per call) through an LRU of the pool's resident size. "
                   "--no-misses: counters only.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per interval on stdout.")
@click.option("--prometheus", metavar="HOST:PORT",
              help="Serve the metrics (Prometheus text format) on http://HOST:PORT/metrics, e.g. 127.0.0.1:9464.")
@click.option("--textfile", type=click.Path(file_okay=False, exists=True, writable=True), metavar="DIR",
              help="Write the metrics to DIR/moetrace.prom every interval (node_exporter's textfile collector); "
                   "removed when watch ends, so that no stale alarm stays behind.")
@click.argument("interval", type=click.FloatRange(min=0.05), default=1.0, required=False)
@click.argument("count", type=click.IntRange(min=1), required=False)
@click.pass_context
def watch(ctx, pool_dir, pid, cgroup, noclear, rows, thresholds, misses, as_json, prometheus, textfile, interval,
          count):
    """Watch the expert pool in the page cache: every INTERVAL seconds (default 1), COUNT times
    (default: until Ctrl-C, SIGTERM, or the watched process's end).

    \b
    Per interval: requested bytes (the followed processes' reads), pages added (missed),
    re-added (read again after eviction) and evicted, by evictor class; device bytes on the
    pool; reclaim scan-to-steal; file refaults; PSI memory some/full; locked fraction; the top
    experts. Alarms (thresholds in the [watch] table of check's TOML): rereads, outside_evictor,
    psi_full, amplification. The probes count in the kernel (no per-page stream): memory stays
    flat however long it runs. Needs root (or CAP_BPF + CAP_PERFMON).

    \b
    Examples:
      moetrace watch --pool /var/tmp/pool --cgroup /sys/fs/cgroup/serve
      moetrace watch --pool /var/tmp/pool --pid 4242 5
      moetrace watch --pool /var/tmp/pool --json 2 30 > watch.jsonl
    """
    from moetrace.analyses.compare import load_thresholds
    from moetrace.kernel.features import private_mounts
    from moetrace.live.watch import WatchOptions, Watcher

    private_mounts()
    th = load_thresholds(thresholds).watch
    opts = WatchOptions(pool=pool_dir, pid=pid, cgroup=cgroup, interval=interval, count=count, top=max(rows, 10),
                        thresholds=th, misses=misses)
    say = (lambda s: click.echo(f"moetrace watch: {s}", err=True))
    w = Watcher(opts, say=say)
    sig = _Signals(w)
    show: dict = {}
    try:
        w.open()
        sig.watching = True
        for note in w.notes:
            say(note)
        show = {"json": as_json, "rows": rows, "count": count, "textfile": textfile,
                "exposition": _exposition(w, prometheus, textfile, say)}
        say(f"watching every {interval:g} s" + (f", {count} times" if count else " (Ctrl-C ends)"))
        if not as_json and not noclear and sys.stdout.isatty():
            from rich.live import Live

            with Live(auto_refresh=False, redirect_stderr=False) as live:
                why = _loop(w, show, _Refreshing(live))
        else:
            why = _loop(w, show, None)
    except _Stop:
        w.abort()
        why = w.stop_reason
    finally:
        w.abort()
        if show.get("exposition") is not None:
            show["exposition"].close()
        sig.restore()
    say(f"stopped: {why}; probes detached")
    exit_now(ctx, 0)


def _exposition(w, prometheus, textfile, say):
    """The metrics' exposition when --prometheus or --textfile asked for it."""
    if not (prometheus or textfile):
        return None
    from moetrace.live.exposition import Exposition

    ex = Exposition(w.n_experts, w.n_per_layer)
    ex.update(w.prev, {})
    if prometheus:
        ex.serve(prometheus)
        say(f"metrics on http://{prometheus}/metrics")
    if textfile:
        say(f"metrics written to {ex.write_textfile(textfile)} every interval")
    return ex


class _Refreshing:
    """rich's Live, refreshed at each update (no refresh thread)."""

    def __init__(self, live):
        self.live = live

    def update(self, renderable) -> None:
        self.live.update(renderable, refresh=True)
