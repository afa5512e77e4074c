"""The replay harness: exact counts, the iteration log, sync-fd, signals, modes (unit tier)."""

from __future__ import annotations

from common.replay import *  # noqa: F401,F403


@pytest.mark.parametrize("mode", ["pagecache", "mmap", "direct"])
@pytest.mark.parametrize("layout", ["files", "one", "layers"])
def test_counts_and_iteration_log(small, tmp_path, mode, layout):
    pool = small[layout]
    if mode == "direct" and not o_direct_ok(pool.path_of(0)):
        pytest.skip("tmp_path's filesystem has no O_DIRECT")
    run = tmp_path / "run"
    opts = rp.ReplayOptions(mode=mode, threads=3, warmup=1, passes=2, run_dir=str(run))
    res = rp.run_replay(small["plan"], pool.root, opts)
    acc, eb = small["acc"], small["eb"]
    n = len(acc)
    s = json.loads((run / rp.SUMMARY_FILE).read_text())
    assert s == json.loads(json.dumps(res.summary))
    assert s["complete"] is True and s["exit_status"] == 0 and s["mode"] == mode
    assert s["phases"]["measured"]["reads"] == 2 * n and s["phases"]["warmup"]["reads"] == n
    assert s["phases"]["measured"]["bytes"] == 2 * n * eb
    assert s["plan"]["distinct_experts"] == np.unique(acc.expert_id).size
    df = pd.read_parquet(run / rp.ITERATIONS_FILE)
    assert [c for c, _ in rp.ITERATION_COLUMNS] == list(df.columns)
    assert len(df) == 3 * acc.n_iterations
    assert (df["phase"] == "warmup").sum() == acc.n_iterations
    assert sorted(df.loc[df.phase == "measured", "repeat"].unique()) == [0, 1]
    want = per_iteration_reads(acc)
    for _, g in df.groupby(["phase", "repeat"]):
        assert g["iteration"].tolist() == list(range(acc.n_iterations))
        assert g["reads"].tolist() == want.tolist()
        assert g["bytes"].tolist() == (want * eb).tolist()
    assert g["plan_passes"].tolist() == [2 if i % 5 == 4 else 1 for i in range(acc.n_iterations)]
    assert (df["duration_ns"] == df["end_ns"] - df["start_ns"]).all() and (df["duration_ns"] > 0).all()
    assert (np.diff(df["start_ns"].to_numpy()) > 0).all()
    assert (df["start_ns"].to_numpy()[1:] >= df["end_ns"].to_numpy()[:-1]).all()
    m = s["measured"]
    d = df.loc[df.phase == "measured", "duration_ns"]
    assert m["median_ns"] == float(d.median()) and m["min_ns"] == d.min() and m["max_ns"] == d.max()
    assert [len(x) for x in m["per_iteration_ns"]] == [acc.n_iterations] * 2
    assert s["measured_start_ns"] <= df.loc[df.phase == "measured", "start_ns"].min()
    assert s["loop_entry_ns"] <= s["measured_start_ns"]
    assert (df["arena_hits"] == 0).all() and (df["hints_submitted"] == 0).all()


