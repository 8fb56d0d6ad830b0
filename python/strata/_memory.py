"""How strata.torch reaches tensor memory: the one seam between torch tensors and the engine's
addresses (pointer, device, stream, dtype, numel).

Every address strata.torch hands the engine comes from here, and every tensor it makes on the
model's device too, so that which memory crosses the binding is decided in one place:

- ``host_address(t)``: host memory (a CPU tensor), for the calls whose host code reads it;
- ``address(t)``: memory of the model's device (device memory of its GPU for a CUDA model), for
  the calls that take it (gradients, initial values, state reads and writes: the binding stages
  device memory through host memory where host code needs it);
- ``outputs(ts)``: addresses the engine writes into (the stage-3 gathers' copies);
- ``stream()``, ``keep_until(t, stream)``, ``synchronize()``: torch's current stream, a tensor kept
  from torch's caching allocator until work queued on an engine stream completed, a host wait;
- ``empty``, ``zeros``, ``scalar``, ``to_device``, ``alias``: tensors on the model's device, and
  a view of engine memory (DLPack: no numpy needed).

A model on the CPU gets :class:`HostMemory`, a CUDA model :class:`CudaMemory`. Tests replace the
factory (``strata.torch._memory_factory``): tests/fakecuda/torch_stand_in.py runs ZeroOptimizer's
CUDA branch on stand-ins for CUDA tensors backed by the fake CUDA runtime's device memory, which
host code cannot read (so a device address passed where host code reads it is a SIGSEGV in CI).
"""
import contextlib

import torch


class HostMemory:
    """A model on the CPU: every tensor is host memory; no streams."""

    cuda = False

    def __init__(self, device):
        self.device = device

    def device_of(self, t):
        return t.device

    def host_address(self, t):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise AssertionError("strata: internal: a host address of a %s%s tensor" % (
                t.device, "" if t.is_contiguous() else " non-contiguous"))
        return t.data_ptr()

    def address(self, t):
        if self.device_of(t) != self.device or not t.is_contiguous():
            raise AssertionError("strata: internal: an address of a tensor on %s, not %s"
                                 % (self.device_of(t), self.device))
        return t.data_ptr()

    @contextlib.contextmanager
    def outputs(self, tensors):
        yield [self.address(t) for t in tensors]

    def stream(self):
        return None

    def keep_until(self, t, stream):
        pass

    def synchronize(self):
        pass

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.device)

    def zeros(self, shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def scalar(self, value):
        return torch.tensor(value, dtype=torch.float32, device=self.device)

    def to_device(self, t, dtype):
        return t.to(device=self.device, dtype=dtype)

    def alias(self, buf, dtype, shape):
        """A tensor over engine memory (a ParamBuffer): DLPack, the engine kept alive by it."""
        return torch.utils.dlpack.from_dlpack(buf).view(dtype).view(shape)

    def after_engine_wrote(self):
        """The engine wrote its parameter memory (a step, a load): aliases see it already."""

    def close(self):
        pass


class CudaMemory(HostMemory):
    """A model on a GPU: its tensors are device memory of that GPU; torch's current stream."""

    cuda = True

    def stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream

    def keep_until(self, t, stream):
        """`t` stays allocated until the work queued so far on `stream` (an engine stream, a raw
        cudaStream_t) completed: torch's caching allocator does not reuse its block before (the
        engine's gradient copy reads it after the hand-in returned)."""
        t.record_stream(torch.cuda.ExternalStream(stream, device=self.device))

    def synchronize(self):
        torch.cuda.current_stream(self.device).synchronize()


def memory_for(t):
    """The seam for a model whose (first trained) parameter is `t`."""
    return CudaMemory(t.device) if t.device.type == "cuda" else HostMemory(t.device)
