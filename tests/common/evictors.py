"""Who evicted a pool page: the pagecache probe's evictor classes (probes/moetrace.bpf.h EVICTOR_*).

Tiers: the classes agree between the C header and the declaration (no kernel); live, outside
evictions provoked on purpose while a recording runs — fadvise(DONTNEED), ftruncate and
drop_caches from another process than the recorded one, and this machine's DAMON pageout
scheme — each attributed per expert to its class, checked against mincore(2) (resident pages
before and after each action) and the recording's own per-page stream (when each deletion
happened), and `doctor --json` shows the kdamond scheme.
"""


from __future__ import annotations


import json


import os


import re


import subprocess


import sys


import time


from pathlib import Path


import numpy as np


import pandas as pd


import pytest


from conftest import io_lock, moetrace_cli


from moetrace.record.probes.pagecache import EVICTORS


from moetrace.record.probes import PROBES


PROBES_DIR = Path(__file__).resolve().parents[2] / "probes"


N, PAGES = 8, 256  # 8 experts x 1 MiB


RECORD = [sys.executable, "-c", "from moetrace.cli import main; main()", "record"]


def _resident(path: Path, first: int = 0, n: int | None = None) -> int:
    from common.record import _resident_pages_range

    return _resident_pages_range(path, first, n)


_HOLDER = r"""
import os, sys, time
from pathlib import Path
files = sorted(Path(sys.argv[1]).rglob("*.bin"))
for f in files:
    with open(f, "rb") as fh:
        while fh.read(1 << 20):
            pass
Path(sys.argv[2]).write_text("ready")
deadline = time.monotonic() + float(sys.argv[4])
while not Path(sys.argv[3]).exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _start(tmp: Path, pool: Path, run: Path, timeout_s: float = 120):
    ready, go = tmp / "ready", tmp / "go"
    for f in (ready, go):
        f.unlink(missing_ok=True)
    proc = subprocess.Popen([*RECORD, "--probes", "pagecache", "--pool", str(pool), "--stream-events",
                             "--out", str(run), "--", sys.executable, "-c", _HOLDER, str(pool), str(ready), str(go),
                             str(timeout_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t_end = time.monotonic() + 90
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > t_end:
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"the recorded holder did not get ready: {err}")
        time.sleep(0.05)
    return proc, go


def _finish(proc, go: Path):
    go.write_text("go")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return err


def _tables(run: Path):
    from common import read_run

    doc, t = read_run(run)
    e = t["experts"]
    return doc, e[e["kind"] == "expert"].reset_index(drop=True), t["page_events"]


def _deleted(ev: pd.DataFrame, eid: int, evictor: str, t0: int | None = None, t1: int | None = None) -> int:
    sel = (ev["kind"] == "delete") & (ev["expert_id"] == eid) & (ev["evictor"] == evictor)
    if t0 is not None:
        sel &= ev["ts_ns"] > t0
    if t1 is not None:
        sel &= ev["ts_ns"] <= t1
    return int(ev.loc[sel, "pages"].sum())


@pytest.fixture(scope="module")
def epool(tmp_path_factory):
    base = tmp_path_factory.mktemp("evict")
    moetrace_cli("pool", "create", base / "pool", "--layers", "1", "--experts", N, "--k", N, "--expert-bytes", "1MiB",
                 "--layout", "files")
    return base / "pool"


def _damon_scheme():
    from moetrace.kernel.damon import read_damon

    return [s for s in read_damon()["active_schemes"] if s["evicts_page_cache"] and s["operations"] == "paddr"]


__all__ = ['EVICTORS', 'N', 'PAGES', 'PROBES', 'PROBES_DIR', 'Path', 'RECORD', '_HOLDER', '_damon_scheme', '_deleted', '_finish', '_resident', '_start', '_tables', 'epool', 'io_lock', 'json', 'moetrace_cli', 'np', 'os', 'pd', 'pytest', 're', 'subprocess', 'sys', 'time']
