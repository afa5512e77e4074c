#!/usr/bin/env bash
# The §5 mechanism experiments of issue 34 (README, "§5 explained"): does a kswapd pass that
# bites a large share of the oldest MGLRU generation (M1) make MGLRU read more than the miss
# demand? Every cell replays the lab inputs (examples/lab_inputs.sh: a 512 MiB pool of 1 MiB
# experts, a low-reuse trace) with pread, recorded with the default probes + vmscan, the sampler
# (vmstat 1 Hz, MemFree 10 Hz, lru_gen 1 Hz, zoneinfo) running beside it in the guest.
#   a1  the 6.12 balloon-0.81 and cgroup groups again, measured: kswapd's share of reclaim and
#       Σhigh / (f·C) per cell (6 cells, MGLRU on; ~15 min under TCG)
#   e1  causal, 6.12, 2 vCPUs, 2 readers, balloon 0.81, C = 320 MiB: the lru_gen-bites controller
#       biting 0.26·C against 5 MiB bites, 3 repeats each, and plain balloon cells with MGLRU off,
#       with the page and read-call streams (pages evicted before their first read) (9 cells; ~30 min)
#   e1m e1's bites with an mmap replay (page-table aging makes generations: f, the oldest
#       generation's share, falls below pread's ~0.9), 2 repeats each (4 cells; ~12 min)
#   e3  the dose: e1's cells with bites of 0.6·C and 1.0·C (320 MiB), against the oldest
#       generation's f·C (pread fills it: f ~0.9), 2 repeats each (4 cells; ~14 min)
#   e3m the same bites with e1m's mmap replay (4 cells; ~14 min)
#   e3h, e3hm  5 MiB and 1.0·C bites (pread, mmap) on the hot plan at C = 128 MiB (the paper's
#       locality: a cache holds the hot set, so re-reads have room), 2 repeats (4 cells each, ~6 min)
#   e2  the real code path: Debian's 6.12.95 built twice by `lab build` (as it is, and with
#       examples/patches/mglru-6.8-initial-priority.patch), Σhigh / C of 0.02 and 0.26, balloon
#       0.81, MGLRU on and off, 3 repeats (24 cells, ~1 h; the first build ~50 min on 2 cores,
#       the second ~3 min), then `check` per (Σhigh / C, MGLRU)
#   e2d the decisive half of e2 (Σhigh / C 0.26, MGLRU on: 6 cells, ~18 min), then `check`
#   e2m e2d with an mmap replay (aging runs, f falls below Σhigh / C: M1's regime), 6 cells, ~10 min
#   e2h e2m on the hot plan (6 cells, ~10 min)
#   e4  long windows: 8-minute windows on 6.12 and the newest kernel under the balloon and the
#       cgroup wall, min_ttl_ms 0 against 1000 (8 cells, ~1 h 30 min)
#   e4m 8-minute windows of the hot plan with mmap on 6.12 and the newest kernel, balloon 0.81 (2
#       cells, ~25 min; measured: the balloon leaves the hot set resident, no pressure after pass 1)
#   e5  per-layer pool files at read_ahead_kb 128 and 1024, MGLRU on and off (4 cells, ~10 min)
# Resumable: run it again with the same OUT_DIR. Run as root, nothing else heavy beside it.
# Usage: examples/s5_mechanism.sh [OUT_DIR] [a1|e1|e1m|e3|e3m|e3h|e3hm|e2|e2d|e2m|e2h|e4|e4m|e5 ...]   (default: /var/tmp/moetrace-s5 a1 e1)
set -euo pipefail
out=${1:-/var/tmp/moetrace-s5}
shift || true
groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(a1 e1)
here=$(cd "$(dirname "$0")/.." && pwd)
mt=${MOETRACE:-$here/.venv/bin/moetrace}
. "$here/examples/lab_inputs.sh"

