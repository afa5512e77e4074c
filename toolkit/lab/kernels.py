"""`moetrace lab kernels`: the kernels on this host and what matters to moetrace in each, read
without booting them: /boot/config-* (or /proc/config.gz for the running one), BTF from the
image (/boot/vmlinuz-*: the vmlinux inside, its .BTF section; /sys/kernel/btf/vmlinux for the
running one), and the headers under /lib/modules/RELEASE/build.

Debian ships a stub System.map ("The real System.map is in the linux-image-*-dbg package"), so
the functions a probe would attach to are looked up in BTF, with their signatures: how a user
vets a new MGLRU version (the names and arguments the mglru and mlock kprobes depend on)
before booting it.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: the functions moetrace's kprobes resolve by name (probes/mglru.bpf.c, probes/mlock.bpf.c)
LAB_FUNCTIONS = ("evict_folios", "isolate_folios", "should_run_aging", "try_to_inc_max_seq", "inc_max_seq",
                 "folio_inc_gen", "lru_gen_look_around", "walk_mm", "workingset_eviction", "workingset_refault",
                 "mlock_folio", "mlock_new_page", "mlock_new_folio", "munlock_page", "munlock_folio")
CONFIG_KEYS = ("CONFIG_LRU_GEN", "CONFIG_LRU_GEN_ENABLED", "CONFIG_KPROBES", "CONFIG_DEBUG_INFO_BTF",
               "CONFIG_BPF_SYSCALL", "CONFIG_FTRACE_SYSCALLS", "CONFIG_MEMCG", "CONFIG_9P_FS", "CONFIG_VIRTIO_BLK", "CONFIG_KERNEL_XZ",
               "CONFIG_KERNEL_ZSTD")


@dataclass
class KernelFacts:
    release: str
    running: bool
    image: str | None
    config: str | None
    btf_source: str | None
    mglru_built: bool | None
    mglru_default: str | None  # "on" / "off" (CONFIG_LRU_GEN_ENABLED); None when not built
    mglru_now: str | None  # the running kernel's /sys/kernel/mm/lru_gen/enabled
    kprobes: bool | None
    btf: bool | None
    bpf: bool | None
    headers: str  # "exact", "other (RELEASE)", "none"
    functions: dict[str, str | None] = field(default_factory=dict)  # name -> signature (None: absent)
    notes: list[str] = field(default_factory=list)
    #: what the lab needs and this kernel does not have (BTF, BPF, MGLRU, kprobes, the guest's drivers)
    lacks: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _yes(cfg: dict[str, str], key: str) -> bool | None:
    if not cfg:
        return None
    return cfg.get(key, "n") in ("y", "m")


def _headers(release: str, root: Path) -> str:
    """'exact' when /lib/modules/R/build's UTS_RELEASE is R (Debian's include/config/
    kernel.release holds the upstream version, 6.1.170 for 6.1.0-47-amd64: not that)."""
    import re

    build = root / "lib" / "modules" / release / "build"
    if not (build / "include").is_dir():
        return "none"
    try:
        text = (build / "include" / "generated" / "utsrelease.h").read_text()
    except OSError:
        return "unknown"
    m = re.search(r'UTS_RELEASE\s+"([^"]+)"', text)
    got = m.group(1) if m else "?"
    return "exact" if got == release else f"other ({got})"


def kernel_facts(release: str, root: str | os.PathLike = "/", image: str | os.PathLike | None = None,
                 modules: str | os.PathLike | None = None) -> KernelFacts:
    """What moetrace needs to know of kernel ``release`` (installed under ``root``), or of a kernel
    ``image`` of one's own (its config beside it or in its tree; ``modules``: its modules_install
    directory), with what the lab needs and it lacks."""
    from moetrace.errors import InputError
    from moetrace.kernel import btf as B
    from moetrace.kernel.kconfig import config_text, parse_config

    r = Path(root)
    running = release == platform.release() and Path(root) == Path("/") and image is None
    notes: list[str] = []
    if image is not None:
        from moetrace.lab.run import image_config

        cp = image_config(image, release)
        cfg_text, cfg_src = (cp.read_text(), str(cp)) if cp else (None, None)
    else:
        cfg_text, cfg_src = config_text(release, root)
    cfg = parse_config(cfg_text) if cfg_text else {}
    if not cfg:
        notes.append("no kernel config found (/boot/config-RELEASE, /proc/config.gz, or beside the image)")
    image = Path(image) if image is not None else r / "boot" / f"vmlinuz-{release}"
    if not image.is_file() and r == Path("/"):
        from moetrace.kernel.kconfig import unpacked_tree

        tree = unpacked_tree(release)
        image = tree / "vmlinuz" if tree is not None else image
    btf_path = Path("/sys/kernel/btf/vmlinux") if running and Path("/sys/kernel/btf/vmlinux").exists() else (
        image if image.is_file() else None)
    b = None
    if btf_path is not None:
        try:
            b = B.load(btf_path)
        except InputError as e:
            notes.append(f"BTF not read: {e.format_message()}")
    if b is None and btf_path is not None and not notes:
        notes.append(f"{btf_path} has no BTF")
    funcs = {f: (b.signature(f) if b is not None else None) for f in LAB_FUNCTIONS} if b is not None else {}
    mglru_now = None
    if running:
        try:
            mglru_now = Path("/sys/kernel/mm/lru_gen/enabled").read_text().strip()
        except OSError:
            mglru_now = None
    built = _yes(cfg, "CONFIG_LRU_GEN")
    facts = KernelFacts(
        release=release, running=running, image=str(image) if image.is_file() else None, config=cfg_src,
        btf_source=str(btf_path) if b is not None else None, mglru_built=built,
        mglru_default=(("on" if _yes(cfg, "CONFIG_LRU_GEN_ENABLED") else "off") if built else None),
        mglru_now=mglru_now, kprobes=_yes(cfg, "CONFIG_KPROBES"),
        btf=(b is not None) if btf_path is not None else _yes(cfg, "CONFIG_DEBUG_INFO_BTF"),
        bpf=_yes(cfg, "CONFIG_BPF_SYSCALL"), headers=_headers(release, r), functions=funcs, notes=notes)
    facts.lacks = _lacks(facts, cfg, release, modules)
    return facts


def _lacks(k: KernelFacts, cfg: dict[str, str], release: str, modules) -> list[str]:
    """What the lab needs of a kernel and ``k`` does not have (unknown: not listed)."""
    from moetrace.errors import UsageError
    from moetrace.lab.run import missing_drivers, modules_base

    out = []
    for have, what in ((k.btf, "BTF (CONFIG_DEBUG_INFO_BTF): the CO-RE probes relocate against it"),
                       (k.bpf, "BPF (CONFIG_BPF_SYSCALL)"),
                       (_yes(cfg, "CONFIG_FTRACE_SYSCALLS"), "syscall tracepoints (CONFIG_FTRACE_SYSCALLS): the mlock, "
                                                             "pagecache and reads probes attach to them"),
                       (k.mglru_built, "MGLRU (CONFIG_LRU_GEN): the mglru probe and `--mglru on`"),
                       (k.kprobes, "kprobes (CONFIG_KPROBES): the mglru and mlock function hooks")):
        if have is False:
            out.append(what)
    if cfg:
        try:
            base = modules_base(release, modules)
        except UsageError:
            base = None
        missing = missing_drivers(cfg, base / "modules.dep" if base else None)
        if missing:
            out.append(f"the guest's drivers {', '.join(missing)} (neither built in nor among its modules: "
                       f"--modules DIR of `make modules_install INSTALL_MOD_PATH=DIR`)")
    return out


def list_kernels(root: str | os.PathLike = "/") -> list[KernelFacts]:
    """The running kernel first, then every /boot/vmlinuz-* (by release), then the kernels the lab
    set-up unpacked without installing them (a newer Debian kernel)."""
    r = Path(root)
    releases = [platform.release()] if Path(root) == Path("/") else []
    for img in sorted((r / "boot").glob("vmlinuz-*")):
        rel = img.name[len("vmlinuz-"):]
        if rel not in releases:
            releases.append(rel)
    if Path(root) == Path("/"):
        from moetrace.lab.run import unpacked_releases

        releases += [rel for rel in unpacked_releases() if rel not in releases]
    return [kernel_facts(rel, root) for rel in releases]
