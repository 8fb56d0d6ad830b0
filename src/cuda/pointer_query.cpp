// Pointer classification and the any-to-any copy (device_query.hpp), on the CUDA runtime.
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "cuda/device_guard.hpp"
#include "strata/device_query.hpp"
#include "strata/error.hpp"

namespace strata {

PointerInfo query_pointer(const void* p) {
  PointerInfo info;
  if (p == nullptr || !cuda_available()) return info;
  cudaPointerAttributes a{};
  // Since CUDA 11 memory the runtime does not know answers cudaMemoryTypeUnregistered with
  // cudaSuccess; an error (a sticky one of another call included) is read as "not CUDA's" and
  // cleared from this thread's last error, which the caller did not cause.
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return info;
  }
  switch (a.type) {
    case cudaMemoryTypeDevice:
      info.kind = MemoryKind::kDevice;
      info.device = a.device;
      break;
    case cudaMemoryTypeManaged:
      info.kind = MemoryKind::kManaged;
      info.device = a.device;
      break;
    case cudaMemoryTypeHost: info.kind = MemoryKind::kPinnedHost; break;
    default: break;
  }
  return info;
}

void copy_any_memory(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  const PointerInfo d = query_pointer(dst), s = query_pointer(src);
  const int ordinal = s.device >= 0 ? s.device : d.device;
  if (ordinal < 0) {  // host to host
    std::memcpy(dst, src, bytes);
    return;
  }
  cuda::DeviceGuard guard(ordinal);
  const cudaError_t rc = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    fail(ErrorCode::kDevice, strcat("cudaMemcpy(", bytes, " bytes, ", describe_memory(s), " to ",
                                    describe_memory(d), "): ", cudaGetErrorString(rc)));
  }
}

}  // namespace strata
