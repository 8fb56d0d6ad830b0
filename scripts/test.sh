#!/usr/bin/env bash
# The whole test suite: installs dependencies, checks the formatting, the function length and
# clang's thread-safety analysis, builds, runs every test under CTest (the CUDA and NCCL code
# among them, against the fake CUDA runtime: label "fakecuda", tests/fakecuda), then again under
# ASan+UBSan (every test not labelled "no_sanitizer"), then the concurrent layers (CTest label
# "tsan") under ThreadSanitizer; each sanitizer build compiles only what its tests run, in the
# background of the test phase before it. Each test process runs on one CPU (CTest's "cpus"
# resource: docs/development.md).
# Environment: STRATA_SANITIZERS=0 skips the sanitizer builds (quick local runs).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/deps.sh" || exit 1
export CTEST_OUTPUT_ON_FAILURE=1
jobs=$(nproc)

total_pass=0 total_fail=0 total_skip=0
phase_log=""
phase() {  # phase NAME: a header, and when it began (printed again at the end, for CI's tail)
  phase_log+="$1: ${SECONDS}s; "
  echo "== $1 == (${SECONDS}s)"
}
run_ctest() {  # run_ctest BUILD_DIR [ctest args...]
  local dir=$1
  shift
  local log
  log=$(mktemp)
  # One CPU of the "cpus" resource per test binary, which pins itself to it (tests/test_main.cpp)
  (cd "$dir" && ctest --timeout 900 -j "$jobs" --resource-spec-file tests/cpus.json "$@") 2>&1 |
    tee "$log"
  local rc=${PIPESTATUS[0]}
  local ran failed skipped
  ran=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\2/p' "$log" | tail -1)
  failed=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\1/p' "$log" | tail -1)
  skipped=$(grep -c '\*\*\*Skipped' "$log" || true)
  ran=${ran:-0} failed=${failed:-0}
  total_fail=$((total_fail + failed))
  total_skip=$((total_skip + skipped))
  total_pass=$((total_pass + ran - failed - skipped))
  rm -f "$log"
  [ "$rc" -eq 0 ] && [ "$ran" -gt 0 ]
}

# build_tested BUILD_DIR [ctest selection...]: builds only the executables the selected tests run
# (and what those depend on: the strata CLI for the tests that run it), not the whole tree: the
# sanitizer builds compile no test they will not run. Before the build CTest cannot say which
# executable a test runs, so a test's name is its executable's, or that name with "_tsan"
# appended (test_zero_placements_tsan runs test_zero_placements); a name that follows neither
# rule makes the build fail with "unknown target", never skip silently.
build_tested() {
  local dir=$1
  shift
  local targets
  targets=$(cd "$dir" && ctest -N "$@" | sed -n 's/^ *Test *#[0-9]*: //p' | sed 's/_tsan$//' |
    sort -u | tr '\n' ' ')
  [ -n "$targets" ] || { echo "no tests selected by '$*' in $dir" >&2; return 1; }
  # shellcheck disable=SC2086
  cmake --build "$dir" -j "$jobs" --target $targets
}

# Line tables only (-g1): file:line in backtraces and sanitizer reports, at two thirds of the
# compile time that full debug information (-g) costs. Unity builds (CMake compiles a target's
# sources eight at a time as one file): each header is parsed and each inline function compiled
# once per eight sources, about half the compile time of the three builds below (a cold main build:
# 8 min 05 s -> 4 min 19 s on 2 cores). Developers' builds (scripts/build.sh) compile file by file,
# which keeps every file's includes complete.
build_flags=(-DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DCMAKE_CXX_FLAGS_DEBUG="-g1"
  -DCMAKE_UNITY_BUILD=ON)

# The sanitizer builds use clang 16 (scripts/deps.sh installs it): it compiles them in about half
# of GCC 12's time at -O0 (ASan) and 0.7x at -O2 (TSan), measured on the repository's largest
# translation units. The ASan build also runs clang's thread-safety analysis (-Wthread-safety
# -Werror=thread-safety) over every layer it compiles, which is what
# scripts/check_thread_safety.sh checks on its own when the sanitizer builds are skipped.
# The main build stays GCC: the benchmarks' figures and the CPU kernels are measured with it.
san_cc=()
if command -v clang++-16 >/dev/null && command -v clang-16 >/dev/null; then
  san_cc=(-DCMAKE_CXX_COMPILER=clang++-16 -DCMAKE_C_COMPILER=clang-16)
else
  echo "test.sh: clang-16 not found (scripts/deps.sh installs it): the sanitizer builds use" \
    "the default compiler, and the thread-safety analysis runs on its own"
fi
sanitizers=${STRATA_SANITIZERS:-1}

