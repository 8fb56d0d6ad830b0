#!/usr/bin/python3
"""A torch loop written for AdamW runs unchanged on ZeroOptimizer, or fails loudly (issue 24): one
test per thing a real loop does that used to be ignored or refused — torch's clip_grad_norm_, a
layer unfrozen mid-run, DDP wrapping, stage-3 model.state_dict(), per-group betas (OneCycleLR,
CyclicLR), add_param_group. Comparisons are against torch.optim.AdamW (foreach=False) on a copy
of the model, one process.
"""
import copy
import os
import sys
import tempfile
import unittest

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint  # noqa: F401  (torch.utils.checkpoint.checkpoint)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_api as A  # noqa: E402  (the tiny GPT, batches, base_config, bitwise helpers)
import strata  # noqa: E402
from strata import errors  # noqa: E402

BETAS = (0.9, 0.95)


def adamw(groups):
    return torch.optim.AdamW(groups, lr=3e-3, betas=BETAS, weight_decay=0.1, foreach=False)


def close_to(tc, got, want, tol, what):
    for n in want:
        d = float((got[n].reshape(-1) - want[n].detach().reshape(-1).float()).abs().max())
        tc.assertLessEqual(d, tol, "%s: %s differs by %g" % (what, n, d))


class ClipGradNorm(unittest.TestCase):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), c) between backward and step clips with
    strata's global norm and returns it (it returned 0 and clipped nothing: p.grad is None once the
    hooks handed the gradient over)."""

    def run_case(self, stage, max_norm):
        ref = A.tiny_gpt()
        model = copy.deepcopy(ref)
        opt = strata.torch.ZeroOptimizer(model, A.base_config(stage), param_groups=A.torch_groups(model))
        topt = adamw(A.torch_groups(ref))
        for s in range(4):
            x, y = A.batch(s)
            loss = model(x, y)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            r = opt.step()
            topt.zero_grad()
            ref(x, y).backward()
            tnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            topt.step()
            self.assertIsInstance(norm, torch.Tensor)
            self.assertGreater(float(norm), 0.0)
            self.assertAlmostEqual(float(norm), float(tnorm), delta=1e-5 * float(tnorm))
            self.assertEqual(float(torch.tensor(r.grad_norm, dtype=torch.float32)), float(norm))
            if max_norm < float(tnorm):
                self.assertLess(r.clip_coef, 1.0)
        close_to(self, A.master_of(opt, model), dict(ref.named_parameters()), 1e-6,
                 "stage %d max_norm %g" % (stage, max_norm))
        opt.close()

    def test_clips_like_torch(self):
        for stage in (0, 2, 3):
            for max_norm in (0.05, 1e6):
                with self.subTest(stage=stage, max_norm=max_norm):
                    self.run_case(stage, max_norm)

    def test_before_backward_and_other_norms_are_refused(self):
        model = A.tiny_gpt()
        opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
        with self.assertRaisesRegex(errors.UsageError, "before the backward"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        x, y = A.batch(0)
        opt.backward(model(x, y))
        with self.assertRaisesRegex(errors.UnsupportedError, "norm_type=inf"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"))
        with self.assertRaisesRegex(errors.UnsupportedError, "of the .* parameters"):
            torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], 1.0)
        opt.clip_grad_norm_(1.0)
        self.assertTrue(opt.step().applied)  # the refusals left the optimizer usable
        opt.close()


class ChangedRequiresGrad(unittest.TestCase):
    """A layer frozen at construction and unfrozen mid-run used to train on silently without ever
    changing; now the step is refused naming it (and freezing a trained one too)."""

    def test_unfreezing_a_frozen_layer_is_refused(self):
        model = A.tiny_gpt()
        for p in model.blocks[0].parameters():
            p.requires_grad_(False)
        opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
        x, y = A.batch(0)
        opt.backward(model(x, y))
        opt.step()
        model.blocks[0].requires_grad_(True)
        with self.assertRaisesRegex(errors.UsageError, "blocks.0.*was frozen"):
            opt.backward(model(x, y))
        model.blocks[0].requires_grad_(False)  # frozen again: the loop goes on
        opt.backward(model(x, y))
        self.assertTrue(opt.step().applied)
        model.blocks[1].requires_grad_(False)
        with self.assertRaisesRegex(errors.UsageError, "blocks.1.*no longer requires grad"):
            opt.backward(model(x, y))
        opt.close()


class DDPWrapping(unittest.TestCase):
    """DDP around a model strata trains averaged the gradients twice, silently; refused now, both
    ways round."""

    def test_ddp_is_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "store"),
                                    rank=0, world_size=1)
            try:
                def net():
                    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
                model = net()
                with self.assertRaisesRegex(errors.UnsupportedError, "bare module"):
                    strata.torch.ZeroOptimizer(nn.parallel.DistributedDataParallel(net()),
                                               A.base_config(2))
                opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
                with self.assertRaisesRegex(errors.UnsupportedError, "a second time"):
                    nn.parallel.DistributedDataParallel(model)
                nn.parallel.DistributedDataParallel(net())  # other models: untouched
                opt.close()
            finally:
                dist.destroy_process_group()


class Stage3StateDict(unittest.TestCase):
    """model.state_dict() at stage 3 returned (0,)-shaped tensors unless opt.close() came first."""

    def test_full_tensors(self):
        ref = A.tiny_gpt()
        model = copy.deepcopy(ref)
        opt = strata.torch.ZeroOptimizer(model, A.base_config(3), param_groups=A.torch_groups(model))
        topt = adamw(A.torch_groups(ref))
        A.train(model, opt, 3)
        A.train(ref, topt, 3, strata_opt=False)
        want = ref.state_dict()
        for what, sd in (("model.state_dict()", model.state_dict()),
                         ("full_state_dict()", opt.full_state_dict())):
            self.assertEqual(sorted(sd), sorted(want), what)
            for k, v in want.items():
                self.assertEqual(tuple(sd[k].shape), tuple(v.shape), "%s %s" % (what, k))
            A.assert_bitwise(self, {k: v.float() for k, v in sd.items()}, want, what)
        with opt.full_parameters():
            self.assertEqual(tuple(model.head.weight.shape), tuple(ref.head.weight.shape))
        self.assertEqual(model.head.weight.numel(), 0)  # partitioned again after the block
        A.train(model, opt, 1, start=3)  # and training goes on
        opt.close()


class TorchModulesAtStage3(unittest.TestCase):
    """Stage 3 on torch's own modules (issue 24 point 3): nn.TransformerEncoderLayer and
    nn.TransformerDecoderLayer (nn.MultiheadAttention reads out_proj.weight without calling
    out_proj), tied embeddings, torch.utils.checkpoint in both modes: equal bit for bit to AdamW on
    the same model; evaluation under no_grad (the encoder's fast path) equals the reference's. These
    failed with "mat2 must be a matrix, got 1-D tensor" or a size mismatch."""

    class Net(nn.Module):
        def __init__(self, ckpt=None, decoder=False):
            super().__init__()
            torch.manual_seed(3)
            self.ckpt, self.decoder = ckpt, decoder
            self.emb = nn.Embedding(50, 16)
            self.enc = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)
            self.dec = (nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
                        if decoder else None)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.emb.weight  # tied

        def forward(self, x, y):
            h = self.emb(x)
            if self.ckpt is None:
                h = self.enc(h)
            else:
                for layer in self.enc.layers:
                    h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=self.ckpt)
            if self.dec is not None:
                h = self.dec(h, self.emb(y))
            return nn.functional.cross_entropy(self.head(h).reshape(-1, 50), y.reshape(-1))

    def data(self, s):
        g = torch.Generator().manual_seed(100 + s)
        return torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 50, (2, 8), generator=g)

    def run_case(self, **kw):
        ref = self.Net(**kw)
        model = copy.deepcopy(ref)
        opt = strata.torch.ZeroOptimizer(model, A.base_config(3), param_groups=A.torch_groups(model))
        topt = adamw(A.torch_groups(ref))
        for s in range(3):
            x, y = self.data(s)
            opt.backward(model(x, y))
            opt.step()
            topt.zero_grad()
            ref(x, y).backward()
            topt.step()
        A.assert_bitwise(self, A.master_of(opt, model), dict(ref.named_parameters()), str(kw))
        model.eval(), ref.eval()
        with torch.no_grad():
            x, y = self.data(9)
            self.assertEqual(float(model(x, y)), float(ref(x, y)), "eval %s" % kw)
        opt.close()

    def test_transformer_layers_and_tied_embedding(self):
        for kw in ({}, {"decoder": True}):
            with self.subTest(**kw):
                self.run_case(**kw)

    def test_activation_checkpointing_both_modes(self):
        for reentrant in (True, False):
            with self.subTest(use_reentrant=reentrant):
                self.run_case(ckpt=reentrant)


class ParamGroupHyperParameters(unittest.TestCase):
    """Per-group betas/eps were refused, so OneCycleLR (momentum cycle on beta1) failed at its first
    step; add_param_group was accepted and failed at step() with 'unknown group'."""

    def groups(self, m):
        return [{"params": [p for p in m.parameters() if p.dim() >= 2], "betas": (0.8, 0.99),
                 "eps": 1e-6},
                {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]

    def test_per_group_betas_and_one_cycle_bitwise(self):
        for stage in (1, 3):
            with self.subTest(stage=stage):
                ref = A.tiny_gpt()
                model = copy.deepcopy(ref)
                opt = strata.torch.ZeroOptimizer(model, A.base_config(stage),
                                                 param_groups=self.groups(model))
                topt = adamw(self.groups(ref))
                sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-3, total_steps=6)
                tsched = torch.optim.lr_scheduler.OneCycleLR(topt, max_lr=5e-3, total_steps=6)
                la = A.train(model, opt, 5, sched=sched)
                lb = A.train(ref, topt, 5, sched=tsched, strata_opt=False)
                self.assertEqual(la, lb)
                self.assertEqual([g["betas"] for g in opt.param_groups],
                                 [g["betas"] for g in topt.param_groups])
                A.assert_bitwise(self, A.master_of(opt, model), dict(ref.named_parameters()),
                                 "stage %d" % stage)
                opt.close()

    def test_cyclic_lr_as_for_adamw(self):
        """CyclicLR cycles beta1 where this torch supports it for AdamW; where it does not (torch
        < 2.0 wants 'momentum'), ZeroOptimizer fails the same way AdamW does."""
        model = A.tiny_gpt()
        opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
        try:
            torch.optim.lr_scheduler.CyclicLR(adamw(A.tiny_gpt().parameters()), 1e-4, 1e-3)
            torch_error = None
        except ValueError as e:
            torch_error = str(e)
        if torch_error is None:
            torch.optim.lr_scheduler.CyclicLR(opt, 1e-4, 1e-3)
        else:
            with self.assertRaisesRegex(ValueError, "momentum"):
                torch.optim.lr_scheduler.CyclicLR(opt, 1e-4, 1e-3)
        sched = torch.optim.lr_scheduler.CyclicLR(opt, 1e-4, 1e-3, cycle_momentum=False)
        A.train(model, opt, 2, sched=sched)
        opt.close()

    def test_add_param_group_is_refused_clearly(self):
        model = A.tiny_gpt()
        extra = nn.Linear(3, 3)
        opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
        with self.assertRaisesRegex(errors.UnsupportedError, "param_groups=\\["):
            opt.add_param_group({"params": list(extra.parameters())})
        self.assertEqual(len(opt.param_groups), 2)
        A.train(model, opt, 1)
        opt.close()


class Accumulation(unittest.TestCase):
    """Gradient accumulation (issue 26): K backwards before step(), each on a micro-batch with its
    loss scaled by 1/K, equal bit for bit to torch.optim.AdamW's loop over the same micro-batches
    (one rank: torch's p.grad adds the micro-batches in the order strata does). It used to be
    refused at the second backward."""

    def loop(self, model, opt, k, steps, strata_opt):
        for s in range(steps):
            x, y = A.batch(s, rows=6)
            if not strata_opt:
                opt.zero_grad(set_to_none=True)
            m = 6 // k
            for j in range(k):
                loss = model(x[j * m:(j + 1) * m], y[j * m:(j + 1) * m]) / k
                opt.backward(loss) if strata_opt else loss.backward()
            opt.step()

    def test_bitwise_vs_adamw(self):
        with tempfile.TemporaryDirectory() as tmp:
            nvme = dict(offload={"optimizer": {"tier": "nvme"}, "gradients": {"tier": "nvme"}},
                        tiers={"nvme": {"paths": [tmp], "direct_io": "off"},
                               "host": {"buffer_size": "256KiB"}})
            cases = [(st, k, {}) for st in range(4) for k in (1, 2, 3)]
            cases += [(2, 3, nvme), (3, 2, nvme)]
            for stage, k, more in cases:
                with self.subTest(stage=stage, k=k, nvme=bool(more)):
                    ref = A.tiny_gpt()
                    model = copy.deepcopy(ref)
                    opt = strata.torch.ZeroOptimizer(model, A.base_config(stage, **more),
                                                     param_groups=A.torch_groups(model))
                    topt = adamw(A.torch_groups(ref))
                    self.loop(model, opt, k, 3, True)
                    self.loop(ref, topt, k, 3, False)
                    A.assert_bitwise(self, A.master_of(opt, model), dict(ref.named_parameters()),
                                     "stage %d K %d" % (stage, k))
                    opt.close()

    def test_a_micro_batch_missing_a_gradient_is_refused(self):
        model = A.tiny_gpt()
        opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
        x, y = A.batch(0)
        opt.backward(model(x, y))
        opt.step()
        for p in model.blocks[1].parameters():  # a partial backward: blocks.1 gets no gradient
            p.requires_grad_(False)
        try:
            model(x, y).backward()
        finally:
            for p in model.blocks[1].parameters():
                p.requires_grad_(True)
        with self.assertRaisesRegex(errors.UsageError, "arrived again .micro-batch 2. before"):
            model(x, y).backward()
        opt.close()


class CheckpointResume(unittest.TestCase):
    """load_checkpoint restores every group's lr (and weight decay, betas, eps) and returns the
    loop's client_state: a resume through opt.load_checkpoint + sched.load_state_dict continues
    bit for bit. The lr used to stay the constructor's, so the first resumed step was wrong."""

    def test_resume_restores_groups_and_client_state(self):
        decay = lambda s: 0.5 ** s  # noqa: E731
        with tempfile.TemporaryDirectory() as tmp:
            model = A.tiny_gpt()
            opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
            opt.param_groups[1]["betas"] = (0.8, 0.9)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
            A.train(model, opt, 3, sched=sched)
            opt.save_checkpoint(tmp, client_state={"step": 3, "sched": sched.state_dict()})
            want = A.train(model, opt, 2, start=3, sched=sched)
            want_groups = [(g["lr"], g["betas"]) for g in opt.param_groups]
            opt.close()

            model = A.tiny_gpt(seed=9)  # other initial values: the checkpoint brings them
            opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
            state = opt.load_checkpoint(tmp)
            self.assertEqual(state["step"], 3)
            self.assertEqual(opt.param_groups[1]["betas"], (0.8, 0.9))
            sched.load_state_dict(state["sched"])
            got = A.train(model, opt, 2, start=3, sched=sched)
            self.assertEqual(got, want)
            self.assertEqual([(g["lr"], g["betas"]) for g in opt.param_groups], want_groups)
            with self.assertRaisesRegex(errors.InvalidArgumentError, "not JSON"):
                opt.save_checkpoint(tmp, client_state={"f": lambda: 0})
            self.assertEqual(opt.load_checkpoint(tmp)["step"], 3)  # the failed save wrote nothing
            opt.close()


class AsyncCheckpoint(unittest.TestCase):
    """save_checkpoint(blocking=False) returns after a snapshot; the training goes on while the
    shards are written; wait_checkpoint() commits. The checkpoint equals a blocking save of the
    same step, and the steps after it are those of a run that did not save."""

    def test_async_equals_blocking(self):
        with tempfile.TemporaryDirectory() as a_dir, tempfile.TemporaryDirectory() as b_dir:
            model = A.tiny_gpt()
            opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
            A.train(model, opt, 3)
            opt.save_checkpoint(b_dir, client_state={"step": 3})
            blocked = opt.save_checkpoint(a_dir, client_state={"step": 3}, blocking=False)
            self.assertGreaterEqual(blocked, 0.0)
            self.assertTrue(opt.checkpoint_pending)
            after = A.train(model, opt, 2, start=3)
            opt.wait_checkpoint()
            self.assertFalse(opt.checkpoint_pending)
            opt.close()

            model = A.tiny_gpt()
            opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
            A.train(model, opt, 3)
            self.assertEqual(A.train(model, opt, 2, start=3), after)  # the save changed nothing
            opt.close()

            got = []
            for d in (a_dir, b_dir):
                model = A.tiny_gpt(seed=9)
                opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
                self.assertEqual(opt.load_checkpoint(d)["step"], 3)
                got.append(A.train(model, opt, 2, start=3))
                opt.close()
            self.assertEqual(got[0], got[1])
            self.assertEqual(got[0], after)


class ZeroGrad(unittest.TestCase):
    """zero_grad() between backward and step drops the gradients, as torch's does (it used to
    raise), and after step() refused a missing gradient it lets the loop go on (it used to leave
    the optimizer stuck: backward, zero_grad and step all raised from then on)."""

    def test_drops_like_torch(self):
        with tempfile.TemporaryDirectory() as tmp:
            nvme = dict(offload={"optimizer": {"tier": "nvme"}, "gradients": {"tier": "nvme"}},
                        tiers={"nvme": {"paths": [tmp], "direct_io": "off"}})
            for stage, more in ((0, {}), (2, {}), (3, {}), (2, nvme)):
                with self.subTest(stage=stage, nvme=bool(more)):
                    ref = A.tiny_gpt()
                    model = copy.deepcopy(ref)
                    opt = strata.torch.ZeroOptimizer(model, A.base_config(stage, **more),
                                                     param_groups=A.torch_groups(model))
                    topt = adamw(A.torch_groups(ref))
                    for m, o, strata_opt in ((model, opt, True), (ref, topt, False)):
                        for s in range(3):
                            x, y = A.batch(s)
                            o.zero_grad()
                            m(*A.batch(s + 50)).backward()  # dropped by the zero_grad below
                            o.zero_grad()
                            m(x, y).backward()
                            o.step()
                    A.assert_bitwise(self, A.master_of(opt, model), dict(ref.named_parameters()),
                                     "stage %d" % stage)
                    opt.close()

    def test_a_missing_gradient_does_not_leave_the_optimizer_stuck(self):
        model = A.tiny_gpt()
        model.extra = nn.Linear(4, 4)
        opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
        x, y = A.batch(0)
        opt.backward(model(x, y))
        with self.assertRaisesRegex(errors.UsageError, "'extra.weight'.*never arrived"):
            opt.step()
        opt.zero_grad()
        opt.backward(model(x, y) + model.extra(torch.ones(1, 4)).sum())
        self.assertTrue(opt.step().applied)
        opt.close()


class TrainerSequence(unittest.TestCase):
    """transformers.Trainer's call sequence (transformers is not packaged here): model.train(),
    loss.backward(), clip_grad_norm_(model.parameters(), max_grad_norm), optimizer.step(),
    lr_scheduler.step(), model.zero_grad(); then torch.save(optimizer.state_dict()) and a resume
    through load_state_dict into a fresh optimizer and scheduler — against the same loop on AdamW
    (tied embeddings: the GPT's head is its token embedding)."""

    def loop(self, model, opt, sched, start, steps, max_grad_norm=0.5):
        losses = []
        for s in range(start, start + steps):
            model.train()
            x, y = A.batch(s)
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            sched.step()
            model.zero_grad()
            losses.append(float(loss))
        return losses

    def test_trainer_sequence_with_resume(self):
        for stage in (2, 3):
            with self.subTest(stage=stage):
                ref = A.tiny_gpt()
                model = copy.deepcopy(ref)
                decay = lambda s: 1.0 / (1 + s)  # noqa: E731
                opt = strata.torch.ZeroOptimizer(model, A.base_config(stage),
                                                 param_groups=A.torch_groups(model))
                sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
                topt = adamw(A.torch_groups(ref))
                tsched = torch.optim.lr_scheduler.LambdaLR(topt, decay)
                la = self.loop(model, opt, sched, 0, 3)
                lb = self.loop(ref, topt, tsched, 0, 3)
                with tempfile.TemporaryDirectory() as tmp:
                    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()},
                               os.path.join(tmp, "state.pt"))
                    opt.close()
                    saved = torch.load(os.path.join(tmp, "state.pt"))
                opt = strata.torch.ZeroOptimizer(model, A.base_config(stage),
                                                 param_groups=A.torch_groups(model))
                sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
                opt.load_state_dict(saved["opt"])
                sched.load_state_dict(saved["sched"])
                la += self.loop(model, opt, sched, 3, 3)
                lb += self.loop(ref, topt, tsched, 3, 3)
                for a, b in zip(la, lb):
                    self.assertAlmostEqual(a, b, delta=1e-6 * abs(b))
                close_to(self, A.master_of(opt, model), dict(ref.named_parameters()), 1e-6,
                         "stage %d" % stage)
                opt.close()


if __name__ == "__main__":
    unittest.main()
