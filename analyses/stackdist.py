"""Exact LRU hit rates for every capacity from one pass (Mattson stack distances).

The stack distance of an access is 1 + the number of distinct items accessed
since the previous access of the same item (0 here for a first access, i.e.
infinite). An LRU cache of capacity C hits an access iff its stack distance is
between 1 and C, so one histogram of stack distances over the scored window
gives the LRU hit count of *every* capacity at once (Mattson et al., 1970).

Distances are counted with a Fenwick tree over access times. Only the most
recent access of each item holds a set bit, so at most ``n_items`` bits are set
at once: the tree covers ``2 * n_items`` time slots and is compacted (live
slots renumbered in order, tree rebuilt in O(slots)) whenever it fills. The tree
therefore stays cache-resident (about 0.7 MB for 82,432 items) however long the
stream is, and the pass costs O(log n_items) per access.

Scopes:

* ``per_layer`` — one independent cache per layer of B experts: the distance is
  counted within that layer's own access stream (one tree per layer).
* ``global`` — one pool keyed by expert_id = layer * n_experts + expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

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


def window(acc: Accesses, warm_fraction: float = 0.6) -> Window:
    """Split ``acc`` into a warm window (first ``floor(warm_fraction * n_iterations)``
    iterations) and a scored window (the rest)."""
    wf = float(warm_fraction)
    if not (0.0 <= wf < 1.0) or math.isnan(wf):
        raise UsageError(f"warm fraction must be in [0, 1), got {warm_fraction!r}",
                         hint="e.g. --warm-fraction 0.6 warms on 60% and scores the last 40%")
    n_it = int(acc.n_iterations)
    warm = int(math.floor(round(wf * n_it, 9)))
    cut = int(np.searchsorted(acc.iteration, warm, side="left"))
    return Window(n_it, warm, cut, len(acc))


def stream(acc: Accesses, scope: str) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(group, item, n_groups, n_items) arrays for a scope, as the kernels take them.

    per_layer: group = layer, item = expert; global: one group, item = expert_id.
    """
    scope = normalize_scope(scope)
    if scope == "per_layer":
        return (np.ascontiguousarray(acc.layer, dtype=np.int32),
                np.ascontiguousarray(acc.expert, dtype=np.int32), int(acc.n_layers), int(acc.n_experts))
    n_total = int(acc.n_layers) * int(acc.n_experts)
    if n_total >= 2**31:
        raise UsageError(f"{n_total} experts in all do not fit the simulator's 32-bit ids")
    item = acc.layer.astype(np.int32) * np.int32(acc.n_experts) + acc.expert.astype(np.int32)
    return np.zeros(1, np.int32), np.ascontiguousarray(item, dtype=np.int32), 1, n_total


@njit(cache=True, nogil=True)
def _stack_kernel(group, item, n_groups, n_items, cut, hist, dist_out):  # pragma: no cover - numba
    """One pass: hist[d] += 1 for every access at index >= cut with stack distance
    d (0 = first access); dist_out[i] = d when dist_out has one slot per access."""
    S = 2 * n_items + 2
    tree = np.zeros(n_groups * (S + 1), np.int32)
    owner = np.full(n_groups * S, -1, np.int32)
    last = np.full(n_groups * n_items, -1, np.int32)
    counter = np.zeros(n_groups, np.int64)
    live = np.zeros(n_groups, np.int64)
    return _stack_chunk(group, item, n_groups, n_items, cut, hist, dist_out, tree, owner, last, counter, live)


def stack_state(n_groups: int, n_items: int) -> tuple:
    """Fresh state for :func:`_stack_chunk` (tree, owner, last, counter, live): O(items), not O(accesses)."""
    S = 2 * n_items + 2
    return (np.zeros(n_groups * (S + 1), np.int32), np.full(n_groups * S, -1, np.int32),
            np.full(n_groups * n_items, -1, np.int32), np.zeros(n_groups, np.int64), np.zeros(n_groups, np.int64))


