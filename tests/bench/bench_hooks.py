"""Benchmark: a kernel function hook as a BPF trampoline (fentry) against the same hook as a
kprobe, on a kernel that offers both (issue 18, acceptance 4).

    sudo .venv/bin/python tests/bench/bench_hooks.py [--kernel 6.12] [--rounds 5]

Boots the lab kernel (``moetrace lab run``; TCG where KVM fails) and runs this script inside it
with ``--guest``. There, ``--rounds`` times, interleaved in rotating order, one workload runs
three ways:

  none    the workload alone;
  fentry  under ``moetrace record --probes mlock --bpf-stats`` (its function hooks as fentry);
  kprobe  the same with MOETRACE_NO_FENTRY=1 (the plan takes each hook's kprobe candidate).

The workload mlocks and munlocks a 32 MiB anonymous region of 4 KiB folios ``--cycles`` times,
so the kernel calls mlock_folio / munlock_folio once per page (8192 calls per cycle), the hooks
the mlock probe's function groups attach to. The time compared is the workload's own loop (its
perf_counter around the cycles: the recorder's start-up and tear-down are excluded). Printed:
per round the three loop times, then per way the median and the ratio to ``none`` with a 95 %
bootstrap interval over the rounds, and from --bpf-stats the programs' own run time per hook
call (run_time_ns / run_cnt of the fe_* / kp_* programs). The kprobe's trap (int3 or ftrace
and its handler) is outside the program's run time; the loop ratio includes it.
Everything the guest writes stays in the lab directory (a temporary one unless --out).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WAYS = ("none", "fentry", "kprobe")
MADV_NOHUGEPAGE = 15


def workload(cycles: int, mib: int) -> float:
    """mlock + munlock ``mib`` MiB of 4 KiB anonymous folios ``cycles`` times; seconds of the loop."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = mib << 20
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), MADV_NOHUGEPAGE)
    for off in range(0, size, mmap.PAGESIZE):  # populated: mlock finds every page present
        m[off] = 1
    t0 = time.perf_counter()
    for _ in range(cycles):
        if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(size)) != 0:
            raise OSError(ctypes.get_errno(), "mlock")
        if libc.munlock(ctypes.c_void_p(addr), ctypes.c_size_t(size)) != 0:
            raise OSError(ctypes.get_errno(), "munlock")
    return time.perf_counter() - t0


def _one(way: str, cycles: int, mib: int, scratch: Path) -> dict:
    """One workload run ``way``; {"loop_s", "hooks": {program: (run_cnt, run_time_ns)}, "kinds"}."""
    me = [sys.executable, __file__, "--workload", "--cycles", str(cycles), "--mib", str(mib)]
    if way == "none":
        out = subprocess.run(me, capture_output=True, text=True, check=True).stdout
        return {"loop_s": json.loads(out)["loop_s"], "hooks": {}, "kinds": {}}
    run = scratch / f"run-{way}-{time.monotonic_ns()}"
    env = dict(os.environ, MOETRACE_NO_FENTRY="1" if way == "kprobe" else "0")
    cmd = [str(Path(sys.executable).with_name("moetrace")), "record", "--probes", "mlock", "--bpf-stats",
           "--out", str(run), "--", *me]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"record ({way}) failed: {out.stderr[-3000:]}")
    loop = json.loads(out.stdout.strip().splitlines()[-1])["loop_s"]
    man = json.loads((run / "manifest.json").read_text())
    progs = (man.get("bpf_runtime") or {}).get("programs", {}).get("mlock", {})
    hooks = {p: (v["run_cnt"], v["run_time_ns"]) for p, v in progs.items() if p.startswith(("fe_", "kp_"))}
    kinds = {g: e["candidate"]["kind"] for g, e in
             ((e["group"], e) for e in man["attach_plan"]["mlock"]["entries"]) if e.get("candidate")
             and g.startswith("kp_")}
    shutil.rmtree(run, ignore_errors=True)
    return {"loop_s": loop, "hooks": hooks, "kinds": kinds}


