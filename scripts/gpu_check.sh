#!/usr/bin/env bash
# GPU acceptance check (issues 12 and 27). On a machine with an NVIDIA GPU (A100/H100/H200 class):
#   0. prints the driver, the CUDA version it supports and the GPUs FIRST (so a failure below can
#      be read against them); with a driver older than the toolkit needs (CUDA 13: >= 580) it uses
#      the toolkit's cuda-compat libraries when present, and says so;
#   1. builds strata with CUDA into build-gpu/: for the GPU's own architecture (nvidia-smi's
#      compute_cap), or for 80;90 when that cannot be read — never `native`, whose detection fails
#      at configure time with a driver older than the toolkit;
#   2. runs every CUDA and NCCL test (CTest label `gpu`): the CUDA device, the CUDA Adam kernel
#      against CpuAdam, the NCCL communicator, the engine's placement matrix on runtime.device cuda
#      with NCCL. FAILS when every gpu test was skipped (a GPU the tests could not use is not a
#      pass), and says how many were skipped otherwise;
#   3. `strata bench step` with Adam on the device (optimizer.update device, runtime.device cuda);
#   4. `strata profile --quick` (host<->device copies, GPU Adam, the sample step);
#   5. the Python example on the GPU: examples/train_gpt.py --device cuda, 20 steps, with a Python
#      whose torch sees the GPU (STRATA_GPU_PYTHON, else python3 on PATH, else /usr/bin/python3),
#      the package built for it;
# and prints ONE summary line (also written to $OUT/summary.txt). Bounded: each phase has its own
# timeout (build 210 s, tests 120 s, bench 30 s, profile 45 s, python 60 s: 465 s at worst), so one
# call stays under 8 minutes; set STRATA_GPU_BUILD to reuse a build directory.
#
# Usage: scripts/gpu_check.sh [OUT_DIR]     (default: ./gpu-check-out)
# Environment: STRATA_GPU_BUILD (build dir, default build-gpu), STRATA_JOBS (default nproc),
#              STRATA_GPU_SWAP (a directory for the swap files, default a fresh one under /tmp),
#              STRATA_CUDA_ARCHS (force CMAKE_CUDA_ARCHITECTURES), STRATA_GPU_PYTHON (the Python
#              with CUDA torch for phase 5).
# Exit code: 0 when every phase passed, 1 otherwise, 2 when there is no GPU (nothing ran).
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$PWD/gpu-check-out}
build=${STRATA_GPU_BUILD:-$root/build-gpu}
jobs=${STRATA_JOBS:-$(nproc)}
mkdir -p "$out"
t0=$(date +%s)
declare -A result
phases="build ctest bench_step profile python"
summary() {
  local status=PASS
  for k in $phases; do
    case "${result[$k]:-not-run}" in ok*) ;; *) status=FAIL ;; esac
  done
  local line="gpu_check: $status in $(( $(date +%s) - t0 )) s — gpu: ${gpu_name:-none}; driver: ${driver:-?}; archs: ${archs:-?}; build: ${result[build]:-not-run}; ctest (label gpu): ${result[ctest]:-not-run}; bench step (Adam on the device): ${result[bench_step]:-not-run}; profile --quick: ${result[profile]:-not-run}; python example on cuda: ${result[python]:-not-run}; logs in $out"
  echo "$line" | tee "$out/summary.txt"
  [ "$status" = PASS ]
}

# ---- 0. driver and GPUs first ---------------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >"$out/gpus.txt" 2>&1; then
  echo "gpu_check: NO GPU — nothing ran (nvidia-smi -L failed; see $out/gpus.txt)" | tee "$out/summary.txt"
  exit 2
fi
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv \
  >"$out/gpu-query.csv" 2>&1
