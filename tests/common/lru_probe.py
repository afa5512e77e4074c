"""The lru probe (probes/lru.bpf.c + toolkit/record/probes/lru.py): classic LRU placement per expert.

Tiers: the C file and its Python side agree, the tables are built as declared (no kernel);
it compiles, loads and detaches with the knob sets the recorder uses (probe_build); live,
through ``moetrace record --probes pagecache,lru``:

* a cold 2-pass replay of 23 x 1 MiB experts (both layouts): LRU insertions of pool pages
  per expert == the pages the pagecache probe saw added (a different tracepoint), exactly
  5,888 in all; the second pass activates every page once (on the inactive list, or before
  it reached a list), and the pool's activations are within, and almost all of, the
  machine's /proc/vmstat pgactivate delta (counted where mm_lru_activate fires);
* a third pass of the fully cached pool inserts nothing;
* a pool 3x the cache a v1/v2 memory limit leaves: every eviction (evicted_pages == the
  pagecache probe's, per expert) of a page added in the recording has its insertion time,
  the dwell histogram adds up to the dwell counts and brackets the sums.

Live measurements hold the machine-wide I/O lock (conftest.io_lock)."""


from __future__ import annotations


import json


import os


import re


import subprocess


import time


import sys


from pathlib import Path


from types import SimpleNamespace


import numpy as np


import pandas as pd


import pytest


from moetrace.kernel import bpf


from moetrace.record.probes import lru as lrurec


from moetrace.run import directory as rundir


from moetrace.record.probes.lru import FIELDS, HISTOGRAMS, HIST_SLOTS, SPEC, anon_flag_from_format, lru_knobs, lru_tables


from conftest import io_lock  # noqa: E402


from common.record import REPLAY, _drop, _moetrace, _resident_pages  # noqa: E402
from common import read_run


SRC = bpf.core_source("lru").read_text()


N, MIB = 23, 1 << 20


PAGE = os.sysconf("SC_PAGE_SIZE")


PAGES = MIB // PAGE


#: `moetrace record` as a user runs it: the venv's console script
MOETRACE = Path(sys.executable).with_name("moetrace")


RECORD = [str(MOETRACE), "record"] if MOETRACE.exists() else \
    [sys.executable, "-c", "from moetrace.cli import main; main()", "record"]


#: the real 6.18 format file of pagemap:mm_lru_insertion (print fmt line)
INSERTION_FMT = ('print fmt: "folio=%p pfn=0x%lx lru=%d flags=%s%s%s%s%s%s", REC->folio, REC->pfn, REC->lru, '
                 'REC->flags & 0x0001u ? "M" : " ", REC->flags & 0x0002u ? "a" : "f", '
                 'REC->flags & 0x0008u ? "s" : " ", REC->flags & 0x0010u ? "b" : " ", '
                 'REC->flags & 0x0020u ? "d" : " ", REC->flags & 0x0040u ? "B" : " "')


def _defines(prefix: str, src: str = SRC) -> list[tuple[str, int]]:
    return [(n, int(i)) for n, i in re.findall(r"^#define %s(\w+) (\d+)$" % prefix, src, re.M)]


def _pmap(n: int, ppe: int, inodes: dict | None = None):
    from moetrace.record.poolmap import PAGE as page_bytes, PoolMap

    return PoolMap(inodes if inodes is not None else {100 + i: (i, 1) for i in range(n)}, (8 << 20) | 1,
                   ppe * page_bytes, n, n)


KNOB_SETS = [
    dict(MOE_POOL_DEV=254 << 20, MOE_N_EXPERTS=23, MOE_PPE=256, MOE_MAX_PFNS=8192),  # files layout, 1 MiB experts
    dict(MOE_POOL_DEV=254 << 20, MOE_N_EXPERTS=600, MOE_PPE=1, MOE_MAX_PFNS=4096),  # 4 KiB extents: 512 pieces per folio
    # an older kernel: no activate, no folio order
    dict(MOE_POOL_DEV=0, MOE_N_EXPERTS=7, MOE_PPE=100, MOE_HAVE_ACTIVATE=0, MOE_HAVE_ORDER=0),
    dict(),  # no pool: everything unattributed (the declaration's defaults)
]


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    from conftest import make_expert_pools

    return make_expert_pools(tmp_path_factory.mktemp("lru"), N)


def _record(out: Path, cmd: list[str], *opts: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*RECORD, "--out", str(out), "--probes", "pagecache,lru", *opts, "--", *cmd],
                          capture_output=True, text=True, timeout=timeout)


def _load(run: Path):
    doc, tables = read_run(run)
    pc, lru = tables["experts"], tables["lru"]
    return (doc, pc[pc["kind"] == "expert"].reset_index(drop=True),
            lru[lru["kind"] == "expert"].reset_index(drop=True), lru[lru["kind"] == "unattributed"].iloc[0],
            tables["lru_dwell_histogram"])


def _common_checks(doc: dict) -> None:
    assert doc["complete"] is True and doc["exit_status"] == 0
    assert doc["attach_plan"]["lru"]["recorded"] is True and doc["attach_plan"]["lru"]["status"] == "yes"
    lost = doc["lost"]["lru"]
    assert lost["lost_events"] == 0 and lost["unprocessed_pages"] == 0 and lost["join_update_failed"] == 0, lost
    assert doc["summaries"]["lru"]["drain"]["ok"] is True, doc["summaries"]["lru"]["drain"]
    assert set(doc["tables"]) >= {"lru", "lru_dwell_histogram"}
    assert doc["knobs"]["lru"]["MOE_HAVE_ACTIVATE"] == 1


#: pressure: 3 layers x 32 experts x 1 MiB = 96 MiB through a cache of ~32 MiB (test_record_pressure)
PL, PE = 3, 32


POOL_PAGES = PL * PE * PAGES


CACHE_BYTES = 32 * MIB


HEADROOM_BYTES = 72 * MIB


@pytest.fixture(scope="module")
def pressure_pool(tmp_path_factory):
    from conftest import make_layered_pool

    return make_layered_pool(tmp_path_factory.mktemp("lrupressure"), PL, PE)


__all__ = ['CACHE_BYTES', 'FIELDS', 'HEADROOM_BYTES', 'HISTOGRAMS', 'HIST_SLOTS', 'INSERTION_FMT', 'KNOB_SETS', 'MIB', 'MOETRACE', 'N', 'PAGE', 'PAGES', 'PE', 'PL', 'POOL_PAGES', 'Path', 'RECORD', 'REPLAY', 'SPEC', 'SRC', 'SimpleNamespace', '_common_checks', '_defines', '_drop', '_load', '_moetrace', '_pmap', '_record', '_resident_pages', 'anon_flag_from_format', 'bpf', 'io_lock', 'json', 'lru_knobs', 'lru_tables', 'lrurec', 'np', 'os', 'pd', 'pools', 'pressure_pool', 'pytest', 're', 'rundir', 'subprocess', 'sys', 'time']
