"""`moetrace lab run`: boot another kernel under QEMU with this host's root read-only, run one
command in it, power off, and bring back what it wrote (README.md, "Kernel lab").

The guest: a busybox initramfs built here (the kernel's 9p / virtio modules from
/lib/modules/R, resolved through modules.dep; built-in ones skipped), the host root over 9p
read-only, a guest tmpfs over /tmp, and one writable 9p share, the lab directory, at
``/tmp/lab`` in the guest. The command runs there as PID 1's child with MGLRU switched as
asked; its exit status, the guest's kernel release and MGLRU state land in ``lab.json``.
``--accel auto`` tries KVM first and boots under TCG when KVM fails before COMMAND starts, in
any way (a hang, an abort, an exit), with the reason in lab.json; a guest still running at the
timeout is killed (by pid) and reported.
"""

from __future__ import annotations

import gzip
import io
import json
import lzma
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moetrace.atomic import atomic_write
from moetrace.errors import MoetraceError, UsageError
from moetrace.kernel.syscalls import set_pdeathsig
from moetrace.run.documents import LAB_SCHEMA, Lab
from moetrace.run.metadata import write_lab

#: modules the guest needs (with their dependencies, from modules.dep); ext4 only with a pool
GUEST_MODULES = ("virtio_pci", "virtio_blk", "9pnet_virtio", "9p", "overlay")
POOL_MODULES = ("ext4",)
#: the memory cgroup `--memcg` makes in the guest (cgroup v2)
GUEST_MEMCG = "/sys/fs/cgroup/lab"
#: the guest's CPU under TCG. Not "max": QEMU 7.2's TCG then offers AVX/AVX2, and numpy's
#: AVX2 sort kernels crash in the guest (measured: np.sort/argsort SIGSEGV on 6.12 under
#: -cpu max, which killed `moetrace record` while it built its tables; none with this model)
TCG_CPU = os.environ.get("MOETRACE_LAB_CPU", "Nehalem")
#: TCG's threading. "single": every vCPU on one host thread. QEMU 7.2's multi-threaded TCG lets a
#: vCPU run stale code after the kernel patched it on another (text_poke_bp's int3 survives
#: the patch): "Oops: int3" in syscall_exit_to_user_mode_prepare while the recorder attached
#: tracepoints (a static key flipped), then "Fatal exception in interrupt" (1 of 3 full-set
#: recordings; the ~1 in 137 boots that panicked at 1.6 s had the same last line)
TCG_THREAD = os.environ.get("MOETRACE_LAB_TCG_THREAD", "single")
#: the guest's vCPUs when none are asked for, per accelerator. TCG runs every vCPU on one host thread
#: (TCG_THREAD), so a second one adds no parallelism, only its cost: measured on 6.12, `record --
#: true` started its command 18.0 s after boot with 2 vCPUs and 13.3 s with 1 (the boot 4.8 -> 4.3 s,
#: the probes' loads and attaches, which patch kernel text on every vCPU, 2.5 -> 2.3 s)
DEFAULT_CPUS = {"kvm": 2, "tcg": int(os.environ.get("MOETRACE_LAB_TCG_CPUS", "1"))}
#: seconds a KVM guest has to reach COMMAND (a TCG boot takes 3-5 s; under this host's nested
#: PVM KVM a stock kernel hangs, so `--accel auto` then falls back to TCG)
KVM_BOOT_DEADLINE_S = float(os.environ.get("MOETRACE_LAB_KVM_DEADLINE", "20"))
#: boots retried when the guest panicked before COMMAND started
BOOT_RETRIES = 2
GUEST_SHARE = "/tmp/lab"
ALIASES = {"6.1": "6.1.0-47-amd64", "6.12": "6.12.95+deb12-amd64"}


#: the guest's drivers (GUEST_MODULES + POOL_MODULES) and the config symbol of each
GUEST_DRIVERS = {"virtio_pci": "CONFIG_VIRTIO_PCI", "virtio_blk": "CONFIG_VIRTIO_BLK",
                 "9pnet_virtio": "CONFIG_NET_9P_VIRTIO", "9p": "CONFIG_9P_FS", "overlay": "CONFIG_OVERLAY_FS",
                 "ext4": "CONFIG_EXT4_FS"}


def image_release(image: str | os.PathLike) -> str | None:
    """The release a bzImage says it is: the x86 boot protocol's setup header ("HdrS" at 0x202)
    points at the version string (0x20E: its offset - 0x200), whose first word is the release
    (a kernel tree's own build included). None: not a bzImage."""
    import struct

    try:
        with open(image, "rb") as fh:
            head = fh.read(0x210)
            if len(head) < 0x210 or head[0x202:0x206] != b"HdrS":
                return None
            fh.seek(struct.unpack_from("<H", head, 0x20E)[0] + 0x200)
            text = fh.read(256).split(b"\0", 1)[0].decode("ascii", "replace").strip()
    except OSError:
        return None
    return text.split()[0] if text else None


