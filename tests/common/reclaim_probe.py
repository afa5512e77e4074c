"""The reclaim probe (probes/reclaim.bpf.c and probes/reclaim.bpf.c + toolkit/record/probes/reclaim.py).

Tiers: the C file and its Python side agree (no kernel); it compiles, loads and detaches
(probe_build, needs root); live: a reader in a cgroup v1/v2 memory scope of 64 MiB reads
256 MiB of files three times while the probe is attached — the probe's scanned and
reclaimed totals equal /proc/vmstat's pgscan_{anon,file} / pgsteal_{anon,file} deltas
within 2 %, and memcg limit reclaim is what did it. Measurements run under fcntl.flock on
/tmp/moetrace-io.lock."""


from __future__ import annotations


import ctypes


import fcntl


import os


import re


import subprocess


import sys


import tempfile


import time


from pathlib import Path


import pytest


from moetrace.kernel import bpf


from moetrace.record.probes import reclaim as reclaimrec


from moetrace.probes import PROBES_DIR


from moetrace.record.probes import PROBES


from moetrace.record.probes.reclaim import (FIELDS, GROUPS, HAVE_KNOBS, KINDS, STATS, TIMELINE_FIELDS, ReclaimRecorder,
                                 read_vmstat, reclaim_knobs, resolve_attach, vmstat_delta)


#: probes/reclaim.bpf.c
SRC = reclaimrec.SOURCE.read_text()


from conftest import io_lock as shared_io_lock  # noqa: E402


MiB = 1 << 20


PAGE = os.sysconf("SC_PAGE_SIZE")


def _defines(prefix: str, src: str = SRC) -> list[tuple[str, int]]:
    return [(n, int(i)) for n, i in re.findall(r"^#define %s(\w+) (\d+)" % prefix, src, re.M)]


def _prog_exists(prog_id: int) -> bool:
    """bpf(BPF_PROG_GET_FD_BY_ID): does a program with this id still exist?"""
    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 4)(prog_id, 0, 0, 0)
    fd = libc.syscall(321, 13, ctypes.byref(attr), ctypes.sizeof(attr))  # x86_64 SYS_bpf
    if fd >= 0:
        os.close(fd)
        return True
    return False


def _prog_ids(rec: ReclaimRecorder) -> list[int]:
    """Ids of the attached recorder's programs (either loader)."""
    return [bpf.prog_fdinfo(fd)["prog_id"] for fd in rec.probe.prog_fds().values()]


@pytest.fixture
def io_lock():
    with shared_io_lock():
        yield


@pytest.fixture
def file_set():
    """256 MiB in 8 files under /var/tmp/moetrace-test-*, written, synced and dropped from
    the page cache (so the scoped reader's pages are charged to its memcg). Deleted after."""
    d = Path(tempfile.mkdtemp(prefix="moetrace-test-", dir="/var/tmp"))
    paths = []
    try:
        chunk = os.urandom(4 * MiB)
        for i in range(8):
            p = d / f"f{i}.bin"
            with open(p, "wb") as fh:
                for _ in range(32 * MiB // len(chunk)):
                    fh.write(chunk)
                fh.flush()
                os.fsync(fh.fileno())
            paths.append(p)
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        yield paths
    finally:
        for p in d.glob("*"):
            p.unlink()
        d.rmdir()


READER = r"""
import os, sys
passes = int(sys.argv[1])
n = 0
for _ in range(passes):
    for p in sys.argv[2:]:
        fd = os.open(p, os.O_RDONLY)
        try:
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    break
                n += len(b)
        finally:
            os.close(fd)
print(n)
"""


def _mounted():
    """Features with tracefs mounted when absent (as record does; the session fixture unmounts
    it): resolved without it, every tracepoint reads as unavailable and the test depended on
    an earlier test having mounted it."""
    from moetrace.kernel.features import Features

    return Features(mount=True)


__all__ = ['FIELDS', '_mounted', 'GROUPS', 'HAVE_KNOBS', 'KINDS', 'MiB', 'PAGE', 'PROBES', 'PROBES_DIR', 'Path', 'READER', 'ReclaimRecorder', 'SRC', 'STATS', 'TIMELINE_FIELDS', '_defines', '_prog_exists', '_prog_ids', 'bpf', 'ctypes', 'fcntl', 'file_set', 'io_lock', 'os', 'pytest', 're', 'read_vmstat', 'reclaim_knobs', 'reclaimrec', 'resolve_attach', 'shared_io_lock', 'subprocess', 'sys', 'tempfile', 'time', 'vmstat_delta']
