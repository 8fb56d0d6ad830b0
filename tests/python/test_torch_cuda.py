#!/usr/bin/python3
"""strata.torch.ZeroOptimizer on a CUDA model against torch.optim.AdamW (foreach=False) on an
identical CUDA copy, one process (issue 47, point 3). Runs wherever torch sees a GPU and the strata
build has CUDA; SKIPPED (exit 77, by name) elsewhere.

The model: two nn.TransformerEncoder layers over a token embedding whose weight is tied to the
output head, and a frozen Linear (requires_grad False: left out of the optimizer; it must not
change; attention's in_proj_bias is frozen too, see make()). The matrix combines the axes instead
of taking their product: stage 0 keeps the state on the GPU; stages 1-3 each meet every
optimizer-state tier gpu / cpu / nvme (offload.optimizer.tier); across those cases (plus the
device update, optimizer.update device, and one under torch.set_default_device("cuda")) run
accumulation 1 and 2, torch.nn.utils.clip_grad_norm_ every step, optimizer.overlap off / on
(stages 2-3, state off the GPU), a state_dict round trip into a fresh optimizer,
save_checkpoint / load_checkpoint into a fresh one, opt.backward(loss) and plain loss.backward().
After 6 steps: max |delta| of the FP32 masters and of the model's parameters (after close())
against AdamW's <= 1e-5 x max |param|; each case prints its figures and whether the masters are
bitwise AdamW's (state off the GPU: the CPU Adam; with clipping the coefficient's rounding differs
from torch's, so those cases are close, not bitwise).

    PYTHONPATH=build/python python3 tests/python/test_torch_cuda.py [--device cpu] [-k FILTER]

--device cpu runs the same matrix on a CPU model (a check of the test itself; CI runs the CPU
paths elsewhere). Exit status: 0 every case passed, 1 a case failed, 77 skipped.
Environment: STRATA_TEST_SWAP: the directory for NVMe swap (default: a fresh one under $TMPDIR).
"""
import argparse
import copy
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, LAYERS = 256, 64, 4, 2
ROWS, SEQ = 4, 16
STEPS, SPLIT = 6, 3  # the round trip / resume happens after SPLIT steps
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
CLIP = 0.5           # below the gradients' norm here: every step clips
TOL = 1e-5           # max |delta| <= TOL x max |param|


@dataclass
class Case:
    stage: int
    tier: str               # offload.optimizer.tier
    k: int = 1              # micro-batches per step
    clip: bool = False
    overlap: str = "off"    # optimizer.overlap
    update: str = "cpu"     # optimizer.update (state off the GPU: cpu = CPU Adam, device)
    sdict: bool = False     # state_dict() -> a fresh optimizer's load_state_dict() after SPLIT
    ckpt: bool = False      # save_checkpoint -> a fresh optimizer's load_checkpoint after SPLIT
    opt_backward: bool = False  # opt.backward(loss) instead of loss.backward()
    default_device: bool = False  # under torch.set_default_device("cuda")

    @property
    def name(self):
        parts = ["s%d" % self.stage, self.tier, "K%d" % self.k]
        parts += ["clip"] if self.clip else []
        parts += ["overlap-%s" % self.overlap] if self.overlap != "off" else []
        parts += ["update-%s" % self.update] if self.update != "cpu" else []
        parts += ["state_dict"] if self.sdict else []
        parts += ["checkpoint"] if self.ckpt else []
        parts += ["opt.backward"] if self.opt_backward else []
        parts += ["default-device"] if self.default_device else []
        return " ".join(parts)


CASES = [  # (stage 0 keeps the state on the model's device: offloading needs stage >= 1)
    Case(0, "gpu", k=1, clip=True, ckpt=True, opt_backward=True),
    Case(0, "gpu", k=2, sdict=True),
    Case(1, "gpu", k=2, ckpt=True),
    Case(1, "cpu", k=1, clip=True, sdict=True),
    Case(1, "nvme", k=2, clip=True, ckpt=True, opt_backward=True),
    Case(2, "gpu", k=2, clip=True, sdict=True),
    Case(2, "cpu", k=1, overlap="on", ckpt=True),
    Case(2, "nvme", k=2, clip=True, overlap="on"),
    Case(3, "gpu", k=1, clip=True, ckpt=True),
    Case(3, "cpu", k=2, clip=True, overlap="on", sdict=True),
    Case(3, "nvme", k=1, overlap="on", sdict=True, opt_backward=True),
    Case(2, "cpu", k=2, clip=True, update="device"),
    Case(3, "nvme", k=2, clip=True, update="device", ckpt=True),
    Case(3, "cpu", k=2, clip=True, sdict=True, default_device=True),
]