@pytest.mark.parametrize("layout", ["files", "one", "layers"])
@pytest.mark.parametrize("mode", ["pagecache", "mmap", "direct", "pinned", "chunked"])
def test_reader_copies_the_right_bytes(small, mode, layout):
    """Every expert read by each read path equals the expert's bytes on disk."""
    pool = small[layout]
    eb = small["eb"]
    if mode == "direct" and not o_direct_ok(pool.path_of(0)):
        pytest.skip("no O_DIRECT here")
    if mode == "pinned" and not mlock_ok(8 * eb):
        pytest.skip("RLIMIT_MEMLOCK too small for the test arena")
    kw = {"mode": mode}
    if mode == "pinned":
        kw["arena_bytes"] = 8 * eb + 100  # 8 whole experts; the rest are misses
    if mode == "chunked":
        kw = {"mode": "pagecache", "read_size": 24 * KIB}
    plan = rp.load_flat_plan(small["plan"])
    rep = rp.Replayer(plan, pool, rp.ReplayOptions(threads=2, **kw))
    with rep:
        rep.prepare()
        fn = rep._reader()
        w = rep.pool_threads.workers[0]
        for eid in range(pool.n_total):
            fn(w, eid)
            with open(pool.path_of(eid), "rb") as fh:
                fh.seek(pool.offset_of(eid))
                want = fh.read(eb)
            assert bytes(w.mv[:eb]) == want, f"expert {eid}"
            w.mv[:eb] = b"\0" * eb
        if mode == "pinned":
            assert w.hits == 8 and rep.arena_len == 8 * eb


def test_pinned_arena_hits_match_the_frequency_table(small, tmp_path):
    eb = small["eb"]
    if not mlock_ok(5 * eb):
        pytest.skip("RLIMIT_MEMLOCK too small for the test arena")
    acc = small["acc"]
    counts = np.bincount(acc.expert_id, minlength=32)
    top = np.lexsort((np.arange(32), -counts))[:5]
    run = tmp_path / "run"
    res = rp.run_replay(small["plan"], small["files"].root,
                        rp.ReplayOptions(mode="pinned", arena_bytes=5 * eb + eb // 2, threads=4, passes=2,
                                         run_dir=str(run)))
    s = res.summary
    assert s["arena_experts"] == 5 and s["arena_bytes"] == 5 * eb and s["vmlck_bytes"] >= 5 * eb
    assert s["preload_ns"] > 0 and s["arena"]["preload_bytes"] == 5 * eb
    hits = int(np.isin(acc.expert_id, top).sum())
    assert s["phases"]["measured"]["arena_hits"] == 2 * hits
    assert s["phases"]["warmup"]["arena_hits"] == hits
    df = pd.read_parquet(run / rp.ITERATIONS_FILE)
    per_it = np.bincount(acc.iteration[np.isin(acc.expert_id, top)], minlength=acc.n_iterations)
    assert df.loc[df.phase == "warmup", "arena_hits"].tolist() == per_it.tolist()
    # preload is excluded: the first measured iteration starts after loop entry, after the preload
    assert s["loop_entry_ns"] <= df.loc[df.phase == "measured", "start_ns"].min()


def test_freq_table_from_another_plan(small, tmp_path):
    eb = small["eb"]
    if not mlock_ok(3 * eb):
        pytest.skip("RLIMIT_MEMLOCK too small for the test arena")
    other = make_accesses(4, 8, 2, 30, seed=9, skew=0.0)
    other_plan = make_plan(tmp_path / "other.bin", other, eb, hints=False)
    counts = np.bincount(other.expert_id, minlength=32)
    top = np.sort(np.lexsort((np.arange(32), -counts))[:3])
    plan = rp.load_flat_plan(small["plan"])
    with rp.Replayer(plan, small["files"], rp.ReplayOptions(mode="hybrid", arena_bytes=3 * eb,
                                                            freq_table=str(other_plan))) as rep:
        rep.prepare()
        assert rep.arena_ids.tolist() == top.tolist()
    bad = make_plan(tmp_path / "bad.bin", make_accesses(3, 8, 2, 4), eb, hints=False)
    with pytest.raises(UsageError, match="3x8"):
        rp.frequency_table(str(bad), plan, 4, 8)


def test_mlock_failure_names_the_limit(monkeypatch):
    class FakeLibc:
        def mlock(self, addr, n):
            ctypes.set_errno(errno.ENOMEM)
            return -1

    monkeypatch.setattr(rp, "libc", FakeLibc())
    with pytest.raises(MoetraceError, match="RLIMIT_MEMLOCK") as ei:
        rp._mlock(4096, 1 << 20)
    assert "cgroup" in ei.value.format_message()

    class FakeLibc2(FakeLibc):
        def mlock(self, addr, n):
            ctypes.set_errno(errno.EPERM)
            return -1

    monkeypatch.setattr(rp, "libc", FakeLibc2())
    with pytest.raises(MoetraceError, match="CAP_IPC_LOCK"):
        rp._mlock(4096, 1 << 20)


