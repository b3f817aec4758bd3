#!/usr/bin/env bash
# Builds the Debian package: configures BUILD_DIR (default build/) when it has no build
# system yet, builds it, runs cpack -G DEB into BUILD_DIR/package, and prints the path of
# the .deb (the only line on stdout; the rest goes to stderr). Installs nothing: that is
# `sudo apt install ./steptrace_VERSION_ARCH.deb` (scripts/deb-install-check.sh tries it
# on a throw-away machine). Usage: scripts/package.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-${BUILD_DIR:-build}}

if [[ ! -f $build_dir/CMakeCache.txt ]]; then
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" \
    -DSTEPTRACE_WERROR=ON >&2
fi
cmake --build "$build_dir" -j "$(nproc)" >&2
if [[ ! -f $build_dir/CPackConfig.cmake ]]; then
  echo "package: $build_dir has no CPackConfig.cmake: configure it with STEPTRACE_INSTALL=ON" >&2
  exit 1
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
cpack -G DEB --config "$build_dir/CPackConfig.cmake" -B "$build_dir/package" >"$log" 2>&1 ||
  { cat "$log" >&2; echo "package: cpack -G DEB failed" >&2; exit 1; }
# "CPack: - package: /abs/path/steptrace_0.1.0_amd64.deb generated."
deb=$(sed -n 's/^CPack: - package: \(.*\.deb\) generated\.$/\1/p' "$log")
if [[ -z $deb || ! -f $deb ]]; then
  cat "$log" >&2
  echo "package: cpack did not say which .deb it made" >&2
  exit 1
fi
echo "$deb"
