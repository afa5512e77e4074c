"""Router traces: the canonical typed parser and the access stream.

Engine format (JSON Lines, one router record per line)::

    {"step": 12, "layer": 3, "experts": [5, 17, ...]}
    {"step": 12, "layer": 3, "experts": [9, 2, ...], "request": "r7"}

``step`` is the engine's forward pass (one iteration of the replay). The
optional ``request`` names the request the token belongs to: a forward pass of
a serving engine runs one token of every running request (a decode batch), so
one step holds one record per (request, layer). A trace without ``request``
fields is one request. Optional ``"phase": "prefill"`` records are excluded.
Within a record the experts are in rank order as routed (the router's top-k
order); moetrace keeps that order (see :data:`ORDERS`).

Records of a step appear in layer order per request. No event tag exists, so
each (step, request) unit is typed from its record widths and from per-layer
duplication (paper §2):

* width k   -> one position (``normal``);
* width 2k  -> two positions, speculation accepted (``spec_accept``, 2 tokens);
* a layer routed twice for one request in one step -> a failed speculation
  (first record, usually width 2k) followed by a fallback pass (width k):
  ``spec_fallback``, 1 accepted token; both passes are replayed as issued.

accepted tokens = normal units + 2 x spec_accept units + spec_fallback units.

Layers are the ones present: a trace that routes only layers 8 and 9 has two
layers, renumbered 0 and 1 (``accounting["layer_ids"]`` keeps the original
ids), unless the caller gives ``n_layers`` (``--layers``), which keeps the ids
as they are and bounds them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np
import pandas as pd

from moetrace.atomic import atomic_write
from moetrace.errors import InputError, UsageError
from moetrace.inputs.typer import (  # noqa: F401 - the typing rules' constants, re-exported
    DEFAULT_REQUEST,
    KIND_DTYPE,
    KINDS,
    MAX_EXPERT,
    MAX_LAYER,
    MAX_STEP,
    WIDE_POOL_WARN,
    ChunkTyper,
    RecordChunk,
    max_expert_record,
    no_records,
    resolve_geometry,
)

TRACE_SCHEMA = "moetrace.typed_trace/2"
_OLD_SCHEMAS = ("moetrace.typed_trace/1",)  # no request/token columns: one request
# (layer, expert) pairs the dense analyses (trace stats, sim) keep a counter for, at most: 2^24,
# a thousand times the largest model's pool; each counter array is then at most 128 MiB.
MAX_DENSE_POOL = 2**24
# The order of the experts a (step, pass, layer) slot reads: as routed (rank
# order, the default whenever a trace keeps it) or ascending expert index.
ORDERS = ("rank", "sorted")


@dataclass
class Record:
    """One router record as read from a file (line/offset for error messages).

    request: the request the token belongs to (None: the trace names none, one
    request). lines: the source line of each expert, for tables with one
    expert per row (errors then name the offending row, not the record's first).
    """

    step: int
    layer: int
    experts: list[int]
    line: int | None = None
    offset: int | None = None
    request: str | None = None
    lines: list[int] | None = None


@dataclass
class TypedTrace:
    """A typed router trace: one row per (step, request, pass, layer, position, expert).

    Columns: step (int64, engine forward pass), request (int32, index into
    ``requests``), token (int32, the token's position within its request,
    0-based over accepted tokens), pass (int8, 0 or 1: 1 is the fallback pass
    of a failed speculation), layer (int16), position (int8, 0 or 1: the second
    position of a spec_accept record), expert (int32, index within the layer),
    kind (normal / spec_accept / spec_fallback), accepted (bool: the selection
    belongs to an accepted token; False for the rejected first pass of a
    spec_fallback unit). Rows keep the file's order, so the experts of a record
    stay in rank order.
    """

    table: pd.DataFrame
    k: int
    n_layers: int
    n_experts: int
    accounting: dict = field(default_factory=dict)
    source: str = ""
    requests: list = field(default_factory=lambda: [DEFAULT_REQUEST])

    @property
    def n_steps(self) -> int:
        return int(self.accounting.get("steps", self.table["step"].nunique()))

    @property
    def n_requests(self) -> int:
        return len(self.requests)

    def save(self, path: str | os.PathLike) -> None:
        """Write the typed trace as Parquet with its accounting in the schema metadata."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        meta = {
            "schema": TRACE_SCHEMA,
            "k": self.k,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "accounting": self.accounting,
            "source": self.source,
            "requests": [str(x) for x in self.requests],
        }
        tbl = pa.Table.from_pandas(self.table, preserve_index=False)
        tbl = tbl.replace_schema_metadata({**(tbl.schema.metadata or {}), b"moetrace": json.dumps(meta).encode()})
        with atomic_write(path, what="typed trace") as tmp:
            pq.write_table(tbl, tmp)

    def request_code(self, name: str) -> int:
        """The code of the request named name (UsageError listing a few names if unknown)."""
        try:
            return [str(x) for x in self.requests].index(str(name))
        except ValueError:
            few = ", ".join(str(x) for x in self.requests[:8]) + (" ..." if len(self.requests) > 8 else "")
            raise UsageError(f"no request {name!r} in {self.source or 'the trace'} "
                             f"({len(self.requests)} requests: {few})") from None

    def select_request(self, name: str) -> "TypedTrace":
        """The trace of one request alone: its rows, steps renumbered by the forward passes it ran in."""
        code = self.request_code(name)
        t = self.table[self.table["request"].to_numpy() == code].reset_index(drop=True)
        t["request"] = np.zeros(len(t), np.int32)
        acc = dict(self.accounting)
        tok = t.loc[t["accepted"], ["token", "position"]]
        acc.update(requests=1, request=str(name), steps=int(t["step"].nunique()),
                   accepted_tokens=int(tok["token"].max()) + 1 if len(tok) else 0, selections=int(len(t)))
        return TypedTrace(t, self.k, self.n_layers, self.n_experts, acc, self.source, [str(name)])

    def accesses(self, order: str = "rank") -> "Accesses":
        """The access stream (see :class:`Accesses`). Its consumers (sim, replay) keep state per
        (layer, expert): a pool larger than MAX_DENSE_POOL pairs is an InputError naming the
        stray expert id that inferred it."""
        check_dense_pool(self.n_layers, self.n_experts, self.source or "the trace", "simulate or replay",
                         self.accounting)
        return accesses_from_table(self.table, self.n_layers, self.n_experts, order=order)

    def tokens(self) -> pd.DataFrame:
        """Accepted-token selections: columns request, token (position within the
        request), layer, expert, in (step, request) order."""
        t = self.table[self.table["accepted"]]
        return pd.DataFrame({"request": t["request"].to_numpy(np.int32), "token": t["token"].to_numpy(np.int64),
                             "layer": t["layer"].to_numpy(), "expert": t["expert"].to_numpy()})

    def stream_tokens(self) -> pd.DataFrame:
        """The pooled stream: every accepted token of every request read as one token
        sequence, in (step, request, position) order. Columns token, layer, expert.
        For a one-request trace this equals tokens()."""
        t = self.table[self.table["accepted"]]
        step = t["step"].to_numpy(np.int64)
        req = t["request"].to_numpy(np.int64)
        tok = t["token"].to_numpy(np.int64)
        order = np.lexsort((tok, req, step))
        key = np.empty(order.size, np.int64)
        if order.size:
            s, r, k_ = step[order], req[order], tok[order]
            new = np.ones(order.size, bool)
            new[1:] = (s[1:] != s[:-1]) | (r[1:] != r[:-1]) | (k_[1:] != k_[:-1])
            key[order] = np.cumsum(new) - 1
        return pd.DataFrame({"token": key, "layer": t["layer"].to_numpy(), "expert": t["expert"].to_numpy()})


