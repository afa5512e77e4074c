"""plan.bin: the compiled replay stream (format version 1.1).

A plan is what the replay harness reads: the pool geometry, then every engine
iteration as a list of passes, each pass the per-layer expert sets to read, plus
optional prefetch hints (next-layer predictions). It is compiled from one typed
trace, or from several merged iteration by iteration (the paper's batch union,
truncated to the shortest input). docs/plan-format.md holds the same layout with
worked examples.

Layout (all integers little-endian; offsets in bytes)::

    [header, 160 B] [meta JSON, padded to 8] [iteration index, 32 B x n_iterations]
    [pass blocks, in iteration then pass order]

Header (offset 0)::

      0  8s   magic            b"MOETPLAN"
      8  u16  version_major    1; a reader rejects any other major version
     10  u16  version_minor    1; minor bumps only use reserved bytes and flag bits
     12  u32  header_size      160 (the header CRC sits at header_size - 4)
     16  u32  flags            bit 0: pass blocks carry hint sections;
                               bit 1 (1.1): experts within a layer are in rank
                               order as routed, not ascending
     20  u32  n_layers
     24  u32  n_experts        experts per layer
     28  u32  k                experts per token
     32  u64  expert_bytes     0 = unknown (logical bytes are then not reported)
     40  u32  id_bytes         2 (uint16 ids/counts, n_experts <= 65535) or 4
     44  u32  n_iterations
     48  u64  n_passes
     56  u64  n_reads          sum of all per-layer expert set sizes
     64  u64  n_hints          sum of all hint set sizes
     72  i64  accepted_tokens  from the typed accounting; -1 = unknown
     80  u64  meta_offset      = header_size
     88  u64  meta_length      bytes of UTF-8 JSON (without padding)
     96  u64  index_offset     = meta_offset + meta_length rounded up to 8
    104  u64  blocks_offset    = index_offset + 32 x n_iterations
    112  u64  file_size        total bytes; a shorter file is truncated
    120  u32  meta_crc32       CRC-32 (zlib) of the meta JSON bytes
    124  u32  index_crc32      CRC-32 of the whole iteration index
    128  u32  n_inputs         traces merged into this plan (0 = built from Accesses)
    132  u32  hint_source      0 none, 1 oracle, 2 predictor
    136  20B  reserved         zero
    156  u32  header_crc32     CRC-32 of header bytes [0, 156)

Iteration index entry (32 B, entry i at index_offset + 32 i)::

      0  u64  offset           absolute offset of the iteration's first pass block
      8  u64  length           bytes of all the iteration's pass blocks
     16  i64  step             engine step number (of the first input)
     24  u32  n_reads          reads in the iteration (all passes)
     28  u16  n_passes         0, 1 or 2
     30  u16  reserved         zero

Pass block (4-byte aligned, starting at the index entry's offset)::

      0  u32  tag              0x53534150 (b"PASS")
      4  u32  iteration
      8  u8   pass             0, or 1 for the fallback pass of a failed speculation
      9  u8   flags            bit 0: hint section present (= header flag bit 0)
     10  u16  reserved         zero
     12  u32  n_reads
     16  u32  n_hints          0 when there is no hint section
     20       counts[n_layers]       id dtype: experts read at each layer
              experts[n_reads]       id dtype: expert index within its layer,
                                     layer-major, ascending within a layer
                                     (rank order when header flag bit 1)
              (hint section, when flag bit 0)
              hint_counts[n_layers]  id dtype
              hints[n_hints]         id dtype, layer-major, ascending
              zero padding to a multiple of 4
       -4 u32  crc32            CRC-32 of the block's bytes before it

Hints are keyed by the layer that *issues* them: hints of layer l are the
experts to prefetch once layer l of this pass has been read, predicting the next
non-empty (pass, layer) slot in replay order — layer l+1 of the same pass, or
the first layer of the next pass after the last layer. Everything a replayer
needs during one pass is therefore in that pass's block. An oracle plan hints
the actual next set (recall 1.0); a predictor plan hints a recorded predictor's
sets. expert_id = layer * n_experts + expert, as everywhere in moetrace.

Readers verify the header and index CRCs and the file size on open, then each
pass block's CRC as they stream; every failure is a PlanFormatError naming the
byte offset.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from moetrace.version import __version__
from moetrace.jsonutil import json_default
from moetrace.errors import InputError, PlanFormatError, UsageError
from moetrace.inputs.geometry import Geometry, preset

if TYPE_CHECKING:  # pandas is heavy: moetrace.inputs.trace is imported only where needed
    from moetrace.inputs.trace import Accesses, TypedTrace

MAGIC = b"MOETPLAN"
VERSION_MAJOR = 1
VERSION_MINOR = 1
PLAN_SCHEMA = "moetrace.plan/1"
HEADER_SIZE = 160
FLAG_HINTS = 1
FLAG_RANK_ORDER = 2
HINT_SOURCES = ("none", "oracle", "predictor")
PASS_TAG = 0x53534150  # b"PASS" little-endian

_HEADER = struct.Struct("<8sHHIIIIIQIIQQQqQQQQQIIII20x")
assert _HEADER.size == HEADER_SIZE - 4
_PASS_HEAD = struct.Struct("<IIBBHII")
assert _PASS_HEAD.size == 20
INDEX_DTYPE = np.dtype([("offset", "<u8"), ("length", "<u8"), ("step", "<i8"),
                        ("n_reads", "<u4"), ("n_passes", "<u2"), ("reserved", "<u2")])
assert INDEX_DTYPE.itemsize == 32

_INDEX_CHUNK = 65536  # index entries read at a time (2 MiB)
_SPAN_BYTES = 4 << 20  # pass-block bytes read at a time when streaming
_WRITE_FLUSH = 4 << 20


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class PlanHeader:
    """The decoded header of a plan.bin, plus its meta JSON."""

    n_layers: int
    n_experts: int
    k: int
    expert_bytes: int
    id_bytes: int
    n_iterations: int
    n_passes: int
    n_reads: int
    n_hints: int
    accepted_tokens: int | None
    hint_source: str
    n_inputs: int
    flags: int
    version: tuple[int, int]
    meta_offset: int
    meta_length: int
    index_offset: int
    blocks_offset: int
    file_size: int
    meta_crc32: int
    index_crc32: int
    meta: dict = field(default_factory=dict)

    @property
    def has_hints(self) -> bool:
        return bool(self.flags & FLAG_HINTS)

    @property
    def order(self) -> str:
        """The order of the experts within a layer: "rank" (as routed) or "sorted"."""
        return "rank" if self.flags & FLAG_RANK_ORDER else "sorted"

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.n_layers, self.n_experts, self.k, self.expert_bytes,
                        self.meta.get("geometry_name", "custom"))

    @property
    def logical_bytes(self) -> int | None:
        """reads x expert_bytes, None when expert_bytes is unknown (0)."""
        return self.n_reads * self.expert_bytes if self.expert_bytes else None

    @property
    def id_dtype(self) -> np.dtype:
        return np.dtype("<u2" if self.id_bytes == 2 else "<u4")


@dataclass
class PlanPass:
    """One pass of one iteration as stored in a plan.

    counts[l] experts are read at layer l; experts is the flat layer-major array
    (expert index within the layer, ascending per layer). hint_counts / hints
    are the same for the prefetch hints issued after each layer (None when the
    plan has no hints). Arrays are read-only views into the block just read.
    """

    iteration: int
    pass_index: int
    step: int
    offset: int
    counts: np.ndarray
    experts: np.ndarray
    hint_counts: np.ndarray | None = None
    hints: np.ndarray | None = None

    @property
    def n_reads(self) -> int:
        return int(self.experts.size)

    def by_layer(self) -> list[np.ndarray]:
        """Per-layer expert arrays (index l = layer l; empty where nothing is read)."""
        return np.split(self.experts, np.cumsum(self.counts)[:-1])

    def hints_by_layer(self) -> list[np.ndarray] | None:
        """Per-layer hint arrays: entry l = experts to prefetch after layer l."""
        if self.hints is None:
            return None
        return np.split(self.hints, np.cumsum(self.hint_counts)[:-1])


# ---------------------------------------------------------------------------
# writing


def _hint_source_code(name: str) -> int:
    try:
        return HINT_SOURCES.index(name)
    except ValueError:
        raise UsageError(f"unknown hint source {name!r}", hint=f"one of {', '.join(HINT_SOURCES)}") from None


def write_plan(
    path: str | os.PathLike,
    accesses: "Accesses",
    geometry: Geometry,
    *,
    hints: "Accesses | None" = None,
    hint_source: str | None = None,
    accepted_tokens: int | None = None,
    steps: np.ndarray | None = None,
    n_inputs: int = 0,
    meta: dict | None = None,
) -> PlanHeader:
    """Write accesses (canonical order) as plan.bin at path, atomically.

    hints, when given, are *target-keyed* predictions in the Accesses layout
    (the experts predicted for (iteration, pass, layer)); they are stored keyed
    by the issuing slot, the previous non-empty (pass, layer) slot of the replay
    order (module docstring). Pass the accesses themselves for an oracle plan.
    Predictions for slots that are read nothing, or for the very first slot, have
    no issuer and are dropped (their count goes into meta["hints"]["dropped"]).
    steps gives the engine step of each iteration (default: the iteration index).
    Returns the header written. Raises UsageError for accesses that do not fit
    the geometry or are not in canonical order; nothing is left at path on error.
    """
    L, E = geometry.n_layers, geometry.n_experts
    if (accesses.n_layers, accesses.n_experts) != (L, E):
        raise UsageError(f"accesses have geometry {accesses.n_layers}x{accesses.n_experts}, "
                         f"the plan {L}x{E}")
    n_it = int(accesses.n_iterations)
    if steps is None:
        steps = np.arange(n_it, dtype=np.int64)
    steps = np.asarray(steps, np.int64)
    if steps.size < n_it:
        raise UsageError(f"{steps.size} step numbers for {n_it} iterations")
    order = getattr(accesses, "order", "sorted")
    src = (hint_source or "predictor") if hints is not None else "none"
    with PlanWriter(path, geometry, order, hint_source=src) as w:
        w.add(accesses, steps, hints=hints)
        return w.close(accepted_tokens=accepted_tokens, n_inputs=n_inputs, meta=meta)


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """Sorted distinct values; skips the sort when a is already strictly increasing."""
    if a.size < 2 or bool(np.all(a[1:] > a[:-1])):
        return a
    a = np.sort(a)
    return a[np.r_[True, a[1:] != a[:-1]]]


def _slot_keys(acc: "Accesses", L: int, E: int, n_it: int, what: str, canonical: bool, rank: bool = False
               ) -> tuple[np.ndarray, np.ndarray]:
    """Validate an access stream; return its slot keys ((iteration * 2 + pass) * L + layer,
    int64) and experts. canonical=True requires canonical order (with rank=True:
    slots ascending, each expert once per slot, in any order within the slot);
    otherwise the stream is sorted and deduplicated."""
    it, ps, lay, ex = acc.iteration, acc.pass_, acc.layer, acc.expert
    n = ex.size
    if not (it.size == ps.size == lay.size == n):
        raise UsageError(f"{what}: column lengths differ")
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if it.min() < 0 or it.max() >= n_it or ps.min() < 0 or ps.max() > 1:
        raise UsageError(f"{what} hold an iteration or pass out of range ({n_it} iterations, passes 0-1)")
    if lay.min() < 0 or lay.max() >= L or ex.min() < 0 or ex.max() >= E:
        raise UsageError(f"{what} hold a layer or expert outside the geometry {L}x{E}")
    skey = it.astype(np.int64)
    skey *= 2
    skey += ps
    skey *= L
    skey += lay
    full = skey * E
    full += ex
    if rank and canonical:
        if n > 1 and not (bool(np.all(skey[1:] >= skey[:-1]))
                          and bool(np.all(np.diff(np.sort(full)) > 0))):
            raise UsageError(f"{what} are not in rank order (sorted by iteration, pass, layer; each expert once "
                             "per layer)")
        return skey, np.asarray(ex)
    if n > 1 and not bool(np.all(full[1:] > full[:-1])):
        if canonical:
            raise UsageError(f"{what} are not in canonical order (sorted by iteration, pass, layer, expert, "
                             "each expert once per layer)")
        full = _sorted_unique(full)
        skey = full // E
        return skey, full - skey * E
    return skey, np.asarray(ex)


def _issuer_hints(hints: "Accesses", slots: np.ndarray, pass_keys: np.ndarray, P: int, L: int, E: int,
                  n_it: int, known: tuple | None = None):
    """Re-key target-keyed predictions by their issuing slot (the previous non-empty slot).

    slots: the plan's non-empty slot keys, ascending; pass_keys: iteration * 2 +
    pass of each of the P passes. Returns hint ids, per-pass per-layer counts
    (P x L), per-pass start offsets into the ids (P + 1), and stats.
    """
    if (hints.n_layers, hints.n_experts) != (L, E):
        raise UsageError("hints and accesses have different geometries")
    if known is not None and hints is known[0]:  # oracle: the accesses themselves, already keyed
        tkey, hex_ = known[1], known[2]
    else:
        tkey, hex_ = _slot_keys(hints, L, E, n_it, "hints", canonical=False)
    m = hex_.size
    if m == 0 or slots.size == 0:
        return (np.zeros(0, np.int64), np.zeros((P, L), np.int64), np.zeros(P + 1, np.int64),
                {"predicted": int(m), "dropped": int(m)})
    new = np.ones(m, bool)
    new[1:] = tkey[1:] != tkey[:-1]
    rs = np.flatnonzero(new)
    run_len = np.diff(np.append(rs, m))
    ut = tkey[rs]  # distinct target slots, ascending
    pos = np.searchsorted(slots, ut)
    posc = np.minimum(pos, slots.size - 1)
    keep = (pos > 0) & (slots[posc] == ut)  # the target is read and has an issuer
    issuer = slots[pos[keep] - 1]
    # dense issuer = pass row * L + layer
    row = np.searchsorted(pass_keys, issuer // L)
    dense = row * L + issuer % L
    h_counts = np.bincount(dense, weights=run_len[keep], minlength=P * L).astype(np.int64).reshape(P, L)
    h_ids = hex_[np.repeat(keep, run_len)]
    h_start = np.zeros(P + 1, np.int64)
    np.cumsum(h_counts.sum(axis=1), out=h_start[1:])
    stats = {"predicted": int(m), "dropped": int(m - h_ids.size)}
    return h_ids, h_counts, h_start, stats


class PlanWriter:
    """Writes a plan from access chunks in bounded memory (write_plan is one add).

    ``add(acc, steps)`` takes the next iterations' accesses (the Accesses
    layout, iterations numbered globally from 0 and contiguous across calls,
    in canonical order for ``order``) and their engine step numbers; pass
    blocks go to a temporary file as they come. ``close(...)`` writes the
    header, meta and index in front of the blocks and renames the result into
    place; ``abort()`` (or leaving a ``with`` block on an error) removes
    everything. Only the iteration index (32 bytes per iteration) is held.
    Hints (a writer made with a hint_source) need the whole stream in one add:
    a slot's issuer may sit in the previous chunk.
    """

    def __init__(self, path: str | os.PathLike, geometry: Geometry, order: str = "sorted",
                 hint_source: str = "none"):
        self.hint_source = hint_source
        self.has_hints = hint_source != "none"
        self.hint_code = _hint_source_code(hint_source)
        self.hint_stats: dict = {}
        self.n_hints = 0
        self.path = os.fspath(path)
        self.geometry = geometry
        self.order = order
        self.L, self.E = geometry.n_layers, geometry.n_experts
        self.id_bytes = 2 if self.E <= 0xFFFF else 4
        self.idt = np.dtype("<u2" if self.id_bytes == 2 else "<u4")
        self.tmp_blocks = f"{self.path}.tmp-{os.getpid()}.blocks"
        self.tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            self.fh = open(self.tmp_blocks, "wb")
        except OSError as e:
            raise InputError(f"cannot write the plan: {e.strerror}", path=self.path) from None
        self.index_parts: list[np.ndarray] = []
        self.n_it = 0
        self.n_passes = 0
        self.n_reads = 0
        self.pos = 0  # bytes of blocks written

    def __enter__(self) -> "PlanWriter":
        return self

    def __exit__(self, et, ev, tb) -> None:
        if et is not None:
            self.abort()

    def add(self, acc: "Accesses", steps: np.ndarray, hints: "Accesses | None" = None) -> None:
        """Append iterations; hints (target-keyed, see write_plan) only in a writer made with a
        hint_source, and only for a single add (an issuer may sit in the previous chunk)."""
        L, E = self.L, self.E
        first = self.n_it
        n_it = int(acc.n_iterations) - first if acc.n_iterations > first else 0
        it = acc.iteration.astype(np.int64) - first
        sub = type(acc)(it, acc.pass_, acc.layer, acc.expert, L, E, n_it, acc.order)
        skey, ex = _slot_keys(sub, L, E, n_it, "accesses", canonical=True, rank=self.order == "rank")
        n = ex.size
        passkey = skey // L
        lay = skey - passkey * L
        new = np.ones(n, bool)
        if n:
            new[1:] = passkey[1:] != passkey[:-1]
        starts = np.flatnonzero(new)
        P = starts.size
        pass_keys = passkey[starts]
        pass_it = pass_keys // 2
        pass_p = pass_keys % 2
        pass_start = np.append(starts, n)
        pidx = np.cumsum(new) - 1
        counts = np.bincount(pidx * L + lay, minlength=P * L).reshape(P, L) if n else np.zeros((0, L), np.int64)
        del pidx, lay
        ids = ex.astype(self.idt)
        if self.has_hints:
            if self.n_it or hints is None:
                raise UsageError("a plan with hints is written in one add() with its hints")
            new_slot = np.ones(n, bool)
            new_slot[1:] = skey[1:] != skey[:-1]
            h_ids, h_counts, h_start, self.hint_stats = _issuer_hints(hints, skey[new_slot], pass_keys, P, L, E,
                                                                      n_it, known=(acc, skey, ex))
            h_ids = h_ids.astype(self.idt)
        index = np.zeros(n_it, INDEX_DTYPE)
        index["step"] = np.asarray(steps, np.int64)[:n_it]
        it_first = np.searchsorted(pass_it, np.arange(n_it + 1))
        index["n_passes"] = np.diff(it_first)
        index["n_reads"] = np.diff(pass_start[it_first])
        offs = np.full(n_it, -1, np.int64)
        buf = bytearray()
        for j in range(P):
            i = int(pass_it[j])
            if offs[i] < 0:
                offs[i] = self.pos
            a, b = pass_start[j], pass_start[j + 1]
            parts = [counts[j].astype(self.idt).tobytes(), ids[a:b].tobytes()]
            nh = 0
            if self.has_hints:
                hs, he = h_start[j], h_start[j + 1]
                nh = int(he - hs)
                parts += [h_counts[j].astype(self.idt).tobytes(), h_ids[hs:he].tobytes()]
                self.n_hints += nh
            body_len = sum(len(x) for x in parts)
            pad = _align(_PASS_HEAD.size + body_len, 4) - (_PASS_HEAD.size + body_len)
            blk = b"".join([_PASS_HEAD.pack(PASS_TAG, first + i, int(pass_p[j]), FLAG_HINTS if self.has_hints else 0,
                                            0, int(b - a), nh), *parts, b"\0" * pad])
            buf += blk
            buf += struct.pack("<I", zlib.crc32(blk))
            self.pos += len(blk) + 4
            if len(buf) >= _WRITE_FLUSH:
                self.fh.write(buf)
                buf.clear()
        self.fh.write(buf)
        # iterations without passes get an empty span where they fall
        nxt = self.pos
        ends = np.zeros(n_it, np.int64)
        for i in range(n_it - 1, -1, -1):
            if offs[i] < 0:
                offs[i] = nxt
            ends[i] = nxt
            nxt = offs[i]
        index["offset"] = offs  # relative to the blocks; shifted in close()
        index["length"] = ends - offs
        self.index_parts.append(index)
        self.n_it += n_it
        self.n_passes += P
        self.n_reads += n

    def close(self, accepted_tokens: int | None = None, n_inputs: int = 0, meta: dict | None = None
              ) -> PlanHeader:
        try:
            self.fh.close()
            meta = dict(meta or {})
            meta.setdefault("schema", PLAN_SCHEMA)
            meta.setdefault("toolkit_version", __version__)
            meta.setdefault("geometry_name", self.geometry.name)
            if self.has_hints:
                meta["hints"] = {"source": self.hint_source, **meta.get("hints", {}), **self.hint_stats}
            meta_bytes = json.dumps(meta, sort_keys=True, default=json_default).encode()
            meta_offset = HEADER_SIZE
            index_offset = _align(meta_offset + len(meta_bytes), 8)
            blocks_offset = index_offset + INDEX_DTYPE.itemsize * self.n_it
            index = np.concatenate(self.index_parts) if self.index_parts else np.zeros(0, INDEX_DTYPE)
            index["offset"] = index["offset"] + np.uint64(blocks_offset)
            index_bytes = index.tobytes()
            file_size = blocks_offset + self.pos
            flags = (FLAG_RANK_ORDER if self.order == "rank" else 0) | (FLAG_HINTS if self.has_hints else 0)
            acc = -1 if accepted_tokens is None else int(accepted_tokens)
            g = self.geometry
            head = _HEADER.pack(MAGIC, VERSION_MAJOR, VERSION_MINOR, HEADER_SIZE, flags, self.L, self.E, g.k,
                                g.expert_bytes, self.id_bytes, self.n_it, self.n_passes, self.n_reads, self.n_hints,
                                acc, meta_offset, len(meta_bytes), index_offset, blocks_offset, file_size,
                                zlib.crc32(meta_bytes), zlib.crc32(index_bytes), n_inputs, self.hint_code)
            with open(self.tmp, "wb") as out:
                out.write(head + struct.pack("<I", zlib.crc32(head)))
                out.write(meta_bytes)
                out.write(b"\0" * (index_offset - meta_offset - len(meta_bytes)))
                out.write(index_bytes)
                with open(self.tmp_blocks, "rb") as blocks:
                    while True:
                        chunk = blocks.read(_SPAN_BYTES)
                        if not chunk:
                            break
                        out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise InputError(f"cannot write the plan: {e.strerror}", path=self.path) from None
        except BaseException:
            self.abort()
            raise
        self.abort()  # removes the blocks file
        return read_header(self.path)

    def abort(self) -> None:
        try:
            self.fh.close()
        except OSError:
            pass
        for f in (self.tmp_blocks, self.tmp):
            if os.path.exists(f):
                os.unlink(f)


# ---------------------------------------------------------------------------
# compiling traces


def h_none(hints, hints_from) -> bool:
    return hints in (None, "none") and hints_from is None


def _is_streamable(src) -> bool:
    """A path to an engine JSONL trace large enough for the streaming compiler
    (moetrace.inputs.stream.is_streamable: MOETRACE_STREAM_BYTES, default 8 MiB)."""
    from moetrace.inputs.stream import is_streamable

    return is_streamable(os.fspath(src))


def _compile_stream(path: str, out, L, E, K, base, expert_bytes: int, order: str, request: str | None,
                    block_bytes: int | None = None) -> PlanHeader | None:
    """Compile one engine JSONL in bounded memory (moetrace.inputs.stream); None when
    the fast reader cannot take the file (the caller then uses the in-memory path,
    which reports the exact error)."""
    from moetrace.inputs.stream import with_stream

    def write(ts) -> PlanHeader | None:
        L, E, K = ts.n_layers, ts.n_experts, ts.k
        if K > E:
            return None  # an inconsistent k: the in-memory path says which record disagrees
        custom = base is None or (L, E, K) != (base.n_layers, base.n_experts, base.k)
        geo = Geometry(L, E, K, int(expert_bytes), "custom" if custom else base.name)
        with PlanWriter(out, geo, order) as w:
            _add_stream_tables(w, ts, order, request)
            return w.close(**_stream_close(w, ts, path, order, request))

    return with_stream(path, write, K, L, E, block_bytes, force=True)


def _add_stream_tables(w: "PlanWriter", ts, order: str, request: str | None) -> None:
    """Every typed chunk of ts (of one request, when given) added to the plan as accesses."""
    from moetrace.inputs.trace import accesses_from_table

    for t in ts.tables():
        if request is not None:
            code = ts.requests.get(str(request))
            t = t[t["request"].to_numpy() == code] if code is not None else t.iloc[:0]
        if len(t) == 0:
            continue
        acc = accesses_from_table(t, ts.n_layers, ts.n_experts, order=order)
        steps = np.unique(t["step"].to_numpy(np.int64))
        acc.iteration = acc.iteration + np.int32(w.n_it)
        acc.n_iterations += w.n_it
        w.add(acc, steps)


def _stream_close(w: "PlanWriter", ts, path: str, order: str, request: str | None) -> dict:
    """The arguments of PlanWriter.close for a streamed trace: accepted tokens and the metadata."""
    n_req = len(ts.requests)
    accounting = ts.accounting()
    accepted = accounting["accepted_tokens"]
    if request is not None:
        code = ts.requests.get(str(request))
        if code is None:
            names = list(ts.requests)
            few = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
            raise UsageError(f"no request {str(request)!r} in {path} ({len(names)} requests: {few})")
        accepted = int(ts.typer.next_token[code])
        accounting = dict(accounting, requests=1, request=str(request), steps=w.n_it, accepted_tokens=accepted)
    meta = {"sources": [{"path": path, "iterations": w.n_it, "accounting": accounting}],
            "merged_iterations": w.n_it, "order": order, "requests": [n_req if request is None else 1]}
    if request is not None:
        meta["request"] = str(request)
    return {"accepted_tokens": accepted, "n_inputs": 1, "meta": meta}


def _window_accepted(tt: "TypedTrace", n_it: int) -> int:
    """Accepted tokens (of every request) in the first n_it iterations of a typed trace."""
    if n_it >= tt.n_steps and "accepted_tokens" in tt.accounting:
        return int(tt.accounting["accepted_tokens"])
    steps = tt.table["step"].to_numpy()
    u = np.unique(steps)
    m = tt.table["accepted"].to_numpy(bool)
    if n_it < u.size:
        m = m & (steps < u[n_it])
    key = tt.table["request"].to_numpy(np.int64)[m] * (1 << 32) + tt.table["token"].to_numpy(np.int64)[m]
    return int(np.unique(key).size)


def _check_typed(tt: "TypedTrace", path: str, n_layers: int | None, n_experts: int | None,
                 k: int | None) -> None:
    """A loaded .parquet typed trace is not re-validated by load_trace: check it fits."""
    if k is not None and tt.k != k:
        raise UsageError(f"{path}: the typed trace has k={tt.k}, the geometry says k={k}",
                         hint="re-parse the engine trace with the right --k, or drop --k")
    if len(tt.table):
        lmax = int(tt.table["layer"].max())
        emax = int(tt.table["expert"].max())
        if n_layers is not None and lmax >= n_layers:
            raise InputError(f"unknown layer {lmax} (the geometry has {n_layers} layers)", path=path)
        if n_experts is not None and emax >= n_experts:
            raise InputError(f"unknown expert {emax} (the geometry has {n_experts} experts per layer)",
                             path=path)


def read_predictor(path: str | os.PathLike, steps: np.ndarray, n_layers: int, n_experts: int
                   ) -> tuple["Accesses", dict]:
    """Read a recorded predictor plan (engine JSONL: the record for (step, layer) holds
    the experts predicted for that layer) as target-keyed predictions.

    steps maps engine step numbers to plan iterations (iteration i = steps[i]). A
    layer's second record in a step predicts the fallback pass. Records for steps
    not in the plan are counted in the returned stats, not silently lost.
    Raises InputError (file, line) for layers or experts outside the geometry.
    """
    from moetrace.inputs.trace import Accesses, read_jsonl

    spath = os.fspath(path)
    step_to_it = {int(s): i for i, s in enumerate(np.asarray(steps).tolist())}
    its: list[int] = []
    pss: list[int] = []
    lays: list[int] = []
    exs: list[int] = []
    seen: dict[tuple[int, int], int] = {}
    unmatched = 0
    extra_pass = 0
    n_rec = 0
    for r in read_jsonl(spath):
        n_rec += 1
        if r.layer < 0 or r.layer >= n_layers:
            raise InputError(f"unknown layer {r.layer} (the geometry has {n_layers} layers)", path=spath,
                             line=r.line)
        if r.experts and (min(r.experts) < 0 or max(r.experts) >= n_experts):
            raise InputError(f"unknown expert in {r.experts} (the geometry has {n_experts} experts per layer)",
                             path=spath, line=r.line)
        i = step_to_it.get(r.step)
        if i is None:
            unmatched += 1
            continue
        occ = seen.get((r.step, r.layer), 0)
        seen[(r.step, r.layer)] = occ + 1
        if occ >= 2:
            extra_pass += 1
            continue
        m = len(r.experts)
        its += [i] * m
        pss += [occ] * m
        lays += [r.layer] * m
        exs += r.experts
    if n_rec and unmatched == n_rec:
        raise InputError("no predictor record names a step of the plan's trace", path=spath,
                         hint=f"the trace's steps run {int(steps[0])}..{int(steps[-1])}" if len(steps) else None)
    it = np.asarray(its, np.int64)
    ps = np.asarray(pss, np.int64)
    lay = np.asarray(lays, np.int64)
    ex = np.asarray(exs, np.int64)
    key = _sorted_unique(((it * 2 + ps) * n_layers + lay) * n_experts + ex)
    ex = key % n_experts
    rest = key // n_experts
    lay = rest % n_layers
    rest //= n_layers
    acc = Accesses((rest // 2).astype(np.int32), (rest % 2).astype(np.int8), lay.astype(np.int16),
                   ex.astype(np.int32), n_layers, n_experts, len(steps))
    stats = {"path": spath, "records": n_rec, "records_unmatched_step": unmatched,
             "records_third_pass": extra_pass}
    return acc, stats


def compile_plan(
    inputs: Sequence["str | os.PathLike | TypedTrace"],
    out: str | os.PathLike,
    *,
    geometry: str | Geometry | None = None,
    n_layers: int | None = None,
    n_experts: int | None = None,
    k: int | None = None,
    expert_bytes: int | None = None,
    hints: str | None = None,
    hints_from: str | os.PathLike | None = None,
    request: str | None = None,
    order: str = "rank",
) -> PlanHeader:
    """Compile typed traces (engine .jsonl, typed .parquet, or TypedTrace objects) into plan.bin.

    One iteration = one forward pass (step); per layer it reads the batch union
    of the experts its requests selected, each once. request names one request
    to compile alone (its forward passes only). order: "rank" keeps each
    slot's experts as routed (best rank over the batch first), "sorted" makes
    them ascending. Several inputs are merged iteration by iteration and truncated to the
    shortest (moetrace.inputs.trace.merge_accesses). Geometry: explicit n_layers /
    n_experts / k / expert_bytes win, then the preset named by geometry, then
    the trace (expert_bytes then defaults to 0 = unknown). hints="oracle" stores
    the actual next-layer sets as hints; hints_from names a recorded predictor
    JSONL. The plan's accepted tokens = the sum of each input's accepted tokens
    within the merged window. Raises InputError / UsageError with the file and line.
    """
    from moetrace.inputs.trace import TypedTrace

    if not inputs:
        raise UsageError("no trace to compile", hint="name one or more trace files")
    if hints not in (None, "none", "oracle"):
        raise UsageError(f"unknown hint mode {hints!r}", hint="use --hints oracle or --hints-from PREDICTOR.jsonl")
    if hints == "oracle" and hints_from is not None:
        raise UsageError("--hints oracle and --hints-from are exclusive")
    base, L, E, K, expert_bytes = _compile_geometry(geometry, n_layers, n_experts, k, expert_bytes)
    if (len(inputs) == 1 and not isinstance(inputs[0], TypedTrace) and h_none(hints, hints_from)
            and _is_streamable(inputs[0])):
        h = _compile_stream(os.fspath(inputs[0]), out, L, E, K, base, int(expert_bytes), order, request)
        if h is not None:
            return h
    traces, names = _load_inputs(inputs, L, E, K, request)
    ks = {tt.k for tt in traces}
    if K is None:
        if len(ks) > 1:
            raise UsageError(f"the inputs infer different k: {sorted(ks)}", hint="pass --k")
        K = ks.pop()
    L = L if L is not None else max(tt.n_layers for tt in traces)
    E = E if E is not None else max(tt.n_experts for tt in traces)
    custom = base is None or (L, E, K) != (base.n_layers, base.n_experts, base.k)
    geo = Geometry(L, E, K, int(expert_bytes), "custom" if custom else base.name)
    return _write_merged(out, traces, names, geo, order, request, hints, hints_from)


def _compile_geometry(geometry: "str | Geometry | None", n_layers: int | None, n_experts: int | None,
                      k: int | None, expert_bytes: int | None) -> tuple:
    """(preset or None, layers, experts, k, expert bytes): explicit values win, then the preset;
    None where the trace decides. UsageError for a value out of range."""
    base: Geometry | None
    if isinstance(geometry, Geometry):
        base = geometry
    elif geometry:
        base = preset(geometry)
    else:
        base = None
    L = n_layers if n_layers is not None else (base.n_layers if base else None)
    E = n_experts if n_experts is not None else (base.n_experts if base else None)
    K = k if k is not None else (base.k if base else None)
    for name, v in (("layers", L), ("experts", E), ("k", K)):
        if v is not None and v <= 0:
            raise UsageError(f"--{name} must be positive, got {v}")
    if K is not None and E is not None and K > E:
        raise UsageError(f"k={K} exceeds experts per layer={E}")
    if expert_bytes is None:
        expert_bytes = base.expert_bytes if base else 0
    if expert_bytes < 0:
        raise UsageError("--expert-bytes must be >= 0")
    return base, L, E, K, expert_bytes


def _load_inputs(inputs, L: int | None, E: int | None, K: int | None, request: str | None) -> tuple[list, list]:
    """(typed traces, their names): each input loaded (or taken as given), of one request when named."""
    from moetrace.inputs.trace import TypedTrace, load_trace

    traces: list[TypedTrace] = []
    names: list[str] = []
    for src in inputs:
        if isinstance(src, TypedTrace):
            tt, name = src, src.source or "<TypedTrace>"
        else:
            name = os.fspath(src)
            tt = load_trace(name, k=K, n_layers=L, n_experts=E)
        if request is not None:
            tt = tt.select_request(request)
        _check_typed(tt, name, L, E, K)
        traces.append(tt)
        names.append(name)
    return traces, names


def _write_merged(out, traces: list, names: list, geo: Geometry, order: str, request: str | None,
                  hints: str | None, hints_from) -> PlanHeader:
    """The traces' access streams merged iteration by iteration, written as the plan."""
    from moetrace.inputs.trace import accesses_from_table, merge_accesses

    L, E = geo.n_layers, geo.n_experts
    streams = [accesses_from_table(tt.table, L, E, order=order) for tt in traces]
    acc = merge_accesses(streams)
    n_it = acc.n_iterations
    accepted = sum(_window_accepted(tt, n_it) for tt in traces)
    steps = np.unique(traces[0].table["step"].to_numpy(np.int64))[:n_it]
    meta: dict = {
        "sources": [{"path": nm, "iterations": s.n_iterations, "accounting": tt.accounting}
                    for nm, s, tt in zip(names, streams, traces)],
        "merged_iterations": n_it,
        "order": order,
        "requests": [tt.n_requests for tt in traces],
    }
    if request is not None:
        meta["request"] = str(request)
    h = None
    src = None
    if hints == "oracle":
        h, src = acc, "oracle"
    elif hints_from is not None:
        h, st = read_predictor(hints_from, steps, L, E)
        src = "predictor"
        meta["hints"] = st
    return write_plan(out, acc, geo, hints=h, hint_source=src, accepted_tokens=accepted, steps=steps,
                      n_inputs=len(traces), meta=meta)


