"""`moetrace record` with the pagecache probe.

No-kernel tier: run directory helpers, privilege refusal, attach-plan resolution
against fake features, requested-page accounting. Live tier (root + BPF): the
issue's acceptance 1 (23 experts x 1 MiB, files and pool layouts, cold then
hot), exact per-page re-adds, exit-status propagation, SIGINT/SIGTERM.
"""


from __future__ import annotations


from common import read_run
import ctypes


import json


import mmap


import os


import signal


import subprocess


import sys


import time


from pathlib import Path


import pytest


from moetrace.kernel import bpf


from moetrace.run import directory as rundir


from moetrace.kernel.syscalls import kernel_dev
from moetrace.record.recorder import pool_from_command


N, MIB = 23, 1 << 20


PAGES = MIB // mmap.PAGESIZE


RECORD = [sys.executable, "-c", "from moetrace.cli.record import record; record.main(prog_name='moetrace record')"]


REPLAY = [sys.executable, "-m", "moetrace.cli.replay"]


from conftest import io_lock as _io_lock  # noqa: E402


def _resident_pages(path: Path) -> int:
    """Resident pages of a file by mincore(2): the independent oracle (what fincore does)."""
    return _resident_pages_range(path)


def _resident_pages_range(path: Path, first: int = 0, n: int | None = None) -> int:
    """Resident pages of ``n`` pages of a file from page ``first`` (default: to the end), by mincore(2)."""
    from moetrace.kernel.syscalls import resident_pages

    return resident_pages(path, first, n)


def _drop(pool_dir: Path) -> None:
    """Drop a pool's pages from the page cache (fadvise DONTNEED) and check it."""
    files = sorted(pool_dir.rglob("*.bin"))
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a pool just written) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = sum(_resident_pages(p) for p in files)
    assert left == 0, f"{left} pool pages still resident after DONTNEED"


def _moetrace(*args, check=True):
    r = subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *args],
                       capture_output=True, text=True)
    if check and r.returncode:
        raise AssertionError(r.stderr)
    return r


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    from conftest import make_expert_pools

    return make_expert_pools(tmp_path_factory.mktemp("rec"), N)


def _record(out: Path, cmd: list[str], *opts: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*RECORD, "--out", str(out), *opts, "--", *cmd], capture_output=True, text=True,
                          timeout=timeout)


def _experts(run: Path):
    doc, tables = read_run(run)
    df = tables["experts"]
    return doc, df[df["kind"] == "expert"].reset_index(drop=True), df[df["kind"] == "unattributed"].iloc[0]


def _trace_mounts() -> list[tuple[str, str]]:
    """(fstype, target) of every tracefs and debugfs mount."""
    out = []
    for line in Path("/proc/mounts").read_text().splitlines():
        f = line.split()
        if f[2] in ("tracefs", "debugfs"):
            out.append((f[2], f[1]))
    return out


__all__ = ['MIB', 'N', 'PAGES', 'Path', 'RECORD', 'REPLAY', '_drop', '_experts', '_io_lock', '_moetrace', '_record', '_resident_pages', '_resident_pages_range', '_trace_mounts', 'bpf', 'ctypes', 'json', 'kernel_dev', 'mmap', 'os', 'pool_from_command', 'pools', 'pytest', 'rundir', 'signal', 'subprocess', 'sys', 'time']
