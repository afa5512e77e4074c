"""Engine JSONL traces in bounded memory: a fast chunked reader and a vectorised typer.

:func:`moetrace.inputs.trace.type_records` types a whole trace held as Python
objects (about 150 bytes per read): the reference, and what small traces use.
Production traces (a million tokens of a 92-layer, k=16 model is 1.5 G reads)
go through here instead:

* :func:`read_chunks` parses the JSONL with pyarrow's streaming JSON reader
  (C++, blocks of ``block_bytes``) into columnar :class:`RecordChunk` s that
  end at step boundaries;
* :class:`ChunkTyper` types each chunk with numpy exactly as ``type_records``
  does (same kinds, passes, tokens, requests, errors), carrying the state that
  crosses chunks (the last step, every request's next token);
* :func:`scan_geometry` is the pre-pass that infers k, the layers present and
  the largest expert when the caller does not give them.

Memory is one chunk (``block_bytes`` of JSON, a few hundred MB of arrays at
most) plus the per-request state, whatever the trace's length. Anything the
fast reader cannot take (a request field of mixed types, a huge integer, bad
JSON) is handed to the reference parser, which reports the file and line --
streaming stays for well-formed traces, errors stay exact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from moetrace.errors import InputError, UsageError

DEFAULT_BLOCK_BYTES = 1 << 20
# engine JSONL traces larger than this take the streaming path (MOETRACE_STREAM_BYTES overrides)
STREAM_BYTES = 8 << 20


@dataclass
class RecordChunk:
    """Records of whole steps, columnar: per record step, layer, request code,
    width and index (0-based, counting every JSON object of the file, prefill
    included, for error lines); experts flat in record order."""

    step: np.ndarray
    layer: np.ndarray
    request: np.ndarray
    width: np.ndarray
    experts: np.ndarray
    index: np.ndarray

    def __len__(self) -> int:
        return int(self.step.size)


class _Fallback(Exception):
    """The fast reader cannot take this file: use the reference parser."""


def _line_of(path: str, index: int) -> tuple[int, int]:
    """(line, offset) of the index-th JSON object (non-blank line) of a file, streaming."""
    seen = -1
    offset = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if raw.strip():
                seen += 1
                if seen == index:
                    return lineno, offset
            offset += len(raw)
    return 0, 0


def exact_error(path: str) -> None:
    """Run the reference reader over the whole file (streaming, nothing kept) so
    that it raises its exact InputError; returns if the file reads cleanly."""
    from moetrace.inputs.trace import read_jsonl

    for _ in read_jsonl(path):
        pass


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
    import pandas as pd
    import pyarrow as pa
    import pyarrow.json as pj

    spath = str(path)
    requests = requests if requests is not None else {}
    schema = pa.schema([("step", pa.int64()), ("layer", pa.int64()), ("experts", pa.list_(pa.int64())),
                        ("phase", pa.string())])
    try:
        reader = pj.open_json(spath, read_options=pj.ReadOptions(block_size=block_bytes, use_threads=True),
                              parse_options=pj.ParseOptions(explicit_schema=schema,
                                                            unexpected_field_behavior="infer"))
    except OSError as e:
        raise InputError(f"cannot open trace: {e.strerror or e}", path=spath) from None
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        raise _Fallback() from None
    carry: RecordChunk | None = None
    base = 0
    named: bool | None = None
    prefill = 0
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            break
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OSError):
            raise _Fallback() from None
        n = batch.num_rows
        cols = batch.schema.names
        step = batch.column("step")
        layer = batch.column("layer")
        ex = batch.column("experts")
        if step.null_count or layer.null_count or ex.null_count or (pa.types.is_list(ex.type) and
                                                                    ex.values.null_count):
            raise _Fallback()
        idx = np.arange(base, base + n, dtype=np.int64)
        base += n
        keep = np.ones(n, bool)
        if "phase" in cols:
            ph = batch.column("phase").to_numpy(zero_copy_only=False)
            pre = ph == "prefill"
            prefill += int(pre.sum())
            keep &= ~pre
        if "request" in cols:
            rq = batch.column("request")
            if not (pa.types.is_string(rq.type) or pa.types.is_integer(rq.type) or pa.types.is_null(rq.type)):
                raise _Fallback()
            vals = rq.cast(pa.string()).to_numpy(zero_copy_only=False) if not pa.types.is_null(rq.type) else \
                np.full(n, None, object)
        else:
            vals = np.full(n, None, object)
        present = ~pd.isna(vals[keep]) if keep.any() else np.zeros(0, bool)
        if present.size:
            if named is None:
                named = bool(present[0])
                if stats is not None:
                    stats["named"] = named
            if (present != named).any():
                raise _Fallback()  # the reference parser names the line
        offs = ex.offsets.to_numpy()
        width = np.diff(offs).astype(np.int64)
        flat = ex.values.to_numpy()
        # keep only non-prefill records
        if not keep.all():
            kr = np.repeat(keep, width)
            flat = flat[kr]
            width = width[keep]
        st = step.to_numpy()[keep]
        ly = layer.to_numpy()[keep]
        ix = idx[keep]
        if named:
            local, uniq = pd.factorize(vals[keep])
            glob = np.empty(len(uniq), np.int32)
            for j, name in enumerate(uniq):
                c = requests.get(name)
                if c is None:
                    c = requests[name] = len(requests)
                glob[j] = c
            codes = glob[local] if local.size else np.zeros(0, np.int32)
        else:
            if "0" not in requests:
                requests["0"] = 0
            codes = np.zeros(st.size, np.int32)
        chunk = RecordChunk(st.astype(np.int64), ly.astype(np.int64), codes, width, flat.astype(np.int64), ix)
        if carry is not None:
            chunk = _concat(carry, chunk)
            carry = None
        if len(chunk) == 0:
            continue
        # hold back the last step: the next block may continue it
        last = chunk.step[-1]
        cut = int(np.searchsorted(chunk.step, last, side="left")) if bool(np.all(np.diff(chunk.step) >= 0)) \
            else len(chunk)
        if cut == len(chunk) or cut == 0:
            # unsorted steps (the typer reports them) or one step filling the block: emit whole
            if cut == 0:
                carry = chunk
                continue
            yield chunk
            continue
        carry = _slice(chunk, cut, len(chunk))
        yield _slice(chunk, 0, cut)
    if carry is not None and len(carry):
        yield carry
    if stats is not None:
        stats["prefill_records"] = prefill
        stats["named"] = bool(named)


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
    from moetrace.inputs.trace import MAX_LAYER

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
        if c.experts.size:
            j = int(np.argmax(c.experts))
            if int(c.experts[j]) > mx:
                mx = int(c.experts[j])
                rec = int(np.searchsorted(np.cumsum(c.width), j, side="right"))
                mx_at = int(c.index[rec])
        n += len(c)
    if k is None:
        raise _Fallback()
    return Geometry0(k, np.flatnonzero(seen), mx, n, len(reqs), mx_at)


@dataclass
class ChunkTyper:
    """Types record chunks as type_records does, chunk by chunk (module docstring).

    k, n_layers and n_experts are the bounds to check (n_layers/n_experts None:
    unchecked above, as the caller renumbers layers via ``layer_map``).
    layer_map: original layer id -> dense layer (the layers present), or None.
    """

    k: int
    path: str
    n_layers: int | None = None
    n_experts: int | None = None
    layer_map: np.ndarray | None = None
    prev_step: int | None = None
    next_token: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    steps: int = 0
    records: int = 0
    steps_by_kind: np.ndarray = field(default_factory=lambda: np.zeros(3, np.int64))
    records_by_kind: np.ndarray = field(default_factory=lambda: np.zeros(3, np.int64))
    selections: int = 0
    fallback_steps: int = 0
    max_expert: int = -1

    def _err(self, index: int, msg: str, hint: str | None = None) -> InputError:
        line, off = _line_of(self.path, int(index))
        return InputError(msg, path=self.path, line=line or None, offset=off if line else None, hint=hint)

    def type(self, c: RecordChunk):
        """The typed table of one chunk (a pandas DataFrame with the columns of
        TypedTrace.table). Raises InputError with the line of the first bad record."""
        import pandas as pd

        from moetrace.inputs.trace import KIND_DTYPE, MAX_EXPERT, MAX_LAYER, MAX_STEP

        k = self.k
        n = len(c)
        step, layer, req, width = c.step, c.layer, c.request, c.width
        errs: list[tuple[int, int, int, str, str | None]] = []  # (step order, phase, record, msg, hint)

        def first(mask: np.ndarray, phase: int, msg, hint=None):
            if mask.any():
                i = int(np.argmax(mask))
                errs.append((i, phase, i, msg(i) if callable(msg) else msg, hint))

        # step order
        back = np.zeros(n, bool)
        if n > 1:
            back[1:] = step[1:] < step[:-1]
        if self.prev_step is not None and n and step[0] < self.prev_step:
            back[0] = True
        bad_step = (step < -MAX_STEP) | (step > MAX_STEP)
        first(bad_step, 0, lambda i: f"step {int(step[i])} is out of range (|step| <= 2^62)")
        prevs = np.concatenate([[self.prev_step if self.prev_step is not None else step[0]], step[:-1]])
        first(back, 0, lambda i: f"step goes backwards ({int(step[i])} after {int(prevs[i])})",
              "records must be in engine order; concatenated traces need `plan compile` with several inputs")
        # step index within the chunk (records of a step are contiguous once order holds)
        newstep = np.ones(n, bool)
        if n > 1:
            newstep[1:] = step[1:] != step[:-1]
        sidx = np.cumsum(newstep) - 1
        # layers
        hi_l = self.n_layers if self.n_layers is not None else MAX_LAYER + 1
        first((layer < 0) | (layer >= hi_l), 0,
              lambda i: f"unknown layer {int(layer[i])}" + (f" (the geometry has {self.n_layers} layers)"
                                                            if self.n_layers is not None
                                                            else f" (layers are 0 to {MAX_LAYER})"))
        # widths
        first((width != k) & (width != 2 * k), 0,
              lambda i: f"record width {int(width[i])} is neither k={k} nor 2k={2 * k}",
              "pass --k if the inferred k is wrong")
        # experts: per record min/max, duplicates within a position
        rec_of = np.repeat(np.arange(n), width)
        ex = c.experts
        if ex.size:
            neg = np.zeros(n, bool)
            np.logical_or.at(neg, rec_of, ex < 0)
            first(neg, 0, lambda i: f"unknown expert {int(ex[rec_of == i].min())}")
            big = np.zeros(n, bool)
            np.logical_or.at(big, rec_of, ex > MAX_EXPERT)
            first(big, 0, lambda i: f"expert id {int(ex[rec_of == i].max())} is out of range (expert ids are 0 "
                                    f"to {MAX_EXPERT})")
            if self.n_experts is not None:
                over = np.zeros(n, bool)
                np.logical_or.at(over, rec_of, ex >= self.n_experts)
                first(over, 0, lambda i: f"unknown expert {int(ex[rec_of == i].max())} (the geometry has "
                                         f"{self.n_experts} experts per layer)")
            starts = np.repeat(np.cumsum(width) - width, width)
            pos = ((np.arange(ex.size) - starts) >= k).astype(np.int64)
            half = rec_of * 2 + pos
            o = np.lexsort((ex, half))
            dup = np.zeros(ex.size, bool)
            dup[1:] = (half[o][1:] == half[o][:-1]) & (ex[o][1:] == ex[o][:-1])
            dup_rec = np.zeros(n, bool)
            dup_rec[rec_of[o][dup]] = True
            first(dup_rec, 0, "an expert appears twice in one position")
        else:
            pos = np.zeros(0, np.int64)
        # units (step, request) and occurrences of (unit, layer)
        ukey = sidx.astype(np.int64) * (int(req.max()) + 1 if n else 1) + req
        uniq, unit = np.unique(ukey, return_inverse=True)
        lk = unit.astype(np.int64) * (MAX_LAYER + 2) + layer
        o = np.argsort(lk, kind="stable")
        grp = np.ones(n, bool)
        if n > 1:
            grp[1:] = lk[o][1:] != lk[o][:-1]
        gstart = np.maximum.accumulate(np.where(grp, np.arange(n), 0))
        occ = np.empty(n, np.int64)
        occ[o] = np.arange(n) - gstart
        gsize_sorted = np.diff(np.append(np.flatnonzero(grp), n))
        gsize = np.empty(n, np.int64)
        gsize[o] = np.repeat(gsize_sorted, gsize_sorted)
        first(occ >= 2, 0, lambda i: f"layer {int(layer[i])} routed three times in step {int(step[i])}"
              + (f" for request {self._name(int(req[i]))!r}" if self._named else ""))
        n_units = uniq.size
        fb = np.zeros(n_units, bool)
        np.logical_or.at(fb, unit, occ > 0)
        wmin = np.full(n_units, np.iinfo(np.int64).max)
        wmax = np.full(n_units, -1, np.int64)
        np.minimum.at(wmin, unit, width)
        np.maximum.at(wmax, unit, width)
        # fallback pass records must have width k
        first((occ == 1) & (width != k), 1,
              lambda i: f"fallback pass record has width {int(width[i])}, expected k={k}")
        # a unit without a repeated layer must not mix widths
        mix_u = ~fb & (wmin != wmax)
        if mix_u.any():
            w0 = np.full(n_units, -1, np.int64)
            firstrec = np.full(n_units, n, np.int64)
            np.minimum.at(firstrec, unit, np.arange(n))
            w0 = width[np.minimum(firstrec, n - 1)]
            bad = mix_u[unit] & (width != w0[unit])
            first(bad, 1, lambda i: f"step {int(step[i])} mixes record widths {int(w0[unit[i]])} and "
                                    f"{int(width[i])}" + (f" for request {self._name(int(req[i]))!r}"
                                                          if self._named else "")
                  + " without a repeated layer")
        if errs:
            # the reference scans step by step: record-level checks of a step before its unit checks
            key = [(int(sidx[i]), ph, i) for i, ph, _, _, _ in errs]
            j = int(np.argmin([a * 4 * (n + 1) + b * (n + 1) + c_ for a, b, c_ in key]))
            _, _, i, msg, hint = errs[j]
            raise self._err(int(c.index[i]), msg, hint)
        kind_u = np.where(fb, 2, np.where(wmin == k, 0, 1)).astype(np.int8)
        accepted = ~((occ == 0) & (gsize == 2))
        # tokens: per request, units in step order
        ureq = (uniq % (int(req.max()) + 1 if n else 1)).astype(np.int64)
        inc = np.where(kind_u == 1, 2, 1).astype(np.int64)
        need = int(ureq.max()) + 1 if ureq.size else 0
        if need > self.next_token.size:
            self.next_token = np.concatenate([self.next_token, np.zeros(need - self.next_token.size, np.int64)])
        ou = np.lexsort((np.arange(n_units), ureq))
        cs = np.cumsum(inc[ou])
        rs = ureq[ou]
        gfirst = np.ones(n_units, bool)
        if n_units > 1:
            gfirst[1:] = rs[1:] != rs[:-1]
        gbase = np.maximum.accumulate(np.where(gfirst, np.arange(n_units), 0))
        before = cs - inc[ou] - np.where(gbase > 0, cs[gbase - 1], 0)
        tok_u = np.empty(n_units, np.int64)
        tok_u[ou] = self.next_token[rs] + before
        np.add.at(self.next_token, ureq, inc)
        rec_kind = kind_u[unit]
        # state and accounting
        self.prev_step = int(step[-1]) if n else self.prev_step
        self.steps += int(newstep.sum())
        self.records += n
        self.steps_by_kind += np.bincount(kind_u, minlength=3)
        self.records_by_kind += np.bincount(rec_kind, minlength=3)
        self.selections += int(ex.size)
        fb_steps = np.zeros(int(sidx[-1]) + 1 if n else 0, bool)
        fb_steps[sidx[occ == 1]] = True
        self.fallback_steps += int(fb_steps.sum())
        if ex.size:
            self.max_expert = max(self.max_expert, int(ex.max()))
        lay = layer if self.layer_map is None else self.layer_map[layer]
        rep = lambda a: np.repeat(a, width)  # noqa: E731
        return pd.DataFrame({
            "step": rep(step),
            "request": rep(req.astype(np.int32)),
            "token": (rep(tok_u[unit]) + pos).astype(np.int32),
            "pass": rep(np.minimum(occ, 1).astype(np.int8)),
            "layer": rep(lay.astype(np.int16)),
            "position": pos.astype(np.int8),
            "expert": ex.astype(np.int32),
            "kind": pd.Categorical.from_codes(rep(rec_kind), dtype=KIND_DTYPE),
            "accepted": rep(accepted),
        })

    # request names, for messages only
    names: list = field(default_factory=list)
    _named: bool = False

    def _name(self, code: int) -> str:
        return str(self.names[code]) if code < len(self.names) else str(code)

    def accounting(self, requests: int) -> dict:
        from moetrace.inputs.trace import KINDS

        acc = {
            "steps": self.steps,
            "requests": requests,
            "records": self.records,
            "records_by_kind": {KINDS[i]: int(self.records_by_kind[i]) for i in range(3)},
            "steps_by_kind": {KINDS[i]: int(self.steps_by_kind[i]) for i in range(3)},
            "accepted_tokens": int(self.steps_by_kind[0] + 2 * self.steps_by_kind[1] + self.steps_by_kind[2]),
            "selections": self.selections,
            "k": int(self.k),
            "passes": int(self.steps + self.fallback_steps),
        }
        if requests > 1:
            acc["unit"] = "steps_by_kind counts (step, request) units"
        return acc


def check_k(k: int | None) -> None:
    if k is not None and k <= 0:
        raise UsageError(f"k must be positive, got {k}")


class TypedStream:
    """A whole engine JSONL trace typed chunk by chunk: geometry first (a pre-pass
    when k, layers or experts are not given), then :meth:`tables`, then
    :meth:`accounting` -- what parse_jsonl gives, in bounded memory.

    Raises _Fallback (from the constructor or while iterating) when the fast
    reader cannot take the file; the caller then uses the reference parser.
    """

    def __init__(self, path: str | os.PathLike, k: int | None = None, n_layers: int | None = None,
                 n_experts: int | None = None, block_bytes: int | None = None):
        from moetrace.inputs.trace import MAX_EXPERT, WIDE_POOL_WARN, _ranges

        self.path = str(path)
        self.block = block_bytes or DEFAULT_BLOCK_BYTES
        check_k(k)
        self.layer_map = None
        self.notes: list[str] = []
        self.warnings: list[str] = []
        self.layer_ids = None
        n_layers_check, n_experts_check = n_layers, n_experts
        if k is None or n_layers is None or n_experts is None:
            g0 = scan_geometry(self.path, self.block)
            k = g0.k if k is None else k
            if n_layers is None:
                present = g0.layers
                if present.size != int(present.max()) + 1:
                    self.layer_ids = [int(x) for x in present]
                    self.layer_map = np.full(int(present.max()) + 1, -1, np.int64)
                    self.layer_map[present] = np.arange(present.size)
                    self.notes.append(f"the trace routes {present.size} layers ({_ranges(self.layer_ids)}); they "
                                      f"are layers 0-{present.size - 1} here (give --layers to keep the ids)")
                n_layers = int(present.size)
            if n_experts is None:
                if g0.max_expert > MAX_EXPERT:
                    raise _Fallback()
                n_experts = g0.max_expert + 1
                if n_experts > WIDE_POOL_WARN:
                    line, _ = _line_of(self.path, g0.max_expert_at)
                    self.warnings.append(
                        f"expert id {g0.max_expert} (line {line}) makes a pool of {n_experts:,} experts per layer; "
                        "if that is not the model's size, give --experts N or --geometry PRESET")
        self.k, self.n_layers, self.n_experts = int(k), int(n_layers), int(n_experts)
        self.requests: dict = {}
        self._stats: dict = {}
        self.typer = ChunkTyper(self.k, self.path, n_layers_check, n_experts_check, self.layer_map)

    def tables(self) -> Iterator:
        for chunk in read_chunks(self.path, self.block, self.requests, self._stats):
            self.typer.names = list(self.requests)
            self.typer._named = bool(self._stats.get("named", False))
            yield self.typer.type(chunk)
        if self.typer.records == 0:
            raise InputError("the trace holds no decode records", path=self.path,
                             hint="is every record marked \"phase\": \"prefill\", or is the file empty?")

    @property
    def names(self) -> list:
        return list(self.requests) or ["0"]

    def accounting(self) -> dict:
        acc = self.typer.accounting(len(self.requests))
        acc["prefill_records_excluded"] = int(self._stats.get("prefill_records", 0))
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

    tmp = f"{out}.tmp-{os.getpid()}"
    writer = None
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
        writer.close()
        writer = None
        os.replace(tmp, out)
        return acc
    finally:
        if writer is not None:
            writer.close()
        if os.path.exists(tmp):
            os.unlink(tmp)


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


def import_engine_jsonl(path: str | os.PathLike, out: str | os.PathLike, *, keep_warmup: bool = False,
                        min_repeats: int = 16, k: int | None = None, n_layers: int | None = None,
                        n_experts: int | None = None) -> tuple[TypedStream, dict, int]:
    """`trace import` of a canonical engine JSONL in bounded memory: drop the leading
    warm-up blocks (as importers.drop_warmup), type every chunk (validation and
    accounting), write the records to ``out`` atomically. Returns (stream, warm-up
    info, records written). Raises _Fallback like TypedStream."""
    if min_repeats < 2:
        raise UsageError(f"--warmup-min-repeats must be at least 2, got {min_repeats}")
    import json

    ts = TypedStream(path, k, n_layers, n_experts)
    info = {"steps_dropped": 0, "rows_dropped": 0, "records_dropped": 0, "blocks": [], "min_repeats": min_repeats}
    if keep_warmup:
        info.update(kept=True, candidates=[])
    tmp = f"{out}.tmp-{os.getpid()}"
    n_out = 0
    # warm-up detection state: the current run of identical leading steps
    looking = True
    run_sig = None
    run_steps: list[RecordChunk] = []  # held back while a leading run may still be warm-up
    run_first = None

    def flush(fh, c: RecordChunk) -> int:
        offs = np.concatenate([[0], np.cumsum(c.width)])
        names = list(ts.requests)
        named = bool(ts._stats.get("named", False))
        lines = []
        for r in range(len(c)):
            ex = ", ".join(map(str, c.experts[offs[r]:offs[r + 1]].tolist()))
            if named:
                lines.append('{"step": %d, "layer": %d, "experts": [%s], "request": %s}\n'
                             % (c.step[r], c.layer[r], ex, json.dumps(names[c.request[r]])))
            else:
                lines.append('{"step": %d, "layer": %d, "experts": [%s]}\n' % (c.step[r], c.layer[r], ex))
        fh.write("".join(lines))
        return len(c)

    try:
        with open(tmp, "w") as fh:
            for c in read_chunks(ts.path, ts.block, ts.requests, ts._stats):
                if looking:
                    starts, sigs = _step_signatures(c)
                    ends = np.append(starts[1:], len(c))
                    emit_from = None
                    for j, sig in enumerate(sigs):
                        if run_sig is None or sig != run_sig:
                            if run_sig is not None:
                                if len(run_steps) >= min_repeats:
                                    info["blocks"].append([run_first, len(run_steps)])
                                    info["steps_dropped"] += len(run_steps)
                                    info["records_dropped"] += sum(len(s) for s in run_steps)
                                    info["rows_dropped"] += sum(len(s) for s in run_steps)
                                    if keep_warmup:
                                        for part in run_steps:
                                            ts.typer.names = list(ts.requests)
                                            ts.typer._named = bool(ts._stats.get("named", False))
                                            ts.typer.type(part)
                                            n_out += flush(fh, part)
                                    run_steps = []
                                else:
                                    looking = False
                                    emit_from = j
                                    break
                            run_sig, run_first = sig, int(c.step[starts[j]])
                        run_steps.append(_slice(c, int(starts[j]), int(ends[j])))
                    if looking:
                        continue
                    held = run_steps
                    run_steps = []
                    rest = [_slice(c, int(starts[emit_from]), len(c))]
                    if keep_warmup:
                        info["candidates"] = [list(b) for b in info["blocks"]]
                        info.update(steps_dropped=0, records_dropped=0, rows_dropped=0, blocks=[])
                    for part in held + rest:
                        ts.typer.names = list(ts.requests)
                        ts.typer._named = bool(ts._stats.get("named", False))
                        ts.typer.type(part)
                        n_out += flush(fh, part)
                    continue
                ts.typer.names = list(ts.requests)
                ts.typer._named = bool(ts._stats.get("named", False))
                ts.typer.type(c)
                n_out += flush(fh, c)
            if looking:
                total = info["steps_dropped"] + len(run_steps)
                if keep_warmup:
                    info["candidates"] = [list(b) for b in info["blocks"]]
                    info.update(steps_dropped=0, records_dropped=0, rows_dropped=0, blocks=[])
                if len(run_steps) >= min_repeats and not keep_warmup:
                    raise InputError(f"all {total} steps are one identical route repeated (warm-up junk?)",
                                     path=ts.path, hint="pass --keep-warmup to import them anyway")
                for part in run_steps:
                    ts.typer.type(part)
                    n_out += flush(fh, part)
        if ts.typer.records == 0:
            raise InputError("the trace holds no decode records", path=ts.path,
                             hint="is every record marked \"phase\": \"prefill\", or is the file empty?")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return ts, info, n_out
