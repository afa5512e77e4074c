#!/usr/bin/env bash
# Domain shift and batching, offline (paper §3 and Fig. 5):
#  - four synthetic domains of one model, their locality and cross-domain Jaccard;
#  - a static-frequency table trained on domain 0 scored on domain 1, against LRU;
#  - the batch-4 union plan (iteration-by-iteration merge) and its simulated hit rates.
# Usage: examples/domain_shift.sh [OUT_DIR] [PRESET]   (default: /tmp/moetrace-domains, qwen3-30b-a3b)
set -euo pipefail
out=${1:-/tmp/moetrace-domains}
preset=${2:-qwen3-30b-a3b}
here=$(cd "$(dirname "$0")/.." && pwd)
mt=${MOETRACE:-$here/.venv/bin/moetrace}
mkdir -p "$out"

"$mt" trace synth --preset "$preset" --domains 4 --steps 300 --spec-accept-rate 0.1 \
    --spec-fallback-rate 0.05 -o "$out/d_{domain}.jsonl"
"$mt" trace stats "$out"/d_{0,1,2,3}.jsonl

echo "== static table from domain 0, scored on domain 1 (fair windows) =="
"$mt" sim "$out/d_1.jsonl" --geometry "$preset" --policy lru,static --static-table "$out/d_0.jsonl" \
    --budgets 8,16,32

echo "== batch-4 union plan =="
"$mt" plan compile "$out"/d_{0,1,2,3}.jsonl --geometry "$preset" -o "$out/batch4.bin"
"$mt" plan inspect "$out/batch4.bin"
"$mt" sim "$out/batch4.bin" --policy lru,belady --budgets 16,32,64 --scope both --plot "$out/batch4.png"
