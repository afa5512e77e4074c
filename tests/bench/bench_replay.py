"""Benchmark: the replay harness against fio on the same files, block size and threads.

    flock /tmp/moetrace-io.lock .venv/bin/python tests/bench/bench_replay.py [--gib 1] [--repeats 3]

(the script also takes /tmp/moetrace-io.lock itself around the measurements).

Creates a files-layout pool (default 1 GiB: 16 layers x 64 experts x 1 MiB
under /var/tmp/moetrace-bench-replay-*) and a plan whose single iteration reads
every expert once, layer by layer, so that one pass of the replay and one loop
of fio read exactly the same bytes: the same files, each once, in 1 MiB calls
(the replay reads an expert in one preadv; fio bs=1M), with 8 threads / 8 fio
jobs (psync; job j reads experts e with e % 8 == j, in layer order). Then,
interleaved, --repeats times each:

(a) hit-dominated: the pool is in the page cache (warmed first); replay
    --mode pagecache --warmup 1 --passes N vs fio direct=0 invalidate=0 loops=N;
(b) miss-dominated: replay --mode direct --warmup 0 --passes M vs fio direct=1
    loops=M (every byte from the device, every pass).

GB/s: replay = measured bytes / the measured passes' wall time (replay.json);
fio = read io_bytes / read runtime (group_reporting). Prints each run, the
medians and replay/fio; the target is >= 0.95x.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

LOCK = "/tmp/moetrace-io.lock"


@contextlib.contextmanager
def io_lock():
    with open(LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build(d: Path, gib: float, eb: int, n_experts: int):
    from moetrace.inputs.geometry import Geometry
    from moetrace.inputs.plan import write_plan
    from moetrace.inputs.pool import create_pool
    from moetrace.inputs.trace import Accesses

    n_layers = max(1, int(gib * (1 << 30)) // (eb * n_experts))
    geo = Geometry(n_layers, n_experts, n_experts, eb, "bench")
    pool = create_pool(d / "pool", geo, layout="files", seed=11)
    for p in pool.data_paths():  # written pages must be clean for the direct runs
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    L, E = n_layers, n_experts
    acc = Accesses(np.zeros(L * E, np.int32), np.zeros(L * E, np.int8),
                   np.repeat(np.arange(L, dtype=np.int16), E), np.tile(np.arange(E, dtype=np.int32), L), L, E, 1)
    write_plan(d / "plan.bin", acc, geo)
    return pool, d / "plan.bin"


def fio_jobfile(d: Path, pool, threads: int, eb: int, direct: bool, loops: int) -> Path:
    """Job j reads experts e with e % threads == j, in layer order, each file once per loop.

    fio refuses option values over 4096 characters: longer per-job file lists go
    through opendir= over a directory of hard links to the same inodes (shared
    page cache; readdir order instead of layer order)."""
    files = pool.files  # expert order: layer-major
    lines = ["[global]", "ioengine=psync", "rw=read", f"bs={eb}", f"direct={int(direct)}", "invalidate=0",
             "group_reporting=1", "thread=1", f"loops={loops}", ""]
    for j in range(threads):
        mine = [files[e] for e in range(len(files)) if e % threads == j]
        value = ":".join(mine)
        if len(value) < 4000:
            lines += [f"[r{j}]", f"directory={pool.root}", "filename=" + value, ""]
            continue
        links = d / "fio-links" / f"j{j}"
        if not links.exists():
            links.mkdir(parents=True)
            for i, rel in enumerate(mine):
                os.link(pool.root / rel, links / f"{i:06d}")
        lines += [f"[r{j}]", f"opendir={links}", ""]
    path = d / f"fio-{'direct' if direct else 'warm'}.fio"
    path.write_text("\n".join(lines))
    return path


def run_fio(job: Path) -> tuple[float, int]:
    out = subprocess.run(["fio", "--output-format=json", str(job)], capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout[out.stdout.index("{"):])
    rd = doc["jobs"][0]["read"]
    return rd["io_bytes"] / (rd["runtime"] / 1000) / 1e9, int(rd["io_bytes"])


def run_replay(plan: Path, pool, mode: str, threads: int, warmup: int, passes: int) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "moetrace.cli.replay", str(plan), "--pool", str(pool.root), "--mode", mode,
           "--threads", str(threads), "--warmup", str(warmup), "--passes", str(passes), "--json"]
    env = dict(os.environ)
    env.pop("MOETRACE_RUN_DIR", None)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    s = json.loads(out.stdout)
    m = s["phases"]["measured"]
    return m["bytes"] / sum(m["wall_ns"]), int(m["bytes"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="pool size in GiB")
    ap.add_argument("--expert-bytes", type=int, default=1 << 20, help="bytes per expert = fio bs")
    ap.add_argument("--experts", type=int, default=64, help="experts per layer")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warm-passes", type=int, default=8, help="measured passes (fio loops) in the warm case")
    ap.add_argument("--direct-passes", type=int, default=1, help="measured passes (fio loops) with O_DIRECT")
    ap.add_argument("--keep", metavar="DIR", help="build the pool in DIR and keep it")
    a = ap.parse_args(argv)
    if shutil.which("fio") is None:
        print("fio is not installed (apt-get install fio)", file=sys.stderr)
        return 2
    d = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="moetrace-bench-replay-", dir="/var/tmp"))
    d.mkdir(parents=True, exist_ok=True)
    eb, T = a.expert_bytes, a.threads
    try:
        pool, plan = build(d, a.gib, eb, a.experts)
        total = pool.data_bytes
        print(f"pool {pool.root}: {pool.geometry.n_layers} layers x {pool.geometry.n_experts} experts x "
              f"{eb} B = {total / 2**30:.2f} GiB, files layout; {T} threads, block {eb} B, psync")
        warm_job = fio_jobfile(d, pool, T, eb, False, a.warm_passes)
        direct_job = fio_jobfile(d, pool, T, eb, True, a.direct_passes)
        res = {k: [] for k in ("warm_replay", "warm_fio", "direct_replay", "direct_fio")}
        with io_lock():
            for r in range(a.repeats):
                first_replay = r % 2 == 0
                for case in ("warm", "direct"):
                    order = ["replay", "fio"] if first_replay else ["fio", "replay"]
                    for who in order:
                        if who == "replay":
                            if case == "warm":
                                g, n = run_replay(plan, pool, "pagecache", T, 1, a.warm_passes)
                                want = a.warm_passes * total
                            else:
                                g, n = run_replay(plan, pool, "direct", T, 0, a.direct_passes)
                                want = a.direct_passes * total
                        else:
                            if case == "warm":  # make sure the pool is cached (fio alone may run first)
                                run_replay(plan, pool, "pagecache", T, 1, 1)
                            g, n = run_fio(warm_job if case == "warm" else direct_job)
                            want = (a.warm_passes if case == "warm" else a.direct_passes) * total
                        assert n == want, f"{who} {case} read {n} bytes, expected {want}"
                        res[f"{case}_{who}"].append(g)
                        print(f"  repeat {r} {case:<6} {who:<6} {g:6.2f} GB/s ({n / 2**30:.1f} GiB)", flush=True)
        print()
        for case, label in (("warm", "(a) hit-dominated, page cache"), ("direct", "(b) miss-dominated, O_DIRECT")):
            rr, ff = statistics.median(res[f"{case}_replay"]), statistics.median(res[f"{case}_fio"])
            print(f"{label:<32} replay {rr:6.2f} GB/s   fio {ff:6.2f} GB/s   replay/fio {rr / ff:.3f}x "
                  f"({'ok' if rr / ff >= 0.95 else 'BELOW 0.95x'})")
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
