"""The reclaim bite: how much each kswapd pass freed against the oldest MGLRU generation it
started from (issue 34's hypothesis M1: a 6.8 kswapd pass asks for Σhigh, the sum of the zones'
high watermarks, in one go; when Σhigh exceeds the oldest generation, one bite drains min_seq to
folios inserted moments ago).

Inputs are the lab guest's sampler files (moetrace.run.sampler: vmstat at 1 Hz, MemFree at
10 Hz, lru_gen at 1 Hz, zoneinfo once) and, when the cell's recording has them, the vmscan
probe's tables (kswapd wakes / sleeps, every shrink_inactive batch with who ran it), the
pagecache probe's page stream and the reads probe's read calls (``record --stream-events``).
Every time here is in the sampler's seconds ``t`` (0 = ``sampler.json`` ``t0_monotonic_ns``);
the probes' CLOCK_MONOTONIC ns are shifted onto it.

* :func:`counter_deltas` / :func:`compute_reclaim_split` — the vmstat counters over a window:
  kswapd's share of the pages reclaimed (pgsteal_kswapd / (pgsteal_kswapd + pgsteal_direct):
  global reclaim only, a memcg's own reclaim is in neither), scan-to-steal per reclaimer.
* :func:`pick_lruvec`, :func:`compute_oldest_generation` — per lru_gen sample of one (memcg, node):
  min_seq (the oldest generation holding file pages), max_seq, the oldest generation's file
  pages and its share f(t) of the memcg's file pages.
* :func:`compute_generation_lifetimes` — how long each sequence number was the oldest.
* :func:`compute_passes` (vmscan probe) / :func:`compute_passes_vmstat` (pageoutrun steps,
  without the probe) and :func:`attach_oldest` — the bite distribution: per kswapd pass the
  pages it freed against the oldest generation's file pages at its start.
* :func:`compute_memfree_cycles` — the MemFree sawtooth: each drop and how far MemFree rose
  above Σhigh after it (the overshoot).
* :func:`compute_evicted_before_read` — page lifetimes (add -> delete) with no read call
  covering the page completed in between.
* :func:`compute_rereads_after_passes` — per pass, the pages each expert read again before the
  next pass began.
* :func:`epoch_rereads`, :func:`compute_rereads_after_advances` — hypothesis M2 (protected
  folios pile up until f falls to a quarter, then aging sweeps the hot set): the pages read again
  per replay iteration, in the iterations that ran from each min_seq (or max_seq) advance to 2 s
  after it (lru_gen at 1 Hz: the advance is known to the second) against the others.
* :func:`summarize_bites` — the figures above in one :class:`BiteSummary`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

NS = 1_000_000_000
#: the columns of :func:`compute_passes` / :func:`compute_passes_vmstat`
PASS_COLUMNS = ("pass", "source", "nid", "order", "start_s", "end_s", "ended_by", "passes", "batches",
                "scanned_pages", "freed_pages", "freed_file_pages", "freed_per_pass_pages", "scan_to_steal",
                "min_priority")


def _num(v: Any) -> float | None:
    return None if v is None or pd.isna(v) else float(v)


def _ratio(a: Any, b: Any) -> float | None:
    a, b = _num(a), _num(b)
    return None if a is None or not b else a / b


def in_window(df: pd.DataFrame, t0: float | None, t1: float | None, col: str = "t") -> pd.DataFrame:
    """The rows with ``col`` inside [t0, t1] (None: open on that side)."""
    m = pd.Series(True, index=df.index)
    if t0 is not None:
        m &= df[col] >= t0
    if t1 is not None:
        m &= df[col] <= t1
    return df[m]


# -- vmstat ---------------------------------------------------------------------------------------

def counter_deltas(vmstat: pd.DataFrame, t0: float | None = None, t1: float | None = None) -> dict[str, Any]:
    """Each counter's last minus first value over the rows inside [t0, t1] (None where either is
    NA: the kernel lacks it), with ``t_first`` / ``t_last`` (the rows used); {} with under two rows.
    Gauges (nr_*) get a delta too: read them as the change."""
    w = in_window(vmstat, t0, t1).sort_values("t")
    if len(w) < 2:
        return {}
    a, b = w.iloc[0], w.iloc[-1]
    out: dict[str, Any] = {"t_first": float(a["t"]), "t_last": float(b["t"])}
    for c in w.columns:
        if c != "t":
            out[c] = None if pd.isna(a[c]) or pd.isna(b[c]) else int(b[c]) - int(a[c])
    return out


def compute_reclaim_split(d: dict[str, Any]) -> dict[str, Any]:
    """From :func:`counter_deltas`: ``kswapd_share`` of the pages reclaimed (global reclaim:
    pgsteal_kswapd / (pgsteal_kswapd + pgsteal_direct); None when nothing was), scan-to-steal of
    kswapd and of direct reclaim, pgrefill (under MGLRU: protected folios, not in pgscan),
    kswapd passes (pageoutrun) and direct-reclaim stalls (allocstall_* summed)."""
    sk, sd = d.get("pgsteal_kswapd"), d.get("pgsteal_direct")
    total = (sk or 0) + (sd or 0)
    stalls = [v for k, v in d.items() if k.startswith("allocstall_") and v is not None]
    return {"kswapd_share": (sk or 0) / total if total else None,
            "scan_to_steal_kswapd": _ratio(d.get("pgscan_kswapd"), sk),
            "scan_to_steal_direct": _ratio(d.get("pgscan_direct"), sd),
            "pgsteal_kswapd_pages": sk, "pgsteal_direct_pages": sd, "pgscan_kswapd_pages": d.get("pgscan_kswapd"),
            "pgscan_direct_pages": d.get("pgscan_direct"), "pgrefill_pages": d.get("pgrefill"),
            "pageoutrun": d.get("pageoutrun"), "allocstall": sum(stalls) if stalls else None,
            "workingset_refault_file_pages": d.get("workingset_refault_file")}


# -- lru_gen --------------------------------------------------------------------------------------

def pick_lruvec(lru_gen: pd.DataFrame, memcg_path: str | None = None) -> tuple[int, str, int] | None:
    """(memcg_id, memcg_path, node) whose generations to follow: ``memcg_path``'s (its node with
    the most file pages), else the (memcg, node) holding the most file pages on average over the
    samples. A memcg listed with id 0 is one going offline (its id already released: measured in a
    6.12 guest, the cell's memcg after the cell removed it) and is taken only when nothing else is.
    None when lru_gen has no rows (or none of that memcg)."""
    g = lru_gen if memcg_path is None else lru_gen[lru_gen["memcg_path"] == memcg_path]
    if (g["memcg_id"] != 0).any():
        g = g[g["memcg_id"] != 0]
    if g.empty:
        return None
    per = g.groupby(["memcg_id", "memcg_path", "node", "t"], observed=True)["nr_file"].sum()
    mean = per.groupby(level=[0, 1, 2]).mean().sort_values(ascending=False, kind="stable")
    mid, path, node = mean.index[0]
    return int(mid), str(path), int(node)


GEN_COLUMNS = ("t", "min_seq", "max_seq", "generations", "file_pages", "oldest_file_pages", "oldest_share",
               "oldest_age_ms")


def compute_oldest_generation(lru_gen: pd.DataFrame, memcg_id: int, node: int) -> pd.DataFrame:
    """Per lru_gen sample of one (memcg, node): ``min_seq`` (the oldest generation holding file
    pages: lru_gen lists from the anon min_seq, which can be older), ``max_seq``, ``generations``
    listed, ``file_pages`` (all generations), ``oldest_file_pages``, ``oldest_share`` = f(t), the
    oldest's share of the file pages (NA: no file pages), ``oldest_age_ms``."""
    g = lru_gen[(lru_gen["memcg_id"] == memcg_id) & (lru_gen["node"] == node)].sort_values(["t", "seq"])
    if g.empty:
        return pd.DataFrame({c: pd.Series(dtype="Float64") for c in GEN_COLUMNS})
    by = g.groupby("t")
    out = pd.DataFrame({"max_seq": by["seq"].max(), "generations": by["seq"].size(),
                        "file_pages": by["nr_file"].sum()})
    first = g[g["nr_file"] > 0].groupby("t").first()
    out["min_seq"] = first["seq"].reindex(out.index)
    out["oldest_file_pages"] = first["nr_file"].reindex(out.index)
    out["oldest_age_ms"] = first["age_ms"].reindex(out.index)
    fp = out["file_pages"].astype("Float64")
    out["oldest_share"] = out["oldest_file_pages"].astype("Float64") / fp.where(fp > 0)
    out = out.reset_index()
    for c in ("min_seq", "max_seq", "generations", "file_pages", "oldest_file_pages", "oldest_age_ms"):
        out[c] = out[c].astype("Int64")
    return out[list(GEN_COLUMNS)]


def compute_generation_lifetimes(gens: pd.DataFrame) -> pd.DataFrame:
    """How long each sequence number was the oldest (min_seq): ``seq``, ``first_t`` (the first
    sample showing it as min_seq; NA when it came and went between two samples), ``left_t`` (the
    first sample showing a newer one; NA: still the oldest at the end), ``lifetime_s`` (NA when
    either is), ``at_start`` (already the oldest at the first sample: a lower bound)."""
    s = gens.dropna(subset=["min_seq"]).sort_values("t")
    cols = {"seq": "Int64", "first_t": "Float64", "left_t": "Float64", "lifetime_s": "Float64", "at_start": "boolean"}
    if s.empty:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in cols.items()})
    t, seq = s["t"].to_numpy(float), s["min_seq"].to_numpy(np.int64)
    rows = []
    for v in range(int(seq.min()), int(seq.max()) + 1):
        seen = np.flatnonzero(seq == v)
        later = np.flatnonzero(seq > v)
        first = float(t[seen[0]]) if len(seen) else None
        left = float(t[later[0]]) if len(later) else None
        rows.append({"seq": v, "first_t": first, "left_t": left,
                     "lifetime_s": (left - first) if first is not None and left is not None else None,
                     "at_start": bool(len(seen) and seen[0] == 0)})
    return pd.DataFrame({c: pd.array([r[c] for r in rows], dtype=dt) for c, dt in cols.items()})


