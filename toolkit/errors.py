"""Typed errors: each says what failed, where, the likely cause and the fix.

All derive from click.ClickException so the CLI prints one clean line (never a
traceback) and exits with status 1 (2 for usage errors). The two signal classes at
the end are control flow, not errors: a SIGINT/SIGTERM that stops work after its
cleanup ran.
"""

from __future__ import annotations

import click


class MoetraceError(click.ClickException):
    """Base class of every error moetrace reports to a user."""

    def __init__(self, message: str, hint: str | None = None):
        if hint:
            message = f"{message}\n  hint: {hint}"
        super().__init__(message)


class InputError(MoetraceError):
    """Bad input data, with its location (file, line, byte offset where known)."""

    def __init__(
        self,
        message: str,
        path: str | None = None,
        line: int | None = None,
        offset: int | None = None,
        hint: str | None = None,
    ):
        self.path, self.line, self.offset = path, line, offset
        loc = []
        if path is not None:
            loc.append(str(path))
        if line is not None:
            loc.append(f"line {line}")
        if offset is not None:
            loc.append(f"offset {offset}")
        prefix = ":".join(loc[:1]) + ("" if len(loc) < 2 else ": " + ", ".join(loc[1:]))
        super().__init__(f"{prefix}: {message}" if prefix else message, hint)


class PlanFormatError(InputError):
    """A plan.bin that is corrupt, truncated or of an unknown version."""


class UsageError(MoetraceError):
    """Options that contradict each other or name something that does not exist."""

    exit_code = 2


class PrivilegeError(MoetraceError):
    """BPF cannot be loaded by this process: names the missing privilege."""


class ProbeError(MoetraceError):
    """A probe cannot run on this kernel, or failed to load, attach or be read."""


class ScopeError(MoetraceError):
    """A memory scope (cgroup, balloon) could not be created, joined or removed."""


class ReplayInterrupted(MoetraceError):
    """The replay was stopped by SIGINT/SIGTERM; outputs were written with complete=false."""

    def __init__(self, signum: int, run_dir: str | None):
        import signal

        self.signum = signum
        self.exit_code = 128 + signum
        where = f"; partial results in {run_dir}" if run_dir else ""
        super().__init__(f"replay interrupted by {signal.Signals(signum).name}{where}")


# -- signals as control flow -------------------------------------------------------------------

class SignalReceived(Exception):
    """Raised inside a worker when SIGINT/SIGTERM arrived: unwinds to the code that cleans up."""

    def __init__(self, signum: int):
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class CellInterrupted(BaseException):
    """SIGINT/SIGTERM arrived during a cell; everything it made has been removed. A
    BaseException, so no ``except Exception`` on the way up swallows it."""

    def __init__(self, signum: int):
        import signal

        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
