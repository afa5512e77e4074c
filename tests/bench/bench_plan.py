"""Benchmark: plan.bin compile, stream, inspect and load for ~10 million reads.

    .venv/bin/python tests/bench/bench_plan.py [--reads 10000000] [--keep DIR]

Times are the best of two runs (one for inspect and read_accesses). Builds ~10 million reads of the kimi-k3 geometry (92 layers x 896 experts,
k=16) with numpy directly into an Accesses object: per iteration and layer 16
distinct uniform-random experts, and every 20th iteration a fallback pass
(failed speculation) re-routing every layer. Then times, in this process:

* baseline: writing / reading the raw uint16 expert array with numpy
  (tofile / fromfile), the I/O floor for the same ids;
* write_plan without hints and with oracle hints (accesses/s, MB/s of file);
* iter_passes streaming every block with CRC checks;
* inspect_plan (streaming + hint recall);
* read_accesses (loads everything).

Peak RSS (getrusage ru_maxrss) is measured in fresh subprocesses: one that only
imports, one that streams the whole hinted plan, one that loads it with
read_accesses. Streaming must stay near the import baseline, however large the
plan; loading grows with it.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

L, E, K = 92, 896, 16


def build_accesses(n_target: int, seed: int = 3):
    """~n_target reads: per (iteration, pass, layer) 16 distinct experts, every 20th iteration 2 passes."""
    from moetrace.inputs.trace import Accesses

    per_pass = L * K
    n_pass = -(-n_target // per_pass)
    # pass list: iteration i has pass 0, and pass 1 when i % 20 == 19
    its, pss = [], []
    i = 0
    while len(its) < n_pass:
        its.append(i)
        pss.append(0)
        if i % 20 == 19 and len(its) < n_pass:
            its.append(i)
            pss.append(1)
        i += 1
    its = np.asarray(its, np.int32)
    pss = np.asarray(pss, np.int8)
    rng = np.random.default_rng(seed)
    rows = n_pass * L
    ex = np.empty((rows, K), np.int32)
    chunk = 8192
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        u = rng.random((r1 - r0, E), dtype=np.float32)
        ex[r0:r1] = np.argpartition(u, K, axis=1)[:, :K]
    ex.sort(axis=1)
    n = rows * K
    return Accesses(np.repeat(its, per_pass), np.repeat(pss, per_pass),
                    np.tile(np.repeat(np.arange(L, dtype=np.int16), K), n_pass), ex.reshape(-1), L, E,
                    int(its[-1]) + 1), n


def timed(fn, repeat: int = 1):
    """(result, best wall time of `repeat` runs)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        r = fn()
        best = min(best, time.perf_counter() - t)
    return r, best


RSS_CHILD = r"""
import resource, sys
from moetrace.inputs import plan as P
mode, path = sys.argv[1], sys.argv[2]
if mode == "load":
    import moetrace.inputs.trace  # read_accesses builds a moetrace.inputs.trace.Accesses (imports pandas)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n = 0
if mode == "stream":
    for ps in P.iter_passes(path):
        n += ps.n_reads
elif mode == "load":
    n = len(P.read_accesses(path))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(base, peak, n)
"""


# Linux keeps ru_maxrss across fork and execve, so a child forked from this (by
# then large) process would report our peak. Children are therefore started by a
# small launcher process that is itself started before anything big is built.
LAUNCHER = r"""
import subprocess, sys
child = sys.argv[1]
for line in sys.stdin:
    mode, path = line.split()
    r = subprocess.run([sys.executable, "-c", child, mode, path], capture_output=True, text=True)
    sys.stdout.write(r.stdout.strip() if r.returncode == 0 else "error " + r.stderr.replace("\n", " | "))
    sys.stdout.write("\n")
    sys.stdout.flush()
"""


