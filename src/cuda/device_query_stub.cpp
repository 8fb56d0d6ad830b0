// Device query for builds without CUDA.
#include "strata/device_query.hpp"

namespace strata {
GpuQuery query_cuda_devices() { return GpuQuery{{}, "no GPU: built without CUDA"}; }
bool cuda_available() { return false; }
bool cuda_smoke_test() { return false; }
}  // namespace strata