# ---------------------------------------------------------------------------
# reading


#: layer ids are int16 and global expert ids int32 wherever a plan is read into (Accesses, FlatPlan)
_MAX_LAYERS = 2**15 - 1
_MAX_EXPERT_IDS = 2**31 - 1


def _read_exact(fh, offset: int, n: int) -> bytes:
    fh.seek(offset)
    return fh.read(n)


def _parse_header(buf: bytes, path: str, actual_size: int) -> PlanHeader:
    if len(buf) < 12:
        raise PlanFormatError(f"truncated header: the file ends at offset {len(buf)}, a plan header "
                              f"needs {HEADER_SIZE} bytes", path=path, offset=len(buf))
    if buf[:8] != MAGIC:
        raise PlanFormatError(f"bad magic {buf[:8]!r} at offset 0 (expected {MAGIC!r}): not a moetrace plan",
                              path=path, offset=0, hint="compile one with `moetrace plan compile TRACE -o plan.bin`")
    major, minor = struct.unpack_from("<HH", buf, 8)
    if major != VERSION_MAJOR:
        raise PlanFormatError(f"unknown plan format version {major}.{minor} at offset 8 "
                              f"(this moetrace {__version__} reads {VERSION_MAJOR}.x)", path=path, offset=8,
                              hint="use the moetrace that wrote the plan, or recompile it with this one")
    if len(buf) < 16:
        raise PlanFormatError(f"truncated header: the file ends at offset {len(buf)}, a plan header "
                              f"needs {HEADER_SIZE} bytes", path=path, offset=len(buf))
    (header_size,) = struct.unpack_from("<I", buf, 12)
    if header_size < HEADER_SIZE or header_size > 1 << 20:
        raise PlanFormatError(f"bad header_size {header_size} at offset 12", path=path, offset=12)
    if len(buf) < header_size:
        raise PlanFormatError(f"truncated header: the file ends at offset {len(buf)}, the header needs "
                              f"{header_size} bytes", path=path, offset=len(buf))
    (stored,) = struct.unpack_from("<I", buf, header_size - 4)
    got = zlib.crc32(buf[:header_size - 4])
    if stored != got:
        raise PlanFormatError(f"header checksum mismatch (bytes 0..{header_size - 4}, CRC-32 stored at offset "
                              f"{header_size - 4}: {stored:#010x}, computed {got:#010x})",
                              path=path, offset=header_size - 4)
    (magic, major, minor, header_size, flags, L, E, k, expert_bytes, id_bytes, n_it, P, n_reads, n_hints,
     acc, meta_offset, meta_length, index_offset, blocks_offset, file_size, meta_crc, index_crc, n_inputs,
     src) = _HEADER.unpack_from(buf, 0)

    def bad(msg: str, off: int):
        return PlanFormatError(f"inconsistent header: {msg} (field at offset {off})", path=path, offset=off)

    if L <= 0 or E <= 0 or k <= 0:
        raise bad(f"geometry {L}x{E} k={k}", 20)
    if id_bytes not in (2, 4) or (id_bytes == 2 and E > 0xFFFF):
        raise bad(f"id_bytes {id_bytes} for {E} experts", 40)
    if meta_offset != header_size:
        raise bad(f"meta_offset {meta_offset} != header_size {header_size}", 80)
    if index_offset != _align(meta_offset + meta_length, 8):
        raise bad(f"index_offset {index_offset}", 96)
    if blocks_offset != index_offset + INDEX_DTYPE.itemsize * n_it:
        raise bad(f"blocks_offset {blocks_offset}", 104)
    if file_size < blocks_offset:
        raise bad(f"file_size {file_size} < blocks_offset {blocks_offset}", 112)
    if L > _MAX_LAYERS or L * E > _MAX_EXPERT_IDS:
        raise bad(f"geometry {L}x{E} is beyond what a reader keeps (at most {_MAX_LAYERS} layers and "
                  f"{_MAX_EXPERT_IDS} expert ids)", 20)
    # every pass block holds its head, CRC and per-layer counts, every read and hint an id: a header
    # whose totals cannot fit in the file is damaged (and would make readers allocate for them)
    per_pass = _PASS_HEAD.size + 4 + (2 * L if flags & FLAG_HINTS else L) * id_bytes
    need = P * per_pass + (n_reads + n_hints) * id_bytes
    if blocks_offset + need > file_size:
        raise bad(f"{P} passes of {L} layers, {n_reads} reads and {n_hints} hints need at least {need} bytes "
                  f"of pass blocks, file_size {file_size} leaves {file_size - blocks_offset}", 48)
    if src >= len(HINT_SOURCES):
        raise bad(f"hint_source {src}", 132)
    return PlanHeader(L, E, k, expert_bytes, id_bytes, n_it, P, n_reads, n_hints, None if acc < 0 else acc,
                      HINT_SOURCES[src], n_inputs, flags, (major, minor), meta_offset, meta_length,
                      index_offset, blocks_offset, file_size, meta_crc, index_crc)


