"""A capacity sweep: cells over C x repeats in randomized (seeded) order (the paper's Table 2 /
Fig. 2 data). Each cell is a job (:mod:`moetrace.capacity.jobs`, run by
:func:`moetrace.capacity.cell.run_cell`) that :mod:`moetrace.capacity.dispatch` submits here or to
Slurm; the results are merged from the cell directories (:func:`merged_rows`); the tables and the
figure are :func:`moetrace.reports.sweep.write_results`; ``moetrace sweep`` is the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from moetrace.errors import CellInterrupted
from moetrace.run.documents import SWEEP_SCHEMA, Cell, SweepSpec

CELL_COLUMNS = ["capacity", "capacity_bytes", "repeat", "order", "cell_dir", "mechanism", "mode", "retained",
                "reasons", "iteration_time_median_ns", "iteration_time_spread", "measured_iterations",
                "device_bytes", "device_bytes_per_iteration", "miss_bytes_per_iteration", "amplification",
                "budget_experts", "peak_memory_bytes", "oom_kill", "vmlck_at_loop_entry_bytes",
                "anon_at_loop_entry_bytes", "measured_hints_submitted", "measured_hints_completed",
                "outside_evicted_pages", "flags", "effective_capacity_bytes", "lru_hit_rate", "host", "host_order"]


def parse_capacities(text: str) -> list[tuple[str, int]]:
    """'2.2GiB,1GiB,512MiB' -> [(label, bytes), ...] (labels as written, for directory names)."""
    from moetrace.errors import UsageError
    from moetrace.inputs.geometry import parse_bytes

    out = []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        out.append((re.sub(r"[^A-Za-z0-9.]+", "_", part), parse_bytes(part)))
    if not out:
        raise UsageError("--capacities is empty", hint="e.g. --capacities 2.2GiB,1GiB,512MiB,256MiB")
    if len({b for _, b in out}) != len(out):
        raise UsageError(f"--capacities repeats a capacity: {text}")
    return out


def cell_row(res: Cell, label: str, repeat: int, order: int, cell_dir: str) -> dict:
    """One results row from a cell's result (cell.json; a matrix cell whose guest brought none
    back: only ``retained`` and ``reasons``)."""
    sim = res.get("simulated") or {}
    return {
        "capacity": label, "capacity_bytes": res.get("capacity_bytes"), "repeat": repeat, "order": order,
        "cell_dir": cell_dir, "mechanism": res.get("mechanism"), "mode": res.get("mode"),
        "retained": bool(res.get("retained")), "reasons": "; ".join(res["reasons"]),
        "iteration_time_median_ns": res.get("iteration_time_median_ns"),
        "iteration_time_spread": res.get("iteration_time_spread"),
        "measured_iterations": res.get("measured_iterations"),
        "device_bytes": res.get("device_bytes"),
        "device_bytes_per_iteration": res.get("device_bytes_per_iteration"),
        "miss_bytes_per_iteration": res.get("miss_bytes_per_iteration"),
        "amplification": res.get("amplification"), "budget_experts": sim.get("budget_experts"),
        "peak_memory_bytes": res.get("peak_memory_bytes"),
        "oom_kill": (res.get("oom_events") or {}).get("oom_kill"),
        "vmlck_at_loop_entry_bytes": res.get("vmlck_at_loop_entry_bytes"),
        "anon_at_loop_entry_bytes": res.get("anon_at_loop_entry_bytes"),
        "measured_hints_submitted": res.get("measured_hints_submitted"),
        "measured_hints_completed": res.get("measured_hints_completed"),
        "outside_evicted_pages": (res.get("outside_evictions") or {}).get("pages"),
        "flags": "; ".join(res.get("flags", [])),
        "effective_capacity_bytes": effective_capacity(res), "lru_hit_rate": sim.get("hit_rate"),
        "host": (res.get("host") or {}).get("name"),
    }


def effective_capacity(res: Cell) -> int | None:
    """What the pool's pages could occupy at loop entry, beside nominal C: under a cgroup wall the
    limit less the scope's anonymous memory; otherwise the machine's MemAvailable (free and
    reclaimable memory, the pool's cached pages included)."""
    if res.get("mechanism") == "cgroup":
        return res.get("file_capacity_at_loop_entry_bytes")
    return res.get("mem_available_at_loop_entry_bytes")


def sweep_doc(specs: dict[str, Any], caps: list[tuple[str, int]], repeats: int, seed: int) -> SweepSpec:
    """What identifies a sweep: the cells' common inputs (absolute paths, the plan's key), the
    capacities, repeats and seed; a directory holds the cells of one such sweep."""
    from moetrace.capacity.cell import plan_key

    first = asdict(next(iter(specs.values())))
    common = {k: v for k, v in first.items() if k not in ("capacity_bytes", "python", "name")}
    common["plan_key"] = plan_key(first["plan"], first["warmup"], first["passes"])
    return {"cells": common, "capacities": [[label, int(c)] for label, c in caps], "repeats": repeats, "seed": seed}


def absolute(spec):
    """The spec with absolute paths (a job may run in another working directory, on another node)."""
    fix = {k: os.path.abspath(getattr(spec, k)) for k in ("plan", "pool") if getattr(spec, k)}
    if spec.freq_table not in (None, "oracle"):
        fix["freq_table"] = os.path.abspath(spec.freq_table)
    return replace(spec, **fix)


def prepare_sweep(out: Path, specs: dict[str, Any], caps: list[tuple[str, int]], repeats: int, seed: int,
                  stage_pool: str | None = None) -> list:
    """The sweep's cells as jobs, in the seeded randomized order: sweep.json, jobs/NAME.json and
    miss_curve.npz written (or, for a directory that holds this sweep already, kept: the cells
    retained there are not run again). A directory holding another sweep, or anything but a
    sweep, is refused."""
    from moetrace.capacity.cell import ensure_miss_curve
    from moetrace.capacity.jobs import CellJob
    from moetrace.errors import UsageError
    from moetrace.jsonutil import write_json
    from moetrace.run.metadata import write_sweep_meta

    out = Path(out).resolve()
    specs = {label: absolute(s) for label, s in specs.items()}
    doc = sweep_doc(specs, caps, repeats, seed)
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]
    meta = out / "sweep.json"
    if meta.exists():
        from moetrace.run.metadata import read_sweep_meta

        old = read_sweep_meta(meta)
        if old["digest"] != digest:
            was = old["spec"]
            diff = sorted(k for k in set(was) | set(doc) if was.get(k) != doc.get(k))
            raise UsageError(f"{out} holds another sweep (differs in: {', '.join(diff) or 'its digest'})",
                             hint="re-run with the options it was started with, or give another --out")
    elif out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} is not empty and holds no sweep.json", hint="give a new or empty directory as --out")
    order = [(label, r) for label, _ in caps for r in range(repeats)]
    random.Random(seed).shuffle(order)
    out.mkdir(parents=True, exist_ok=True)
    first = specs[caps[0][0]]
    curve = ensure_miss_curve(out / "miss_curve.npz", first.plan, first.warmup, first.passes)
    jobs = [CellJob(f"{label}-r{r}", label, r, i, specs[label], str(out), str(curve), stage_pool)
            for i, (label, r) in enumerate(order)]
    if not meta.exists():
        write_sweep_meta(meta, {"schema": SWEEP_SCHEMA, "digest": digest, "spec": doc,
                          "cells": [{"name": j.name, "capacity": j.label, "repeat": j.repeat, "order": j.order,
                                     "dir": f"cells/{j.name}"} for j in jobs]})
    for j in jobs:
        write_json(j.job_path, j.as_dict())
    return jobs


