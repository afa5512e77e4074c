"""The stacks probe (probes/stacks.bpf.c + toolkit/record/probes/stacks.py + toolkit/kernel/symbolize.py).

Tiers:
- no kernel: maps parsing and lookup over a fake /proc, kallsyms lookup (and the zeros
  fallback), ELF symbols of this very process checked against dlsym, the folded format,
  knob parsing, kswapd discovery, and the leak checker on planted files (each plant found
  with its file and offset; clean look-alikes not flagged).
- probe build: compiles, loads, opens the cpu-clock perf events, puts the kswapd threads in
  the task map, and detaches (program ids and perf-event fds gone), with the knob sets the
  recorder uses.
- live: ``moetrace record --probes stacks`` over a replay of a cold 64 MiB pool (plus hot
  passes). Oracle: the followed tree's CPU time from getrusage (a shim that runs the replay
  as its child and reports RUSAGE_SELF + RUSAGE_CHILDREN). Samples must equal
  cpu_s x sample_hz within 3 binomial sigmas + 2, sigma = sqrt(n p (1 - p)) for n =
  wall x hz x CPUs ticks of which a fraction p lands on the command (measured here: ratios
  0.95-1.005 at 99 Hz, 0.986-0.988 at 999 Hz). Kernel frames must show the page-cache read
  path of 6.18 (filemap_read, filemap_get_pages, copy_page_to_iter / _copy_to_iter; at 999 Hz
  on a cold pass also readahead: page_cache_ra_order / page_cache_ra_unbounded /
  filemap_add_folio), user frames the interpreter (python3.x / libpython), and
  find_kernel_addresses(run_dir) must be [].
"""


from __future__ import annotations


import ctypes


import json


import math


import os


import subprocess


import sys


from pathlib import Path


import pandas as pd


import pytest


from moetrace.run import directory as rundir


from moetrace.record.probes import stacks as stacksrec


from moetrace.kernel import symbolize


from moetrace.record.probes import PROBES


from moetrace.kernel.symbolize import Kallsyms, Mapping, ProcMaps, Symbolizer, find_kernel_addresses, parse_maps


from conftest import io_lock  # noqa: E402


SPEC = PROBES["stacks"]


MIB = 1 << 20


RECORD = [sys.executable, "-c", "from moetrace.cli import main; main()", "record"]


REPLAY = [sys.executable, "-m", "moetrace.cli.replay"]


MAPS = """\
00400000-00420000 r--p 00000000 fe:00 1                                  /usr/bin/prog
00420000-00500000 r-xp 00020000 fe:00 1                                  /usr/bin/prog
7f0000000000-7f0000100000 r-xp 00001000 fe:00 2                          /lib/libx.so
7f0000200000-7f0000201000 rw-p 00000000 00:00 0 
7fff00000000-7fff00002000 r-xp 00000000 00:00 0                          [vdso]
"""


def _fake_proc(tmp_path: Path, pid: int, maps: str) -> Path:
    d = tmp_path / "proc" / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "maps").write_text(maps)
    return tmp_path


KALLSYMS = """\
ffffffff81000000 T _stext
ffffffff81100000 T filemap_read
ffffffff81100800 t filemap_get_pages
ffffffff81200000 D some_data
ffffffffc0001000 t ext4_helper	[ext4]
"""


def _perf_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[perf_event]":
                n += 1
        except OSError:
            pass
    return n


def _ctx():
    from moetrace.kernel.features import Features
    from moetrace.record.probe import RecordContext
    from moetrace.record.spec import resolve

    feats = Features("/", mount=True)
    return RecordContext(features=feats, plan=resolve(SPEC, feats))


SHIM = '''\
import json, os, resource, subprocess, sys
out, cmd = sys.argv[1], sys.argv[2:]
rc = subprocess.run(cmd).returncode
s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
with open(out, "w") as fh:
    json.dump({"self_cpu_s": s.ru_utime + s.ru_stime, "children_cpu_s": c.ru_utime + c.ru_stime}, fh)
os._exit(rc)
'''


def _moetrace(*args):
    r = subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *args],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A 64 MiB pool of 32 x 2 MiB expert files and a one-pass plan over all of them."""
    base = tmp_path_factory.mktemp("stacks")
    n = 32
    _moetrace("pool", "create", str(base / "pool"), "--layers", "1", "--experts", str(n), "--k", str(n),
              "--expert-bytes", "2MiB", "--layout", "files")
    from moetrace.inputs.trace import write_jsonl

    write_jsonl([(0, 0, list(range(n)))], base / "t.jsonl")
    _moetrace("plan", "compile", str(base / "t.jsonl"), "--layers", "1", "--experts", str(n), "--k", str(n),
              "--expert-bytes", "2MiB", "-o", str(base / "plan.bin"))
    (base / "shim.py").write_text(SHIM)
    return base


def _drop(pool_dir: Path) -> None:
    for p in sorted(pool_dir.rglob("*.bin")):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _record_replay(base: Path, run: Path, passes: int, env_knobs: str | None = None) -> tuple[dict, dict]:
    env = dict(os.environ)
    env.pop(stacksrec.KNOBS_ENV, None)
    if env_knobs:
        env[stacksrec.KNOBS_ENV] = env_knobs
    oracle = base / f"{run.name}.cpu.json"
    cmd = [sys.executable, str(base / "shim.py"), str(oracle), *REPLAY, str(base / "plan.bin"), "--pool",
           str(base / "pool"), "--warmup", "0", "--passes", str(passes), "--threads", "2"]
    with io_lock():
        _drop(base / "pool")
        r = subprocess.run([*RECORD, "--out", str(run), "--probes", "stacks", "--", *cmd], capture_output=True,
                           text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    return rundir.read_manifest(run), json.loads(oracle.read_text())


def _frames(df: pd.DataFrame) -> dict[str, int]:
    out: dict[str, int] = {}
    for s, n in zip(df["stack"], df["samples"]):
        for f in set(s.split(";")[1:]):
            out[f] = out.get(f, 0) + int(n)
    return out


def _check_rate(doc: dict, cpu: dict, hz: int) -> None:
    summ = doc["summaries"]["stacks"]
    expected = (cpu["self_cpu_s"] + cpu["children_cpu_s"]) * hz
    n = doc["timings"]["command_wall_s"] * hz * os.cpu_count()
    p = min(expected / n, 1.0)
    tol = 3 * math.sqrt(n * p * (1 - p)) + 2
    got = summ["command_samples"]
    print(f"stacks {hz} Hz: {got} samples, oracle {expected:.1f} (cpu x hz), tolerance {tol:.1f}, "
          f"ratio {got / expected:.3f}")
    assert abs(got - expected) <= tol, (got, expected, tol)


__all__ = ['KALLSYMS', 'Kallsyms', 'MAPS', 'MIB', 'Mapping', 'PROBES', 'Path', 'ProcMaps', 'RECORD', 'REPLAY', 'SHIM', 'SPEC', 'Symbolizer', '_check_rate', '_ctx', '_drop', '_fake_proc', '_frames', '_moetrace', '_perf_fds', '_record_replay', 'ctypes', 'find_kernel_addresses', 'io_lock', 'json', 'math', 'os', 'parse_maps', 'pd', 'pool', 'pytest', 'rundir', 'stacksrec', 'subprocess', 'symbolize', 'sys']
