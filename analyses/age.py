"""Generation age: how long expert pages lived in the page cache before the kernel let them go.

Classic LRU (the lru probe, any kernel): per expert, insertion-to-eviction dwell and
insertion-to-activation dwell, activations; log2 histograms of each, with quantiles.

MGLRU (the mglru probe's ``lru_gen`` samples of <debugfs>/lru_gen, and its
``mglru_aging`` events when the aging kprobes attached): per sample and memcg/node, the
live generations (min_seq .. max_seq), the age of the oldest one — the generation
eviction takes from, so the age a page reaches before it is evicted — and the file
pages it holds; aging cadence (max_seq increments per second and ms between them);
generations born during the recording with their size. Inputs are exactly the tables
the mglru probe writes (toolkit/record/probes/mglru.py), so the kernel lab's runs on 6.1
and 6.12 go through the same code as the fixtures rendered in those formats.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from moetrace.analyses.hitpath import hist_quantile

I64 = "Int64"


# -- classic LRU ---------------------------------------------------------------------------------

def compute_lru_dwell_experts(lru: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, expert): ``inserted_pages``, ``activated_pages``, ``evicted_pages``,
    ``evicted_activated_pages``, ``dwell_ns_mean`` (insertion to eviction, pages evicted
    after an insertion the probe saw) and ``activation_dwell_ns_mean``;
    ``activated_share`` = activated / inserted pages."""
    e = lru[lru["kind"] == "expert"].sort_values("expert_id").reset_index(drop=True)
    cols = ["layer", "expert", "expert_id", "inserted_pages", "activated_pages", "evicted_pages",
            "evicted_activated_pages", "dwell_count", "dwell_ns_mean", "activation_dwell_ns_mean"]
    out = e[[c for c in cols if c in e]].copy()
    ins = out["inserted_pages"].astype("Float64")
    out["activated_share"] = out["activated_pages"].astype("Float64") / ins.where(ins > 0)
    return out


def compute_dwell_quantiles(hist: pd.DataFrame, quantiles=(0.5, 0.9, 0.99)) -> pd.DataFrame:
    """lru_dwell_histogram (kind, lo_ns, hi_ns, pages) -> per kind: ``pages`` and
    ``p50_ns`` .. (log2-bucket interpolation, within a factor of 2)."""
    rows = []
    for kind, g in hist.groupby("kind", sort=True):
        r: dict[str, Any] = {"kind": kind, "pages": int(g["pages"].sum())}
        for q in quantiles:
            r[f"p{round(q * 100)}_ns"] = hist_quantile(g["lo_ns"].to_numpy(), g["hi_ns"].to_numpy(),
                                                     g["pages"].to_numpy(), q)
        rows.append(r)
    return pd.DataFrame(rows, columns=["kind", "pages", *(f"p{round(q * 100)}_ns" for q in quantiles)])


# -- MGLRU ---------------------------------------------------------------------------------------

def compute_generations(lru_gen: pd.DataFrame, memcg_path: str | None = None) -> pd.DataFrame:
    """One row per (sample, memcg, node): ``time_ns``, ``memcg_id``, ``memcg_path``,
    ``node``, ``generations`` (live ones), ``min_seq``, ``max_seq``, ``oldest_age_ms`` (the
    generation eviction takes from), ``youngest_age_ms``, ``file_pages``, ``anon_pages``,
    ``oldest_file_pages``. Generations the full format marks evicted for file pages are
    left out of the file columns. ``memcg_path``: keep one memcg (None: all)."""
    g = lru_gen
    if memcg_path is not None:
        g = g[g["memcg_path"] == memcg_path]
    if g.empty:
        return pd.DataFrame(columns=["time_ns", "sample", "memcg_id", "memcg_path", "node", "generations",
                                     "min_seq", "max_seq", "oldest_age_ms", "youngest_age_ms", "file_pages",
                                     "anon_pages", "oldest_file_pages"])
    live = g[~g["file_evicted"]] if "file_evicted" in g else g
    key = ["sample", "memcg_id", "node"]
    a = g.groupby(key).agg(time_ns=("time_ns", "first"), memcg_path=("memcg_path", "first"),
                           generations=("seq", "size"), min_seq=("seq", "min"), max_seq=("seq", "max"),
                           anon_pages=("nr_anon_pages", "sum"))
    f = live.sort_values("seq").groupby(key).agg(oldest_age_ms=("age_ms", "first"),
                                                 youngest_age_ms=("age_ms", "last"),
                                                 file_pages=("nr_file_pages", "sum"),
                                                 oldest_file_pages=("nr_file_pages", "first"))
    out = a.join(f, how="left").reset_index()
    for c in ("oldest_age_ms", "youngest_age_ms", "file_pages", "oldest_file_pages"):
        out[c] = out[c].astype(I64)
    return out[["time_ns", "sample", "memcg_id", "memcg_path", "node", "generations", "min_seq", "max_seq",
                "oldest_age_ms", "youngest_age_ms", "file_pages", "anon_pages", "oldest_file_pages"]]


