#!/usr/bin/env bash
# GPU acceptance check (issues 12, 27, 47). On a machine with an NVIDIA GPU (A100/H100/H200 class).
#
#   scripts/gpu_check.sh --bundle FILE [RESULTS_DIR]   a GPU node without a package registry or
#       network: FILE from scripts/gpu_bundle.sh on a build host. Unpacks it (STRATA_GPU_WORK,
#       default /tmp/strata-gpu-check; the CTest files' paths are rewritten to the unpacked
#       place), builds only the Python extension against this node's python3 + torch + pybind11
#       (scripts/gpu_pybuild.sh; NCCL from torch's wheel when the toolkit has none), then runs
#       the phases below. Needs: bash, tar, g++, python3 with torch (CUDA); ctest (cmake) when
#       present, else the bundle's gpu tests run one by one.
#   scripts/gpu_check.sh [RESULTS_DIR]                 a source checkout whose build dependencies
#       are installed (scripts/deps.sh): builds strata with CUDA into build-gpu/ for the GPU's own
#       architecture (nvidia-smi's compute_cap; 80;90 when unreadable; never `native`) with the
#       Python package for that Python, then the same phases.
#
# Phases, each under `timeout`, each PASS / FAIL / SKIP:
#   unpack | build    the bundle unpacked and its CLI runs / the CMake build
#   pybuild           the extension for this node's Python (--bundle: in the background, beside
#                     ctest)
#   ctest             every CUDA and NCCL test (CTest label gpu); FAIL when all were skipped
#   bench_adam        strata bench adam --device cuda --params 256M: the GPU kernel against a D2D copy
#   bench_step        strata bench step with optimizer.update device (Adam on the GPU), runtime cuda
#   spec_pinned       strata bench step --backward auto, optimizer.overlap on, stage 2, state in
#   spec_nvme           pinned host memory / on NVMe (STRATA_GPU_SWAP): the speculative update
#   profile           strata profile --quick (1B, stage 2, NVMe, runtime.device auto)
#   torch_cuda        tests/python/test_torch_cuda.py: ZeroOptimizer on a CUDA model vs AdamW
#   train_gpt         examples/train_gpt.py --device cuda --compare-torch, 30 steps: |loss - AdamW's|
#                     <= 1e-4 at every step (from its --log-json)
#   hf_trainer        examples/hf_trainer.py --device cuda (transformers' Trainer, strata vs AdamW);
#                     SKIP where transformers does not import
# Driver first: prints the driver, its CUDA version and the GPUs; a driver older than the toolkit
# needs (CUDA 13: >= 580) uses the toolkit's cuda-compat libraries when present, and says so.
#
# RESULTS_DIR (default ./gpu-check-out) gets at most six files: summary.txt (the phase lines and
# ONE summary line, also printed last), gpu.txt (GPU, driver, OS, Python, torch, NCCL, ldd of the
# CLI), build.log (the bundle's MANIFEST and unpack, or the build; pybuild), ctest.log, bench.log
# (the five CLI phases) and python.log (the three Python phases). Scratch (swap, JSON, the
# unpacked bundle) stays in STRATA_GPU_WORK. Aimed at under 5 minutes on a 16-core H200 host with a
# bundle (the phases' timeouts add up to more: a hung phase costs its timeout, not the run).
#
# Environment: STRATA_GPU_PYTHON (the python3 with CUDA torch; default: python3 on PATH, else
#   /usr/bin/python3), STRATA_GPU_WORK, STRATA_GPU_SWAP (swap directory, default under the work
#   directory: point it at NVMe), STRATA_JOBS (default nproc), STRATA_GPU_BUILD and
#   STRATA_CUDA_ARCHS (without --bundle: build directory, CMAKE_CUDA_ARCHITECTURES),
#   STRATA_GPU_CHECK_FORCE=1 (run the GPU phases without a visible GPU: a dry run of the script).
# Exit code: 0 when no phase failed, 1 otherwise, 2 when there is no GPU (the GPU phases SKIP).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
root=$(cd "$(dirname "$0")/.." && pwd)
bundle="" out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle=${2:?--bundle needs a file}; shift 2 ;;
    --bundle=*) bundle=${1#--bundle=}; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_check: unknown option '$1' (--help)" >&2; exit 1 ;;
    *) [ -z "$out" ] || { echo "gpu_check: one RESULTS_DIR only (--help)" >&2; exit 1; }
       out=$1; shift ;;
  esac
