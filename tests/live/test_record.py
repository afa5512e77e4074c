"""`moetrace record` with the pagecache probe (live tier)."""

from __future__ import annotations

from common.record import *  # noqa: F401,F403
from common import read_run


@pytest.mark.parametrize("layout", ["files", "pool"])
def test_acceptance_cold_pass_then_all_hits(live, pools, layout, tmp_path):
    pool, plan = pools[layout], pools["plan"]
    replay = [*REPLAY, str(plan), "--pool", str(pool), "--warmup", "0", "--passes", "1", "--threads", "4"]
    from pagewatch import PageWatcher, armed_interval, check_recorded

    with _io_lock():
        w = PageWatcher(pool)  # who else touches the pool's pages, from the drop to the last mincore
        try:
            _drop(pool)
            t_drop = time.monotonic_ns()
            cold = _record(tmp_path / "cold", replay, "--pool", str(pool))
            # the pool taken from the replay's --pool; a declared, not recorded probe is a note under warn
            hot = _record(tmp_path / "hot", replay, "--probes", "pagecache,block,reclaim,mglru",
                          "--missing-probes", "warn")
            t_m0 = time.monotonic_ns()
            resident = sum(_resident_pages(p) for p in sorted(pool.rglob("*.bin")))
            t_m1 = time.monotonic_ns()
        finally:
            w.stop()
    assert cold.returncode == 0, cold.stderr
    assert hot.returncode == 0, hot.stderr
    assert w.lost == 0
    doc, e, _u = _experts(tmp_path / "cold")
    doc2, e2, _ = _experts(tmp_path / "hot")
    # the recordings against the watcher: the same pages added and evicted over their intervals
    check_recorded(w, doc, e["added_pages"], e["evicted_pages"])
    check_recorded(w, doc2, e2["added_pages"], e2["evicted_pages"])
    outside = w.deleted_by(t_drop)  # every pool page deleted by anyone after the drop, by evictor
    print(f"\n[{layout}] pool pages deleted after the drop, by evictor: {outside or 'none'}")
    ev_cols = [f"evicted_by_{k}_pages" for k in w.evictors]
    for df in (e, e2):  # every eviction has exactly one evictor class
        assert (df[ev_cols].sum(axis=1) == df["evicted_pages"]).all()
    assert doc["complete"] is True and doc["exit_status"] == 0
    assert list(e["layer"]) == [0] * N and list(e["expert"]) == list(range(N))
    assert list(e["expert_id"]) == list(range(N))
    # every page added once, plus re-adds of pages evicted (by someone else) before their read ended
    assert list(e["added_pages"] - e["re_added_pages"]) == [PAGES] * N, e.to_string()
    assert list(e["requested_pages"]) == [PAGES] * N
    assert list(e["requested_bytes"]) == [MIB] * N
    assert list(e["hit_pages"]) == list(-e["re_added_pages"])
    # the hot pass re-reads what was not resident when it began (and pages evicted during it)
    (h0, _h1), _outer = armed_interval(doc2)
    missing = PAGES - w.resident(at_ns=h0, since_ns=t_drop)
    assert (missing <= e2["added_pages"].to_numpy()).all() and \
        (e2["added_pages"].to_numpy() <= missing + w.pages(1, *_outer)).all(), (missing.tolist(), e2["added_pages"].tolist())
    # mincore = the watcher's residency (a deletion while mincore ran may fall either side)
    assert int(w.resident(t_m1, t_drop).sum()) <= resident <= int(w.resident(t_m0, t_drop).sum())
    if not outside:  # nobody else evicted a pool page: the strict figures
        assert list(e["added_pages"]) == [PAGES] * N and list(e["re_added_pages"]) == [0] * N
        assert list(e2["added_pages"]) == [0] * N and resident == N * PAGES
    # block: each expert's 1 MiB came from the disk once, attributed through its FIEMAP extents
    # (and every re-added page once more)
    assert list(e["device_read_bytes"]) == list(MIB + e["re_added_pages"] * 4096) or outside, \
        e["device_read_bytes"].tolist()
    assert (e["bios"] >= 1).all()
    assert doc["lost"]["block"]["ring_lost_bios"] == 0 and doc["attach_plan"]["block"]["recorded"] is True
    assert doc["attach_plan"]["block"]["knobs"] == {"MOE_BYTES_TP": 2}  # block_bio_queue first
    assert doc["summaries"]["block"]["attach"]["bytes"] == "block:block_bio_queue"
    assert doc["block_device"]["tp_dev"] == doc["summaries"]["block"]["dev"] != 0
    _doc, tables = read_run(tmp_path / "cold")
    assert {"block_latency", "block_device", "reclaim", "reclaim_histogram"} <= set(tables)
    assert list(tables["reclaim"]["kind"]) == ["memcg", "direct", "kswapd", "damon", "proactive", "other"]
    assert int(tables["block_latency"]["requests"].sum()) == int(tables["block_device"]["complete_matched"].iloc[0])
    assert doc["attach_plan"]["reclaim"]["recorded"] is True and doc["lost"]["reclaim"]["lost_events"] == 0
    snaps = json.loads((tmp_path / "cold" / "snapshots.json").read_text())
    assert snaps["pool_disk"]["disk"] == doc["block_device"]["disk"] and "post" in snaps["pool_disk"]
    assert set(doc["timings"]) >= {"pagecache_load_attach_s", "block_load_attach_s",
                                   "reclaim_load_attach_s", "probes_attach_s"}
    assert doc["lost"]["pagecache"]["counters_lost_events"] == 0
    assert doc["lost"]["pagecache"]["unprocessed_pages"] == 0
    assert doc["stats"]["pagecache"]["dev_mismatch_events"] == 0
    assert doc["timings"]["pagecache_load_attach_s"] > 0
    assert doc["pool"]["layout"] == layout and doc["plan"]["reads"] == N
    assert doc["kernel"]["release"] == Path("/proc/sys/kernel/osrelease").read_text().strip()
    # the attach plan is probespec.resolve's (what doctor shows), as AttachPlan.to_dict()
    plan = doc["attach_plan"]["pagecache"]
    assert plan["recorded"] is True and plan["status"] == "yes" and plan["knobs"]["MOE_HAVE_ORDER"] == 1
    assert {e["group"]: e["status"] for e in plan["entries"]}["add"] == "attached"
    from moetrace.record.doctor import doctor as doctor_report

    # record unmounted the debugfs it mounted: let doctor mount tracefs (the session fixture unmounts it)
    assert doctor_report(mount=True)["plans"]["pagecache"]["entries"] == plan["entries"]
    # the replay's own log landed beside the probe tables
    assert (tmp_path / "cold" / "replay" / "iterations.parquet").exists()
    # owner-only, all the way down
    for p in [tmp_path / "cold", *(tmp_path / "cold").rglob("*")]:
        assert rundir.is_private(p), p
    assert doc2["pool"]["source"] == "the command's --pool"
    assert list(e2["hit_pages"]) == list(PAGES - e2["added_pages"])
    # what was added came from the disk, nothing else did
    assert int(e2["device_read_bytes"].sum()) == int(e2["added_pages"].sum()) * 4096 or outside
    mg = doc2["attach_plan"]["mglru"]  # an enrichment probe this kernel may lack: a note under warn
    if mg["status"] == "no":
        assert mg["recorded"] is False and mg["skip_reason"] == mg["reason"] != ""
        assert any(n.startswith("probe mglru skipped") for n in doc2["notes"])
    else:
        assert mg["recorded"] is True


