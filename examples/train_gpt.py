#!/usr/bin/python3
"""Train a small GPT with strata's ZeRO engine (strata.torch.ZeroOptimizer) on text that is on
every Debian machine (/usr/share/common-licenses; --data FILE for your own).

  # one process, optimizer state on NVMe (examples/zero2-nvme.yaml: swap under ./strata-swap)
  PYTHONPATH=build/python /usr/bin/python3 examples/train_gpt.py --config examples/zero2-nvme.yaml

  # two ranks (torchrun; `python3 -m strata.torchrun` is torchrun with Debian 12's Python 3.11
  # fix), or under mpirun
  PYTHONPATH=build/python /usr/bin/python3 -m strata.torchrun --standalone --nproc_per_node 2 \\
      examples/train_gpt.py --config examples/zero2-nvme.yaml
  mpirun -np 2 -x PYTHONPATH=build/python /usr/bin/python3 examples/train_gpt.py

  # on a GPU (one per rank: cuda:LOCAL_RANK): the model, the batches and the engine's gpu-tier
  # state on the device, the reductions on strata's NCCL
  PYTHONPATH=build/python python3 examples/train_gpt.py --device cuda --config examples/zero2-nvme.yaml

Every step prints the loss, tokens/s and the step's time split: backward (forward excluded;
including handing the gradients to the engine), reduce (gradient reduce + norm/overflow exchange
left after the backward), optimizer (Adam over the rank's partition, NVMe streaming included;
"exposed": the part after the last gradient, what the backward did not hide: optimizer.overlap),
transfers (parameter gathers, gradient spill to NVMe). --save-every N writes the engine's
checkpoint to --checkpoint-dir; --resume continues from it bitwise. --compare-torch trains
torch.optim.AdamW on the same global batches beside it (rank 0) and --plot writes both loss curves.
"""
import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_model as G  # noqa: E402
import strata  # noqa: E402


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="strata YAML (default: built-in defaults, state in host memory)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, as strata's --set (repeatable), e.g. zero.stage=3")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model trains (cuda: this rank's GPU, cuda:LOCAL_RANK)")
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    ap.add_argument("--checkpoint-dir", default="checkpoints/gpt")
    ap.add_argument("--blocking-saves", action="store_true",
                    help="wait for each checkpoint's writes (default: asynchronous saves)")
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    ap.add_argument("--stop-after", type=int, default=0,
                    help="leave after this step (a preempted job, for trying --resume)")
    ap.add_argument("--data", help="a text file (default: Debian's license texts)")
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4, help="sequences per rank and step")
    ap.add_argument("--accumulate", type=int, default=1, metavar="K",
                    help="micro-batches per step (gradient accumulation): --rows / K sequences each, "
                         "one backward per micro-batch, the loss scaled by 1/K")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--grad-clip", type=float, default=1.0,
                    help="clip_grad_norm_(model.parameters(), G) every step (0: no clipping)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--compare-torch", action="store_true",
                    help="also train torch.optim.AdamW on the same global batches (rank 0); the loss "
                         "printed beside strata's is the copy's on rank 0's rows, as strata's is")
    ap.add_argument("--plot", default="", help="PNG with the loss curve(s) (default with "
                    "--compare-torch: gpt_loss.png)")
    ap.add_argument("--log-json", default="", help="write the per-step records to this JSON file (rank 0)")
    return ap.parse_args()


