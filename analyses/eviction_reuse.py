"""Why a page was read again: each pool eviction against the plan's accesses around it.

For every folio the kernel evicted (the mglru probe's ``mglru_evictions``, or any table with
``time_ns`` and ``expert_id``), the replay's iteration log places the eviction in iteration g
(the last one started at or before it). The plan then says, for its expert:

- ``last_access`` — the last iteration <= g that read the expert, and how long before the
  eviction that was (``iterations_since_access``, ``ms_since_access`` from that iteration's
  start);
- ``next_access`` — the first iteration > g that reads it again (NA: never in the log), so the
  page was read from the device again: a re-read;
- ``distance`` — the distinct other experts read between the two accesses (iterations strictly
  between them): the LRU stack distance of the re-read. A global LRU holding ``budget``
  experts keeps the page when distance < budget: ``lru_keeps``. A re-read that LRU would have
  kept is excess traffic — amplification over miss demand, page by page;
- with the generation samples (``lru_gen``): ``gens_above_oldest`` (seq - the oldest generation
  holding file pages in its memcg at the last sample before the eviction: 0 = taken from the
  oldest) and
  ``gens_below_youngest`` (max_seq - seq).

Iteration granularity: an expert read in the same iteration as its eviction counts as accessed
then (``iterations_since_access`` 0).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

COLS = ["expert_id", "evict_iteration", "pages", "time_ns", "last_access", "iterations_since_access",
        "ms_since_access", "next_access", "distance", "lru_keeps", "seq"]


def _occurrences(it_of_read: np.ndarray, expert_of_read: np.ndarray) -> dict[int, np.ndarray]:
    """expert -> sorted global iterations that read it."""
    order = np.lexsort((it_of_read, expert_of_read))
    e, it = expert_of_read[order], it_of_read[order]
    cuts = np.flatnonzero(np.diff(e)) + 1
    return {int(es[0]): np.unique(its) for es, its in zip(np.split(e, cuts), np.split(it, cuts)) if es.size}


def replay_reads(iterations: pd.DataFrame, plan_iteration: np.ndarray, plan_expert_id: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The replay's reads in log order: (global iteration, expert id) for each read, from the
    iteration log's ``step`` (the plan iteration it replayed) and the plan's accesses."""
    order = np.argsort(plan_iteration, kind="stable")
    pi, pe = plan_iteration[order], plan_expert_id[order]
    starts = np.searchsorted(pi, np.arange(int(pi.max()) + 2 if pi.size else 1))
    g_list, e_list = [], []
    for g, step in enumerate(iterations["step"].to_numpy(np.int64)):
        e = pe[starts[step]:starts[step + 1]]
        g_list.append(np.full(e.size, g, np.int64))
        e_list.append(e)
    if not g_list:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(g_list), np.concatenate(e_list).astype(np.int64)


def compute_eviction_reuse(evictions: pd.DataFrame, iterations: pd.DataFrame, plan_iteration: np.ndarray,
                           plan_expert_id: np.ndarray, budget: int) -> pd.DataFrame:
    """One row per (expert, eviction iteration): ``pages`` evicted, first ``time_ns``, and the
    columns of the module's docstring. ``iterations``: the replay's log in order (``start_ns``,
    ``step``), warm-up included, so that an access before the window is seen."""
    if evictions.empty or iterations.empty:
        return pd.DataFrame(columns=COLS)
    it = iterations.reset_index(drop=True)
    starts = it["start_ns"].to_numpy(np.int64)
    g_read, e_read = replay_reads(it, np.asarray(plan_iteration), np.asarray(plan_expert_id))
    occ = _occurrences(g_read, e_read)
    ev = evictions.assign(evict_iteration=np.searchsorted(starts, evictions["time_ns"].to_numpy(np.int64),
                                                          side="right") - 1)
    ev = ev[ev["evict_iteration"] >= 0]
    agg = {"pages": ("time_ns", "size"), "time_ns": ("time_ns", "min")}
    if "seq" in ev:
        agg["seq"] = ("seq", "min")
    grp = ev.groupby(["expert_id", "evict_iteration"], sort=True).agg(**agg).reset_index()
    # the reads of each global iteration as one sorted array, for the distinct counts
    by_g = np.argsort(g_read, kind="stable")
    g_sorted, e_sorted = g_read[by_g], e_read[by_g]
    rows = []
    for r in grp.itertuples(index=False):
        occ_e = occ.get(int(r.expert_id), np.empty(0, np.int64))
        k = np.searchsorted(occ_e, r.evict_iteration, side="right")
        last = int(occ_e[k - 1]) if k > 0 else None
        nxt = int(occ_e[k]) if k < occ_e.size else None
        dist = None
        if last is not None and nxt is not None:
            lo, hi = np.searchsorted(g_sorted, last + 1), np.searchsorted(g_sorted, nxt)
            between = np.unique(e_sorted[lo:hi])
            dist = int(between.size - np.count_nonzero(between == r.expert_id))
        rows.append({"expert_id": int(r.expert_id), "evict_iteration": int(r.evict_iteration), "pages": int(r.pages),
                     "time_ns": int(r.time_ns), "last_access": last,
                     "iterations_since_access": None if last is None else int(r.evict_iteration) - last,
                     "ms_since_access": None if last is None else (int(r.time_ns) - int(starts[last])) / 1e6,
                     "next_access": nxt, "distance": dist,
                     "lru_keeps": None if dist is None else bool(dist < budget),
                     "seq": getattr(r, "seq", None)})
    out = pd.DataFrame(rows, columns=COLS)
    for c in ("last_access", "iterations_since_access", "next_access", "distance", "seq"):
        out[c] = out[c].astype("Int64")
    out["lru_keeps"] = out["lru_keeps"].astype("boolean")
    out["ms_since_access"] = out["ms_since_access"].astype("Float64")
    return out