def generation_turnover(gens: pd.DataFrame) -> dict[str, Any]:
    """``min_seq_advances`` and ``max_seq_advances`` between the first and the last sample,
    ``turnovers_per_min`` (min_seq advances per minute of samples), f's median, lowest and the
    share of samples at or below a quarter (``oldest_share_median``, ``_min``, ``_below_quarter``:
    where M2 expects aging to sweep the hot set); None where the samples do not tell."""
    s = gens.dropna(subset=["min_seq"]).sort_values("t")
    f = gens["oldest_share"].dropna() if len(gens) else pd.Series(dtype="Float64")
    out: dict[str, Any] = {"min_seq_advances": None, "max_seq_advances": None, "turnovers_per_min": None,
                           "oldest_share_median": _num(f.median()) if len(f) else None,
                           "oldest_share_min": _num(f.min()) if len(f) else None,
                           "oldest_share_below_quarter": float((f <= 0.25).mean()) if len(f) else None,
                           "oldest_file_pages_median": _num(gens["oldest_file_pages"].median()) if len(gens) else None}
    if len(s) < 2:
        return out
    span = float(s["t"].iloc[-1] - s["t"].iloc[0])
    adv = int(s["min_seq"].iloc[-1] - s["min_seq"].iloc[0])
    out.update(min_seq_advances=adv, max_seq_advances=int(s["max_seq"].iloc[-1] - s["max_seq"].iloc[0]),
               turnovers_per_min=adv / (span / 60) if span > 0 else None)
    return out


