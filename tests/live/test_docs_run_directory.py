"""docs/run-directory.md against a fresh recording (live tier): `moetrace record --stream-events`
with every declared probe, and a one-cell `moetrace sweep --record --stream-events`; every file,
table and column they wrote must be documented, and every key of their JSON documents, at every
level, declared (moetrace.run.documents; no key older versions wrote). The no-kernel twin,
tests/unit/test_docs_run_directory.py, checks the writers' declarations and the golden
directories."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common import docs_run_directory as D
from conftest import io_lock

pytestmark = pytest.mark.live


def _moetrace(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moetrace.cli", *map(str, args)], capture_output=True, text=True,
                          env={**__import__("os").environ, "CI": "1"}, timeout=600)


@pytest.fixture(scope="module")
def recorded(live, tmp_path_factory):
    """A run directory and a sweep directory (one recorded cell) of a 4 x 8 x 1 MiB pool."""
    from conftest import make_layered_pool
    from moetrace.record.probes import PROBES

    base = make_layered_pool(tmp_path_factory.mktemp("docs-run-dir"), 4, 8)
    pool, plan = base / "pool", base / "plan.bin"
    with io_lock():
        r = _moetrace("record", "--out", base / "run", "--stream-events", "--probes", ",".join(PROBES),
                      "--missing-probes", "warn", "--", sys.executable, "-m", "moetrace.cli.replay", plan,
                      "--pool", pool, "--warmup", 1, "--passes", 1, "--threads", 2)
        assert r.returncode == 0, r.stderr
        s = _moetrace("sweep", "--plan", plan, "--pool", pool, "--capacities", "16MiB", "--repeats", 1,
                      "--headroom", "40MiB", "--threads", 2, "--record", "--stream-events", "--out", base / "sweep",
                      "--json")
        assert s.returncode == 0, s.stdout + s.stderr
    return base


def test_a_fresh_recording_is_documented(recorded):
    doc = D.load()
    run = recorded / "run"
    for t in ("experts", "epochs", "page_events", "stream_intervals", "read_calls"):  # what the check covers
        assert (run / f"{t}.parquet").is_file(), t
    assert (run / "replay" / "iterations.parquet").is_file()
    problems = D.check_directory(doc, run, "run")
    assert not problems, "\n".join(problems)


def test_a_fresh_sweep_and_its_cell_are_documented(recorded):
    doc = D.load()
    sweep = recorded / "sweep"
    cells = sorted((sweep / "cells").iterdir())
    assert len(cells) == 1 and (cells[0] / "cell.json").is_file() and (cells[0] / "run" / "manifest.json").is_file()
    assert (cells[0] / "run" / "page_events.parquet").is_file()
    problems = D.check_directory(doc, sweep, "sweep")
    assert not problems, "\n".join(problems)