status=0
phase "format (clang-format, 100 columns), function length (80 lines)"
"$root/scripts/check_format.sh" || status=1
"$root/scripts/check_function_length.sh" || status=1
if [ "$sanitizers" = "0" ] || [ ${#san_cc[@]} -eq 0 ]; then
  phase "thread safety (clang -Wthread-safety)"
  "$root/scripts/check_thread_safety.sh" "$root/build-tsa" || status=1
fi

phase "build (RelWithDebInfo)"
"$root/scripts/build.sh" "$root/build" -DSTRATA_BUILD_TESTS=ON -DSTRATA_BUILD_BENCHMARKS=ON \
  "${build_flags[@]}" || exit 1
# The sanitizer builds run in the background of the test phase before them, at the lowest CPU
# priority (nice 19), in what the tests leave idle (processes starting, waits on the disk and on
# other ranks). Measured in a fresh clone on 2 cores: the main tests 286 s with the ASan build
# beside them (247 s alone), the build done 44 s after them: 330 s for what took 365 one after
# the other. Each build's output goes to a log, printed when the build is waited for.
bg_pid="" bg_log=""
configure_san() {  # configure_san BUILD_DIR [cmake args...]
  local dir=$1
  shift
  cmake -S "$root" -B "$dir" -G Ninja -DSTRATA_WITH_CUDA=OFF -DSTRATA_BUILD_BENCHMARKS=OFF \
    "${san_cc[@]}" "${build_flags[@]}" "$@" >/dev/null
}
start_build() {  # start_build BUILD_DIR [ctest selection...]: build_tested, niced, in the background
  bg_log=$(mktemp)
  (renice -n 19 -p "$BASHPID" >/dev/null && build_tested "$@") >"$bg_log" 2>&1 &
  bg_pid=$!
}
wait_build() {  # wait_build NAME: waits for the background build, prints its log; fails with it
  local rc=0
  wait "$bg_pid" || rc=$?
  echo "== $1: built in the background (ended at ${SECONDS}s, rc $rc) =="
  if [ "$rc" -ne 0 ]; then cat "$bg_log"; else tail -n 3 "$bg_log"; fi
  rm -f "$bg_log"
  return "$rc"
}
if [ "$sanitizers" != "0" ]; then
  tsa=()
  [ ${#san_cc[@]} -gt 0 ] && tsa=("-DCMAKE_CXX_FLAGS=-Wthread-safety -Werror=thread-safety")
  if configure_san "$root/build-asan" -DSTRATA_SANITIZE=address,undefined \
    -DSTRATA_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Debug "${tsa[@]}" &&
    configure_san "$root/build-tsan" -DSTRATA_SANITIZE=thread -DSTRATA_BUILD_TESTS=ON \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo; then
    start_build "$root/build-asan" -LE no_sanitizer
    echo "(building ASan+UBSan${tsa:+ with the thread-safety analysis} in the background, nice 19)"
  else
    echo "test.sh: configuring a sanitizer build failed (above): no sanitizer runs" >&2
    status=1 sanitizers=0
  fi
fi
# Every test, in one CTest run (one tail of a last long test, not two): the gpu tests' binaries
# (CUDA device, CUDA Adam, NCCL, the placement matrix with 1, 2 and 4 fake GPUs) among them, against
# the fake CUDA runtime + fake NCCL (label fakecuda): built whenever the toolkit and NCCL's headers
# are there (no GPU needed). Without them the label is empty, and that is said.
phase "tests (with the CUDA and NCCL code on the fake CUDA runtime, label fakecuda)"
if [ -z "$(cd "$root/build" && ctest -N -L fakecuda | sed -n 's/^ *Test *#[0-9]*: //p')" ]; then
  echo "no fakecuda tests: this build has no CUDA toolkit with NCCL (STRATA_HAVE_CUDA/NCCL off)"
fi
run_ctest "$root/build" || status=1

if [ "$sanitizers" != "0" ]; then
  asan_built=0
  wait_build "ASan+UBSan build" && asan_built=1 || status=1
  start_build "$root/build-tsan" -L tsan
  if [ "$asan_built" = 1 ]; then
    phase "tests under ASan+UBSan (the TSan build in the background)"
    # detect_stack_use_after_return=0: GCC's default, clang's since LLVM 15 is 1 (a fake stack
    # per frame: test_zero_offload 40 s -> 81 s); the suite ran without it under GCC before.
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:detect_stack_use_after_return=0 \
      UBSAN_OPTIONS=print_stacktrace=1 \
      run_ctest "$root/build-asan" -LE no_sanitizer || status=1
  fi
  if wait_build "TSan build"; then
    phase "tests under TSan"
    TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
      run_ctest "$root/build-tsan" -L tsan || status=1
  else
    status=1
  fi
fi

echo
echo "phases began at: $phase_log"
echo "all: $total_pass passed, $total_fail failed, $total_skip skipped (${SECONDS}s)"
exit $status