class PlanReader:
    """An open plan.bin: header and index verified on open, pass blocks read on demand.

    Use as a context manager. passes() streams every pass block by block;
    read_iteration(i) reads one iteration through the index (two preads).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            self._fh = open(self.path, "rb")
        except OSError as e:
            raise InputError(f"cannot open plan: {e.strerror}", path=self.path) from None
        try:
            self._open()
        except BaseException:
            self._fh.close()
            raise

    def _open(self) -> None:
        fh, path = self._fh, self.path
        size = os.fstat(fh.fileno()).st_size
        self.actual_size = size
        head = fh.read(HEADER_SIZE)
        if len(head) >= 16:
            (hs,) = struct.unpack_from("<I", head, 12)
            if HEADER_SIZE < hs <= 1 << 20 and head[:8] == MAGIC:
                head += fh.read(hs - HEADER_SIZE)
        h = _parse_header(head, path, size)
        self.header = h
        if size < h.file_size:
            raise PlanFormatError(self._truncation(size), path=path, offset=size)
        if size > h.file_size:
            raise PlanFormatError(f"{size - h.file_size} unexpected bytes after the end of the plan at offset "
                                  f"{h.file_size}", path=path, offset=h.file_size)
        meta = _read_exact(fh, h.meta_offset, h.meta_length)
        got = zlib.crc32(meta)
        if got != h.meta_crc32:
            raise PlanFormatError(f"meta checksum mismatch in the meta section at offset {h.meta_offset} "
                                  f"(stored {h.meta_crc32:#010x}, computed {got:#010x})", path=path,
                                  offset=h.meta_offset)
        try:
            h.meta = json.loads(meta)
        except (ValueError, UnicodeDecodeError):
            raise PlanFormatError("meta section is not JSON", path=path, offset=h.meta_offset) from None
        if not isinstance(h.meta, dict):
            raise PlanFormatError(f"meta section at offset {h.meta_offset} is not a JSON object "
                                  f"(a {type(h.meta).__name__})", path=path, offset=h.meta_offset)
        # verify the index CRC and its chaining, chunk by chunk
        crc = 0
        expect = h.blocks_offset
        passes = reads = 0
        for base, chunk in self._index_chunks(verify=False):
            crc = zlib.crc32(chunk.tobytes(), crc)
        if crc != h.index_crc32:
            raise PlanFormatError(f"index checksum mismatch in the iteration index at offset {h.index_offset} "
                                  f"(stored {h.index_crc32:#010x}, computed {crc:#010x})", path=path,
                                  offset=h.index_offset)
        for base, chunk in self._index_chunks(verify=False):
            off = chunk["offset"].astype(np.int64)
            ln = chunk["length"].astype(np.int64)
            prev_end = np.r_[expect, (off + ln)[:-1]]
            bad = np.flatnonzero(off != prev_end)
            if bad.size:
                i = base + int(bad[0])
                raise PlanFormatError(f"iteration index entry {i} points at offset {int(off[bad[0]])}, "
                                      f"expected {int(prev_end[bad[0]])}", path=path,
                                      offset=h.index_offset + 32 * i)
            if off.size:
                expect = int(off[-1] + ln[-1])
            passes += int(chunk["n_passes"].sum(dtype=np.int64))
            reads += int(chunk["n_reads"].sum(dtype=np.int64))
        if expect != h.file_size or passes != h.n_passes or reads != h.n_reads:
            raise PlanFormatError("the iteration index does not agree with the header's totals",
                                  path=path, offset=h.index_offset)

    def _truncation(self, size: int) -> str:
        h = self.header
        tail = f"the file ends at offset {size}, the header says {h.file_size} bytes"
        if size < h.index_offset:
            return f"truncated meta section at offset {h.meta_offset}: {tail}"
        if size < h.blocks_offset:
            return f"truncated iteration index at offset {h.index_offset}: {tail}"
        # binary search over the (complete) index for the iteration holding EOF
        lo, hi = 0, h.n_iterations - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._entry(mid)["offset"] <= size:
                lo = mid
            else:
                hi = mid - 1
        e = self._entry(lo)
        return (f"truncated pass block section: iteration {lo} starts at offset {int(e['offset'])} and needs "
                f"{int(e['length'])} bytes; {tail}")

    def _entry(self, i: int) -> np.void:
        raw = _read_exact(self._fh, self.header.index_offset + 32 * i, 32)
        return np.frombuffer(raw, INDEX_DTYPE)[0]

    def _index_chunks(self, start: int = 0, verify: bool = True) -> Iterator[tuple[int, np.ndarray]]:
        h = self.header
        for base in range(start, h.n_iterations, _INDEX_CHUNK):
            m = min(_INDEX_CHUNK, h.n_iterations - base)
            raw = _read_exact(self._fh, h.index_offset + 32 * base, 32 * m)
            if len(raw) != 32 * m:
                raise PlanFormatError(f"truncated iteration index at offset {h.index_offset + 32 * base + len(raw)}",
                                      path=self.path, offset=h.index_offset + 32 * base + len(raw))
            yield base, np.frombuffer(raw, INDEX_DTYPE)

    def iteration_reads(self) -> np.ndarray:
        """Reads of each iteration (int64, one per iteration), from the index alone."""
        out = np.zeros(self.header.n_iterations, np.int64)
        for base, chunk in self._index_chunks():
            out[base:base + chunk.size] = chunk["n_reads"]
        return out

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "PlanReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _parse_span(self, buf: bytes, base_off: int, entries: np.ndarray, first_it: int) -> Iterator[PlanPass]:
        h = self.header
        L = h.n_layers
        idt = h.id_dtype
        w = h.id_bytes
        hinted = h.has_hints
        pos = 0
        mv = memoryview(buf)
        E = h.n_experts
        for r, e in enumerate(entries):
            i = first_it + r
            end = pos + int(e["length"])
            step = int(e["step"])
            it_reads = 0
            last_p = -1
            for _ in range(int(e["n_passes"])):
                off = base_off + pos
                if pos + _PASS_HEAD.size + 4 > end:
                    raise PlanFormatError(f"pass block of iteration {i} at offset {off} overruns its index span",
                                          path=self.path, offset=off)
                tag, it, p, flags, _res, nr, nh = _PASS_HEAD.unpack_from(buf, pos)
                body = (2 * L if hinted else L) + nr + nh
                blen = _align(_PASS_HEAD.size + body * w, 4)
                if pos + blen + 4 > end:
                    # a damaged length field; report the checksum of what the index spans
                    raise PlanFormatError(f"checksum mismatch in the pass block of iteration {i} at offset {off} "
                                          f"(its header is damaged: n_reads={nr}, n_hints={nh} overrun the "
                                          f"block)", path=self.path, offset=off)
                (stored,) = struct.unpack_from("<I", buf, pos + blen)
                got = zlib.crc32(mv[pos:pos + blen])
                if stored != got:
                    raise PlanFormatError(f"checksum mismatch in the pass block of iteration {i} at offset {off} "
                                          f"(bytes {off}..{off + blen}, stored {stored:#010x}, computed "
                                          f"{got:#010x})", path=self.path, offset=off)
                if tag != PASS_TAG or it != i or bool(flags & FLAG_HINTS) != hinted or nh and not hinted:
                    raise PlanFormatError(f"pass block at offset {off} does not match the index "
                                          f"(tag {tag:#x}, iteration {it}, expected {i})",
                                          path=self.path, offset=off)
                q = pos + _PASS_HEAD.size
                counts = np.frombuffer(buf, idt, L, q)
                q += L * w
                experts = np.frombuffer(buf, idt, nr, q)
                q += nr * w
                hc = hx = None
                if hinted:
                    hc = np.frombuffer(buf, idt, L, q)
                    q += L * w
                    hx = np.frombuffer(buf, idt, nh, q)
                if int(counts.sum(dtype=np.int64)) != nr or (hinted and int(hc.sum(dtype=np.int64)) != nh):
                    raise PlanFormatError(f"pass block at offset {off}: per-layer counts do not add up to n_reads",
                                          path=self.path, offset=off)
                # checksums only prove the bytes are as written: the values must fit the geometry too
                if p > 1 or p <= last_p:
                    raise PlanFormatError(f"pass block at offset {off}: pass {p} of iteration {i} "
                                          f"(passes are 0, then 1 for a fallback)", path=self.path, offset=off)
                if (nr and int(experts.max()) >= E) or (hinted and nh and int(hx.max()) >= E):
                    raise PlanFormatError(f"pass block at offset {off}: an expert index "
                                          f">= n_experts={E}", path=self.path, offset=off)
                last_p = p
                it_reads += nr
                yield PlanPass(i, p, step, off, counts, experts, hc, hx)
                pos += blen + 4
            if it_reads != int(e["n_reads"]):
                at = h.index_offset + 32 * i
                raise PlanFormatError(f"iteration {i}: its pass blocks read {it_reads} experts, the index entry "
                                      f"at offset {at} says {int(e['n_reads'])}", path=self.path, offset=at)
            if pos != end:
                raise PlanFormatError(f"iteration {i}: its pass blocks end at offset {base_off + pos}, the index "
                                      f"says {base_off + end}", path=self.path, offset=base_off + pos)

    def passes(self, start: int = 0, stop: int | None = None) -> Iterator[PlanPass]:
        """Stream the passes of iterations [start, stop), reading ~4 MiB at a time."""
        h = self.header
        stop = h.n_iterations if stop is None else min(stop, h.n_iterations)
        for base, chunk in self._index_chunks(start):
            if base >= stop:
                break
            chunk = chunk[: max(0, stop - base)]
            lens = chunk["length"].astype(np.int64)
            cum = np.cumsum(lens)
            r = 0
            while r < chunk.size:
                # take iterations until the span reaches _SPAN_BYTES (at least one)
                lim = (cum[r - 1] if r else 0) + _SPAN_BYTES
                s = max(r + 1, int(np.searchsorted(cum, lim, side="right")))
                s = min(s, chunk.size)
                off0 = int(chunk["offset"][r])
                n = int(cum[s - 1] - (cum[r - 1] if r else 0))
                buf = _read_exact(self._fh, off0, n)
                if len(buf) != n:
                    raise PlanFormatError(f"truncated pass block section at offset {off0 + len(buf)}",
                                          path=self.path, offset=off0 + len(buf))
                yield from self._parse_span(buf, off0, chunk[r:s], base + r)
                r = s

    def read_iteration(self, i: int) -> list[PlanPass]:
        """The passes of iteration i (one index read, one block read)."""
        if not 0 <= i < self.header.n_iterations:
            raise UsageError(f"iteration {i} out of range (the plan has {self.header.n_iterations})")
        e = np.array([self._entry(i)], INDEX_DTYPE)
        buf = _read_exact(self._fh, int(e["offset"][0]), int(e["length"][0]))
        return list(self._parse_span(buf, int(e["offset"][0]), e, i))


def read_header(path: str | os.PathLike) -> PlanHeader:
    """Read and verify a plan's header, meta and index (not the pass blocks)."""
    with PlanReader(path) as r:
        return r.header


