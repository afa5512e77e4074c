#!/usr/bin/env bash
# How far to trust `moetrace check` on this machine, measured: identical cells (A/A) in the kernel
# lab, then a capacity cut to an eighth that a check must name. The cells are lab_matrix.sh's
# (C = 320 MiB over a 512 MiB pool, pread, 1 warm-up + 2 measured passes, recorded) on 6.12 and 6.1
# x MGLRU on/off x {cgroup wall, balloon locking 81 %, vm-memory} x 6 repeats: 72 cells, then 3
# cells at C = 40 MiB (6.12, MGLRU on, cgroup). 59-116 s each under TCG (measured): about 2 h.
# Six repeats a group give 30 one-cell A/A pairs and 20 comparisons of 3 cells against 3 (the
# cell-level test of a check of repeats); `calibrate` prints both, the thresholds that keep the
# pairs quiet and how they fare held out, and det(3): the smallest change 3 repeats detect.
# Stop it any time and run it again with the same OUT_DIR: it resumes, keeping finished cells.
# Out: OUT_DIR/calibration.txt, OUT_DIR/thresholds.toml, OUT_DIR/check-c8.txt. Run by hand as
# root (not by the test suite).
# Usage: examples/lab_calibrate.sh [OUT_DIR]   (default: /var/tmp/moetrace-calibrate)
set -euo pipefail
out=${1:-/var/tmp/moetrace-calibrate}
here=$(cd "$(dirname "$0")/.." && pwd)
mt=${MOETRACE:-$here/.venv/bin/moetrace}
. "$here/examples/lab_inputs.sh"
spec aa '["6.12", "6.1"]' '["on", "off"]' '["cgroup", "balloon:0.81", "vm-memory"]' 320MiB 6
spec c8 '["6.12"]' '["on"]' '["cgroup"]' 40MiB 3
run aa
run c8
"$mt" calibrate "$out/aa" --write-thresholds "$out/thresholds.toml" | tee "$out/calibration.txt"
# the C/8 check: 3 of the A/A group's cells against the 3 cells at C / 8, as a developer would run it
rm -rf "$out/check-base" "$out/check-cand" && mkdir -p "$out/check-base" "$out/check-cand"
for r in 0 1 2; do
  ln -s "$out/aa/cells/6.12-mglru-on/cgroup-320MiB-r$r/cell" "$out/check-base/r$r"
  ln -s "$out/c8/cells/6.12-mglru-on/cgroup-40MiB-r$r/cell" "$out/check-cand/r$r"
done
set +e
"$mt" check "$out/check-base" "$out/check-cand" | tee "$out/check-c8.txt"
status=${PIPESTATUS[0]}
set -e
echo "check C/8: exit $status (1: regression named)"
