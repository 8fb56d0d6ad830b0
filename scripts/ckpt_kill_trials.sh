#!/usr/bin/env bash
# Crash safety of checkpoints with a background writer in flight (issue 23, point 3).
#
# Runs `strata train` with asynchronous saves (--save-every 3, the default mode) and stops it with
# a signal at a random point, TRIALS times; after each stop:
#   - SIGKILL: whatever manifest.json names passes `strata checkpoint verify`;
#   - SIGTERM: the process ended by the signal (exit 143) or finished, and the swap files and any
#     partial shard (a shard of a serial above the committed manifest's) are gone;
#   - `strata train --resume` continues from the last committed checkpoint and gives, step for
#     step, bitwise the losses, gradient norms, loss scales and skip decisions of a run that never
#     stopped (compared as the JSON numbers strata prints: shortest round-trip doubles);
#   - the final checkpoint passes `strata checkpoint verify`.
# Kill points: a step K (2..STEPS-2) whose line was printed, then a random delay of 0..D ms, from a
# seeded generator; every trial is recorded in OUT/trials.tsv (seed, trial, K, delay, the step
# the resume started from, the result), and the run prints the command that repeats it.
#
# Usage: scripts/ckpt_kill_trials.sh --strata BIN [--trials N] [--seed S] [--signal KILL|TERM]
#                                    [--out DIR] [--steps N] [--ranks N] [--stage N]
#                                    [--delay-ms D] [--nvme]
#   BIN: a strata executable; the test-only build tests/checkpoint's strata_slow_saves (every
#   checkpoint write takes >= 4 ms more) makes most kills land while a writer is at work.
#   --nvme: optimizer state on NVMe (a swap directory under OUT), the path that copy-on-write
#   and snapshot slots take (tiers.nvme.snapshot_room 0.5).
# The >= 50-trial run (the lead's; minutes):
#   scripts/ckpt_kill_trials.sh --strata build/tests/checkpoint/strata_slow_saves --trials 60 \
#     --seed 23 --nvme --out /tmp/strata-kill-trials
# CTest runs 5 trials of each signal (tests/checkpoint/CMakeLists.txt: ckpt_kill_trials_*).
# Exit: 0 all trials passed, 1 a trial failed (the first failure's files are kept in OUT), 2 usage.
set -uo pipefail

bin="" trials=5 seed=1 sig=KILL out="" steps=24 ranks=2 stage=2 delay_ms=60 nvme=0
while [ $# -gt 0 ]; do
  case "$1" in
    --strata) bin=$2; shift 2 ;;
    --trials) trials=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --signal) sig=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --stage) stage=$2; shift 2 ;;
    --delay-ms) delay_ms=$2; shift 2 ;;
    --nvme) nvme=1; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "ckpt_kill_trials: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
  echo "ckpt_kill_trials: --strata BIN (an executable strata) is required" >&2; exit 2
fi
case "$sig" in KILL|TERM) ;; *) echo "ckpt_kill_trials: --signal KILL or TERM" >&2; exit 2 ;; esac
for v in "$trials" "$seed" "$steps" "$ranks" "$stage" "$delay_ms"; do
  case "$v" in ''|*[!0-9]*) echo "ckpt_kill_trials: '$v' is not a number" >&2; exit 2 ;; esac
done
if [ "$steps" -lt 6 ]; then echo "ckpt_kill_trials: --steps must be >= 6" >&2; exit 2; fi
py=/usr/bin/python3
[ -x "$py" ] || py=python3
root=$(cd "$(dirname "$0")/.." && pwd)
[ -n "$out" ] || out=$(mktemp -d "${TMPDIR:-/tmp}/strata-kill-trials.XXXXXX")
mkdir -p "$out"
out=$(cd "$out" && pwd)
swap="$out/swap"

args=(train "$root/configs/default.yaml"
  --set precision.params=bf16 --set precision.grads=fp16
  --set precision.loss_scale.initial=4e6 --set precision.loss_scale.growth_interval=3
  --set zero.stage="$stage" --set zero.reduce_bucket_size=300 --set zero.sub_group_size=500
  --set optimizer.lr=0.01 --set runtime.cpu_threads=1 --set runtime.collective_timeout_s=60
  --steps "$steps" --hidden 24 --batch 16 --ranks "$ranks")
if [ "$nvme" = 1 ]; then
  args+=(--set offload.optimizer.tier=nvme --set "tiers.nvme.paths=[$swap]"
    --set tiers.nvme.snapshot_room=0.5 --set tiers.host.buffer_size=16KiB)
fi

# The per-step records of two --json reports agree bitwise from step FIRST+1 on.
compare() {  # compare WANT.json GOT.json FIRST -> prints a reason and fails, or nothing
  "$py" - "$1" "$2" "$3" <<'EOF'
import json, sys
want, got, first = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), int(sys.argv[3])
w = want["steps"][first:]
g = got["steps"]
if len(g) != len(w):
    sys.exit("%d steps after the resume, want %d" % (len(g), len(w)))
for a, b in zip(g, w):
    for k in ("step", "loss", "grad_norm", "loss_scale", "applied"):
        if a[k] != b[k]:
            sys.exit("step %s: %s %r, the uninterrupted run %r" % (a["step"], k, a[k], b[k]))
if got["skipped_steps"] != want["skipped_steps"]:
    sys.exit("skipped_steps %r, want %r" % (got["skipped_steps"], want["skipped_steps"]))
