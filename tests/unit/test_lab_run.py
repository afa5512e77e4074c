"""`moetrace lab run` without QEMU (no-kernel tier): a stand-in QEMU script plays the guest
(it writes the console and the guest's status file where the real one would), so the host-side
logic is tested alone: a guest that panics before COMMAND starts is booted again and the failed
boot is reported; one that panics every time is an error naming the console's cause."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moetrace.errors import MoetraceError, UsageError
from moetrace.lab import run as L

FAKE_QEMU = r'''#!/usr/bin/env python3
import json, os, sys
argv = sys.argv[1:]
console = next(a for a in argv if a.startswith("file:"))[5:]
share = next(a for a in argv if "mount_tag=labshare" in a).split("path=")[1].split(",")[0]
count = os.path.join(share, ".boots")
n = int(open(count).read()) + 1 if os.path.exists(count) else 1
open(count, "w").write(str(n))
open(os.path.join(share, ".argv"), "a").write(" ".join(argv) + "\n")
if n <= int(os.environ["FAKE_PANICS"]):
    open(console, "w").write("[    1.58] CR2: 0000000000000000\n"
                             "[    1.58] Kernel panic - not syncing: Fatal exception in interrupt\n")
    sys.exit(0)
open(console, "w").write("booted\n")
json.dump({"cmd_start_uptime_s": 3.0, "exit_status": 5, "release": "6.12.95+deb12-amd64", "mglru": "0x0007",
           "end_uptime_s": 3.5}, open(os.path.join(share, ".guest-status.json"), "w"))
'''


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    q = tmp_path / "qemu"
    q.write_text(FAKE_QEMU.replace("/usr/bin/env python3", sys.executable))
    q.chmod(0o755)
    monkeypatch.setattr(L, "resolve_kernel", lambda k, modules=None: ("6.12.95+deb12-amd64", tmp_path / "vmlinuz"))
    monkeypatch.setattr(L, "build_initramfs", lambda rel, dest, modules=(), base=None: dest)
    return q


@pytest.mark.parametrize("panics", [0, 1, 2])
def test_a_guest_that_panics_before_command_is_booted_again(fake, tmp_path, monkeypatch, panics):
    monkeypatch.setenv("FAKE_PANICS", str(panics))
    out = tmp_path / "lab"
    res = L.run_in_guest("6.12", ["true"], out, qemu=str(fake), timeout_s=30, accel="tcg")
    assert res.status == "ok" and res.exit_status == 5
    doc = json.loads((out / "lab.json").read_text())
    from moetrace.run.documents import Lab, undeclared  # every key declared (and documented)

    assert not undeclared(doc, Lab)
    assert (out / ".boots").read_text() == str(panics + 1)
    assert [f["attempt"] for f in doc["boot_failures"]] == list(range(1, panics + 1))
    for f in doc["boot_failures"]:
        assert f["cause"] == "[    1.58] Kernel panic - not syncing: Fatal exception in interrupt"
        assert "Kernel panic" in (out / f["console"]).read_text()


def test_a_guest_that_always_panics_is_an_error_with_the_cause(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PANICS", "99")
    out = tmp_path / "lab"
    with pytest.raises(MoetraceError, match="stopped before COMMAND finished: .*Fatal exception in interrupt"):
        L.run_in_guest("6.12", ["true"], out, qemu=str(fake), timeout_s=30, accel="tcg")
    assert (out / ".boots").read_text() == str(L.BOOT_RETRIES + 1)
    doc = json.loads((out / "lab.json").read_text())
    assert doc["status"] == "no-status" and len(doc["boot_failures"]) == L.BOOT_RETRIES
    assert not list(Path(tmp_path).glob("moetrace-lab-*"))


def test_tcg_boots_one_vcpu_unless_asked(fake, tmp_path, monkeypatch):
    """Under TCG every vCPU runs on one host thread: one vCPU by default (a second only slows
    the guest), --cpus otherwise; lab.json names the count booted."""
    monkeypatch.setenv("FAKE_PANICS", "0")
    for cpus, want in ((None, 1), (3, 3)):
        out = tmp_path / f"lab{want}"
        res = L.run_in_guest("6.12", ["true"], out, qemu=str(fake), timeout_s=30, accel="tcg", cpus=cpus)
        assert f" -smp {want} " in (out / ".argv").read_text()
        assert res.doc["cpus"] == want and L.DEFAULT_CPUS["kvm"] == 2
        # TCG's emulated CPU needs no speculation mitigations (they cost the most there); KVM's keeps them
        assert res.doc["kernel_cmdline"].endswith("mitigations=off moetrace.accel=tcg")
        assert "mitigations=off" in (out / ".argv").read_text() and not L.ACCEL_CMDLINE["kvm"]


HANGING_KVM = r'''#!/usr/bin/env python3
import os, sys, time
if "kvm" in sys.argv[1:]:  # a stock kernel under this host's nested KVM: the console stops at the BIOS
    console = next(a for a in sys.argv[1:] if a.startswith("file:"))[5:]
    open(console, "w").write("Booting from ROM...\n")
    open(os.environ["FAKE_KVM_LOG"], "a").write("kvm\n")
    time.sleep(60)
os.execv(sys.executable, [sys.executable, os.environ["FAKE_TCG"], *sys.argv[1:]])
'''


def test_accel_auto_falls_back_to_tcg_when_kvm_hangs_and_remembers_it(fake, tmp_path, monkeypatch):
    """--accel auto: KVM first; a guest that has not reached COMMAND by the deadline is killed and
    booted under TCG, with the reason in lab.json; the hang is remembered per kernel pair, so the
    next auto run goes to TCG at once. --accel kvm then fails with the cause; --accel tcg never
    tries KVM. A missing /dev/kvm: auto uses TCG and says why, kvm is refused."""
    q = tmp_path / "qemu-kvm"
    q.write_text(HANGING_KVM.replace("/usr/bin/env python3", sys.executable))
    q.chmod(0o755)
    monkeypatch.setenv("FAKE_TCG", str(fake))
    monkeypatch.setenv("FAKE_PANICS", "0")
    monkeypatch.setenv("FAKE_KVM_LOG", str(tmp_path / "kvm.log"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(L, "KVM_BOOT_DEADLINE_S", 1.0)
    monkeypatch.setattr(L, "kvm_unusable", lambda dev="/dev/kvm": None)
    out = tmp_path / "lab"
    res = L.run_in_guest("6.12", ["true"], out, qemu=str(q), timeout_s=30, accel="auto")
    doc = json.loads((out / "lab.json").read_text())
    assert res.exit_status == 5 and doc["accel"] == "tcg" and doc["accel_requested"] == "auto"
    assert "did not reach COMMAND within 1 s under KVM" in doc["kvm_fallback"]
    assert (tmp_path / "kvm.log").read_text() == "kvm\n"
    assert "6.12.95+deb12-amd64" in L.accel_cache().read_text()
    # the next auto run does not try KVM again
    res = L.run_in_guest("6.12", ["true"], tmp_path / "lab2", qemu=str(q), timeout_s=30, accel="auto")
    doc = json.loads((tmp_path / "lab2" / "lab.json").read_text())
    assert doc["accel"] == "tcg" and "KVM failed this kernel here before" in doc["kvm_fallback"]
    assert "did not reach COMMAND within 1 s" in doc["kvm_fallback"]
    assert (tmp_path / "kvm.log").read_text() == "kvm\n"
    with pytest.raises(MoetraceError, match="--accel kvm: the guest did not reach COMMAND within 1 s"):
        L.run_in_guest("6.12", ["true"], tmp_path / "lab3", qemu=str(q), timeout_s=30, accel="kvm")
    assert (tmp_path / "kvm.log").read_text() == "kvm\nkvm\n"
    doc = json.loads((L.run_in_guest("6.12", ["true"], tmp_path / "lab4", qemu=str(q), timeout_s=30,
                                     accel="tcg").doc and (tmp_path / "lab4" / "lab.json")).read_text())
    assert doc["accel"] == "tcg" and doc["kvm_fallback"] is None and (tmp_path / "kvm.log").read_text().count("kvm") == 2
    monkeypatch.setattr(L, "kvm_unusable", lambda dev="/dev/kvm": "cannot open /dev/kvm: No such file or directory")
    res = L.run_in_guest("6.12", ["true"], tmp_path / "lab5", qemu=str(q), timeout_s=30, accel="auto")
    assert res.doc["accel"] == "tcg" and res.doc["kvm_fallback"] == \
        "KVM not tried: cannot open /dev/kvm: No such file or directory"
    from moetrace.errors import UsageError
    with pytest.raises(UsageError, match="--accel kvm: cannot open /dev/kvm"):
        L.run_in_guest("6.12", ["true"], tmp_path / "lab6", qemu=str(q), timeout_s=30, accel="kvm")
    assert not list(Path(tmp_path).glob("moetrace-lab-*"))


ABORTING_KVM = r'''#!/usr/bin/env python3
import os, sys
if "kvm" in sys.argv[1:]:  # QEMU on a host whose KVM refuses an MSR: it aborts at once, console empty
    open(os.environ["FAKE_KVM_LOG"], "a").write("kvm\n")
    sys.stderr.write("qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69\n"
                     "qemu-system-x86_64: ../../target/i386/kvm/kvm.c:2893: kvm_buf_set_msrs: Assertion failed.\n")
    sys.stderr.flush()
    os.abort()
os.execv(sys.executable, [sys.executable, os.environ["FAKE_TCG"], *sys.argv[1:]])
'''


def test_accel_auto_falls_back_to_tcg_when_qemu_aborts_under_kvm(fake, tmp_path, monkeypatch):
    """A QEMU that aborts under KVM before the guest starts (measured on one machine of this kind:
    `failed to set MSR 0x10a`, SIGABRT, empty console) is a KVM failure like a hang: auto boots
    under TCG with QEMU's own words in lab.json and remembers it; --accel kvm fails with them."""
    q = tmp_path / "qemu-abort"
    q.write_text(ABORTING_KVM.replace("/usr/bin/env python3", sys.executable))
    q.chmod(0o755)
    monkeypatch.setenv("FAKE_TCG", str(fake))
    monkeypatch.setenv("FAKE_PANICS", "0")
    monkeypatch.setenv("FAKE_KVM_LOG", str(tmp_path / "kvm.log"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(L, "kvm_unusable", lambda dev="/dev/kvm": None)
    res = L.run_in_guest("6.12", ["true"], tmp_path / "lab", qemu=str(q), timeout_s=30, accel="auto")
    doc = json.loads((tmp_path / "lab" / "lab.json").read_text())
    assert res.exit_status == 5 and doc["accel"] == "tcg"
    assert doc["kvm_fallback"] == ("QEMU stopped under KVM before COMMAND started (killed by signal 6: "
                                   "qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69)")
    res = L.run_in_guest("6.12", ["true"], tmp_path / "lab2", qemu=str(q), timeout_s=30, accel="auto")
    assert res.doc["accel"] == "tcg" and "failed to set MSR 0x10a" in res.doc["kvm_fallback"]
    assert res.doc["kvm_fallback"].startswith("KVM not tried: KVM failed this kernel here before")
    assert (tmp_path / "kvm.log").read_text() == "kvm\n"
    with pytest.raises(MoetraceError, match="--accel kvm: QEMU stopped under KVM .*signal 6"):
        L.run_in_guest("6.12", ["true"], tmp_path / "lab3", qemu=str(q), timeout_s=30, accel="kvm")
    assert not list(Path(tmp_path).glob("moetrace-lab-*"))


def test_the_guest_finds_current_bytecode_for_every_module(tmp_path, monkeypatch):
    """The guest reads the host's root read-only: `lab run` writes moetrace's bytecode first (a
    module edited since, or never compiled on a host with PYTHONDONTWRITEBYTECODE, would be
    compiled at every boot: 2.3 s of `record`'s start-up under TCG)."""
    import importlib.util
    import os
    import struct

    dirs = L.package_dirs()
    assert {d.name for d in dirs} >= {"toolkit", "analyses", "probes"}
    mod = Path(L.__file__).resolve()
    pyc = Path(importlib.util.cache_from_source(str(mod)))
    pyc.unlink(missing_ok=True)
    L.byte_compile_package()
    for src in sorted(p for d in dirs for p in d.rglob("*.py")):
        c = Path(importlib.util.cache_from_source(str(src)))
        assert c.exists(), f"no bytecode for {src}"
        mtime, size = struct.unpack("<II", c.read_bytes()[8:16])
        st = os.stat(src)
        assert (mtime, size) == (int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF), f"stale bytecode for {src}"


def test_a_lab_workdir_is_removed_at_the_end_and_one_whose_owner_died_by_the_next_run(tmp_path):
    from moetrace.lab.run import lab_workdir

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "moetrace-lab-stale"
    stale.mkdir()
    (stale / "owner").write_text(f"{dead.pid} 1\n")  # a SIGKILLed run's (its pid gone or reused)
    (stale / "pool.ext4").write_bytes(b"x")
    legacy = tmp_path / "moetrace-lab-legacy"  # no owner file: not known to be ours, left alone
    legacy.mkdir()
    alive = tmp_path / "moetrace-lab-alive"
    alive.mkdir()
    (alive / "owner").write_text(f"{os.getpid()} {Path(f'/proc/{os.getpid()}/stat').read_text().rsplit(')', 1)[1].split()[19]}\n")
    with lab_workdir(tmp_path) as wd:
        assert Path(wd).is_dir() and Path(wd, "owner").read_text().split()[0] == str(os.getpid())
        assert not stale.exists() and legacy.exists() and alive.exists()
    assert not Path(wd).exists()


def _bzimage(path: Path, version: str) -> Path:
    """A file with an x86 boot protocol setup header pointing at ``version`` (what `make bzImage`
    writes at 0x202 / 0x20E), nothing bootable."""
    import struct

    b = bytearray(0x800)
    b[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", b, 0x20E, 0x400 - 0x200)
    v = version.encode() + b" (me@box) #1 SMP\0"
    b[0x400:0x400 + len(v)] = v
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(b))
    return path


DRIVERS_Y = "".join(f"CONFIG_{k}=y\n" for k in ("VIRTIO_PCI", "VIRTIO_BLK", "NET_9P_VIRTIO", "9P_FS",
                                                "OVERLAY_FS", "EXT4_FS"))


def test_a_kernel_image_of_ones_own_is_named_by_its_header_and_its_drivers_checked(tmp_path):
    from moetrace.lab.run import image_config, image_release

    tree = tmp_path / "linux"
    img = _bzimage(tree / "arch" / "x86" / "boot" / "bzImage", "7.3.0-rc1-mglru+")
    assert image_release(img) == "7.3.0-rc1-mglru+" and image_release(tmp_path) is None
    (tmp_path / "junk").write_bytes(b"\0" * 4096)
    assert image_release(tmp_path / "junk") is None
    (tree / ".config").write_text(DRIVERS_Y)
    assert image_config(img, "7.3.0-rc1-mglru+") == tree / ".config"
    # every driver built in: no modules needed
    assert L.resolve_kernel(str(img)) == ("7.3.0-rc1-mglru+", img) and L.modules_base("7.3.0-rc1-mglru+") is None
    # 9p as modules: refused without them, accepted with a modules_install directory that has them
    (tree / ".config").write_text(DRIVERS_Y.replace("CONFIG_9P_FS=y", "CONFIG_9P_FS=m"))
    with pytest.raises(UsageError, match=r"(?s)lacks the guest's drivers 9p .*--modules DIR"):
        L.resolve_kernel(str(img))
    mods = tmp_path / "mods"
    d = mods / "lib" / "modules" / "7.3.0-rc1-mglru+"
    d.mkdir(parents=True)
    (d / "modules.dep").write_text("kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko\nkernel/net/9p/9pnet.ko:\n")
    assert L.resolve_kernel(str(img), mods)[0] == "7.3.0-rc1-mglru+"
    assert L.modules_base("7.3.0-rc1-mglru+", mods) == d
    assert [p.name for p in L.module_files("7.3.0-rc1-mglru+", ("9p",), d)] == ["9pnet.ko", "9p.ko"]
    with pytest.raises(UsageError, match="no modules.dep for 7.3.0-rc1-mglru"):
        L.modules_base("7.3.0-rc1-mglru+", tmp_path)
    with pytest.raises(UsageError, match="no kernel image"):
        L.resolve_kernel(str(tmp_path / "nope" / "bzImage"))


def test_lab_kernels_says_what_an_image_lacks(tmp_path):
    from click.testing import CliRunner

    from moetrace.cli import cli

    img = _bzimage(tmp_path / "bzImage", "7.3.0-test")
    (tmp_path / "config").write_text(DRIVERS_Y.replace("CONFIG_OVERLAY_FS=y\n", "") + "CONFIG_BPF_SYSCALL=y\n"
                                     "# CONFIG_LRU_GEN is not set\nCONFIG_KPROBES=y\n")
    r = CliRunner().invoke(cli, ["lab", "kernels", str(img), "--json"])
    assert r.exit_code == 0, r.output
    k, = json.loads(r.output)
    assert k["release"] == "7.3.0-test" and k["config"] == str(tmp_path / "config") and not k["running"]
    lacks = " | ".join(k["lacks"])
    assert "MGLRU (CONFIG_LRU_GEN)" in lacks and "overlay" in lacks and "kprobes" not in lacks
    assert "BTF" in lacks  # a header and no kernel: no BTF in it
