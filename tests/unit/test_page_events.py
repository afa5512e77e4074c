"""Streamed page-event attribution (moetrace.analyses.page_events): hand-computed tables,
the streaming path (tiny batches, a recorder-format Parquet file), epochs at their
boundaries, re-reads within an epoch, and equality with a pandas groupby on random input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetrace.analyses.page_events import COUNT_COLUMNS, attribute_page_events, count_epoch_rereads
from moetrace.errors import InputError
from moetrace.record.probes.pagecache import EVICTORS, PAGE_EVENT_DTYPE

EV_COLS = [f"evicted_by_{e}_pages" for e in EVICTORS]


def events(rows: list[tuple], **over) -> pd.DataFrame:
    """rows: (ts_ns, expert_id, kind, pages, re_added, evictor[, first_page_index]) ->
    a page_events frame with the recorder's dtypes."""
    rows = [r if len(r) == 7 else r + (0,) for r in rows]
    df = pd.DataFrame({
        "ts_ns": np.array([r[0] for r in rows], np.uint64),
        "expert_id": np.array([r[1] for r in rows], np.uint32),
        "kind": pd.array([r[2] for r in rows], dtype="string"),
        "first_page_index": np.array([r[6] for r in rows], np.uint32),
        "pages": np.array([r[3] for r in rows], np.uint32),
        "re_added_pages": np.array([r[4] for r in rows], np.uint32),
        "tgid": np.full(len(rows), 4242, np.uint32),
        "evictor": pd.array([r[5] for r in rows], dtype="string"),
    })
    for k, v in over.items():
        df[k] = v
    return df


def recorder_parquet(path, df: pd.DataFrame):
    """Write ``df`` the way PagecacheRecorder.write does: from the ring's struct records."""
    rec = np.zeros(len(df), PAGE_EVENT_DTYPE)
    rec["ts_ns"], rec["expert_id"] = df["ts_ns"], df["expert_id"]
    rec["kind"] = (df["kind"] == "delete").to_numpy()
    rec["first_page"], rec["pages"], rec["re_added"] = df["first_page_index"], df["pages"], df["re_added_pages"]
    rec["tgid"] = df["tgid"]
    rec["evictor"] = [EVICTORS.index(e) if isinstance(e, str) else 0 for e in df["evictor"]]
    ev = pd.DataFrame(rec)
    ev["kind"] = ev["kind"].map({0: "add", 1: "delete"}).astype("string")
    ev["evictor"] = pd.Categorical.from_codes(ev["evictor"].astype(np.int64), EVICTORS).astype("string")
    ev.loc[ev["kind"] == "add", "evictor"] = pd.NA
    ev = ev.drop(columns=["reserved"]).rename(columns={"first_page": "first_page_index", "re_added": "re_added_pages"})
    ev.to_parquet(path, index=False)
    return path


def expected_experts(n_total: int, rows: dict[int | None, dict[str, int]]) -> pd.DataFrame:
    """The experts table: zeros but for ``rows`` {expert_id (None: unattributed): {column: value}}."""
    n1 = n_total + 1
    vals = {c: np.zeros(n1, np.int64) for c in COUNT_COLUMNS}
    for eid, cols in rows.items():
        for c, v in cols.items():
            vals[c][n_total if eid is None else eid] = v
    df = pd.DataFrame({
        "kind": pd.array(["expert"] * n_total + ["unattributed"], dtype="string"),
        "expert_id": pd.array(list(range(n_total)) + [pd.NA], dtype="Int64"),
    })
    for c in COUNT_COLUMNS:
        df[c] = pd.array(vals[c], dtype="Int64")
    df.loc[n_total, "re_added_pages"] = pd.NA
    return df


# 3 experts (ids 0..2); 3 and 7 are unattributed. Every evictor class once, on expert 1,
# with pages 1..9 so that each column is identifiable; an NA and an unknown evictor on expert 2.
HAND = [
    (100, 0, "add", 4, 0, None),
    (101, 0, "add", 2, 1, None),
    (102, 0, "delete", 3, 0, "kswapd"),
    (103, 3, "add", 5, 0, None),
    (104, 7, "delete", 6, 0, "memcg"),
    (105, 2, "add", 8, 2, None),
    (106, 2, "delete", 1, 0, None),
    (107, 2, "delete", 2, 0, "gremlin"),
] + [(110 + i, 1, "delete", i + 1, 0, ev) for i, ev in enumerate(EVICTORS)]