def image_config(image: str | os.PathLike, release: str | None) -> Path | None:
    """The config of a kernel image: beside it (``config``), its tree's ``.config`` when it is
    ``<tree>/arch/x86/boot/bzImage``, else /boot/config-RELEASE."""
    img = Path(image).resolve()
    cands = [img.parent / "config", img.parent / f"config-{release}"]
    if len(img.parents) > 3 and img.parent.name == "boot" and img.parents[1].name == "x86":
        cands.append(img.parents[3] / ".config")
    if release:
        cands.append(Path(f"/boot/config-{release}"))
    return next((c for c in cands if c.is_file()), None)


def missing_drivers(config: dict[str, str], modules_dep: Path | None) -> list[str]:
    """The guest's drivers that are neither built in (=y) nor in ``modules_dep`` as modules."""
    have = set()
    if modules_dep is not None and modules_dep.is_file():
        for line in modules_dep.read_text().splitlines():
            have.add(Path(line.partition(":")[0]).name.split(".ko")[0].replace("-", "_"))
    return [d for d, key in GUEST_DRIVERS.items() if config.get(key) != "y" and d not in have]


def resolve_kernel(kernel: str, modules: str | os.PathLike | None = None) -> tuple[str, Path]:
    """(release, image) of '6.1', '6.12', 'newest' (the newest unpacked lab kernel), a release
    under /boot or unpacked by the lab set-up (also by its version prefix, '7.2'), or an image path
    (a kernel tree's arch/x86/boot/bzImage: its release read from the image's header; its modules
    from ``modules``, a `make modules_install INSTALL_MOD_PATH=DIR` directory, or built in)."""
    from moetrace.kernel.kconfig import unpacked_tree

    if "/" in kernel:
        img = Path(kernel)
        if not img.is_file():
            raise UsageError(f"no kernel image {img}", hint="give a bzImage (a kernel tree's arch/x86/boot/bzImage)")
        rel = image_release(img) or img.name.removeprefix("vmlinuz-")
        _check_guest_drivers(rel, img, modules)
        return rel, img
    else:
        rel = ALIASES.get(kernel) or _unpacked_alias(kernel) or kernel
        tree = unpacked_tree(rel)
        img = tree / "vmlinuz" if tree is not None and not Path(f"/boot/vmlinuz-{rel}").is_file() \
            else Path(f"/boot/vmlinuz-{rel}")
    if not img.is_file():
        raise UsageError(f"no kernel image {img}", hint="`moetrace lab setup` installs the lab kernels; "
                                                       "`moetrace lab kernels` lists what is here")
    if modules is not None:
        _check_guest_drivers(rel, img, modules)
    elif not (modules_dir(rel) / "modules.dep").is_file():
        raise UsageError(f"no modules for {rel} (no {modules_dir(rel) / 'modules.dep'})",
                         hint="install its linux-image package, or `moetrace lab setup` for the lab's kernels")
    return rel, img


def modules_base(release: str, modules: str | os.PathLike | None = None) -> Path | None:
    """Where the guest's modules come from: ``modules`` (DIR/lib/modules/RELEASE of a
    `modules_install INSTALL_MOD_PATH=DIR`, or DIR itself holding modules.dep), else the installed
    or unpacked kernel's; None when there are none (the drivers built in)."""
    if modules is not None:
        d = Path(modules)
        for cand in (d / "lib" / "modules" / release, d):
            if (cand / "modules.dep").is_file():
                return cand
        raise UsageError(f"--modules {d}: no modules.dep for {release} (neither {d / 'lib/modules' / release} nor {d})",
                         hint="give the INSTALL_MOD_PATH of `make modules_install` (the release must match the image)")
    base = modules_dir(release)
    return base if (base / "modules.dep").is_file() else None


def _check_guest_drivers(release: str, image: Path, modules) -> None:
    """UsageError naming the guest drivers (virtio, 9p, overlay, ext4) that the image's config
    neither builds in nor the modules provide."""
    from moetrace.kernel.kconfig import parse_config

    base = modules_base(release, modules)
    cfg_path = image_config(image, release)
    if cfg_path is None:
        if base is None:
            raise UsageError(f"no modules and no config for {image} ({release})",
                             hint="give --modules DIR (make modules_install INSTALL_MOD_PATH=DIR), or put the "
                                  "tree's .config beside the image as 'config'")
        return
    missing = missing_drivers(parse_config(cfg_path.read_text()), base / "modules.dep" if base else None)
    if missing:
        raise UsageError(f"{image} ({release}) lacks the guest's drivers {', '.join(missing)} ({cfg_path}: not "
                         f"=y, and not among {'the modules of ' + str(base) if base else 'any modules'})",
                         hint="build them in (=y) or as modules and give --modules DIR of `make modules_install "
                              "INSTALL_MOD_PATH=DIR`")


def unpacked_releases() -> list[str]:
    """Releases the lab set-up unpacked (not installed as the host's kernels), oldest first."""
    from moetrace.kernel.kconfig import LAB_KERNELS, unpacked_tree

    rels = [d.name for d in LAB_KERNELS.glob("*") if unpacked_tree(d.name) is not None] \
        if LAB_KERNELS.is_dir() else []
    return sorted(rels, key=_version_key)


