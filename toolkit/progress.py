"""Progress bars for the long commands (``pool create``, ``cell``, ``sweep``), on stderr.

A bar is shown only where someone watches it. :func:`progress_enabled` decides, first rule
that applies:

1. ``--json`` (``json_out=True``): never; the command's output is for a program.
2. ``MOETRACE_PROGRESS=0`` (or false/no/off): never; ``MOETRACE_PROGRESS=1`` (or
   true/yes/on): always, also when stderr is not a terminal and under CI (for a test under
   a pty, or a log that wants the bar).
3. ``CI`` set to anything but empty/0/false/no (CI runs with ``CI=true``): never.
4. Otherwise: iff the stream (stderr) is a terminal.

Progress goes to stderr, never stdout: stdout carries the command's result (a table, a
summary, JSON), and a bar there would interleave with it when stdout is piped. Library
code never prints: it takes an optional ``progress`` / ``on_phase`` callback (default
None: nothing) and the CLI turns calls into bar updates.

tqdm is imported only when a bar is actually enabled, so importing this module costs
nothing on a command's start-up path."""

from __future__ import annotations

import io
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator, TextIO

ENV = "MOETRACE_PROGRESS"
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _env_flag(name: str) -> bool | None:
    """True/False for an on/off value of ``name``; None when unset, empty or unrecognized."""
    v = os.environ.get(name, "").strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    return None


def progress_enabled(json_out: bool = False, stream: TextIO | None = None) -> bool:
    """Whether to draw a progress bar on ``stream`` (default: the current sys.stderr)."""
    if json_out:
        return False
    forced = _env_flag(ENV)
    if forced is not None:
        return forced
    ci = os.environ.get("CI", "").strip().lower()
    if ci and ci not in ("0", "false", "no"):
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


class NoBar:
    """The disabled bar: accepts tqdm's calls and does nothing."""

    n = 0
    total = None

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        pass

    def set_description_str(self, desc: str | None = None, refresh: bool = True) -> None:
        pass

    def refresh(self) -> None:
        pass

    def write(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __bool__(self) -> bool:
        return False


def _no_size(stream: Any) -> bool:
    """A terminal of 0 columns or rows (a pty nobody set a size on)."""
    try:
        return min(os.get_terminal_size(stream.fileno())) <= 0
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return False


@contextmanager
def bar(total: float | None = None, desc: str = "", unit: str = "it", enabled: bool = True,
        stream: TextIO | None = None, **kwargs: Any) -> Iterator[Any]:
    """A tqdm bar on ``stream`` (default: the current sys.stderr) when ``enabled``, else a
    :class:`NoBar`. Either has update(n), set_postfix(...), set_description(...). Extra
    keyword arguments go to tqdm (unit_scale=True, unit_divisor=1024, leave=False,
    bar_format=...). The bar is closed on leaving the block, also on an exception."""
    if not enabled:
        yield NoBar()
        return
    from tqdm import tqdm

    # no tqdm_monitor thread: `cell` forks the replay with a preexec_fn, which a second
    # thread makes unsafe; the monitor only tunes miniters, which these bars do not need
    tqdm.monitor_interval = 0
    stream = sys.stderr if stream is None else stream
    if _no_size(stream):  # a terminal that reports 0x0 (a new pty): tqdm would draw nothing
        kwargs.setdefault("ncols", 80)
        kwargs.setdefault("nrows", 24)
    else:
        kwargs.setdefault("dynamic_ncols", True)
    b = tqdm(total=total, desc=desc, unit=unit, file=stream, **kwargs)
    try:
        yield b
    finally:
        b.close()
