#!/usr/bin/env bash
# Does `moetrace check` cry wolf with one cell a side on this host? Pairs of identical cells (A/A)
# must never exit 1 (0, or 3: inconclusive); a capacity cut to an eighth must exit 1 in every pair.
# As a new user would try it: an olmoe x 128 KiB pool (128 MiB), `trace synth --preset olmoe` (300
# steps), `moetrace cell` with its defaults, one cell a side, then `moetrace check BASE CAND`.
# Groups: MECHANISMS x two capacities: cgroup at C = 64 and 256 MiB (half the pool, twice it);
# balloon at its smallest C on this host and twice that (a balloon leaves the machine its safe
# reserve, moetrace.capacity.scope.safe_reserve_bytes: C >= 1.93 GB on a 24 GB host, so the pool
# fits). A/A pairs go round the groups, two fresh cells each; a cut pair checks a fresh cell at
# C / 8 against the first A/A base cell at C, round the cgroup capacities (a balloon cannot go
# below its reserve). check reads no per-machine thresholds file here (MOETRACE_MACHINE_THRESHOLDS
# is set empty): the shipped defaults, as on a machine never calibrated.
# Measured on a 2-CPU VM with a kernel build beside it: a cgroup cell 4-16 s (C / 8 the slowest),
# a balloon cell 19-73 s (locking ~20 GB); 20 A/A pairs over both mechanisms and 4 cuts: 15 min.
# Env: MOETRACE_AA_PAIRS (A/A pairs, default 20), MOETRACE_AA_CUTS (default 4),
#      MOETRACE_AA_MECHANISMS (default "cgroup balloon"), MOETRACE_AA_STEPS (the trace's steps,
#      default 300: synth's; the live test's 100 make shorter cells), MOETRACE (the moetrace command).
# Out: OUT_DIR/pairs.tsv (kind, group, base, candidate, exit status, regressed, inconclusive),
#      OUT_DIR/checks/*.json (each check's --json), the table on stdout. Exit 0 when A/A never
#      exited 1 and every cut did; 1 otherwise. Root (cells need it).
# Usage: examples/check_aa.sh [OUT_DIR]   (default: /var/tmp/moetrace-check-aa; emptied first)
set -euo pipefail
out=${1:-/var/tmp/moetrace-check-aa}
here=$(cd "$(dirname "$0")/.." && pwd)
mt=${MOETRACE:-$here/.venv/bin/moetrace}
py=$(dirname "$(command -v "$mt")")/python
[ -x "$py" ] || py=python3
pairs=${MOETRACE_AA_PAIRS:-20}
cuts=${MOETRACE_AA_CUTS:-4}
read -r -a mechs <<< "${MOETRACE_AA_MECHANISMS:-cgroup balloon}"
export MOETRACE_MACHINE_THRESHOLDS=
rm -rf "$out" && mkdir -p "$out/cells" "$out/checks"
"$mt" pool create "$out/pool" --geometry olmoe --expert-bytes 128KiB > /dev/null
"$mt" trace synth --preset olmoe --steps "${MOETRACE_AA_STEPS:-300}" -o "$out/t.jsonl" > /dev/null
"$mt" plan compile "$out/t.jsonl" --geometry olmoe --expert-bytes 128KiB -o "$out/plan.bin" > /dev/null

