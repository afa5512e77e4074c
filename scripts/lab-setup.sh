#!/usr/bin/env bash
# The kernel lab's packages (README.md, "Kernel lab"): QEMU, a static
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
# the last line: what `moetrace lab build` needs to build a kernel tree (pahole for BTF comes with
# the 6.12 packages from backports)
for p in qemu-system-x86 busybox-static "linux-image-$K61-unsigned" "linux-headers-$K61" \
         "linux-image-$K612-unsigned" "linux-headers-$K612" \
         build-essential flex bison bc libelf-dev libssl-dev pahole; do
  have_pkg "$p" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  if [ "${updated:-1}" = 0 ] || ! apt-cache show "linux-image-$K612-unsigned" >/dev/null 2>&1; then
    apt-get update -qq >/dev/null || apt-get update
  fi
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# The newest Debian kernel the registry serves (sid; else trixie-backports), unpacked for the lab
# only: never installed as the host's kernel and nothing of the host upgraded. apt runs with a
# state of its own (sources list, package lists, cache under $LABROOT/apt): the host's apt never
# sees the suite. Unpacked into $LABK/RELEASE/usr/lib/modules/RELEASE/{vmlinuz,config,kernel/...}
# with a modules.dep of its own (depmod -b); `moetrace lab run --kernel newest` boots it, and the
# probes compiled here load there unchanged (CO-RE). MOETRACE_NO_NEWEST_KERNEL=1 skips it.
LABROOT=${MOETRACE_LAB_ROOT:-/var/lib/moetrace/lab}
LABK=${MOETRACE_LAB_KERNELS:-$LABROOT/kernels}
newest_kernel() {
  local a="$LABROOT/apt" suite R pkgs deps tmp
  mkdir -p "$a/lists/partial" "$a/archives/partial" "$LABK"
  : > "$a/status"
  for suite in sid trixie-backports; do
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main" \
      > "$a/sources.list"
    local A=(-o "Dir::Etc::SourceList=$a/sources.list" -o Dir::Etc::SourceParts=/nonexistent
             -o "Dir::State::Lists=$a/lists" -o "Dir::Cache=$a" -o "Dir::Cache::Archives=$a/archives"
             -o "Dir::State::status=$a/status")
    apt-get "${A[@]}" update -qq >/dev/null 2>&1 || continue
    R=$(apt-cache "${A[@]}" search --names-only '^linux-image-[0-9][0-9.]*\+deb[0-9]+-amd64$' 2>/dev/null \
        | awk '{print $1}' | sed 's/^linux-image-//' | sort -V | tail -1)
    [ -n "$R" ] || continue
    if [ -f "$LABK/$R/usr/lib/modules/$R/vmlinuz" ] && [ -f "$LABK/$R/usr/lib/modules/$R/modules.dep" ]; then
      log "newest lab kernel: $R (unpacked in $LABK/$R)"; return 0
    fi
    # the image package, and the split packages it depends on (sid: linux-binary / -modules / -base)
    deps=$(apt-cache "${A[@]}" depends "linux-image-$R" 2>/dev/null | awk -v r="$R" '$1 == "Depends:" &&
           ($2 == "linux-binary-" r || $2 == "linux-modules-" r || $2 == "linux-base-" r) {print $2}')
    pkgs="linux-image-$R $deps"
    log "unpacking Debian $suite's $R for the lab ($pkgs)"
    tmp="$LABK/.$R.tmp"; rm -rf "$tmp"; mkdir -p "$tmp/debs"
    (cd "$tmp/debs" && apt-get "${A[@]}" download $pkgs >/dev/null 2>&1) || { rm -rf "$tmp"; continue; }
    for f in "$tmp"/debs/*.deb; do dpkg-deb -x "$f" "$tmp"; done
    rm -rf "$tmp/debs"
    # one layout whatever the packaging: usr/lib/modules/R holds vmlinuz, config and the modules
    mkdir -p "$tmp/usr/lib/modules/$R"
    if [ -d "$tmp/lib/modules/$R" ] && [ ! -L "$tmp/lib" ]; then cp -a "$tmp/lib/modules/$R/." "$tmp/usr/lib/modules/$R/"; rm -rf "$tmp/lib"; fi
    [ -f "$tmp/boot/vmlinuz-$R" ] && cp "$tmp/boot/vmlinuz-$R" "$tmp/usr/lib/modules/$R/vmlinuz"
    [ -f "$tmp/boot/config-$R" ] && cp "$tmp/boot/config-$R" "$tmp/usr/lib/modules/$R/config"
    [ -e "$tmp/lib" ] || ln -s usr/lib "$tmp/lib"
    depmod -b "$tmp" "$R"
    if [ ! -f "$tmp/usr/lib/modules/$R/vmlinuz" ] || [ ! -f "$tmp/usr/lib/modules/$R/modules.dep" ]; then
      rm -rf "$tmp"; log "WARNING: $suite's $R unpacked without a vmlinuz or modules.dep"; continue
    fi
    rm -rf "$LABK/$R"; mv "$tmp" "$LABK/$R"
    log "newest lab kernel: $R (unpacked in $LABK/$R, not installed)"
    return 0
  done
  return 1
}
if [ "${MOETRACE_NO_NEWEST_KERNEL:-0}" != 1 ]; then
  newest_kernel || log "WARNING: no newer Debian kernel could be fetched (sid, trixie-backports): the lab has 6.1 and 6.12"
fi
log "ready: /boot/vmlinuz-$K61 /boot/vmlinuz-$K612"
