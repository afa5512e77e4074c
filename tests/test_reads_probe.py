"""The reads probe (probes/reads.c + moetrace.record.probes.reads).

No kernel: attribution of fd identities to experts (files and pool layouts, unattributed
sources), tables against the declaration, the /proc fd resolver on a fake tree, the
replay oracle. Probe build: compiles, loads and detaches with the knob sets the recorder
uses. Live: a psync replay of a 23 x 1 MiB pool against the replay's own log (calls and
bytes exactly, per pass by the iteration log's time windows), cold misses of 256 pages
per expert and all-hit second passes, added pages equal to the pagecache probe's, chunked
reads, fd reuse / errors / read() / forks from a script that counts its own calls, and
`moetrace record --probes pagecache,reads -- replay ...` end to end.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moetrace.run import directory as rundir
from moetrace.record.spec import resolve
from moetrace.record.probes import PROBES
from moetrace.record.probes.reads import (CLASSES, FD_FIELDS, HIST_SLOTS, NOPOS, READ_CALL_DTYPE, UNATTRIBUTED, Collected,
                               FdResolver, PoolIndex, Resolution, build, calls_table, kernel_dev, reads_knobs,
                               replay_oracle)

SPEC = PROBES["reads"]
N, MIB = 23, 1 << 20
PAGES = MIB // mmap.PAGESIZE
BIN = Path(sys.executable).parent
RECORD = [sys.executable, "-c", "from moetrace.cli import main; main()", "record"]
REPLAY = [sys.executable, "-m", "moetrace.cli.replay"]
from conftest import io_lock  # noqa: E402
from test_record import _drop  # noqa: E402  (fadvise DONTNEED, then mincore: 0 pages resident)


# ---------------------------------------------------------------------------
# no kernel

FILES_POOL = PoolIndex({100 + i: (i, 1) for i in range(4)}, dev=(8 << 20) | 1, extent_bytes=MIB, n_total=4,
                       n_experts=2)
ONE_FILE_POOL = PoolIndex({200: (0, 4)}, dev=(8 << 20) | 1, extent_bytes=MIB, n_total=4, n_experts=2)


def test_pool_index_locates_calls():
    p = FILES_POOL
    assert p.locate(102, p.dev, 5 * MIB) == ("expert", 2)  # one expert per file: position irrelevant
    assert p.locate(102, p.dev, None) == ("expert", 2)
    assert p.locate(999, p.dev, 0) == ("other_files", None)
    assert p.locate(102, p.dev + 1, 0) == ("other_files", None)  # same inode number, other filesystem
    assert p.locate(None, None, 0) == ("unresolved_fd", None)
    q = ONE_FILE_POOL
    assert q.split and not p.split
    assert q.locate(200, q.dev, 0) == ("expert", 0)
    assert q.locate(200, q.dev, 3 * MIB + 4095) == ("expert", 3)
    assert q.locate(200, q.dev, 4 * MIB) == ("pool_tail", None)
    assert q.locate(200, q.dev, None) == ("no_position", None)


def test_knobs_from_plan_and_pool():
    from moetrace.kernel.features import Features

    plan = resolve(SPEC, Features("/"))
    k = reads_knobs(plan, ONE_FILE_POOL, stream=True)
    assert k["MOE_EXTENT"] == MIB and k["MOE_STREAM"] == 1 and k["MOE_PAGE_SHIFT"] == 12
    assert set(k) == {kn.name for kn in SPEC.knobs}
    assert reads_knobs(plan, FILES_POOL, stream=False)["MOE_EXTENT"] == 0  # one expert per file: no split
    assert reads_knobs(plan, None, stream=False)["MOE_EXTENT"] == 0
    # a pool file's identities are per extent: `fds` holds 4 per expert + 4096 others, a power of two
    big = PoolIndex({5: (0, 8000)}, 1, MIB, 8000, 8000)
    assert reads_knobs(plan, big, stream=False)["MOE_MAX_FDS"] == 65536
    assert reads_knobs(plan, ONE_FILE_POOL, stream=False)["MOE_MAX_FDS"] == 16384  # the default suffices


def _fd_row(tgid, fd, gen, epoch, chunk, calls, hit, miss, err, added, ino=0, dev=0, nbytes=None):
    v = {f: 0 for f in FD_FIELDS}
    nbytes = calls * MIB if nbytes is None else nbytes
    v.update(calls=calls, bytes=nbytes, requested_bytes=calls * MIB, hit_calls=hit, hit_bytes=hit * MIB,
             hit_latency_ns=hit * 1000, miss_calls=miss, miss_bytes=miss * MIB, miss_latency_ns=miss * 50_000,
             error_calls=err, error_latency_ns=err * 10, added_pages=added, ino=ino, dev=dev)
    return {"tgid": tgid, "fd": fd, "gen": gen, "epoch": epoch, "chunk": chunk, **v}


def _collected(rows, hist_rows=(), stream=None):
    fds = pd.DataFrame(rows, columns=["tgid", "fd", "gen", "epoch", "chunk", *FD_FIELDS])
    fds["chunk"] = fds["chunk"].astype("uint64")
    fh = pd.DataFrame(list(hist_rows), columns=["tgid", "fd", "gen", "epoch", "cls", "slot", "calls"])
    hist = np.zeros((3, HIST_SLOTS), np.int64)
    for r in hist_rows:
        hist[r[4], r[5]] += r[6]
    hist[0, 3] += 5  # calls only the all-calls histogram saw (e.g. a full per-fd histogram map)
    classes = {c: {"calls": 0, "bytes": 0, "requested_bytes": 0, "added_pages": 0, "beyond_pages": 0,
                   "other_pages": 0, "latency_ns": 0} for c in CLASSES}
    stats = {s: 0 for s in SPEC.stats}
    overflow = {f: 0 for f in FD_FIELDS}
    overflow.update(calls=2, bytes=10)
    bad_fd = {f: 0 for f in FD_FIELDS}
    bad_fd.update(calls=3, error_calls=3, error_latency_ns=30)
    return Collected(classes, hist, fds, fh, overflow, stats, bad_fd=bad_fd, stream=stream)


def test_files_layout_attribution_and_fd_reuse():
    """fd 5 of tgid 10 is expert 1's file (gen 0), then closed and reopened as expert 3's (gen 1):
    two identities; an identity the scan missed is resolved by its first added page."""
    dev = FILES_POOL.dev
    rows = [_fd_row(10, 5, 0, 0, 0, 3, 2, 1, 0, 256),
            _fd_row(10, 5, 1, 0, 0, 2, 1, 1, 0, 256, ino=103, dev=dev),  # learned from an added page
            _fd_row(10, 7, 0, 0, NOPOS, 4, 4, 0, 0, 0, nbytes=40),   # read() of a non-pool file
            _fd_row(11, 3, 0, 0, 0, 1, 0, 0, 1, 0, nbytes=0)]          # an error on an fd never seen open
    resolved = {(10, 5, 0, 0): Resolution(101, dev, "/p/e1.bin", "proc"),
                (10, 7, 0, 0): Resolution(555, dev, "/usr/lib/x.py", "proc")}
    hist_rows = [(10, 5, 0, 0, 0, 10, 2), (10, 5, 0, 0, 1, 16, 1), (10, 5, 1, 0, 0, 10, 1), (10, 5, 1, 0, 1, 16, 1),
                 (10, 7, 0, 0, 0, 9, 4), (11, 3, 0, 0, 2, 4, 1)]
    tables, summary = build(_collected(rows, hist_rows), resolved, FILES_POOL, 0)
    r = tables["reads"]
    assert [c for c in r.columns] == [c.name for c in SPEC.schema]
    e = r[r["kind"] == "expert"].set_index("expert_id")
    assert e["calls"].tolist() == [0, 3, 0, 2] and e["added_pages"].tolist() == [0, 256, 0, 256]
    assert e.loc[1, "hit_only_calls"] == 2 and e.loc[1, "miss_calls"] == 1 and e.loc[1, "fd_identities"] == 1
    assert e.loc[1, "hit_only_ns_per_kib"] == pytest.approx(2000 / 2048)
    assert e.loc[0, "calls"] == 0 and pd.isna(e.loc[0, "hit_only_ns_per_kib"])  # nothing read: NaN, not 0
    assert list(e["layer"]) == [0, 0, 1, 1] and list(e["expert"]) == [0, 1, 0, 1]
    u = r[r["kind"] == "unattributed"].set_index("source")
    assert list(u.index) == list(UNATTRIBUTED)
    assert u.loc["other_files", "calls"] == 4 and u.loc["other_files", "bytes"] == 40
    assert u.loc["unresolved_fd", "error_calls"] == 1
    assert u.loc["fd_map_full", "calls"] == 2 and pd.isna(u.loc["fd_map_full", "fd_identities"])
    assert u.loc["bad_fd", "error_calls"] == 3 and u.loc["bad_fd", "error_latency_ns_sum"] == 30
    assert int(r["calls"].sum()) == 3 + 2 + 4 + 1 + 2 + 3  # every call lands in exactly one row
    f = tables["reads_files"]
    assert sorted(f["resolved_by"].dropna()) == ["add", "proc", "proc"]
    assert f.loc[f["gen"] == 1, "expert_id"].tolist() == [3]
    assert f["extent"].isna().sum() == 1  # read(): no position
    lat = tables["reads_latency"]
    assert set(lat["scope"]) == {"all", "pool", "not_pool"}
    pool = lat[lat["scope"] == "pool"]
    assert int(pool["calls"].sum()) == 5 and set(pool["class"]) == {"hit_only", "miss"}
    tot = lat.groupby("scope")["calls"].sum()
    assert tot["all"] == tot["pool"] + tot["not_pool"] == 10 + 5
    assert (lat["hi_ns"] == 2 * lat["lo_ns"]).all() or (lat["lo_ns"] == 0).any()
    one = lat[(lat["scope"] == "all") & (lat["slot"] == 10)].iloc[0]
    assert (one["lo_ns"], one["hi_ns"]) == (512, 1024)
    assert summary["fd_identities"]["resolved_add"] == 1 and summary["fd_identities"]["unresolved"] == 1
    for name, df in tables.items():  # every table is the declared one, in order and dtype
        cols = SPEC.tables()[name]
        assert list(df.columns) == [c.name for c in cols], name
        for c in cols:
            assert str(df[c.name].dtype) == c.dtype, (name, c.name, df[c.name].dtype)


def test_pool_file_attribution_by_extent_and_conflicts():
    q = ONE_FILE_POOL
    rows = [_fd_row(10, 4, 0, 0, 0, 2, 1, 1, 0, 256), _fd_row(10, 4, 0, 0, 3, 1, 0, 1, 0, 300),
            _fd_row(10, 4, 0, 0, 9, 1, 1, 0, 0, 0), _fd_row(10, 4, 0, 0, NOPOS, 1, 1, 0, 0, 0),
            _fd_row(12, 4, 0, 0, 1, 1, 0, 1, 0, 256, ino=777, dev=q.dev)]  # add says 777, /proc says pool
    resolved = {(10, 4, 0, 0): Resolution(200, q.dev, "/p/pool.bin", "proc"),
                (12, 4, 0, 0): Resolution(200, q.dev, "/p/pool.bin", "proc")}
    tables, summary = build(_collected(rows), resolved, q, MIB)
    e = tables["reads"].set_index("source")
    ex = tables["reads"][tables["reads"]["kind"] == "expert"]
    assert ex["calls"].tolist() == [2, 1, 0, 1] and ex["added_pages"].tolist() == [256, 256, 0, 300]
    assert e.loc["pool_tail", "calls"] == 1 and e.loc["no_position", "calls"] == 1
    assert summary["fd_identities"]["ino_conflicts"] == 1  # /proc wins, the disagreement is counted


def test_stream_calls_are_attributed_by_their_own_position():
    q = ONE_FILE_POOL
    ev = np.zeros(4, READ_CALL_DTYPE)
    ev["tgid"], ev["fd"] = 10, 4
    ev["pos"] = [0, 2 * MIB + 4096, NOPOS, MIB]
    ev["count"], ev["ret"] = MIB, [MIB, MIB, 100, -9]
    ev["added_pages"] = [256, 0, 0, 0]
    ev["syscall"] = [2, 2, 3, 0]
    ev["ino"][0], ev["dev"][0] = 200, q.dev
    ev[3]["fd"] = 9  # another fd, never resolved
    inos = {(10, 4, 0, 0): Resolution(200, q.dev, None, "proc")}
    df = calls_table(ev.tobytes(), inos, q)
    assert df["expert_id"].tolist()[:2] == [0, 2] and pd.isna(df["expert_id"].iloc[2])
    assert df["source"].tolist() == ["expert", "expert", "no_position", "unresolved_fd"]
    assert df["class"].tolist() == ["miss", "hit_only", "hit_only", "error"]
    assert df["syscall"].tolist() == ["preadv2", "preadv2", "read", "pread64"]
    assert pd.isna(df["offset_bytes"].iloc[2]) and df["offset_bytes"].iloc[1] == 2 * MIB + 4096
    assert df["ino"].iloc[0] == 200 and pd.isna(df["ino"].iloc[1])
    assert calls_table(b"", {}, None).empty


def test_fd_resolver_on_a_fake_proc(tmp_path):
    """Resolved only when the kernel's (gen, epoch) of the fd is unchanged across the stat."""
    proc = tmp_path / "proc"
    (proc / "42" / "fd").mkdir(parents=True)
    target = tmp_path / "e0.bin"
    target.write_bytes(b"x")
    os.symlink(target, proc / "42" / "fd" / "5")
    os.symlink(tmp_path / "gone", proc / "42" / "fd" / "6")  # dangling: stat fails
    gens = {(42, 5): (3, 1)}
    r = FdResolver(lambda tgid, fd: gens.get((tgid, fd), (0, 0)), proc=str(proc))
    assert r.resolve((42, 5, 3, 1))
    st = target.stat()
    assert r.resolved[(42, 5, 3, 1)] == Resolution(st.st_ino, kernel_dev(st.st_dev), str(target), "proc")
    assert not r.resolve((42, 5, 2, 1)) and r.failed == 1  # the fd was closed and reused since
    assert not r.resolve((42, 6, 0, 0)) and r.failed == 2
    gens[(42, 5)] = (4, 1)
    assert r.scan([42, 99]) == 1 and (42, 5, 4, 1) in r.resolved  # 99: no such process
    assert r.failed == 2  # scan failures are not announcement failures


