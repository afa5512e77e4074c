"""Benchmark: the cost of `moetrace record` on a hit-dominated replay (issue 4, acceptance 6).

    sudo .venv/bin/python tests/bench/bench_record.py [--repeats 5] [--pass-s 0.75]

(root: the probes need it; the script takes /tmp/moetrace-io.lock itself for
the whole run, so do not wrap it in `flock`).

Creates a files-layout pool (default 4 layers x 64 experts x 1 MiB = 256 MiB
under /var/tmp/moetrace-bench-record-*), warms it into the page cache, and
compiles a plan whose every iteration reads every expert once (one 1 MiB
preadv per expert), with as many iterations as make one pass last about
--pass-s seconds (calibrated with an unrecorded replay). Every read is then a
page-cache hit. Then --repeats times, interleaved and in alternating order:

(a) replay vs `moetrace record -- replay` (default probes: counters only);
(b) replay vs `moetrace record --stream-events -- replay` (per-page streams on).

(aa) with --aa: replay vs replay, the same interleaving: the noise floor of this
machine (what a ratio of two unrecorded runs looks like).

Each replay runs --warmup 1 --passes N (default 2). The time compared is the
measured passes' wall time from the replay's own replay.json
(measured_end_ns - measured_start_ns), so the recorder's start-up (compile +
attach) is excluded; the median iteration time ratio is printed beside it.
Record start-up is printed from the run manifest (timings.probes_attach_s and
the per-probe compile+attach timings) and as the wall time from launching
`record` to the child's start (timings.command_start_ns). Prints per-pair
ratios, the median ratio with a 95 % bootstrap interval over the pairs, and the
verdict against the targets: (a) <= 1.03x, (b) <= 1.10x.
The pool and every run directory are removed at the end (also on error).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LOCK = "/tmp/moetrace-io.lock"
TARGETS = {"a": 1.03, "b": 1.10}
LABELS = {"a": "(a) counters only (default probes)", "b": "(b) per-page streams (--stream-events)",
          "aa": "(aa) replay vs replay (noise floor)"}


def median_ci(x: list[float], n_boot: int = 10000, seed: int = 7) -> tuple[float, float]:
    """95 % bootstrap interval of the median of ``x`` (resampling the pairs)."""
    a = np.asarray(x, float)
    if len(a) < 2:
        return float(a[0]), float(a[0])
    idx = np.random.default_rng(seed).integers(0, len(a), (n_boot, len(a)))
    med = np.median(a[idx], axis=1)
    return float(np.percentile(med, 2.5)), float(np.percentile(med, 97.5))


@contextlib.contextmanager
def io_lock():
    with open(LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_pool(d: Path, n_layers: int, n_experts: int, eb: int):
    from moetrace.inputs.geometry import Geometry
    from moetrace.inputs.pool import create_pool

    geo = Geometry(n_layers, n_experts, n_experts, eb, "bench-record")
    pool = create_pool(d / "pool", geo, layout="files", seed=13)
    for p in pool.data_paths():  # clean pages: nothing for writeback to do during the runs
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return pool, geo


def build_plan(path: Path, geo, n_iter: int) -> Path:
    """n_iter iterations, each reading every expert of every layer once."""
    from moetrace.inputs.plan import write_plan
    from moetrace.inputs.trace import Accesses

    L, E = geo.n_layers, geo.n_experts
    per = L * E
    acc = Accesses(np.repeat(np.arange(n_iter, dtype=np.int32), per), np.zeros(n_iter * per, np.int8),
                   np.tile(np.repeat(np.arange(L, dtype=np.int16), E), n_iter),
                   np.tile(np.arange(E, dtype=np.int32), L * n_iter), L, E, n_iter)
    if path.exists():
        path.unlink()
    write_plan(path, acc, geo)
    return path


def replay_cmd(plan: Path, pool_root: Path, threads: int, warmup: int, passes: int) -> list[str]:
    return [sys.executable, "-m", "moetrace.cli.replay", str(plan), "--pool", str(pool_root), "--mode", "pagecache",
            "--threads", str(threads), "--warmup", str(warmup), "--passes", str(passes)]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MOETRACE_RUN_DIR", None)
    return env


def measured(doc: dict) -> tuple[float, float, int]:
    """(measured wall s, median iteration s, measured bytes) from a replay.json."""
    assert doc.get("complete"), f"replay incomplete: {doc.get('error')}"
    wall = (doc["measured_end_ns"] - doc["measured_start_ns"]) / 1e9
    return wall, doc["measured"]["median_ns"] / 1e9, int(doc["phases"]["measured"]["bytes"])


def run_plain(cmd: list[str], run_dir: Path) -> dict:
    subprocess.run(cmd + ["--run-dir", str(run_dir)], check=True, env=_env(), stdout=subprocess.DEVNULL)
    doc = json.loads((run_dir / "replay.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    return doc


PROBES: str | None = None  # --probes for record (None: record's default set)


def run_recorded(cmd: list[str], run_dir: Path, stream: bool, bpf_stats: bool = False) -> tuple[dict, dict, float]:
    """(replay.json, manifest.json, seconds from launching record to the child's start)."""
    rec = [sys.executable, "-m", "moetrace.cli.record", "--out", str(run_dir)]
    if bpf_stats:
        rec.append("--bpf-stats")
    if PROBES:
        rec += ["--probes", PROBES]
    if stream:
        rec.append("--stream-events")
    t0 = time.monotonic_ns()
    out = subprocess.run(rec + ["--"] + cmd, env=_env(), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"record exited {out.returncode}: {out.stderr.strip()[-2000:]}")
    man = json.loads((run_dir / "manifest.json").read_text())
    doc = json.loads((run_dir / "replay" / "replay.json").read_text())
    startup = (man["timings"]["command_start_ns"] - t0) / 1e9
    shutil.rmtree(run_dir, ignore_errors=True)
    return doc, man, startup


def _one_lifecycle(run_dir: Path, pythonpath: str | None) -> dict[str, float]:
    env = _env()
    if pythonpath and pythonpath.startswith("env:"):  # this tree with an environment variable set
        k, _, v = pythonpath[4:].partition("=")
        env[k] = v
    elif pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    rec = [sys.executable, "-m", "moetrace.cli.record", "--out", str(run_dir)]
    if PROBES:
        rec += ["--probes", PROBES]
    t0 = time.monotonic_ns()
    out = subprocess.run(rec + ["--", "true"], env=env, capture_output=True, text=True)
    t1 = time.monotonic_ns()
    if out.returncode != 0:
        raise RuntimeError(f"record exited {out.returncode}: {out.stderr.strip()[-2000:]}")
    man = json.loads((run_dir / "manifest.json").read_text())
    tm = man["timings"]
    shutil.rmtree(run_dir, ignore_errors=True)
    row = {"startup_s": (tm["command_start_ns"] - t0) / 1e9, "attach_s": tm["probes_attach_s"],
           "teardown_s": (t1 - tm["command_end_ns"]) / 1e9, "total_s": (t1 - t0) / 1e9}
    rel = (man.get("detach") or {}).get("releaser_pid")
    if rel and not man["detach"].get("waited"):
        # the releaser finishes the kernel's part after record returned: until every program is
        # gone (child exit -> releaser exit), waited here so the next run starts on a quiet kernel
        from moetrace.kernel.bpf import wait_pid_exit

        if not wait_pid_exit(rel, timeout=120):
            raise RuntimeError(f"releaser {rel} still running after 120 s")
        row["released_s"] = (time.monotonic_ns() - tm["command_end_ns"]) / 1e9
    for k in ("collect_detach_s", "detach_release_wait_s"):
        if k in tm:
            row[k] = tm[k]
    row.update({k: v for k, v in tm.items() if k.endswith("_load_attach_s")})
    return row


def lifecycle(n: int, baselines: list[str]) -> int:
    """Start-up and tear-down of `record -- true`, this tree and each baseline interleaved."""
    trees = [("this tree", None)] + [tuple(b.split("=", 1)) for b in baselines]  # type: ignore[misc]
    rows: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
    d = Path(tempfile.mkdtemp(prefix="moetrace-bench-lifecycle-", dir="/var/tmp"))
    try:
        for i in range(n):
            for label, pp in (trees if i % 2 == 0 else trees[::-1]):
                r = _one_lifecycle(d / f"run-{i}-{len(rows[label])}", pp)
                rows[label].append(r)
                print(f"  {i} {label}: start-up {r['startup_s']:.2f} s (attach {r['attach_s']:.2f}), tear-down "
                      f"{r['teardown_s']:.2f} s" + _teardown_detail(r), flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print()
    for label, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if all(k in r for r in rs)}
        rng = {k: (min(r[k] for r in rs), max(r[k] for r in rs)) for k in ("startup_s", "teardown_s")}
        per = ", ".join(f"{k[: -len('_load_attach_s')]} {v:.2f}" for k, v in med.items()
                        if k.endswith("_load_attach_s"))
        print(f"{label}: {len(rs)} runs; start-up median {med['startup_s']:.2f} s (range {rng['startup_s'][0]:.2f}-"
              f"{rng['startup_s'][1]:.2f}; compile + attach {med['attach_s']:.2f}: {per}); tear-down median "
              f"{med['teardown_s']:.2f} s (range {rng['teardown_s'][0]:.2f}-{rng['teardown_s'][1]:.2f})"
              + _teardown_detail(med, "; "))
    return 0


def _teardown_detail(r: dict[str, float], sep: str = " (") -> str:
    """collect + detach, and the kernel's release: waited by record (older trees, --wait-detach)
    or finished by the releaser after record returned (child exit -> every program gone)."""
    if "collect_detach_s" not in r:
        return ""
    out = f"{sep}collect + detach {r['collect_detach_s']:.2f} s"
    if "detach_release_wait_s" in r:
        out += f", kernel release waited by record {r['detach_release_wait_s']:.2f} s"
    if "released_s" in r:
        out += f", every program gone {r['released_s']:.2f} s after the child exited (record did not wait)"
    return out + (")" if sep == " (" else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64, help="experts per layer")
    ap.add_argument("--expert-bytes", type=int, default=1 << 20, help="bytes per expert = bytes per read call")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeats", type=int, default=5, help="pairs per case")
    ap.add_argument("--passes", type=int, default=2, help="measured passes per replay")
    ap.add_argument("--pass-s", type=float, default=0.75, help="target seconds per pass (calibrated)")
    ap.add_argument("--probes", default=None, help="record --probes LIST (default: record's default set)")
    ap.add_argument("--cases", default="ab", help="which cases to run: a (counters), b (streams) or ab")
    ap.add_argument("--aa", action="store_true", help="also run replay-vs-replay pairs: the noise floor")
    ap.add_argument("--bpf-stats-runs", type=int, default=3,
                    help="recorded runs with --bpf-stats after the pairs: the probes' own kernel CPU time "
                         "(0: skip)")
    ap.add_argument("--lifecycle", type=int, default=0, metavar="N",
                    help="instead of the pairs: N recordings of `true` with the default set, interleaved "
                         "with N of each --lifecycle-baseline; start-up (launch -> child start, per-probe "
                         "compile + attach) and tear-down (child exit -> record exit, collect + detach, the "
                         "kernel's release)")
    ap.add_argument("--lifecycle-baseline", action="append", default=[], metavar="LABEL=PYTHONPATH",
                    help="another moetrace source tree to time the same way (e.g. before=/tmp/old), put first on "
                         "PYTHONPATH; or this tree with a variable set, LABEL=env:VAR=VALUE; repeatable")
    a = ap.parse_args(argv)
    global PROBES
    PROBES = a.probes
    if os.geteuid() != 0:
        print("bench_record needs root (the probes); run it with sudo", file=sys.stderr)
        return 2
    if a.lifecycle:
        with io_lock():
            return lifecycle(a.lifecycle, a.lifecycle_baseline)
    d = Path(tempfile.mkdtemp(prefix="moetrace-bench-record-", dir="/var/tmp"))
    try:
        with io_lock():
            return _bench(a, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _bench(a, d: Path) -> int:
    eb, T = a.expert_bytes, a.threads
    pool, geo = build_pool(d, a.layers, a.experts, eb)
    total = pool.data_bytes
    plan = d / "plan.bin"
    # calibrate: warm the pool into the page cache, time one iteration, size the plan
    build_plan(plan, geo, 4)
    doc = run_plain(replay_cmd(plan, pool.root, T, 2, 1), d / "cal")
    it_s = doc["measured"]["median_ns"] / 1e9
    n_iter = max(1, math.ceil(a.pass_s / it_s))
    build_plan(plan, geo, n_iter)
    print(f"pool: {geo.n_layers} layers x {geo.n_experts} experts x {eb} B = {total / 2**20:.0f} MiB, files "
          f"layout, warm in the page cache; plan: {n_iter} iterations x {geo.n_layers * geo.n_experts} reads of "
          f"{eb} B (one pass {n_iter * total / 2**30:.2f} GiB, ~{n_iter * it_s:.2f} s at {it_s * 1e3:.1f} "
          f"ms/iteration); replay --mode pagecache --threads {T} --warmup 1 --passes {a.passes}", flush=True)
    cmd = replay_cmd(plan, pool.root, T, 1, a.passes)
    want = a.passes * n_iter * total
    cases = list(a.cases) + (["aa"] if a.aa else [])
    ratios: dict[str, list] = {c: [] for c in cases}
    med_ratios: dict[str, list] = {c: [] for c in cases}
    startups: dict[str, list] = {c: [] for c in cases}
    attach: dict[str, list] = {c: [] for c in cases}
    per_probe: dict[str, dict[str, list]] = {c: {} for c in cases}
    hits: dict[str, list] = {c: [] for c in cases}
    n = 0
    for r in range(a.repeats):
        for case in cases:
            order = ["plain", "record"] if (r % 2 == 0) else ["record", "plain"]
            res = {}
            for who in order:
                n += 1
                if who == "plain" or case == "aa":
                    res[who] = measured(run_plain(cmd, d / f"plain-{n}"))
                else:
                    doc, man, st = run_recorded(cmd, d / f"run-{n}", stream=case == "b")
                    res[who] = measured(doc)
                    tm = man["timings"]
                    startups[case].append(st)
                    attach[case].append(tm["probes_attach_s"])
                    for k, v in tm.items():
                        if k.endswith("_load_attach_s"):
                            per_probe[case].setdefault(k[: -len("_load_attach_s")], []).append(v)
                    t = man.get("totals") or {}
                    hits[case].append((t.get("experts_requested_pages"), t.get("experts_added_pages"),
                                       (man.get("lost") or {}).get("pagecache")))
                assert res[who][2] == want, f"{who} read {res[who][2]} bytes, expected {want}"
            (pw, pm, _), (rw, rm, _) = res["plain"], res["record"]
            ratios[case].append(rw / pw)
            med_ratios[case].append(rm / pm)
            second = "second replay" if case == "aa" else "recorded"
            print(f"  pair {r} {case} ({'->'.join(order)}): replay {pw:.4f} s, {second} {rw:.4f} s, ratio "
                  f"{rw / pw:.4f}x (median iteration {pm * 1e3:.2f} vs {rm * 1e3:.2f} ms, {rm / pm:.4f}x); "
                  + (f"record start-up {startups[case][-1]:.2f} s" if startups[case] else "no probes in either"),
                  flush=True)
    print()
    rc = 0
    for case in cases:
        m = statistics.median(ratios[case])
        mi = statistics.median(med_ratios[case])
        lo, hi = median_ci(ratios[case])
        verdict = ""
        if case in TARGETS:
            ok = m <= TARGETS[case]
            rc |= 0 if ok else 1
            verdict = f" (target <= {TARGETS[case]:.2f}x: {'ok' if ok else 'ABOVE TARGET'})"
        print(f"{LABELS[case]:<42} median ratio {m:.4f}x, 95 % interval {lo:.4f}-{hi:.4f}x{verdict}; per pair "
              f"{', '.join(f'{x:.4f}' for x in ratios[case])}; median-iteration ratio {mi:.4f}x")
        if case == "aa":
            continue
        pp = ", ".join(f"{p} {statistics.median(v):.2f} s" for p, v in per_probe[case].items())
        print(f"    record start-up (median): compile + attach {statistics.median(attach[case]):.2f} s ({pp}); "
              f"launch -> child start {statistics.median(startups[case]):.2f} s")
        req, add, lost = hits[case][-1]
        print(f"    last recorded run: requested {req} pages, added {add} (misses); pagecache lost {lost}")
    if a.bpf_stats_runs:
        # the deterministic part of the cost: what the probes' BPF programs ran in the kernel
        fr, per = [], {}
        for i in range(a.bpf_stats_runs):
            doc, man, _st = run_recorded(cmd, d / f"stats-{i}", stream=False, bpf_stats=True)
            rt = man["bpf_runtime"]
            wall = rt["command_wall_ns"]
            fr.append(rt["total_run_time_ns"] / wall)
            tm = man["timings"]
            per.setdefault("recorder user space", []).append(
                (tm["recorder_user_s"] + tm["recorder_system_s"]) * 1e9 / wall)
            for p, ns in rt["per_probe_run_time_ns"].items():
                per.setdefault(p, []).append(ns / wall)
        print(f"(c) BPF run time of the default probes (--bpf-stats, {a.bpf_stats_runs} runs): median "
              f"{100 * statistics.median(fr):.3f} % of one CPU over the recorded command's wall time; per probe "
              "(and the recorder's own CPU while the command ran) "
              + ", ".join(f"{p} {100 * statistics.median(v):.3f} %" for p, v in sorted(per.items(),
                                                                                   key=lambda kv: -max(kv[1]))))
    return rc


if __name__ == "__main__":
    sys.exit(main())