mib=$((1 << 20))
groups=()
for m in "${mechs[@]}"; do
  case $m in
    cgroup) groups+=("cgroup:$((64 * mib))" "cgroup:$((256 * mib))");;
    balloon)
      c=$("$py" -c 'from moetrace.capacity.scope import safe_reserve_bytes as r
from moetrace.kernel.procfs import read_meminfo as m
q = 256 << 20
print(-(-(r(m()["MemTotal_bytes"]) - (64 << 20)) // q) * q)')
      groups+=("balloon:$c" "balloon:$((2 * c))");;
    *) echo "unknown mechanism $m (cgroup, balloon)" >&2; exit 2;;
  esac
done
label() { echo "${1%%:*}-$(( ${1##*:} / mib ))MiB"; }
cell_s=()
# cell MECHANISM CAPACITY DIR: one cell with moetrace cell's defaults; its time kept; 0 when retained
cell() {
  local t0=$SECONDS rc=0
  "$mt" cell --plan "$out/plan.bin" --pool "$out/pool" --mechanism "$1" --capacity "$2" --name aa \
      --out "$3" > "$3.log" 2>&1 || rc=$?
  cell_s+=("$1:$((SECONDS - t0))")
  return $rc
}
# check KIND GROUP BASE CAND: one check, its status and named metrics into pairs.tsv
check() {
  local n rc=0 j
  n=$(ls "$out/checks" | wc -l)
  j="$out/checks/$n-${1//\//}-${2//>/}.json"
  "$mt" check "$3" "$4" --json > "$j" 2> "$j.err" || rc=$?
  "$py" - "$j" "$1" "$2" "$3" "$4" "$rc" >> "$out/pairs.tsv" <<'PY'
import json, sys
j, kind, group, base, cand, rc = sys.argv[1:]
try:
    d = json.load(open(j))
except ValueError:
    d = {}
names = lambda k: ",".join(sorted({m for ms in (d.get(k) or {}).values() for m in ms})) or "-"
print("\t".join([kind, group, base, cand, rc, names("regressed"), names("inconclusive")]))
PY
}

printf 'kind\tgroup\tbase\tcandidate\texit\tregressed\tinconclusive\n' > "$out/pairs.tsv"
declare -A first_base
for ((p = 0; p < pairs; p++)); do
  g=${groups[$((p % ${#groups[@]}))]}
  d="$out/cells/$(label "$g")"
  mkdir -p "$d"
  if cell "${g%%:*}" "${g##*:}" "$d/$p-a" && cell "${g%%:*}" "${g##*:}" "$d/$p-b"; then
    check A/A "$(label "$g")" "$d/$p-a" "$d/$p-b"
    [ -n "${first_base[$g]:-}" ] || first_base[$g]="$d/$p-a"
  else
    printf 'A/A\t%s\t%s\t%s\tcell\t-\t-\n' "$(label "$g")" "$d/$p-a" "$d/$p-b" >> "$out/pairs.tsv"
  fi
done
cgroups=("cgroup:$((64 * mib))" "cgroup:$((256 * mib))")
for ((k = 0; k < cuts; k++)); do
  g=${cgroups[$((k % 2))]}
  c=${g##*:}
  d="$out/cells/$(label "$g")"
  mkdir -p "$d"
  base=${first_base[$g]:-}
  if [ -z "$base" ]; then
    base="$d/cut$k-base"
    cell cgroup "$c" "$base" || true
  fi
  if cell cgroup $((c / 8)) "$d/cut$k-eighth"; then
    check cut "$(label "$g")->$((c / 8 / mib))MiB" "$base" "$d/cut$k-eighth"
  else
    printf 'cut\t%s\t%s\t%s\tcell\t-\t-\n' "$(label "$g")" "$base" "$d/cut$k-eighth" >> "$out/pairs.tsv"
  fi
done

"$py" - "$out/pairs.tsv" "${cell_s[@]}" <<'PY'
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])][1:]
cols = ["0", "1", "2", "3", "cell"]
print(f"{'kind':5s} {'group':24s} {'pairs':>5s} " + " ".join(f"{'exit ' + c if c != 'cell' else 'no cell':>7s}" for c in cols)
      + "  named (regressed / inconclusive)")
for kind in ("A/A", "cut"):
    groups = dict.fromkeys(r[1] for r in rows if r[0] == kind)
    for g in [*groups, "all"]:
        rs = [r for r in rows if r[0] == kind and (g == "all" or r[1] == g)]
        if not rs:
            continue
        named = sorted({m for r in rs for m in r[5].split(",") if m != "-"}) if g != "all" else []
        undec = sorted({m for r in rs for m in r[6].split(",") if m != "-"}) if g != "all" else []
        print(f"{kind:5s} {g:24s} {len(rs):5d} " + " ".join(f"{sum(r[4] == c for r in rs):7d}" for c in cols)
              + (f"  {', '.join(named) or '-'} / {', '.join(undec) or '-'}" if g != "all" else ""))
times = {}
for s in sys.argv[2:]:
    m, t = s.split(":")
    times.setdefault(m, []).append(int(t))
print("cell time: " + "; ".join(f"{m} {len(t)} cells, {min(t)}-{max(t)} s (mean {sum(t) / len(t):.1f} s)"
                                for m, t in times.items()))
aa = [r[4] for r in rows if r[0] == "A/A"]
cut = [r[4] for r in rows if r[0] == "cut"]
ok = "1" not in aa and all(c == "1" for c in cut) and "cell" not in aa
print(f"A/A pairs: {len(aa)}, exit 1 in {aa.count('1')}; cuts to an eighth: {len(cut)}, exit 1 in "
      f"{cut.count('1')}: {'as it should' if ok else 'NOT as it should'}")
sys.exit(0 if ok else 1)
PY