def test_replay_oracle(tmp_path):
    doc = {"mode": "pagecache", "prefetch": "none", "read_bytes_per_call": 262144, "read_len_bytes": MIB,
           "complete": True, "phases": {"warmup": {"reads": 23, "bytes": 23 * MIB, "arena_hits": 0},
                                        "measured": {"reads": 46, "bytes": 46 * MIB, "arena_hits": 0}}}
    (tmp_path / "replay.json").write_text(json.dumps(doc))
    o = replay_oracle(tmp_path)
    assert o["calls_per_expert"] == 4 and o["expected_calls"] == 69 * 4 and o["expected_bytes"] == 69 * MIB
    doc["mode"] = "mmap"
    (tmp_path / "replay.json").write_text(json.dumps(doc))
    assert replay_oracle(tmp_path)["comparable"] is False and replay_oracle(tmp_path)["expected_calls"] is None
    assert replay_oracle(tmp_path / "nope") is None and replay_oracle(None) is None


def test_recorder_is_registered():
    from moetrace.record.probe import recorder_class
    from moetrace.record.probes.reads import ReadsRecorder

    assert recorder_class("reads") is ReadsRecorder and ReadsRecorder.needs_poll


# ---------------------------------------------------------------------------
# probe build

KNOB_SETS = {
    "default": {},
    "pool-stream": dict(MOE_EXTENT=MIB, MOE_STREAM=1),
    "minimal": dict(MOE_HAVE_PREADV=0, MOE_HAVE_PREADV2=0, MOE_HAVE_READ=0, MOE_TRACK_CLOSE=0,
                    MOE_TRACK_CLOSE_RANGE=0, MOE_TRACK_EXEC=0, MOE_FOLLOW_FORKS=0, MOE_HAVE_ORDER=0),
}


