"""`moetrace lab run` boots the lab kernels under QEMU (live tier: needs the set-up's QEMU and
kernels; skips without them, fails under MOETRACE_LIVE=1). Oracles: the guest's own uname,
/sys/kernel/mm/lru_gen/enabled, a write that must fail outside the share, and this host's
process table after a guest is killed at its timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.lab import K61, K612, _lab, _need  # noqa: F401
from conftest import sigint_default


def test_guest_sees_the_host_root_read_only_and_writes_only_its_share(tmp_path):
    _need()
    out = tmp_path / "lab"
    r = _lab(out, "--kernel", "6.12", "--", "sh", "-c",
             "uname -r; cat /sys/kernel/mm/lru_gen/enabled; "
             "if touch /etc/moetrace-lab-probe 2>/dev/null; then echo WROTE-ROOT; fi; "
             "echo from-guest > /tmp/lab/made-in-guest; exit 7")
    assert r.returncode == 7, r.stderr + ((out / "lab.json").read_text() if (out / "lab.json").exists() else "")
    assert (out / "stdout").read_text().split() == [K612, "0x0007"]  # MGLRU on by default in 6.12
    assert (out / "made-in-guest").read_text() == "from-guest\n"
    assert not Path("/etc/moetrace-lab-probe").exists()
    doc = json.loads((out / "lab.json").read_text())
    assert doc["status"] == "ok" and doc["exit_status"] == 7 and doc["release"] == K612 and doc["mglru"] == "0x0007"
    assert 0 < doc["cmd_start_uptime_s"] < doc["end_uptime_s"]
    print(f"\n6.12: command at {doc['cmd_start_uptime_s']} s guest uptime, host wall {doc['host_wall_s']} s")


def test_a_kernel_tree_build_boots_with_its_modules_install(tmp_path):
    """--kernel PATH to a tree's arch/x86/boot/bzImage (here 6.12's image laid out as a build: its
    .config in the tree, its modules from a modules_install directory): the release comes from the
    image's header, the guest's drivers from --modules."""
    import shutil

    _need()
    tree = tmp_path / "linux"
    img = tree / "arch" / "x86" / "boot" / "bzImage"
    img.parent.mkdir(parents=True)
    shutil.copy(f"/boot/vmlinuz-{K612}", img)
    shutil.copy(f"/boot/config-{K612}", tree / ".config")
    mods = tmp_path / "mods" / "lib" / "modules"
    mods.mkdir(parents=True)
    (mods / K612).symlink_to(f"/lib/modules/{K612}")
    out = tmp_path / "lab"
    r = _lab(out, "--kernel", str(img), "--modules", str(tmp_path / "mods"), "--json", "--", "uname", "-r")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["release"] == K612 and doc["image"] == str(img) and (out / "stdout").read_text().strip() == K612


@pytest.mark.parametrize("mglru, want", [("off", "0x0000"), ("on", "0x0007")])
def test_61_mglru_switched_as_asked(tmp_path, mglru, want):
    _need()
    out = tmp_path / "lab"
    r = _lab(out, "--kernel", "6.1", "--mglru", mglru, "--json", "--", "cat", "/sys/kernel/mm/lru_gen/enabled")
    assert r.returncode == 0, r.stderr + ((out / "lab.json").read_text() if (out / "lab.json").exists() else "")
    doc = json.loads(r.stdout)
    assert doc["release"] == K61 and doc["mglru"] == want and (out / "stdout").read_text().strip() == want


def test_a_hung_guest_is_killed_at_the_timeout(tmp_path):
    """Under --accel auto (with a cache of its own): KVM fails a stock kernel before COMMAND on
    machines of this kind (measured: a hang at the BIOS on one, an abort at once on
    another), so the guest is killed at the KVM deadline, or QEMU's exit is seen, and it is
    booted under TCG, saying why; there COMMAND hangs and is killed at the timeout."""
    _need()
    from moetrace.lab.run import KVM_BOOT_DEADLINE_S, kvm_unusable

    out = tmp_path / "lab"
    r = _lab(out, "--kernel", "6.12", "--accel", "auto", "--timeout", "25", "--", "sleep", "1000", timeout=150,
             env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert r.returncode == 1 and "still running after 25 s and was killed" in r.stderr
    doc = json.loads((out / "lab.json").read_text())
    assert doc["status"] == "timeout" and "exit_status" not in doc
    assert doc["accel_requested"] == "auto" and doc["accel"] == "tcg"
    if kvm_unusable() is None:
        assert doc["kvm_fallback"].startswith((
            f"the guest did not reach COMMAND within {KVM_BOOT_DEADLINE_S:.0f} s under KVM",
            "QEMU stopped under KVM before COMMAND started")), doc["kvm_fallback"]
        assert "falling back to TCG" in r.stderr and (tmp_path / "cache" / "moetrace" / "lab-accel.json").is_file()
    left = subprocess.run(["pgrep", "-f", f"path={out}"], capture_output=True, text=True).stdout.split()
    assert left == []  # our qemu (its share is this test's directory) is gone


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_stopping_lab_run_leaves_no_guest_and_no_temporary_files(tmp_path, sig):
    """Ctrl-C or SIGTERM: QEMU killed and the initramfs / pool image directory removed; even a
    SIGKILLed `lab run` takes its QEMU with it (PR_SET_PDEATHSIG)."""
    _need()
    out, tmp = tmp_path / "lab", tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.Popen([sys.executable, "-m", "moetrace.cli", "lab", "run", "--out", str(out), "--kernel", "6.12",
                          "--accel", "tcg", "--", "sleep", "1000"], env=dict(os.environ, TMPDIR=str(tmp)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    t0 = time.monotonic()
    while not (out / ".guest-status.json").exists():  # written by the guest right before COMMAND
        assert p.poll() is None and time.monotonic() - t0 < 120, p.communicate()
        time.sleep(0.2)
    assert list(tmp.iterdir()) and _qemus(out)
    p.send_signal(sig)
    p.communicate(timeout=60)
    t0 = time.monotonic()
    while _qemus(out) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert _qemus(out) == []
    if sig != signal.SIGKILL:
        assert p.returncode != 0 and list(tmp.iterdir()) == []


def _qemus(out: Path) -> list[str]:
    """pids of QEMU processes whose share is ``out`` (this test's own)."""
    return subprocess.run(["pgrep", "-f", f"path={out},mount_tag"], capture_output=True, text=True).stdout.split()
