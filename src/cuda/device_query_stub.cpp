// Device query for builds without CUDA.
#include <cstring>

#include "strata/device_query.hpp"

namespace strata {
GpuQuery query_cuda_devices() { return GpuQuery{{}, "no GPU: built without CUDA"}; }
bool cuda_available() { return false; }
bool cuda_smoke_test() { return false; }
PointerInfo query_pointer(const void*) { return {}; }  // every address is host memory
void copy_any_memory(void* dst, const void* src, std::size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
}
}  // namespace strata
