#!/usr/bin/python3
"""Same numbers: a small GPT (examples/gpt_model.py, ~2.7M parameters, fp32) trained 30 steps
with strata.torch.ZeroOptimizer must end bitwise equal to torch.optim.AdamW on one process fed
the same global batch with DDP's gradient averaging.

The reference (one process, `reference`): per step, the global batch is world x ROWS rows; rank
r's micro-batch is rows [r*ROWS, (r+1)*ROWS). The reference runs forward + backward on each
micro-batch in turn, sums the gradients in rank order, ((g0 + g1) + g2) + g3, divides the sum by
the world size (DDP's average), and steps torch.optim.AdamW (foreach=False) with the same two
parameter groups (weight decay 0.1 for matrices and embeddings, 0 for biases and norms) and the
same LambdaLR warm-up. strata's host reductions add in the same rank order and divide by N
(AdamStepOptions::grad_divisor), as DDP does.

`train` runs under a launcher (or alone) the cases named by --cases, each a fresh model and
optimizer for --steps steps, and writes DIR/rank<R>.json; `check` reads those files and the
reference and fails (exit 1) on any difference. Cases:
  s0 s1 s2 s3         zero.stage 0..3, state in host memory: bitwise equal (params, exp_avg, exp_avg_sq)
  nvme<S>             stage S with offload.optimizer on NVMe (a temp dir): bitwise equal
  ckpt<S>             stage S, save_checkpoint after 15 steps; a new model (other initial values)
                      and optimizer at stage 3 (1 if S is 3) load_checkpoint and run the other
                      15: bitwise equal
  sdict<S>            the same through state_dict() / load_state_dict()
  nvmesdict<S>        sdict<S> with offload.optimizer on NVMe (load_state_dict: Engine.write_states)
  bf16<S>             stage S, bf16 parameters and gradients, dynamic loss scaling switched on
                      (precision.loss_scale.enabled: true; bf16 is not scaled by default) (initial 1024,
                      growth every 10 steps); at step 25 the last rank's loss is made inf: every
                      rank must skip that step and back the loss scale off alike. Checked two ways:
                      (a) bitwise against the mixed-precision reference below; (b) its loss curve
                      against the fp32 run's on the same micro-batches: the mean over steps 15-24 (before
                      the skip) of |mean over ranks of (loss_bf16 - loss_fp32)| <= BF16_LOSS_TOL.

The bf16 reference ("bf16" dtype of `reference`): torch.optim.AdamW steps FP32 master weights;
each step copies them into a bf16 copy of the model (round to nearest even), runs every
micro-batch's forward/backward on it with the loss times the loss scale, sums the ranks' bf16
gradients in FP32 in rank order, rounds the sum to bf16 once (what strata's reduce-scatter does),
and hands AdamW that sum times 1/(loss_scale * N); a non-finite sum skips the step and halves the
scale, 10 good steps double it.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
import gpt_model as G  # noqa: E402

MODEL = dict(d_model=192, layers=6, heads=6, seq_len=32)
ROWS = 2            # rows per rank and step
LR, WD, BETAS, EPS = 1e-3, 0.1, (0.9, 0.95), 1e-8
SEED = 20240613
OVERFLOW_STEP = 25
LOSS_SCALE, GROWTH_INTERVAL = 1024.0, 10
# bf16 vs fp32 training: steps 15-24, the mean absolute difference of the ranks' mean loss.
LOSS_WINDOW = range(15, 25)
BF16_LOSS_TOL = 0.02  # measured 0.0015 on 2 ranks


def warmup(step):
    return min(1.0, (step + 1) / 10.0)


def build_model(dtype=torch.float32):
    torch.manual_seed(SEED)
    m = G.GPT(**MODEL)
    return m.to(dtype)


def groups(model, decay=WD):
    decay_p, no_decay = [], []
    for n, p in model.named_parameters():
        (decay_p if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay_p, "weight_decay": decay}, {"params": no_decay, "weight_decay": 0.0}]


def names_in_group_order(model):
    ids = {id(p): n for n, p in model.named_parameters()}
    return [ids[id(p)] for g in groups(model) for p in g["params"]]


# ---- reference ----
def reference(args):
    torch.set_num_threads(1)
    data = G.load_corpus()
    for dtype_name in args.dtypes.split(","):
        if dtype_name == "bf16":
            out = reference_bf16(args, data)
        else:
            out = reference_fp32(args, data)
        torch.save(out, "%s.%s.pt" % (args.out, dtype_name))
        print("reference world %d %s: %d steps, final losses %s" % (args.world, dtype_name, args.steps,
                                                                     out["losses"][-1]))


def micro_batch_grads(model, params, x, y, world, scale=1.0, inf_rank=None):
    """Gradients of each rank's micro-batch, summed in FP32 in rank order; the losses."""
    total, losses = None, []
    for r in range(world):
        for p in params:
            p.grad = None
        loss = model(x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS])
        losses.append(float(loss))
        if r == inf_rank:
            loss = loss * float("inf")
        (loss * scale if scale != 1.0 else loss).backward()
        g = [p.grad.float() if p.grad.dtype != torch.float32 else p.grad for p in params]
        total = g if total is None else [a.add_(b) for a, b in zip(total, g)]  # rank order
    return total, losses


