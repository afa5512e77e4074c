"""Live: killing a running `moetrace cell` (SIGINT, SIGTERM, SIGKILL of the parent) leaves no
moetrace cgroup, no replay, no balloon and no mlocked memory behind (after SIGKILL: once the
next cell has run). Oracles: the cgroup hierarchy, /proc/PID, /proc/meminfo Mlocked."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moetrace.capacity.scope import find_memory_controller
from moetrace.kernel.procfs import read_meminfo

MIB = 1 << 20
GEO = ["--layers", "4", "--experts", "32", "--k", "4"]
CELL = [sys.executable, "-c", "from moetrace.cli.cell import cell; cell()"]


@pytest.fixture(scope="module")
def setup(live, tmp_path_factory):
    fh = open("/tmp/moetrace-io.lock", "a")
    fcntl.flock(fh, fcntl.LOCK_EX)
    d = tmp_path_factory.mktemp("killpool")
    run = lambda *a: subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *a],
                                    check=True, capture_output=True)
    run("pool", "create", str(d / "pool"), *GEO, "--expert-bytes", "1MiB")
    run("trace", "synth", *GEO, "--steps", "40", "-o", str(d / "t.jsonl"))
    run("plan", "compile", str(d / "t.jsonl"), *GEO, "--expert-bytes", "1MiB", "-o", str(d / "plan.bin"))
    yield d
    fcntl.flock(fh, fcntl.LOCK_UN)
    fh.close()


def scope_path(name: str) -> Path:
    return Path(find_memory_controller().mount) / f"moetrace-{name}"


def start_cell(d: Path, name: str, *extra: str) -> subprocess.Popen:
    # many measured passes at a small C: the replay runs for many seconds from the device
    return subprocess.Popen(CELL + ["--plan", str(d / "plan.bin"), "--pool", str(d / "pool"),
                                    "--capacity", "16MiB", "--passes", "200", "--name", name,
                                    "--out", str(d / f"out-{name}"), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_running(p: subprocess.Popen, name: str, timeout: float = 60.0) -> list[int]:
    """Wait until the scope exists and holds the running replay; returns its pids."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert p.poll() is None, p.stderr.read().decode()
        procs = scope_path(name) / "cgroup.procs"
        try:
            pids = [int(x) for x in procs.read_text().split()]
        except OSError:
            pids = []
        if pids and (Path(f"/proc/{pids[0]}/cmdline").read_bytes().find(b"moetrace.cli.replay") >= 0):
            time.sleep(1.0)  # into the passes
            return pids
        time.sleep(0.1)
    raise AssertionError(f"scope moetrace-{name} never held a running replay")


def wait_dead(pids: list[int], timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not [p for p in pids if _alive(p)]:
            return
        time.sleep(0.1)
    raise AssertionError(f"still alive: {[p for p in pids if _alive(p)]}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def our_scopes() -> list[str]:
    return [n for n in os.listdir(find_memory_controller().mount) if n.startswith("moetrace-kill")]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_cleans_up(setup, sig, code):
    name = f"kill-{sig.name.lower()}"
    p = start_cell(setup, name)
    pids = wait_running(p, name)
    p.send_signal(sig)
    rc = p.wait(60)
    err = p.stderr.read().decode()
    assert rc == code, err
    assert "removed" in err
    wait_dead(pids)
    assert not scope_path(name).exists() and our_scopes() == []
    cell = (setup / f"out-{name}" / "cell.json").read_text()
    assert "interrupted by" in cell and '"scope_removed": true' in cell


def test_sigkill_then_next_cell_cleans(setup):
    # a SIGKILLed cell cannot unmount the debugfs/tracefs its watch mounted: it mounts them in a
    # mount namespace of its own, which dies with it; nothing new is mounted here afterwards
    # (a safety net removes what a failure would leave, only what was not mounted before)
    mounted_before = _trace_mounts()
    try:
        _sigkill_then_next_cell_cleans(setup, mounted_before)
        assert _trace_mounts() == mounted_before
    finally:
        for target in reversed(_trace_mounts()):
            if target not in mounted_before:
                subprocess.run(["umount", target], capture_output=True)


def _trace_mounts() -> list[str]:
    return [ln.split()[1] for ln in Path("/proc/mounts").read_text().splitlines()
            if ln.split()[2] in ("debugfs", "tracefs")]


def _sigkill_then_next_cell_cleans(setup, mounted_before):
    base = read_meminfo()["Mlocked_bytes"]
    avail = read_meminfo()["MemAvailable_bytes"]
    name = "kill-sigkill"
    # balloon mechanism (~1 GiB balloon) so SIGKILL must also take the balloon down (PDEATHSIG)
    p = start_cell(setup, name, "--mechanism", "balloon", "--capacity", str(avail - 1152 * MIB))
    pids = wait_running(p, name)
    if "/sys/kernel/debug" not in mounted_before:
        # the cell's watch (`moetrace record`, the replay's parent) had to mount debugfs for its probes: in a
        # mount namespace of its own, which its child the replay shares; here nothing is mounted
        assert os.readlink(f"/proc/{pids[0]}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        assert "/sys/kernel/debug" in Path(f"/proc/{pids[0]}/mounts").read_text()
        assert "/sys/kernel/debug" not in _trace_mounts()
    bpids = [int(x) for x in (scope_path(name + ".balloon") / "cgroup.procs").read_text().split()]
    # the balloon's own exact oracle: its VmLck is its one locked mapping, resident and locked
    # in full (the machine's Mlocked is no oracle: anything else may unlock meanwhile; a fresh
    # machine's CI saw Mlocked - base 26 pages short of the balloon's VmLck)
    locked = _vmlck(bpids[0])
    maps = _locked_mappings(bpids[0])
    assert bpids and locked > 512 * MIB and len(maps) == 1, maps
    assert maps[0] == {"size": locked, "rss": locked, "locked": locked}, maps
    p.kill()
    p.wait(30)
    wait_dead(pids + bpids)  # replay and balloon die with their parent
    assert abs(read_meminfo()["Mlocked_bytes"] - base) < 8 * MIB
    assert scope_path(name).exists()  # nobody was left to remove it ...
    # ... until the next cell (of another name) finds its owner dead and removes it
    q = subprocess.run(CELL + ["--plan", str(setup / "plan.bin"), "--pool", str(setup / "pool"),
                               "--capacity", "256MiB", "--name", "kill-next", "--out", str(setup / "out-next"),
                               "--json"], capture_output=True, text=True, timeout=120)
    assert q.returncode == 0, q.stderr
    assert our_scopes() == []
    import json

    stale = json.loads((setup / "out-next" / "cell.json").read_text())["stale_scopes_removed"]
    assert str(scope_path(name)) in stale and str(scope_path(name + ".balloon")) in stale


def _locked_mappings(pid: int) -> list[dict[str, int]]:
    """{size, rss, locked} bytes of every VM_LOCKED mapping of ``pid`` (/proc/PID/smaps)."""
    out: list[dict[str, int]] = []
    cur: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("Size", "Rss", "Locked"):
            cur[key.lower()] = int(val.split()[0]) * 1024
        elif key == "VmFlags":
            if "lo" in val.split():
                out.append(cur)
            cur = {}
    return out


def _vmlck(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmLck for pid {pid}")
