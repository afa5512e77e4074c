#!/usr/bin/env bash
# `make test`: every tier, in two phases, on a 2-core machine.
#   1. the kernel lab's tests (tests/live/test_lab_*.py) beside the no-kernel and probe-build
#      tiers: a lab test's oracles are its guest's own counters (the guest's /proc/vmstat, its
#      cgroups), and the other two read no device-wide counter, so neither disturbs the other;
#      a TCG guest runs on one host thread, the tier beside it on the other core.
#   2. the host's live tests alone: their oracles are device-wide (/proc/vmstat, diskstats).
# Extra arguments go to every pytest run (e.g. -x). Exit status: 0 only when every run passed.
# Ctrl-C stops the lab run too (its guests are powered off by `lab run`'s own handler).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
tmp=$(mktemp -d /tmp/moetrace-tests.XXXXXX)
lab_pid=
stop_lab() {
    if [ -n "$lab_pid" ] && kill -0 "$lab_pid" 2>/dev/null; then
        kill -INT -- "-$lab_pid" 2>/dev/null
        wait "$lab_pid" 2>/dev/null
    fi
}
trap 'stop_lab; cat "$tmp/lab.log" 2>/dev/null; rm -rf "$tmp"; exit 130' INT TERM
trap 'rm -rf "$tmp"' EXIT

set -m  # the lab run in a process group of its own (not SIGINT-ignoring): stopped by pid above
"$PY" -m pytest -q -p no:cacheprovider --basetemp "$tmp/lab" "$@" tests/live/test_lab_*.py > "$tmp/lab.log" 2>&1 &
lab_pid=$!
set +m
echo "test: the lab tier runs beside the no-kernel and probe-build tiers (its log follows them)"
"$PY" -m pytest -q "$@" tests/unit tests/probe_build
unit=$?
wait "$lab_pid"
lab=$?
lab_pid=
echo "== the kernel lab's tests (tests/live/test_lab_*.py), run beside them =="
cat "$tmp/lab.log"
echo "== the host's live tests, alone =="
"$PY" -m pytest -q "$@" tests/live --ignore-glob='tests/live/test_lab_*.py'
live=$?
echo "test: no-kernel + probe-build exit $unit, lab exit $lab, host live exit $live"
[ "$unit" -eq 0 ] && [ "$lab" -eq 0 ] && [ "$live" -eq 0 ]
