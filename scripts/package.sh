#!/usr/bin/env bash
# Builds the packages: configures BUILD_DIR (default build/) when it has no build system
# yet, builds it, runs cpack -G DEB into PACKAGE_DIR (default BUILD_DIR/package), puts the
# build's Python wheel (BUILD_DIR/python/steptrace-VERSION-py3-none-PLATFORM.whl, made by
# bindings/python/CMakeLists.txt) beside the .deb, and prints their paths: the .deb on
# the first line of stdout, the wheel on the second (the rest goes to stderr). A build
# without python3 has no wheel: stderr says so and stdout has the .deb only. Installs
# nothing: that is `sudo apt install ./steptrace_VERSION_ARCH.deb` (scripts/
# deb-install-check.sh tries it on a throw-away machine), or `pip install --no-index
# steptrace-*.whl` in any venv. PACKAGE_BUILD=0: BUILD_DIR is built already (tests).
# Usage: scripts/package.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-${BUILD_DIR:-build}}
package_dir=${PACKAGE_DIR:-$build_dir/package}

if [[ ! -f $build_dir/CMakeCache.txt ]]; then
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" \
    -DSTEPTRACE_WERROR=ON >&2
fi
if [[ ${PACKAGE_BUILD:-1} != 0 ]]; then
  cmake --build "$build_dir" -j "$(nproc)" >&2
fi
if [[ ! -f $build_dir/CPackConfig.cmake ]]; then
  echo "package: $build_dir has no CPackConfig.cmake: configure it with STEPTRACE_INSTALL=ON" >&2
  exit 1
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
"${CPACK:-cpack}" -G DEB --config "$build_dir/CPackConfig.cmake" -B "$package_dir" >"$log" 2>&1 ||
  { cat "$log" >&2; echo "package: cpack -G DEB failed" >&2; exit 1; }
# "CPack: - package: /abs/path/steptrace_0.1.0_amd64.deb generated."
deb=$(sed -n 's/^CPack: - package: \(.*\.deb\) generated\.$/\1/p' "$log")
if [[ -z $deb || ! -f $deb ]]; then
  cat "$log" >&2
  echo "package: cpack did not say which .deb it made" >&2
  exit 1
fi
echo "$deb"

# The wheel of this version (an older build's may still lie beside it).
version=$(sed -n 's/^set(CPACK_PACKAGE_VERSION "\(.*\)")$/\1/p' "$build_dir/CPackConfig.cmake")
wheels=("$build_dir"/python/steptrace-"$version"-py3-none-*.whl)
if [[ ! -f ${wheels[0]} ]]; then
  echo "package: no Python wheel in $build_dir/python (configured without python3?): the .deb only" >&2
  exit 0
fi
if [[ ${#wheels[@]} -ne 1 ]]; then
  echo "package: more than one wheel of $version in $build_dir/python: ${wheels[*]}" >&2
  exit 1
fi
wheel="$(dirname "$deb")/$(basename "${wheels[0]}")"
cp -f "${wheels[0]}" "$wheel"
echo "$wheel"