def open_plan(path: str | os.PathLike) -> PlanReader:
    """Open a plan for streaming or random access (see PlanReader)."""
    return PlanReader(path)


def iter_passes(path: str | os.PathLike) -> Iterator[PlanPass]:
    """Stream every pass of a plan in replay order, verifying each block's CRC.

    Memory stays bounded (one ~4 MiB span of blocks and a 2 MiB index chunk at a
    time) however long the plan is. A corrupt block raises PlanFormatError when
    the stream reaches it; run verify_plan() first to fail before replaying.
    """
    with PlanReader(path) as r:
        yield from r.passes()


def verify_plan(path: str | os.PathLike) -> PlanHeader:
    """Read every block of a plan, verifying all checksums; returns the header."""
    with PlanReader(path) as r:
        for _ in r.passes():
            pass
        return r.header


def read_accesses(path: str | os.PathLike) -> "Accesses":
    """Load a whole plan as a moetrace.inputs.trace.Accesses (for the simulator)."""
    from moetrace.inputs.trace import Accesses

    with PlanReader(path) as r:
        h = r.header
        L = h.n_layers
        n_iters = np.empty(h.n_passes, np.int32)
        n_pass = np.empty(h.n_passes, np.int8)
        counts = np.empty((h.n_passes, L), np.int64)
        experts = np.empty(h.n_reads, np.int32)
        j = q = 0
        for ps in r.passes():
            n_iters[j] = ps.iteration
            n_pass[j] = ps.pass_index
            counts[j] = ps.counts
            experts[q:q + ps.n_reads] = ps.experts
            q += ps.n_reads
            j += 1
    per_pass = counts.sum(axis=1)
    return Accesses(np.repeat(n_iters, per_pass), np.repeat(n_pass, per_pass),
                    np.repeat(np.tile(np.arange(L, dtype=np.int16), h.n_passes), counts.ravel()),
                    experts, L, h.n_experts, h.n_iterations, h.order)


