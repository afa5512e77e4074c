"""The raw system calls moetrace makes without a library: bpf(2), perf_event_open(2),
migrate_pages(2), prctl(2), mincore(2), pidfd_open(2) + process_madvise(2); and the kernel's
encoding of a device number.

One syscall-number table, one libc handle (:data:`libc`, its prototypes set once here: every
module that calls libc uses it). bpf(2)'s callers pass a ctypes structure of the UAPI's
``union bpf_attr`` layout (append-only, stable) for its command.
"""

from __future__ import annotations

import ctypes
import os
import signal

#: syscall numbers per machine (asm/unistd.h); absent: moetrace cannot make that call there
SYS_BPF = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "ppc64le": 361, "s390x": 351}
SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241, "riscv64": 241, "ppc64le": 319, "s390x": 331}
SYS_MIGRATE_PAGES = {"x86_64": 256, "aarch64": 238}
# pidfd_open (5.3) and process_madvise (5.10) came after the numbers were unified: one for all
SYS_PIDFD_OPEN, SYS_PROCESS_MADVISE = 434, 440
MADV_PAGEOUT = 21
PR_SET_PDEATHSIG = 1

#: the C library (the process's own namespace), errno kept for ctypes.get_errno()
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mmap.restype = ctypes.c_void_p
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_FAILED = ctypes.c_void_p(-1).value


def close_fd(fd: int | None) -> None:
    """Close ``fd`` if it is one; an fd already closed (or never valid) is not an error."""
    if fd is None:
        return
    try:
        os.close(fd)
    except OSError:
        pass


def kernel_dev(st_dev: int) -> int:
    """A stat() device number in the kernel-internal encoding tracepoints print and BPF reads
    (``inode->i_sb->s_dev``): (major << 20) | minor."""
    return (os.major(st_dev) << 20) | os.minor(st_dev)


def bpf_nr() -> int | None:
    """This machine's bpf(2) syscall number, or None when unknown."""
    return SYS_BPF.get(os.uname().machine)


def sys_bpf(cmd: int, attr: ctypes.Structure | ctypes.Array) -> int:
    """bpf(cmd, &attr, sizeof attr): the result (>= 0), or -errno (never raises)."""
    nr = bpf_nr()
    if nr is None:
        return -38  # ENOSYS
    r = libc.syscall(ctypes.c_long(nr), ctypes.c_int(cmd), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))
    return int(r) if r >= 0 else -ctypes.get_errno()


def set_pdeathsig(sig: int = signal.SIGKILL, *, orphan_exits: bool = False) -> None:
    """prctl(PR_SET_PDEATHSIG, sig): this process gets ``sig`` when its parent thread exits.
    Raises OSError on failure. ``orphan_exits``: when the parent is already gone (this process
    was reparented before the call, or its parent is init), exit at once with status 1, the
    signal never coming (a replay started by a cell that died meanwhile)."""
    ppid = os.getppid()
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_PDEATHSIG): {os.strerror(e)}")
    if orphan_exits and (ppid == 1 or os.getppid() != ppid):
        os._exit(1)


def resident_pages(path: str | os.PathLike, first: int = 0, n: int | None = None) -> int:
    """Pages of a file resident in the page cache, by mincore(2) (what fincore does): ``n``
    pages from page ``first`` (default: to the end). The file is mapped, never read."""
    r = resident_map(path)
    return int(r[first:len(r) if n is None else first + n].sum())


def resident_map(path: str | os.PathLike) -> "np.ndarray":
    """Per page of a file, True when it is resident in the page cache (mincore(2)); the file
    is mapped, never read."""
    import mmap

    import numpy as np

    size = os.stat(path).st_size
    if size == 0:
        return np.zeros(0, bool)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return (np.frombuffer(vec, np.uint8) & 1).astype(bool)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def process_pageout(pid: int, ranges: list[tuple[int, int]]) -> int:
    """process_madvise(MADV_PAGEOUT) on [start, end) address ranges of process ``pid``: the
    kernel reclaims the pages only that process maps there (a page another process also maps
    stays). The bytes advised; OSError (with errno) when the kernel refuses."""
    if not ranges:
        return 0
    pidfd = libc.syscall(ctypes.c_long(SYS_PIDFD_OPEN), ctypes.c_int(pid), ctypes.c_uint(0))
    if pidfd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"pidfd_open({pid}): {os.strerror(e)}")
    try:
        done = 0
        for i in range(0, len(ranges), 512):  # IOV_MAX is 1024: batches well under it
            chunk = ranges[i:i + 512]
            vec = (_IoVec * len(chunk))(*[_IoVec(a, b - a) for a, b in chunk])
            r = libc.syscall(ctypes.c_long(SYS_PROCESS_MADVISE), ctypes.c_int(pidfd), vec, ctypes.c_size_t(len(chunk)),
                             ctypes.c_int(MADV_PAGEOUT), ctypes.c_uint(0))
            if r < 0:
                e = ctypes.get_errno()
                raise OSError(e, f"process_madvise({pid}, MADV_PAGEOUT): {os.strerror(e)}")
            done += int(r)
        return done
    finally:
        close_fd(int(pidfd))
