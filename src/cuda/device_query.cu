// Device query, compiled by nvcc so that the CUDA build path is always exercised.
#include <cuda_runtime.h>
#include <unistd.h>

#include <string>

#include "strata/device_query.hpp"

namespace strata {
namespace {
__global__ void probe_kernel(int* out) { *out = 42; }
}  // namespace

GpuQuery query_cuda_devices() {
  GpuQuery q;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // Without a driver the runtime says "CUDA driver version is insufficient for CUDA runtime
    // version" (cudaErrorInsufficientDriver): say what is really missing.
    const bool no_driver = (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice) &&
                           ::access("/proc/driver/nvidia/version", F_OK) != 0;
    q.status = no_driver
                   ? std::string("no GPU: no NVIDIA driver (/proc/driver/nvidia/version is absent)")
                   : std::string("no GPU: ") + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky-free error state
    return q;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    GpuInfo g;
    g.index = i;
    g.name = prop.name;
    g.total_memory = prop.totalGlobalMem;
    g.major = prop.major;
    g.minor = prop.minor;
    g.multiprocessors = prop.multiProcessorCount;
    q.devices.push_back(g);
  }
  q.status = count == 0 ? "no GPU: the CUDA runtime reports 0 devices"
                        : std::to_string(q.devices.size()) + " GPU(s)";
  return q;
}

bool cuda_available() {
  static const bool available = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return count > 0;
  }();
  return available;
}

// Launches a one-thread kernel and checks its result: proves the compiled device code runs on
// this GPU's architecture. Returns false (never throws) when it does not.
bool cuda_smoke_test() {
  int* d = nullptr;
  if (cudaMalloc(&d, sizeof(int)) != cudaSuccess) return false;
  probe_kernel<<<1, 1>>>(d);
  int h = 0;
  bool ok = cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess && h == 42;
  cudaFree(d);
  return ok;
}

}  // namespace strata