@njit(cache=True, nogil=True)
def _stack_chunk(group, item, n_groups, n_items, cut, hist, dist_out, tree, owner, last, counter,
                 live):  # pragma: no cover - numba
    """The stack-distance pass over one chunk of a stream, its state carried in the
    arrays (a Fenwick tree per group over 2 * n_items + 2 time slots, the slot
    owners, each item's latest slot, slot counters, live counts): a long stream
    goes through in chunks with the same result as one call."""
    n = item.shape[0]
    S = 2 * n_items + 2  # time slots per group; > n_items so a compaction frees room
    write = dist_out.shape[0] == n
    for i in range(n):
        g = group[i] if n_groups > 1 else 0
        x = item[i]
        tb = g * (S + 1)
        ob = g * S
        lx = g * n_items + x
        p = last[lx]
        d = 0
        if p >= 0:
            # set bits at slots <= p
            s = 0
            j = p + 1
            while j > 0:
                s += tree[tb + j]
                j -= j & (-j)
            d = live[g] - s + 1
            j = p + 1
            while j <= S:
                tree[tb + j] -= 1
                j += j & (-j)
            owner[ob + p] = -1
            live[g] -= 1
        if counter[g] == S:
            # compact: renumber live slots 0..m-1 in time order, rebuild the tree
            m = 0
            for s2 in range(S):
                y = owner[ob + s2]
                if y >= 0:
                    owner[ob + m] = y
                    last[g * n_items + y] = m
                    m += 1
            for s2 in range(m, S):
                owner[ob + s2] = -1
            for j in range(1, S + 1):
                lo = j - (j & (-j))
                v = m - lo
                if v < 0:
                    v = 0
                w = j & (-j)
                tree[tb + j] = v if v < w else w
            counter[g] = m
        c = counter[g]
        j = c + 1
        while j <= S:
            tree[tb + j] += 1
            j += j & (-j)
        owner[ob + c] = x
        last[lx] = c
        counter[g] = c + 1
        live[g] += 1
        if i >= cut:
            hist[d] += 1
        if write:
            dist_out[i] = d
    return hist


class LiveStack:
    """Stack distances of an unbounded stream fed in pieces (``moetrace watch``): one global
    LRU stack over ``n_items`` items, its state O(items) whatever the stream's length.
    ``feed(items)`` returns each access's distance (0 = the item's first access)."""

    def __init__(self, n_items: int):
        self.n_items = max(int(n_items), 1)
        self.state = stack_state(1, self.n_items)
        self._hist = np.zeros(self.n_items + 2, np.int64)
        self._group = np.zeros(1, np.int32)

    def feed(self, items: np.ndarray) -> np.ndarray:
        item = np.ascontiguousarray(items, dtype=np.int32)
        if len(item) and (item.min() < 0 or item.max() >= self.n_items):
            raise UsageError(f"stack items must be in [0, {self.n_items})")
        out = np.zeros(len(item), np.int32)
        if len(item):
            _stack_chunk(self._group, item, 1, self.n_items, len(item), self._hist, out, *self.state)
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
    group, item, n_groups, n_items = stream(acc, scope)
    hist = np.zeros(n_items + 2, np.int64)
    out = np.zeros(item.shape[0], np.int32)
    _stack_kernel(group, item, n_groups, n_items, 0, hist, out)
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
    scope = normalize_scope(scope)
    win = window(acc, warm_fraction)
    group, item, n_groups, n_items = stream(acc, scope)
    hist = np.zeros(n_items + 2, np.int64)
    _stack_kernel(group, item, n_groups, n_items, win.cut, hist, np.zeros(0, np.int32))
    cum = np.zeros(n_items + 1, np.int64)
    cum[1:] = np.cumsum(hist[1:n_items + 1])
    return StackCurve(scope, cum, win.scored_accesses, win, int(hist[0]))


def lru_curve(acc: Accesses, scope: str = "per_layer", warm_fraction: float = 0.6
              ) -> tuple[np.ndarray, np.ndarray]:
    """(budgets 1..n_items, LRU hit rate at each) from one stack-distance pass.

    Use :func:`lru_stack_curve` for hit counts and miss demand at any budget.
    """
    c = lru_stack_curve(acc, scope, warm_fraction)
    return c.budgets, c.hit_rates
