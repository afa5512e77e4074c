# Sourced by the lab examples (lab_matrix.sh, lab_calibrate.sh): the inputs every matrix cell
# replays, made once in $out: a 512 MiB pool (1 layer x 512 experts x 1 MiB, files), a low-reuse
# zipf-0.6 trace of 128 steps, k = 8, and its plan. Needs $out and $mt (the moetrace command).
geo=(--layers 1 --experts 512 --k 8 --expert-bytes 1MiB)
mkdir -p "$out"
if [ ! -f "$out/plan.bin" ]; then
  rm -rf "$out/pool"
  "$mt" pool create "$out/pool" "${geo[@]}" --layout files
  "$mt" trace synth --layers 1 --experts 512 --k 8 --steps 128 --zipf 0.6 --reuse 0.02 --reuse-8 0.1 \
      --reuse-64 0.3 --seed 7 -o "$out/t.jsonl"
  "$mt" plan compile "$out/t.jsonl" "${geo[@]}" -o "$out/plan.bin"
fi
