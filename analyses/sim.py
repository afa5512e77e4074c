"""Expert-cache policy simulations under fair windows (paper §3, Fig. 1).

Input: the access stream :class:`moetrace.inputs.trace.Accesses` (per iteration, pass
and layer the deduplicated expert set, in canonical sorted order). Each access
is one expert read; a cache holds whole experts.

Fair windows: every policy runs over the whole stream (warming on the first
``warm_fraction`` of iterations) and only accesses of the remaining iterations
are scored. A static table "trained on the warm window" counts warm iterations
only.

Scopes: ``per_layer`` gives each layer an independent cache of B experts;
``global`` is one pool of N experts keyed by expert_id.

One simulator, two drivers: :func:`simulate_source` runs every policy x scope x
budget over a *source* read chunk by chunk (each kernel carries its O(experts)
state between chunks): :func:`compute_sim` drives it over an in-memory stream
(:class:`ArraySource`, one chunk), :func:`moetrace.analyses.simstream.compute_sim_stream`
over a plan file in bounded memory. The one-budget functions (:func:`lru_hits`,
:func:`lfu_hits`, :func:`belady_hits`, ...) call the same kernels directly.

Policies (every policy but static admits every missed expert, evicting one
resident expert when full — demand paging, no bypass):

* ``lru`` — evict the least recently used. Computed for every budget at once
  from Mattson stack distances (:class:`moetrace.analyses.stackdist.StackPass`);
  :func:`lru_hits` is the direct simulation at one budget.
* ``lfu`` — evict the least frequently used, ties by least recently used.
  Frequencies count every access from the start of the stream, resident or
  not (the paper's perfect LFU over the simulated stream), never reset.
* ``static`` — a fixed table of the top-B experts by access count (per layer,
  or top-N expert_ids globally; ties by lower id; experts with zero count are
  never in the table); an access hits iff its expert is in the table, nothing
  else is admitted. Tables: ``oracle`` (counts over the whole trace), ``warm``
  (counts over the warm window), or the counts of another access stream
  (domain shift).
* ``belady`` — Belady's MIN: on a miss, evict the resident expert whose next use
  is farthest. Demand paging without bypass (the accessed expert is always
  admitted). Because warm-window misses are not scored, the optimum for the
  scored window is MIN started from the best state a demand-paging cache can
  hold at the cut: the expert read last before the cut (it was just loaded)
  plus the B-1 warm-seen experts whose next use is soonest. This is the exact
  minimum of scored misses over all demand-paging policies with the same warm
  window, so belady >= lru, lfu at every budget. It does **not** bound static:
  a static table is preloaded (it can hold an expert before its first read)
  and bypasses (it never admits), e.g. B=1 on a, b, a, b: static {a} hits
  every a, any demand-paging cache misses every access.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import pandas as pd
from numba import njit

from moetrace.errors import UsageError
from moetrace.inputs.trace import Accesses
from moetrace.analyses.belady import BeladyTimes
from moetrace.analyses.stackdist import (SCOPES, StackPass, Window, first_at, normalize_scope, scope_shape,
                                         warm_iterations, window)

POLICIES = ("lru", "lfu", "static", "belady")

# ---------------------------------------------------------------------------
# numba kernels. Every kernel takes the stream as (layer, expert) per access: the
# state of an expert is kept at x = layer * n_experts + expert (its expert_id) in
# both scopes; its group (its own cache) is its layer (per_layer, grouped) or 0.


@njit(cache=True, nogil=True)
def _lru_kernel(layer, expert, n_experts, grouped, n_groups, N, budget, cut):  # pragma: no cover - numba
    """Direct LRU at one budget per group: doubly linked list, O(1) per access."""
    n = expert.shape[0]
    prev = np.full(N, -1, np.int32)
    nxt = np.full(N, -1, np.int32)
    inc = np.zeros(N, np.bool_)
    head = np.full(n_groups, -1, np.int32)  # most recent
    tail = np.full(n_groups, -1, np.int32)  # least recent
    size = np.zeros(n_groups, np.int64)
    hits = 0
    for i in range(n):
        g = np.int64(layer[i]) if grouped else 0
        x = np.int64(layer[i]) * n_experts + expert[i]
        if inc[x]:
            if i >= cut:
                hits += 1
            if head[g] == x:
                continue
            # unlink
            p = prev[x]
            q = nxt[x]
            nxt[p] = q
            if q >= 0:
                prev[q] = p
            else:
                tail[g] = p
        else:
            if size[g] == budget:
                t = tail[g]
                inc[t] = False
                p = prev[t]
                tail[g] = p
                if p >= 0:
                    nxt[p] = -1
                else:
                    head[g] = -1
                size[g] -= 1
            inc[x] = True
            size[g] += 1
        # push front
        prev[x] = -1
        h = head[g]
        nxt[x] = h
        if h >= 0:
            prev[h] = x
        else:
            tail[g] = x
        head[g] = x
    return hits


@njit(cache=True, nogil=True, inline="always")
def _swap(heap, hb, pos, i, j):  # pragma: no cover - numba
    """Swap heap slots i and j of the group at hb, keeping pos (item -> slot) in step."""
    a = heap[hb + i]
    b = heap[hb + j]
    heap[hb + i] = b
    heap[hb + j] = a
    pos[b] = i
    pos[a] = j


@njit(cache=True, nogil=True)
def _sift_down(heap, hb, size, key, pos, k, sign):  # pragma: no cover - numba
    """Restore the heap below slot k; sign=+1 min-heap, -1 max-heap on key."""
    while True:
        lch = 2 * k + 1
        if lch >= size:
            break
        c = lch
        r = lch + 1
        if r < size and sign * key[heap[hb + r]] < sign * key[heap[hb + lch]]:
            c = r
        if sign * key[heap[hb + c]] < sign * key[heap[hb + k]]:
            _swap(heap, hb, pos, k, c)
            k = c
        else:
            break


@njit(cache=True, nogil=True)
def _sift_up(heap, hb, key, pos, k, sign):  # pragma: no cover - numba
    while k > 0:
        p = (k - 1) // 2
        if sign * key[heap[hb + k]] < sign * key[heap[hb + p]]:
            _swap(heap, hb, pos, k, p)
            k = p
        else:
            break


def _lfu_state(n_groups: int, n_total: int, budget: int) -> tuple:
    """Fresh state for :func:`_lfu_chunk` (freq, key, pos, heap, size)."""
    return (np.zeros(n_total, np.int64), np.zeros(n_total, np.int64), np.full(n_total, -1, np.int64),
            np.zeros(n_groups * budget, np.int32), np.zeros(n_groups, np.int64))


@njit(cache=True, nogil=True)
def _lfu_chunk(layer, expert, n_experts, grouped, budget, cut, base, freq, key, pos, heap,
               size):  # pragma: no cover - numba
    """Perfect LFU over one chunk (accesses base, base+1, ...): a min-heap per group on
    (frequency, last access), state carried in the arrays; hits from chunk index cut on."""
    n = expert.shape[0]
    hits = 0
    for i in range(n):
        g = np.int64(layer[i]) if grouped else 0
        x = np.int64(layer[i]) * n_experts + expert[i]
        hb = g * budget
        freq[x] += 1
        key[x] = (freq[x] << 34) | (base + i)
        k = pos[x]
        if k >= 0:
            if i >= cut:
                hits += 1
            _sift_down(heap, hb, size[g], key, pos, k, 1)
        elif size[g] == budget:
            v = heap[hb]
            pos[v] = -1
            heap[hb] = x
            pos[x] = 0
            _sift_down(heap, hb, size[g], key, pos, 0, 1)
        else:
            k = size[g]
            heap[hb + k] = x
            pos[x] = k
            size[g] = k + 1
            _sift_up(heap, hb, key, pos, k, 1)
    return hits


@njit(cache=True, nogil=True)
def _next_use_chunk(layer, expert, n_experts, seen, base, out):  # pragma: no cover - numba
    """Backwards over one chunk (accesses base .. base + len - 1): out[i] = the next
    access of the same expert (from seen, the state of the later chunks), seen updated."""
    for i in range(expert.shape[0] - 1, -1, -1):
        x = np.int64(layer[i]) * n_experts + expert[i]
        out[i] = seen[x]
        seen[x] = base + i


@njit(cache=True, nogil=True)
def _warm_last(layer, expert, n_experts, grouped, base, lastw, forced):  # pragma: no cover - numba
    """Over warm accesses: lastw[x] = the last access index of each expert, forced[g] = the
    expert of each group's latest access (it must be resident at the cut)."""
    for i in range(expert.shape[0]):
        x = np.int64(layer[i]) * n_experts + expert[i]
        lastw[x] = base + i
        forced[np.int64(layer[i]) if grouped else 0] = x


