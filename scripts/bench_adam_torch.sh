#!/usr/bin/env bash
# strata's CPU AdamW beside torch 1.13's AdamW(foreach=True) on the same machine: 50M FP32
# parameters, FP32 grads, 2 threads (both sides), alternating strata and torch runs so that
# bandwidth drift on a shared machine hits both. Prints each run and the ratio of medians.
# Usage: scripts/bench_adam_torch.sh [STRATA_BINARY] [PARAMS] [THREADS] [RUNS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
strata=${1:-$root/build/strata}
params=${2:-50M}
threads=${3:-2}
runs=${4:-3}
py=/usr/bin/python3
if ! $py -c 'import torch' 2>/dev/null; then
  echo "bench_adam_torch: $py cannot import torch (apt install python3-torch)" >&2
  exit 2
fi
n=$($py -c "import sys; s=sys.argv[1]; m={'K':1e3,'M':1e6,'B':1e9,'G':1e9}; print(int(float(s[:-1])*m[s[-1]]) if s[-1] in m else int(s))" "$params")
echo "load before: $(uptime)"
ours=()
theirs=()
for ((r = 0; r < runs; r++)); do
  s=$("$strata" bench adam --params "$params" --threads "$threads" --grads fp32 --rounds 5 --json |
      $py -c 'import json,sys; j=json.load(sys.stdin); print(j["adam"]["params_per_second"], j["fraction_of_bound"])')
  t=$(OMP_NUM_THREADS=$threads $py "$root/scripts/adam_torch_ref.py" bench "$n" "$threads" 5 |
      sed -n 's/.*params_per_second=\([^ ]*\).*/\1/p')
  echo "run $r: strata $(echo "$s" | cut -d' ' -f1) params/s (fraction of bound $(echo "$s" | cut -d' ' -f2)), torch AdamW foreach $t params/s"
  ours+=("$(echo "$s" | cut -d' ' -f1)")
  theirs+=("$t")
done
echo "load after: $(uptime)"
$py - "${ours[*]}" "${theirs[*]}" <<'PY'
import statistics, sys
a = [float(x) for x in sys.argv[1].split()]
b = [float(x) for x in sys.argv[2].split()]
ma, mb = statistics.median(a), statistics.median(b)
print("median: strata %.4g params/s, torch %.4g params/s, ratio strata/torch = %.2f" % (ma, mb, ma / mb))
PY
