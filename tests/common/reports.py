"""What the report and check tests share: the recorded golden inputs and their maker."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "reports"
PLAN = DATA / "sweep" / "plan.bin"


def _make_golden():
    spec = importlib.util.spec_from_file_location("make_golden", DATA / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: tests/data/reports/make_golden.py as a module (INPUTS, CHECKS, golden_csv, report_tables, ...)
MG = _make_golden()

__all__ = ["DATA", "MG", "PLAN", "ROOT"]