def _meta_sources(meta: dict) -> list:
    """The source paths the meta names (a foreign writer's meta may hold anything there)."""
    src = meta.get("sources")
    if not isinstance(src, list):
        return []
    return [s["path"] if isinstance(s, dict) and isinstance(s.get("path"), str) else None for s in src]


def inspect_plan(path: str | os.PathLike) -> dict:
    """Summarize a plan, streaming (and verifying) every block.

    Returns path, format_version, file_bytes, geometry, iterations, passes,
    fallback_passes, reads, logical_bytes (None if expert bytes are unknown),
    accepted_tokens (None if unknown), reads_per_iteration,
    reads_per_accepted_token, hint_source, hint_count, hint_recall and
    hint_precision (None without hints), sources and verified.

    hint_recall = hinted experts that the next non-empty slot reads / all reads
    of slots that follow another slot (the first slot of the plan has no issuer);
    hint_precision = the same hits / all hints.
    """
    with PlanReader(path) as r:
        h = r.header
        L, E = h.n_layers, h.n_experts
        fallback = 0
        hits = 0
        targets = 0
        carry: np.ndarray | None = None  # hints issued by the last slot of the previous pass
        seen = np.zeros(L * E, bool)
        layer_base = np.arange(L, dtype=np.int64) * E
        for ps in r.passes():
            fallback += ps.pass_index == 1
            if not h.has_hints:
                continue
            cnt = ps.counts.astype(np.int64)
            nz = np.flatnonzero(cnt)
            if nz.size == 0:
                continue
            # mark this pass's reads in a (layer, expert) bitmap, count hinted ones, unmark
            akey = np.repeat(layer_base, cnt)
            akey += ps.experts
            seen[akey] = True
            first, last = int(nz[0]), int(nz[-1])
            if carry is not None:  # hints of the previous pass's last slot target our first slot
                targets += int(cnt[first])
                hits += int(np.count_nonzero(seen[first * E + carry]))
            # within the pass: hints of slot nz[a] target slot nz[a + 1]
            hc = ps.hint_counts.astype(np.int64)
            n_inner = int(hc[:last].sum())
            nxt = np.full(L, -1, np.int64)
            nxt[nz[:-1]] = nz[1:] * E
            hkey = np.repeat(nxt, hc)[:n_inner]
            ok = hkey >= 0  # hints issued at empty slots have no target
            hkey += ps.hints[:n_inner]
            hits += int(np.count_nonzero(seen[hkey[ok]]))
            targets += ps.n_reads - int(cnt[first])
            seen[akey] = False
            carry = ps.hints[n_inner:n_inner + hc[last]].astype(np.int64)
    has = h.has_hints
    out = {
        "path": os.fspath(path),
        "format_version": f"{h.version[0]}.{h.version[1]}",
        "file_bytes": h.file_size,
        "geometry": {"name": h.meta.get("geometry_name", "custom"), "n_layers": L, "n_experts": E, "k": h.k,
                     "expert_bytes": h.expert_bytes},
        "iterations": h.n_iterations,
        "passes": h.n_passes,
        "fallback_passes": int(fallback),
        "reads": h.n_reads,
        "logical_bytes": h.logical_bytes,
        "accepted_tokens": h.accepted_tokens,
        "reads_per_iteration": h.n_reads / h.n_iterations if h.n_iterations else None,
        "reads_per_accepted_token": h.n_reads / h.accepted_tokens if h.accepted_tokens else None,
        "hint_source": h.hint_source,
        "hint_count": h.n_hints if has else None,
        "hint_recall": (hits / targets if targets else None) if has else None,
        "hint_precision": (hits / h.n_hints if h.n_hints else None) if has else None,
        "hint_stats": h.meta.get("hints") if has else None,
        "inputs": h.n_inputs,
        "sources": _meta_sources(h.meta),
        "verified": True,
    }
    return out


