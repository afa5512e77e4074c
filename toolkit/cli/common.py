"""Small helpers shared by subcommands: JSON output, progress bars, sizes."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from moetrace.inputs.geometry import parse_bytes
from moetrace.jsonutil import json_default


def emit_json(obj: Any) -> None:
    """Print one JSON document (numpy scalars converted) to stdout."""
    click.echo(json.dumps(obj, indent=2, default=json_default))


def progress(iterable=None, length: int | None = None, label: str = ""):
    """A click progress bar on a terminal, silent otherwise (stderr)."""
    return click.progressbar(iterable, length=length, label=label, file=sys.stderr,
                             hidden=not sys.stderr.isatty())


class ByteSize(click.ParamType):
    """A size option: 4096, 256KiB, 17.55MB, 2GiB."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_bytes(value)
        except click.ClickException as e:
            self.fail(e.message, param, ctx)


BYTES = ByteSize()


def exit_now(ctx: click.Context, code: int) -> None:
    """Exit with ``code``. In a moetrace process of its own, without the interpreter's module
    teardown (~0.1 s with pandas and pyarrow loaded, at the end of every recording): the output
    streams are flushed and the exit handlers run (mounts, temporary directories), then the
    process ends. Hosted (pytest's CliRunner, a notebook), it is click's ordinary exit."""
    import atexit
    import os
    import sys

    from moetrace.kernel.features import own_process

    if not own_process():
        ctx.exit(code)
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
