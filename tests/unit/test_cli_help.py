"""Every command and subcommand answers --help without error."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from moetrace.cli import cli


def walk(group: click.Group, prefix: list[str]):
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None, f"{' '.join(prefix + [name])} is listed but cannot be loaded"
        yield prefix + [name]
        if isinstance(cmd, click.Group):
            yield from walk(cmd, prefix + [name])


COMMANDS = [[]] + list(walk(cli, []))


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "moetrace")
def test_help(path):
    r = CliRunner().invoke(cli, path + ["--help"])
    assert r.exit_code == 0, r.output
    assert "Usage:" in r.output
    assert len(r.output.strip().splitlines()) >= 3


def test_expected_commands_exist():
    flat = {" ".join(p) for p in COMMANDS}
    for name in ("trace parse", "trace import", "trace synth", "trace stats", "plan compile",
                 "plan inspect", "sim", "demo", "pool create", "pool verify", "replay", "cell", "sweep",
                 "record", "doctor", "report", "flame"):
        assert name in flat


def test_report_help_names_every_section():
    """`report --only` defaults to every section of moetrace.reports.report.SECTIONS (the one list:
    a new section is added there alone) and its help names them."""
    from moetrace.reports.report import SECTIONS

    r = CliRunner(env={"COLUMNS": "300"}).invoke(cli, ["report", "--help"], terminal_width=300)
    assert f"(default: every one: {', '.join(SECTIONS)})" in r.output, r.output
