"""The replay harness: exact counts, the iteration log, sync-fd, signals, modes.

No-kernel tier: tiny pools in tmp_path (tens of experts of 64 KiB) and plans
built directly from Accesses, checked against counts computed here from the
same Accesses. Live tier (`live` fixture, root): device bytes from
/proc/diskstats of the pool's block device, VmLck from /proc/<pid>/status and
fincore, under the shared I/O flock (/tmp/moetrace-io.lock).
"""


from __future__ import annotations


import contextlib


import ctypes


import errno


import json


import os


import re


import signal


import socket


import subprocess


import sys


import time


from pathlib import Path


import numpy as np


import pandas as pd


import pytest


from click.testing import CliRunner


from moetrace.errors import MoetraceError, UsageError


from moetrace.inputs.geometry import Geometry


from moetrace.inputs.plan import write_plan


from moetrace.inputs.pool import create_pool


from moetrace.inputs.trace import Accesses


from moetrace.replay import harness as rp


from moetrace.cli.replay import replay as replay_cmd


KIB = 1024


MIB = 1024 * 1024


ROOT = Path(__file__).resolve().parents[2]


def make_accesses(L: int, E: int, k: int, n_it: int, seed: int = 0, skew: float = 1.2,
                  fallback_every: int = 0, empty_layer: int | None = None) -> Accesses:
    """Per (iteration, pass, layer) k distinct experts (Zipf-skewed), canonical order.

    fallback_every=n adds a second pass to every n-th iteration; empty_layer
    leaves that layer unread in pass 0 of odd iterations."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, E + 1) ** skew
    w /= w.sum()
    it, ps, lay, ex = [], [], [], []
    for i in range(n_it):
        passes = [0, 1] if fallback_every and i % fallback_every == fallback_every - 1 else [0]
        for p in passes:
            for layer in range(L):
                if empty_layer is not None and layer == empty_layer and p == 0 and i % 2:
                    continue
                sel = np.sort(rng.choice(E, size=k, replace=False, p=w))
                it += [i] * k
                ps += [p] * k
                lay += [layer] * k
                ex += sel.tolist()
    return Accesses(np.asarray(it, np.int32), np.asarray(ps, np.int8), np.asarray(lay, np.int16),
                    np.asarray(ex, np.int32), L, E, n_it)


def make_plan(path: Path, acc: Accesses, eb: int, hints: bool = True) -> Path:
    geo = Geometry(acc.n_layers, acc.n_experts, 2, eb, "test")
    write_plan(path, acc, geo, hints=acc if hints else None, hint_source="oracle" if hints else None)
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 4 x 8 x 64 KiB pool (files, pool and layers layouts) and a 12-iteration plan with a fallback pass."""
    d = tmp_path_factory.mktemp("replay")
    eb = 64 * KIB
    geo = Geometry(4, 8, 2, eb, "test")
    files = create_pool(d / "pool_files", geo, layout="files", seed=1)
    one = create_pool(d / "pool_one", geo, layout="pool", seed=2)
    layers = create_pool(d / "pool_layers", geo, layout="layers", seed=4)
    acc = make_accesses(4, 8, 2, 12, seed=3, fallback_every=5, empty_layer=2)
    plan = make_plan(d / "plan.bin", acc, eb)
    plain = make_plan(d / "plain.bin", acc, eb, hints=False)
    return {"dir": d, "eb": eb, "files": files, "one": one, "layers": layers, "acc": acc, "plan": plan,
            "plain": plain}


def per_iteration_reads(acc: Accesses) -> np.ndarray:
    return np.bincount(acc.iteration, minlength=acc.n_iterations)


def o_direct_ok(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def mlock_ok(nbytes: int) -> bool:
    soft, _ = __import__("resource").getrlimit(__import__("resource").RLIMIT_MEMLOCK)
    return os.geteuid() == 0 or soft == -1 or soft >= nbytes + 64 * KIB


def _spawn(args, env=None, pass_fds=()):
    e = dict(os.environ)
    e.pop("MOETRACE_RUN_DIR", None)
    e.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "moetrace.cli.replay", *map(str, args)], env=e,
                            pass_fds=pass_fds, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _readline(sock: socket.socket, timeout: float = 60) -> str:
    sock.settimeout(timeout)
    buf = b""
    while not buf.endswith(b"\n"):
        c = sock.recv(1)
        if not c:
            raise EOFError(buf)
        buf += c
    return buf.decode()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


from conftest import io_lock  # noqa: E402


def device_of(path: Path) -> str:
    st = os.stat(path)
    link = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    return os.path.basename(link)


def read_sectors(dev: str) -> int:
    with open("/proc/diskstats") as fh:
        for line in fh:
            f = line.split()
            if f[2] == dev:
                return int(f[5])
    raise LookupError(dev)


