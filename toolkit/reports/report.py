"""`moetrace report`: one self-contained HTML page, its Markdown twin, and every table as
Parquet and JSON, for a run, a cell or a sweep.

Layout of ``--out`` (default ``<input>/report``)::

    report.html          every figure embedded (PNG data URIs, inline flame SVG): opens offline
    REPORT.md            the same findings in Markdown (figures as figures/*.png)
    report.json          the headline figures and the list of tables
    tables/NAME.parquet  each analysis table (NA kept), and tables/NAME.json (records)
    figures/NAME.png     each figure
    flame.svg            interactive flame graph of the sampled stacks (hover, click to zoom, search)
    flame.speedscope.json  the same stacks for speedscope
    timeline.json        Chrome trace-event JSON: open in ui.perfetto.dev

Sections (``sections``): amp, hitpath, age, reclaim, flame, timeline. Every number comes
from a ``compute_*`` function of moetrace.analyses; this module only arranges them.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moetrace.errors import UsageError
from moetrace.reports.document import (TOP_N, Report, fmt_bytes, fmt_num, fmt_pct, is_na, prepare_out, staged,
                                       table_json, write_report)
from moetrace.reports.findings import run_findings

SECTIONS = ("amp", "hitpath", "age", "reclaim", "flame", "timeline")


# -- sections of a run ---------------------------------------------------------------------------

def _geometry(run) -> tuple[int, int]:
    from moetrace.analyses.amplification import run_geometry

    n_layers, n_experts, _ = run_geometry(run.meta)
    return n_layers, n_experts


def _sim(run, plan: Path | None, notes: list[str]):
    from moetrace.analyses import amplification as A

    plan = plan or run.plan_path()
    cap = A.capacity_bytes(run.meta)
    if plan is None:
        notes.append("the plan the replay ran was not found: simulated miss demand per expert is NA "
                     "(give --plan)")
        return None
    if cap is None:
        notes.append("not a capacity cell: no capacity to simulate the miss demand at (per-expert "
                     "amplification is NA)")
        return None
    pool = run.manifest.get("pool") or {}
    warm, passes = A.run_phases(run.meta)
    return A.simulated_misses(plan, cap, int(pool.get("extent_bytes") or pool["geometry"]["expert_bytes"]),
                              warm, passes)


def section_amp(rep: Report, run, sim, it: pd.DataFrame) -> None:
    """Re-read amplification: the figures of the measured pass against the kernel's counters, the
    per-iteration and per-expert picture, observed vs simulated, the paper's alarm."""
    from moetrace.analyses import amplification as A

    rep.h(2, "Re-read amplification", "amp")
    ex = A.compute_amplification_experts(run.tables, run.meta, sim=sim)
    _amp_summary(rep, run, ex, it)
    rec = A.compute_reconciliation(run.tables, run.meta)
    rep.table("reconciliation", rec, "Totals against the kernel's own counters: moetrace's and the /proc deltas "
              "of the same window", None, fold=True)
    rep.summary["reconciliation"] = json.loads(table_json(rec))
    _amp_figures(rep, run, ex, it, sim is not None)
    _amp_alarm(rep, run)


def _amp_summary(rep: Report, run, ex: pd.DataFrame, it: pd.DataFrame) -> None:
    cell = run.cell or {}
    meas_added = ex["measured_added_pages"].sum(min_count=1)
    meas_sim = ex["measured_sim_miss_pages"].sum(min_count=1)
    lb_col = "in_iteration_re_added_pages" if "in_iteration_re_added_pages" in it else "in_iteration_re_added_pages_min"
    in_it = int(it.loc[it["phase"] == "measured", lb_col].sum()) if len(it) else None
    stream = ((run.manifest.get("lost") or {}).get("pagecache") or {}).get("stream") or {}
    lost = int(stream.get("lost_kernel") or 0) + int(stream.get("lost_user") or 0)
    exact = lb_col == "in_iteration_re_added_pages" and lost == 0
    if lb_col == "in_iteration_re_added_pages" and lost:
        # a counted re-read needs its add, delete and add all seen: a lost event can only hide one
        rep.notes.append(f"the page stream lost {lost:,} of {int(stream.get('records') or 0) + lost:,} events: "
                         "re-reads within one iteration are a lower bound")
    rows = [("capacity C", fmt_bytes(cell.get("capacity_bytes")) if cell else "NA (not a cell)"),
            ("device bytes, measured pass (diskstats)", fmt_bytes(cell.get("device_bytes"))),
            ("pages added in the measured pass (pagecache probe)", fmt_num(meas_added)),
            ("simulated LRU miss pages, measured pass", fmt_num(meas_sim)),
            ("amplification (cell: device / miss demand)", fmt_num(cell.get("amplification"))),
            ("pages re-added in the measured pass (re-reads)", fmt_num(ex["measured_re_added_pages"].sum(min_count=1))),
            ("re-reads within one iteration" + (" (exact)" if exact else " (at least: the stream lost events)"
                                                if lb_col == "in_iteration_re_added_pages" else " (at least)"),
             fmt_num(in_it)),
            ("kernel's workingset_refault_file, measured window", fmt_num(cell.get("refault_file_pages")))]
    rep.kv(rows, name="amp_summary")
    rep.summary.update({"capacity_bytes": cell.get("capacity_bytes"), "device_bytes": cell.get("device_bytes"),
                        "amplification": cell.get("amplification"),
                        "measured_added_pages": _int(meas_added), "measured_sim_miss_pages": _int(meas_sim),
                        "measured_re_added_pages": _int(ex["measured_re_added_pages"].sum(min_count=1)),
                        "in_iteration_re_added_pages": in_it, "in_iteration_exact": exact,
                        "re_added_pages": _int(ex["re_added_pages"].sum(min_count=1))})


