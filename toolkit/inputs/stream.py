"""Engine JSONL traces in bounded memory: the streaming driver of the one typer.

:func:`moetrace.inputs.trace.type_records` types a whole trace held as Python
objects (about 150 bytes per read): what small traces and the importers use.
Production traces (a million tokens of a 92-layer, k=16 model is 1.5 G reads)
go through here instead; both drive the same rules,
:class:`moetrace.inputs.typer.ChunkTyper`:

* :func:`read_chunks` parses the JSONL with pyarrow's streaming JSON reader
  (C++, blocks of ``block_bytes``) into columnar :class:`RecordChunk` s that
  end at step boundaries;
* :class:`TypedStream` types them chunk by chunk, the typer carrying the state
  that crosses chunks (the last step, every request's next token);
* :func:`scan_geometry` is the pre-pass that infers k, the layers present and
  the largest expert when the caller does not give them.

The entry points choose the path: :func:`with_stream` (and :func:`parse_trace`,
``plan.compile_plan``, ``importers.import_to_jsonl`` on top of it) streams a
trace larger than :func:`stream_limit` and returns None for the in-memory path.
Memory is one chunk (``block_bytes`` of JSON, a few hundred MB of arrays at
most) plus the per-request state, whatever the trace's length. Anything the
fast reader cannot take (a request field of mixed types, a huge integer, bad
JSON) goes to the in-memory driver, which reports the file and line --
streaming stays for well-formed traces, errors stay exact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import numpy as np

from moetrace.atomic import atomic_write
from moetrace.errors import InputError, UsageError
from moetrace.inputs.typer import (  # noqa: F401 - ChunkTyper and RecordChunk: re-exported
    MAX_EXPERT,
    MAX_LAYER,
    ChunkTyper,
    RecordChunk,
    line_of,
    max_expert_record,
    no_records,
    resolve_geometry,
)

T = TypeVar("T")
DEFAULT_BLOCK_BYTES = 1 << 20
# engine JSONL traces larger than this take the streaming path (MOETRACE_STREAM_BYTES overrides)
STREAM_BYTES = 8 << 20


class _Fallback(Exception):
    """The fast reader cannot take this file: use the reference parser."""


def read_chunks(path: str | os.PathLike, block_bytes: int = DEFAULT_BLOCK_BYTES,
                requests: dict | None = None, stats: dict | None = None) -> Iterator[RecordChunk]:
    """Stream the records of an engine JSONL trace as chunks of whole steps.

    requests: the name -> code map to extend (shared with the typer). Prefill
    records are dropped (counted in stats["prefill_records"]). Raises _Fallback
    when pyarrow cannot read the file as canonical records (anything unexpected
    from the fast reader -- bad bytes, odd types -- is a fallback: the reference
    parser then names the line).
    """
    try:
        if not _objects_only(str(path)):
            raise _Fallback()
        yield from _read_chunks(path, block_bytes, requests, stats)
    except (InputError, UsageError, _Fallback):
        raise
    except Exception:  # noqa: BLE001 - pyarrow and numpy raise many types on odd input
        raise _Fallback() from None


_PRESCANNED: dict = {}


def _objects_only(path: str, block: int = 16 << 20) -> bool:
    """True when every non-blank line of the file starts with '{' (a JSON object).

    pyarrow's JSON reader (26.0) crashes the process (SIGSEGV) on a block that
    opens with a ``null`` line, so nothing else is handed to it: any other line
    sends the file to the reference parser, which names it. A numpy pass over
    the bytes, remembered per (path, size, mtime) for the process."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    key = (path, st.st_size, st.st_mtime_ns)
    if key in _PRESCANNED:
        return _PRESCANNED[key]
    ok = True
    prev_nl = True  # the file starts a line
    with open(path, "rb") as fh:
        while ok:
            buf = fh.read(block)
            if not buf:
                break
            a = np.frombuffer(buf, np.uint8)
            starts = np.flatnonzero(a == 10) + 1  # bytes that begin a line
            if prev_nl:
                starts = np.concatenate([[0], starts])
            starts = starts[starts < a.size]
            first = a[starts]
            # a line must begin with '{' or be blank ('\n', '\r')
            ok = bool(np.all((first == ord("{")) | (first == 10) | (first == 13)))
            prev_nl = a[-1] == 10
    _PRESCANNED[key] = ok
    return ok


