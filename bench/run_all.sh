#!/usr/bin/env bash
# Runs every benchmark of bench/ in turn and keeps their output: the commands behind
# bench/RESULTS.md. Usage: bench/run_all.sh [BUILD_DIR] [OUT_DIR]
#   BUILD_DIR: a Release build with STEPTRACE_BUILD_BENCH=ON (default: build)
#   OUT_DIR:   where the outputs go (default: BUILD_DIR/bench-results)
# Figures are printed, never asserted; e2e_load and memory_bench exit non-zero only when
# the daemon's counts are not exact.
set -euo pipefail
build_dir=${1:-build}
out_dir=${2:-$build_dir/bench-results}
mkdir -p "$out_dir"
bin=$build_dir/bench

run() {
  local name=$1
  shift
  echo "== $name: $* (load average: $(cut -d' ' -f1-3 /proc/loadavg))" | tee "$out_dir/$name.txt"
  "$@" 2>&1 | tee -a "$out_dir/$name.txt"
}

run hot_path "$bin/hot_path_bench" --benchmark_repetitions=5
run hot_path_monotonic env STEPTRACE_CLOCK=monotonic "$bin/hot_path_bench" --benchmark_repetitions=5
run ingest "$bin/ingest_bench" --benchmark_repetitions=5
run trace_export "$bin/trace_export_bench" --benchmark_repetitions=5
run burst "$bin/burst_bench"
run spare_ring "$bin/spare_ring_bench" --benchmark_repetitions=5
run spare_ring_socket env STEPTRACE_SHM_RINGS=0 "$bin/spare_ring_bench" --benchmark_repetitions=5
run e2e "$bin/e2e_load" --procs 2 --spans 10000000 --runs 3
run e2e_monotonic env STEPTRACE_CLOCK=monotonic "$bin/e2e_load" --procs 2 --spans 10000000 --runs 3
run e2e_default_search "$bin/e2e_load" --procs 2 --spans 10000000 --runs 3 --search
run snapshot "$bin/snapshot_bench"
run memory "$bin/memory_bench" --spans-per-thread 20000000 --threads 4 --processes 1000 \
  --spans-per-step 100
echo "outputs in $out_dir"