def _version_key(release: str) -> tuple:
    import re

    return tuple(int(x) for x in re.findall(r"\d+", release.split("+")[0].split("-")[0])) + (release,)


def _unpacked_alias(kernel: str) -> str | None:
    """'newest' or a version prefix ('7.2') of an unpacked lab kernel."""
    rels = unpacked_releases()
    if kernel == "newest":
        return rels[-1] if rels else None
    hit = [r for r in rels if r.startswith(kernel + ".") or r.startswith(kernel + "+")]
    return hit[-1] if hit else None


def modules_dir(release: str) -> Path:
    """/lib/modules/RELEASE for an installed kernel, else an unpacked lab kernel's."""
    from moetrace.kernel.kconfig import unpacked_tree

    installed = Path(f"/lib/modules/{release}")
    if (installed / "modules.dep").is_file():
        return installed
    return unpacked_tree(release) or installed


def module_files(release: str, wanted=GUEST_MODULES, base: Path | None = None) -> list[Path]:
    """The .ko files to load, dependencies first (built-in modules left out); ``base``: the
    modules' directory (default: the release's installed or unpacked ones; none there: [])."""
    base = base or modules_base(release)
    if base is None:
        return []
    deps: dict[str, list[str]] = {}
    for line in (base / "modules.dep").read_text().splitlines():
        mod, _, rest = line.partition(":")
        deps[mod] = rest.split()
    by_name = {Path(m).name.split(".ko")[0].replace("-", "_"): m for m in deps}
    order: list[str] = []

    def visit(m: str) -> None:
        for d in deps.get(m, []):
            visit(d)
        if m not in order:
            order.append(m)

    for w in wanted:
        if w in by_name:
            visit(by_name[w])
    return [base / m for m in order]


