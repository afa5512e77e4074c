"""The reads probe (probes/reads.bpf.c + moetrace.record.probes.reads).

No kernel: attribution of fd identities to experts (files and pool layouts, unattributed
sources), tables against the declaration, the /proc fd resolver on a fake tree, the
replay oracle. Probe build: compiles, loads and detaches with the knob sets the recorder
uses. Live: a psync replay of a 23 x 1 MiB pool against the replay's own log (calls and
bytes exactly, per pass by the iteration log's time windows), cold misses of 256 pages
per expert and all-hit second passes, added pages equal to the pagecache probe's, chunked
reads, fd reuse / errors / read() / forks from a script that counts its own calls, and
`moetrace record --probes pagecache,reads -- replay ...` end to end.
"""


from __future__ import annotations


import json


import mmap


import os


import subprocess


import sys


import textwrap


from pathlib import Path


import numpy as np


import pandas as pd


import pytest


from moetrace.run import directory as rundir


from moetrace.record.spec import resolve


from moetrace.record.probes import PROBES
from moetrace.kernel.syscalls import kernel_dev
from moetrace.record.poolmap import PoolMap


from moetrace.record.probes.reads import (CLASSES, FD_FIELDS, HIST_SLOTS, NOPOS, READ_CALL_DTYPE, SYSCALLS, UNATTRIBUTED,
                               Collected,
                               FdPaths, Resolution, build, calls_table, reads_knobs,
                               replay_oracle)


SPEC = PROBES["reads"]


N, MIB = 23, 1 << 20


PAGES = MIB // mmap.PAGESIZE


BIN = Path(sys.executable).parent


RECORD = [sys.executable, "-c", "from moetrace.cli import main; main()", "record"]


REPLAY = [sys.executable, "-m", "moetrace.cli.replay"]


from conftest import io_lock  # noqa: E402


from common.record import _drop  # noqa: E402  (fadvise DONTNEED, then mincore: 0 pages resident)


FILES_POOL = PoolMap({100 + i: (i, 1) for i in range(4)}, dev=(8 << 20) | 1, extent_bytes=MIB, n_total=4,
                       n_experts=2)


ONE_FILE_POOL = PoolMap({200: (0, 4)}, dev=(8 << 20) | 1, extent_bytes=MIB, n_total=4, n_experts=2)


def _fd_row(tgid, fd, gen, epoch, chunk, calls, hit, miss, err, added, ino=0, dev=0, nbytes=None, by=None):
    """One `fds` row; ``by``: the kernel's ino_by (1: the fd table, 2: an added page; default: 1
    when ``ino`` is given)."""
    v = {f: 0 for f in FD_FIELDS}
    nbytes = calls * MIB if nbytes is None else nbytes
    v.update(calls=calls, bytes=nbytes, requested_bytes=calls * MIB, hit_calls=hit, hit_bytes=hit * MIB,
             hit_latency_ns=hit * 1000, miss_calls=miss, miss_bytes=miss * MIB, miss_latency_ns=miss * 50_000,
             error_calls=err, error_latency_ns=err * 10, added_pages=added, ino=ino, dev=dev,
             ino_by=(1 if ino else 0) if by is None else by)
    return {"tgid": tgid, "fd": fd, "gen": gen, "epoch": epoch, "chunk": chunk, **v}


def _collected(rows, hist_rows=(), stream=None):
    fds = pd.DataFrame(rows, columns=["tgid", "fd", "gen", "epoch", "chunk", *FD_FIELDS])
    fds["chunk"] = fds["chunk"].astype("uint64")
    fh = pd.DataFrame(list(hist_rows), columns=["tgid", "fd", "gen", "epoch", "cls", "slot", "calls"])
    hist = np.zeros((3, HIST_SLOTS), np.int64)
    for r in hist_rows:
        hist[r[4], r[5]] += r[6]
    hist[0, 3] += 5  # calls only the all-calls histogram saw (e.g. a full per-fd histogram map)
    classes = {c: {"calls": 0, "bytes": 0, "requested_bytes": 0, "added_pages": 0, "beyond_pages": 0,
                   "other_pages": 0, "latency_ns": 0} for c in CLASSES}
    stats = {s: 0 for s in SPEC.stats}
    overflow = {f: 0 for f in FD_FIELDS}
    overflow.update(calls=2, bytes=10)
    bad_fd = {f: 0 for f in FD_FIELDS}
    bad_fd.update(calls=3, error_calls=3, error_latency_ns=30)
    return Collected(classes, hist, fds, fh, overflow, stats, bad_fd=bad_fd, stream=stream)


KNOB_SETS = {
    "default": {},
    "pool-stream": dict(MOE_EXTENT=MIB, MOE_STREAM=1),
    "minimal": dict(MOE_HAVE_PREADV=0, MOE_HAVE_PREADV2=0, MOE_HAVE_READ=0, MOE_TRACK_CLOSE=0,
                    MOE_TRACK_CLOSE_RANGE=0, MOE_TRACK_EXEC=0, MOE_FOLLOW_FORKS=0, MOE_HAVE_ORDER=0),
}


def _moetrace(*args: str) -> None:
    r = subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *args],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    from conftest import make_expert_pools

    return make_expert_pools(tmp_path_factory.mktemp("reads"), N)


def _record(out: Path, cmd: list[str], *opts: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*RECORD, "--out", str(out), *opts, "--", *cmd], capture_output=True, text=True,
                          timeout=timeout)


def _replay_log(run: Path) -> tuple[dict, pd.DataFrame]:
    rep = run / "replay"
    return json.loads((rep / "replay.json").read_text()), pd.read_parquet(rep / "iterations.parquet")


__all__ = ['BIN', 'CLASSES', 'Collected', 'FD_FIELDS', 'FILES_POOL', 'FdPaths', 'HIST_SLOTS', 'KNOB_SETS', 'MIB', 'N', 'NOPOS', 'ONE_FILE_POOL', 'PAGES', 'PROBES', 'Path', 'PoolMap', 'READ_CALL_DTYPE', 'RECORD', 'REPLAY', 'Resolution', 'SPEC', 'SYSCALLS', 'UNATTRIBUTED', '_collected', '_drop', '_fd_row', '_moetrace', '_record', '_replay_log', 'build', 'calls_table', 'io_lock', 'json', 'kernel_dev', 'mmap', 'np', 'os', 'pd', 'pools', 'pytest', 'reads_knobs', 'replay_oracle', 'resolve', 'rundir', 'subprocess', 'sys', 'textwrap']
