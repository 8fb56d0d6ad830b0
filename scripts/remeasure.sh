#!/usr/bin/env bash
# Re-measures every ratio in docs/performance.md, each against the reference it is quoted
# against, alternating strata and the reference within the run (every tool below does that
# itself), and prints one table: figure, the value docs/performance.md quotes, the value now, and
# the command. Run it on an otherwise idle machine (load average < 1): figures taken while other
# work runs are not results. About 10-15 minutes on the 2-vCPU development machine.
#
# Usage: scripts/remeasure.sh [BUILD_DIR] [OUT_DIR]     (root: bench_fio.sh reserves huge pages)
# Environment: STRATA_REMEASURE_SKIP="fio torch ..." skips parts (plan tier adam torch fio step
#   profile); NVME_DIR (default /var/tmp/strata-remeasure) for the disk benchmarks.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
out=${2:-$root/results/remeasure-$(date -u +%Y%m%dT%H%M%SZ)}
nvme=${NVME_DIR:-/var/tmp/strata-remeasure}
py=/usr/bin/python3
skip=" ${STRATA_REMEASURE_SKIP:-} "
want() { [[ "$skip" != *" $1 "* ]]; }

"$root/scripts/deps.sh"
"$root/scripts/build.sh" "$build" -DSTRATA_BUILD_BENCHMARKS=ON >/dev/null
mkdir -p "$out" "$nvme"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
echo "remeasure: load average before: $load_before (want < 1); results in $out" >&2
if $py -c "import sys; sys.exit(0 if float('${load_before%% *}') < 1.0 else 1)"; then quiet=yes; else
  quiet=no
  echo "remeasure: WARNING: the machine is not quiet; these figures are not results" >&2
fi

if want plan; then
  echo "== bench_plan (config load and plan vs reading the file; interleaved repetitions)" >&2
  "$build/bench/bench_plan" --benchmark_min_time=0.2 --benchmark_repetitions=5 \
    --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/plan.json" --benchmark_out_format=json >/dev/null
fi
if want tier; then
  echo "== bench_tier (TierStore round trip vs the raw IoEngine, alternating per iteration)" >&2
  "$build/bench/bench_tier" --benchmark_filter='RoundTrip/GiB:(2|4)/' \
    --benchmark_out="$out/tier.json" --benchmark_out_format=json >/dev/null
fi
if want adam; then
  echo "== strata bench adam (Adam vs the same-pattern stream kernel, ABBA)" >&2
  "$build/strata" bench adam --params 50M --threads 2 --rounds 11 --json >"$out/adam_fp32.json"
  "$build/strata" bench adam --params 50M --threads 2 --rounds 11 --grads bf16 --json >"$out/adam_bf16.json"
fi
if want torch; then
  echo "== scripts/bench_adam_torch.sh (strata vs torch AdamW foreach, alternating processes)" >&2
  "$root/scripts/bench_adam_torch.sh" "$build/strata" 50M 2 5 | tee "$out/adam_torch.txt" >&2 || true
fi
if want fio; then
  echo "== scripts/bench_fio.sh (strata bench io vs fio with huge pages, alternating)" >&2
  JSON_OUT="$out/fio.json" ROUNDS=5 "$root/scripts/bench_fio.sh" "$nvme/fio" "$build" | tee "$out/fio.txt" >&2 || true
fi
if want step; then
  echo "== strata bench step (overlap of the offloaded step)" >&2
  mkdir -p /tmp/strata-nvme
  "$build/strata" bench step "$root/bench/step/step.yaml" --json >"$out/step.json" || true
fi
if want profile; then
  echo "== scripts/run.sh (the main job: profile predictions against measured steps)" >&2
  STRATA_RUN_OUT="$out/run" "$root/scripts/run.sh" >"$out/run.txt" || true
fi
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

$py - "$out" "$quiet" "$load_before" "$load_after" <<'PY'
import json, os, re, statistics, sys
out, quiet, lb, la = sys.argv[1:5]

def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

rows = []  # (figure, docs value, now, command)
def row(fig, doc, now, cmd):
    rows.append((fig, doc, "-" if now is None else now, cmd))