def _read_chunks(path: str | os.PathLike, block_bytes: int, requests: dict | None,
                 stats: dict | None) -> Iterator[RecordChunk]:
    batches = _BatchReader(str(path), block_bytes, requests if requests is not None else {}, stats)
    carry: RecordChunk | None = None
    for chunk in batches:
        if carry is not None:
            chunk = _concat(carry, chunk)
            carry = None
        if len(chunk) == 0:
            continue
        # hold back the last step: the next block may continue it
        last = chunk.step[-1]
        cut = int(np.searchsorted(chunk.step, last, side="left")) if bool(np.all(np.diff(chunk.step) >= 0)) \
            else len(chunk)
        if cut == 0:  # one step filling the block: wait for its end
            carry = chunk
        elif cut == len(chunk):  # unsorted steps (the typer reports them): emit whole
            yield chunk
        else:
            carry = _slice(chunk, cut, len(chunk))
            yield _slice(chunk, 0, cut)
    if carry is not None and len(carry):
        yield carry
    if stats is not None:
        stats["prefill_records"] = batches.prefill
        stats["named"] = bool(batches.named)


class _BatchReader:
    """pyarrow's streaming JSON reader over a trace: one RecordChunk per block (prefill records
    dropped and counted, request names coded through ``requests``); _Fallback for anything
    it cannot read as canonical records."""

    def __init__(self, spath: str, block_bytes: int, requests: dict, stats: dict | None):
        import pyarrow as pa
        import pyarrow.json as pj

        self.requests, self.stats = requests, stats
        self.named: bool | None = None
        self.prefill = 0
        self.base = 0
        schema = pa.schema([("step", pa.int64()), ("layer", pa.int64()), ("experts", pa.list_(pa.int64())),
                            ("phase", pa.string())])
        try:
            self.reader = pj.open_json(spath, read_options=pj.ReadOptions(block_size=block_bytes, use_threads=True),
                                       parse_options=pj.ParseOptions(explicit_schema=schema,
                                                                     unexpected_field_behavior="infer"))
        except OSError as e:
            raise InputError(f"cannot open trace: {e.strerror or e}", path=spath) from None
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            raise _Fallback() from None

    def __iter__(self) -> Iterator[RecordChunk]:
        import pyarrow as pa

        while True:
            try:
                batch = self.reader.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OSError):
                raise _Fallback() from None
            yield self._chunk(batch)

    def _chunk(self, batch) -> RecordChunk:
        import pyarrow as pa

        n = batch.num_rows
        step, layer, ex = batch.column("step"), batch.column("layer"), batch.column("experts")
        if step.null_count or layer.null_count or ex.null_count or (pa.types.is_list(ex.type) and
                                                                    ex.values.null_count):
            raise _Fallback()
        idx = np.arange(self.base, self.base + n, dtype=np.int64)
        self.base += n
        keep = np.ones(n, bool)
        if "phase" in batch.schema.names:
            pre = batch.column("phase").to_numpy(zero_copy_only=False) == "prefill"
            self.prefill += int(pre.sum())
            keep &= ~pre
        vals = self._request_names(batch, keep)
        width = np.diff(ex.offsets.to_numpy()).astype(np.int64)
        flat = ex.values.to_numpy()
        if not keep.all():  # keep only non-prefill records
            flat = flat[np.repeat(keep, width)]
            width = width[keep]
        st = step.to_numpy()[keep]
        codes = self._codes(vals[keep], st.size)
        return RecordChunk(st.astype(np.int64), layer.to_numpy()[keep].astype(np.int64), codes, width,
                           flat.astype(np.int64), idx[keep])

    def _request_names(self, batch, keep: np.ndarray) -> np.ndarray:
        """Per record its request name (None: names none); _Fallback for a mix of both (the
        in-memory driver names the line) or a request of another type."""
        import pandas as pd
        import pyarrow as pa

        n = batch.num_rows
        vals = np.full(n, None, object)
        if "request" in batch.schema.names:
            rq = batch.column("request")
            if not (pa.types.is_string(rq.type) or pa.types.is_integer(rq.type) or pa.types.is_null(rq.type)):
                raise _Fallback()
            if not pa.types.is_null(rq.type):
                vals = rq.cast(pa.string()).to_numpy(zero_copy_only=False)
        present = ~pd.isna(vals[keep]) if keep.any() else np.zeros(0, bool)
        if present.size:
            if self.named is None:
                self.named = bool(present[0])
                if self.stats is not None:
                    self.stats["named"] = self.named
            if (present != self.named).any():
                raise _Fallback()
        return vals

    def _codes(self, names: np.ndarray, n: int) -> np.ndarray:
        """The request codes of the kept records (new names get the next codes)."""
        import pandas as pd

        if not self.named:
            self.requests.setdefault("0", 0)
            return np.zeros(n, np.int32)
        local, uniq = pd.factorize(names)
        glob = np.empty(len(uniq), np.int32)
        for j, name in enumerate(uniq):
            c = self.requests.get(name)
            if c is None:
                c = self.requests[name] = len(self.requests)
            glob[j] = c
        return glob[local] if local.size else np.zeros(0, np.int32)