# -- kswapd passes ------------------------------------------------------------------------------------

def _empty_passes() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="object") for c in PASS_COLUMNS})


def compute_passes(wakes: pd.DataFrame, batches: pd.DataFrame, t0_ns: int,
                   end_ns: int | None = None) -> pd.DataFrame:
    """The kswapd passes of the vmscan probe: a pass runs from a ``wake`` record (one per
    balance_pgdat) to the next wake or sleep of its node (``ended_by``; ``end`` at ``end_ns``,
    else the last record). Per pass the kswapd batches inside it: ``batches``,
    ``scanned_pages``, ``freed_pages`` (nr_reclaimed summed), ``freed_file_pages``,
    ``scan_to_steal`` (NA: nothing freed), ``min_priority``; ``passes`` is 1. Times in seconds
    since ``t0_ns``."""
    w = wakes.sort_values("time_ns", kind="stable")
    if not (w["kind"] == "wake").any():
        return _empty_passes()
    kb = batches[batches["who"] == "kswapd"].sort_values("time_ns", kind="stable")
    stop = int(end_ns if end_ns is not None else max(int(w["time_ns"].max()),
                                                     int(kb["time_ns"].max()) if len(kb) else 0))
    rows = []
    for nid, ev in w.groupby("nid"):
        ts, kinds = ev["time_ns"].to_numpy(np.int64), ev["kind"].to_numpy(object)
        b = kb[kb["nid"] == nid]
        bt = b["time_ns"].to_numpy(np.int64)
        for i in np.flatnonzero(kinds == "wake"):
            start, end = int(ts[i]), (int(ts[i + 1]) if i + 1 < len(ts) else stop)
            sel = b.iloc[np.searchsorted(bt, start, "left"):np.searchsorted(bt, end, "left")]
            freed = int(sel["reclaimed_pages"].sum())
            rows.append({"source": "vmscan", "nid": int(nid), "order": int(ev["order"].iloc[i]),
                         "start_s": (start - t0_ns) / NS, "end_s": (end - t0_ns) / NS,
                         "ended_by": str(kinds[i + 1]) if i + 1 < len(ts) else "end", "passes": 1,
                         "batches": len(sel), "scanned_pages": int(sel["scanned_pages"].sum()), "freed_pages": freed,
                         "freed_file_pages": int(sel.loc[sel["file"].astype(bool), "reclaimed_pages"].sum()),
                         "freed_per_pass_pages": float(freed),
                         "scan_to_steal": _ratio(sel["scanned_pages"].sum(), freed),
                         "min_priority": int(sel["priority"].min()) if len(sel) else None})
    return _passes_frame(rows)


def _passes_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    if not rows:
        return _empty_passes()
    df = pd.DataFrame(rows).sort_values(["start_s", "nid"], kind="stable").reset_index(drop=True)
    df.insert(0, "pass", np.arange(len(df), dtype=np.int64))
    for c in ("order", "nid", "batches", "min_priority", "freed_file_pages", "passes"):
        df[c] = pd.array(df[c].tolist(), dtype="Int64")
    for c in ("scan_to_steal", "freed_per_pass_pages"):
        df[c] = pd.array(df[c].tolist(), dtype="Float64")
    return df[list(PASS_COLUMNS)]


def compute_passes_vmstat(vmstat: pd.DataFrame) -> pd.DataFrame:
    """The kswapd passes as vmstat sees them, without the probe: one row per sampling interval
    in which pageoutrun (one per balance_pgdat) stepped: ``passes`` (its step), ``freed_pages``
    and ``scanned_pages`` (pgsteal_kswapd / pgscan_kswapd over the interval), the interval's
    ``freed_per_pass_pages`` (freed / passes: a mean, not each pass). Empty without pageoutrun."""
    need = ("pageoutrun", "pgsteal_kswapd", "pgscan_kswapd")
    v = vmstat.sort_values("t")
    if any(c not in v or v[c].isna().all() for c in need):
        return _empty_passes()
    d = v[list(need)].astype("float64").diff()
    t = v["t"].to_numpy(float)
    rows = []
    for i in np.flatnonzero(d["pageoutrun"].to_numpy() > 0):
        n, freed, scanned = int(d["pageoutrun"].iloc[i]), d["pgsteal_kswapd"].iloc[i], d["pgscan_kswapd"].iloc[i]
        rows.append({"source": "vmstat", "nid": None, "order": None, "start_s": float(t[i - 1]), "end_s": float(t[i]),
                     "ended_by": None, "passes": n, "batches": None, "scanned_pages": int(scanned),
                     "freed_pages": int(freed), "freed_file_pages": None, "freed_per_pass_pages": freed / n,
                     "scan_to_steal": _ratio(scanned, freed), "min_priority": None})
    return _passes_frame(rows)


