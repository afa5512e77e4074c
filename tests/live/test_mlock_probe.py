"""The mlock probe (probes/mlock.bpf.c + moetrace.record.probes.mlock) (live tier)."""

from __future__ import annotations

from common.mlock_probe import *  # noqa: F401,F403
from common import read_run


def test_probe_locked_bytes_equal_vmlck_after_each_call(live):
    from moetrace.kernel.features import Features
    from moetrace.record.probe import RecordContext
    from moetrace.record.spec import resolve

    feats = Features(mount=True)
    rec = ml.MlockRecorder(RecordContext(features=feats, plan=resolve(SPEC, feats)))
    rec.open()
    try:
        child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        rec.follow(child.pid)
        child.stdin.write("g")
        child.stdin.close()
        child.stdin = None  # communicate() below must not flush it again
        deadline = time.monotonic() + 60
        while child.poll() is None and time.monotonic() < deadline:
            rec.poll(50)
        out, err = child.communicate(timeout=30)
        assert child.returncode == 0, err
    finally:
        rec.close()
    assert rec.collected
    logged = [json.loads(x) for x in out.splitlines()]
    assert len(logged) == 15
    calls = rec.calls
    assert rec.stats["ring_lost"] == 0 and rec.stats["pending_full"] == 0
    assert rec.stream.lost_kernel == 0 and rec.stream.lost_user == 0
    pos: dict[int, int] = {}
    for lg in logged:
        rows = calls[calls["tgid"] == lg["pid"]].reset_index(drop=True)
        start, ln = lg["key"]
        i = pos.get(lg["pid"], 0)
        while i < len(rows):
            r = rows.iloc[i]
            if r["call"] == lg["op"]:
                if lg["op"] in ("mlockall", "munlockall"):
                    break
                if lg["op"] == "mmap" and int(r["ret"]) == lg["ret"] and int(r["len_bytes"]) == ln:
                    break
                if lg["op"] != "mmap" and int(r["start"]) == start and int(r["len_bytes"]) == ln:
                    break
            i += 1
        assert i < len(rows), f"no probe row for {lg}"
        pos[lg["pid"]] = i + 1
        assert int(r["ret"]) == lg["ret"], (lg, r.to_dict())
        if lg["op"] == "mlockall":
            assert r["locked_bytes"] is pd.NA  # unknowable from arguments, and said so
            assert lg["vmlck"] > 0
        else:
            assert r["locked_bytes"] is not pd.NA and int(r["locked_bytes"]) == lg["vmlck"], (lg, r.to_dict())
    by_op = [(lg["op"], lg["vmlck"] // PAGE) for lg in logged if lg["op"] != "mlockall"]
    assert by_op[:11] == [("mlock", 2), ("mlock", 3), ("mlock2", 5), ("munlock", 4), ("munlock", 4),
                          ("mlock", 8), ("munmap", 6), ("mlock", 6), ("mmap", 14), ("mremap", 22),
                          ("munmap", 6)], by_op
    gchild = [lg for lg in logged if lg["pid"] != child.pid]
    assert len(gchild) == 1 and gchild[0]["vmlck"] == 3 * PAGE
    # both processes ended: an exit row each (sched_process_exit), their locks released
    s = rec.summary()
    for pid, last in ((child.pid, logged[-1]["vmlck"]), (gchild[0]["pid"], 3 * PAGE)):
        t = s["per_tgid"][str(pid)]
        assert t["exited"] is True and t["locked_bytes_at_exit"] == last and t["locked_bytes_end"] == 0, t
        assert calls[calls["tgid"] == pid]["call"].iloc[-1] == "exit"
    assert logged[-1]["vmlck"] == PAGE and s["per_tgid"][str(child.pid)]["failed_calls"] >= 1
    assert s["total_locked_bytes_end"] == 0
    real = calls[~calls["call"].isin(["exit", "exec"])]
    assert (real["latency_ns"] > 0).all()


def test_record_pinned_replay_locked_bytes_at_loop_entry_equal_vmlck(live, pinned_pool, tmp_path):
    from moetrace.run import directory as rundir

    d = pinned_pool
    arena = 5 * (1 << 20) + 12345  # whole experts are locked: 5 MiB
    cmd = [*REPLAY, str(d / "plan.bin"), "--pool", str(d / "pool"), "--mode", "pinned", "--arena-bytes",
           str(arena), "--warmup", "0", "--passes", "2", "--threads", "2"]
    r = subprocess.run([*RECORD, "--probes", "mlock", "--out", str(tmp_path / "run"), "--", *cmd],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc, tables = read_run(tmp_path / "run")
    assert doc["complete"] is True
    assert doc["attach_plan"]["mlock"]["recorded"] is True
    rs = json.loads((tmp_path / "run" / "replay" / "replay.json").read_text())
    assert rs["arena_bytes"] == 5 << 20 and rs["vmlck_bytes"] == 5 << 20
    chk = doc["summaries"]["mlock"]["replay_check"]
    assert chk["match"] is True, chk
    assert chk["probe_locked_bytes_at_loop_entry"] == rs["vmlck_bytes"] == 5 << 20
    calls = tables["mlock"]
    mine = calls[calls["tgid"] == rs["pid"]]
    locks = mine[mine["call"] == "mlock"]
    assert len(locks) == 1 and int(locks["len_bytes"].iloc[0]) == 5 << 20 and int(locks["ret"].iloc[0]) == 0
    assert int(locks["time_ns"].iloc[0]) < rs["loop_entry_ns"]
    assert (mine["call"] == "munlock").sum() == 1  # Replayer.close() unlocks the arena
    tl = tables["mlock_timeline"]
    assert ml.locked_bytes_at(tl, rs["pid"], rs["loop_entry_ns"]) == 5 << 20
    assert ml.locked_bytes_at(tl, rs["pid"], rs["measured_end_ns"]) == 5 << 20
    assert int(tl[tl["tgid"] == rs["pid"]]["locked_bytes"].iloc[-1]) == 0
    assert doc["lost"]["mlock"]["ring_lost_calls"] == 0 and doc["lost"]["mlock"]["user_lost_calls"] == 0
    assert doc["stats"]["mlock"]["unmatched_exits"] == 0 and doc["stats"]["mlock"]["pending_full"] == 0
    # munmap / mmap calls that touched no locked range are counted, not listed
    assert set(mine["call"]) <= {"mlock", "munlock", "exit"}, set(mine["call"])
    assert doc["summaries"]["mlock"]["calls"] > len(calls)
    assert set(doc["tables"]) >= {"mlock", "mlock_timeline"}
    assert doc["summaries"]["mlock"]["max_total_locked_bytes"] == 5 << 20
    for c in SPEC.schema:
        assert c.name in calls.columns
    assert list(calls.columns) == [c.name for c in SPEC.schema]
