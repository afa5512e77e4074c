"""Engine routing logs: JSON Lines written by a logging hook in a serving engine.

Shape (vLLM and SGLang hooks write much the same)::

    {"type": "meta", "model": "Qwen/Qwen1.5-MoE-A2.7B", "engine": "vllm", "layers": [8], "top_k": 4, ...}
    {"type": "route", "req_id": "0", "token_idx": 0, "layer": 8, "topk_ids": [12, 3, 40, 7],
     "topk_weights": [0.41, 0.22, 0.2, 0.17]}
    ...

One file per logged layer, or all layers in one file; several files are merged
by forward pass. The first line may be metadata (``"type": "meta"``, kept in
the import's account); every other line is one token row of one forward pass
at one layer. Field names (first match wins):

* experts: ``topk_ids`` | ``expert_ids`` | ``experts`` -- in rank order as routed
* layer: ``layer`` | ``layer_id`` | ``layer_idx``
* row: ``token_idx`` | ``token_index`` | ``row`` -- the row's index within
  its forward pass, restarting at 0 on every pass
* request (optional): ``req_id`` | ``request_id`` | ``seq_id`` | ``request``
* forward pass (optional): ``step`` | ``forward_pass`` | ``pass_id`` | ``iteration``
* phase (optional): ``phase`` ("prefill" / "decode") | ``is_prefill`` (bool)

Forward passes. With a pass field, its value; without one, a pass ends where
a row of a layer the pass has already logged comes back to row 0 (per-layer
files: every row 0 starts a pass; one file with all layers: layer-major rows).
Within a pass and layer the rows must count 0, 1, 2, ...; every layer of a
pass must hold the same rows (in every file).

What each pass is, in log order:

1. warm-up junk: the engine's start-up profiling and graph-capture passes run
   dummy tokens, so every row of such a pass routes identically. Leading passes
   whose rows all carry one route are dropped while they have at least
   ``min_repeats`` rows, or repeat the route of a pass already dropped (small
   capture batches); each dropped block is reported with its reason.
2. prefill: rows of prompt tokens. With a phase field, as it says. With a
   request field that varies, the rows of a request that has several rows in a
   pass (its prompt). Otherwise by size: a pass with more rows than the decode
   batch (``max_batch``; default: the most common row count of the passes
   left) is prefill. Prefill rows are excluded, as everywhere in moetrace.
3. decode: one row per running sequence. The request of a row is its request
   field when that varies; when it is absent or one constant for the whole log
   (it then identifies nothing), it is inferred from the row's slot in the
   decode batch while the batch's composition holds: a segment of decode
   passes with the same row count and no prefill between them; the request of
   slot j in segment s is named ``s<s>.<j>``. A batch that shrinks or grows
   starts a new segment (which sequence left is not in the log), so a
   sequence that outlives a change is counted as two requests.

The records come out as ``(step = forward pass index in the log, layer,
experts, request)``, experts in rank order.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from moetrace.errors import InputError, UsageError
from moetrace.inputs.trace import Record, json_lines, valid_text
from moetrace.inputs.typer import MAX_EXPERT, MAX_LAYER

EXPERT_KEYS = ("topk_ids", "expert_ids", "experts")
LAYER_KEYS = ("layer", "layer_id", "layer_idx")
ROW_KEYS = ("token_idx", "token_index", "row")
REQUEST_KEYS = ("req_id", "request_id", "seq_id", "request")
PASS_KEYS = ("step", "forward_pass", "pass_id", "iteration")
DEFAULT_MIN_REPEATS = 16


def _first(obj: dict, keys: Sequence[str]):
    for key in keys:
        if key in obj:
            return key, obj[key]
    return None, None


def sniff(path: str | os.PathLike) -> str | None:
    """"routelog" when the file's first JSON line is a meta or route line (or has
    topk_ids), "engine" when it is a canonical step/layer/experts record, else None."""
    try:
        with open(str(path), "rb") as fh:
            first = b""
            for raw in fh:
                if raw.strip():
                    first = raw.strip()
                    break
    except OSError:
        return None
    if first.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
        first = first[3:].lstrip()
    if not first.startswith(b"{"):
        return None
    try:
        obj = json.loads(first)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    if obj.get("type") in ("meta", "route") or _first(obj, EXPERT_KEYS[:2])[0]:
        return "routelog"
    if {"step", "layer", "experts"} <= obj.keys():
        return "engine"
    return None


@dataclass
class _Pass:
    """One forward pass: per layer, its rows' experts and source lines; per row its request/phase."""

    index: int
    layers: dict = field(default_factory=dict)  # layer -> [experts list per row]
    lines: dict = field(default_factory=dict)  # layer -> [line per row]
    requests: list | None = None  # per row (from the first layer logged)
    phases: list | None = None  # per row: True prefill, False decode, None unknown
    where: tuple = ("", 0)  # (file, line) of its first row
    first_layer: int | None = None  # the layer whose rows give requests and phases

    @property
    def n_rows(self) -> int:
        return len(next(iter(self.layers.values()))) if self.layers else 0


