"""The mlock probe (probes/mlock.bpf.c + moetrace.record.probes.mlock) (unit tier)."""

from __future__ import annotations

from common.mlock_probe import *  # noqa: F401,F403


def test_call_codes_and_record_layout_match_the_c_file():
    codes = re.findall(r"#define CALL_(\w+) (\d+)", SRC)
    assert [n.lower() for n, _ in codes] == list(ml.CALLS)
    assert [int(i) for _, i in codes] == list(range(len(ml.CALLS)))
    assert ml.EVENT_DTYPE.itemsize == 64
    assert ml.EVENT_DTYPE == SPEC.struct("mlock_event").dtype()
    assert [c.name for c in SPEC.schema][:10] == ["time_ns", "tgid", "tid", "call", "start", "len_bytes",
                                                 "new_len_bytes", "flags", "ret", "latency_ns"]


def test_rangeset_matches_a_page_set():
    rng = random.Random(7)
    rs = ml.RangeSet()
    pages: set[int] = set()
    for _ in range(3000):
        a = rng.randrange(0, 200)
        b = a + rng.randrange(0, 30)
        op = rng.random()
        if op < 0.45:
            d = rs.add(a, b)
            want = len(set(range(a, b)) - pages)
            pages |= set(range(a, b))
            assert d == want
        elif op < 0.9:
            d = rs.remove(a, b)
            want = -len(set(range(a, b)) & pages)
            pages -= set(range(a, b))
            assert d == want
        else:
            assert rs.overlap(a, b) == len(set(range(a, b)) & pages)
        assert rs.total == len(pages)
        rr = rs.ranges()
        assert all(s < e for s, e in rr) and all(rr[i][1] < rr[i + 1][0] for i in range(len(rr) - 1)), rr
    assert rs.clear() == -len(pages) and rs.total == 0


