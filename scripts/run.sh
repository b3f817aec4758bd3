#!/usr/bin/env bash
# README command (1): set up, build, start steptraced on a local socket (no root), and walk
# through what it sees of the simulated trainer (examples/sim_trainer): seven worker
# processes sharing two 8 GiB GPUs through a VRAM ledger file, 3 GiB per reservation.
#  - Worker 0 (GPU 0) is SIGKILLed while it holds its reservation: the daemon shows it LEAKED.
#  - Workers 1-3 on GPU 0 and worker 5 on GPU 1 then hold their reservations at once: the
#    ledger sums them per GPU. Worker 1 cleaned up the dead entry (credited to it) and sends
#    three bad annotations; worker 3 reserves without waiting for room, so GPU 0 is
#    over-committed (9 GiB reserved, 8 GiB total). `steptrace stats` counts the anomalies.
#  - steptraced is restarted (SIGTERM writes a snapshot to the state dir; the new daemon
#    restores it and re-checks the holders against /proc): the view is the same.
#  - Worker 4 starts late and waits for VRAM (`steptrace top`). Worker 6 (GPU 1) starts
#    then too (--hang-one): it reserves with a 1 s lease and renews it while it waits to
#    train and every training step, a trainer's heartbeat. The others train, release.
#  - Worker 6 hangs halfway without dying: it stops renewing. Within one liveness interval
#    past its lease the daemon shows it EXPIRED (not LEAKED: its process lives); the
#    trainer's parent, a watchdog, cleans it up (credited to it) and SIGKILLs the worker.
#  - Then the per-step report, the ledger and the stats (lease_expired: 1).
# sim_trainer pauses at checkpoints (--checkpoints) until this script has looked. The
# daemon is stopped with SIGTERM on exit, whatever happens. Any failure exits non-zero with
# a message saying what failed.
#
# Environment: BUILD_DIR (default build), RUN_DIR (default ./run: socket, state, logs),
# STEPS (default 150); SKIP_SETUP=1 / SKIP_BUILD=1 reuse what is there.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${BUILD_DIR:-build}
run_dir=${RUN_DIR:-$PWD/run}
steps=${STEPS:-150}
gib=$((1024 * 1024 * 1024))
gpu0=GPU-00000000-sim0-0000-0000-000000000000
gpu1=GPU-00000000-sim1-0000-0000-000000000000

