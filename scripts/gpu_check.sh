#!/usr/bin/env bash
# GPU acceptance check (issue 12, point 7). On a machine with an NVIDIA GPU (H100/H200 class):
#   1. builds strata with CUDA for the local GPU (CMAKE_CUDA_ARCHITECTURES=native) into build-gpu/;
#   2. runs every CUDA and NCCL test (CTest label `gpu`): the CUDA device (memory, streams, events,
#      host registration), the CUDA Adam kernel against CpuAdam, the NCCL communicator, and the
#      engine's placement matrix on runtime.device cuda with NCCL (1 rank, and across the GPUs
#      when there are several: 2 and up to 4 ranks, one per GPU);
#   3. `strata bench step` with Adam on the device (optimizer.update device, runtime.device cuda:
#      the state streamed from NVMe, copied to the GPU, updated by the CUDA kernel);
#   4. `strata profile --quick` (host<->device copies, GPU Adam, the sample step);
# and prints ONE summary line (also written to $OUT/summary.txt). Bounded: each phase has its own
# timeout (build 240 s, tests 100 s, bench 50 s, profile 80 s: 7 min 50 s at worst), so one call
# stays under 8 minutes; set STRATA_GPU_BUILD to reuse a build directory.
#
# Usage: scripts/gpu_check.sh [OUT_DIR]     (default: ./gpu-check-out)
# Environment: STRATA_GPU_BUILD (build dir, default build-gpu), STRATA_JOBS (default nproc),
#              STRATA_GPU_SWAP (a directory for the swap files, default a fresh one under /tmp).
# Exit code: 0 when every phase passed, 1 otherwise, 2 when there is no GPU (nothing ran).
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$PWD/gpu-check-out}
build=${STRATA_GPU_BUILD:-$root/build-gpu}
jobs=${STRATA_JOBS:-$(nproc)}
mkdir -p "$out"
t0=$(date +%s)
declare -A result
summary() {
  local status=PASS
  for k in build ctest bench_step profile; do
    case "${result[$k]:-not-run}" in ok*) ;; *) status=FAIL ;; esac
  done
  local line="gpu_check: $status in $(( $(date +%s) - t0 )) s — gpu: ${gpu_name:-none}; build: ${result[build]:-not-run}; ctest (label gpu): ${result[ctest]:-not-run}; bench step (Adam on the device): ${result[bench_step]:-not-run}; profile --quick: ${result[profile]:-not-run}; logs in $out"
  echo "$line" | tee "$out/summary.txt"
  [ "$status" = PASS ]
}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >"$out/gpus.txt" 2>&1; then
  echo "gpu_check: NO GPU — nothing ran (nvidia-smi -L failed; see $out/gpus.txt)" | tee "$out/summary.txt"
  exit 2
fi
gpu_name=$(head -1 "$out/gpus.txt" | sed 's/ (UUID.*//')
ngpu=$(grep -c '^GPU ' "$out/gpus.txt")
gpu_name="$gpu_name (x$ngpu)"

# ---- 1. build (CUDA for this GPU; tests; the CLI) ------------------------------------------------
# Every test labelled gpu, and the CLI.
targets="strata_cli test_device_cuda test_optim_cuda test_comm_nccl test_zero_placements_cuda"
gen=""
command -v ninja >/dev/null && gen="-G Ninja"
if timeout 240 bash -c "
    cmake -S '$root' -B '$build' $gen -DCMAKE_BUILD_TYPE=Release -DSTRATA_WITH_CUDA=ON \
          -DCMAKE_CUDA_ARCHITECTURES=native -DSTRATA_BUILD_TESTS=ON -DSTRATA_BUILD_BENCHMARKS=OFF &&
    cmake --build '$build' -j '$jobs' --target $targets" >"$out/build.log" 2>&1; then
  result[build]="ok"
else
  result[build]="FAILED (rc $?, $out/build.log)"
  summary
  exit 1
fi

# ---- 2. every CUDA and NCCL test -------------------------------------------------------------------
# (A gpu-labelled test whose target is not in $targets shows as "Not Run": add it there.)
if (cd "$build" && timeout 100 ctest -L gpu --output-on-failure --timeout 95 >"$out/ctest.log" 2>&1); then
  passed=$(grep -oE '[0-9]+ tests passed' "$out/ctest.log" | head -1)
  skipped=$(grep -cE '\(Skipped\)|\[  SKIPPED \]' "$out/ctest.log")
  result[ctest]="ok (${passed:-?}; skipped lines: $skipped)"
  if grep -q "SKIPPED" "$out/ctest.log"; then result[ctest]="${result[ctest]} — some cases SKIPPED, see ctest.log"; fi
else
  result[ctest]="FAILED (rc $?, $out/ctest.log)"
fi

# ---- 3. strata bench step, Adam on the device -----------------------------------------------------
swap=${STRATA_GPU_SWAP:-$(mktemp -d /tmp/strata-gpu-check-XXXXXX)}
if timeout 50 "$build/strata" bench step "$root/bench/step/step.yaml" --params 16M --rounds 2 --no-scaling --json \
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
if timeout 80 "$build/strata" profile "$out/profile.yaml" --quick --json >"$out/profile.json" 2>"$out/profile.log"; then
  result[profile]="ok ($out/profile.json)"
else
  result[profile]="FAILED (rc $?, $out/profile.log)"
fi
[ -z "${STRATA_GPU_SWAP:-}" ] && rm -rf "$swap"

summary