def _int_field(obj: dict, keys: Sequence[str], what: str, path: str, line: int, required: bool = True,
               lo: int = 0, hi: int = 2**62):
    key, v = _first(obj, keys)
    if key is None:
        if required:
            raise InputError(f"JSON Lines: a route line needs a {what} field ({' | '.join(keys)})",
                             path=path, line=line)
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise InputError(f"JSON Lines: {key} must be an integer, got {json.dumps(v)[:40]}", path=path, line=line)
    if not lo <= v <= hi:
        raise InputError(f"JSON Lines: {key} {v} is out of range ({lo} to {hi})", path=path, line=line)
    return v


def _check_pass(p: _Pass, path: str) -> _Pass:
    counts = {lay: len(v) for lay, v in p.layers.items()}
    if len(set(counts.values())) > 1:
        lay = min(counts, key=counts.get)
        raise InputError(f"JSON Lines: forward pass {p.index} (from line {p.where[1]}) logs "
                         f"{counts[lay]} rows at layer {lay} but {max(counts.values())} at another layer",
                         path=path, line=p.lines[lay][-1])
    return p


def _read_file(path: str, stats: dict) -> list[_Pass]:
    """The forward passes of one log file (see the module docstring)."""
    return list(_iter_file(path, stats))


def _route_fields(obj: dict, path: str, lineno: int, start: int) -> tuple:
    """(layer, row, forward pass or None, experts, request or None, phase: True prefill, False decode,
    None unknown) of a route line; InputError naming the line for a field that is missing or wrong."""
    layer = _int_field(obj, LAYER_KEYS, "layer", path, lineno, hi=MAX_LAYER)
    row = _int_field(obj, ROW_KEYS, "row index", path, lineno, hi=2**31)
    pid = _int_field(obj, PASS_KEYS, "forward pass", path, lineno, required=False)
    ekey, ex = _first(obj, EXPERT_KEYS)
    if ekey is None:
        raise InputError(f"JSON Lines: a route line needs the experts ({' | '.join(EXPERT_KEYS)})",
                         path=path, line=lineno, offset=start)
    if not isinstance(ex, list) or not ex or not all(isinstance(x, int) and not isinstance(x, bool)
                                                     for x in ex):
        raise InputError(f"JSON Lines: {ekey} must be a non-empty list of integers", path=path,
                         line=lineno, offset=start)
    bad = [x for x in ex if not 0 <= x <= MAX_EXPERT]
    if bad:
        raise InputError(f"JSON Lines: expert id {bad[0]} in {ekey} is out of range (0 to {MAX_EXPERT})",
                         path=path, line=lineno, offset=start)
    rkey, req = _first(obj, REQUEST_KEYS)
    if req is not None and (isinstance(req, bool) or not isinstance(req, (str, int)) or not valid_text(req)):
        raise InputError(f"JSON Lines: {rkey} must be a string (of valid Unicode: no lone surrogate) or an "
                         "integer", path=path, line=lineno)
    phase = None
    if "phase" in obj:
        phase = {"prefill": True, "decode": False}.get(obj["phase"]) if isinstance(obj["phase"], str) else None
        if phase is None:
            raise InputError(f"JSON Lines: phase {json.dumps(obj['phase'])[:30]} is neither "
                             "\"prefill\" nor \"decode\"", path=path, line=lineno)
    elif "is_prefill" in obj:
        if not isinstance(obj["is_prefill"], bool):
            raise InputError("JSON Lines: is_prefill must be true or false", path=path, line=lineno)
        phase = obj["is_prefill"]
    return layer, row, pid, ex, req, phase