def lr_at(step, base, warmup, total):
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def main():
    a = parse()
    if a.accumulate < 1 or a.rows % a.accumulate:
        raise SystemExit("train_gpt: --accumulate %d must be >= 1 and divide --rows %d"
                         % (a.accumulate, a.rows))
    world_hint = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 1) // world_hint))
    torch.manual_seed(a.seed)
    device = torch.device("cpu")
    if a.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model = G.GPT(a.d_model, a.layers, a.heads, a.seq_len).to(device)
    twin = None
    if a.compare_torch:
        import copy

        twin = copy.deepcopy(model)
    overrides = list(a.set) + ["optimizer.lr=%g" % a.lr]
    opt = strata.torch.ZeroOptimizer(model, a.config, overrides=overrides)
    rank, world = opt.rank, opt.world
    cfg = opt.config
    if rank == 0:
        print("strata %s: GPT %.2fM parameters on %s, %d rank(s) (%s), zero.stage %d, optimizer state on "
              "%s, %s params / %s grads" % (strata.__version__, G.num_params(model) / 1e6, device, world,
                                            opt.backend, cfg["stage"], cfg["optimizer_tier"],
                                            cfg["params_dtype"], cfg["grads_dtype"]), flush=True)
    data = G.load_corpus(a.data)
    start = 0
    if a.resume:
        opt.load_checkpoint(a.checkpoint_dir)
        start = int(opt.stats()["steps"])
        if rank == 0:
            print("resumed from %s at step %d" % (a.checkpoint_dir, start), flush=True)
    topt = None
    if twin is not None and rank == 0:
        topt = torch.optim.AdamW(strata.torch.no_decay_param_groups(twin, cfg["weight_decay"]), lr=a.lr,
                                 betas=cfg["betas"], eps=cfg["eps"])
    records = []
    prev = opt.stats()
    tokens = a.rows * a.seq_len * world
    for step in range(start, a.steps):
        lr = lr_at(step, a.lr, a.warmup, a.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        t0 = time.perf_counter()
        x, y = G.global_batch(data, step, world * a.rows, a.seq_len, seed=a.seed)
        x, y = x.to(device), y.to(device)
        xs, ys = x[rank * a.rows:(rank + 1) * a.rows], y[rank * a.rows:(rank + 1) * a.rows]
        loss, m = 0.0, a.rows // a.accumulate
        for k in range(a.accumulate):  # micro-batches: their gradients add up in the engine
            part = model(xs[k * m:(k + 1) * m], ys[k * m:(k + 1) * m]) / a.accumulate
            opt.backward(part)
            loss += float(part)
        if a.grad_clip > 0:  # strata's global norm across ranks, torch's coefficient
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        result = opt.step()
        dt = time.perf_counter() - t0
        s = opt.stats()
        d = {k: s[k] - prev[k] for k in ("backward_s", "reduce_s", "norm_s", "optimizer_s", "gather_s",
                                         "grad_spill_s", "step_s")}
        prev = s
        rec = {"step": step + 1, "loss": float(loss), "lr": lr, "tokens_per_s": tokens / dt, "step_s": dt,
               "backward_s": d["backward_s"], "reduce_s": d["reduce_s"] + d["norm_s"],
               "optimizer_s": d["optimizer_s"], "transfers_s": d["gather_s"] + d["grad_spill_s"],
               "applied": result.applied, "loss_scale": result.loss_scale, "grad_norm": result.grad_norm,
               "exposed_s": result.exposed_s}
        if topt is not None:
            for g in topt.param_groups:
                g["lr"] = lr
            topt.zero_grad(set_to_none=True)
            if world > 1:  # the loss printed is rank 0's: the twin's on the same rows, same weights
                with torch.no_grad():
                    rec["torch_loss"] = float(twin(xs, ys))
            tl = twin(x, y)  # trained on the global batch, as the ranks together are
            tl.backward()
            if a.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(twin.parameters(), a.grad_clip)
            topt.step()
            rec.setdefault("torch_loss", float(tl))
        records.append(rec)
        if rank == 0:
            print("step %4d | loss %.4f%s | %7.0f tok/s | %.3f s: backward %.3f, reduce %.3f, optimizer %.3f "
                  "(exposed %.3f), transfers %.3f%s" % (
                      rec["step"], rec["loss"], " (torch %.4f)" % rec["torch_loss"] if "torch_loss" in rec else "",
                      rec["tokens_per_s"], dt, rec["backward_s"], rec["reduce_s"], rec["optimizer_s"],
                      rec["exposed_s"], rec["transfers_s"], "" if result.applied else " [overflow: skipped]"),
                  flush=True)
        if a.save_every and (step + 1) % a.save_every == 0:
            blocked = opt.save_checkpoint(a.checkpoint_dir, blocking=a.blocking_saves)
            if rank == 0:
                print("checkpoint: %s (step %d, %s; training blocked %.1f ms)"
                      % (a.checkpoint_dir, step + 1,
                         "written" if a.blocking_saves else "writing in the background",
                         blocked * 1e3), flush=True)
        if a.stop_after and step + 1 >= a.stop_after:
            break
    if a.save_every:
        blocked = opt.wait_checkpoint()  # commits the last asynchronous save
        if rank == 0 and not a.blocking_saves:
            print("checkpoint: committed (training blocked %.1f ms)" % (blocked * 1e3), flush=True)
    if rank == 0 and a.log_json:
        with open(a.log_json, "w") as f:
            json.dump(records, f)
    plot = a.plot or ("gpt_loss.png" if a.compare_torch else "")
    if rank == 0 and plot and records:
        write_plot(plot, records, world, cfg)
    opt.close()


def write_plot(path, records, world, cfg):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["loss"] for r in records], label="strata ZeroOptimizer (stage %d, state on %s, %d rank%s)"
            % (cfg["stage"], cfg["optimizer_tier"], world, "s" if world > 1 else ""))
    if "torch_loss" in records[0]:
        ax.plot(steps, [r["torch_loss"] for r in records], "--", label="torch.optim.AdamW (one process)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss" if world == 1 else "loss (strata: rank 0's micro-batch; torch: global batch)")
    ax.set_title("small GPT on Debian's license texts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("plot: %s" % path, flush=True)


if __name__ == "__main__":
    main()