@pytest.mark.probe_build
@pytest.mark.parametrize("name", list(KNOB_SETS))
def test_reads_compiles_loads_and_detaches(live, name):
    from moetrace.kernel import bpf
    from moetrace.kernel.bpf import prog_id_exists, prog_info

    full = SPEC.knob_values(**KNOB_SETS[name])
    probe = bpf.load_probe("reads", full)
    try:
        tps = set(probe.tracepoints)
        assert {"syscalls:sys_enter_pread64", "syscalls:sys_exit_pread64",
                "filemap:mm_filemap_add_to_page_cache"} <= tps
        assert ("syscalls:sys_enter_preadv2" in tps) == bool(full["MOE_HAVE_PREADV2"])
        assert ("syscalls:sys_exit_read" in tps) == bool(full["MOE_HAVE_READ"])
        assert ("syscalls:sys_enter_close" in tps) == bool(full["MOE_TRACK_CLOSE"])
        assert ("task:task_newtask" in tps) == bool(full["MOE_FOLLOW_FORKS"])
        assert len(tps) == 3 + 2 * sum(full[k] for k in ("MOE_HAVE_PREADV", "MOE_HAVE_PREADV2", "MOE_HAVE_READ")) \
            + sum(full[k] for k in ("MOE_TRACK_CLOSE", "MOE_TRACK_CLOSE_RANGE", "MOE_TRACK_EXEC", "MOE_FOLLOW_FORKS"))
        assert len(probe.table("stats")) == len(SPEC.stats)
        assert len(probe.table("classes")) == len(CLASSES)
        ids = [prog_info(f.fd)["id"] for f in probe.bpf.funcs.values()]
        assert ids and all(prog_id_exists(i) for i in ids)
    finally:
        probe.close()
    assert not any(prog_id_exists(i) for i in ids), "programs still loaded after close()"


