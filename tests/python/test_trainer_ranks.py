#!/usr/bin/python3
"""transformers.Trainer's call sequence (issue 24, point 4) on one rank or several (under
`python3 -m strata.torchrun`), with gradient accumulation K = 2 (transformers is not packaged
here; the loop is what Trainer.train runs): per step model.train(), per micro-batch
`loss = model(x, y); (loss / K).backward()`, then clip_grad_norm_(model.parameters(),
max_grad_norm), optimizer.step(), lr_scheduler.step(), model.zero_grad(); after 3 steps
torch.save(optimizer.state_dict()) and a resume through load_state_dict into a fresh optimizer
and scheduler. Compared with torch.optim.AdamW (foreach=False) on the same global batch — every
rank's micro-batches, each loss / K, the gradients summed and divided by the world size (DDP's
average) — computed in each process: the FP32 masters agree within 1e-6 (strata sums the ranks'
and micro-batches' gradients in another order than torch's accumulation), stages 2 and 3. The
model: the small GPT of examples/gpt_model.py (tied embedding and head, attention, LayerNorm, no
weight decay on biases and norms).

    test_trainer_ranks.py                                   (one rank)
    launch.py --launcher torchrun --np 2 test_trainer_ranks.py
"""
import copy
import os
import sys
import tempfile
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_api as A  # noqa: E402  (the tiny GPT, batches, base_config, torch_groups)
import strata  # noqa: E402

K = 2
MAX_GRAD_NORM = 0.5
TOL = 1e-6


def rank_world():
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def micro_batch(step, k, rank, world):
    """Rank `rank`'s micro-batch k of step `step` (distinct for every step, micro-batch, rank)."""
    return A.batch((step * K + k) * world + rank)


def decay(s):
    return 1.0 / (1 + s)


def trainer_loop(model, opt, sched, start, steps, rank, world):
    """What transformers.Trainer does per optimizer step (gradient_accumulation_steps = K)."""
    losses = []
    for s in range(start, start + steps):
        model.train()
        total = 0.0
        for k in range(K):
            x, y = micro_batch(s, k, rank, world)
            loss = model(x, y)
            (loss / K).backward()
            total += float(loss) / K
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        sched.step()
        model.zero_grad()
        losses.append(total)
    return losses


def reference_loop(ref, topt, tsched, start, steps, world):
    """The same global batch on torch.optim.AdamW in this process: every rank's micro-batches."""
    for s in range(start, start + steps):
        ref.train()
        topt.zero_grad(set_to_none=True)
        for r in range(world):
            for k in range(K):
                x, y = micro_batch(s, k, r, world)
                (ref(x, y) / K).backward()
        for p in ref.parameters():
            if p.grad is not None:
                p.grad /= world
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_GRAD_NORM)
        topt.step()
        tsched.step()


class TrainerSequenceRanks(unittest.TestCase):
    def run_stage(self, stage):
        rank, world = rank_world()
        ref = A.tiny_gpt()
        model = copy.deepcopy(ref)
        self.assertIs(model.head.weight, model.wte.weight)  # tied
        # train.accumulate (import-deepspeed's gradient_accumulation_steps): the loop reads K there.
        opt = strata.torch.ZeroOptimizer(model, A.base_config(stage, train={"accumulate": K}),
                                         param_groups=A.torch_groups(model))
        self.assertEqual(opt.world, world)
        self.assertEqual(opt.config["accumulate"], K)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
        topt = torch.optim.AdamW(A.torch_groups(ref), lr=3e-3, betas=(0.9, 0.95),
                                 weight_decay=0.1, foreach=False)
        tsched = torch.optim.lr_scheduler.LambdaLR(topt, decay)
        la = trainer_loop(model, opt, sched, 0, 3, rank, world)
        reference_loop(ref, topt, tsched, 0, 3, world)
        # Trainer's checkpoint: torch.save(optimizer.state_dict()) (collective: every rank gets
        # the whole state), then a fresh optimizer and scheduler load it.
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "optimizer.pt")
            torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, path)
            opt.close()
            saved = torch.load(path)
        opt = strata.torch.ZeroOptimizer(model, A.base_config(stage),
                                         param_groups=A.torch_groups(model))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        la += trainer_loop(model, opt, sched, 3, 3, rank, world)
        reference_loop(ref, topt, tsched, 3, 3, world)
        self.assertTrue(all(x == x and x < 1e9 for x in la), la)  # finite
        got = A.master_of(opt, model)  # collective
        worst = 0.0
        for n, p in ref.named_parameters():
            if n not in got:
                continue  # the tied head: the embedding's name holds it
            d = float((got[n].reshape(-1) - p.detach().reshape(-1)).abs().max())
            worst = max(worst, d)
            self.assertLessEqual(d, TOL, "stage %d world %d: %s differs by %g" % (stage, world, n, d))
        moved = max(float((got[n].reshape(-1) - p.detach().reshape(-1)).abs().max())
                    for n, p in A.tiny_gpt().named_parameters() if n in got)
        self.assertGreater(moved, 1e-3)  # it trained: far from the initial values
        self.assertEqual(int(opt.state_dict()["state"][0]["step"]), 6)
        print("stage %d world %d K %d: max |strata - AdamW| = %g" % (stage, world, K, worst))
        opt.close()

    def test_stage2(self):
        self.run_stage(2)

    def test_stage3(self):
        self.run_stage(3)


if __name__ == "__main__":
    unittest.main()
