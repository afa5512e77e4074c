"""Record a replay with the eBPF probes, then read the run directory as any analysis would.

    sudo .venv/bin/python examples/record_run.py [WORK_DIR]

Builds a 2-layer x 32-expert x 1 MiB pool (64 MiB) and a 3-iteration plan, drops the
pool from the page cache, runs ``moetrace record -- replay`` (every default probe this
kernel offers), then opens the run directory with :func:`moetrace.open_run` (no
root needed for that part) and prints: what each iteration added to the page cache
(epochs), the read calls by class (reads), the hottest kernel frames (stacks) and each
probe's kernel CPU time (--bpf-stats). The pool is removed at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

import moetrace
from moetrace.inputs.trace import write_jsonl

L, E = 2, 32


def cli(*args) -> None:
    r = subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *map(str, args)],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"moetrace {args[0]} failed: {r.stderr.strip()}")


def main() -> int:
    if os.geteuid() != 0:
        print("recording needs root (BPF): sudo .venv/bin/python examples/record_run.py", file=sys.stderr)
        return 2
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="moetrace-example-",
                                                                             dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    pool, run = work / "pool", work / "run"
    try:
        cli("pool", "create", pool, "--layers", L, "--experts", E, "--k", E, "--expert-bytes", "1MiB", "--force")
        write_jsonl([(s, layer, list(range(E))) for s in range(3) for layer in range(L)], work / "t.jsonl")
        cli("plan", "compile", work / "t.jsonl", "--layers", L, "--experts", E, "--k", E, "--expert-bytes", "1MiB",
            "-o", work / "plan.bin")
        for p in pool.rglob("*.bin"):  # cold start: the first iteration misses, the rest hit
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)  # a pool just written is dirty: DONTNEED drops clean pages only
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        shutil.rmtree(run, ignore_errors=True)
        r = subprocess.run([sys.executable, "-m", "moetrace.cli.record", "--out", run, "--missing-probes", "warn",
                            "--bpf-stats", "--", sys.executable, "-m", "moetrace.cli.replay", work / "plan.bin",
                            "--pool", pool, "--warmup", "1", "--passes", "1", "--threads", "2"],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"record failed: {r.stderr.strip()[-2000:]}")

        # -- the analysis side: a run directory, no kernel needed from here on
        recording = moetrace.open_run(run)  # tables read on first use
        doc, t = recording.manifest, recording.tables
        print(f"run {run}: complete={doc['complete']}, probes recorded: "
              + ", ".join(p for p, a in doc["attach_plan"].items() if a["recorded"]))
        meta = t["epochs"].set_index("epoch")
        ee = t["expert_epochs"]
        per = ee[ee["kind"] == "expert"].groupby("epoch")[["added_pages", "re_added_pages"]].sum()
        per = meta[["phase", "repeat", "iteration"]].join(per).fillna({"added_pages": 0, "re_added_pages": 0})
        print("\nexpert pages added to the page cache per epoch (one per replay iteration):")
        print(per.to_string())
        if "reads" in t:
            rd = t["reads"]
            e = rd[rd["kind"] == "expert"] if "kind" in rd else rd
            cols = [c for c in ("calls", "hit_only_calls", "miss_calls", "added_pages") if c in e]
            print("\nread calls of the replay, summed over experts:", e[cols].sum().to_dict())
        if "stacks" in t:
            st = t["stacks"]
            frames = st.assign(leaf=st["stack"].str.split(";").str[-1]).groupby("leaf")["samples"].sum()
            print("\nhottest leaf frames:", frames.sort_values(ascending=False).head(5).to_dict())
        rt = doc.get("bpf_runtime") or {}
        if rt.get("stats_enabled"):
            print("\nBPF run time per probe (ns):", rt["per_probe_run_time_ns"])
        pd.set_option("display.width", 120)
        return 0
    finally:
        shutil.rmtree(pool, ignore_errors=True)  # keep the run directory, drop the 64 MiB pool


if __name__ == "__main__":
    sys.exit(main())
