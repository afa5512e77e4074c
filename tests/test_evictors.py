"""Who evicted a pool page: the pagecache probe's evictor classes (probes/moetrace.h EVICTOR_*).

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

PROBES_DIR = Path(__file__).resolve().parents[1] / "probes"
N, PAGES = 8, 256  # 8 experts x 1 MiB
RECORD = [sys.executable, "-c", "from moetrace.cli import main; main()", "record"]


def test_evictor_classes_match_the_header():
    text = (PROBES_DIR / "moetrace.h").read_text()
    got = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(r"#define EVICTOR_([A-Z_]+) (\d+)", text)}
    assert list(got) == list(EVICTORS) and list(got.values()) == list(range(len(EVICTORS)))
    assert int(re.search(r"#define N_EVICTORS (\d+)", text).group(1)) == len(EVICTORS)
    spec = PROBES["pagecache"]
    cols = [c.name for c in spec.schema if c.name.startswith("evicted_by_")]
    assert cols == [f"evicted_by_{e}_pages" for e in EVICTORS]
    assert [c.name for c in spec.tables()["epochs"] if c.name.startswith("evicted_by_")] == cols


def _resident(path: Path, first: int = 0, n: int | None = None) -> int:
    from test_record import _resident_pages_range

    return _resident_pages_range(path, first, n)


# -- a recorded command that reads the pool, then waits while others act on it ---------------------

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
    from moetrace.run.directory import load_run

    doc, t = load_run(run)
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


@pytest.mark.live
def test_fadvise_truncate_drop_caches_from_another_process(live, epool, tmp_path):
    """Experts 0-2 fadvise(DONTNEED)d, expert 3 truncated to half, then drop_caches — all by
    this test process, while a recording holds the pool: each deletion lands in its class."""
    from test_record import _drop

    files = sorted(epool.rglob("*.bin"))
    acts: dict[str, tuple[int, int, list[int]]] = {}  # action -> (t before, t after, resident before per expert)
    with io_lock():
        _drop(epool)
        proc, go = _start(tmp_path, epool, tmp_path / "run")
        try:
            t0 = time.monotonic_ns()
            before = [_resident(f) for f in files[:3]]
            for f in files[:3]:
                fd = os.open(f, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            acts["fadvise"] = (t0, time.monotonic_ns(), before)
            t0 = time.monotonic_ns()
            before = [_resident(files[3], PAGES // 2, PAGES // 2)]
            with open(files[3], "r+b") as fh:
                os.ftruncate(fh.fileno(), PAGES // 2 * 4096)
            acts["truncate"] = (t0, time.monotonic_ns(), before)
            after_trunc = [_resident(f) for f in files]
            t0 = time.monotonic_ns()
            before = [_resident(f) for f in files]
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1")
            acts["drop_caches"] = (t0, time.monotonic_ns(), before)
            left = [_resident(f) for f in files]
        finally:
            err = _finish(proc, go)
    doc, e, ev = _tables(tmp_path / "run")
    print("\n" + err + e[["expert_id", "added_pages", "evicted_pages"] +
                          [f"evicted_by_{k}_pages" for k in EVICTORS]].to_string())
    cols = [f"evicted_by_{k}_pages" for k in EVICTORS]
    assert (e[cols].sum(axis=1) == e["evicted_pages"]).all()  # every deletion has one class
    assert left == [0] * N and after_trunc[:3] == [0, 0, 0]
    assert list(e["added_pages"]) == [PAGES] * N  # read once, never re-read
    # each action's class holds what mincore saw resident right before it, less what DAMON took
    # in the microseconds between that mincore and the action (the stream says when)
    for name, experts in (("fadvise", range(3)), ("truncate", [3]), ("drop_caches", range(N))):
        t0, t1, before = acts[name]
        for i, eid in enumerate(experts):
            got = int(e.loc[eid, f"evicted_by_{name}_pages"])
            raced = _deleted(ev, eid, "damon", t0, t1)
            assert before[i] - raced <= got <= before[i], (name, eid, got, before[i], raced)
            assert got == _deleted(ev, eid, name)  # the counters agree with the stream
    assert int(e["evicted_by_fadvise_pages"].iloc[3:].sum()) == 0
    assert int(e["evicted_by_truncate_pages"].drop(index=3).sum()) == 0
    assert int(e.loc[:2, "evicted_by_fadvise_pages"].sum()) > 0 and int(e.loc[3, "evicted_by_truncate_pages"]) > 0
    # nothing in this test reclaims: no reclaim class, and no evictions outside the named ones
    for k in ("kswapd", "direct", "memcg", "proactive", "other"):
        assert int(e[f"evicted_by_{k}_pages"].sum()) == 0, k
    assert doc["totals"]["experts_evicted_by"]["fadvise"] == int(e["evicted_by_fadvise_pages"].sum())


def _damon_scheme():
    from moetrace.kernel.damon import read_damon

    return [s for s in read_damon()["active_schemes"] if s["evicts_page_cache"] and s["operations"] == "paddr"]


@pytest.mark.live
def test_damon_pageout_is_attributed_to_damon(live, epool, tmp_path):
    """This machine's kdamond pageout scheme evicts freshly read pool pages while the recorded
    command sits idle: every pool page that mincore sees leave is in evicted_by_damon."""
    schemes = _damon_scheme()
    if not schemes:
        reason = "no active DAMON pageout scheme over physical memory on this machine"
        if os.environ.get("MOETRACE_LIVE") == "1":
            pytest.fail(f"MOETRACE_LIVE=1: {reason} (the machines this project runs on start kdamond.0 at boot)")
        pytest.skip(reason)
    from test_record import _drop

    files = sorted(epool.rglob("*.bin"))
    with io_lock():
        _drop(epool)
        proc, go = _start(tmp_path, epool, tmp_path / "run", timeout_s=200)
        try:
            full = sum(_resident(f) for f in files)
            t_end = time.monotonic() + 150
            now = full
            while time.monotonic() < t_end:  # DAMON takes a few hundred pages every few seconds here
                time.sleep(1)
                now = sum(_resident(f) for f in files)
                if full - now >= 64:
                    break
        finally:
            err = _finish(proc, go)
        after = sum(_resident(f) for f in files)
    doc, e, ev = _tables(tmp_path / "run")
    damon = int(e["evicted_by_damon_pages"].sum())
    print(f"\nresident after the read {full}, at the stop {now}, after the recording {after}; "
          f"evicted by damon {damon}, by class {doc['totals']['experts_evicted_by']}")
    assert full == sum(-(-f.stat().st_size // 4096) for f in files)  # all read (expert 3 may be truncated)
    assert full - now >= 64, f"DAMON evicted only {full - now} pool pages in 150 s"
    assert int(e["evicted_pages"].sum()) == damon  # nobody else evicted
    assert full - now <= damon <= full - after  # mincore before / after the recording's stop
    pool_ev = ev[ev["expert_id"] < N]
    assert damon == int(pool_ev.loc[(pool_ev["kind"] == "delete") & (pool_ev["evictor"] == "damon"), "pages"].sum())
    # the pool's device: other files' deletions are unattributed, classed all the same
    u = doc["totals"]["unattributed_evicted_by"]
    assert sum(u.values()) == doc["totals"]["unattributed_evicted_pages"]


@pytest.mark.live
def test_doctor_shows_the_damon_scheme(live):
    r = moetrace_cli("doctor", "--json")
    rep = json.loads(r.stdout)
    active = rep["damon"]["active_schemes"]
    assert [(s["kdamond"], s["index"]) for s in active] == [(s["kdamond"], s["index"]) for s in _damon_scheme()]
    rows = [x for x in rep["rows"] if x["section"] == "background"]
    for s in active:
        row = next(x for x in rows if x["name"] == f"damon.{s['thread']}.scheme{s['index']}")
        assert row["status"] == ("active" if s["evicts_page_cache"] else "passive")
        assert s["action"] in row["detail"]
    # read only: doctor wrote nothing (the kdamond's state and scheme are as before)
    from moetrace.kernel.damon import read_damon

    assert [(s["action"], s["quotas"]) for s in read_damon()["active_schemes"]] == \
        [(s["action"], s["quotas"]) for s in active]
