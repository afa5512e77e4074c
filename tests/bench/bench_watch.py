"""Benchmark: the cost of `moetrace watch` on a hit-dominated replay (issue 20, acceptance 4).

    sudo .venv/bin/python tests/bench/bench_watch.py [--repeats 5] [--pass-s 0.75] [--soak-s 600]

(root; takes /tmp/moetrace-io.lock itself for the whole run.)

The pool and plan of bench_record (4 layers x 64 experts x 1 MiB, files layout, warmed into the
page cache; every iteration reads every expert once: every read a page-cache hit). A memory
cgroup without a limit holds the replay. --repeats times, interleaved and in alternating order:

  replay in the cgroup   vs   replay in the cgroup while `moetrace watch --pool P --cgroup CG
                              --json 1` watches it (the default probes: pagecache, block, reads
                              with its per-call stream feeding the computed misses)

The time compared is the replay's measured passes (replay.json), so watch's attach is excluded.
Watch's CPU is its process's user + system time (/proc/PID/stat) from the replay's start to its
end, in % of one CPU over that wall time (its attach comes before and is excluded). Targets: time ratio <= 1.03x, watch CPU <= 2 %.

--soak-s: then one watch over a replay that loops for that long, its RSS sampled every 10 s:
memory flat = the last third's RSS within 1 MiB of the second third's (the first is warm-up;
printed with the slope and the RSS minute by minute).
Everything it creates (pool, cgroup, run dirs) is removed at the end, also on error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_record import build_plan, build_pool, io_lock, measured, median_ci, replay_cmd  # noqa: E402

TARGET_RATIO, TARGET_CPU = 1.03, 0.02
TICK = os.sysconf("SC_CLK_TCK")
WATCH = [sys.executable, "-c", "from moetrace.cli import main; main()", "watch"]


def cpu_s(pid: int) -> float:
    """utime + stime of a live process, in seconds (/proc/PID/stat)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def in_cgroup(cmd: list[str], cg: Path) -> list[str]:
    return ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh", *cmd]


class Watch:
    """`moetrace watch --json` on the cgroup, started and attached, stopped by SIGTERM."""

    def __init__(self, pool: Path, cg: Path, out: Path, extra: tuple[str, ...] = ()):
        self.out = open(out, "w")
        self.p = subprocess.Popen([*WATCH, "--pool", str(pool), "--cgroup", str(cg), "--json", *extra, "1"],
                                  stdout=self.out, stderr=subprocess.PIPE, text=True)
        for line in self.p.stderr:
            if "watching every" in line:
                return
        raise RuntimeError(f"watch did not attach (exit {self.p.wait()})")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(60)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
            self.out.close()