def _cpio(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive of (path, mode, data) entries (directories: data b'')."""
    out = io.BytesIO()
    for ino, (name, mode, data) in enumerate(entries + [("TRAILER!!!", 0, b"")], start=1):
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0))
        out.write(hdr.encode() + nb)
        out.write(b"\0" * ((4 - (110 + len(nb)) % 4) % 4))
        out.write(data)
        out.write(b"\0" * ((4 - len(data) % 4) % 4))
    return out.getvalue()


INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod /modules/$m || echo "lab: insmod $m failed"; done
fail() { echo "lab: $*"; echo o > /proc/sysrq-trigger; sleep 30; }
# virtio devices probe asynchronously: a 9p tag may not exist yet right after insmod (seen once)
mount9p() { i=0; while ! mount -t 9p -o "trans=virtio,version=9p2000.L,msize=262144$3" "$1" "$2" 2>/dev/null; do
  i=$((i + 1)); [ $i -ge 100 ] && return 1; sleep 0.05; done; }
mkdir -p /newroot
mount9p hostroot /newroot ",ro,cache=loose" || fail "cannot mount the host root (9p tag hostroot)"
# /tmp: the host's /tmp read-only beneath, the guest's writes in a tmpfs above (overlayfs), so
# files the host has under /tmp (a pool, a plan) are there and nothing reaches the host
mkdir -p /upper; mount -t tmpfs tmpfs /upper; mkdir -p /upper/up /upper/work
mount -t overlay overlay -o lowerdir=/newroot/tmp,upperdir=/upper/up,workdir=/upper/work /newroot/tmp \
  || { echo "lab: no overlay over /tmp (a plain tmpfs instead)"; mount -t tmpfs tmpfs /newroot/tmp; }
mkdir -p /newroot/tmp/lab
mount9p labshare /newroot/tmp/lab "" || fail "cannot mount the lab share (9p tag labshare)"
mount -t proc proc /newroot/proc; mount -t sysfs sys /newroot/sys; mount -t devtmpfs dev /newroot/dev
mount -t tmpfs tmpfs /newroot/run
mount -t cgroup2 none /newroot/sys/fs/cgroup 2>/dev/null
exec switch_root /newroot /bin/sh /tmp/lab/.guest.sh
"""

GUEST = r"""#!/bin/sh
cd /tmp/lab
up() { cut -d' ' -f1 /proc/uptime; }
export HOME=/tmp PATH=@BIN@:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# the host's root is read-only here: cells without --out land in the lab share (back on the host)
export MOETRACE_RUN_ROOT="${MOETRACE_RUN_ROOT:-/tmp/lab}"
mount -t debugfs none /sys/kernel/debug 2>/dev/null
mount -t tracefs none /sys/kernel/tracing 2>/dev/null
setup_failed() { echo "lab: $*" > /tmp/lab/stderr; echo "{\"setup_error\": \"$*\", \"exit_status\": 125," \
  "\"release\": \"$(uname -r)\", \"mglru\": \"none\"}" > .guest-status.json; sync; echo o > /proc/sysrq-trigger; sleep 30; }
POOL=@POOL@
if [ -n "$POOL" ]; then
  # the pool's disk by its serial (a swap disk may come first), else the first disk
  dev=/dev/vda; for s in /sys/block/vd*/serial; do [ "$(cat "$s" 2>/dev/null)" = @POOL_SERIAL@ ] && dev=/dev/${s#/sys/block/} && dev=${dev%/serial}; done
  mkdir -p "$POOL" 2>/dev/null; mount -t ext4 -o ro,noatime "$dev" "$POOL" || setup_failed "cannot mount the pool image ($dev) at $POOL"
fi
MEMCG=@MEMCG@
if [ -n "$MEMCG" ]; then
  { echo +memory > /sys/fs/cgroup/cgroup.subtree_control && mkdir -p @CGDIR@ && echo "$MEMCG" > @CGDIR@/memory.max \
    && { echo 0 > @CGDIR@/memory.swap.max 2>/dev/null; true; }; } || setup_failed "cannot make the memory cgroup @CGDIR@"
  export MOETRACE_LAB_CGROUP=@CGDIR@
fi
MGLRU=@MGLRU@
if [ -e /sys/kernel/mm/lru_gen/enabled ] && [ "$MGLRU" != keep ]; then
  if [ "$MGLRU" = on ]; then echo y > /sys/kernel/mm/lru_gen/enabled; else echo n > /sys/kernel/mm/lru_gen/enabled; fi
fi
# under TCG every vCPU runs on one host thread: the recorder's warm-up does not overlap its loads,
# so it imports only what a replay shares with it, and only for a command in a cgroup of its own
# (moetrace.lazyimport)
if grep -q 'moetrace.accel=tcg' /proc/cmdline && [ -z "${MOETRACE_WARM_IMPORTS+x}" ]; then
  export MOETRACE_WARM_IMPORTS=pyarrow,pyarrow.parquet
fi
@ENV@
echo "{\"cmd_start_uptime_s\": $(up)," > .guest-status.json
@CMD@ > /tmp/lab/stdout 2> /tmp/lab/stderr
rc=$?
lru=$(cat /sys/kernel/mm/lru_gen/enabled 2>/dev/null || echo none)
echo "\"exit_status\": $rc, \"release\": \"$(uname -r)\", \"mglru\": \"$lru\", \"end_uptime_s\": $(up)}" >> .guest-status.json
sync
echo o > /proc/sysrq-trigger
sleep 30
"""


def build_initramfs(release: str, dest: Path, modules=GUEST_MODULES, base: Path | None = None) -> Path:
    busybox = shutil.which("busybox") or "/bin/busybox"
    entries: list[tuple[str, int, bytes]] = []
    for d in ("bin", "dev", "proc", "sys", "modules", "newroot", "tmp"):
        entries.append((d, stat.S_IFDIR | 0o755, b""))
    entries.append(("bin/busybox", stat.S_IFREG | 0o755, Path(busybox).read_bytes()))
    entries.append(("init", stat.S_IFREG | 0o755, INIT.encode()))
    names = []
    for f in module_files(release, modules, base):
        data = f.read_bytes()
        name = f.name
        if name.endswith(".xz"):
            data, name = lzma.decompress(data), name[:-3]
        elif name.endswith(".zst"):
            import zstandard

            data, name = zstandard.ZstdDecompressor().decompressobj().decompress(data), name[:-4]
        entries.append((f"modules/{name}", stat.S_IFREG | 0o644, data))
        names.append(name)
    entries.append(("modules.order", stat.S_IFREG | 0o644, ("\n".join(names) + "\n").encode()))
    dest.write_bytes(gzip.compress(_cpio(entries), compresslevel=1))
    return dest


def pool_image(pool_dir: Path, dest: Path) -> Path:
    """An ext4 image holding ``pool_dir``'s files (mke2fs -d: nothing mounted on the host).
    The guest mounts it read-only at the pool's own path, so its reads go through the guest's
    page cache and block layer (virtio-blk), not 9p."""
    pool_dir = Path(pool_dir)
    if not pool_dir.is_dir():
        raise UsageError(f"--pool {pool_dir}: not a directory", hint="a pool made by `moetrace pool create`")
    if shutil.which("mke2fs") is None:
        raise UsageError("mke2fs not found", hint="apt-get install e2fsprogs")
    files = [f for f in pool_dir.rglob("*") if f.is_file()]
    data = sum(-(-f.stat().st_size // 4096) * 4096 for f in files)
    size_kib = (data + data // 10 + (16 << 20) + 4096 * len(files)) // 1024
    r = subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", "-O", "^has_journal", "-b", "4096", "-L", "moepool",
                        "-d", str(pool_dir), str(dest), f"{size_kib}k"], capture_output=True, text=True)
    if r.returncode != 0:
        raise MoetraceError(f"mke2fs could not build the pool image from {pool_dir}: {r.stderr.strip()}",
                            hint="is there room in the temporary directory (TMPDIR)?")
    return dest


def swap_drive(dest: Path, size_bytes: int) -> list[str]:
    """QEMU arguments of a blank (sparse) raw disk of ``size_bytes`` at ``dest`` for the guest's
    swap, found there by its serial (SWAP_SERIAL); removed with the boot's work directory."""
    with open(dest, "wb") as fh:
        fh.truncate(int(size_bytes))
    return ["-drive", f"file={dest},if=none,id=moeswap,format=raw",
            "-device", f"virtio-blk-pci,drive=moeswap,serial={SWAP_SERIAL}"]


def _qemu(argv: list[str], timeout_s: float, started: Callable[[], bool] | None = None,
          boot_deadline_s: float | None = None) -> tuple[str, bytes, int]:
    """Run QEMU to its end or the timeout: (status ok|timeout|boot-timeout, its stderr, its
    return code). ``boot_deadline_s``: QEMU is killed ("boot-timeout") when ``started()`` is
    still false by then. QEMU dies with this process even when it is SIGKILLed (PDEATHSIG),
    and a SIGTERM unwinds like Ctrl-C (QEMU killed, the caller's temporary directory removed)."""
    old_term = signal.signal(signal.SIGTERM, _terminated)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=set_pdeathsig)
    status = "ok"
    t0 = time.monotonic()
    watch = started is not None and boot_deadline_s is not None
    try:
        while True:
            left = timeout_s - (time.monotonic() - t0)
            try:
                _o, err = proc.communicate(timeout=max(0.0, min(left, 0.5) if watch else left))
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic() - t0
                if watch and started():
                    watch = False
                    continue
                if watch and now >= boot_deadline_s:
                    status = "boot-timeout"
                elif now < timeout_s:
                    continue
                else:
                    status = "timeout"
                os.killpg(proc.pid, signal.SIGKILL)
                _o, err = proc.communicate()
                break
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, old_term)
    return status, err or b"", proc.returncode


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def _why_stopped(console: str) -> str:
    """The console's own words for a guest that powered off early (a panic, an init failure)."""
    lines = console.splitlines()
    for key in ("Kernel panic", "lab: ", "BUG: ", "Oops"):
        hit = [ln.strip() for ln in lines if key in ln]
        if hit:
            return hit[0]
    return "no panic on the console (last line: " + (lines[-1].strip() if lines else "none") + ")"