# Belady: a 4-ary max-heap per group of packed entries (next use << 31 | expert_id:
# expert_ids are < 2**31, see scope_shape; next uses < 2**32), pos[x] = x's slot or
# -1, sifted by moving a hole. A group's heap has budget + 4 slots, the last four
# sentinels -1 (entries are >= 0), so a level's four children are compared without
# bounds or branches. Entries are unique (the expert breaks ties of next use, which
# only never-used-again experts share: which of them goes first changes no hit).
_ARITY = 4
_ID_BITS = 31
_ID_MASK = (1 << _ID_BITS) - 1


@njit(cache=True, nogil=True)
def _max_up(heap, pos, hb, k, v):  # pragma: no cover - numba
    """Entry v placed at slot k or above: the hole rises while its parent's entry is smaller."""
    while k > 0:
        p = (k - 1) >> 2
        pv = heap[hb + p]
        if pv >= v:
            break
        heap[hb + k] = pv
        pos[pv & _ID_MASK] = k
        k = p
    heap[hb + k] = v
    pos[v & _ID_MASK] = k


@njit(cache=True, nogil=True)
def _max_replace_root(heap, pos, hb, size, v):  # pragma: no cover - numba
    """The root of a full heap replaced by entry v, bottom-up: the hole goes down the
    largest children to a leaf, then v rises from there."""
    k = 0
    c = 1
    while c < size:
        a0 = heap[hb + c]
        a1 = heap[hb + c + 1]
        a2 = heap[hb + c + 2]
        a3 = heap[hb + c + 3]
        i01 = c + np.int64(a1 > a0)
        i23 = c + 2 + np.int64(a3 > a2)
        m01 = max(a0, a1)
        m23 = max(a2, a3)
        c = i23 if m23 > m01 else i01
        w = max(m01, m23)
        heap[hb + k] = w
        pos[w & _ID_MASK] = k
        k = c
        c = 4 * k + 1
    _max_up(heap, pos, hb, k, v)


