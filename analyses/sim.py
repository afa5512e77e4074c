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

Policies (every policy but static admits every missed expert, evicting one
resident expert when full — demand paging, no bypass):

* ``lru`` — evict the least recently used. Computed for every budget at once
  from Mattson stack distances (:mod:`moetrace.analyses.stackdist`);
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

import os
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
from numba import njit

from moetrace.errors import InputError, UsageError
from moetrace.inputs.trace import Accesses
from moetrace.analyses.stackdist import SCOPES, Window, lru_stack_curve, normalize_scope, stream, window

POLICIES = ("lru", "lfu", "static", "belady")
# toolkit/inputs/plan.py writes b"MOETPLAN"; b"MOEPLAN" is the spelling in the issue.
PLAN_MAGICS = (b"MOETPLAN", b"MOEPLAN")

# ---------------------------------------------------------------------------
# numba kernels: group = layer (per_layer) or 0 (global); item = expert or expert_id


@njit(cache=True, nogil=True)
def _lru_kernel(group, item, n_groups, n_items, budget, cut):  # pragma: no cover - numba
    """Direct LRU at one budget per group: doubly linked list, O(1) per access."""
    n = item.shape[0]
    N = n_groups * n_items
    prev = np.full(N, -1, np.int32)
    nxt = np.full(N, -1, np.int32)
    inc = np.zeros(N, np.bool_)
    head = np.full(n_groups, -1, np.int32)  # most recent
    tail = np.full(n_groups, -1, np.int32)  # least recent
    size = np.zeros(n_groups, np.int64)
    hits = 0
    for i in range(n):
        g = group[i] if n_groups > 1 else 0
        x = g * n_items + item[i]
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
            a = heap[hb + k]
            b = heap[hb + c]
            heap[hb + k] = b
            heap[hb + c] = a
            pos[b] = k
            pos[a] = c
            k = c
        else:
            break


@njit(cache=True, nogil=True)
def _sift_up(heap, hb, key, pos, k, sign):  # pragma: no cover - numba
    while k > 0:
        p = (k - 1) // 2
        if sign * key[heap[hb + k]] < sign * key[heap[hb + p]]:
            a = heap[hb + k]
            b = heap[hb + p]
            heap[hb + k] = b
            heap[hb + p] = a
            pos[b] = k
            pos[a] = p
            k = p
        else:
            break


@njit(cache=True, nogil=True)
def _lfu_kernel(group, item, n_groups, n_items, budget, cut):  # pragma: no cover - numba
    """Perfect LFU at one budget per group: min-heap on (frequency, last access)."""
    N = n_groups * n_items
    return _lfu_chunk(group, item, n_groups, n_items, budget, cut, 0, np.zeros(N, np.int64), np.zeros(N, np.int64),
                      np.full(N, -1, np.int64), np.zeros(n_groups * budget, np.int32), np.zeros(n_groups, np.int64))


def lfu_state(n_groups: int, n_items: int, budget: int) -> tuple:
    """Fresh state for :func:`_lfu_chunk` (freq, key, pos, heap, size)."""
    N = n_groups * n_items
    return (np.zeros(N, np.int64), np.zeros(N, np.int64), np.full(N, -1, np.int64),
            np.zeros(n_groups * budget, np.int32), np.zeros(n_groups, np.int64))


@njit(cache=True, nogil=True)
def _lfu_chunk(group, item, n_groups, n_items, budget, cut, base, freq, key, pos, heap,
               size):  # pragma: no cover - numba
    """LFU over one chunk (accesses base, base+1, ...), state carried in the arrays;
    hits counted from chunk index cut on."""
    n = item.shape[0]
    hits = 0
    for i in range(n):
        g = group[i] if n_groups > 1 else 0
        x = g * n_items + item[i]
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
def _next_use(gid, n_total):  # pragma: no cover - numba
    """next_use[i] = index of the next access of the same item, or n."""
    n = gid.shape[0]
    out = np.empty(n, np.int64)
    seen = np.full(n_total, n, np.int64)
    _next_use_chunk(gid, seen, 0, out)
    return out


@njit(cache=True, nogil=True)
def _next_use_chunk(gid, seen, base, out):  # pragma: no cover - numba
    """Backwards over one chunk (accesses base .. base + len - 1): out[i] = the next
    access of the same item (from seen, the state of the later chunks), seen updated."""
    for i in range(gid.shape[0] - 1, -1, -1):
        x = gid[i]
        out[i] = seen[x]
        seen[x] = base + i


