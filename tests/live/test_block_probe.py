"""The block probe (probes/block.bpf.c + toolkit/record/probes/block.py) (live tier)."""

from __future__ import annotations

from common.block_probe import *  # noqa: F401,F403


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