def _concat(a: RecordChunk, b: RecordChunk) -> RecordChunk:
    return RecordChunk(*(np.concatenate([getattr(a, f), getattr(b, f)]) for f in
                         ("step", "layer", "request", "width", "experts", "index")))


def _slice(c: RecordChunk, i: int, j: int) -> RecordChunk:
    offs = np.concatenate([[0], np.cumsum(c.width)])
    return RecordChunk(c.step[i:j], c.layer[i:j], c.request[i:j], c.width[i:j],
                       c.experts[offs[i]:offs[j]], c.index[i:j])


@dataclass
class Geometry0:
    """What a pre-pass learns: k (smallest width), layers present, largest expert."""

    k: int
    layers: np.ndarray
    max_expert: int
    records: int
    requests: int
    max_expert_at: int = 0  # index of the record holding it (for its line)


def scan_geometry(path: str | os.PathLike, block_bytes: int = DEFAULT_BLOCK_BYTES) -> Geometry0:
    """One fast pass: k, the layers present and the largest expert id."""
    k = None
    seen = np.zeros(0, bool)
    mx = -1
    mx_at = 0
    n = 0
    reqs: dict = {}
    for c in read_chunks(path, block_bytes, reqs):
        if len(c) == 0:
            continue
        w = int(c.width.min())
        k = w if k is None else min(k, w)
        lo, hi = int(c.layer.min()), int(c.layer.max())
        if lo < 0 or hi > MAX_LAYER:
            raise _Fallback()
        if hi >= seen.size:
            seen = np.concatenate([seen, np.zeros(hi + 1 - seen.size, bool)])
        seen[np.unique(c.layer)] = True
        cmx, cat = max_expert_record(c)
        if cmx > mx:
            mx, mx_at = cmx, cat
        n += len(c)
    if k is None:
        raise _Fallback()
    return Geometry0(k, np.flatnonzero(seen), mx, n, len(reqs), mx_at)


def check_k(k: int | None) -> None:
    if k is not None and k <= 0:
        raise UsageError(f"k must be positive, got {k}")


