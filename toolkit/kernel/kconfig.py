"""A kernel's build configuration (.config), and what follows from it that BTF does not carry.

Read from ``/boot/config-RELEASE`` (Debian installs it with the image; the lab's extracted
kernels keep theirs beside the image) or, for the running kernel, ``/proc/config.gz``.
Macros of the build (page-flags layout) are not in BTF: :func:`lru_gen_pgoff` derives the one
the mglru probe needs from the config and two enumerators BTF does have.
"""

from __future__ import annotations

import gzip
import os
import platform
from pathlib import Path


def parse_config(text: str) -> dict[str, str]:
    """A kernel .config: {CONFIG_X: 'y' | 'm' | value}; '# CONFIG_X is not set' gives 'n'."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("# CONFIG_") and line.endswith(" is not set"):
            out[line[2:-len(" is not set")]] = "n"
        elif line.startswith("CONFIG_") and "=" in line:
            k, _, v = line.partition("=")
            out[k] = v.strip('"')
    return out


#: where scripts/lab-setup.sh unpacks kernels that must not become the host's (a newer Debian
#: kernel from sid or backports): LAB_KERNELS/RELEASE/usr/lib/modules/RELEASE/{vmlinuz,config,...}
LAB_KERNELS = Path(os.environ.get("MOETRACE_LAB_KERNELS", "/var/lib/moetrace/lab/kernels"))


def unpacked_tree(release: str) -> Path | None:
    """The modules directory of an unpacked lab kernel (it holds vmlinuz and config), or None."""
    d = LAB_KERNELS / release / "usr" / "lib" / "modules" / release
    return d if (d / "vmlinuz").is_file() else None


def config_text(release: str, root: str | os.PathLike = "/",
                extra: tuple[str | os.PathLike, ...] = ()) -> tuple[str | None, str | None]:
    """(the .config text of kernel ``release``, where it was read) or (None, None): ``extra``
    paths first, then ROOT/boot/config-RELEASE, ROOT/usr/lib/modules/RELEASE/config (where newer
    Debian kernels keep it), an unpacked lab kernel's, then /proc/config.gz when ``release`` runs."""
    tree = unpacked_tree(release) if Path(root) == Path("/") else None
    for p in (*map(Path, extra), Path(root) / "boot" / f"config-{release}",
              Path(root) / "usr" / "lib" / "modules" / release / "config", *((tree / "config",) if tree else ())):
        if p.is_file():
            return p.read_text(errors="replace"), str(p)
    if release == platform.release() and Path(root) == Path("/") and Path("/proc/config.gz").is_file():
        return gzip.decompress(Path("/proc/config.gz").read_bytes()).decode(errors="replace"), "/proc/config.gz"
    return None, None


def _order_base_2(n: int) -> int:
    return max(0, (int(n) - 1).bit_length())


def lru_gen_pgoff(cfg: dict[str, str], nr_pageflags: int, max_nr_zones: int) -> tuple[int | None, str]:
    """(LRU_GEN_PGOFF, "") of a build, or (None, why not): the bit of folio->flags where the MGLRU
    generation field starts. <linux/page-flags-layout.h> and <linux/mm.h> (6.1 .. 6.12, checked
    against both lab kernels' headers by tests/probe_build/test_mglru.py) chain the fields from
    the top bit down: SECTIONS, NODES, ZONES, LAST_CPUPID, KASAN_TAG, LRU_GEN; a field that does
    not fit beside NR_PAGEFLAGS is left out (NODES, LAST_CPUPID). ``nr_pageflags`` /
    ``max_nr_zones``: enum pageflags' __NR_PAGEFLAGS and enum zone_type's __MAX_NR_ZONES (BTF)."""
    if cfg.get("CONFIG_LRU_GEN") != "y":
        return None, "the kernel is built without MGLRU (CONFIG_LRU_GEN)"
    if cfg.get("CONFIG_SPARSEMEM") == "y" and cfg.get("CONFIG_SPARSEMEM_VMEMMAP") != "y":
        return None, "SPARSEMEM without VMEMMAP keeps the section in page flags (not derived here)"
    bits = 64 if cfg.get("CONFIG_64BIT") == "y" else 32
    free = bits - int(nr_pageflags)
    zones = _order_base_2(max_nr_zones) if max_nr_zones > 1 else 0
    gen = 3  # LRU_GEN_WIDTH = order_base_2(MAX_NR_GENS + 1), MAX_NR_GENS = 4
    kasan = 8 if "y" in (cfg.get("CONFIG_KASAN_SW_TAGS"), cfg.get("CONFIG_KASAN_HW_TAGS")) else 0
    nodes_shift = int(cfg.get("CONFIG_NODES_SHIFT", "0")) if cfg.get("CONFIG_NUMA") == "y" else 0
    nodes = nodes_shift if zones + gen + nodes_shift <= free else 0
    cpupid = 0
    if cfg.get("CONFIG_NUMA_BALANCING") == "y":
        cpupid = 8 + _order_base_2(int(cfg.get("CONFIG_NR_CPUS", "1")))  # LAST__PID_SHIFT + NR_CPUS_BITS
    cpupid = cpupid if zones + gen + nodes + kasan + cpupid <= free else 0
    return bits - nodes - zones - cpupid - kasan - gen, ""
