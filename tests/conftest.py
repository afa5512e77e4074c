"""Test tiers (docs/style.md): no-kernel (default), probe-build, live.

Live tests use the `live` fixture, which decides once per session whether a
real kernel can be exercised and says why not. MOETRACE_LIVE=1 (set by CI)
turns those skips into failures.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
SHARED = Path(__file__).resolve().parents[1].parent / "shared"
# The real OLMoE/Mixtral counts: the shared data folder beside the checkout when
# present, else the identical copy bundled with the package (toolkit/data).
_SHARED_COUNTS = SHARED / "data" / "olmoe_mixtral_expert_counts.json"
COUNTS_FILE = _SHARED_COUNTS if _SHARED_COUNTS.exists() else (
    Path(__file__).resolve().parents[1] / "toolkit" / "data" / "olmoe_mixtral_expert_counts.json")


IO_LOCK = "/tmp/moetrace-io.lock"


@contextlib.contextmanager
def io_lock():
    """Hold the machine-wide I/O lock: measurements against device-wide oracles
    (/proc/diskstats, /proc/vmstat) must not overlap another moetrace test's I/O."""
    with open(IO_LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _live_reason() -> str | None:
    if os.geteuid() != 0:
        return "live tests need root"
    if not os.path.exists("/sys/fs/cgroup"):
        return "no /sys/fs/cgroup"
    return None


_LIVE = _live_reason()


@pytest.fixture(scope="session")
def live() -> None:
    """Skip (or, with MOETRACE_LIVE=1, fail) when live kernel tests cannot run."""
    if _LIVE is not None:
        if os.environ.get("MOETRACE_LIVE") == "1":
            pytest.fail(f"MOETRACE_LIVE=1 but live tests cannot run: {_LIVE}")
        pytest.skip(_LIVE)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def counts_file() -> Path:
    """The real OLMoE/Mixtral routing counts."""
    return COUNTS_FILE


@pytest.fixture(scope="session", autouse=True)
def _unmount_what_tests_mounted():
    """Probes mount debugfs/tracefs when absent (bcc needs them); take them down afterwards."""
    yield
    from moetrace.features import unmount_ours

    unmount_ours()