class TypedStream:
    """A whole engine JSONL trace typed chunk by chunk: geometry first (a pre-pass
    when k, layers or experts are not given), then :meth:`tables`, then
    :meth:`accounting` -- what parse_jsonl gives, in bounded memory.

    Raises _Fallback (from the constructor or while iterating) when the fast
    reader cannot take the file; the public entry points (:func:`parse_trace`,
    :func:`compile_stream`, ``importers.import_to_jsonl``) then use the in-memory
    driver of the same typer, which names the line.
    """

    def __init__(self, path: str | os.PathLike, k: int | None = None, n_layers: int | None = None,
                 n_experts: int | None = None, block_bytes: int | None = None):
        self.path = str(path)
        self.block = block_bytes or DEFAULT_BLOCK_BYTES
        check_k(k)
        if k is None or n_layers is None or n_experts is None:
            g0 = scan_geometry(self.path, self.block)
            if g0.k <= 0 or g0.max_expert > MAX_EXPERT:
                raise _Fallback()  # the in-memory driver names the record
            k = g0.k if k is None else k
            where = lambda: f"line {line_of(self.path, g0.max_expert_at)[0]}"  # noqa: E731
            geo = resolve_geometry(n_layers, n_experts, g0.layers, g0.max_expert, where)
        else:
            geo = resolve_geometry(n_layers, n_experts, np.zeros(0, np.int64), -1, str)
        self.layer_map, self.layer_ids, self.notes, self.warnings = geo.layer_map, geo.layer_ids, geo.notes, \
            geo.warnings
        self.k, self.n_layers, self.n_experts = int(k), geo.n_layers, geo.n_experts
        self.requests: dict = {}
        self.reader_stats: dict = {}
        self.typer = ChunkTyper(self.k, self.path, n_layers, n_experts, self.layer_map)

    @property
    def named(self) -> bool:
        """The records name their requests (known once a chunk has been read)."""
        return bool(self.reader_stats.get("named", False))

    def chunks(self) -> Iterator[RecordChunk]:
        """The file's record chunks (request codes of :attr:`requests`), not yet typed."""
        return read_chunks(self.path, self.block, self.requests, self.reader_stats)

    def type_chunk(self, chunk: RecordChunk):
        """The typed table of the next chunk (chunks in file order)."""
        self.typer.set_requests(list(self.requests), self.named)
        return self.typer.type(chunk)

    def tables(self) -> Iterator:
        for chunk in self.chunks():
            yield self.type_chunk(chunk)
        if self.typer.records == 0:
            raise no_records(self.path)

    @property
    def names(self) -> list:
        return list(self.requests) or ["0"]

    def accounting(self) -> dict:
        acc = self.typer.accounting(len(self.requests))
        acc["prefill_records_excluded"] = int(self.reader_stats.get("prefill_records", 0))
        if self.layer_ids is not None:
            acc["layer_ids"] = self.layer_ids
        if self.notes:
            acc["notes"] = list(self.notes)
        if self.warnings:
            acc["warnings"] = list(self.warnings)
        return acc


def stream_limit() -> int:
    """Inputs larger than this many bytes take the streaming path (MOETRACE_STREAM_BYTES, default 8 MiB)."""
    return int(os.environ.get("MOETRACE_STREAM_BYTES", STREAM_BYTES))


def is_streamable(path: str | os.PathLike, limit: int | None = None) -> bool:
    """An engine JSONL (not a typed Parquet) larger than MOETRACE_STREAM_BYTES (default 8 MiB)."""
    limit = stream_limit() if limit is None else limit
    try:
        if os.path.getsize(path) <= limit:
            return False
        with open(path, "rb") as fh:
            return fh.read(4) != b"PAR1"
    except OSError:
        return False