def _amp_figures(rep: Report, run, ex: pd.DataFrame, it: pd.DataFrame, has_sim: bool) -> None:
    """Per iteration and observed vs simulated side by side, the layers x experts heatmaps, the
    experts and layers carrying the re-reads."""
    from moetrace.analyses import amplification as A
    from moetrace.reports import figures as F

    n_layers, n_experts = _geometry(run)
    if len(it):
        fig, ax = F.new_figure()
        F.plot_iterations(it, ax)
        rep.figure("iterations", F.png_bytes(fig), "Pages added and re-added per replay iteration, against the "
                                                   "simulated LRU misses at this capacity")
    fig, ax = F.new_figure(5, 4.2)
    F.plot_observed_vs_sim(ex, ax)
    rep.figure("observed_vs_sim", F.png_bytes(fig), "Per expert: observed page hit rate vs simulated LRU "
                                                    "hit rate at the same capacity (recording: warm-up + measured)")
    if len(it):
        rep.table("amp_iterations", it, "Per replay iteration", max_rows=None if len(it) <= 40 else 40, fold=True)
    fig, axes = F.new_figure(11, 4, ncols=2)
    F.plot_heatmap(ex, "re_added_pages", n_layers, n_experts, axes[0], title="pages re-added (re-reads)",
                   unit="pages", cmap="magma")
    F.plot_heatmap(ex, "amplification", n_layers, n_experts, axes[1],
                   title="amplification (device bytes / simulated miss bytes)", cmap="coolwarm")
    rep.figure("heatmap_amp", F.png_bytes(fig), "Layers x experts: re-reads and amplification", wide=True)
    cols = ["layer", "expert", "re_added_pages", "re_added_pages_share", "added_pages", "requested_pages",
            "device_read_bytes", "sim_miss_pages", "amplification", "observed_hit_rate", "sim_hit_rate"]
    top = A.top_experts(ex, "re_added_pages", TOP_N)
    rep.table("amp_experts", ex, "The experts carrying most re-reads (all experts in the table file)",
              show=top[[c for c in cols if c in top]])
    lay = A.compute_layers(ex)
    rep.table("amp_layers", lay, "Layers by share of the re-reads",
              show=lay.sort_values("re_added_pages", ascending=False), fold=True)
    _observed_vs_sim(rep, run, ex, lay, has_sim)


def _observed_vs_sim(rep: Report, run, ex: pd.DataFrame, lay: pd.DataFrame, has_sim: bool) -> None:
    ovs = lay[["layer"]].copy()
    g = ex.groupby("layer")
    ovs["requested_pages"] = g["requested_pages"].sum().to_numpy()
    ovs["hit_pages"] = g["hit_pages"].sum().to_numpy()
    ovs["observed_hit_rate"] = ovs["hit_pages"].astype("Float64") / ovs["requested_pages"].astype("Float64")
    acc = g["sim_accesses"].sum(min_count=1)
    miss = g["sim_miss_pages"].sum(min_count=1)
    ppe = (run.manifest.get("pool") or {}).get("pages_per_expert") or 1
    ovs["sim_hit_rate"] = (1 - miss.astype("Float64") / (acc.astype("Float64") * ppe)).to_numpy()
    ovs["difference"] = ovs["observed_hit_rate"] - ovs["sim_hit_rate"]
    rep.table("observed_vs_sim", ovs, "Per layer: observed vs simulated hit rate", max_rows=None
              if len(ovs) <= 30 else 30, fold=True)
    tot_req = ex["requested_pages"].sum(min_count=1)
    rep.summary["observed_hit_rate"] = _ratio(ex["hit_pages"].sum(min_count=1), tot_req)
    rep.summary["sim_hit_rate"] = (None if not has_sim else
                                   1 - _ratio(ex["sim_miss_pages"].sum(min_count=1), acc.sum() * ppe))


def _amp_alarm(rep: Report, run) -> None:
    from moetrace.analyses import reclaim as R

    cell = run.cell or {}
    s2s = R.scan_to_steal(run.tables.get("reclaim")) if "reclaim" in run.tables else None
    alarm = R.compute_alarm(cell.get("amplification"), s2s)
    rep.summary["alarm"] = alarm
    cls = "alarm" if alarm["alarm"] else "ok"
    verdict = ("ALARM: device bytes above miss demand with scan-to-steal above 2" if alarm["alarm"] else
               "unknown (amplification or scan-to-steal missing)" if alarm["alarm"] is None else
               "no alarm")
    rep.html.append(f"<p class='{cls}'>Paper's alarm condition ({html.escape(alarm['rule'])}): "
                    f"{html.escape(verdict)}; amplification {fmt_num(alarm['amplification'])}, "
                    f"scan-to-steal {fmt_num(alarm['scan_to_steal'])}.</p>")
    rep.md.append(f"**Alarm** ({alarm['rule']}): {verdict}; amplification {fmt_num(alarm['amplification'])}, "
                  f"scan-to-steal {fmt_num(alarm['scan_to_steal'])}.\n")


