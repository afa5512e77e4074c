"""The demo's words: what `moetrace demo` says of each step and writes into REPORT.md (the sim
table, the locality headline, the recorded cell, the watched intervals, the sweep report's
Markdown), from the JSON the steps wrote and the directories they made."""

from __future__ import annotations

import json
from pathlib import Path

from moetrace.errors import MoetraceError


def fmt_ratio(v) -> str:
    """A ratio to two decimals, NA for None."""
    return "NA" if v is None else f"{v:.2f}"


def fmt_gb(n) -> str:
    """Bytes in GB to one decimal, "unknown" for None."""
    return "unknown" if n is None else f"{n / 1e9:.1f} GB"


def locality_headline(st: dict) -> dict:
    """Pick the headline numbers out of `trace stats --json` (one trace)."""
    tr = st["traces"][0] if isinstance(st, dict) and "traces" in st else st
    s = tr.get("summary", tr) if isinstance(tr, dict) else {}
    keys = [("zipf_slope", "Zipf slope"), ("W1", "W1"), ("W8", "W8"), ("W64", "W64"),
            ("top8_share_mean", "top-8 share"), ("coverage", "coverage")]
    out = {}
    for key, label in keys:
        v = s.get(key)
        if isinstance(v, float):
            out[label] = f"{v:.3f}" if key == "zipf_slope" else f"{100 * v:.1f}%"
    if not out:
        raise MoetraceError("trace stats --json did not give the expected summary fields")
    return out


def sim_table(rows: list[dict]) -> str:
    """The per-layer hit rates of `sim --json`'s rows: a row per budget, a column per policy."""
    pols = sorted({r["policy"] for r in rows}, key=["lru", "lfu", "static", "belady"].index)
    budgets = sorted({r["budget"] for r in rows if r["scope"] == "per_layer"})
    lines = ["      B/layer " + "".join(f"{p:>9}" for p in pols)]
    for b in budgets:
        cells = {r["policy"]: r["hit_rate"] for r in rows if r["budget"] == b and r["scope"] == "per_layer"}
        lines.append(f"      {b:>7} " + "".join(f"{100 * cells[p]:>8.1f}%" for p in pols))
    return "\n".join(lines)


def recorded_summary(sweep: Path) -> str:
    """What `record` saw in the smallest-capacity cell: page-cache events per expert."""
    import pandas as pd

    runs = sorted(sweep.glob("cells/*/run/experts.parquet"),
                  key=lambda p: int(json.loads((p.parent.parent / "cell.json").read_text())["capacity_bytes"]))
    if not runs:
        return "      (no recorded run found)"
    df = pd.read_parquet(runs[0])
    e = df[df["kind"] == "expert"]
    top = e.sort_values("re_added_pages", ascending=False).head(3)
    cell = runs[0].parent.parent.name
    lines = [f"      recorded ({cell}, warm-up + measured): pages added {int(e['added_pages'].sum())}, "
             f"evicted {int(e['evicted_pages'].sum())}, re-added {int(e['re_added_pages'].sum())}",
             "      most re-read experts: " + ", ".join(
                 f"L{int(r.layer)}/E{int(r.expert)} ({int(r.re_added_pages)} pages)" for r in top.itertuples())]
    cj = json.loads((runs[0].parent.parent / "cell.json").read_text())
    m = (cj.get("record") or {}).get("measured_pages")
    if m is not None:
        lines.append(f"      measured pass alone (per-iteration epochs): added {m['added_pages']}, "
                     f"re-added {m['re_added_pages']} pages; /proc/vmstat workingset_refault_file over the "
                     f"measured window {cj.get('refault_file_pages')}")
    return "\n".join(lines)


def watch_summary(figs: list[dict]) -> tuple[str, str]:
    """Totals of the watched intervals (`watch --json` objects) and the alarms they raised: the
    line to print and REPORT.md's section."""
    tot = {k: sum(int(f["pool"].get(k) or 0) for f in figs)
           for k in ("added_pages", "re_added_pages", "device_read_bytes", "computed_miss_bytes", "expert_accesses")}
    raised: dict[str, int] = {}
    for f in figs:
        for name, a in (f.get("alarms") or {}).items():
            if a.get("on"):
                raised[name] = raised.get(name, 0) + 1
    amp = tot["device_read_bytes"] / tot["computed_miss_bytes"] if tot["computed_miss_bytes"] else None
    text = (f"      {len(figs)} intervals: {tot['expert_accesses']} expert accesses, added {tot['added_pages']} pages, "
            f"re-added {tot['re_added_pages']}, device {tot['device_read_bytes'] / 2**20:.1f} MiB against computed "
            f"misses {tot['computed_miss_bytes'] / 2**20:.1f} MiB (amplification {fmt_ratio(amp)}); alarms raised: "
            + (", ".join(f"{k} in {v} intervals" for k, v in raised.items()) or "none"))
    return text, ("\n## Watched live (`moetrace watch`)\n\nThe same pool at 48 MiB, one more replay watched by cgroup "
            "every 0.5 s (watch.jsonl: one object per interval):\n\n```\n" + text.strip() + "\n```\n")


def report_markdown(out: Path) -> str:
    """The sweep report's Markdown, its figure links made relative to OUT."""
    md = (out / "report" / "REPORT.md").read_text()
    md = md.replace("](figures/", "](report/figures/").replace("](flame.svg)", "](report/flame.svg)")
    body = md.split("\n", 1)[1] if md.startswith("# ") else md
    return ("\n## Sweep report (`moetrace report`)\n\nThe same as report/report.html (every figure embedded, "
            "opens offline); tables in report/tables/.\n" + body.replace("\n### ", "\n#### ").replace("\n## ", "\n### "))


def demo_markdown(title: str, parse: dict, headline: dict, plan: dict, table: str, sweep_md: str) -> str:
    """REPORT.md: the trace's accounting (`trace parse --json`), its locality headline, the plan
    (`plan inspect --json`), the fair-window hit rates, then the capacity sweep's sections."""
    sk = parse["steps_by_kind"]
    return (f"# {title}\n\n"
            f"Accepted tokens: {parse['accepted_tokens']} over {parse['steps']} steps "
            f"({sk['normal']} normal, {sk['spec_accept']} spec_accept, {sk['spec_fallback']} spec_fallback).\n\n"
            "## Locality\n\n" + "\n".join(f"- {k}: {v}" for k, v in headline.items()) + "\n\n"
            f"## Plan\n\n- {plan.get('iterations')} iterations, {plan.get('passes')} passes, {plan.get('reads')} "
            f"reads, {fmt_gb(plan.get('logical_bytes'))} logical bytes\n\n"
            "## Fair-window hit rates (per layer)\n\n```\n" + table + "\n```\n\n![hit rates](sim.png)\n" + sweep_md)