def _belady_state(n_groups: int, n_total: int, budget: int) -> tuple:
    """Fresh state for :func:`_belady_chunk` (heap, pos, size)."""
    heap = np.zeros((n_groups, budget + _ARITY), np.int64)
    heap[:, budget:] = -1
    return heap.reshape(-1), np.full(n_total, -1, np.int32), np.zeros(n_groups, np.int64)


@njit(cache=True, nogil=True)
def _belady_warm(n_items, budget, n, lastw, forced, first_next, chosen, count):  # pragma: no cover - numba
    """The experts of the best post-warm state: each group's forced expert, then the warm
    experts whose next use (first_next[x], the first scored access) is soonest, into
    chosen[g * budget + j], j < count[g]."""
    N = lastw.shape[0]
    m = 0
    for x in range(N):
        if lastw[x] >= 0:
            m += 1
    cand = np.empty(m, np.int64)
    ckey = np.empty(m, np.int64)
    j = 0
    for x in range(N):
        if lastw[x] >= 0:
            cand[j] = x
            # group-major, then soonest next use (first scored access)
            ckey[j] = (x // n_items) * (n + 1) + first_next[x]
            j += 1
    order = np.argsort(ckey)
    for g in range(count.shape[0]):
        if forced[g] >= 0 and budget > 0:
            chosen[g * budget] = forced[g]
            count[g] = 1
    for t in range(m):
        x = cand[order[t]]
        g = x // n_items
        if count[g] < budget and x != forced[g]:
            chosen[g * budget + count[g]] = x
            count[g] += 1


@njit(cache=True, nogil=True)
def _belady_start(budget, first_next, chosen, count, heap, pos, size):  # pragma: no cover - numba
    """The heaps of the post-warm state (see :func:`_belady_warm`)."""
    for g in range(count.shape[0]):
        for k in range(count[g]):
            x = chosen[g * budget + k]
            _max_up(heap, pos, g * (budget + _ARITY), k, (np.int64(first_next[x]) << _ID_BITS) | x)
        size[g] = count[g]


@njit(cache=True, nogil=True)
def _belady_chunk(layer, expert, n_experts, grouped, budget, nxt, heap, pos, size):  # pragma: no cover - numba
    """MIN over a chunk of scored accesses (nxt: each one's next use), state carried."""
    hits = 0
    for i in range(expert.shape[0]):
        g = np.int64(layer[i]) if grouped else 0
        x = np.int64(layer[i]) * n_experts + expert[i]
        hb = g * (budget + _ARITY)
        v = (np.int64(nxt[i]) << _ID_BITS) | x
        k = pos[x]
        if k >= 0:
            hits += 1
            _max_up(heap, pos, hb, k, v)  # its next use was now (the least): it grows
        elif size[g] == budget:
            pos[heap[hb] & _ID_MASK] = -1  # evict the farthest next use
            _max_replace_root(heap, pos, hb, size[g], v)
        else:
            k = size[g]
            size[g] = k + 1
            _max_up(heap, pos, hb, k, v)
    return hits


def _check_belady_length(n: int) -> None:
    if n >= 1 << (63 - _ID_BITS):
        raise UsageError(f"Belady packs next uses in {63 - _ID_BITS} bits: {n:,} accesses are too many",
                         hint="simulate Belady on a part of the stream (fewer iterations), or the other policies")


class _BeladyCache:
    """MIN at one budget of a scope, from the best post-warm state, fed the scored window in
    order: the global scope's one cache as a set of next-use times (:class:`BeladyTimes`,
    its bitmap from ``scratch``), per_layer's caches as heaps. ``first_next[x]``: the first
    scored access of expert x (n when none)."""

    def __init__(self, shape: tuple[bool, int, int], n_total: int, budget: int, win: Window, lastw: np.ndarray,
                 forced: np.ndarray, first_next: np.ndarray, scratch=None):
        self.grouped, ng, ni = shape
        self.budget, self.cut = budget, win.cut
        chosen, count = np.zeros(ng * budget, np.int64), np.zeros(ng, np.int64)
        _belady_warm(ni, budget, win.n_accesses, lastw, forced, first_next, chosen, count)
        if self.grouped:
            self.heap = _belady_state(ng, n_total, budget)
            _belady_start(budget, first_next, chosen, count, *self.heap)
        else:
            self.times = BeladyTimes(win.scored_accesses, budget, scratch)
            self.times.start(first_next[chosen[:count[0]]] - win.cut)

    def feed(self, layer: np.ndarray, expert: np.ndarray, n_experts: int, nxt: np.ndarray) -> int:
        """Hits of the next scored accesses (nxt: their next uses as stream indices)."""
        if self.grouped:
            return int(_belady_chunk(layer, expert, n_experts, True, self.budget, nxt, *self.heap))
        return self.times.feed(nxt, self.cut)


def _belady_run(acc: Accesses, shape: tuple[bool, int, int], budget: int, win: Window, nxt: np.ndarray) -> int:
    """MIN over acc's scored window from the best post-warm state; nxt over the whole stream."""
    _check_belady_length(len(acc))
    N = acc.n_layers * acc.n_experts
    cut = win.cut
    lastw = np.full(N, -1, np.int64)
    forced = np.full(shape[1], -1, np.int64)
    _warm_last(acc.layer[:cut], acc.expert[:cut], acc.n_experts, shape[0], 0, lastw, forced)
    first_next = np.where(lastw >= 0, nxt[np.maximum(lastw, 0)], 0)
    cache = _BeladyCache(shape, N, budget, win, lastw, forced, first_next)
    return cache.feed(acc.layer[cut:], acc.expert[cut:], acc.n_experts, nxt[cut:])


# ---------------------------------------------------------------------------
# one-budget simulations


def _check_budget(budget: int) -> int:
    if isinstance(budget, (bool, np.bool_)) or int(budget) != budget or int(budget) < 1:
        raise UsageError(f"budget must be a positive whole number of experts, got {budget!r}")
    return int(budget)


def lru_hits(acc: Accesses, budget: int, scope: str = "per_layer", warm_fraction: float = 0.6) -> int:
    """Scored-window hits of a direct LRU simulation at one budget (a linked list;
    the reference that the one-pass curve must equal)."""
    budget = _check_budget(budget)
    win = window(acc, warm_fraction)
    grouped, ng, ni = scope_shape(acc.n_layers, acc.n_experts, scope)
    return int(_lru_kernel(acc.layer, acc.expert, acc.n_experts, grouped, ng, acc.n_layers * acc.n_experts,
                           min(budget, ni), win.cut))


def lfu_hits(acc: Accesses, budget: int, scope: str = "per_layer", warm_fraction: float = 0.6) -> int:
    """Scored-window hits of perfect LFU (ties by least recent) at one budget."""
    budget = _check_budget(budget)
    win = window(acc, warm_fraction)
    grouped, ng, ni = scope_shape(acc.n_layers, acc.n_experts, scope)
    bb = min(budget, ni)
    st = _lfu_state(ng, acc.n_layers * acc.n_experts, bb)
    return int(_lfu_chunk(acc.layer, acc.expert, acc.n_experts, grouped, bb, win.cut, 0, *st))


def next_use(acc: Accesses) -> np.ndarray:
    """Stream index of the next access of the same expert (len(acc) when none); int32
    below 2**31 accesses (half the memory traffic of MIN's pass over it), else int64.

    The same in both scopes: an expert_id belongs to one layer."""
    n = len(acc)
    dt = np.int32 if n < 2**31 else np.int64
    out = np.empty(n, dt)
    _next_use_chunk(acc.layer, acc.expert, acc.n_experts, np.full(acc.n_layers * acc.n_experts, n, dt), 0, out)
    return out


def belady_hits(acc: Accesses, budget: int, scope: str = "per_layer", warm_fraction: float = 0.6,
                nxt: np.ndarray | None = None) -> int:
    """Scored-window hits of Belady's MIN (demand paging, optimal warm state) at one budget.

    ``nxt`` may pass a precomputed :func:`next_use` array to share it across budgets."""
    budget = _check_budget(budget)
    win = window(acc, warm_fraction)
    shape = scope_shape(acc.n_layers, acc.n_experts, scope)
    if nxt is None:
        nxt = next_use(acc)
    return _belady_run(acc, shape, min(budget, shape[2]), win, nxt)


def _counts(acc: Accesses, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Accesses per expert_id in acc[start:stop]."""
    eid = acc.layer[start:stop].astype(np.int64) * int(acc.n_experts) + acc.expert[start:stop]
    return np.bincount(eid, minlength=int(acc.n_layers) * int(acc.n_experts)).astype(np.int64)


def static_ranks(counts: np.ndarray, n_layers: int, n_experts: int, scope: str) -> np.ndarray:
    """Rank of every expert_id in the static table (0 = most accessed; ties by lower
    id); experts with zero count get rank n_items (never in any table)."""
    scope = normalize_scope(scope)
    counts = np.asarray(counts, dtype=np.int64)
    if scope == "per_layer":
        c = counts.reshape(n_layers, n_experts)
        order = np.argsort(-c, axis=1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(n_experts)[None, :], axis=1)
        rank = rank.reshape(-1)
        rank[counts == 0] = n_experts
        return rank
    order = np.argsort(-counts, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(counts.size)
    rank[counts == 0] = counts.size
    return rank


def _table_counts(table: str | Accesses, n_layers: int, n_experts: int, all_counts, warm_counts) -> np.ndarray:
    """The counts that rank a static table: ``all_counts()`` (oracle), ``warm_counts()`` (warm)
    or another stream's (a trace of the same geometry)."""
    if isinstance(table, Accesses):
        if (table.n_layers, table.n_experts) != (n_layers, n_experts):
            raise UsageError(
                f"static table from a {table.n_layers}x{table.n_experts} trace cannot rank a "
                f"{n_layers}x{n_experts} trace", hint="use a table trace of the same model")
        return _counts(table)
    if table == "oracle":
        return all_counts()
    if table == "warm":
        return warm_counts()
    raise UsageError(f"unknown static table {table!r}", hint="oracle, warm, or a trace/plan file")


def static_table_counts(acc: Accesses, table: str | Accesses = "oracle", warm_fraction: float = 0.6
                        ) -> np.ndarray:
    """Access counts per expert_id that rank a static table.

    ``oracle``: the whole stream; ``warm``: warm-window iterations only; an
    :class:`Accesses` of another trace: its whole stream (same geometry)."""
    return _table_counts(table, acc.n_layers, acc.n_experts, lambda: _counts(acc),
                         lambda: _counts(acc.head(window(acc, warm_fraction).warm_iterations)))


def _static_curve(rank: np.ndarray, scored_counts: np.ndarray, n_items: int) -> np.ndarray:
    """cum[b] = scored accesses to experts of rank < b."""
    hist = np.bincount(rank, weights=scored_counts, minlength=n_items + 1).astype(np.int64)
    cum = np.zeros(n_items + 1, np.int64)
    cum[1:] = np.cumsum(hist[:n_items])
    return cum


def static_hits_curve(acc: Accesses, scope: str = "per_layer", warm_fraction: float = 0.6,
                      table: str | Accesses = "oracle") -> np.ndarray:
    """cum[b] = scored-window hits of a static table of b experts (per layer, or in
    all for global), b = 0 .. n_items, from one pass."""
    scope = normalize_scope(scope)
    win = window(acc, warm_fraction)
    rank = static_ranks(static_table_counts(acc, table, warm_fraction), acc.n_layers, acc.n_experts, scope)
    n_items = acc.n_experts if scope == "per_layer" else acc.n_layers * acc.n_experts
    return _static_curve(rank, _counts(acc, win.cut), n_items)


def static_hits(acc: Accesses, budget: int, scope: str = "per_layer", warm_fraction: float = 0.6,
                table: str | Accesses = "oracle") -> int:
    """Scored-window hits of a static table of ``budget`` experts."""
    budget = _check_budget(budget)
    cum = static_hits_curve(acc, scope, warm_fraction, table)
    return int(cum[min(budget, cum.size - 1)])


def simulate(acc: Accesses, policy: str, budget: int, scope: str = "per_layer",
             warm_fraction: float = 0.6, table: str | Accesses = "oracle") -> int:
    """Scored-window hits of one policy at one budget (lru here is the direct simulation)."""
    policy = str(policy).lower()
    if policy == "lru":
        return lru_hits(acc, budget, scope, warm_fraction)
    if policy == "lfu":
        return lfu_hits(acc, budget, scope, warm_fraction)
    if policy == "belady":
        return belady_hits(acc, budget, scope, warm_fraction)
    if policy == "static":
        return static_hits(acc, budget, scope, warm_fraction, table)
    raise UsageError(f"unknown policy {policy!r}", hint=f"choose from {', '.join(POLICIES)}")


# ---------------------------------------------------------------------------
# the tidy table


COLUMNS = ["policy", "scope", "budget", "budget_total", "hits", "accesses", "misses", "hit_rate",
           "scored_iterations", "miss_bytes_per_iteration", "static_table"]


def parse_budgets(text: str | Iterable[int] | None, what: str = "--budgets") -> list[int]:
    """'8,16,32' -> [8, 16, 32] (sorted, unique); a clear UsageError for anything else."""
    if text is None:
        return []
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[int] = []
    for raw in items:
        s = str(raw).strip()
        if s == "":
            raise UsageError(f"{what}: empty budget in {text!r}", hint="write e.g. 8,16,32,64")
        try:
            v = int(s)
        except ValueError:
            raise UsageError(f"{what}: {s!r} is not a whole number of experts",
                             hint="write e.g. 8,16,32,64") from None
        if v < 1:
            raise UsageError(f"{what}: budget {v} must be at least 1 expert")
        out.append(v)
    if not out:
        raise UsageError(f"{what}: no budgets given", hint="write e.g. 8,16,32,64")
    return sorted(set(out))


def parse_policies(text: str | Sequence[str]) -> list[str]:
    """'lru,belady' -> ['lru', 'belady'] (order kept, checked)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for p in items:
        p = str(p).strip().lower()
        if p not in POLICIES:
            raise UsageError(f"unknown policy {p!r}", hint=f"choose from {', '.join(POLICIES)}")
        if p not in out:
            out.append(p)
    if not out:
        raise UsageError("no policy given", hint=f"choose from {', '.join(POLICIES)}")
    return out


class ArraySource:
    """An in-memory access stream as the simulator's source: one chunk, the whole stream.

    A source (this, or :class:`moetrace.analyses.simstream.PlanSource`) gives the
    geometry (n_layers, n_experts, n_iterations, n_accesses), ``start(it)`` (the
    stream index of iteration it's first read), ``ranges()`` (iteration ranges
    [a, b) in stream order), ``chunk(a, b)`` (the global index of its first read and
    its :class:`Accesses`) and ``scratch(n)`` (n zeroed int64 for Belady's
    next uses and the global scope's bitmaps of next-use times: in memory here, a
    memory-mapped file for a plan)."""

    def __init__(self, acc: Accesses):
        self.acc = acc
        self.n_layers, self.n_experts = int(acc.n_layers), int(acc.n_experts)
        self.n_iterations, self.n_accesses = int(acc.n_iterations), len(acc)

    def start(self, iteration: int) -> int:
        return first_at(self.acc.iteration, iteration)

    def ranges(self) -> list[tuple[int, int]]:
        return [(0, self.n_iterations)] if self.n_accesses else []

    def chunk(self, a: int, b: int) -> tuple[int, Accesses]:
        i, j = self.start(a), self.start(b)
        if (i, j) == (0, self.n_accesses):
            return 0, self.acc
        acc = self.acc
        return i, Accesses(acc.iteration[i:j], acc.pass_[i:j], acc.layer[i:j], acc.expert[i:j], acc.n_layers,
                           acc.n_experts, b, acc.order)

    def scratch(self, n: int) -> np.ndarray:
        return np.zeros(n, np.int64)


class _Simulation:
    """Every policy x scope x budget over one stream: a forward pass fed chunk by chunk
    (LRU stack distances, LFU heaps, access counts, Belady's warm state), then
    Belady's passes over the scored window. State is O(experts x budgets)."""

    def __init__(self, n_layers: int, n_experts: int, policies: list[str], plan: dict, win: Window):
        self.L, self.E, self.N = n_layers, n_experts, n_layers * n_experts
        self.policies, self.plan, self.win = policies, plan, win
        self.shape = {sc: scope_shape(n_layers, n_experts, sc) for sc in plan}
        self.stacks = {sc: StackPass(n_layers, n_experts, sc) for sc in plan} if "lru" in policies else {}
        self.lfu = {}
        if "lfu" in policies:
            for sc, (bs, _) in plan.items():
                ng, ni = self.shape[sc][1:]
                for b in bs:
                    self.lfu[(sc, b)] = [_lfu_state(ng, self.N, min(b, ni)), min(b, ni), 0]
        self.counts_all = np.zeros(self.N, np.int64)
        self.counts_warm = np.zeros(self.N, np.int64)
        self.lastw = np.full(self.N, -1, np.int64)
        self.forced = {sc: np.full(self.shape[sc][1], -1, np.int64) for sc in plan}
        self.belady_hits: dict = {}

    def forward(self, base: int, acc: Accesses) -> None:
        """One chunk, in stream order (base: the global index of its first access)."""
        lc = max(0, min(len(acc), self.win.cut - base))  # chunk index where the scored window starts
        self.counts_all += _counts(acc)
        if lc:
            self.counts_warm += _counts(acc, 0, lc)
        for sc in self.plan:
            grouped = self.shape[sc][0]
            if sc in self.stacks:
                self.stacks[sc].feed(acc.layer, acc.expert, lc)
            for b in self.plan[sc][0]:
                st = self.lfu.get((sc, b))
                if st is not None:
                    st[2] += int(_lfu_chunk(acc.layer, acc.expert, self.E, grouped, st[1], lc, base, *st[0]))
            if "belady" in self.policies and lc:
                _warm_last(acc.layer[:lc], acc.expert[:lc], self.E, grouped, base, self.lastw, self.forced[sc])

    def belady(self, src, progress=None) -> None:
        """Next uses of the scored window, backwards into src.scratch; then MIN forwards at
        every (scope, budget) at once from the best post-warm state."""
        cut, n = self.win.cut, self.win.n_accesses
        _check_belady_length(n)
        nxt = src.scratch(max(n - cut, 1))
        seen = np.full(self.N, n, np.int64)
        scored = [r for r in src.ranges() if src.start(r[1]) > cut]
        for a, b in reversed(scored):
            base, acc = src.chunk(a, b)
            lc = max(0, cut - base)
            _next_use_chunk(acc.layer[lc:], acc.expert[lc:], self.E, seen, base + lc,
                            np.asarray(nxt[base + lc - cut:base + len(acc) - cut]))
            if progress is not None:
                progress(0)
        # seen[x] is now each expert's first scored access: the next use of its last warm access
        runs = []
        for sc, (bs, _) in self.plan.items():
            for b in bs:
                bb = min(b, self.shape[sc][2])
                runs.append((sc, b, _BeladyCache(self.shape[sc], self.N, bb, self.win, self.lastw, self.forced[sc],
                                                 seen, src.scratch)))
                self.belady_hits[(sc, b)] = 0
        for a, b in scored:
            base, acc = src.chunk(a, b)
            lc = max(0, cut - base)
            lay, ex = acc.layer[lc:], acc.expert[lc:]
            nx = np.asarray(nxt[base + lc - cut:base + len(acc) - cut])
            for sc, b_, cache in runs:
                self.belady_hits[(sc, b_)] += cache.feed(lay, ex, self.E, nx)

    def rows(self, static_table: str | Accesses, static_table_name: str) -> list[tuple]:
        """(policy, scope, budget, budget_total, hits, static_table) per policy x scope x budget."""
        rows = []
        for sc, (bs, per) in self.plan.items():
            ni = self.shape[sc][2]
            curve = self.stacks[sc].cum_hits() if sc in self.stacks else None
            scurve = None
            if "static" in self.policies:
                tc = _table_counts(static_table, self.L, self.E, lambda: self.counts_all, lambda: self.counts_warm)
                scurve = _static_curve(static_ranks(tc, self.L, self.E, sc), self.counts_all - self.counts_warm, ni)
            for policy in self.policies:
                for b in bs:
                    if policy == "lru":
                        h = int(curve[min(b, curve.size - 1)])
                    elif policy == "static":
                        h = int(scurve[min(b, scurve.size - 1)])
                    elif policy == "lfu":
                        h = self.lfu[(sc, b)][2]
                    else:
                        h = self.belady_hits[(sc, b)]
                    rows.append((policy, sc, b, b * per, h, static_table_name if policy == "static" else None))
        return rows


def simulate_source(src, policies: Sequence[str] = POLICIES, budgets: Sequence[int] = (8, 16, 32, 64),
                    scopes: Sequence[str] = ("per_layer",), global_budgets: Sequence[int] | None = None,
                    warm_fraction: float = 0.6, expert_bytes: int | None = None,
                    static_table: str | Accesses = "oracle", static_table_name: str | None = None,
                    progress=None) -> pd.DataFrame:
    """The simulator: :func:`compute_sim`'s table for any source (:class:`ArraySource`,
    or a plan's :class:`~moetrace.analyses.simstream.PlanSource`), read chunk by chunk:
    one forward pass, then for Belady one backward and one forward pass over the
    scored window. ``progress(n)`` is called after each chunk with its accesses."""
    policies = parse_policies(policies)
    scopes = [normalize_scope(s) for s in scopes]
    budgets = parse_budgets(budgets)
    gb = parse_budgets(global_budgets, "--global-budgets") if global_budgets is not None else None
    warm = warm_iterations(warm_fraction, src.n_iterations)
    win = Window(src.n_iterations, warm, src.start(warm), src.n_accesses)
    if static_table_name is None:
        static_table_name = static_table if isinstance(static_table, str) else "file"
    L = src.n_layers
    plan = {sc: (budgets, L) if sc == "per_layer" else (gb if gb is not None else sorted({b * L for b in budgets}), 1)
            for sc in scopes}
    sim = _Simulation(L, src.n_experts, policies, plan, win)
    for a, b in src.ranges():
        base, acc = src.chunk(a, b)
        sim.forward(base, acc)
        if progress is not None:
            progress(len(acc))
    if "belady" in policies:
        sim.belady(src, progress)
    df = pd.DataFrame(sim.rows(static_table, static_table_name),
                      columns=["policy", "scope", "budget", "budget_total", "hits", "static_table"])
    return _finish_table(df, win, float(warm_fraction), expert_bytes, L, src.n_experts)


def compute_sim(acc: Accesses, policies: Sequence[str] = POLICIES, budgets: Sequence[int] = (8, 16, 32, 64),
                scopes: Sequence[str] = ("per_layer",), global_budgets: Sequence[int] | None = None,
                warm_fraction: float = 0.6, expert_bytes: int | None = None,
                static_table: str | Accesses = "oracle", static_table_name: str | None = None) -> pd.DataFrame:
    """Hit rate and miss demand per policy x scope x budget under fair windows.

    ``budgets`` are experts per layer (per_layer scope). The global scope uses
    ``global_budgets`` (experts in all) or, when None, ``budget * n_layers`` for
    each per-layer budget (the same memory). Columns: policy, scope, budget (the
    cache size of that scope), budget_total (experts in all), hits, accesses,
    misses, hit_rate, scored_iterations, miss_bytes_per_iteration (misses x
    expert_bytes / scored iteration; NA without expert_bytes), static_table.
    ``df.attrs`` holds the window and inputs. The in-memory driver of
    :func:`simulate_source`.
    """
    return simulate_source(ArraySource(acc), policies, budgets, scopes, global_budgets, warm_fraction,
                           expert_bytes, static_table, static_table_name)


def _finish_table(df: pd.DataFrame, win: Window, warm_fraction: float, expert_bytes: int | None,
                  n_layers: int, n_experts: int) -> pd.DataFrame:
    """The tidy table from (policy, scope, budget, budget_total, hits, static_table) rows."""
    n, scored_iterations = win.scored_accesses, win.scored_iterations
    df["budget"] = df["budget"].astype(np.int64)
    df["budget_total"] = df["budget_total"].astype(np.int64)
    df["hits"] = df["hits"].astype(np.int64)
    df["accesses"] = np.int64(n)
    df["misses"] = df["accesses"] - df["hits"]
    df["hit_rate"] = df["hits"] / n if n else np.nan
    df["scored_iterations"] = np.int64(scored_iterations)
    if expert_bytes is None or not scored_iterations:
        df["miss_bytes_per_iteration"] = pd.Series([pd.NA] * len(df), dtype="Float64")
    else:
        df["miss_bytes_per_iteration"] = (df["misses"] * float(expert_bytes) / scored_iterations
                                          ).astype("Float64")
    df["static_table"] = df["static_table"].astype("string")
    df = df[COLUMNS]
    df.attrs.update(n_iterations=win.n_iterations, warm_iterations=win.warm_iterations,
                    scored_iterations=scored_iterations, warm_fraction=float(warm_fraction),
                    expert_bytes=expert_bytes, n_layers=n_layers, n_experts=n_experts,
                    n_accesses=win.n_accesses)
    return df


def plot_sim(df: pd.DataFrame, ax) -> None:
    """Hit rate vs budget per policy (and scope) on a matplotlib axis.

    The x axis is experts per layer (global budgets divided by the layer count)."""
    n_layers = df.attrs.get("n_layers") or 1
    colors = {p: f"C{i}" for i, p in enumerate(POLICIES)}
    for (scope, policy), g in df.groupby(["scope", "policy"], sort=False):
        g = g.sort_values("budget_total")
        x = g["budget_total"] / n_layers
        style = "-" if scope == "per_layer" else "--"
        ax.plot(x, g["hit_rate"] * 100, style, marker="o" if scope == "per_layer" else "s",
                color=colors.get(policy), label=f"{policy} ({scope.replace('_', '-')})")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(lambda v, _pos: f"{v:g}")
    ax.set_xlabel("budget (experts per layer)")
    ax.set_ylabel("hit rate in scored window (%)")
    wf = df.attrs.get("warm_fraction")
    if wf is not None:
        ax.set_title(f"fair window: warm {wf:.0%}, scored {1 - wf:.0%}")
    ax.grid(True, alpha=0.3)
    ax.legend()


__all__ = ["POLICIES", "SCOPES", "Window", "window", "lru_hits", "lfu_hits", "belady_hits", "next_use",
           "static_hits", "static_hits_curve", "static_ranks", "static_table_counts", "simulate",
           "compute_sim", "simulate_source", "ArraySource", "plot_sim", "parse_budgets", "parse_policies", "COLUMNS"]
