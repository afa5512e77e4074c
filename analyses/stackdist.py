"""Exact LRU hit rates for every capacity from one pass (Mattson stack distances).

The stack distance of an access is 1 + the number of distinct items accessed
since the previous access of the same item (0 here for a first access, i.e.
infinite). An LRU cache of capacity C hits an access iff its stack distance is
between 1 and C, so one histogram of stack distances over the scored window
gives the LRU hit count of *every* capacity at once (Mattson et al., 1970).

Distances are counted over a bitmap of time slots: only the most recent access
of each item holds a set bit, so the distance of an access is the set bits from
its item's slot to the next free one. The words after the item's slot count as
their slots minus the slots cleared there since the last compaction, read from a
small tree of cleared counts (fanout 16, one vector add per level to update), so
an access costs one bit clear, one bit set and a few loads and vector adds. The
slots are renumbered densely (compacted) whenever they run out, which keeps
every array cache-resident (about 0.4 MB for 82,432 items) however long the
stream is.

Scopes:

* ``per_layer`` — one independent cache per layer of B experts: the distance is
  counted within that layer's own access stream (one tree per layer).
* ``global`` — one pool keyed by expert_id = layer * n_experts + expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit, types
from llvmlite import ir
from numba.extending import intrinsic

from moetrace.errors import UsageError
from moetrace.inputs.trace import Accesses

SCOPES = ("per_layer", "global")


def normalize_scope(scope: str) -> str:
    """'per-layer' / 'per_layer' / 'global' -> 'per_layer' | 'global'."""
    s = str(scope).strip().lower().replace("-", "_")
    if s not in SCOPES:
        raise UsageError(f"unknown scope {scope!r}", hint="choose per-layer or global")
    return s


@dataclass(frozen=True)
class Window:
    """The fair evaluation window: warm on the first iterations, score the rest.

    Every access is simulated; only accesses with ``iteration >=
    warm_iterations`` (stream index ``>= cut``) are counted.
    """

    n_iterations: int
    warm_iterations: int
    cut: int  # first stream index of the scored window
    n_accesses: int

    @property
    def scored_iterations(self) -> int:
        return self.n_iterations - self.warm_iterations

    @property
    def scored_accesses(self) -> int:
        return self.n_accesses - self.cut


def warm_iterations(warm_fraction: float, n_iterations: int) -> int:
    """floor(warm_fraction * n_iterations), the warm window's iterations; a UsageError
    unless 0 <= warm_fraction < 1."""
    wf = float(warm_fraction)
    if not (0.0 <= wf < 1.0) or math.isnan(wf):
        raise UsageError(f"warm fraction must be in [0, 1), got {warm_fraction!r}",
                         hint="e.g. --warm-fraction 0.6 warms on 60% and scores the last 40%")
    return int(math.floor(round(wf * int(n_iterations), 9)))


def first_at(iteration: np.ndarray, it: int) -> int:
    """The stream index of iteration ``it``'s first access (``iteration`` sorted). The key is
    given in the array's dtype: numpy casts an array to int64 for a Python int key, a copy
    of the whole stream (~10 ms per 10 M accesses) for one binary search."""
    if iteration.dtype.kind in "iu" and np.iinfo(iteration.dtype).min <= it <= np.iinfo(iteration.dtype).max:
        it = iteration.dtype.type(it)
    return int(np.searchsorted(iteration, it, side="left"))


def window(acc: Accesses, warm_fraction: float = 0.6) -> Window:
    """Split ``acc`` into a warm window (first ``floor(warm_fraction * n_iterations)``
    iterations) and a scored window (the rest)."""
    n_it = int(acc.n_iterations)
    warm = warm_iterations(warm_fraction, n_it)
    return Window(n_it, warm, first_at(acc.iteration, warm), len(acc))


def scope_shape(n_layers: int, n_experts: int, scope: str) -> tuple[bool, int, int]:
    """(grouped, n_groups, n_items) of a scope: per_layer is one cache per layer over its
    experts, global one over every expert_id (which must fit 32 bits)."""
    if normalize_scope(scope) == "per_layer":
        return True, int(n_layers), int(n_experts)
    n_total = int(n_layers) * int(n_experts)
    if n_total >= 2**31:
        raise UsageError(f"{n_total} experts in all do not fit the simulator's 32-bit ids")
    return False, 1, n_total


def stream(acc: Accesses, scope: str) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(group, item, n_groups, n_items) arrays for a scope.

    per_layer: group = layer, item = expert; global: one group, item = expert_id.
    (The kernels take layer and expert as they are; this is for callers that want the
    items of a scope, e.g. to write them out.)
    """
    grouped, n_groups, n_items = scope_shape(acc.n_layers, acc.n_experts, scope)
    if grouped:
        return (np.ascontiguousarray(acc.layer, dtype=np.int32),
                np.ascontiguousarray(acc.expert, dtype=np.int32), n_groups, n_items)
    item = acc.layer.astype(np.int32) * np.int32(acc.n_experts) + acc.expert.astype(np.int32)
    return np.zeros(1, np.int32), np.ascontiguousarray(item, dtype=np.int32), 1, n_items


