// The current-device guard (device_guard.hpp).
#include "cuda/device_guard.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::cuda {
namespace {

using PrimaryCtxGetState = CUresult (*)(CUdevice, unsigned int*, int*);

PrimaryCtxGetState primary_ctx_get_state() {
  static const PrimaryCtxGetState fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &p, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<PrimaryCtxGetState>(nullptr);
    }
    return reinterpret_cast<PrimaryCtxGetState>(p);
  }();
  return fn;
}

[[noreturn]] void fail_cuda(cudaError_t rc, const std::string& call) {
  (void)cudaGetLastError();  // a non-sticky error must not surface at an unrelated later check
  fail(ErrorCode::kDevice,
       strcat("CUDA ", call, " failed: ", cudaGetErrorName(rc), ": ", cudaGetErrorString(rc)));
}

}  // namespace

bool primary_context_active(int ordinal) noexcept {
  PrimaryCtxGetState fn = primary_ctx_get_state();
  if (!fn) return true;
  unsigned int flags = 0;
  int active = 0;
  if (fn(static_cast<CUdevice>(ordinal), &flags, &active) != CUDA_SUCCESS) return true;
  return active != 0;
}

DeviceGuard::DeviceGuard(int ordinal) {
  int current = 0;
  cudaError_t rc = cudaGetDevice(&current);
  if (rc != cudaSuccess) fail_cuda(rc, "cudaGetDevice");
  if (current == ordinal) return;
  rc = cudaSetDevice(ordinal);
  if (rc != cudaSuccess) fail_cuda(rc, strcat("cudaSetDevice(", ordinal, ")"));
  previous_ = current;
}

DeviceGuard::~DeviceGuard() {
  if (previous_ < 0 || !primary_context_active(previous_)) return;
  const cudaError_t rc = cudaSetDevice(previous_);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    log_error("CUDA cudaSetDevice(", previous_,
              ") restoring the caller's device failed: ", cudaGetErrorString(rc));
  }
}

int stream_device(void* stream) {
  int dev = 0;
  const cudaError_t rc =
      stream ? cudaStreamGetDevice(static_cast<cudaStream_t>(stream), &dev) : cudaGetDevice(&dev);
  if (rc != cudaSuccess) fail_cuda(rc, stream ? "cudaStreamGetDevice" : "cudaGetDevice");
  return dev;
}

}  // namespace strata::cuda