def test_attribution_and_exact_re_adds(live, pools, tmp_path):
    """Read all, evict all, re-read experts 3, 7 and 22: only those are re-added (exactly)."""
    pool = pools["pool"]
    pf = pool / "pool.bin"
    drop = (f"import os; fd=os.open('{pf}', os.O_RDONLY); os.fsync(fd); "
            f"os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)")
    reread = "; ".join(f"dd if={pf} of=/dev/null bs=1M skip={e} count=1 status=none" for e in (3, 7, 22))
    script = f"cat {pf} > /dev/null && {sys.executable} -c \"{drop}\" && {reread}"
    with _io_lock():
        _drop(pool)
        r = _record(tmp_path / "r", ["sh", "-c", script], "--pool", str(pool))
    assert r.returncode == 0, r.stderr
    doc, e, _u = _experts(tmp_path / "r")
    want_re = [PAGES if i in (3, 7, 22) else 0 for i in range(N)]
    assert list(e["evicted_pages"]) == [PAGES] * N
    assert list(e["re_added_pages"]) == want_re
    assert list(e["added_pages"]) == [PAGES + w for w in want_re]
    assert e["requested_pages"].isna().all() and e["hit_pages"].isna().all()  # no replay log: NA, not 0
    assert doc["requested"]["available"] is False


