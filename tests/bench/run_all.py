"""Run every benchmark under tests/bench (on purpose, not as timed tests).

    .venv/bin/python tests/bench/run_all.py [NAME ...]

Each bench_*.py is a script that prints its figures and the ratio against a
baseline measured in the same run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main(argv: list[str]) -> int:
    scripts = sorted(HERE.glob("bench_*.py"))
    if argv:
        scripts = [s for s in scripts if any(a in s.stem for a in argv)]
    rc = 0
    for s in scripts:
        print(f"== {s.stem} ==", flush=True)
        rc |= subprocess.call([sys.executable, str(s)])
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