def section_hitpath(rep: Report, run) -> None:
    from moetrace.analyses import hitpath as H
    from moetrace.reports import figures as F

    rep.h(2, "Hit path", "hitpath")
    if "reads" not in run.tables:
        rep.p("The reads probe was not recorded: no per-call classes or latencies.")
        return
    n_layers, n_experts = _geometry(run)
    s = H.compute_hitpath_summary(run.tables["reads"])
    rep.summary["hitpath"] = s
    rep.kv([("read calls (pool)", s["calls"]), ("hit-only calls", s["hit_only_calls"]),
            ("miss calls", s["miss_calls"]), ("hit-only ns per KiB", s["hit_only_ns_per_kib"]),
            ("miss ns per KiB", s["miss_ns_per_kib"])], name="hitpath_summary")
    rep.p("A hit-only call added no page while in flight; a call that waited for a page another thread was "
          "reading also adds none and counts here (its latency is in the tail).")
    if "reads_latency" in run.tables:
        q = H.compute_latency_quantiles(run.tables["reads_latency"])
        rep.table("hitpath_latency", q, "Read-call latency by class (log2 histogram quantiles)", None)
        fig, ax = F.new_figure()
        lat = run.tables["reads_latency"]
        lat = lat[lat["scope"] == "pool"] if (lat["scope"] == "pool").any() else lat
        F.plot_log2_hist(lat, "class", "calls", ax, title="Pool read-call latency", xlabel="ns")
        rep.figure("hitpath_latency", F.png_bytes(fig), "Latency distribution of pool read calls, by class")
    ex = H.compute_hitpath_experts(run.tables["reads"])
    fig, ax = F.new_figure(6.5, 4)
    F.plot_heatmap(ex, "hit_only_ns_per_kib", n_layers, n_experts, ax, title="hit-only ns per KiB",
                   unit="ns/KiB", cmap="viridis")
    rep.figure("heatmap_hitpath", F.png_bytes(fig), "Layers x experts: hit-path cost")
    rep.table("hitpath_experts", ex, "Costliest hit paths (ns per KiB of hit-only calls)",
              show=ex.sort_values("hit_only_ns_per_kib", ascending=False, na_position="last"), fold=True)
    rep.table("hitpath_layers", H.compute_hitpath_layers(run.tables["reads"]), "Per layer", max_rows=None
              if n_layers <= 30 else 30, fold=True)
    if "stacks" in run.tables:
        b = H.compute_stack_breakdown(run.tables["stacks"])
        if len(b):
            fig, ax = F.new_figure(6.5, 3.2)
            F.plot_breakdown(b, ax, title="Where the replay's CPU time goes (sampled kernel stacks)")
            rep.figure("hitpath_stacks", F.png_bytes(fig), "Sampled time by kernel path, replay threads")
            rep.table("hitpath_stacks", b, "Sampled time by the deepest recognised kernel frame", None, fold=True)


def _mglru_state(mg) -> str:
    """The record manifest's ``mglru`` (on, enabled_raw) in words."""
    if not isinstance(mg, dict) or not mg:
        return "not built (no /sys/kernel/mm/lru_gen)" if mg in (None, {}, False) else str(mg)
    on = mg.get("on")
    raw = mg.get("enabled_raw")
    word = "on" if on else ("off" if on is False else "unknown")
    return f"{word} (enabled {raw})" if raw else word