def _iter_file(path: str, stats: dict) -> Iterator[_Pass]:
    """The forward passes of one log file, one at a time (a pass is complete when the next begins)."""
    n_passes = 0
    cur: _Pass | None = None
    cur_id = None
    next_row: dict[int, int] = {}
    explicit = None
    rows = 0
    for lineno, start, obj in json_lines(path, "JSON Lines: ", "not a valid JSON line"):
        if not isinstance(obj, dict):
            raise InputError(f"JSON Lines: a line must be a JSON object, got {type(obj).__name__}",
                             path=path, line=lineno, offset=start)
        typ = obj.get("type", "route")
        if typ == "meta":
            stats.setdefault("meta", {})[path] = obj
            continue
        if typ != "route":
            stats.setdefault("lines_skipped", collections.Counter())[str(typ)[:40]] += 1
            continue
        layer, row, pid, ex, req, phase = _route_fields(obj, path, lineno, start)
        if explicit is None:
            explicit = pid is not None
        elif explicit != (pid is not None):
            raise InputError("JSON Lines: some route lines name their forward pass and others do not",
                             path=path, line=lineno)
        if explicit:
            new = cur is None or pid != cur_id
            if new and cur is not None and pid < cur_id:
                raise InputError(f"JSON Lines: forward pass {pid} comes after {cur_id}", path=path,
                                 line=lineno, hint="the log's lines must be in engine order")
        else:
            new = cur is None or (row == 0 and layer in cur.layers)
        if new:
            if cur is not None:
                yield _check_pass(cur, path)
            cur = _Pass(n_passes, where=(path, lineno))
            n_passes += 1
            cur_id = pid
            next_row = {}
        want = next_row.get(layer, 0)
        if row != want:
            raise InputError(f"JSON Lines: row {row} of layer {layer} where row {want} was expected "
                             f"(forward pass {cur.index} from line {cur.where[1]})", path=path, line=lineno,
                             hint="rows of a pass count 0, 1, 2, ... per layer; is a line missing?")
        next_row[layer] = row + 1
        if layer not in cur.layers:
            cur.layers[layer] = []
            cur.lines[layer] = []
            if cur.requests is None:
                cur.requests, cur.phases = [], []
                cur.first_layer = layer
        cur.layers[layer].append(ex)
        cur.lines[layer].append(lineno)
        if layer == cur.first_layer:
            cur.requests.append(None if req is None else str(req))
            cur.phases.append(phase)
        rows += 1
    if cur is not None:
        yield _check_pass(cur, path)
    stats["rows_read"] = stats.get("rows_read", 0) + rows


def _merge(paths: Sequence[str], stats: dict) -> Iterator[_Pass]:
    """Merge per-layer files pass by pass (pass i of every file is one forward pass), streaming."""
    gens = [(p, _iter_file(p, stats)) for p in paths]
    if len(gens) == 1:
        yield from gens[0][1]
        return
    owner: dict[int, str] = {}
    i = 0
    while True:
        got = [(path, next(g, None)) for path, g in gens]
        ended = [path for path, p in got if p is None]
        if ended:
            if len(ended) == len(got):
                return
            n = {path: i + (0 if p is None else 1 + sum(1 for _ in g))
                 for (path, p), (_, g) in zip(got, gens)}
            (pa, na), (pb, nb) = min(n.items(), key=lambda x: x[1]), max(n.items(), key=lambda x: x[1])
            raise InputError(f"JSON Lines: {pa} holds {na} forward passes but {pb} holds {nb}; per-layer files "
                             "are merged pass by pass", path=pa, hint="were the files written by the same run?")
        base = got[0][1]
        merged = _Pass(i, where=base.where, requests=base.requests, phases=base.phases)
        for path, p in got:
            for lay in p.layers:
                if owner.setdefault(lay, path) != path:
                    raise InputError(f"JSON Lines: layer {lay} is logged in {owner[lay]} and in {path}", path=path)
            if p.n_rows != base.n_rows:
                raise InputError(f"JSON Lines: forward pass {i} has {p.n_rows} rows here but {base.n_rows} rows in "
                                 f"{base.where[0]} (line {base.where[1]})", path=path, line=p.where[1])
            merged.layers.update(p.layers)
            merged.lines.update(p.lines)
        yield merged
        i += 1


