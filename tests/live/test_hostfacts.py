"""Live: the host facts of this machine (moetrace.kernel.hostfacts) agree with its own tools:
`hostname`, `uname -r`, `stat -c %d` of the pool's directory, `nproc --all` and the MGLRU knob
as `cat` reads it. tests/unit/test_hostfacts.py covers the fake trees."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from moetrace.kernel.hostfacts import host_facts


def tool(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


def test_the_facts_of_this_machine(live, tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    facts = host_facts(pool)
    if facts["device"] is None:
        pytest.skip(f"{tmp_path} is not on a block device")
    assert facts["name"] == tool("hostname")
    assert facts["kernel"] == tool("uname", "-r")
    majmin, name = facts["device"].split(" ")
    major, minor = (int(x) for x in majmin.split(":"))
    assert os.makedev(major, minor) == int(tool("stat", "-c", "%d", str(pool)))
    assert Path(f"/sys/dev/block/{majmin}").resolve().name == name
    assert facts["cpus"] == int(tool("nproc", "--all"))
    knob = Path("/sys/kernel/mm/lru_gen/enabled")
    assert facts["mglru"] == (tool("cat", str(knob)) if knob.exists() else None)
    assert facts["memory_bytes"] > 0
