"""Belady's MIN for one cache over a bitmap of next-use times (the global scope).

A cache that knows the future is described, for MIN, by the next-use times of
what it holds: nothing else decides a hit or an eviction. An access at time t
hits iff an item held has its next use at t (times are unique: one access a
time), and then that item's next use moves on; a miss evicts the farthest next
use. So the cache is a set of times: a bit per scored access, set while the
item accessed then is held with that next use, plus a count of held items never
used again (the farthest of all, evicted first; which of them goes changes no
hit). A hit tests and clears bit t, sequentially; an insertion sets one bit;
the farthest is the highest set bit, kept at hand and after an eviction found
below it through summary levels (a bit per non-zero word of the level below),
one load and one leading-zero count a level. A next use farther than all held
(a rare expert's: a fifth of the bench's accesses) goes on a stack instead, each
above the last: it is evicted from there without touching the bitmap, or hit
from its bottom. No item ids, no positions, no heap: the same hits as the heap
of :mod:`moetrace.analyses.sim` in about half its time at the bench's global
budget (10 M accesses, 2,944 items).

Memory: one bit per scored access (1/64 of the next-use array's int64s), taken
from the caller's zeroed scratch so that a plan streamed from disk keeps it in a
memory-mapped file like its next uses. Groups (the per_layer scope) keep the
heap: a set of times is one cache's.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _top_bit(typingctx, x):  # pragma: no cover - numba
    """Index of the highest set bit of a non-zero uint64 (63 - LLVM ctlz: one instruction)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        lz = builder.ctlz(args[0], ir.Constant(ir.IntType(1), 1))
        return builder.sub(ir.Constant(ir.IntType(64), 63), lz)

    return types.int64(types.uint64), codegen


def levels(n_times: int) -> np.ndarray:
    """Word offsets of the bitmap's levels in one flat array: level 0 has a bit per time,
    each level above a bit per word of the one below, the last one word."""
    offs, words, total = [], (max(int(n_times), 1) + 63) // 64, 0
    while True:
        offs.append(total)
        total += words
        if words == 1:
            break
        words = (words + 63) // 64
    offs.append(total)  # the total, for sizing
    return np.array(offs, np.int64)


@njit(cache=True, nogil=True)
def _set(bm, offs, t):  # pragma: no cover - numba
    """Set bit t, and each summary bit above it that was clear."""
    one = np.uint64(1)
    for h in range(offs.shape[0] - 1):
        w = offs[h] + (t >> 6)
        old = bm[w]
        bm[w] = old | (one << np.uint64(t & 63))
        if old != 0:
            break
        t >>= 6


@njit(cache=True, nogil=True)
def _clear(bm, offs, t):  # pragma: no cover - numba
    """Clear bit t, and each summary bit above it whose word became zero."""
    one = np.uint64(1)
    for h in range(offs.shape[0] - 1):
        w = offs[h] + (t >> 6)
        new = bm[w] & ~(one << np.uint64(t & 63))
        bm[w] = new
        if new != 0:
            break
        t >>= 6


@njit(cache=True, nogil=True)
def _below(bm, offs, t):  # pragma: no cover - numba
    """The highest set time below t (-1 when none): up the levels from t until a word has a
    set bit below t's, then down that bit's words."""
    one = np.uint64(1)
    top = offs.shape[0] - 1
    h = 0
    while True:
        if h == top:
            return -1
        m = bm[offs[h] + (t >> 6)] & ((one << np.uint64(t & 63)) - one)
        if m != 0:
            t = ((t >> 6) << 6) + _top_bit(m)
            break
        t >>= 6
        h += 1
    while h > 0:
        h -= 1
        t = (t << 6) + _top_bit(bm[offs[h] + t])
    return t


@njit(cache=True, nogil=True)
def _start(times, never, bm, offs, state):  # pragma: no cover - numba
    """The held items' next-use times (never: used no more) as the starting state."""
    for k in range(times.shape[0]):
        if times[k] >= never:
            state[1] += 1
        else:
            _set(bm, offs, times[k])
            state[2] = max(state[2], times[k])
    state[0] += times.shape[0]


@njit(cache=True, nogil=True)
def _chunk(nxt, t0, shift, never, budget, bm, offs, stack, state):  # pragma: no cover - numba
    """MIN over scored accesses t0, t0 + 1, ... (their times since the cut): nxt[i] - shift
    is access i's next use as such a time (>= never: none). state = [held, held never
    used again, highest set time or -1, lo, top]: stack[lo:top], ascending, holds times
    that were the farthest of all when inserted (they stay out of the bitmap). Returns
    the hits."""
    held, dead, hi, lo, top = state[0], state[1], state[2], state[3], state[4]
    hits = 0
    one = np.uint64(1)
    for i in range(nxt.shape[0]):
        t = t0 + i
        if bm[t >> 6] & (one << np.uint64(t & 63)):
            hits += 1
            _clear(bm, offs, t)
            if t == hi:  # it was the bitmap's only one
                hi = -1
        elif lo < top and stack[lo] == t:
            hits += 1
            lo += 1
        elif held == budget:
            if dead > 0:
                dead -= 1
            elif lo < top and stack[top - 1] > hi:
                top -= 1
            else:  # the farthest next use is in the bitmap
                _clear(bm, offs, hi)
                hi = _below(bm, offs, hi)
        else:
            held += 1
        u = np.int64(nxt[i]) - shift
        if u >= never:
            dead += 1
        elif u > hi and (lo == top or u > stack[top - 1]):
            if top == stack.shape[0]:
                stack[0:top - lo] = stack[lo:top]
                top -= lo
                lo = 0
            stack[top] = u
            top += 1
        else:
            _set(bm, offs, u)
            hi = max(hi, u)
    state[0], state[1], state[2], state[3], state[4] = held, dead, hi, lo, top
    return hits


class BeladyTimes:
    """MIN for one cache of ``budget`` items over ``n_times`` scored accesses, fed in
    order, as a set of next-use times (module docstring).

    ``scratch(n)`` gives n zeroed int64 for the bitmap (default: in memory)."""

    def __init__(self, n_times: int, budget: int, scratch=None):
        self.n_times, self.budget = int(n_times), int(budget)
        self.offs = levels(self.n_times)
        words = int(self.offs[-1])
        self.bm = (np.zeros(words, np.int64) if scratch is None else scratch(words)).view(np.uint64)
        self.state = np.array([0, 0, -1, 0, 0], np.int64)
        self.stack = np.zeros(2 * self.budget + 1, np.int64)
        self.fed = 0

    def start(self, times: np.ndarray) -> None:
        """The starting cache: the next-use times (since the cut; n_times or more for none)
        of the items held before the first scored access, at most ``budget`` of them."""
        times = np.ascontiguousarray(times, dtype=np.int64)
        if times.size > self.budget:
            raise ValueError(f"{times.size} items held at the start of a cache of {self.budget}")
        _start(times, self.n_times, self.bm, self.offs, self.state)

    def feed(self, nxt: np.ndarray, shift: int = 0) -> int:
        """The next scored accesses, given their next uses (``nxt - shift`` as times since
        the cut): returns their hits."""
        h = _chunk(nxt, self.fed, int(shift), self.n_times, self.budget, self.bm, self.offs, self.stack,
                   self.state)
        self.fed += len(nxt)
        return int(h)
