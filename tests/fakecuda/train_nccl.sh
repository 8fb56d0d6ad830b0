#!/usr/bin/env bash
# train_nccl.sh STRATA SOURCE_DIR: `strata train` with runtime.communicator nccl, 2 in-process
# ranks on two fake GPUs (LD_PRELOAD set by CTest), for ZeRO stages 0-3: it must run on both GPUs
# and give the losses of the same run on the in-process host communicator, bitwise (a sum of two
# is the same in any order; the CUDA Adam kernel follows CpuAdam's operation order). The runs
# "0a" and "1a" accumulate 2 micro-batches at stages 0-1 with a 100-element bucket: a gradient
# handed in from host memory is added on the device through a staging buffer of 100 elements,
# piece by piece (the MLP's tensors are larger).
set -uo pipefail
strata=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
for run in 0 1 2 3 0a 1a; do
  stage=${run%a}
  bucket=300
  extra=()
  if [ "$run" != "$stage" ]; then
    bucket=100
    extra=(--accumulate 2)
  fi
  args=("$src/configs/default.yaml" --steps 5 --ranks 2 --hidden 16 --json "${extra[@]}"
        --set "zero.stage=$stage" --set zero.reduce_bucket_size=$bucket --set zero.sub_group_size=500
        --set runtime.collective_timeout_s=60 --set runtime.cpu_threads=1
        --set "tiers.nvme.paths=[$tmp]")
  rm -f "$tmp/report"
  if ! STRATA_FAKECUDA_REPORT=$tmp/report "$strata" train "${args[@]}" \
      --set runtime.communicator=nccl >"$tmp/nccl.json" 2>"$tmp/nccl.err"; then
    cat "$tmp/nccl.err"
    echo "FAIL: run $run: strata train on NCCL exited non-zero"
    status=1
    continue
  fi
  env -u LD_PRELOAD "$strata" train "${args[@]}" --set runtime.communicator=inprocess \
    >"$tmp/host.json" 2>"$tmp/host.err" || { cat "$tmp/host.err"; echo "FAIL: host run"; exit 1; }
  grep -q '"communicator": "nccl"' "$tmp/nccl.json" || {
    cat "$tmp/nccl.json"; echo "FAIL: run $run: the communicator is not nccl"; status=1; }
  for gpu in 0 1; do
    grep -q "^context $gpu " "$tmp/report" || { echo "FAIL: run $run: GPU $gpu unused"; status=1; }
  done
  grep '"loss":' "$tmp/nccl.json" >"$tmp/nccl.loss"
  grep '"loss":' "$tmp/host.json" >"$tmp/host.loss"
  if [ "$(wc -l <"$tmp/nccl.loss")" -ne 5 ] || ! cmp -s "$tmp/nccl.loss" "$tmp/host.loss"; then
    echo "FAIL: run $run: the losses on NCCL differ from the host run's:"
    paste "$tmp/nccl.loss" "$tmp/host.loss"
    status=1
  else
    echo "ok: run $run: 5 losses on NCCL (GPUs 0 and 1) = the host run's"
  fi
done
exit $status
