"""The report of an engine cell or an engine sweep (moetrace.capacity.enginecell, .enginesweep):
findings first, each number a link to the table row it comes from.

A sweep's findings compare the loaders at the capacity nearest half the model's expert pool
(the issue's question: what the stock loader reads there, against the routed miss demand, and
how much of it no routed expert needed, by cause); then the per-capacity table and the figure.
A cell's: its figures, the tokens, the experts whose added pages no routed expert needed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd

from moetrace.reports.document import Report, prepare_out, staged, write_report
from moetrace.run.handle import ENGINE_CELL_JSON, ENGINE_SWEEP_JSON

#: a cell's figures as the report's tables show them (name, engine_cell.json key, scale)
CELL_FIGURES = (("decode_per_token_ns", "decode_ms_per_token", 1e6),
                ("device_per_token_bytes", "device_bytes_per_token", 1),
                ("miss_demand_per_token_bytes", "miss_bytes_per_token", 1),
                ("amplification", "amplification", 1),
                ("unneeded_share", "unneeded_share", 1),
                ("readahead_share", None, 1))
CAUSES = ("demand", "readahead", "populate", "other")


def _cell_row(doc: dict[str, Any]) -> dict[str, Any]:
    causes = doc.get("added_by_cause") or {}
    added = sum(causes.values())
    row: dict[str, Any] = {"loader": doc.get("label"), "capacity_bytes": (doc.get("inputs") or {}).get("capacity_bytes")}
    for name, key, scale in CELL_FIGURES:
        v = (causes.get("readahead", 0) / added if added else None) if key is None else doc.get(key)
        row[name] = None if v is None else v * scale
    return row


def _expert_pool_bytes(cell_dir: Path) -> int | None:
    try:
        m = json.loads((cell_dir / "run" / "manifest.json").read_text())
        g = m["pool"]["geometry"]
        return int(g["n_layers"]) * int(g["n_experts"]) * int(g["expert_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def build_engine_report(path: str | os.PathLike, out: str | os.PathLike | None = None, force: bool = False
                        ) -> dict[str, Any]:
    """Write the report of the engine cell or sweep at ``path`` into ``out`` (default path/report)."""
    p = Path(path)
    out = Path(out) if out is not None else p / "report"
    prepare_out(out, force)
    with staged(out) as stage:
        if (p / ENGINE_SWEEP_JSON).is_file():
            rep = Report(stage, f"moetrace engine sweep: {p.name}")
            _sweep(rep, p)
            sections: tuple[str, ...] = ("engine_sweep", "engine_cells")
        else:
            rep = Report(stage, f"moetrace engine cell: {p.name}")
            _cell(rep, p, json.loads((p / ENGINE_CELL_JSON).read_text()))
            sections = ("engine_cell", "engine_tokens", "engine_experts")
        return write_report(rep, sections, final=out)


def _sweep(rep: Report, p: Path) -> None:
    doc = json.loads((p / ENGINE_SWEEP_JSON).read_text())
    res = pd.read_parquet(p / "engine_results.parquet")
    cap = pd.read_parquet(p / "engine_capacity.parquet") if (p / "engine_capacity.parquet").is_file() else None
    rep.h(2, "engine sweep", "engine_sweep")
    rep.p(f"llama.cpp on {doc['model']}: {doc['tokens']} tokens a cell ({doc['warmup_tokens']} warm-up), loaders "
          f"{', '.join(doc['loaders'])}, {doc['repeats']} repeats per loader and C, in a seeded random order.")
    ok = res[res["retained"]]
    if not len(ok):
        rep.notes.append("no engine cell of this sweep was retained")
        return
    pool = _expert_pool_bytes(Path(ok["cell_dir"].iloc[0]))
    caps = sorted(ok["capacity_bytes"].unique())
    half = min(caps, key=lambda c: abs(c - pool / 2)) if pool else caps[len(caps) // 2]
    at = ok[ok["capacity_bytes"] == half]
    rows = []
    for lo, g in at.groupby("loader"):
        docs = [json.loads((Path(d) / ENGINE_CELL_JSON).read_text()) for d in g["cell_dir"]]
        r = pd.DataFrame([_cell_row(x) for x in docs]).drop(columns=["loader"]).median(numeric_only=True)
        rows.append({"loader": lo, "cells": len(g), **r.to_dict()})
    half_df = pd.DataFrame(rows)
    rep.table("engine_half", half_df, f"at C = {half >> 20} MiB (nearest half the expert pool"
              f"{'' if pool is None else f' of {pool >> 20} MiB'}): medians over the repeats", max_rows=None)
    _half_findings(rep, half_df, half)
    if cap is not None and len(cap):
        shown = cap[["loader", "capacity_bytes", "repeats"]].copy()
        for name, key, scale in CELL_FIGURES:
            col = key or "readahead_share"
            shown[name] = cap[col] * scale
        rep.table("engine_capacity", shown, "per loader and C: medians over the retained repeats", max_rows=None)
    if (p / "engine_fig.png").is_file():
        rep.figure("engine_fig", (p / "engine_fig.png").read_bytes(),
                   "decode time and device bytes per token against C, per loader (range of the repeats), "
                   "the routed miss demand (LRU at C) dashed", wide=True)
    rep.h(2, "cells", "engine_cells")
    links = {"cell_dir": [os.path.relpath(Path(d) / "report" / "report.html", rep.out) for d in res["cell_dir"]]}
    rep.table("engine_results", res, "every cell (cell_dir: its own report, when written)", max_rows=None,
              links=links, fold=True)
    rep.summary.update({"kind": "engine_sweep", "half_capacity_bytes": int(half)})


def _half_findings(rep: Report, half_df: pd.DataFrame, half: int) -> None:
    for i, r in half_df.reset_index(drop=True).iterrows():
        def f(col):
            return rep.fig("engine_half", i, col)
        rep.finding(f"{r['loader']} at C = {half >> 20} MiB: ", f("device_per_token_bytes"),
                    " read per token against a routed miss demand of ", f("miss_demand_per_token_bytes"),
                    " (amplification ", f("amplification"), "); no routed expert needed ", f("unneeded_share"),
                    " of the expert pages it added, readahead added ", f("readahead_share"), " of them; ",
                    f("decode_per_token_ns"), " per token.",
                    cls="alarm" if (r["amplification"] or 0) > 2 else "")
    if len(half_df) > 1:
        by = half_df.set_index("loader")
        hi, lo = by["device_per_token_bytes"].idxmax(), by["device_per_token_bytes"].idxmin()
        ratio = by.loc[hi, "device_per_token_bytes"] / max(by.loc[lo, "device_per_token_bytes"], 1)
        rep.finding(f"{hi} reads {ratio:.0f}x the device bytes per token of {lo} at this C "
                    f"(moetrace check OUT/cells/{lo} OUT/cells/{hi} tests it capacity by capacity).")


def _cell(rep: Report, p: Path, doc: dict[str, Any]) -> None:
    rep.h(2, "engine cell", "engine_cell")
    if not doc.get("retained") or doc.get("device_bytes_per_token") is None:
        rep.notes.extend(doc.get("reasons") or ["the cell was not retained"])
        return
    row = _cell_row(doc)
    fig = pd.DataFrame([row])
    rep.table("engine_cell", fig, f"{doc.get('label')}, C = {int(row['capacity_bytes']) >> 20} MiB, over "
              f"{doc.get('measured_tokens')} measured tokens", max_rows=None)
    causes = doc.get("added_by_cause") or {}
    cause_df = pd.DataFrame({"cause": list(CAUSES), "pages": [causes.get(c, 0) for c in CAUSES]})
    cause_df.loc[len(cause_df)] = ["populate at load", doc.get("load_populate_pages", 0)]
    rep.table("engine_causes", cause_df, "expert pages added over the measured tokens, by cause (and the load's "
              "populate)", max_rows=None)

    def f(col):
        return rep.fig("engine_cell", 0, col)
    rep.finding(f"{doc.get('label')}: ", f("device_per_token_bytes"), " read per token against a routed miss "
                "demand of ", f("miss_demand_per_token_bytes"), " (amplification ", f("amplification"), "); ",
                f("unneeded_share"), " of the expert pages added no routed expert needed, ",
                rep.fig("engine_causes", 1, "pages"), " pages by readahead; ", f("decode_per_token_ns"), " per token.",
                cls="alarm" if (row["amplification"] or 0) > 2 else "")
    for name, cap in (("engine_tokens", "per token (decode time, pages added, those a routed expert needed)"),
                      ("engine_experts", "per (layer, expert) over the measured tokens, most unneeded pages first")):
        f_ = p / f"{name}.parquet"
        if f_.is_file():
            df = pd.read_parquet(f_)
            if name == "engine_experts":
                df = df.sort_values("unneeded_pages", ascending=False)
            rep.h(2, name.replace("_", " "), name)
            rep.table(name, df, cap)
    rep.summary.update({"kind": "engine_cell", "amplification": doc.get("amplification")})


__all__ = ["build_engine_report"]
