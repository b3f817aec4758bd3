#!/usr/bin/env bash
# Soak test (issue 15): honest trainers beside hostile tenants, against the real
# steptraced, for SECONDS seconds.
#
# Starts the steptraced of BUILD_DIR on a temporary socket and state dir with the shipped
# defaults (config/steptraced.json; only socket, socket_mode, state_dir and metrics_listen
# differ), then
# runs at the same time:
#   honest tenant (with root: uid 60005, an unprivileged tenant with no share but its own;
#   without root the script's own uid):
#     - py-trainer: a Python trainer (bindings/python) on 2 threads, ~1,000 spans/s, a
#       burst of 20,000 spans every 5 s, steptrace.flush every second (its own drops,
#       flush failures and slowest flush are read from its status file);
#     - sim_trainer (examples/sim_trainer) in a loop: 2 workers sharing a VRAM ledger
#       file, 1,000 steps a run (a run that fails, e.g. a flush timing out, is counted);
#     - a pinger: a `ping` text command on a new connection every 0.5 s, timed.
#     - a scraper: `GET /metrics` over HTTP (metrics_listen on a free loopback port) and
#       `stats --json` on the socket every second, each timed; `stats` also gives the
#       daemon's charged state bytes, set beside its RSS (issue 26: within 25%).
#   hostile tenants (with root: four other uids, 60001 to 60004, via setpriv, so the
#   per-uid quotas are what protects the honest one; without root every client shares
#   the script's uid and the quotas apply to all of them together):
#     uid 60001, connection hogs:
#       - 300 idle text connections, each sent `ping` once and then sits (reopened when
#         the daemon closes it: timeouts.text_idle_ms);
#       - 8 connections that ask for `report --json` and never read (reopened when closed);
#     uid 60002, churn and junk:
#       - 20 silent connections (raw_client silent) and 10 slow ones (raw_client slow,
#         one byte every 2 s), reopened when the daemon closes them;
#       - short-lived binary clients (raw_client good, 3 pairs), ~8 a second;
#       - ledger leaks: ledger_worker making 32 reservations on 64 junk GPU UUIDs in
#         turn (the uid's 16-GPU quota admits those on its first 16) and exiting while
#         holding them, ~3 a second, until the uid's reservation quota refuses more;
#       - bad streams (raw_client garbage/oversize/badversion/badstep/truncated), ~5 a second;
#       - readers: `report --json`, `metrics`, `ledger --json`, `stats`, ~2 a second;
#       - state, every 3 s in turn: raw_client good with 1,024 thread ids and a custom
#         step, or a Python client registering 1,100 custom steps (past
#         max_custom_steps) and recording each on 2 threads.
#     uid 60003, the state-size bomb: up to BOMB_PROCS (default 48) processes at once
#       (raw_client good --customs), each registering 1,024 custom steps and recording
#       each on 256 thread ids (262,144 per-thread step states and 1,024 histograms a
#       process), then staying connected 2 minutes; a new one every second. Together
#       more than limits.max_state_bytes (1 GiB): the uid's share refuses the rest
#       (counted as `refused`), never another uid's spans.
#     uid 60004, the render flood and the trace lock-out:
#       - 16 connections each looping `report --json` (reading every reply) and 8
#         keep-alive HTTP connections looping `GET /metrics`;
#       - `trace --for 3600` on a new connection every 0.2 s, closed 0.3 s later (each
#         must end its wait at once, not hold a slot for the hour);
#       - the same uid's own trainer (raw_client good, 4 threads x 50 pairs) every 2 s:
#         it must connect and get its FlushAck every time (a lock-out fails the run).
# Every 10 s one line: elapsed s, the machine's 1-minute load average, daemon RSS
# (VmRSS), daemon CPU % of one core over the interval (utime+stime), the slowest ping of
# the interval and the last one, how long the sampler's `report --json` took, the honest
# tenant's dropped events (daemon's view, max per process seen; and the py-trainer's own
# count), py-trainer flush failures, sim_trainer failed runs, connections now / rejected
# in total, limit hits in total, processes tracked, leaked reservations, the slowest
# HTTP scrape and `stats` of the interval, the charged state MiB and charged/RSS,
# (charged + view copies + pending replies + flight recorder)/RSS, the lock-out uid's
# failed trainer runs. Then a summary.
#
# Exit status: 0 when the daemon stayed up (and stopped cleanly on SIGTERM within
# STOP_BOUND_S), the honest
# tenant dropped nothing and lost no flush or run, the slowest ping stayed under
# PING_BOUND_MS (default 2000), the slowest scrape and `stats` under SCRAPE_BOUND_MS
# (default 5000), and the lock-out uid's trainer never failed; 1 otherwise, with the
# reasons; 2 bad usage.
# Environment: PING_BOUND_MS, SCRAPE_BOUND_MS, STOP_BOUND_S, BOMB_PROCS (default 48), INTERVAL_S
# (default 10), KEEP_DIR=1 (keep the temp dir).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/soak.sh SECONDS [--build-dir DIR]

