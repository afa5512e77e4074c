"""The reads probe (probes/reads.bpf.c + moetrace.record.probes.reads) (unit tier)."""

from __future__ import annotations

from common.reads_probe import *  # noqa: F401,F403


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
    big = PoolMap({5: (0, 8000)}, 1, MIB, 8000, 8000)
    assert reads_knobs(plan, big, stream=False)["MOE_MAX_FDS"] == 65536
    assert reads_knobs(plan, ONE_FILE_POOL, stream=False)["MOE_MAX_FDS"] == 16384  # the default suffices


def test_files_layout_attribution_and_fd_reuse():
    """fd 5 of tgid 10 is expert 1's file (gen 0), then closed and reopened as expert 3's (gen 1):
    two identities; an identity whose fd table the kernel could not read is resolved by its
    first added page; one the kernel resolved by neither stays unresolved."""
    dev = FILES_POOL.dev
    rows = [_fd_row(10, 5, 0, 0, 0, 3, 2, 1, 0, 256, ino=101, dev=dev),
            _fd_row(10, 5, 1, 0, 0, 2, 1, 1, 0, 256, ino=103, dev=dev, by=2),  # learned from an added page
            _fd_row(10, 7, 0, 0, NOPOS, 4, 4, 0, 0, 0, nbytes=40, ino=555, dev=dev),  # read() of a non-pool file
            _fd_row(11, 3, 0, 0, 0, 1, 0, 0, 1, 0, nbytes=0)]          # an error, inode never read
    paths = {(10, 5, 0, 0): "/p/e1.bin", (10, 7, 0, 0): "/usr/lib/x.py"}
    hist_rows = [(10, 5, 0, 0, 0, 10, 2), (10, 5, 0, 0, 1, 16, 1), (10, 5, 1, 0, 0, 10, 1), (10, 5, 1, 0, 1, 16, 1),
                 (10, 7, 0, 0, 0, 9, 4), (11, 3, 0, 0, 2, 4, 1)]
    tables, summary = build(_collected(rows, hist_rows), paths, FILES_POOL, 0)
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
    assert sorted(f["resolved_by"].dropna()) == ["add", "fd", "fd"]
    assert sorted(f["path"].dropna()) == ["/p/e1.bin", "/usr/lib/x.py"]
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
    ids = summary["fd_identities"]
    assert (ids["resolved_fd"], ids["resolved_add"], ids["unresolved"], ids["with_path"]) == (2, 1, 1, 2)
    for name, df in tables.items():  # every table is the declared one, in order and dtype
        cols = SPEC.tables()[name]
        assert list(df.columns) == [c.name for c in cols], name
        for c in cols:
            assert str(df[c.name].dtype) == c.dtype, (name, c.name, df[c.name].dtype)


def test_pool_file_attribution_by_extent():
    """One pool file split by extent; an identity's extents share its inode, the fd table's
    answer before an added page's."""
    q = ONE_FILE_POOL
    rows = [_fd_row(10, 4, 0, 0, 0, 2, 1, 1, 0, 256, ino=200, dev=q.dev),
            _fd_row(10, 4, 0, 0, 3, 1, 0, 1, 0, 300, ino=200, dev=q.dev),
            _fd_row(10, 4, 0, 0, 9, 1, 1, 0, 0, 0, ino=200, dev=q.dev),
            _fd_row(10, 4, 0, 0, NOPOS, 1, 1, 0, 0, 0, ino=200, dev=q.dev),
            _fd_row(12, 4, 0, 0, 1, 1, 0, 1, 0, 256, ino=777, dev=q.dev, by=2),  # an added page says 777 ...
            _fd_row(12, 4, 0, 0, 2, 1, 1, 0, 0, 0, ino=200, dev=q.dev)]  # ... the fd table says the pool
    tables, summary = build(_collected(rows), {}, q, MIB)
    e = tables["reads"].set_index("source")
    ex = tables["reads"][tables["reads"]["kind"] == "expert"]
    assert ex["calls"].tolist() == [2, 1, 1, 1] and ex["added_pages"].tolist() == [256, 256, 0, 300]
    assert e.loc["pool_tail", "calls"] == 1 and e.loc["no_position", "calls"] == 1
    assert summary["fd_identities"]["resolved_fd"] == 2 and summary["fd_identities"]["with_path"] == 0


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
    inos = {(10, 4, 0, 0): Resolution(200, q.dev, None, "fd")}
    df = calls_table(ev.tobytes(), inos, q)
    assert df["expert_id"].tolist()[:2] == [0, 2] and pd.isna(df["expert_id"].iloc[2])
    assert df["source"].tolist() == ["expert", "expert", "no_position", "unresolved_fd"]
    assert df["class"].tolist() == ["miss", "hit_only", "hit_only", "error"]
    assert df["syscall"].tolist() == ["preadv2", "preadv2", "read", "pread64"]
    assert pd.isna(df["offset_bytes"].iloc[2]) and df["offset_bytes"].iloc[1] == 2 * MIB + 4096
    assert df["ino"].iloc[0] == 200 and pd.isna(df["ino"].iloc[1])
    assert calls_table(b"", {}, None).empty


