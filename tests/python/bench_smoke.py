#!/usr/bin/python3
"""bench/python/bench_optimizer_step.py and bench/python/bench_torch_loop.py on tiny models, one
round: each benchmark runs and prints its parts' JSON with every figure present (a smoke test: no speed is asserted here; the speed
figures are taken by running the benchmark on a quiet machine, docs/performance.md).

Usage: bench_smoke.py SOURCE_DIR BUILD_DIR"""
import json
import math
import os
import subprocess
import sys
import tempfile

src, build = sys.argv[1], sys.argv[2]
with tempfile.TemporaryDirectory(prefix="strata-bench-smoke-") as tmp:
    out = subprocess.run(
        ["/usr/bin/python3", os.path.join(src, "bench", "python", "bench_optimizer_step.py"),
         "--d-model", "64", "--layers", "2", "--vocab", "500", "--threads", "1", "--rounds", "2",
         "--buffers", "2", "--buffer-size", "1MiB", "--sub-group", "40000",
         "--nvme", os.path.join(tmp, "nvme"), "--strata", os.path.join(build, "strata"),
         "--it-d-model", "32", "--it-layers", "1", "--it-heads", "2", "--it-seq", "16", "--it-rows", "2",
         "--it-rounds", "2", "--json"],
        check=True, capture_output=True, text=True).stdout
lines = [json.loads(l) for l in out.splitlines() if l.strip()]
parts = {l["part"]: l for l in lines}
assert set(parts) == {"host", "nvme", "iteration"}, out
host, nvme, it = parts["host"], parts["nvme"], parts["iteration"]
for k in ("strata_iteration_s", "torch_adamw_iteration_s", "strata_over_torch", "strata_exposed_step_s",
          "strata_handin_s_per_iteration"):
    assert it[k] > 0 and math.isfinite(it[k]), (k, it)
assert len(it["strata_iteration_s_rounds"]) == 2 and it["params"] > 0, it
n = 500 * 64 + 2 * (2 * 64 + 3 * 64 * 64 + 3 * 64 + 64 * 64 + 64 + 2 * 64 + 4 * 64 * 64 + 4 * 64 + 64 * 4 * 64 + 64)
assert host["params"] == n and nvme["params"] == n, (host["params"], n)
for k in ("strata_step_s", "torch_adamw_foreach_step_s", "speedup"):
    assert host[k] > 0 and math.isfinite(host[k]), (k, host)
assert host["torch_step_minor_faults"] >= 0 and host["malloc"] == "glibc default", host
assert len(host["torch_step_s_rounds"]) == 2, host
for k in ("strata_step_s", "device_bound_s", "step_over_bound", "in_process_bound_s",
          "step_over_in_process_bound", "bench_step_t_engine_step_s", "step_loop_s",
          "step_loop_compute_s"):
    assert nvme[k] > 0 and math.isfinite(nvme[k]), (k, nvme)
# (> 0 on the host-emulated device, where the statistics pass needs no slot; 0 on CUDA.)
assert nvme["step_loop_gate_s"] >= 0, nvme
assert len(nvme["step_over_bound_rounds"]) == 2
assert nvme["io_engine"] in ("io_uring", "threads"), nvme

# bench_torch_loop.py: each variant's memory in its own process (strata plan beside it), then the
# iteration alternating.
with tempfile.TemporaryDirectory(prefix="strata-bench-smoke-") as tmp:
    out = subprocess.run(
        ["/usr/bin/python3", os.path.join(src, "bench", "python", "bench_torch_loop.py"),
         "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "16", "--rows", "2",
         "--threads", "1", "--iters", "1", "--rounds", "1", "--nvme", tmp,
         "--strata", os.path.join(build, "strata"), "--json"],
        check=True, capture_output=True, text=True).stdout
loop = {l["part"]: l for l in (json.loads(x) for x in out.splitlines() if x.strip())}
assert set(loop) == {"memory", "iteration"}, out
mem, its = loop["memory"], loop["iteration"]
variants = {"adamw_for_loop", "adamw_foreach", "strata_host_stage1", "strata_host_stage2",
            "strata_nvme_stage2"}
assert set(mem["peak_bytes"]) == variants, mem
for name in variants:
    assert mem["peak_bytes"][name]["peak"] > 0 and name in mem["held_bytes"], (name, mem)
    if name.startswith("strata"):
        assert math.isfinite(mem["corrected_over_planned"][name]), (name, mem)
for k in ("handin_cost", "speedup_vs_for_loop", "speedup_vs_foreach", "overlap_speedup_vs_for_loop"):
    assert its[k] > 0 and math.isfinite(its[k]), (k, its)
print("bench smoke: ok (%d parameters; host speedup %.2f, nvme step / bound %.2f; torch loop "
      "hand-in %.2f: not results)" % (n, host["speedup"], nvme["step_over_bound"],
                                      its["handin_cost"]))
