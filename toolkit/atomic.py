"""The one atomic writer: a file appears whole under its name or not at all.

It lives at the package's lowest floor (beside errors.py and jsonutil.py) because every floor
writes files this way: the kernel lab's caches, the run directory, the replay's outputs, the
cell's records, the inputs. It imports nothing heavy (a replay imports it inside its cell's
memory scope)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, *, mode: int | None = None, fsync: bool = False,
                 what: str | None = None) -> Iterator[Path]:
    """A temporary path beside ``path`` (same directory, so the final rename is atomic; hidden
    and named by this process's pid, so two writers never share it) to write the content to;
    moved onto ``path`` when the block ends cleanly, removed otherwise.

    ``mode``: the temporary file is created with it before the block writes (and chmod-ed, the
    umask not applying), so the content is never readable with wider permissions, e.g. 0o600 for
    a run directory's files. ``fsync``: the content is flushed to the device before the rename
    (a summary that must survive a crash; not for a recording's intermediate writes, whose
    writeback would land in the measured window). ``what``: an OSError becomes
    :class:`moetrace.errors.InputError` "cannot write the <what>", naming the path.

        with atomic_write(run / "x.json", mode=0o600) as tmp:
            tmp.write_text(text)
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if mode is not None:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode))
            os.chmod(tmp, mode)
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        if what is None:
            raise
        from moetrace.errors import InputError

        raise InputError(f"cannot write the {what}: {e.strerror or e}", path=str(path),
                         hint="check the directory exists, is writable and has free space") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