def run_replay(cmd: list[str], cg: Path, run_dir: Path, watch: Watch | None) -> tuple[float, float | None]:
    """(measured wall s, watch's share of one CPU over the replay process's life, or None)."""
    c0, t0 = (cpu_s(watch.p.pid) if watch else None), time.monotonic()
    subprocess.run(in_cgroup(cmd + ["--run-dir", str(run_dir)], cg), check=True, stdout=subprocess.DEVNULL)
    c1, t1 = (cpu_s(watch.p.pid) if watch else None), time.monotonic()
    doc = json.loads((run_dir / "replay.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    wall, _med, _b = measured(doc)
    return wall, ((c1 - c0) / (t1 - t0)) if watch else None


def calibrate(plan_dir: Path, pool, geo, cg: Path, pass_s: float, d: Path) -> Path:
    plan = build_plan(plan_dir / "plan.bin", geo, 2)
    wall, _ = run_replay(replay_cmd(plan, Path(pool.root), 4, 1, 1), cg, d / "cal", None)
    n = max(2, int(round(pass_s / (wall / 2))))
    return build_plan(plan_dir / "plan.bin", geo, n)


def pairs(args, plan: Path, pool, cg: Path, d: Path) -> int:
    ratios, cpus = [], []
    cmd = replay_cmd(plan, Path(pool.root), 4, 1, args.passes)
    for i in range(args.repeats):
        order = ("plain", "watch") if i % 2 == 0 else ("watch", "plain")
        got = {}
        for arm in order:
            w = Watch(Path(pool.root), cg, d / f"w{i}.jsonl", tuple(args.watch_arg)) if arm == "watch" else None
            try:
                got[arm] = run_replay(cmd, cg, d / f"r{i}{arm}", w)
            finally:
                if w:
                    w.stop()
        r = got["watch"][0] / got["plain"][0]
        cpu = got["watch"][1]
        ratios.append(r)
        cpus.append(cpu)
        print(f"  pair {i}: plain {got['plain'][0]:.3f} s, watched {got['watch'][0]:.3f} s, ratio {r:.4f}, "
              f"watch CPU {cpu:.2%} of one CPU", flush=True)
    lo, hi = median_ci(ratios)
    clo, chi = median_ci(cpus)
    ok = np.median(ratios) <= TARGET_RATIO and np.median(cpus) <= TARGET_CPU
    print(f"time ratio median {np.median(ratios):.4f} [95 % {lo:.4f}, {hi:.4f}] (target <= {TARGET_RATIO}); "
          f"watch CPU median {np.median(cpus):.2%} [{clo:.2%}, {chi:.2%}] (target <= {TARGET_CPU:.0%}): "
          f"{'met' if ok else 'NOT met'}")
    return 0 if ok else 1


def soak(args, plan: Path, pool, cg: Path, d: Path) -> int:
    """One watch over a replay looping --soak-s seconds; RSS every 10 s."""
    w = Watch(Path(pool.root), cg, d / "soak.jsonl", tuple(args.watch_arg))
    rep = None
    try:
        passes = 10 ** 6
        rep = subprocess.Popen(in_cgroup(replay_cmd(plan, Path(pool.root), 4, 0, passes) +
                                         ["--run-dir", str(d / "soak-run")], cg), stdout=subprocess.DEVNULL)
        t0, samples = time.monotonic(), []
        while time.monotonic() - t0 < args.soak_s:
            samples.append((time.monotonic() - t0, rss_bytes(w.p.pid)))
            time.sleep(10)
    finally:
        if rep is not None:
            rep.send_signal(signal.SIGINT)
            try:
                rep.wait(60)
            except subprocess.TimeoutExpired:
                rep.kill()
                rep.wait()
        w.stop()
    t = np.array([s[0] for s in samples])
    rss = np.array([s[1] for s in samples], float)
    print("  RSS MiB by minute: " + " ".join(f"{r / 2**20:.1f}" for tt, r in samples if int(tt) % 60 < 10))
    third = max(1, len(rss) // 3)
    first, last = rss[third:2 * third].mean(), rss[-third:].mean()  # after the first third's warm-up
    late = t >= t[third] if len(t) > 3 else np.ones(len(t), bool)
    slope = np.polyfit(t[late], rss[late], 1)[0] if late.sum() > 1 else 0.0
    lines = sum(1 for _ in open(d / "soak.jsonl"))
    ok = last - first <= 1 << 20
    print(f"soak {args.soak_s:.0f} s, {lines} intervals: watch RSS second third {first / 2**20:.1f} MiB, last third "
          f"{last / 2**20:.1f} MiB, slope after the first third {slope * 3600 / 2**20:.2f} MiB/h: "
          f"{'flat' if ok else 'GROWS'}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pass-s", type=float, default=0.75)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--soak-s", type=float, default=0, help="also the 10-minute memory soak (600)")
    ap.add_argument("--watch-arg", action="append", default=[], help="an extra argument of watch (e.g. --no-misses)")
    args = ap.parse_args()
    from moetrace.capacity.scope import Scope, find_memory_controller, remove_stale_scopes

    ctrl = find_memory_controller()
    d = Path(tempfile.mkdtemp(prefix="moetrace-bench-watch-", dir="/var/tmp"))
    scope = None
    with io_lock():
        try:
            remove_stale_scopes("benchwatch", ctrl)
            scope = Scope("benchwatch", ctrl).create(None)
            pool, geo = build_pool(d, 4, 64, 1 << 20)
            for p in pool.data_paths():
                Path(p).read_bytes()
            plan = calibrate(d, pool, geo, scope.path, args.pass_s, d)
            rc = pairs(args, plan, pool, scope.path, d)
            if args.soak_s > 0:
                rc |= soak(args, plan, pool, scope.path, d)
            return rc
        finally:
            if scope is not None:
                scope.remove(kill=True)
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