plan = load("plan.json")
if plan:
    cpu = {}
    for b in plan["benchmarks"]:
        if b.get("aggregate_name") == "median":
            cpu[b["run_name"]] = b["cpu_time"]
    ref = cpu.get("BM_ReadFile")
    for name, doc in (("BM_LoadConfig", "19"), ("BM_MakePlan", "0.7"), ("BM_LoadAndPlan", "19"),
                      ("BM_ToYamlRoundTrip", "33")):
        now = f"{cpu[name] / ref:.3g}" if ref and name in cpu else None
        row(f"{name} / BM_ReadFile (CPU time)", doc, now, "bench/bench_plan")
tier = load("tier.json")
if tier:
    for b in tier["benchmarks"]:
        if "store_vs_raw" in b:
            row(f"TierStore / raw IoEngine, {b['name']}", "0.87-1.034 (quiet)", f"{b['store_vs_raw']:.3f}",
                "bench/bench_tier --benchmark_filter='RoundTrip/GiB:(2|4)/'")
for dt, doc in (("fp32", "1.025 (quiet)"), ("bf16", "1.034 (quiet)")):
    a = load(f"adam_{dt}.json")
    row(f"CPU Adam / same-pattern stream bound, {dt} grads", doc,
        f"{a['fraction_of_bound']:.3f}" if a else None,
        f"strata bench adam --params 50M --threads 2 --rounds 11{' --grads bf16' if dt == 'bf16' else ''}")
try:
    txt = open(os.path.join(out, "adam_torch.txt")).read()
    m = re.search(r"ratio strata/torch = ([0-9.]+)", txt)
    row("CPU Adam / torch AdamW(foreach), 50M params, 2 threads", "8-12 (issue 16)",
        m.group(1) if m else None, "scripts/bench_adam_torch.sh build/strata 50M 2 5")
except OSError:
    pass
fio = load("fio.json")
if fio:
    for case in fio:
        m = case["bytes_per_second"]
        if "strata_io_uring" in m and "fio_hugepages" in m:
            row(f"io_uring / fio-huge, {case['rw']} {case['block_size']} qd {case['queue_depth']}",
                "1.02-1.34 (final run)", f"{m['strata_io_uring'] / m['fio_hugepages']:.3f}",
                "ROUNDS=5 scripts/bench_fio.sh DIR build")
step = load("step.json")
if step and "step" in step:
    s = step["step"]
    t = s.get("t_step_s") or 0
    legs = max(s.get("t_read_s", 0), s.get("t_update_s", 0), s.get("t_write_s", 0))
    row("offloaded step: max(legs) / pipelined step", "0.50-0.53 (quiet)", f"{legs / t:.3f}" if t else None,
        "strata bench step bench/step/step.yaml")
    if "t_io_s" in s and t:
        row("offloaded step: max(t_io, t_update) / pipelined step", "0.95-1.06 (quiet)",
            f"{max(s['t_io_s'], s.get('t_update_s', 0)) / t:.3f}", "strata bench step bench/step/step.yaml")
    if "serial_over_pipelined" in step:
        row("offloaded step: unpipelined / pipelined", "1.29-1.60 (quiet)", f"{step['serial_over_pipelined']:.3f}",
            "strata bench step bench/step/step.yaml")
prof = load("run/profile.json")
if prof:
    s = prof["sample_step"]
    for name, r in (("profile loop serial", s["serial"]), ("profile loop pipelined", s["pipelined"])):
        row(f"profile prediction error, {name}", "within +-15% (quiet)", f"{r['error'] * 100:+.1f}%", "scripts/run.sh")
    e = s.get("engine_step", {})
    if e.get("ran"):
        for name in ("serial", "pipelined"):
            row(f"profile prediction error, zero step {name}", "-27.5% / -8.9% (quiet)",
                f"{e[name]['error'] * 100:+.1f}%", "scripts/run.sh")
    c = prof.get("engine_check", {})
    if c.get("ran"):
        row(f"profile prediction error, {c['ranks']}-rank engine check", "within +-15%",
            f"{c['error'] * 100:+.1f}%", "scripts/run.sh (mpirun -np 2)")

print(f"remeasure: load average {lb} before, {la} after; quiet: {quiet}"
      + ("" if quiet == "yes" else "  -- NOT RESULTS: rerun on an idle machine"))
hdr = ("figure", "docs/performance.md", "now", "command")
w = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(4)]
print("  ".join(h.ljust(w[i]) for i, h in enumerate(hdr)))
for r in rows:
    print("  ".join(str(x).ljust(w[i]) for i, x in enumerate(r)))
PY