class Net(nn.Module):
    """Embedding (tied to the head) -> TransformerEncoder -> + frozen Linear -> LayerNorm ->
    head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, 4 * D, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.frozen = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x, y):
        h = self.enc(self.emb(x))
        h = h + self.frozen(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def make(device):
    torch.manual_seed(3)
    m = Net()
    nn.init.normal_(m.emb.weight, std=0.02)  # GPT's init: logits of a sane size, loss ~ln(VOCAB)
    m.frozen.requires_grad_(False)
    # Attention's in_proj_bias is frozen too: its key third has a zero gradient in exact
    # arithmetic (softmax ignores a constant shift), so what it gets is rounding noise, which
    # Adam scales up to full steps: it would measure the backward's rounding, not the optimizer.
    for layer in m.enc.layers:
        layer.self_attn.in_proj_bias.requires_grad_(False)
    return m.to(device)


def groups(model):
    import strata

    return strata.torch.no_decay_param_groups(model, weight_decay=WD)


def config(case, swap):
    return {"zero": {"stage": case.stage, "reduce_bucket_size": 20000, "sub_group_size": 30000},
            "optimizer": {"type": "adamw", "lr": LR, "betas": list(BETAS), "eps": EPS,
                          "weight_decay": WD, "overlap": case.overlap, "update": case.update},
            "offload": {"optimizer": {"tier": case.tier}},
            "tiers": {"nvme": {"paths": [swap]}},
            "runtime": {"cpu_threads": 2}}


def batch(step, k, device):
    g = torch.Generator(device="cpu").manual_seed(1000 * step + k)
    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g, device="cpu")
    y = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g, device="cpu")
    return x.to(device), y.to(device)


def train_step(model, opt, step, case, device, strata_side):
    """One optimizer step as a torch loop runs it: zero_grad, K micro-batches of loss / K,
    clip_grad_norm_ (torch's function: strata's parameters are recognized), step."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for k in range(case.k):
        x, y = batch(step, k, device)
        loss = model(x, y) / case.k
        if strata_side and case.opt_backward:
            opt.backward(loss)
        else:
            loss.backward()
        total += float(loss)
    if case.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    return total


def masters(opt, model):
    """name -> FP32 master (gathered from the engine), flattened, on the CPU."""
    sd = opt.state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: sd["state"][i]["master"].detach().to("cpu").reshape(-1)
            for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}


def compare(got, ref):
    """(max |delta|, max |param|, elements not bitwise equal, elements) over ref's parameters."""
    diff, scale, differ, total = 0.0, 0.0, 0, 0
    for n, p in ref.named_parameters():
        if n not in got:
            continue
        a = got[n].detach().to("cpu", torch.float32).reshape(-1)
        b = p.detach().to("cpu", torch.float32).reshape(-1)
        diff = max(diff, float((a - b).abs().max()))
        scale = max(scale, float(b.abs().max()))
        differ += int((a.view(torch.int32) != b.view(torch.int32)).sum())
        total += b.numel()
    return diff, scale, differ, total


def fresh_optimizer(case, device, swap, opt, model, ckpt_dir):
    """The round trip / resume: the state leaves `opt` (state_dict, or a checkpoint), `opt` is
    closed, and a new model at its initial values with a new ZeroOptimizer takes the state in."""
    import strata

    sd = opt.state_dict() if case.sdict else None
    if case.ckpt:
        opt.save_checkpoint(ckpt_dir, client_state={"step": SPLIT})
    opt.close()
    model2 = make(device)
    opt2 = strata.torch.ZeroOptimizer(model2, config=config(case, swap),
                                      param_groups=groups(model2))
    if case.sdict:
        opt2.load_state_dict(sd)
    else:
        state = opt2.load_checkpoint(ckpt_dir)
        if state != {"step": SPLIT}:
            raise AssertionError("load_checkpoint returned %r, not the client_state saved"
                                 % (state,))
    return opt2, model2


