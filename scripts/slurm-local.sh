#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for the tests and for trying
# `moetrace sweep --executor slurm` (issue 22): Debian's slurm-wlm 22.05 (slurmctld, slurmd,
# slurm-client) and munge, installed by scripts/bootstrap.sh.
#
#   eval "$(scripts/slurm-local.sh up)"   # start it; stdout is only `export SLURM_CONF=...`
#   scripts/slurm-local.sh status         # sinfo; exit 0 when up, 1 when not
#   scripts/slurm-local.sh down           # stop it and remove every trace of it
#
# What `up` makes, all under ${MOETRACE_SLURM_DIR:-/run/moetrace-slurm} (mode 0711, root):
#   - munged with its own key (munge.key, 0400, fresh random bytes), socket, pid, log and seed
#     files: the machine's /etc/munge and /run/munge are never read or touched;
#   - slurm.conf: cluster "moetrace-local", one node (this host, `hostname -s`, its CPU topology
#     from `slurmd -C`, RealMemory 95% of MemTotal), one partition `local` (default, no time
#     limit), controller and node daemon on free loopback ports; auth and credentials through
#     our munged; no accounting (no slurmdbd: finished jobs stay visible to
#     `squeue --states=all` for MinJobAge=600 s instead); select/cons_tres with
#     CR_Core_Memory so `--exclusive` gives a job the node alone; proctrack/linuxproc and
#     task/none, because the cells move their own processes into memory cgroups of their
#     own and Slurm must not own those;
#   - slurmctld and slurmd started with `-f slurm.conf`, run as root (jobs run as their
#     submitter), state, spool, pid and log files in the same directory.
# There is no systemd here: the daemons are started directly and stopped by their pid files
# (a pid is signalled only while /proc/PID/comm still names that daemon), never by name.
# `down` cancels every job of this cluster, waits for them to end, stops slurmd, slurmctld
# and munged, and removes the directory: no process, socket, port or file of it is left.
# `up` on a failure prints the daemons' log tails and undoes what it started.
set -euo pipefail

DIR=${MOETRACE_SLURM_DIR:-/run/moetrace-slurm}
CONF=$DIR/slurm.conf
MARK=$DIR/.moetrace-slurm          # rm -rf only a directory this script made
DAEMONS=(slurmd slurmctld munged)  # in the order `down` stops them
UP_TIMEOUT=30
STOP_TIMEOUT=15

say() { printf 'slurm-local: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

usage() {
  cat <<EOF
usage: $0 up|down|status

  up      start a single-node Slurm cluster on this host (munged, slurmctld, slurmd) with its
          state in \${MOETRACE_SLURM_DIR:-/run/moetrace-slurm}; prints only
          'export SLURM_CONF=<dir>/slurm.conf' on stdout, so: eval "\$($0 up)".
          A second 'up' while it runs only prints that line again.
  down    cancel its jobs, stop its daemons by their pid files, remove the directory
          (exit 0 when nothing is up)
  status  print sinfo of it; exit 0 when up, 1 when not

Needs root, and Debian's slurmctld, slurmd, slurm-client and munge (scripts/bootstrap.sh).
EOF
}

pid_of() {  # pid of a daemon of ours that is alive, from its pid file ("" if none)
  local name=$1 f=$DIR/$1.pid pid comm
  [ -r "$f" ] || return 0
  pid=$(tr -dc '0-9' <"$f")
  [ -n "$pid" ] || return 0
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 0
  [ "$comm" = "$name" ] && alive "$pid" && echo "$pid"
  return 0
}

slurm() { SLURM_CONF=$CONF "$@"; }

node_state() { slurm sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n1; }

free_port_pair() {  # first p >= 16817 with p and p+1 not listening on TCP
  local p
  for ((p = 16817; p < 17817; p += 2)); do
    if [ -z "$(ss -Htln "( sport = :$p or sport = :$((p + 1)) )")" ]; then
      echo "$p"; return 0
    fi
  done
  die "no free pair of TCP ports in 16817-17816 (ss -tln shows them all in use)"
}

write_conf() {
  local port topo mem_kb
  port=$(free_port_pair)
  # the node as slurmd sees it (CPUs, boards, sockets, cores, threads); RealMemory a bit under
  # MemTotal, since a node that reports less memory than configured is drained
  topo=$(slurmd -C 2>/dev/null | sed -n 's/^NodeName=[^ ]* \(CPUs=.*\) RealMemory=.*/\1/p')
  [ -n "$topo" ] || topo="CPUs=$(nproc)"
  mem_kb=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
  cat >"$CONF" <<EOF
# written by scripts/slurm-local.sh up; removed by scripts/slurm-local.sh down
ClusterName=moetrace-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
PlugStackConfig=$DIR/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
# schedule a submitted job at once (~1 s to start, not ~3 s: few jobs here, and tests wait on them)
SchedulerParameters=batch_sched_delay=0,sched_min_interval=100000
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MinJobAge=600
ReturnToService=2
NodeName=$NODE NodeAddr=127.0.0.1 $topo RealMemory=$((mem_kb * 95 / 100 / 1024)) State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  : >"$DIR/plugstack.conf"  # no SPANK plugins (not /etc/slurm's)
}

log_tails() {
  local f
  for f in munged slurmctld slurmd; do
    [ -s "$DIR/$f.log" ] || continue
    say "--- last lines of $DIR/$f.log"
    tail -n 25 "$DIR/$f.log" >&2
  done
}

fail_up() {
  say "up failed: $*"
  log_tails
  say "undoing what was started"
  do_down
  exit 1
}

is_up() {  # all three daemons alive and the node answers sinfo as idle/allocated/mixed
  [ -f "$MARK" ] && [ -n "$(pid_of munged)" ] && [ -n "$(pid_of slurmctld)" ] &&
    [ -n "$(pid_of slurmd)" ] || return 1
  case "$(node_state)" in idle* | alloc* | mix* | completing*) return 0 ;; esac
  return 1
}

