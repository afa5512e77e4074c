"""The block probe (probes/block.c + toolkit/record/probes/block.py).

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
from moetrace.record.probes.block import BIO_EVENT_DTYPE, BYTES_TP, STATS, BlockRecorder, block_cflags, resolve_attach
from moetrace.kernel.extents import SECTOR, block_device_of, pool_extents
from moetrace.inputs.geometry import Geometry
from moetrace.inputs.pool import create_pool
from moetrace.record.probes import PROBES

SRC = blockattr.SOURCE.read_text()
from conftest import io_lock as shared_io_lock  # noqa: E402
MiB = 1 << 20
N = 23


# -- tier 1: the two sides agree --------------------------------------------------------------

def test_declaration_matches_c_source():
    slots = re.findall(r"#define STAT_(\w+) (\d+)", SRC)
    assert [int(i) for _, i in slots] == list(range(len(slots)))
    assert [n.lower() for n, _ in slots] == list(STATS)
    assert int(re.search(r"#define N_STATS (\d+)", SRC).group(1)) == len(STATS)
    assert int(re.search(r"#define HIST_SLOTS (\d+)", SRC).group(1)) == blockattr.HIST_SLOTS
    body = re.search(r"struct bio_event \{(.*?)\};", SRC, re.S).group(1)
    fields = re.findall(r"^\s*(u\d+)\s+(\w+);", body, re.M)
    assert [f for _, f in fields] == list(BIO_EVENT_DTYPE.names)
    assert [int(t[1:]) // 8 for t, _ in fields] == [BIO_EVENT_DTYPE[n].itemsize for n in BIO_EVENT_DTYPE.names]
    spec = PROBES["block"]
    # every attach candidate's function exists, and the bytes candidates are the MOE_BYTES_TP choices
    for g in spec.attach:
        for c in g.candidates:
            assert re.search(r"^int %s\(struct tracepoint__%s \*args\)" % (c.fn_name, c.target.replace(":", "__")),
                             SRC, re.M), c
            assert c.fn_name == "tp_" + c.target.split(":", 1)[1]  # blockattr derives fn names so
    assert {c.target for c in spec.group("bytes").candidates} == set(BYTES_TP)
    # every knob (declared or set by blockattr) has a default: compilable as is
    knobs = {k.name for k in spec.knobs} | {f[2:].split("=")[0] for f in block_cflags(0, 2)}
    for k in knobs:
        assert f"#ifndef {k}\n#define {k} " in SRC, k
    assert "{" + "{" not in SRC and "%s" not in SRC  # -D only, no templates


def test_cflags_are_checked():
    assert block_cflags(254 << 20, 1, 64) == ["-DMOE_DEV=266338304", "-DMOE_BYTES_TP=1", "-DMOE_RINGBUF_PAGES=64",
                                              "-DMOE_STREAM_BIOS=1", "-DMOE_MAX_INFLIGHT=65536"]
    with pytest.raises(ValueError):
        block_cflags(0, 1, ring_pages=100)


# -- tier 2: probe build ----------------------------------------------------------------------

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


@pytest.mark.probe_build
@pytest.mark.parametrize("bytes_tp", list(BYTES_TP))
def test_block_probe_compiles_loads_and_detaches(live, bytes_tp):
    if bytes_tp not in _bytes_tps():
        pytest.skip(f"no tracepoint {bytes_tp} on this kernel")
    dev = block_device_of("/tmp").tp_dev if os.path.exists("/tmp") else 0
    t0 = time.perf_counter()
    rec = BlockRecorder(dev=dev, bytes_tp=bytes_tp).open()
    took = time.perf_counter() - t0
    try:
        ids = [blockattr.prog_fdinfo(f.fd)["prog_id"] for f in rec.bpf.funcs.values()]
        assert len(ids) == 4 and all(_prog_exists(i) for i in ids)
        assert len(rec.bpf[b"stats"]) == len(STATS)
    finally:
        res = rec.close()
    print(f"\nblock probe ({bytes_tp}): compile+load {rec.compile_s:.2f} s, attach {rec.attach_s * 1e3:.1f} ms, "
          f"open() {took:.2f} s")
    assert not any(_prog_exists(i) for i in ids), "programs still loaded after close()"
    assert res is not None and res.lost_events == 0


@pytest.mark.probe_build
def test_block_probe_compiles_as_is(live):
    """No -D flags at all: every knob has a default."""
    bcc = __import__("bcc")
    from moetrace.probes import PROBES_DIR

    b = bcc.BPF(src_file=str(blockattr.SOURCE).encode(), cflags=[f"-I{PROBES_DIR}", *blockattr.QUIET_CFLAGS])
    try:
        for fn in (b"tp_block_bio_queue", b"tp_block_rq_issue", b"tp_block_rq_complete", b"tp_block_rq_requeue"):
            b.load_func(fn, bcc.BPF.TRACEPOINT)
    finally:
        b.cleanup()


@pytest.mark.probe_build
def test_attach_resolved_from_declaration(live):
    plan = resolve_attach()
    assert plan["bytes"] in BYTES_TP
    assert plan["bytes"] == _bytes_tps()[0]  # the first available candidate wins
    assert plan["rq_issue"] == "block:block_rq_issue"


@pytest.mark.probe_build
def test_detaches_on_exception(live):
    with pytest.raises(RuntimeError, match="boom"):
        with BlockRecorder(dev=0) as rec:
            ids = [blockattr.prog_fdinfo(f.fd)["prog_id"] for f in rec.bpf.funcs.values()]
            raise RuntimeError("boom")
    assert rec.bpf is None and rec.result is not None
    assert not any(_prog_exists(i) for i in ids)


# -- tier 3: live, a known workload -----------------------------------------------------------

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
    paths = pool.data_paths()
    for _ in range(5):
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        if _resident_bytes(paths) == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"pool still resident after DONTNEED: {_resident_bytes(paths)} bytes")


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


@pytest.mark.live
@pytest.mark.parametrize("layout,direct", [("files", True), ("files", False), ("pool", True), ("pool", False)],
                         ids=["files-direct", "files-buffered", "pool-direct", "pool-buffered"])
def test_known_workload_bytes_per_expert(live, io_lock, tmp_path, layout, direct):
    """Counting at block_bio_queue: every bio once, with its full size."""
    _known_workload(tmp_path, layout, direct, BQ)


@pytest.mark.live
@pytest.mark.parametrize("layout,direct", [("files", True), ("pool", False)], ids=["files-direct", "pool-buffered"])
def test_known_workload_io_start_never_overcounts(live, io_lock, tmp_path, layout, direct):
    """block_io_start fires when a request is created, with its first bio's size: bios
    plug-merged into the request afterwards are not seen (measured here: up to -4.3 % on
    buffered pool-file reads in 17 of 30 runs, bio_queue exact in 60 of 60). It never
    over-counts; attribution of what it sees stays consistent."""
    if IO not in _bytes_tps():
        pytest.skip(f"no tracepoint {IO} on this kernel")
    _known_workload(tmp_path, layout, direct, IO, exact=False)


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
          f"compile+load {rec.compile_s:.2f} s attach {rec.attach_s * 1e3:.1f} ms | "
          f"attributed {res.attributed_bytes} unattributed {res.unattributed_bytes} kernel {res.kernel_read_bytes} "
          f"diskstats {disk_bytes} | bios {res.kernel_bios} issues {st['issues']} requeues {st['requeues']} "
          f"completes {st['completes']} matched {st['complete_matched']} lost {res.lost_events} "
          f"recursion_misses {res.recursion_misses} inflight_left {res.inflight_left}")
    print(res.latency.to_string(index=False))
    assert res.lost_events == 0
    # every streamed record reached user space: attributed + unattributed == the in-kernel total
    assert res.attributed_bytes + res.unattributed_bytes == res.streamed_bytes == res.kernel_read_bytes
    # issue - requeue is the second oracle (environment.md)
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


@pytest.mark.live
def test_ring_overflow_is_counted(live, io_lock, tmp_path):
    p = tmp_path / "small.bin"
    p.write_bytes(os.urandom(8 * MiB))
    dev = block_device_of(p)
    fd = os.open(p, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    rec = _StalledRecorder(dev=dev.tp_dev, bytes_tp=BQ, ring_pages=1).open()
    try:
        buf = mmap.mmap(-1, 4096)
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            for off in range(0, 8 * MiB, 4096):  # 2048 bios; a one-page ring holds ~170 records
                os.preadv(fd, [buf], off)
        finally:
            os.close(fd)
            buf.close()
    finally:
        res = rec.close()
    print(f"\nstalled ring: bios {res.kernel_bios} streamed {res.streamed_bios} lost {res.lost_events}")
    assert res.lost_events > 0
    assert res.kernel_bios == res.streamed_bios + res.lost_events
    assert res.streamed_bytes < res.kernel_read_bytes
    assert res.unattributed_bytes == res.streamed_bytes  # no index: nothing attributed