def kvm_unusable(dev: str = "/dev/kvm") -> str | None:
    """None when this process can open ``dev`` read-write (QEMU's KVM can start), else why not."""
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return f"cannot open {dev}: {e.strerror}"
    os.close(fd)
    return None


def accel_cache() -> Path:
    """Where `--accel auto` remembers a KVM that failed ($XDG_CACHE_HOME or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moetrace" / "lab-accel.json"


def _kvm_failed_before(release: str) -> str | None:
    """"<ISO time>: <reason>" of the last KVM failure of this guest kernel on this host kernel,
    or None. (Caches written before reasons were kept hold ``kvm_hung``: a hang.)"""
    try:
        seen = json.loads(accel_cache().read_text())
    except (OSError, ValueError):
        return None
    hit = seen.get(f"{os.uname().release} {release}") if isinstance(seen, dict) else None
    if not isinstance(hit, dict):
        return None
    if hit.get("kvm_failed"):
        return f"{hit['kvm_failed']}: {hit.get('reason') or 'no reason kept'}"
    return f"{hit['kvm_hung']}: it hung before COMMAND" if hit.get("kvm_hung") else None


def _remember_kvm_failed(release: str, reason: str) -> None:
    path = accel_cache()
    try:
        seen = json.loads(path.read_text())
        seen = seen if isinstance(seen, dict) else {}
    except (OSError, ValueError):
        seen = {}
    seen[f"{os.uname().release} {release}"] = {"kvm_failed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                               "reason": reason}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as tmp:
            tmp.write_text(json.dumps(seen, indent=1) + "\n")
    except OSError:  # not remembered: the next auto run tries KVM again
        pass


def kvm_failure(status: str, started: bool, rc: int | None, err: bytes, console: str = "") -> str | None:
    """Why a KVM boot failed before COMMAND started, or None when it did not fail so. Any way
    counts (measured in the kernel lab: KVM differs from machine to machine): the guest
    hung (killed at the KVM deadline), or QEMU stopped before the guest reached COMMAND (an
    abort such as "failed to set MSR 0x10a", exit -6 with an empty console, or any exit)."""
    if status == "boot-timeout":
        return (f"the guest did not reach COMMAND within {KVM_BOOT_DEADLINE_S:.0f} s under KVM "
                f"(a nested KVM that hangs stock kernels does this)")
    if started or status != "ok":
        return None
    if rc == 0:
        return f"the guest powered off under KVM before COMMAND started: {_why_stopped(console)}"
    lines = [ln.strip() for ln in err.decode(errors="replace").splitlines() if ln.strip()]
    said = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "nothing on stderr")
    how = f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exit status {rc}"
    return f"QEMU stopped under KVM before COMMAND started ({how}: {said[:300]})"


#: the guest kernel's command line (moetrace.accel=kvm|tcg is added per boot)
KERNEL_CMDLINE = "console=ttyS0 panic=-1 quiet loglevel=3"
#: more of it per accelerator. TCG emulates its CPU model (TCG_CPU): the kernel's speculation
#: mitigations there guard nothing and cost the most of anything under emulation (page-table
#: isolation switches CR3 at every kernel entry and exit, and without PCID each switch flushes
#: TCG's software TLB): `record -- true` started its command 15.8-16.1 s after boot with
#: mitigations=off, 18.5-20.2 s without (6.12, interleaved). KVM runs the host's CPU: its
#: mitigations stay as the kernel chooses (a guest measured there is a kernel as deployed).
ACCEL_CMDLINE = {"kvm": "", "tcg": "mitigations=off"}
#: QEMU arguments of each accelerator (TCG's CPU model and threading: see TCG_CPU, TCG_THREAD)
ACCEL_ARGS = {"kvm": lambda thread: ["-accel", "kvm", "-cpu", "host"],
              "tcg": lambda thread: ["-accel", f"tcg,thread={thread}", "-cpu", TCG_CPU]}
#: the disks' serials (/sys/block/vdX/serial in the guest): how the guest finds them
POOL_SERIAL, SWAP_SERIAL = "moetrace-pool", "moetrace-swap"


@dataclass
class LabResult:
    status: str  # "ok", "timeout", "no-status"
    exit_status: int | None
    doc: Lab  # what lab.json holds


WORKDIR_PREFIX = "moetrace-lab-"
OWNER = "owner"


@contextmanager
def lab_workdir(root: str | os.PathLike | None = None):
    """A work directory for one boot (initramfs, the pool's image, the console) under the temp
    root, removed at the end; one whose owner died (SIGKILL) is removed by the next run here."""
    from moetrace.capacity.scope import proc_start_time

    root = Path(root or tempfile.gettempdir())
    remove_stale_workdirs(root)
    tmp = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=root))
    try:
        (tmp / OWNER).write_text(f"{os.getpid()} {proc_start_time(os.getpid())}\n")
        yield str(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_workdirs(root: str | os.PathLike) -> list[str]:
    """Remove every lab work directory under ``root`` whose owner file names a process that is
    gone (pid and start time: no pid reuse); one without an owner file is left alone."""
    from moetrace.capacity.scope import pid_alive

    removed = []
    for d in Path(root).glob(WORKDIR_PREFIX + "*"):
        try:
            pid, start = (d / OWNER).read_text().split()
            alive = pid_alive(int(pid), None if start == "None" else int(start))
        except (OSError, ValueError):
            continue
        if not alive:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


def byte_compile_package() -> None:
    """Write the bytecode of moetrace's modules where it is missing or stale (compileall; ~0.3 s
    when none is there, ms when all is current). The guest reads the host's root read-only, so it
    cannot write bytecode: without this, every boot compiles each module it imports from source
    (38 modules, 2.3 s of `record`'s start-up under TCG, on a host with PYTHONDONTWRITEBYTECODE
    or after an edit)."""
    import compileall

    for d in package_dirs():
        compileall.compile_dir(str(d), quiet=2, workers=1)


def package_dirs() -> list[Path]:
    """The directories moetrace's packages live in (toolkit/, analyses/, probes/: pyproject's
    package-dir)."""
    import importlib.util

    out = []
    for name in ("moetrace", "moetrace.analyses", "moetrace.probes"):
        spec = importlib.util.find_spec(name)
        for loc in (spec.submodule_search_locations or []) if spec else []:
            if Path(loc).resolve() not in out:
                out.append(Path(loc).resolve())
    return out


def _core_btf_for(image: Path) -> Path | None:
    """The probes' minimal BTF for this kernel, made here before it boots (moetrace.kernel.minbtf):
    in the guest, where the host's root is read-only, the recorder finds it through that root and
    libbpf skips parsing the kernel's whole BTF per object (seconds each under TCG)."""
    from moetrace.kernel import minbtf
    from moetrace.kernel.bpf import probe_objects

    objs = probe_objects()
    if not objs or not image.is_file():
        return None
    try:
        return minbtf.ensure_for_image(image, objs)
    except OSError:
        return None