done
out=${out:-$PWD/gpu-check-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ -n "$bundle" ]; then
  [ -f "$bundle" ] || { echo "gpu_check: --bundle $bundle: no such file" >&2; exit 1; }
  bundle=$(cd "$(dirname "$bundle")" && pwd)/$(basename "$bundle")
fi
jobs=${STRATA_JOBS:-$(nproc)}
work=${STRATA_GPU_WORK:-/tmp/strata-gpu-check}
mkdir -p "$work"
work=$(cd "$work" && pwd)
swap=${STRATA_GPU_SWAP:-$work/swap}
rm -f "$out"/{summary.txt,gpu.txt,build.log,ctest.log,bench.log,python.log}
: >"$out/bench.log"
: >"$out/python.log"
t0=$(date +%s)

declare -A result
phases=()
# note PHASE STATUS TEXT: records a phase's verdict (PASS | FAIL | SKIP) and prints it.
note() {
  local p=$1 st=$2
  shift 2
  phases+=("$p")
  result[$p]="$st${*:+ ($*)}"
  printf '== [%4d s] %-12s %s\n' "$(( $(date +%s) - t0 ))" "$p" "${result[$p]}"
}
# log FILE TITLE COMMAND...: appends a header and the command's output to FILE; its exit status.
log() {
  local f=$1 title=$2 rc=0
  shift 2
  printf '\n===== %s\n$ %s\n' "$title" "$*" >>"$f"
  "$@" >>"$f" 2>&1 || rc=$?
  echo "===== rc $rc" >>"$f"
  return "$rc"
}
summary() {
  local status=PASS fails=0 skips=0 line="" p
  for p in "${phases[@]}"; do
    case "${result[$p]}" in PASS*) ;; SKIP*) skips=$((skips + 1)) ;; *) fails=$((fails + 1)) ;; esac
    line+="; $p ${result[$p]%% (*}"
  done
  [ "$fails" -eq 0 ] || status=FAIL
  [ "$gpu_ok" = 1 ] || status="NO GPU"
  {
    echo "== phases"
    for p in "${phases[@]}"; do printf '%-12s %s\n' "$p" "${result[$p]}"; done
    echo "gpu_check: $status in $(( $(date +%s) - t0 )) s ($fails failed, $skips skipped) -" \
         "gpu: ${gpu_name:-none}; driver ${driver:-?}; ${how}${line}; logs in $out"
  } >"$out/summary.txt"
  tail -1 "$out/summary.txt"
  if [ "$gpu_ok" != 1 ]; then return 2; fi
  [ "$status" = PASS ]
}
finish() { local rc=0; summary || rc=$?; rm -rf "$swap"; exit "$rc"; }

# ---- GPU, driver, toolkit first ---------------------------------------------------------------
gpu_ok=0 gpu_name="" driver="" cap=""
{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) $(hostname), $(nproc) cores"
  free -g | sed -n 2p || true
  grep -E '^(PRETTY_NAME)=' /etc/os-release 2>/dev/null || true
} >"$out/gpu.txt"
if command -v nvidia-smi >/dev/null && nvidia-smi -L >>"$out/gpu.txt" 2>&1; then
  gpu_ok=1
  nvidia-smi >>"$out/gpu.txt" 2>&1 || true
  query=$(nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap \
            --format=csv,noheader 2>/dev/null || true)
  echo "$query" >>"$out/gpu.txt"
  echo "== GPUs and driver =="
  echo "$query"
  grep -m1 -o 'CUDA Version: [0-9.]*' "$out/gpu.txt" || true
  driver=$(echo "$query" | head -1 | cut -d, -f3 | tr -d ' ')
  gpu_name="$(echo "$query" | head -1 | cut -d, -f2 | sed 's/^ *//') (x$(echo "$query" | grep -c .))"
  cap=$(echo "$query" | head -1 | cut -d, -f5 | tr -d ' .')
else
  echo "gpu_check: NO GPU visible (nvidia-smi -L failed; $out/gpu.txt)" | tee -a "$out/gpu.txt"
