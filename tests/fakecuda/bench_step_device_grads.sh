#!/usr/bin/env bash
# bench_step_device_grads.sh STRATA SOURCE_DIR: `strata bench step --backward` on a CUDA engine
# (two fake GPUs, LD_PRELOAD set by CTest, LOCAL_RANK=1) hands in device-resident gradients
# (issue 47, point 5): the JSON says gradients "device", every gradient byte once per round, a
# device -> host bandwidth measured on GPU 1 (never a context on GPU 0), the overlapped engine's
# master weights bitwise the serial one's, and the same master weights (CRC32C) as the run on the
# host-emulated device, whose gradients stay in host memory.
set -uo pipefail
strata=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export STRATA_FAKECUDA_REPORT=$tmp/report LOCAL_RANK=1 STRATA_LOG_LEVEL=warn
params=96K    # bf16 gradients: 192000 bytes
tensors=4

# run DEVICE OUT: the overlap bench, one round, its JSON document in OUT.
run() {
  mkdir -p "$tmp/swap-$1"
  "$strata" bench step "$src/bench/step/step.yaml" --params $params --rounds 1 --json \
    --backward 0.01 --tensors $tensors --set "tiers.nvme.paths=[$tmp/swap-$1]" \
    --set tiers.host.buffer_size=1MiB --set tiers.host.buffer_count=3 \
    --set runtime.device="$1" >"$2" 2>"$2.err"
  local rc=$?
  if [ $rc -ne 0 ]; then
    cat "$2" "$2.err"
    echo "FAIL: strata bench step --backward (runtime.device $1) exited $rc"
    exit 1
  fi
}
# field FILE KEY: the value of "KEY" in the JSON document FILE (a scalar on its own line).
field() { sed -n "s/^ *\"$2\": \"\{0,1\}\([^\",]*\)\"\{0,1\},\{0,1\}$/\1/p" "$1" | head -n 1; }
expect() {  # expect FILE KEY VALUE
  local got
  got=$(field "$1" "$2")
  if [ "$got" != "$3" ]; then
    cat "$1"
    echo "FAIL: $2 is '$got' in $1, expected '$3'"
    exit 1
  fi
}

run cuda "$tmp/cuda.json"
expect "$tmp/cuda.json" gradients device
expect "$tmp/cuda.json" hand_in_bytes 192000
expect "$tmp/cuda.json" d2h_copy_bytes 192000
expect "$tmp/cuda.json" overlapped_equals_serial true
d2h=$(field "$tmp/cuda.json" d2h_bytes_per_second)
awk -v r="$d2h" 'BEGIN { exit !(r > 0) }' || { echo "FAIL: d2h_bytes_per_second '$d2h'"; exit 1; }
touch "$tmp/report"
if grep -q '^context 0 ' "$tmp/report"; then
  cat "$tmp/report"
  echo "FAIL: a context was created on GPU 0 although LOCAL_RANK=1"
  exit 1
fi

run host "$tmp/host.json"
expect "$tmp/host.json" gradients host
expect "$tmp/host.json" d2h_copy_bytes 0
expect "$tmp/host.json" overlapped_equals_serial true
crc=$(field "$tmp/host.json" serial_master_crc32c)
[ -n "$crc" ] || { cat "$tmp/host.json"; echo "FAIL: no serial_master_crc32c"; exit 1; }
expect "$tmp/cuda.json" serial_master_crc32c "$crc"
echo "ok: device-resident gradients on GPU 1, $(field "$tmp/cuda.json" hand_in_bytes) bytes" \
  "per round, the same master weights as the host run (CRC32C $crc)"
