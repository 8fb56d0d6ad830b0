// Which CUDA GPUs this process can use. Never throws for "no GPU": a machine without a GPU, a
// driver or a CUDA build is an ordinary case, reported in `status`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace strata {

struct GpuInfo {
  int index = 0;
  std::string name;
  std::uint64_t total_memory = 0;
  int major = 0;
  int minor = 0;
  int multiprocessors = 0;
};

struct GpuQuery {
  std::vector<GpuInfo> devices;
  // "2 GPU(s)", "no GPU: no NVIDIA driver (...)", "no GPU: <reason from the CUDA runtime>", or
  // "no GPU: built without CUDA".
  std::string status;
};

GpuQuery query_cuda_devices();

// True when this build has CUDA and at least one device answered.
bool cuda_available();

// What an address is, as the CUDA runtime tells it (cudaPointerGetAttributes): device memory of
// a GPU, host memory CUDA page-locked (cudaHostRegister / cudaMallocHost), managed memory, or
// memory CUDA does not know (ordinary host memory). Without a CUDA build or a GPU every address
// is kHost. The engine and the Python binding check the memory a caller hands them with it, so
// that device memory given where host code would read it is an error naming the call, not a
// SIGSEGV (include/strata/engine.hpp says which calls take which memory).
enum class MemoryKind { kHost, kPinnedHost, kDevice, kManaged };
struct PointerInfo {
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;  // the GPU of device or managed memory; -1 for host memory
};
PointerInfo query_pointer(const void* p);
// "host memory", "page-locked host memory", "device memory of cuda:1", "managed memory of cuda:0".
std::string describe_memory(const PointerInfo& info);

// Copies `bytes` bytes between any two of host and device memory (cudaMemcpy with
// cudaMemcpyDefault on the legacy default stream of the device memory's GPU: ordered after the
// work queued there, not after non-blocking streams; synchronous). For the few calls that take
// a caller's device memory outside a step (initial values, state reads and writes). Throws
// Error(kDevice) naming the copy. Host to host (every copy in a build without CUDA): a memcpy.
void copy_any_memory(void* dst, const void* src, std::size_t bytes);

}  // namespace strata
