"""The reclaim probe (probes/reclaim.bpf.c + toolkit/record/probes/reclaim.py) (live tier)."""

from __future__ import annotations

from common.reclaim_probe import *  # noqa: F401,F403


@pytest.mark.live
def test_memcg_reclaim_matches_vmstat(live, io_lock, file_set):
    """64 MiB scope, 256 MiB read 3 times: memcg limit reclaim scans and steals; the probe's
    totals equal /proc/vmstat's pgscan/pgsteal (anon + file) deltas within 2 %."""
    from moetrace.capacity.scope import Scope

    limit, passes = 64 * MiB, 3
    scope = Scope(f"reclaim-test-{os.getpid()}")
    scope.create(limit)
    try:
        rec = ReclaimRecorder(bucket_ns=100_000_000, features=_mounted()).open()
        try:
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", READER, str(passes), *map(str, file_set)],
                                 preexec_fn=scope.preexec(), capture_output=True, text=True, timeout=300)
            took = time.perf_counter() - t0
        finally:
            res = rec.close()
        stat = scope.memory_stat()
        peak = scope.peak_bytes()
    finally:
        scope.remove(kill=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == passes * 256 * MiB
    assert not scope.exists()

    pk = res.per_kind.set_index("kind")
    chk = res.vmstat_check()
    m = res.kind("memcg")
    print(f"\nreader {passes} x 256 MiB in a {limit >> 20} MiB scope: {took:.1f} s, peak {peak} | "
          f"compile+load {res.load_s:.2f} s attach {res.attach_s * 1e3:.1f} ms")
    print(pk[["invocations", "completed", "scanned_pages", "reclaimed_pages", "scan_to_steal",
              "duration_ns_sum", "end_reclaimed_pages", "scanned_file_pages", "inactive_calls",
              "active_calls", "active_taken_pages", "isolate_calls", "isolate_taken_pages"]].to_string())
    print(f"vmstat delta: {res.vmstat}")
    print(f"check: {chk}")
    print(f"stats {res.stats} open_windows {res.open_windows} recursion_misses {res.recursion_misses}")
    print(f"memcg durations: {m['histogram']}; memory.stat: { {k: stat.get(k) for k in ('pgpgin', 'pgpgout')} }")

    # the oracle: every reclaimer's shrink_inactive scan/steal is in pgscan/pgsteal_{anon,file}
    scan_v, steal_v = chk["vmstat_pgscan"], chk["vmstat_pgsteal"]
    assert steal_v > 0 and scan_v > 0
    assert abs(res.scanned_pages - scan_v) <= 0.02 * scan_v
    assert abs(res.reclaimed_pages - steal_v) <= 0.02 * steal_v
    # memcg limit reclaim did it: at least the pages read beyond the limit, less slack
    read_pages = passes * 256 * MiB // PAGE
    assert m["reclaimed_pages"] >= 0.9 * (read_pages - limit // PAGE)
    assert m["reclaimed_pages"] >= 0.9 * res.reclaimed_pages
    assert m["invocations"] > 0 and m["completed"] >= m["invocations"] - res.open_windows - res.stats["nested_begins"]
    # within a memcg window, end's nr_reclaimed is the sum of its shrink_inactive steals
    assert abs(m["end_reclaimed_pages"] - m["reclaimed_pages"]) <= 0.02 * m["reclaimed_pages"]
    # memcg reclaim is not counted in the global per-reclaimer counters (cgroup_reclaim(sc))
    if res.vmstat.get("pgscan_direct", 0) == 0:
        assert pk.loc["direct", "scanned_pages"] == 0
    # the histogram: one entry per completed invocation, bounds bracket the duration sum
    h = res.histogram[res.histogram["kind"] == "memcg"]
    assert int(h["invocations"].sum()) == m["completed"]
    lo = int((h["lo_ns"].astype("int64") * h["invocations"]).sum())
    hi = int((h["hi_ns"].astype("int64") * h["invocations"]).sum())
    assert lo <= m["duration_ns_sum"] <= hi
    # the timeline adds up to the totals
    tl = res.timeline
    assert res.stats["timeline_overflow"] == 0
    by = tl.groupby("who")[["nr_scanned_pages", "nr_reclaimed_pages", "invocations"]].sum()
    assert int(by.loc["memcg", "nr_scanned_pages"]) == m["scanned_pages"]
    assert int(by.loc["memcg", "nr_reclaimed_pages"]) == m["reclaimed_pages"]
    assert int(by.loc["memcg", "invocations"]) == m["completed"]
    assert res.stats["task_map_full"] == 0
    s = res.summary()
    assert s["lost_events"] == 0 and s["kinds"]["memcg"]["scan_to_steal"] >= 1.0
