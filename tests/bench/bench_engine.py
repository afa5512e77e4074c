"""Benchmark: the cost of `moetrace record` on a real engine (issue 35, acceptance 7).

    sudo .venv/bin/python tests/bench/bench_engine.py [--repeats 5] [--tokens 64] [--cold]

(root: the probes need it; the script takes /tmp/moetrace-io.lock itself for the whole run.)

Writes the tiny MoE (`model synth`, 388 MiB, under /var/tmp/moetrace-bench-engine-*), warms it
into the page cache, then --repeats times, interleaved in alternating order:

  (u) the unrecorded engine: `moetrace model route MODEL -n TOKENS` (llama.cpp through the
      routing logger);
  (r) the same under `moetrace record --pool MODEL --probes pagecache,block --bpf-stats` (--probes
      names others).

Figures per pair: the decode time per token the logger times around each llama_decode (its
eval_ms / n_eval: the engine's own measure; under record the driver also steps the engine
between tokens for the per-token epochs, outside that timing), their ratio r/u; the
start-up record adds (launching record to the engine's start: the manifest's command_start_ns);
the probes' CPU in the kernel (bpf_runtime total_run_time_ns over the command's wall time: a
fraction of one CPU) and the recorder's own user + system CPU; the maps' kernel memory
(manifest kernel_maps) and the recorder's peak RSS (timings recorder_maxrss_bytes). Medians with a 95 % bootstrap interval over
the pairs. --cold: the cache emptied before every token (each token reads its experts: the
page-cache probes fire ~12 k times a token) instead of a warm cache (they hardly fire).
Everything it made is removed at the end (also on error).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_record import io_lock, median_ci  # noqa: E402  (the bench scripts' shared helpers)

PY = [sys.executable, "-m", "moetrace.cli"]


def route(model: Path, out: Path, tokens: int, cold: bool) -> list[str]:
    return [*PY, "model", "route", str(model), "-o", str(out), "-n", str(tokens), "--json",
            *(["--cold", "--advise", "random"] if cold else [])]


def unrecorded(model: Path, d: Path, tokens: int, cold: bool) -> dict:
    r = subprocess.run(route(model, d / "u.jsonl", tokens, cold), capture_output=True, text=True, check=True)
    s = json.loads(r.stdout)
    return {"ms_per_token": s["eval_ms"] / s["n_eval"]}


PROBES = "pagecache,block"


def recorded(model: Path, d: Path, tokens: int, cold: bool) -> dict:
    run = d / "run"
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.monotonic_ns()
    r = subprocess.run([*PY, "record", "--out", str(run), "--pool", str(model), "--probes", PROBES,
                        "--bpf-stats", "--", *route(model, d / "r.jsonl", tokens, cold)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    s = json.loads(r.stdout[r.stdout.index("{"):r.stdout.rindex("}") + 1])
    m = json.loads((run / "manifest.json").read_text())
    tm, rt = m["timings"], m["bpf_runtime"]
    return {"ms_per_token": s["eval_ms"] / s["n_eval"], "startup_s": (tm["command_start_ns"] - t0) / 1e9,
            "probe_cpu": rt["cpu_fraction_of_wall"], "recorder_cpu_s": tm["recorder_user_s"] + tm["recorder_system_s"],
            "kernel_maps_bytes": sum(v["bytes"] for v in m["kernel_maps"].values()),
            "recorder_maxrss_bytes": tm["recorder_maxrss_bytes"]}


def _line(name: str, xs: list[float], unit: str = "", scale: float = 1.0) -> str:
    import statistics

    lo, hi = median_ci(xs)
    return f"  {name}: median {statistics.median(xs) * scale:.3f}{unit} (95 % CI {lo * scale:.3f}-{hi * scale:.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--probes", default=PROBES, help="record --probes (default: %(default)s)")
    a = ap.parse_args(argv)
    globals()["PROBES"] = a.probes
    from moetrace.inputs.modelsynth import ModelSpec, synth_model

    d = Path(tempfile.mkdtemp(prefix="moetrace-bench-engine-", dir="/var/tmp"))
    try:
        model = d / "tiny.gguf"
        synth_model(model, ModelSpec())
        with io_lock():
            unrecorded(model, d, 4, False)  # the model read into the page cache once
            pairs = []
            for i in range(a.repeats):
                order = ("u", "r") if i % 2 == 0 else ("r", "u")
                got = {k: (unrecorded if k == "u" else recorded)(model, d, a.tokens, a.cold) for k in order}
                pairs.append(got)
                print(f"  pair {i} ({'-'.join(order)}): unrecorded {got['u']['ms_per_token']:.3f} ms/token, recorded "
                      f"{got['r']['ms_per_token']:.3f} ms/token, start-up {got['r']['startup_s']:.2f} s, probes "
                      f"{100 * got['r']['probe_cpu']:.2f} % of a CPU", flush=True)
        ratio = [p["r"]["ms_per_token"] / p["u"]["ms_per_token"] for p in pairs]
        print(f"{'cold' if a.cold else 'warm'} cache, {a.tokens} tokens, {a.repeats} interleaved pairs:")
        print(_line("decode time per token, recorded / unrecorded", ratio, "x"))
        print(_line("unrecorded decode per token", [p["u"]["ms_per_token"] for p in pairs], " ms"))
        print(_line("start-up record adds (launch to the engine's start)", [p["r"]["startup_s"] for p in pairs], " s"))
        print(_line("probes' CPU in the kernel (share of one CPU)", [p["r"]["probe_cpu"] for p in pairs], " %", 100))
        print(_line("recorder's own CPU", [p["r"]["recorder_cpu_s"] for p in pairs], " s"))
        print(f"  kernel maps {pairs[0]['r']['kernel_maps_bytes'] / 2**20:.1f} MiB; the recorder's peak RSS "
              f"{max(p['r']['recorder_maxrss_bytes'] for p in pairs) / 2**20:.0f} MiB")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