def reference_out(model, opt, init, losses, scales=None):
    params = [p for g in opt.param_groups for p in g["params"]]
    out = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}, "init": init, "losses": losses,
           "step": int(opt.state[params[0]]["step"]), "loss_scale": scales}
    for n, p in model.named_parameters():
        out["params"][n] = p.detach().clone()
        out["exp_avg"][n] = opt.state[p]["exp_avg"].clone()
        out["exp_avg_sq"][n] = opt.state[p]["exp_avg_sq"].clone()
    return out


def reference_fp32(args, data):
    model = build_model()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(groups(model), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    params = [p for g in opt.param_groups for p in g["params"]]
    losses = []
    for step in range(args.steps):
        x, y = G.global_batch(data, step, args.world * ROWS, MODEL["seq_len"])
        total, step_losses = micro_batch_grads(model, params, x, y, args.world)
        losses.append(step_losses)
        for p, g in zip(params, total):
            p.grad = g / args.world  # DDP's average
        opt.step()
        sched.step()
    return reference_out(model, opt, init, losses)


def reference_bf16(args, data):
    master = build_model()
    with torch.no_grad():  # the bf16 run starts from the bf16-rounded initial values
        for p in master.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    init = {n: p.detach().clone() for n, p in master.named_parameters()}
    half = build_model(torch.bfloat16)
    opt = torch.optim.AdamW(groups(master), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    mparams = [p for g in opt.param_groups for p in g["params"]]
    hparams = [p for g in groups(half) for p in g["params"]]
    scale, good, losses, scales = LOSS_SCALE, 0, [], []
    for step in range(args.steps):
        with torch.no_grad():
            for h, m in zip(hparams, mparams):
                h.copy_(m)  # round to nearest even
        x, y = G.global_batch(data, step, args.world * ROWS, MODEL["seq_len"])
        total, step_losses = micro_batch_grads(half, hparams, x, y, args.world, scale,
                                               args.world - 1 if step == OVERFLOW_STEP else None)
        losses.append(step_losses)
        reduced = [t.to(torch.bfloat16) for t in total]  # one rounding of the FP32 sum
        if all(bool(torch.isfinite(g).all()) for g in reduced):
            inv = 1.0 / (scale * args.world)
            for p, g in zip(mparams, reduced):
                p.grad = g.float() * inv
            opt.step()
            good += 1
            if good >= GROWTH_INTERVAL:
                scale, good = scale * 2.0, 0
        else:
            scale, good = max(1.0, scale * 0.5), 0
        scales.append(scale)
        sched.step()
    return reference_out(master, opt, init, losses, scales)


# ---- strata ----
def case_config(case, tmp):
    cfg = {
        "optimizer": {"type": "adamw", "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
        "precision": {"params": "fp32", "grads": "fp32"},
        # Small buckets and sub-groups: several reduce-scatters overlap the backward, Adam runs in
        # several sub-groups, tensors straddle partition boundaries.
        "zero": {"stage": int(case[-1]), "reduce_bucket_size": 300000, "sub_group_size": 400000},
        "runtime": {"cpu_threads": 1, "collective_timeout_s": 120},
    }
    if case.startswith("nvme"):
        cfg["offload"] = {"optimizer": {"tier": "nvme"}}
        cfg["tiers"] = {"host": {"buffer_count": 4, "buffer_size": "1MiB"},
                        "nvme": {"paths": [tmp], "block_size": "64KiB"}}
    if case.startswith("bf16"):
        cfg["precision"] = {"params": "bf16", "grads": "bf16",
                            "loss_scale": {"enabled": True, "initial": LOSS_SCALE,
                                           "growth_interval": GROWTH_INTERVAL}}
    return cfg


def run_case(strata, case, data, steps, tmp, shared):
    """One case: `steps` steps; ckpt<S> / sdict<S> stop half-way, save (checkpoint / state_dict),
    and continue in a new model and optimizer with another stage (and other initial values).
    tmp: this rank's scratch directory (NVMe swap); shared: the ranks' common one (checkpoints)."""
    bf16 = case.startswith("bf16")
    resume = case.startswith(("ckpt", "sdict", "nvmesdict"))
    stage = int(case[-1])
    model = build_model(torch.bfloat16 if bf16 else torch.float32)
    names = names_in_group_order(model)  # (at stage 3 the parameters are empty once registered)
    opt = strata.torch.ZeroOptimizer(model, case_config(case, tmp), param_groups=groups(model))
    sched = None if resume else torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    rank, world = opt.rank, opt.world
    rec = {"backend": opt.backend, "world": world, "rank": rank, "losses": [], "overflow": [], "loss_scale": []}
    t0 = time.time()
    for step in range(steps):
        if resume and step == steps // 2:
            if case.startswith("ckpt"):
                opt.save_checkpoint(os.path.join(shared, "ckpt-" + case))
            else:
                saved = opt.state_dict()
            opt.close()
            torch.manual_seed(SEED + 1)  # other initial values: everything must come from the save
            model = G.GPT(**MODEL)
            cfg = case_config(case, tmp)
            cfg["zero"]["stage"] = 3 if stage < 3 else 1
            opt = strata.torch.ZeroOptimizer(model, cfg, param_groups=groups(model))
            if case.startswith("ckpt"):
                opt.load_checkpoint(os.path.join(shared, "ckpt-" + case))
            else:
                opt.load_state_dict(saved)
        if resume:  # what LambdaLR(opt, warmup) sets (its state is not in the checkpoint)
            for g in opt.param_groups:
                g["lr"] = LR * warmup(step)
        x, y = G.global_batch(data, step, world * ROWS, MODEL["seq_len"])
        loss = model(x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS])
        rec["losses"].append(float(loss))
        if bf16 and step == OVERFLOW_STEP and rank == world - 1:
            loss = loss * float("inf")
        opt.backward(loss)
        r = opt.step()
        if sched is not None:
            sched.step()
        rec["overflow"].append(r.overflow)
        rec["loss_scale"].append(r.loss_scale)
    rec["seconds"] = time.time() - t0
    sd = opt.state_dict()
    state = {n: sd["state"][i] for i, n in enumerate(names)}
    params = {}
    in_groups = [p for g in opt.param_groups for p in g["params"]]  # state_dict's order
    for i, n in enumerate(names):
        p = in_groups[i]
        params[n] = p.detach().clone() if opt.stage < 3 else state[n]["master"].to(p.dtype)
    rec["optimizer_step"] = int(float(state[names[0]]["step"]))
    opt.close()
    return rec, state, params


def compare(rec, state, params, ref, fp32_ref=None):
    """Bitwise: params (stages 0-2: the model's own tensors), master, exp_avg, exp_avg_sq."""
    rec["mismatch"] = {}
    for n in ref["params"]:
        for what, got, want in (("params", params[n], ref["params"][n]),
                                ("master", state[n]["master"], ref["params"][n]),
                                ("exp_avg", state[n]["exp_avg"], ref["exp_avg"][n]),
                                ("exp_avg_sq", state[n]["exp_avg_sq"], ref["exp_avg_sq"][n])):
            if what == "params" and got.dtype != torch.float32:  # bf16 model: round the master
                want = want.to(got.dtype)
                bad = int((got.view(-1).view(torch.int16) != want.view(-1).view(torch.int16)).sum())
            else:
                bad = int((got.view(-1).view(torch.int32) != want.view(-1).view(torch.int32)).sum())
            if bad:
                rec["mismatch"]["%s %s" % (what, n)] = [bad, float((got.float() - want.float()).abs().max())]
    rec["bitwise"] = not rec["mismatch"]
    rec["ref_step"] = ref["step"]
    if ref.get("loss_scale") is not None:
        rec["ref_loss_scale"] = ref["loss_scale"]
    if fp32_ref is not None:  # fp32 training's losses on this rank's micro-batches (see check)
        rec["fp32_losses"] = [l[rec["rank"]] for l in fp32_ref["losses"]]


def train(args):
    import strata

    torch.set_num_threads(1)
    data = G.load_corpus()
    results = {}
    rank = None
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory(prefix="strata-nvme-", dir=args.tmp) as tmp:
            rec, state, params = run_case(strata, case, data, args.steps, tmp, args.out)
        rank = rec["rank"]
        bf16 = case.startswith("bf16")
        ref = torch.load("%s.%s.pt" % (args.ref, "bf16" if bf16 else "fp32"))
        compare(rec, state, params, ref, torch.load("%s.fp32.pt" % args.ref) if bf16 else None)
        results[case] = rec
        print("rank %d %s: %s (%s, %.1f s)" % (
            rank, case, "bitwise equal" if rec["bitwise"] else "MISMATCH %s" % list(rec["mismatch"].items())[:3],
            rec["backend"], rec["seconds"]), flush=True)
    with open(os.path.join(args.out, "rank%d.json" % rank), "w") as f:
        json.dump(results, f)


def check(args):
    ok = True
    files = sorted(f for f in os.listdir(args.out) if f.startswith("rank") and f.endswith(".json"))
    if len(files) != args.world:
        print("FAIL: %d rank result files for world %d" % (len(files), args.world))
        return 1
    per_rank = [json.load(open(os.path.join(args.out, f))) for f in files]
    for case in per_rank[0]:
        recs = [r[case] for r in per_rank]
        for r in recs:
            if r["world"] != args.world:
                print("FAIL %s: rank %d saw world %d" % (case, r["rank"], r["world"]))
                ok = False
            if not r["bitwise"] or r["optimizer_step"] != r["ref_step"]:
                print("FAIL %s rank %d: not bitwise equal (%d/%d steps): %s" % (
                    case, r["rank"], r["optimizer_step"], r["ref_step"], list(r["mismatch"].items())[:5]))
                ok = False
            if case.startswith("bf16"):
                want = [s == OVERFLOW_STEP for s in range(len(r["overflow"]))]
                if r["overflow"] != want:
                    print("FAIL %s rank %d: overflow steps %s, want only step %d" % (
                        case, r["rank"], [i for i, o in enumerate(r["overflow"]) if o], OVERFLOW_STEP))
                    ok = False
                if r["loss_scale"] != r["ref_loss_scale"]:
                    print("FAIL %s rank %d: loss scales %s, reference %s" % (case, r["rank"], r["loss_scale"],
                                                                           r["ref_loss_scale"]))
                    ok = False
        if case.startswith("bf16"):
            gap = sum(abs(sum(r["losses"][i] - r["fp32_losses"][i] for r in recs)) / len(recs)
                      for i in LOSS_WINDOW) / len(LOSS_WINDOW)
            for r in recs:
                r["loss_gap_fp32"] = gap
            if gap > BF16_LOSS_TOL:
                print("FAIL %s: loss %.4f away from fp32 training (> %.2f)" % (case, gap, BF16_LOSS_TOL))
                ok = False
        if any(r["loss_scale"] != recs[0]["loss_scale"] or r["overflow"] != recs[0]["overflow"] for r in recs):
            print("FAIL %s: ranks disagree on overflow / loss scale" % case)
            ok = False
        summary = "bitwise equal on %d ranks" % len(recs) if all(r["bitwise"] for r in recs) else "MISMATCH"
        if case.startswith("bf16"):
            summary += ", loss vs fp32 %.4f, overflow skipped at step %s, loss scale %g -> %g" % (
                recs[0]["loss_gap_fp32"], [i for i, o in enumerate(recs[0]["overflow"]) if o],
                LOSS_SCALE, recs[0]["loss_scale"][-1])
        print("%-6s world %d (%s): %s; %.1f s" % (case, args.world, recs[0]["backend"], summary,
                                                 max(r["seconds"] for r in recs)))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference")
    r.add_argument("--world", type=int, required=True)
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--dtypes", default="fp32")
    r.add_argument("--out", required=True, help="path prefix: OUT.fp32.pt, OUT.bf16.pt")
    t = sub.add_parser("train")
    t.add_argument("--cases", required=True)
    t.add_argument("--steps", type=int, default=30)
    t.add_argument("--ref", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--tmp", default=None, help="where the NVMe cases put their swap directory")
    c = sub.add_parser("check")
    c.add_argument("--world", type=int, required=True)
    c.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.cmd == "reference":
        reference(args)
    elif args.cmd == "train":
        train(args)
    else:
        sys.exit(check(args))


if __name__ == "__main__":
    main()
