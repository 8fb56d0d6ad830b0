// The memory a caller hands the engine, checked where the CUDA runtime can tell
// (strata/device_query.hpp, query_pointer): device memory given where host code would read or
// write it, or host memory given where a kernel or a device copy expects the engine's GPU, is
// Error(kInvalidArgument) naming the call and the memory, never a SIGSEGV or an illegal address.
// Without CUDA (or on a machine without a GPU) every address is host memory: nothing to check.
#pragma once

#include <string_view>

#include "strata/device_query.hpp"

namespace strata {
class Device;
}

namespace strata::zero {

// `p` is read or written by host code (initial values, read_state / write_state, host gradients).
void require_host_memory(const void* p, const char* call, std::string_view tensor);

// Device (or managed) memory `info` (query_pointer's answer, asked once by the caller) is read by
// a GPU `device`'s kernels and copies (set_gradient's): it must be that GPU's.
void require_device_memory(const Device& device, const PointerInfo& info, const char* call,
                           std::string_view tensor);

}  // namespace strata::zero
