"""Stack distances on streams long and wide enough for the kernel's compactions and a
cleared-slot tree of two and three levels, against an independent reference (a Fenwick
tree over access times in plain Python), in one call and fed in uneven chunks."""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.analyses.stackdist import StackPass, _stack_state, first_at, lru_stack_curve, stack_distances
from moetrace.inputs.trace import Accesses


def reference_distances(items: np.ndarray) -> np.ndarray:
    """1 + distinct items since the previous access of the same item (0 for a first
    access): the accesses in (p, i) that are the latest of their item, by a Fenwick tree
    over times holding a 1 at each item's latest access."""
    n = len(items)
    tree = [0] * (n + 1)

    def add(i: int, v: int) -> None:
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:  # sum over times < i
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    last: dict[int, int] = {}
    out = np.zeros(n, np.int32)
    for i, x in enumerate(items.tolist()):
        p = last.get(x)
        if p is not None:
            out[i] = prefix(i) - prefix(p)
            add(p, -1)
        add(i, 1)
        last[x] = i
    return out


def skewed_stream(n_layers: int, n_experts: int, n: int, seed: int) -> Accesses:
    """n accesses, layer by turns, experts Zipf-like with bursts of recent reuse (short and
    long distances both), in the typed order of the simulator's inputs."""
    rng = np.random.default_rng(seed)
    layer = (np.arange(n) % n_layers).astype(np.int16)
    expert = (rng.zipf(1.3, n) - 1) % n_experts
    reuse = rng.random(n) < 0.3
    back = rng.integers(1, 40, n)
    idx = np.arange(n)
    src = np.where(reuse & (idx - back * n_layers >= 0), idx - back * n_layers, idx)
    expert = expert[src].astype(np.int32)  # same layer: back is a multiple of n_layers
    it = (idx // n_layers).astype(np.int32)
    return Accesses(it, np.zeros(n, np.int8), layer, expert, n_layers, n_experts, int(it[-1]) + 1)


@pytest.mark.parametrize("n_layers,n_experts,n,levels", [(1, 700, 20_000, 2), (2, 3_000, 30_000, 3),
                                                         (3, 100, 12_000, 1)])
def test_long_streams_match_the_reference(n_layers, n_experts, n, levels):
    acc = skewed_stream(n_layers, n_experts, n, seed=n_experts)
    gid = acc.layer.astype(np.int64) * n_experts + acc.expert
    assert _stack_state(1, n_layers * n_experts)[2].size == levels  # the tree depth this case covers
    ref = reference_distances(gid)
    assert (ref > 0).mean() > 0.5 and ref.max() > 200  # reuses, near and far
    d = stack_distances(acc, "global")
    assert np.array_equal(d, ref)
    d = stack_distances(acc, "per_layer")
    for layer in range(n_layers):
        m = acc.layer == layer
        assert np.array_equal(d[m], reference_distances(acc.expert[m]))


@pytest.mark.parametrize("scope", ["global", "per_layer"])
def test_chunks_equal_one_pass(scope):
    acc = skewed_stream(2, 900, 25_000, seed=7)
    one = stack_distances(acc, scope)
    sp = StackPass(acc.n_layers, acc.n_experts, scope)
    out = np.zeros(len(acc), np.int32)
    cuts = [0, 1, 2, 500, 4_097, 4_098, 12_000, 25_000]
    for a, b in zip(cuts[:-1], cuts[1:]):
        sp.feed(acc.layer[a:b], acc.expert[a:b], 0, out[a:b])
    assert np.array_equal(out, one)
    assert np.array_equal(np.bincount(one, minlength=sp.hist.size), sp.hist)
    curve = lru_stack_curve(acc, scope, 0.0)
    assert np.array_equal(curve.cum_hits, sp.cum_hits())


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64, np.uint32])
def test_first_at_equals_searchsorted(dtype):
    it = np.repeat(np.arange(0, 300, 3), 4).astype(dtype)
    for key in (0, 1, 3, 4, 150, 297, 298, 10**6, 2**40, -5):
        if key < 0 and it.dtype.kind == "u":
            continue
        assert first_at(it, key) == int(np.searchsorted(it.astype(np.int64), key, side="left")), key
