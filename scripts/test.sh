#!/usr/bin/env bash
# README command (2): set up, build, and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --tests
scripts/build.sh
ctest --test-dir build --output-on-failure -j 2 --timeout 300