__all__ = ["MAGIC", "VERSION_MAJOR", "VERSION_MINOR", "PlanHeader", "PlanPass", "PlanReader", "write_plan",
           "compile_plan", "read_predictor", "read_header", "open_plan", "iter_passes", "verify_plan",
           "read_accesses", "inspect_plan"]


# ---------------------------------------------------------------------------
# the plan, flattened for replay


@dataclass
class FlatPlan:
    """A whole plan in memory, flattened into slots (one per non-empty (pass, layer)).

    ids: global expert ids of every read in replay order; slot_bounds[s]..[s+1]
    spans slot s in ids; hint_ids / hint_bounds the same for the hint set slot s
    issues (global ids of the slot it targets); iter_bounds[i]..[i+1] the slots
    of iteration i. Held in memory so that the measured interval reads nothing
    but pool bytes (no plan-file I/O).
    """

    path: str
    header: object
    ids: np.ndarray
    slot_bounds: np.ndarray
    hint_ids: np.ndarray
    hint_bounds: np.ndarray
    iter_bounds: np.ndarray
    iterations: np.ndarray
    steps: np.ndarray
    plan_passes: np.ndarray

    @property
    def n_iterations(self) -> int:
        return int(self.iterations.size)

    @property
    def n_reads(self) -> int:
        return int(self.ids.size)

    @property
    def n_hint_sets(self) -> int:
        """Non-empty hint sets per pass over the plan (what the advisor is given)."""
        return int(np.count_nonzero(np.diff(self.hint_bounds)))

    def counts(self, n_total: int) -> np.ndarray:
        """Accesses per expert_id over the whole plan (the oracle frequency table)."""
        return np.bincount(self.ids, minlength=n_total)


