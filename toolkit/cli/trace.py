"""`moetrace trace`: parse, import, synthesize and describe router traces."""

from __future__ import annotations

import click

from moetrace.cli import LazyGroup


@click.group(
    cls=LazyGroup,
    lazy={
        "parse": ".trace_parse:parse",
        "import": ".trace_import:import_",
        "synth": ".trace_synth:synth",
        "stats": ".trace_stats:stats",
    },
)
def trace() -> None:
    """Router traces: parse (typed), import (other engines), synth (generator), stats (locality)."""