fi
force=${STRATA_GPU_CHECK_FORCE:-0}
if [ "$gpu_ok" != 1 ] && [ -z "$bundle" ]; then
  # Without a bundle the build needs the GPU's architecture and takes minutes: nothing runs.
  echo "gpu_check: NO GPU - nothing ran (nvidia-smi -L failed; see $out/gpu.txt)" | tee "$out/summary.txt"
  exit 2
fi
nvcc=/usr/local/cuda/bin/nvcc
if [ ! -x "$nvcc" ] && command -v nvcc >/dev/null; then nvcc=$(command -v nvcc); fi
toolkit=$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\).*/\1/p' || true)
echo "nvcc: ${toolkit:+CUDA $toolkit at }$nvcc" >>"$out/gpu.txt"
if [ "${toolkit:-0}" -ge 13 ] && [ -n "$driver" ] && [ "${driver%%.*}" -lt 580 ] 2>/dev/null; then
  if [ -d /usr/local/cuda/compat ]; then
    export LD_LIBRARY_PATH=/usr/local/cuda/compat${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "driver $driver is older than CUDA $toolkit needs (>= 580): using /usr/local/cuda/compat"
    driver="$driver (+cuda-compat)"
  else
    echo "WARNING: driver $driver is older than CUDA $toolkit needs (>= 580) and there is no" \
         "/usr/local/cuda/compat: the CUDA runtime will refuse the GPU"
  fi
fi
run_gpu=$gpu_ok
[ "$force" = 1 ] && run_gpu=1

# The Python: STRATA_GPU_PYTHON, else the python3 on PATH (on a GPU node usually a venv with CUDA
# torch), else /usr/bin/python3; the first whose torch sees a GPU, else the first with torch.
py="" py_any=""
for cand in ${STRATA_GPU_PYTHON:-} python3 /usr/bin/python3; do
  command -v "$cand" >/dev/null || continue
  if "$cand" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    py=$(command -v "$cand")
    break
  fi
  if [ -z "$py_any" ] && "$cand" -c 'import torch' 2>/dev/null; then py_any=$(command -v "$cand"); fi
done
py=${py:-$py_any}
if [ -n "$py" ]; then
  echo "python: $py, $("$py" -c 'import sys, torch
print("Python %d.%d.%d," % sys.version_info[:3], "torch", torch.__version__, "CUDA",
      torch.version.cuda, "GPU visible:", torch.cuda.is_available())' 2>&1 | tail -1)" |
    tee -a "$out/gpu.txt"
else
  echo "python: none with torch (STRATA_GPU_PYTHON)" | tee -a "$out/gpu.txt"
fi
# NCCL: torch's wheel (nvidia/nccl/lib) first, else the toolkit's; for the CLI and the tests.
nccl_dir=""
if [ -n "$py" ]; then
  nccl_dir=$("$py" -c 'import glob, os, nvidia
libs = (p for r in nvidia.__path__ for p in sorted(glob.glob(os.path.join(r, "*/lib/libnccl.so*"))))
print(os.path.dirname(next(libs, "")))' 2>/dev/null || true)
fi
if [ -z "$nccl_dir" ] && [ -e /usr/local/cuda/lib64/libnccl.so.2 ]; then nccl_dir=/usr/local/cuda/lib64; fi
echo "nccl: ${nccl_dir:-not found (the CLI and tests need libnccl.so.2)}" >>"$out/gpu.txt"

# ---- unpack (--bundle) or build --------------------------------------------------------------
pybuild_pid=""
if [ -n "$bundle" ]; then
  how="bundle $(basename "$bundle")"
  dest=$work/strata-gpu
  src=$dest/src bld=$dest/build pypath=$dest/python
  # shellcheck disable=SC2317  # (called through log)
  unpack() {
    rm -rf "$dest" || return 1
    timeout 120 tar -xzf "$bundle" -C "$work" || return 1
    if [ ! -f "$dest/MANIFEST" ]; then
      echo "no strata-gpu/MANIFEST in $bundle: not a gpu_bundle.sh bundle"
      return 1
    fi
    cat "$dest/MANIFEST"
    local prefix
    prefix=$(sed -n 's/^prefix=//p' "$dest/MANIFEST")
    # CTest's files name the build host's paths: rewrite them to this place.
    if [ -n "$prefix" ] && [ "$prefix" != "$dest" ]; then
      find "$bld" -name CTestTestfile.cmake -print0 | xargs -0 -r sed -i "s|$prefix|$dest|g" || return 1
      echo "CTest files: $prefix -> $dest"
    fi
    ldd "$bld/strata" | grep 'not found' && return 1
    "$bld/strata" --version
  }
  # The bundle's libraries, NCCL, the toolkit's runtime; the bundle's cudart only as a fallback.
  LD_LIBRARY_PATH=$work/strata-gpu/lib${nccl_dir:+:$nccl_dir}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$work/strata-gpu/lib/cuda
  if log "$out/build.log" "unpack $bundle into $work" unpack && [ -x "$bld/strata" ]; then
    manifest() { sed -n "s/^$1=//p" "$dest/MANIFEST"; }
    archs=$(manifest cuda_architectures)
    note unpack PASS "tree $(manifest git_rev) +$(manifest dirty_files) changed files, sm_$archs"
    if [ -n "$cap" ] && ! [[ ";$archs;" == *";$cap;"* ]]; then
      echo "WARNING: the bundle has CUDA code for $archs, the GPU is sm_$cap (PTX JIT at best)" |
        tee -a "$out/gpu.txt"
    fi
    { echo "== ldd strata"; ldd "$bld/strata"; } >>"$out/gpu.txt" 2>&1 || true
  else
    note unpack FAIL "$out/build.log"
    finish
  fi
  how+=", archs ${archs:-?}"
  if [ -z "$py" ]; then
    note pybuild FAIL "no python3 with torch: set STRATA_GPU_PYTHON"
  else
    # In the background, beside ctest; reported after it.
    ( PY=$py STRATA_JOBS=$jobs timeout 600 bash "$src/scripts/gpu_pybuild.sh" "$dest" "$pypath" \
        >"$work/pybuild.log" 2>&1 ) &
    pybuild_pid=$!
  fi
else
  build=${STRATA_GPU_BUILD:-$root/build-gpu}
  src=$root bld=$build pypath=$build/python
  if [ -n "${STRATA_CUDA_ARCHS:-}" ]; then
    archs=$STRATA_CUDA_ARCHS
  elif [[ "$cap" =~ ^[0-9]+$ ]]; then
    archs=$cap
  else
    archs="80;90"
  fi
  how="source build $bld, archs $archs"
  py_prefix=""
  if [ -n "$py" ]; then
    py_prefix=$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
    pb=$("$py" -c 'import pybind11; print(pybind11.get_cmake_dir())' 2>/dev/null) && py_prefix="$py_prefix;$pb"
  fi
  gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  pyargs=()
  if [ -n "$py" ]; then pyargs=("-DSTRATA_PYTHON=$py" "-DCMAKE_PREFIX_PATH=$py_prefix"); fi
  targets=(strata_cli test_device_cuda test_optim_cuda test_comm_nccl test_zero_placements_cuda test_tier_cuda)
  if [ -n "$nccl_dir" ]; then export LD_LIBRARY_PATH=$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
  if log "$out/build.log" "configure" timeout 120 cmake -S "$root" -B "$build" "${gen[@]}" \
         -DCMAKE_BUILD_TYPE=Release -DSTRATA_WITH_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$archs" \
         -DSTRATA_BUILD_TESTS=ON -DSTRATA_BUILD_BENCHMARKS=OFF "${pyargs[@]}" &&
     log "$out/build.log" "build" timeout 300 cmake --build "$build" -j "$jobs" --target "${targets[@]}"; then
    note build PASS "$build"
  else
    note build FAIL "$out/build.log"
    finish
  fi
  if log "$out/build.log" "python package" timeout 300 cmake --build "$build" -j "$jobs" \
         --target strata_python strata_python_files; then
    note pybuild PASS "$pypath"
  else
    note pybuild FAIL "the Python package did not build: pybind11 / torch missing? $out/build.log"
  fi
fi
X=$bld/strata
mkdir -p "$swap"

# ---- ctest -L gpu -----------------------------------------------------------------------------
if [ "$run_gpu" != 1 ]; then
  note ctest SKIP "no GPU"
else
  rc=0
  if command -v ctest >/dev/null; then
    (cd "$bld" && timeout 300 ctest -L gpu --output-on-failure --timeout 280 -j 3 >"$out/ctest.log" 2>&1) || rc=$?
    total=$(sed -n 's/.*tests passed, [0-9]* tests failed out of \([0-9]*\).*/\1/p' "$out/ctest.log" | tail -1)
    failed=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of.*/\1/p' "$out/ctest.log" | tail -1)
    skipped=$(grep -c '\*\*\*Skipped' "$out/ctest.log" || true)
  elif [ -n "$bundle" ]; then
    # No ctest on this node: the bundle's gpu tests one by one (exit 77: skipped), as CTest would.
    total=0 failed=0 skipped=0
    echo "no ctest: running the bundle's gpu tests directly" >"$out/ctest.log"
    # shellcheck disable=SC2013  # (words: the test names)
    for t in $(sed -n 's/^gpu_tests=//p' "$dest/MANIFEST"); do
      f=$(find "$bld/tests" -maxdepth 2 -type f -name "$t" | head -1)
      total=$((total + 1)) trc=0
      echo "===== $t" >>"$out/ctest.log"
      (cd "$(dirname "${f:-$bld/none}")" && STRATA_SOURCE_DIR=$src STRATA_BINARY_DIR=$bld \
         timeout 280 "${f:-$bld/tests/$t}") >>"$out/ctest.log" 2>&1 || trc=$?
      echo "===== $t: rc $trc" >>"$out/ctest.log"
      case $trc in 0) ;; 77) skipped=$((skipped + 1)); echo "$t ***Skipped" >>"$out/ctest.log" ;;
                   *) failed=$((failed + 1)) rc=1 ;; esac
    done
  else
    echo "no ctest on PATH" >"$out/ctest.log"
    total=0 failed=0 skipped=0 rc=127
  fi
  cases_skipped=$(grep -c '\[  SKIPPED \]' "$out/ctest.log" || true)
  total=${total:-0} failed=${failed:-0}
  if [ "$total" -eq 0 ]; then
    note ctest FAIL "no gpu test ran, rc $rc, $out/ctest.log"
  elif [ "$skipped" -ge "$total" ]; then
    note ctest FAIL "all $total gpu tests SKIPPED: the GPU was not usable, $out/ctest.log"
  elif [ "$rc" -ne 0 ]; then
    note ctest FAIL "$failed of $total failed, $skipped skipped, rc $rc, $out/ctest.log"
  else
    note ctest PASS "$((total - skipped)) of $total passed, $skipped skipped; $cases_skipped skipped cases"
  fi