@pytest.mark.probe_build
def test_recorder_open_close_abort_are_idempotent(live, tmp_path):
    """The recorder's own path (knobs from the live attach plan), a pid of our own followed:
    our preads are counted and classed; close() and abort() leave no program behind."""
    from moetrace.kernel.features import Features
    from moetrace.record.probe import RecordContext
    from moetrace.record.probes.reads import ReadsRecorder
    from moetrace.kernel.bpf import prog_id_exists

    feats = Features("/")
    rec = ReadsRecorder(RecordContext(features=feats, plan=resolve(SPEC, feats), log_dir=tmp_path))
    rec.open()
    ids = rec.prog_ids()
    try:
        f = tmp_path / "x.bin"
        f.write_bytes(b"y" * 8192)
        fd = os.open(f, os.O_RDONLY)
        rec.follow(os.getpid())
        for _ in range(3):
            assert len(os.pread(fd, 4096, 0)) == 4096
        with pytest.raises(OSError):
            os.pread(-1, 10, 0)
        rec.poll(50)
        t = rec.probe.table("tgids")
        del t[t.Key(os.getpid())]  # stop following before pytest does anything else
        os.close(fd)
        rec.close()
        rec.close()
        rec.abort()
    finally:
        rec.abort()
    assert ids and not any(prog_id_exists(i) for i in ids)
    assert rec.collected
    tables, summary = rec.tables()
    assert summary["calls_by_syscall"]["pread64"] == 4
    assert summary["classes"]["error"]["calls"] == 1
    files = tables["reads_files"]
    mine = files[(files["fd"] == fd) & (files["path"] == str(f))]
    assert int(mine["calls"].sum()) == 3 and int(mine["hit_only_calls"].sum()) == 3  # just written: cached
    assert int(mine["bytes"].sum()) == 3 * 4096


