"""The typing rules of router traces, written once (paper §2; see moetrace.inputs.trace).

A trace has no event tags: each (step, request) unit is typed from its record
widths and from per-layer duplication. :class:`ChunkTyper` holds those rules
(widths k / 2k, speculation accepted or failed, requests and their tokens, the
error of the first bad record with its line) over columnar :class:`RecordChunk` s
of whole steps. Two drivers feed it:

* :func:`moetrace.inputs.trace.type_records`: a trace held as Record objects,
  typed as one chunk (the records also give each error its line and the values
  as read);
* :class:`moetrace.inputs.stream.TypedStream`: an engine JSONL read chunk by
  chunk in bounded memory, the typer carrying what crosses chunks (the last
  step, every request's next token).

:func:`resolve_geometry` turns what a pass learned (layers present, largest
expert) into the geometry both drivers report, with the same notes and warnings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np
import pandas as pd

from moetrace.errors import InputError

KINDS = ("normal", "spec_accept", "spec_fallback")
KIND_DTYPE = pd.CategoricalDtype(list(KINDS))
# Largest ids a trace may name: the typed table keeps experts as int32, layers as int16.
MAX_EXPERT = 2**31 - 2
MAX_LAYER = 2**15 - 2
MAX_STEP = 2**62
# An inferred pool wider than this many experts per layer is almost surely a stray id.
WIDE_POOL_WARN = 4096
DEFAULT_REQUEST = "0"
NO_RECORDS_HINT = "is every record marked \"phase\": \"prefill\", or is the file empty?"


def ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5, 8, 9] -> '0-2, 5, 8-9'."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(out)


def no_records(path: str | None) -> InputError:
    """The error of a trace without a decode record."""
    return InputError("the trace holds no decode records", path=path, hint=NO_RECORDS_HINT)


@dataclass
class RecordChunk:
    """Records of whole steps, columnar: per record step, layer, request code,
    width and index (0-based: for a file, counting every JSON object of it, prefill
    included, for error lines; for records held in memory, the record's position);
    experts flat in record order. has_request: per record, whether it names a
    request (None: the reader already checked that all or none do)."""

    step: np.ndarray
    layer: np.ndarray
    request: np.ndarray
    width: np.ndarray
    experts: np.ndarray
    index: np.ndarray
    has_request: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.step.size)


def line_of(path: str, index: int) -> tuple[int, int]:
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


def max_expert_record(c: RecordChunk) -> tuple[int, int]:
    """(largest expert id of a chunk, index of the first record holding it); (-1, 0) if none."""
    if not c.experts.size:
        return -1, 0
    j = int(np.argmax(c.experts))
    rec = int(np.searchsorted(np.cumsum(c.width), j, side="right"))
    return int(c.experts[j]), int(c.index[rec])


@dataclass
class Resolved:
    """The geometry of a typed trace and what the reader says about it."""

    n_layers: int
    n_experts: int
    layer_map: np.ndarray | None = None  # original layer id -> dense layer, when renumbered
    layer_ids: list | None = None
    notes: list = field(default_factory=list)
    warnings: list = field(default_factory=list)


def resolve_geometry(n_layers: int | None, n_experts: int | None, present: np.ndarray, max_expert: int,
                     where_max: Callable[[], str]) -> Resolved:
    """n_layers / n_experts as given, else inferred: the layers present (renumbered densely
    when some are missing, with a note) and the largest expert + 1 (a warning naming
    ``where_max()`` when the pool is implausibly wide)."""
    out = Resolved(0, 0)
    if n_layers is None:
        if present.size and present.size != int(present.max()) + 1:
            out.layer_ids = [int(x) for x in present]
            out.layer_map = np.full(int(present.max()) + 1, -1, np.int64)
            out.layer_map[present] = np.arange(present.size)
            out.notes.append(f"the trace routes {present.size} layers ({ranges(out.layer_ids)}); they are "
                             f"layers 0-{present.size - 1} here (give --layers to keep the ids)")
        n_layers = int(present.size)
    if n_experts is None:
        n_experts = max_expert + 1
        if n_experts > WIDE_POOL_WARN:
            out.warnings.append(f"expert id {max_expert} ({where_max()}) makes a pool of {n_experts:,} experts "
                                "per layer; if that is not the model's size, give --experts N or --geometry PRESET")
    out.n_layers, out.n_experts = int(n_layers), int(n_experts)
    return out


class _Err(NamedTuple):
    """A rule a record breaks: ordered as a step-by-step reader meets it (step, record
    checks before unit checks, then the unit's first record, then the record)."""

    sidx: int
    phase: int
    order: int
    record: int
    msg: str
    hint: str | None
    expert_index: int | None


class _Units(NamedTuple):
    """(step, request) units of a chunk and the occurrences of each (unit, layer)."""

    uniq: np.ndarray  # unit keys, sorted
    unit: np.ndarray  # per record: its unit
    occ: np.ndarray  # per record: 0 first pass of its (unit, layer), 1 the second, 2+ an error
    gsize: np.ndarray  # per record: passes of its (unit, layer)
    fb: np.ndarray  # per unit: a layer routed twice (a failed speculation)
    wmin: np.ndarray
    wmax: np.ndarray
    firstrec: np.ndarray  # per unit: its first record


@dataclass
class ChunkTyper:
    """Types record chunks (module docstring), carrying the state between chunks.

    k, n_layers and n_experts are the bounds to check (n_layers/n_experts None:
    unchecked above, as the caller renumbers layers via ``layer_map`` or infers them).
    layer_map: original layer id -> dense layer (the layers present), or None.
    source: the records as read when the caller holds them (chunk.index indexes
    them): errors then quote their values and lines; else the values come from
    the chunk and the lines from ``path``.
    """

    k: int
    path: str | None
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
    # request names (for messages), and whether the records name requests
    names: list = field(default_factory=list)
    _named: bool = False
    source: Sequence | None = None

    def set_requests(self, names: list, named: bool) -> None:
        """The request names known so far (codes index them) and whether records name requests."""
        self.names, self._named = names, named

    def _name(self, code: int) -> str:
        return str(self.names[code]) if code < len(self.names) else str(code)

    def _record(self, c: RecordChunk, i: int) -> tuple:
        """(step, layer, experts, request name) of record i of c, as read."""
        if self.source is not None:
            r = self.source[int(c.index[i])]
            return r.step, r.layer, list(r.experts), r.request
        o = int(c.width[:i].sum())
        return (int(c.step[i]), int(c.layer[i]), c.experts[o:o + int(c.width[i])].tolist(),
                self._name(int(c.request[i])))

    def _err(self, index: int, msg: str, hint: str | None = None, expert_index: int | None = None) -> InputError:
        if self.source is None:
            line, off = line_of(self.path, int(index))
            return InputError(msg, path=self.path, line=line or None, offset=off if line else None, hint=hint)
        rec = self.source[int(index)]
        line = rec.line
        if expert_index is not None and rec.lines is not None and expert_index < len(rec.lines):
            line = rec.lines[expert_index]
        return InputError(msg, path=self.path, line=line, offset=rec.offset if line == rec.line else None,
                          hint=hint)

    def type(self, c: RecordChunk) -> pd.DataFrame:
        """The typed table of one chunk (the columns of TypedTrace.table). Raises
        InputError with the line of the first bad record, as a reader going step by
        step meets it."""
        n = len(c)
        newstep = np.ones(n, bool)
        if n > 1:
            newstep[1:] = c.step[1:] != c.step[:-1]
        sidx = np.cumsum(newstep) - 1  # step index within the chunk
        pos = self._position(c)
        errs = self._record_errors(c, sidx) + self._expert_errors(c, sidx, pos)
        u = _units(c, sidx)
        errs += self._unit_errors(c, sidx, u)
        if errs:
            e = min(errs, key=lambda x: (x.sidx, x.phase, x.order))
            raise self._err(int(c.index[e.record]), e.msg, e.hint, e.expert_index)
        kind_u = np.where(u.fb, 2, np.where(u.wmin == self.k, 0, 1)).astype(np.int8)
        tok_u = self._tokens(c, u, kind_u)
        self._count(c, u, kind_u, sidx, newstep)
        return self._table(c, u, kind_u, tok_u, pos)

    def _position(self, c: RecordChunk) -> np.ndarray:
        """Per expert: 0 for the first k of its record, 1 for the second k."""
        starts = np.repeat(np.cumsum(c.width) - c.width, c.width)
        return ((np.arange(c.experts.size) - starts) >= self.k).astype(np.int64)

    def _first(self, errs: list, mask: np.ndarray, sidx: np.ndarray, msg: Callable[[int], str],
               hint: str | None = None, expert_index: Callable[[int], int] | None = None) -> None:
        if mask.any():
            i = int(np.argmax(mask))
            errs.append(_Err(int(sidx[i]), 0, i, i, msg(i), hint, expert_index(i) if expert_index else None))

    def _record_errors(self, c: RecordChunk, sidx: np.ndarray) -> list[_Err]:
        """The checks of step order, requests, layers and widths, per record."""
        errs: list[_Err] = []
        n, k, step = len(c), self.k, c.step
        rec = lambda i: self._record(c, i)  # noqa: E731
        back = np.zeros(n, bool)
        if n > 1:
            back[1:] = step[1:] < step[:-1]
        if self.prev_step is not None and n and step[0] < self.prev_step:
            back[0] = True
        self._first(errs, (step < -MAX_STEP) | (step > MAX_STEP), sidx,
                    lambda i: f"step {rec(i)[0]} is out of range (|step| <= 2^62)")
        self._first(errs, back, sidx, lambda i: f"step goes backwards ({rec(i)[0]} after "
                                                f"{rec(i - 1)[0] if i else self.prev_step})",
                    "records must be in engine order; concatenated traces need `plan compile` with several inputs")
        if c.has_request is not None:
            named = self._named
            self._first(errs, c.has_request != named, sidx,
                        lambda i: "this record " + ("names no request" if named else f"names request {rec(i)[3]!r}")
                        + " but the first record " + ("does" if named else "does not"),
                        "give every record a \"request\", or none (one request)")
        hi_l = self.n_layers if self.n_layers is not None else MAX_LAYER + 1
        self._first(errs, (c.layer < 0) | (c.layer >= hi_l), sidx,
                    lambda i: f"unknown layer {rec(i)[1]}" + (f" (the geometry has {self.n_layers} layers)"
                                                              if self.n_layers is not None
                                                              else f" (layers are 0 to {MAX_LAYER})"))
        self._first(errs, (c.width != k) & (c.width != 2 * k), sidx,
                    lambda i: f"record width {int(c.width[i])} is neither k={k} nor 2k={2 * k}",
                    "pass --k if the inferred k is wrong")
        return errs

    def _expert_errors(self, c: RecordChunk, sidx: np.ndarray, pos: np.ndarray) -> list[_Err]:
        """The checks of expert ids (range, geometry) and of duplicates within a position."""
        errs: list[_Err] = []
        ex, n = c.experts, len(c)
        if not ex.size:
            return errs
        lo = lambda i: min(self._record(c, i)[2])  # noqa: E731
        hi = lambda i: max(self._record(c, i)[2])  # noqa: E731
        where = lambda v: lambda i: self._record(c, i)[2].index(v(i))  # noqa: E731
        ends = np.cumsum(c.width)

        def per_record(bad: np.ndarray) -> np.ndarray:
            """Per record: any of its experts is bad (a record of no expert: none is)."""
            cs = np.concatenate([[0], np.cumsum(bad, dtype=np.int64)])
            return cs[ends] > cs[ends - c.width]

        self._first(errs, per_record(ex < 0), sidx, lambda i: f"unknown expert {lo(i)}", expert_index=where(lo))
        self._first(errs, per_record(ex > MAX_EXPERT), sidx,
                    lambda i: f"expert id {hi(i)} is out of range (expert ids are 0 to {MAX_EXPERT})",
                    expert_index=where(hi))
        if self.n_experts is not None:
            self._first(errs, per_record(ex >= self.n_experts), sidx,
                        lambda i: f"unknown expert {hi(i)} (the geometry has {self.n_experts} experts per layer)",
                        expert_index=where(hi))
        # (record, position, expert) as one sortable key; out-of-range ids (errors of their own,
        # met first) are clipped so that they cannot wrap onto another record's key
        half = np.repeat(np.arange(n, dtype=np.int64), c.width) * 2 + pos
        key = np.sort(half * (MAX_EXPERT + 3) + np.clip(ex, -1, MAX_EXPERT + 1) + 1)
        dup = np.zeros(ex.size, bool)
        dup[1:] = key[1:] == key[:-1]
        dup_rec = np.zeros(n, bool)
        dup_rec[key[dup] // (MAX_EXPERT + 3) // 2] = True
        self._first(errs, dup_rec, sidx, lambda i: "an expert appears twice in one position")
        return errs

    def _unit_errors(self, c: RecordChunk, sidx: np.ndarray, u: _Units) -> list[_Err]:
        """A layer routed three times; per unit, fallback widths and mixed widths."""
        errs: list[_Err] = []
        n, k, width = len(c), self.k, c.width
        req_of = lambda i: f" for request {self._record(c, i)[3]!r}" if self._named else ""  # noqa: E731
        self._first(errs, u.occ >= 2, sidx, lambda i: f"layer {self._record(c, i)[1]} routed three times in step "
                                                      f"{self._record(c, i)[0]}" + req_of(i))

        def unit_first(mask: np.ndarray, msg: Callable[[int], str]) -> None:
            if mask.any():  # the first unit (by its first record) with a bad record, then that record
                cand = np.flatnonzero(mask)
                o = u.firstrec[u.unit[cand]] * (n + 1) + cand
                i = int(cand[int(np.argmin(o))])
                errs.append(_Err(int(sidx[i]), 1, int(o.min()), i, msg(i), None, None))

        unit_first((u.occ == 1) & (width != k), lambda i: f"fallback pass record has width {int(width[i])}, "
                                                          f"expected k={k}")
        mix_u = ~u.fb & (u.wmin != u.wmax)
        if mix_u.any():
            w0 = width[np.minimum(u.firstrec, n - 1)]
            unit_first(mix_u[u.unit] & (width != w0[u.unit]),
                       lambda i: f"step {self._record(c, i)[0]} mixes record widths {int(w0[u.unit[i]])} and "
                                 f"{int(width[i])}" + req_of(i) + " without a repeated layer")
        return errs

    def _tokens(self, c: RecordChunk, u: _Units, kind_u: np.ndarray) -> np.ndarray:
        """Each unit's first token: per request, units in step order, 2 tokens for a spec_accept."""
        n, n_units = len(c), u.uniq.size
        ureq = (u.uniq % (int(c.request.max()) + 1 if n else 1)).astype(np.int64)
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
        return tok_u

    def _count(self, c: RecordChunk, u: _Units, kind_u: np.ndarray, sidx: np.ndarray, newstep: np.ndarray) -> None:
        """The state and accounting carried to the next chunk."""
        n = len(c)
        self.prev_step = int(c.step[-1]) if n else self.prev_step
        self.steps += int(newstep.sum())
        self.records += n
        self.steps_by_kind += np.bincount(kind_u, minlength=3)
        self.records_by_kind += np.bincount(kind_u[u.unit], minlength=3)
        self.selections += int(c.experts.size)
        fb_steps = np.zeros(int(sidx[-1]) + 1 if n else 0, bool)
        fb_steps[sidx[u.occ == 1]] = True
        self.fallback_steps += int(fb_steps.sum())
        if c.experts.size:
            self.max_expert = max(self.max_expert, int(c.experts.max()))

    def _table(self, c: RecordChunk, u: _Units, kind_u: np.ndarray, tok_u: np.ndarray, pos: np.ndarray):
        accepted = ~((u.occ == 0) & (u.gsize == 2))  # the first pass of a layer routed again: rejected
        lay = c.layer if self.layer_map is None else self.layer_map[c.layer]
        rep = lambda a: np.repeat(a, c.width)  # noqa: E731
        return pd.DataFrame({
            "step": rep(c.step),
            "request": rep(c.request.astype(np.int32)),
            "token": (rep(tok_u[u.unit]) + pos).astype(np.int32),
            "pass": rep(np.minimum(u.occ, 1).astype(np.int8)),
            "layer": rep(lay.astype(np.int16)),
            "position": pos.astype(np.int8),
            "expert": c.experts.astype(np.int32),
            "kind": pd.Categorical.from_codes(rep(kind_u[u.unit]), dtype=KIND_DTYPE),
            "accepted": rep(accepted),
        })

    def accounting(self, requests: int) -> dict:
        """The accounting of everything typed so far (TypedTrace.accounting's keys)."""
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


def _units(c: RecordChunk, sidx: np.ndarray) -> _Units:
    n = len(c)
    ukey = sidx.astype(np.int64) * (int(c.request.max()) + 1 if n else 1) + c.request
    uniq, unit = np.unique(ukey, return_inverse=True)
    unit = unit.reshape(-1)
    # out-of-range layers are errors; clipped, they cannot wrap onto a valid (unit, layer)
    lk = unit.astype(np.int64) * (MAX_LAYER + 3) + np.clip(c.layer, -1, MAX_LAYER + 1) + 1
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
    n_units = uniq.size
    fb = np.zeros(n_units, bool)
    np.logical_or.at(fb, unit, occ > 0)
    wmin = np.full(n_units, np.iinfo(np.int64).max)
    wmax = np.full(n_units, -1, np.int64)
    np.minimum.at(wmin, unit, c.width)
    np.maximum.at(wmax, unit, c.width)
    firstrec = np.full(n_units, n, np.int64)
    np.minimum.at(firstrec, unit, np.arange(n))
    return _Units(uniq, unit, occ, gsize, fb, wmin, wmax, firstrec)
