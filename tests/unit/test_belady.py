"""Belady's MIN as a set of next-use times (the global scope) against a plain reference and
against the per-layer heaps, on streams long enough for three bitmap levels, many
evictions and a warm state; fed in uneven chunks."""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.analyses import sim
from moetrace.analyses.belady import BeladyTimes, levels
from moetrace.inputs.trace import Accesses


def stream(n_layers: int, n_experts: int, n: int, seed: int) -> Accesses:
    """n accesses, layer by turns, experts Zipf-like (near and far reuses, rare experts)."""
    rng = np.random.default_rng(seed)
    layer = (np.arange(n) % n_layers).astype(np.int16)
    expert = ((rng.zipf(1.2, n) - 1) % n_experts).astype(np.int32)
    it = (np.arange(n) // n_layers).astype(np.int32)
    return Accesses(it, np.zeros(n, np.int8), layer, expert, n_layers, n_experts, int(it[-1]) + 1)


def reference_min(items: list[int], budget: int) -> int:
    """MIN from an empty cache by its definition: on a miss with a full cache, evict the item
    whose next use is farthest (never used again: farthest of all)."""
    n = len(items)
    nxt, seen = [n] * n, {}
    for i in range(n - 1, -1, -1):
        nxt[i] = seen.get(items[i], n)
        seen[items[i]] = i
    held: dict[int, int] = {}
    hits = 0
    for i, x in enumerate(items):
        if x in held:
            hits += 1
        elif len(held) == budget:
            del held[max(held, key=held.__getitem__)]
        held[x] = nxt[i]
    return hits


def test_levels():
    assert levels(1).tolist() == [0, 1]  # one word: level 0 is the top
    assert levels(64 * 64).tolist() == [0, 64, 65]
    assert levels(64 * 64 + 1).tolist() == [0, 65, 67, 68]
    assert len(levels(300_000)) - 1 == 4 and len(levels(120_000)) - 1 == 3


@pytest.mark.parametrize("budget", [1, 2, 5, 40])
def test_global_equals_the_reference(budget):
    acc = stream(3, 40, 6_000, seed=budget)
    items = (acc.layer.astype(np.int64) * acc.n_experts + acc.expert).tolist()
    assert sim.belady_hits(acc, budget, "global", 0.0) == reference_min(items, budget)


@pytest.mark.parametrize("wf", [0.0, 0.6])
def test_one_layer_bitmap_equals_heap(wf):
    acc = stream(1, 1_500, 300_000, seed=3)  # 4 bitmap levels over the whole stream, 3 over 40%
    nxt = sim.next_use(acc)
    for budget in (1, 3, 17, 200, 1_499, 1_500):
        assert sim.belady_hits(acc, budget, "global", wf, nxt=nxt) == \
            sim.belady_hits(acc, budget, "per_layer", wf, nxt=nxt), budget


def test_chunks_equal_one_feed():
    acc = stream(2, 700, 50_000, seed=5)
    nxt = sim.next_use(acc)
    n = len(acc)
    one = BeladyTimes(n, 90)
    whole = one.feed(nxt)
    parts = BeladyTimes(n, 90, scratch=lambda k: np.zeros(k, np.int64))
    cuts = [0, 1, 2, 64, 4_097, 20_000, n]
    assert sum(parts.feed(nxt[a:b]) for a, b in zip(cuts[:-1], cuts[1:])) == whole
    assert whole == sim.belady_hits(acc, 90, "global", 0.0, nxt=nxt)
    with pytest.raises(ValueError):
        BeladyTimes(n, 2).start(np.arange(3))
