#!/usr/bin/env bash
# Runs every Google Benchmark binary (build/bench/bench_*) with JSON output into one results
# folder, then prints where the files are. Usage: scripts/bench.sh [RESULTS_DIR] [-- extra args]
# Environment: STRATA_BUILD_DIR (default build), STRATA_BENCH_FILTER (passed as --benchmark_filter).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/deps.sh"
build=${STRATA_BUILD_DIR:-$root/build}
out=${1:-$root/results/bench-$(date -u +%Y%m%dT%H%M%SZ)}
shift || true
[ "${1:-}" = "--" ] && shift
"$root/scripts/build.sh" "$build" -DSTRATA_BUILD_BENCHMARKS=ON -DCMAKE_BUILD_TYPE=Release >/dev/null
mkdir -p "$out"
shopt -s nullglob
bins=("$build"/bench/bench_*)
[ ${#bins[@]} -gt 0 ] || { echo "bench.sh: no benchmark binaries in $build/bench" >&2; exit 1; }
for b in "${bins[@]}"; do
  name=$(basename "$b")
  echo "== $name" >&2
  args=(--benchmark_out="$out/$name.json" --benchmark_out_format=json)
  [ -n "${STRATA_BENCH_FILTER:-}" ] && args+=(--benchmark_filter="$STRATA_BENCH_FILTER")
  "$b" "${args[@]}" "$@"
done
{
  echo "{\"date\": \"$(date -u +%FT%TZ)\", \"host\": \"$(hostname)\", \"kernel\": \"$(uname -r)\","
  echo " \"cpus\": $(nproc), \"load\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
} >"$out/environment.json"
echo "results in $out" >&2
