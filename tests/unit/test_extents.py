"""FIEMAP extents -> disk sectors -> expert (toolkit/kernel/extents.py).

No kernel probes: FIEMAP on files we create needs only read access; the sector index
is checked on inline tables; partitions and stacked devices on fake /sys trees."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from moetrace.errors import InputError
from moetrace.kernel.extents import (FIEMAP_EXTENT_LAST, SECTOR, BlockDevice, ExpertExtents, block_device_for,
                              block_device_of, fiemap, flag_names, pool_extents, tp_dev, tp_dev_split)
from moetrace.inputs.geometry import Geometry
from moetrace.inputs.pool import create_pool


def _fiemap_or_skip(path: Path):
    try:
        return fiemap(path)
    except InputError as e:
        pytest.skip(f"filesystem of {path} has no FIEMAP: {e}")


def _block_or_skip(path: Path) -> BlockDevice:
    try:
        return block_device_of(path)
    except InputError as e:
        pytest.skip(f"{path} is not on a plain disk: {e}")


def test_tp_dev_encoding():
    assert tp_dev(254, 0) == 254 << 20
    assert tp_dev(8, 17) == (8 << 20) | 17
    assert tp_dev_split(tp_dev(259, 3)) == (259, 3)
    assert flag_names(0x801) == ["last", "unwritten"]


def test_fiemap_covers_a_synced_file(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(3 << 20))
    ext = _fiemap_or_skip(p)
    assert ext and ext[-1].flags & FIEMAP_EXTENT_LAST
    assert sum(x.length for x in ext) >= 3 << 20
    assert ext[0].logical == 0
    # contiguous logical coverage, no delalloc after FIEMAP_FLAG_SYNC
    for a, b in zip(ext, ext[1:]):
        assert a.logical + a.length == b.logical
    assert not any("delalloc" in x.flag_names for x in ext)


def test_fiemap_loops_over_many_extents(tmp_path):
    # a sparse file: every other 4 KiB block written -> hundreds of extents (> one ioctl batch)
    p = tmp_path / "sparse.bin"
    with open(p, "wb") as fh:
        for i in range(600):
            fh.seek(i * 8192)
            fh.write(b"x" * 4096)
    ext = _fiemap_or_skip(p)
    assert len(ext) == 600
    assert [x.logical for x in ext] == [i * 8192 for i in range(600)]
    assert ext[-1].flags & FIEMAP_EXTENT_LAST and not any(x.flags & FIEMAP_EXTENT_LAST for x in ext[:-1])


@pytest.mark.parametrize("layout", ["files", "pool"])
def test_pool_ranges_cover_exactly_the_expert_bytes(tmp_path, layout):
    g = Geometry(n_layers=1, n_experts=23, k=2, expert_bytes=1 << 20)
    pool = create_pool(tmp_path / "pool", g, layout=layout)
    _fiemap_or_skip(pool.data_paths()[0])
    dev = _block_or_skip(pool.data_paths()[0])
    idx = pool_extents(pool)
    assert idx.device == dev and idx.problems == {}
    assert (idx.bytes_per_expert() == 1 << 20).all()
    assert set(idx.experts.tolist()) == set(range(23))
    # sorted, disjoint, every interval start maps back to its expert
    assert (idx.starts[1:] >= idx.ends[:-1]).all()
    assert (idx.lookup(idx.starts) == idx.experts).all()
    assert (idx.lookup(idx.ends - 1) == idx.experts).all()
    # the sectors agree with FIEMAP of the expert's bytes (partition start added)
    for e in (0, 11, 22):
        ext = fiemap(pool.path_of(e))
        off = pool.offset_of(e)
        x = next(x for x in ext if x.logical <= off < x.logical + x.length)
        sector = dev.part_start + (x.physical + off - x.logical) // SECTOR
        assert idx.lookup(sector)[0] == e
    # a bio covering the whole expert attributes exactly its bytes
    for e in range(23):
        m = idx.experts == e
        by, bios, un = idx.attribute(idx.starts[m], idx.ends[m] - idx.starts[m])
        assert by[e] == 1 << 20 and by.sum() == 1 << 20 and un == 0 and bios[e] == m.sum()


def test_pool_layout_padding_is_unattributed(tmp_path):
    eb = (1 << 20) + 1000  # not page-aligned: extents are padded to 1 MiB + 4 KiB
    g = Geometry(n_layers=1, n_experts=5, k=1, expert_bytes=eb)
    pool = create_pool(tmp_path / "pool", g, layout="pool")
    _fiemap_or_skip(pool.data_paths()[0])
    _block_or_skip(pool.data_paths()[0])
    idx = pool_extents(pool)
    want = -(-eb // SECTOR) * SECTOR  # the last partial sector belongs to the expert
    assert (idx.bytes_per_expert() == want).all()


def test_inline_index_lookup_and_split():
    # expert 0: sectors [100, 200) and [300, 400) ; expert 1: [200, 300) ; expert 2: [1000, 1008)
    idx = ExpertExtents.from_ranges([(100, 100, 0), (300, 100, 0), (200, 100, 1), (1000, 8, 2)], n_total=4,
                                    n_experts=2)
    # [100,200) and [200,300) are adjacent but of different experts: not merged
    assert idx.starts.tolist() == [100, 200, 300, 1000]
    assert idx.lookup(np.array([0, 99, 100, 199, 200, 299, 300, 399, 400, 999, 1000, 1007, 1008])).tolist() == \
        [-1, -1, 0, 0, 1, 1, 0, 0, -1, -1, 2, 2, -1]
    assert idx.lookup(150).tolist() == [0]
    sec = np.array([90, 150, 250, 395, 1004, 5000])
    nr = np.array([20, 200, 10, 10, 8, 4])
    by, bios, un = idx.attribute(sec, nr)
    # bio 0: 10 unattributed + 10 of e0 ; bio 1: 50 e0 + 100 e1 + 50 e0 ; bio 2: 10 e1 ;
    # bio 3: 5 e0 + 5 unattr ; bio 4: 4 e2 + 4 unattr ; bio 5: 4 unattr
    assert by.tolist() == [(10 + 100 + 5) * SECTOR, 110 * SECTOR, 4 * SECTOR, 0]
    assert un == (10 + 5 + 4 + 4) * SECTOR
    assert by.sum() + un == nr.sum() * SECTOR
    # bio 1 touches e0 twice but counts once for it
    assert bios.tolist() == [3, 2, 1, 0]
    df = idx.to_frame()
    assert df["layer"].tolist() == [0, 0, 0, 1] and df["expert"].tolist() == [0, 1, 0, 0]


def test_inline_index_merges_and_refuses_overlap():
    idx = ExpertExtents.from_ranges([(0, 8, 3), (8, 8, 3), (16, 0, 1)], n_total=4)
    assert idx.starts.tolist() == [0] and idx.ends.tolist() == [16]
    assert idx.sectors_of(3) == 16
    with pytest.raises(InputError, match="overlap"):
        ExpertExtents.from_ranges([(0, 10, 0), (5, 10, 1)], n_total=2)
    empty = ExpertExtents.from_ranges([], n_total=2)
    assert empty.lookup([1, 2]).tolist() == [-1, -1]
    by, bios, un = empty.attribute(np.array([1]), np.array([8]))
    assert by.sum() == 0 and un == 8 * SECTOR


def _fake_sysfs(root: Path, partitioned: bool, stacked: bool = False) -> None:
    disk = root / "sys/devices/pci0000:00/virtio0/block/sda"
    disk.mkdir(parents=True)
    (disk / "dev").write_text("8:0\n")
    (disk / "slaves").mkdir()
    if stacked:
        (disk / "slaves" / "vdb").mkdir()
    links = root / "sys/dev/block"
    links.mkdir(parents=True)
    os.symlink("../../devices/pci0000:00/virtio0/block/sda", links / "8:0")
    if partitioned:
        part = disk / "sda2"
        part.mkdir()
        (part / "dev").write_text("8:2\n")
        (part / "partition").write_text("2\n")
        (part / "start").write_text("411648\n")
        os.symlink("../../devices/pci0000:00/virtio0/block/sda/sda2", links / "8:2")


def test_partition_start_and_disk_device(tmp_path):
    _fake_sysfs(tmp_path, partitioned=True)
    bd = block_device_for(8, 2, root=tmp_path)
    assert (bd.disk, bd.disk_major, bd.disk_minor, bd.part_start) == ("sda", 8, 0, 411648)
    assert bd.fs_name == "sda2" and bd.partitioned and bd.tp_dev == 8 << 20
    whole = block_device_for(8, 0, root=tmp_path)
    assert whole.part_start == 0 and not whole.partitioned and whole.disk == "sda"
    with pytest.raises(InputError, match="not a block device"):
        block_device_for(0, 42, root=tmp_path)


def test_stacked_device_is_refused(tmp_path):
    _fake_sysfs(tmp_path, partitioned=False, stacked=True)
    with pytest.raises(InputError, match="stacked"):
        block_device_for(8, 0, root=tmp_path)


def test_partition_start_shifts_pool_sectors(tmp_path):
    g = Geometry(n_layers=1, n_experts=3, k=1, expert_bytes=64 << 10)
    pool = create_pool(tmp_path / "pool", g, layout="files")
    _fiemap_or_skip(pool.data_paths()[0])
    plain = pool_extents(pool, device=BlockDevice(8, 0, "sda", "sda", 8, 0, 0))
    shifted = pool_extents(pool, device=BlockDevice(8, 2, "sda2", "sda", 8, 0, 411648))
    assert (shifted.starts - plain.starts == 411648).all()
    assert shifted.device.tp_dev == 8 << 20
