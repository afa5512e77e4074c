# Sourced by the lab examples (lab_matrix.sh, lab_calibrate.sh): spec and run, and the inputs every matrix cell
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
# spec NAME KERNELS MGLRU MECHANISMS CAPACITY REPEATS: $out/NAME.toml, every cell replaying the plan
# above with pread (pagecache), 1 warm-up + 2 measured passes
spec() {
  cat > "$out/$1.toml" <<TOML
kernels = $2
mglru = $3
mechanisms = $4
capacities = ["$5"]
repeats = $6
plan = "plan.bin"
pool = "pool"
mode = "pagecache"
warmup = 1
passes = 2
timeout = 480
TOML
}
# run NAME [DIR]: the matrix of $out/NAME.toml in $out/DIR (default NAME), resumed when started before
run() {
  local resume=()
  local dir=${2:-$1}
  [ -f "$out/$dir/matrix.json" ] && resume=(--resume)
  "$mt" lab matrix "$out/$1.toml" --out "$out/$dir" "${resume[@]}"
}
