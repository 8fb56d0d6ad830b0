"""strata.torch.ZeroOptimizer's CUDA branch on the fake CUDA runtime (issue 47, point 2).

Debian's torch is CPU-only, so a CUDA model cannot exist here. What can: ZeroOptimizer's CUDA
branch, run on stand-ins for CUDA tensors. strata.torch reaches tensor memory only through its
seam (strata/_memory.py); FakeCudaMemory below answers for a model "on cuda:1" whose tensors
compute on the CPU, and gives the engine what a CUDA model's tensors would: for each address a
copy of the tensor in fake device memory (which host code cannot read: a device address passed
where host code reads it dies with SIGSEGV), written on a fake stream standing for torch's
current stream; engine memory (param_buffer) is a DeviceParamBuffer whose contents the model's
CPU tensors mirror after every engine write. So the same torch.py lines a GPU user runs — the
hand-in on the producer's stream, the state reads and writes, the stage-3 gathers' copies,
checkpoints — run here against the binding and the engine on a (fake) GPU.

Each case trains the same model (an embedding tied to the output layer, a frozen layer, a norm)
for three steps with accumulation 2 and clip_grad_norm_ each step, a write into a parameter
between steps, a state_dict round trip into a new optimizer, and a checkpoint save / load into a
third; once with the stand-in CUDA model, once with the same model on the CPU (the host engine).
Every parameter, master weight and moment must be bitwise equal. And the hand-in never waits for
the GPU: the fake runtime's host-synchronization counter stays at 0 during a stage 0-1 backward
(ad1d2e5: one per gradient).

Run by CTest (label fakecuda) with LD_PRELOAD=libstrata_fakecuda.so, STRATA_FAKECUDA_DEVICES=2,
LOCAL_RANK=1 (the engine must take GPU 1).
"""
import contextlib
import copy
import ctypes
import os
import sys
import tempfile
import warnings

import torch

import strata.torch as st
from strata import _memory

DEVICE = 1
DEFAULT = 4  # cudaMemcpyDefault
cuda = ctypes.CDLL(os.environ["LD_PRELOAD"].split(":")[0])
if not cuda.fakecuda_active():
    sys.exit("the fake CUDA runtime is not the one answering")
cuda.fakecuda_counter.restype = ctypes.c_long
cuda.fakecuda_counter.argtypes = [ctypes.c_char_p]


def check(rc, what):
    if rc != 0:
        raise RuntimeError("%s failed: CUDA error %d" % (what, rc))


def host_syncs():
    return cuda.fakecuda_counter(b"host_sync")


