#!/usr/bin/env bash
# A capacity sweep whose cells run as Slurm jobs (issue 22): a 16 MiB pool (4 layers x 16 experts
# x 256 KiB), a 40-step trace, C = 8 and 4 MiB x 2 repeats under the cgroup wall, every cell a job
# submitted with `--executor slurm` (one node, exclusive), the results merged and reported.
# With SLURM_CONF set, the cluster it names is used; without, a single-node cluster is started on
# this machine for the run (scripts/slurm-local.sh up) and stopped after (down), also on error and
# Ctrl-C. Root (the cells create memory cgroups). About 30 s.
# Out: OUT_DIR/sweep (results.csv, capacity.csv, fig2.png, cells/, jobs/), OUT_DIR/report.
# Usage: examples/sweep_slurm.sh [OUT_DIR]   (default: /var/tmp/moetrace-sweep-slurm; must be new)
set -euo pipefail
out=${1:-/var/tmp/moetrace-sweep-slurm}
here=$(cd "$(dirname "$0")/.." && pwd)
mt=${MOETRACE:-$here/.venv/bin/moetrace}
if [ -e "$out/sweep" ]; then
  echo "sweep_slurm: $out/sweep exists: give a new OUT_DIR (or run the sweep command below into it to resume)" >&2
  exit 2
fi
mkdir -p "$out"
if [ -z "${SLURM_CONF:-}" ]; then
  eval "$("$here/scripts/slurm-local.sh" up)"
  trap '"$here/scripts/slurm-local.sh" down' EXIT
  trap 'exit 130' INT TERM
fi
geo=(--layers 4 --experts 16 --k 2)
"$mt" pool create "$out/pool" "${geo[@]}" --expert-bytes 256KiB --force --json > /dev/null
"$mt" trace synth "${geo[@]}" --steps 40 --seed 3 -o "$out/trace.jsonl" --json > /dev/null
"$mt" plan compile "$out/trace.jsonl" "${geo[@]}" --expert-bytes 256KiB -o "$out/plan.bin" --json > /dev/null
"$mt" sweep --plan "$out/plan.bin" --pool "$out/pool" --capacities 8MiB,4MiB --repeats 2 --passes 3 \
    --executor slurm --slurm-time 10 --out "$out/sweep"
"$mt" report "$out/sweep" --out "$out/report" --no-cell-reports | head -3
rm -rf "$out/pool"
echo "sweep_slurm: $out/sweep/results.csv, $out/report/report.html"
