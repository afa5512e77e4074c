"""Re-read amplification: what the kernel read again, per iteration and per (layer, expert).

Pure functions of a run's tables and meta (:attr:`moetrace.run.handle.Run.meta`); no root,
no kernel. Pages are 4 KiB page-cache pages; ``*_pages`` columns count them.

* :func:`compute_amplification_experts` — per expert: requested, hit, added (missed),
  evicted, re-added pages over the recording (warm-up + measured) and in the measured
  phase alone, device bytes (block probe, through FIEMAP extents), the simulated LRU miss
  demand at the run's capacity for the same accesses, and amplification = device bytes /
  miss demand.
* :func:`compute_amplification_iterations` — per replay iteration (epoch): pages added,
  evicted, re-added, re-reads within the iteration, simulated misses, duration.
* :func:`compute_layers` — the expert table summed per layer.
* :func:`compute_reconciliation` — the run's totals against its own /proc deltas.

Re-reads within one iteration (a page read, evicted and read again before the iteration
ended) are counted exactly, per page, from ``page_events`` when the run streamed them
(:func:`moetrace.analyses.page_events.count_epoch_rereads`, streaming); otherwise from
the per-iteration epoch counters as a lower bound: an expert whose pages were added more
than ``pages_per_expert`` times in one epoch had at least the excess re-read within it
(``in_iteration_re_added_pages_min``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

PAGE = 4096
I64 = "Int64"


def _experts(tables: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    ex = tables["experts"]
    return ex[ex["kind"] == "expert"].sort_values("expert_id").reset_index(drop=True)


def run_geometry(meta: Mapping[str, Any]) -> tuple[int, int, int]:
    """(n_layers, n_experts, pages_per_expert) from the manifest's pool / plan."""
    pool = meta.get("pool") or {}
    g = pool.get("geometry") or {}
    plan = meta.get("plan") or {}
    n_layers = int(g.get("n_layers") or plan.get("n_layers"))
    n_experts = int(g.get("n_experts") or plan.get("n_experts"))
    ppe = pool.get("pages_per_expert")
    if ppe is None:
        ppe = -(-int(g.get("expert_bytes") or plan.get("expert_bytes")) // PAGE)
    return n_layers, n_experts, int(ppe)


def capacity_bytes(meta: Mapping[str, Any]) -> int | None:
    cell = meta.get("cell") or {}
    c = cell.get("capacity_bytes")
    return int(c) if c is not None else None


def run_phases(meta: Mapping[str, Any]) -> tuple[int, int]:
    """(warm-up passes, measured passes) of the replay (1, 1 when unknown)."""
    rep = meta.get("replay") or {}
    cell = (meta.get("cell") or {}).get("inputs") or {}
    warm = rep.get("warmup", cell.get("warmup", 1))
    passes = rep.get("passes", cell.get("passes", 1))
    return int(warm or 0), int(passes or 1)


# -- the simulated miss demand, per access ---------------------------------------------------------

def simulated_misses(plan: str | Path, capacity: int, extent_bytes: int, warmup: int, passes: int
                     ) -> dict[str, np.ndarray]:
    """Global LRU over warm-up + measured repetitions of the plan, at ``capacity //
    extent_bytes`` experts (the cell's own simulation, moetrace.capacity.cell.miss_curve),
    per access: ``expert_id``, ``iteration`` (0-based over all repetitions), ``miss`` (bool),
    ``measured`` (bool: past the warm-up repetitions), plus ``budget_experts``."""
    from moetrace.analyses.stackdist import repeated_accesses, stack_distances
    from moetrace.inputs.plan import read_accesses

    acc = read_accesses(plan)
    n = int(acc.n_iterations)
    rep = repeated_accesses(acc, warmup + passes)
    d = stack_distances(rep, "global")
    budget = int(capacity // extent_bytes)
    return {"expert_id": rep.expert_id.astype(np.int64), "iteration": rep.iteration.astype(np.int64),
            "miss": (d == 0) | (d > budget), "measured": rep.iteration >= warmup * n,
            "budget_experts": np.int64(budget), "n_iterations": np.int64(n)}


def _sim_for(tables, meta, sim: Mapping[str, np.ndarray] | None, plan: str | Path | None):
    if sim is not None:
        return sim
    cap = capacity_bytes(meta)
    if plan is None or cap is None:
        return None
    pool = meta.get("pool") or {}
    warm, passes = run_phases(meta)
    return simulated_misses(plan, cap, int(pool.get("extent_bytes") or pool["geometry"]["expert_bytes"]),
                            warm, passes)


# -- per expert ----------------------------------------------------------------------------------

def measured_epochs(tables: Mapping[str, pd.DataFrame]) -> pd.DataFrame | None:
    """expert_epochs rows of the measured phase (None without per-iteration epochs)."""
    if "expert_epochs" not in tables or "epochs" not in tables:
        return None
    ep = tables["epochs"]
    ids = ep.loc[ep["phase"] == "measured", "epoch"]
    ee = tables["expert_epochs"]
    return ee[ee["epoch"].isin(ids) & (ee["kind"] == "expert")]


def compute_amplification_experts(tables: Mapping[str, pd.DataFrame], meta: Mapping[str, Any], *,
                                  sim: Mapping[str, np.ndarray] | None = None,
                                  plan: str | Path | None = None) -> pd.DataFrame:
    """One row per (layer, expert) of the pool.

    Recording totals (warm-up + measured): ``requested_pages``, ``hit_pages``,
    ``added_pages``, ``evicted_pages``, ``re_added_pages``, ``device_read_bytes``;
    ``sim_accesses`` / ``sim_miss_pages`` (LRU at the run's capacity over the same
    accesses, NA without a plan or capacity); ``amplification`` = device_read_bytes /
    (sim_miss_pages x 4096) (NA where the simulation misses nothing);
    ``observed_hit_rate`` = hit/requested pages, ``sim_hit_rate``.
    Measured phase (per-iteration epochs; NA without them): ``measured_added_pages``,
    ``measured_re_added_pages``, ``measured_sim_miss_pages``, ``measured_amplification``
    (added / simulated miss pages)."""
    n_layers, n_experts, ppe = run_geometry(meta)
    e = _experts(tables)
    out = pd.DataFrame({"layer": e["layer"].astype("int32"), "expert": e["expert"].astype("int32"),
                        "expert_id": e["expert_id"].astype("int64")})
    for c in ("requested_pages", "hit_pages", "added_pages", "evicted_pages", "re_added_pages",
              "device_read_bytes"):
        out[c] = e[c].astype(I64) if c in e else pd.array([pd.NA] * len(e), dtype=I64)
    n_total = n_layers * n_experts
    s = _sim_for(tables, meta, sim, plan)
    ids = out["expert_id"].to_numpy()
    if s is not None:
        acc = np.bincount(s["expert_id"], minlength=n_total)
        miss = np.bincount(s["expert_id"], weights=s["miss"], minlength=n_total).astype(np.int64)
        mm = np.bincount(s["expert_id"], weights=s["miss"] & s["measured"], minlength=n_total).astype(np.int64)
        out["sim_accesses"] = pd.array(acc[ids], dtype=I64)
        out["sim_miss_pages"] = pd.array(miss[ids] * ppe, dtype=I64)
        out["measured_sim_miss_pages"] = pd.array(mm[ids] * ppe, dtype=I64)
    else:
        for c in ("sim_accesses", "sim_miss_pages", "measured_sim_miss_pages"):
            out[c] = pd.array([pd.NA] * len(out), dtype=I64)
    den = out["sim_miss_pages"].astype("Float64") * PAGE
    out["amplification"] = (out["device_read_bytes"].astype("Float64") / den.where(den > 0)).astype("Float64")
    req = out["requested_pages"].astype("Float64")
    out["observed_hit_rate"] = (out["hit_pages"].astype("Float64") / req.where(req > 0)).astype("Float64")
    sa = out["sim_accesses"].astype("Float64")
    out["sim_hit_rate"] = (1 - out["sim_miss_pages"].astype("Float64") / (sa * ppe).where(sa > 0)).astype("Float64")
    me = measured_epochs(tables)
    if me is not None:
        g = me.groupby("expert_id")[["added_pages", "re_added_pages"]].sum()
        for c in ("added_pages", "re_added_pages"):
            out[f"measured_{c}"] = pd.array(g[c].reindex(ids, fill_value=0).to_numpy(np.int64), dtype=I64)
    else:
        for c in ("added_pages", "re_added_pages"):
            out[f"measured_{c}"] = pd.array([pd.NA] * len(out), dtype=I64)
    den = out["measured_sim_miss_pages"].astype("Float64")
    out["measured_amplification"] = (out["measured_added_pages"].astype("Float64") / den.where(den > 0)
                                     ).astype("Float64")
    return out


def top_experts(df: pd.DataFrame, column: str = "re_added_pages", n: int = 10) -> pd.DataFrame:
    """The ``n`` experts carrying most of ``column``, with their share of its total."""
    tot = df[column].astype("Float64").sum()
    top = df.sort_values([column, "expert_id"], ascending=[False, True]).head(n).copy()
    top[f"{column}_share"] = (top[column].astype("Float64") / tot) if tot else pd.NA
    return top.reset_index(drop=True)


def compute_layers(experts: pd.DataFrame) -> pd.DataFrame:
    """The per-expert amplification table summed per layer (rates recomputed from sums)."""
    cols = [c for c in ("requested_pages", "hit_pages", "added_pages", "evicted_pages", "re_added_pages",
                        "device_read_bytes", "sim_miss_pages", "measured_added_pages", "measured_re_added_pages",
                        "measured_sim_miss_pages") if c in experts]
    g = experts.groupby("layer")[cols].sum(min_count=1).reset_index()
    den = g["sim_miss_pages"].astype("Float64") * PAGE
    g["amplification"] = (g["device_read_bytes"].astype("Float64") / den.where(den > 0)).astype("Float64")
    tot = g["re_added_pages"].astype("Float64").sum()
    g["re_added_share"] = (g["re_added_pages"].astype("Float64") / tot) if tot else pd.NA
    return g


# -- per iteration -------------------------------------------------------------------------------

def compute_amplification_iterations(tables: Mapping[str, pd.DataFrame], meta: Mapping[str, Any], *,
                                     sim: Mapping[str, np.ndarray] | None = None,
                                     plan: str | Path | None = None) -> pd.DataFrame:
    """One row per replay iteration epoch (warm-up and measured): ``epoch``, ``phase``,
    ``repeat``, ``iteration``, ``duration_ns`` (the replay's log), ``requested_pages``
    (the log's bytes / 4 KiB), ``added_pages``, ``evicted_pages``, ``re_added_pages``,
    ``in_iteration_re_added_pages_min`` (lower bound, see module doc) or
    ``in_iteration_re_added_pages`` (exact, from page_events), ``sim_miss_pages``.
    Empty without per-iteration epochs."""
    if "epochs" not in tables or "expert_epochs" not in tables:
        return pd.DataFrame()
    _n_layers, _n_experts, ppe = run_geometry(meta)
    ep = tables["epochs"]
    ep = ep[ep["phase"].isin(["warmup", "measured"])].copy()
    ee = tables["expert_epochs"]
    ee = ee[ee["kind"] == "expert"]
    g = ee.groupby("epoch")[["added_pages", "evicted_pages", "re_added_pages"]].sum()
    excess = (ee["added_pages"].astype("int64") - ppe).clip(lower=0)
    lb = excess.groupby(ee["epoch"]).sum()
    out = ep[["epoch", "phase", "repeat", "iteration"]].reset_index(drop=True)
    for c in ("added_pages", "evicted_pages", "re_added_pages"):
        out[c] = pd.array(g[c].reindex(out["epoch"], fill_value=0).to_numpy(np.int64), dtype=I64)
    if "page_events" in tables:
        from moetrace.analyses.page_events import count_epoch_rereads

        n_layers, n_experts, _ = run_geometry(meta)
        # streamed from the Parquet file when the tables know it (bounded memory), else the frame
        src = tables.path("page_events") if hasattr(tables, "path") else tables["page_events"]
        rr = count_epoch_rereads(src, n_layers * n_experts, ppe, tables["epochs"])
        per = rr.groupby("epoch")["reread_pages"].sum()
        out["in_iteration_re_added_pages"] = pd.array(
            per.reindex(out["epoch"].astype("int64"), fill_value=0).to_numpy(np.int64), dtype=I64)
    else:
        out["in_iteration_re_added_pages_min"] = pd.array(lb.reindex(out["epoch"], fill_value=0).to_numpy(np.int64),
                                                          dtype=I64)
    it = tables.get("iterations")
    if it is not None and len(it):
        key = ["phase", "repeat", "iteration"]
        j = out[key].astype({"repeat": "int64", "iteration": "int64"}).merge(
            it.assign(repeat=it["repeat"].astype("int64"), iteration=it["iteration"].astype("int64"))[
                key + ["duration_ns", "bytes"]], on=key, how="left")
        out["duration_ns"] = pd.array(j["duration_ns"], dtype=I64)
        out["requested_pages"] = pd.array((j["bytes"] // PAGE), dtype=I64)
    else:
        out["duration_ns"] = out["requested_pages"] = pd.array([pd.NA] * len(out), dtype=I64)
    s = _sim_for(tables, meta, sim, plan)
    if s is not None:
        warm, _passes = run_phases(meta)
        n = int(s["n_iterations"])
        per = np.bincount(s["iteration"], weights=s["miss"], minlength=n * (warm + _passes)).astype(np.int64)
        # the epoch's (phase, repeat, iteration) -> repetition index in the simulated stream
        rep_idx = np.where(out["phase"] == "measured", warm + out["repeat"].astype("int64"),
                           out["repeat"].astype("int64"))
        pos = rep_idx * n + out["iteration"].astype("int64").to_numpy()
        ok = (pos >= 0) & (pos < per.size)
        out["sim_miss_pages"] = pd.array(np.where(ok, per[np.clip(pos, 0, per.size - 1)] * ppe, 0), dtype=I64)
        out.loc[~ok, "sim_miss_pages"] = pd.NA
    else:
        out["sim_miss_pages"] = pd.array([pd.NA] * len(out), dtype=I64)
    return out


# -- reconciliation against the run's own /proc deltas ---------------------------------------------

def _vm_delta(snaps: Mapping[str, Any], key: str) -> int | None:
    try:
        return int(snaps["post"]["vmstat"][key]) - int(snaps["pre"]["vmstat"][key])
    except (KeyError, TypeError, ValueError):
        return None


def compute_reconciliation(tables: Mapping[str, pd.DataFrame], meta: Mapping[str, Any]) -> pd.DataFrame:
    """Each total moetrace attributes, beside the kernel's own figure over the same window:
    ``quantity``, ``moetrace``, ``kernel``, ``kernel_source``, ``difference``, ``equal``.

    * device bytes: experts + unattributed (block probe) vs /proc/diskstats of the pool's
      disk over the probe's window;
    * device bytes the block probe saw that no page-cache add on the pool's filesystem
      explains (metadata read through the block device's own page cache);
    * measured device bytes: pages the pagecache probe saw added in the measured epochs x
      4 KiB (experts alone, then every file of the pool's device: under a tight wall the
      replay's own libraries are evicted and read again too) vs the cell's diskstats delta
      over the measured window (cells only);
    * measured re-reads: pages re-added in the measured epochs vs the cell's
      workingset_refault_file delta (the kernel undercounts when it reclaimed shadow
      nodes: the cell says so in its notes);
    * reclaim: pages the reclaim probe saw reclaimed vs /proc/vmstat pgsteal_* delta."""
    rows = []
    cell = meta.get("cell") or {}
    snaps = meta.get("snapshots") or {}
    bd = tables.get("block_device")
    if bd is not None and len(bd):
        ex = tables["experts"]
        dev = ex["device_read_bytes"].astype("Int64").sum()
        rows.append(("device bytes, whole recording (experts + unattributed)", int(dev),
                     _int(bd["diskstats_read_bytes"].sum(min_count=1)), "/proc/diskstats (pool disk, probe window)"))
    if bd is not None and len(bd):
        # what the block probe read that no page-cache add on the pool's filesystem explains:
        # metadata read through the block device's own page cache (another s_dev) and O_DIRECT
        # reads (the pinned arena's preload), less the pages a write added without a read
        added_all = int(tables["experts"]["added_pages"].astype("Int64").sum()) * PAGE
        rows.append(("device bytes read without a page-cache add on the pool's filesystem (metadata, O_DIRECT), "
                     "less pages added without a read (files written)",
                     int(dev) - added_all, None, "block probe total - pages added on the pool's device x 4 KiB"))
    me = measured_epochs(tables)
    if me is not None and cell.get("device_bytes") is not None:
        ee, ep = tables["expert_epochs"], tables["epochs"]
        ids = ep.loc[ep["phase"] == "measured", "epoch"]
        all_meas = int(ee.loc[ee["epoch"].isin(ids), "added_pages"].sum())
        rows.append(("device bytes, measured pass: expert pages added x 4 KiB", int(me["added_pages"].sum()) * PAGE,
                     int(cell["device_bytes"]), "/proc/diskstats (measured window, cell.json)"))
        rows.append(("device bytes, measured pass: every page added on the pool's device x 4 KiB "
                     "(experts + the replay's other files)", all_meas * PAGE, int(cell["device_bytes"]),
                     "/proc/diskstats (measured window, cell.json)"))
    if me is not None and cell.get("refault_file_pages") is not None:
        rows.append(("re-reads, measured pass (pages re-added)", int(me["re_added_pages"].sum()),
                     int(cell["refault_file_pages"]), "/proc/vmstat workingset_refault_file (measured window)"))
    rc = tables.get("reclaim")
    if rc is not None and len(rc):
        # /proc/vmstat's pgsteal_kswapd / pgsteal_direct count global reclaim only: a memcg's
        # limit reclaim counts in its own memory.stat (mm/vmscan.c: "if (!cgroup_reclaim(sc))")
        steal = [_vm_delta(snaps, k) for k in ("pgsteal_kswapd", "pgsteal_direct")]
        kernel = sum(v for v in steal if v is not None) if any(v is not None for v in steal) else None
        glob = rc[rc["kind"].isin(["kswapd", "direct"])]
        rows.append(("pages reclaimed by kswapd and direct reclaim (reclaim probe)", int(glob["reclaimed_pages"].sum()),
                     kernel, "/proc/vmstat pgsteal_kswapd + pgsteal_direct (recording window, every task)"))
    df = pd.DataFrame(rows, columns=["quantity", "moetrace", "kernel", "kernel_source"])
    df["moetrace"] = pd.array(df["moetrace"], dtype=I64)
    df["kernel"] = pd.array(df["kernel"], dtype=I64)
    df["difference"] = df["moetrace"] - df["kernel"]
    df["equal"] = (df["difference"] == 0).astype("boolean")
    return df


def _int(v) -> int | None:
    return None if v is None or pd.isna(v) else int(v)
