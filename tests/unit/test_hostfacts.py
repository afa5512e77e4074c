"""No-kernel tests of moetrace.kernel.hostfacts on fake /proc and /sys trees: every fact read,
an NVMe namespace's model found under /sys/class/block, and an unreadable fact None, never an
exception. tests/live/test_hostfacts.py checks the facts of this machine against its tools."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from moetrace.kernel.hostfacts import HOST_KEYS, disk_model, host_facts


def fake_host(root: Path, pool: Path, *, mglru: str | None = "0x0007", model_under: str | None = "sys/block",
              meminfo: bool = True) -> None:
    """A fake tree: the pool's real MAJ:MIN -> partition nvme0n1p1 of disk nvme0n1, the disk's
    model under ``model_under`` (None: no model), MGLRU enabled = ``mglru`` and 16 GiB MemTotal."""
    st = os.stat(pool)
    disk = root / "sys/devices/pci0000:00/0000:00:04.0/nvme/nvme0/nvme0n1"
    (disk / "nvme0n1p1").mkdir(parents=True)
    (disk / "nvme0n1p1/partition").write_text("1\n")
    (root / "sys/dev/block").mkdir(parents=True)
    os.symlink(os.path.relpath(disk / "nvme0n1p1", root / "sys/dev/block"),
               root / f"sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if model_under is not None:
        (root / model_under / "nvme0n1/device").mkdir(parents=True)
        (root / model_under / "nvme0n1/device/model").write_text("Samsung SSD 990 PRO 2TB                 \n")
    if mglru is not None:
        (root / "sys/kernel/mm/lru_gen").mkdir(parents=True)
        (root / "sys/kernel/mm/lru_gen/enabled").write_text(mglru + "\n")
    (root / "proc").mkdir(parents=True)
    if meminfo:
        (root / "proc/meminfo").write_text("MemTotal:       16777216 kB\nMemFree:         1024 kB\n")


def test_every_fact_from_the_fake_tree(tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    fake_host(tmp_path / "root", pool)
    st = os.stat(pool)
    facts = host_facts(pool, root=tmp_path / "root")
    assert list(facts) == list(HOST_KEYS)
    assert facts == {"name": socket.gethostname(), "kernel": os.uname().release, "mglru": "0x0007",
                     "device": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)} nvme0n1p1",
                     "model": "Samsung SSD 990 PRO 2TB", "cpus": os.cpu_count(), "memory_bytes": 16 << 30}


def test_an_nvme_model_under_sys_class_block(tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    fake_host(tmp_path / "root", pool, model_under="sys/class/block", mglru="0x0000")
    facts = host_facts(pool, root=tmp_path / "root")
    assert (facts["model"], facts["mglru"]) == ("Samsung SSD 990 PRO 2TB", "0x0000")
    assert disk_model("nvme0n1", tmp_path / "root") == "Samsung SSD 990 PRO 2TB"


def test_unreadable_facts_are_none(tmp_path):
    """A virtual disk without a model, a kernel without MGLRU, no /proc/meminfo: None each, the
    rest read; a pool dir on no block device, a missing one or none at all: device and model None."""
    pool = tmp_path / "pool"
    pool.mkdir()
    root = tmp_path / "root"
    fake_host(root, pool, mglru=None, model_under=None, meminfo=False)
    facts = host_facts(pool, root=root)
    assert (facts["mglru"], facts["model"], facts["memory_bytes"]) == (None, None, None)
    assert facts["device"].endswith(" nvme0n1p1") and facts["name"] == socket.gethostname()
    empty = tmp_path / "empty"
    empty.mkdir()
    for where in (pool, tmp_path / "no-such-pool", None):
        facts = host_facts(where, root=empty)
        assert (facts["device"], facts["model"], facts["mglru"], facts["memory_bytes"]) == (None, None, None, None)
        assert (facts["kernel"], facts["cpus"]) == (os.uname().release, os.cpu_count())