# s5spec NAME KERNELS MGLRU MECHANISMS REPEATS [EXTRA TOML LINES]: lab_inputs.sh's spec at C = 320 MiB,
# a longer timeout, and the extra keys (a window in place of passes, mode = "mmap" in place of pread)
s5spec() {
  spec "$1" "$2" "$3" "$4" 320MiB "$5"
  sed -i 's/^timeout = .*/timeout = 1800/' "$out/$1.toml"
  case ${6:-} in *window*) sed -i '/^passes = /d' "$out/$1.toml" ;; esac
  case ${6:-} in *'mode = "mmap"'*) sed -i '/^mode = "pagecache"$/d' "$out/$1.toml" ;; esac
  [ -z "${6:-}" ] || printf '%s\n' "$6" >> "$out/$1.toml"
}

# hot NAME: NAME.toml replays the hot plan at C = 128 MiB instead: the lab geometry with the
# paper's locality (kimi-k3's W1 34 %, W8 58 %, W64 81 %), made once. Its 128 steps touch 210
# experts (the lab plan's: 512), so C must be below 210 MiB for the passes to miss at all
hot() {
  if [ ! -f "$out/plan-hot.bin" ]; then
    "$mt" trace synth --layers 1 --experts 512 --k 8 --steps 128 --reuse 0.34 --reuse-8 0.58 --reuse-64 0.81 \
        --seed 7 -o "$out/t-hot.jsonl"
    "$mt" plan compile "$out/t-hot.jsonl" "${geo[@]}" -o "$out/plan-hot.bin"
  fi
  sed -i -e 's/^plan = .*/plan = "plan-hot.bin"/' -e 's/^capacities = .*/capacities = ["128MiB"]/' "$out/$1.toml"
}

# the two images of E2, built (or found in the build cache) from Debian's lab 6.12 source
e2_images() {
  local deb
  deb=$(ls "$out"/linux-source-6.12_6.12.95-1~bpo12+1_all.deb 2>/dev/null || true)
  if [ -z "$deb" ]; then
    (cd "$out" && apt-get download linux-source-6.12=6.12.95-1~bpo12+1 >/dev/null)
    deb=$(ls "$out"/linux-source-6.12_6.12.95-1~bpo12+1_all.deb)
  fi
  local field='import json, sys; d = json.load(sys.stdin); print(d["image"], d["release"])'
  read -r base rbase < <("$mt" lab build "$deb" --json | python3 -c "$field")
  read -r cand rcand < <("$mt" lab build "$deb" --patch "$here/examples/patches/mglru-6.8-initial-priority.patch" \
                         --json | python3 -c "$field")
}

# e2check NAME: `check` base against candidate for every group of cells that differ by the kernel
# alone (the same cell name in both kernels' conditions), 3 repeats a side; verdicts in NAME/check/
e2check() {
  local m=$out/$1 state grp bdir cdir c
  for state in on off; do
    bdir=$m/cells/$rbase-mglru-$state; cdir=$m/cells/$rcand-mglru-$state
    [ -d "$bdir" ] && [ -d "$cdir" ] || continue
    for grp in $(ls "$bdir" | sed 's/-r[0-9]*$//' | sort -u); do
      mkdir -p "$m/check/$state-$grp/base" "$m/check/$state-$grp/cand"
      for c in "$bdir/$grp"-r*; do ln -sfn "$c/cell" "$m/check/$state-$grp/base/$(basename "$c")"; done
      for c in "$cdir/$grp"-r*; do ln -sfn "$c/cell" "$m/check/$state-$grp/cand/$(basename "$c")"; done
      echo "== check, MGLRU $state, $grp: $rbase (base) against $rcand (the 6.8 clamp)"
      "$mt" check "$m/check/$state-$grp/base" "$m/check/$state-$grp/cand" > "$m/check/$state-$grp.txt" \
        && echo "exit 0" || echo "exit $?"
      tail -2 "$m/check/$state-$grp.txt"
    done
  done
}

