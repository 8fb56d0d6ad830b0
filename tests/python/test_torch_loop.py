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
import warnings

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
    """Issue 48, point 3: freezing and unfreezing as torch.optim.AdamW. A layer frozen when the
    optimizer is built is in it (refused before) and trains once unfrozen; a trained layer frozen
    mid-run is skipped (no update, no decay, moments untouched, not in the clip norm; refused
    before). Bitwise AdamW(model.parameters()) through the same toggles, with clipping."""

    def run_toggles(self, stage):
        ref = A.tiny_gpt()
        model = copy.deepcopy(ref)
        for m in (ref, model):
            m.blocks[0].requires_grad_(False)
        opt = strata.torch.ZeroOptimizer(model, A.base_config(stage),
                                         param_groups=[{"params": list(model.parameters())}])
        topt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                 foreach=False)
        for s in range(6):
            if s == 2:  # unfrozen
                for m in (ref, model):
                    m.blocks[0].requires_grad_(True)
            if s == 4:  # another frozen mid-run
                for m in (ref, model):
                    m.blocks[1].requires_grad_(False)
            x, y = A.batch(s)
            opt.backward(model(x, y))
            n = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
            opt.step()
            topt.zero_grad(set_to_none=True)
            ref(x, y).backward()
            tn = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
            topt.step()
            self.assertAlmostEqual(n, tn, delta=1e-5 * tn, msg="stage %d step %d" % (stage, s))
        got = A.master_of(opt, model)
        for name, p in ref.named_parameters():
            if name in got:
                d = float((got[name].reshape(-1) - p.detach().reshape(-1)).abs().max())
                self.assertLess(d, 1e-5, "stage %d: %s differs by %g" % (stage, name, d))
        init = dict(A.tiny_gpt().named_parameters())
        for name in ("blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"):
            if name in got:  # both trained some steps: not their initial values
                self.assertGreater(float((got[name] - init[name].detach()).abs().max()), 1e-4)
        opt.close()

    def test_freezing_and_unfreezing_as_adamw(self):
        for stage in (1, 2, 3):
            self.run_toggles(stage)

    def test_a_parameter_left_out_and_unfrozen_is_refused(self):
        model = A.tiny_gpt()
        held = [p for n, p in model.named_parameters() if not n.startswith("blocks.0.")]
        opt = strata.torch.ZeroOptimizer(model, A.base_config(2), param_groups=[{"params": held}])
        for p in model.blocks[0].parameters():
            p.requires_grad_(False)
        x, y = A.batch(0)
        opt.backward(model(x, y))
        opt.step()
        model.blocks[0].requires_grad_(True)
        with self.assertRaisesRegex(errors.UsageError, "blocks.0.*not in the optimizer"):
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

    def test_bf16_bitwise_vs_adamw_on_fp32_master(self):
        """bf16 parameters and gradients, K = 2 at stage 2 (one rank): the micro-batches' bf16
        gradients summed as torch's p.grad sums them (grad_accum bf16: one FP32 add rounded to
        bf16) or in FP32 (grad_accum fp32), then torch AdamW on FP32 master weights."""
        for accum in ("bf16", "fp32"):
            with self.subTest(grad_accum=accum):
                master = A.tiny_gpt()
                with torch.no_grad():  # strata's master starts from the bf16 model's values
                    for p in master.parameters():
                        p.copy_(p.to(torch.bfloat16).float())
                model = copy.deepcopy(master).to(torch.bfloat16)
                half = copy.deepcopy(model)  # the reference's bf16 model
                prec = {"params": "bf16", "grads": "bf16", "grad_accum": accum}
                opt = strata.torch.ZeroOptimizer(model, A.base_config(2, precision=prec),
                                                 param_groups=A.torch_groups(model))
                topt = adamw(A.torch_groups(master))
                for s in range(2):
                    x, y = A.batch(s, rows=6)
                    for j in range(2):
                        opt.backward(model(x[j * 3:(j + 1) * 3], y[j * 3:(j + 1) * 3]) / 2)
                    opt.step()
                    sums = [None] * len(list(half.parameters()))
                    for j in range(2):
                        half.zero_grad(set_to_none=True)
                        (half(x[j * 3:(j + 1) * 3], y[j * 3:(j + 1) * 3]) / 2).backward()
                        for i, p in enumerate(half.parameters()):
                            g = p.grad.float() if accum == "fp32" else p.grad
                            sums[i] = g if sums[i] is None else (
                                sums[i] + g if accum == "fp32"
                                else (sums[i].float() + g.float()).to(torch.bfloat16))
                    for pm, g in zip(master.parameters(), sums):
                        pm.grad = g.float()
                    topt.step()
                    with torch.no_grad():
                        for ph, pm in zip(half.parameters(), master.parameters()):
                            ph.copy_(pm.to(torch.bfloat16))
                A.assert_bitwise(self, A.master_of(opt, model), dict(master.named_parameters()),
                                 "bf16 K 2 grad_accum " + accum)
                opt.close()

    def test_a_micro_batch_missing_a_gradient_is_refused(self):
        model = A.tiny_gpt()
        opt = strata.torch.ZeroOptimizer(model, A.base_config(2), unused_parameters="error")
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

    def resumed(self, *dirs):
        """Two more steps of a fresh model (other initial values) resumed from each checkpoint
        of step 3."""
        got = []
        for d in dirs:
            model = A.tiny_gpt(seed=9)
            opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
            self.assertEqual(opt.load_checkpoint(d)["step"], 3)
            got.append(A.train(model, opt, 2, start=3))
            opt.close()
        return got

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

            got = self.resumed(a_dir, b_dir)
            self.assertEqual(got[0], got[1])
            self.assertEqual(got[0], after)


    def test_close_commits_the_pending_save(self):
        """close() with an asynchronous save still pending waits for its writer and commits it
        (it used to drop the engine with the save uncommitted: the directory held no checkpoint)."""
        with tempfile.TemporaryDirectory() as a_dir, tempfile.TemporaryDirectory() as b_dir:
            model = A.tiny_gpt()
            opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
            A.train(model, opt, 3)
            opt.save_checkpoint(b_dir, client_state={"step": 3})
            opt.save_checkpoint(a_dir, client_state={"step": 3}, blocking=False)
            self.assertTrue(opt.checkpoint_pending)
            opt.close()
            self.assertTrue(os.path.exists(os.path.join(a_dir, "manifest.json")))
            got = self.resumed(a_dir, b_dir)
            self.assertEqual(got[0], got[1])