def attach_oldest(passes: pd.DataFrame, gens: pd.DataFrame) -> pd.DataFrame:
    """``passes`` with the oldest generation at each pass's start (the last lru_gen sample at or
    before it): ``min_seq_at_start``, ``oldest_file_pages_at_start``, ``oldest_share_at_start``,
    and ``bite_over_oldest`` = freed per pass / those pages (NA: no sample before, or none)."""
    out = passes.copy()
    g = gens.dropna(subset=["min_seq"]).sort_values("t")
    cols = {"min_seq_at_start": "Int64", "oldest_file_pages_at_start": "Int64", "oldest_share_at_start": "Float64",
            "bite_over_oldest": "Float64"}
    if out.empty or g.empty:
        for c, dt in cols.items():
            out[c] = pd.array([None] * len(out), dtype=dt)
        return out
    right = pd.DataFrame({"t": g["t"].astype(float), "min_seq_at_start": g["min_seq"],
                          "oldest_file_pages_at_start": g["oldest_file_pages"],
                          "oldest_share_at_start": g["oldest_share"]})
    left = out.assign(_start=out["start_s"].astype(float)).sort_values("_start", kind="stable")
    m = pd.merge_asof(left, right, left_on="_start", right_on="t", direction="backward").drop(columns=["_start", "t"])
    m = m.sort_values("pass").reset_index(drop=True)
    oldest = m["oldest_file_pages_at_start"].astype("Float64")
    m["bite_over_oldest"] = m["freed_per_pass_pages"].astype("Float64") / oldest.where(oldest > 0)
    for c, dt in cols.items():
        m[c] = m[c].astype(dt)
    return m


# -- MemFree ---------------------------------------------------------------------------------------

MEMFREE_CYCLE_COLUMNS = ("cycle", "min_t", "free_min_kb", "peak_t", "free_peak_kb", "rise_kb", "overshoot_kb",
                         "confirmed")


def zigzag(values: np.ndarray, delta: float) -> list[tuple[str, int]]:
    """The turning points of a series, with hysteresis ``delta``: ("trough", i) once the series
    has risen ``delta`` above its low since the last peak, ("peak", i) once it has fallen
    ``delta`` below its high since the last trough; a last extreme not yet confirmed ends the
    list as ("trough?" / "peak?", i)."""
    out: list[tuple[str, int]] = []
    if not len(values):
        return out
    want, cand = "trough", 0
    for i in range(1, len(values)):
        v, c = values[i], values[cand]
        if (want == "trough" and v < c) or (want == "peak" and v > c):
            cand = i
        elif abs(v - c) >= delta:
            out.append((want, cand))
            want, cand = ("peak" if want == "trough" else "trough"), i
    out.append((want + "?", cand))
    return out


def free_series(memfree: pd.DataFrame, zones: list[dict[str, Any]] | None,
                page_bytes: int = 4096) -> tuple[pd.DataFrame, float, float, str] | None:
    """The free memory kswapd works on, with its watermarks: (``memfree`` with a ``free_kb``
    column, Σlow kB, Σhigh kB, what was summed). With per-zone free pages (``free_<zone>_pages``)
    and zoneinfo's zones: the zones whose free pages fell below their low watermark in these rows
    (the ones kswapd balanced; a DMA zone no allocation reaches stays out, with its ~15 MB free),
    all managed zones when none did; else MemFree against every managed zone's watermarks. None
    without zones' watermarks."""
    if not zones:
        return None
    kb = page_bytes / 1024
    managed = {str(z["zone"]).lower(): z for z in zones if z.get("managed", 0) > 0}
    have = {n: f"free_{n}_pages" for n in managed if f"free_{n}_pages" in memfree.columns}
    if not have or any(memfree[c].isna().all() for c in have.values()):
        return (memfree.assign(free_kb=memfree["memfree_kb"].astype("Float64")),
                sum(z.get("low", 0) for z in managed.values()) * kb,
                sum(z.get("high", 0) for z in managed.values()) * kb, "MemFree")
    hit = [n for n, c in have.items() if (memfree[c].astype("Float64") < managed[n].get("low", 0)).any()]
    use = hit or list(have)
    free = sum(memfree[have[n]].astype("Float64") for n in use) * kb
    return (memfree.assign(free_kb=free), sum(managed[n].get("low", 0) for n in use) * kb,
            sum(managed[n].get("high", 0) for n in use) * kb, "+".join(use))


def compute_memfree_cycles(memfree: pd.DataFrame, sum_low_kb: float, sum_high_kb: float,
                           column: str = "memfree_kb") -> pd.DataFrame:
    """The MemFree sawtooth: each drop's lowest point (``min_t``, ``free_min_kb``) and the
    highest point MemFree reached after it before falling again (``peak_t``,
    ``free_peak_kb``), ``rise_kb`` between them, and ``overshoot_kb`` = peak - Σhigh: how far
    past the high watermarks the reclaim freed (kswapd stops a pass at every zone's high).
    Turning points need a move of at least Σhigh - Σlow (the watermark gap: smaller wiggles
    are the allocator's, not a pass); ``confirmed``: MemFree fell again after the peak (the
    last one may still be rising). MemFree is the machine's, Σ the zones': the DMA zone's free
    pages are in both, the per-zone order of events is not."""
    m = memfree.dropna(subset=[column]).sort_values("t")
    t, f = m["t"].to_numpy(float), m[column].astype("float64").to_numpy(np.float64)
    turns = zigzag(f, max(sum_high_kb - sum_low_kb, 4.0))
    rows = []
    for k, (kind, i) in enumerate(turns):
        if kind != "trough" or k + 1 >= len(turns):
            continue
        peak_kind, j = turns[k + 1]
        rows.append({"cycle": len(rows), "min_t": t[i], "free_min_kb": f[i], "peak_t": t[j],
                     "free_peak_kb": f[j], "rise_kb": f[j] - f[i], "overshoot_kb": f[j] - sum_high_kb,
                     "confirmed": peak_kind == "peak"})
    df = pd.DataFrame(rows, columns=list(MEMFREE_CYCLE_COLUMNS))
    for c in MEMFREE_CYCLE_COLUMNS[1:-1]:
        df[c] = df[c].astype("float64")
    df["cycle"] = df["cycle"].astype("int64")
    df["confirmed"] = df["confirmed"].astype("bool")
    return df


