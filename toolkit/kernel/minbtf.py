"""A minimal BTF per kernel for the probes' CO-RE relocations, made once and cached.

libbpf parses the running kernel's whole BTF (/sys/kernel/btf/vmlinux, ~6 MB) for every object
it loads: 15-50 ms here, seconds per object under the lab's TCG. ``bpftool gen min_core_btf``
keeps only the types the probe objects relocate against (a few KiB); given to libbpf as the
object's ``btf_custom_path``, it replaces the kernel's BTF for CO-RE. (An object whose
programs attach by BTF id, fentry / fexit / tp_btf, still has libbpf parse the kernel's own.)

One file per (kernel BTF, probe objects) pair, named by a digest of both, so a rebuilt probe or
another kernel gets a file of its own: in ``MOETRACE_BTF_CACHE`` when set, else
/var/cache/moetrace/btf (root), else a per-user directory under the temporary directory. The lab
makes the file for the kernel it boots on the host, before the boot (:func:`ensure` with that
kernel's BTF); the guest finds it through the host's root.

What it reads: the probe objects (probes/build/*.bpf.o, which a wheel carries) and the kernel's
BTF; no header, vmlinux.h or C source. bpftool is the one tool it runs, and it is optional: where
there is none (a wheel installed without it), libbpf parses the kernel's whole BTF as above.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from moetrace.atomic import atomic_write

log = logging.getLogger("moetrace.kernel.minbtf")

KERNEL_BTF = Path("/sys/kernel/btf/vmlinux")
_EDGE = 1 << 16  # bytes of the kernel BTF's head and tail in its digest (with its size)


def cache_dirs() -> list[Path]:
    """Where the files are looked for and made, in order (``MOETRACE_BTF_CACHE``: there only)."""
    env = os.environ.get("MOETRACE_BTF_CACHE")
    if env:
        return [Path(env)]
    return [Path("/var/cache/moetrace/btf"), Path(tempfile.gettempdir()) / f"moetrace-btf-{os.geteuid()}"]


def kernel_digest(data: bytes) -> str:
    """A kernel BTF's identity: its size, head and tail (the type section's start and the
    string section's end: another build differs in both), without hashing all 6 MB."""
    h = hashlib.sha256(len(data).to_bytes(8, "little"))
    h.update(data[:_EDGE])
    h.update(data[-_EDGE:])
    return h.hexdigest()[:16]


def objects_digest(objects: list[Path]) -> str:
    """The objects' identity: name, size and mtime of each (a stat, not a read: at every
    recording's start, when the page cache may have dropped them). A rebuilt object is another
    set; should a stale file still miss a type, the load fails and the loader retries with the
    kernel's own BTF (moetrace.kernel.bpf.load_core)."""
    h = hashlib.sha256()
    for o in sorted(objects):
        st = o.stat()
        h.update(f"{o.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def file_name(kernel_btf: bytes, objects: list[Path]) -> str:
    return f"{kernel_digest(kernel_btf)}-{objects_digest(objects)}.btf"


def find(name: str) -> Path | None:
    for d in cache_dirs():
        p = d / name
        if p.is_file() and p.stat().st_size > 0:
            return p
    return None


def build(kernel_btf_file: Path, objects: list[Path], out: Path) -> None:
    """``bpftool gen min_core_btf`` into ``out`` (written whole or not at all)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out) as tmp:
        r = subprocess.run(["bpftool", "gen", "min_core_btf", str(kernel_btf_file), str(tmp), *map(str, objects)],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0 or not tmp.is_file():
            raise OSError(f"bpftool gen min_core_btf failed: {(r.stderr or r.stdout).strip()[-500:]}")


def ensure(objects: list[Path], kernel_btf: bytes | None = None) -> Path | None:
    """The minimal BTF of ``objects`` against a kernel's BTF (``kernel_btf``: its raw bytes, e.g.
    a lab kernel's from its image; default: the running kernel's), made now when no cache has
    it; None when it cannot be had (no BTF, no bpftool, nowhere to write): the loader then uses
    the kernel's BTF as it is."""
    try:
        data = kernel_btf if kernel_btf is not None else KERNEL_BTF.read_bytes()
        name = file_name(data, objects)
    except OSError:
        return None
    hit = find(name)
    if hit is not None or shutil.which("bpftool") is None:
        return hit
    for d in cache_dirs():
        src = KERNEL_BTF if kernel_btf is None else d / f".{name}.{os.getpid()}.vmlinux"
        try:
            if kernel_btf is not None:
                d.mkdir(parents=True, exist_ok=True)
                src.write_bytes(kernel_btf)
            build(src, objects, d / name)
            return d / name
        except (OSError, subprocess.SubprocessError) as e:
            log.debug("minimal BTF not made in %s: %s", d, e)
        finally:
            if src != KERNEL_BTF:
                src.unlink(missing_ok=True)
    return None


def ensure_for_image(image: Path, objects: list[Path]) -> Path | None:
    """:func:`ensure` for a kernel image (/boot/vmlinuz-*: a lab kernel, made on the host before
    it boots). The image's BTF digest is remembered beside the files (keyed by the image's path,
    size and mtime), so a later call finds the file without unpacking the image again."""
    from moetrace.errors import MoetraceError
    from moetrace.kernel import btf

    st = image.stat()
    tag = "image-" + hashlib.sha256(f"{image.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    for d in cache_dirs():
        try:
            digest = (d / tag).read_text().strip()
        except OSError:
            continue
        hit = find(f"{digest}-{objects_digest(objects)}.btf")
        if hit is not None:
            return hit
    try:
        data = btf.raw(image)
    except MoetraceError as e:
        log.debug("no BTF read from %s: %s", image, e)
        return None
    if data is None:
        return None
    out = ensure(objects, data)
    if out is not None:
        try:
            (out.parent / tag).write_text(kernel_digest(data) + "\n")
        except OSError:
            pass
    return out

