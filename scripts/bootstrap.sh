#!/usr/bin/env bash
# Set up everything moetrace needs on a fresh Debian 12 machine (run as root).
# Idempotent: a second run only checks. Used by `make demo`, `make test` and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MOETRACE_VENV:-.venv}
log() { printf 'bootstrap: %s\n' "$*" >&2; }
warn() { printf 'bootstrap: WARNING: %s\n' "$*" >&2; }

need_apt=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
# chromium: the HTML report is checked in a real browser (tests/live/test_report_browser.py)
# clang, bpftool, libbpf-dev: the CO-RE probes are compiled once, here (scripts/build-probes.sh);
# libbpf1 loads them at record time. No kernel headers: the probes read kernel structs through
# BTF relocations.
# prometheus: `moetrace watch --prometheus` is scraped by a real server in the tests (started by
# the test on a loopback port; the package's own service is not started here)
# slurmctld, slurmd, slurm-client, munge: the single-node Slurm cluster of scripts/slurm-local.sh
# (`sweep --executor slurm`, issue 22), named one by one (slurm-wlm is only a metapackage of the
# three); no slurmdbd and no database: there is no accounting. slurm-local.sh starts the daemons
# with a config and munge key of its own; the packages' services do not start here (no systemd,
# policy-rc.d), and where they would, slurmd/slurmctld wait for an /etc/slurm/slurm.conf that
# nothing here writes.
for p in python3-venv python3-pip fio chromium clang bpftool libbpf-dev libbpf1 prometheus \
         slurmctld slurmd slurm-client munge; do
  have_pkg "$p" || need_apt+=("$p")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing packages: ${need_apt[*]}; run as root or: sudo apt-get install -y ${need_apt[*]}"; exit 1
  fi
  log "installing ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null || apt-get update
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
# The probes, compiled once against this machine's BTF (CO-RE: the objects load on every kernel
# with BTF, the lab's included). Rebuilds only what is stale.
bash scripts/build-probes.sh

# The kernel lab's QEMU and kernels (Debian 6.1 and 6.12 with MGLRU): `moetrace lab kernels` and
# the lab tests read them. Root only; MOETRACE_NO_LAB=1 skips it.
if [ "$(id -u)" = 0 ] && [ "${MOETRACE_NO_LAB:-0}" != 1 ]; then
  bash scripts/lab-setup.sh
fi

# The engines (README.md, "Recording a real engine"): Debian sid's llama.cpp unpacked with its own
# loader under /var/lib/moetrace/engines, never installed. Root only; MOETRACE_NO_ENGINE=1 skips it.
if [ "$(id -u)" = 0 ] && [ "${MOETRACE_NO_ENGINE:-0}" != 1 ]; then
  bash scripts/engine-setup.sh || warn "no llama.cpp (scripts/engine-setup.sh failed): \`moetrace doctor\` says why"
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  /usr/bin/python3 -m venv "$VENV"
fi
stamp="$VENV/.moetrace-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  log "installing moetrace (editable) and its dependencies"
  plog="$VENV/pip-install.log"
  # setuptools too (pyproject's build requirement): the wheel test builds with --no-build-isolation, offline
  if ! { "$VENV/bin/python" -m pip install -q --upgrade pip 'setuptools>=77' &&
         "$VENV/bin/python" -m pip install -q -e '.[test]'; } >"$plog" 2>&1; then
    cat "$plog" >&2
    log "pip install failed (log above, also in $plog)"; exit 1
  fi
  touch "$stamp"
fi
# bytecode for every module (a guest of `moetrace lab run` reads this tree read-only and would
# compile each module at every boot; a host with PYTHONDONTWRITEBYTECODE at every run)
"$VENV/bin/python" -m compileall -q -j 0 toolkit analyses probes >/dev/null
log "ready: $VENV/bin/moetrace"