def mark_kswapd_cycles(cycles: pd.DataFrame, passes: pd.DataFrame) -> pd.DataFrame:
    """``cycles`` with ``kswapd``: a kswapd pass ran while MemFree rose (a pass's [start_s,
    end_s] overlaps [min_t, peak_t]); the other rises are the allocator's or a process exiting."""
    out = cycles.copy()
    if out.empty or passes.empty:
        out["kswapd"] = pd.Series([False] * len(out), dtype="bool")
        return out
    ps, pe = passes["start_s"].astype(float).to_numpy(), passes["end_s"].astype(float).to_numpy()
    lo, hi = out["min_t"].to_numpy(float), out["peak_t"].to_numpy(float)
    out["kswapd"] = ((ps[None, :] <= hi[:, None]) & (pe[None, :] >= lo[:, None])).any(axis=1)
    return out


# -- pages evicted before a read -----------------------------------------------------------------------

def _pages(first: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row index, page) for each page of each row's [first, first + count)."""
    rep = np.repeat(np.arange(len(first)), count)
    start = np.repeat(np.cumsum(count) - count, count)
    return rep, np.repeat(first, count) + (np.arange(int(count.sum())) - start)


def page_lifetimes(page_events: pd.DataFrame, n_experts_total: int | None = None) -> pd.DataFrame:
    """Every pool page's stays in the page cache that ended inside the stream: ``expert_id``,
    ``page`` (within the expert), ``add_ns``, ``delete_ns`` (a delete whose add the stream did
    not see is left out: the page was resident before the recording, or its add was lost)."""
    ev = page_events
    if n_experts_total is not None:
        ev = ev[ev["expert_id"].astype(np.int64) < n_experts_total]
    rep, page = _pages(ev["first_page_index"].to_numpy(np.int64), ev["pages"].to_numpy(np.int64))
    p = pd.DataFrame({"expert_id": ev["expert_id"].to_numpy(np.int64)[rep], "page": page,
                      "ts_ns": ev["ts_ns"].to_numpy(np.int64)[rep],
                      "add": (ev["kind"].astype(str).to_numpy() == "add")[rep]})
    p = p.sort_values(["expert_id", "page", "ts_ns"], kind="stable").reset_index(drop=True)
    prev_same = (p["expert_id"].shift() == p["expert_id"]) & (p["page"].shift() == p["page"])
    ends = np.flatnonzero((~p["add"].to_numpy()) & prev_same.to_numpy() & p["add"].shift(fill_value=False).to_numpy())
    return pd.DataFrame({"expert_id": p["expert_id"].to_numpy()[ends], "page": p["page"].to_numpy()[ends],
                         "add_ns": p["ts_ns"].to_numpy()[ends - 1], "delete_ns": p["ts_ns"].to_numpy()[ends]})


def read_pages(read_calls: pd.DataFrame, extent_bytes: int | None, page_bytes: int = 4096) -> pd.DataFrame:
    """Every page each read call of an expert copied, when the call completed: ``expert_id``,
    ``page`` (within the expert), ``done_ns`` (entry + latency). ``extent_bytes``: the pool file's
    extent (a file holding many experts: the position within the expert is the offset modulo
    it); None for one file per expert. Calls that read nothing, failed or have no position are
    left out."""
    r = read_calls[read_calls["expert_id"].notna() & read_calls["offset_bytes"].notna() & (read_calls["ret"] > 0)]
    off = r["offset_bytes"].to_numpy(np.int64)
    pos = off % extent_bytes if extent_bytes else off
    first = pos // page_bytes
    count = (pos + r["ret"].to_numpy(np.int64) - 1) // page_bytes - first + 1
    rep, page = _pages(first, count)
    done = r["ts_ns"].to_numpy(np.int64) + r["latency_ns"].to_numpy(np.int64)
    return pd.DataFrame({"expert_id": r["expert_id"].to_numpy(np.int64)[rep], "page": page, "done_ns": done[rep]})


def compute_evicted_before_read(page_events: pd.DataFrame, read_calls: pd.DataFrame, extent_bytes: int | None,
                                page_bytes: int = 4096, n_experts_total: int | None = None) -> pd.DataFrame:
    """:func:`page_lifetimes` with ``read_done_ns`` (the last read call covering the page that
    completed before the delete; NA: none) and ``evicted_before_read``: no read of the page
    completed between its add and its delete — it was read in (by a miss or readahead) and
    evicted before any reader got it."""
    life = page_lifetimes(page_events, n_experts_total)
    reads = read_pages(read_calls, extent_bytes, page_bytes)
    if life.empty:
        return life.assign(read_done_ns=pd.array([], dtype="Int64"), evicted_before_read=pd.array([], dtype="bool"))
    key = lambda df: df["expert_id"].to_numpy(np.int64) * (1 << 32) + df["page"].to_numpy(np.int64)  # noqa: E731
    left = life.assign(_k=key(life)).sort_values("delete_ns", kind="stable")
    right = reads.assign(_k=key(reads)).sort_values("done_ns", kind="stable")[["_k", "done_ns"]]
    m = pd.merge_asof(left, right, left_on="delete_ns", right_on="done_ns", by="_k", direction="backward")
    m = m.drop(columns=["_k"]).rename(columns={"done_ns": "read_done_ns"})
    m["read_done_ns"] = m["read_done_ns"].astype("Int64")
    m["evicted_before_read"] = (m["read_done_ns"].isna() | (m["read_done_ns"] < m["add_ns"])).astype(bool)
    return m.sort_values(["expert_id", "page", "add_ns"]).reset_index(drop=True)


# -- re-reads after each pass ------------------------------------------------------------------------