def check_dense_pool(n_layers: int, n_experts: int, path: str, what: str, accounting: dict | None = None) -> None:
    """InputError when a pool of n_layers x n_experts is too large for an analysis that keeps a
    counter per (layer, expert) (``what``: "compute statistics", "simulate"): the pool of a
    trace is inferred from its largest expert id, so one stray id would make the analysis
    allocate gigabytes. The error names the id and its line when the parser warned about it."""
    if n_layers * n_experts <= MAX_DENSE_POOL:
        return
    import re

    line = None
    culprit = ""
    for w in (accounting or {}).get("warnings", []):
        m = re.match(r"expert id (\d+) \(line (\d+)\)", w) if isinstance(w, str) else None
        if m:
            culprit, line = f"expert id {m.group(1)} makes ", int(m.group(2))
            break
    raise InputError(f"{culprit}a pool of {n_layers} layers x {n_experts:,} experts, too large to {what} "
                     f"(at most {MAX_DENSE_POOL:,} (layer, expert) pairs)", path=path, line=line,
                     hint="is the largest expert id a stray value? Give --experts N (or a geometry preset) "
                          "for the model's pool")


def _fail(msg: str, rec: Record | None, path: str | None, hint: str | None = None,
          expert_index: int | None = None) -> InputError:
    line = rec.line if rec else None
    if rec is not None and expert_index is not None and rec.lines is not None and expert_index < len(rec.lines):
        line = rec.lines[expert_index]
    return InputError(msg, path=path, line=line, offset=rec.offset if rec and line == rec.line else None,
                      hint=hint)


