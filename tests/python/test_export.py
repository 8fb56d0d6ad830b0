#!/usr/bin/python3
"""Exports people can load (issue 24, point 5): `strata checkpoint export` of a checkpoint written
by ZeroOptimizer.save_checkpoint holds every tensor of model.state_dict() under its model name and
in its model shape (a tied weight under both names, the frozen layer, LayerNorm, BatchNorm's
running statistics and its int64 counter), so that strata.safetensors.load_file (the package's
pure-Python reader) + model.load_state_dict(strict=True) gives back rank 0's model state bitwise;
stages 0 and 3, one rank or several (under `python3 -m strata.torchrun`). A damaged extra file is
found by `strata checkpoint verify` and refused by export. The reader's own checks: crafted
headers are refused before anything is allocated.

    test_export.py --strata build/strata            (one process; also the reader's tests)
    launch.py --launcher torchrun --np 2 test_export.py --strata build/strata
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

import torch
import torch.distributed as dist
import torch.nn as nn

import strata
import strata.safetensors as st
from strata import errors

torch.set_num_threads(1)
V, D, B, T = 11, 8, 4, 5
STRATA = None  # the CLI, from --strata


class Net(nn.Module):
    """A tied embedding/head, LayerNorm, a frozen Linear, BatchNorm (running_mean, running_var,
    num_batches_tracked: int64) and a non-persistent buffer (not in state_dict)."""

    def __init__(self, seed=3):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, D)
        self.norm = nn.LayerNorm(D)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.bn = nn.BatchNorm1d(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scratch", torch.arange(3.0), persistent=False)

    def forward(self, x):
        h = self.frozen(self.norm(self.emb(x)))
        h = self.bn(h.reshape(-1, D)).reshape(h.shape)
        return self.head(h)


def rank_world():
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B * T,), generator=g)


def bits(t):
    t = t.detach().contiguous().reshape(-1)
    as_int = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
              torch.bfloat16: torch.int16}
    return t.view(as_int[t.dtype]) if t.dtype in as_int else t


def barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def run_cli(*args):
    return subprocess.run([STRATA] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True)


def train_and_save(stage, directory, steps=3):
    """Trains Net on this rank's batches, saves a checkpoint; returns rank 0's expected state."""
    rank, _ = rank_world()
    model = Net()
    opt = strata.torch.ZeroOptimizer(
        model, {"zero": {"stage": stage, "reduce_bucket_size": 50, "sub_group_size": 70},
                "optimizer": {"lr": 1e-2, "weight_decay": 0.1}, "runtime": {"cpu_threads": 1}})
    for s in range(steps):
        model.train()
        x, y = batch(s, rank)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, V), y)
        loss.backward()
        opt.step()
        model.zero_grad()
    opt.save_checkpoint(directory)
    want = opt.full_state_dict()  # collective at stage 3
    opt.close()
    return want


class Export(unittest.TestCase):
    def check_stage(self, stage):
        rank, world = rank_world()
        tmp = os.environ["STRATA_EXPORT_TMP"]
        ckpt, out = os.path.join(tmp, "ckpt-s%d" % stage), os.path.join(tmp, "s%d.safetensors" % stage)
        if rank == 0:
            shutil.rmtree(ckpt, ignore_errors=True)
        barrier()
        want = train_and_save(stage, ckpt)
        try:
            if rank == 0:
                self.check_export(stage, world, ckpt, out, want)
        finally:
            barrier()

    def check_export(self, stage, world, ckpt, out, want):
        r = run_cli("checkpoint", "export", ckpt, "--out", out, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        info = json.loads(r.stdout)
        sd = st.load_file(out)
        # Every state_dict entry under its name and shape (the tied weight twice), nothing else.
        self.assertEqual(sorted(sd), sorted(want))
        self.assertEqual(info["tensors"], len(want))
        self.assertEqual(sd["bn.num_batches_tracked"].dtype, torch.int64)
        self.assertEqual(int(sd["bn.num_batches_tracked"]), 3)
        self.assertNotIn("scratch", sd)
        fresh = Net(seed=99)
        fresh.load_state_dict(sd, strict=True)
        got = fresh.state_dict()
        for k, v in want.items():
            self.assertEqual((got[k].dtype, tuple(got[k].shape)), (v.dtype, tuple(v.shape)), k)
            self.assertTrue(torch.equal(bits(got[k]), bits(v)), "stage %d world %d: %s differs"
                            % (stage, world, k))
        meta = st.load_metadata(out)
        self.assertEqual(meta["saved_stage"], str(stage))
        self.assertEqual(meta["saved_world"], str(world))
        self.assertEqual(run_cli("checkpoint", "verify", ckpt).returncode, 0)

    def test_stage0(self):
        self.check_stage(0)

    def test_stage3(self):
        self.check_stage(3)

    def test_damaged_extra_file(self):
        """The frozen parameters and buffers are checksummed like the rest: one flipped byte of
        the extra file fails verify (exit 1) and export (exit 1, no output file). A new save
        removes the previous one's extra file with its shards."""
        rank, _ = rank_world()
        tmp = os.environ["STRATA_EXPORT_TMP"]
        ckpt, out = os.path.join(tmp, "ckpt-bad"), os.path.join(tmp, "bad.safetensors")
        if rank == 0:
            shutil.rmtree(ckpt, ignore_errors=True)
        barrier()
        train_and_save(2, ckpt, steps=1)
        train_and_save(2, ckpt, steps=1)  # the second save replaces the first's extra file
        try:
            if rank == 0:
                self.check_damaged(ckpt, out)
        finally:
            barrier()

    def check_damaged(self, ckpt, out):
        extra = [f for f in os.listdir(ckpt) if f.startswith("extra-")]
        self.assertEqual(extra, ["extra-2.bin"], os.listdir(ckpt))
        with open(os.path.join(ckpt, extra[0]), "r+b") as f:
            f.seek(5)
            b = f.read(1)
            f.seek(5)
            f.write(bytes([b[0] ^ 0x10]))
        r = run_cli("checkpoint", "verify", ckpt)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("extra", r.stdout)
        r = run_cli("checkpoint", "export", ckpt, "--out", out)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("CRC32C", r.stderr)
        self.assertFalse(os.path.exists(out))