def compute_rereads_after_passes(passes: pd.DataFrame, epochs: pd.DataFrame, expert_epochs: pd.DataFrame,
                                 t0_ns: int) -> pd.DataFrame:
    """Per pass, the pages each expert read again (re-added after their eviction) in the replay
    iterations that began between this pass's start and the next's: ``pass``, ``expert_id``,
    ``layer``, ``expert``, ``re_added_pages`` (only nonzero rows)."""
    cols = ["pass", "expert_id", "layer", "expert", "re_added_pages"]
    if passes.empty or epochs.empty or expert_epochs.empty:
        return pd.DataFrame({c: pd.Series(dtype="Int64") for c in cols})
    starts = np.sort(passes["start_s"].astype(float).to_numpy())
    order = passes.sort_values("start_s", kind="stable")["pass"].to_numpy()
    ep = epochs.dropna(subset=["start_ns"])
    at = (ep["start_ns"].astype("int64").to_numpy() - t0_ns) / NS
    idx = np.searchsorted(starts, at, "right") - 1  # the last pass that began at or before the epoch
    which = pd.Series(np.where(idx >= 0, order[np.clip(idx, 0, None)], -1), index=ep["epoch"].to_numpy())
    ee = expert_epochs[(expert_epochs["kind"] == "expert") & (expert_epochs["re_added_pages"].fillna(0) > 0)]
    ee = ee.assign(**{"pass": ee["epoch"].map(which)})
    ee = ee[ee["pass"].notna() & (ee["pass"] >= 0)]
    out = ee.groupby(["pass", "expert_id", "layer", "expert"], as_index=False)["re_added_pages"].sum()
    for c in cols:
        out[c] = out[c].astype("Int64")
    return out[cols].sort_values(["pass", "expert_id"]).reset_index(drop=True)


def epoch_rereads(epochs: pd.DataFrame, expert_epochs: pd.DataFrame, t0_ns: int) -> pd.DataFrame:
    """Per replay iteration (epoch) of the recording: ``epoch``, ``start_s`` (sampler seconds) and
    ``re_added_pages``, the pages its experts read again after their eviction (the unattributed
    rows left out)."""
    ep = epochs.dropna(subset=["start_ns"])
    ee = expert_epochs[expert_epochs["kind"] == "expert"]
    pages = ee.groupby("epoch")["re_added_pages"].sum()
    return pd.DataFrame({"epoch": ep["epoch"].to_numpy(),
                         "start_s": (ep["start_ns"].astype("int64").to_numpy() - t0_ns) / NS,
                         "re_added_pages": ep["epoch"].map(pages).fillna(0).astype("int64").to_numpy()})


ADVANCE_COLUMNS = ("advance", "seq", "from_t", "to_t", "from_seq", "to_seq", "iterations", "re_added_pages_after")


def compute_rereads_after_advances(gens: pd.DataFrame, per_epoch: pd.DataFrame, seq: str = "min_seq",
                                   follow_s: float = 2.0) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The re-reads that followed each advance of ``seq`` (``min_seq``: the oldest generation
    evicted whole; ``max_seq``: aging made a new one) seen between two lru_gen samples
    ``from_t`` .. ``to_t``: the replay iterations that ran in [from_t, to_t + follow_s] and the
    pages read again in them (ADVANCE_COLUMNS; an iteration ends where the next begins, the
    last one open). The figures: re-reads per iteration in those iterations and in the others,
    and their ratio ``burst`` (None without an advance, or with no re-read in the others)."""
    s = gens.dropna(subset=[seq]).sort_values("t")
    e = per_epoch.sort_values("start_s").reset_index(drop=True)
    t, v = s["t"].to_numpy(float), s[seq].to_numpy(np.int64)
    at = np.flatnonzero(v[1:] > v[:-1]) + 1
    starts, pages = e["start_s"].to_numpy(float), e["re_added_pages"].to_numpy(np.int64)
    ends = np.append(starts[1:], np.inf)
    after = np.zeros(len(e), dtype=bool)
    rows = []
    for n, i in enumerate(at):
        sel = (starts <= t[i] + follow_s) & (ends > t[i - 1])
        after |= sel
        rows.append({"advance": n, "seq": seq, "from_t": float(t[i - 1]), "to_t": float(t[i]),
                     "from_seq": int(v[i - 1]), "to_seq": int(v[i]), "iterations": int(sel.sum()),
                     "re_added_pages_after": int(pages[sel].sum())})
    adv = pd.DataFrame(rows, columns=list(ADVANCE_COLUMNS))
    inside = float(pages[after].mean()) if after.any() else None
    outside = float(pages[~after].mean()) if (~after).any() else None
    return adv, {"advances": len(at), "iterations_after": int(after.sum()), "reread_after_per_iteration": inside,
                 "reread_other_per_iteration": outside,
                 "burst": inside / outside if inside is not None and outside else None}


# -- the summary -------------------------------------------------------------------------------------

@dataclass
class BiteSummary:
    """One cell's bite figures over its measured window (None: not measured, or nothing to divide)."""

    window_start_s: float | None = None
    window_end_s: float | None = None
    # vmstat over the window (compute_reclaim_split)
    kswapd_share: float | None = None
    scan_to_steal_kswapd: float | None = None
    scan_to_steal_direct: float | None = None
    pgsteal_kswapd_pages: int | None = None
    pgsteal_direct_pages: int | None = None
    pgscan_kswapd_pages: int | None = None
    pgscan_direct_pages: int | None = None
    pgrefill_pages: int | None = None
    pageoutrun: int | None = None
    allocstall: int | None = None
    workingset_refault_file_pages: int | None = None
    # the watermarks (zoneinfo.json: its end, else its start)
    page_bytes: int = 4096
    sum_low_pages: int | None = None
    sum_high_pages: int | None = None
    sum_high_bytes: int | None = None
    capacity_bytes: int | None = None
    # the generations of the memcg followed
    memcg_id: int | None = None
    memcg_path: str | None = None
    node: int | None = None
    oldest_share_median: float | None = None  # f
    oldest_share_min: float | None = None
    oldest_share_below_quarter: float | None = None  # the share of samples with f <= 0.25
    oldest_file_pages_median: float | None = None
    sum_high_over_fC: float | None = None
    sum_high_over_oldest: float | None = None
    min_seq_advances: int | None = None
    max_seq_advances: int | None = None
    turnovers_per_min: float | None = None
    generation_lifetime_s_median: float | None = None
    # the bites
    pass_source: str | None = None  # vmscan (the probe), vmstat (pageoutrun steps) or None
    passes: int | None = None
    bite_p50_pages: float | None = None
    bite_max_pages: float | None = None
    bite_max_over_oldest: float | None = None  # the largest pass's bite / the oldest generation (ties: the highest)
    bite_over_oldest_p50: float | None = None
    pass_scan_to_steal_p50: float | None = None
    sawtooth_of: str | None = None  # the free memory followed: the zones kswapd balanced ("dma32+normal"), or MemFree
    memfree_cycles: int | None = None  # rises of it during which a kswapd pass ran
    overshoot_kb_median: float | None = None
    overshoot_kb_max: float | None = None
    # pages evicted before a read completed (the page and read streams)
    evicted_pages: int | None = None
    evicted_before_read_pages: int | None = None
    # M2: re-reads per replay iteration in those that ran up to 2 s after a min_seq (aging: max_seq) advance / the others
    reread_after_advance_per_iteration: float | None = None
    reread_other_per_iteration: float | None = None
    reread_burst_ratio: float | None = None
    reread_burst_ratio_aging: float | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: the matrix row's columns (:meth:`Bites.columns`), in order