# A header, then any further arguments as indented explanation lines.
say() {
  printf '\n==> %s\n' "$1"
  shift
  (($# == 0)) || printf '    %s\n' "$@"
}
die() {
  printf 'run.sh: %s\n' "$*" >&2
  exit 1
}

daemon_pid=""
trainer_pid=""
trainer_out=""
# SIGTERM to the daemon, then up to SECONDS for it to exit; fails if it still runs.
term_daemon() {
  local polls=$(($1 * 10))
  kill -TERM "$daemon_pid" 2>/dev/null || true
  for _ in $(seq "$polls"); do
    kill -0 "$daemon_pid" 2>/dev/null || return 0
    sleep 0.1
  done
  ! kill -0 "$daemon_pid" 2>/dev/null
}
cleanup() {
  local status=$?
  if [[ -n $trainer_pid ]] && kill -0 "$trainer_pid" 2>/dev/null; then
    kill -KILL "$trainer_pid" 2>/dev/null || true # its workers die with it (PDEATHSIG)
    wait "$trainer_pid" 2>/dev/null || true
  fi
  if ((status != 0)) && [[ -n $trainer_out && -s $trainer_out ]]; then
    printf 'run.sh: sim_trainer printed:\n' >&2
    cat "$trainer_out" >&2
  fi
  if [[ -n $daemon_pid ]] && kill -0 "$daemon_pid" 2>/dev/null; then
    if ! term_daemon 10; then
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
checkpoints=$run_dir/checkpoints
trainer_out_file=$run_dir/sim_trainer.out
export STEPTRACE_SOCKET=$socket

if "$steptrace" --timeout 2 ping >/dev/null 2>&1; then
  die "a steptraced already answers on $socket; stop it first (or set RUN_DIR elsewhere)"
fi
# A fresh run: no aggregates restored from an earlier one, an empty ledger file.
rm -rf "$state_dir" "$ledger_file" "$checkpoints" "$log" "$trainer_out_file"
mkdir -p "$state_dir" "$checkpoints"

start_daemon() {
  "$steptraced" --config config/steptraced.json --socket "$socket" --state-dir "$state_dir" \
    2>>"$log" &
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
}

stop_daemon() {
  term_daemon 5 || die "steptraced (pid $daemon_pid) still runs 5 s after SIGTERM"
  local status=0
  wait "$daemon_pid" || status=$?
  daemon_pid=""
  ((status == 0)) || die "steptraced exited with status $status on SIGTERM; see $log"
}

# Waits (bounded) until sim_trainer reaches checkpoint $1.
reach() {
  for _ in $(seq 600); do
    [[ -e $checkpoints/$1.reached ]] && return 0
    kill -0 "$trainer_pid" 2>/dev/null || break
    sleep 0.05
  done
  [[ -e $checkpoints/$1.reached ]] ||
    die "sim_trainer did not reach its '$1' checkpoint (exited, or 30 s passed)"
}
# Lets sim_trainer go on from checkpoint $1.
go_on() { touch "$checkpoints/$1.go"; }

ledger() { "$steptrace" ledger || die "steptrace ledger failed"; }
# The non-zero ledger anomaly counters of `steptrace stats`.
anomalies() {
  local stats
  stats=$("$steptrace" stats) || die "steptrace stats failed"
  awk -F': ' '/^ledger_anomalies\./ && $2 != "0"' <<<"$stats"
}
# The reservation rows of a ledger text (ID | PID | Process | Task | Size | Age | Lease |
# Holder), without the Age and Lease columns, which change as time passes.
reservation_rows() {
  awk -F' *[|] *' 'NF == 8 && $8 ~ /^(alive|LEAKED|EXPIRED)$/ { print $1, $2, $3, $4, $5, $8 }'
}
expect() { # TEXT PATTERN WHAT
  grep -qE -- "$2" <<<"$1" || die "expected $3 (no match for '$2')"
}

say "Starting steptraced on $socket (state in $state_dir, log in $log)"
start_daemon

say "Running sim_trainer: 7 workers x $steps steps, two 8 GiB GPUs, 3 GiB per reservation" \
  "GPU 0 $gpu0: workers 0-4" "GPU 1 $gpu1: workers 5-6"
# The job id reports and metrics group its processes by (torchrun and Slurm set theirs).
STEPTRACE_JOB=sim-demo \
  "$sim_trainer" --gpu "$gpu0" --workers 5 --gpu "$gpu1" --workers 2 --steps "$steps" \
  --vram-total $((8 * gib)) --reserve $((3 * gib)) --kill-one --anomalies --overcommit \
  --late-workers 1 --hang-one --lease-ms 1000 --ledger "$ledger_file" \
  --checkpoints "$checkpoints" >"$trainer_out_file" &
trainer_pid=$!
trainer_out=$trainer_out_file

reach killed
say "steptrace ledger: worker 0 was SIGKILLed holding 3 GiB on GPU 0, its reservation is LEAKED" \
  "(the daemon notices a death within one liveness interval, 500 ms: reports never probe)"
for _ in $(seq 50); do
  ledger_now=$(ledger)
  grep -q 'LEAKED' <<<"$ledger_now" && break
  sleep 0.1
done
echo "$ledger_now"
expect "$ledger_now" 'LEAKED' "the killed worker's reservation shown as LEAKED"
go_on killed

reach holding
say "steptrace ledger: workers 1-3 hold 3 GiB each on GPU 0, worker 5 holds 3 GiB on GPU 1" \
  "Reserved bytes are summed per GPU; \`steptrace report\` ends with this same view." \
  "Worker 1 removed the dead worker's entry: the cleanup is credited to it (Cleanups 1)." \
  "Worker 3 reserved without waiting for room: 9 GiB reserved > 8 GiB total, OVERCOMMITTED."
held=$(ledger)
echo "$held"
expect "$held" 'OVERCOMMITTED' "GPU 0 over-committed"
expect "$held" 'Reservations: 3$' "three reservations on GPU 0"
expect "$held" 'Reservations: 1$' "one reservation on GPU 1"
[[ $(reservation_rows <<<"$held" | grep -c ' alive$') == 4 ]] || die "expected 4 live holders"

say "steptrace stats: the ledger anomalies counted so far (kinds not listed are 0)" \
  "Worker 1 sent its reservation id again, a 0-byte reserve and a release of an id nobody" \
  "holds: each refused and counted. Going over-committed counts once."
counts=$(anomalies)
echo "$counts"
for kind in duplicate_reservation zero_byte_reserve unknown_release overcommitted; do
  expect "$counts" "^ledger_anomalies\\.$kind: [1-9]" "a non-zero $kind count"
done

say "Restarting steptraced while they hold: SIGTERM (it writes its snapshot), then start it" \
  "again on the same state dir"
stop_daemon
snapshot=$state_dir/steptraced.snapshot.json
[[ -s $snapshot ]] || die "steptraced wrote no snapshot $snapshot on SIGTERM"
echo "snapshot written: $snapshot ($(stat -c %s "$snapshot") bytes)"
start_daemon
grep 'restored snapshot' "$log" || true # its log line, when it says so
say "steptrace ledger after the restart: the same view, restored from the snapshot" \
  "Each holder was re-checked against /proc (pid and start time): all four still alive."
restored=$(ledger)
echo "$restored"
[[ $(reservation_rows <<<"$restored") == "$(reservation_rows <<<"$held")" ]] ||
  die "the restarted daemon's reservations differ from those before the restart"
expect "$restored" 'OVERCOMMITTED' "GPU 0 still over-committed after the restart"
go_on holding

reach waiting
# Worker 4 polls for VRAM while the others still hold it; `top` shows it at a glance.
waiting_seen=""
for _ in $(seq 100); do
  top_now=$("$steptrace" top --iterations 1 2>&1) || die "steptrace top failed: $top_now"
  if grep -q "WAITING FOR VRAM" <<<"$top_now"; then
    waiting_seen=1
    say "steptrace top: worker 4 started late and waits for VRAM on GPU 0"
    echo "$top_now"
    break
  fi
  sleep 0.02
done
go_on waiting
[[ -n $waiting_seen ]] || die "steptrace top never showed worker 4 WAITING FOR VRAM"

# Worker 6 trains half its steps, renewing its lease each step, then hangs. sim_trainer
# stops at this checkpoint once the daemon shows the lease EXPIRED; look for it here too
# (bounded: 10 s, though it takes at most one liveness interval past the lease).
reach expired
expired_now=""
for _ in $(seq 100); do
  expired_now=$(ledger)
  grep -q '| EXPIRED$' <<<"$expired_now" && break
  sleep 0.1
done
say "steptrace ledger: worker 6 hangs without dying: it stopped renewing its 1 s lease" \
  "The daemon marks it EXPIRED within one liveness interval (500 ms) once the lease passes;" \
  "unlike LEAKED, its process is alive (a hung trainer, not a dead one). Anyone may clean" \
  "up an EXPIRED lease: next the trainer's parent, a watchdog, cleans it up (credited to it)" \
  "and SIGKILLs the hung worker; the others go on."
echo "$expired_now"
expect "$expired_now" '[|] EXPIRED$' "the hung worker's reservation shown as EXPIRED within 10 s"
expect "$expired_now" 'Reservations: [0-9]+ \(1 expired\)$' "one expired reservation (GPU 1)"
hung_rows=$(reservation_rows <<<"$expired_now" | awk '$NF == "EXPIRED"')
[[ $(wc -l <<<"$hung_rows") == 1 && $(awk '{ print $3 }' <<<"$hung_rows") == sim-worker-6 ]] ||
  die "expected one EXPIRED reservation, worker 6's; got: $hung_rows"
hung_pid=$(awk '{ print $2 }' <<<"$hung_rows")
kill -0 "$hung_pid" 2>/dev/null || die "the hung worker (pid $hung_pid) is not alive"
go_on expired

say "sim_trainer's summary (the holders trained and released, then worker 4 got its turn;" \
  "worker 6's expired reservation was cleaned up by the janitor, which SIGKILLed it)"
trainer_status=0
wait "$trainer_pid" || trainer_status=$?
trainer_pid=""
trainer_out=""
cat "$trainer_out_file"

say "steptrace report (grouped by job: sim_trainer ran as job sim-demo)"
report=$("$steptrace" report) || die "steptrace report failed"
echo "$report"
expect "$report" '^══ Job sim-demo \(uid [0-9]+\) · [0-9]+ processes' "the job's section"
expect "$("$steptrace" metrics)" '^steptrace_job_step_seconds_total\{job_id="sim-demo",uid="[0-9]+",step="Forward"\} [0-9.e+-]+$' \
  "per-job step time in the metrics"
say "steptrace ledger: everything released (Releases) or cleaned up (Cleanups): worker 0's" \
  "leak by worker 1 on GPU 0, worker 6's expired lease by the janitor (sim_trainer) on GPU 1"
final_ledger=$(ledger)
echo "$final_ledger"
((trainer_status == 0)) || die "sim_trainer failed with status $trainer_status (its summary is above)"
expect "$final_ledger" '^  Reservations: 0$' "no reservation left"
[[ $(grep -c '^  Reservations: 0$' <<<"$final_ledger") == 2 ]] ||
  die "expected both GPUs to hold no reservation at the end"
expect "$final_ledger" '^ +[0-9]+ +[|] sim_trainer +[|] 0 +[|] 0 +[|] 1 +[|]' \
  "the expired lease's cleanup credited to the janitor (sim_trainer: Cleanups 1)"
say "steptrace stats: the ledger anomalies, kept across the restart; one lease expired"
counts=$(anomalies)
echo "$counts"
expect "$counts" '^ledger_anomalies\.lease_expired: 1$' "lease_expired counted exactly once"

say "Stopping steptraced (SIGTERM)"
stop_daemon
echo "done: steptraced stopped cleanly; its snapshot is in $state_dir"