class GradientsReadable(unittest.TestCase):
    """p.grad after a backward (issue 48, point 2): it was None after every backward, so gradient
    logging read nothing. Stages 0-1: a view of the engine's gradient (a write reaches the step);
    stage 2 with keep_grads=True: torch's own accumulated tensor; None again after step()."""

    def run_case(self, stage, keep, k=2):
        ref = A.tiny_gpt()
        model = copy.deepcopy(ref)
        opt = strata.torch.ZeroOptimizer(model, A.base_config(stage),
                                         param_groups=A.torch_groups(model), keep_grads=keep)
        topt = adamw(A.torch_groups(ref))
        for s in range(3):
            topt.zero_grad(set_to_none=True)
            x, y = A.batch(s, rows=4)
            for j in range(k):
                for m in (model, ref):
                    (m(x[2 * j:2 * j + 2], y[2 * j:2 * j + 2]) / k).backward()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                self.assertIsNotNone(p.grad, "stage %d step %d: %s" % (stage, s, n))
                self.assertTrue(torch.equal(p.grad, q.grad), "stage %d step %d: %s's p.grad"
                                % (stage, s, n))
            opt.step()
            topt.step()
            self.assertTrue(all(p.grad is None for p in model.parameters()))
        A.assert_bitwise(self, A.master_of(opt, model), dict(ref.named_parameters()),
                         "stage %d" % stage)
        opt.close()

    def test_views_at_stages_0_and_1(self):
        for stage in (0, 1):
            with self.subTest(stage=stage):
                self.run_case(stage, keep=False)

    def test_kept_at_stage_2_on_request(self):
        self.run_case(2, keep=True)
        model = A.tiny_gpt()
        opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
        x, y = A.batch(0)
        model(x, y).backward()
        self.assertTrue(all(p.grad is None for p in model.parameters()))  # the default: no memory
        opt.close()

    def test_a_write_into_the_view_is_stepped(self):
        """Scaling p.grad in place (a loop's own unscaling) changes the update as torch's does."""
        ref = A.tiny_gpt()
        model = copy.deepcopy(ref)
        opt = strata.torch.ZeroOptimizer(model, A.base_config(1),
                                         param_groups=A.torch_groups(model))
        topt = adamw(A.torch_groups(ref))
        for s in range(2):
            topt.zero_grad(set_to_none=True)
            x, y = A.batch(s)
            for m in (model, ref):
                m(x, y).backward()
                for p in m.parameters():
                    p.grad.mul_(0.25 + s)
            opt.step()
            topt.step()
        A.assert_bitwise(self, A.master_of(opt, model), dict(ref.named_parameters()), "scaled")
        opt.close()

    def test_keep_grads_at_stage_3_is_refused(self):
        with self.assertRaisesRegex(errors.InvalidArgumentError, r"keep_grads=True\) at zero.stage 3"):
            strata.torch.ZeroOptimizer(A.tiny_gpt(), A.base_config(3), keep_grads=True)


