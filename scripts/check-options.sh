#!/usr/bin/env bash
# Every build option can be turned off on its own: configures (only) the tree with each
# of STEPTRACE_BUILD_TESTS, _BENCH, _DAEMON and _EXAMPLES OFF in turn, and with all four
# OFF, each into a fresh temporary directory, then fully builds the all-OFF (client-only)
# configuration with -Werror. The four single-option configures run side by side while
# the all-OFF one is configured and built. Fails, showing its output, on the first (in
# that order) that does not configure or build. Runs scripts/setup.sh first unless
# SKIP_SETUP=1.
#   scripts/check-options.sh       env: JOBS (default nproc), BUILD_TYPE (default Debug)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ ${SKIP_SETUP:-0} != 1 ]]; then
  scripts/setup.sh
fi

options=(STEPTRACE_BUILD_TESTS STEPTRACE_BUILD_BENCH STEPTRACE_BUILD_DAEMON STEPTRACE_BUILD_EXAMPLES)
work=$(mktemp -d "${TMPDIR:-/tmp}/steptrace-options.XXXXXX")
trap 'rm -rf "$work"' EXIT

# configure NAME -DOPTION=OFF ...: configures into $work/NAME, quietly (its output in
# $work/NAME.log); the status is cmake's.
configure() {
  local name=$1
  shift
  cmake -S . -B "$work/$name" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Debug}" \
    -DSTEPTRACE_WERROR=ON "$@" >"$work/$name.log" 2>&1
}
# report NAME STATUS -DOPTION=OFF ...: says whether NAME configured (and what its tree
# skips, and why: the message(STATUS) lines); on failure shows its output and exits.
report() {
  local name=$1 status=$2
  shift 2
  if ((status != 0)); then
    cat "$work/$name.log" >&2
    echo "check-options: FAILED to configure with $*" >&2
    exit 1
  fi
  echo "check-options: configures with $*"
  grep -E '^-- (tests|bench)' "$work/$name.log" | sed 's/^-- /    /' || true
}

# A configure runs mostly one process at a time: the four with one option OFF run side by
# side, in the background, while the client-only tree is configured and built; all are
# waited for, then reported in this order.
pids=()
for option in "${options[@]}"; do
  configure "no-${option#STEPTRACE_BUILD_}" "-D$option=OFF" &
  pids+=($!)
done
all_off=()
for option in "${options[@]}"; do all_off+=("-D$option=OFF"); done
client_only_status=0
configure client-only "${all_off[@]}" || client_only_status=$?
build_status=0
if ((client_only_status == 0)); then
  cmake --build "$work/client-only" -j "${JOBS:-$(nproc)}" >"$work/client-only-build.log" 2>&1 ||
    build_status=$?
fi
statuses=()
for pid in "${pids[@]}"; do
  status=0
  wait "$pid" || status=$?
  statuses+=("$status")
done
for i in "${!options[@]}"; do
  report "no-${options[$i]#STEPTRACE_BUILD_}" "${statuses[$i]}" "-D${options[$i]}=OFF"
done
report client-only "$client_only_status" "${all_off[@]}"

if ((build_status != 0)); then
  tail -n 80 "$work/client-only-build.log" >&2
  echo "check-options: FAILED to build the client-only configuration (${all_off[*]})" >&2
  exit 1
fi
for f in client/libsteptrace.so client/libsteptrace.a include/steptrace/version.h; do
  [[ -e $work/client-only/$f ]] || { echo "check-options: client-only build has no $f" >&2; exit 1; }
done
echo "check-options: builds with ${all_off[*]} (the client library only)"
