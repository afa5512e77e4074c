"""Test tiers (README.md, "Tests"), one folder each: tests/unit (no kernel: pure tables, fixtures,
fake /proc and /sys trees), tests/probe_build (every probe's object is built, agrees with its declaration, loads and detaches),
tests/live (the running kernel, against independent oracles). tests/common/<name>.py holds
what the tier files of one subject share (helpers, constants, fixtures); tests/pagewatch.py
is the live tests' independent watcher of a pool's pages.

Probe-build and live tests use the `live` fixture, the one place that decides (once per
session) whether a real kernel can be exercised — root, cgroups, BTF, the compiled probes — and
says why not.
MOETRACE_LIVE=1 (set by CI) turns those skips into failures.
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
    """Why live kernel tests cannot run here (None: they can). Decided once per session:
    root, cgroups, BTF, and the compiled probe objects (every live and probe-build test loads
    probes)."""
    if os.geteuid() != 0:
        return "live tests need root"
    if not os.path.exists("/sys/fs/cgroup"):
        return "no /sys/fs/cgroup"
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        return "no kernel BTF (/sys/kernel/btf/vmlinux): the compiled probes cannot load"
    from moetrace.kernel.bpf import stale_object
    from moetrace.record.probes import PROBES

    for name in PROBES:
        why = stale_object(name)
        if why:
            return f"probe {name}: {why}"
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
    """Probes mount debugfs/tracefs when absent (libbpf reads tracepoint ids there); take them down
    afterwards."""
    yield
    from moetrace.kernel.features import unmount_ours

    unmount_ours()


def drop_pages(paths, resident, tries: int = 10) -> None:
    """fsync + POSIX_FADV_DONTNEED every file until ``resident(paths)`` (mincore/fincore) says
    none of it is cached; dirty pages of a file just written need the fsync first."""
    import time

    for _ in range(tries):
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        if resident(paths) == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"pool still resident after DONTNEED: {resident(paths)} (pages or bytes)")


def sigint_default() -> None:
    """A preexec_fn: SIGINT back to its default in the child. A shell starts a background job
    (`cmd &` without job control: how CI may be launched) with SIGINT ignored, the children
    inherit that, and Python then never raises KeyboardInterrupt: a Ctrl-C test would wait."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def moetrace_cli(*args: str, check: bool = True):
    """Run the moetrace CLI in a subprocess (the installed package, this Python)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *map(str, args)],
                       capture_output=True, text=True)
    if check and r.returncode:
        raise AssertionError(r.stderr)
    return r


def make_expert_pools(base: Path, n: int = 23, steps: int = 1) -> dict[str, Path]:
    """One layer of ``n`` experts x 1 MiB in both layouts (base/files, base/pool) and a plan
    (base/plan.bin) whose ``steps`` iterations read every expert once each."""
    from moetrace.inputs.trace import write_jsonl

    out: dict[str, Path] = {}
    for layout in ("files", "pool"):
        moetrace_cli("pool", "create", base / layout, "--layers", "1", "--experts", n, "--k", n,
                     "--expert-bytes", "1MiB", "--layout", layout)
        out[layout] = base / layout
    write_jsonl([(s, 0, list(range(n))) for s in range(steps)], base / "t.jsonl")
    moetrace_cli("plan", "compile", base / "t.jsonl", "--layers", "1", "--experts", n, "--k", n,
                 "--expert-bytes", "1MiB", "-o", base / "plan.bin")
    out["plan"] = base / "plan.bin"
    out["base"] = base
    return out


def make_layered_pool(base: Path, layers: int, experts: int) -> Path:
    """base/pool: ``layers`` x ``experts`` x 1 MiB (files layout) and base/plan.bin, one
    iteration reading every expert of every layer once. Returns base."""
    from moetrace.inputs.trace import write_jsonl

    moetrace_cli("pool", "create", base / "pool", "--layers", layers, "--experts", experts, "--k", experts,
                 "--expert-bytes", "1MiB", "--layout", "files")
    write_jsonl([(0, layer, list(range(experts))) for layer in range(layers)], base / "t.jsonl")
    moetrace_cli("plan", "compile", base / "t.jsonl", "--layers", layers, "--experts", experts, "--k", experts,
                 "--expert-bytes", "1MiB", "-o", base / "plan.bin")
    return base
