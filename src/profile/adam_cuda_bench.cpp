// The CUDA Adam kernel against a device-to-device copy of the same traffic (strata bench adam
// --device cuda, the profiler): see profile/adam_bench.hpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "profile/adam_bench.hpp"
#include "strata/adam.hpp"
#include "strata/error.hpp"

namespace strata::profile {
namespace {
void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    fail(ErrorCode::kDevice, strcat(what, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}
}  // namespace

AdamCudaBenchResult run_adam_cuda_bench(std::size_t params, int rounds) {
  if (params == 0 || rounds < 1)
    fail(ErrorCode::kInvalidArgument, "bench adam --device cuda: params > 0 and rounds >= 1");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    fail(ErrorCode::kUnsupported, "bench adam --device cuda: no CUDA device");
  struct DevBuf {
    void* p = nullptr;
    ~DevBuf() {
      if (p) cudaFree(p);
    }
  };
  DevBuf p, m, v, g, copy_src, copy_dst;
  const std::size_t bytes = params * 4;
  check_cuda(cudaMalloc(&p.p, bytes), "cudaMalloc param");
  check_cuda(cudaMalloc(&m.p, bytes), "cudaMalloc exp_avg");
  check_cuda(cudaMalloc(&v.p, bytes), "cudaMalloc exp_avg_sq");
  check_cuda(cudaMalloc(&g.p, bytes), "cudaMalloc grad");
  // The copy moves as many bytes as one step: 28 B/param = 14 B read + 14 B written.
  const std::size_t copy_bytes = params * 14;
  check_cuda(cudaMalloc(&copy_src.p, copy_bytes), "cudaMalloc copy src");
  check_cuda(cudaMalloc(&copy_dst.p, copy_bytes), "cudaMalloc copy dst");
  check_cuda(cudaMemset(p.p, 0, bytes), "cudaMemset");
  check_cuda(cudaMemset(m.p, 0, bytes), "cudaMemset");
  check_cuda(cudaMemset(v.p, 0, bytes), "cudaMemset");
  check_cuda(cudaMemset(g.p, 0, bytes), "cudaMemset");
  check_cuda(cudaMemset(copy_src.p, 0, copy_bytes), "cudaMemset");
  cudaEvent_t e0, e1;
  check_cuda(cudaEventCreate(&e0), "cudaEventCreate");
  check_cuda(cudaEventCreate(&e1), "cudaEventCreate");
  const AdamParams hp{OptimizerType::kAdamW, 1e-4, 0.9, 0.999, 1e-8, 0.01};
  AdamTensors t{static_cast<float*>(p.p),
                static_cast<float*>(m.p),
                static_cast<float*>(v.p),
                g.p,
                DType::kFp32,
                nullptr,
                DType::kBf16,
                params};
  AdamCudaBenchResult r;
  std::int64_t step = 1;
  auto time_it = [&](auto&& fn) {
    check_cuda(cudaEventRecord(e0, nullptr), "cudaEventRecord");
    fn();
    check_cuda(cudaEventRecord(e1, nullptr), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    return double(ms) / 1e3;
  };
  auto adam = [&] { adam_step_cuda(hp, t, {step++, 1.0f, false}, nullptr, nullptr); };
  auto copy = [&] {
    check_cuda(
        cudaMemcpyAsync(copy_dst.p, copy_src.p, copy_bytes, cudaMemcpyDeviceToDevice, nullptr),
        "cudaMemcpyAsync D2D");
  };
  time_it(adam);
  time_it(copy);
  std::vector<double> fr;
  for (int i = 0; i < rounds; ++i) {
    const double ta = time_it(adam), tc = time_it(copy);
    r.adam_seconds.push_back(ta);
    r.copy_seconds.push_back(tc);
    fr.push_back(tc / ta);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(fr.begin(), fr.end());
  r.fraction_of_copy = fr[fr.size() / 2];
  std::vector<double> a = r.adam_seconds, c = r.copy_seconds;
  std::sort(a.begin(), a.end());
  std::sort(c.begin(), c.end());
  r.adam_params_per_second = double(params) / a[a.size() / 2];
  r.adam_bytes_per_second = r.adam_params_per_second * 28.0;
  r.copy_bytes_per_second = 2.0 * double(copy_bytes) / c[c.size() / 2];
  return r;
}

}  // namespace strata::profile