echo "== GPUs and driver =="
cat "$out/gpu-query.csv"
grep -m1 -o 'CUDA Version: [0-9.]*' "$out/nvidia-smi.txt" || true
driver=$(sed -n 2p "$out/gpu-query.csv" | cut -d, -f3 | tr -d ' ')
gpu_name=$(head -1 "$out/gpus.txt" | sed 's/ (UUID.*//')
ngpu=$(grep -c '^GPU ' "$out/gpus.txt")
gpu_name="$gpu_name (x$ngpu)"
driver_major=${driver%%.*}
nvcc=/usr/local/cuda/bin/nvcc
toolkit=$("$nvcc" --version 2>/dev/null | grep -o 'release [0-9]*' | grep -o '[0-9]*$' || echo 0)
if [ "${toolkit:-0}" -ge 13 ] && [ "${driver_major:-0}" -lt 580 ] 2>/dev/null; then
  if [ -d /usr/local/cuda/compat ]; then
    export LD_LIBRARY_PATH=/usr/local/cuda/compat${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "driver $driver is older than CUDA $toolkit needs (>= 580): using /usr/local/cuda/compat"
    driver="$driver (+cuda-compat)"
  else
    echo "WARNING: driver $driver is older than CUDA $toolkit needs (>= 580) and there is no" \
         "/usr/local/cuda/compat: the CUDA runtime will refuse the GPU"
  fi
fi
# The GPU's own architecture (compute_cap 9.0 -> 90), else the defaults 80;90.
cap=$(sed -n 2p "$out/gpu-query.csv" | cut -d, -f5 | tr -d ' .')
if [ -n "${STRATA_CUDA_ARCHS:-}" ]; then
  archs=$STRATA_CUDA_ARCHS
elif [[ "$cap" =~ ^[0-9]+$ ]]; then
  archs=$cap
else
  archs="80;90"
fi

# The Python the example runs with: one whose torch sees a GPU (STRATA_GPU_PYTHON, else the
# `python3` on PATH — on a GPU machine usually a venv with CUDA torch —, else /usr/bin/python3);
# the package is built for it, against its torch and pybind11 (pip's CMake configs).
py=""
for cand in ${STRATA_GPU_PYTHON:-} python3 /usr/bin/python3; do
  if command -v "$cand" >/dev/null &&
     "$cand" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    py=$(command -v "$cand")
    break
  fi
done
py_prefix=""
if [ -n "$py" ]; then
  py_prefix=$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
  pb=$("$py" -c 'import pybind11; print(pybind11.get_cmake_dir())' 2>/dev/null) &&
    py_prefix="$py_prefix;$pb"
  echo "python for the example: $py ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
else
  echo "no python3 whose torch sees a GPU: phase 5 will fail"
fi

# ---- 1. build (CUDA for this GPU; tests; the CLI; the Python package) ---------------------------
targets="strata_cli test_device_cuda test_optim_cuda test_comm_nccl test_zero_placements_cuda"
gen=""
command -v ninja >/dev/null && gen="-G Ninja"
if timeout 210 bash -c "
    cmake -S '$root' -B '$build' $gen -DCMAKE_BUILD_TYPE=Release -DSTRATA_WITH_CUDA=ON \
          '-DCMAKE_CUDA_ARCHITECTURES=$archs' -DSTRATA_BUILD_TESTS=ON -DSTRATA_BUILD_BENCHMARKS=OFF \
          ${py:+'-DSTRATA_PYTHON=$py' '-DCMAKE_PREFIX_PATH=$py_prefix'} &&
    cmake --build '$build' -j '$jobs' --target $targets &&
    { cmake --build '$build' -j '$jobs' --target strata_python strata_python_files ||
      echo 'gpu_check: the Python package did not build (phase 5 will say so)'; }" \
    >"$out/build.log" 2>&1; then
  result[build]="ok"
else
  result[build]="FAILED (rc $?, $out/build.log)"
  summary
  exit 1
fi

# ---- 2. every CUDA and NCCL test: passing, not skipped --------------------------------------------
(cd "$build" && timeout 120 ctest -L gpu --output-on-failure --timeout 110 >"$out/ctest.log" 2>&1)
rc=$?
total=$(sed -n 's/.*tests passed, [0-9]* tests failed out of \([0-9]*\).*/\1/p' "$out/ctest.log" | tail -1)
failed=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of.*/\1/p' "$out/ctest.log" | tail -1)
skipped=$(grep -c '\*\*\*Skipped' "$out/ctest.log" || true)
cases_skipped=$(grep -c '\[  SKIPPED \]' "$out/ctest.log" || true)
total=${total:-0} failed=${failed:-0}
if [ "$total" -eq 0 ]; then
  result[ctest]="FAILED (no gpu test ran, $out/ctest.log)"
elif [ "$skipped" -ge "$total" ]; then
  result[ctest]="FAILED (all $total gpu tests SKIPPED: the GPU was not usable, $out/ctest.log)"
elif [ "$rc" -ne 0 ]; then
  result[ctest]="FAILED ($failed of $total failed, $skipped skipped, $out/ctest.log)"
else
  result[ctest]="ok ($((total - skipped)) of $total passed, $skipped skipped; $cases_skipped skipped cases)"
fi

# ---- 3. strata bench step, Adam on the device -----------------------------------------------------
swap=${STRATA_GPU_SWAP:-$(mktemp -d /tmp/strata-gpu-check-XXXXXX)}
if timeout 30 "$build/strata" bench step "$root/bench/step/step.yaml" --params 16M --rounds 2 --no-scaling --json \
     --set "tiers.nvme.paths=[$swap]" --set optimizer.update=device --set runtime.device=cuda \
     >"$out/bench_step.json" 2>"$out/bench_step.log"; then
  eff=$(grep -oE '"device_efficiency": *[0-9.eE+-]+' "$out/bench_step.json" | head -1 | sed 's/.*: *//')
  on=$(grep -oE '"update_on": *"[^"]*"' "$out/bench_step.json" | head -1 | sed 's/.*: *//')
  result[bench_step]="ok (update on $on, max(t_io, t_update)/t_step = $eff)"
else
  result[bench_step]="FAILED (rc $?, $out/bench_step.log)"
fi

# ---- 4. strata profile --quick ---------------------------------------------------------------------
cat >"$out/profile.yaml" <<EOF
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
if timeout 45 "$build/strata" profile "$out/profile.yaml" --quick --json >"$out/profile.json" 2>"$out/profile.log"; then
  result[profile]="ok ($out/profile.json)"
else
  result[profile]="FAILED (rc $?, $out/profile.log)"
fi

# ---- 5. the Python example on the GPU ---------------------------------------------------------------
if [ -z "$py" ]; then
  result[python]="FAILED (no python3 whose torch sees the GPU; set STRATA_GPU_PYTHON)"
elif ! ls "$build"/python/strata/_strata*.so >/dev/null 2>&1; then
  result[python]="FAILED (the Python package was not built: pybind11/torch missing? $out/build.log)"
elif ! PYTHONPATH="$build/python" "$py" "$root/examples/train_gpt.py" --help 2>/dev/null | grep -q -- '--device'; then
  result[python]="FAILED (examples/train_gpt.py has no --device option: torch GPU models not supported yet)"
elif PYTHONPATH="$build/python" timeout 60 "$py" "$root/examples/train_gpt.py" --device cuda --steps 20 \
       --set "tiers.nvme.paths=[$swap]" --log-json "$out/train_gpt.json" >"$out/train_gpt.log" 2>&1; then
  result[python]="ok (20 steps on cuda, $out/train_gpt.log)"
else
  result[python]="FAILED (rc $?, $out/train_gpt.log)"
fi
[ -z "${STRATA_GPU_SWAP:-}" ] && rm -rf "$swap"

summary
