"""Empty an engine's model from the page cache between two tokens, from outside and with the
engine unmodified: process_madvise(MADV_PAGEOUT) on the engine's mappings of the file (pages a
process maps are not dropped by fadvise), then POSIX_FADV_DONTNEED on the file for the pages no
one maps. moetrace itself never keeps the file mapped (mincore maps it only for the count), or
its own mapping would keep the pages.
"""

from __future__ import annotations

import os
from pathlib import Path

from moetrace.errors import MoetraceError


def file_mappings(pid: int, path: str | os.PathLike, maps_text: str | None = None) -> list[tuple[int, int]]:
    """The [start, end) address ranges where process ``pid`` maps ``path`` (by device and
    inode, as /proc/PID/maps names them; ``maps_text``: that file's content, read if None)."""
    st = os.stat(path)
    want_dev, want_ino = (os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino
    if maps_text is None:
        try:
            maps_text = Path(f"/proc/{pid}/maps").read_text()
        except OSError as e:
            raise MoetraceError(f"cannot read the mappings of process {pid}: {e.strerror}",
                                hint="is the engine still running, and are you root?") from None
    out = []
    for line in maps_text.splitlines():
        f = line.split(maxsplit=5)
        if len(f) < 5 or f[4] == "0":
            continue
        major, minor = (int(x, 16) for x in f[3].split(":"))
        if (major, minor) == want_dev and int(f[4]) == want_ino:
            a, b = (int(x, 16) for x in f[0].split("-"))
            out.append((a, b))
    return out


def drop_unmapped(path: str | os.PathLike) -> int:
    """``path``'s pages nobody maps out of the page cache (dirty ones written back first, or
    FADV_DONTNEED could not drop them); the pages still resident (mincore)."""
    from moetrace.kernel.syscalls import resident_pages

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_pages(path)


def empty_cache(pid: int, path: str | os.PathLike, rounds: int = 3) -> dict[str, int]:
    """Drop ``path``'s pages from the page cache while process ``pid`` keeps it mapped: its
    dirty pages written back, the engine's mappings paged out, then the file's unmapped pages
    dropped; again (up to ``rounds``) while pages stay. A page the engine faulted in last can
    sit in its CPU's LRU add batch, where MADV_PAGEOUT cannot isolate it; FADV_DONTNEED, failing
    on it, drains every CPU's batch (mm/fadvise.c), so the next round takes it. Resident pages
    before and after (mincore), the bytes advised and the rounds run."""
    from moetrace.kernel.syscalls import process_pageout, resident_pages

    before = left = resident_pages(path)
    advised = n = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # a dirty page (a model just written) neither call can drop: written back first
        while n < rounds and (n == 0 or left):
            advised += process_pageout(pid, file_mappings(pid, path))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            left, n = resident_pages(path), n + 1
    finally:
        os.close(fd)
    return {"resident_before_pages": before, "resident_after_pages": left, "advised_bytes": advised, "rounds": n}
