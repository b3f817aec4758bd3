#!/usr/bin/env bash
# Installs what steptrace needs to build and test, from Debian 12 packages only.
# Idempotent: when every package is present it does not call apt-get at all.
#   scripts/setup.sh           what the build, the daemon and the examples need
#   scripts/setup.sh --tests   also what only tests use: python3-torch (Debian's PyTorch,
#                              for the torch tests) and node with npm (the trace viewer
#                              test installs @tracerbench/trace-model from npm's registry)
set -euo pipefail

with_tests=0
case "${1:-}" in
  "") ;;
  --tests) with_tests=1 ;;
  -h | --help)
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  *)
    echo "setup: unknown argument '$1' (usage: scripts/setup.sh [--tests])" >&2
    exit 2
    ;;
esac

packages=(
  build-essential cmake ninja-build pkg-config git
  libboost-dev libcli11-dev nlohmann-json3-dev libspdlog-dev libsystemd-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev clang-format clang-tidy
  socat python3 systemd
  python3-pip python3-setuptools python3-wheel python3-venv
  dpkg-dev file prometheus
)
# The Rust binding's tests (tests/rust) need cargo: Debian's, unless one is on PATH
# already (rustup's, say).
if ! command -v cargo >/dev/null; then
  packages+=(cargo)
fi
if ((with_tests)); then
  packages+=(python3-torch)
  # The trace viewer test (tests/timeline) imports traces with an npm package under
  # node: Debian's, unless both are on PATH already.
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    packages+=(nodejs npm)
  fi
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

echo "setup: installing ${missing[*]}"
# sudo resets the environment, so DEBIAN_FRONTEND goes through env; under CI=true sudo
# must not ask for a password (-n fails at once instead of waiting at a prompt).
as_root=(env DEBIAN_FRONTEND=noninteractive)
if [[ $(id -u) -ne 0 ]]; then
  if [[ ${CI:-} == true ]]; then as_root=(sudo -n "${as_root[@]}"); else as_root=(sudo "${as_root[@]}"); fi
fi
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