def save_typed(ts: TypedStream, out: str | os.PathLike) -> dict:
    """Type a whole trace into a typed Parquet (TypedTrace.save's format) chunk by
    chunk, atomically; returns the accounting. Raises _Fallback like TypedStream."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from moetrace.inputs.trace import TRACE_SCHEMA

    writer = None
    with atomic_write(out) as tmp:
        try:
            for t in ts.tables():
                tbl = pa.Table.from_pandas(t, preserve_index=False)
                if writer is None:
                    writer = pq.ParquetWriter(tmp, tbl.schema)
                writer.write_table(tbl.cast(writer.schema) if tbl.schema != writer.schema else tbl)
            acc = ts.accounting()
            meta = {"schema": TRACE_SCHEMA, "k": ts.k, "n_layers": ts.n_layers, "n_experts": ts.n_experts,
                    "accounting": acc, "source": ts.path, "requests": [str(x) for x in ts.names]}
            writer.add_key_value_metadata({"moetrace": json.dumps(meta)})
        finally:
            if writer is not None:
                writer.close()
    return acc


def _step_signatures(c: RecordChunk) -> tuple[np.ndarray, list]:
    """(first record index of each step, each step's route signature: its records'
    (layer, expert set, width) in order), as drop_warmup compares steps."""
    new = np.ones(len(c), bool)
    new[1:] = c.step[1:] != c.step[:-1]
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(c))
    offs = np.concatenate([[0], np.cumsum(c.width)])
    sigs = []
    for a, b in zip(starts, ends):
        sigs.append(tuple((int(c.layer[r]), frozenset(c.experts[offs[r]:offs[r + 1]].tolist()), int(c.width[r]))
                          for r in range(a, b)))
    return starts, sigs


class _WarmupFilter:
    """Drops the leading warm-up blocks of a chunked trace as importers.drop_warmup does:
    runs of at least ``min_repeats`` identical steps (same route signature) at the start.
    :meth:`feed` and :meth:`finish` return the parts to write, in order; ``info`` is the
    account (the blocks found become ``candidates`` with ``keep_warmup``)."""

    def __init__(self, min_repeats: int, keep_warmup: bool):
        self.min_repeats, self.keep = min_repeats, keep_warmup
        self.info = {"steps_dropped": 0, "rows_dropped": 0, "records_dropped": 0, "blocks": [],
                     "min_repeats": min_repeats}
        if keep_warmup:
            self.info.update(kept=True, candidates=[])
        self.looking = True
        self.run_sig = None
        self.run_first = None
        self.run_steps: list[RecordChunk] = []  # held back while a leading run may still be warm-up

    def feed(self, c: RecordChunk) -> list[RecordChunk]:
        if not self.looking:
            return [c]
        out: list[RecordChunk] = []
        starts, sigs = _step_signatures(c)
        ends = np.append(starts[1:], len(c))
        for j, sig in enumerate(sigs):
            if self.run_sig is None or sig != self.run_sig:
                if self.run_sig is not None:
                    if len(self.run_steps) < self.min_repeats:
                        self.looking = False
                        held, self.run_steps = self.run_steps, []
                        self._candidates()
                        return out + held + [_slice(c, int(starts[j]), len(c))]
                    out += self._drop_run()
                self.run_sig, self.run_first = sig, int(c.step[starts[j]])
            self.run_steps.append(_slice(c, int(starts[j]), int(ends[j])))
        return out

    def _drop_run(self) -> list[RecordChunk]:
        """The run just ended is warm-up: counted, and returned only to keep it."""
        run, self.run_steps = self.run_steps, []
        self.info["blocks"].append([self.run_first, len(run)])
        self.info["steps_dropped"] += len(run)
        self.info["records_dropped"] += sum(len(s) for s in run)
        self.info["rows_dropped"] += sum(len(s) for s in run)
        return run if self.keep else []

    def _candidates(self) -> None:
        if self.keep:
            self.info["candidates"] = [list(b) for b in self.info["blocks"]]
            self.info.update(steps_dropped=0, records_dropped=0, rows_dropped=0, blocks=[])

    def finish(self, path: str) -> list[RecordChunk]:
        """What is still held at the end of the file (an error if it is all one warm-up run)."""
        if not self.looking:
            return []
        total = self.info["steps_dropped"] + len(self.run_steps)
        self._candidates()
        if len(self.run_steps) >= self.min_repeats and not self.keep:
            raise InputError(f"all {total} steps are one identical route repeated (warm-up junk?)",
                             path=path, hint="pass --keep-warmup to import them anyway")
        return self.run_steps


def _write_chunk(fh, c: RecordChunk, names: list | None) -> int:
    """Write a chunk's records as engine JSONL (with "request" when names is given)."""
    import json

    offs = np.concatenate([[0], np.cumsum(c.width)])
    lines = []
    for r in range(len(c)):
        ex = ", ".join(map(str, c.experts[offs[r]:offs[r + 1]].tolist()))
        if names is not None:
            lines.append('{"step": %d, "layer": %d, "experts": [%s], "request": %s}\n'
                         % (c.step[r], c.layer[r], ex, json.dumps(names[c.request[r]])))
        else:
            lines.append('{"step": %d, "layer": %d, "experts": [%s]}\n' % (c.step[r], c.layer[r], ex))
    fh.write("".join(lines))
    return len(c)


