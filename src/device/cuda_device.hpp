// The CUDA device (internal; built only with STRATA_HAVE_CUDA). Host code using the CUDA runtime.
#pragma once

#include <memory>

#include "strata/device.hpp"

namespace strata::device {

// Throws Error(kUnsupported) when the device cannot be used (no driver, no such ordinal).
std::unique_ptr<Device> make_cuda_device(int ordinal);

}  // namespace strata::device
