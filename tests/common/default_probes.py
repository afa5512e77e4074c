"""Acceptance 3: every probe in record's default set attaches on this kernel or is listed by
doctor with its reason; every probe with a C file compiles, loads and detaches here with the
knobs its attach plan derives (probe-build tier).

The per-probe tests (test_<probe>_probe.py) check what each probe measures; these check the
set as a whole, the way `moetrace record` and `moetrace doctor` see it.
"""


from __future__ import annotations


import json


import os


import subprocess


import sys


import pytest


from moetrace.kernel import bpf


from moetrace.record import spec as probespec


from moetrace.record import probes as probe_registry


from moetrace.record import recorder


from moetrace.run import directory as rundir


from moetrace.record.probes import DEFAULT_PROBES, PROBES


RECORD = [sys.executable, "-c", "from moetrace.cli.record import record; record.main(prog_name='moetrace record')"]


# --mount: record unmounts the debugfs it mounted; doctor must see the same tracefs (the session fixture
# unmounts what it mounts)
DOCTOR = [sys.executable, "-c", "from moetrace.cli import main; main()", "doctor", "--json", "--mount"]


WITH_SOURCE = [n for n, sp in PROBES.items() if sp.source_path.exists()]


@pytest.fixture(scope="module")
def plans(live):
    from moetrace.kernel.features import Features

    return probe_registry.resolve_all(Features("/", mount=True))


__all__ = ['DEFAULT_PROBES', 'DOCTOR', 'PROBES', 'RECORD', 'WITH_SOURCE', 'bpf', 'json', 'os', 'plans', 'probe_registry', 'probespec', 'pytest', 'recorder', 'rundir', 'subprocess', 'sys']
