#!/usr/bin/env bash
# The kernel lab's packages (docs: shared/docs/environment.md, "The kernel lab"): QEMU, a static
# busybox for the initramfs, and two Debian kernels with MGLRU, kprobes, BTF and exact headers:
# 6.1 (MGLRU built, off by default) and 6.12 from bookworm-backports (MGLRU on by default).
# Idempotent; run as root by scripts/bootstrap.sh (and `moetrace lab setup`).
set -euo pipefail
log() { printf 'lab-setup: %s\n' "$*" >&2; }
K61=6.1.0-47-amd64
K612=6.12.95+deb12-amd64
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
if [ "$(id -u)" != 0 ]; then
  log "needs root (apt-get); run: sudo bash $0"; exit 1
fi
export DEBIAN_FRONTEND=noninteractive
src=/etc/apt/sources.list.d/moetrace-backports.sources
if [ ! -f "$src" ]; then
  # only the 6.12 kernel comes from backports: no `-t bookworm-backports` (it would upgrade
  # bpftool and linux-libc-dev too)
  cat > "$src" <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  updated=0
fi
need=()
for p in qemu-system-x86 busybox-static "linux-image-$K61-unsigned" "linux-headers-$K61" \
         "linux-image-$K612-unsigned" "linux-headers-$K612"; do
  have_pkg "$p" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  if [ "${updated:-1}" = 0 ] || ! apt-cache show "linux-image-$K612-unsigned" >/dev/null 2>&1; then
    apt-get update -qq >/dev/null || apt-get update
  fi
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
log "ready: /boot/vmlinuz-$K61 /boot/vmlinuz-$K612"
