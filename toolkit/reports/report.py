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

import base64
import contextlib
import datetime as _dt
import html
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moetrace import __version__
from moetrace.errors import UsageError
from moetrace.jsonutil import json_default

SECTIONS = ("amp", "hitpath", "age", "reclaim", "flame", "timeline")
TOP_N = 15


# -- formatting ------------------------------------------------------------------------------------

def fmt_bytes(n) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)) or n is pd.NA:
        return "NA"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_num(v, digits: int = 3) -> str:
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return "NA"
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    if isinstance(v, (float, np.floating)):
        if float(v).is_integer() and abs(v) >= 1000:
            return f"{int(v):,}"
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _cell(v) -> str:
    try:
        if pd.isna(v):
            return "NA"
    except (TypeError, ValueError):
        pass
    return fmt_num(v)


def md_table(df: pd.DataFrame, max_rows: int | None = None) -> str:
    d = df if max_rows is None else df.head(max_rows)
    cols = [str(c) for c in d.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in d.itertuples(index=False):
        lines.append("| " + " | ".join(_cell(v).replace("|", "\\|") for v in row) + " |")
    if max_rows is not None and len(df) > max_rows:
        lines.append(f"\n({len(df) - max_rows} more rows in the table file)")
    return "\n".join(lines)


def html_table(df: pd.DataFrame, max_rows: int | None = None) -> str:
    d = df if max_rows is None else df.head(max_rows)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in d.columns)
    body = []
    for row in d.itertuples(index=False):
        body.append("<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row) + "</tr>")
    more = (f"<p class='more'>{len(df) - max_rows} more rows in the table file.</p>"
            if max_rows is not None and len(df) > max_rows else "")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{more}"


# -- the document being built ------------------------------------------------------------------------

@dataclass
class Report:
    """What a report accumulates: HTML and Markdown parts, tables, figures, headline figures."""

    out: Path
    title: str
    html: list[str] = field(default_factory=list)
    md: list[str] = field(default_factory=list)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: dict[str, bytes] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def h(self, level: int, text: str, anchor: str | None = None) -> None:
        a = f" id='{anchor}'" if anchor else ""
        self.html.append(f"<h{level}{a}>{html.escape(text)}</h{level}>")
        self.md.append("#" * level + " " + text + "\n")

    def p(self, text: str) -> None:
        self.html.append(f"<p>{html.escape(text)}</p>")
        self.md.append(text + "\n")

    def table(self, name: str, df: pd.DataFrame, caption: str, max_rows: int | None = TOP_N,
              show: pd.DataFrame | None = None) -> None:
        """Keep ``df`` as tables/NAME.*; show ``show`` (default df) up to max_rows rows."""
        self.tables[name] = df
        s = df if show is None else show
        self.html.append(f"<div class='tbl'><p class='cap'>{html.escape(caption)} "
                         f"<span class='file'>tables/{name}.parquet</span></p>{html_table(s, max_rows)}</div>")
        self.md.append(f"*{caption}* (`tables/{name}.parquet`)\n\n{md_table(s, max_rows)}\n")

    def figure(self, name: str, png: bytes, caption: str) -> None:
        self.figures[name] = png
        b64 = base64.b64encode(png).decode()
        self.html.append(f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,{b64}'/>"
                         f"<figcaption>{html.escape(caption)}</figcaption></figure>")
        self.md.append(f"![{caption}](figures/{name}.png)\n")

    def raw_svg(self, svg: str, caption: str, file: str) -> None:
        body = svg[svg.find("<svg"):] if "<svg" in svg else svg
        self.html.append(f"<figure class='svg'>{body}<figcaption>{html.escape(caption)} "
                         f"(<a href='{file}'>{file}</a>)</figcaption></figure>")
        self.md.append(f"[{caption}]({file})\n")

    def kv(self, rows: list[tuple[str, Any]]) -> None:
        df = pd.DataFrame(rows, columns=["figure", "value"])
        self.html.append(html_table(df.assign(value=df["value"].map(lambda v: v if isinstance(v, str) else _cell(v)))))
        self.md.append(md_table(df.assign(value=df["value"].map(lambda v: v if isinstance(v, str) else _cell(v))))
                       + "\n")


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
h1{font-size:1.6em} h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em} h3{margin-top:1.5em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0} th,td{border:1px solid #ddd;padding:.2em .5em;text-align:right}
th{background:#f4f4f4} td:first-child,th:first-child{text-align:left}
figure{margin:1em 0} figure img{max-width:100%;border:1px solid #eee} figcaption{font-size:.85em;color:#555}
.cap{font-weight:600;margin-bottom:.2em} .file{font-weight:normal;color:#888;font-size:.85em;margin-left:.5em}
.more{font-size:.8em;color:#777} nav a{margin-right:1em} .note{background:#fff8e1;padding:.5em;border-left:3px solid #f0b400}
.alarm{background:#fdecea;border-left:3px solid #d93025;padding:.5em} .ok{background:#e6f4ea;border-left:3px solid #188038;padding:.5em}
figure.svg svg{max-width:100%;height:auto}
.tbl{overflow-x:auto;max-width:100%}
"""


def _write(rep: Report, sections: Iterable[str], final: Path | None = None) -> dict[str, Any]:
    """Write the report into ``rep.out`` (a staging directory); the paths in the returned
    document are those in ``final`` (where :func:`staged` moves it), default ``rep.out``."""
    out = rep.out
    final = final or out
    (out / "tables").mkdir(parents=True, exist_ok=True)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    for name, df in rep.tables.items():
        df.to_parquet(out / "tables" / f"{name}.parquet", index=False)
        (out / "tables" / f"{name}.json").write_text(table_json(df))
    for name, png in rep.figures.items():
        (out / "figures" / f"{name}.png").write_bytes(png)
    nav = "".join(f"<a href='#{s}'>{s}</a>" for s in sections)
    notes = "".join(f"<p class='note'>{html.escape(n)}</p>" for n in rep.notes)
    page = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(rep.title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(rep.title)}</h1><nav>{nav}</nav>{notes}"
            + "\n".join(rep.html)
            + f"<hr><p class='more'>moetrace {__version__}, "
              f"{_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}</p></body></html>\n")
    (out / "report.html").write_text(page)
    md = f"# {rep.title}\n\n" + "".join(f"> {n}\n\n" for n in rep.notes) + "\n".join(rep.md)
    (out / "REPORT.md").write_text(md)
    doc = {"schema": "moetrace.report/1", "title": rep.title, "summary": rep.summary,
           "tables": sorted(rep.tables), "figures": sorted(rep.figures), "files": rep.files, "notes": rep.notes,
           "html": str(final / "report.html"), "markdown": str(final / "REPORT.md")}
    (out / "report.json").write_text(json.dumps(doc, indent=1, default=json_default) + "\n")
    return doc


def table_json(df: pd.DataFrame) -> str:
    """Records JSON with NA as null and floats rounded to 9 significant digits (stable
    across platforms for golden files)."""
    def conv(v):
        if v is None or v is pd.NA:
            return None
        if isinstance(v, (np.integer,)):
            return int(v)
        if isinstance(v, (float, np.floating)):
            return None if math.isnan(v) else float(f"{float(v):.9g}")
        if isinstance(v, (np.bool_,)):
            return bool(v)
        return v

    recs = [{str(k): conv(v) for k, v in zip(df.columns, row)} for row in df.astype(object).itertuples(index=False)]
    if not recs:
        return "[]\n"
    return "[\n" + ",\n".join(json.dumps(r, default=json_default) for r in recs) + "\n]\n"  # a row a line


# -- sections of a run ---------------------------------------------------------------------------

def _geometry(run) -> tuple[int, int]:
    from moetrace.analyses.amplification import _geometry

    n_layers, n_experts, _ = _geometry(run.meta)
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
    warm, passes = A._phases(run.meta)
    return A.simulated_misses(plan, cap, int(pool.get("extent_bytes") or pool["geometry"]["expert_bytes"]),
                              warm, passes)


def section_amp(rep: Report, run, sim, it: pd.DataFrame) -> None:
    from moetrace.analyses import amplification as A
    from moetrace.analyses import reclaim as R
    from moetrace.reports import figures as F

    n_layers, n_experts = _geometry(run)
    rep.h(2, "Re-read amplification", "amp")
    ex = A.compute_amplification_experts(run.tables, run.meta, sim=sim)
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
            ("pages added in the measured pass (pagecache probe)", _cell(meas_added)),
            ("simulated LRU miss pages, measured pass", _cell(meas_sim)),
            ("amplification (cell: device / miss demand)", _cell(cell.get("amplification"))),
            ("pages re-added in the measured pass (re-reads)", _cell(ex["measured_re_added_pages"].sum(min_count=1))),
            ("re-reads within one iteration" + (" (exact)" if exact else " (at least: the stream lost events)"
                                                if lb_col == "in_iteration_re_added_pages" else " (at least)"),
             _cell(in_it)),
            ("kernel's workingset_refault_file, measured window", _cell(cell.get("refault_file_pages")))]
    rep.kv(rows)
    rep.summary.update({"capacity_bytes": cell.get("capacity_bytes"), "device_bytes": cell.get("device_bytes"),
                        "amplification": cell.get("amplification"),
                        "measured_added_pages": _int(meas_added), "measured_sim_miss_pages": _int(meas_sim),
                        "measured_re_added_pages": _int(ex["measured_re_added_pages"].sum(min_count=1)),
                        "in_iteration_re_added_pages": in_it, "in_iteration_exact": exact,
                        "re_added_pages": _int(ex["re_added_pages"].sum(min_count=1))})
    rec = A.compute_reconciliation(run.tables, run.meta)
    rep.h(3, "Totals against the kernel's own counters")
    rep.table("reconciliation", rec, "moetrace's totals and the /proc deltas of the same window", None)
    rep.summary["reconciliation"] = json.loads(table_json(rec))
    if len(it):
        fig, ax = F.new_figure()
        F.plot_iterations(it, ax)
        rep.figure("iterations", F.png_bytes(fig), "Pages added and re-added per replay iteration, against the "
                                                   "simulated LRU misses at this capacity")
        rep.table("amp_iterations", it, "Per replay iteration", max_rows=None if len(it) <= 40 else 40)
    fig, axes = F.new_figure(11, 4, ncols=2)
    F.plot_heatmap(ex, "re_added_pages", n_layers, n_experts, axes[0], title="pages re-added (re-reads)",
                   unit="pages", cmap="magma")
    F.plot_heatmap(ex, "amplification", n_layers, n_experts, axes[1],
                   title="amplification (device bytes / simulated miss bytes)", cmap="coolwarm")
    rep.figure("heatmap_amp", F.png_bytes(fig), "Layers x experts: re-reads and amplification")
    cols = ["layer", "expert", "re_added_pages", "re_added_pages_share", "added_pages", "requested_pages",
            "device_read_bytes", "sim_miss_pages", "amplification", "observed_hit_rate", "sim_hit_rate"]
    top = A.top_experts(ex, "re_added_pages", TOP_N)
    rep.table("amp_experts", ex, "The experts carrying most re-reads (all experts in the table file)",
              show=top[[c for c in cols if c in top]])
    lay = A.compute_layers(ex)
    rep.table("amp_layers", lay, "Layers by share of the re-reads",
              show=lay.sort_values("re_added_pages", ascending=False))
    rep.h(3, "Observed vs simulated")
    fig, ax = F.new_figure(5, 4.2)
    F.plot_observed_vs_sim(ex, ax)
    rep.figure("observed_vs_sim", F.png_bytes(fig), "Per expert: observed page hit rate vs simulated LRU "
                                                    "hit rate at the same capacity (recording: warm-up + measured)")
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
              if len(ovs) <= 30 else 30)
    tot_req = ex["requested_pages"].sum(min_count=1)
    rep.summary["observed_hit_rate"] = _ratio(ex["hit_pages"].sum(min_count=1), tot_req)
    rep.summary["sim_hit_rate"] = (None if sim is None else
                                   1 - _ratio(ex["sim_miss_pages"].sum(min_count=1), acc.sum() * ppe))
    s2s = R.scan_to_steal(run.tables.get("reclaim")) if "reclaim" in run.tables else None
    alarm = R.compute_alarm(cell.get("amplification"), s2s)
    rep.summary["alarm"] = alarm
    cls = "alarm" if alarm["alarm"] else "ok"
    verdict = ("ALARM: device bytes above miss demand with scan-to-steal above 2" if alarm["alarm"] else
               "unknown (amplification or scan-to-steal missing)" if alarm["alarm"] is None else
               "no alarm")
    rep.html.append(f"<p class='{cls}'>Paper's alarm condition ({html.escape(alarm['rule'])}): "
                    f"{html.escape(verdict)}; amplification {_cell(alarm['amplification'])}, "
                    f"scan-to-steal {_cell(alarm['scan_to_steal'])}.</p>")
    rep.md.append(f"**Alarm** ({alarm['rule']}): {verdict}; amplification {_cell(alarm['amplification'])}, "
                  f"scan-to-steal {_cell(alarm['scan_to_steal'])}.\n")


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
            ("miss ns per KiB", s["miss_ns_per_kib"])])
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
              show=ex.sort_values("hit_only_ns_per_kib", ascending=False, na_position="last"))
    rep.table("hitpath_layers", H.compute_hitpath_layers(run.tables["reads"]), "Per layer", max_rows=None
              if n_layers <= 30 else 30)
    if "stacks" in run.tables:
        b = H.compute_stack_breakdown(run.tables["stacks"])
        if len(b):
            fig, ax = F.new_figure(6.5, 3.2)
            F.plot_breakdown(b, ax, title="Where the replay's CPU time goes (sampled kernel stacks)")
            rep.figure("hitpath_stacks", F.png_bytes(fig), "Sampled time by kernel path, replay threads")
            rep.table("hitpath_stacks", b, "Sampled time by the deepest recognised kernel frame", None)


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
                  show=d.sort_values("dwell_ns_mean", na_position="last"))
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
        rep.table("age_cadence", cad, "Aging cadence per memcg and node", None)
        rep.table("age_generations", gens, "Generations per sample", 20)
        ev = G.compute_age_at_eviction(lg)
        rep.table("age_at_eviction", ev, "Generations evicted between samples, with their age", 20)
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
                      show=per.sort_values("age_ms_median", na_position="last"))
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
        rep.table("age_locked_fraction", lf, "Locked bytes over time (fraction of C)", 20)


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
          f"last access (median {_cell(s['reread_iterations_since_access_median'])} iterations after it); "
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
              show=per.sort_values("excess_pages", ascending=False))


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
    if len(tl):
        fig, ax = F.new_figure()
        F.plot_reclaim_timeline(tl, ax)
        rep.figure("reclaim_timeline", F.png_bytes(fig), "Pages reclaimed per 100 ms by reclaimer, and "
                                                          "scan-to-steal over time")
        rep.table("reclaim_timeline", tl, "Reclaim per 100 ms bucket", 20)
    psi = R.compute_psi(run.snapshots)
    if len(psi):
        rep.table("reclaim_psi", psi, "Pressure stall (PSI) over the recording", None)
        m = psi[(psi["resource"] == "memory") & (psi["level"] == "some")]
        share = m["stall_share"].iloc[0] if len(m) else None
        rep.summary["psi_memory_some_share"] = None if share is None or pd.isna(share) else float(share)
    if it is not None and len(it):
        w = R.compute_refault_windows(it)
        fig, ax = F.new_figure()
        F.plot_refaults(w, ax)
        rep.figure("reclaim_refaults", F.png_bytes(fig), "Refault share per iteration")
        rep.table("reclaim_refault_windows", w, "Refault windows (one per iteration) and thrash state", 40)
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
    from moetrace.reports.timeline import compute_timeline, write_timeline

    rep.h(2, "Timeline", "timeline")
    doc = compute_timeline(run.tables, run.meta)
    write_timeline(doc, rep.out / "timeline.json")
    rep.files["timeline"] = "timeline.json"
    rep.p(f"timeline.json: {len(doc['traceEvents'])} trace events (iterations as slices, page-cache, mlock and "
          "MGLRU counters). Open it in ui.perfetto.dev or chrome://tracing.")


def _int(v):
    return None if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)) else int(v)


def _ratio(a, b):
    try:
        if a is pd.NA or b is pd.NA or not b:
            return None
        return float(a) / float(b)
    except (TypeError, ValueError):
        return None


def _header(rep: Report, run) -> None:
    m = run.manifest
    k = m.get("kernel") or {}
    cell = run.cell or {}
    probes = [p for p, a in (m.get("attach_plan") or {}).items() if isinstance(a, dict) and a.get("recorded")]
    rows = [("run", str(run.path)), ("complete", "yes" if m.get("complete") else "NO (interrupted)"),
            ("kernel", str(k.get("release", k) if isinstance(k, dict) else k)),
            ("probes recorded", ", ".join(probes) or "none"),
            ("pool", f"{(m.get('pool') or {}).get('layout', '?')}, "
                     f"{(m.get('pool') or {}).get('files', '?')} files"),
            ("plan", f"{(m.get('plan') or {}).get('iterations', '?')} iterations")]
    if cell:
        rows += [("capacity", f"{fmt_bytes(cell.get('capacity_bytes'))} ({cell.get('mechanism')}, "
                              f"{cell.get('mode')})"),
                 ("retained", "yes" if cell.get("retained") else f"no: {cell.get('reasons')}")]
    rep.kv(rows)
    for n in (m.get("notes") or []) + (cell.get("notes") or []):
        rep.notes.append(str(n))


def _prepare_out(out: Path, force: bool) -> None:
    """Refuse a non-empty ``out`` that holds no earlier report (unless ``force``); nothing is
    changed there until the new report is complete (:func:`staged`)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} exists and is not a directory", hint="choose another --out")
    if out.exists() and any(out.iterdir()):
        if not (out / "report.json").exists() and not force:
            raise UsageError(f"{out} exists, is not empty and holds no earlier report",
                             hint="choose another --out, or pass --force")


def _merge_into(src: Path, dst: Path) -> None:
    """Move every file under ``src`` to the same place under ``dst`` (replacing namesakes)."""
    dst.mkdir(exist_ok=True)
    for entry in sorted(src.iterdir()):
        d = dst / entry.name
        if entry.is_dir() and not entry.is_symlink():
            _merge_into(entry, d)
        else:
            os.replace(entry, d)


@contextlib.contextmanager
def staged(out: Path, clear: tuple[str, ...] = ("tables", "figures")) -> Iterator[Path]:
    """A staging directory inside ``out`` (``.report.tmp-*``) to build a report in. When the
    block completes, the ``clear`` subdirectories of an earlier report are removed and every
    file built replaces its namesake in ``out``; when it raises, the staging directory goes
    (and ``out`` too if this created it, empty): a failed report leaves the earlier one
    untouched."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".report.tmp-", dir=out))
    try:
        yield stage
        for sub in clear:
            shutil.rmtree(out / sub, ignore_errors=True)
        _merge_into(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if created:
            try:
                out.rmdir()
            except OSError:
                pass
        raise
    shutil.rmtree(stage, ignore_errors=True)


def build_run_report(run, out: str | os.PathLike, *, sections: Iterable[str] = SECTIONS,
                     plan: str | os.PathLike | None = None, title: str | None = None, force: bool = False,
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The report of one run or cell (:func:`moetrace.run.handle.open_run`)."""
    sections = _check_sections(sections)
    out = Path(out)
    _prepare_out(out, force)
    with staged(out) as stage:
        rep = Report(stage, title or f"moetrace report: {run.name}")
        say = progress or (lambda s: None)
        _header(rep, run)
        wants_sim = ("amp" in sections or "reclaim" in sections) and has_pool(run)
        sim = _sim(run, Path(plan) if plan else None, rep.notes) if wants_sim else None
        run_sections(rep, run, sections, sim, say)
        rep.summary["kind"] = "cell" if run.cell is not None else "run"
        return _write(rep, sections, final=out)


def has_pool(run) -> bool:
    """Whether the run knows its pool's geometry (record --pool, or a replay's manifest)."""
    from moetrace.analyses.amplification import _geometry

    try:
        _geometry(run.meta)
    except (KeyError, TypeError, ValueError):
        return False
    return "experts" in run.tables


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


def _check_sections(sections: Iterable[str]) -> tuple[str, ...]:
    s = tuple(dict.fromkeys(x.strip() for x in sections if x.strip()))
    bad = [x for x in s if x not in SECTIONS]
    if bad:
        raise UsageError(f"unknown report section(s): {', '.join(bad)}", hint=f"choose from {', '.join(SECTIONS)}")
    return s


# -- a sweep -------------------------------------------------------------------------------------

def compute_table2(sweep) -> pd.DataFrame:
    """The paper's Table 2 from a sweep: per capacity C, cells retained, iteration time
    (median and spread), device and miss bytes per iteration, amplification."""
    cap = sweep.capacity
    if cap is None or cap.empty:
        return pd.DataFrame()
    t = pd.DataFrame({
        "capacity_bytes": cap["capacity_bytes"].astype("int64"),
        "cells": cap["cells"].astype("int64"), "retained": cap["retained"].astype("int64"),
        "iteration_ms": cap["iteration_time_median_ns"].astype("Float64") / 1e6,
        "iteration_spread": cap["iteration_time_spread"].astype("Float64"),
        "device_mib_per_iteration": cap["device_bytes_per_iteration"].astype("Float64") / 2**20,
        "miss_mib_per_iteration": cap["miss_bytes_per_iteration"].astype("Float64") / 2**20,
        "amplification": cap["amplification"].astype("Float64")})
    return t.sort_values("capacity_bytes", ascending=False).reset_index(drop=True)


def build_sweep_report(sweep, out: str | os.PathLike, *, sections: Iterable[str] = SECTIONS,
                       cell: str | None = None, plan: str | os.PathLike | None = None, force: bool = False,
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Table 2, Fig. 2 and the per-cell reclaim verdicts of a sweep, then the full run
    report of one recorded cell (``cell``; default: the smallest capacity recorded)."""
    sections = _check_sections(sections)
    out = Path(out)
    _prepare_out(out, force)
    with staged(out) as stage:
        return _sweep_report(sweep, out, stage, sections, cell, plan, progress)


def _sweep_report(sweep, out: Path, stage: Path, sections, cell, plan, progress) -> dict[str, Any]:
    from moetrace.analyses import reclaim as R

    say = progress or (lambda s: None)
    rep = Report(stage, f"moetrace sweep report: {sweep.path.name}")
    rep.h(2, "Capacity sweep (the paper's Table 2)", "sweep")
    t2 = compute_table2(sweep)
    rep.table("table2", t2, "Per capacity C: iteration time, device and miss bytes per iteration, amplification",
              None)
    rep.summary["table2"] = json.loads(table_json(t2))
    fig2 = sweep.path / "fig2.png"
    if fig2.is_file():
        rep.figure("fig2", fig2.read_bytes(), "Fig. 2: iteration time and device bytes against C")
    say("cells")
    sr = R.compute_sweep_reclaim(sweep.cells)
    if len(sr):
        rep.table("sweep_cells", sr, "Recorded cells: amplification, scan-to-steal and the alarm", None)
        rep.summary["cells"] = json.loads(table_json(sr))
    res = sweep.results
    rep.table("results", res, "Every cell (results.parquet)", None)
    if not sweep.cells:
        rep.p("No cell of this sweep was recorded (run the sweep with --record for per-expert detail).")
        rep.summary["kind"] = "sweep"
        return _write(rep, ("sweep",), final=out)
    chosen = None
    if cell is not None:
        chosen = next((c for c in sweep.cells if c.name == cell), None)
        if chosen is None:
            raise UsageError(f"no recorded cell named {cell!r} in {sweep.path}",
                             hint="choose one of " + ", ".join(c.name for c in sweep.cells))
    else:
        chosen = default_detail_cell(sweep.cells)
    rep.h(2, f"Cell {chosen.name}: per-expert detail")
    amp = (chosen.cell or {}).get("amplification")
    rep.p(f"Cell {chosen.name} (C = {fmt_bytes((chosen.cell or {}).get('capacity_bytes'))}, amplification "
          f"{_cell(amp)}): {'given by --cell' if cell else 'the retained cell with the highest amplification'}; "
          f"`moetrace report {sweep.path}/cells/<name>` reports any other.")
    rep.summary["detail_cell"] = chosen.name
    _header(rep, chosen)
    sim = _sim(chosen, Path(plan) if plan else None, rep.notes)
    run_sections(rep, chosen, sections, sim, say)
    rep.summary["kind"] = "sweep"
    return _write(rep, ("sweep",) + sections, final=out)


def default_detail_cell(cells: list):
    """The retained recorded cell with the highest amplification (the smallest capacity
    among equals, and when none has one)."""
    retained = [c for c in cells if (c.cell or {}).get("retained")] or cells

    def key(c):
        a = (c.cell or {}).get("amplification")
        return (-(a if a is not None else -1.0), int((c.cell or {}).get("capacity_bytes") or 0))

    return min(retained, key=key)


def build_report(path: str | os.PathLike, out: str | os.PathLike | None = None, **kw) -> dict[str, Any]:
    """Open ``path`` (run, cell or sweep) and write its report to ``out`` (default
    ``<path>/report``)."""
    from moetrace.run.handle import kind_of, open_run, open_sweep

    p = Path(path)
    out = Path(out) if out is not None else p / "report"
    if kind_of(p) == "sweep":
        kw.pop("title", None)
        return build_sweep_report(open_sweep(p), out, **kw)
    kw.pop("cell", None)
    return build_run_report(open_run(p), out, **kw)


@dataclass
class MatrixInputs:
    """What a matrix report shows, computed by moetrace.lab (the report imports no lab code)."""

    path: Path
    cells: pd.DataFrame  # a row per finished cell (lab.matrix.matrix_rows)
    summary: pd.DataFrame  # a row per kernel x MGLRU x mechanism x C (lab.matrix_report.summarize)
    findings: list[str]
    fig3: bytes | None
    detail: Path | None  # the cell directory whose per-expert detail follows (None: none recorded)
    pairs: pd.DataFrame | None = None  # `check` per MGLRU and kernel pair (lab.matrix_report.pair_checks)


def build_matrix_report(m: MatrixInputs, out: str | os.PathLike, *, sections: Iterable[str] = SECTIONS,
                        force: bool = False, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The §5 matrix: the findings in words, Fig. 3, the summary over repeats, every cell, then
    the full report of one recorded cell (``m.detail``)."""
    from moetrace.run.handle import open_run

    sections = _check_sections(sections)
    out = Path(out)
    _prepare_out(out, force)
    with staged(out) as stage:
        rep = Report(stage, f"moetrace matrix report: {m.path.name}")
        rep.h(2, "The §5 matrix: MGLRU x capacity mechanism", "matrix")
        if m.findings:
            rep.html.append("<ul>" + "".join(f"<li>{html.escape(f)}</li>" for f in m.findings) + "</ul>")
            rep.md.append("".join(f"- {f}\n" for f in m.findings))
        else:
            rep.p("No finished cell yet.")
        rep.summary["findings"] = m.findings
        if m.fig3:
            rep.figure("fig3", m.fig3, "Fig. 3 (middle): device MB per iteration, MGLRU on (left) and off (right) "
                                       "per mechanism, median and range over the repeats; dotted: miss demand; "
                                       "numbers: kswapd scan-to-steal")
        rep.table("matrix_summary", m.summary, "Per kernel x MGLRU x mechanism: medians and ranges over the "
                                               "retained repeats", None)
        if m.pairs is not None and len(m.pairs):
            rep.table("matrix_pairs", m.pairs, "`check` per pair: MGLRU off -> on, and the first kernel -> each "
                                               "other (same MGLRU), over the retained repeats", None)
            rep.summary["pairs"] = json.loads(table_json(m.pairs))
        rep.table("matrix_cells", m.cells, "Every finished cell", None)
        rep.summary["cells"] = len(m.cells)
        if m.detail is None:
            rep.summary["kind"] = "matrix"
            return _write(rep, ("matrix",), final=out)
        run = open_run(m.detail)
        rep.h(2, f"Cell {m.detail.parent.parent.name}/{m.detail.parent.name}: per-expert detail")
        rep.p("The retained cell with the highest amplification; `moetrace report <matrix>/cells/<condition>/"
              "<cell>/cell` reports any other.")
        rep.summary["detail_cell"] = str(m.detail.relative_to(m.path))
        _header(rep, run)
        sim = _sim(run, None, rep.notes) if has_pool(run) else None
        run_sections(rep, run, sections, sim, progress or (lambda s: None))
        rep.summary["kind"] = "matrix"
        return _write(rep, ("matrix",) + tuple(sections), final=out)
