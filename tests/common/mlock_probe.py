"""The mlock probe (probes/mlock.bpf.c + moetrace.record.probes.mlock).

No-kernel tier: the locked-range model (an interval set per process, page-rounded like
do_mlock) against a brute-force page set, and against hand-computed call sequences; the
ring record layout. Probe-build tier: mlock.c compiles, loads and detaches with the
recorder's knobs and with every optional group off; its kprobe programs (switched off on
this kernel) pass the verifier when compiled in. Live tier: a ctypes child's VmLck after
each of its calls is the probe's locked bytes after that call (a forked grandchild
included); `moetrace record --probes mlock -- replay --mode pinned` puts the replay's own
VmLck at loop entry in the manifest and the probe matches it exactly.
"""


from __future__ import annotations


import json


import mmap


import random


import re


import shutil


import subprocess


import sys


import tempfile


import time


from pathlib import Path


import numpy as np


import pandas as pd


import pytest


from moetrace.record.probes import mlock as ml


from moetrace.record.probes import PROBES


SPEC = PROBES["mlock"]


PAGE = mmap.PAGESIZE


SRC = (Path(__file__).resolve().parents[2] / "probes" / "mlock.bpf.c").read_text()


RECORD = [sys.executable, "-c", "from moetrace.cli.record import record; record.main(prog_name='moetrace record')"]


REPLAY = [sys.executable, "-m", "moetrace.cli.replay"]


def _calls(rows: list[tuple]) -> pd.DataFrame:
    """(time, tgid, call, start, len, ret[, flags[, new_len]]) -> a calls frame."""
    full = [r + (0,) * (8 - len(r)) for r in rows]
    return pd.DataFrame({
        "time_ns": np.array([r[0] for r in full], np.int64), "tgid": np.array([r[1] for r in full], np.int32),
        "tid": np.array([r[1] for r in full], np.int32), "call": pd.array([r[2] for r in full], dtype="string"),
        "start": np.array([r[3] for r in full], np.uint64), "len_bytes": np.array([r[4] for r in full], np.int64),
        "new_len_bytes": pd.array([r[7] if r[2] == "mremap" else pd.NA for r in full], dtype="Int64"),
        "flags": np.array([r[6] for r in full], np.int64), "ret": np.array([r[5] for r in full], np.int64),
        "latency_ns": np.zeros(len(full), np.int64)})


def _features():
    from moetrace.kernel.features import Features

    return Features(mount=True)


_CHILD = r"""
import ctypes, ctypes.util, json, mmap, os, sys
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
V, S, I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
sig = {"mlock": [V, S], "munlock": [V, S], "mlock2": [V, S, ctypes.c_uint], "mlockall": [I], "munlockall": [],
       "munmap": [V, S], "mmap": [V, S, I, I, I, ctypes.c_long], "mremap": [V, S, S, I]}
for n, a in sig.items():
    getattr(libc, n).argtypes = a
libc.mmap.restype = V
libc.mremap.restype = V
P = mmap.PAGESIZE
RW, PRIV_ANON, LOCKED = 3, 0x22, 0x2000

def vmlck():
    for line in open("/proc/self/status"):
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024

def do(op, *args, key=None):
    r = getattr(libc, op)(*args)
    err = ctypes.get_errno()
    if op in ("mmap", "mremap"):
        r = r if r not in (None, ctypes.c_void_p(-1).value) else -err
    elif r != 0:
        r = -err
    print(json.dumps({"pid": os.getpid(), "op": op, "key": key, "ret": r, "vmlck": vmlck()}), flush=True)
    return r

sys.stdin.read(1)  # the gate: the recorder follows this pid first
base = libc.mmap(None, 64 * P, RW, PRIV_ANON, -1, 0)
do("mlock", base + 100, 5000, key=[base + 100, 5000])
do("mlock", base, 3 * P, key=[base, 3 * P])
do("mlock2", base + 10 * P, 2 * P, 1, key=[base + 10 * P, 2 * P])
do("munlock", base + P, P, key=[base + P, P])
do("munlock", base + 30 * P, 4 * P, key=[base + 30 * P, 4 * P])
do("mlock", base + 20 * P, 4 * P, key=[base + 20 * P, 4 * P])
do("munmap", base + 21 * P, 2 * P, key=[base + 21 * P, 2 * P])
do("mlock", base + 21 * P, P, key=[base + 21 * P, P])  # the hole just unmapped: ENOMEM, nothing locked
m2 = do("mmap", None, 8 * P, RW, PRIV_ANON | LOCKED, -1, 0, key=[0, 8 * P])
m3 = do("mremap", m2, 8 * P, 16 * P, 1, key=[m2, 8 * P])
do("munmap", m3, 16 * P, key=[m3, 16 * P])
pid = os.fork()
if pid == 0:  # a grandchild: followed through task_newtask, starts with nothing locked
    do("mlock", base + 40 * P, 3 * P, key=[base + 40 * P, 3 * P])
    os._exit(0)
os.waitpid(pid, 0)
do("mlockall", 1, key=[0, 0])
do("munlockall", key=[0, 0])
do("mlock", base, P, key=[base, P])
"""


@pytest.fixture(scope="module")
def pinned_pool():
    d = Path(tempfile.mkdtemp(prefix="moetrace-test-mlock-", dir="/var/tmp"))
    try:
        def mt(*a):
            r = subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *a],
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stderr

        n = 12
        mt("pool", "create", str(d / "pool"), "--layers", "1", "--experts", str(n), "--k", "4",
           "--expert-bytes", "1MiB", "--layout", "files")
        from moetrace.inputs.trace import write_jsonl

        write_jsonl([(i, 0, [(i + j) % n for j in range(4)]) for i in range(6)], d / "t.jsonl")
        mt("plan", "compile", str(d / "t.jsonl"), "--layers", "1", "--experts", str(n), "--k", "4",
           "--expert-bytes", "1MiB", "-o", str(d / "plan.bin"))
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


__all__ = ['PAGE', 'PROBES', 'Path', 'RECORD', 'REPLAY', 'SPEC', 'SRC', '_CHILD', '_calls', '_features', 'json', 'ml', 'mmap', 'np', 'pd', 'pinned_pool', 'pytest', 'random', 're', 'shutil', 'subprocess', 'sys', 'tempfile', 'time']
