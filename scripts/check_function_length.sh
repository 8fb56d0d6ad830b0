#!/usr/bin/env bash
# Lists the C++ functions longer than the house limit (80 lines, docs/development.md) under src/,
# with universal-ctags' start and end lines; exits 1 when there is one. Lambdas count in the
# function that holds them. Run from scripts/test.sh (CI).
# Usage: scripts/check_function_length.sh [MAX_LINES]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
max=${1:-80}
if ! command -v ctags >/dev/null || ! ctags --version 2>/dev/null | grep -q Universal; then
  echo "check_function_length: universal-ctags not found (apt-get install universal-ctags)" >&2
  exit 1
fi
long=$(git ls-files -- 'src/*' | grep -E '\.(cpp|hpp|h|cu)$' |
  ctags -L - --languages=C++ --langmap=C++:+.cu --c++-kinds=f --fields=+ne -o - 2>/dev/null |
  awk -F'\t' -v max="$max" '$1 !~ /^__anon/ {
    l = 0; e = 0
    for (i = 4; i <= NF; i++) {
      if ($i ~ /^line:/) l = substr($i, 6)
      if ($i ~ /^end:/) e = substr($i, 5)
    }
    if (e && e - l + 1 > max) printf "%5d lines  %s:%d  %s\n", e - l + 1, $2, l, $1
  }' | sort -rn)
if [ -n "$long" ]; then
  echo "functions over $max lines:"
  echo "$long"
  exit 1
fi
echo "check_function_length: no function over $max lines under src/"
