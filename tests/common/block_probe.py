"""The block probe (probes/block.bpf.c and probes/block.bpf.c + toolkit/record/probes/block.py).

Tiers: the C file and its Python side agree (no kernel); it compiles, loads and detaches
(probe_build, needs root); live: a known workload of 23 experts x 1 MiB read once after
dropping them from the cache — device bytes attributed to experts + unattributed ==
the in-kernel total == /proc/diskstats (sectors read x 512) within 2 %, and each
expert's sectors are read exactly once (1 MiB each). Measurements run under
fcntl.flock on /tmp/moetrace-io.lock."""


from __future__ import annotations


import ctypes


import fcntl


import mmap


import os


import re


import subprocess


import time


from pathlib import Path


import pytest


from moetrace.record.probes import block as blockattr


from moetrace.record.probes.block import BIO_EVENT_DTYPE, BYTES_TP, STATS, BlockRecorder, block_knobs, resolve_attach


from moetrace.kernel.extents import SECTOR, block_device_of, pool_extents


from moetrace.inputs.geometry import Geometry


from moetrace.inputs.pool import create_pool


from moetrace.record.probes import PROBES


#: probes/block.bpf.c
SRC = blockattr.SOURCE.read_text()


from conftest import io_lock as shared_io_lock  # noqa: E402


MiB = 1 << 20


N = 23


def _prog_exists(prog_id: int) -> bool:
    """bpf(BPF_PROG_GET_FD_BY_ID): does a program with this id still exist?"""
    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 4)(prog_id, 0, 0, 0)
    fd = libc.syscall(321, 13, ctypes.byref(attr), ctypes.sizeof(attr))  # x86_64 SYS_bpf
    if fd >= 0:
        os.close(fd)
        return True
    return False


def _bytes_tps() -> list[str]:
    from moetrace.kernel.features import has_tracepoint
    return [t for t in BYTES_TP if has_tracepoint(*t.split(":"))] or list(BYTES_TP)


@pytest.fixture
def io_lock():
    with shared_io_lock():
        yield


def _diskstats_read_bytes(disk: str) -> int:
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if f[2] == disk:
            return int(f[5]) * SECTOR
    raise AssertionError(f"{disk} not in /proc/diskstats")


def _resident_bytes(paths) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(x) for x in out.split())


def _drop(pool) -> None:
    from conftest import drop_pages

    drop_pages(pool.data_paths(), _resident_bytes, tries=5)


def _read_each_once(pool, direct: bool) -> None:
    g = pool.geometry
    buf = mmap.mmap(-1, g.expert_bytes)  # page-aligned: fine for O_DIRECT
    fds: dict[Path, int] = {}
    try:
        for e in range(g.n_total):
            p = pool.path_of(e)
            if p not in fds:
                fds[p] = os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            n = os.preadv(fds[p], [buf], pool.offset_of(e))
            assert n == g.expert_bytes
    finally:
        for fd in fds.values():
            os.close(fd)
        buf.close()


BQ, IO = "block:block_bio_queue", "block:block_io_start"


def _known_workload(tmp_path, layout: str, direct: bool, bytes_tp: str, exact: bool = True) -> None:
    pool = create_pool(tmp_path / "pool", Geometry(n_layers=1, n_experts=N, k=2, expert_bytes=MiB),
                       layout=layout)
    idx = pool_extents(pool)
    assert idx.problems == {} and (idx.bytes_per_expert() == MiB).all()
    disk = idx.device.disk
    _drop(pool)
    rec = BlockRecorder(idx, bytes_tp=bytes_tp, ring_pages=64).open()
    try:
        d0 = _diskstats_read_bytes(disk)
        _read_each_once(pool, direct)
        d1 = _diskstats_read_bytes(disk)
    finally:
        res = rec.close()
    disk_bytes = d1 - d0
    st = res.stats
    print(f"\n{layout} {'O_DIRECT' if direct else 'buffered'} via {res.attach['bytes']}: "
          f"compile+load {rec.load_s:.2f} s attach {rec.attach_s * 1e3:.1f} ms | "
          f"attributed {res.attributed_bytes} unattributed {res.unattributed_bytes} kernel {res.kernel_read_bytes} "
          f"diskstats {disk_bytes} | bios {res.kernel_bios} issues {st['issues']} requeues {st['requeues']} "
          f"completes {st['completes']} matched {st['complete_matched']} lost {res.lost_events} "
          f"recursion_misses {res.recursion_misses} inflight_left {res.inflight_left}")
    print(res.latency.to_string(index=False))
    assert res.lost_events == 0
    # every streamed record reached user space: attributed + unattributed == the in-kernel total
    assert res.attributed_bytes + res.unattributed_bytes == res.streamed_bytes == res.kernel_read_bytes
    # issue - requeue is the second oracle (the bytes the disk was asked for, less the requeued ones)
    assert abs(st["issue_bytes"] - st["requeue_bytes"] - disk_bytes) <= 0.02 * disk_bytes
    # latency histogram: one entry per matched completion
    assert int(res.latency["requests"].sum()) == st["complete_matched"] > 0
    assert st["complete_matched"] <= st["completes"]
    assert all(isinstance(v, int) for v in res.recursion_misses.values())
    per = res.per_expert.set_index("expert_id")
    if not exact:
        assert res.kernel_read_bytes <= disk_bytes * 1.02
        assert (per["device_read_bytes"] <= MiB).all()
        return
    # the in-kernel total == diskstats within 2 % (others' reads on the disk land in both)
    assert abs(res.kernel_read_bytes - disk_bytes) <= 0.02 * disk_bytes
    # each expert's sectors were read exactly once
    assert (per["device_read_bytes"] == MiB).all(), per["device_read_bytes"].tolist()
    assert (per["bios"] >= 1).all()
    if direct:
        assert res.attributed_bytes == N * MiB


class _StalledRecorder(BlockRecorder):
    """Never polls while recording: the ring fills and the kernel counts what it drops."""

    def _poll_loop(self) -> None:
        self._stop.wait()


__all__ = ['BIO_EVENT_DTYPE', 'BQ', 'BYTES_TP', 'BlockRecorder', 'Geometry', 'IO', 'MiB', 'N', 'PROBES', 'Path', 'SECTOR', 'SRC', 'STATS', '_StalledRecorder', '_bytes_tps', '_diskstats_read_bytes', '_drop', '_known_workload', '_prog_exists', '_read_each_once', '_resident_bytes', 'block_knobs', 'block_device_of', 'blockattr', 'create_pool', 'ctypes', 'fcntl', 'io_lock', 'mmap', 'os', 'pool_extents', 'pytest', 're', 'resolve_attach', 'shared_io_lock', 'subprocess', 'time']
