#!/usr/bin/env bash
# Builds the wire-decoder fuzzer (tests/fuzz/decoder_fuzz.cpp) with libFuzzer, ASan and
# UBSan, and runs it for SECONDS (default 60) on a copy of tests/fuzz/corpus/.
# Exits non-zero on any crash, leak or sanitizer report; the input that caused it is
# left in $FUZZ_BUILD_DIR/artifacts/.
#   scripts/fuzz.sh [SECONDS]      env: FUZZ_BUILD_DIR (default build-fuzz/), CXX_FUZZ (default clang++)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-60}
if ! [[ $seconds =~ ^[0-9]+$ ]] || (( seconds < 1 )); then
  echo "usage: $0 [SECONDS]" >&2
  exit 2
fi
build=${FUZZ_BUILD_DIR:-$repo/build-fuzz}
cxx=${CXX_FUZZ:-clang++}
mkdir -p "$build"
build=$(cd "$build" && pwd)

echo "fuzz.sh: building $build/decoder_fuzz"
"$cxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -fno-omit-frame-pointer -Wall -Wextra -Werror -I"$repo" \
  "$repo/tests/fuzz/decoder_fuzz.cpp" -o "$build/decoder_fuzz"

# Work on a copy: libFuzzer adds what it finds to the corpus directory it is given.
rm -rf "$build/corpus" "$build/artifacts"
mkdir -p "$build/corpus" "$build/artifacts"
cp "$repo"/tests/fuzz/corpus/* "$build/corpus/"

log=$build/fuzz.log
echo "fuzz.sh: running for ${seconds}s (log: $log)"
status=0
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:allocator_may_return_null=0 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  "$build/decoder_fuzz" -max_total_time="$seconds" -max_len=4096 -timeout=10 \
  -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$build/artifacts/" \
  "$build/corpus" >"$log" 2>&1 || status=$?

# A sanitizer report fails the run even if the exit status were somehow zero.
if grep -qE 'ERROR: (AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|libFuzzer)|runtime error:|invariant failed' "$log"; then
  (( status == 0 )) && status=1
fi
if ls "$build"/artifacts/* >/dev/null 2>&1; then
  (( status == 0 )) && status=1
fi
if (( status != 0 )); then
  tail -n 60 "$log" >&2
  echo "fuzz.sh: FAILED (status $status); reproducer(s):" >&2
  ls -l "$build"/artifacts/ >&2 || true
  exit "$status"
fi
grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|#[0-9]+ +DONE)' "$log" || true
echo "fuzz.sh: OK, no crash, leak or sanitizer report in ${seconds}s"
