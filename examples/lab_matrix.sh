#!/usr/bin/env bash
# The paper's §5 matrix in the kernel lab: 6.12, 6.1 and the newest Debian kernel the lab set-up
# unpacked (7.2) x MGLRU on/off (each a fresh boot, never a runtime toggle) x {cgroup wall,
# balloon locking 74 / 81 / 90 % of the guest, vm-memory (the paper's mem= boot)} x 3 repeats,
# C = 320 MiB over a 512 MiB pool (1 layer x 512 experts x 1 MiB, 8 per step, 128 steps of a
# low-reuse trace: simulated miss demand 53 % of the reads), pread replay, 1 warm-up + 2 measured
# passes, every cell recorded with the default probes. 90 cells, 84-134 s each under TCG
# (measured, 6.12 / 6.1 / 7.2): about 2 h 50 min. Stop it any time (Ctrl-C, or a kill): run the script
# again with the same OUT_DIR and it resumes, keeping every finished cell.
# Out: OUT_DIR/m/matrix_summary.md (the table), OUT_DIR/m/matrix_fig3.png (Fig. 3),
# OUT_DIR/m/matrix_cells.csv (a row per cell). `moetrace lab matrix ... --report` rewrites them
# from the cells finished so far, also while the matrix runs. Not run by the test suite (the CI
# runs a two-cell matrix); run by hand as root.
# Usage: examples/lab_matrix.sh [OUT_DIR]   (default: /var/tmp/moetrace-matrix)
set -euo pipefail
out=${1:-/var/tmp/moetrace-matrix}
here=$(cd "$(dirname "$0")/.." && pwd)
mt=${MOETRACE:-$here/.venv/bin/moetrace}
. "$here/examples/lab_inputs.sh"
spec matrix '["6.12", "6.1", "newest"]' '["on", "off"]' \
    '["cgroup", "balloon:0.74", "balloon:0.81", "balloon:0.9", "vm-memory"]' 320MiB 3
run matrix m
