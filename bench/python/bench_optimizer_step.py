#!/usr/bin/python3
"""The optimizer step of strata.torch.ZeroOptimizer against torch.optim.AdamW (issue 13, point 6).

A transformer-shaped parameter set (embedding + LAYERS blocks of d_model: QKV, projection, MLP,
two LayerNorms; 133M parameters by default), FP32, one process. Only step() is timed; the
gradients (fixed random values) are handed in before each timed step, outside the timing.

1. Host: ZeroOptimizer with the optimizer state in pinned host memory (offload.optimizer
   {tier: cpu, pin_memory: true}) and CPU Adam, against torch.optim.AdamW(foreach=True) on a copy
   of the same parameters, with the same number of threads (torch.set_num_threads(T),
   runtime.cpu_threads T), alternating strata / torch each round after a warm-up round. Prints
   both medians and speedup = torch / strata (target >= 5), and torch's minor page faults per
   step: with glibc's default malloc, torch's foreach temporaries (up to ~1 GiB per step here)
   are returned to the OS and faulted in again each step, which makes torch's step 1.3-2x slower
   and its time vary 0.45-2.0 s from round to round. --malloc keep runs the benchmark with glibc
   keeping freed memory (torch's best case on this machine: no faults); report both.
2. With --nvme DIR: ZeroOptimizer with the state on NVMe (swap in DIR), alternating each round
   one timed step with the device bound max(t_io, t_update) (t_io: read || write of every chunk,
   no update) measured twice: on the same engine in this process right after the step (the
   benchmark-only binding Engine._measure_bound, what `strata bench step` runs), and by one round
   of `strata bench step` on the same config and element count. Prints the medians and
   step / bound for both (target <= 1.1).

3. Iteration (issue 26, point 5): a whole training iteration (zero_grad, forward, backward, step)
   of the example GPT (examples/gpt_model.py, 4.2M parameters by default), ZeroOptimizer with
   the default config (state in host memory) against torch.optim.AdamW, alternating each round.
   Prints both medians, strata / torch (target <= 1.05), and strata's exposed optimizer time (its
   step() after the backward) and gradient hand-in time per iteration. --iteration-only runs only
   this part.

Run it on a quiet machine (speed figures taken while other jobs run are not results):
  PYTHONPATH=build/python /usr/bin/python3 bench/python/bench_optimizer_step.py \\
      --threads 8 --nvme /mnt/nvme/strata-bench --strata build/strata
Prints one JSON line per part (--json: only those lines).
"""
import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn

import strata

# --malloc keep: glibc malloc without mmap for big blocks and without trimming (set before the
# process starts: the benchmark runs itself again with them), so that torch's temporaries are
# reused instead of page-faulted in anew each step.
_KEEP_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 46)}
MALLOC_MODE = "keep" if all(os.environ.get(k) == v for k, v in _KEEP_ENV.items()) else "glibc default"


class Shapes(nn.Module):
    """Parameters shaped like a GPT of d_model, LAYERS blocks, VOCAB tokens (no forward needed)."""

    def __init__(self, d, layers, vocab):
        super().__init__()
        self.wte = nn.Parameter(torch.randn(vocab, d) * 0.02)
        for i in range(layers):
            for name, shape in (("ln1_w", (d,)), ("ln1_b", (d,)), ("qkv_w", (3 * d, d)), ("qkv_b", (3 * d,)),
                                ("proj_w", (d, d)), ("proj_b", (d,)), ("ln2_w", (d,)), ("ln2_b", (d,)),
                                ("fc_w", (4 * d, d)), ("fc_b", (4 * d,)), ("out_w", (d, 4 * d)), ("out_b", (d,))):
                self.register_parameter("b%d_%s" % (i, name), nn.Parameter(torch.randn(shape) * 0.02))


