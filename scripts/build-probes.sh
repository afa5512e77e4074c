#!/usr/bin/env bash
# Build the CO-RE probe objects once: probes/<name>.bpf.c -> probes/build/<name>.bpf.o, compiled
# by clang (-target bpf -g -O2) against a vmlinux.h dumped from this machine's BTF by bpftool. Any
# one kernel's BTF serves every kernel: libbpf relocates field reads against the running kernel's
# BTF at load time. Rebuilds only what is stale (source, moetrace.bpf.h, vmlinux.h or this script
# newer than the object). Used by scripts/bootstrap.sh; by hand: bash scripts/build-probes.sh [-f]
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf 'build-probes: %s\n' "$*" >&2; }
force=0
[ "${1:-}" = "-f" ] && force=1
src=probes
out=probes/build
btf=${MOETRACE_BTF:-/sys/kernel/btf/vmlinux}
for tool in clang bpftool; do
  command -v "$tool" >/dev/null || { log "$tool not found: apt-get install clang bpftool libbpf-dev (make setup does)"; exit 1; }
done
[ -e /usr/include/bpf/bpf_helpers.h ] || { log "no <bpf/bpf_helpers.h>: apt-get install libbpf-dev"; exit 1; }
mkdir -p "$out"
if [ ! -s "$out/vmlinux.h" ] || [ "$force" = 1 ]; then
  [ -r "$btf" ] || { log "no BTF at $btf (set MOETRACE_BTF to a vmlinux with BTF)"; exit 1; }
  bpftool btf dump file "$btf" format c > "$out/vmlinux.h.tmp"
  mv "$out/vmlinux.h.tmp" "$out/vmlinux.h"
  log "vmlinux.h from $btf"
fi
arch=$(uname -m); case "$arch" in x86_64) tarch=x86;; aarch64) tarch=arm64;; *) tarch=$arch;; esac
built=0
for c in "$src"/*.bpf.c; do
  [ -e "$c" ] || continue
  name=$(basename "$c" .bpf.c)
  obj="$out/$name.bpf.o"
  if [ "$force" = 0 ] && [ -e "$obj" ] && [ "$obj" -nt "$c" ] && [ "$obj" -nt "$src/moetrace.bpf.h" ] \
     && [ "$obj" -nt "$out/vmlinux.h" ] && [ "$obj" -nt "$0" ]; then
    continue
  fi
  clang -g -O2 -target bpf -mcpu=v3 -D__TARGET_ARCH_"$tarch" -Wall -Wno-unused-function \
        -I"$out" -I"$src" -c "$c" -o "$obj.tmp"
  mv "$obj.tmp" "$obj"
  built=$((built + 1))
done
log "$built built, objects in $out"