def test_apply_calls_rounds_like_the_kernel_and_never_counts_twice():
    B = 1 << 30  # a page-aligned base address
    P = PAGE
    seq = [
        (1, 10, "mlock", B + 100, 5000, 0),               # crosses a page boundary: 2 pages
        (2, 10, "mlock", B, 3 * P, 0),                    # overlaps: 3 pages in all
        (3, 10, "mlock2", B + 10 * P, 2 * P, 0, 1),       # MLOCK_ONFAULT counts like mlock: 5
        (4, 10, "munlock", B + P, 1, 0),                  # one byte still unlocks its page: 4
        (5, 10, "munlock", B + 30 * P, 4 * P, 0),         # never locked: 4
        (6, 10, "mlock", B + 20 * P, 4 * P, -12),         # failed (ENOMEM): 4
        (7, 10, "mlock", B + 20 * P, 4 * P, 0),           # 8
        (8, 10, "munmap", B + 21 * P, 2 * P - 5, 0),      # PAGE_ALIGN(len): 2 pages gone: 6
        (9, 10, "mmap", 0, 8 * P - 1, B + 100 * P, ml.MAP_LOCKED),  # +8: 14
        (10, 10, "mremap", B + 100 * P, 8 * P, B + 200 * P, 1, 16 * P),  # locked mapping moves, grows: 22
        (11, 10, "mmap", 0, 2 * P, B + 200 * P, ml.MAP_FIXED),      # replaces 2 locked pages: 20
        (12, 20, "mlock", B, P, 0),                       # another process: 1
        (13, 10, "mlockall", 0, 0, 0, ml.MCL_CURRENT),    # unknowable
        (14, 10, "mlock", B, P, 0),                       # still unknowable
        (15, 10, "munlockall", 0, 0, 0),                  # known again: 0
        (16, 10, "mlock", B + 5 * P, P, 0),               # 1
    ]
    df, tl, summ = ml.apply_calls(_calls(seq))
    want = [2, 3, 5, 4, 4, 4, 8, 6, 14, 22, 20, 1, None, None, 0, 1]
    got = [None if v is pd.NA else int(v) // P for v in df["locked_bytes"]]
    assert got == want
    assert [None if v is pd.NA else int(v) // P for v in df["delta_bytes"]] == \
        [2, 1, 2, -1, 0, 0, 4, -2, 8, 8, -2, 1, None, None, None, 1]
    # the timeline: one row per change, with the total over processes (NA while one is unknowable)
    assert list(tl["time_ns"]) == [1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 13, 15, 16]
    tot = [None if v is pd.NA else int(v) // P for v in tl["total_locked_bytes"]]
    assert tot == [2, 3, 5, 4, 8, 6, 14, 22, 20, 21, None, 1, 2]
    assert ml.locked_bytes_at(tl, 10, 12) == 20 * P and ml.locked_bytes_at(tl, 10, 14) is None
    assert ml.locked_bytes_at(tl, 20, 11) == 0 and ml.locked_bytes_at(tl, 10, 0) == 0
    assert summ["10"]["locked_bytes_end"] == P and summ["10"]["failed_calls"] == 1
    assert summ["10"]["max_locked_bytes"] == 22 * P and summ["20"]["locked_bytes_end"] == P
    assert str(tl["locked_bytes"].dtype) == "Int64" and str(df["locked_bytes"].dtype) == "Int64"


def test_mremap_partly_overlapping_a_locked_range_is_marked_unknowable():
    B, P = 1 << 30, PAGE
    df, _tl, summ = ml.apply_calls(_calls([(1, 5, "mlock", B, 2 * P, 0),
                                           (2, 5, "mremap", B + P, 4 * P, B + 50 * P, 1, 4 * P)]))
    assert df["locked_bytes"].iloc[1] is pd.NA and summ["5"]["inexact_calls"] == 1


def test_exit_and_exec_release_everything_and_the_table_drops_idle_mapping_calls():
    B, P = 1 << 30, PAGE
    df, tl, summ = ml.apply_calls(_calls([
        (1, 5, "mlock", B, 4 * P, 0),
        (2, 5, "munmap", B + 64 * P, P, 0),            # a locked process's unrelated munmap: no change
        (3, 5, "mmap", 0, P, B + 70 * P, ml.MAP_FIXED),  # ld.so-style MAP_FIXED elsewhere: no change
        (4, 5, "exec", 0, 0, 0),                       # a new mm: nothing locked
        (5, 5, "mlock", B, P, 0),
        (6, 5, "exit", 0, 0, 0),
    ]))
    assert [int(v) // P for v in df["locked_bytes"]] == [4, 4, 4, 0, 1, 0]
    assert summ["5"]["exited"] is True and summ["5"]["locked_bytes_at_exit"] == P
    assert summ["5"]["locked_bytes_end"] == 0 and list(tl["time_ns"]) == [1, 4, 5, 6]
    table = ml.table_rows(df)
    assert list(table["call"]) == ["mlock", "exec", "mlock", "exit"] and "changed" not in table.columns


def test_records_round_trip():
    ev = np.zeros(3, ml.EVENT_DTYPE)
    ev["ts_ns"] = [30, 10, 20]
    ev["tgid"] = 7
    ev["call"] = [ml.CALLS.index("munlock"), ml.CALLS.index("mlock"), ml.CALLS.index("mremap")]
    ev["start"] = [1 << 30, 1 << 30, 1 << 31]
    ev["len"] = [PAGE, 2 * PAGE, PAGE]
    ev["len2"] = [0, 0, 3 * PAGE]
    ev["ret"] = [0, 0, -14]
    df = ml.records_to_calls(ev.tobytes())
    assert list(df["call"]) == ["munlock", "mlock", "mremap"]
    assert df["new_len_bytes"].tolist()[:2] == [pd.NA, pd.NA] and df["new_len_bytes"].iloc[2] == 3 * PAGE
    out, tl, _ = ml.apply_calls(df)
    assert list(out["time_ns"]) == [10, 20, 30] and list(out["locked_bytes"]) == [2 * PAGE, 2 * PAGE, PAGE]
    ev["call"][0] = 99
    with pytest.raises(ml.ProbeError, match="unknown call code"):
        ml.records_to_calls(ev.tobytes())


def test_mlock_is_a_default_enrichment_probe_with_units_in_names():
    assert SPEC.default is True and SPEC.enrichment is True  # in the default set; missing only warns
    assert set(SPEC.tables()) == {"mlock", "mlock_timeline"}
    req = {g.name for g in SPEC.attach if g.required}
    assert req == {"mlock_enter", "mlock_exit", "munlock_enter", "munlock_exit"}
    for g in SPEC.attach:
        if g.name.startswith("kp_"):
            assert g.knob and [c.kind for c in g.candidates][:2] == ["fentry", "kprobe"]