fi

# ---- pybuild's verdict (bundle) -------------------------------------------------------------
if [ -n "$pybuild_pid" ]; then
  rc=0
  wait "$pybuild_pid" || rc=$?
  cat "$work/pybuild.log" >>"$out/build.log"
  if [ "$rc" -eq 0 ]; then
    note pybuild PASS "$(grep -m1 '^python ' "$work/pybuild.log" | cut -c1-160)"
  else
    note pybuild FAIL "rc $rc: $(grep -m1 'FAILED at' "$work/pybuild.log" || echo "see $out/build.log")"
  fi
fi

# ---- the CLI on the GPU ---------------------------------------------------------------------
# the last error the CLI printed into bench.log (a failed phase's note)
cli_error() { grep -E 'error:|Error|^===== rc (124|137)$' "$out/bench.log" | tail -1 | cut -c1-200 || true; }
if [ "$run_gpu" != 1 ]; then
  for p in bench_adam bench_step spec_pinned spec_nvme profile; do note "$p" SKIP "no GPU"; done
else
  if log "$out/bench.log" "bench adam --device cuda" timeout 90 "$X" bench adam --device cuda --params 256M &&
     grep -q 'Gparams/s' "$out/bench.log"; then
    note bench_adam PASS "$(grep 'adam: .*Gparams/s' "$out/bench.log" | tail -1 | sed 's/^ *adam: *//')," \
      "$(grep 'fraction of copy' "$out/bench.log" | tail -1 | sed 's/^ *//')"
  else
    note bench_adam FAIL "$(cli_error); $out/bench.log"
  fi

  j=$work/bench_step.json
  if timeout 90 "$X" bench step "$src/bench/step/step.yaml" --params 16M --rounds 2 --no-scaling --json \
       --set "tiers.nvme.paths=[$swap]" --set optimizer.update=device --set runtime.device=cuda \
       >"$j" 2>"$work/bench_step.err"; then
    { echo; echo "===== bench step, optimizer.update device (JSON)"; cat "$j" "$work/bench_step.err"; } \
      >>"$out/bench.log"
    eff=$(grep -oE '"device_efficiency": *[0-9.eE+-]+' "$j" | head -1 | sed 's/.*: *//' || true)
    on=$(grep -oE '"update_on": *"[^"]*"' "$j" | head -1 | sed 's/.*: *//' || true)
    note bench_step PASS "update on $on, max(t_io, t_update)/t_step = ${eff:-?}"
  else
    rc=$?
    { echo; echo "===== bench step, optimizer.update device: rc $rc"; cat "$j" "$work/bench_step.err"; } \
      >>"$out/bench.log"
    note bench_step FAIL "rc $rc: $(cli_error); $out/bench.log"
  fi

  # The speculative update behind a simulated backward (stage 2, overlap on), state pinned / NVMe.
  spec=("$X" bench step "$src/bench/step/step.yaml" --backward auto --tensors 16 --rounds 3
        --params 128M --set zero.stage=2 --set optimizer.overlap=on --set runtime.device=cuda
        --set zero.sub_group_size=2M --set tiers.host.buffer_size=64MiB --set "tiers.nvme.paths=[$swap]")
  pinned=(--set offload.optimizer.tier=cpu --set offload.optimizer.pin_memory=true
          --set tiers.host.pinned_budget=8GiB)
  if log "$out/bench.log" "speculative update, state pinned" timeout 120 "${spec[@]}" "${pinned[@]}"; then
    note spec_pinned PASS "$(grep 'ratios' "$out/bench.log" | tail -1 | sed 's/^ *ratios *//' | cut -c1-200)"
  else
    note spec_pinned FAIL "$(cli_error); $out/bench.log"
  fi
  if log "$out/bench.log" "speculative update, state on NVMe ($swap)" timeout 120 "${spec[@]}"; then
    note spec_nvme PASS "$(grep 'ratios' "$out/bench.log" | tail -1 | sed 's/^ *ratios *//' | cut -c1-200)"
  else
    note spec_nvme FAIL "$(cli_error); $out/bench.log"
  fi

  cat >"$work/profile.yaml" <<EOF
