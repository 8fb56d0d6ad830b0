"""The Python binding's CUDA path (what strata.torch.ZeroOptimizer does with a CUDA model) on the
fake CUDA runtime: Debian's torch is CPU-only, so the device memory and the caller's stream come
from the fake runtime through ctypes, as torch's would (a device pointer, a stream handle int).

Run by CTest (label fakecuda) with LD_PRELOAD=libstrata_fakecuda.so, STRATA_FAKECUDA_DEVICES=2,
LOCAL_RANK=1: the engine must take GPU 1. For stages 0-2:
  - a model "on cuda:0" is refused naming cuda:1 (the rank's GPU);
  - param_buffer is device memory: DLPack (cuda, ordinal 1) and __cuda_array_interface__, no
    buffer protocol;
  - set_gradient_device(id, ptr, stream): the gradient is written on the caller's stream behind a
    gate a timer opens after the call was made; the engine's copy must wait for it (on the GPU:
    the call itself returns without waiting);
  - step(stream): a copy of the parameters queued on the caller's stream behind the gate must
    still read the old parameters; afterwards the stream reads the new ones, bitwise those of the
    same step on the host device;
  - copy_param(id, device_ptr, stream) (the stage-3 gather path) copies on the GPU;
  - every entry strata.torch may call with a CUDA tensor's memory, called with fake device memory:
    add_parameter, read_state, write_state, set_gradient (staged), copy_params; another GPU's
    memory to set_gradient_device and device memory as a checkpoint's extra tensor are refused
    naming the memory (every_entry_with_device_memory).
"""
import ctypes
import os
import sys
import threading

import torch  # noqa: F401  (strata imports it first)

from strata import _strata
from strata import errors

N = 3000
FLOAT = 4
cuda = ctypes.CDLL(os.environ["LD_PRELOAD"].split(":")[0])
if not cuda.fakecuda_active():
    sys.exit("the fake CUDA runtime is not the one answering")
HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
DEFAULT = 4  # cudaMemcpyDefault


def check(rc, what):
    if rc != 0:
        raise RuntimeError("%s failed: CUDA error %d" % (what, rc))


def config(stage, device):
    return _strata.parse_config("{}", "<test>", [
        "zero.stage=%d" % stage, "runtime.device=%s" % device,
        "runtime.communicator=%s" % ("nccl" if device == "cuda" else "inprocess"),
        "precision.params=fp32", "precision.grads=fp32", "precision.loss_scale.initial=1",
        "optimizer.lr=0.01", "zero.reduce_bucket_size=1000",
        "runtime.cpu_threads=1", "runtime.collective_timeout_s=30"])


def values(seed, scale):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(N, generator=g) * 2 - 1) * scale


class Gate:
    """A caller's stream (on GPU 1) whose work waits, behind a host function, until a timer thread
    opens the gate after the engine call under test was made."""

    def __init__(self):
        check(cuda.cudaSetDevice(1), "cudaSetDevice")
        self.stream = ctypes.c_void_p()
        check(cuda.cudaStreamCreateWithFlags(ctypes.byref(self.stream), 1), "cudaStreamCreate")
        self.opened = threading.Event()
        self.fn = HOSTFN(lambda _: self.opened.wait(30))

    def close(self):
        self.opened.clear()
        check(cuda.cudaLaunchHostFunc(self.stream, self.fn, None), "cudaLaunchHostFunc")

    def open_later(self):
        threading.Timer(0.2, self.opened.set).start()

    @property
    def handle(self):
        return self.stream.value  # torch.cuda.Stream.cuda_stream is such an int


def pinned(t):
    check(cuda.cudaHostRegister(ctypes.c_void_p(t.data_ptr()), t.numel() * FLOAT, 0),
          "cudaHostRegister")
    return t


def copy_async(dst, src, gate):
    check(cuda.cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), N * FLOAT, DEFAULT,
                               gate.stream), "cudaMemcpyAsync")


def reference(stage):
    e = _strata.Engine(config(stage, "host"), "single")
    w = values(1, 1.0)
    e.add_parameter("w", w.data_ptr(), N)
    e.finalize()
    g = values(2, 0.5)
    e.set_gradient(0, g.data_ptr())
    assert e.step()["applied"]
    out = torch.empty(N)
    e.copy_param(0, out.data_ptr())
    return out


def refused_on_another_gpu(stage):
    try:
        _strata.Engine(config(stage, "cuda"), "nccl", None, 0)
    except errors.InvalidArgumentError as e:
        assert "cuda:1" in str(e), e
        return
    raise AssertionError("a model on cuda:0 was accepted with LOCAL_RANK=1")