# ---------------------------------------------------------------------------
# live


def _moetrace(*args: str) -> None:
    r = subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *args],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    from conftest import make_expert_pools

    return make_expert_pools(tmp_path_factory.mktemp("reads"), N)


def _record(out: Path, cmd: list[str], *opts: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*RECORD, "--out", str(out), *opts, "--", *cmd], capture_output=True, text=True,
                          timeout=timeout)


def _replay_log(run: Path) -> tuple[dict, pd.DataFrame]:
    rep = run / "replay"
    return json.loads((rep / "replay.json").read_text()), pd.read_parquet(rep / "iterations.parquet")


@pytest.mark.parametrize("layout", ["files", "pool"])
def test_cold_pass_misses_then_hot_pass_hits(live, pools, layout, tmp_path):
    """warm-up (cold) + measured (hot) psync replay, 4 threads, per-call stream: per pass (the
    iteration log's own time windows) the calls and bytes equal the replay's; every call of
    the cold pass is a miss adding exactly 256 pages, every call of the hot pass is hit-only.
    The pool file is read with POSIX_FADV_RANDOM so that no readahead crosses an extent."""
    replay = [*REPLAY, str(pools["plan"]), "--pool", str(pools[layout]), "--warmup", "1", "--passes", "1",
              "--threads", "4", *(["--fadvise-random"] if layout == "pool" else [])]
    with io_lock():
        _drop(pools[layout])
        r = _record(tmp_path / "run", replay, "--probes", "pagecache,reads", "--stream-events")
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    doc, tables = rundir.load_run(run)
    rj, it = _replay_log(run)
    assert rj["complete"] is True and rj["mode"] == "pagecache"
    calls = tables["read_calls"]
    lost = doc["lost"]["reads"]
    assert lost["stream"]["lost_kernel"] == 0 and lost["stream"]["lost_user"] == 0
    assert lost["counters_lost_events"] == 0 and lost["inflight_full_calls"] == 0
    pool_calls = calls[calls["source"] == "expert"]
    for phase, want_cls, want_pages in (("warmup", "miss", PAGES), ("measured", "hit_only", 0)):
        w = it[it["phase"] == phase]
        assert len(w) == 1
        lo, hi = int(w["start_ns"].iloc[0]), int(w["end_ns"].iloc[0])
        inside = pool_calls[(pool_calls["ts_ns"] >= lo) & (pool_calls["ts_ns"] + pool_calls["latency_ns"] <= hi)]
        # the replay's own log: reads (expert accesses, one call each) and bytes of the pass
        assert len(inside) == int(w["reads"].iloc[0]) == N, phase
        assert int(inside["ret"].sum()) == int(w["bytes"].iloc[0]) == N * MIB, phase
        assert sorted(inside["expert_id"].tolist()) == list(range(N)), phase
        assert (inside["class"] == want_cls).all(), inside["class"].value_counts()
        assert inside["added_pages"].tolist() == [want_pages] * N, phase
        assert (inside["beyond_pages"] == 0).all() and (inside["other_added_pages"] == 0).all()
    assert len(pool_calls) == 2 * N  # no pool read outside the two passes
    # the kernel's per-fd aggregates (no stream needed) say the same per expert
    e = tables["reads"][tables["reads"]["kind"] == "expert"]
    assert e["calls"].tolist() == [2] * N and e["bytes"].tolist() == [2 * MIB] * N
    assert e["miss_calls"].tolist() == [1] * N and e["hit_only_calls"].tolist() == [1] * N
    assert e["added_pages"].tolist() == [PAGES] * N and int(e["added_pages"].sum()) == N * PAGES == 5888
    # ... and equal the pagecache probe's pages of the same recording, expert by expert
    pc = tables["experts"][tables["experts"]["kind"] == "expert"]
    assert e["added_pages"].tolist() == pc["added_pages"].tolist()
    chk = doc["summaries"]["reads"]["replay_check"]
    assert chk["calls_match"] is True and chk["bytes_match"] is True
    assert doc["tables"]["reads"] == {c.name: {"dtype": c.dtype, "unit": c.unit, "doc": c.doc} for c in SPEC.schema}
    assert doc["attach_plan"]["reads"]["recorded"] is True
    # the hit path is cheaper than the miss path (summed: one preempted call must not decide)
    assert int(e["hit_only_latency_ns_sum"].sum()) < int(e["miss_latency_ns_sum"].sum())