@intrinsic
def _popcount(typingctx, x):  # pragma: no cover - numba
    """Set bits of a uint64 (LLVM ctpop: one instruction)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return types.int64(types.uint64), codegen


# Cleared-slot tree: level h has one node of _FAN int32 entries per _FAN nodes (words at
# level 0) of the level below; entry e of level h counts the cleared slots in the nodes
# (words) after e within e's node, so the cleared slots in the words after word w are
# the sum over levels of entry w >> 4h. Clearing a slot in word w adds 1 to the entries
# before w's at each level: a masked add of one node, which _add_before does as one
# vector operation (16 int32 lanes: one AVX-512 or two AVX2 instructions).
_FAN = 16
_FAN_BITS = 4
_SLOTS_PER_ITEM = 3  # slots per group / items: a compaction every >= 2 x items accesses


@intrinsic
def _add_before(typingctx, arr, start, j):  # pragma: no cover - numba
    """arr[start + k] += 1 for k < j, k = 0 .. _FAN - 1 (an int32 array): one vector add."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int32 and arr.ndim == 1
            and isinstance(start, types.Integer) and isinstance(j, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        vty = ir.VectorType(i32, _FAN)
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        at = context.cast(builder, args[1], signature.args[1], types.int64)
        jj = builder.trunc(context.cast(builder, args[2], signature.args[2], types.int64), i32)
        ptr = builder.bitcast(builder.gep(data, [at]), vty.as_pointer())
        v = builder.load(ptr, align=4)
        splat = builder.insert_element(ir.Constant(vty, ir.Undefined), jj, ir.Constant(i32, 0))
        splat = builder.shuffle_vector(splat, ir.Constant(vty, ir.Undefined), ir.Constant(vty, [0] * _FAN))
        below = builder.icmp_unsigned("<", ir.Constant(vty, list(range(_FAN))), splat)
        builder.store(builder.add(v, builder.zext(below, vty)), ptr, align=4)
        return context.get_dummy_value()

    return types.void(arr, start, j), codegen


def _stack_state(n_groups: int, n_items: int) -> tuple:
    """Fresh state for :func:`_stack_chunk`: (bits, tree, levels, last, counter, scratch).

    Per group: W words of time slots (W a multiple of _FAN, > n_items + 1 slots), and a
    cleared-slot tree of T entries whose level h starts at levels[h]."""
    W = -(-(_SLOTS_PER_ITEM * n_items + 2) // (64 * _FAN)) * _FAN
    levels, T, span = [], 0, 1
    while True:
        levels.append(T)
        T += -(-W // (span * _FAN)) * _FAN
        if span * _FAN >= W:
            break
        span *= _FAN
    return (np.zeros(n_groups * W, np.uint64), np.zeros(n_groups * T, np.int32), np.array(levels, np.int64),
            np.full(n_groups * n_items, -1, np.int32), np.zeros(n_groups, np.int64), np.zeros(W, np.int64))


@njit(cache=True, nogil=True)
def _compact(g, n_items, W, T, bits, tree, last, scratch):  # pragma: no cover - numba
    """Group g's live slots renumbered 0..m-1 in time order (a slot's rank by popcount),
    its bitmap rebuilt and its cleared-slot tree zeroed; returns m, the next free slot."""
    wb = g * W
    one = np.uint64(1)
    m = 0
    for w in range(W):
        scratch[w] = m
        m += _popcount(bits[wb + w])
    for y in range(g * n_items, (g + 1) * n_items):
        q = last[y]
        if q >= 0:
            last[y] = scratch[q >> 6] + _popcount(bits[wb + (q >> 6)] & ((one << np.uint64(q & 63)) - one))
    for w in range(W):
        lo = w * 64
        if m >= lo + 64:
            bits[wb + w] = ~np.uint64(0)
        elif m > lo:
            bits[wb + w] = (one << np.uint64(m - lo)) - one
        else:
            bits[wb + w] = 0
    tree[g * T:(g + 1) * T] = 0
    return m


@njit(cache=True, nogil=True)
def _stack_chunk(layer, expert, n_experts, grouped, cut, hist, dist_out, bits, tree, levels, last, counter,
                 scratch):  # pragma: no cover - numba
    """The stack-distance pass over one chunk, its state carried in the arrays (see
    :class:`StackPass`): hist[d] += 1 from chunk index cut on; dist_out[i] = d when
    dist_out has one slot per access.

    Per group: a bitmap of time slots (a set bit = the latest access of some item),
    each item's latest slot, the cleared-slot tree. The distance of an access whose
    item sits at slot p (word wp) is the set bits in p..c-1 (c: the next free slot):
    those of word wp by popcount, plus the slots allocated in the words after wp
    (c - 64 (wp + 1), all < c were allocated since the compaction) less the cleared
    ones there (the tree's entries on wp's path); clearing slot p adds 1 on that path."""
    n = expert.shape[0]
    n_groups = last.shape[0] // n_experts if grouped else 1
    n_items = last.shape[0] // n_groups
    W = bits.shape[0] // n_groups
    T = tree.shape[0] // n_groups
    S = W * 64
    write = dist_out.shape[0] == n
    one = np.uint64(1)
    for i in range(n):
        g = np.int64(layer[i]) if grouped else 0
        wb = g * W
        tb = g * T
        lx = np.int64(layer[i]) * n_experts + expert[i]  # the expert_id in both scopes
        c = counter[g]
        if c == S:
            c = _compact(g, n_items, W, T, bits, tree, last, scratch)
        p = np.int64(last[lx])
        wc = c >> 6
        d = 0
        if p >= 0:
            wp = p >> 6
            sh = np.uint64(p & 63)
            word = bits[wb + wp]
            d = _popcount(word >> sh)
            bits[wb + wp] = word ^ (one << sh)
            if wp != wc:
                d += c - ((wp + 1) << 6)
            e = wp
            for h in range(levels.shape[0]):
                t = tb + levels[h] + e
                d -= tree[t]  # 0 when wp == wc: nothing after the last word
                j = e & (_FAN - 1)
                _add_before(tree, t - j, j)
                e >>= _FAN_BITS
        bits[wb + wc] |= one << np.uint64(c & 63)
        last[lx] = c
        counter[g] = c + 1
        if i >= cut:
            hist[d] += 1
        if write:
            dist_out[i] = d
    return hist


class StackPass:
    """Mattson stack distances of a stream fed in chunks, per scope: ``feed`` adds a
    chunk's distances (from chunk index ``cut`` on) to ``hist``; the state is O(items)
    whatever the stream's length, and any chunking gives the same result as one call.

    ``hist[d]`` counts accesses at stack distance d (0 = first access); per_layer
    keeps one stack per layer, global one over expert_id = layer * n_experts + expert.
    """

    def __init__(self, n_layers: int, n_experts: int, scope: str = "per_layer"):
        self.scope = normalize_scope(scope)
        self.n_experts = int(n_experts)
        self.grouped, n_groups, self.n_items = scope_shape(n_layers, n_experts, self.scope)
        self.hist = np.zeros(self.n_items + 2, np.int64)
        self._state = _stack_state(n_groups, self.n_items)

    def feed(self, layer: np.ndarray, expert: np.ndarray, cut: int = 0, distances: np.ndarray | None = None) -> None:
        """Stack distances of one chunk (layer and expert per access, in stream order);
        ``distances``, an int32 array of the chunk's length, receives each one."""
        out = np.zeros(0, np.int32) if distances is None else distances
        _stack_chunk(layer, expert, self.n_experts, self.grouped, int(cut), self.hist, out, *self._state)

    def cum_hits(self) -> np.ndarray:
        """cum[b] = accesses counted with distance 1..b: LRU hits at capacity b, b = 0 .. n_items."""
        cum = np.zeros(self.n_items + 1, np.int64)
        cum[1:] = np.cumsum(self.hist[1:self.n_items + 1])
        return cum


class LiveStack:
    """Stack distances of an unbounded stream fed in pieces (``moetrace watch``): one global
    LRU stack over ``n_items`` items, its state O(items) whatever the stream's length.
    ``feed(items)`` returns each access's distance (0 = the item's first access)."""

    def __init__(self, n_items: int):
        self.n_items = max(int(n_items), 1)
        self._pass = StackPass(1, self.n_items, "global")

    def feed(self, items: np.ndarray) -> np.ndarray:
        item = np.ascontiguousarray(items, dtype=np.int32)
        if len(item) and (item.min() < 0 or item.max() >= self.n_items):
            raise UsageError(f"stack items must be in [0, {self.n_items})")
        out = np.zeros(len(item), np.int32)
        if len(item):
            self._pass.feed(np.zeros(len(item), np.int8), item, len(item), out)
        return out


def lru_misses(distances: np.ndarray, capacity_items: int) -> np.ndarray:
    """Which accesses an LRU of ``capacity_items`` items misses: first accesses and those
    whose stack distance exceeds the capacity."""
    d = np.asarray(distances)
    return (d == 0) | (d > int(capacity_items))


def repeated_accesses(acc: Accesses, times: int) -> Accesses:
    """The access stream repeated ``times`` times (iterations renumbered): a replay's warm-up
    and measured passes over one plan."""
    n = int(acc.n_iterations)
    reps = np.arange(times, dtype=np.int64)
    it = (acc.iteration.astype(np.int64)[None, :] + reps[:, None] * n).ravel().astype(np.int64)
    return Accesses(it, np.tile(acc.pass_, times), np.tile(acc.layer, times), np.tile(acc.expert, times),
                    acc.n_layers, acc.n_experts, n * times)


def stack_distances(acc: Accesses, scope: str = "per_layer") -> np.ndarray:
    """Per-access LRU stack distance (int32; 0 = first access of that item in its scope)."""
    out = np.zeros(len(acc), np.int32)
    StackPass(acc.n_layers, acc.n_experts, scope).feed(acc.layer, acc.expert, 0, out)
    return out


@dataclass(frozen=True)
class StackCurve:
    """LRU hits in the scored window for every capacity, from one pass.

    ``cum_hits[b]`` = hits of an LRU cache of b items (per layer for per_layer,
    in all for global), b = 0 .. n_items; larger capacities equal ``cum_hits[-1]``
    (only first accesses miss).
    """

    scope: str
    cum_hits: np.ndarray  # int64, length n_items + 1
    accesses: int  # accesses in the scored window
    window: Window
    cold: int  # first accesses (compulsory misses) in the scored window

    @property
    def n_items(self) -> int:
        return int(self.cum_hits.size - 1)

    @property
    def budgets(self) -> np.ndarray:
        """Capacities 1 .. n_items."""
        return np.arange(1, self.n_items + 1, dtype=np.int64)

    @property
    def hit_rates(self) -> np.ndarray:
        """Hit rate at each of :attr:`budgets` (NaN when the window scores nothing)."""
        if self.accesses == 0:
            return np.full(self.n_items, np.nan)
        return self.cum_hits[1:] / self.accesses

    def hits_at(self, budget: int | np.ndarray) -> np.ndarray | int:
        """LRU hits at any capacity (scalar or array)."""
        b = np.clip(np.asarray(budget, dtype=np.int64), 0, self.n_items)
        out = self.cum_hits[b]
        return int(out) if out.ndim == 0 else out

    def hit_rate_at(self, budget: int | np.ndarray) -> float | np.ndarray:
        """LRU hit rate at any capacity (NaN when the window scores nothing)."""
        h = np.asarray(self.hits_at(budget), dtype=np.float64)
        r = h / self.accesses if self.accesses else np.full(h.shape, np.nan)
        return float(r) if r.ndim == 0 else r

    def miss_bytes_per_iteration(self, budget: int | np.ndarray, expert_bytes: int) -> float | np.ndarray:
        """Miss demand: LRU misses x expert_bytes / scored iterations (NaN if none scored)."""
        m = self.accesses - np.asarray(self.hits_at(budget), dtype=np.float64)
        it = self.window.scored_iterations
        r = m * float(expert_bytes) / it if it else np.full(m.shape, np.nan)
        return float(r) if r.ndim == 0 else r


def lru_stack_curve(acc: Accesses, scope: str = "per_layer", warm_fraction: float = 0.6) -> StackCurve:
    """One pass over ``acc``: exact LRU hits at every capacity in the scored window."""
    win = window(acc, warm_fraction)
    sp = StackPass(acc.n_layers, acc.n_experts, scope)
    sp.feed(acc.layer, acc.expert, win.cut)
    return StackCurve(sp.scope, sp.cum_hits(), win.scored_accesses, win, int(sp.hist[0]))


def lru_curve(acc: Accesses, scope: str = "per_layer", warm_fraction: float = 0.6
              ) -> tuple[np.ndarray, np.ndarray]:
    """(budgets 1..n_items, LRU hit rate at each) from one stack-distance pass.

    Use :func:`lru_stack_curve` for hit counts and miss demand at any budget.
    """
    c = lru_stack_curve(acc, scope, warm_fraction)
    return c.budgets, c.hit_rates
