"""Router traces: the canonical typed parser and the access stream.

Engine format (JSON Lines, one router record per line)::

    {"step": 12, "layer": 3, "experts": [5, 17, ...]}

Optional ``"phase": "prefill"`` records are excluded. Records of a step appear
in layer order. No event tag exists, so each record is typed from its width and
from per-layer duplication within a step (paper §2):

* width k   -> one position (``normal``);
* width 2k  -> two positions, speculation accepted (``spec_accept``, 2 tokens);
* a layer routed twice in one step -> a failed speculation (first record,
  usually width 2k) followed by a fallback pass (width k): ``spec_fallback``,
  1 accepted token; both passes are replayed as issued.

accepted tokens = normal steps + 2 x spec_accept steps + spec_fallback steps.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np
import pandas as pd

from moetrace.errors import InputError, UsageError

KINDS = ("normal", "spec_accept", "spec_fallback")
KIND_DTYPE = pd.CategoricalDtype(list(KINDS))
TRACE_SCHEMA = "moetrace.typed_trace/1"


@dataclass
class Record:
    """One router record as read from a file (line/offset for error messages)."""

    step: int
    layer: int
    experts: list[int]
    line: int | None = None
    offset: int | None = None


@dataclass
class TypedTrace:
    """A typed router trace: one row per (step, pass, layer, position, expert).

    Columns: step (int64, engine iteration), pass (int8, 0 or 1: 1 is the
    fallback pass of a failed speculation), layer (int16), position (int8, 0
    or 1: the second position of a spec_accept record), expert (int32, index
    within the layer), kind (normal / spec_accept / spec_fallback), accepted
    (bool: the selection belongs to an accepted token; False for the rejected
    first pass of a spec_fallback step).
    """

    table: pd.DataFrame
    k: int
    n_layers: int
    n_experts: int
    accounting: dict = field(default_factory=dict)
    source: str = ""

    @property
    def n_steps(self) -> int:
        return int(self.accounting.get("steps", self.table["step"].nunique()))

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
        }
        tbl = pa.Table.from_pandas(self.table, preserve_index=False)
        tbl = tbl.replace_schema_metadata({**(tbl.schema.metadata or {}), b"moetrace": json.dumps(meta).encode()})
        tmp = f"{path}.tmp-{os.getpid()}"
        pq.write_table(tbl, tmp)
        os.replace(tmp, path)

    def accesses(self) -> "Accesses":
        return accesses_from_table(self.table, self.n_layers, self.n_experts)

    def tokens(self) -> pd.DataFrame:
        """Accepted-token selections in token order: columns token, layer, expert."""
        t = self.table[self.table["accepted"]]
        tok = t["step"].to_numpy(np.int64) * 2 + t["position"].to_numpy(np.int64)
        codes, _ = pd.factorize(tok, sort=True)
        return pd.DataFrame({"token": codes.astype(np.int64), "layer": t["layer"].to_numpy(),
                             "expert": t["expert"].to_numpy()})


def _fail(msg: str, rec: Record | None, path: str | None, hint: str | None = None) -> InputError:
    return InputError(msg, path=path, line=rec.line if rec else None, hint=hint)


def read_jsonl(path: str | os.PathLike, stats: dict | None = None) -> Iterator[Record]:
    """Stream engine-format records from a JSONL file, skipping prefill records
    (counted in stats["prefill_records"] when a dict is given).

    Raises InputError with the line (and column) of a malformed record.
    """
    spath = str(path)
    try:
        fh = open(spath, "rb")
    except OSError as e:
        raise InputError(f"cannot open trace: {e.strerror}", path=spath) from None
    with fh:
        offset = 0
        for lineno, raw in enumerate(fh, 1):
            start = offset
            offset += len(raw)
            s = raw.strip()
            if not s:
                continue
            try:
                obj = json.loads(s)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                col = getattr(e, "colno", None)
                raise InputError(
                    f"not valid JSON ({getattr(e, 'msg', str(e))}" + (f" at column {col})" if col else ")"),
                    path=spath, line=lineno, offset=start,
                ) from None
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
                raise InputError(f"record lacks the field {e.args[0]!r}", path=spath, line=lineno,
                                 offset=start) from None
            if not (_is_int(step) and _is_int(layer)):
                raise InputError("step and layer must be integers", path=spath, line=lineno, offset=start)
            if not isinstance(experts, list) or not all(_is_int(x) for x in experts):
                raise InputError("experts must be a list of integers", path=spath, line=lineno, offset=start)
            yield Record(step, layer, experts, lineno, start)


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
    n_experts, when given, bound the layer and expert indices (else inferred).
    Raises InputError (with file and line) for widths that are neither k nor
    2k, unknown layers or experts, a step going backwards, a layer routed three
    times in one step, or inconsistent widths within one step.
    """
    recs = list(records)
    if not recs:
        raise InputError("the trace holds no decode records", path=path,
                         hint="is every record marked \"phase\": \"prefill\", or is the file empty?")
    widths = np.fromiter((len(r.experts) for r in recs), dtype=np.int64, count=len(recs))
    if k is None:
        k = int(widths.min())
        if k <= 0:
            raise _fail("a record has no experts", recs[int(widths.argmin())], path)
    elif k <= 0:
        raise UsageError(f"k must be positive, got {k}")

    n = len(recs)
    rec_pass = np.zeros(n, np.int8)
    rec_kind = np.zeros(n, np.int8)
    rec_accepted = np.ones(n, bool)
    max_layer = -1
    max_expert = -1
    prev_step = None
    i = 0
    n_steps = 0
    steps_by_kind = [0, 0, 0]
    while i < n:
        step = recs[i].step
        if prev_step is not None and step < prev_step:
            raise _fail(f"step goes backwards ({step} after {prev_step})", recs[i], path,
                        hint="records must be in engine order; concatenated traces need `plan compile` with several inputs")
        j = i
        seen: dict[int, int] = {}
        while j < n and recs[j].step == step:
            r = recs[j]
            if r.layer < 0 or (n_layers is not None and r.layer >= n_layers):
                raise _fail(f"unknown layer {r.layer}" + (f" (the geometry has {n_layers} layers)" if n_layers else ""),
                            r, path)
            w = widths[j]
            if w != k and w != 2 * k:
                raise _fail(f"record width {w} is neither k={k} nor 2k={2 * k}", r, path,
                            hint="pass --k if the inferred k is wrong")
            lo, hi = min(r.experts), max(r.experts)
            if lo < 0 or (n_experts is not None and hi >= n_experts):
                bad = lo if lo < 0 else hi
                raise _fail(f"unknown expert {bad}" + (f" (the geometry has {n_experts} experts per layer)"
                                                       if n_experts else ""), r, path)
            for half in ((r.experts,) if w == k else (r.experts[:k], r.experts[k:])):
                if len(set(half)) != len(half):
                    raise _fail("an expert appears twice in one position", r, path)
            occ = seen.get(r.layer, 0)
            if occ >= 2:
                raise _fail(f"layer {r.layer} routed three times in step {step}", r, path)
            seen[r.layer] = occ + 1
            rec_pass[j] = occ
            max_layer = max(max_layer, r.layer)
            max_expert = max(max_expert, hi)
            j += 1
        sl = slice(i, j)
        if rec_pass[sl].max() > 0:
            kind = 2
            for jj in range(i, j):
                if rec_pass[jj] == 1 and widths[jj] != k:
                    raise _fail(f"fallback pass record has width {widths[jj]}, expected k={k}", recs[jj], path)
            # the first pass of a layer that was routed again is the rejected speculation
            twice = {lay for lay, c in seen.items() if c == 2}
            for jj in range(i, j):
                if rec_pass[jj] == 0 and recs[jj].layer in twice:
                    rec_accepted[jj] = False
        else:
            w0 = widths[i]
            bad = np.nonzero(widths[sl] != w0)[0]
            if bad.size:
                raise _fail(f"step {step} mixes record widths {w0} and {widths[i + bad[0]]} without a repeated layer",
                            recs[i + int(bad[0])], path)
            kind = 0 if w0 == k else 1
        rec_kind[sl] = kind
        steps_by_kind[kind] += 1
        n_steps += 1
        prev_step = step
        i = j

    n_layers = n_layers if n_layers is not None else max_layer + 1
    n_experts = n_experts if n_experts is not None else max_expert + 1

    experts = np.fromiter((x for r in recs for x in r.experts), dtype=np.int32, count=int(widths.sum()))
    rep = lambda a: np.repeat(a, widths)  # noqa: E731
    steps = rep(np.fromiter((r.step for r in recs), np.int64, n))
    layers = rep(np.fromiter((r.layer for r in recs), np.int16, n))
    # position within the record: 0 for the first k experts, 1 for the second k
    starts = np.repeat(np.cumsum(widths) - widths, widths)
    position = ((np.arange(experts.size) - starts) >= k).astype(np.int8)
    table = pd.DataFrame({
        "step": steps,
        "pass": rep(rec_pass),
        "layer": layers,
        "position": position,
        "expert": experts,
        "kind": pd.Categorical.from_codes(rep(rec_kind), dtype=KIND_DTYPE),
        "accepted": rep(rec_accepted),
    })
    records_by_kind = np.bincount(rec_kind, minlength=3)
    accounting = {
        "steps": n_steps,
        "records": n,
        "records_by_kind": {KINDS[c]: int(records_by_kind[c]) for c in range(3)},
        "steps_by_kind": {KINDS[c]: int(steps_by_kind[c]) for c in range(3)},
        "passes": int(n_steps + steps_by_kind[2]),
        "accepted_tokens": int(steps_by_kind[0] + 2 * steps_by_kind[1] + steps_by_kind[2]),
        "selections": int(experts.size),
        "k": int(k),
    }
    if excluded:
        accounting["excluded"] = dict(excluded)
    return TypedTrace(table, int(k), int(n_layers), int(n_experts), accounting, path or "")


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
    tmp = f"{path}.tmp-{os.getpid()}"
    n = 0
    try:
        with open(tmp, "w") as fh:
            for step, layer, experts in records:
                fh.write('{"step": %d, "layer": %d, "experts": [%s]}\n'
                         % (step, layer, ", ".join(str(int(x)) for x in experts)))
                n += 1
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return n


