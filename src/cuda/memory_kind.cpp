// describe_memory (device_query.hpp): built with and without CUDA.
#include "strata/device_query.hpp"
#include "strata/error.hpp"

namespace strata {

std::string describe_memory(const PointerInfo& info) {
  switch (info.kind) {
    case MemoryKind::kDevice: return strcat("device memory of cuda:", info.device);
    case MemoryKind::kManaged: return strcat("managed memory of cuda:", info.device);
    case MemoryKind::kPinnedHost: return "page-locked host memory";
    case MemoryKind::kHost: break;
  }
  return "host memory";
}

}  // namespace strata