def test_flat_plan_oracle_hints_target_the_next_slot(small):
    """An oracle plan's hint set issued by slot s is exactly slot s+1's reads, across
    empty layers, fallback passes and iteration boundaries."""
    fp = rp.load_flat_plan(small["plan"])
    acc = small["acc"]
    assert fp.ids.tolist() == acc.expert_id.astype(np.int64).tolist()
    ns = fp.slot_bounds.size - 1
    for s in range(ns - 1):
        h = fp.hint_ids[fp.hint_bounds[s]:fp.hint_bounds[s + 1]]
        nxt = fp.ids[fp.slot_bounds[s + 1]:fp.slot_bounds[s + 2]]
        assert h.tolist() == nxt.tolist(), s
    assert fp.hint_bounds[ns] == fp.hint_bounds[ns - 1]  # the last slot has no target
    assert fp.n_hint_sets == ns - 1
    # slots per iteration: 4 layers, minus the empty one in odd iterations, x passes
    per = np.diff(fp.iter_bounds)
    want = [(4 - (i % 2)) + (4 if i % 5 == 4 else 0) for i in range(acc.n_iterations)]
    assert per.tolist() == want


@pytest.mark.parametrize("kind", ["fadvise", "pread"])
def test_prefetch_counters(small, tmp_path, kind):
    run = tmp_path / "run"
    res = rp.run_replay(small["plan"], small["files"].root,
                        rp.ReplayOptions(prefetch=kind, threads=2, warmup=1, passes=2, run_dir=str(run),
                                         fadvise_random=True))
    h = res.summary["hints"]
    fp = rp.load_flat_plan(small["plan"])
    assert h["submitted"] == 3 * fp.n_hint_sets
    assert h["submitted"] == h["completed"] + h["overwritten"] and h["pending"] == 0
    assert h["error"] is None and h["experts_issued"] > 0
    df = pd.read_parquet(run / rp.ITERATIONS_FILE)
    assert df["hints_submitted"].sum() == h["submitted"]
    assert df["hints_overwritten"].sum() == h["overwritten"]
    assert df["hints_completed"].sum() <= h["completed"]


def test_advisor_overwrites_a_waiting_set():
    """One slot: a set put while another waits replaces it (counted overwritten)."""
    import threading

    gate = threading.Event()
    seen = []

    def locate(eid):
        seen.append(eid)
        if eid == 1:
            gate.wait(10)
        return fd, 0

    fd = os.open(__file__, os.O_RDONLY)
    try:
        adv = rp.PrefetchAdvisor("fadvise", locate, 100, 4096)
        adv.put([1])  # the worker takes it and blocks in locate(1)
        for _ in range(200):
            if seen:
                break
            time.sleep(0.01)
        adv.put([2])
        adv.put([3])  # replaces [2] in the slot
        assert adv.overwritten == 1 and adv.pending == 2
        gate.set()
        adv.close()
    finally:
        os.close(fd)
    assert seen == [1, 3]
    assert (adv.submitted, adv.overwritten, adv.completed, adv.pending) == (3, 1, 2, 0)