do_up() {
  if is_up; then
    echo "export SLURM_CONF=$CONF"; return 0
  fi
  if [ -e "$DIR" ]; then
    [ -f "$MARK" ] || die "$DIR exists but was not made by this script; remove it or set MOETRACE_SLURM_DIR"
    say "a cluster in $DIR is not (fully) running: stopping what is left first"
    do_down
  fi
  [ ${#DIR} -le 90 ] || die "MOETRACE_SLURM_DIR is ${#DIR} bytes long: munged's socket path in it must stay under 108 bytes; use a shorter one"
  local exe
  for exe in munged slurmctld slurmd sinfo; do
    command -v "$exe" >/dev/null || die "$exe not found: run scripts/bootstrap.sh (apt-get install slurmctld slurmd slurm-client munge)"
  done
  mkdir -p -m 0700 "$DIR" "$DIR/ctld" "$DIR/spool"
  chmod 0711 "$DIR"  # munged wants its socket's directory searchable by all; not listable
  : >"$MARK"
  say "starting munged, slurmctld, slurmd in $DIR"
  dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none
  chmod 0400 "$DIR/munge.key"
  write_conf
  munged --socket="$DIR/munge.socket" --key-file="$DIR/munge.key" --pid-file="$DIR/munged.pid" \
    --log-file="$DIR/munged.log" --seed-file="$DIR/munged.seed" 2>>"$DIR/munged.log" ||
    fail_up "munged did not start"
  slurmctld -f "$CONF" 2>>"$DIR/slurmctld.log" || fail_up "slurmctld did not start"
  slurmd -f "$CONF" 2>>"$DIR/slurmd.log" || fail_up "slurmd did not start"
  local state="" end=$((SECONDS + UP_TIMEOUT))
  while [ $SECONDS -lt $end ]; do  # a deadline, not a count: sinfo may itself wait for a reply
    state=$(node_state)
    case "$state" in idle*) break ;; esac
    sleep 0.5
  done
  case "$state" in idle*) ;; *) fail_up "node $NODE not idle after ${UP_TIMEOUT}s (sinfo says: '${state:-no answer}')" ;; esac
  local d
  for d in "${DAEMONS[@]}"; do
    [ -n "$(pid_of "$d")" ] || fail_up "$d exited after start"
  done
  say "up: node $NODE idle, partition local (SLURM_CONF=$CONF)"
  echo "export SLURM_CONF=$CONF"
}

