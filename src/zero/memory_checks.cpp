// Checks of the memory a caller hands the engine (memory_checks.hpp).
#include "zero/memory_checks.hpp"

#include "strata/device.hpp"
#include "strata/device_query.hpp"
#include "strata/error.hpp"

namespace strata::zero {

void require_host_memory(const void* p, const char* call, std::string_view tensor) {
  const PointerInfo info = query_pointer(p);
  if (info.kind != MemoryKind::kDevice) return;  // managed memory is host-accessible
  fail(ErrorCode::kInvalidArgument,
       strcat("engine: ", call, "('", tensor, "'): the buffer is ", describe_memory(info),
              ", which host code cannot read or write; pass host memory (torch: a CPU tensor, "
              "t.cpu())"));
}

void require_device_memory(const Device& device, const PointerInfo& info, const char* call,
                           std::string_view tensor) {
  if (info.device == device.ordinal()) return;
  fail(ErrorCode::kInvalidArgument,
       strcat("engine: ", call, "('", tensor, "'): the buffer is ", describe_memory(info),
              " but the engine's kernels and copies read device memory of cuda:", device.ordinal(),
              " (", device.name(), "); move the tensor to that GPU"));
}

}  // namespace strata::zero