def merged_rows(out: str | os.PathLike) -> list[dict]:
    """One results row per cell that ran (cell.json present), in the sweep's order, whatever the
    order the jobs finished in; ``host_order`` is the order the cells started on their host."""
    from moetrace.capacity.jobs import last_run
    from moetrace.run.metadata import read_cell, read_sweep_meta

    out = Path(out)
    meta = read_sweep_meta(out / "sweep.json")
    rows, started = [], {}
    for c in meta["cells"]:
        path = out / c["dir"] / "cell.json"
        if not path.is_file():  # not run yet (or stopped before its cell.json)
            continue
        res = read_cell(path)
        row = cell_row(res, c["capacity"], c["repeat"], c["order"], str(out / c["dir"]))
        ran = last_run(out, c["name"])
        row["host"] = row.get("host") or ran.get("host")
        started[c["name"]] = (row["host"], ran.get("started_at") or 0.0)
        rows.append(row)
    for host in {h for h, _ in started.values()}:
        mine = sorted((t, name) for name, (h, t) in started.items() if h == host)
        rank = {name: i for i, (_, name) in enumerate(mine)}
        for row in rows:
            name = Path(row["cell_dir"]).name
            if started.get(name, (None,))[0] == host:
                row["host_order"] = rank[name]
    return rows


@dataclass
class SweepOutcome:
    rows: list[dict]
    jobs: int
    #: the CellInterrupted that stopped the sweep (Ctrl-C), or None
    stopped: CellInterrupted | None = None
    #: the cells run this time (the others were retained before), the jobs submitted (a
    #: resubmission counted again), and the cells whose jobs failed twice (name -> why)
    ran: list[str] = field(default_factory=list)
    submitted: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def run_sweep(specs: dict[str, Any], caps: list[tuple[str, int]], repeats: int, seed: int, out: Path,
              executor=None, on_status=None, on_event=None, stage_pool: str | None = None,
              on_end=None) -> SweepOutcome:
    """Run every (capacity, repeat) cell in a seeded random order into ``out/cells/<C>-r<i>``, each
    a job (:mod:`moetrace.capacity.jobs`) on ``executor`` (default: local subprocesses); cells
    retained in ``out`` before are not run again. ``specs``: capacity label -> CellSpec. A cell
    whose setup fails is a row that is not retained, with its reason; a job that fails is
    resubmitted once. Ctrl-C (CellInterrupted: the running jobs cancelled and cleaned up) stops
    it with the rows so far. ``on_status`` / ``on_event`` / ``on_end``: see
    :func:`moetrace.capacity.dispatch.dispatch`."""
    from moetrace.capacity.dispatch import LocalExecutor, dispatch
    out = Path(out).resolve()
    jobs = prepare_sweep(out, specs, caps, repeats, seed, stage_pool)
    todo = [j for j in jobs if not j.finished()]
    res = dispatch(todo, executor or LocalExecutor(out), on_status=on_status, on_event=on_event, on_end=on_end)
    return SweepOutcome(merged_rows(out), len(jobs), res.stopped, [j.name for j in todo], res.submitted, res.failed)