def test_fd_paths_on_a_fake_proc(tmp_path):
    """A path is kept only when the link still shows the inode the kernel announced."""
    proc = tmp_path / "proc"
    (proc / "42" / "fd").mkdir(parents=True)
    target = tmp_path / "e0.bin"
    target.write_bytes(b"x")
    os.symlink(target, proc / "42" / "fd" / "5")
    os.symlink(tmp_path / "gone", proc / "42" / "fd" / "6")  # dangling: closed meanwhile
    st = target.stat()
    ino, dev = st.st_ino, kernel_dev(st.st_dev)
    p = FdPaths(proc=str(proc))
    assert p.look(42, 5, 3, 1, ino, dev) and p.paths == {(42, 5, 3, 1): str(target)}
    assert not p.look(42, 5, 4, 1, ino + 1, dev) and p.stale == 1  # reused for another file since
    assert not p.look(42, 6, 0, 0, ino, dev) and p.stale == 2
    assert not p.look(42, 7, 0, 0, 0, 0) and p.unread == 1 and p.stale == 2  # no inode: nothing to check
    assert p.announced == 4 and len(p.paths) == 1


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
    from moetrace.record.probes import recorder_class
    from moetrace.record.probes.reads import ReadsRecorder

    assert recorder_class("reads") is ReadsRecorder and ReadsRecorder.needs_poll


def test_c_source_has_the_declarations_indices():
    """probes/reads.bpf.c: SC_*, CLASS_* and HIST_SLOTS in the declaration's order (STAT_*: every
    probe's, test_probe_build.py)."""
    import re

    from moetrace.kernel import bpf
    from moetrace.record.probes.reads import CLASSES, HIST_SLOTS

    src = bpf.core_source("reads").read_text()

    def defines(prefix: str) -> list[tuple[str, int]]:
        return [(n, int(i)) for n, i in re.findall(r"^#define %s(\w+) (\d+)" % prefix, src, re.M)]

    for prefix, names in (("SC_", SYSCALLS), ("CLASS_", CLASSES)):
        d = defines(prefix)
        assert [n.lower() for n, _i in d] == list(names) and [i for _n, i in d] == list(range(len(names))), prefix
    assert int(re.search(r"^#define HIST_SLOTS (\d+)", src, re.M).group(1)) == HIST_SLOTS
    assert int(re.search(r"^#define N_CLASSES (\d+)", src, re.M).group(1)) == len(CLASSES)


def test_fd_frames_from_map_records():
    """The kernel's (fd_key, fd_agg) records -> one row per identity and one per nonzero
    histogram slot; the map sizes follow the knobs (a ring of one page when nothing streams)."""
    from moetrace.record.probes.reads import FD_AGG_DTYPE, FD_KEY_DTYPE, LIVE_DTYPE, PAGE, fd_frames

    assert FD_AGG_DTYPE.itemsize == 17 * 8 + 4 * 3 * HIST_SLOTS and LIVE_DTYPE.itemsize == 8 + FD_AGG_DTYPE.itemsize
    keys = np.zeros(2, FD_KEY_DTYPE)
    keys["tgid"], keys["fd"], keys["gen"], keys["chunk"] = 10, (5, 6), (0, 2), (0, NOPOS)
    aggs = np.zeros(2, FD_AGG_DTYPE)
    aggs["c"]["calls"], aggs["c"]["ino"] = (3, 1), (77, 0)
    aggs["hist"][0, 4], aggs["hist"][0, HIST_SLOTS + 9], aggs["hist"][1, 2 * HIST_SLOTS] = 2, 1, 1
    fds, fh = fd_frames(keys, aggs)
    assert list(fds.columns) == ["tgid", "fd", "gen", "epoch", "chunk", *FD_FIELDS]
    assert fds["calls"].tolist() == [3, 1] and fds["ino"].tolist() == [77, 0]
    assert fds["chunk"].dtype == np.uint64 and int(fds["chunk"].iloc[1]) == NOPOS
    assert fh[["fd", "gen", "cls", "slot", "calls"]].values.tolist() == [[5, 0, 0, 4, 2], [5, 0, 1, 9, 1],
                                                                         [6, 2, 2, 0, 1]]
    empty = fd_frames(np.zeros(0, FD_KEY_DTYPE), np.zeros(0, FD_AGG_DTYPE))
    assert empty[0].empty and list(empty[1].columns) == ["tgid", "fd", "gen", "epoch", "cls", "slot", "calls"]
    k = {x.name: int(x.default) for x in SPEC.knobs}
    assert SPEC.map_sizes(k)["calls"] == PAGE and SPEC.map_sizes(k | {"MOE_STREAM": 1})["calls"] == 256 * PAGE
    assert SPEC.map_sizes(k)["fd_overflow"] == 2 and SPEC.map_sizes(k)["idents"] == 16 * PAGE
