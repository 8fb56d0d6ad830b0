#!/usr/bin/env bash
# The clang-format check CI runs (from scripts/test.sh): every C++ / CUDA file git tracks under
# src, include, tests, python/src, bench and examples must be formatted as the repository's
# .clang-format says (Google base, 100 columns). Prints each file that is not, with the command
# that fixes it, and exits 1; exits 0 when all are. Needs clang-format (Debian: clang-format-14).
# Usage: scripts/check_format.sh [--fix]   (--fix rewrites the files instead of checking them)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

fix=0
[ "${1:-}" = "--fix" ] && fix=1
fmt=$(command -v clang-format || command -v clang-format-14 || true)
if [ -z "$fmt" ]; then
  echo "check_format: clang-format not found (apt-get install clang-format)" >&2
  exit 1
fi

bad=0 checked=0
while IFS= read -r f; do
  checked=$((checked + 1))
  if [ "$fix" = 1 ]; then
    "$fmt" -i "$f"
  elif ! "$fmt" --dry-run -Werror "$f" >/dev/null 2>&1; then
    echo "not formatted: $f   (fix: $fmt -i $f)"
    bad=$((bad + 1))
  fi
done < <(git ls-files -- 'src/*' 'include/*' 'tests/*' 'python/src/*' 'bench/*' 'examples/*' |
         grep -E '\.(cpp|hpp|h|cc|cu|cuh)$')

if [ "$bad" -gt 0 ]; then
  echo "check_format: $bad of $checked files not formatted (scripts/check_format.sh --fix)"
  exit 1
fi
echo "check_format: $checked files formatted"
