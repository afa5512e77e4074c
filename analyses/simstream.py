"""Cache simulations over a plan.bin in bounded memory.

:func:`moetrace.analyses.sim.compute_sim` holds the whole access stream (11
bytes per read, more in temporaries); a plan of a million tokens of a
production model is 1.5 G reads. :func:`compute_sim_stream` gives the same
table from a plan read chunk by chunk (``chunk_reads`` reads at a time), with
every kernel's state carried between chunks (it is O(experts), not O(reads)):

* LRU, every budget: one stack-distance pass (Mattson) per scope;
* LFU: one heap per budget, in the same forward pass;
* static: access counts per expert (whole stream, warm window, scored window)
  in the same pass, then the table's hits from the counts;
* Belady: next uses come from the future, so a backward pass over the scored
  window writes them to a memory-mapped file (8 bytes per scored read, in
  ``TMPDIR``, removed afterwards); the warm state comes from the forward pass;
  a last forward pass over the scored window runs MIN per budget.

Memory: one chunk of accesses plus the kernels' state and the plan's index
(8 bytes per iteration).
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Sequence

import numpy as np
import pandas as pd

from moetrace.analyses import sim as S
from moetrace.analyses.stackdist import _stack_chunk, normalize_scope, stack_state
from moetrace.errors import UsageError
from moetrace.inputs.trace import Accesses

DEFAULT_CHUNK_READS = 1 << 18


class PlanSource:
    """A plan read as chunks of whole iterations (global access indices kept)."""

    def __init__(self, path: str | os.PathLike, chunk_reads: int = DEFAULT_CHUNK_READS):
        from moetrace.inputs.plan import PlanReader

        self.path = os.fspath(path)
        self.reader = PlanReader(self.path)
        h = self.reader.header
        self.header = h
        self.n_layers, self.n_experts, self.n_iterations = h.n_layers, h.n_experts, h.n_iterations
        self.order = h.order
        reads = np.zeros(h.n_iterations, np.int64)
        for base, chunk in self.reader._index_chunks(0):
            reads[base:base + chunk.size] = chunk["n_reads"]
        self.offsets = np.zeros(h.n_iterations + 1, np.int64)  # global index of each iteration's first read
        np.cumsum(reads, out=self.offsets[1:])
        self.n_accesses = int(self.offsets[-1])
        self.chunk_reads = max(1, int(chunk_reads))

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> "PlanSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ranges(self, start: int = 0, stop: int | None = None) -> list[tuple[int, int]]:
        """Iteration ranges [a, b) of at most chunk_reads reads (at least one iteration each)."""
        stop = self.n_iterations if stop is None else stop
        out = []
        a = start
        while a < stop:
            b = int(np.searchsorted(self.offsets, self.offsets[a] + self.chunk_reads, side="right")) - 1
            b = min(max(b, a + 1), stop)
            out.append((a, b))
            a = b
        return out

    def chunk(self, a: int, b: int) -> tuple[int, Accesses]:
        """(global index of the first read, the accesses of iterations [a, b))."""
        L = self.n_layers
        its, ps, lays, exs = [], [], [], []
        for p in self.reader.passes(a, b):
            c = p.counts.astype(np.int64)
            n = int(c.sum())
            its.append(np.full(n, p.iteration, np.int32))
            ps.append(np.full(n, p.pass_index, np.int8))
            lays.append(np.repeat(np.arange(L, dtype=np.int16), c))
            exs.append(p.experts.astype(np.int32))
        cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))  # noqa: E731
        acc = Accesses(cat(its, np.int32), cat(ps, np.int8), cat(lays, np.int16), cat(exs, np.int32), L,
                       self.n_experts, b, self.order)
        return int(self.offsets[a]), acc


def _group_item(acc: Accesses, scope: str) -> tuple[np.ndarray, np.ndarray, int, int]:
    if scope == "per_layer":
        return acc.layer.astype(np.int32), acc.expert.astype(np.int32), acc.n_layers, acc.n_experts
    item = acc.layer.astype(np.int32) * np.int32(acc.n_experts) + acc.expert.astype(np.int32)
    return np.zeros(1, np.int32), item, 1, acc.n_layers * acc.n_experts


def compute_sim_stream(path: str | os.PathLike, policies: Sequence[str] = S.POLICIES,
                       budgets: Sequence[int] = (8, 16, 32, 64), scopes: Sequence[str] = ("per_layer",),
                       global_budgets: Sequence[int] | None = None, warm_fraction: float = 0.6,
                       expert_bytes: int | None = None, static_table: str | Accesses = "oracle",
                       static_table_name: str | None = None, chunk_reads: int = DEFAULT_CHUNK_READS,
                       progress=None) -> pd.DataFrame:
    """compute_sim's table for a plan file, in bounded memory (module docstring)."""
    policies = S.parse_policies(policies)
    scopes = [normalize_scope(x) for x in scopes]
    budgets = S.parse_budgets(budgets)
    gb = S.parse_budgets(global_budgets, "--global-budgets") if global_budgets is not None else None
    wf = float(warm_fraction)
    if not (0.0 <= wf < 1.0) or math.isnan(wf):
        raise UsageError(f"warm fraction must be in [0, 1), got {warm_fraction!r}",
                         hint="e.g. --warm-fraction 0.6 warms on 60% and scores the last 40%")
    if static_table_name is None:
        static_table_name = static_table if isinstance(static_table, str) else "file"
    with PlanSource(path, chunk_reads) as src:
        L, E, n_it, n = src.n_layers, src.n_experts, src.n_iterations, src.n_accesses
        N = L * E
        warm = int(math.floor(round(wf * n_it, 9)))
        cut = int(src.offsets[warm])
        plan_budgets = {}
        for scope in scopes:
            if scope == "per_layer":
                plan_budgets[scope] = (budgets, L)
            else:
                plan_budgets[scope] = (gb if gb is not None else sorted({b * L for b in budgets}), 1)
        n_items = {"per_layer": E, "global": N}
        n_groups = {"per_layer": L, "global": 1}
        hist = {sc: np.zeros(n_items[sc] + 2, np.int64) for sc in scopes}
        stk = {sc: stack_state(n_groups[sc], n_items[sc]) for sc in scopes} if "lru" in policies else {}
        lfu = {}
        if "lfu" in policies:
            for sc in scopes:
                for b in plan_budgets[sc][0]:
                    bb = min(b, n_items[sc])
                    lfu[(sc, b)] = [S.lfu_state(n_groups[sc], n_items[sc], bb), bb, 0]
        counts_all = np.zeros(N, np.int64)
        counts_warm = np.zeros(N, np.int64)
        lastw = np.full(N, -1, np.int64)
        forced = {sc: np.full(n_groups[sc], -1, np.int64) for sc in scopes}
        ranges = src.ranges()
        # forward pass: LRU, LFU, counts, the warm state
        for a, b in ranges:
            base, acc = src.chunk(a, b)
            m = len(acc)
            lc = max(0, min(m, cut - base))  # chunk index where the scored window starts
            eid = acc.layer.astype(np.int64) * E + acc.expert
            counts_all += np.bincount(eid, minlength=N)
            if lc:
                counts_warm += np.bincount(eid[:lc], minlength=N)
            for sc in scopes:
                g, it, ng, ni = _group_item(acc, sc)
                if "lru" in policies:
                    _stack_chunk(g, it, ng, ni, lc, hist[sc], np.zeros(0, np.int32), *stk[sc])
                for b_ in plan_budgets[sc][0]:
                    if (sc, b_) in lfu:
                        st = lfu[(sc, b_)]
                        st[2] += int(S._lfu_chunk(g, it, ng, ni, st[1], lc, base, *st[0]))
                if "belady" in policies and lc:
                    # x = group * items + item is the expert_id in both scopes: one lastw serves both
                    S._warm_last(g[:lc] if ng > 1 else g, it[:lc], ng, ni, base, lastw, forced[sc])
            if progress is not None:
                progress(m)
        rows = []
        # static tables from counts
        scored_counts = counts_all - counts_warm
        bel_hits: dict = {}
        if "belady" in policies:
            bel_hits = _belady_stream(src, ranges, scopes, plan_budgets, n_items, n_groups, cut, n, lastw,
                                      forced, progress)
        for scope in scopes:
            bs, per = plan_budgets[scope]
            curve = None
            if "lru" in policies:
                h = hist[scope]
                curve = np.zeros(n_items[scope] + 1, np.int64)
                curve[1:] = np.cumsum(h[1:n_items[scope] + 1])
            scurve = None
            if "static" in policies:
                if isinstance(static_table, Accesses):
                    if (static_table.n_layers, static_table.n_experts) != (L, E):
                        raise UsageError(
                            f"static table from a {static_table.n_layers}x{static_table.n_experts} trace cannot "
                            f"rank a {L}x{E} trace", hint="use a table trace of the same model")
                    tc = S._counts(static_table)
                elif static_table == "oracle":
                    tc = counts_all
                elif static_table == "warm":
                    tc = counts_warm
                else:
                    raise UsageError(f"unknown static table {static_table!r}", hint="oracle, warm, or a trace/plan file")
                rank = S.static_ranks(tc, L, E, scope)
                shist = np.bincount(rank, weights=scored_counts, minlength=n_items[scope] + 1).astype(np.int64)
                scurve = np.zeros(n_items[scope] + 1, np.int64)
                scurve[1:] = np.cumsum(shist[:n_items[scope]])
            for policy in policies:
                for b in bs:
                    if policy == "lru":
                        hh = int(curve[min(b, curve.size - 1)])
                    elif policy == "static":
                        hh = int(scurve[min(b, scurve.size - 1)])
                    elif policy == "lfu":
                        hh = lfu[(scope, b)][2]
                    else:
                        hh = bel_hits[(scope, b)]
                    rows.append((policy, scope, b, b * per, hh, static_table_name if policy == "static" else None))
    scored = n - cut
    df = pd.DataFrame(rows, columns=["policy", "scope", "budget", "budget_total", "hits", "static_table"])
    return S._finish_table(df, scored, n_it - warm, n_it, warm, wf, expert_bytes, L, E, n)