for g in "${groups[@]}"; do
  case $g in
    a1) s5spec a1 '["6.12"]' '["on"]' '["balloon:0.81", "cgroup"]' 3
        run a1 ;;
    e1) s5spec e1-on '["6.12"]' '["on"]' '["balloon:0.81+lru_gen-bites:0.26", "balloon:0.81+lru_gen-bites:5MiB"]' 3 \
          $'cpus = 2\nreaders = 2\nstream_events = true'
        s5spec e1-off '["6.12"]' '["off"]' '["balloon:0.81"]' 3 $'cpus = 2\nreaders = 2\nstream_events = true'
        run e1-on
        run e1-off ;;
    e1m) s5spec e1m '["6.12"]' '["on"]' '["balloon:0.81+lru_gen-bites:0.26", "balloon:0.81+lru_gen-bites:5MiB"]' 2 \
          $'mode = "mmap"'
        run e1m ;;
    e3) s5spec e3 '["6.12"]' '["on"]' '["balloon:0.81+lru_gen-bites:0.6", "balloon:0.81+lru_gen-bites:320MiB"]' 2 \
          $'cpus = 2\nreaders = 2\nstream_events = true'
        run e3 ;;
    e3m) s5spec e3m '["6.12"]' '["on"]' '["balloon:0.81+lru_gen-bites:0.6", "balloon:0.81+lru_gen-bites:320MiB"]' 2 \
          $'mode = "mmap"'
        run e3m ;;
    e3h) s5spec e3h '["6.12"]' '["on"]' '["balloon:0.81+lru_gen-bites:5MiB", "balloon:0.81+lru_gen-bites:128MiB"]' 2 \
          $'cpus = 2\nreaders = 2\nstream_events = true'
        hot e3h
        run e3h ;;
    e3hm) s5spec e3hm '["6.12"]' '["on"]' '["balloon:0.81+lru_gen-bites:5MiB", "balloon:0.81+lru_gen-bites:128MiB"]' 2 \
          $'mode = "mmap"'
        hot e3hm
        run e3hm ;;
    e2h) e2_images
        s5spec e2h "[\"$base\", \"$cand\"]" '["on"]' '["balloon:0.81"]' 3 $'bite_fraction = 0.26\nmode = "mmap"'
        hot e2h
        run e2h
        e2check e2h ;;
    e2) e2_images
        s5spec e2 "[\"$base\", \"$cand\"]" '["on", "off"]' '["balloon:0.81"]' 3 'bite_fraction = [0.02, 0.26]'
        run e2
        e2check e2 ;;
    e2d) e2_images
        s5spec e2d "[\"$base\", \"$cand\"]" '["on"]' '["balloon:0.81"]' 3 'bite_fraction = 0.26'
        run e2d
        e2check e2d ;;
    e2m) e2_images
        s5spec e2m "[\"$base\", \"$cand\"]" '["on"]' '["balloon:0.81"]' 3 $'bite_fraction = 0.26\nmode = "mmap"'
        run e2m
        e2check e2m ;;
    e4) s5spec e4 '["6.12", "newest"]' '["on"]' '["balloon:0.81", "cgroup"]' 1 $'window = "8min"\nmin_ttl_ms = [0, 1000]'
        run e4 ;;
    e4m) s5spec e4m '["6.12", "newest"]' '["on"]' '["balloon:0.81"]' 1 $'window = "8min"\nmode = "mmap"'
        hot e4m
        run e4m ;;
    e5) s5spec e5 '["6.12"]' '["on", "off"]' '["balloon:0.81"]' 1 $'pool_layout = "layer"\nread_ahead_kb = [128, 1024]'
        run e5 ;;
    *) echo "unknown group $g (a1 e1 e1m e3 e3m e3h e3hm e2 e2d e2m e2h e4 e4m e5)" >&2; exit 2 ;;
  esac
done
