#!/usr/bin/env bash
# bench_step_local_rank.sh STRATA SOURCE_DIR: `strata bench step` with runtime.device cuda under
# a launcher's LOCAL_RANK=1 on two fake GPUs (LD_PRELOAD set by CTest): it must run, and must
# never create a context on GPU 0 (F6: the NCCL communicator was put on GPU 0 while the engine's
# buffers were on GPU LOCAL_RANK).
set -uo pipefail
strata=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export STRATA_FAKECUDA_REPORT=$tmp/report LOCAL_RANK=1
"$strata" bench step "$src/bench/step/step.yaml" --params 300K --rounds 1 --no-scaling --json \
  --set "tiers.nvme.paths=[$tmp]" --set tiers.host.buffer_size=1MiB --set tiers.host.buffer_count=3 \
  --set optimizer.update=device --set runtime.device=cuda >"$tmp/out" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  cat "$tmp/out"
  echo "FAIL: strata bench step exited $rc"
  exit 1
fi
grep -q '"update_on"' "$tmp/out" || { cat "$tmp/out"; echo "FAIL: no JSON document"; exit 1; }
touch "$tmp/report"
cat "$tmp/report"
if grep -q '^context 0 ' "$tmp/report"; then
  echo "FAIL: a context was created on GPU 0 although LOCAL_RANK=1"
  exit 1
fi
grep -q '^context 1 ' "$tmp/report" || { echo "FAIL: GPU 1 was never used"; exit 1; }
echo "ok: bench step ran on GPU 1 only"