def _belady_stream(src: PlanSource, ranges, scopes, plan_budgets, n_items, n_groups, cut: int, n: int,
                   lastw: np.ndarray, forced: dict, progress) -> dict:
    """Belady hits per (scope, budget): next uses spilled backwards to a memory map, then MIN forwards."""
    scored = n - cut
    out: dict = {}
    N = src.n_layers * src.n_experts
    fd, tmp = tempfile.mkstemp(prefix="moetrace-nextuse-", suffix=".i64")
    os.close(fd)
    try:
        nxt = np.memmap(tmp, dtype=np.int64, mode="w+", shape=(max(scored, 1),))
        seen = np.full(N, n, np.int64)
        scored_ranges = [r for r in ranges if src.offsets[r[1]] > cut]
        for a, b in reversed(scored_ranges):
            base, acc = src.chunk(a, b)
            eid = acc.layer.astype(np.int32) * np.int32(src.n_experts) + acc.expert.astype(np.int32)
            lc = max(0, cut - base)
            buf = np.empty(eid.size - lc, np.int64)
            S._next_use_chunk(eid[lc:], seen, base + lc, buf)
            nxt[base + lc - cut: base + eid.size - cut] = buf
            if progress is not None:
                progress(0)
        # seen[x] is now each item's first scored access: the next use of its last warm access
        for scope in scopes:
            ng, ni = n_groups[scope], n_items[scope]
            for b in plan_budgets[scope][0]:
                bb = min(b, ni)
                st = S.belady_state(ng, ni, bb)
                S._belady_start(ng, ni, bb, n, lastw, forced[scope], seen, *st)
                hits = 0
                for a, b2 in scored_ranges:
                    base, acc = src.chunk(a, b2)
                    lc = max(0, cut - base)
                    g, it, _, _ = _group_item(acc, scope)
                    hits += int(S._belady_chunk(g[lc:] if ng > 1 else g, it[lc:], ng, ni, bb,
                                                np.asarray(nxt[base + lc - cut: base + len(acc) - cut]), *st))
                out[(scope, b)] = hits
        del nxt
    finally:
        os.unlink(tmp)
    return out