def run_in_guest(kernel: str, command: list[str], out: Path, *, memory: str = "2G", cpus: int | None = None,
                 mglru: str = "keep", timeout_s: float = 600.0, env: dict[str, str] | None = None,
                 pool: Path | None = None, memcg: str | None = None, accel: str = "auto",
                 qemu: str = "qemu-system-x86_64", modules: str | os.PathLike | None = None,
                 swap_bytes: int | None = None, tcg_thread: str | None = None) -> LabResult:
    """Boot ``kernel``, run ``command`` in the guest (cwd /tmp/lab = ``out``), power off.

    ``pool``: a directory put on a virtio-blk ext4 image and mounted read-only at its own
    path in the guest. ``memcg``: a memory.max for a cgroup v2 made in the guest
    (GUEST_MEMCG, exported as MOETRACE_LAB_CGROUP). ``cpus``: vCPUs, else DEFAULT_CPUS of the
    accelerator the guest boots under. ``modules``: the guest's modules for a kernel image of one's
    own (:func:`modules_base`). ``swap_bytes``: a blank raw disk of that size (serial SWAP_SERIAL;
    the guest's own mkswap/swapon: moetrace.lab.guest). ``tcg_thread``: TCG's threading, single
    or multi (default TCG_THREAD; in lab.json)."""
    kvm_why = _check_guest_options(mglru, accel, qemu, memcg)
    tcg_thread = tcg_thread or TCG_THREAD
    release, image = resolve_kernel(kernel, modules)
    mod_base = modules_base(release, modules)
    core_btf = _core_btf_for(Path(image))
    byte_compile_package()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _clear_guest_outputs(out)
    pool_path = str(Path(pool).resolve()) if pool is not None else ""
    envs = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in (env or {}).items())
    (out / ".guest.sh").write_text(GUEST.replace("@MGLRU@", mglru).replace("@CMD@", shlex.join(command))
                                   .replace("@ENV@", envs).replace("@POOL@", shlex.quote(pool_path))
                                   .replace("@MEMCG@", shlex.quote(memcg or "")).replace("@CGDIR@", GUEST_MEMCG)
                                   .replace("@POOL_SERIAL@", POOL_SERIAL)
                                   # moetrace, replay, ... of this installation first on the guest's PATH
                                   .replace("@BIN@", shlex.quote(str(Path(sys.executable).parent))))
    t0 = time.monotonic()
    with lab_workdir() as tmp:
        initrd = build_initramfs(release, Path(tmp) / "initramfs.cpio.gz",
                                 GUEST_MODULES + (POOL_MODULES if pool is not None else ()), mod_base)
        drives: list[str] = []
        if pool is not None:
            img = pool_image(Path(pool), Path(tmp) / "pool.ext4")
            drives = ["-drive", f"file={img},if=none,id=moepool,format=raw,readonly=on",
                      "-device", f"virtio-blk-pci,drive=moepool,serial={POOL_SERIAL}"]
        if swap_bytes:
            drives += swap_drive(Path(tmp) / "swap.img", swap_bytes)
        console = Path(tmp) / "console.log"
        common = ["-m", memory, "-nographic", "-no-reboot",
                  "-kernel", str(image), "-initrd", str(initrd),
                  "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
                  "-virtfs", f"local,path={out.resolve()},mount_tag=labshare,security_model=none,multidevs=remap",
                  "-serial", f"file:{console}", "-monitor", "none", "-display", "none", *drives]
        boot = _boot(out, qemu, common, console, release, accel, kvm_why, cpus, timeout_s, tcg_thread)
        boot["wall"] = time.monotonic() - t0
        (out / "console.log").write_text(boot["text"])
    (out / ".guest.sh").unlink(missing_ok=True)
    doc: Lab = {"schema": LAB_SCHEMA, "kernel": release, "image": str(image), "command": command,
           "memory": memory, "cpus": boot["ncpu"], "kernel_cmdline": boot["append"], "mglru_requested": mglru,
           "accel": boot["used"], "accel_requested": accel, "kvm_fallback": boot["kvm_fallback"], "status": None,
           "tcg_thread": tcg_thread if boot["used"] == "tcg" else None, "swap_bytes": swap_bytes or None,
           "core_btf": str(core_btf) if core_btf else None, "pool": pool_path or None,
           "memcg": ({"path": GUEST_MEMCG, "memory.max": memcg} if memcg else None)}
    return _guest_result(out, release, doc, boot, timeout_s)