def run_case(case, device, swap_root):
    import strata

    swap = tempfile.mkdtemp(prefix="swap-", dir=swap_root)
    ckpt_dir = tempfile.mkdtemp(prefix="ckpt-", dir=swap_root)
    try:
        ref = make(device)
        model = copy.deepcopy(ref)
        frozen0 = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
        opt = strata.torch.ZeroOptimizer(model, config=config(case, swap),
                                         param_groups=groups(model))
        topt = torch.optim.AdamW(groups(ref), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                 foreach=False)
        losses, tlosses, seconds = [], [], []
        for s in range(STEPS):
            if s == SPLIT and (case.sdict or case.ckpt):
                opt, model = fresh_optimizer(case, device, swap, opt, model, ckpt_dir)
            sync(device)
            t0 = time.perf_counter()
            losses.append(train_step(model, opt, s, case, device, True))
            sync(device)
            seconds.append(time.perf_counter() - t0)
            tlosses.append(train_step(ref, topt, s, case, device, False))
        m = masters(opt, model)
        tied = model.head.weight is model.emb.weight
        opt.close()  # the parameters become ordinary tensors holding the current values
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        mdiff, scale, differ, total = compare(m, ref)
        pdiff, _, _, _ = compare(params, ref)
        bad = []
        if not mdiff <= TOL * scale:
            bad.append("masters differ by %.3g > %.3g" % (mdiff, TOL * scale))
        if not pdiff <= TOL * scale:
            bad.append("parameters differ by %.3g > %.3g" % (pdiff, TOL * scale))
        now = dict(model.named_parameters())
        changed = [n for n, p in frozen0.items() if not torch.equal(now[n].detach().cpu(), p.cpu())]
        if changed:
            bad.append("frozen parameters changed: %s" % ", ".join(changed))
        if not tied:
            bad.append("the head's weight is no longer the embedding's")
        if model.emb.weight.device != torch.device(device) and device != "cpu":
            bad.append("the parameters left %s: %s" % (device, model.emb.weight.device))
        line = ("%s: masters max|d| %.3g, params max|d| %.3g (max|param| %.3g, rel %.2g, bound "
                "%.0e); bitwise with AdamW: %s; loss %.6f vs AdamW %.6f; %.1f ms/step"
                % (case.name, mdiff, pdiff, scale, max(mdiff, pdiff) / max(scale, 1e-30), TOL,
                   "yes" if differ == 0 else "no (%d of %d elements differ)" % (differ, total),
                   losses[-1], tlosses[-1], 1e3 * sorted(seconds)[len(seconds) // 2]))
        return bad, line
    except Exception as e:  # a failure of one case is reported; the others still run
        traceback.print_exc(limit=6)
        return ["%s: %s" % (type(e).__name__, str(e)[:400])], case.name
    finally:
        shutil.rmtree(swap, ignore_errors=True)
        shutil.rmtree(ckpt_dir, ignore_errors=True)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_default_device_case(case, device, swap_root):
    """The case under torch.set_default_device(device): factory calls without a device= go there
    (review C2: strata's host reads must name the CPU)."""
    if not hasattr(torch, "set_default_device"):
        return None, "%s: torch %s has no set_default_device" % (case.name, torch.__version__)
    torch.set_default_device(device)
    try:
        return run_case(case, device, swap_root)
    finally:
        torch.set_default_device("cpu")


def skip(why):
    print("SKIPPED: test_torch_cuda: %s" % why, flush=True)
    sys.exit(77)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("-k", dest="filter", default="", help="run the cases whose name contains this")
    a = ap.parse_args()
    if a.device == "cuda":
        if not torch.cuda.is_available():
            skip("torch %s sees no CUDA GPU (torch.version.cuda %s)"
                 % (torch.__version__, torch.version.cuda))
    import strata

    if a.device == "cuda":
        if not strata._strata.with_cuda:
            skip("this strata was built without CUDA (%s)" % strata.__file__)
        device = "cuda:%d" % torch.cuda.current_device()
        print("torch %s, CUDA %s, %s; strata %s (%s)" % (
            torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), strata.__version__,
            os.path.dirname(strata.__file__)), flush=True)
    else:
        device = "cpu"
        print("torch %s on the CPU; strata %s" % (torch.__version__, strata.__version__),
              flush=True)
    torch.manual_seed(0)
    swap_root = tempfile.mkdtemp(prefix="strata-cuda-test-", dir=os.environ.get("STRATA_TEST_SWAP"))
    failed, passed, skipped = [], 0, 0
    t0 = time.perf_counter()
    try:
        for case in CASES:
            if a.filter and a.filter not in case.name:
                continue
            if case.default_device:
                bad, line = run_default_device_case(case, device, swap_root)
            else:
                bad, line = run_case(case, device, swap_root)
            if bad is None:
                skipped += 1
                print("SKIP  " + line, flush=True)
            elif bad:
                failed.append("%s: %s" % (case.name, "; ".join(bad)))
                print("FAIL  %s -- %s" % (line, "; ".join(bad)), flush=True)
            else:
                passed += 1
                print("PASS  " + line, flush=True)
    finally:
        shutil.rmtree(swap_root, ignore_errors=True)
    print("test_torch_cuda: %d passed, %d failed, %d skipped on %s in %.0f s"
          % (passed, len(failed), skipped, device, time.perf_counter() - t0), flush=True)
    for f in failed:
        print("FAIL", f)
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