def _route_sig(p: _Pass):
    """The pass's single route (per layer, the one expert set all its rows share), or None."""
    sig = []
    for lay in sorted(p.layers):
        rows = p.layers[lay]
        first = frozenset(rows[0])
        if any(frozenset(r) != first for r in rows[1:]):
            return None
        sig.append((lay, first))
    return tuple(sig)


def read_route_log(paths: Sequence[str | os.PathLike], *, min_repeats: int = DEFAULT_MIN_REPEATS,
                   keep_warmup: bool = False, max_batch: int | None = None,
                   stats: dict | None = None) -> Iterator[tuple[Record, int]]:
    """Read engine routing logs (module docstring) as (Record, source rows) pairs of decode tokens.

    stats receives: rows_read, meta, warmup (passes/rows dropped, blocks with
    reasons), prefill_excluded (rows), forward_passes, decode_passes,
    requests_from ("req_id" or "decode batch slot"), segments, max_batch.
    Raises InputError ("JSON Lines: ...", file and line) for bad lines.
    """
    if min_repeats < 2:
        raise UsageError(f"--warmup-min-repeats must be at least 2, got {min_repeats}")
    stats = stats if stats is not None else {}
    spaths = [str(p) for p in paths]
    sv = _survey(spaths, stats, min_repeats, keep_warmup)  # first pass (streaming)
    stats["forward_passes"] = sv.n_passes
    if not sv.n_passes:
        raise InputError("JSON Lines: the log holds no route lines", path=spaths[0])
    w = _warmup_account(sv, stats, min_repeats, keep_warmup, spaths[0])
    varying = _request_source(sv, stats, max_batch)
    real = itertools.islice(_merge(spaths, {}), w, None)  # second pass: the records
    yield from _decode_records(real, sv.has_phase, varying, stats.get("max_batch"), stats)
    if stats["decode_passes"] == 0:
        raise InputError(f"JSON Lines: no decode passes among {sv.n_passes - w} forward passes "
                         f"({stats['prefill_excluded']} prefill rows)", path=str(paths[0]),
                         hint="pass --max-batch N if decode passes have more rows than the inferred batch")


@dataclass
class _Survey:
    """What the first pass over a log learns: passes, the leading warm-up blocks, pass sizes, what
    the request and phase fields hold."""

    n_passes: int = 0
    warmup: int = 0  # leading passes that are warm-up
    blocks: list = field(default_factory=list)
    sizes: collections.Counter = field(default_factory=collections.Counter)
    req_values: set = field(default_factory=set)  # at most two names (and None): constant or varying
    has_phase: bool = True


def _survey(spaths: list[str], stats: dict, min_repeats: int, keep_warmup: bool) -> _Survey:
    sv = _Survey()
    dropped_sigs: set = set()
    looking = True
    for p in _merge(spaths, stats):
        sv.n_passes += 1
        if looking:
            sig = _route_sig(p)
            if sig is not None and (p.n_rows >= min_repeats or sig in dropped_sigs):
                reason = (f"{p.n_rows} rows of one identical route (dummy tokens: profiling or graph capture)"
                          if sig not in dropped_sigs else "the route of an earlier warm-up pass (graph capture)")
                if sv.blocks and sv.blocks[-1]["reason"] == reason:
                    sv.blocks[-1]["passes"] += 1
                    sv.blocks[-1]["rows"] += p.n_rows
                else:
                    sv.blocks.append({"first_pass": p.index, "line": p.where[1], "file": p.where[0], "passes": 1,
                                      "rows": p.n_rows, "reason": reason})
                dropped_sigs.add(sig)
                sv.warmup += 1
                if not keep_warmup:
                    continue
            else:
                looking = False
        sv.sizes[p.n_rows] += 1
        if len(sv.req_values) < 3:
            sv.req_values.update(p.requests)
        sv.has_phase = sv.has_phase and all(ph is not None for ph in p.phases)
    return sv


