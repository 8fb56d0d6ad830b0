// cudaDeviceSynchronize for the raw CUDA Adam timing (adam_step_cuda on the legacy stream).
#include <cuda_runtime.h>

#include "profile/profile_internal.hpp"
#include "strata/error.hpp"

namespace strata::profile {

void gpu_synchronize() {
  const cudaError_t rc = cudaDeviceSynchronize();
  if (rc != cudaSuccess)
    fail(ErrorCode::kDevice, std::string("cudaDeviceSynchronize: ") + cudaGetErrorString(rc));
}

}  // namespace strata::profile