def load_flat_plan(path: str | os.PathLike) -> FlatPlan:
    """Read and verify a whole plan (every block CRC) into a FlatPlan."""
    spath = os.fspath(path)
    if not os.path.exists(spath):
        raise InputError("no such plan", path=spath, hint="compile one with `moetrace plan compile`")
    with open_plan(spath) as r:
        h = r.header
        L, E = h.n_layers, h.n_experts
        ids = np.empty(h.n_reads, np.int64)
        hint_chunks: list[np.ndarray] = []
        slot_sizes: list[np.ndarray] = []
        hint_sizes: list[np.ndarray] = []
        pass_first_slot: list[int] = []
        pass_iter: list[int] = []
        it_passes = np.zeros(h.n_iterations, np.int32)
        steps = np.zeros(h.n_iterations, np.int64)
        q = 0
        n_slots = 0
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per pass: nz layers, counts, hints split
        for ps in r.passes():
            cnt = ps.counts.astype(np.int64)
            nz = np.flatnonzero(cnt)
            lay = np.repeat(np.arange(L, dtype=np.int64), cnt)
            ids[q:q + ps.n_reads] = lay * E + ps.experts
            q += ps.n_reads
            slot_sizes.append(cnt[nz])
            pass_first_slot.append(n_slots)
            pass_iter.append(ps.iteration)
            n_slots += nz.size
            it_passes[ps.iteration] += 1
            steps[ps.iteration] = ps.step
            hb = ps.hints_by_layer() if h.has_hints else None
            pending.append((nz, hb))
        # hints: slot nz[a] of a pass targets nz[a+1]; the last slot targets the next pass's first slot
        first_layer = [int(nz[0]) if nz.size else -1 for nz, _ in pending]
        nxt_first = [-1] * len(pending)
        nf = -1
        for j in range(len(pending) - 1, -1, -1):
            nxt_first[j] = nf
            if first_layer[j] >= 0:
                nf = first_layer[j]
        for j, (nz, hb) in enumerate(pending):
            if hb is None:
                hint_sizes.append(np.zeros(nz.size, np.int64))
                continue
            sizes = np.zeros(nz.size, np.int64)
            for a, layer in enumerate(nz):
                target = int(nz[a + 1]) if a + 1 < nz.size else nxt_first[j]
                hx = hb[int(layer)]
                if target < 0 or hx.size == 0:
                    continue
                hint_chunks.append(target * E + hx.astype(np.int64))
                sizes[a] = hx.size
            hint_sizes.append(sizes)
        # an iteration's slots: passes are stored in iteration order
        slot_bounds = np.zeros(n_slots + 1, np.int64)
        if n_slots:
            np.cumsum(np.concatenate(slot_sizes), out=slot_bounds[1:])
        hint_bounds = np.zeros(n_slots + 1, np.int64)
        if n_slots:
            np.cumsum(np.concatenate(hint_sizes), out=hint_bounds[1:])
        iter_bounds = np.zeros(h.n_iterations + 1, np.int64)
        pf = np.asarray(pass_first_slot + [n_slots], np.int64)
        pi = np.asarray(pass_iter, np.int64)
        # first slot of iteration i = first slot of its first pass (or of the next non-empty one)
        first_pass = np.searchsorted(pi, np.arange(h.n_iterations + 1), side="left")
        iter_bounds[:] = pf[first_pass]
    hint_ids = np.concatenate(hint_chunks) if hint_chunks else np.zeros(0, np.int64)
    return FlatPlan(spath, h, ids, slot_bounds, hint_ids, hint_bounds, iter_bounds,
                    np.arange(h.n_iterations, dtype=np.int64), steps, it_passes)
