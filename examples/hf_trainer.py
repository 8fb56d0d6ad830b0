#!/usr/bin/python3
"""transformers' Trainer with strata: a GPT-2 built from a config (no download, no tokenizer)
trained by `Trainer(..., optimizers=(ZeroOptimizer(model, config=...), scheduler))`, then the
same Trainer with torch.optim.AdamW; prints both loss curves and the largest difference, and exits
1 when the losses differ by more than --tol (1e-4) at any micro-batch.

  PYTHONPATH=build/python python3 examples/hf_trainer.py                 # on the GPU
  PYTHONPATH=build/python python3 examples/hf_trainer.py --device cpu
  PYTHONPATH=build/python python3 examples/hf_trainer.py --set zero.stage=3 \\
      --set offload.optimizer.tier=nvme --set "tiers.nvme.paths=[/mnt/nvme/swap]"

The model: transformers.GPT2Config (2 layers, n_embd 64, 4 heads, a byte vocabulary of 256, no
dropout). The data: byte windows of --data FILE, else of /usr/share/common-licenses (Debian and
Ubuntu have it), else a generated corpus (examples/gpt_model.py's load_corpus). What the Trainer
does with the optimizer (transformers 4.x with accelerate): accelerate's prepare() wraps it
(AcceleratedOptimizer: a state_dict() / load_state_dict() round trip moving the state to the
device), then per step loss.backward() per micro-batch (gradient accumulation --accumulate),
accelerator.clip_grad_norm_(model.parameters(), max_grad_norm) (torch's clip_grad_norm_, which
strata recognizes), optimizer.step(), lr_scheduler.step(), zero_grad(). The optimizer must be made
after the model is on its device (Trainer's own .to() is then a no-op).

Default strata config: zero.stage 2, the Adam state in host memory (offload.optimizer.tier cpu:
the CPU Adam), fp32; --config / --set change it. Needs transformers (and accelerate).
"""
import argparse
import dataclasses
import math
import os
import sys
import tempfile


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--config", help="strata YAML (default: stage 2, Adam state in host memory)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="strata config override (repeatable), e.g. zero.stage=3")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps")
    ap.add_argument("--rows", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--data", help="a text file (default: /usr/share/common-licenses)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--tol", type=float, default=1e-4, help="largest |loss - AdamW's| allowed")
    return ap.parse_args()


A = parse()
if A.device == "cuda" and "CUDA_VISIBLE_DEVICES" not in os.environ:
    # One process, one GPU: with several visible, Trainer would wrap the model in DataParallel
    # (copies of the parameters strata does not train).
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_model as G  # noqa: E402
import strata  # noqa: E402

try:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers import get_linear_schedule_with_warmup
except ImportError as e:
    raise SystemExit("hf_trainer: needs transformers (pip install transformers accelerate): %s" % e)

BETAS, EPS = (0.9, 0.999), 1e-8


class Windows(torch.utils.data.Dataset):
    """Fixed byte windows of the corpus: input_ids = labels (the model shifts them)."""

    def __init__(self, data, n, seq_len, seed):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(data) - seq_len - 1, (n,), generator=g).tolist()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.rows = [buf[s:s + seq_len].long() for s in starts]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class RecordingTrainer(Trainer):
    """Trainer that keeps every micro-batch's loss unrounded (its logs round to 4 digits)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.micro_losses = []

    def compute_loss(self, model, inputs, *args, **kwargs):
        out = super().compute_loss(model, inputs, *args, **kwargs)
        loss = out[0] if isinstance(out, tuple) else out
        self.micro_losses.append(float(loss.detach()))
        return out


def training_args(out_dir):
    """TrainingArguments for this run, with the names this transformers version has."""
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    kw = dict(output_dir=out_dir, per_device_train_batch_size=A.rows,
              gradient_accumulation_steps=A.accumulate, max_steps=A.steps, learning_rate=A.lr,
              weight_decay=A.weight_decay, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
              adam_epsilon=EPS, max_grad_norm=A.max_grad_norm, logging_steps=1,
              save_strategy="no", report_to="none", seed=A.seed, data_seed=A.seed,
              dataloader_num_workers=0, dataloader_pin_memory=False, disable_tqdm=True,
              remove_unused_columns=False)
    if A.device == "cpu":
        kw["use_cpu" if "use_cpu" in fields else "no_cuda"] = True
    return TrainingArguments(**{k: v for k, v in kw.items() if k in fields})


def make_model(device):
    torch.manual_seed(A.seed)
    cfg = GPT2Config(vocab_size=G.VOCAB, n_positions=A.seq_len, n_embd=64, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).to(device)


def strata_config():
    if A.config:
        return A.config
    return {"zero": {"stage": 2}, "offload": {"optimizer": {"tier": "cpu"}},
            "optimizer": {"type": "adamw", "lr": A.lr, "betas": list(BETAS), "eps": EPS,
                          "weight_decay": A.weight_decay},
            "precision": {"params": "fp32", "grads": "fp32"}}


def train(kind, args, dataset):
    model = make_model(args.device)
    groups = strata.torch.no_decay_param_groups(model, weight_decay=A.weight_decay)
    if kind == "strata":
        opt = strata.torch.ZeroOptimizer(model, config=strata_config(), overrides=A.set,
                                         param_groups=groups)
        what = "strata ZeroOptimizer (zero.stage %d, Adam state on %s)" % (
            opt.stage, opt.config["optimizer_tier"])
    else:
        opt = torch.optim.AdamW(groups, lr=A.lr, betas=BETAS, eps=EPS,
                                weight_decay=A.weight_decay, foreach=False)
        what = "torch.optim.AdamW"
    sched = get_linear_schedule_with_warmup(opt, A.warmup, A.steps)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=dataset,
                               optimizers=(opt, sched))
    out = trainer.train()
    if kind == "strata":
        opt.close()
    print("%s: %d steps, %d micro-batches, final training loss %.4f"
          % (what, out.global_step, len(trainer.micro_losses), out.training_loss), flush=True)
    return trainer.micro_losses, what


def main():
    if A.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("hf_trainer: torch %s sees no GPU (--device cpu)" % torch.__version__)
    data = G.load_corpus(A.data)
    dataset = Windows(data, A.steps * A.accumulate * A.rows, A.seq_len, A.seed)
    with tempfile.TemporaryDirectory(prefix="hf-trainer-") as tmp:
        args = training_args(tmp)
        print("transformers %s, torch %s, strata %s on %s; GPT-2 %d layers, n_embd 64; %d steps "
              "of %d x %d sequences of %d bytes, max_grad_norm %g"
              % (transformers.__version__, torch.__version__, strata.__version__, args.device,
                 2, A.steps, A.accumulate, A.rows, A.seq_len, A.max_grad_norm), flush=True)
        ours, what = train("strata", args, dataset)
        theirs, _ = train("adamw", args, dataset)
    if not ours or len(ours) != len(theirs):
        print("hf_trainer: FAIL: %d micro-batch losses with strata, %d with AdamW"
              % (len(ours), len(theirs)))
        return 1
    print("%6s %12s %12s %10s" % ("micro", "strata", "AdamW", "|diff|"))
    for i, (a, b) in enumerate(zip(ours, theirs)):
        print("%6d %12.6f %12.6f %10.3g" % (i + 1, a, b, abs(a - b)))
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    ok = worst <= A.tol and all(math.isfinite(x) for x in ours)
    print("hf_trainer: %s max |loss - AdamW's| %.3g over %d micro-batches (bound %g); %s on %s; "
          "loss %.4f -> %.4f" % ("PASS" if ok else "FAIL", worst, len(ours), A.tol, what,
                                 args.device, ours[0], ours[-1]), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
