"""Benchmark: `moetrace record` start-up, back to back and after a pause (issue 33, acceptance 6).

    sudo .venv/bin/python tests/bench/bench_startup.py [--runs 5] [--probes LIST] [--mode both]

(root: the probes need it.)

Start-up is the wall time from launching `moetrace record --out RUN -- sh -c 'date +%s.%N > F'`
to the command's own clock reading in F (the command has exec'd: launch -> command exec).

(a) back to back: --runs recordings, each launched the moment the previous `record` returned,
    as a sweep's cells are. Each recording leaves a releaser process that finishes the kernel's
    part of its detach (RCU grace periods under the kernel's event_mutex, seconds for the
    default set) while the next one starts.
(b) after a pause: --runs recordings, each launched only once the previous one's releaser has
    exited (the manifest's detach.releaser_pid) and --pause seconds more.

Prints every run, the median and range per mode and a VERDICT line against the target:
median < 1 s in both modes. Run directories are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 1.0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MOETRACE_RUN_DIR", None)
    return env


def one(d: Path, i: int, probes: str | None) -> tuple[float, dict]:
    """(launch -> command exec in s, the run's manifest) of one `record -- sh -c 'date > F'`."""
    stamp = d / f"exec-{i}"
    cmd = [sys.executable, "-m", "moetrace.cli.record", "--out", str(d / f"run-{i}")]
    if probes:
        cmd += ["--probes", probes]
    cmd += ["--", "sh", "-c", f"date +%s.%N > {stamp}"]
    t0 = time.time()
    out = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"record exited {out.returncode}: {out.stderr.strip()[-2000:]}")
    startup = float(stamp.read_text().strip()) - t0
    man = json.loads((d / f"run-{i}" / "manifest.json").read_text())
    shutil.rmtree(d / f"run-{i}", ignore_errors=True)
    return startup, man


def wait_released(man: dict) -> None:
    """Until the run's releaser has exited (every program, map and perf event gone)."""
    from moetrace.kernel.bpf import wait_pid_exit

    rel = (man.get("detach") or {}).get("releaser_pid")
    if rel and not wait_pid_exit(rel, timeout=120):
        raise RuntimeError(f"releaser {rel} still running after 120 s")


def series(d: Path, runs: int, probes: str | None, pause: float | None, label: str) -> list[float]:
    out = []
    for i in range(runs):
        st, man = one(d, i, probes)
        tm = man["timings"]
        load = {k[: -len("_load_s")]: v for k, v in tm.items() if k.endswith("_load_s")}
        print(f"  {label} {i}: launch -> exec {st:.3f} s (probes loaded + attached in {tm['probes_attach_s']:.2f} s; "
              f"slowest load {max(load.values(), default=0):.2f} s)", flush=True)
        out.append(st)
        if pause is not None:
            wait_released(man)
            time.sleep(pause)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--probes", default=None, help="--probes for record (default: record's default set)")
    ap.add_argument("--pause", type=float, default=2.0, help="seconds after a releaser exits, in mode (b)")
    ap.add_argument("--mode", choices=("both", "back-to-back", "pause"), default="both")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_startup: needs root (the probes); run with sudo", file=sys.stderr)
        return 2
    d = Path(tempfile.mkdtemp(prefix="moetrace-bench-startup-", dir="/var/tmp"))
    results: dict[str, list[float]] = {}
    try:
        if a.mode in ("both", "pause"):
            results["after a pause"] = series(d, a.runs, a.probes, a.pause, "pause")
        if a.mode in ("both", "back-to-back"):
            results["back to back"] = series(d, a.runs, a.probes, None, "back-to-back")
            # the last run's releaser outlives the bench by seconds: nothing to clean up
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print()
    ok = True
    for label, xs in results.items():
        m = statistics.median(xs)
        ok &= m < TARGET_S
        print(f"{label:<14} ({len(xs)} runs): median {m:.3f} s, range {min(xs):.3f}-{max(xs):.3f} s; "
              f"per run {', '.join(f'{x:.2f}' for x in xs)}")
    print(f"VERDICT: {'PASS' if ok else 'FAIL'} (target: record's launch -> command exec median < {TARGET_S:.0f} s "
          f"in {' and '.join(results)})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
