"""`moetrace lab matrix` for real (live tier: the set-up's QEMU and lab kernels): a two-cell
matrix on 6.12 with MGLRU on — a v2 cgroup cell and a vm-memory cell (the guest's RAM sized for
C, no limit inside) — each recorded in a boot of its own. Oracles: the guest's /proc/vmstat
around each recording (every page read from the pool image is an expert page added: pgpgin / 4)
and each cell's own retention rules; the matrix's table holds both cells."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.lab import K612, _need, make_lab_pool


@pytest.fixture(scope="module")
def matrix_pool(tmp_path_factory):
    """96 MiB: more than the cgroup cell's wall (16 MiB + 96 MiB headroom, of which the replay's
    Python takes ~40), so that cell re-reads."""
    _need()
    return make_lab_pool(tmp_path_factory.mktemp("labmatrix"), experts=96, steps=2)


def test_a_two_cell_matrix_on_612_records_each_cell_in_its_own_boot(matrix_pool, tmp_path):
    spec = tmp_path / "m.toml"
    spec.write_text(f'''kernels = ["6.12"]
mglru = ["on"]
mechanisms = ["cgroup", "vm-memory"]
capacities = ["16MiB"]
repeats = 1
plan = "{matrix_pool}/plan.bin"
pool = "{matrix_pool}/pool"
headroom = "96MiB"
guest_base = "320MiB"
warmup = 1
passes = 1
timeout = 900
''')
    out = tmp_path / "matrix"
    m = [f"{Path(sys.executable).parent}/moetrace", "lab", "matrix", str(spec), "--out", str(out)]
    r = subprocess.run(m + ["--json"], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["cells"]
    assert sorted(x["mechanism_spec"] for x in rows) == ["cgroup", "vm-memory"]
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("matrix: [")]  # one line a cell, as it ends
    assert [ln[:len("matrix: [1/2] 6.12-mglru-on/")] for ln in said] == [
        "matrix: [1/2] 6.12-mglru-on/", "matrix: [2/2] 6.12-mglru-on/"], r.stderr
    for row in rows:
        done = json.loads((out / row["cell_dir"] / "done.json").read_text())
        assert done["lab"]["release"] == K612 and done["lab"]["mglru"] == "0x0007", done["lab"]
        assert row["retained"] is True, (row["cell_dir"], done["reasons"])
        run = out / row["cell_dir"] / "cell" / "run"
        man = json.loads((run / "manifest.json").read_text())
        snaps = json.loads((run / "snapshots.json").read_text())
        pgpgin = snaps["post"]["vmstat"]["pgpgin"] - snaps["pre"]["vmstat"]["pgpgin"]
        assert man["totals"]["experts_added_pages"] * 4 == pgpgin > 0, (row["cell_dir"], man["totals"], pgpgin)
        assert row["mem_available_at_loop_entry_bytes"] > 0
    by = {x["mechanism_spec"]: x for x in rows}
    assert by["cgroup"]["mechanism"] == "cgroup" and by["vm-memory"]["mechanism"] == "machine"
    assert by["cgroup"]["device_bytes"] > 0  # 96 MiB through a 112 MiB wall that holds the replay too
    # the vm-memory guest: C + headroom + the guest's own need + the recorder's allowance, in 64 MiB
    # steps; what the page cache could take at loop entry is reported beside nominal C (the whole
    # pool fits there: 96 MiB)
    assert by["vm-memory"]["guest_memory"] == f"{-(-(16 + 96 + 320 + 320) // 64) * 64}M"
    for x in rows:  # a cell that held the whole pool read nothing in its measured passes
        assert x["pool_fits"] == (x["effective_capacity_bytes"] >= 96 << 20), x
        assert (x["device_bytes"] > 0) == (not x["pool_fits"]), x
    assert by["cgroup"]["pool_fits"] is False
    with open(out / "matrix_cells.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 2
    # finished: a second start is refused, --resume has nothing left to run
    again = subprocess.run(m, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "holds a matrix already" in again.stderr
    resumed = subprocess.run(m + ["--resume"], capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0 and "2 of 2 cells finished before; running 0" in resumed.stderr
    print(f"\nlab matrix (6.12, MGLRU on): " + "; ".join(
        f"{x['mechanism_spec']} {x['host_wall_s']:.0f} s host wall, device {x['device_bytes'] / 2**20:.1f} MiB, "
        f"effective capacity {x['effective_capacity_bytes'] / 2**20:.0f} MiB (MemAvailable at loop entry "
        f"{x['mem_available_at_loop_entry_bytes'] / 2**20:.0f} MiB)" for x in rows))
