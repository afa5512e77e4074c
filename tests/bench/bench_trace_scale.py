"""Benchmark: production-sized traces in bounded memory (import, parse, stats, compile, sim).

    .venv/bin/python tests/bench/bench_trace_scale.py [--reads 100e6] [--baseline-reads 8e6]
        [--requests 25] [--workdir /var/tmp/moetrace-bench-scale] [--keep]

A synthetic kimi-k3 trace (92 layers x 896 experts, k=16: 1,472 reads per
token) of ``--reads`` reads is generated once (``moetrace trace synth``) and
re-batched into ``--requests`` concurrent requests (token t is request t mod R,
forward pass t div R: one record per (request, layer) per step, as a serving
engine runs them). Each command then runs as its own process and is measured
from outside (wall time; peak RSS from wait4's rusage):

    trace import T -o imported.jsonl        trace parse T -o typed.parquet
    trace stats T --json                    plan compile T -o plan.bin --geometry kimi-k3
    sim plan.bin --policy lru --budgets 1,2,4,...,896   (the LRU curve: every budget from one pass)
    sim plan.bin --policy lru,lfu,static,belady --budgets 8,16,32,64

Baseline in the same run: the same commands on a ``--baseline-reads`` prefix
(i) as shipped (streamed) and (ii) forced onto the in-memory path
(MOETRACE_STREAM_BYTES=huge; sim gets the JSONL trace, which the in-memory path
loads whole), so the memory ratio is measured, not asserted. Results: time per
read (ns), peak RSS, and both extrapolated linearly to 1.6 G reads (a million
tokens of the production model); the goal is < 4 GB peak and < 3 min for the
LRU curve of every budget at 1.6 G reads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

READS_PER_TOKEN = 92 * 16
TARGET = 1.6e9


def moetrace() -> str:
    return str(Path(sys.executable).with_name("moetrace"))


def run(args: list[str], env: dict | None = None, out: Path | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one command, measured from outside."""
    t0 = time.perf_counter()
    with open(out or os.devnull, "wb") as fh:
        p = subprocess.Popen(args, stdout=fh, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
        _, status, ru = os.wait4(p.pid, 0)
        err = p.stderr.read().decode(errors="replace")
        p.stderr.close()
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"{' '.join(args)} failed ({rc}):\n{err[-2000:]}")
    return wall, ru.ru_maxrss * 1024


def batch(src: Path, dst: Path, requests: int, max_tokens: int) -> int:
    """Re-batch a one-request synthetic trace into `requests` concurrent requests. Returns tokens."""
    with open(src) as fi, open(dst, "w") as fo:
        tok = -1
        prev = None
        for line in fi:
            d = json.loads(line)
            if d["step"] != prev:
                prev = d["step"]
                tok += 1
                if tok >= max_tokens:
                    break
            d["step"] = tok // requests
            d["request"] = f"r{tok % requests}"
            fo.write(json.dumps(d) + "\n")
    # records of a step must be grouped: rows above are step-major already (tokens of a step are consecutive)
    return min(tok + 1, max_tokens)


