"""What the kernel-lab live tests share: the lab kernels, the skip-or-fail rule, `moetrace lab
run` as a subprocess, and a small pool + plan (1 layer x 64 experts x 1 MiB, 4 iterations
reading every expert) for the guest to replay."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

K61, K612 = "6.1.0-47-amd64", "6.12.95+deb12-amd64"
LAB_EXPERTS, LAB_STEPS = 64, 4


def _need() -> None:
    missing = [w for w, ok in (("qemu-system-x86_64", shutil.which("qemu-system-x86_64")),
                               (f"/boot/vmlinuz-{K61}", Path(f"/boot/vmlinuz-{K61}").is_file()),
                               (f"/boot/vmlinuz-{K612}", Path(f"/boot/vmlinuz-{K612}").is_file())) if not ok]
    if missing:
        why = f"kernel lab not installed ({', '.join(missing)}): bash scripts/lab-setup.sh"
        if os.environ.get("MOETRACE_LIVE") == "1":
            pytest.fail(f"MOETRACE_LIVE=1 but {why}")
        pytest.skip(why)


def newest_release() -> str:
    """The newest Debian kernel the lab set-up unpacked (not installed), or skip / fail."""
    from moetrace.lab.run import unpacked_releases

    rels = unpacked_releases()
    if not rels:
        why = "no unpacked lab kernel under /var/lib/moetrace/lab/kernels: bash scripts/lab-setup.sh"
        if os.environ.get("MOETRACE_LIVE") == "1":
            pytest.fail(f"MOETRACE_LIVE=1 but {why}")
        pytest.skip(why)
    return rels[-1]


def _lab(out: Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`moetrace lab run --out OUT ARGS`, under TCG unless ARGS name --accel (auto would try this
    host's KVM first: 20 s lost the first time, then remembered in ~/.cache)."""
    accel = () if "--accel" in args else ("--accel", "tcg")
    return subprocess.run([sys.executable, "-m", "moetrace.cli", "lab", "run", "--out", str(out), *accel, *args],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def make_lab_pool(d: Path, experts: int = LAB_EXPERTS, steps: int = LAB_STEPS) -> Path:
    """d/pool (1 layer x ``experts`` x 1 MiB, files layout) and d/plan.bin (``steps``
    iterations, each reading every expert once). Returns d."""
    from conftest import moetrace_cli
    from moetrace.inputs.trace import write_jsonl

    geo = ["--layers", "1", "--experts", str(experts), "--k", str(experts), "--expert-bytes", "1MiB"]
    moetrace_cli("pool", "create", d / "pool", *geo, "--layout", "files")
    write_jsonl([(s, 0, list(range(experts))) for s in range(steps)], d / "t.jsonl")
    moetrace_cli("plan", "compile", d / "t.jsonl", *geo, "-o", d / "plan.bin")
    return d


@pytest.fixture(scope="module")
def lab_pool(tmp_path_factory):
    """A directory with pool/ (64 MiB, files layout) and plan.bin."""
    _need()
    return make_lab_pool(tmp_path_factory.mktemp("labpool"))
