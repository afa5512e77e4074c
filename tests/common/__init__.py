"""What every tier's tests share beside the per-subject modules of this folder."""

from __future__ import annotations


def read_run(path):
    """(manifest, {table name: DataFrame}) of a run directory, every table read now (the
    replay's iteration log as ``iterations``), through :func:`moetrace.open_run`."""
    from moetrace.run.handle import open_run

    run = open_run(path)
    return run.manifest, dict(run.tables)
