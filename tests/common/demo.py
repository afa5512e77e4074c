"""The README's demo command runs end to end and writes its artifacts."""


from __future__ import annotations


import json


from pathlib import Path


import pandas as pd


from click.testing import CliRunner


from moetrace.cli import cli


def run_demo(out: Path, *extra: str):
    r = CliRunner().invoke(cli, ["demo", "--out", str(out), "--steps", "120", *extra])
    assert r.exit_code == 0, r.output
    return r


__all__ = ['CliRunner', 'Path', 'cli', 'json', 'pd', 'run_demo']