def _check_guest_options(mglru: str, accel: str, qemu: str, memcg: str | None) -> str | None:
    """UsageError for an option run_in_guest cannot honour; else why KVM cannot be used (None: it can)."""
    if mglru not in ("on", "off", "keep"):
        raise UsageError(f"--mglru {mglru!r}", hint="on, off or keep")
    if accel not in ("auto", "kvm", "tcg"):
        raise UsageError(f"--accel {accel!r}", hint="auto, kvm or tcg")
    kvm_why = kvm_unusable()
    if accel == "kvm" and kvm_why:
        raise UsageError(f"--accel kvm: {kvm_why}", hint="--accel tcg (emulated, ~20x slower) works everywhere")
    if shutil.which(qemu) is None:
        raise UsageError(f"{qemu} not found", hint="`moetrace lab setup` installs qemu-system-x86")
    if memcg is not None and not memcg.strip():
        raise UsageError("--memcg: empty", hint="a memory.max value, e.g. 80M")
    return kvm_why


def _clear_guest_outputs(out: Path) -> None:
    for f in (".guest-status.json", "stdout", "stderr"):
        (out / f).unlink(missing_ok=True)


def _boot(out: Path, qemu: str, common: list[str], console: Path, release: str, accel: str,
          kvm_why: str | None, cpus: int | None, timeout_s: float, tcg_thread: str = TCG_THREAD) -> dict[str, Any]:
    """Run the guest until COMMAND ran: under KVM first when it may (a KVM failure remembered,
    then TCG), booted again after a panic before COMMAND started (at most BOOT_RETRIES times).
    Returns status, err, rc, text (the console), used, ncpu, append, kvm_fallback, boot_failures."""
    before = _kvm_failed_before(release) if accel == "auto" and not kvm_why else None
    if before:
        kvm_why = (f"KVM failed this kernel here before ({before}; remembered in {accel_cache()}: "
                   f"--accel kvm tries it again)")
    accels = ["kvm", "tcg"] if accel == "auto" and not kvm_why else ["tcg"] if accel != "kvm" else ["kvm"]
    kvm_fallback = None if accel != "auto" or not kvm_why else f"KVM not tried: {kvm_why}"
    used = accels.pop(0)
    boot_failures: list[dict[str, Any]] = []
    while True:
        console.unlink(missing_ok=True)
        # the guest reads moetrace.accel from /proc/cmdline (an unknown module parameter: ignored)
        ncpu = cpus if cpus is not None else DEFAULT_CPUS[used]
        append = " ".join(filter(None, (KERNEL_CMDLINE, ACCEL_CMDLINE[used], f"moetrace.accel={used}")))
        argv = [qemu, *ACCEL_ARGS[used](tcg_thread), "-smp", str(ncpu), *common, "-append", append]
        started = (out / ".guest-status.json").exists
        status, err, rc = _qemu(argv, timeout_s, started, KVM_BOOT_DEADLINE_S if used == "kvm" else None)
        text = console.read_text(errors="replace") if console.exists() else ""
        why = kvm_failure(status, started(), rc, err, text) if used == "kvm" else None
        if why:
            if not accels:
                (out / "console.log").write_text(text)
                raise MoetraceError(f"--accel kvm: {why}", hint="--accel tcg (or auto: falls back by itself)")
            kvm_fallback = why
            _remember_kvm_failed(release, why)
            print(f"moetrace lab: {why}; falling back to TCG (remembered in {accel_cache()})", file=sys.stderr)
            used = accels.pop(0)
            _clear_guest_outputs(out)
            continue
        # a guest that died before COMMAND started (a panic while booting under TCG: seen once
        # in ~100 boots of 6.12, "Fatal exception in interrupt" at ~1.6 s): COMMAND never ran,
        # so boot again, at most BOOT_RETRIES times, and say so in lab.json
        if status == "ok" and not started() and "Kernel panic" in text and len(boot_failures) < BOOT_RETRIES:
            n = len(boot_failures) + 1
            (out / f"console-failed-boot-{n}.log").write_text(text)
            boot_failures.append({"attempt": n, "cause": _why_stopped(text),
                                  "console": f"console-failed-boot-{n}.log"})
            print(f"moetrace lab: the guest panicked before COMMAND started ({boot_failures[-1]['cause']}); "
                  f"booting again", file=sys.stderr)
            continue
        return {"status": status, "err": err, "rc": rc, "text": text, "used": used, "ncpu": ncpu,
                "append": append, "kvm_fallback": kvm_fallback, "boot_failures": boot_failures}


