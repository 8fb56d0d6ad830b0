// DLPack export of engine memory (torch.from_dlpack): a one-dimensional uint8 tensor over a
// buffer the engine owns, kept alive by `owner` until the consumer's tensor is freed. The
// DLPack ABI structs are declared here (DLPack 0.x, the "dltensor" capsule every torch >= 1.10
// takes); no dlpack header needed.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <memory>

namespace strata::python {

enum class DlDevice : int { kCpu = 1, kCuda = 2 };

// A "dltensor" capsule over `bytes` bytes at `data` on (device, ordinal); `owner` is released
// (with the GIL held) when the consumer is done, or when the capsule is dropped unconsumed.
pybind11::capsule dlpack_capsule(std::shared_ptr<void> owner, void* data, std::size_t bytes,
                                 DlDevice device, int ordinal);

}  // namespace strata::python