class TensorOrder(unittest.TestCase):
    """The engine holds the parameters in the model's order whatever their groups (its
    checkpoint's tensor list says so), so that the backward completes gradient buckets as it goes:
    registered group by group, the no-decay group's biases and norms of every layer shared the
    top bucket, which several ranks reduce first and which completed only at the last hand-in.
    torch's indices (state_dict, param_groups) stay the groups' order."""

    def test_model_order_in_the_engine_group_order_in_state_dict(self):
        import json
        model = A.tiny_gpt()
        groups = A.torch_groups(model)
        opt = strata.torch.ZeroOptimizer(model, A.base_config(2), param_groups=groups)
        with tempfile.TemporaryDirectory() as d:
            opt.save_checkpoint(d)
            with open(os.path.join(d, "manifest.json")) as f:
                tensors = json.load(f)["tensors"]
        names = [t["name"] if isinstance(t, dict) else t for t in tensors]
        self.assertEqual(names, [n for n, _ in model.named_parameters()])
        in_groups = [p for g in groups for p in g["params"]]
        self.assertNotEqual([id(p) for p in in_groups], [id(p) for p in model.parameters()])
        sd = opt.state_dict()
        for i, p in enumerate(in_groups):
            self.assertEqual(tuple(sd["state"][i]["master"].shape), tuple(p.shape), i)
        opt.close()


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
        opt = strata.torch.ZeroOptimizer(model, A.base_config(2), unused_parameters="error")
        x, y = A.batch(0)
        opt.backward(model(x, y))
        with self.assertRaisesRegex(errors.UsageError, "'extra.weight'.*never arrived"):
            opt.step()
        opt.zero_grad()
        opt.backward(model(x, y) + model.extra(torch.ones(1, 4)).sum())
        self.assertTrue(opt.step().applied)
        opt.close()


class WithHeads(nn.Module):
    """The tiny GPT, a head the loss never uses and one it uses on odd steps only."""

    def __init__(self):
        super().__init__()
        self.gpt = A.tiny_gpt()
        torch.manual_seed(11)
        self.unused = nn.Linear(8, 8)
        self.alt = nn.Linear(8, 1)

    def forward(self, x, y, step, use_alt=None):
        loss = self.gpt(x, y)
        if (step % 2 == 1) if use_alt is None else use_alt:
            loss = loss + 0.1 * self.alt(torch.linspace(-1, 1, 8).reshape(1, 8)).sum()
        return loss


