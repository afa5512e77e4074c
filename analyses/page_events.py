"""Per-expert (and per-epoch) attribution of the page-cache event stream, streamed.

``moetrace record --stream-events`` writes ``page_events.parquet``: one row per
(page-cache event, expert piece) of the pool (toolkit/record/probes/pagecache.py,
``page_event`` struct; probes/pagecache.bpf.c ``emit``):

=================== ======== ==========================================================
column              type     meaning
=================== ======== ==========================================================
``ts_ns``           uint64   CLOCK_MONOTONIC of the event (ns)
``expert_id``       uint32   layer * n_experts + expert; ``n_experts_total`` (any value
                             >= it here) = unattributed (pool-filesystem pages of no
                             expert)
``kind``            string   ``'add'`` (a miss, readahead included) or ``'delete'``
``first_page_index`` uint32  first page of the piece *within the expert* (0 when
                             unattributed)
``pages``           uint32   pages in this piece
``re_added_pages``  uint32   of an add: pages of the piece added again after their
                             eviction (exact, per page, over the whole recording)
``tgid``            uint32   process of the event
``evictor``         string   of a delete: kswapd, direct, memcg, proactive, damon,
                             fadvise, truncate, drop_caches, other (NA for adds)
=================== ======== ==========================================================

:func:`attribute_page_events` sums the stream per expert (and per (epoch, expert))
without loading it: the file is read in record batches of ``batch_rows`` rows, only
the columns needed, ``kind`` / ``evictor`` as dictionary arrays (so a batch's
strings are never materialised: a lookup table over the few dictionary values maps
the indices to classes), and each batch is reduced with ``np.bincount`` into
preallocated int64 arrays. Memory is O(batch_rows + n_experts_total) for the totals;
with epochs, O(batch_rows + the rows of the per-epoch result) (see
:func:`attribute_page_events`).

:func:`count_epoch_rereads` counts the pages read again within one epoch (added,
deleted and added again inside the same epoch) exactly from the stream, with one
int32 state per pool page.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Union

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from numba import njit

from moetrace.errors import InputError, UsageError
from moetrace.run.evictors import EVICTORS

#: what :func:`attribute_page_events` and :func:`count_epoch_rereads` read
Source = Union[str, "os.PathLike[str]", pq.ParquetFile, pa.Table, pa.RecordBatch, pd.DataFrame]

#: count columns of both result tables, in order
COUNT_COLUMNS: tuple[str, ...] = (("added_pages", "evicted_pages", "re_added_pages")
                                  + tuple(f"evicted_by_{e}_pages" for e in EVICTORS)
                                  + ("add_events", "delete_events"))

_NEV = len(EVICTORS)
#: event classes of a batch: 0 add, 1 + i delete by EVICTORS[i], _NEV + 1 delete with an NA or
#: unknown evictor (counted in evicted_pages and delete_events, in no evicted_by_* column)
_NCLS = _NEV + 2
_UNKNOWN_EVICTOR = _NEV + 1
_KIND_BAD = 2
#: rows per np.bincount call: pages (uint32) * rows stays below 2**53, where float64
#: weights are exact integers
_EXACT_ROWS = 1 << 21
#: bins of one np.bincount over (epoch, expert, class) keys: a batch spanning more epochs is
#: counted in runs of epochs (16 MiB of float64 bins per call)
_DENSE_SLOTS = 1 << 21


@dataclass
class PageEventAttribution:
    """The result of :func:`attribute_page_events`.

    ``experts``: one row per expert in expert_id order, then the unattributed row
    (``n_experts_total + 1`` rows, zeros included): ``kind`` ('expert' |
    'unattributed'), ``expert_id`` (Int64, NA for unattributed), then
    :data:`COUNT_COLUMNS` (Int64; ``re_added_pages`` is NA for unattributed, whose
    pages the kernel does not follow). ``evicted_pages`` minus the sum of the
    ``evicted_by_*_pages`` columns is the pages of deletes whose evictor was NA or
    not a known class.

    ``re_added_pages`` sums the column over every row (the recorder writes 0 on
    deletes).

    ``expert_epochs`` (None without epochs): one row per (epoch, expert) with at least
    one event, in the epochs' start order (the NA epoch last), then by expert_id
    (unattributed last): ``epoch`` (Int32, the epochs table's label; NA = events in no
    epoch's [start_ns, end_ns)), ``kind``, ``expert_id``, then :data:`COUNT_COLUMNS`.
    An absent row is all zero. Summed over epochs (NA included) it equals ``experts``.

    ``events``: rows read; ``events_outside_epochs``: of them, in no epoch (None
    without epochs); ``batches``: record batches read.
    """

    experts: pd.DataFrame
    expert_epochs: pd.DataFrame | None
    events: int
    events_outside_epochs: int | None
    batches: int


# -- reading -----------------------------------------------------------------------------------

_STRING_COLS = ("kind", "evictor")


def iter_batches(source: Source, columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    """Record batches of at most ``batch_rows`` rows with ``columns`` (in that order)."""
    if batch_rows < 1:
        raise UsageError(f"batch_rows must be >= 1 (got {batch_rows})")
    path = None
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            # pre_buffer off: the reader holds one column chunk at a time, not a row group's
            # (half the peak memory of a 2**20-row batch with ts_ns; the same speed on local files)
            source = pq.ParquetFile(path, read_dictionary=[c for c in _STRING_COLS if c in columns],
                                    pre_buffer=False)
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"cannot read the page events: {e}", path=path) from None
    if isinstance(source, pq.ParquetFile):
        _require(source.schema_arrow.names, columns, path)
        it = source.iter_batches(batch_size=batch_rows, columns=columns)
        while True:
            try:
                b = next(it)
            except StopIteration:
                return
            except (OSError, pa.ArrowException) as e:  # a damaged page, found as the stream reaches it
                raise InputError(f"cannot read the page events: {e}", path=path) from None
            yield b
    if isinstance(source, pd.DataFrame):
        _require(list(source.columns), columns, None)
        source = pa.Table.from_pandas(source[columns], preserve_index=False)
    if isinstance(source, pa.RecordBatch):
        source = pa.Table.from_batches([source])
    if not isinstance(source, pa.Table):
        raise UsageError(f"page events: unsupported source type {type(source).__name__}",
                         hint="a Parquet path, pyarrow.parquet.ParquetFile, pyarrow Table or pandas DataFrame")
    _require(source.column_names, columns, None)
    yield from source.select(columns).to_batches(max_chunksize=batch_rows)


def _require(have: list[str], want: list[str], path: str | None) -> None:
    missing = [c for c in want if c not in have]
    if missing:
        raise InputError(f"page events lack column(s) {', '.join(missing)}", path=path,
                         hint="is this a page_events table of `moetrace record --stream-events`?")


def _int_column(arr: pa.Array, name: str) -> np.ndarray:
    """A non-null integer column as numpy (zero-copy for the recorder's unsigned types)."""
    if arr.null_count:
        raise InputError(f"page events: {arr.null_count} NA value(s) in {name}")
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    a = arr.to_numpy(zero_copy_only=False)
    if a.dtype.kind not in "iu":
        raise InputError(f"page events: {name} is {arr.type}, not an integer")
    if a.dtype.kind == "i" and a.size and a.min() < 0:
        raise InputError(f"page events: negative {name}")
    return a


def _codes(arr: pa.Array, table: dict[str, int], other: int) -> np.ndarray:
    """uint8 class of every row: ``table[value]``; NA and values not in ``table``: ``other``.

    A dictionary array is mapped through its few dictionary values (no per-row string);
    a plain string array is dictionary-encoded first (one hash per row: test inputs)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not pa.types.is_dictionary(arr.type):
        arr = pc.dictionary_encode(arr)
    values = arr.dictionary.to_pylist()
    lut = np.array([table.get(v, other) if v is not None else other for v in values] + [other], np.uint8)
    idx = arr.indices
    if arr.null_count:
        idx = pc.fill_null(idx, len(values))
    return lut[idx.to_numpy()]


_KINDS = {"add": 0, "delete": 1}
_EVICTOR_CLS = {e: 1 + i for i, e in enumerate(EVICTORS)}


def _kind_codes(arr: pa.Array) -> np.ndarray:
    """0 add, 1 delete; anything else is an error."""
    k = _codes(arr, _KINDS, _KIND_BAD)
    if k.size and k.max() == _KIND_BAD:
        bad = pc.unique(pc.filter(arr, pa.array(k == _KIND_BAD))).to_pylist()
        raise InputError(f"page events: kind {bad[:5]!r} is neither 'add' nor 'delete'")
    return k


# -- per-batch reduction -----------------------------------------------------------------------

def _reduce(rel: np.ndarray, span: int, cls: np.ndarray, pages: np.ndarray, re_added: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pages[span, _NCLS], events[span, _NCLS], re_added[span]) int64 of rows keyed
    ``rel`` (0 <= rel < span) in class ``cls``."""
    pg = ev = ra = None
    for a in range(0, max(rel.size, 1), _EXACT_ROWS):
        b = a + _EXACT_ROWS
        r = rel[a:b]
        slot = r * _NCLS + cls[a:b]
        p = np.bincount(slot, weights=pages[a:b], minlength=span * _NCLS).astype(np.int64)
        e = np.bincount(slot, minlength=span * _NCLS).astype(np.int64, copy=False)
        x = np.bincount(r, weights=re_added[a:b], minlength=span).astype(np.int64)
        if pg is None:
            pg, ev, ra = p, e, x
        else:
            pg += p
            ev += e
            ra += x
    return pg.reshape(span, _NCLS), ev.reshape(span, _NCLS), ra


def _count_matrix(pg: np.ndarray, ev: np.ndarray, ra: np.ndarray) -> np.ndarray:
    """int64 [rows, len(COUNT_COLUMNS)] from _reduce's class-wise arrays."""
    out = np.empty((pg.shape[0], len(COUNT_COLUMNS)), np.int64)
    out[:, 0] = pg[:, 0]
    out[:, 1] = pg[:, 1:].sum(axis=1)
    out[:, 2] = ra
    out[:, 3:3 + _NEV] = pg[:, 1:1 + _NEV]
    out[:, 3 + _NEV] = ev[:, 0]
    out[:, 4 + _NEV] = ev[:, 1:].sum(axis=1)
    return out


def _sum_by_key(keys: np.ndarray, cols: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """(sorted unique keys, int64 sums of each column per key), exact (sort + reduceat);
    keys already strictly increasing are returned as they are."""
    if keys.size == 0 or bool(np.all(keys[1:] > keys[:-1])):
        return keys, cols
    order = np.argsort(keys, kind="stable")
    ks = keys[order]
    starts = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
    return ks[starts], [np.add.reduceat(c[order], starts) for c in cols]


_ADD_EV, _DEL_EV = COUNT_COLUMNS.index("add_events"), COUNT_COLUMNS.index("delete_events")


class _EpochCounts:
    """Per (epoch position, expert) sums: a dense (n1 x columns) block per epoch position
    the stream is in, moved to a sparse list (rows with events only) once the stream has
    passed it. A time-ordered stream keeps one batch's epochs dense; an unordered one
    may flush an epoch twice (merged at the end). The "no epoch" position stays dense."""

    def __init__(self, n1: int, n_epochs: int):
        self.n1, self.n_epochs = n1, n_epochs
        self.blocks: dict[int, np.ndarray] = {}
        self.keys: list[np.ndarray] = []
        self.cols: list[list[np.ndarray]] = [[] for _ in COUNT_COLUMNS]  # flushed rows, per column
        self.totals = np.zeros((n1, len(COUNT_COLUMNS)), np.int64)

    def add(self, p0: int, counts: np.ndarray) -> None:
        """Add ``counts`` [k * n1, columns] of epoch positions p0 .. p0 + k - 1."""
        for j, blk in enumerate(counts.reshape(-1, self.n1, counts.shape[1])):
            if not (blk[:, _ADD_EV].any() or blk[:, _DEL_EV].any()):
                continue
            have = self.blocks.get(p0 + j)
            if have is None:
                self.blocks[p0 + j] = blk  # a view of the caller's fresh array
            else:
                have += blk

    def flush_before(self, pos: int) -> None:
        """Move the blocks of epoch positions < pos to the sparse list."""
        for p in sorted(k for k in self.blocks if k < pos):
            blk = self.blocks.pop(p)
            rows = np.flatnonzero(blk[:, _ADD_EV] | blk[:, _DEL_EV])
            self.keys.append(p * self.n1 + rows)
            for c, col in enumerate(self.cols):
                col.append(blk[rows, c])
            self.totals += blk

    def result(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """(keys = position * n1 + expert slot, sorted and unique; one int64 array per
        count column)."""
        self.flush_before(self.n_epochs + 1)
        w = len(COUNT_COLUMNS)
        if not self.keys:
            return np.zeros(0, np.int64), [np.zeros(0, np.int64) for _ in range(w)]
        keys = np.concatenate(self.keys)
        cols = []
        for c in range(w):  # one column at a time: the flushed pieces go as their column is built
            cols.append(np.concatenate(self.cols[c]))
            self.cols[c] = []
        self.keys = []
        return _sum_by_key(keys, cols)


# -- epochs --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Epochs:
    labels: np.ndarray  # int64 epoch label, in start order
    starts: np.ndarray  # int64 ns, sorted
    ends: np.ndarray  # int64 ns

    @property
    def n(self) -> int:
        return int(self.labels.size)

    def positions(self, ts: np.ndarray) -> np.ndarray:
        """Per event: the position (in start order) of the epoch whose [start_ns, end_ns)
        holds ts, or n (no epoch)."""
        if self.n == 0:
            return np.zeros(ts.size, np.int64)
        if ts.size > 4 * self.n and bool(np.all(ts[1:] >= ts[:-1])):
            # time-ordered: find the epochs' starts in ts (n lookups, not ts.size)
            first = np.searchsorted(ts, self.starts, side="left")
            i = np.repeat(np.arange(-1, self.n), np.diff(first, prepend=0, append=ts.size))
        else:
            i = np.searchsorted(self.starts, ts, side="right") - 1
        inside = (i >= 0) & (ts < self.ends[np.maximum(i, 0)])
        return np.where(inside, i, self.n)


def _epochs(epochs: pd.DataFrame) -> _Epochs:
    """Validate and sort an epochs table (epoch, start_ns, end_ns). An NA end_ns ends at
    the next epoch's start (the last: never)."""
    for c in ("epoch", "start_ns", "end_ns"):
        if c not in epochs.columns:
            raise InputError(f"epochs table lacks column {c}")
    if epochs["start_ns"].isna().any() or epochs["epoch"].isna().any():
        raise InputError("epochs table: NA epoch or start_ns")
    e = epochs[["epoch", "start_ns", "end_ns"]]
    labels = e["epoch"].to_numpy(np.int64)
    starts = e["start_ns"].to_numpy(np.int64)
    big = np.iinfo(np.int64).max
    ends_na = e["end_ns"].isna().to_numpy()
    ends = e["end_ns"].astype("Int64").to_numpy(np.int64, na_value=big)
    if len(np.unique(labels)) != labels.size:
        raise InputError("epochs table: duplicate epoch labels")
    order = np.lexsort((ends, starts))
    labels, starts, ends, ends_na = labels[order], starts[order], ends[order], ends_na[order]
    nxt = np.r_[starts[1:], big]
    ends = np.where(ends_na, nxt, ends)
    if (ends < starts).any():
        raise InputError("epochs table: an epoch ends before it starts")
    if (ends[:-1] > starts[1:]).any():
        raise InputError("epochs table: epochs overlap (an epoch's end_ns is after the next one's start_ns)")
    return _Epochs(labels, starts, ends)


# -- attribution -------------------------------------------------------------------------------

_ATTR_COLS = ["expert_id", "kind", "pages", "re_added_pages", "evictor"]


def attribute_page_events(source: Source, n_experts_total: int, epochs: pd.DataFrame | None = None,
                          batch_rows: int = 1 << 20) -> PageEventAttribution:
    """Pages added / evicted (by evictor class) / re-added, and events, per expert of a
    page-event stream, and per (epoch, expert) when ``epochs`` is given.

    ``source``: a page_events Parquet path (or ParquetFile), read in batches of
    ``batch_rows`` rows; or a pyarrow Table / RecordBatch / pandas DataFrame with the
    same columns (tests). ``n_experts_total``: experts of the pool (layers x experts);
    expert_id >= it is unattributed. ``epochs``: an epochs table (``epoch``,
    ``start_ns``, ``end_ns``; extra columns ignored): an event belongs to the epoch
    whose [start_ns, end_ns) holds its ts_ns (NA end_ns: until the next epoch's
    start); epochs must not overlap.

    Memory: one batch plus (n_experts_total + 1) x 11 int64 accumulators without
    epochs. With epochs, a dense (n_experts_total + 1) x 14 int64 block per epoch
    the current batch touches; a block the stream has passed keeps only its rows with
    events (the result's rows), so memory follows the size of the per-epoch result,
    never the stream's length. Any event order gives the same result; a time-ordered
    stream is the fast one (an unordered batch is sorted by epoch first).

    Deletes with an NA or unknown evictor count in evicted_pages / delete_events only.
    Raises InputError for a missing column, NA in an integer column, or a kind other
    than 'add' / 'delete'. See :class:`PageEventAttribution` for the tables.
    """
    n_total = int(n_experts_total)
    if n_total < 0:
        raise UsageError(f"n_experts_total must be >= 0 (got {n_experts_total})")
    n1 = n_total + 1
    ep = _epochs(epochs) if epochs is not None else None
    cols = _ATTR_COLS + (["ts_ns"] if ep is not None else [])
    pg_acc = np.zeros((n1, _NCLS), np.int64)
    ev_acc = np.zeros((n1, _NCLS), np.int64)
    ra_acc = np.zeros(n1, np.int64)
    acc = _EpochCounts(n1, ep.n) if ep is not None else None
    # epoch positions per dense reduction: at most _DENSE_SLOTS bins per bincount
    width = max(1, _DENSE_SLOTS // (n1 * _NCLS))
    events = outside = batches = 0
    for batch in iter_batches(source, cols, batch_rows):
        batches += 1
        n = batch.num_rows
        if n == 0:
            continue
        events += n
        eid = _int_column(batch.column(0), "expert_id")
        kind = _kind_codes(batch.column(1))
        pages = _int_column(batch.column(2), "pages")
        re_added = _int_column(batch.column(3), "re_added_pages")
        evc = _codes(batch.column(4), _EVICTOR_CLS, _UNKNOWN_EVICTOR)
        cls = evc * kind  # add (kind 0) -> class 0; delete -> its evictor class
        e = np.minimum(eid, n_total).astype(np.int64)
        if acc is None:
            pg, ev, ra = _reduce(e, n1, cls, pages, re_added)
            pg_acc += pg
            ev_acc += ev
            ra_acc += ra
            continue
        pos = ep.positions(_int_column(batch.column(5), "ts_ns").view(np.int64))
        outside += int(np.count_nonzero(pos == ep.n))
        if not bool(np.all(pos[1:] >= pos[:-1])):
            order = np.argsort(pos, kind="stable")
            pos, e, cls, pages, re_added = pos[order], e[order], cls[order], pages[order], re_added[order]
        a = 0
        while a < n:  # runs of at most `width` epoch positions, each counted densely
            p0 = int(pos[a])
            b = int(np.searchsorted(pos, p0 + width, side="left"))
            span = (int(pos[b - 1]) - p0 + 1) * n1
            pg, ev, ra = _reduce((pos[a:b] - p0) * n1 + e[a:b], span, cls[a:b], pages[a:b], re_added[a:b])
            acc.add(p0, _count_matrix(pg, ev, ra))
            a = b
        acc.flush_before(int(pos[0]))
    if acc is None:
        counts = _count_matrix(pg_acc, ev_acc, ra_acc)
        return PageEventAttribution(_experts_frame(counts, n_total), None, events, None, batches)
    keys, vals = acc.result()
    pos, eid = np.divmod(keys, n1)
    inside = pos < ep.n
    lab = np.zeros(pos.size, np.int64)
    lab[inside] = ep.labels[pos[inside]]
    label = pd.array(lab, dtype="Int32")
    label[~inside] = pd.NA
    by_epoch = pd.concat([pd.DataFrame({"epoch": label}), _id_frame(eid, n_total),
                          _count_frame(vals, eid >= n_total)], axis=1)
    return PageEventAttribution(_experts_frame(acc.totals, n_total), by_epoch, events, outside, batches)


def _id_frame(eid: np.ndarray, n_total: int) -> pd.DataFrame:
    un = eid >= n_total
    ids = pd.array(eid, dtype="Int64")
    ids[un] = pd.NA
    kind = pc.take(pa.array(["expert", "unattributed"], pa.large_string()), pa.array(un.view(np.int8)))
    return pd.DataFrame({"kind": pd.array(kind, dtype="string"), "expert_id": ids})


def _count_frame(cols: list[np.ndarray], unattributed: np.ndarray) -> pd.DataFrame:
    """Int64 count columns (no copy of the int64 arrays); re_added_pages NA where unattributed."""
    n = unattributed.size
    out = {c: pd.arrays.IntegerArray(np.ascontiguousarray(v, np.int64),
                                     unattributed.copy() if c == "re_added_pages" else np.zeros(n, np.bool_))
           for c, v in zip(COUNT_COLUMNS, cols)}
    return pd.DataFrame(out, copy=False)


def _experts_frame(counts: np.ndarray, n_total: int) -> pd.DataFrame:
    eid = np.arange(n_total + 1, dtype=np.int64)
    return pd.concat([_id_frame(eid, n_total), _count_frame(list(counts.T), eid >= n_total)], axis=1)


# -- re-reads within an epoch ------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _reread_kernel(eid, is_del, first, pages, pos, n_epochs, n_total, ppe, state, out):  # pragma: no cover
    """Walk one batch in stream order. state[page] = 0 (never added) or 2 * (pos + 1) +
    (1 if deleted since that add), pos the epoch position of the add (n_epochs: none);
    out[pos, eid] += pages of an add whose previous add was in the same epoch with a
    delete in between. Returns the pages beyond the expert (not followed)."""
    bad = 0
    for i in range(eid.size):
        e = eid[i]
        if e >= n_total:
            continue
        f = first[i]
        n = pages[i]
        if f + n > ppe:
            bad += f + n - ppe if f < ppe else n
            n = ppe - f if f < ppe else 0
        base = e * ppe + f
        if is_del[i]:
            for p in range(base, base + n):
                state[p] |= 1 if state[p] != 0 else 0
        else:
            s = pos[i]
            tag = 2 * (s + 1)
            cnt = 0
            for p in range(base, base + n):
                if state[p] == tag + 1:
                    cnt += 1
                state[p] = tag
            if cnt and s < n_epochs:
                out[s, e] += cnt
    return bad


def count_epoch_rereads(source: Source, n_experts_total: int, pages_per_expert: int, epochs: pd.DataFrame,
                        batch_rows: int = 1 << 20) -> pd.DataFrame:
    """Pages read again within one epoch: per (epoch, expert), the pages of adds whose
    page was added before *in the same epoch* and deleted since (add, delete, add
    again, all inside the epoch's [start_ns, end_ns)). Pages cached before their first
    add in the epoch, and adds outside every epoch, never count.

    Exact per page: one int32 state per pool page (``n_experts_total x
    pages_per_expert`` x 4 bytes, e.g. 64 MiB for 4096 experts of 16 MiB) plus an
    int64 (epochs x n_experts_total) result array and one batch; the stream is walked
    in its order (the recorder's ring order; a delete and an add of one page are
    never reordered in practice: the kernel serialises them on the page). Columns
    read: expert_id, kind, first_page_index (page within the expert), pages, ts_ns.
    Unattributed rows are skipped (no page identity).

    Returns ``epoch`` (Int32 label), ``kind`` ('expert'), ``expert_id`` (Int64),
    ``reread_pages`` (Int64): the rows with a nonzero count, by epoch then expert.
    Raises InputError when a piece reaches beyond ``pages_per_expert``.
    """
    n_total, ppe = int(n_experts_total), int(pages_per_expert)
    if n_total < 0 or ppe < 1:
        raise UsageError(f"need n_experts_total >= 0 and pages_per_expert >= 1 (got {n_total}, {ppe})")
    ep = _epochs(epochs)
    state = np.zeros(n_total * ppe, np.int32)
    out = np.zeros((max(ep.n, 1), n_total), np.int64)
    bad = 0
    cols = ["expert_id", "kind", "first_page_index", "pages", "ts_ns"]
    for batch in iter_batches(source, cols, batch_rows):
        if batch.num_rows == 0:
            continue
        eid = _int_column(batch.column(0), "expert_id").astype(np.int64)
        is_del = _kind_codes(batch.column(1)).astype(np.bool_)
        first = _int_column(batch.column(2), "first_page_index").astype(np.int64)
        pages = _int_column(batch.column(3), "pages").astype(np.int64)
        pos = ep.positions(_int_column(batch.column(4), "ts_ns").view(np.int64))
        bad += _reread_kernel(eid, is_del, first, pages, pos, ep.n, n_total, ppe, state, out)
    if bad:
        raise InputError(f"page events: {bad} page(s) beyond pages_per_expert = {ppe}",
                         hint="pass the pool's pages per expert (its extent in pages)")
    pos, eid = np.nonzero(out[: ep.n])
    return pd.DataFrame({
        "epoch": pd.array(ep.labels[pos], dtype="Int32"),
        "kind": pd.array(["expert"] * pos.size, dtype="string"),
        "expert_id": pd.array(eid.astype(np.int64), dtype="Int64"),
        "reread_pages": pd.array(out[pos, eid], dtype="Int64"),
    })