HAND_EXPECTED = {
    0: {"added_pages": 6, "evicted_pages": 3, "re_added_pages": 1, "evicted_by_kswapd_pages": 3,
        "add_events": 2, "delete_events": 1},
    1: {"evicted_pages": sum(range(1, len(EVICTORS) + 1)), "delete_events": len(EVICTORS),
        **{c: i + 1 for i, c in enumerate(EV_COLS)}},
    2: {"added_pages": 8, "re_added_pages": 2, "evicted_pages": 3, "add_events": 1, "delete_events": 2},
    None: {"added_pages": 5, "evicted_pages": 6, "evicted_by_memcg_pages": 6, "add_events": 1,
           "delete_events": 1},
}


@pytest.mark.parametrize("batch_rows", [1 << 20, 3, 1])
def test_hand_computed_totals(batch_rows):
    r = attribute_page_events(events(HAND), 3, batch_rows=batch_rows)
    pd.testing.assert_frame_equal(r.experts, expected_experts(3, HAND_EXPECTED))
    assert r.expert_epochs is None and r.events_outside_epochs is None
    assert r.events == len(HAND)
    assert r.batches == -(-len(HAND) // batch_rows)


def test_sources_agree_and_recorder_parquet_streams(tmp_path):
    rows = [r for r in HAND if r[2] == "add" or r[5] in EVICTORS]  # the recorder writes known classes only
    df = events(rows)
    want = attribute_page_events(df, 3).experts
    path = recorder_parquet(tmp_path / "page_events.parquet", df)
    for src in (path, str(path), pa.Table.from_pandas(df, preserve_index=False), df.iloc[::-1]):
        r = attribute_page_events(src, 3, batch_rows=3)
        pd.testing.assert_frame_equal(r.experts, want)
    r = attribute_page_events(path, 3, batch_rows=3)
    assert r.batches == -(-len(rows) // 3) and r.events == len(rows)
    # categorical (dictionary) columns in a frame decode the same way
    cat = df.assign(kind=df["kind"].astype("category"), evictor=df["evictor"].astype("category"))
    pd.testing.assert_frame_equal(attribute_page_events(cat, 3, batch_rows=2).experts, want)


def test_empty_input(tmp_path):
    df = events([])
    for src in (df, recorder_parquet(tmp_path / "e.parquet", df)):
        r = attribute_page_events(src, 2, batch_rows=3)
        pd.testing.assert_frame_equal(r.experts, expected_experts(2, {}))
        assert r.events == 0
        ep = pd.DataFrame({"epoch": [0], "start_ns": [0], "end_ns": [10]})
        r = attribute_page_events(src, 2, ep, batch_rows=3)
        assert r.expert_epochs is not None and len(r.expert_epochs) == 0
        assert list(r.expert_epochs.columns) == ["epoch", "kind", "expert_id", *COUNT_COLUMNS]
        assert r.events_outside_epochs == 0
        pd.testing.assert_frame_equal(r.experts, expected_experts(2, {}))
    assert len(count_epoch_rereads(df, 2, 4, ep)) == 0


def test_no_experts_everything_unattributed():
    r = attribute_page_events(events([(1, 0, "add", 3, 0, None), (2, 5, "delete", 2, 0, "direct")]), 0)
    pd.testing.assert_frame_equal(r.experts, expected_experts(0, {None: {
        "added_pages": 3, "evicted_pages": 2, "evicted_by_direct_pages": 2, "add_events": 1, "delete_events": 1}}))


# epochs given out of order, labels not positions: 7 = [10, 20), 3 = [20, 30), a gap
# [30, 35), 9 = [35, 40), 5 = [40, ...) (NA end: open)
EPOCHS = pd.DataFrame({"epoch": [9, 7, 5, 3], "phase": ["m", "setup", "after", "m"],
                       "start_ns": [35, 10, 40, 20], "end_ns": pd.array([40, 20, pd.NA, 30], dtype="Int64")})


@pytest.mark.parametrize("batch_rows", [1 << 20, 3, 2])
def test_epoch_assignment_at_boundaries(batch_rows):
    ts_epoch = [(9, None), (10, 7), (19, 7), (20, 3), (29, 3), (30, None), (34, None), (35, 9), (39, 9),
                (40, 5), (10**15, 5)]
    rows = [(ts, 0, "add", 1 + i, 0, None) for i, (ts, _) in enumerate(ts_epoch)]
    rows.append((25, 4, "delete", 100, 0, "damon"))  # unattributed (n_total 2) in epoch 3
    r = attribute_page_events(events(rows), 2, EPOCHS, batch_rows=batch_rows)
    got = r.expert_epochs
    # added pages of expert 0 per epoch: the pages are 1 + row index
    want_add: dict = {}
    for i, (_, e) in enumerate(ts_epoch):
        want_add[e] = want_add.get(e, 0) + 1 + i
    exp0 = got[got["expert_id"] == 0]
    assert [None if pd.isna(e) else int(e) for e in exp0["epoch"]] == [7, 3, 9, 5, None]  # start order, NA last
    assert dict(zip([None if pd.isna(e) else int(e) for e in exp0["epoch"]], exp0["added_pages"].tolist())) == want_add
    assert dict(zip([None if pd.isna(e) else int(e) for e in exp0["epoch"]], exp0["add_events"].tolist())) == {
        7: 2, 3: 2, 9: 2, 5: 2, None: 3}
    un = got[got["kind"] == "unattributed"]
    assert len(un) == 1 and un["epoch"].iloc[0] == 3 and un["evicted_by_damon_pages"].iloc[0] == 100
    assert pd.isna(un["expert_id"].iloc[0]) and pd.isna(un["re_added_pages"].iloc[0])
    assert r.events_outside_epochs == 3
    assert got["epoch"].dtype == "Int32" and got["expert_id"].dtype == "Int64"
    pd.testing.assert_frame_equal(r.experts, attribute_page_events(events(rows), 2).experts)


def test_unordered_stream_same_epochs():
    rng = np.random.default_rng(5)
    rows = [(int(t), int(e), "add" if k else "delete", int(p), 0, None if k else "kswapd")
            for t, e, k, p in zip(rng.integers(0, 60, 200), rng.integers(0, 4, 200), rng.random(200) < .6,
                                  rng.integers(1, 9, 200))]
    df = events(rows)
    want = attribute_page_events(df.sort_values("ts_ns", kind="stable"), 3, EPOCHS).expert_epochs
    for b in (1, 7, 1000):
        got = attribute_page_events(df, 3, EPOCHS, batch_rows=b).expert_epochs
        pd.testing.assert_frame_equal(got, want)


def test_errors(tmp_path):
    with pytest.raises(InputError, match="neither 'add' nor 'delete'"):
        attribute_page_events(events([(1, 0, "add", 1, 0, None), (2, 0, "evict", 1, 0, None)]), 2, batch_rows=1)
    with pytest.raises(InputError, match="lack column"):
        attribute_page_events(events([(1, 0, "add", 1, 0, None)]).drop(columns=["pages"]), 2)
    no_ts = events([(1, 0, "add", 1, 0, None)]).drop(columns=["ts_ns"])
    assert attribute_page_events(no_ts, 2).events == 1  # ts_ns is needed with epochs only
    with pytest.raises(InputError, match="lack column"):
        attribute_page_events(no_ts, 2, EPOCHS)
    path = recorder_parquet(tmp_path / "p.parquet", events([(1, 0, "add", 1, 0, None)]))
    pd.read_parquet(path).rename(columns={"pages": "pages_x"}).to_parquet(tmp_path / "q.parquet")
    with pytest.raises(InputError, match=r"q.parquet: page events lack column\(s\) pages\n"):
        attribute_page_events(tmp_path / "q.parquet", 2)
    with pytest.raises(InputError, match="overlap"):
        attribute_page_events(events([]), 2, pd.DataFrame({"epoch": [0, 1], "start_ns": [0, 5], "end_ns": [6, 9]}))
    with pytest.raises(InputError, match="cannot read"):
        attribute_page_events(tmp_path / "missing.parquet", 2)
    with pytest.raises(InputError, match="NA value"):
        attribute_page_events(pd.DataFrame({"expert_id": pd.array([1, None], dtype="Int64"), "kind": ["add"] * 2,
                                            "pages": [1, 1], "re_added_pages": [0, 0], "evictor": [None, None]}), 2)


# -- re-reads within one epoch ---------------------------------------------------------------

REREAD_EPOCHS = pd.DataFrame({"epoch": [0, 1], "start_ns": [0, 100], "end_ns": [100, 200]})


@pytest.mark.parametrize("batch_rows", [1 << 20, 3, 1])
def test_rereads_hand_computed(batch_rows):
    rows = [
        # expert 0, epoch 0: pages 0-3 added, 1-2 deleted, 0-3 added again: 2 re-read
        (1, 0, "add", 4, 0, None, 0), (2, 0, "delete", 2, 0, "kswapd", 1), (3, 0, "add", 4, 2, None, 0),
        # expert 1: added and deleted in epoch 0, added again in epoch 1: not within one epoch
        (4, 1, "add", 2, 0, None, 6), (5, 1, "delete", 2, 0, "memcg", 6), (150, 1, "add", 2, 2, None, 6),
        # expert 1, epoch 1: page 6-7 (added at 150) deleted and re-added twice: 2 + 2
        (160, 1, "delete", 2, 0, "kswapd", 6), (161, 1, "add", 2, 2, None, 6),
        (162, 1, "delete", 2, 0, "kswapd", 6), (163, 1, "add", 2, 2, None, 6),
        # expert 2: deleted before any add in the epoch (cached before), added: not a re-read
        (170, 2, "delete", 3, 0, "direct", 0), (171, 2, "add", 3, 3, None, 0),
        # after every epoch: add, delete, add: no epoch, not counted
        (300, 2, "add", 1, 0, None, 7), (301, 2, "delete", 1, 0, "other", 7), (302, 2, "add", 1, 1, None, 7),
        # unattributed rows are skipped (first_page_index 0, no page identity)
        (10, 3, "add", 5, 0, None, 0), (11, 3, "delete", 5, 0, "other", 0), (12, 3, "add", 5, 0, None, 0),
    ]
    got = count_epoch_rereads(events(rows), 3, 8, REREAD_EPOCHS, batch_rows=batch_rows)
    want = pd.DataFrame({"epoch": pd.array([0, 1], dtype="Int32"), "kind": pd.array(["expert"] * 2, dtype="string"),
                         "expert_id": pd.array([0, 1], dtype="Int64"), "reread_pages": pd.array([2, 4], dtype="Int64")})
    pd.testing.assert_frame_equal(got, want)


def test_rereads_beyond_the_expert():
    with pytest.raises(InputError, match="beyond pages_per_expert"):
        count_epoch_rereads(events([(1, 0, "add", 4, 0, None, 6)]), 3, 8, REREAD_EPOCHS)


def _reread_reference(df: pd.DataFrame, n_total: int, ppe: int, epochs: pd.DataFrame) -> dict:
    """Per page, its event history walked in stream order (a dict per page)."""
    ep = _epoch_of(df["ts_ns"].to_numpy(np.int64), epochs)
    last: dict[tuple[int, int], tuple[object, bool]] = {}  # page -> (epoch of its last add, deleted since)
    out: dict[tuple[int, int], int] = {}
    for (eid, kind, first, pages), e in zip(df[["expert_id", "kind", "first_page_index", "pages"]].itertuples(
            index=False), ep):
        if eid >= n_total:
            continue
        for p in range(first, first + pages):
            prev = last.get((eid, p))
            if kind == "delete":
                if prev is not None:
                    last[(eid, p)] = (prev[0], True)
            else:
                if e is not None and prev is not None and prev[0] == e and prev[1]:
                    out[(e, eid)] = out.get((e, eid), 0) + 1
                last[(eid, p)] = (e if e is not None else "none", False)
    return out


# -- equality with pandas on random input ----------------------------------------------------

def _epoch_of(ts: np.ndarray, epochs: pd.DataFrame) -> list:
    """Naive: the label of the epoch whose [start, end) holds each ts (None: none)."""
    e = epochs.sort_values("start_ns").reset_index(drop=True)
    spans = []
    for i, row in e.iterrows():
        end = row["end_ns"] if not pd.isna(row["end_ns"]) else (
            e["start_ns"].iloc[i + 1] if i + 1 < len(e) else 2**62)
        spans.append((int(row["start_ns"]), int(end), int(row["epoch"])))
    return [next((lab for s, en, lab in spans if s <= t < en), None) for t in ts]


def _reference(df: pd.DataFrame, n_total: int, by: list[str]) -> pd.DataFrame:
    """The same sums with a plain pandas groupby over ``by`` (+ the clipped expert slot)."""
    d = df.assign(slot=np.minimum(df["expert_id"].to_numpy(np.int64), n_total),
                  add=df["kind"] == "add", dele=df["kind"] == "delete")
    d["added_pages"] = d["pages"].where(d["add"], 0).astype(np.int64)
    d["evicted_pages"] = d["pages"].where(d["dele"], 0).astype(np.int64)
    # NA (compared as 0) for unattributed pages: the kernel does not follow them
    d["re_added_pages"] = d["re_added_pages"].where(d["slot"] < n_total, 0).astype(np.int64)
    for ev, c in zip(EVICTORS, EV_COLS):
        d[c] = d["pages"].where(d["dele"] & (d["evictor"] == ev).fillna(False), 0).astype(np.int64)
    d["add_events"], d["delete_events"] = d["add"].astype(np.int64), d["dele"].astype(np.int64)
    return d.groupby(by + ["slot"], dropna=False)[list(COUNT_COLUMNS)].sum()


ROW = st.tuples(st.integers(0, 80), st.integers(0, 9), st.sampled_from(["add", "delete"]), st.integers(0, 40),
                st.integers(0, 3), st.sampled_from([None, "gremlin", *EVICTORS]), st.integers(0, 7))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(ROW, max_size=60), n_total=st.integers(0, 8), batch_rows=st.integers(1, 70),
       cuts=st.lists(st.integers(0, 90), min_size=1, max_size=6, unique=True), open_end=st.booleans())
def test_matches_pandas_groupby(rows, n_total, batch_rows, cuts, open_end):
    df = events(rows)
    cuts = sorted(cuts)
    # epochs between consecutive cuts (labels in reverse order), the last open-ended or closed
    starts, ends = cuts[:-1] or [cuts[0]], cuts[1:] or [cuts[0] + 5]
    epochs = pd.DataFrame({"epoch": np.arange(len(starts))[::-1] * 10, "start_ns": starts,
                           "end_ns": pd.array(ends[:-1] + [pd.NA if open_end else ends[-1]], dtype="Int64")})
    r = attribute_page_events(df, n_total, epochs, batch_rows=batch_rows)
    plain = attribute_page_events(df, n_total, batch_rows=batch_rows)
    pd.testing.assert_frame_equal(r.experts, plain.experts)

    ref = _reference(df, n_total, []).reindex(range(n_total + 1), fill_value=0)
    got = plain.experts[list(COUNT_COLUMNS)].astype("Int64").fillna(0).to_numpy(np.int64)
    np.testing.assert_array_equal(got, ref.to_numpy(np.int64))
    assert plain.experts["re_added_pages"].isna().tolist() == [False] * n_total + [True]

    lab = _epoch_of(df["ts_ns"].to_numpy(np.int64), epochs)
    ref_e = _reference(df.assign(ep=pd.array(lab, dtype="Int64")), n_total, ["ep"])
    got_e = r.expert_epochs.assign(slot=r.expert_epochs["expert_id"].fillna(n_total).astype(np.int64))
    got_e = got_e.assign(ep=got_e["epoch"].astype("Int64")).set_index(["ep", "slot"])[list(COUNT_COLUMNS)]
    assert r.events_outside_epochs == sum(x is None for x in lab)
    assert len(got_e) == len(ref_e)
    ref_map = {(None if pd.isna(k[0]) else int(k[0]), int(k[1])): v for k, v in
               zip(ref_e.index, ref_e.to_numpy(np.int64))}
    for k, v in zip(got_e.index, got_e.fillna(0).to_numpy(np.int64)):
        np.testing.assert_array_equal(v, ref_map[(None if pd.isna(k[0]) else int(k[0]), int(k[1]))])

    ppe = 48  # first <= 7, pages <= 40
    rr = count_epoch_rereads(df, n_total, ppe, epochs, batch_rows=batch_rows)
    assert {(int(a), int(b)): int(c) for a, b, c in rr[["epoch", "expert_id", "reread_pages"]].itertuples(
        index=False)} == _reread_reference(df, n_total, ppe, epochs)