@njit(cache=True, nogil=True)
def _warm_last(group, item, n_groups, n_items, base, lastw, forced):  # pragma: no cover - numba
    """Over warm accesses: lastw[x] = the last access index of each item, forced[g] = the
    item of each group's latest access (it must be resident at the cut)."""
    for i in range(item.shape[0]):
        g = group[i] if n_groups > 1 else 0
        x = g * n_items + item[i]
        lastw[x] = base + i
        forced[g] = x


@njit(cache=True, nogil=True)
def _belady_start(n_groups, n_items, budget, n, lastw, forced, first_next, key, pos, heap,
                  size):  # pragma: no cover - numba
    """The best post-warm state: each group's forced item, then the warm items whose
    next use (first_next[x], the first scored access) is soonest."""
    N = n_groups * n_items
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
    for g in range(n_groups):
        x = forced[g]
        if x >= 0 and budget > 0:
            heap[g * budget] = x
            key[x] = first_next[x]
            pos[x] = 0
            size[g] = 1
    for t in range(m):
        x = cand[order[t]]
        g = x // n_items
        if size[g] < budget and pos[x] < 0:
            k = size[g]
            heap[g * budget + k] = x
            key[x] = first_next[x]
            pos[x] = k
            size[g] = k + 1
            _sift_up(heap, g * budget, key, pos, k, -1)


def belady_state(n_groups: int, n_items: int, budget: int) -> tuple:
    """Fresh state for :func:`_belady_chunk` (key, pos, heap, size)."""
    N = n_groups * n_items
    return (np.zeros(N, np.int64), np.full(N, -1, np.int64), np.zeros(n_groups * budget, np.int32),
            np.zeros(n_groups, np.int64))


@njit(cache=True, nogil=True)
def _belady_chunk(group, item, n_groups, n_items, budget, nxt, key, pos, heap, size):  # pragma: no cover - numba
    """MIN over a chunk of scored accesses (nxt: each one's next use), state carried."""
    hits = 0
    for i in range(item.shape[0]):
        g = group[i] if n_groups > 1 else 0
        x = g * n_items + item[i]
        hb = g * budget
        key[x] = nxt[i]
        k = pos[x]
        if k >= 0:
            hits += 1
            _sift_up(heap, hb, key, pos, k, -1)  # key grew: move toward the max root
        elif size[g] == budget:
            v = heap[hb]
            pos[v] = -1
            heap[hb] = x
            pos[x] = 0
            _sift_down(heap, hb, size[g], key, pos, 0, -1)
        else:
            k = size[g]
            heap[hb + k] = x
            pos[x] = k
            size[g] = k + 1
            _sift_up(heap, hb, key, pos, k, -1)
    return hits


def _belady_kernel(group, item, n_groups, n_items, budget, cut, nxt):
    """MIN over the scored window from the best post-warm state (see module doc)."""
    N = n_groups * n_items
    lastw = np.full(N, -1, np.int64)
    forced = np.full(n_groups, -1, np.int64)
    _warm_last(group[:cut] if n_groups > 1 else group, item[:cut], n_groups, n_items, 0, lastw, forced)
    first_next = np.where(lastw >= 0, nxt[np.maximum(lastw, 0)], 0)
    st = belady_state(n_groups, n_items, budget)
    _belady_start(n_groups, n_items, budget, item.shape[0], lastw, forced, first_next, *st)
    return _belady_chunk(group[cut:] if n_groups > 1 else group, item[cut:], n_groups, n_items, budget,
                         nxt[cut:], *st)


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
    group, item, ng, ni = stream(acc, scope)
    return int(_lru_kernel(group, item, ng, ni, min(budget, ni), win.cut))


def lfu_hits(acc: Accesses, budget: int, scope: str = "per_layer", warm_fraction: float = 0.6) -> int:
    """Scored-window hits of perfect LFU (ties by least recent) at one budget."""
    budget = _check_budget(budget)
    win = window(acc, warm_fraction)
    group, item, ng, ni = stream(acc, scope)
    return int(_lfu_kernel(group, item, ng, ni, min(budget, ni), win.cut))


def next_use(acc: Accesses) -> np.ndarray:
    """Stream index of the next access of the same expert (len(acc) when none).

    The same in both scopes: an expert_id belongs to one layer."""
    _, item, _, n_total = stream(acc, "global")
    return _next_use(item, n_total)


