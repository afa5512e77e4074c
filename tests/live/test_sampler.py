"""Live: the lab sampler (moetrace.lab.sampler) on this host agrees with /proc/vmstat read around
it — its first and last rows lie between the reads taken before it started and after it stopped,
and a 32 MiB file read from disk while it ran shows in its pgpgin — and `moetrace lab sample`
passes its command's exit status through. tests/unit/test_sampler.py covers the fake trees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import drop_pages, io_lock

from moetrace.kernel.procfs import read_vmstat
from moetrace.run.sampler import read_samples

MIB = 1 << 20


def _cold_file(d: Path, size: int) -> Path:
    """A file of ``size`` bytes on disk, none of it in the page cache (mincore says so)."""
    from moetrace.kernel.syscalls import resident_pages

    p = d / "data.bin"
    with open(p, "wb") as fh:
        fh.write(os.urandom(size))
    drop_pages([p], lambda ps: sum(resident_pages(x) for x in ps))
    return p


def test_the_samplers_rows_lie_between_reads_taken_around_it(live, tmp_path):
    from moetrace.lab.sampler import Sampler

    d = Path(os.environ.get("MOETRACE_TEST_DISK_DIR", "/var/tmp")) / f"moetrace-sampler-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    try:
        with io_lock():
            f = _cold_file(d, 32 * MIB)
            before = read_vmstat()
            with Sampler(tmp_path / "s", memfree_hz=10, vmstat_hz=5):
                with open(f, "rb") as fh:
                    while fh.read(MIB):
                        pass
                time.sleep(0.5)
            after = read_vmstat()
    finally:
        for p in d.glob("*"):
            p.unlink()
        d.rmdir()
    s = read_samples(tmp_path / "s")
    first, last = s.vmstat.iloc[0], s.vmstat.iloc[-1]
    counters = [c for c in s.vmstat.columns if c != "t" and not c.startswith("nr_") and c in before and c in after]
    assert "pgsteal_kswapd" in counters and "pageoutrun" in counters
    for c in counters:
        assert before[c] <= first[c] <= last[c] <= after[c], c
    assert int(last["pgpgin"] - first["pgpgin"]) >= 32 * 1024  # KiB: the file came from the disk meanwhile
    assert [c for c in s.vmstat.columns if s.vmstat[c].isna().all()] == s.meta["vmstat_absent"]
    m = s.meta
    assert m["complete"] and m["streams"]["vmstat"]["ticks"] >= 1 and m["streams"]["memfree"]["ticks"] >= 3
    assert m["streams"]["lru_gen"]["available"] == Path("/sys/kernel/mm/lru_gen").exists()
    assert s.zoneinfo["start"]["sum_high_pages"] == sum(z["high"] for z in s.zoneinfo["start"]["zones"]
                                                        if z.get("managed", 0) > 0) > 0


def test_lab_sample_runs_a_command_and_passes_its_status(live, tmp_path):
    r = subprocess.run([sys.executable, "-m", "moetrace.cli", "lab", "sample", "--out", str(tmp_path / "s"),
                        "--memfree-hz", "20", "--", "sh", "-c", "sleep 0.3; exit 3"], capture_output=True, text=True)
    assert r.returncode == 3, r.stderr
    m = json.loads((tmp_path / "s" / "sampler.json").read_text())
    assert m["command"] == ["sh", "-c", "sleep 0.3; exit 3"] and m["exit_status"] == 3 and m["complete"]
    r = subprocess.run([sys.executable, "-m", "moetrace.cli", "lab", "sample", "--out", str(tmp_path / "t"), "--",
                        "/nonexistent/command"], capture_output=True, text=True)
    assert r.returncode == 127