def test_exit_status_is_propagated(live, tmp_path):
    from moetrace.kernel.bpf import prog_id_exists, wait_pid_exit

    r = _record(tmp_path / "f", ["false"])
    assert r.returncode == 1, r.stderr
    # the releaser finishes the kernel's part of detaching after record returned (its output
    # pipes were closed at once: this run returned), and leaves nothing loaded
    doc = read_run(tmp_path / "f")[0]
    assert doc["detach"]["waited"] is False and "detach_release_wait_s" not in doc["timings"]
    assert wait_pid_exit(doc["detach"]["releaser_pid"], timeout=60), "the releaser did not exit within 60 s"
    assert doc["bpf_prog_ids"] and not any(prog_id_exists(i) for i in doc["bpf_prog_ids"])
    # --wait-detach: nothing is loaded any more when record returns
    r = _record(tmp_path / "s", ["sh", "-c", "exit 7"], "--wait-detach")
    assert r.returncode == 7, r.stderr
    doc = read_run(tmp_path / "s")[0]
    assert doc["detach"]["waited"] is True and doc["timings"]["detach_release_wait_s"] > 0
    assert not any(prog_id_exists(i) for i in doc["bpf_prog_ids"])
    doc, tables = read_run(tmp_path / "s")
    assert doc["complete"] is True and doc["exit_status"] == 7
    assert tables["experts"]["kind"].tolist() == ["unattributed"]
    # no pool: every disk's reads are counted, none attributed
    assert doc["summaries"]["block"]["index_used"] is False and doc["summaries"]["block"]["dev"] == 0


def test_an_old_knob_name_is_accepted_with_one_deprecation_line(live, tmp_path):
    """`--knob lru.MAX_INODES=V` (the name before the MOE_ prefix) still works: one line on
    stderr names the new name, and the manifest has the knob under it."""
    r = _record(tmp_path / "k", ["true"], "--probes", "lru", "--knob", "lru.MAX_INODES=4096")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "deprecated" in x]
    assert len(lines) == 1 and "lru.MOE_MAX_INODES" in lines[0], r.stderr
    doc = read_run(tmp_path / "k")[0]
    assert doc["knobs"]["lru"]["MOE_MAX_INODES"] == 4096 and "MAX_INODES" not in doc["knobs"]["lru"]
    r = _record(tmp_path / "n", ["true"], "--probes", "lru", "--knob", "lru.MOE_MAX_INODES=4096")
    assert r.returncode == 0 and "deprecated" not in r.stderr, r.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_killed_record_detaches_and_stays_loadable(live, pools, tmp_path, sig):
    from moetrace.kernel.bpf import prog_id_exists, wait_pid_exit

    run = tmp_path / "k"
    replay = [*REPLAY, str(pools["plan"]), "--pool", str(pools["files"]), "--warmup", "0", "--passes", "1000000"]
    p = subprocess.Popen([*RECORD, "--out", str(run), "--", *replay], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        ids = None
        while time.monotonic() < deadline:  # wait for the probes and the child to be up
            try:
                doc = json.loads((run / rundir.MANIFEST).read_text())
                if doc.get("bpf_prog_ids") and (run / "replay").exists():
                    ids = doc["bpf_prog_ids"]
                    break
            except (OSError, json.JSONDecodeError):
                pass
            time.sleep(0.1)
        assert ids, "record did not attach within 60 s"
        time.sleep(2.0)  # let the replay reach its loop
        p.send_signal(sig)
        _out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 128 + sig, err
    doc, tables = read_run(run)
    # record returned once the probes were disarmed and dropped; its releaser finishes the
    # kernel's part on its own, within seconds (~44 ms per tracepoint)
    assert doc["detach"]["waited"] is False and doc["detach"]["releaser_pid"] > 1
    assert wait_pid_exit(doc["detach"]["releaser_pid"], timeout=60), "the releaser did not exit within 60 s"
    assert not any(prog_id_exists(i) for i in ids), "a probe is still loaded"
    assert doc["complete"] is False
    assert doc["interrupted_by"] == signal.Signals(sig).name
    assert doc["detached"] is True
    # the default set was attached: every BPF probe's programs were among the ids checked above
    recorded = {p for p, a in doc["attach_plan"].items() if a["recorded"]}
    assert {"pagecache", "block", "reclaim", "lru", "reads", "mlock", "stacks"} <= recorded, recorded
    assert len(ids) >= 20, ids
    assert len(tables["experts"]) == N + 1
    assert rundir.is_private(run)
    # and a new recording works right after
    r = _record(tmp_path / "after", ["true"])
    assert r.returncode == 0, r.stderr


def test_refuses_without_privileges(live, tmp_path):
    """As an unprivileged user, record stops before loading anything and names the need."""
    if subprocess.run(["which", "setpriv"], capture_output=True).returncode:
        pytest.skip("setpriv not installed")
    tmp_path.chmod(0o777)
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                        *RECORD, "--out", str(tmp_path / "np"), "--", "true"],
                       capture_output=True, text=True, env={**os.environ, "HOME": str(tmp_path)})
    assert r.returncode != 0
    assert "CAP_BPF" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "np").exists()


