#!/bin/bash
# Issue 27, "traces that real viewers read right", end to end: two real steptraced (two
# "nodes"), a real trainer on each (sim_trainer, which forks its workers) with one job
# id and a rank each, `steptrace trace --job` on each node, `trace --pid --children`, and
# `steptrace trace merge` of the nodes' files; then every file is imported by an
# importer independent of steptrace, @tracerbench/trace-model under node (installed here
# from the npm registry into the build directory, pinned), which must find no
# overlapping sibling spans on any track, and checked by scripts/trace-viewer-check.py
# (Perfetto's and speedscope's format rules). Nothing is skipped: without node, npm or
# the registry the test fails and says so.
#
# Usage: viewer_import_test.sh STEPTRACED STEPTRACE SIM_TRAINER SOURCE_DIR NPM_DIR
set -euo pipefail
steptraced=$1 steptrace=$2 sim_trainer=$3 source_dir=$4 npm_dir=$5
readonly kTraceModel="@tracerbench/trace-model@8.0.0"

fail() { echo "FAIL: $*" >&2; exit 1; }

command -v node >/dev/null || fail "node is not installed; CI must have node and npm (apt-get install nodejs npm)"
if [[ ! -f "$npm_dir/node_modules/@tracerbench/trace-model/package.json" ]]; then
  command -v npm >/dev/null || fail "npm is not installed; CI must have node and npm"
  mkdir -p "$npm_dir"
  # About 4 packages, 1 MB, 2 s; once per build directory.
  npm install --no-audit --no-fund --no-save --prefix "$npm_dir" "$kTraceModel" >&2 ||
    fail "npm install $kTraceModel into $npm_dir failed (is the npm registry reachable?)"
fi

work=$(mktemp -d /tmp/steptrace-viewer-XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do
    kill $(pgrep -P "$pid" || true) "$pid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

start_daemon() {  # NAME
  mkdir -p "$work/$1"
  "$steptraced" --socket "$work/$1.sock" --state-dir "$work/$1" --log-level warn \
    2> "$work/$1.log" &
  pids+=($!)
  for _ in $(seq 100); do
    "$steptrace" --socket "$work/$1.sock" ping >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  cat "$work/$1.log" >&2
  fail "steptraced $1 did not answer"
}

train() {  # NAME RANK
  STEPTRACE_SOCKET="$work/$1.sock" STEPTRACE_JOB=viewerjob RANK=$2 \
    "$sim_trainer" --ledger "$work/$1.ledger" --workers 2 --steps 30 --dim 32 \
    > "$work/$1.train.log" 2>&1 || { cat "$work/$1.train.log" >&2; fail "sim_trainer on $1"; }
}

start_daemon node1
start_daemon node2
train node1 0
train node2 1

cd "$work"
"$steptrace" --socket node1.sock trace --job viewerjob -o node1.json
"$steptrace" --socket node2.sock trace --job viewerjob -o node2.json
"$steptrace" --socket node1.sock trace -o node1-all.json
"$steptrace" trace merge node1.json node2.json -o job.json
"$steptrace" trace merge node1.json node2.json --align-step Forward:3 -o job-aligned.json

# --children: a live trainer's forked workers come along with it (the trainer itself is
# a launcher that traces nothing while they run, like torchrun).
STEPTRACE_SOCKET="$work/node1.sock" STEPTRACE_JOB=childjob \
  "$sim_trainer" --ledger "$work/c.ledger" --workers 2 --steps 100000000 --dim 64 \
  > "$work/c.train.log" 2>&1 &
parent=$!
pids+=("$parent")
connected=0
for _ in $(seq 600); do # up to 30 s: a loaded 2-core machine starts them slowly
  if [[ $("$steptrace" --socket node1.sock report --json --job childjob 2>/dev/null |
    python3 -c 'import json,sys; print(len(json.load(sys.stdin)["processes"]))' 2>/dev/null) == 2 ]]; then
    connected=1
    break
  fi
  sleep 0.05
done
((connected)) || fail "the --children trainer's 2 workers did not connect within 30 s"
sleep 0.5 # the workers train
# --last 2: the workers' ledger records at their start are in the window, so the daemon's
# own "steptraced: GPU memory" counter track (pid: the daemon's) comes along; it is what a
# `--last 2` run once took for a process that is no descendant. Descendants are matched by
# pid and start time in the daemon, so a reused pid brings no earlier process either.
"$steptrace" --socket node1.sock trace --pid "$parent" --children --last 2 -o children.json
python3 - "$parent" <<'PY' || fail "--children did not take the workers along"
import json, sys
doc = json.load(open("children.json"))
daemon = doc["otherData"]["daemon_pid"]
names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
         if e["ph"] == "M" and e["name"] == "process_name"}
print(f"children.json: processes {names} (parent {sys.argv[1]}, daemon {daemon})")
if daemon in names and names[daemon] != "steptraced: GPU memory":
    sys.exit(1)
pids = set(names) - {daemon}
# sim_trainer's parent sends nothing until its workers are done: the two workers.
sys.exit(0 if len(pids) == 2 and int(sys.argv[1]) not in pids else 1)
PY
workers=$(pgrep -P "$parent" || true)
kill $workers "$parent" 2>/dev/null || true

python3 - <<'PY' || fail "the merged trace's tracks"
import json
doc = json.load(open("job.json"))
names = sorted(e["args"]["name"] for e in doc["traceEvents"]
               if e["ph"] == "M" and e["name"] == "process_name")
print("job.json tracks:", names)
assert any(n.split(" / ")[1] == "rank 0" for n in names), names
assert any(n.split(" / ")[1] == "rank 1" for n in names), names
assert len({n.split(" / ")[0] for n in names}) == 2, names  # two nodes
PY

# --align-step Forward:3 aligns each node's median rank (here its one rank, over the
# rank's processes): the third Forward of rank 0 and of rank 1 start together.
python3 - <<'PY' || fail "--align-step: the ranks' third Forward spans do not start together"
import collections, json
doc = json.load(open("job-aligned.json"))
track = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
         if e["ph"] == "M" and e["name"] == "process_name"}
starts = collections.defaultdict(list)
for e in doc["traceEvents"]:
    if e["ph"] == "X" and e["name"] == "Forward":
        parts = track[e["pid"]].split(" / ")
        if parts[1].startswith("rank "):
            starts[(parts[0], parts[1])].append(round(e["ts"] * 1000))
third = {k: sorted(v)[2] for k, v in starts.items() if len(v) >= 3}
print("job-aligned.json: third Forward start (ns) per (node, rank):", third)
assert len(third) == 2 and len(set(third.values())) == 1, third
assert [n["align_ranks"] for n in doc["otherData"]["nodes"]] == [1, 1], doc["otherData"]
PY

node "$source_dir/tests/timeline/trace_model_check.js" "$npm_dir/node_modules" \
  node1.json node2.json node1-all.json job.json job-aligned.json children.json
python3 "$source_dir/scripts/trace-viewer-check.py" \
  node1.json node2.json node1-all.json job.json job-aligned.json children.json
echo "PASS"
