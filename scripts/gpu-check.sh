#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: starts the steptraced of a build dir with `nvml: on` on
# a temporary socket, optionally holds some VRAM with a small program if one is at hand,
# and prints what the daemon reports (ledger, device figures, findings, metrics) next to
# `nvidia-smi --query-gpu` so the two can be compared by eye. Needs no GPU to be run,
# but then says so and stops: the test suite covers NVML with a stand-in library.
#   scripts/gpu-check.sh [--build-dir DIR] [--seconds N]
#   env HOLD_VRAM_CMD: a command that allocates VRAM and sleeps (e.g. a CUDA program or
#   `python3 -c "import torch; x=torch.empty(2**30, device='cuda'); import time; time.sleep(30)"`)
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=build
seconds=5
while [[ $# -gt 0 ]]; do
    case $1 in
        --build-dir) build_dir=$2; shift 2 ;;
        --seconds) seconds=$2; shift 2 ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
    esac
done

daemon=$build_dir/daemon/steptraced
cli=$build_dir/cli/steptrace
[[ -x $daemon && -x $cli ]] || { echo "gpu-check: build first (no $daemon or $cli)" >&2; exit 2; }
if ! command -v nvidia-smi >/dev/null; then
    echo "gpu-check: no nvidia-smi on this machine: nothing to compare (no GPU?)" >&2
    exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/steptrace-gpu-check.XXXXXX")
daemon_pid=
hold_pid=
cleanup() {
    [[ -n $hold_pid ]] && kill "$hold_pid" 2>/dev/null || true
    [[ -n $daemon_pid ]] && kill "$daemon_pid" 2>/dev/null && wait "$daemon_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

printf '{"nvml": "on", "nvml_interval_ms": 500}\n' > "$work/config.json"
"$daemon" --socket "$work/sock" --config "$work/config.json" 2> "$work/daemon.log" &
daemon_pid=$!
for _ in $(seq 50); do
    [[ -S $work/sock ]] && break
    if ! kill -0 "$daemon_pid" 2>/dev/null; then
        echo "gpu-check: steptraced did not start:" >&2
        cat "$work/daemon.log" >&2
        exit 1
    fi
    sleep 0.1
done

if [[ -n ${HOLD_VRAM_CMD:-} ]]; then
    bash -c "$HOLD_VRAM_CMD" &
    hold_pid=$!
    echo "gpu-check: holding VRAM with pid $hold_pid: $HOLD_VRAM_CMD"
else
    echo "gpu-check: HOLD_VRAM_CMD not set: sampling only (a process using VRAM would show as UNDECLARED)"
fi
sleep "$seconds"

export STEPTRACE_SOCKET=$work/sock
echo "== steptraced: ledger (NVML) =="
"$cli" ledger
echo
echo "== steptraced: device figures (ledger --json) =="
"$cli" ledger --json | python3 -c '
import json, sys
doc = json.load(sys.stdin)
for g in doc["gpus"]:
    d = g.get("device") or {}
    print(g["gpu"], d.get("name"), "total", d.get("total_bytes"), "used", d.get("used_bytes"),
          "free", d.get("free_bytes"))
    for p in d.get("processes", []):
        print("   pid", p["pid"], "used", p["used_bytes"], "visible", p["visible"])
    for f in g.get("findings", []):
        print("   finding", f)
if doc.get("device_error"):
    print("device_error:", doc["device_error"])
'
echo
echo "== nvidia-smi =="
nvidia-smi --query-gpu=uuid,name,memory.total,memory.used,memory.free --format=csv,nounits
nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,nounits || true
echo
echo "(nvidia-smi reports MiB; steptraced bytes. Daemon log: NVML lines below.)"
grep -i nvml "$work/daemon.log" || true