model: {parameters: 1B}
precision: {params: bf16, grads: bf16}
world: {ranks: 1}
zero: {stage: 2}
offload: {optimizer: {tier: nvme}}
tiers:
  host: {pinned_budget: 2GiB, buffer_count: 4, buffer_size: 64MiB}
  nvme: {paths: [$swap]}
runtime: {device: auto}
EOF
  f=$work/profile.txt
  rc=0
  log "$f" "profile --quick" timeout 120 "$X" profile "$work/profile.yaml" --quick || rc=$?
  cat "$f" >>"$out/bench.log"
  # The sample step's prediction error, and the host <-> device copies it measured.
  errs=$(awk '$1 == "serial" && $NF ~ /%$/ {s = $NF} $1 == "pipelined" && $NF ~ /%$/ {p = $NF}
              END {if (s != "") print "sample step error serial " s ", pipelined " p}' "$f")
  h2d=$(grep -m1 '^Host <-> device copies' "$f" | cut -c1-120 || true)
  if [ "$rc" -ne 0 ]; then
    note profile FAIL "rc $rc: $(cli_error); $out/bench.log"
  elif grep -qE '(GPU Adam|Host <-> device copies): skipped' "$f"; then
    note profile FAIL "it measured no GPU: ${h2d:-?}"
  else
    note profile PASS "${errs:-no sample step?}; largest copy (size, h2d d2h pinned, h2d d2h" \
      "pageable): $(grep -A12 '^Host <-> device copies' "$f" | grep -E '^ +[0-9]' | tail -1 | tr -s ' ')"
  fi
fi

# ---- strata.torch on the GPU ------------------------------------------------------------------
have_pkg=0
if [ -n "$py" ] && ls "$pypath"/strata/_strata*.so >/dev/null 2>&1; then have_pkg=1; fi
if [ "$have_pkg" != 1 ]; then
  for p in torch_cuda train_gpt hf_trainer; do note "$p" FAIL "no strata Python package (pybuild)"; done
elif [ "$run_gpu" != 1 ]; then
  for p in torch_cuda train_gpt hf_trainer; do note "$p" SKIP "no GPU"; done
else
  rc=0
  log "$out/python.log" "tests/python/test_torch_cuda.py" timeout 300 \
    env PYTHONPATH="$pypath" STRATA_LOG_LEVEL=warn STRATA_TEST_SWAP="$swap" \
    "$py" "$src/tests/python/test_torch_cuda.py" || rc=$?
  last=$(grep '^test_torch_cuda: ' "$out/python.log" | tail -1 || true)
  case $rc in
    0) note torch_cuda PASS "${last#test_torch_cuda: }" ;;
    77) note torch_cuda FAIL "SKIPPED although a GPU is present: $(grep -m1 SKIPPED "$out/python.log")" ;;
    *) note torch_cuda FAIL "rc $rc${last:+, ${last#test_torch_cuda: }}, $out/python.log" ;;
  esac

  # train_gpt on the GPU with AdamW beside it; the verdict from its per-step records.
  cat "$src"/docs/*.md "$src"/README.md >"$work/text.txt"
  rc=0
  log "$out/python.log" "examples/train_gpt.py --device cuda --compare-torch, 30 steps" timeout 180 \
    env PYTHONPATH="$pypath" STRATA_LOG_LEVEL=warn "$py" "$src/examples/train_gpt.py" --device cuda \
    --steps 30 --compare-torch --data "$work/text.txt" --set "tiers.nvme.paths=[$swap]" \
    --log-json "$work/train_gpt.json" --plot "$work/train_gpt.png" || rc=$?
  verdict=$("$py" - "$work/train_gpt.json" <<'EOF' 2>&1
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print("FAIL no per-step records (%s)" % e)
    sys.exit()
d = max((abs(x["loss"] - x["torch_loss"]) for x in r if "torch_loss" in x), default=float("nan"))
ok = len(r) == 30 and all("torch_loss" in x for x in r) and d <= 1e-4
print("%s %d steps, loss %.4f -> %.4f, max |loss - AdamW's| %.3g (bound 1e-4)"
      % ("PASS" if ok else "FAIL", len(r), r[0]["loss"] if r else 0, r[-1]["loss"] if r else 0, d))
EOF
)
  echo "train_gpt verdict: $verdict" >>"$out/python.log"
  if [ "$rc" -ne 0 ] && [ "${verdict%% *}" = PASS ] &&
     grep -q "No module named 'matplotlib'" "$out/python.log"; then
    rc=0 verdict="$verdict; no plot (no matplotlib)"
  fi
  if [ "$rc" -eq 0 ] && [ "${verdict%% *}" = PASS ]; then
    note train_gpt PASS "${verdict#PASS }"
  else
    err=$(grep -E 'Error|error:' "$out/python.log" | tail -1 | cut -c1-160 || true)
    note train_gpt FAIL "rc $rc, ${verdict#FAIL }: $err; $out/python.log"
  fi

  if ! "$py" -c 'import transformers' >/dev/null 2>&1; then
    note hf_trainer SKIP "transformers does not import in $py"
  else
    rc=0
    log "$out/python.log" "examples/hf_trainer.py --device cuda" timeout 300 \
      env PYTHONPATH="$pypath" STRATA_LOG_LEVEL=warn \
      "$py" "$src/examples/hf_trainer.py" --device cuda || rc=$?
    last=$(grep '^hf_trainer: ' "$out/python.log" | tail -1 || true)
    if [ "$rc" -eq 0 ]; then
      note hf_trainer PASS "${last#hf_trainer: }"
    else
      note hf_trainer FAIL "rc $rc${last:+, ${last#hf_trainer: }}, $out/python.log"
    fi
  fi
fi
finish
