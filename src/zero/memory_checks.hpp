// The memory a caller hands the engine, checked where the CUDA runtime can tell
// (strata/device_query.hpp, query_pointer): device memory given where host code would read or
// write it, or host memory given where a kernel or a device copy expects the engine's GPU, is
// Error(kInvalidArgument) naming the call and the memory, never a SIGSEGV or an illegal address.
// Without CUDA (or on a machine without a GPU) every address is host memory: nothing to check.
#pragma once

#include <string_view>

namespace strata {
class Device;
}

namespace strata::zero {

// `p` is read or written by host code (initial values, read_state / write_state, host gradients).
void require_host_memory(const void* p, const char* call, std::string_view tensor);

// `p` is read by `device`'s kernels and copies (set_gradient's device memory): on a GPU it must
// be device memory of that GPU; on the host-emulated device it is host memory, checked as above.
void require_device_memory(const Device& device, const void* p, const char* call,
                           std::string_view tensor);

}  // namespace strata::zero
