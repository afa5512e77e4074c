"""Record the report tests' inputs on this machine (root, the compiled probes), then write the golden outputs.

    sudo .venv/bin/python tests/data/reports/make_golden.py record   # re-record the inputs (~2 min)
    .venv/bin/python tests/data/reports/make_golden.py golden         # rewrite expected/ from them

Inputs (committed, a few MiB): a 128-expert pool (8 layers x 16 experts x 1 MiB = 128 MiB),
a 30-step synthetic trace (30 % speculative fallbacks: a layer read twice in an iteration)
compiled to plan.bin, warm-up + 5 measured passes, and
  sweep/   `moetrace sweep --record` at C = 128 MiB (the pool fits), 48 MiB and 32 MiB (cgroup
           wall: the pool is 4x the smallest C), one repeat each; sweep/plan.bin is the plan
  pinned/  `moetrace cell --mode pinned --record` at C = 128 MiB (the arena holds the pool): the
           same plan and capacity as sweep/cells/128MiB-r0, for the differential flame graph
  run/     `moetrace record --stream-events -- replay` (no capacity: a plain recording)
The pool itself is deleted. expected/ holds the report tables of each input as CSV: a
change to an analysis that alters a figure shows as a diff there (tests/unit/test_reports.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
L, E, K, STEPS = 8, 16, 4, 30
INPUTS = ("sweep", "pinned", "run")


def moetrace(*args) -> None:
    subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *map(str, args)], check=True,
                   env={**os.environ, "CI": "1"})


def record() -> None:
    if os.geteuid() != 0:
        sys.exit("recording needs root (BPF, cgroups)")
    work = Path(tempfile.mkdtemp(prefix="moetrace-golden-", dir="/var/tmp"))
    try:
        pool, plan = work / "pool", work / "plan.bin"
        geo = ["--layers", L, "--experts", E, "--k", K, "--expert-bytes", "1MiB"]
        # speculative fallbacks read a layer twice in one iteration: re-reads within an iteration
        moetrace("trace", "synth", "--layers", L, "--experts", E, "--k", K, "--steps", STEPS, "--seed", 1,
                 "--spec-fallback-rate", "0.3",
                 "-o", work / "t.jsonl")
        moetrace("plan", "compile", work / "t.jsonl", *geo, "-o", plan)
        moetrace("pool", "create", pool, *geo, "--force")
        for d in INPUTS:
            shutil.rmtree(HERE / d, ignore_errors=True)
        # headroom: the replay's own anonymous memory (~26 MiB at loop entry, more while it imports)
        common = ["--plan", plan, "--pool", pool, "--threads", 2, "--record", "--passes", 5]
        moetrace("sweep", *common, "--headroom", "40MiB", "--capacities", "128MiB,48MiB,32MiB", "--repeats", 1,
                 "--out", HERE / "sweep")
        shutil.copy(plan, HERE / "sweep" / "plan.bin")
        moetrace("cell", *common, "--capacity", "128MiB", "--mode", "pinned", "--headroom", "96MiB",
                 "--out", HERE / "pinned")
        subprocess.run([sys.executable, "-m", "moetrace.cli.record", "--out", HERE / "run", "--stream-events",
                        "--", sys.executable, "-m", "moetrace.cli.replay", plan, "--pool", pool, "--warmup", "1",
                        "--passes", "1", "--threads", "2"], check=True)
        for p in HERE.rglob("*"):  # readable by the test user (run directories are made 0700 / 0600)
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
    finally:
        shutil.rmtree(work, ignore_errors=True)


GOLDEN_SECTIONS = ("amp", "hitpath", "age", "reclaim")


def golden_csv(df) -> str:
    """A table as the golden files hold it: CSV, NA as 'NA', floats to 9 significant digits."""
    return df.to_csv(index=False, na_rep="NA", float_format="%.9g", lineterminator="\n")


def report_tables(name: str, tmp: Path) -> dict:
    """The report tables of input ``name`` (built into ``tmp``)."""
    import pandas as pd

    from moetrace.reports.report import build_report

    doc = build_report(HERE / name, tmp / "report", sections=GOLDEN_SECTIONS, plan=HERE / "sweep" / "plan.bin")
    return {t: pd.read_parquet(tmp / "report" / "tables" / f"{t}.parquet") for t in doc["tables"]}


#: `moetrace check` pairs with golden comparison tables: (name, base, candidate)
CHECKS = (("same_cell", "sweep/cells/48MiB-r0", "sweep/cells/48MiB-r0"),
          ("smaller_capacity", "sweep/cells/48MiB-r0", "sweep/cells/32MiB-r0"),
          ("pagecache_vs_pinned", "sweep/cells/128MiB-r0", "pinned"))


def check_tables(name: str) -> dict:
    """The comparison tables of one CHECKS pair, by group."""
    from moetrace.reports.check import run_check

    _n, base, cand = next(c for c in CHECKS if c[0] == name)
    return run_check(HERE / base, HERE / cand).tables


def golden() -> None:
    exp = HERE / "expected"
    shutil.rmtree(exp, ignore_errors=True)
    for d in INPUTS:
        with tempfile.TemporaryDirectory() as tmp:
            (exp / d).mkdir(parents=True)
            for t, df in report_tables(d, Path(tmp)).items():
                (exp / d / f"{t}.csv").write_text(golden_csv(df))
    (exp / "check").mkdir()
    for name, _b, _c in CHECKS:
        for g, df in check_tables(name).items():
            (exp / "check" / f"{name}.csv").write_text(f"# group: {g}\n" + golden_csv(df))


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "golden"
    if what == "record":
        record()
        golden()
    elif what == "golden":
        golden()
    else:
        sys.exit(__doc__)