def test_page_event_stream_matches_counters(live, pools, tmp_path):
    """--stream-events: per-(event, expert) ring records sum to the in-kernel counters;
    lost records are counted per interval (zero here)."""
    pool = pools["pool"]
    replay = [*REPLAY, str(pools["plan"]), "--pool", str(pool), "--warmup", "0", "--passes", "1"]
    with _io_lock():
        _drop(pool)
        r = _record(tmp_path / "s", replay, "--stream-events")
    assert r.returncode == 0, r.stderr
    doc, tables = read_run(tmp_path / "s")
    ev, iv = tables["page_events"], tables["stream_intervals"]
    lost = doc["lost"]["pagecache"]["stream"]
    assert lost["lost_kernel"] == int(iv["lost_kernel_records"].sum())
    assert lost["lost_user"] == int(iv["lost_user_records"].sum())
    assert lost["records"] == len(ev) == int(iv["records"].sum()) - lost["lost_user"]
    if lost["lost_kernel"] == 0:
        e = tables["experts"]
        adds = ev[(ev["kind"] == "add") & (ev["expert_id"] < N)].groupby("expert_id")["pages"].sum()
        assert adds.reindex(range(N), fill_value=0).tolist() == e[e["kind"] == "expert"]["added_pages"].tolist()
        assert adds.tolist() == [PAGES] * N


def test_record_unmounts_the_tracefs_it_mounted(live, tmp_path):
    """tracefs absent -> record mounts it, says so, and unmounts it at the end."""
    before = _trace_mounts()
    # deepest first: tracefs automounted under debugfs, then debugfs, then tracefs
    for _fs, target in sorted(before, key=lambda m: -len(m[1])):
        if subprocess.run(["umount", target], capture_output=True).returncode != 0:
            pytest.skip(f"{target} is busy here: cannot test the mount-on-demand path")
    try:
        assert _trace_mounts() == []
        r = _record(tmp_path / "run", ["true"])
        assert r.returncode == 0, r.stderr
        man = json.loads((tmp_path / "run" / "manifest.json").read_text())
        assert any(n.startswith("mounted ") for n in man["notes"]), man["notes"]
        assert _trace_mounts() == [], "record left the tracefs it mounted"
    finally:
        for fs, target in sorted(before, key=lambda m: len(m[1])):
            if (fs, target) not in _trace_mounts() and not target.endswith("/debug/tracing"):
                subprocess.run(["mount", "-t", fs, "nodev", target], check=True)


@pytest.mark.parametrize("layout", ["files", "pool"])
def test_record_around_any_command_attributes_only_the_pool(live, pools, layout, tmp_path):
    """`moetrace record --pool P -- dd ...`: what dd reads of one expert is attributed to it, a file
    outside the pool is not, and requested pages are NA (no replay log) with the reason."""
    from moetrace.inputs.pool import open_pool

    pool = open_pool(pools[layout])
    target = 7
    if layout == "files":
        src, skip = pool.data_paths()[target], 0
    else:
        src, skip = pool.data_paths()[0], target * (pool.extent_bytes // MIB)
    other = tmp_path / "outside.bin"
    other.write_bytes(os.urandom(2 * MIB))
    cmd = ["sh", "-c", f"dd if={src} of=/dev/null bs=1M count=1 skip={skip} status=none && "
                       f"dd if={other} of=/dev/null bs=1M status=none"]
    with _io_lock():
        _drop(pools[layout])
        fd = os.open(other, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        r = _record(tmp_path / "run", cmd, "--pool", str(pools[layout]), "--probes", "pagecache,block")
    assert r.returncode == 0, r.stderr
    doc, e, u = _experts(tmp_path / "run")
    added = e["added_pages"].astype(int).tolist()
    assert added[target] >= PAGES and sum(added) - added[target] <= 2 * PAGES // 4, added  # readahead may spill
    if layout == "files":  # its own file: readahead cannot spill to another expert
        assert added[target] == PAGES and sum(added) == PAGES, added
    print(layout, "added", added[target], "others", sum(added) - added[target], "unattributed",
          int(u["added_pages"]), "device", int(e.loc[target, "device_read_bytes"]))
    assert int(e.loc[target, "device_read_bytes"]) >= MIB
    assert e["requested_pages"].isna().all() and doc["requested"]["available"] is False
    assert "no replay log" in doc["requested"]["source"]
    # the file outside the pool: on the same filesystem its pages are "unattributed", never an expert's
    same_fs = os.stat(other).st_dev == os.stat(pools[layout]).st_dev
    if same_fs:
        assert int(u["added_pages"]) >= 2 * PAGES
    assert doc["complete"] is True and doc["exit_status"] == 0
    assert doc["epochs"]["epochs"] == 0  # dd writes no epochs: totals only