class RssProbe:
    """Runs RSS_CHILD in fresh processes spawned by a small launcher."""

    def __init__(self) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", LAUNCHER, RSS_CHILD], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)

    def __call__(self, mode: str, path: str) -> tuple[int, int, int]:
        self.p.stdin.write(f"{mode} {path}\n")
        self.p.stdin.flush()
        out = self.p.stdout.readline().split()
        if not out or out[0] == "error":
            raise RuntimeError(" ".join(out))
        return int(out[0]), int(out[1]), int(out[2])

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reads", type=int, default=10_000_000)
    ap.add_argument("--keep", help="write the plans into this folder and keep them")
    args = ap.parse_args()
    child_rss = RssProbe()

    from moetrace.inputs import plan as P
    from moetrace.inputs.geometry import PRESETS

    geo = PRESETS["kimi-k3"]
    (acc, n), t_build = timed(lambda: build_accesses(args.reads))
    print(f"built {n:,} reads, {acc.n_iterations:,} iterations ({L}x{E}, k={K}) in {t_build:.2f} s")

    d = args.keep or tempfile.mkdtemp(prefix="bench_plan_")
    os.makedirs(d, exist_ok=True)
    plain, hinted, raw = (os.path.join(d, x) for x in ("plan.bin", "plan_hints.bin", "raw.u16"))
    try:
        ids = acc.expert.astype("<u2")
        _, t_raw_w = timed(lambda: (ids.tofile(raw), os.sync()), repeat=2)
        _, t_raw_r = timed(lambda: np.fromfile(raw, "<u2"), repeat=2)
        mb_raw = os.path.getsize(raw) / 1e6
        print(f"baseline raw uint16 ids: write {t_raw_w:.3f} s ({mb_raw / t_raw_w:,.0f} MB/s), "
              f"read {t_raw_r:.3f} s ({mb_raw / t_raw_r:,.0f} MB/s)")

        def row(label, t, nbytes, base=None):
            extra = f"  ({t / base:.1f}x the raw baseline)" if base else ""
            print(f"{label:<28} {t:7.3f} s  {n / t / 1e6:7.2f} M accesses/s  {nbytes / t / 1e6:8.1f} MB/s{extra}")

        _, t = timed(lambda: P.write_plan(plain, acc, geo), repeat=2)
        row("compile (no hints)", t, os.path.getsize(plain), t_raw_w)
        _, t = timed(lambda: P.write_plan(hinted, acc, geo, hints=acc, hint_source="oracle"), repeat=2)
        row("compile (oracle hints)", t, os.path.getsize(hinted), t_raw_w)
        del ids

        def stream(path):
            m = 0
            for ps in P.iter_passes(path):
                m += ps.n_reads
            assert m == n
        for path, label in ((plain, "stream (no hints)"), (hinted, "stream (oracle hints)")):
            _, t = timed(lambda: stream(path), repeat=2)
            row(label, t, os.path.getsize(path), t_raw_r)
        s, t = timed(lambda: P.inspect_plan(hinted))
        assert s["hint_recall"] == 1.0, s["hint_recall"]
        row("inspect (hints, recall)", t, os.path.getsize(hinted), t_raw_r)
        back, t = timed(lambda: P.read_accesses(plain))
        assert np.array_equal(back.expert, acc.expert) and np.array_equal(back.iteration, acc.iteration)
        row("read_accesses (load all)", t, os.path.getsize(plain), t_raw_r)
        in_mem = sum(getattr(back, f).nbytes for f in ("iteration", "pass_", "layer", "expert"))
        del back, acc

        print(f"files: plan.bin {os.path.getsize(plain) / 1e6:.1f} MB, with hints "
              f"{os.path.getsize(hinted) / 1e6:.1f} MB; Accesses in memory {in_mem / 1e6:.1f} MB")
        unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        b0, _, _ = child_rss("none", hinted)
        b1, p1, m1 = child_rss("stream", hinted)
        b2, p2, m2 = child_rss("load", hinted)
        assert m1 == n and m2 == n
        mib = lambda x: x * unit / 2**20  # noqa: E731
        print(f"peak RSS: import only {mib(b0):.1f} MiB; streaming the hinted plan {mib(p1):.1f} MiB "
              f"(+{mib(p1 - b1):.1f} MiB over its import baseline, file {os.path.getsize(hinted) / 2**20:.1f} MiB); "
              f"read_accesses {mib(p2):.1f} MiB (+{mib(p2 - b2):.1f} MiB over import of moetrace.inputs.trace)")
        print(f"this process: peak RSS {mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss):.1f} MiB")
    finally:
        child_rss.close()
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