def load_trace(path: str | os.PathLike, k: int | None = None, n_layers: int | None = None,
               n_experts: int | None = None) -> TypedTrace:
    """Load a typed trace (.parquet written by `trace parse`) or parse an engine JSONL."""
    spath = str(path)
    if not os.path.exists(spath):
        raise InputError("no such file", path=spath)
    with open(spath, "rb") as fh:
        head = fh.read(4)
    if head == b"PAR1":
        import pyarrow.parquet as pq

        try:
            tbl = pq.read_table(spath)
        except Exception as e:  # pyarrow raises several types for damaged files
            raise InputError(f"cannot read Parquet: {e}", path=spath) from None
        meta = json.loads((tbl.schema.metadata or {}).get(b"moetrace", b"{}"))
        if meta.get("schema") != TRACE_SCHEMA:
            raise InputError("Parquet file is not a moetrace typed trace", path=spath,
                             hint="make one with `moetrace trace parse TRACE.jsonl -o typed.parquet`")
        df = tbl.to_pandas()
        df["kind"] = df["kind"].astype(KIND_DTYPE)
        tt = TypedTrace(df, meta["k"], meta["n_layers"], meta["n_experts"], meta["accounting"], spath)
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

    Canonical order: sorted by (iteration, pass, layer, expert), each expert at
    most once per (iteration, pass, layer) — a spec_accept record's two
    positions read the union of their experts once. iteration is a dense
    0-based engine-iteration index.
    """

    iteration: np.ndarray  # int32
    pass_: np.ndarray  # int8
    layer: np.ndarray  # int16
    expert: np.ndarray  # int32
    n_layers: int
    n_experts: int
    n_iterations: int

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
                        self.n_layers, self.n_experts, min(n_iterations, self.n_iterations))


def accesses_from_table(table: pd.DataFrame, n_layers: int, n_experts: int) -> Accesses:
    """Deduplicate a typed table into the canonical access stream."""
    step = table["step"].to_numpy(np.int64)
    it, _ = pd.factorize(step, sort=True)
    ps = table["pass"].to_numpy(np.int64)
    lay = table["layer"].to_numpy(np.int64)
    ex = table["expert"].to_numpy(np.int64)
    key = ((it.astype(np.int64) * 2 + ps) * n_layers + lay) * n_experts + ex
    key = np.sort(key, kind="stable")
    if key.size:
        key = key[np.concatenate(([True], key[1:] != key[:-1]))]
    ex = key % n_experts
    rest = key // n_experts
    lay = rest % n_layers
    rest //= n_layers
    ps = rest % 2
    it = rest // 2
    n_it = int(it[-1]) + 1 if it.size else 0
    return Accesses(it.astype(np.int32), ps.astype(np.int8), lay.astype(np.int16), ex.astype(np.int32),
                    n_layers, n_experts, n_it)


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
        "pass": np.concatenate([p.pass_ for p in parts]),
        "layer": np.concatenate([p.layer for p in parts]),
        "expert": np.concatenate([p.expert for p in parts]),
    })
    return accesses_from_table(table, n_layers, n_experts)
