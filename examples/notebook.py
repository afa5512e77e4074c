"""Read a recorded sweep the way a notebook would: moetrace.open_sweep / open_run, the
analyses as plain DataFrames, then the report. No root, no kernel.

    .venv/bin/python examples/notebook.py [SWEEP_DIR] [REPORT_DIR]

SWEEP_DIR defaults to the sweep recorded for the tests (tests/data/reports/sweep: a 128 MiB
pool at C = 128, 48 and 32 MiB); `make demo` writes another to demo-out/sweep.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pandas as pd

import moetrace
from moetrace.analyses import amplification, hitpath, reclaim
from moetrace.reports.report import build_report

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    sweep_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "data" / "reports" / "sweep"
    sweep = moetrace.open_sweep(sweep_dir)
    pd.set_option("display.width", 140)
    print("cells:", ", ".join(c.name for c in sweep.cells))
    print(reclaim.compute_sweep_reclaim(sweep.cells).to_string(index=False))

    run = min(sweep.cells, key=lambda c: c.cell["capacity_bytes"])  # the tightest cell
    print(f"\n{run.name}: tables {', '.join(run.tables)}")
    ex = amplification.compute_amplification_experts(run.tables, run.meta, plan=run.plan_path())
    print("\nexperts re-read most (pages re-added), with their amplification:")
    print(amplification.top_experts(ex, "re_added_pages", 5)[
        ["layer", "expert", "re_added_pages", "device_read_bytes", "sim_miss_pages", "amplification"]].to_string(
        index=False))
    print("\nhit path:", {k: round(v, 1) if isinstance(v, float) else v
                          for k, v in hitpath.compute_hitpath_summary(run.tables["reads"]).items()
                          if k in ("hit_only_calls", "miss_calls", "hit_only_ns_per_kib", "miss_ns_per_kib")})

    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp(prefix="moetrace-report-"))
    doc = build_report(sweep_dir, out / "report")
    print(f"\nreport: {doc['html']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