procs_in_dir() {  # pids (other than ours) with an open file or cwd under $DIR: job steps left behind
  local p l
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" != $$ ] || continue
    for l in "$p"/cwd "$p"/fd/*; do
      case "$(readlink "$l" 2>/dev/null)" in "$DIR" | "$DIR"/*) echo "${p#/proc/}"; break ;; esac
    done
  done
}

alive() {  # pid exists and is not a zombie (pid 1 here may reap late)
  local st
  st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "${st%% *}" != Z ]
}

wait_gone() {  # wait up to $1 tenths of a second until none of the pids is alive; prints those left
  local n=$1 t p left=()
  shift
  for ((t = 0; t <= n; t++)); do
    left=()
    for p in "$@"; do alive "$p" && left+=("$p"); done
    [ ${#left[@]} -gt 0 ] || return 0
    sleep 0.1
  done
  echo "${left[*]}"
}

with_descendants() {  # the given pids and every process below them (a job step's processes)
  local p ppid all=("$@") i=0
  declare -A kids=()
  for p in /proc/[0-9]*; do
    ppid=$(sed 's/.*) //' "$p/stat" 2>/dev/null | cut -d' ' -f2) || continue
    [ -n "$ppid" ] && kids[$ppid]+=" ${p#/proc/}"
  done
  while [ $i -lt ${#all[@]} ]; do
    # shellcheck disable=SC2206
    all+=(${kids[${all[$i]}]:-})
    i=$((i + 1))
  done
  printf '%s\n' "${all[@]}" | sort -un
}

stop_pids() {  # stop_pids SECONDS PID...: SIGTERM, wait up to SECONDS, then SIGKILL what is left
  local secs=$1 left
  shift
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  left=$(wait_gone $((secs * 10)) "$@")
  [ -n "$left" ] || return 0
  say "still running after ${secs}s, sending SIGKILL: $left"
  # shellcheck disable=SC2086
  kill -KILL $left 2>/dev/null || true
  # shellcheck disable=SC2086
  left=$(wait_gone 50 $left)
  [ -z "$left" ] || say "WARNING: pids $left survived SIGKILL"
}

cancel_jobs() {  # every job of this cluster, then wait (bounded) until none is running
  local ids t
  ids=$(slurm squeue -h -o '%A' 2>/dev/null | tr '\n' ' ') || ids=""
  [ -n "${ids// /}" ] || return 0
  say "cancelling jobs: $ids"
  # shellcheck disable=SC2086
  slurm scancel $ids 2>/dev/null || true
  for ((t = 0; t < STOP_TIMEOUT * 2; t++)); do
    [ -z "$(slurm squeue -h -t running,completing,configuring,suspended -o '%A' 2>/dev/null)" ] && return 0
    sleep 0.5
  done
  say "jobs still running or completing after ${STOP_TIMEOUT}s; their processes are stopped below"
}

do_down() {
  [ -e "$DIR" ] || return 0
  [ -f "$MARK" ] || die "$DIR was not made by this script (no $MARK); not touching it"
  [ -n "$(pid_of slurmctld)" ] && [ -n "$(pid_of munged)" ] && cancel_jobs
  local d pid
  for d in "${DAEMONS[@]}"; do
    pid=$(pid_of "$d")
    [ -z "$pid" ] || stop_pids "$STOP_TIMEOUT" "$pid"
  done
  local left
  mapfile -t left < <(procs_in_dir)
  if [ ${#left[@]} -gt 0 ]; then
    mapfile -t left < <(with_descendants "${left[@]}")
    say "stopping processes still using $DIR and those they started: ${left[*]}"
    stop_pids 3 "${left[@]}"  # slurmstepd ignores SIGTERM
  fi
  rm -rf -- "$DIR"
}

do_status() {
  if is_up; then
    slurm sinfo
    return 0
  fi
  if [ -e "$DIR" ]; then
    echo "moetrace-local Slurm: not (fully) running, state in $DIR (run: $0 down)"
  else
    echo "moetrace-local Slurm: down"
  fi
  return 1
}

case "${1:-}" in
  -h | --help | help) usage; exit 0 ;;
  up | down | status) ;;
  *) usage >&2; exit 2 ;;
esac
[ $# -eq 1 ] || { usage >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "needs root (it starts munged, slurmctld and slurmd as root): sudo $0 $1"
case "$DIR" in /?*) ;; *) die "MOETRACE_SLURM_DIR must be an absolute path other than /, not '$DIR'" ;; esac
NODE=$(hostname -s)
case "$1" in
  up) do_up ;;
  down) do_down ;;
  status) do_status ;;
esac