Runs steptraced (from DIR, default build/) with honest trainers and hostile clients
together for SECONDS seconds, printing every 10 s the daemon's RSS, CPU, ping latency,
the honest trainers' drops, connections and limit hits, then a summary.
Exit 0: daemon up, no honest drops, max ping < PING_BOUND_MS (2000), max scrape and
stats < SCRAPE_BOUND_MS (5000), the lock-out uid's trainer never failed. Else 1.
EOF
}

repo=$(cd "$(dirname "$0")/.." && pwd)
build_dir=$repo/build
seconds=""
while (($# > 0)); do
  case $1 in
    -h | --help)
      usage
      exit 0
      ;;
    --build-dir)
      (($# >= 2)) || {
        usage >&2
        exit 2
      }
      build_dir=$2
      shift 2
      ;;
    --build-dir=*)
      build_dir=${1#--build-dir=}
      shift
      ;;
    *)
      if [[ -z $seconds && $1 =~ ^[0-9]+$ ]] && (($1 > 0)); then
        seconds=$1
        shift
      else
        printf 'soak.sh: bad argument: %s\n' "$1" >&2
        usage >&2
        exit 2
      fi
      ;;
  esac
done
if [[ -z $seconds ]]; then
  usage >&2
  exit 2
fi
[[ -d $build_dir ]] || {
  printf 'soak.sh: no build directory %s\n' "$build_dir" >&2
  exit 2
}
build_dir=$(cd "$build_dir" && pwd)
ping_bound_ms=${PING_BOUND_MS:-2000}
scrape_bound_ms=${SCRAPE_BOUND_MS:-5000}
bomb_procs=${BOMB_PROCS:-48}
[[ $bomb_procs =~ ^[0-9]+$ ]] || {
  printf 'soak.sh: BOMB_PROCS must be a number, not %s\n' "$bomb_procs" >&2
  exit 2
}
interval=${INTERVAL_S:-10}

steptraced=$build_dir/daemon/steptraced
steptrace=$build_dir/cli/steptrace
raw_client=$build_dir/tests/server/raw_client
ledger_worker=$build_dir/tests/ledger/ledger_worker
sim_trainer=$build_dir/examples/sim_trainer
libsteptrace=$build_dir/client/libsteptrace.so
for f in "$steptraced" "$steptrace" "$raw_client" "$ledger_worker" "$sim_trainer" "$libsteptrace"; do
  [[ -e $f ]] || {
    printf 'soak.sh: %s is missing (build with scripts/build.sh first)\n' "$f" >&2
    exit 1
  }
done
python=$(command -v python3) || {
  echo "soak.sh: python3 is needed" >&2
  exit 1
}
# The hostile tenants' python: a system one, which other uids can run.
hostile_python=/usr/bin/python3
[[ -x $hostile_python ]] || hostile_python=$python

script_uid=$(id -u)
if ((script_uid == 0)); then
  honest_uid=60005
  hog_uid=60001
  junk_uid=60002
  bomb_uid=60003
  flood_uid=60004
else
  honest_uid=$script_uid
  hog_uid=$honest_uid
  junk_uid=$honest_uid
  bomb_uid=$honest_uid
  flood_uid=$honest_uid
  echo "soak.sh: not root: every client runs as uid $honest_uid, so the per-uid quotas" \
    "apply to honest and hostile clients together" >&2
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/steptrace-soak.XXXXXX")
daemon_pid=""
sleeper_pid=""
jobs_pids=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  local pid
  for pid in "${jobs_pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  sleep 0.5
  for pid in "${jobs_pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  [[ -z $sleeper_pid ]] || kill "$sleeper_pid" 2>/dev/null || true
  if [[ -n $daemon_pid ]] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -KILL "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
  if [[ ${KEEP_DIR:-0} == 1 ]]; then
    echo "soak.sh: kept $tmp" >&2
  else
    rm -rf "$tmp"
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Other uids must reach the socket (and nothing else in here).
chmod 711 "$tmp"
socket=$tmp/steptraced.sock
state_dir=$tmp/state
mkdir -m 700 "$state_dir" "$tmp/honest"
chown "$honest_uid" "$tmp/honest" # its trainers, pinger and scraper write there
mkdir -m 1777 "$tmp/results" # the hog writes its status there as its own uid
log=$tmp/steptraced.log
export STEPTRACE_SOCKET=$socket
# A free loopback port for metrics_listen (free when asked; the daemon fails to start,
# and the script says so, in the unlikely case another program takes it meanwhile).
metrics_port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$python" - "$repo/config/steptraced.json" "$tmp/steptraced.json" "$socket" "$state_dir" "$metrics_port" <<'EOF'
import json, sys
config = json.load(open(sys.argv[1]))
config.update(socket=sys.argv[3], state_dir=sys.argv[4], socket_mode="0666",
              metrics_listen="127.0.0.1:" + sys.argv[5])
json.dump(config, open(sys.argv[2], "w"), indent=2)
EOF

# ---------------------------------------------------------------------------------------
# Helper programs (Python), written into the temp dir.

# The honest Python trainer: 2 threads of Forward{Matmul}/Backward spans with sleeps as
# "compute", a burst every 5 s, a flush every second; status file: spans dropped
# flush_failures max_flush_ms.
cat >"$tmp/honest_trainer.py" <<'EOF'
import os, sys, threading, time
import steptrace
status_path = sys.argv[1]
if steptrace.connect() != 0:
    print("py-trainer: cannot connect", file=sys.stderr)
