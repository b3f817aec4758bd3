#!/usr/bin/env bash
# Style checks CI runs: the include rules of docs/ARCHITECTURE.md's Folders table
# (scripts/check-includes.py, and its self-test), clang-format (no diff allowed) and
# clang-tidy's naming rules from .clang-tidy, over our own sources.
# Usage: scripts/lint.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}

# Which folder may include which: the "may include" column of docs/ARCHITECTURE.md.
echo "lint: include rules (docs/ARCHITECTURE.md, Folders)"
python3 scripts/check-includes.py
python3 scripts/check-includes.py --self-test

mapfile -t files < <(git ls-files '*.h' '*.hpp' '*.cpp' '*.c' | grep -v '^tests/fuzz/corpus/')
echo "lint: clang-format on ${#files[@]} files"
clang-format --dry-run --Werror "${files[@]}"

# File names are snake_case, like every other name.
bad_names=$(printf '%s\n' "${files[@]}" | grep -vE '(^|/)[a-z0-9_]+\.(h|hpp|cpp|c)$' || true)
if [[ -n $bad_names ]]; then
  echo "lint: file names that are not snake_case:" >&2
  echo "$bad_names" >&2
  exit 1
fi

mapfile -t sources < <(git ls-files '*.cpp' | grep -v '^tests/fuzz/')
echo "lint: clang-tidy naming on ${#sources[@]} translation units"
run-clang-tidy -quiet -p "$build_dir" -j "$(nproc)" "${sources[@]/#/$PWD/}" > "$build_dir/clang-tidy.log" 2>&1 || {
  grep -E 'error:|warning:' "$build_dir/clang-tidy.log" | sort -u | head -50
  echo "lint: clang-tidy found naming problems (full log: $build_dir/clang-tidy.log)"
  exit 1
}
echo "lint: clean"
