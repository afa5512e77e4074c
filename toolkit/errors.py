"""Typed errors: each says what failed, where, the likely cause and the fix.

All derive from click.ClickException so the CLI prints one clean line (never a
traceback) and exits with status 1 (2 for usage errors).
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
