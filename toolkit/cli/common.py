"""Small helpers shared by subcommands: JSON output, progress bars, sizes."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from moetrace.inputs.geometry import parse_bytes, parse_duration
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


class Duration(click.ParamType):
    """A duration option: 90s, 8min, 1.5h, or seconds."""

    name = "duration"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return parse_duration(value)
        except click.ClickException as e:
            self.fail(e.message, param, ctx)


DURATION = Duration()


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


def executor_options(stage_pool: bool):
    """Where the cells run (`sweep`, `lab matrix`): --executor local|slurm and Slurm's job
    options; with ``stage_pool``, --stage-pool."""
    opts = [
        click.option("--executor", type=click.Choice(["local", "slurm"]), default="local", show_default=True,
                     help="local: each cell's job in a subprocess here, one at a time; slurm: every cell a "
                          "Slurm job (submitit; sbatch/squeue/scancel on PATH, SLURM_CONF as Slurm reads it)."),
        click.option("--slurm-partition", default=None, help="The partition the jobs go to (default: the "
                                                             "cluster's default)."),
        click.option("--slurm-time", default=None,
                     help="Each job's time limit: minutes or [D-]HH:MM:SS (default: --timeout + 10 minutes)."),
        click.option("--slurm-exclusive/--slurm-shared", "slurm_exclusive", default=True, show_default=True,
                     help="A node alone for each cell (its page cache, its device): keep it on for measurements."),
        click.option("--slurm-option", "slurm_options", multiple=True, metavar="KEY=VALUE",
                     help="Another sbatch option, e.g. --slurm-option constraint=nvme (repeatable)."),
    ]
    if stage_pool:
        opts.append(click.option("--stage-pool", default=None, type=click.Path(file_okay=False),
                                 help="Copy the pool to this node-local directory first (checked by its manifest "
                                      "checksum, reused when there): a network filesystem's page cache is not "
                                      "the local one a cell measures."))

    def add(f):
        for o in reversed(opts):
            f = o(f)
        return f
    return add


def slurm_time_minutes(text: str | None, timeout_s: float) -> int:
    """--slurm-time as minutes: '90', '1:30:00', '2-00:00:00'; default --timeout + 10 minutes."""
    from moetrace.errors import UsageError

    if text is None:
        return int(timeout_s // 60) + 10
    try:
        days, _, rest = text.rpartition("-")
        parts = [int(p) for p in rest.split(":")]
        if len(parts) == 1 and not days:
            mins = parts[0]
        else:
            h, m, sec = ([0] * (3 - len(parts)) + parts)[-3:]
            mins = (int(days or 0) * 24 + h) * 60 + m + (1 if sec else 0)
    except ValueError:
        raise UsageError(f"--slurm-time {text!r} is not minutes or [D-]HH:MM:SS", hint="e.g. --slurm-time 2:00:00") from None
    if mins < 1:
        raise UsageError(f"--slurm-time {text!r} is under a minute")
    return mins


def slurm_params(partition, time_text, exclusive, options, timeout_s, executor) -> dict:
    """make_executor's Slurm keywords from the options (none for --executor local, which refuses them)."""
    from moetrace.errors import UsageError

    if executor != "slurm":
        if partition or time_text or options:
            raise UsageError("--slurm-* options apply to --executor slurm", hint="add --executor slurm")
        return {}
    extra = {}
    for o in options:
        key, eq, val = o.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--slurm-option {o!r} is not KEY=VALUE", hint="e.g. --slurm-option constraint=nvme")
        extra[key.strip().lstrip("-").replace("-", "_")] = val
    return {"partition": partition, "time_min": slurm_time_minutes(time_text, timeout_s), "exclusive": exclusive,
            "extra": extra}
