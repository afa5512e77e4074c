#!/usr/bin/env bash
# The engines moetrace records (README.md, "Recording a real engine"): Debian sid's llama.cpp,
# unpacked with sid's own loader and libraries into a versioned directory, never installed: the
# host's dpkg, apt and libraries are never touched (apt runs with a state of its own). sid moves,
# so nothing here names a build number: the package set is resolved from sid's index each time
# (the tools, their libllama / libggml, and the shared libraries those need, two levels of
# Depends restricted to lib*, zlib1g and gcc-N-base), the version read from the unpacked packages.
#
#   $ENGROOT/llama.cpp/VERSION/root/...     the unpacked packages (usr/bin, usr/lib/x86_64-linux-gnu)
#   $ENGROOT/llama.cpp/VERSION/engine.json  version, packages, loader, library path, CPU backend
#   $ENGROOT/llama.cpp/VERSION/bin/moetrace-route-log  the routing logger (toolkit/engines/route_log.c),
#                                           rebuilt whenever its source changes
#   $ENGROOT/llama.cpp/current -> VERSION
#
# The CPU backend: Debian ships one libggml-cpu-*.so per x86 level in a directory the library
# hard-codes under /usr; a 10-line probe (built here against the unpacked headers) asks ggml to
# score them on this CPU, and engine.json records the best, for GGML_BACKEND_PATH.
# Idempotent (a second run only checks); MOETRACE_NO_ENGINE=1 skips it; MOETRACE_ENGINE_ROOT moves it.
set -euo pipefail
log() { printf 'engine-setup: %s\n' "$*" >&2; }
ENGROOT=${MOETRACE_ENGINE_ROOT:-/var/lib/moetrace/engines}
E=$ENGROOT/llama.cpp
TOOLS=(llama.cpp-tools llama.cpp-examples llama.cpp-tools-extra libllama-dev libggml-dev)
a=$ENGROOT/apt
mkdir -p "$a/lists/partial" "$a/archives/partial" "$E"
: > "$a/status"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main" \
  > "$a/sources.list"
A=(-o "Dir::Etc::SourceList=$a/sources.list" -o Dir::Etc::SourceParts=/nonexistent
   -o "Dir::State::Lists=$a/lists" -o "Dir::Cache=$a" -o "Dir::Cache::Archives=$a/archives"
   -o "Dir::State::status=$a/status" -o APT::Sandbox::User=root)

# an index younger than a day is used as it is (a set-up that runs twice does not fetch twice)
if [ -z "$(find "$a/lists" -name '*_Packages*' -mmin -1440 2>/dev/null | head -1)" ]; then
  apt-get "${A[@]}" update -qq >/dev/null 2>&1 || { log "cannot read Debian sid's index (network?)"; exit 1; }