def time_strata(opt, params, grads):
    # What a backward does: autograd accumulates each gradient; the optimizer's hooks take it.
    torch.autograd.backward(params, grad_tensors=grads)
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_torch(opt, params, grads, faults=None):
    for p, g in zip(params, grads):
        p.grad = g
    f0 = minor_faults()
    t0 = time.perf_counter()
    opt.step()
    t = time.perf_counter() - t0
    if faults is not None:
        faults.append(minor_faults() - f0)
    return t


def part_host(a, model_a, model_b, grads):
    cfg = {"zero": {"stage": 1}, "runtime": {"cpu_threads": a.threads},
           "optimizer": {"lr": 1e-4, "weight_decay": 0.01},
           "offload": {"optimizer": {"tier": "cpu", "pin_memory": True}},
           "tiers": {"host": {"pinned_budget": "64GiB"}}}
    zopt = strata.torch.ZeroOptimizer(model_a, cfg, param_groups=[{"params": list(model_a.parameters())}])
    topt = torch.optim.AdamW(model_b.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    pa, pb = list(model_a.parameters()), list(model_b.parameters())
    ts, tt, tf, sf = [], [], [], []
    time_strata(zopt, pa, grads)  # warm-up (first touch of the state)
    time_torch(topt, pb, grads)
    for _ in range(a.rounds):
        f0 = minor_faults()
        ts.append(time_strata(zopt, pa, grads))
        sf.append(minor_faults() - f0)  # the backward's hand-in included
        tt.append(time_torch(topt, pb, grads, tf))
    ms, mt = statistics.median(ts), statistics.median(tt)
    zopt.close()
    del topt
    return {"part": "host", "params": a.n, "threads": a.threads, "rounds": a.rounds,
            "strata_step_s": ms, "torch_adamw_foreach_step_s": mt, "speedup": mt / ms,
            "strata_params_per_second": a.n / ms, "torch_params_per_second": a.n / mt,
            # Minor page faults per step (median): torch's foreach temporaries are freed to the OS
            # and faulted in again (glibc malloc returns big blocks) unless --malloc keep.
            "torch_step_minor_faults": statistics.median(tf),
            "strata_round_minor_faults": statistics.median(sf),
            "torch_step_s_rounds": tt, "malloc": MALLOC_MODE, "target": ">= 5"}


def bench_step_bound(a, yaml_path):
    """One `strata bench step` run (one round) on the optimizer's config: its device bound."""
    out = subprocess.run([a.strata, "bench", "step", yaml_path, "--params", str(a.n), "--rounds", "1",
                          "--no-scaling", "--json"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)["step"]


def part_nvme(a, model_a, grads):
    cfg = {"zero": {"stage": 1, "sub_group_size": a.sub_group}, "runtime": {"cpu_threads": a.threads},
           "optimizer": {"lr": 1e-4, "weight_decay": 0.01},
           "offload": {"optimizer": {"tier": "nvme"}},
           "tiers": {"host": {"buffer_count": a.buffers, "buffer_size": a.buffer_size, "pinned_budget": "8GiB"},
                     "nvme": {"paths": [a.nvme]}},
           "precision": {"params": "fp32", "grads": "fp32"}}
    zopt = strata.torch.ZeroOptimizer(model_a, cfg, param_groups=[{"params": list(model_a.parameters())}])
    pa = list(model_a.parameters())
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(zopt.config_yaml())
        path = f.name
    # Alternating, each round: one optimizer step; the device bound of the same engine, files and
    # state measured in this process right after it (EngineAccess::measure, what `strata bench
    # step` runs: read || write back every chunk, and Adam alone); one `strata bench step` round on
    # the same config and element count in a new process. (The disk's speed drifts by up to 30 %
    # within minutes on a shared host: a bound measured after all the steps is no reference.)
    ts, inproc, steps = [], [], []
    try:
        time_strata(zopt, pa, grads)  # warm-up
        for _ in range(a.rounds):
            ts.append(time_strata(zopt, pa, grads))
            inproc.append(zopt._engine._measure_bound())
            steps.append(bench_step_bound(a, path))
    finally:
        os.unlink(path)
        zopt.close()
    bounds = [max(s["t_io_s"], s["t_update_s"]) for s in steps]
    ibounds = [max(s["t_io_s"], s["t_update_s"]) for s in inproc]
    ms, mb, mi = statistics.median(ts), statistics.median(bounds), statistics.median(ibounds)
    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    return {"part": "nvme", "params": a.n, "threads": a.threads, "rounds": a.rounds, "strata_step_s": ms,
            # bench_step_t_engine_step_s: the whole Engine::step() of bench step (statistics pass +
            # update), the same step in C++.
            **{"bench_step_" + k: med(steps, k)
               for k in ("t_io_s", "t_update_s", "t_step_s", "t_engine_step_s")},
            "device_bound_s": mb, "step_over_bound": ms / mb,
            "step_over_bound_rounds": [t / b for t, b in zip(ts, bounds)],
            "in_process_t_io_s": med(inproc, "t_io_s"),
            # The step's own update loop (medians, step_loop<part>_s from last_loop<part>_s): its
            # computes, its waits for reads, and its gate (the statistics pass and the agreement,
            # run under the first reads).
            **{"step_loop" + part + "_s": med(inproc, "last_loop" + part + "_s")
               for part in ("", "_compute", "_wait_read", "_gate")},
            "in_process_bound_s": mi, "step_over_in_process_bound": ms / mi,
            "step_over_in_process_bound_rounds": [t / b for t, b in zip(ts, ibounds)],
            "io_engine": steps[0]["io_engine"], "target": "<= 1.1"}


def part_iteration(a):
    """Whole iterations of a small GPT: ZeroOptimizer (defaults) vs torch AdamW, alternating."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
    import gpt_model as G

    torch.manual_seed(1)
    ma = G.GPT(a.it_d_model, a.it_layers, a.it_heads, a.it_seq)
    mb = copy.deepcopy(ma)
    zopt = strata.torch.ZeroOptimizer(ma, None, overrides=["optimizer.lr=1e-3"] + a.it_set)
    topt = torch.optim.AdamW(mb.parameters(), lr=1e-3)
    data = G.load_corpus(None)

    def run(model, backward, opt_step, zero_grad, i):
        x, y = G.global_batch(data, i, a.it_rows, a.it_seq, seed=1)
        t0 = time.perf_counter()
        zero_grad()
        backward(model(x, y))
        t1 = time.perf_counter()
        opt_step()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    def strata_it(i):
        return run(ma, zopt.backward, zopt.step, zopt.zero_grad, i)

    def torch_it(i):
        return run(mb, lambda l: l.backward(), topt.step, topt.zero_grad, i)

    for i in range(3):  # warm-up: first touch of the state, torch's allocator
        strata_it(i), torch_it(i)
    s0 = zopt.stats()
    ts, tt, exposed = [], [], []
    for i in range(a.it_rounds):
        t, e = strata_it(i)
        ts.append(t)
        exposed.append(e)
        tt.append(torch_it(i)[0])
    s1 = zopt.stats()
    ms, mt = statistics.median(ts), statistics.median(tt)
    n = sum(p.numel() for p in ma.parameters())
    cfg = zopt.config
    zopt.close()
    return {"part": "iteration", "params": n, "stage": cfg["stage"], "optimizer_tier": cfg["optimizer_tier"],
            "rounds": a.it_rounds, "threads": torch.get_num_threads(),
            "strata_iteration_s": ms, "torch_adamw_iteration_s": mt, "strata_over_torch": ms / mt,
            "strata_exposed_step_s": statistics.median(exposed),
            "strata_handin_s_per_iteration": (s1["handin_s"] - s0["handin_s"]) / a.it_rounds,
            "strata_iteration_s_rounds": ts, "torch_iteration_s_rounds": tt, "target": "<= 1.05"}


def print_iteration(a):
    r = part_iteration(a)
    print(json.dumps(r) if a.json else
          "iteration: %.2fM-parameter GPT, stage %d, state on %s: ZeroOptimizer %.4f s, torch AdamW %.4f s: "
          "strata / torch %.3f (target <= 1.05); exposed step %.4f s, hand-in %.4f s per iteration\n%s"
          % (r["params"] / 1e6, r["stage"], r["optimizer_tier"], r["strata_iteration_s"],
             r["torch_adamw_iteration_s"], r["strata_over_torch"], r["strata_exposed_step_s"],
             r["strata_handin_s_per_iteration"], json.dumps(r)), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=11,
                    help="alternating rounds per part (with glibc's default malloc torch's step varies "
                         "0.45-2.0 s from round to round here: the median of 11 is steady, of 5 not)")
    ap.add_argument("--nvme", help="a directory on the NVMe drive: also run part 2")
    ap.add_argument("--strata", default=os.path.join(os.path.dirname(__file__), "..", "..", "build", "strata"),
                    help="the strata executable (part 2)")
    ap.add_argument("--buffers", type=int, default=4)
    ap.add_argument("--buffer-size", default="64MiB")
    ap.add_argument("--sub-group", default="100M")
    ap.add_argument("--malloc", choices=("default", "keep"), default="default",
                    help="keep: run with glibc malloc keeping freed memory (MALLOC_MMAP_MAX_=0, "
                         "MALLOC_TRIM_THRESHOLD_=2^46), so torch's step does not page-fault its "
                         "temporaries anew (torch's best case here); default: as torch runs by default")
    ap.add_argument("--json", action="store_true")
    it = ap.add_argument_group("part 3, iteration (the example GPT)")
    it.add_argument("--iteration-only", action="store_true", help="run only part 3")
    it.add_argument("--it-d-model", type=int, default=240)
    it.add_argument("--it-layers", type=int, default=6)
    it.add_argument("--it-heads", type=int, default=6)
    it.add_argument("--it-seq", type=int, default=64)
    it.add_argument("--it-rows", type=int, default=4, help="sequences per iteration")
    it.add_argument("--it-rounds", type=int, default=30)
    it.add_argument("--it-set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for part 3's ZeroOptimizer (repeatable)")
    a = ap.parse_args()
    if a.malloc == "keep" and MALLOC_MODE != "keep":
        os.environ.update(_KEEP_ENV)
        os.execv(sys.executable, [sys.executable] + sys.argv)
    torch.set_num_threads(a.threads)
    if a.iteration_only:
        print_iteration(a)
        return 0
    torch.manual_seed(0)
    model_a = Shapes(a.d_model, a.layers, a.vocab)
    a.n = sum(p.numel() for p in model_a.parameters())
    if not a.json:
        print("parameters: %.1fM, threads %d, rounds %d" % (a.n / 1e6, a.threads, a.rounds), flush=True)
    grads = [torch.randn_like(p) * 1e-3 for p in model_a.parameters()]
    model_b = copy.deepcopy(model_a)
    r = part_host(a, model_a, model_b, grads)
    print(json.dumps(r) if a.json else
          "host: ZeroOptimizer step %.4f s, torch AdamW(foreach) %.4f s: speedup %.2fx (target >= 5)\n%s"
          % (r["strata_step_s"], r["torch_adamw_foreach_step_s"], r["speedup"], json.dumps(r)), flush=True)
    del model_b
    if a.nvme:
        os.makedirs(a.nvme, exist_ok=True)
        model_c = Shapes(a.d_model, a.layers, a.vocab)
        r = part_nvme(a, model_c, grads)
        print(json.dumps(r) if a.json else
              "nvme: ZeroOptimizer step %.4f s; device bound in this process %.4f s: step / bound %.3f; "
              "strata bench step: max(t_io %.4f, t_update %.4f) = %.4f s: step / bound %.3f (target <= 1.1)\n%s"
              % (r["strata_step_s"], r["in_process_bound_s"], r["step_over_in_process_bound"],
                 r["bench_step_t_io_s"], r["bench_step_t_update_s"], r["device_bound_s"],
                 r["step_over_bound"], json.dumps(r)), flush=True)
    print_iteration(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