MATRIX_COLUMNS = ("kswapd_share", "scan_to_steal_kswapd", "scan_to_steal_direct", "sum_high_over_fC",
                  "turnovers_per_min", "bite_p50_pages", "bite_max_over_oldest", "evicted_before_read_pages",
                  "oldest_share_min", "oldest_share_below_quarter", "reread_burst_ratio", "reread_burst_ratio_aging")


@dataclass
class Bites:
    """:func:`compute_bites`'s result: the summary and the frames behind it (each restricted to
    the window): ``passes`` (PASS_COLUMNS + :func:`attach_oldest`'s), ``generations`` (f(t)),
    ``lifetimes``, ``memfree_cycles`` and ``advances`` (min_seq's, then max_seq's, with the
    re-reads that followed each: ADVANCE_COLUMNS; empty without the per-iteration recording)."""

    summary: BiteSummary
    passes: pd.DataFrame
    generations: pd.DataFrame
    lifetimes: pd.DataFrame
    memfree_cycles: pd.DataFrame
    advances: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(ADVANCE_COLUMNS)))

    def columns(self) -> dict[str, float | None]:
        """The matrix row's columns (MATRIX_COLUMNS)."""
        d = self.summary.as_dict()
        return {c: (None if d[c] is None else float(d[c])) for c in MATRIX_COLUMNS}


def watermarks(zoneinfo: dict[str, Any] | None, s: BiteSummary) -> None:
    """Σlow, Σhigh and the page size into ``s`` from zoneinfo.json (its end when it has one: the
    lab may set min_free_kbytes after the sampler started; a change is noted)."""
    if not zoneinfo:
        s.notes.append("no zoneinfo.json: Σhigh unknown")
        return
    start, end = zoneinfo.get("start") or {}, zoneinfo.get("end") or {}
    side = end or start
    if end and start and end.get("sum_high_pages") != start.get("sum_high_pages"):
        s.notes.append(f"Σhigh changed while sampling: {start.get('sum_high_pages')} -> {end.get('sum_high_pages')} "
                       "pages (the end's used)")
    s.page_bytes = int(side.get("page_size_bytes") or 4096)
    s.sum_low_pages, s.sum_high_pages = side.get("sum_low_pages"), side.get("sum_high_pages")
    if s.sum_high_pages is not None:
        s.sum_high_bytes = int(s.sum_high_pages) * s.page_bytes