def add_generation_position(reuse: pd.DataFrame, lru_gen: pd.DataFrame, memcg_id: int) -> pd.DataFrame:
    """``gens_above_oldest`` / ``gens_below_youngest`` of each eviction's seq against its memcg's
    oldest generation holding file pages and its max_seq, at the last lru_gen sample before it
    (the file and anon types age apart: the oldest generation listed may hold only anon)."""
    g = lru_gen[lru_gen["memcg_id"] == memcg_id]
    f = g[g["nr_file_pages"] > 0].groupby("sample").agg(time_ns=("time_ns", "first"), min_seq=("seq", "min"))
    top = g.groupby("sample")["seq"].max().rename("max_seq")
    g = f.join(top).sort_values("time_ns").reset_index(drop=True)
    out = reuse.sort_values("time_ns").reset_index(drop=True)
    if g.empty or out.empty or out["seq"].isna().all():
        return out.assign(gens_above_oldest=pd.array([pd.NA] * len(out), dtype="Int64"),
                          gens_below_youngest=pd.array([pd.NA] * len(out), dtype="Int64"))
    m = pd.merge_asof(out[["time_ns"]].astype("int64"), g.astype("int64"), on="time_ns", direction="backward")
    out["gens_above_oldest"] = (out["seq"] - m["min_seq"].astype("Int64")).astype("Int64")
    out["gens_below_youngest"] = (m["max_seq"].astype("Int64") - out["seq"]).astype("Int64")
    return out


def compute_eviction_reuse_generations(evictions: pd.DataFrame, iterations: pd.DataFrame, accesses, budget: int,
                                       lru_gen: pd.DataFrame) -> pd.DataFrame:
    """:func:`compute_eviction_reuse` with :func:`add_generation_position` against the memcg most
    evictions came from; ``accesses``: the plan's (inputs.plan.read_accesses)."""
    reuse = compute_eviction_reuse(evictions, iterations, accesses.iteration, accesses.expert_id, budget)
    memcg = int(evictions["memcg_id"].mode().iloc[0]) if "memcg_id" in evictions and len(evictions) else -1
    return add_generation_position(reuse, lru_gen, memcg)


def summarize_eviction_reuse(reuse: pd.DataFrame) -> dict:
    """Page-weighted: ``evicted_pages``, ``reread_pages`` (read again later in the log),
    ``excess_pages`` (re-reads a global LRU of the budget would have kept) and its share of the
    re-reads, the share of re-reads evicted within one iteration of their last access, and
    (with generation positions) the share of evictions taken from the oldest generation."""
    if reuse.empty:
        return {"evicted_pages": 0}
    p = reuse["pages"].astype("int64")
    reread = reuse["next_access"].notna()
    excess = reuse["lru_keeps"].fillna(False).astype(bool)
    young = reuse["iterations_since_access"].fillna(1 << 30).astype("int64") <= 1
    out = {"evicted_pages": int(p.sum()), "reread_pages": int(p[reread].sum()), "excess_pages": int(p[excess].sum())}
    rr = out["reread_pages"]
    out["excess_share_of_rereads"] = out["excess_pages"] / rr if rr else None
    out["rereads_evicted_within_one_iteration_share"] = int(p[reread & young].sum()) / rr if rr else None
    out["reread_iterations_since_access_median"] = _weighted_median(
        reuse.loc[reread, "iterations_since_access"], p[reread])
    if "gens_above_oldest" in reuse and reuse["gens_above_oldest"].notna().any():
        known = reuse["gens_above_oldest"].notna()
        oldest = known & (reuse["gens_above_oldest"].fillna(-1).astype("int64") == 0)
        out["evicted_from_oldest_share"] = int(p[oldest].sum()) / int(p[known].sum())
    return out


def _weighted_median(values: pd.Series, weights: pd.Series) -> float | None:
    """The median of ``values`` counted ``weights`` times each (NA values left out)."""
    ok = values.notna()
    if not ok.any():
        return None
    v = values[ok].astype("float64").to_numpy()
    w = weights[ok].astype("float64").to_numpy()
    order = np.argsort(v, kind="stable")
    cum = np.cumsum(w[order])
    return float(v[order][np.searchsorted(cum, cum[-1] / 2)])