def compute_aging_cadence(lru_gen: pd.DataFrame, aging: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per (memcg, node): ``samples``, ``span_ms`` (first to last sample), ``seq_increments``
    (max_seq growth), ``increments_per_s``, ``ms_per_increment`` (NA when max_seq did not
    grow), ``births`` (distinct generations born inside the span, from birth_ns) and,
    with the mglru probe's aging events (``mglru_aging``: kinds try_to_inc_max_seq /
    inc_max_seq*), ``aging_events_all_memcgs`` and ``aging_interval_ms_median_all_memcgs``
    between successive events (the events carry no memcg)."""
    gens = compute_generations(lru_gen)
    rows = []
    for (mid, node), g in gens.groupby(["memcg_id", "node"], sort=True):
        g = g.sort_values("time_ns")
        span_ms = (int(g["time_ns"].iloc[-1]) - int(g["time_ns"].iloc[0])) / 1e6
        inc = int(g["max_seq"].iloc[-1] - g["max_seq"].iloc[0])
        sub = lru_gen[(lru_gen["memcg_id"] == mid) & (lru_gen["node"] == node)]
        t0, t1 = int(g["time_ns"].iloc[0]), int(g["time_ns"].iloc[-1])
        births = sub.loc[(sub["birth_ns"] > t0) & (sub["birth_ns"] <= t1), "seq"].nunique()
        rows.append({"memcg_id": int(mid), "memcg_path": g["memcg_path"].iloc[0], "node": int(node),
                     "samples": len(g), "span_ms": span_ms, "seq_increments": inc,
                     "increments_per_s": inc / (span_ms / 1e3) if span_ms > 0 else None,
                     "ms_per_increment": span_ms / inc if inc > 0 else None, "births": int(births)})
    out = pd.DataFrame(rows)
    if aging is not None and len(aging) and len(out):
        # try_to_inc_max_seq (6.1, 6.12), inc_max_seq[.constprop.N]: the events carry no memcg, so
        # their count and spacing are over all memcgs (the columns say so)
        inc = aging[aging["kind"].astype(str).str.contains("inc_max_seq")].sort_values("time_ns")
        gaps = np.diff(inc["time_ns"].to_numpy(np.int64)) / 1e6
        out["aging_events_all_memcgs"] = len(inc)
        out["aging_interval_ms_median_all_memcgs"] = float(np.median(gaps)) if gaps.size else None
    for c in ("increments_per_s", "ms_per_increment"):
        if c in out:
            out[c] = out[c].astype("Float64")
    return out


def compute_generation_births(lru_gen: pd.DataFrame) -> pd.DataFrame:
    """Each generation seen, once: ``memcg_id``, ``node``, ``seq``, ``birth_ns`` (median over
    the samples that saw it: jiffy resolution), ``first_seen_ns``, ``last_seen_ns``,
    ``max_file_pages`` and ``last_file_pages`` (what it still held when last seen),
    ``lifetime_ms`` (birth to last sighting: a lower bound of its age at eviction when it
    disappeared before the recording ended)."""
    if lru_gen.empty:
        return pd.DataFrame(columns=["memcg_id", "node", "seq", "birth_ns", "first_seen_ns", "last_seen_ns",
                                     "max_file_pages", "last_file_pages", "lifetime_ms"])
    g = lru_gen.sort_values("time_ns").groupby(["memcg_id", "node", "seq"])
    out = g.agg(birth_ns=("birth_ns", "median"), first_seen_ns=("time_ns", "first"),
                last_seen_ns=("time_ns", "last"), max_file_pages=("nr_file_pages", "max"),
                last_file_pages=("nr_file_pages", "last")).reset_index()
    out["birth_ns"] = out["birth_ns"].round().astype("int64")
    out["lifetime_ms"] = (out["last_seen_ns"] - out["birth_ns"]) / 1e6
    return out


def compute_age_at_eviction(lru_gen: pd.DataFrame, memcg_path: str | None = None) -> pd.DataFrame:
    """Between successive samples, the generations that left (min_seq moved past them):
    ``time_ns`` (the later sample), ``memcg_id``, ``node``, ``seq``, ``age_ms`` (their age at
    the last sample that saw them alive, a lower bound of the age at eviction, and the
    upper bound one sampling period later), ``file_pages`` (what they held then)."""
    g = lru_gen if memcg_path is None else lru_gen[lru_gen["memcg_path"] == memcg_path]
    rows = []
    for (mid, node), sub in g.groupby(["memcg_id", "node"], sort=True):
        samples = sorted(sub["sample"].unique())
        prev = None
        for s in samples:
            cur = sub[sub["sample"] == s]
            if prev is not None:
                gone = prev[prev["seq"] < int(cur["seq"].min())]
                for r in gone.itertuples():
                    rows.append({"time_ns": int(cur["time_ns"].iloc[0]), "memcg_id": int(mid), "node": int(node),
                                 "seq": int(r.seq), "age_ms": int(r.age_ms), "file_pages": int(r.nr_file_pages)})
            prev = cur
    return pd.DataFrame(rows, columns=["time_ns", "memcg_id", "node", "seq", "age_ms", "file_pages"])


def compute_eviction_ages(evictions: pd.DataFrame, lru_gen: pd.DataFrame,
                          aging: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each pool eviction the mglru probe recorded (``mglru_evictions``) with the age of the
    generation it was taken from: ``birth_ns`` of (memcg_id, seq) from the lru_gen samples
    that saw that generation (``birth_source`` "lru_gen"), else from the aging events
    (generation s is born by the first try_to_inc_max_seq(seq = s - 1) at or before the
    eviction: "aging", over all memcgs), else NA; ``age_ms`` = eviction - birth."""
    ev = evictions.copy()
    births = compute_generation_births(lru_gen)[["memcg_id", "seq", "birth_ns"]] if len(lru_gen) else \
        pd.DataFrame({"memcg_id": pd.Series([], dtype="int64"), "seq": pd.Series([], dtype="int64"),
                      "birth_ns": pd.Series([], dtype="int64")})
    births = births.groupby(["memcg_id", "seq"], as_index=False)["birth_ns"].min()
    ev["seq_key"] = ev["seq"].astype("float64")
    b = births.assign(seq_key=births["seq"].astype("float64")).drop(columns="seq")
    ev = ev.merge(b, how="left", left_on=["memcg_id", "seq_key"], right_on=["memcg_id", "seq_key"])
    ev["birth_source"] = pd.array(np.where(ev["birth_ns"].notna(), "lru_gen", pd.NA), dtype="string")
    if aging is not None and len(aging):
        inc = aging[aging["kind"].astype(str).str.contains("inc_max_seq") & aging["seq"].notna()]
        first = inc.groupby("seq")["time_ns"].min()  # seq asked to grow -> first attempt
        born_of = pd.Series(first.to_numpy(np.int64), index=first.index.astype("int64") + 1)
        miss = ev["birth_ns"].isna() & ev["seq"].notna()
        cand = ev.loc[miss, "seq"].astype("int64").map(born_of)
        ok = cand.notna() & (cand <= ev.loc[miss, "time_ns"])
        idx = cand[ok].index
        ev.loc[idx, "birth_ns"] = cand[ok].astype("float64")
        ev.loc[idx, "birth_source"] = "aging"
    ev["birth_ns"] = ev["birth_ns"].astype("Int64")
    ev["age_ms"] = ((ev["time_ns"].astype("Int64") - ev["birth_ns"]).astype("Float64") / 1e6)
    return ev.drop(columns=["seq_key"])