spans = [0, 0]
stop = threading.Event()
def work(i):
    last_burst = time.monotonic()
    while not stop.is_set():
        with steptrace.span("Forward"):
            with steptrace.span("Matmul"):
                time.sleep(0.001)
            time.sleep(0.0005)
        with steptrace.span("Backward"):
            time.sleep(0.001)
        spans[i] += 3
        if time.monotonic() - last_burst >= 5:
            for _ in range(20000):
                steptrace.start(steptrace.Step.Transpose)
                steptrace.end(steptrace.Step.Transpose)
            spans[i] += 20000
            last_burst = time.monotonic()
threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
for t in threads:
    t.start()
failures = 0
max_ms = 0.0
while True:
    time.sleep(1)
    t0 = time.monotonic()
    rc = steptrace.flush(5000)
    ms = (time.monotonic() - t0) * 1000
    max_ms = max(max_ms, ms)
    if rc != 0:
        failures += 1
    tmp = status_path + ".tmp"
    with open(tmp, "w") as f:
        f.write("%d %d %d %.1f\n" % (sum(spans), steptrace.dropped(), failures, max_ms))
    os.replace(tmp, status_path)
EOF

# The pinger: `ping` on a new connection every 0.5 s; one "EPOCH_S MS" line per ping
# (MS = -1: no answer within 30 s, or an error).
cat >"$tmp/pinger.py" <<'EOF'
import socket, sys, time
path, out = sys.argv[1], sys.argv[2]
with open(out, "a", buffering=1) as f:
    while True:
        t0 = time.monotonic()
        ms = -1.0
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(path)
            s.sendall(b"ping\n")
            reply = b""
            while b"\n" not in reply:
                chunk = s.recv(4096)
                if not chunk:
                    break
                reply += chunk
            s.close()
            if reply.startswith(b"pong"):
                ms = (time.monotonic() - t0) * 1000
        except OSError:
            pass
        f.write("%.3f %.2f\n" % (time.time(), ms))
        time.sleep(max(0.0, 0.5 - (time.monotonic() - t0)))
EOF

# Connection hogs: N idle text connections (each sent `ping` once) and M that ask for
# `report --json` and never read; whatever the daemon closes (or refuses) is reopened
# after 1 s. Counts opened/closed in a status file.
cat >"$tmp/hog.py" <<'EOF'
import os, select, socket, sys, time
path, idle_n, noread_n, status = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
poller = select.poll()
conns = {}  # fd -> (socket, kind)
opened = closed = failed = 0
def open_one(kind):
    global opened, failed
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if kind == "noread":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(path)
        s.sendall(b"ping\n" if kind == "idle" else b"report --json\n")
    except OSError:
        s.close()
        failed += 1
        return
    opened += 1
    conns[s.fileno()] = (s, kind)
    # idle: read (the pong, then EOF when closed); noread: only hang-ups, never read
    poller.register(s, select.POLLIN if kind == "idle" else 0)
last = 0.0
while True:
    now = time.monotonic()
    if now - last >= 1.0:
        last = now
        want = {"idle": idle_n, "noread": noread_n}
        for _, kind in conns.values():
            want[kind] -= 1
        for kind, n in want.items():
            for _ in range(n):
                open_one(kind)
        with open(status + ".tmp", "w") as f:
            f.write("open=%d opened=%d closed=%d refused=%d\n" % (len(conns), opened, closed, failed))
        os.replace(status + ".tmp", status)
    for fd, ev in poller.poll(200):
        s, kind = conns[fd]
        if kind == "idle" and not ev & (select.POLLHUP | select.POLLERR):
            try:
                if s.recv(65536):
                    continue
            except OSError:
                pass
        poller.unregister(fd)
        del conns[fd]
        s.close()
        closed += 1
EOF

# The scraper: every second `GET /metrics` over HTTP (a new connection each time) and
# `stats --json` on the socket; one line per round:
# "EPOCH_S SCRAPE_MS STATS_MS CHARGED_BYTES RSS_BYTES" (MS = -1: no complete answer in 30 s).
cat >"$tmp/scraper.py" <<'EOF'
import http.client, json, socket, sys, time
path, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def scrape():
    t0 = time.monotonic()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/metrics")
        r = c.getresponse()
        body = r.read()
        c.close()
        if r.status == 200 and b"steptrace_" in body:
            return (time.monotonic() - t0) * 1000
    except (OSError, http.client.HTTPException):
        pass
    return -1.0
def stats():
    t0 = time.monotonic()
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(path)
        s.sendall(b"stats --json\n")
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
        s.close()
        doc = json.loads(reply)
        memory = doc.get("memory", {})
        charged = memory.get("state_bytes_charged", 0)
        # All the daemon states it holds (memory.accounted_bytes): the charge, view
        # copies, pending replies, HTTP scrape bodies and the flight recorder; summed
        # here for a daemon too old to have the field.
        held = memory.get("accounted_bytes")
        if held is None:
            held = (charged + memory.get("view_copy_bytes", 0) +
                    memory.get("reply_bytes_pending", 0) +
                    doc.get("flight_recorder", {}).get("bytes", 0))
        return ((time.monotonic() - t0) * 1000, charged, memory.get("rss_bytes", 0), held)
    except (OSError, ValueError):
        return (-1.0, 0, 0, 0)