fi
ver=$(apt-cache "${A[@]}" show llama.cpp-tools 2>/dev/null | awk '$1 == "Version:" {print $2; exit}')
[ -n "$ver" ] || { log "Debian sid has no llama.cpp-tools today"; exit 1; }
V=${ver#*:}  # the directory: the version without its epoch
src=$(cd "$(dirname "$0")/.." && pwd)/toolkit/engines/route_log.c

# build_logger DIR: the routing logger against DIR's headers and libraries (the host's cc; sid's
# libllama needs newer glibc symbols than the host's, which only the loader resolves at run time)
build_logger() {
  local d=$1 L=$1/root/usr/lib/x86_64-linux-gnu sum
  sum=$(sha256sum "$src" | cut -d' ' -f1)
  [ "$(cat "$d/bin/route_log.sha256" 2>/dev/null)" = "$sum" ] && [ -x "$d/bin/moetrace-route-log" ] && return 0
  mkdir -p "$d/bin"
  cc -O2 -Wall -Wextra -I"$d/root/usr/include" "$src" -o "$d/bin/.moetrace-route-log.tmp" -L"$L" \
     -Wl,--allow-shlib-undefined -lllama -lggml -lggml-base
  mv "$d/bin/.moetrace-route-log.tmp" "$d/bin/moetrace-route-log"
  echo "$sum" > "$d/bin/route_log.sha256"
  log "routing logger built: $d/bin/moetrace-route-log"
}
if [ -f "$E/$V/engine.json" ]; then
  build_logger "$E/$V"
  ln -sfn "$V" "$E/current"
  log "llama.cpp $ver: $E/$V (unpacked before)"; exit 0
fi

# the package set: the tools, and two levels of what they depend on, libraries only
resolve() {
  local -A seen=()
  local queue=("$@") next p d level
  for level in 0 1 2; do
    next=()
    for p in "${queue[@]}"; do
      [ -n "${seen[$p]:-}" ] && continue
      seen[$p]=1
      [ "$level" = 2 ] && continue
      for d in $(apt-cache "${A[@]}" depends --no-recommends --no-suggests --no-conflicts --no-breaks \
                   --no-replaces --no-enhances "$p" 2>/dev/null |
                 awk '$1 == "Depends:" || $1 == "PreDepends:" {print $2}' |
                 grep -E '^(lib[a-z0-9][a-z0-9.+-]*|zlib1g|gcc-[0-9]+-base)$'); do
        next+=("$d")
      done
    done
    queue=("${next[@]}")
  done
  printf '%s\n' "${!seen[@]}" | sort
}
mapfile -t pkgs < <(resolve "${TOOLS[@]}")
tmp="$E/.$V.tmp"
rm -rf "$tmp"
mkdir -p "$tmp/debs" "$tmp/root"
trap 'rm -rf "$tmp"' EXIT
log "fetching llama.cpp $ver and ${#pkgs[@]} packages from Debian sid (not installed)"
(cd "$tmp/debs" && apt-get "${A[@]}" download "${pkgs[@]}" >/dev/null 2>&1) ||
  { log "downloading ${pkgs[*]} failed"; exit 1; }
for f in "$tmp"/debs/*.deb; do dpkg-deb -x "$f" "$tmp/root"; done
L=$tmp/root/usr/lib/x86_64-linux-gnu
loader=$L/ld-linux-x86-64.so.2
[ -x "$loader" ] || loader=$tmp/root/lib64/ld-linux-x86-64.so.2
[ -e "$loader" ] || { log "sid's libc6 brought no ld-linux-x86-64.so.2"; exit 1; }

# the CPU backend ggml scores best here
cat > "$tmp/backend-probe.c" <<'EOF'
#include <ggml-backend.h>
#include <stdio.h>
int main(int argc, char **argv) {
    ggml_backend_load_all_from_path(argv[1]);
    for (size_t i = 0; i < ggml_backend_dev_count(); i++)
        printf("%s\n", ggml_backend_dev_description(ggml_backend_dev_get(i)));
    return ggml_backend_dev_count() ? 0 : 1;
}
EOF
backend=null
cpu=""
if cc -o "$tmp/backend-probe" "$tmp/backend-probe.c" -I"$tmp/root/usr/include" -L"$L" -lggml -lggml-base \
     -Wl,--allow-shlib-undefined 2>"$tmp/cc.log"; then
  out=$("$loader" --inhibit-cache --library-path "$L:$L/llama" "$tmp/backend-probe" "$L/ggml/backends0" 2>&1 || true)
  b=$(printf '%s\n' "$out" | sed -n 's/.*loaded CPU backend from \(.*\.so\).*/\1/p' | tail -1)
  [ -n "$b" ] && backend="\"${b/$tmp/$E/$V}\""
  cpu=$(printf '%s\n' "$out" | grep -v -e load_backend -e ggml_backend | head -1)
else
  log "WARNING: the backend probe did not build ($(tail -1 "$tmp/cc.log")): the portable x64 backend"
fi
if [ "$backend" = null ] && [ -f "$L/ggml/backends0/libggml-cpu-x64.so" ]; then
  backend="\"$E/$V/root/usr/lib/x86_64-linux-gnu/ggml/backends0/libggml-cpu-x64.so\""
fi
build=$(GGML_BACKEND_PATH=x "$loader" --inhibit-cache --library-path "$L:$L/llama" "$tmp/root/usr/bin/llama-cli" \
        --version 2>&1 | sed -n 's/^version: \(.*\)$/\1/p' | head -1)
{
  printf '{\n "schema": "moetrace.engine/1",\n "engine": "llama.cpp",\n "version": "%s",\n' "$ver"
  printf ' "build": "%s",\n "suite": "sid",\n "root": "%s",\n' "$build" "$E/$V/root"
  printf ' "loader": "%s",\n' "${loader/$tmp/$E/$V}"
  printf ' "library_path": ["%s", "%s"],\n' "$E/$V/root/usr/lib/x86_64-linux-gnu" "$E/$V/root/usr/lib/x86_64-linux-gnu/llama"
  printf ' "backend": %s,\n "cpu": "%s",\n "include": "%s",\n' "$backend" "${cpu//\"/}" "$E/$V/root/usr/include"
  printf ' "packages": {'
  sep=""
  for f in "$tmp"/debs/*.deb; do
    printf '%s"%s": "%s"' "$sep" "$(dpkg-deb -f "$f" Package)" "$(dpkg-deb -f "$f" Version)"; sep=", "
  done
  printf '}\n}\n'
} > "$tmp/engine.json"
rm -rf "$tmp/debs" "$tmp/backend-probe" "$tmp/backend-probe.c" "$tmp/cc.log"
python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$tmp/engine.json"
build_logger "$tmp"
rm -rf "${E:?}/$V"
mv "$tmp" "$E/$V"
trap - EXIT
ln -sfn "$V" "$E/current"
log "llama.cpp $ver ($build): $E/$V, backend $(basename "${backend//\"/}")"