def section_age(rep: Report, run) -> None:
    from moetrace.analyses import age as G
    from moetrace.reports import figures as F

    rep.h(2, "Generation age", "age")
    mg = run.manifest.get("mglru") or {}
    rep.summary["mglru_state"] = _mglru_state(mg)
    rep.p(f"MGLRU on this kernel: {_mglru_state(mg)}.")
    n_layers, n_experts = _geometry(run)
    if "lru" in run.tables:
        d = G.compute_lru_dwell_experts(run.tables["lru"])
        rep.h(3, "Classic LRU: dwell before eviction")
        if "lru_dwell_histogram" in run.tables:
            q = G.compute_dwell_quantiles(run.tables["lru_dwell_histogram"])
            rep.table("age_dwell_quantiles", q, "Dwell quantiles (log2 histogram)", None)
            rep.summary["dwell_quantiles"] = json.loads(table_json(q))
            fig, ax = F.new_figure()
            F.plot_log2_hist(run.tables["lru_dwell_histogram"], "kind", "pages", ax, title="LRU dwell",
                             xlabel="ns")
            rep.figure("age_dwell", F.png_bytes(fig), "Insertion-to-eviction and insertion-to-activation dwell")
        fig, ax = F.new_figure(6.5, 4)
        d2 = d.assign(dwell_ms=d["dwell_ns_mean"].astype("Float64") / 1e6)
        F.plot_heatmap(d2, "dwell_ms", n_layers, n_experts, ax, title="mean age at eviction (ms)", unit="ms",
                       cmap="cividis")
        rep.figure("heatmap_age", F.png_bytes(fig), "Layers x experts: mean insertion-to-eviction dwell")
        rep.table("age_experts", d, "Youngest at eviction (mean dwell)",
                  show=d.sort_values("dwell_ns_mean", na_position="last"), fold=True)
    else:
        rep.p("The lru probe was not recorded.")
    if "lru_gen" in run.tables and len(run.tables["lru_gen"]):
        lg = run.tables["lru_gen"]
        rep.h(3, "MGLRU generations")
        gens = G.compute_generations(lg)
        fig, ax = F.new_figure()
        F.plot_generations(gens, ax)
        rep.figure("age_generations", F.png_bytes(fig), "Age of the oldest generation over time")
        cad = G.compute_aging_cadence(lg, run.tables.get("mglru_aging"))
        rep.table("age_cadence", cad, "Aging cadence per memcg and node", None, fold=True)
        rep.table("age_generations", gens, "Generations per sample", 20, fold=True)
        ev = G.compute_age_at_eviction(lg)
        rep.table("age_at_eviction", ev, "Generations evicted between samples, with their age", 20, fold=True)
        rep.summary["mglru"] = {"samples": int(lg["sample"].nunique()), "cadence": json.loads(table_json(cad))}
        evs = run.tables.get("mglru_evictions")
        if evs is not None and len(evs):
            ages = G.compute_eviction_ages(evs, lg, run.tables.get("mglru_aging"))
            per = G.compute_eviction_age_experts(ages)
            rep.h(3, "Age of the generation each expert page was evicted from")
            rep.p("One record per evicted pool folio (the mglru probe's workingset_eviction kprobe): its "
                  "memcg's min_seq at eviction, the generation the kernel's shadow entry records, and that "
                  "generation's age then (birth from the lru_gen samples, else from the aging events).")
            fig, ax = F.new_figure(6.5, 4)
            F.plot_heatmap(per, "age_ms_median", n_layers, n_experts, ax,
                           title="median age of the evicted generation (ms)", unit="ms", cmap="cividis")
            rep.figure("heatmap_eviction_age", F.png_bytes(fig), "Layers x experts: median age of the generation "
                       "a page was evicted from")
            rep.table("age_eviction_experts", per, "Youngest evicted generations (median age)",
                      show=per.sort_values("age_ms_median", na_position="last"), fold=True)
            known = ages["age_ms"].dropna()
            rep.summary["mglru"]["evictions"] = {
                "folios": int(len(ages)), "birth_known": int(len(known)),
                "age_ms_median": float(known.median()) if len(known) else None,
                "age_ms_p90": float(known.quantile(0.9)) if len(known) else None}
            section_eviction_reuse(rep, run, evs, lg)
    else:
        rep.p("No lru_gen samples (not an MGLRU kernel, or the mglru probe was not recorded): generation "
              "ages come from the kernel lab's runs.")
    lf = G.locked_fraction(run.tables.get("mlock_timeline"), run.meta)
    if len(lf):
        rep.table("age_locked_fraction", lf, "Locked bytes over time (fraction of C)", 20, fold=True)


def section_eviction_reuse(rep: Report, run, evs: pd.DataFrame, lru_gen: pd.DataFrame) -> None:
    """Why evicted pages were read again (analyses.eviction_reuse), for a cell: its replay log, its
    plan and the LRU budget it was scored against; measured iterations only."""
    from moetrace.analyses import eviction_reuse as ER
    from moetrace.inputs.plan import read_accesses
    from moetrace.reports import figures as F

    it = run.tables.get("iterations")
    plan = run.plan_path()
    budget = ((run.cell or {}).get("simulated") or {}).get("budget_experts")
    rep.h(3, "Why evicted pages were read again")
    if it is None or plan is None or budget is None:
        rep.p("Needs a cell's replay log, its plan and the LRU budget it was scored against (a recorded "
              "`moetrace cell`).")
        return
    acc = read_accesses(plan)
    reuse = ER.compute_eviction_reuse_generations(evs, it, acc, int(budget), lru_gen)
    measured = set(np.flatnonzero((it["phase"] == "measured").to_numpy()))
    reuse = reuse[reuse["evict_iteration"].isin(measured)]
    s = ER.summarize_eviction_reuse(reuse)
    rep.summary["eviction_reuse"] = s
    if not s.get("reread_pages"):
        rep.p(f"{s.get('evicted_pages', 0)} pool pages evicted in the measured iterations; none read again.")
        return

    def pct(v):
        return "-" if v is None else f"{100 * v:.0f} %"

    rep.p(f"In the measured iterations the kernel evicted {s['evicted_pages']} pool pages; {s['reread_pages']} "
          f"were read again later. {pct(s['excess_share_of_rereads'])} of those re-reads were of pages a global "
          f"LRU of {budget} experts (C) would still have held: traffic beyond miss demand. "
          f"{pct(s['rereads_evicted_within_one_iteration_share'])} were evicted within one iteration of their "
          f"last access (median {fmt_num(s['reread_iterations_since_access_median'])} iterations after it); "
          f"{pct(s.get('evicted_from_oldest_share'))} of the evictions came from the oldest generation holding "
          f"file pages.")
    per = reuse.assign(reread=reuse["pages"].where(reuse["next_access"].notna(), 0),
                       excess=reuse["pages"].where(reuse["lru_keeps"].fillna(False).astype(bool), 0))
    per = per.groupby("expert_id").agg(evicted_pages=("pages", "sum"), reread_pages=("reread", "sum"),
                                       excess_pages=("excess", "sum"),
                                       iterations_since_access_median=("iterations_since_access", "median"))
    per = per.reset_index()
    per["layer"], per["expert"] = per["expert_id"] // acc.n_experts, per["expert_id"] % acc.n_experts
    per["excess_share"] = per["excess_pages"] / per["reread_pages"].where(per["reread_pages"] > 0)
    n_layers, n_experts = _geometry(run)
    fig, ax = F.new_figure(6.5, 4)
    F.plot_heatmap(per, "excess_pages", n_layers, n_experts, ax, title="re-read pages LRU(C) would have kept",
                   unit="pages", cmap="magma")
    rep.figure("heatmap_excess_rereads", F.png_bytes(fig), "Layers x experts: re-reads beyond miss demand")
    rep.table("age_eviction_reuse_experts", per, "Experts with the most re-reads beyond miss demand",
              show=per.sort_values("excess_pages", ascending=False), fold=True)