EOF
}

verify() {  # verify DIR WHAT: strata checkpoint verify on the committed checkpoint, if any
  [ -f "$1/manifest.json" ] || return 0
  if ! "$bin" checkpoint verify "$1" >"$out/verify.log" 2>&1; then
    echo "checkpoint verify failed $2:"; cat "$out/verify.log"; return 1
  fi
}

# No swap files left; no partial shard: a shard of a serial above the committed one may stay only
# whole (its writer had finished and fdatasynced it — the save was abandoned before its commit;
# the next save removes it), i.e. of the size of the reference run's shards (the same layout).
clean_after_term() {  # clean_after_term DIR
  if [ "$nvme" = 1 ] && [ -n "$(find "$swap" -mindepth 1 2>/dev/null | head -1)" ]; then
    echo "swap left behind:"; find "$swap" -mindepth 1; return 1
  fi
  "$py" - "$1" "$out/ref" 2>&1 <<'EOF'
import json, os, re, sys
d, ref = sys.argv[1], sys.argv[2]
def manifest(d):
    p = os.path.join(d, "manifest.json")
    return json.load(open(p)) if os.path.exists(p) else None
m = manifest(d)
serial = m["serial"] if m else 0
whole = {s["bytes"] for s in manifest(ref)["shards"]}
for n in os.listdir(d):
    g = re.match(r"shard-(\d+)-", n)
    size = os.path.getsize(os.path.join(d, n))
    if g and int(g.group(1)) > serial and size not in whole:
        sys.exit("partial %s (%d bytes) left after SIGTERM (committed serial %d)" %
                 (n, size, serial))
EOF
}

echo "ckpt_kill_trials: $trials trials, SIG$sig, seed $seed, $ranks ranks, stage $stage," \
  "nvme $nvme; files in $out"
rm -rf "$swap"; mkdir -p "$swap"
rm -rf "$out/ref"
if ! "$bin" "${args[@]}" --checkpoint-dir "$out/ref" --save-every 3 --json >"$out/want.json" \
  2>"$out/want.err"; then
  echo "the uninterrupted run failed:"; cat "$out/want.err"; exit 1
fi
printf 'seed\ttrial\tsignal\tstep\tdelay_ms\tresumed_from\tresult\n' >"$out/trials.tsv"
RANDOM=$seed
failed=0
for ((t = 0; t < trials; t++)); do
  k=$((2 + RANDOM % (steps - 3)))
  d=$((RANDOM % (delay_ms + 1)))
  dir="$out/ckpt-$t"
  rm -rf "$dir" "$swap"; mkdir -p "$swap"
  log="$out/run-$t.log"
  "$bin" "${args[@]}" --checkpoint-dir "$dir" --save-every 3 >"$log" 2>&1 &
  pid=$!
  # Until step K is printed (or the run ends), then D ms more.
  while kill -0 "$pid" 2>/dev/null && ! grep -q "^step $k " "$log" 2>/dev/null; do
    sleep 0.005
  done
  sleep "$(awk -v d="$d" 'BEGIN { printf "%.3f", d / 1000 }')"
  kill -s "$sig" "$pid" 2>/dev/null
  { wait "$pid"; } 2>/dev/null
  rc=$?
  why=""
  if [ "$sig" = TERM ]; then
    [ "$rc" = 143 ] || [ "$rc" = 0 ] || why="exit $rc after SIGTERM (want 143, or 0: finished)"
    [ -n "$why" ] || why=$(clean_after_term "$dir" 2>&1) || true
  fi
  [ -n "$why" ] || why=$(verify "$dir" "after the SIG$sig" 2>&1) || true
  from=-
  if [ -z "$why" ]; then
    rm -rf "$swap"; mkdir -p "$swap"
    if "$bin" "${args[@]}" --checkpoint-dir "$dir" --save-every 3 --resume --json \
      >"$out/got-$t.json" 2>"$out/got-$t.err"; then
      from=$("$py" -c 'import json,sys; r=json.load(open(sys.argv[1]))["checkpoint"]
print(r["resumed_from_step"] or 0)' "$out/got-$t.json")
      why=$(compare "$out/want.json" "$out/got-$t.json" "$from" 2>&1) || true
      [ -n "$why" ] || why=$(verify "$dir" "after the resumed run") || true
    else
      why="the resumed run failed: $(tail -3 "$out/got-$t.err")"
    fi
  fi
  result=${why:-ok}
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$seed" "$t" "$sig" "$k" "$d" "$from" \
    "$(echo "$result" | tr '\t\n' '  ')" >>"$out/trials.tsv"
  echo "trial $t: SIG$sig after step $k + ${d} ms, resumed after step $from: $result"
  if [ -n "$why" ]; then
    failed=$((failed + 1))
  else
    rm -rf "$dir" "$log" "$out/got-$t.json" "$out/got-$t.err"
  fi
done
rm -rf "$swap"
echo "ckpt_kill_trials: $((trials - failed)) of $trials trials passed (record: $out/trials.tsv;" \
  "repeat: $0 --strata $bin --trials $trials --seed $seed --signal $sig --ranks $ranks" \
  "--stage $stage --steps $steps --delay-ms $delay_ms$([ "$nvme" = 1 ] && echo ' --nvme'))"
[ "$failed" = 0 ]