def _warmup_account(sv: _Survey, stats: dict, min_repeats: int, keep_warmup: bool, path: str) -> int:
    """stats["warmup"]; returns the leading passes to skip (InputError if that is all of them)."""
    if keep_warmup:
        stats["warmup"] = {"steps_dropped": 0, "rows_dropped": 0, "records_dropped": 0, "blocks": [],
                           "kept": True, "candidates": sv.blocks, "unit": "forward passes"}
        return 0
    if sv.warmup == sv.n_passes:
        raise InputError(f"JSON Lines: all {sv.n_passes} forward passes are warm-up junk (one identical "
                         "route per pass)", path=path, hint="pass --keep-warmup to import them")
    stats["warmup"] = {"steps_dropped": sv.warmup, "rows_dropped": int(sum(b["rows"] for b in sv.blocks)),
                       "records_dropped": 0, "blocks": sv.blocks, "min_repeats": min_repeats,
                       "unit": "forward passes", "rows_unit": "token rows"}
    return sv.warmup


def _request_source(sv: _Survey, stats: dict, max_batch: int | None) -> bool:
    """Whether req_id names the requests (it varies); else they are decode batch slots, and
    stats["max_batch"] is the batch size (given, or the most common pass size without phases)."""
    req_values = sv.req_values
    varying = len(req_values - {None}) > 1 and None not in req_values
    if not varying:
        if max_batch is None:
            max_batch = (max(sv.sizes.items(), key=lambda x: (x[1], x[0]))[0]
                         if sv.sizes and not sv.has_phase else None)
        stats["max_batch"] = max_batch
    stats["requests_from"] = "req_id" if varying else "decode batch slot"
    if not varying and len(req_values) == 1 and None not in req_values:
        stats.setdefault("notes", []).append(
            f"req_id is {next(iter(req_values))!r} on every row, so it names no request: requests are "
            "inferred from the decode batch slot")
    return varying


def _decode_records(real: Iterator["_Pass"], has_phase: bool, varying: bool, max_batch: int | None,
                    stats: dict) -> Iterator[tuple[Record, int]]:
    """The decode rows of each forward pass as records, per layer; requests from req_id or
    the decode batch slot (a new segment whenever the batch size changes)."""
    prefill_rows = 0
    segment = -1
    prev_size = None
    decode_passes = 0
    sizes_seen: list[int] = []
    for p in real:
        n = p.n_rows
        if has_phase:
            decode = [not ph for ph in p.phases]
        elif varying:
            cnt = collections.Counter(p.requests)
            decode = [cnt[r] == 1 for r in p.requests]
        else:
            decode = [n <= max_batch] * n
        nd = sum(decode)
        prefill_rows += n - nd
        if nd == 0:
            prev_size = None  # a prefill pass: the batch composition changes
            continue
        decode_passes += 1
        if not varying:
            if nd != prev_size:
                segment += 1
                sizes_seen.append(nd)
            prev_size = nd
        names, slot = [], 0
        for j in range(n):
            if not decode[j]:
                names.append(None)
                continue
            names.append(p.requests[j] if varying else f"s{segment}.{slot}")
            slot += 1
        for lay in sorted(p.layers):
            rows, lines = p.layers[lay], p.lines[lay]
            for j in range(n):
                if decode[j]:
                    yield Record(p.index, lay, rows[j], lines[j], None, names[j]), 1
    stats["prefill_excluded"] = prefill_rows
    stats["prefill_unit"] = "token rows"
    stats["decode_passes"] = decode_passes
    if not varying:
        stats["segments"] = segment + 1
        stats["segment_batch_sizes"] = sizes_seen[:50]
