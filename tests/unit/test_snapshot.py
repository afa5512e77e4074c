"""No-kernel tests of the snapshot readers, scopes, balloon sizing and the capacity table (fake trees)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moetrace.analyses.capacity_response import compute_capacity_table, plot_capacity, reference_curve
from moetrace.capacity.scope import MemoryController, Scope, balloon_size, find_memory_controller, remove_stale_scopes
from moetrace.errors import InputError, UsageError
from moetrace.kernel.procfs import (KernelLog, block_device, device_of, parse_kmsg, parse_lru_gen, read_diskstats,
                               read_lru_gen, read_meminfo, read_psi, read_vmlck, read_vmstat, take_snapshot)

DISKSTATS = """\
   7       0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
 254       0 vda 27501 5860 2201058 14324 25747 48184 5716360 19924 0 12212 35958 25423 14 3925344 1647 1866 60
 254       1 vda1 100 0 800 4 0 0 0 0 0 4 4
"""

LRU_GEN_61 = """\
memcg     1 /
 node     0
          0      65272          0           0
          3      65272       5072       36786
memcg     2 /moe
 node     0
         10       1924          0           0
         11       1924          0       29492
         12       1564          0       37934
         13       1224          0       29223
"""


def fake_tree(root: Path) -> Path:
    """A fake /proc, /sys and /dev under root."""
    (root / "proc/pressure").mkdir(parents=True)
    (root / "proc/diskstats").write_text(DISKSTATS)
    (root / "proc/vmstat").write_text("nr_free_pages 100\npgpgin 2048\nworkingset_refault_file 7\n")
    (root / "proc/meminfo").write_text("MemTotal:       24731184 kB\nMemAvailable:    4194304 kB\n"
                                       "Mlocked:            9144 kB\nHugePages_Total:       0\n")
    (root / "proc/pressure/memory").write_text("some avg10=1.50 avg60=0.25 avg300=0.00 total=1234\n"
                                              "full avg10=0.00 avg60=0.00 avg300=0.00 total=99\n")
    (root / "proc/pressure/io").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=5\n")
    (root / "proc/4242").mkdir()
    (root / "proc/4242/status").write_text("Name:\treplay\nVmLck:\t  524288 kB\nVmRSS:\t 600000 kB\n")
    (root / "sys/kernel/debug").mkdir(parents=True)
    (root / "sys/kernel/debug/lru_gen").write_text(LRU_GEN_61)
    (root / "proc/mounts").write_text(
        "/dev/vda / ext4 rw,relatime 0 0\n"
        "debugfs /sys/kernel/debug debugfs rw 0 0\n"
        "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n")
    (root / "sys/fs/cgroup/unified").mkdir(parents=True)
    (root / "sys/fs/cgroup/unified/cgroup.controllers").write_text("hugetlb\n")
    (root / "sys/fs/cgroup/memory").mkdir(parents=True)
    (root / "dev").mkdir()
    (root / "dev/kmsg").write_text(
        "6,100,1000,-;EXT4-fs (vda): mounted filesystem\n"
        " SUBSYSTEM=block\n"
        "4,101,2000,-;replay invoked oom-killer: gfp_mask=0xcc0, order=0\n"
        "3,102,3000,-;Memory cgroup out of memory: Killed process 77 (python)\n")
    return root


def test_diskstats_vmstat_meminfo_psi(tmp_path):
    root = fake_tree(tmp_path)
    ds = read_diskstats(root)
    assert ds["vda"]["sectors_read"] == 2201058 and ds["vda"]["flush_ms"] == 60
    assert ds["vda1"]["sectors_read"] == 800 and "discards_completed" not in ds["vda1"]  # 11-field line
    assert read_diskstats(root, "vda")["reads_completed"] == 27501
    with pytest.raises(InputError, match="nvme0n1"):
        read_diskstats(root, "nvme0n1")
    assert read_vmstat(root) == {"nr_free_pages": 100, "pgpgin": 2048, "workingset_refault_file": 7}
    mi = read_meminfo(root)
    assert mi["MemTotal_bytes"] == 24731184 * 1024 and mi["Mlocked_bytes"] == 9144 * 1024
    assert mi["HugePages_Total"] == 0
    psi = read_psi(root)
    assert psi["memory"]["some"] == {"avg10": 1.5, "avg60": 0.25, "avg300": 0.0, "total_us": 1234}
    assert psi["memory"]["full"]["total_us"] == 99 and "cpu" not in psi
    assert read_vmlck(4242, root) == 524288 * 1024
    assert read_vmlck(999999, root) is None


def test_lru_gen_parse_real_sample(tmp_path):
    rows = parse_lru_gen(LRU_GEN_61)
    assert len(rows) == 6
    assert rows[0] == {"memcg_id": 1, "memcg_path": "/", "node": 0, "seq": 0, "age_ms": 65272,
                       "nr_anon": 0, "nr_file": 0}
    moe = [r for r in rows if r["memcg_path"] == "/moe"]
    assert [r["seq"] for r in moe] == [10, 11, 12, 13]
    assert sum(r["nr_file"] for r in moe) == 29492 + 37934 + 29223
    root = fake_tree(tmp_path)
    assert read_lru_gen(root) == rows  # found through the fake /proc/mounts debugfs line
    (root / "proc/mounts").write_text("/dev/vda / ext4 rw 0 0\n")
    assert read_lru_gen(root) is None  # no debugfs mounted: absent, not empty


def test_kmsg_since_mark(tmp_path):
    root = fake_tree(tmp_path)
    recs = parse_kmsg((root / "dev/kmsg").read_text())
    assert [r.seq for r in recs] == [100, 101, 102]  # continuation line skipped
    log = KernelLog(root)
    assert log.source == "kmsg" and log.mark == 102 and log.since() == []
    with open(root / "dev/kmsg", "a") as fh:
        fh.write("4,103,4000,-;python invoked oom-killer: gfp_mask=0xcc0\n6,104,4100,-;eth0: link up\n")
    assert log.since() == ["python invoked oom-killer: gfp_mask=0xcc0"]
    assert [r.seq for r in log.records()] == [103, 104]


def _fake_block(root: Path, major: int, minor: int, partition: bool) -> None:
    disk = root / "sys/devices/pci0000:00/virtio1/block/vdz"
    (disk / "vdz1").mkdir(parents=True)
    (disk / "vdz1/partition").write_text("1\n")
    (root / "sys/dev/block").mkdir(parents=True)
    target = disk / "vdz1" if partition else disk
    os.symlink(os.path.relpath(target, root / "sys/dev/block"), root / f"sys/dev/block/{major}:{minor}")


def test_device_of_fake_sys(tmp_path):
    f = tmp_path / "data.bin"
    f.write_bytes(b"x")
    st = os.stat(f)
    fake = tmp_path / "fake"
    _fake_block(fake, os.major(st.st_dev), os.minor(st.st_dev), partition=True)
    d = device_of(f, fake)
    assert (d.name, d.disk, d.major, d.minor) == ("vdz1", "vdz", os.major(st.st_dev), os.minor(st.st_dev))
    fake2 = tmp_path / "fake2"
    _fake_block(fake2, 9, 3, partition=False)
    assert block_device(9, 3, fake2).name == block_device(9, 3, fake2).disk == "vdz"
    with pytest.raises(InputError, match="tmpfs"):
        block_device(0, 51, fake2)


def test_take_snapshot_fake(tmp_path):
    root = fake_tree(tmp_path)
    s = take_snapshot("loop_entry", root, device="vda", pids={"replay": 4242, "gone": 999999})
    assert s["diskstats"]["sectors_read"] == 2201058
    assert s["vmlck_bytes"] == {"replay": 524288 * 1024, "gone": None}
    assert s["lru_gen"][-1]["nr_file"] == 29223 and s["psi"]["io"]["some"]["total_us"] == 5


def test_memory_controller_and_stale_scopes(tmp_path):
    root = fake_tree(tmp_path)
    c = find_memory_controller(root)
    assert c.version == 1 and c.mount == str(root / "sys/fs/cgroup/memory")  # v2 lacks "memory"
    (root / "sys/fs/cgroup/unified/cgroup.controllers").write_text("cpu memory pids\n")
    assert find_memory_controller(root).version == 2
    # stale scopes: a dead owner's scope is removed, a live owner's is kept, others untouched
    mc = MemoryController(1, str(root / "sys/fs/cgroup/memory"))
    owners = tmp_path / "owners"
    owners.mkdir()
    for n in ("moetrace-dead", "moetrace-live", "other"):
        (Path(mc.mount) / n).mkdir()
    (owners / "moetrace-dead.pid").write_text("999999 1\n")
    (owners / "moetrace-live.pid").write_text(f"{os.getppid()} None\n")
    assert remove_stale_scopes(None, mc, str(owners)) == [str(Path(mc.mount) / "moetrace-dead")]
    assert sorted(os.listdir(mc.mount)) == ["moetrace-live", "other"]
    assert not (owners / "moetrace-dead.pid").exists()
    # the named scope goes whoever owns it
    assert remove_stale_scopes("live", mc, str(owners)) == [str(Path(mc.mount) / "moetrace-live")]
    assert Scope("x", mc, str(owners)).name == "moetrace-x"
    with pytest.raises(UsageError):
        Scope("a/b", mc)


def test_balloon_size_and_reserve(tmp_path):
    root = fake_tree(tmp_path)  # MemAvailable 4 GiB, MemTotal ~23.6 GiB -> reserve 1 GiB + 1.18 GiB
    size, facts = balloon_size(3 << 30, 64 << 20, root)
    assert size == (4 << 30) - (3 << 30) - (64 << 20)
    assert facts["reserve_bytes"] == (1 << 30) + 24731184 * 1024 // 20
    with pytest.raises(UsageError, match="safe reserve"):
        balloon_size(512 << 20, 64 << 20, root)
    with pytest.raises(UsageError, match="negative balloon"):
        balloon_size(8 << 30, 0, root)


@pytest.mark.parametrize("total, want", [
    (24731184 << 10, (1 << 30) + (24731184 << 10) // 20),   # this host: 1 GiB + 5%, as always
    (16 << 30, (1 << 30) + (16 << 30) // 20),               # from 16 GiB up: 1 GiB + 5%
    (4 << 30, (256 << 20) + (4 << 30) // 20),               # a 4 GiB lab guest: 256 MiB + 5%
    (2 << 30, (256 << 20) + (2 << 30) // 20),               # never below 256 MiB + 5%
    (8 << 30, (512 << 20) + (8 << 30) // 20)])              # MemTotal / 16 between
def test_safe_reserve_fits_the_machine(total, want):
    from moetrace.capacity.scope import safe_reserve_bytes

    assert safe_reserve_bytes(total) == want
    # whatever the size, a balloon leaves at least 256 MiB + 5% of the machine
    assert safe_reserve_bytes(total) >= total // 20 + (256 << 20)


def _cells() -> pd.DataFrame:
    mib = 1 << 20
    return pd.DataFrame({
        "capacity_bytes": [256 * mib] * 3 + [64 * mib] * 3,
        "retained": [True, True, True, True, True, False],
        "reasons": ["", "", "", "", "", "OOM event in the scope"],
        "iteration_time_median_ns": [1e6, 1.2e6, 1.1e6, 4e6, 6e6, np.nan],
        "device_bytes_per_iteration": [0.0, 0.0, 4096.0, 10 * mib, 12 * mib, np.nan],
        "miss_bytes_per_iteration": [0.0, 0.0, 0.0, 8 * mib, 8 * mib, 8 * mib],
    })


def test_capacity_table_hand_computed():
    t = compute_capacity_table(_cells())
    assert list(t["capacity_bytes"]) == [256 << 20, 64 << 20]
    big, small = t.iloc[0], t.iloc[1]
    assert (big["cells"], big["retained"], small["retained"]) == (3, 3, 2)
    assert big["iteration_time_median_ns"] == 1.1e6
    assert big["iteration_time_spread"] == pytest.approx(0.2e6 / 1.1e6)
    assert big["device_bytes_per_iteration"] == 0.0 and np.isnan(big["amplification"])  # miss 0 -> NA
    # small: median device of retained (10, 12 MiB) = 11 MiB; amplification = 11 / 8
    assert small["device_bytes_per_iteration"] == 11 << 20
    assert small["amplification"] == pytest.approx(11 / 8)
    assert small["iteration_time_median_ns"] == 5e6 and small["reasons"] == "OOM event in the scope"
    assert reference_curve(t) == (float(64 << 20), float(64 << 20) * (11 << 20))


def test_capacity_table_per_host_when_cells_come_from_several():
    """Cells from two hosts: repeats pooled per host (host first, hosts by name, C descending);
    one host, or none named, leaves the table exactly as without a host column."""
    from moetrace.analyses.capacity_response import UNKNOWN_HOST, cell_hosts

    mib = 1 << 20
    one = _cells().assign(host="node-a")
    assert compute_capacity_table(one).equals(compute_capacity_table(_cells()))
    assert compute_capacity_table(_cells().assign(host=None)).equals(compute_capacity_table(_cells()))
    two = _cells().assign(host=["node-b", "node-a", "node-b", "node-a", "node-b", None])
    assert cell_hosts(two) == {"node-b": 3, "node-a": 2}  # retained cells; the unretained one names none
    t = compute_capacity_table(two)
    assert list(t.columns[:2]) == ["host", "capacity_bytes"]
    assert list(zip(t["host"], t["capacity_bytes"], t["cells"], t["retained"])) == [
        ("host unknown", 64 * mib, 1, 0), ("node-a", 256 * mib, 1, 1), ("node-a", 64 * mib, 1, 1),
        ("node-b", 256 * mib, 2, 2), ("node-b", 64 * mib, 1, 1)]
    assert UNKNOWN_HOST == "host unknown"
    by = t.set_index(["host", "capacity_bytes"])
    assert by.loc[("node-b", 256 * mib), "iteration_time_median_ns"] == pytest.approx(1.05e6)  # (1 + 1.1) / 2
    assert by.loc[("node-a", 256 * mib), "iteration_time_median_ns"] == 1.2e6
    assert by.loc[("node-a", 64 * mib), "amplification"] == pytest.approx(10 / 8)  # 10 MiB / 8 MiB
    assert by.loc[("node-b", 64 * mib), "amplification"] == pytest.approx(12 / 8)
    assert by.loc[("host unknown", 64 * mib), "reasons"] == "OOM event in the scope"


def test_plot_capacity(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2)
    plot_capacity(_cells(), axes)
    assert axes[1].get_xscale() == "log" and axes[1].get_yscale() == "log"
    labels = [t.get_text() for t in axes[1].get_legend().get_texts()]
    assert any("a/C" in s for s in labels) and any("miss demand" in s for s in labels)
    assert any("not shown" in s for s in labels)  # the 0 B cells at 256 MiB
    fig.savefig(tmp_path / "f.png")
    plt.close(fig)
    # cells from two hosts: a median line per host
    fig, axes = plt.subplots(1, 2)
    plot_capacity(_cells().assign(host=["b", "a", "b", "a", "b", "a"]), axes)
    labels = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert "median of the repeats (a)" in labels and "median of the repeats (b)" in labels
    plt.close(fig)
    assert (tmp_path / "f.png").stat().st_size > 1000