def belady_hits(acc: Accesses, budget: int, scope: str = "per_layer", warm_fraction: float = 0.6,
                nxt: np.ndarray | None = None) -> int:
    """Scored-window hits of Belady's MIN (demand paging, optimal warm state) at one budget.

    ``nxt`` may pass a precomputed :func:`next_use` array to share it across budgets."""
    budget = _check_budget(budget)
    win = window(acc, warm_fraction)
    group, item, ng, ni = stream(acc, scope)
    if nxt is None:
        nxt = next_use(acc)
    return int(_belady_kernel(group, item, ng, ni, min(budget, ni), win.cut, nxt))


def _counts(acc: Accesses) -> np.ndarray:
    n_total = int(acc.n_layers) * int(acc.n_experts)
    return np.bincount(stream(acc, "global")[1], minlength=n_total).astype(np.int64)


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


def static_table_counts(acc: Accesses, table: str | Accesses = "oracle", warm_fraction: float = 0.6
                        ) -> np.ndarray:
    """Access counts per expert_id that rank a static table.

    ``oracle``: the whole stream; ``warm``: warm-window iterations only; an
    :class:`Accesses` of another trace: its whole stream (same geometry)."""
    if isinstance(table, Accesses):
        if (table.n_layers, table.n_experts) != (acc.n_layers, acc.n_experts):
            raise UsageError(
                f"static table from a {table.n_layers}x{table.n_experts} trace cannot rank a "
                f"{acc.n_layers}x{acc.n_experts} trace", hint="use a table trace of the same model")
        return _counts(table)
    if table == "oracle":
        return _counts(acc)
    if table == "warm":
        return _counts(acc.head(window(acc, warm_fraction).warm_iterations))
    raise UsageError(f"unknown static table {table!r}", hint="oracle, warm, or a trace/plan file")


def static_hits_curve(acc: Accesses, scope: str = "per_layer", warm_fraction: float = 0.6,
                      table: str | Accesses = "oracle") -> np.ndarray:
    """cum[b] = scored-window hits of a static table of b experts (per layer, or in
    all for global), b = 0 .. n_items, from one pass."""
    scope = normalize_scope(scope)
    win = window(acc, warm_fraction)
    rank = static_ranks(static_table_counts(acc, table, warm_fraction), acc.n_layers, acc.n_experts, scope)
    n_items = acc.n_experts if scope == "per_layer" else acc.n_layers * acc.n_experts
    eid = stream(acc, "global")[1][win.cut:]
    hist = np.bincount(rank[eid], minlength=n_items + 1)
    cum = np.zeros(n_items + 1, np.int64)
    cum[1:] = np.cumsum(hist[:n_items])
    return cum


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
    ``df.attrs`` holds the window and inputs.
    """
    policies = parse_policies(policies)
    scopes = [normalize_scope(s) for s in scopes]
    budgets = parse_budgets(budgets)
    gb = parse_budgets(global_budgets, "--global-budgets") if global_budgets is not None else None
    win = window(acc, warm_fraction)
    if static_table_name is None:
        static_table_name = static_table if isinstance(static_table, str) else "file"
    rows = []
    nxt = next_use(acc) if "belady" in policies else None
    for scope in scopes:
        if scope == "per_layer":
            bs, per = budgets, acc.n_layers
        else:
            bs, per = (gb if gb is not None else sorted({b * acc.n_layers for b in budgets})), 1
        curve = lru_stack_curve(acc, scope, warm_fraction) if "lru" in policies else None
        scurve = static_hits_curve(acc, scope, warm_fraction, static_table) if "static" in policies else None
        for policy in policies:
            for b in bs:
                if policy == "lru":
                    h = curve.hits_at(b)
                elif policy == "static":
                    h = int(scurve[min(b, scurve.size - 1)])
                elif policy == "lfu":
                    h = lfu_hits(acc, b, scope, warm_fraction)
                else:
                    h = belady_hits(acc, b, scope, warm_fraction, nxt=nxt)
                rows.append((policy, scope, b, b * per, h, static_table_name if policy == "static" else None))
    df = pd.DataFrame(rows, columns=["policy", "scope", "budget", "budget_total", "hits", "static_table"])
    return _finish_table(df, win.scored_accesses, win.scored_iterations, win.n_iterations, win.warm_iterations,
                         float(warm_fraction), expert_bytes, acc.n_layers, acc.n_experts, len(acc))


def _finish_table(df: pd.DataFrame, n: int, scored_iterations: int, n_iterations: int, warm_iterations: int,
                  warm_fraction: float, expert_bytes: int | None, n_layers: int, n_experts: int,
                  n_accesses: int) -> pd.DataFrame:
    """The tidy table from (policy, scope, budget, budget_total, hits, static_table) rows."""
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
    df.attrs.update(n_iterations=n_iterations, warm_iterations=warm_iterations,
                    scored_iterations=scored_iterations, warm_fraction=float(warm_fraction),
                    expert_bytes=expert_bytes, n_layers=n_layers, n_experts=n_experts,
                    n_accesses=n_accesses)
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


# ---------------------------------------------------------------------------
# inputs


def is_plan(path: str | os.PathLike) -> bool:
    """True when the file starts with a plan magic (checked on the head, nothing imported).
    InputError when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(max(len(m) for m in PLAN_MAGICS))
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror}", path=str(path)) from None
    return any(head.startswith(m) for m in PLAN_MAGICS)


