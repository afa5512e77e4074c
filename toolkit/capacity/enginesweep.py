"""Engine sweeps: engine cells (moetrace.capacity.enginecell) over capacities x repeats x loaders,
in a seeded random order, into OUT/cells/<loader>/<C>-r<i>/ (so that `moetrace check
OUT/cells/stock OUT/cells/random` compares the loaders capacity by capacity).

Writes engine_sweep.json (inputs, order, complete), engine_results.parquet/.csv (one row per
cell), engine_capacity.parquet/.csv (per loader and C: the median and range over the retained
repeats) and engine_fig.png (decode time and device bytes per token against C, each loader a
line, the routed miss demand beside). Running it again into the same OUT runs only the cells
not yet retained."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moetrace.errors import MoetraceError, UsageError
from moetrace.run.handle import ENGINE_CELL_JSON, ENGINE_SWEEP_JSON

RESULT_COLUMNS = ("loader", "capacity_bytes", "repeat", "retained", "decode_ms_per_token", "device_bytes_per_token",
                  "miss_bytes_per_token", "amplification", "unneeded_share", "readahead_share", "reason", "cell_dir")
FIGURES = ("decode_ms_per_token", "device_bytes_per_token", "miss_bytes_per_token", "amplification",
           "unneeded_share", "readahead_share")


def cell_dir(out: Path, loader: str, capacity: int, repeat: int) -> Path:
    return out / "cells" / loader / f"{capacity >> 20}MiB-r{repeat}"


def _row(doc: dict[str, Any], loader: str, cap: int, rep: int, d: Path) -> dict[str, Any]:
    causes = doc.get("added_by_cause") or {}
    added = sum(causes.values())
    return {"loader": loader, "capacity_bytes": cap, "repeat": rep, "retained": bool(doc.get("retained")),
            **{k: doc.get(k) for k in FIGURES if k != "readahead_share"},
            "readahead_share": causes.get("readahead", 0) / added if added else None,
            "reason": "; ".join(doc.get("reasons") or []) or None, "cell_dir": str(d)}


def run_engine_sweep(base, capacities: Sequence[int], repeats: int, loaders: Sequence[str], out: str | Path,
                     seed: int = 0, say: Callable[[str], None] = lambda s: None):
    """Every (loader, C, repeat) cell of ``base`` (an EngineCellSpec whose loader and capacity each
    cell replaces); the results table."""
    import dataclasses

    from moetrace.capacity.enginecell import LOADERS, run_engine_cell

    if not capacities or repeats < 1 or not loaders:
        raise UsageError("an engine sweep needs capacities, loaders and at least one repeat")
    bad = [x for x in loaders if x not in LOADERS]
    if bad:
        raise UsageError(f"--loaders {','.join(bad)}: each one of {', '.join(LOADERS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    order = [(lo, int(c), r) for lo in loaders for c in capacities for r in range(repeats)]
    random.Random(seed).shuffle(order)
    doc = {"schema": "moetrace.engine_sweep/1", "model": base.model, "capacities": [int(c) for c in capacities],
           "repeats": repeats, "loaders": list(loaders), "seed": seed, "order": order, "complete": False,
           "tokens": base.tokens, "warmup_tokens": base.warmup_tokens, "read_ahead_kb": base.read_ahead_kb}
    (out / ENGINE_SWEEP_JSON).write_text(json.dumps(doc, indent=1) + "\n")
    rows = []
    for i, (lo, cap, rep) in enumerate(order):
        d = cell_dir(out, lo, cap, rep)
        prev = _read(d)
        if prev is not None and prev.get("retained"):
            say(f"[{i + 1}/{len(order)}] {lo} C={cap >> 20}MiB r{rep}: retained before, kept")
            rows.append(_row(prev, lo, cap, rep, d))
            continue
        say(f"[{i + 1}/{len(order)}] {lo} C={cap >> 20}MiB r{rep} ...")
        shutil.rmtree(d, ignore_errors=True)  # an earlier attempt's (not retained, or cut short)
        spec = dataclasses.replace(base, loader=lo, capacity_bytes=cap, name=f"{base.name}-{i}")
        try:
            res = run_engine_cell(spec, d)
        except MoetraceError as e:
            res = {"retained": False, "reasons": [e.message]}
        rows.append(_row(res, lo, cap, rep, d))
    return finish(out, rows, doc)


def _read(d: Path) -> dict[str, Any] | None:
    try:
        return json.loads((d / ENGINE_CELL_JSON).read_text())
    except (OSError, ValueError):
        return None


def finish(out: Path, rows: list[dict[str, Any]], doc: dict[str, Any]):
    """The results and per-capacity tables, the figure, engine_sweep.json complete."""
    import pandas as pd

    res = pd.DataFrame(rows, columns=list(RESULT_COLUMNS)).sort_values(["loader", "capacity_bytes", "repeat"])
    res.to_parquet(out / "engine_results.parquet", index=False)
    res.to_csv(out / "engine_results.csv", index=False)
    cap = capacity_table(res)
    cap.to_parquet(out / "engine_capacity.parquet", index=False)
    cap.to_csv(out / "engine_capacity.csv", index=False)
    if len(cap):
        from moetrace.reports.figures import engine_sweep_png

        (out / "engine_fig.png").write_bytes(engine_sweep_png(cap))
    doc["complete"] = True
    doc["retained"] = int(res["retained"].sum())
    (out / ENGINE_SWEEP_JSON).write_text(json.dumps(doc, indent=1) + "\n")
    return res


def capacity_table(res):
    """Per (loader, C): the retained repeats' median, min and max of each figure."""
    import pandas as pd

    ok = res[res["retained"]]
    rows = []
    for (lo, cap), g in ok.groupby(["loader", "capacity_bytes"]):
        r: dict[str, Any] = {"loader": lo, "capacity_bytes": int(cap), "repeats": len(g)}
        for f in FIGURES:
            v = pd.to_numeric(g[f], errors="coerce").dropna()
            r[f] = float(v.median()) if len(v) else None
            r[f"{f}_min"] = float(v.min()) if len(v) else None
            r[f"{f}_max"] = float(v.max()) if len(v) else None
        rows.append(r)
    return pd.DataFrame(rows)


__all__ = ["capacity_table", "cell_dir", "finish", "run_engine_sweep"]
