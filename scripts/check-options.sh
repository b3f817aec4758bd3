#!/usr/bin/env bash
# Every build option can be turned off on its own: configures (only) the tree with each
# of STEPTRACE_BUILD_TESTS, _BENCH, _DAEMON and _EXAMPLES OFF in turn, and with all four
# OFF, each into a fresh temporary directory, then fully builds the all-OFF (client-only)
# configuration with -Werror. Fails on the first configuration that does not configure
# or build, showing its output. Runs scripts/setup.sh first unless SKIP_SETUP=1.
#   scripts/check-options.sh       env: JOBS (default nproc), BUILD_TYPE (default Debug)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ ${SKIP_SETUP:-0} != 1 ]]; then
  scripts/setup.sh
fi

options=(STEPTRACE_BUILD_TESTS STEPTRACE_BUILD_BENCH STEPTRACE_BUILD_DAEMON STEPTRACE_BUILD_EXAMPLES)
work=$(mktemp -d "${TMPDIR:-/tmp}/steptrace-options.XXXXXX")
trap 'rm -rf "$work"' EXIT

# configure NAME -DOPTION=OFF ...: configures into $work/NAME, quietly unless it fails.
configure() {
  local name=$1
  shift
  if ! cmake -S . -B "$work/$name" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Debug}" \
    -DSTEPTRACE_WERROR=ON "$@" >"$work/$name.log" 2>&1; then
    cat "$work/$name.log" >&2
    echo "check-options: FAILED to configure with $*" >&2
    exit 1
  fi
  echo "check-options: configures with $*"
  # What it skips, and why (the tree's message(STATUS) lines).
  grep -E '^-- (tests|bench)' "$work/$name.log" | sed 's/^-- /    /' || true
}

for option in "${options[@]}"; do
  configure "no-${option#STEPTRACE_BUILD_}" "-D$option=OFF"
done
all_off=()
for option in "${options[@]}"; do all_off+=("-D$option=OFF"); done
configure client-only "${all_off[@]}"

if ! cmake --build "$work/client-only" -j "${JOBS:-$(nproc)}" >"$work/client-only-build.log" 2>&1; then
  tail -n 80 "$work/client-only-build.log" >&2
  echo "check-options: FAILED to build the client-only configuration (${all_off[*]})" >&2
  exit 1
fi
for f in client/libsteptrace.so client/libsteptrace.a include/steptrace/version.h; do
  [[ -e $work/client-only/$f ]] || { echo "check-options: client-only build has no $f" >&2; exit 1; }
done
echo "check-options: builds with ${all_off[*]} (the client library only)"