def plan_expert_bytes(path: str | os.PathLike) -> int | None:
    """The expert size a plan's header records (None when unknown or not a plan)."""
    if not is_plan(path):
        return None
    try:
        from moetrace.inputs.plan import read_header
    except ImportError:
        return None
    eb = int(getattr(read_header(path), "expert_bytes", 0) or 0)
    return eb or None


def load_accesses(path: str | os.PathLike, k: int | None = None, n_layers: int | None = None,
                  n_experts: int | None = None, order: str | None = None, request: str | None = None,
                  info: dict | None = None) -> Accesses:
    """The access stream of a trace (typed .parquet or engine .jsonl) or of a plan
    (a file starting with a plan magic, read by moetrace.inputs.plan.read_accesses,
    imported only then).

    A trace gives the batch stream (per forward pass and layer, the union of its
    requests' experts), or with request one request's own stream; order "rank"
    (default) or "sorted" orders each slot's experts. info, when a dict, gets
    stream (a sentence saying which), order and requests."""
    spath = str(path)
    if not os.path.exists(spath):
        raise InputError("no such file", path=spath)
    if os.path.isdir(spath):
        raise InputError("is a directory, not a trace or plan", path=spath)
    if is_plan(spath):
        try:
            from moetrace.inputs.plan import read_accesses
        except ImportError as e:
            raise InputError(f"this is a plan but the plan reader is unavailable ({e})", path=spath) from None
        if request is not None:
            raise UsageError("--request needs a trace: a plan holds no requests")
        acc = read_accesses(spath)
        if order is not None and order != acc.order:
            if order == "rank":
                raise UsageError("this plan was compiled in sorted order; compile it again with --order rank")
            acc = _sorted_accesses(acc)
        if info is not None:
            meta_req = None
            try:
                from moetrace.inputs.plan import read_header

                meta_req = read_header(spath).meta.get("request")
            except Exception:  # noqa: BLE001 - the stream sentence is informational
                pass
            info.update(stream=f"the plan's stream ({'request ' + str(meta_req) if meta_req else 'as compiled'})",
                        order=acc.order)
        return acc
    from moetrace.inputs.trace import load_trace

    tt = load_trace(spath, k=k, n_layers=n_layers, n_experts=n_experts)
    n_req = tt.n_requests
    if request is not None:
        tt = tt.select_request(request)
    acc = tt.accesses(order=order or "rank")
    if info is not None:
        info.update(stream=stream_sentence(request, tt.n_steps, n_req), order=acc.order, requests=n_req)
    return acc


def stream_sentence(request: str | None, n_passes: int, n_requests: int) -> str:
    """Which access stream a simulation ran on, in words."""
    if request is not None:
        return f"request {request} alone ({n_passes} forward passes)"
    if n_requests > 1:
        return f"the batch stream: per forward pass the union of {n_requests} requests' experts"
    return "one request"


def _sorted_accesses(acc: Accesses) -> Accesses:
    """The same stream with each slot's experts ascending."""
    key = ((acc.iteration.astype(np.int64) * 2 + acc.pass_) * acc.n_layers + acc.layer) * acc.n_experts + acc.expert
    o = np.argsort(key, kind="stable")
    return Accesses(acc.iteration[o], acc.pass_[o], acc.layer[o], acc.expert[o], acc.n_layers, acc.n_experts,
                    acc.n_iterations, "sorted")


__all__ = ["POLICIES", "SCOPES", "Window", "window", "lru_hits", "lfu_hits", "belady_hits", "next_use",
           "static_hits", "static_hits_curve", "static_ranks", "static_table_counts", "simulate",
           "compute_sim", "plot_sim", "parse_budgets", "parse_policies", "load_accesses", "is_plan",
           "plan_expert_bytes", "stream_sentence", "COLUMNS"]
