#!/usr/bin/env bash
# Configures and builds strata. Usage: scripts/build.sh [BUILD_DIR] [extra cmake -D args...]
# Environment: STRATA_JOBS (default: number of cores), STRATA_TARGETS (default: all).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
shift || true
jobs=${STRATA_JOBS:-$(nproc)}
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
else
  cmake -S "$root" -B "$build" "$@" >/dev/null
fi
if [ -n "${STRATA_TARGETS:-}" ]; then
  # shellcheck disable=SC2086
  cmake --build "$build" -j "$jobs" --target $STRATA_TARGETS
else
  cmake --build "$build" -j "$jobs"
fi