class FakeCudaMemory(_memory.HostMemory):
    """strata.torch's tensor-memory seam for a model standing on cuda:1 of the fake runtime."""

    cuda = True

    def __init__(self):
        self.device = torch.device("cuda", DEVICE)
        check(cuda.cudaSetDevice(DEVICE), "cudaSetDevice")
        self.s = ctypes.c_void_p()  # torch's current stream, a blocking one as torch's default
        check(cuda.cudaStreamCreateWithFlags(ctypes.byref(self.s), 0), "cudaStreamCreate")
        self.allocs = []   # fake device memory of the stand-ins (freed at close)
        self.aliases = []  # (CPU mirror, DeviceParamBuffer)
        self.kept = 0      # keep_until calls (a gradient kept for the engine's stream)

    def _malloc(self, n):
        d = ctypes.c_void_p()
        check(cuda.cudaMalloc(ctypes.byref(d), max(n, 1)), "cudaMalloc")
        self.allocs.append(d)
        return d.value

    def device_of(self, t):
        return self.device  # every tensor of the model stands on cuda:1

    def address(self, t):
        """A CUDA tensor's address: its bytes in fake device memory, written on the current
        stream as torch's kernels would write them (a pageable copy: staged at the call)."""
        assert t.is_contiguous()
        n = t.numel() * t.element_size()
        d = self._malloc(n)
        check(cuda.cudaMemcpyAsync(ctypes.c_void_p(d), ctypes.c_void_p(t.data_ptr()), n, DEFAULT,
                                   self.s), "cudaMemcpyAsync")
        return d

    @contextlib.contextmanager
    def outputs(self, tensors):
        dsts = [self._malloc(t.numel() * t.element_size()) for t in tensors]
        yield dsts
        for t, d in zip(tensors, dsts):
            check(cuda.cudaMemcpy(ctypes.c_void_p(t.data_ptr()), ctypes.c_void_p(d),
                                  t.numel() * t.element_size(), DEFAULT), "cudaMemcpy")

    def stream(self):
        return self.s.value

    def keep_until(self, t, stream):
        assert stream, "a gradient kept until the engine's stream, but the engine has none"
        self.kept += 1  # (the stand-in's device copy lives until close)

    def synchronize(self):
        check(cuda.cudaStreamSynchronize(self.s), "cudaStreamSynchronize")

    def to_device(self, t, dtype):
        return t.to(dtype=dtype)

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        return torch.zeros(shape, dtype=dtype)

    def scalar(self, value):
        return torch.tensor(value, dtype=torch.float32)

    def alias(self, buf, dtype, shape):
        assert type(buf).__name__ == "DeviceParamBuffer", type(buf)
        assert buf.__dlpack_device__() == (2, DEVICE), buf.__dlpack_device__()
        mirror = torch.empty(buf.nbytes, dtype=torch.uint8)
        self.aliases.append((mirror, buf))
        self._download(mirror, buf)
        return mirror.view(dtype).view(shape)

    def _download(self, mirror, buf):  # into the tensor's memory: no version counter bump
        check(cuda.cudaMemcpy(ctypes.c_void_p(mirror.data_ptr()), ctypes.c_void_p(buf.address),
                              buf.nbytes, DEFAULT), "cudaMemcpy")

    def after_engine_wrote(self):
        for mirror, buf in self.aliases:
            self._download(mirror, buf)

    def close(self):
        self.aliases = []
        for d in self.allocs:
            check(cuda.cudaFree(d), "cudaFree")
        self.allocs = []


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(40, 24)
        self.body = torch.nn.Sequential(torch.nn.Linear(24, 36), torch.nn.GELU(),
                                        torch.nn.Linear(36, 24))
        self.frozen = torch.nn.Linear(24, 24)
        self.frozen.requires_grad_(False)
        self.norm = torch.nn.LayerNorm(24)
        self.head = torch.nn.Linear(24, 40, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x):
        h = self.emb(x)
        return self.head(self.norm(self.body(h) + self.frozen(h)))


def batches(seed, n):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 40, (4, 7), generator=g), torch.randint(0, 40, (4, 7), generator=g))
            for _ in range(n)]


def config(stage, tier, overlap, swap):
    o = {"zero.stage": stage, "offload.optimizer.tier": tier, "optimizer.lr": 3e-3,
         "optimizer.weight_decay": 0.05, "optimizer.grad_clip": 0, "zero.reduce_bucket_size": 400,
         "zero.sub_group_size": 700, "runtime.cpu_threads": 1, "runtime.collective_timeout_s": 60,
         "optimizer.overlap": overlap, "tiers.nvme.paths": [swap]}
    if tier == "gpu":
        o.pop("offload.optimizer.tier")
    return o


@contextlib.contextmanager
def memory(kind):
    """strata.torch's seam for the optimizers built inside: the stand-in CUDA model, or the
    CPU's."""
    saved = st._memory_factory
    seams = []

    def fake(t):
        seams.append(FakeCudaMemory())
        return seams[-1]
    if kind == "cuda":
        st._memory_factory = fake
    try:
        yield seams
    finally:
        st._memory_factory = saved