def test_bad_inputs_are_clean_errors(small, tmp_path):
    r = CliRunner()
    plan, pool = str(small["plan"]), str(small["files"].root)
    other = create_pool(tmp_path / "p6", Geometry(4, 6, 2, small["eb"], "t"), seed=0)
    cases = [
        ([plan, "--pool", str(other.root)], "4 layers x 8 experts but the pool"),
        ([plan, "--pool", str(tmp_path / "nope")], "cannot read the pool manifest"),
        ([plan, "--pool", pool, "--mode", "pinned"], "needs --arena-bytes"),
        ([plan, "--pool", pool, "--arena-bytes", "1MiB"], "pinned or hybrid only"),
        ([str(small["plain"]), "--pool", pool, "--prefetch", "fadvise"], "needs a plan with hints"),
        ([plan, "--pool", pool, "--mode", "direct", "--prefetch", "pread"], "bypasses"),
        ([str(tmp_path / "missing.bin"), "--pool", pool], "no such plan"),
    ]
    bad = tmp_path / "corrupt.bin"
    raw = bytearray(small["plan"].read_bytes())
    raw[-10] ^= 0xFF
    bad.write_bytes(bytes(raw))
    cases.append(([str(bad), "--pool", pool], "checksum mismatch"))
    big = create_pool(tmp_path / "p128", Geometry(4, 8, 2, 128 * KIB, "t"), seed=0)
    cases.append(([plan, "--pool", str(big.root)], "expert_bytes 65536 differ"))
    for args, msg in cases:
        res = r.invoke(replay_cmd, args)
        assert res.exit_code in (1, 2), (args, res.output)
        assert msg in res.output, (args, res.output)
        assert "Traceback" not in res.output
    # a pool file shortened under the manifest
    trunc = create_pool(tmp_path / "pt", Geometry(4, 8, 2, small["eb"], "t"), seed=0)
    with open(trunc.path_of(5), "r+b") as fh:
        fh.truncate(1000)
    res = r.invoke(replay_cmd, [plan, "--pool", str(trunc.root)])
    assert res.exit_code == 1 and "too short" in res.output and "pool verify" in res.output