def _guest_result(out: Path, release: str, doc: Lab, boot: dict[str, Any], timeout_s: float) -> LabResult:
    """lab.json (``doc``, the boot's outcome and the guest's status file) and the LabResult; a
    MoetraceError when COMMAND did not finish (no status, set-up failed, timed out)."""
    st_path = out / ".guest-status.json"
    guest: dict[str, Any] = {}
    if st_path.exists():
        try:
            guest = json.loads(st_path.read_text())
        except json.JSONDecodeError:
            guest = {"raw": st_path.read_text()}
        st_path.unlink()
    status, text = boot["status"], boot["text"]
    if status == "ok" and "exit_status" not in guest:
        status = "no-status"
    doc = {**doc, "status": status, "host_wall_s": round(boot["wall"], 3), "qemu_returncode": boot["rc"],
           "boot_failures": boot["boot_failures"], "qemu_stderr": boot["err"].decode(errors="replace")[-2000:],
           **guest}
    if status != "ok":
        doc["console_tail"] = text[-4000:]
    write_lab(out / "lab.json", doc)
    if status == "no-status":
        raise MoetraceError(f"the guest ({release}) stopped before COMMAND finished: {_why_stopped(text)}",
                            hint=f"the console is in {out / 'console.log'}")
    if "setup_error" in guest:
        raise MoetraceError(f"the guest ({release}) could not set up: {guest['setup_error']}",
                            hint=f"see {out / 'console.log'}")
    if status == "timeout":
        raise MoetraceError(f"the guest ({release}) was still running after {timeout_s:.0f} s and was killed",
                            hint=f"see {out / 'lab.json'} (console_tail); raise --timeout")
    return LabResult(status, guest.get("exit_status"), doc)