def train(model, opt, data, syncs):
    loss_fn = torch.nn.CrossEntropyLoss()
    for i in range(0, len(data), 2):
        for x, y in data[i:i + 2]:  # accumulation 2
            loss = loss_fn(model(x).reshape(-1, 40), y.reshape(-1)) / 2
            before = host_syncs()
            loss.backward()
            syncs.append(host_syncs() - before)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def snapshot(opt, model):
    sd = opt.state_dict()
    out = {"state/%d/%s" % (i, k): v.clone() for i, s in sd["state"].items() for k, v in s.items()}
    with opt.full_parameters():
        out.update({"param/" + k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def run(kind, stage, tier, overlap):
    """Trains, round-trips the state, saves and resumes; returns the snapshots and the host
    synchronizations of each backward."""
    torch.manual_seed(7)
    base = Net()
    data = batches(stage * 10 + len(tier), 12)
    syncs, snaps = [], []
    with tempfile.TemporaryDirectory() as tmp, memory(kind) as seams, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = config(stage, tier, overlap, os.path.join(tmp, "swap"))
        model = copy.deepcopy(base)
        opt = st.ZeroOptimizer(model, overrides=cfg)
        assert opt._cuda == (kind == "cuda")
        train(model, opt, data[:6], syncs)
        with torch.no_grad():  # a write into the model between steps (reseeds the master)
            with opt.full_parameters():
                pass
            if stage < 3:
                model.body[0].weight.mul_(0.75)
        reseed = []  # its first backward writes the master from the model: waits, once
        train(model, opt, data[6:8], reseed)
        syncs += reseed[1:]
        snaps.append(snapshot(opt, model))
        sd = opt.state_dict()
        opt.save_checkpoint(os.path.join(tmp, "ckpt"))
        full = opt.full_state_dict()
        opt.close()
        # state_dict round trip into a new optimizer on a copy of the model
        model2 = copy.deepcopy(base)
        model2.load_state_dict(full)
        opt2 = st.ZeroOptimizer(model2, overrides=cfg)
        opt2.load_state_dict(sd)
        train(model2, opt2, data[8:10], syncs)
        snaps.append(snapshot(opt2, model2))
        opt2.close()
        # checkpoint resume into a third
        model3 = copy.deepcopy(base)
        opt3 = st.ZeroOptimizer(model3, overrides=cfg)
        opt3.load_checkpoint(os.path.join(tmp, "ckpt"))
        train(model3, opt3, data[8:12], syncs)
        snaps.append(snapshot(opt3, model3))
        opt3.close()
        if kind == "cuda":
            assert seams and all(s.kept > 0 for s in seams), "no gradient took the device hand-in"
            for s in seams:
                s.close()
    return snaps, syncs


def compare(case, a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), (case, i, sorted(set(x) ^ set(y)))
        for k in x:
            if not torch.equal(x[k], y[k]):
                d = (x[k].double() - y[k].double()).abs().max().item()
                raise AssertionError("%s, snapshot %d: %s differs from the CPU run's (max |d| %g)"
                                     % (case, i, k, d))


CASES = [(0, "gpu", "off"), (1, "cpu", "off"), (2, "cpu", "on"), (2, "nvme", "off"),
         (2, "gpu", "off"), (3, "cpu", "off"), (3, "gpu", "off")]


def main():
    only = sys.argv[1:]
    for stage, tier, overlap in CASES:
        case = "stage %d, optimizer state %s, overlap %s" % (stage, tier, overlap)
        if only and not any(o in case for o in only):
            continue
        want, _ = run("cpu", stage, tier, overlap)
        got, syncs = run("cuda", stage, tier, overlap)
        compare(case, got, want)
        if stage < 2:  # no bucket: the hand-ins queue their copies; step() waits once
            assert max(syncs) == 0, "%s: host synchronizations per backward %s" % (case, syncs)
        print("ok: %s: bitwise the CPU run's (3 snapshots); host waits per backward %s"
              % (case, sorted(set(syncs))))


if __name__ == "__main__":
    main()