def section_reclaim(rep: Report, run, it: pd.DataFrame | None) -> None:
    from moetrace.analyses import reclaim as R
    from moetrace.reports import figures as F

    rep.h(2, "Reclaim", "reclaim")
    if "reclaim" in run.tables:
        k = R.compute_reclaim_kinds(run.tables["reclaim"])
        rep.table("reclaim_kinds", k, "Who reclaimed, and how hard it scanned", None)
        rep.summary["scan_to_steal"] = R.scan_to_steal(run.tables["reclaim"])
    else:
        rep.p("The reclaim probe was not recorded.")
    tl = R.compute_reclaim_timeline(run.tables["reclaim_timeline"] if "reclaim_timeline" in run.tables else None,
                                    run.meta)
    psi = R.compute_psi(run.snapshots)
    if len(psi):
        rep.table("reclaim_psi", psi, "Pressure stall (PSI) over the recording", None)
        m = psi[(psi["resource"] == "memory") & (psi["level"] == "some")]
        share = m["stall_share"].iloc[0] if len(m) else None
        rep.summary["psi_memory_some_share"] = None if share is None or pd.isna(share) else float(share)
    w = R.compute_refault_windows(it) if it is not None and len(it) else None
    if len(tl):  # the figures side by side, the tables behind them folded below
        fig, ax = F.new_figure()
        F.plot_reclaim_timeline(tl, ax)
        rep.figure("reclaim_timeline", F.png_bytes(fig), "Pages reclaimed per 100 ms by reclaimer, and "
                                                          "scan-to-steal over time")
    if w is not None:
        fig, ax = F.new_figure()
        F.plot_refaults(w, ax)
        rep.figure("reclaim_refaults", F.png_bytes(fig), "Refault share per iteration")
    if len(tl):
        rep.table("reclaim_timeline", tl, "Reclaim per 100 ms bucket", 20, fold=True)
    if w is not None:
        rep.table("reclaim_refault_windows", w, "Refault windows (one per iteration) and thrash state", 40, fold=True)
        rep.summary["thrash_states"] = {str(k): int(v) for k, v in w["state"].value_counts().items()}


def section_flame(rep: Report, run) -> None:
    from moetrace.reports import flame as FL

    rep.h(2, "Flame graph", "flame")
    if "stacks" not in run.tables or run.tables["stacks"].empty:
        rep.p("The stacks probe was not recorded.")
        return
    stacks = FL.folded_from_table(run.tables["stacks"])
    # instance id "flamegraph", not "flame": that is the section's anchor (ids must be unique)
    svg = FL.flame_svg(stacks, title=f"{run.name}: sampled stacks", instance_id="flamegraph")
    (rep.out / "flame.svg").write_text(svg)
    (rep.out / "flame.speedscope.json").write_text(json.dumps(FL.speedscope_json(stacks, run.name)))
    rep.files.update({"flame_svg": "flame.svg", "speedscope": "flame.speedscope.json"})
    rep.raw_svg(svg, "Sampled stacks of the replay and kswapd: hover for counts, click to zoom, Search to "
                     "highlight", "flame.svg")


def section_timeline(rep: Report, run) -> None:
    from moetrace.analyses.timeline import compute_timeline

    rep.h(2, "Timeline", "timeline")
    doc = compute_timeline(run.tables, run.meta)
    (rep.out / "timeline.json").write_text(json.dumps(doc, separators=(",", ":")))
    rep.files["timeline"] = "timeline.json"
    rep.p(f"timeline.json: {len(doc['traceEvents'])} trace events (iterations as slices, page-cache, mlock and "
          "MGLRU counters). Open it in ui.perfetto.dev or chrome://tracing.")


def _int(v):
    return None if is_na(v) else int(v)


def _ratio(a, b):
    try:
        if a is pd.NA or b is pd.NA or not b:
            return None
        return float(a) / float(b)
    except (TypeError, ValueError):
        return None