def _interval(ratios: list[float], n: int = 4000) -> tuple[float, float]:
    rng = random.Random(1)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def guest(rounds: int, cycles: int, mib: int, out: Path) -> dict:
    """The rounds, in the guest; the result is written to ``out`` and returned."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-hooks-"))
    res: dict = {"kernel": os.uname().release, "rounds": [], "cycles": cycles, "mib": mib}
    try:
        _one("fentry", 1, mib, scratch)  # warm: imports, the objects and the pages in the page cache
        for i in range(rounds):
            order = WAYS[i % 3:] + WAYS[:i % 3]
            res["rounds"].append({w: _one(w, cycles, mib, scratch) for w in order})
            print(json.dumps({w: round(r["loop_s"], 3) for w, r in res["rounds"][-1].items()}), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    return res


def report(res: dict) -> str:
    rounds = res["rounds"]
    lines = [f"kernel {res['kernel']}: {len(rounds)} rounds, {res['cycles']} cycles of mlock+munlock of "
             f"{res['mib']} MiB (4 KiB folios: {res['mib'] * 256} mlock_folio + as many munlock_folio calls "
             f"per cycle)"]
    base = [r["none"]["loop_s"] for r in rounds]
    lines.append(f"  none    loop median {statistics.median(base):.3f} s")
    for way in ("fentry", "kprobe"):
        t = [r[way]["loop_s"] for r in rounds]
        ratios = [a / b for a, b in zip(t, base)]
        lo, hi = _interval(ratios)
        cnt = sum(c for r in rounds for c, _ns in r[way]["hooks"].values())
        ns = sum(ns for r in rounds for _c, ns in r[way]["hooks"].values())
        kinds = sorted({k for r in rounds for k in r[way]["kinds"].values()})
        lines.append(f"  {way:7s} loop median {statistics.median(t):.3f} s = {statistics.median(ratios):.3f}x none "
                     f"(95 % {lo:.3f}-{hi:.3f}); hooks attached as {','.join(kinds) or '-'}; "
                     f"program run time {ns / cnt if cnt else float('nan'):.0f} ns per hook call ({cnt} calls)")
    fe = [r["fentry"]["loop_s"] for r in rounds]
    kp = [r["kprobe"]["loop_s"] for r in rounds]
    ratios = [a / b for a, b in zip(kp, fe)]
    lo, hi = _interval(ratios)
    lines.append(f"  kprobe / fentry loop: {statistics.median(ratios):.3f}x (95 % {lo:.3f}-{hi:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", default="6.12", help="lab kernel to boot (moetrace lab kernels lists them)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cycles", type=int, default=20, help="mlock+munlock cycles per workload run")
    ap.add_argument("--mib", type=int, default=32, help="size of the locked region")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds the guest may run")
    ap.add_argument("--out", type=Path, help="keep the lab directory here (default: a temporary one)")
    ap.add_argument("--guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.workload:
        print(json.dumps({"loop_s": workload(a.cycles, a.mib)}))
        return 0
    if a.guest:
        print(report(guest(a.rounds, a.cycles, a.mib, a.result)))
        return 0
    lab = a.out or Path(tempfile.mkdtemp(prefix="bench-hooks-lab-"))
    try:
        cmd = [str(Path(sys.executable).with_name("moetrace")), "lab", "run", "--kernel", a.kernel, "--out", str(lab),
               "--timeout", str(a.timeout), "--", sys.executable, __file__, "--guest", "--rounds", str(a.rounds),
               "--cycles", str(a.cycles), "--mib", str(a.mib), "--result", "/tmp/lab/hooks.json"]
        r = subprocess.run(cmd)
        result = lab / "hooks.json"
        if r.returncode != 0 or not result.exists():
            print(f"the guest run failed (exit {r.returncode}); its output is in {lab}", file=sys.stderr)
            return 1
        print(report(json.loads(result.read_text())))
        return 0
    finally:
        if a.out is None:
            shutil.rmtree(lab, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