def write_raw(path, header, data=b"", length=None):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h) if length is None else length) + h + data)


class Reader(unittest.TestCase):
    """strata.safetensors.load_file: what it reads, and what it refuses before allocating."""

    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "f.safetensors")

    def tearDown(self):
        shutil.rmtree(self.dir)

    def test_reads_every_dtype(self):
        ts = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor(7),
              "c": torch.tensor([True, False]), "d": torch.randn(2, 2).to(torch.bfloat16),
              "e": torch.zeros(0, 4, dtype=torch.float16), "f": torch.tensor([-3], dtype=torch.int8)}
        names = {torch.float32: "F32", torch.int64: "I64", torch.bool: "BOOL",
                 torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8"}
        header, data = {"__metadata__": {"k": "v"}}, b""
        for k, t in ts.items():
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            header[k] = {"dtype": names[t.dtype], "shape": list(t.shape),
                         "data_offsets": [len(data), len(data) + len(raw)]}
            data += raw
        write_raw(self.path, header, data)
        got = st.load_file(self.path)
        self.assertEqual(sorted(got), sorted(ts))
        for k, t in ts.items():
            self.assertEqual((got[k].dtype, got[k].shape), (t.dtype, t.shape), k)
            self.assertTrue(torch.equal(got[k], t), k)
        self.assertEqual(st.load_metadata(self.path), {"k": "v"})

    def refused(self, header, data=b"", length=None, pattern=""):
        write_raw(self.path, header, data, length)
        with self.assertRaisesRegex(errors.InvalidArgumentError, pattern):
            st.load_file(self.path)

    def test_refuses_crafted_files(self):
        ok = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
        self.refused({"a": ok}, b"\0" * 8, length=1 << 40, pattern="header length")
        self.refused(b'{"a": 1, "a": 2}', pattern="twice")
        self.refused(b"\xff\xfe", pattern="UTF-8")
        self.refused([1, 2], pattern="not a JSON object")
        self.refused({"a": dict(ok, dtype="F8")}, b"\0" * 8, pattern="dtype")
        self.refused({"a": dict(ok, extra=1)}, b"\0" * 8, pattern="exactly")
        self.refused({"a": dict(ok, shape=[-1])}, b"\0" * 8, pattern="shape")
        self.refused({"a": dict(ok, shape=[True])}, b"\0" * 8, pattern="shape")
        # A shape of 2^40 elements over 8 bytes: refused before any allocation.
        self.refused({"a": dict(ok, shape=[1 << 40])}, b"\0" * 8, pattern="needs")
        self.refused({"a": dict(ok, data_offsets=[0, 16])}, b"\0" * 8, pattern="outside")
        self.refused({"a": ok, "b": ok}, b"\0" * 8, pattern="tile")  # overlap
        self.refused({"a": dict(ok, data_offsets=[8, 16])}, b"\0" * 16, pattern="tile")  # gap
        self.refused({"a": ok}, b"\0" * 12, pattern="hold 8 data bytes")  # trailing bytes
        self.refused({"__metadata__": {"k": 1}}, pattern="metadata")

    def test_short_file(self):
        with open(self.path, "wb") as f:
            f.write(b"\1\0\0")
        with self.assertRaisesRegex(errors.InvalidArgumentError, "too short"):
            st.load_file(self.path)


def main():
    global STRATA
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", required=True, help="the strata executable")
    a, rest = ap.parse_known_args()
    STRATA = os.path.abspath(a.strata)
    rank, world = rank_world()
    # One directory for every rank: rank 0's name, shared through the environment of the launch.
    base = os.environ.get("STRATA_EXPORT_TMP_BASE", tempfile.gettempdir())
    tmp = os.path.join(base, "strata-export-%s" % os.environ.get("TORCHELASTIC_RUN_ID", os.getpid()))
    os.makedirs(tmp, exist_ok=True)
    os.environ["STRATA_EXPORT_TMP"] = tmp
    tests = ["Export"] + (["Reader"] if world == 1 else [])
    suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromName(n, sys.modules[__name__])
                               for n in tests)
    ok = unittest.TextTestRunner(verbosity=2).run(suite).wasSuccessful()
    barrier()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