with open(out, "a", buffering=1) as f:
    while True:
        t0 = time.monotonic()
        scrape_ms = scrape()
        stats_ms, charged, rss, held = stats()
        f.write("%.3f %.2f %.2f %d %d %d\n" % (time.time(), scrape_ms, stats_ms, charged, rss,
                                              held))
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
EOF

# The render flood: 16 socket connections looping `report --json` and 8 keep-alive HTTP
# connections looping `GET /metrics`, each reading every reply whole; reopened when the
# daemon closes or refuses one. Counts replies in a status file.
cat >"$tmp/flood.py" <<'EOF'
import http.client, os, socket, sys, threading, time
path, port, status = sys.argv[1], int(sys.argv[2]), sys.argv[3]
counts = {"reports": 0, "scrapes": 0, "failures": 0}
lock = threading.Lock()
def bump(key):
    with lock:
        counts[key] += 1
def reports():
    while True:
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(120)
            s.connect(path)
            while True:
                s.sendall(b"report --json\n")
                reply = b""
                while not reply.endswith(b"\n"):
                    chunk = s.recv(1 << 20)
                    if not chunk:
                        raise OSError("closed")
                    reply += chunk
                bump("reports")
        except OSError:
            bump("failures")
            time.sleep(0.5)
def scrapes():
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            while True:
                c.request("GET", "/metrics")
                c.getresponse().read()
                bump("scrapes")
        except (OSError, http.client.HTTPException):
            bump("failures")
            time.sleep(0.5)
for target, n in ((reports, 16), (scrapes, 8)):
    for _ in range(n):
        threading.Thread(target=target, daemon=True).start()
while True:
    time.sleep(1)
    with lock:
        line = " ".join("%s=%d" % kv for kv in sorted(counts.items()))
    with open(status + ".tmp", "w") as f:
        f.write(line + "\n")
    os.replace(status + ".tmp", status)
EOF

# The trace lock-out: `trace --for 3600` on a new connection every 0.2 s, closed 0.3 s
# later without reading. Counts sent in a status file.
cat >"$tmp/trace_lockout.py" <<'EOF'
import os, socket, sys, time
path, status = sys.argv[1], sys.argv[2]
open_conns = []  # (close at, socket)
sent = failed = 0
while True:
    now = time.monotonic()
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(b"trace --for 3600\n")
        open_conns.append((now + 0.3, s))
        sent += 1
    except OSError:
        failed += 1
    while open_conns and open_conns[0][0] <= now:
        open_conns.pop(0)[1].close()
    with open(status + ".tmp", "w") as f:
        f.write("trace_for_sent=%d connect_failed=%d\n" % (sent, failed))
    os.replace(status + ".tmp", status)
    time.sleep(0.2)
EOF

# Many custom steps: registers 1,100 (past max_custom_steps) and records each on 2 threads.
cat >"$tmp/many_steps.py" <<'EOF'
import threading
import steptrace
steptrace.connect()
ids = [steptrace.register_step("hostile-step-%04d" % i) for i in range(1100)]
ids = [i for i in ids if i != steptrace.INVALID_STEP]
def run():
    for i in ids:
        steptrace.start(i)
        steptrace.end(i)
ts = [threading.Thread(target=run) for _ in range(2)]
for t in ts: t.start()
for t in ts: t.join()
steptrace.flush(5000)
EOF

# The sampler: reads `report --json` on stdin; keeps, per honest (pid, start_time), the
# largest `dropped` seen (a process may leave the table later); prints
# "honest_dropped honest_processes tracked leaked".
cat >"$tmp/sample.py" <<'EOF'
import json, sys
uid, seen_path = int(sys.argv[1]), sys.argv[2]
try:
    seen = json.load(open(seen_path))
except (OSError, ValueError):
    seen = {}
try:
    report = json.load(sys.stdin)
except ValueError:
    print("? ? ? ?")
    sys.exit(0)
for p in report.get("processes", []):
    if p.get("uid") == uid:
        key = "%d/%d" % (p["pid"], p["start_time"])
        seen[key] = max(seen.get(key, 0), int(p.get("dropped", 0)))
json.dump(seen, open(seen_path, "w"))
leaked = sum(g.get("leaked_reservations", 0) for g in report.get("ledger", {}).get("gpus", []))
print(sum(seen.values()), len(seen), len(report.get("processes", [])), leaked)
EOF

# `stats --json` on stdin -> "connections_now rejected limit_hits_total"
cat >"$tmp/stats.py" <<'EOF'
import json, sys
try:
    s = json.load(sys.stdin)
except ValueError:
    print("? ? ?")
    sys.exit(0)
c = s.get("connections", {})
print(c.get("now", "?"), c.get("rejected", "?"), sum(s.get("limits_hit", {}).values()))
EOF

# ---------------------------------------------------------------------------------------
# Start the daemon.
"$steptraced" --config "$tmp/steptraced.json" 2>"$log" &
daemon_pid=$!
for _ in $(seq 100); do
  kill -0 "$daemon_pid" 2>/dev/null || {
    cat "$log" >&2
    echo "soak.sh: steptraced exited during start-up" >&2
    exit 1
  }
  "$steptrace" --timeout 1 ping >/dev/null 2>&1 && break
  sleep 0.1
