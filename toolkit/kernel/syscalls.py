"""The raw system calls moetrace makes without a library: bpf(2) and prctl(2).

One syscall-number table, one libc handle. Every caller passes a ctypes structure of
the UAPI's ``union bpf_attr`` layout (append-only, stable) for its command.
"""

from __future__ import annotations

import ctypes
import os
import signal

#: bpf(2) syscall numbers (asm/unistd.h); absent: moetrace cannot call bpf(2) directly there
SYS_BPF = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "ppc64le": 361, "s390x": 351}
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def bpf_nr() -> int | None:
    """This machine's bpf(2) syscall number, or None when unknown."""
    return SYS_BPF.get(os.uname().machine)


def sys_bpf(cmd: int, attr: ctypes.Structure | ctypes.Array) -> int:
    """bpf(cmd, &attr, sizeof attr): the result (>= 0), or -errno (never raises)."""
    nr = bpf_nr()
    if nr is None:
        return -38  # ENOSYS
    r = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(cmd), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))
    return int(r) if r >= 0 else -ctypes.get_errno()


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """prctl(PR_SET_PDEATHSIG, sig): this process gets ``sig`` when its parent thread exits.
    Raises OSError on failure."""
    if _libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_PDEATHSIG): {os.strerror(e)}")


def resident_pages(path: str | os.PathLike, first: int = 0, n: int | None = None) -> int:
    """Pages of a file resident in the page cache, by mincore(2) (what fincore does): ``n``
    pages from page ``first`` (default: to the end). The file is mapped, never read."""
    import mmap

    import numpy as np

    size = os.stat(path).st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            total = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * total)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            last = total if n is None else min(total, first + n)
            return int((np.frombuffer(vec, np.uint8)[first:last] & 1).sum())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