def _header(rep: Report, run) -> None:
    """The recording: what was recorded and how (a folded section below the findings), and its
    notices (mounts, degraded probes, lost events)."""
    m = run.manifest
    k = m.get("kernel") or {}
    cell = run.cell or {}
    probes = [p for p, a in (m.get("attach_plan") or {}).items() if isinstance(a, dict) and a.get("recorded")]
    pool = m.get("pool") or {}
    rows = [("run", str(run.path)), ("complete", "yes" if m.get("complete") else "NO (interrupted)"),
            ("kernel", str(k.get("release", k) if isinstance(k, dict) else k)),
            ("probes recorded", ", ".join(probes) or "none"),
            ("pool", f"{pool.get('layout', '?')}, {pool.get('files', '?')} files"
                     + (f", {fmt_bytes(pool.get('data_bytes'))}" if pool.get("data_bytes") else "")),
            ("plan", f"{(m.get('plan') or {}).get('iterations', '?')} iterations")]
    if cell:
        rows += [("capacity", f"{fmt_bytes(cell.get('capacity_bytes'))} ({cell.get('mechanism')}, "
                              f"{cell.get('mode')})"),
                 ("retained", "yes" if cell.get("retained") else f"no: {cell.get('reasons')}")]
    h: list[str] = [f"<p class='cap'>{html.escape(run.name)}</p>"]
    md: list[str] = [f"*{run.name}*\n\n"]
    rep.kv(rows, target=h, md_target=md)
    rep.recording.append(("".join(h), "".join(md)))
    for n in (m.get("notes") or []) + (cell.get("notes") or []):
        rep.notes.append(str(n))