UTF8_BOM = b"\xef\xbb\xbf"


def utf16_error(head: bytes, path: str) -> InputError | None:
    """The error for a text file that opens with a UTF-16 (or UTF-32) byte order mark, else None.
    (A UTF-8 byte order mark is harmless: readers skip it.)"""
    if head.startswith((b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")):
        return InputError("UTF-16 text (a byte order mark opens the file), not UTF-8", path=path, line=1, offset=0,
                          hint="save the file as UTF-8")
    return None


def valid_text(v: object) -> bool:
    """False for a string no UTF-8 writer can write: one holding a lone surrogate (JSON's
    "\\ud800" escape reads as one)."""
    if not isinstance(v, str):
        return True
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_lines(path: str, prefix: str = "", invalid: str = "not valid JSON") -> Iterator[tuple[int, int, object]]:
    """(line number, byte offset, decoded value) of every non-blank line of a JSON Lines file.

    Strict UTF-8 (a BOM allowed on line 1; UTF-16 refused on line 1); a line that
    is not UTF-8 or not JSON is an InputError with its line, column and offset,
    its message starting with prefix."""
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot open trace: {e.strerror}", path=path) from None
    with fh:
        offset = 0
        for lineno, raw in enumerate(fh, 1):
            start = offset
            offset += len(raw)
            if lineno == 1:
                err = utf16_error(raw, path)
                if err is not None:
                    raise err
            s = raw.strip()
            if not s:
                continue
            try:
                # strict UTF-8 (json.loads of bytes would let encoded surrogates through)
                obj = json.loads(s.decode("utf-8").lstrip("\ufeff") if lineno == 1 else s.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise InputError(f"{prefix}not UTF-8 text (byte 0x{s[e.start]:02x} at column {e.start + 1})",
                                 path=path, line=lineno, offset=start + e.start) from None
            except (ValueError, RecursionError) as e:
                col = getattr(e, "colno", None)
                raise InputError(f"{prefix}{invalid} ({getattr(e, 'msg', type(e).__name__)}"
                                 + (f" at column {col})" if col else ")"), path=path, line=lineno,
                                 offset=start) from None
            yield lineno, start, obj


def read_jsonl(path: str | os.PathLike, stats: dict | None = None) -> Iterator[Record]:
    """Stream engine-format records from a JSONL file, skipping prefill records
    (counted in stats["prefill_records"] when a dict is given).

    Raises InputError with the line (and column) of a malformed record.
    """
    spath = str(path)
    for lineno, start, obj in json_lines(spath):
        if not isinstance(obj, dict):
            raise InputError("a record must be a JSON object with step, layer, experts",
                             path=spath, line=lineno, offset=start)
        if obj.get("phase") == "prefill":
            if stats is not None:
                stats["prefill_records"] = stats.get("prefill_records", 0) + 1
            continue
        try:
            step, layer, experts = obj["step"], obj["layer"], obj["experts"]
        except KeyError as e:
            hint = None
            if obj.get("type") in ("meta", "route") or "topk_ids" in obj:
                hint = "this is an engine routing log: convert it with `moetrace trace import`"
            raise InputError(f"record lacks the field {e.args[0]!r}", path=spath, line=lineno,
                             offset=start, hint=hint) from None
        if not (_is_int(step) and _is_int(layer)):
            raise InputError("step and layer must be integers", path=spath, line=lineno, offset=start)
        if not isinstance(experts, list) or not all(_is_int(x) for x in experts):
            raise InputError("experts must be a list of integers", path=spath, line=lineno, offset=start)
        req = obj.get("request")
        if req is not None:
            if isinstance(req, bool) or not isinstance(req, (str, int)) or not valid_text(req):
                raise InputError("request must be a string (of valid Unicode: no lone surrogate) or an integer",
                                 path=spath, line=lineno, offset=start)
            req = str(req)
        yield Record(step, layer, experts, lineno, start, req)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def type_records(
    records: Iterable[Record],
    k: int | None = None,
    n_layers: int | None = None,
    n_experts: int | None = None,
    path: str | None = None,
    excluded: dict | None = None,
) -> TypedTrace:
    """Type engine records as normal / spec_accept / spec_fallback (module docstring).

    k is inferred as the smallest record width when not given; n_layers and
    n_experts, when given, bound the layer and expert indices (else inferred:
    the layers present, renumbered densely, and the largest expert + 1, with a
    warning in accounting["warnings"] when that is implausibly wide). Raises
    InputError (with file and line) for widths that are neither k nor 2k,
    unknown or out-of-range layers or experts, a step going backwards, a layer
    routed three times for one request in one step, inconsistent widths within
    one unit, or records that name a request mixed with records that do not.

    The records are typed as one chunk by :class:`moetrace.inputs.typer.ChunkTyper`,
    the rules the streaming path (moetrace.inputs.stream) applies chunk by chunk.
    """
    recs = records if isinstance(records, list) else list(records)
    if not recs:
        raise no_records(path)
    chunk, names = _records_chunk(recs)
    k = _check_sizes(chunk, recs, k, n_layers, n_experts, path)
    typer = ChunkTyper(k, path, n_layers, n_experts, source=recs)
    typer.set_requests(names, recs[0].request is not None)
    table = typer.type(chunk)
    mx, at = max_expert_record(chunk)
    geo = resolve_geometry(n_layers, n_experts, np.unique(chunk.layer), mx, lambda: _where(recs, at, mx))
    if geo.layer_map is not None:
        table["layer"] = geo.layer_map[table["layer"].to_numpy(np.int64)].astype(np.int16)
    accounting = typer.accounting(len(names))
    for key, v in (("layer_ids", geo.layer_ids), ("notes", geo.notes), ("warnings", geo.warnings),
                   ("excluded", dict(excluded) if excluded else None)):
        if v:
            accounting[key] = v
    return TypedTrace(table, int(k), geo.n_layers, geo.n_experts, accounting, path or "",
                      names if recs[0].request is not None else [DEFAULT_REQUEST])


def _check_sizes(chunk: RecordChunk, recs: list[Record], k: int | None, n_layers: int | None,
                 n_experts: int | None, path: str | None) -> int:
    """k as given, else the smallest record width; UsageError for a size that is not positive."""
    if k is None:
        k = int(chunk.width.min())
        if k <= 0:
            raise _fail("a record has no experts", recs[int(chunk.width.argmin())], path)
    elif k <= 0:
        raise UsageError(f"k must be positive, got {k}")
    for name, v in (("layers", n_layers), ("experts", n_experts)):
        if v is not None and v <= 0:
            raise UsageError(f"--{name} must be positive, got {v}")
    return int(k)


_I64 = (-(2**63), 2**63 - 1)


def _int64(values: Callable[[], Iterable[int]], count: int) -> np.ndarray:
    """An int64 array of the ints ``values()`` yields; values beyond int64 are clipped to its bounds
    (each such value is out of every range the typer accepts, and its error quotes the record
    as read)."""
    try:
        return np.fromiter(values(), np.int64, count)
    except OverflowError:
        return np.fromiter((min(max(int(v), _I64[0]), _I64[1]) for v in values()), np.int64, count)


def _records_chunk(recs: list[Record]) -> tuple[RecordChunk, list[str]]:
    """The records as one columnar chunk, and the request names in order of appearance."""
    n = len(recs)
    width = np.fromiter((len(r.experts) for r in recs), np.int64, n)
    has = np.fromiter((r.request is not None for r in recs), bool, n)
    names: list[str] = []
    codes = np.zeros(n, np.int32)
    if has[0]:
        code, uniq = pd.factorize(np.array([r.request for r in recs], dtype=object), use_na_sentinel=True)
        names = [str(x) for x in uniq]
        codes = np.maximum(code, 0).astype(np.int32)
    chunk = RecordChunk(_int64(lambda: (r.step for r in recs), n), _int64(lambda: (r.layer for r in recs), n),
                        codes, width, _int64(lambda: (x for r in recs for x in r.experts), int(width.sum())),
                        np.arange(n, dtype=np.int64), has if not has.all() and has.any() else None)
    return chunk, names or [DEFAULT_REQUEST]


def _where(recs: list[Record], at: int, expert: int) -> str:
    """Where a record's expert id was read: its line (of its row, for one-expert-per-row tables)."""
    r = recs[at]
    if r.lines:
        return f"line {r.lines[r.experts.index(expert)]}"
    return f"line {r.line}" if r.line else f"record {at}"


def parse_jsonl(path: str | os.PathLike, k: int | None = None, n_layers: int | None = None,
                n_experts: int | None = None) -> TypedTrace:
    """Parse and type an engine JSONL trace (see the module docstring)."""
    stats = {"prefill_records": 0}
    tt = type_records(read_jsonl(path, stats), k=k, n_layers=n_layers, n_experts=n_experts,
                      path=str(path))
    tt.accounting["prefill_records_excluded"] = stats["prefill_records"]
    return tt


def write_jsonl(records: Iterable[tuple[int, int, Iterable[int]]], path: str | os.PathLike) -> int:
    """Write (step, layer, experts) records in engine JSONL format, atomically. Returns the count."""
    return write_records((Record(int(st), int(lay), list(ex)) for st, lay, ex in records), path)


def _upgrade_v1(df: pd.DataFrame) -> pd.DataFrame:
    """A typed table of schema 1 (no request/token columns) as one request."""
    step = df["step"].to_numpy(np.int64)
    pos = df["position"].to_numpy(np.int64)
    acc = df["accepted"].to_numpy(bool)
    tok = step * 2 + pos
    codes = np.zeros(len(df), np.int64)
    if acc.any():
        u = np.unique(tok[acc])
        codes = np.searchsorted(u, tok)
    df.insert(1, "request", np.zeros(len(df), np.int32))
    df.insert(2, "token", codes.astype(np.int32))
    return df


_TABLE_COLUMNS = ("step", "request", "token", "pass", "layer", "position", "expert", "kind", "accepted")


def _meta_int(meta: dict, key: str) -> int:
    """An integer of a typed trace's metadata (TypeError for anything else: a damaged trace)."""
    v = meta[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{key} is {json.dumps(v)[:40]}, not an integer")
    return v


_INT_COLUMNS = ("step", "request", "token", "pass", "layer", "position", "expert")
# accounting keys consumers read, with the type they read them as
_ACCOUNTING_INTS = ("steps", "accepted_tokens", "records", "selections", "requests", "passes", "k")
_ACCOUNTING_TEXTS = ("warnings", "notes")


def _check_table(tt: TypedTrace) -> None:
    """A loaded typed table holds the columns, types and ranges its metadata promises, so
    every consumer (stats, sim, plan compile) can read it; InputError naming the file if not."""
    df = tt.table
    src = tt.source
    missing = [c for c in _TABLE_COLUMNS if c not in df.columns]
    if missing:
        raise InputError(f"the typed trace lacks the columns {missing}", path=src)
    if not (1 <= tt.k <= MAX_EXPERT + 1 and 1 <= tt.n_layers <= MAX_LAYER + 1
            and 1 <= tt.n_experts <= MAX_EXPERT + 1):
        raise InputError(f"the typed trace's geometry is invalid (k={tt.k}, {tt.n_layers} layers, "
                         f"{tt.n_experts} experts)", path=src)
    if not len(df):
        raise InputError("the typed trace holds no rows", path=src)
    for col in _INT_COLUMNS:
        if df[col].dtype.kind not in "iu":
            raise InputError(f"the typed trace's {col} column holds {df[col].dtype} values, not integers",
                             path=src, hint="re-create it with `moetrace trace parse`")
    if df["accepted"].dtype.kind != "b":
        raise InputError(f"the typed trace's accepted column holds {df['accepted'].dtype} values, not booleans",
                         path=src)
    if df["kind"].isna().any():
        i = int(np.argmax(df["kind"].isna().to_numpy()))
        raise InputError(f"the typed trace's kind column holds a value other than {', '.join(KINDS)} (row {i})",
                         path=src)
    for col, lo, hi in (("step", -MAX_STEP, MAX_STEP + 1), ("layer", 0, tt.n_layers), ("expert", 0, tt.n_experts),
                        ("request", 0, len(tt.requests)), ("token", 0, 2**31 - 1), ("pass", 0, 2),
                        ("position", 0, 2)):
        v = df[col].to_numpy()
        if v.min() < lo or v.max() >= hi:
            raise InputError(f"the typed trace's {col} column holds {int(v.min() if v.min() < lo else v.max())}, "
                             f"outside {lo}-{hi - 1}", path=src)
    for key in _ACCOUNTING_INTS:
        v = tt.accounting.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_STEP:
            raise InputError(f"the typed trace's accounting.{key} is {json.dumps(v)[:40]}, not a count", path=src)
    for key in _ACCOUNTING_TEXTS:
        v = tt.accounting.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise InputError(f"the typed trace's accounting.{key} is not a list of strings", path=src)


def write_records(records: Iterable[Record], path: str | os.PathLike) -> int:
    """Write records in engine JSONL format (with "request" when they name one), atomically.
    Returns the count."""
    n = 0
    with atomic_write(path, what="trace") as tmp, open(tmp, "w") as fh:
        for r in records:
            ex = ", ".join(str(int(x)) for x in r.experts)
            if r.request is None:
                fh.write('{"step": %d, "layer": %d, "experts": [%s]}\n' % (r.step, r.layer, ex))
            else:
                fh.write('{"step": %d, "layer": %d, "experts": [%s], "request": %s}\n'
                         % (r.step, r.layer, ex, json.dumps(r.request)))
            n += 1
    return n


def load_trace(path: str | os.PathLike, k: int | None = None, n_layers: int | None = None,
               n_experts: int | None = None) -> TypedTrace:
    """Load a typed trace (.parquet written by `trace parse`) or parse an engine JSONL."""
    spath = str(path)
    if not os.path.exists(spath):
        raise InputError("no such file", path=spath)
    if os.path.isdir(spath):
        raise InputError("is a directory, not a trace", path=spath)
    try:
        with open(spath, "rb") as fh:
            head = fh.read(4)
    except OSError as e:
        raise InputError(f"cannot open trace: {e.strerror}", path=spath) from None
    if head == b"PAR1":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            tbl = pq.read_table(spath)
        except Exception as e:  # pyarrow raises several types for damaged files
            raise InputError(f"cannot read Parquet: {e}", path=spath) from None
        raw = (tbl.schema.metadata or {}).get(b"moetrace")
        if raw is None:  # a typed trace written chunk by chunk keeps it in the file's key-value metadata
            try:
                raw = (pq.ParquetFile(spath).metadata.metadata or {}).get(b"moetrace", b"{}")
            except Exception:  # noqa: BLE001 - read_table succeeded; a missing footer key means not ours
                raw = b"{}"
        try:
            meta = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            meta = {}
        if not isinstance(meta, dict) or meta.get("schema") not in (TRACE_SCHEMA, *_OLD_SCHEMAS):
            raise InputError("Parquet file is not a moetrace typed trace", path=spath,
                             hint="make one with `moetrace trace parse TRACE.jsonl -o typed.parquet`")
        try:
            df = tbl.to_pandas()
            if meta["schema"] in _OLD_SCHEMAS:
                df = _upgrade_v1(df)
            odd = [v for v in pd.unique(df["kind"].astype(object)) if not (isinstance(v, str) and v in KINDS)]
            if odd:
                raise InputError(f"the typed trace's kind column holds {str(odd[0])[:40]!r}, not one of "
                                 f"{', '.join(KINDS)}", path=spath)
            df["kind"] = df["kind"].astype(KIND_DTYPE)
            requests = meta.get("requests", [DEFAULT_REQUEST])
            if not isinstance(requests, list):
                raise TypeError(f"requests is of type {type(requests).__name__}, not a list")
            tt = TypedTrace(df, _meta_int(meta, "k"), _meta_int(meta, "n_layers"), _meta_int(meta, "n_experts"),
                            dict(meta["accounting"]), spath, [str(x) for x in requests])
            _check_table(tt)
        except InputError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError, NotImplementedError,
                pa.ArrowException) as e:
            raise InputError(f"damaged typed trace ({type(e).__name__}: {e})", path=spath,
                             hint="re-create it with `moetrace trace parse`") from None
        if k is not None and k != tt.k:
            raise InputError(f"the typed trace has k={tt.k}, not {k}", path=spath)
        for name, given, col in (("layers", n_layers, "layer"), ("experts per layer", n_experts, "expert")):
            if given is not None:
                top = int(df[col].max()) if len(df) else -1
                if top >= given:
                    raise InputError(f"unknown {col} {top} (the geometry has {given} {name})", path=spath)
        tt.n_layers = n_layers if n_layers is not None else tt.n_layers
        tt.n_experts = n_experts if n_experts is not None else tt.n_experts
        return tt
    return parse_jsonl(spath, k=k, n_layers=n_layers, n_experts=n_experts)


@dataclass
class Accesses:
    """The replay's access stream: per (iteration, pass, layer) the set of experts read.

    Canonical order: sorted by (iteration, pass, layer), each expert at most
    once per (iteration, pass, layer) -- a spec_accept record's two positions,
    and the requests of a batch, read the union of their experts once. Within
    a slot the experts are ascending (order "sorted") or as routed (order
    "rank": by the best rank any request gave them). iteration is a dense
    0-based engine-iteration (forward pass) index.
    """

    iteration: np.ndarray  # int32
    pass_: np.ndarray  # int8
    layer: np.ndarray  # int16
    expert: np.ndarray  # int32
    n_layers: int
    n_experts: int
    n_iterations: int
    order: str = "sorted"

    def __len__(self) -> int:
        return int(self.expert.size)

    @property
    def expert_id(self) -> np.ndarray:
        """Global id layer * n_experts + expert (int32 when it fits)."""
        dt = np.int32 if self.n_layers * self.n_experts < 2**31 else np.int64
        return self.layer.astype(dt) * dt(self.n_experts) + self.expert.astype(dt)

    def head(self, n_iterations: int) -> "Accesses":
        """The first n_iterations iterations."""
        cut = int(np.searchsorted(self.iteration, n_iterations, side="left"))
        return Accesses(self.iteration[:cut], self.pass_[:cut], self.layer[:cut], self.expert[:cut],
                        self.n_layers, self.n_experts, min(n_iterations, self.n_iterations), self.order)


def _record_rank(table: pd.DataFrame, k: int | None = None) -> np.ndarray:
    """Each row's rank within its record (0 = the router's first choice): rows of a
    record are contiguous and share (step, request, pass, layer); the second
    position of a 2k record ranks again from 0."""
    n = len(table)
    if n == 0:
        return np.zeros(0, np.int64)
    cols = [table[c].to_numpy() for c in ("step", "request", "pass", "layer") if c in table.columns]
    new = np.zeros(n, bool)
    new[0] = True
    for c in cols:
        new[1:] |= c[1:] != c[:-1]
    start = np.maximum.accumulate(np.where(new, np.arange(n), 0))
    rank = np.arange(n) - start
    if "position" in table.columns:
        pos = table["position"].to_numpy(np.int64)
        if pos.any():
            # the second position starts where position turns 1 within the record
            new2 = new.copy()
            new2[1:] |= pos[1:] != pos[:-1]
            start2 = np.maximum.accumulate(np.where(new2, np.arange(n), 0))
            rank = np.arange(n) - start2
    return rank


def accesses_from_table(table: pd.DataFrame, n_layers: int, n_experts: int, order: str = "sorted") -> Accesses:
    """Deduplicate a typed table into the access stream: per (iteration, pass,
    layer) the union of the experts its rows select (a batch union when several
    requests ran in the step), each once.

    order="sorted": experts ascending within a slot (the canonical order);
    order="rank": as routed -- by the best rank any row gave the expert, ties in
    file order (request order within the step).
    """
    if order not in ORDERS:
        raise UsageError(f"unknown order {order!r}; one of {', '.join(ORDERS)}")
    step = table["step"].to_numpy(np.int64)
    it, _ = pd.factorize(step, sort=True)
    ps = table["pass"].to_numpy(np.int64)
    lay = table["layer"].to_numpy(np.int64)
    ex = table["expert"].to_numpy(np.int64)
    skey = (it.astype(np.int64) * 2 + ps) * n_layers + lay
    key = skey * n_experts + ex
    if order == "sorted":
        key = np.sort(key, kind="stable")
        if key.size:
            key = key[np.concatenate(([True], key[1:] != key[:-1]))]
        ex = key % n_experts
        rest = key // n_experts
    else:
        rank = _record_rank(table)
        o1 = np.lexsort((rank, skey))  # slot order, then best rank, then file order
        pos1 = np.empty_like(o1)
        pos1[o1] = np.arange(o1.size)
        o2 = np.lexsort((pos1, key))  # per (slot, expert): the earliest in o1 first
        first = np.ones(o2.size, bool)
        if o2.size:
            first[1:] = key[o2][1:] != key[o2][:-1]
        keep = o2[first]
        keep = keep[np.argsort(pos1[keep], kind="stable")]
        ex = ex[keep]
        rest = skey[keep]
    lay = rest % n_layers
    rest = rest // n_layers
    ps = rest % 2
    it = rest // 2
    n_it = int(it[-1]) + 1 if it.size else 0
    return Accesses(it.astype(np.int32), ps.astype(np.int8), lay.astype(np.int16), ex.astype(np.int32),
                    n_layers, n_experts, n_it, order)


def merge_accesses(streams: list[Accesses]) -> Accesses:
    """Batch union: iteration i reads, per pass and layer, the union of every stream's
    iteration i; truncated to the shortest stream (the paper's batch-4 union)."""
    if not streams:
        raise UsageError("nothing to merge")
    if len(streams) == 1:
        return streams[0]
    geo = {(s.n_layers, s.n_experts) for s in streams}
    if len(geo) != 1:
        raise UsageError(f"traces of different geometries cannot be merged: {sorted(geo)}")
    n_layers, n_experts = geo.pop()
    n_it = min(s.n_iterations for s in streams)
    parts = [s.head(n_it) for s in streams]
    table = pd.DataFrame({
        "step": np.concatenate([p.iteration for p in parts]),
        "request": np.repeat(np.arange(len(parts), dtype=np.int32), [len(p) for p in parts]),
        "pass": np.concatenate([p.pass_ for p in parts]),
        "layer": np.concatenate([p.layer for p in parts]),
        "expert": np.concatenate([p.expert for p in parts]),
    })
    return accesses_from_table(table, n_layers, n_experts, order=streams[0].order)
