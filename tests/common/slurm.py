"""The single-node Slurm cluster of scripts/slurm-local.sh, for live tests (issue 22).

``local_slurm()`` starts a cluster of its own (a fresh state directory under /run, free loopback
ports: it never reuses or stops a cluster someone else started), yields the environment to run
Slurm's commands with (``os.environ`` + ``SLURM_CONF`` + ``MOETRACE_SLURM_DIR``) and always stops
it again. submitit runs ``sbatch``/``scancel``/``squeue`` with this process's own environment:
give it ``SLURM_CONF`` from the yielded dict (``monkeypatch.setenv``). Without root or without
the Debian packages the test is skipped (failed under MOETRACE_LIVE=1) with the fix.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm-local.sh"
DAEMONS = ("munged", "slurmctld", "slurmd")
_SEQ = itertools.count()


def slurm_reason() -> str | None:
    """Why the local Slurm cluster cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (scripts/slurm-local.sh starts munged, slurmctld, slurmd)"
    missing = [exe for exe in (*DAEMONS, "sbatch", "squeue", "scancel", "sinfo") if shutil.which(exe) is None]
    if missing:
        return (f"Slurm not installed ({', '.join(missing)} missing): bash scripts/bootstrap.sh "
                "(apt-get install slurmctld slurmd slurm-client munge)")
    return None


def need_slurm() -> None:
    """Skip (or, with MOETRACE_LIVE=1, fail) when the local Slurm cluster cannot run here."""
    why = slurm_reason()
    if why is not None:
        if os.environ.get("MOETRACE_LIVE") == "1":
            pytest.fail(f"MOETRACE_LIVE=1 but {why}")
        pytest.skip(why)


def slurm_local(action: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """``scripts/slurm-local.sh ACTION`` with ``env`` (its MOETRACE_SLURM_DIR picks the cluster)."""
    return subprocess.run(["bash", str(SCRIPT), action], env=env, capture_output=True, text=True,
                          timeout=timeout)


@contextlib.contextmanager
def local_slurm() -> Iterator[dict[str, str]]:
    """Start a single-node Slurm cluster on this host, yield the environment for its commands
    (os.environ + SLURM_CONF + MOETRACE_SLURM_DIR), and always run ``down`` afterwards."""
    need_slurm()
    env = dict(os.environ, MOETRACE_SLURM_DIR=f"/run/moetrace-slurm-test.{os.getpid()}.{next(_SEQ)}")
    env.pop("SLURM_CONF", None)
    try:
        up = slurm_local("up", env)
        if up.returncode != 0:
            pytest.fail(f"scripts/slurm-local.sh up failed (exit {up.returncode}):\n{up.stderr}")
        line = up.stdout.strip()
        assert line.startswith("export SLURM_CONF="), up.stdout
        env["SLURM_CONF"] = line.removeprefix("export SLURM_CONF=")
        yield env
    finally:
        down = slurm_local("down", env)
        if down.returncode != 0:
            pytest.fail(f"scripts/slurm-local.sh down failed (exit {down.returncode}):\n{down.stderr}")