def build_run_report(run, out: str | os.PathLike, *, sections: Iterable[str] = SECTIONS,
                     plan: str | os.PathLike | None = None, title: str | None = None, force: bool = False,
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The report of one run or cell (:func:`moetrace.run.handle.open_run`)."""
    sections = check_sections(sections)
    out = Path(out)
    prepare_out(out, force)
    with staged(out) as stage:
        rep = Report(stage, title or f"moetrace report: {run.name}")
        say = progress or (lambda s: None)
        _header(rep, run)
        wants_sim = ("amp" in sections or "reclaim" in sections) and has_pool(run)
        sim = _sim(run, Path(plan) if plan else None, rep.notes) if wants_sim else None
        run_sections(rep, run, sections, sim, say)
        run_findings(rep, rep.summary)
        rep.summary["kind"] = "cell" if run.cell is not None else "run"
        return write_report(rep, sections, final=out)


def has_pool(run) -> bool:
    """Whether the run knows its pool's geometry (record --pool, or a replay's manifest)."""
    from moetrace.analyses.amplification import run_geometry

    try:
        run_geometry(run.meta)
    except (KeyError, TypeError, ValueError):
        return False
    return "experts" in run.tables


def run_detail(rep: Report, run, sections: tuple[str, ...], say: Callable[[str], None]) -> None:
    """One recorded cell in full inside another report (a matrix's detail cell): its header, the
    simulated miss demand where it has a pool, and its sections."""
    _header(rep, run)
    sim = _sim(run, None, rep.notes) if has_pool(run) else None
    run_sections(rep, run, sections, sim, say)


def run_sections(rep: Report, run, sections, sim, say) -> None:
    from moetrace.analyses import amplification as A

    if not has_pool(run):
        per_expert = [s for s in sections if s in ("amp", "hitpath", "age")]
        if per_expert:
            rep.h(2, "Per-expert sections", per_expert[0])
            rep.p(f"Left out ({', '.join(per_expert)}): this run was recorded without a pool, so nothing is "
                  "attributed to experts (record with --pool DIR, or record a replay).")
        sections = [s for s in sections if s not in per_expert]
        sim = None
    # the per-iteration table serves amp and reclaim: computed once (it streams page_events)
    it = (A.compute_amplification_iterations(run.tables, run.meta, sim=sim)
          if {"amp", "reclaim"} & set(sections) and has_pool(run) else None)
    steps = (("amp", "amplification", lambda: section_amp(rep, run, sim, it)),
             ("hitpath", "hit path", lambda: section_hitpath(rep, run)),
             ("age", "generation age", lambda: section_age(rep, run)),
             ("reclaim", "reclaim", lambda: section_reclaim(rep, run, it)),
             ("flame", "flame graph", lambda: section_flame(rep, run)),
             ("timeline", "timeline", lambda: section_timeline(rep, run)))
    for name, label, build in steps:
        if name in sections:
            say(label)
            build()


def check_sections(sections: Iterable[str]) -> tuple[str, ...]:
    """The report sections asked for, in order, each once (UsageError naming an unknown one)."""
    s = tuple(dict.fromkeys(x.strip() for x in sections if x.strip()))
    bad = [x for x in s if x not in SECTIONS]
    if bad:
        raise UsageError(f"unknown report section(s): {', '.join(bad)}", hint=f"choose from {', '.join(SECTIONS)}")
    return s


# -- a sweep -------------------------------------------------------------------------------------

TABLE2_SHOWN = {"C": "capacity_bytes", "effective C": "effective_capacity_bytes", "LRU hit rate": "lru_hit_rate",
                "iteration": "iteration_ms", "spread": "iteration_spread",
                "device / iteration": "device_mib_per_iteration", "miss / iteration": "miss_mib_per_iteration",
                "amplification": "amplification", "cells": "cells", "retained": "retained"}


def shown_table2(t2: pd.DataFrame) -> pd.DataFrame:
    """Table 2 as the report shows it: capacities and traffic in KiB / MiB / GiB, times in ms,
    rates and spreads in %."""
    from moetrace.reports.document import fmt_ms

    mib = 2 ** 20
    fmt = {"C": fmt_bytes, "effective C": fmt_bytes, "LRU hit rate": fmt_pct, "spread": fmt_pct,
           "iteration": lambda v: fmt_ms(None if is_na(v) else float(v) * 1e6),
           "device / iteration": lambda v: fmt_bytes(None if is_na(v) else float(v) * mib),
           "miss / iteration": lambda v: fmt_bytes(None if is_na(v) else float(v) * mib)}
    shown = {"host": "host", **TABLE2_SHOWN} if "host" in t2 else TABLE2_SHOWN  # cells from several hosts
    fmt["host"] = str
    return pd.DataFrame({label: [fmt.get(label, fmt_num)(v) for v in t2[col].astype(object)]
                         for label, col in shown.items()})


def _with_cell_facts(results: pd.DataFrame, cells: list) -> pd.DataFrame:
    """The results with the effective capacity and the simulated LRU hit rate of each recorded
    cell filled in where the results lack them (sweeps written before they were columns)."""
    from moetrace.capacity.sweep import effective_capacity

    res = results.copy()
    by_name = {c.name: c.cell or {} for c in cells}
    names = [Path(str(d)).name for d in res["cell_dir"]] if "cell_dir" in res else [None] * len(res)
    for col, get in (("effective_capacity_bytes", effective_capacity),
                     ("lru_hit_rate", lambda c: (c.get("simulated") or {}).get("hit_rate"))):
        have = res[col] if col in res else pd.Series([None] * len(res), index=res.index)
        res[col] = [h if not is_na(h) else get(by_name.get(n, {})) for h, n in zip(have, names)]
        res[col] = pd.to_numeric(res[col], errors="coerce").astype("float64")
    return res


def sweep_table2(sweep) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The sweep's Table 2 (analyses.capacity_response.compute_table2) and the cells it comes
    from (numbers as float64, as Fig. 2 takes them)."""
    from moetrace.analyses.capacity_response import compute_capacity_table, compute_table2
    from moetrace.reports.sweep import numeric_cells

    num = numeric_cells(_with_cell_facts(sweep.results, sweep.cells))
    return compute_table2(compute_capacity_table(num)), num


def fig2_png(cells: pd.DataFrame) -> bytes:
    from moetrace.analyses.capacity_response import plot_capacity
    from moetrace.reports import figures as F

    fig, axes = F.new_figure(11, 3.6, ncols=2)
    plot_capacity(cells, axes)
    return F.png_bytes(fig)


def build_sweep_report(sweep, out: str | os.PathLike, *, sections: Iterable[str] = SECTIONS,
                       cell: str | None = None, plan: str | os.PathLike | None = None, force: bool = False,
                       progress: Callable[[str], None] | None = None, cell_reports: bool = True) -> dict[str, Any]:
    """The findings, Table 2, Fig. 2 and the strip of cells of a sweep, then the full run report of
    one recorded cell (``cell``; default: :func:`default_detail_cell`); with ``cell_reports``
    every other recorded cell's report under cells/NAME/ (linked from the strip)."""
    sections = check_sections(sections)
    out = Path(out)
    prepare_out(out, force)
    with staged(out, clear=("tables", "figures", "cells")) as stage:
        return _sweep_report(sweep, out, stage, sections, cell, plan, progress, cell_reports)


def _sweep_overview(rep: Report, sweep, say) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Table 2, Fig. 2 and the full results: what the sweep measured over C."""
    from moetrace.analyses import reclaim as R

    rep.h(2, "Capacity sweep (the paper's Table 2 and Fig. 2)", "sweep")
    t2, cells = sweep_table2(sweep)
    rep.table("table2", t2, "Table 2: per capacity C, the effective capacity, the simulated LRU hit rate, iteration "
              "time (median, spread over repeats), device reads and LRU miss demand per iteration, amplification",
              None, shown=shown_table2(t2))
    rep.summary["table2"] = json.loads(table_json(t2))
    if len(cells):
        rep.figure("fig2", fig2_png(cells), "Fig. 2: iteration time (left) and device reads per iteration (right) "
                   "against C, on the same log-C axis; bars: the range of the repeats", wide=True)
    say("cells")
    sr = R.compute_sweep_reclaim(sweep.cells)
    rep.summary["cells"] = json.loads(table_json(sr)) if len(sr) else []
    rep.table("results", sweep.results, "Every cell (results.parquet)", None, fold=True)
    return t2, sr
def featured_cell(cells: list) -> tuple[Any, str]:
    """The most informative recorded cell and why: the largest amplification when a retained
    cell amplifies (> findings.AMPLIFIES), else the one in the middle of the curve (simulated LRU
    hit rate nearest 50 %, the smaller C among equals)."""
    from moetrace.reports.findings import AMPLIFIES

    retained = [c for c in cells if (c.cell or {}).get("retained")] or cells
    amp = {c.name: (c.cell or {}).get("amplification") for c in retained}
    known = {k: v for k, v in amp.items() if v is not None}
    if known and max(known.values()) > AMPLIFIES:
        name = max(known, key=known.get)
        return next(c for c in retained if c.name == name), "the one that amplifies most"

    def hit(c):
        h = ((c.cell or {}).get("simulated") or {}).get("hit_rate")
        return (abs(h - 0.5) if h is not None else 2.0, int((c.cell or {}).get("capacity_bytes") or 0))

    return min(retained, key=hit), "in the middle of the curve (no cell amplifies; LRU hit rate nearest 50 %)"


def _cells_strip(rep: Report, sr: pd.DataFrame, links: dict[str, str]) -> None:
    """One row per recorded cell, each a click away from its own report."""
    if not len(sr):
        return
    shown = pd.DataFrame({
        "cell": list(sr["cell"]), "C": [fmt_bytes(v) for v in sr["capacity_bytes"]],
        "LRU hit rate": [fmt_pct(v) for v in sr["lru_hit_rate"]],
        "amplification": [fmt_num(v) for v in sr["amplification"]],
        "re-added pages": [fmt_num(v) for v in sr["re_added_pages"]],
        "scan-to-steal": [fmt_num(v) for v in sr["scan_to_steal"]],
        "reclaimer": [v if isinstance(v, str) else "none" for v in sr["reclaimer"]],
        "outside evicted pages": [fmt_num(v) for v in sr["outside_evicted_pages"].astype("Int64").fillna(0)],
        "alarm": ["NA" if is_na(v) else ("RAISED" if v else "no") for v in sr["alarm"]]})
    rep.table("sweep_cells", sr, "The cells: each one's report is a click away", None, shown=shown,
              links={"cell": [links.get(n) for n in sr["cell"]]})


def _sweep_report(sweep, out: Path, stage: Path, sections, cell, plan, progress, cell_reports) -> dict[str, Any]:
    from moetrace.reports import findings as FD

    say = progress or (lambda s: None)
    rep = Report(stage, f"moetrace sweep report: {sweep.path.name}")
    t2, sr = _sweep_overview(rep, sweep, say)
    FD.hosts(rep, sweep.results)
    FD.capacity_response(rep, t2)
    FD.amplification(rep, t2)
    if not sweep.cells:
        rep.p("No cell of this sweep was recorded (run the sweep with --record for per-expert detail).")
        rep.summary["kind"] = "sweep"
        FD.alarm(rep, rep.summary)
        return write_report(rep, ("sweep",), final=out)
    if cell is not None:
        chosen = next((c for c in sweep.cells if c.name == cell), None)
        if chosen is None:
            raise UsageError(f"no recorded cell named {cell!r} in {sweep.path}",
                             hint="choose one of " + ", ".join(c.name for c in sweep.cells))
        why = "chosen with --cell"
    else:
        chosen, why = featured_cell(sweep.cells)
    links = {chosen.name: "#detail"}
    if cell_reports:
        for c in sweep.cells:
            if c.name != chosen.name:
                say(f"cell {c.name}")
                build_run_report(c, stage / "cells" / c.name, sections=[x for x in sections if x != "timeline"],
                                 plan=plan, title=f"moetrace report: {sweep.path.name} / {c.name}")
                links[c.name] = f"cells/{c.name}/report.html"
    _cells_strip(rep, sr, links)
    rep.h(2, f"Cell {chosen.name}: per-expert detail", "detail")
    rep.p(f"Cell {chosen.name} (C = {fmt_bytes((chosen.cell or {}).get('capacity_bytes'))}): {why}.")
    rep.summary["detail_cell"] = chosen.name
    rep.summary["detail_why"] = why
    FD.featured(rep, chosen.name, why, cell_reports and len(sweep.cells) > 1)
    _header(rep, chosen)
    sim = _sim(chosen, Path(plan) if plan else None, rep.notes)
    run_sections(rep, chosen, sections, sim, say)
    FD.detail(rep, rep.summary)
    rep.summary["kind"] = "sweep"
    return write_report(rep, ("sweep", "detail") + sections, final=out)


def build_report(path: str | os.PathLike, out: str | os.PathLike | None = None, **kw) -> dict[str, Any]:
    """Open ``path`` (run, cell or sweep) and write its report to ``out`` (default
    ``<path>/report``)."""
    from moetrace.run.handle import kind_of, open_run, open_sweep

    p = Path(path)
    if kind_of(p) in ("engine_cell", "engine_sweep"):
        from moetrace.reports.engine import build_engine_report

        return build_engine_report(p, out, force=bool(kw.get("force")))
    out = Path(out) if out is not None else p / "report"
    if kind_of(p) == "sweep":
        kw.pop("title", None)
        return build_sweep_report(open_sweep(p), out, **kw)
    kw.pop("cell", None)
    kw.pop("cell_reports", None)
    return build_run_report(open_run(p), out, **kw)