def drop_from_cache(paths) -> None:
    """fsync + POSIX_FADV_DONTNEED every file until fincore shows none of it resident."""
    from conftest import drop_pages

    drop_pages(paths, resident_pages, tries=10)


def resident_pages(paths) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "PAGES", *map(str, paths)],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(x) for x in out.split())


@pytest.fixture(scope="module")
def livepool(tmp_path_factory):
    """3 layers x 8 experts x 1 MiB on a block device (not tmpfs), files layout."""
    base = Path("/var/tmp")
    d = Path(__import__("tempfile").mkdtemp(prefix="moetrace-test-replay-", dir=base))
    eb = MIB
    pool = create_pool(d / "pool", Geometry(3, 8, 2, eb, "t"), layout="files", seed=5)
    acc = make_accesses(3, 8, 2, 10, seed=7, skew=1.5)
    plan = make_plan(d / "plan.bin", acc, eb)
    yield {"dir": d, "pool": pool, "acc": acc, "plan": plan, "eb": eb}
    import shutil

    shutil.rmtree(d, ignore_errors=True)


#: The replay's interpreter start-up reads its libraries from disk whenever they are not cached
#: (measured with a bcc count of page-cache additions: the replay's process added 2,788 pages of
#: pyarrow's libarrow_s3.so, and numpy's and pyarrow's others, between spawn and its warm-up,
#: on the pool's disk: this VM's DAMON pageout scheme evicts idle library pages). Device-wide
#: diskstats then counted 19-25 MB in a warm-up that reads 17 MiB of pool. This wrapper imports
#: what the replay imports, says "imported" on the sync socket and waits for "start": the
#: parent reads the "before" sectors once only the replay's own reads remain.
_PREIMPORTED_REPLAY = """
import os, sys
import numpy, pyarrow, pyarrow.parquet
import moetrace.cli.replay, moetrace.replay.harness, moetrace.replay.epochs, moetrace.inputs.pool
import moetrace.inputs.plan
fd = int(sys.argv[1])
os.write(fd, b"imported\\n")
buf = b""
while not buf.endswith(b"\\n"):
    c = os.read(fd, 1)
    if not c:
        sys.exit(125)
    buf += c
if buf != b"start\\n":
    sys.exit(125)
sys.argv = ["replay", *sys.argv[2:]]
moetrace.cli.replay.main()
"""


def synced_run(lp, args, probe=None, marks: dict | None = None):
    """Run the replay with --sync-fd; return (sectors before, at loop entry, at done, summary, probe result).
    "Before" is read once the replay's libraries are loaded (:data:`_PREIMPORTED_REPLAY`).
    ``marks`` gets the CLOCK_MONOTONIC ns of each of the three sector reads ("s0", "s1", "s2"),
    to cut a PageWatcher's stream at the same moments."""
    marks = {} if marks is None else marks
    dev = device_of(lp["pool"].path_of(0))
    parent, child = socket.socketpair()
    run = lp["dir"] / f"run-{time.monotonic_ns()}"
    with contextlib.closing(parent):
        e = dict(os.environ)
        e.pop("MOETRACE_RUN_DIR", None)
        argv = [lp["plan"], "--pool", lp["pool"].root, "--sync-fd", child.fileno(), "--run-dir", run, *args]
        p = subprocess.Popen([sys.executable, "-c", _PREIMPORTED_REPLAY, str(child.fileno()), *map(str, argv)],
                             env=e, pass_fds=[child.fileno()], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        child.close()
        try:
            assert _readline(parent) == "imported\n"
            s0 = read_sectors(dev)
            marks["s0"] = time.monotonic_ns()
            parent.sendall(b"start\n")
            line = _readline(parent)
            s1 = read_sectors(dev)
            marks["s1"] = time.monotonic_ns()
            got = probe(p.pid, line) if probe else None
            parent.sendall(b"go\n")
            assert _readline(parent) == "done\n"
            s2 = read_sectors(dev)
            marks["s2"] = time.monotonic_ns()
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == 0, err
    return s0, s1, s2, json.loads((run / rp.SUMMARY_FILE).read_text()), got


def near(got: int, want: int, rel: float = 0.04, slack: int = 512 * KIB) -> bool:
    return abs(got - want) <= rel * want + slack


__all__ = ['Accesses', 'CliRunner', 'Geometry', 'KIB', 'MIB', 'MoetraceError', 'Path', 'ROOT', 'UsageError', '_alive', '_readline', '_spawn', 'contextlib', 'create_pool', 'ctypes', 'device_of', 'drop_from_cache', 'errno', 'io_lock', 'json', 'livepool', 'make_accesses', 'make_plan', 'mlock_ok', 'near', 'np', 'o_direct_ok', 'os', 'pd', 'per_iteration_reads', 'pytest', 're', 'read_sectors', 'replay_cmd', 'resident_pages', 'rp', 'signal', 'small', 'socket', 'subprocess', 'synced_run', 'sys', 'time', 'write_plan']