def import_engine_jsonl(path: str | os.PathLike, out: str | os.PathLike, *, keep_warmup: bool = False,
                        min_repeats: int = 16, k: int | None = None, n_layers: int | None = None,
                        n_experts: int | None = None) -> tuple[TypedStream, dict, int]:
    """`trace import` of a canonical engine JSONL in bounded memory (:func:`write_engine_jsonl`).
    Returns (stream, warm-up info, records written). Raises _Fallback like TypedStream."""
    if min_repeats < 2:
        raise UsageError(f"--warmup-min-repeats must be at least 2, got {min_repeats}")
    ts = TypedStream(path, k, n_layers, n_experts)
    info, n_out = write_engine_jsonl(ts, out, keep_warmup=keep_warmup, min_repeats=min_repeats)
    return ts, info, n_out


def write_engine_jsonl(ts: TypedStream, out: str | os.PathLike, *, keep_warmup: bool = False,
                       min_repeats: int = 16) -> tuple[dict, int]:
    """Drop the leading warm-up blocks of ts's trace (as importers.drop_warmup), type every
    chunk (validation and accounting), write the records to ``out`` atomically. Returns
    (warm-up info, records written). Raises _Fallback like TypedStream."""
    wf = _WarmupFilter(min_repeats, keep_warmup)
    n_out = 0
    with atomic_write(out) as tmp:
        with open(tmp, "w") as fh:
            def write(parts: list[RecordChunk]) -> int:
                for part in parts:
                    ts.type_chunk(part)
                return sum(_write_chunk(fh, part, list(ts.requests) if ts.named else None) for part in parts)

            for c in ts.chunks():
                n_out += write(wf.feed(c))
            n_out += write(wf.finish(ts.path))
        if ts.typer.records == 0:
            raise no_records(ts.path)
    return wf.info, n_out


def with_stream(path: str | os.PathLike, use: Callable[[TypedStream], T], k: int | None = None,
                n_layers: int | None = None, n_experts: int | None = None, block_bytes: int | None = None, *,
                force: bool = False) -> T | None:
    """``use(ts)`` over the trace typed chunk by chunk (a :class:`TypedStream`), or None when
    the trace is for the in-memory driver: not larger than :func:`stream_limit` (unless
    ``force``), a typed Parquet, or a file the fast reader cannot take (the in-memory driver
    of the same typer then reads it and names the line of any error)."""
    if not force and not is_streamable(path):
        return None
    try:
        return use(TypedStream(path, k, n_layers, n_experts, block_bytes))
    except _Fallback:
        return None


def parse_trace(path: str | os.PathLike, out: str | os.PathLike | None = None, k: int | None = None,
                n_layers: int | None = None, n_experts: int | None = None) -> dict:
    """Type an engine JSONL trace and write its typed Parquet to ``out`` (when given): in
    bounded memory when the trace is large, in memory otherwise (the same rules, the same
    result). Returns the accounting with n_layers, n_experts and source."""
    from moetrace.inputs.trace import parse_jsonl

    def streamed(ts: TypedStream) -> dict:
        if out:
            acc = save_typed(ts, out)
        else:
            for _ in ts.tables():
                pass
            acc = ts.accounting()
        return dict(acc, n_layers=ts.n_layers, n_experts=ts.n_experts, source=str(path))

    acc = with_stream(path, streamed, k, n_layers, n_experts)
    if acc is None:
        tt = parse_jsonl(path, k=k, n_layers=n_layers, n_experts=n_experts)
        if out:
            tt.save(out)
        acc = dict(tt.accounting, n_layers=tt.n_layers, n_experts=tt.n_experts, source=str(path))
    return acc