def _generation_figures(s: BiteSummary, lru_gen: pd.DataFrame | None, memcg_path: str | None,
                        t0: float | None, t1: float | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """f, Σhigh / (f·C), turnovers and lifetimes into ``s``; (generations, lifetimes) frames."""
    empty = compute_oldest_generation(pd.DataFrame(columns=["t", "memcg_id", "node", "seq", "nr_file", "age_ms"]), 0, 0)
    if lru_gen is None or lru_gen.empty:
        s.notes.append("no lru_gen samples (MGLRU off, or no debugfs): generations not measured")
        return empty, compute_generation_lifetimes(empty)
    pick = pick_lruvec(in_window(lru_gen, t0, t1), memcg_path)
    if pick is None:
        s.notes.append(f"no lru_gen rows of memcg {memcg_path!r}")
        return empty, compute_generation_lifetimes(empty)
    s.memcg_id, s.memcg_path, s.node = pick
    gens = in_window(compute_oldest_generation(lru_gen, pick[0], pick[2]), t0, t1).reset_index(drop=True)
    life = compute_generation_lifetimes(gens)
    turn = generation_turnover(gens)
    s.min_seq_advances, s.max_seq_advances = turn["min_seq_advances"], turn["max_seq_advances"]
    s.turnovers_per_min, s.oldest_share_median = turn["turnovers_per_min"], turn["oldest_share_median"]
    s.oldest_share_min, s.oldest_share_below_quarter = turn["oldest_share_min"], turn["oldest_share_below_quarter"]
    s.oldest_file_pages_median = turn["oldest_file_pages_median"]
    s.generation_lifetime_s_median = _num(life["lifetime_s"].median()) if life["lifetime_s"].notna().any() else None
    if s.sum_high_bytes is not None and s.capacity_bytes and s.oldest_share_median:
        s.sum_high_over_fC = s.sum_high_bytes / (s.oldest_share_median * s.capacity_bytes)
    if s.sum_high_pages is not None and s.oldest_file_pages_median:
        s.sum_high_over_oldest = s.sum_high_pages / s.oldest_file_pages_median
    return gens, life


def _pass_figures(s: BiteSummary, passes: pd.DataFrame) -> None:
    """The bite distribution into ``s`` from the window's passes (with attach_oldest's columns)."""
    s.passes = int(passes["passes"].astype("Int64").sum()) if len(passes) else 0
    if passes.empty:
        return
    bite = passes["freed_per_pass_pages"].astype("Float64")
    s.bite_p50_pages = _num(bite.median())
    s.bite_max_pages = _num(bite.max())
    largest = passes.loc[(bite == bite.max()).fillna(False).to_numpy(), "bite_over_oldest"]  # ties: the worst
    s.bite_max_over_oldest = _num(largest.max()) if largest.notna().any() else None
    if passes["bite_over_oldest"].notna().any():
        s.bite_over_oldest_p50 = _num(passes["bite_over_oldest"].median())
    if passes["scan_to_steal"].notna().any():
        s.pass_scan_to_steal_p50 = _num(passes["scan_to_steal"].astype("Float64").median())


def _sawtooth(s: BiteSummary, memfree: pd.DataFrame | None, zoneinfo: dict[str, Any] | None, passes: pd.DataFrame,
              t0: float | None, t1: float | None) -> pd.DataFrame:
    """The MemFree cycles of the window, marked kswapd's or not; their overshoot into ``s``."""
    side = ((zoneinfo or {}).get("end") or (zoneinfo or {}).get("start") or {})
    fs = free_series(in_window(memfree, t0, t1), side.get("zones"), s.page_bytes) if memfree is not None else None
    if fs is None:
        return mark_kswapd_cycles(compute_memfree_cycles(pd.DataFrame({"t": [], "memfree_kb": []}), 0, 0), passes)
    frame, low_kb, high_kb, s.sawtooth_of = fs
    cycles = mark_kswapd_cycles(compute_memfree_cycles(frame, low_kb, high_kb, "free_kb"), passes)
    ks = cycles[cycles["kswapd"]]
    s.memfree_cycles = len(ks)
    if len(ks):
        s.overshoot_kb_median = _num(ks["overshoot_kb"].median())
        s.overshoot_kb_max = _num(ks["overshoot_kb"].max())
    return cycles


def compute_bites(vmstat: pd.DataFrame | None, memfree: pd.DataFrame | None, lru_gen: pd.DataFrame | None,
                  zoneinfo: dict[str, Any] | None, capacity_bytes: int | None, *,
                  window: tuple[float | None, float | None] = (None, None), probe_passes: pd.DataFrame | None = None,
                  memcg_path: str | None = None, evicted: pd.DataFrame | None = None,
                  per_epoch: pd.DataFrame | None = None) -> Bites:
    """One cell's bites over ``window`` (sampler seconds; None: open): the sampler's frames
    (moetrace.run.sampler), zoneinfo.json, the capacity C, and optionally the probe's passes
    (:func:`compute_passes`, preferred to vmstat's pageoutrun steps), the memcg to follow (default:
    the one holding the most file pages), :func:`compute_evicted_before_read`'s lifetimes and
    :func:`epoch_rereads`' iterations (M2's re-reads after each advance)."""
    t0, t1 = window
    s = BiteSummary(window_start_s=t0, window_end_s=t1, capacity_bytes=capacity_bytes)
    watermarks(zoneinfo, s)
    if vmstat is not None and len(vmstat):
        for k, v in compute_reclaim_split(counter_deltas(vmstat, t0, t1)).items():
            setattr(s, k, v)
    else:
        s.notes.append("no vmstat samples")
    gens, life = _generation_figures(s, lru_gen, memcg_path, t0, t1)
    if probe_passes is not None and len(probe_passes):
        passes, s.pass_source = probe_passes, "vmscan"
    elif vmstat is not None and len(vmstat):
        passes, s.pass_source = compute_passes_vmstat(in_window(vmstat, t0, t1)), "vmstat"
    else:
        passes = _empty_passes()
    passes = attach_oldest(in_window(passes, t0, t1, "start_s").reset_index(drop=True), gens)
    _pass_figures(s, passes)
    cycles = _sawtooth(s, memfree, zoneinfo, passes, t0, t1)
    if evicted is not None:
        s.evicted_pages = int(len(evicted))
        s.evicted_before_read_pages = int(evicted["evicted_before_read"].sum())
    advances = _advance_figures(s, gens, per_epoch, t0, t1)
    return Bites(s, passes, gens, life, cycles, advances)


def _advance_figures(s: BiteSummary, gens: pd.DataFrame, per_epoch: pd.DataFrame | None,
                     t0: float | None, t1: float | None) -> pd.DataFrame:
    """M2's figures into ``s`` (re-reads after min_seq and max_seq advances against the other
    iterations of the window); the advances with their re-reads."""
    if per_epoch is None or gens.empty:
        return pd.DataFrame(columns=list(ADVANCE_COLUMNS))
    ep = in_window(per_epoch, t0, t1, "start_s")
    out = []
    for seq in ("min_seq", "max_seq"):
        adv, fig = compute_rereads_after_advances(gens, ep, seq)
        if seq == "min_seq":
            s.reread_after_advance_per_iteration = fig["reread_after_per_iteration"]
            s.reread_other_per_iteration, s.reread_burst_ratio = fig["reread_other_per_iteration"], fig["burst"]
        else:
            s.reread_burst_ratio_aging = fig["burst"]
        out.append(adv)
    return pd.concat(out, ignore_index=True) if any(len(a) for a in out) else out[0]