def ensure_trace(work: Path, reads: float, requests: int, seed: int = 0) -> tuple[Path, int]:
    tokens = int(-(-reads // READS_PER_TOKEN))
    tokens -= tokens % requests
    out = work / f"kimi-{tokens}t-{requests}r-s{seed}.jsonl"
    if out.exists():
        return out, tokens
    raw = work / f"kimi-{tokens}t-s{seed}.raw.jsonl"
    if not raw.exists():
        print(f"generating {tokens:,} tokens ({tokens * READS_PER_TOKEN / 1e6:.0f} M reads) ...", flush=True)
        t0 = time.perf_counter()
        subprocess.check_call([moetrace(), "trace", "synth", "--preset", "kimi-k3", "--steps", str(tokens),
                               "--seed", str(seed), "-o", str(raw)], stdout=subprocess.DEVNULL)
        print(f"  synth {time.perf_counter() - t0:.0f} s", flush=True)
    tmp = out.with_suffix(".tmp")
    batch(raw, tmp, requests, tokens)
    tmp.rename(out)
    raw.unlink()
    return out, tokens


def prefix(src: Path, dst: Path, tokens: int, requests: int) -> None:
    steps = tokens // requests
    with open(src) as fi, open(dst, "w") as fo:
        for line in fi:
            if json.loads(line)["step"] >= steps:
                break
            fo.write(line)


COMMANDS = [
    ("import", lambda t, w: ["trace", "import", str(t), "-o", str(w / "imported.jsonl")]),
    ("parse", lambda t, w: ["trace", "parse", str(t), "-o", str(w / "typed.parquet")]),
    ("stats", lambda t, w: ["trace", "stats", str(t), "--json"]),
    ("compile", lambda t, w: ["plan", "compile", str(t), "-o", str(w / "plan.bin"), "--geometry", "kimi-k3"]),
    ("lru-curve", lambda t, w: ["sim", str(w / "plan.bin"), "--policy", "lru",
                                "--budgets", ",".join(str(2 ** i) for i in range(10) if 2 ** i <= 896) + ",896"]),
    ("sim-all", lambda t, w: ["sim", str(w / "plan.bin"), "--policy", "lru,lfu,static,belady",
                              "--budgets", "8,16,32,64"]),
]


SIM = ("lru-curve", "sim-all")


def plan_reads(work: Path) -> int:
    """Accesses in the compiled plan: per forward pass and layer the batch union, fewer than the trace's reads."""
    from moetrace.inputs.plan import read_header

    return read_header(work / "plan.bin").n_reads


def measure(trace: Path, work: Path, reads: int, label: str, env: dict | None = None,
            in_memory_sim: bool = False) -> dict:
    """{command: (wall s, peak RSS bytes, reads it went through)}; sim goes through the plan's accesses."""
    res = {}
    for name, argv in COMMANDS:
        a = argv(trace, work)
        if in_memory_sim and name in SIM:
            a = [str(trace) if x == str(work / "plan.bin") else x for x in a] + ["--geometry", "kimi-k3"]
        wall, rss = run([moetrace(), *a], env)
        n = plan_reads(work) if name in SIM else reads
        res[name] = (wall, rss, n)
        unit = "ns/access" if name in SIM else "ns/read"
        print(f"  {label:<22} {name:<10} {wall:8.1f} s  {wall / n * 1e9:7.1f} {unit:<9}  "
              f"peak {rss / 2**20:8.0f} MiB", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=float, default=100e6)
    ap.add_argument("--baseline-reads", type=float, default=8e6)
    ap.add_argument("--requests", type=int, default=25)
    ap.add_argument("--workdir", default="/var/tmp/moetrace-bench-scale")
    ap.add_argument("--keep", action="store_true", help="keep the generated traces for the next run")
    a = ap.parse_args(argv)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        big, tokens = ensure_trace(work, a.reads, a.requests)
        reads = tokens * READS_PER_TOKEN
        small = work / "baseline.jsonl"
        btok = int(-(-a.baseline_reads // READS_PER_TOKEN))
        btok -= btok % a.requests
        prefix(big, small, btok, a.requests)
        breads = btok * READS_PER_TOKEN
        print(f"trace: {tokens:,} tokens x 92 layers x k=16 = {reads / 1e6:.1f} M reads, {a.requests} concurrent "
              f"requests, {big.stat().st_size / 2**20:.0f} MiB of JSON Lines; baseline prefix {breads / 1e6:.1f} M")
        sub = work / "out"
        sub.mkdir(exist_ok=True)
        print(f"baseline ({breads / 1e6:.1f} M reads), in memory vs streamed, interleaved:")
        mem = measure(small, sub, breads, "in memory", {"MOETRACE_STREAM_BYTES": str(1 << 50)},
                      in_memory_sim=True)
        st = measure(small, sub, breads, "streamed", {"MOETRACE_STREAM_BYTES": "0"})
        print(f"full ({reads / 1e6:.1f} M reads), streamed:")
        full = measure(big, sub, reads, "streamed", {"MOETRACE_STREAM_BYTES": "0"})
        print(f"\n{'command':<10} {'peak in-mem/streamed':>21} {'marginal ns':>12} {'peak streamed':>22} "
              f"{'at 1.6 G':>10}")
        worst = 0.0
        est = {}
        for name, _ in COMMANDS:
            w, r, n = full[name]
            ratio = mem[name][1] / st[name][1]
            # marginal cost per read (sim: per plan access) between the prefix and the full trace:
            # start-up cancels out; extrapolated to 1.6 G of them
            marg = max(w - st[name][0], 0.0) / max(n - st[name][2], 1)
            est[name] = w + (TARGET - n) * marg
            worst = max(worst, r)
            print(f"{name:<10} {ratio:>20.1f}x {marg * 1e9:>11.1f} "
                  f"{st[name][1] / 2**20:>9.0f} -> {r / 2**20:>6.0f} MiB {est[name] / 60:>7.1f} min")
        lru = est["lru-curve"]
        print(f"\n(sim: per plan access; the plan of {a.requests} concurrent requests reads the batch union, "
              f"{full['lru-curve'][2] / reads:.2f} accesses per trace read; 1.6 G plan accesses = a million "
              "tokens of one request)")
        print(f"goal at 1.6 G: LRU curve of every budget {lru / 60:.1f} min (< 3 min: "
              f"{'met' if lru < 180 else 'MISSED'}); peak {worst / 2**30:.2f} GiB at {reads / 1e6:.0f} M reads, "
              f"{max(x[1] for x in st.values()) / 2**30:.2f} GiB at {breads / 1e6:.0f} M (flat in the length; "
              f"< 4 GB: {'met' if worst < 4e9 else 'MISSED'})")
    finally:
        if not a.keep:
            for f in work.glob("*"):
                if f.is_dir():
                    shutil.rmtree(f, ignore_errors=True)
                else:
                    f.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