done
"$steptrace" --timeout 2 ping >/dev/null || {
  echo "soak.sh: steptraced did not answer ping within 10 s" >&2
  exit 1
}

# Every background job gets its own process group (job control), so the cleanup ends
# each job with whatever it runs at that moment.
set -m
spawn() {
  "$@" &
  jobs_pids+=("$!")
  disown # no job-status lines when they are ended
}
as_uid() { # UID CMD...: runs CMD as UID (when root), STEPTRACE_SOCKET kept
  local uid=$1
  shift
  if ((script_uid == 0 && uid != 0)); then
    setpriv --reuid="$uid" --regid="$uid" --clear-groups -- "$@"
  else
    "$@"
  fi
}
# Appends "KIND RC" to the results of a hostile loop (how each client ended).
note() { echo "$1 $2" >>"$tmp/results/$1"; }

export PYTHONPATH=$repo/bindings/python STEPTRACE_LIBRARY=$libsteptrace

# Honest tenant.
spawn as_uid "$honest_uid" "$hostile_python" "$tmp/honest_trainer.py" "$tmp/honest/py-trainer.status"
sim_loop() {
  local run=0 rc
  while :; do
    run=$((run + 1))
    rc=0
    as_uid "$honest_uid" "$sim_trainer" --gpu GPU-00000000-soak-0000-0000-000000000000 --workers 2 --steps 1000 \
      --ledger "$tmp/honest/ledger.txt" --vram-total $((8 << 30)) --reserve $((3 << 30)) \
      >"$tmp/honest/sim.out" 2>&1 || rc=$?
    echo "$run $rc" >>"$tmp/honest/sim.runs"
    ((rc == 0)) || cp "$tmp/honest/sim.out" "$tmp/honest/sim-failed-$run.out"
    sleep 1
  done
}
spawn sim_loop
spawn as_uid "$honest_uid" "$hostile_python" "$tmp/pinger.py" "$socket" "$tmp/honest/pings"
spawn as_uid "$honest_uid" "$hostile_python" "$tmp/scraper.py" "$socket" "$metrics_port" "$tmp/honest/scrapes"

# Hostile tenant 1: connection hogs.
spawn as_uid "$hog_uid" "$hostile_python" "$tmp/hog.py" "$socket" 300 8 "$tmp/results/hog.status.$hog_uid"
pool_loop() { # KIND COUNT ARGS...
  local kind=$1 count=$2 i
  shift 2
  while :; do
    for ((i = 0; i < count; i++)); do
      { rc=0; as_uid "$junk_uid" "$raw_client" "$socket" "$@" 2>/dev/null || rc=$?; note "$kind" "$rc"; } &
    done
    wait
    sleep 1
  done
}
spawn pool_loop silent 20 silent
spawn pool_loop slow 10 slow --interval-ms 2000

# Hostile tenant 2: churn, leaks, bad streams, readers, state.
churn_loop() {
  local rc
  while :; do
    rc=0
    as_uid "$junk_uid" "$raw_client" "$socket" good --pairs 3 2>/dev/null || rc=$?
    note churn "$rc"
    sleep 0.12
  done
}
leak_loop() {
  local n=0 rc args i
  while :; do
    args=()
    for ((i = 0; i < 32; i++)); do
      args+=("$(printf 'GPU-junk-%04d' $(((n * 32 + i) % 64)))" $((n * 32 + i + 1)) 1048576 leak)
    done
    rc=0
    as_uid "$junk_uid" "$ledger_worker" "$socket" hold "${args[@]}" </dev/null >/dev/null 2>&1 || rc=$?
    note leak "$rc"
    n=$((n + 1))
    sleep 0.3
  done
}
bad_loop() {
  local modes=(garbage oversize badversion badstep truncated) n=0 rc mode
  while :; do
    mode=${modes[n % 5]}
    rc=0
    as_uid "$junk_uid" "$raw_client" "$socket" "$mode" 2>/dev/null || rc=$?
    note "bad-$mode" "$rc"
    n=$((n + 1))
    sleep 0.2
  done
}
reader_loop() {
  local cmds=("report --json" metrics "ledger --json" stats) n=0 rc cmd
  while :; do
    cmd=${cmds[n % 4]}
    rc=0
    # shellcheck disable=SC2086 # the command's words
    as_uid "$junk_uid" "$steptrace" --timeout 30 $cmd >/dev/null 2>&1 || rc=$?
    note "read-${cmd%% *}" "$rc"
    n=$((n + 1))
    sleep 0.5
  done
}
state_loop() {
  local n=0 rc
  while :; do
    rc=0
    if ((n % 2 == 0)); then
      as_uid "$junk_uid" "$raw_client" "$socket" good --threads 1024 --pairs 1 --custom hostile-custom 2>/dev/null || rc=$?
      note threads "$rc"
    else
      as_uid "$junk_uid" "$hostile_python" "$tmp/many_steps.py" >/dev/null 2>&1 || rc=$?
      note steps "$rc"
    fi
    n=$((n + 1))
    sleep 3
  done
}
spawn churn_loop
spawn leak_loop
spawn bad_loop
spawn reader_loop
spawn state_loop

