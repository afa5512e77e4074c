"""The reads probe (probes/reads.bpf.c + moetrace.record.probes.reads) (live tier)."""

from __future__ import annotations

from common.reads_probe import *  # noqa: F401,F403
from common import read_run


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
    doc, tables = read_run(run)
    rj, it = _replay_log(run)
    assert rj["complete"] is True and rj["mode"] == "pagecache"
    calls = tables["read_calls"]
    lost = doc["lost"]["reads"]
    assert lost["stream"]["lost_kernel"] == 0 and lost["stream"]["lost_user"] == 0
    assert lost["counters_lost_events"] == 0 and lost["inflight_full_calls"] == 0
    pool_calls = calls[calls["source"] == "expert"]
    # pages a reclaimer (this machine's DAMON pageout) took after the cold pass and the hot pass
    # read again: the pagecache probe counts them per page, per expert. Strict when none.
    pc = tables["experts"][tables["experts"]["kind"] == "expert"].sort_values("expert_id")
    re_added = pc["re_added_pages"].astype(int).tolist()
    assert sum(re_added) <= int(pc["evicted_pages"].sum())
    for phase, want_cls, want_pages in (("warmup", "miss", PAGES), ("measured", "hit_only", 0)):
        w = it[it["phase"] == phase]
        assert len(w) == 1
        lo, hi = int(w["start_ns"].iloc[0]), int(w["end_ns"].iloc[0])
        inside = pool_calls[(pool_calls["ts_ns"] >= lo) & (pool_calls["ts_ns"] + pool_calls["latency_ns"] <= hi)]
        # the replay's own log: reads (expert accesses, one call each) and bytes of the pass
        assert len(inside) == int(w["reads"].iloc[0]) == N, phase
        assert int(inside["ret"].sum()) == int(w["bytes"].iloc[0]) == N * MIB, phase
        assert sorted(inside["expert_id"].tolist()) == list(range(N)), phase
        inside = inside.sort_values("expert_id")
        if phase == "measured":  # an expert with re-added pages missed again, adding just those
            want_cls = ["miss" if r else "hit_only" for r in re_added]
            want_pages = re_added
            assert (inside["class"].tolist() == want_cls), inside["class"].value_counts()
        else:
            assert (inside["class"] == want_cls).all(), inside["class"].value_counts()
            want_pages = [want_pages] * N
        assert inside["added_pages"].tolist() == want_pages, phase
        assert (inside["beyond_pages"] == 0).all() and (inside["other_added_pages"] == 0).all()
    assert len(pool_calls) == 2 * N  # no pool read outside the two passes
    # the kernel's per-fd aggregates (no stream needed) say the same per expert
    e = tables["reads"][tables["reads"]["kind"] == "expert"]
    assert e["calls"].tolist() == [2] * N and e["bytes"].tolist() == [2 * MIB] * N
    missed_again = [int(r > 0) for r in re_added]
    assert e["miss_calls"].tolist() == [1 + m for m in missed_again]
    assert e["hit_only_calls"].tolist() == [1 - m for m in missed_again]
    assert e["added_pages"].tolist() == [PAGES + r for r in re_added]
    assert int(e["added_pages"].sum()) - sum(re_added) == N * PAGES == 5888
    # ... and equal the pagecache probe's pages of the same recording, expert by expert
    assert e["added_pages"].tolist() == pc["added_pages"].tolist()
    chk = doc["summaries"]["reads"]["replay_check"]
    assert chk["calls_match"] is True and chk["bytes_match"] is True
    from moetrace.record.probe import schema_doc

    assert doc["tables"]["reads"] == schema_doc(SPEC, "reads")  # dtype, unit, doc (and the readers' check)
    assert doc["tables"]["reads"]["bytes"] == {"dtype": "Int64", "unit": "bytes", "doc": "sum of ret > 0", "check": "n"}
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
    doc, tables = read_run(run)
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
    doc, tables = read_run(tmp_path / "s")
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
    three experts attributes each call to its own expert. Fds opened, read from the page cache
    and closed at once are attributed too: the kernel reads the inode from the fd table."""
    from moetrace.inputs.pool import open_pool

    fp = open_pool(pools["files"])
    a, b, c, d = (str(fp.path_of(e)) for e in (1, 2, 4, 6))
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
        for _ in range(5):  # open, read, close at once: no look from user space can catch these fds
            f = os.open({d!r}, os.O_RDONLY)
            assert len(os.pread(f, 4096, 0)) == 4096
            os.close(f)
    """)
    r = _record(tmp_path / "s", [sys.executable, "-c", script], "--probes", "reads", "--pool", str(pools["files"]))
    assert r.returncode == 0, r.stderr
    doc, tables = read_run(tmp_path / "s")
    rd = tables["reads"]
    ex = rd[rd["kind"] == "expert"].set_index("expert_id")
    assert ex.loc[1, "calls"] == 2 and ex.loc[1, "bytes"] == 8192
    assert ex.loc[2, "calls"] == 1 and ex.loc[2, "bytes"] == 8192
    assert ex.loc[4, "calls"] == 3 and ex.loc[4, "bytes"] == 3 * 4096
    assert ex.loc[6, "calls"] == 5 and ex.loc[6, "fd_identities"] == 5  # the kernel read each fd's inode
    assert int(ex["calls"].sum()) == 11
    files_t = tables["reads_files"]
    rows = files_t[files_t["path"].isin([a, b, c])].set_index("path")
    assert len(rows) == 3 and rows["fd"].nunique() == 1
    assert rows.loc[b, "gen"] > rows.loc[a, "gen"] and rows.loc[c, "gen"] == rows.loc[b, "gen"]
    assert rows.loc[c, "epoch"] > rows.loc[b, "epoch"]
    st = doc["stats"]["reads"]
    assert st["epoch_bumps"] >= 1 and st["retire_failed"] == 0 and st["fdgen_full"] == 0
