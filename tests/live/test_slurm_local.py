"""scripts/slurm-local.sh: a real single-node Slurm cluster on this host (live tier: root and
Debian's slurmctld, slurmd, slurm-client, munge; skips without them, fails under
MOETRACE_LIVE=1). Oracles: the job's own output (hostname, uid), the job's process in /proc
before and after scancel, and after `down` the process table, the listening sockets (ss) and
the file system."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from common.slurm import DAEMONS, SCRIPT, local_slurm, need_slurm, slurm_local


def _alive(pid: int) -> bool:
    """pid exists and is not a zombie (pid 1 here reaps orphans late; a zombie holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _state(env: dict, job: str) -> str:
    r = subprocess.run(["squeue", "--states=all", "-h", "-o", "%i %T", "-j", job], env=env,
                       capture_output=True, text=True, timeout=30, check=True)
    rows = dict(line.split() for line in r.stdout.splitlines())
    return rows.get(job, "")


def _wait_state(env: dict, job: str, states: set[str], timeout: float = 60) -> str:
    end = time.monotonic() + timeout
    while (state := _state(env, job)) not in states:
        assert time.monotonic() < end, f"job {job} is {state!r} after {timeout}s, expected one of {states}"
        time.sleep(0.25)
    return state


def _sbatch(env: dict, *args: str) -> str:
    r = subprocess.run(["sbatch", "--parsable", *args], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _listening(port: int) -> bool:
    r = subprocess.run(["ss", "-Htln", f"( sport = :{port} )"], capture_output=True, text=True, check=True)
    return bool(r.stdout.strip())


@pytest.fixture
def slurm():
    """A running local cluster: the environment for its commands (SLURM_CONF set)."""
    with local_slurm() as env:
        yield env


def _running_sleeper(env: dict[str, str], pidfile: Path, seconds: int) -> tuple[str, int]:
    """A job running `sleep SECONDS`: its id and the sleeper's pid, once it runs."""
    job = _sbatch(env, "-o", "/dev/null", "--wrap", f"echo $$ > {pidfile}; exec sleep {seconds}")
    _wait_state(env, job, {"RUNNING"})
    end = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < end, "the running job never wrote its pid"
        time.sleep(0.1)
    return job, int(pidfile.read_text())


def test_up_runs_and_cancels_jobs_and_down_leaves_nothing(slurm, tmp_path):
    env = slurm
    conf = Path(env["SLURM_CONF"])
    state_dir = conf.parent
    assert state_dir == Path(env["MOETRACE_SLURM_DIR"])
    pids = {d: int((state_dir / f"{d}.pid").read_text()) for d in DAEMONS}
    assert all(_alive(p) for p in pids.values()), pids
    ports = [int(re.search(rf"^{k}=(\d+)$", conf.read_text(), re.M).group(1))
             for k in ("SlurmctldPort", "SlurmdPort")]
    assert all(_listening(p) for p in ports), ports
    assert oct((state_dir / "munge.key").stat().st_mode & 0o777) == "0o400"

    # a second `up` finds it running: the same one line on stdout, the same daemons
    again = slurm_local("up", env)
    assert again.returncode == 0 and again.stdout == f"export SLURM_CONF={conf}\n", again.stderr
    assert {d: int((state_dir / f"{d}.pid").read_text()) for d in DAEMONS} == pids
    st = slurm_local("status", env)
    assert st.returncode == 0 and re.search(r"^local\*\s+up\s+infinite\s+1\s+idle\s", st.stdout, re.M), st.stdout

    # an exclusive job runs on this host as root
    out = tmp_path / "hello.out"
    job = _sbatch(env, "--exclusive", "-o", str(out), "--wrap", "hostname; id -u")
    assert _wait_state(env, job, {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT"}) == "COMPLETED"
    assert out.read_text().split() == [socket.gethostname(), "0"]

    # scancel ends a running job and its process; squeue still shows it, CANCELLED
    job, sleeper = _running_sleeper(env, tmp_path / "sleep.pid", 300)
    assert _alive(sleeper)
    subprocess.run(["scancel", job], env=env, check=True, timeout=30)
    assert _wait_state(env, job, {"CANCELLED"}, timeout=30) == "CANCELLED"
    end = time.monotonic() + 30
    while _alive(sleeper):
        assert time.monotonic() < end, f"the cancelled job's process {sleeper} still runs"
        time.sleep(0.1)

    # a job still running at `down` is cancelled by it; then nothing of the cluster is left
    job, sleeper2 = _running_sleeper(env, tmp_path / "sleep2.pid", 301)
    down = slurm_local("down", env)
    assert down.returncode == 0, down.stderr
    assert not state_dir.exists()
    assert [(d, p) for d, p in pids.items() if _alive(p)] == []
    assert not _alive(sleeper2)
    assert [p for p in ports if _listening(p)] == []
    # `down` again (and the fixture's own `down`) with nothing up: exit 0, silent
    quiet = slurm_local("down", env)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    st = slurm_local("status", env)
    assert st.returncode == 1 and "down" in st.stdout

    # `up` after `down` works again
    with local_slurm() as env2:
        job = _sbatch(env2, "-o", str(tmp_path / "again.out"), "--wrap", "id -u")
        assert _wait_state(env2, job, {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"}) == "COMPLETED"
        assert (tmp_path / "again.out").read_text() == "0\n"
        again_dir = Path(env2["SLURM_CONF"]).parent
        again_pids = [int((again_dir / f"{d}.pid").read_text()) for d in DAEMONS]
    assert not again_dir.exists() and not any(_alive(p) for p in again_pids)


def test_up_over_a_half_dead_cluster_clears_it_and_its_orphaned_job_first(slurm, tmp_path):
    env = slurm
    state_dir = Path(env["MOETRACE_SLURM_DIR"])
    pids = {d: int((state_dir / f"{d}.pid").read_text()) for d in DAEMONS}
    pidfile = tmp_path / "sleep.pid"
    job = _sbatch(env, "-o", "/dev/null", "--wrap", f"echo $$ > {pidfile}; exec sleep 302")
    _wait_state(env, job, {"RUNNING"})
    end = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < end, "the running job never wrote its pid"
        time.sleep(0.1)
    sleeper = int(pidfile.read_text())
    # the controller dies under a running job: nobody can scancel it any more
    os.kill(pids["slurmctld"], signal.SIGKILL)
    end = time.monotonic() + 10
    while _alive(pids["slurmctld"]):
        assert time.monotonic() < end
        time.sleep(0.1)
    st = slurm_local("status", env)
    assert st.returncode == 1 and "not (fully) running" in st.stdout, st.stdout
    up = slurm_local("up", env)
    assert up.returncode == 0 and up.stdout == f"export SLURM_CONF={env['SLURM_CONF']}\n", up.stderr
    assert "not (fully) running: stopping what is left first" in up.stderr
    # the job's step and its process were stopped (they held the state directory), the old
    # daemons are gone, new ones run and take jobs
    assert not _alive(sleeper) and not any(_alive(p) for p in pids.values())
    new = {d: int((state_dir / f"{d}.pid").read_text()) for d in DAEMONS}
    assert all(_alive(p) for p in new.values()) and not set(new.values()) & set(pids.values())
    job = _sbatch(env, "-o", str(tmp_path / "after.out"), "--wrap", "echo fresh")
    assert _wait_state(env, job, {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"}) == "COMPLETED"
    assert (tmp_path / "after.out").read_text() == "fresh\n"


def test_help_and_usage():
    need_slurm()
    r = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.startswith("usage: ") and "up|down|status" in r.stdout
    r = subprocess.run(["bash", str(SCRIPT), "sideways"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.startswith("usage: ") and r.stdout == ""


def test_refuses_without_root():
    need_slurm()
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        "bash", str(SCRIPT), "status"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "needs root" in r.stderr, r.stderr