def compute_eviction_age_experts(ages: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, expert): ``evicted_folios``, ``age_ms_p10`` / ``age_ms_median`` /
    ``age_ms_p90`` of the generation each folio was evicted from, ``birth_known_share``
    (the evictions whose generation's birth is known), ``seq_first`` / ``seq_last``."""
    cols = ["layer", "expert", "expert_id", "evicted_folios", "age_ms_p10", "age_ms_median", "age_ms_p90",
            "birth_known_share", "seq_first", "seq_last"]
    if ages.empty:
        return pd.DataFrame(columns=cols)
    a = ages.assign(_age=ages["age_ms"].astype("float64"))
    g = a.groupby(["layer", "expert", "expert_id"], sort=True)
    out = g.agg(evicted_folios=("time_ns", "size"), age_ms_p10=("_age", lambda x: x.quantile(0.1)),
                age_ms_median=("_age", "median"), age_ms_p90=("_age", lambda x: x.quantile(0.9)),
                birth_known_share=("_age", lambda x: float(x.notna().mean())),
                seq_first=("seq", "min"), seq_last=("seq", "max")).reset_index()
    for c in ("age_ms_p10", "age_ms_median", "age_ms_p90", "birth_known_share"):
        out[c] = out[c].astype("Float64")
    return out[cols]


def locked_fraction(mlock_timeline: pd.DataFrame | None, meta: Mapping[str, Any]) -> pd.DataFrame:
    """Locked bytes over time against the capacity: ``time_ns``, ``total_locked_bytes``,
    ``locked_fraction`` (of the cell's capacity; NA outside a cell)."""
    if mlock_timeline is None or mlock_timeline.empty:
        return pd.DataFrame(columns=["time_ns", "total_locked_bytes", "locked_fraction"])
    cap = (meta.get("cell") or {}).get("capacity_bytes")
    out = mlock_timeline[["time_ns", "total_locked_bytes"]].copy()
    out["locked_fraction"] = (out["total_locked_bytes"].astype("Float64") / cap) if cap else pd.NA
    return out
