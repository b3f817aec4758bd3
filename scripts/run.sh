#!/usr/bin/env bash
# README command (1): set up, build, start steptraced on a local socket (no root), run the
# simulated multi-process trainer against it (4 workers sharing one GPU, one of them
# SIGKILLed while it holds VRAM), and print what the daemon saw: the leaked reservation,
# then the per-step report and the VRAM ledger. The daemon is stopped with SIGTERM on
# exit, whatever happens. Any failure exits non-zero with a message saying what failed.
#
# Environment: BUILD_DIR (default build), RUN_DIR (default ./run: socket, state, logs),
# WORKERS (default 4), STEPS (default 150); SKIP_SETUP=1 / SKIP_BUILD=1 reuse what is there.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${BUILD_DIR:-build}
run_dir=${RUN_DIR:-$PWD/run}
workers=${WORKERS:-4}
steps=${STEPS:-150}
gib=$((1024 * 1024 * 1024))

say() { printf '\n==> %s\n' "$*"; }
die() {
  printf 'run.sh: %s\n' "$*" >&2
  exit 1
}

daemon_pid=""
trainer_pid=""
cleanup() {
  local status=$?
  if [[ -n $trainer_pid ]] && kill -0 "$trainer_pid" 2>/dev/null; then
    kill -KILL "$trainer_pid" 2>/dev/null || true
  fi
  if [[ -n $daemon_pid ]] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -TERM "$daemon_pid" 2>/dev/null || true
    for _ in $(seq 100); do
      kill -0 "$daemon_pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$daemon_pid" 2>/dev/null; then
      printf 'run.sh: steptraced (pid %s) ignored SIGTERM for 10 s; killing it\n' "$daemon_pid" >&2
      kill -KILL "$daemon_pid" 2>/dev/null || true
      status=1
    fi
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ ${SKIP_SETUP:-0} != 1 ]]; then
  say "Setting up packages (scripts/setup.sh)"
  scripts/setup.sh || die "scripts/setup.sh failed"
fi
if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  say "Building into $build_dir (scripts/build.sh)"
  BUILD_DIR=$build_dir scripts/build.sh || die "the build failed (see above)"
fi
steptraced=$build_dir/daemon/steptraced
steptrace=$build_dir/cli/steptrace
sim_trainer=$build_dir/examples/sim_trainer
for bin in "$steptraced" "$steptrace" "$sim_trainer"; do
  [[ -x $bin ]] || die "$bin was not built"
done

mkdir -p "$run_dir"
socket=$run_dir/steptraced.sock
if ((${#socket} > 100)); then
  # sun_path holds at most 107 bytes: fall back to a short private directory.
  short_dir=$(mktemp -d "${XDG_RUNTIME_DIR:-/tmp}/steptrace.XXXXXX")
  socket=$short_dir/steptraced.sock
fi
state_dir=$run_dir/state
log=$run_dir/steptraced.log
ledger_file=$run_dir/vram-ledger.txt
export STEPTRACE_SOCKET=$socket

if "$steptrace" --timeout 2 ping >/dev/null 2>&1; then
  die "a steptraced already answers on $socket; stop it first (or set RUN_DIR elsewhere)"
fi
# A fresh run: no aggregates restored from an earlier one, an empty ledger file.
rm -rf "$state_dir" "$ledger_file"
mkdir -p "$state_dir"

say "Starting steptraced on $socket (state in $state_dir, log in $log)"
"$steptraced" --config config/steptraced.json --socket "$socket" --state-dir "$state_dir" \
  2>"$log" &
daemon_pid=$!
for _ in $(seq 100); do
  if ! kill -0 "$daemon_pid" 2>/dev/null; then
    cat "$log" >&2
    die "steptraced exited during start-up (its log is above)"
  fi
  if "$steptrace" --timeout 1 ping >/dev/null 2>&1; then break; fi
  sleep 0.1
done
"$steptrace" --timeout 2 ping >/dev/null ||
  die "steptraced (pid $daemon_pid) did not answer ping within 10 s; see $log"
echo "steptraced pid $daemon_pid answers ping"

say "Running sim_trainer: $workers workers x $steps steps sharing one 8 GiB GPU, 3 GiB each; worker 0 is SIGKILLed while it holds its reservation"
"$sim_trainer" --workers "$workers" --steps "$steps" --kill-one --ledger "$ledger_file" \
  --vram-total $((8 * gib)) --reserve $((3 * gib)) --pause-after-kill-ms 1500 &
trainer_pid=$!

# While the others wait to start, the daemon shows the dead worker's reservation leaked.
leak_seen=""
for _ in $(seq 100); do
  ledger_now=$("$steptrace" ledger 2>&1) || die "steptrace ledger failed: $ledger_now"
  if grep -q LEAKED <<<"$ledger_now"; then
    leak_seen=1
    say "The daemon's VRAM ledger right after the kill (the reservation is LEAKED)"
    echo "$ledger_now"
    break
  fi
  kill -0 "$trainer_pid" 2>/dev/null || break
  sleep 0.05
done

# Two 3 GiB reservations fill the 8 GiB GPU: a third worker polls for VRAM, and `top`
# shows it at a glance.
waiting_seen=""
for _ in $(seq 200); do
  kill -0 "$trainer_pid" 2>/dev/null || break
  top_now=$("$steptrace" top --iterations 1 2>&1) || die "steptrace top failed: $top_now"
  if grep -q "WAITING FOR VRAM" <<<"$top_now"; then
    waiting_seen=1
    say "steptrace top while a worker waits for VRAM"
    echo "$top_now"
    break
  fi
  sleep 0.02
done
[[ -n $waiting_seen ]] || echo "(no worker was caught waiting for VRAM by steptrace top this time)"

trainer_status=0
wait "$trainer_pid" || trainer_status=$?
trainer_pid=""

say "steptrace report"
"$steptrace" report || die "steptrace report failed"
say "steptrace ledger (the cleanup is credited to the worker that removed the dead entry)"
"$steptrace" ledger || die "steptrace ledger failed"

((trainer_status == 0)) || die "sim_trainer failed with status $trainer_status (its summary is above)"
[[ -n $leak_seen ]] || die "the daemon never showed the killed worker's reservation as LEAKED"

say "Stopping steptraced (SIGTERM)"
kill -TERM "$daemon_pid"
daemon_status=0
wait "$daemon_pid" || daemon_status=$?
daemon_pid=""
((daemon_status == 0)) || die "steptraced exited with status $daemon_status on SIGTERM; see $log"
echo "done: steptraced stopped cleanly; its snapshot is in $state_dir"