def test_end_to_end_cli_chunked_reads(live, pools, tmp_path):
    """`moetrace record --probes pagecache,reads -- replay ...` (the installed commands), the
    pool file with readahead on and 256 KiB read calls: 4 calls per expert access; calls and
    bytes equal the replay log's exactly; the pages added during the calls equal the pagecache
    probe's in total (readahead charges the calling expert, the pagecache probe the page's)."""
    moetrace, replay = BIN / "moetrace", BIN / "replay"
    if not moetrace.exists() or not replay.exists():
        pytest.skip("moetrace / replay console scripts not installed in this environment")
    run = tmp_path / "cli"
    with io_lock():
        _drop(pools["pool"])
        r = subprocess.run([str(moetrace), "record", "--probes", "pagecache,reads", "--out", str(run), "--",
                            str(replay), str(pools["plan"]), "--pool", str(pools["pool"]), "--warmup", "1",
                            "--passes", "2", "--threads", "2", "--read-size", "256KiB"],
                           capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    doc, tables = rundir.load_run(run)
    assert doc["complete"] is True
    _rj, it = _replay_log(run)
    e = tables["reads"][tables["reads"]["kind"] == "expert"]
    assert int(e["calls"].sum()) == 4 * int(it["reads"].sum()) == 4 * 3 * N
    assert int(e["bytes"].sum()) == int(it["bytes"].sum()) == 3 * N * MIB
    assert e["calls"].tolist() == [12] * N and (e["error_calls"] == 0).all()
    pc = tables["experts"][tables["experts"]["kind"] == "expert"]
    assert int(e["added_pages"].sum()) == int(pc["added_pages"].sum()) == N * PAGES
    assert int(e["miss_calls"].sum()) >= 1 and int(e["hit_only_calls"].sum()) >= 2 * 4 * N  # two hot passes
    assert "read_calls" not in tables  # no --stream-events: counters only
    s = doc["summaries"]["reads"]
    assert s["replay_check"]["calls_per_expert"] == 4 and s["replay_check"]["calls_match"] is True
    assert s["extent_bytes"] == MIB and doc["knobs"]["reads"]["MOE_EXTENT"] == MIB
    assert set(doc["tables"]) >= {"reads", "reads_latency", "reads_files", "experts"}
    lat = tables["reads_latency"]
    pool_lat = lat[lat["scope"] == "pool"]
    assert int(pool_lat["calls"].sum()) == int(e["calls"].sum())
    for p in [run, *run.rglob("*")]:
        assert rundir.is_private(p), p


def test_fd_reuse_errors_read_and_forks(live, pools, tmp_path):
    """A script that counts its own calls, recorded with the pool file as the pool: preads of
    expert 3's extent, then the same fd number reopened on a file outside the pool (close in
    between: a new identity), a pread on the closed fd (EBADF), a pread past the last extent,
    read() of the pool file (no position), and a forked child reading expert 7."""
    from moetrace.inputs.pool import open_pool

    pf = str(pools["pool"] / "pool.bin")
    other = str(open_pool(pools["files"]).path_of(5))
    script = textwrap.dedent(f"""
        import os, time
        fd = os.open({pf!r}, os.O_RDONLY)
        for off in (3 * {MIB}, 3 * {MIB} + 524288):
            assert len(os.pread(fd, 524288, off)) == 524288
        assert os.pread(fd, 100, {N} * {MIB}) == b""
        time.sleep(0.3)
        os.close(fd)
        fd2 = os.open({other!r}, os.O_RDONLY)
        assert fd2 == fd
        assert len(os.pread(fd2, 4096, 8192)) == 4096
        time.sleep(0.3)
        os.close(fd2)
        try:
            os.pread(fd2, 10, 0)
            raise SystemExit("pread on a closed fd succeeded")
        except OSError:
            pass
        f = os.open({pf!r}, os.O_RDONLY)
        assert len(os.read(f, 65536)) == 65536
        time.sleep(0.3)
        os.close(f)
        pid = os.fork()
        if pid == 0:
            f7 = os.open({pf!r}, os.O_RDONLY)
            os.pread(f7, {MIB}, 7 * {MIB})
            time.sleep(0.3)
            os._exit(0)
        os.waitpid(pid, 0)
    """)
    r = _record(tmp_path / "s", [sys.executable, "-c", script], "--probes", "reads", "--pool", str(pools["pool"]))
    assert r.returncode == 0, r.stderr
    doc, tables = rundir.load_run(tmp_path / "s")
    rd = tables["reads"]
    u = rd[rd["kind"] == "unattributed"].set_index("source")
    ex = rd[rd["kind"] == "expert"].set_index("expert_id")
    assert ex.loc[3, "calls"] == 2 and ex.loc[3, "bytes"] == MIB
    assert ex.loc[7, "calls"] == 1 and ex.loc[7, "bytes"] == MIB  # the forked child, followed
    assert int(ex["calls"].sum()) == 3
    assert u.loc["pool_tail", "calls"] == 1 and u.loc["pool_tail", "bytes"] == 0
    assert u.loc["no_position", "calls"] == 1 and u.loc["no_position", "bytes"] == 65536
    assert u.loc["bad_fd", "calls"] == u.loc["bad_fd", "error_calls"] == 1  # EBADF: kept apart in the kernel
    assert int(ex["error_calls"].sum()) == 0
    files_t = tables["reads_files"]
    first = files_t[(files_t["path"] == pf) & (files_t["extent"] == 3)]
    second = files_t[files_t["path"] == other]
    assert len(first) == 1 and len(second) == 1
    assert first["fd"].iloc[0] == second["fd"].iloc[0] and second["gen"].iloc[0] > first["gen"].iloc[0]
    assert second["source"].tolist() == ["other_files"] and int(second["bytes"].iloc[0]) == 4096
    s = doc["summaries"]["reads"]
    assert s["classes"]["error"]["calls"] >= 1
    assert doc["stats"]["reads"]["closes"] >= 3 and doc["stats"]["reads"]["calls_read"] >= 1


def test_files_layout_fd_reuse_and_close_range(live, pools, tmp_path):
    """Files layout: the current identity of an fd is counted in its `fdgen` entry and
    retired to `fds` by close() (a new generation) and by the first call after the
    process's epoch changed (close_range closes without close()): one fd number reused for
    three experts attributes each call to its own expert."""
    from moetrace.inputs.pool import open_pool

    fp = open_pool(pools["files"])
    a, b, c = (str(fp.path_of(e)) for e in (1, 2, 4))
    script = textwrap.dedent(f"""
        import ctypes, os, time
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open({a!r}, os.O_RDONLY)
        for off in (0, 4096):
            assert len(os.pread(fd, 4096, off)) == 4096
        time.sleep(0.3)
        os.close(fd)
        fd2 = os.open({b!r}, os.O_RDONLY)
        assert fd2 == fd
        assert len(os.pread(fd2, 8192, 0)) == 8192
        time.sleep(0.3)
        assert libc.syscall(436, fd2, fd2, 0) == 0, ctypes.get_errno()  # close_range(fd, fd, 0)
        fd3 = os.open({c!r}, os.O_RDONLY)
        assert fd3 == fd
        for off in (0, 65536, 131072):
            assert len(os.pread(fd3, 4096, off)) == 4096
        time.sleep(0.3)
    """)
    r = _record(tmp_path / "s", [sys.executable, "-c", script], "--probes", "reads", "--pool", str(pools["files"]))
    assert r.returncode == 0, r.stderr
    doc, tables = rundir.load_run(tmp_path / "s")
    rd = tables["reads"]
    ex = rd[rd["kind"] == "expert"].set_index("expert_id")
    assert ex.loc[1, "calls"] == 2 and ex.loc[1, "bytes"] == 8192
    assert ex.loc[2, "calls"] == 1 and ex.loc[2, "bytes"] == 8192
    assert ex.loc[4, "calls"] == 3 and ex.loc[4, "bytes"] == 3 * 4096
    assert int(ex["calls"].sum()) == 6
    files_t = tables["reads_files"]
    rows = files_t[files_t["path"].isin([a, b, c])].set_index("path")
    assert len(rows) == 3 and rows["fd"].nunique() == 1
    assert rows.loc[b, "gen"] > rows.loc[a, "gen"] and rows.loc[c, "gen"] == rows.loc[b, "gen"]
    assert rows.loc[c, "epoch"] > rows.loc[b, "epoch"]
    st = doc["stats"]["reads"]
    assert st["epoch_bumps"] >= 1 and st["retire_failed"] == 0 and st["fdgen_full"] == 0
