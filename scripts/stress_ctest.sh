#!/usr/bin/env bash
# "Green every time" (issue 22): the whole CTest suite of BUILD_DIR, N times in a row, beside two
# busy shell loops (a loaded 2-core machine). Each run's output and CTest's LastTest.log are kept
# in LOGDIR (runK.log, LastTestK.log); LOGDIR/summary.txt gets one line a run. Stops the loops on
# exit. Usage: scripts/stress_ctest.sh BUILD_DIR N LOGDIR
# Build BUILD_DIR as scripts/test.sh builds "build" (the fakecuda tests included), from a clone of
# its own, so that a rebuild elsewhere does not change the binaries under test.
set -u
[ $# -eq 3 ] || { echo "usage: $0 BUILD_DIR N LOGDIR" >&2; exit 2; }
dir=$1 n=$2 logs=$3
mkdir -p "$logs"
bash -c 'while :; do :; done' > /dev/null 2>&1 &
b1=$!
bash -c 'while :; do :; done' > /dev/null 2>&1 &
b2=$!
trap 'kill $b1 $b2 2>/dev/null' EXIT
failed=0
for i in $(seq 1 "$n"); do
  start=$SECONDS
  (cd "$dir" && ctest --timeout 900 -j 2 --resource-spec-file tests/cpus.json) > "$logs/run$i.log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  cp "$dir/Testing/Temporary/LastTest.log" "$logs/LastTest$i.log" 2>/dev/null
  echo "run $i rc=$rc $((SECONDS - start))s $(grep -o '[0-9]*% tests passed.*' "$logs/run$i.log")" \
    >> "$logs/summary.txt"
done
echo "$((n - failed)) of $n runs passed" >> "$logs/summary.txt"
[ "$failed" -eq 0 ]