class UnusedParameters(unittest.TestCase):
    """A parameter the loss does not use (an unused head; one used every other step) is skipped by
    that step's update as torch.optim.AdamW skips p.grad None — no update, no weight decay, its
    own step count stays, so its later bias correction uses its own count — with a warning once
    per parameter. Bitwise against AdamW; state_dict's per-parameter steps equal torch's; a
    checkpoint and a torch state_dict with differing counts resume bitwise. It used to raise at
    step() ("never arrived")."""

    NAMES = ("unused.weight", "unused.bias", "alt.weight", "alt.bias")

    def loop(self, model, opt, start, steps, strata_opt, clip=False):
        for s in range(start, start + steps):
            x, y = A.batch(s)
            if not strata_opt:
                opt.zero_grad(set_to_none=True)  # torch 1.13's default would zero, not None
            model(x, y, s).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()

    def check(self, opt, model, ref, topt, what, clip=False):
        if clip:  # the clip norm's summation order differs from torch's: within 1e-6
            close_to(self, A.master_of(opt, model), dict(ref.named_parameters()), 1e-6, what)
        else:
            A.assert_bitwise(self, A.master_of(opt, model), dict(ref.named_parameters()), what)
        sd = opt.state_dict()
        tsd = topt.state_dict()["state"]
        for i, (n, p) in enumerate(ref.named_parameters()):
            want = float(tsd[i]["step"]) if i in tsd else 0.0  # torch: no state, never stepped
            self.assertEqual(float(sd["state"][i]["step"]), want, "%s: step of %s" % (what, n))

    def cases(self, tmp):
        nvme = dict(offload={"optimizer": {"tier": "nvme"}, "gradients": {"tier": "nvme"}},
                    tiers={"nvme": {"paths": [tmp], "direct_io": "off"},
                           "host": {"buffer_size": "256KiB"}})
        return [(0, {}), (3, {}), (2, nvme), (3, nvme)]

    def test_bitwise_vs_adamw_warned_once(self):
        with tempfile.TemporaryDirectory() as tmp:
            for stage, more in self.cases(tmp):
                for clip in (False, True):
                    with self.subTest(stage=stage, nvme=bool(more), clip=clip):
                        ref = WithHeads()
                        model = copy.deepcopy(ref)
                        with warnings.catch_warnings(record=True) as caught:
                            warnings.simplefilter("always")
                            opt = strata.torch.ZeroOptimizer(model, A.base_config(stage, **more),
                                                             param_groups=A.torch_groups(model))
                            self.loop(model, opt, 0, 5, True, clip)
                        topt = adamw(A.torch_groups(ref))
                        self.loop(ref, topt, 0, 5, False, clip)
                        self.check(opt, model, ref, topt, "stage %d" % stage, clip)
                        said = [str(w.message) for w in caught if "got no gradient" in str(w.message)]
                        self.assertEqual(len(said), len(self.NAMES), said)
                        for n in self.NAMES:
                            self.assertEqual(sum("'%s'" % n in m for m in said), 1, (n, said))
                        opt.close()

    def pair(self, stage):
        """WithHeads and its copy; strata (unused parameters skipped silently) and AdamW on them."""
        ref = WithHeads()
        model = copy.deepcopy(ref)
        opt = strata.torch.ZeroOptimizer(model, A.base_config(stage), unused_parameters="ignore",
                                         param_groups=A.torch_groups(model))
        return ref, model, opt, adamw(A.torch_groups(ref))

    def test_zero_grad_keeping_zeros_steps_them_as_adamw(self):
        """zero_grad(set_to_none=False) (torch 1.13's default): AdamW steps a parameter on its
        zero p.grad once it had a gradient ('alt' on even steps after step 1); one that never had
        one ('unused') stays skipped. It was skipped either way."""
        for stage in (0, 2, 3):
            with self.subTest(stage=stage):
                ref, model, opt, topt = self.pair(stage)
                for m, o in ((model, opt), (ref, topt)):
                    for s in range(5):
                        x, y = A.batch(s)
                        o.zero_grad(set_to_none=False)
                        m(x, y, s).backward()
                        o.step()
                self.check(opt, model, ref, topt, "stage %d" % stage)
                sd = opt.state_dict()["state"]
                names = {id(p): n for n, p in model.named_parameters()}
                in_groups = [p for g in opt.param_groups for p in g["params"]]
                steps = {names[id(p)]: float(sd[i]["step"]) for i, p in enumerate(in_groups)}
                self.assertEqual(steps["alt.weight"], 4.0)  # steps 1-4: used, zeros, used, zeros
                self.assertEqual(steps["unused.weight"], 0.0)
                opt.close()

    def test_checkpoint_and_state_dict_keep_each_parameters_step(self):
        with tempfile.TemporaryDirectory() as tmp:
            ref = WithHeads()
            model = copy.deepcopy(ref)
            opt = strata.torch.ZeroOptimizer(model, A.base_config(2), unused_parameters="ignore",
                                             param_groups=A.torch_groups(model))
            topt = adamw(A.torch_groups(ref))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.loop(model, opt, 0, 4, True)
            self.assertFalse([w for w in caught if "got no gradient" in str(w.message)])
            self.loop(ref, topt, 0, 4, False)
            ckpt = os.path.join(tmp, "ckpt")
            opt.save_checkpoint(ckpt)
            torch_state = copy.deepcopy(topt.state_dict())  # alt: step 2, unused: no state
            opt.close()
            self.loop(ref, topt, 4, 3, False)
            for stage in (3, 1):  # resharded: another stage
                with self.subTest(via="checkpoint", stage=stage):
                    model = WithHeads()
                    opt = strata.torch.ZeroOptimizer(model, A.base_config(stage),
                                                     unused_parameters="ignore",
                                                     param_groups=A.torch_groups(model))
                    opt.load_checkpoint(ckpt)
                    self.loop(model, opt, 4, 3, True)
                    self.check(opt, model, ref, topt, "resumed at stage %d" % stage)
                    opt.close()
            with self.subTest(via="torch AdamW state_dict"):
                model = copy.deepcopy(ref)
                back = WithHeads()  # the model as it was at step 4: replay torch to get it
                tb = adamw(A.torch_groups(back))
                self.loop(back, tb, 0, 4, False)
                model.load_state_dict(back.state_dict())
                opt = strata.torch.ZeroOptimizer(model, A.base_config(3), unused_parameters="ignore",
                                                 param_groups=A.torch_groups(model))
                opt.load_state_dict(torch_state)
                self.loop(model, opt, 4, 3, True)
                self.check(opt, model, ref, topt, "from torch's state_dict")
                opt.close()


    def test_accumulation_a_head_missing_from_a_micro_batch(self):
        # K = 2: on odd steps alt is used in the first micro-batch only (its gradient: that one's;
        # the second adds nothing), on even steps in none (skipped).
        for stage in (1, 2):
            with self.subTest(stage=stage):
                ref, model, opt, topt = self.pair(stage)
                for m, o, strata_opt in ((model, opt, True), (ref, topt, False)):
                    for s in range(4):
                        x, y = A.batch(s, rows=4)
                        if not strata_opt:
                            o.zero_grad(set_to_none=True)
                        (m(x[:2], y[:2], s) / 2).backward()
                        (m(x[2:], y[2:], 0) / 2).backward()
                        o.step()
                self.check(opt, model, ref, topt, "K 2 stage %d" % stage)
                opt.close()

    def test_two_ranks_a_head_used_on_one(self):
        """2 ranks (gloo, as under torchrun), stages 1 and 2 with many buckets: alt is used on rank
        0 only on odd steps, on rank 1 only at step 2, by none on the others (no unused head). Each
        rank checks its state bitwise against AdamW on the rank-ordered sum (zeros where a rank did
        not use a parameter, None where none did) / 2."""
        import socket
        import subprocess
        import time
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            procs, outs = [], [os.path.join(tmp, "rank%d.txt" % r) for r in range(2)]
            for r in range(2):
                env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                           LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                           OMP_NUM_THREADS="1")
                procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                               "unused-worker", outs[r]], env=env))
            deadline = time.monotonic() + 300
            for p in procs:
                try:
                    p.wait(timeout=max(1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    for q in procs:
                        q.kill()
                    self.fail("a rank hung (killed after 300 s)")
            for r, p in enumerate(procs):
                self.assertEqual(p.returncode, 0, "rank %d" % r)
                with open(outs[r]) as f:
                    self.assertEqual(f.read(), "ok", "rank %d" % r)

    def test_a_bad_choice_is_refused(self):
        with self.assertRaisesRegex(errors.InvalidArgumentError, "'warn', 'ignore' or 'error'"):
            strata.torch.ZeroOptimizer(WithHeads(), A.base_config(2), unused_parameters="skip")


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


class WhatTheLoopChanges(unittest.TestCase):
    """What a loop changes between steps reaches the engine before the next update (a review
    found: weights loaded into the model after building the optimizer were thrown away at the next
    step; a scheduler's lr reached the engine only at step(), after the speculative update had run
    with the old one, so every overlapped step rolled back), and what strata cannot honour is
    refused (maximize, amsgrad; a plain loss.backward() under a loss scale)."""

    def test_weights_loaded_after_building_the_optimizer_train_from_there(self):
        pretrained = A.tiny_gpt(seed=9).state_dict()
        for stage in (0, 1, 2):
            with self.subTest(stage=stage):
                model = A.tiny_gpt()
                opt = strata.torch.ZeroOptimizer(model, A.base_config(stage),
                                                 param_groups=A.torch_groups(model))
                model.load_state_dict(pretrained)  # after the optimizer: what fine-tuning does
                ref = A.tiny_gpt()
                ref.load_state_dict(pretrained)
                topt = adamw(A.torch_groups(ref))
                la = A.train(model, opt, 3)
                lb = A.train(ref, topt, 3, strata_opt=False)
                self.assertEqual(la, lb)
                A.assert_bitwise(self, A.master_of(opt, model), dict(ref.named_parameters()),
                                 "stage %d" % stage)
                with torch.no_grad():  # an in-place write between steps: nn.init, a clamp
                    for p, q in zip(model.parameters(), ref.parameters()):
                        p.clamp_(-0.05, 0.05)
                        q.clamp_(-0.05, 0.05)
                self.assertEqual(A.train(model, opt, 2, start=3),
                                 A.train(ref, topt, 2, start=3, strata_opt=False))
                A.assert_bitwise(self, A.master_of(opt, model), dict(ref.named_parameters()),
                                 "stage %d after the clamp" % stage)
                opt.close()

    def test_a_write_between_backward_and_step_is_stepped_from(self):
        """As AdamW: the step starts from the weights the loop wrote after the backward (the
        gradient is the backward's), also when the update had been speculated from the old ones."""
        for overlap in ("off", "on"):
            with self.subTest(overlap=overlap):
                cfg = A.base_config(2, optimizer={"overlap": overlap},
                                    offload={"optimizer": {"tier": "cpu"}})
                model, ref = A.tiny_gpt(), A.tiny_gpt()
                opt = strata.torch.ZeroOptimizer(model, cfg, param_groups=A.torch_groups(model))
                topt = adamw(A.torch_groups(ref))
                for m, o, mine in ((model, opt, True), (ref, topt, False)):
                    for s in range(3):
                        x, y = A.batch(s)
                        if not mine:
                            o.zero_grad(set_to_none=True)
                        m(x, y).backward()
                        if s == 1:
                            with torch.no_grad():
                                m.head.weight.mul_(0.5)
                        o.step()
                A.assert_bitwise(self, A.master_of(opt, model), dict(ref.named_parameters()),
                                 "overlap %s" % overlap)
                opt.close()

    def test_a_write_through_p_data_is_the_masters_where_the_parameters_are_the_master(self):
        """A CPU model with FP32 parameters at stages 0-2 without speculation: the engine's master
        weights are the parameters (docs/offload.md, "One copy of the weights"), so even a write
        that torch's version counter does not see (through p.data) is stepped from, as AdamW's
        (with a master of its own the engine would overwrite it at the next step)."""
        for stage, tier in ((0, "gpu"), (1, "cpu"), (2, "gpu"), (2, "cpu")):
            with self.subTest(stage=stage, tier=tier):
                cfg = A.base_config(stage, offload={"optimizer": {"tier": tier}})
                model, ref = A.tiny_gpt(), A.tiny_gpt()
                opt = strata.torch.ZeroOptimizer(model, cfg, param_groups=A.torch_groups(model))
                topt = adamw(A.torch_groups(ref))
                self.assertEqual(A.train(model, opt, 2), A.train(ref, topt, 2, strata_opt=False))
                for m in (model, ref):
                    m.head.weight.data.mul_(0.5)  # not seen by the version counter
                    m.blocks[0].attn.qkv.weight.data[:, :3] = 0.25
                self.assertEqual(A.train(model, opt, 2, start=2),
                                 A.train(ref, topt, 2, start=2, strata_opt=False))
                A.assert_bitwise(self, A.master_of(opt, model), dict(ref.named_parameters()),
                                 "stage %d, state on %s" % (stage, tier))
                opt.close()

    def test_a_scheduler_keeps_the_update_overlapped(self):
        cfg = A.base_config(2, optimizer={"overlap": "on"}, offload={"optimizer": {"tier": "cpu"}})
        model, ref = A.tiny_gpt(), A.tiny_gpt()
        opt = strata.torch.ZeroOptimizer(model, cfg, param_groups=A.torch_groups(model))
        topt = adamw(A.torch_groups(ref))
        lam = lambda s: (s + 1) / 10  # noqa: E731  (a warm-up: lr changes every step)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
        tsched = torch.optim.lr_scheduler.LambdaLR(topt, lam)
        la = A.train(model, opt, 4, sched=sched)
        lb = A.train(ref, topt, 4, sched=tsched, strata_opt=False)
        self.assertEqual(la, lb)
        st = opt.stats()
        self.assertGreater(st["committed_chunks"], 0)
        self.assertEqual(st["rolled_back_chunks"], 0)
        A.assert_bitwise(self, A.master_of(opt, model), dict(ref.named_parameters()), "overlap")
        opt.close()

    def test_maximize_and_amsgrad_are_refused(self):
        for key in ("maximize", "amsgrad"):
            with self.subTest(key=key):
                model = A.tiny_gpt()
                groups = [{"params": list(model.parameters()), key: True}]
                with self.assertRaisesRegex(errors.UnsupportedError, key):
                    strata.torch.ZeroOptimizer(model, A.base_config(2), param_groups=groups)
                opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
                opt.param_groups[0][key] = True  # set later: refused at the step
                x, y = A.batch(0)
                with self.assertRaisesRegex(errors.UnsupportedError, key):
                    opt.backward(model(x, y))
                opt.param_groups[0][key] = False
                opt.zero_grad()
                A.train(model, opt, 1)
                opt.close()

    def test_a_plain_backward_under_a_loss_scale_is_refused(self):
        model = A.tiny_gpt().to(torch.bfloat16)
        cfg = A.base_config(2, precision={"loss_scale": {"enabled": True}})
        opt = strata.torch.ZeroOptimizer(model, cfg)
        self.assertGreater(opt.loss_scale, 1.0)
        x, y = A.batch(0)
        with self.assertRaisesRegex(errors.UsageError, "opt.backward"):
            model(x, y).backward()
        opt.zero_grad()
        opt.backward(model(x, y))
        self.assertTrue(opt.step().applied)
        opt.close()

    def test_a_model_converted_after_building_the_optimizer_is_named(self):
        model = A.tiny_gpt()
        opt = strata.torch.ZeroOptimizer(model, A.base_config(2))
        model.double()
        x, y = A.batch(0)
        model(x, y).backward()
        with self.assertRaisesRegex(errors.UsageError, "moved or converted"):
            opt.step()
        opt.close()


def unused_worker(out):
    """One rank of UnusedParameters.test_two_ranks_a_head_used_on_one: writes "ok" or the failure."""
    rank, world = int(os.environ["RANK"]), 2

    def use_alt(r, s):
        return (s % 2 == 1 and r == 0) or (s == 2 and r == 1)

    msgs = []
    for stage in (1, 2):
        ref = WithHeads()
        ref.unused = None  # alt's bucket is complete where alt is used, at step() elsewhere
        model = copy.deepcopy(ref)
        cfg = A.base_config(stage, zero={"reduce_bucket_size": 512},
                            runtime={"collective_timeout_s": 60})
        opt = strata.torch.ZeroOptimizer(model, cfg, unused_parameters="ignore",
                                         param_groups=A.torch_groups(model))
        if opt.world != world:
            msgs.append("stage %d: a world of %d" % (stage, opt.world))
        topt = adamw(A.torch_groups(ref))
        params = list(ref.parameters())
        for s in range(5):
            x, y = A.batch(world * s + rank)
            model(x, y, s, use_alt(rank, s)).backward()
            opt.step()
            per_rank = []
            for r in range(world):
                ref.zero_grad(set_to_none=True)
                x, y = A.batch(world * s + r)
                ref(x, y, s, use_alt(r, s)).backward()
                per_rank.append([None if p.grad is None else p.grad.clone() for p in params])
            for i, p in enumerate(params):
                gs = [g[i] for g in per_rank]
                if all(g is None for g in gs):
                    p.grad = None  # AdamW skips it
                    continue
                acc = gs[0] if gs[0] is not None else torch.zeros_like(p)
                for g in gs[1:]:
                    acc = acc + (g if g is not None else torch.zeros_like(p))
                p.grad = acc / world
            topt.step()
        got = A.master_of(opt, model)
        sd, tsd = opt.state_dict()["state"], topt.state_dict()["state"]
        for i, (n, p) in enumerate(ref.named_parameters()):
            a, b = got[n].reshape(-1), p.detach().reshape(-1)
            if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                msgs.append("stage %d: %s differs by %g" % (stage, n, float((a - b).abs().max())))
            want = float(tsd[i]["step"]) if i in tsd else 0.0
            if float(sd[i]["step"]) != want:
                msgs.append("stage %d: step of %s %s, torch's %s" % (stage, n, sd[i]["step"], want))
        opt.close()
    with open(out, "w") as f:
        f.write("; ".join(msgs) if msgs else "ok")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "unused-worker":
        unused_worker(sys.argv[2])
        sys.exit(0)
    unittest.main()