# Hostile tenant 3: the state-size bomb (holders stay connected 2 minutes; a new one
# every second while fewer than BOMB_PROCS are alive).
bomb_loop() {
  local holders=() alive p
  while :; do
    alive=()
    for p in "${holders[@]}"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done
    holders=("${alive[@]}")
    if ((${#holders[@]} < bomb_procs)); then
      {
        rc=0
        as_uid "$bomb_uid" "$raw_client" "$socket" good --threads 256 --pairs 1 --custom bomb \
          --customs 1024 --hold-ms 120000 2>/dev/null || rc=$?
        note bomb "$rc"
      } &
      holders+=("$!")
    fi
    sleep 1
  done
}
((bomb_procs == 0)) || spawn bomb_loop

# Hostile tenant 4: the render flood, the trace lock-out, and the same uid's own trainer.
spawn as_uid "$flood_uid" "$hostile_python" "$tmp/flood.py" "$socket" "$metrics_port" \
  "$tmp/results/flood.status.$flood_uid"
spawn as_uid "$flood_uid" "$hostile_python" "$tmp/trace_lockout.py" "$socket" \
  "$tmp/results/trace-lockout.status.$flood_uid"
own_trainer_loop() {
  local rc
  while :; do
    rc=0
    as_uid "$flood_uid" "$raw_client" "$socket" good --threads 4 --pairs 50 2>/dev/null || rc=$?
    echo "$rc" >>"$tmp/honest/own-trainer.runs"
    sleep 2
  done
}
spawn own_trainer_loop

# ---------------------------------------------------------------------------------------
# Sampling.
clk_tck=$(getconf CLK_TCK)
cpu_ticks() { # utime + stime of the daemon (fields 14, 15; after the ")" of comm)
  local stat
  stat=$(<"/proc/$daemon_pid/stat") || return 1
  stat=${stat##*) }
  # shellcheck disable=SC2086 # split into fields
  set -- $stat
  echo $((${12} + ${13}))
}
rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$daemon_pid/status"; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }

printf '%6s %5s %8s %6s %9s %9s %9s %7s %7s %7s %8s %10s %7s %6s %6s %9s %9s %8s %7s %8s %7s\n' \
  t_s load1 rss_MiB cpu_% ping_max ping_last report_ms h_drop py_drop flush_f sim_fail conns/rej \
  limits procs leaked scrape_ms stats_ms chg_MiB chg/rss held/rss own_f
start_ms=$(now_ms)
end_ms=$((start_ms + seconds * 1000))
last_ticks=$(cpu_ticks)
last_ms=$start_ms
ping_lines=0
scrape_lines=0 max_scrape=0 max_stats=0 scrape_miss=0 own_fail=0 own_runs=0
min_ratio="" max_ratio="" min_held="" max_held=""
max_rss=0 max_cpu=0 cpu_sum=0 samples=0 max_ping=0 max_report=0
honest_drop=0 py_drop=0 py_max_flush=0 flush_fail=0 sim_fail=0 sim_runs=0 no_answer=0
reasons=()
next_ms=$((start_ms + interval * 1000))
while :; do
  now=$(now_ms)
  if ((now < next_ms)); then
    # in the background: a SIGTERM/SIGINT runs the cleanup at once, not after the sleep
    sleep "$(printf '%d.%03d' $(((next_ms - now) / 1000)) $(((next_ms - now) % 1000)))" &
    sleeper_pid=$!
    wait "$sleeper_pid"
    sleeper_pid=""
  fi
  next_ms=$((next_ms + interval * 1000))
  if ! kill -0 "$daemon_pid" 2>/dev/null; then
    reasons+=("steptraced exited during the run (at $((($(now_ms) - start_ms) / 1000)) s)")
    break
  fi
  ticks=$(cpu_ticks) || ticks=$last_ticks
  now=$(now_ms)
  cpu=$(((ticks - last_ticks) * 1000 * 1000 / clk_tck / (now - last_ms))) # tenths of %
  last_ticks=$ticks
  last_ms=$now
  rss=$(rss_kib || echo 0)
  # pings since the last line
  mapfile -t new_pings < <(tail -n "+$((ping_lines + 1))" "$tmp/honest/pings" 2>/dev/null)
  ping_lines=$((ping_lines + ${#new_pings[@]}))
  read -r pmax plast pmiss < <(printf '%s\n' "${new_pings[@]}" | awk '
    NF == 2 { if ($2 < 0) miss++; else { if ($2 > max) max = $2; last = $2 } }
    END { printf "%.1f %.1f %d\n", max, last, miss }') || true
  no_answer=$((no_answer + pmiss))
  # scrapes and stats since the last line; the last charged/RSS pair
  mapfile -t new_scrapes < <(tail -n "+$((scrape_lines + 1))" "$tmp/honest/scrapes" 2>/dev/null)
  scrape_lines=$((scrape_lines + ${#new_scrapes[@]}))
  read -r smax stmax smiss charged drss dheld < <(printf '%s\n' "${new_scrapes[@]}" | awk '
    NF == 6 { if ($2 < 0 || $3 < 0) miss++
              if ($2 > smax) smax = $2; if ($3 > stmax) stmax = $3
              if ($5 > 0) { charged = $4; rss = $5; held = $6 } }
    END { printf "%.1f %.1f %d %d %d %d\n", smax, stmax, miss, charged, rss, held }') || true
  scrape_miss=$((scrape_miss + smiss))
  ratio=$(awk -v c="$charged" -v r="$drss" 'BEGIN { if (r > 0) printf "%.2f", c / r; else print "?" }')
  if [[ $ratio != "?" ]]; then
    [[ -n $min_ratio ]] && awk -v a="$ratio" -v b="$min_ratio" 'BEGIN { exit !(a >= b) }' || min_ratio=$ratio
    [[ -n $max_ratio ]] && awk -v a="$ratio" -v b="$max_ratio" 'BEGIN { exit !(a <= b) }' || max_ratio=$ratio
  fi
  held_ratio=$(awk -v c="$dheld" -v r="$drss" 'BEGIN { if (r > 0) printf "%.2f", c / r; else print "?" }')
  if [[ $held_ratio != "?" ]]; then
    [[ -n $min_held ]] && awk -v a="$held_ratio" -v b="$min_held" 'BEGIN { exit !(a >= b) }' || min_held=$held_ratio
    [[ -n $max_held ]] && awk -v a="$held_ratio" -v b="$max_held" 'BEGIN { exit !(a <= b) }' || max_held=$held_ratio
  fi
  awk -v a="$smax" -v b="$max_scrape" 'BEGIN { exit !(a > b) }' && max_scrape=$smax
  awk -v a="$stmax" -v b="$max_stats" 'BEGIN { exit !(a > b) }' && max_stats=$stmax
  if [[ -s $tmp/honest/own-trainer.runs ]]; then
    own_runs=$(wc -l <"$tmp/honest/own-trainer.runs")
    own_fail=$(awk '$1 != 0' "$tmp/honest/own-trainer.runs" | wc -l)
  fi
  t0=$(now_ms)
  report=$("$steptrace" --timeout 30 report --json 2>/dev/null) || report=""
  report_ms=$(($(now_ms) - t0))
  read -r hdrop _ procs leaked < <("$python" "$tmp/sample.py" "$honest_uid" "$tmp/honest/seen.json" <<<"$report") || true
  read -r conns rejected limits < <("$steptrace" --timeout 30 stats --json 2>/dev/null | "$python" "$tmp/stats.py") || true
  read -r _ own_drop flushf py_max_flush < <(cat "$tmp/honest/py-trainer.status" 2>/dev/null || echo "0 0 0 0") || true
  if [[ -s $tmp/honest/sim.runs ]]; then
    sim_runs=$(wc -l <"$tmp/honest/sim.runs")
    sim_fail=$(awk '$2 != 0' "$tmp/honest/sim.runs" | wc -l)
  fi
  [[ $hdrop =~ ^[0-9]+$ ]] || hdrop=$honest_drop
  honest_drop=$hdrop
  py_drop=$own_drop
  flush_fail=$flushf
  elapsed=$(((now - start_ms) / 1000))
  printf '%6d %5s %8.1f %6s %9s %9s %9d %7d %7d %7d %8s %10s %7s %6s %6s %9s %9s %8.1f %7s %8s %7s\n' \
    "$elapsed" "$(cut -d' ' -f1 /proc/loadavg)" "$(awk -v k="$rss" 'BEGIN { print k / 1024 }')" "$((cpu / 10)).$((cpu % 10))" \
    "$pmax" "$plast" "$report_ms" "$hdrop" "$own_drop" "$flushf" "$sim_fail/$sim_runs" \
    "$conns/$rejected" "$limits" "$procs" "$leaked" "$smax" "$stmax" \
    "$(awk -v b="$charged" 'BEGIN { print b / 1048576 }')" "$ratio" "$held_ratio" "$own_fail/$own_runs"
  ((rss > max_rss)) && max_rss=$rss
  ((cpu > max_cpu)) && max_cpu=$cpu
  cpu_sum=$((cpu_sum + cpu))
  samples=$((samples + 1))
  awk -v a="$pmax" -v b="$max_ping" 'BEGIN { exit !(a > b) }' && max_ping=$pmax
  ((report_ms > max_report)) && max_report=$report_ms
  (($(now_ms) < end_ms)) || break
done

# ---------------------------------------------------------------------------------------
# Summary.
daemon_up=0
if kill -0 "$daemon_pid" 2>/dev/null && "$steptrace" --timeout 10 ping >/dev/null 2>&1; then
  daemon_up=1
fi
final_stats=$("$steptrace" --timeout 30 stats 2>/dev/null || true)
# Stop the clients first, then the daemon with SIGTERM: it must exit 0 within STOP_BOUND_S
# (default 60: under systemd's default stop timeout of 90 s, past which the final
# snapshot would be lost to a SIGKILL); how long it took is said.
for pid in "${jobs_pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
sleep 0.5
for pid in "${jobs_pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
jobs_pids=()
stop_status=""
if ((daemon_up)); then
  stop_bound_s=${STOP_BOUND_S:-60}
  term_ms=$(now_ms)
  kill -TERM "$daemon_pid"
  for _ in $(seq $((stop_bound_s * 10))); do
    kill -0 "$daemon_pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$daemon_pid" 2>/dev/null; then
    stop_status="still running ${stop_bound_s} s after SIGTERM"
    reasons+=("steptraced still ran ${stop_bound_s} s after SIGTERM (STOP_BOUND_S)")
  else
    rc=0
    wait "$daemon_pid" || rc=$?
    stop_status="exit status $rc on SIGTERM, after $(($(now_ms) - term_ms)) ms"
    ((rc == 0)) || reasons+=("steptraced exited with status $rc on SIGTERM")
  fi
  daemon_pid=""
fi

echo
echo "summary after ${seconds} s ($samples samples, every ${interval} s):"
printf '  daemon: %s; %s\n' "$( ((daemon_up)) && echo "up at the end" || echo "NOT up at the end")" \
  "${stop_status:-not stopped}"
printf '  max RSS: %.1f MiB\n' "$(awk -v k="$max_rss" 'BEGIN { print k / 1024 }')"
if ((samples > 0)); then
  mean=$((cpu_sum / samples))
  printf '  CPU: mean %d.%d%%, max %d.%d%% of one core\n' $((mean / 10)) $((mean % 10)) \
    $((max_cpu / 10)) $((max_cpu % 10))
fi
printf '  max ping: %s ms (pings every 0.5 s: %d, unanswered: %d); slowest report --json: %d ms\n' \
  "$max_ping" "$ping_lines" "$no_answer" "$max_report"
printf '  HTTP scrape: max %s ms; stats: max %s ms (every 1 s: %d, failed or unanswered: %d)\n' \
  "$max_scrape" "$max_stats" "$scrape_lines" "$scrape_miss"
printf '  charged state bytes / RSS: %s .. %s over the samples\n' "${min_ratio:-?}" "${max_ratio:-?}"
printf '  (charged + view copies + pending replies + flight recorder) / RSS: %s .. %s\n' \
  "${min_held:-?}" "${max_held:-?}"
printf '  lock-out uid %s: its own trainer failed %d of %d runs\n' "$flood_uid" "$own_fail" "$own_runs"
printf '  honest: dropped %d events (daemon view), py-trainer: %d dropped (own count), %d failed flushes (slowest %s ms); sim_trainer: %d failed of %d runs\n' \
  "$honest_drop" "$py_drop" "$flush_fail" "$py_max_flush" "$sim_fail" "$sim_runs"
echo "  hostile clients, how each ended (kind: exit status x count):"
for f in "$tmp"/results/*; do
  [[ -f $f && $f != *.status.* ]] || continue
  printf '    %-16s %s\n' "$(basename "$f"):" "$(sort "$f" | uniq -c | awk '{ printf "%s x %s  ", $3, $1 }')"
done
for f in "$tmp"/results/*.status.*; do
  [[ -f $f ]] && printf '    %-16s %s\n' "$(basename "${f%%.status.*}"):" "$(cat "$f")"
done
echo "  daemon stats at the end (non-zero limits, anomalies, errors):"
grep -E '^(limits_hit|ledger_anomalies|protocol_errors|connections|processes|memory|liveness)' \
  <<<"$final_stats" | awk -F': ' '$2 != "0"' | sed 's/^/    /'
warnings=$(grep -ciE 'warn|error' "$log" || true)
echo "  daemon log: $(wc -l <"$log") lines, $warnings warnings/errors; last 3:"
tail -n 3 "$log" | sed 's/^/    /'

((daemon_up)) || reasons+=("steptraced did not answer ping at the end")
((honest_drop == 0)) || reasons+=("the honest trainers dropped $honest_drop events (daemon view)")
((py_drop == 0)) || reasons+=("the honest py-trainer counted $py_drop dropped events")
((flush_fail == 0)) || reasons+=("the honest py-trainer had $flush_fail failed flushes")
((sim_fail == 0)) || reasons+=("$sim_fail of $sim_runs sim_trainer runs failed")
((no_answer == 0)) || reasons+=("$no_answer pings got no answer within 30 s")
awk -v a="$max_ping" -v b="$ping_bound_ms" 'BEGIN { exit !(a >= b) }' &&
  reasons+=("max ping $max_ping ms >= $ping_bound_ms ms")
((scrape_miss == 0)) || reasons+=("$scrape_miss scrapes or stats failed or got no answer within 30 s")
awk -v a="$max_scrape" -v b="$scrape_bound_ms" 'BEGIN { exit !(a >= b) }' &&
  reasons+=("max HTTP scrape $max_scrape ms >= $scrape_bound_ms ms")
awk -v a="$max_stats" -v b="$scrape_bound_ms" 'BEGIN { exit !(a >= b) }' &&
  reasons+=("max stats $max_stats ms >= $scrape_bound_ms ms")
((own_fail == 0)) || reasons+=("the lock-out uid's own trainer failed $own_fail of $own_runs runs")
if ((${#reasons[@]} > 0)); then
  echo "FAIL:"
  printf '  - %s\n' "${reasons[@]}"
  exit 1
fi
echo "PASS: daemon up, no honest drops, max ping $max_ping ms < $ping_bound_ms ms," \
  "max scrape $max_scrape ms and stats $max_stats ms < $scrape_bound_ms ms, the lock-out uid's trainer never failed"
