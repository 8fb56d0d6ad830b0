// Which CUDA GPUs this process can use. Never throws for "no GPU": a machine without a GPU, a
// driver or a CUDA build is an ordinary case, reported in `status`.
#pragma once

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

}  // namespace strata
