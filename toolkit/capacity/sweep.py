"""A capacity sweep: cells over C x repeats in randomized (seeded) order (the paper's Table 2 /
Fig. 2 data). The loop only: each cell is :func:`moetrace.capacity.cell.run_cell`; the tables
and the figure are :func:`moetrace.reports.sweep.write_results`; ``moetrace sweep`` is the CLI."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import click

from moetrace.errors import CellInterrupted

CELL_COLUMNS = ["capacity", "capacity_bytes", "repeat", "order", "cell_dir", "mechanism", "mode", "retained",
                "reasons", "iteration_time_median_ns", "iteration_time_spread", "measured_iterations",
                "device_bytes", "device_bytes_per_iteration", "miss_bytes_per_iteration", "amplification",
                "budget_experts", "peak_memory_bytes", "oom_kill", "vmlck_at_loop_entry_bytes",
                "anon_at_loop_entry_bytes", "measured_hints_submitted", "measured_hints_completed",
                "outside_evicted_pages", "flags", "effective_capacity_bytes", "lru_hit_rate", "host"]


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


def cell_row(res: dict, label: str, repeat: int, order: int, cell_dir: str) -> dict:
    """One results row from a cell's result (cell.json)."""
    sim = res.get("simulated") or {}
    return {
        "capacity": label, "capacity_bytes": res.get("capacity_bytes"), "repeat": repeat, "order": order,
        "cell_dir": cell_dir, "mechanism": res.get("mechanism"), "mode": res.get("mode"),
        "retained": bool(res.get("retained")), "reasons": "; ".join(res.get("reasons", [])),
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


def effective_capacity(res: dict) -> int | None:
    """What the pool's pages could occupy at loop entry, beside nominal C: under a cgroup wall the
    limit less the scope's anonymous memory; otherwise the machine's MemAvailable (free and
    reclaimable memory, the pool's cached pages included)."""
    if res.get("mechanism") == "cgroup":
        return res.get("file_capacity_at_loop_entry_bytes")
    return res.get("mem_available_at_loop_entry_bytes")


@dataclass
class SweepOutcome:
    rows: list[dict]
    jobs: int
    #: the CellInterrupted that stopped the sweep (Ctrl-C), or None
    stopped: CellInterrupted | None = None


def run_sweep(specs: dict[str, Any], caps: list[tuple[str, int]], repeats: int, seed: int, out: Path,
              plan_path: str, warmup: int, passes: int,
              progress: Callable[[int, int, str | None], None] | None = None,
              on_phase: Callable[[str], None] | None = None) -> SweepOutcome:
    """Run every (capacity, repeat) cell in a seeded random order into ``out/cells/<C>-r<i>``.

    ``specs``: capacity label -> CellSpec. A cell whose setup fails is a row that is not
    retained, with its reason, and the sweep goes on; Ctrl-C (CellInterrupted, after the
    running cell cleaned up) stops it with the rows so far. ``progress(done, total, current)``,
    when given, is called before each cell with the cells done so far and the next cell's
    name (``<C>-r<i>``), and once after the last with ``current`` None; ``on_phase`` is
    passed to each :func:`run_cell`. None (the default): nothing is reported."""
    from moetrace.capacity.cell import miss_curve, run_cell

    (out / "cells").mkdir(parents=True, exist_ok=True)
    jobs = [(label, r) for label, _ in caps for r in range(repeats)]
    random.Random(seed).shuffle(jobs)
    curve = miss_curve(plan_path, warmup, passes)
    rows: list[dict] = []
    outcome = SweepOutcome(rows, len(jobs))

    def report(done: int, total: int, current: str | None) -> None:
        if progress is not None:
            try:
                progress(done, total, current)
            except Exception:  # noqa: BLE001 - a failing display never stops the sweep
                pass
    try:
        for order, (label, r) in enumerate(jobs):
            report(order, len(jobs), f"{label}-r{r}")
            cdir = out / "cells" / f"{label}-r{r}"
            spec = specs[label]
            try:
                res = run_cell(spec, cdir, curve=curve, on_phase=on_phase)
            except click.ClickException as e:  # setup failed for this cell: record it, go on
                res = {"capacity_bytes": spec.capacity_bytes, "mechanism": spec.mechanism, "mode": spec.mode,
                       "retained": False, "reasons": [f"error: {e.format_message()}"]}
            rows.append(cell_row(res, label, r, order, str(cdir)))
        report(len(jobs), len(jobs), None)
    except CellInterrupted as e:
        outcome.stopped = e
    return outcome
