"""Capacity cells inside the kernel lab (live tier: needs the set-up's QEMU and kernels): the
cgroup v2 path (memory.max, memory.swap.max, memory.events), which this host (no v2 memory
controller) never runs, and a balloon locking >= 80 % of the guest's memory, both in one 6.12
guest. Oracles: the guest's own cgroup files and /proc/meminfo as cell.json records them, and
the cell's retention rules (VmLck as requested, no OOM, the scope alive). The guest's replay
carries ~35 MiB of anonymous memory at loop entry (the host's: ~26 MiB), and a v2 memcg also
charges the replay's Python pages read over 9p: a 48 MiB headroom was OOM-killed there
(measured), so the cgroup cell has 96 MiB."""

from __future__ import annotations

import json
import sys
from pathlib import Path


import pytest

from common.lab import K612, _lab, _need, make_lab_pool

MIB = 1 << 20


@pytest.fixture(scope="module")
def cell_pool(tmp_path_factory):
    """160 MiB: more than the cgroup cell's wall (16 MiB + 96 MiB headroom), so it re-reads."""
    _need()
    return make_lab_pool(tmp_path_factory.mktemp("labcells"), experts=160, steps=2)


def test_a_v2_cgroup_cell_and_an_80_percent_balloon_cell_are_retained_in_the_guest(cell_pool, tmp_path):
    out = tmp_path / "lab"
    m = f"{Path(sys.executable).parent}/moetrace"
    common = f"--plan {cell_pool}/plan.bin --pool {cell_pool}/pool --warmup 1 --passes 1 --json"
    script = (f"{m} cell {common} --capacity 16MiB --headroom 96MiB --mechanism cgroup --out /tmp/lab/cg "
              f"> /tmp/lab/cg.json; echo $? > /tmp/lab/cg.rc; "
              f"{m} cell {common} --capacity 448MiB --headroom 64MiB --mechanism balloon --no-watch "
              f"--out /tmp/lab/bl > /tmp/lab/bl.json; echo $? > /tmp/lab/bl.rc; "
              "grep -E 'MemTotal' /proc/meminfo > /tmp/lab/meminfo")
    r = _lab(out, "--kernel", "6.12", "--memory", "4G", "--pool", str(cell_pool / "pool"), "--timeout", "900",
             "--json", "--", "sh", "-c", script, timeout=1000)
    assert r.returncode == 0, r.stderr + ((out / "stderr").read_text() if (out / "stderr").exists() else "")
    assert json.loads(r.stdout)["release"] == K612
    err = (out / "stderr").read_text()
    # the cgroup v2 cell: memory.max = C + headroom on the guest's v2 hierarchy, retained
    assert (out / "cg.rc").read_text().strip() == "0", err
    cg = json.loads((out / "cg" / "cell.json").read_text())
    assert cg["retained"] is True and cg["reasons"] == [] and cg["mechanism"] == "cgroup"
    assert cg["scope"]["cgroup_version"] == 2 and cg["scope"]["limit_bytes"] == 112 * MIB
    # memory.events of the v2 scope: the wall reclaimed ("max" events), nothing was OOM-killed
    assert cg["oom_events"]["oom"] == 0 and cg["oom_events"]["oom_kill"] == 0 and cg["oom_events"]["max"] > 0
    assert cg["scope_removed"] is True
    assert cg["device_bytes"] > 0  # a 160 MiB pool through a 112 MiB wall re-reads
    # the balloon cell: >= 80 % of the guest's memory locked, retained, nothing OOM-killed
    assert (out / "bl.rc").read_text().strip() == "0", err
    bl = json.loads((out / "bl" / "cell.json").read_text())
    total = int((out / "meminfo").read_text().split()[1]) * 1024
    assert bl["retained"] is True and bl["reasons"] == [] and bl["mechanism"] == "balloon"
    assert bl["balloon"]["oom_events"]["oom_kill"] == 0 and bl["oom_events"]["oom_kill"] == 0
    locked = bl["balloon"]["vmlck_bytes"]
    assert locked == bl["balloon"]["balloon_bytes"] and locked >= 0.8 * total, (locked, total, bl["balloon"])
    print(f"\nlab cells (6.12, 4 GiB): v2 cgroup cell {cg['iteration_time_median_ns'] / 1e6:.1f} ms/iteration, "
          f"device {cg['device_bytes_per_iteration'] / MIB:.1f} MiB/iteration; balloon locked "
          f"{locked / MIB:.0f} MiB = {locked / total:.1%} of MemTotal")