def run(stage):
    refused_on_another_gpu(stage)
    want = reference(stage)
    e = _strata.Engine(config(stage, "cuda"), "nccl", None, 1)
    w = values(1, 1.0)
    e.add_parameter("w", w.data_ptr(), N)
    e.finalize()
    assert e.device == "cuda" and e.backend == "nccl", (e.device, e.backend)
    buf = e.param_buffer(0)
    cai = buf.__cuda_array_interface__
    assert type(buf).__name__ == "DeviceParamBuffer" and cai["shape"] == (N * FLOAT,) and cai["data"][0] == buf.address, cai
    try:
        memoryview(buf)
        raise AssertionError("device memory was offered through the buffer protocol")
    except TypeError:
        pass
    gate = Gate()
    g, seen, after = pinned(values(2, 0.5)), pinned(torch.zeros(N)), pinned(torch.zeros(N))
    grad = ctypes.c_void_p()
    check(cuda.cudaMalloc(ctypes.byref(grad), N * FLOAT), "cudaMalloc")
    gate.close()  # the producer: the gradient written on the caller's stream, behind the gate
    copy_async(grad.value, g.data_ptr(), gate)
    gate.open_later()
    e.set_gradient_device(0, grad.value, gate.handle)
    check(cuda.cudaStreamSynchronize(gate.stream), "cudaStreamSynchronize")
    gate.close()  # the consumer: a read of the parameters queued behind the gate
    copy_async(seen.data_ptr(), buf.address, gate)
    gate.open_later()
    r = e.step(gate.handle)
    assert r["applied"], "the gradient was copied before the producer stream wrote it: %s" % r
    copy_async(after.data_ptr(), buf.address, gate)
    check(cuda.cudaStreamSynchronize(gate.stream), "cudaStreamSynchronize")
    assert torch.equal(seen, w), "step() changed the parameters under the consumer's queued read"
    assert torch.equal(after, want), "after step(): %s vs the reference %s" % (after[:4], want[:4])
    # copy_param into device memory (the stage-3 gather path), ordered after the caller's stream.
    dst = ctypes.c_void_p()
    check(cuda.cudaMalloc(ctypes.byref(dst), N * FLOAT), "cudaMalloc")
    e.copy_param(0, dst.value, gate.handle)
    after.zero_()
    check(cuda.cudaMemcpy(ctypes.c_void_p(after.data_ptr()), dst, N * FLOAT, DEFAULT), "cudaMemcpy")
    assert torch.equal(after, want), "copy_param into device memory"
    for t in (g, seen, after):
        check(cuda.cudaHostUnregister(ctypes.c_void_p(t.data_ptr())), "cudaHostUnregister")
    check(cuda.cudaFree(grad), "cudaFree")
    check(cuda.cudaFree(dst), "cudaFree")
    check(cuda.cudaStreamDestroy(gate.stream), "cudaStreamDestroy")
    print("ok: stage %d: device pointers and the caller's stream through the binding" % stage)


def device_copy_of(t):
    d = ctypes.c_void_p()
    check(cuda.cudaMalloc(ctypes.byref(d), t.numel() * FLOAT), "cudaMalloc")
    check(cuda.cudaMemcpy(d, ctypes.c_void_p(t.data_ptr()), t.numel() * FLOAT, DEFAULT),
          "cudaMemcpy")
    return d


def from_device(d, n=N):
    out = torch.empty(n)
    check(cuda.cudaMemcpy(ctypes.c_void_p(out.data_ptr()), d, n * FLOAT, DEFAULT), "cudaMemcpy")
    return out


def refused(fn, *words):
    try:
        fn()
    except errors.InvalidArgumentError as e:
        assert all(w in str(e) for w in words), (words, e)
        return
    raise AssertionError("accepted; expected InvalidArgumentError naming %s" % (words,))


def every_entry_with_device_memory(stage):
    """Each binding entry torch.py may call with a CUDA tensor's memory, with fake device memory
    (which host code cannot read: an entry that read it on the host would die with SIGSEGV):
    taken (staged through the CUDA runtime) or refused with an error naming the memory."""
    w, m = values(1, 1.0), values(3, 0.01)
    e = _strata.Engine(config(stage, "cuda"), "nccl", None, 1)
    dw = device_copy_of(w)
    e.add_parameter("w", dw.value, N)  # initial values in device memory (ad1d2e5: SIGSEGV)
    e.finalize()
    dm, out = device_copy_of(m), ctypes.c_void_p()
    check(cuda.cudaMalloc(ctypes.byref(out), N * FLOAT), "cudaMalloc")
    e.read_state(0, "master", out.value)
    assert torch.equal(from_device(out), w), "read_state into device memory"
    e.write_state(0, "exp_avg", dm.value)
    e.read_state(0, "exp_avg", out.value)
    assert torch.equal(from_device(out), m), "write_state from device memory"
    assert e.gradient_stream != 0
    buf = e.param_buffer(0)
    assert buf.__dlpack_device__() == (2, 1), buf.__dlpack_device__()
    capsule = buf.__dlpack__()
    del capsule, buf  # a capsule nobody consumed: its deleter drops the engine reference
    e.copy_params([0], [out.value], None)
    assert torch.equal(from_device(out), w), "copy_params into device memory"
    check(cuda.cudaSetDevice(0), "cudaSetDevice")
    other = device_copy_of(values(2, 0.5))  # device memory of GPU 0, the engine is on GPU 1
    refused(lambda: e.set_gradient_device(0, other.value, None), "cuda:0", "cuda:1")
    refused(lambda: e.save_checkpoint("/nonexistent", "", [[N]], [[]],
                                      [("x", "F32", [N], dw.value, N * FLOAT)]),
            "device memory of cuda:1", "extra tensor 'x'")
    check(cuda.cudaSetDevice(1), "cudaSetDevice")
    e.set_gradient(0, dm.value)  # the host entry, given device memory: copied on the device
    assert e.step()["applied"]
    for d in (dw, dm, out, other):
        check(cuda.cudaFree(d), "cudaFree")
    print("ok: stage %d: every entry with device memory" % stage)


if __name__ == "__main__":
    for stage in (0, 1, 2):
        run(stage)
        every_entry_with_device_memory(stage)
