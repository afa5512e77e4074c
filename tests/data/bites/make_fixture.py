"""Cut the bite-analysis fixture of this folder out of a real lab run.

The run (kept at /var/tmp/bites/bx1 on the machine that recorded it; not committed): Debian
6.12.95 under TCG, MGLRU on, 512 MiB of guest RAM, no memory cgroup (global pressure: kswapd and
direct reclaim), a pool of 1 layer x 96 experts x 4 MiB (files layout, on the lab's virtio-blk
disk) and a 40-iteration plan of 12 Zipf-drawn experts each, replayed with 2 threads under the
sampler and the recorder:

    moetrace lab run --kernel 6.12 --mglru on --memory 512M --accel tcg --pool POOL --out RUN -- \\
      moetrace lab sample --out /tmp/lab/sampler -- \\
        moetrace record --out /tmp/lab/run --pool POOL --probes vmscan,pagecache,reads,mglru --stream-events -- \\
          moetrace replay plan.bin --pool POOL --threads 2 --warmup 0 --passes 1

The fixture keeps the sampler's rows with t in [T0, T1] (a max_seq advance, the last kswapd
passes, direct reclaim draining the oldest generation and a min_seq advance) unchanged, its
zoneinfo.json and sampler.json as written, the vmscan probe's records in the same window as CSV
(time_ns is the guest's CLOCK_MONOTONIC, as sampler.json's t0_monotonic_ns) and the recording's
armed interval (manifest.json ``interval``: its probes counted only inside it; the recorder
disarmed at t = 44.3 s, the sampler went on to the end of the command).

Run from the repository root: python tests/data/bites/make_fixture.py RUN
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pandas as pd

HERE = Path(__file__).parent / "6.12-global"
T0, T1 = 38.0, 64.5


def cut_csv(src: Path, dst: Path) -> None:
    """The rows of a sampler CSV with t in [T0, T1], byte for byte."""
    lines = src.read_text().splitlines(keepends=True)
    keep = [ln for ln in lines[1:] if T0 <= float(ln.split(",", 1)[0]) <= T1]
    dst.write_text(lines[0] + "".join(keep))


def main(run: Path) -> None:
    out = HERE / "sampler"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("vmstat.csv", "memfree.csv", "lru_gen.csv"):
        cut_csv(run / "sampler" / name, out / name)
    for name in ("zoneinfo.json", "sampler.json"):
        shutil.copy(run / "sampler" / name, out / name)
    t0 = json.loads((run / "sampler" / "sampler.json").read_text())["t0_monotonic_ns"]
    lo, hi = t0 + int(T0 * 1e9), t0 + int(T1 * 1e9)
    for table in ("vmscan_wakes", "vmscan_batches"):
        df = pd.read_parquet(run / "run" / f"{table}.parquet")
        df[(df["time_ns"] >= lo) & (df["time_ns"] <= hi)].to_csv(HERE / f"{table}.csv", index=False)
    iv = json.loads((run / "run" / "manifest.json").read_text())["interval"]
    (HERE / "interval.json").write_text(json.dumps({k: iv[k] for k in ("armed_ns", "disarmed_ns")}) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