def test_help_and_json(small):
    r = CliRunner().invoke(replay_cmd, ["--help"])
    assert r.exit_code == 0 and "Examples:" in r.output and "--sync-fd" in r.output
    r = CliRunner().invoke(replay_cmd, [str(small["plan"]), "--pool", str(small["files"].root), "--json",
                                        "--threads", "2", "--warmup", "0"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert s["phases"]["warmup"]["iterations"] == 0 and s["phases"]["measured"]["reads"] == len(small["acc"])


def test_sync_fd_protocol(small, tmp_path):
    parent, child = socket.socketpair()
    run = tmp_path / "run"
    with contextlib.closing(parent):
        p = _spawn([small["plan"], "--pool", small["files"].root, "--threads", "2", "--sync-fd", child.fileno(),
                    "--run-dir", run], pass_fds=[child.fileno()])
        child.close()
        try:
            line = _readline(parent)
            m = re.fullmatch(r"loop_entry vmlck_bytes=(\d+) arena_bytes=(\d+)\n", line)
            assert m and int(m.group(2)) == 0
            time.sleep(0.2)
            assert p.poll() is None and not (run / rp.SUMMARY_FILE).exists()  # blocked before the measured pass
            t_go = time.monotonic_ns()
            parent.sendall(b"go\n")
            assert _readline(parent) == "done\n"
            t_done = time.monotonic_ns()
            out, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == 0, err
    s = json.loads((run / rp.SUMMARY_FILE).read_text())
    assert s["complete"] and t_go <= s["measured_start_ns"] and s["measured_end_ns"] <= t_done


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_replay_writes_incomplete(small, tmp_path, sig, code):
    parent, child = socket.socketpair()
    run = tmp_path / "run"
    with contextlib.closing(parent):
        p = _spawn([small["plan"], "--pool", small["files"].root, "--threads", "2", "--passes", 100000,
                    "--sync-fd", child.fileno(), "--run-dir", run], pass_fds=[child.fileno()])
        child.close()
        try:
            _readline(parent)
            parent.sendall(b"go\n")
            time.sleep(0.5)
            p.send_signal(sig)
            out, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == code, err
    assert b"Traceback" not in err and b"interrupted" in err
    s = json.loads((run / rp.SUMMARY_FILE).read_text())
    assert s["complete"] is False and s["exit_status"] == code and s["interrupted_by"] == sig.name
    df = pd.read_parquet(run / rp.ITERATIONS_FILE)
    assert (df.phase == "measured").sum() > 0 and s["phases"]["measured"]["iterations"] == (df.phase == "measured").sum()


def test_dies_with_its_parent(small, tmp_path):
    """MOETRACE_PDEATHSIG=1: SIGKILL of the parent kills the replay."""
    code = (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'moetrace.cli.replay', {str(small['plan'])!r}, '--pool', "
        f"{str(small['files'].root)!r}, '--threads', '1', '--passes', '1000000'], env=dict(os.environ, "
        "MOETRACE_PDEATHSIG='1'))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    mid = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    pid = None
    try:
        pid = int(mid.stdout.readline())
        time.sleep(1.5)  # the replay is running (imports done, prctl set)
        assert _alive(pid)
        mid.kill()
        mid.wait()
        for _ in range(100):
            if not _alive(pid):
                break
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        if mid.poll() is None:
            mid.kill()
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_too_many_files_falls_back_to_open_per_access(small, tmp_path):
    """With RLIMIT_NOFILE below the pool's file count, each read opens and closes its file."""
    import resource

    def lower():
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    run = tmp_path / "run"
    env = dict(os.environ)
    env.pop("MOETRACE_RUN_DIR", None)
    p = subprocess.run([sys.executable, "-m", "moetrace.cli.replay", str(small["plan"]), "--pool",
                        str(small["files"].root), "--threads", "2", "--run-dir", str(run)],
                       preexec_fn=lower, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    s = json.loads((run / rp.SUMMARY_FILE).read_text())
    assert s["fd_mode"] == "per-access"
    assert s["phases"]["measured"]["bytes"] == len(small["acc"]) * small["eb"]


def test_a_duration_window_repeats_passes_until_the_time_is_up(small, tmp_path, monkeypatch):
    """--duration (issue 34): at least --passes whole measured passes, then more until the time
    is up; the last stops after the iteration that ends past the deadline."""
    acc = small["acc"]
    clock = {"t": 0}

    def fake_ns():  # every call advances 1 ms: a deterministic clock
        clock["t"] += 1_000_000
        return clock["t"]

    monkeypatch.setattr(rp.time, "monotonic_ns", fake_ns)
    run = tmp_path / "run"
    opts = rp.ReplayOptions(threads=1, warmup=0, passes=1, duration_s=0.001, run_dir=str(run))
    s = rp.run_replay(small["plan"], small["files"].root, opts).summary
    assert s["duration_s"] == 0.001 and s["phases"]["measured"]["repeats"] == 1  # a whole pass at least
    assert s["phases"]["measured"]["iterations"] == acc.n_iterations
    clock["t"] = 0
    opts = rp.ReplayOptions(threads=1, warmup=1, passes=1, duration_s=3 * acc.n_iterations * 0.004,
                            run_dir=str(run))
    s = rp.run_replay(small["plan"], small["files"].root, opts).summary
    df = pd.read_parquet(run / rp.ITERATIONS_FILE)
    m = df[df.phase == "measured"]
    assert m["repeat"].max() >= 2 and (m.groupby("repeat").size().iloc[:-1] == acc.n_iterations).all()
    last = m[m.repeat == m.repeat.max()]
    assert len(last) <= acc.n_iterations and s["complete"] is True
    d = opts.duration_s * 1e9  # the deadline counts from the window's start (just before its first iteration)
    assert m["end_ns"].iloc[-2] < m["start_ns"].iloc[0] + d and m["end_ns"].iloc[-1] >= s["loop_entry_ns"] + d
    with pytest.raises(rp.UsageError, match="--duration must be > 0"):
        rp.ReplayOptions(duration_s=0).check()
