// CUDA Adam/AdamW against the CPU kernel (bit for bit: same operation order, correctly rounded
// intrinsics), vectorized and misaligned (element-wise) variants, and the asynchronous
// non-finite flag, DeviceAdam on a CUDA device. Skipped without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <string>
#include <vector>

#include "optim/adam_test_util.hpp"
#include "strata/adam.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata {
namespace {

bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

struct Dev {
  void* p = nullptr;
  explicit Dev(std::size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes + 64), cudaSuccess); }
  ~Dev() { cudaFree(p); }
  template <class T>
  T* at(std::size_t elem_offset) {
    return static_cast<T*>(p) + elem_offset;
  }
};

TEST(AdamCuda, MatchesCpuKernelBitForBit) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const std::uint64_t seed = testing::test_seed("AdamCuda.MatchesCpu");
  std::mt19937_64 rng(seed);
  CpuAdam cpu(2);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  for (std::size_t n : {std::size_t(1), std::size_t(7), std::size_t(100003)}) {
    for (DType gd : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      for (std::size_t off : {std::size_t(0), std::size_t(1)}) {  // 1: not 16-byte aligned
        const DType cd = gd == DType::kFp16 ? DType::kFp16 : DType::kBf16;
        const std::string what =
            "n=" + std::to_string(n) + " " + testing::dt_name(gd) + " off=" + std::to_string(off);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
        for (auto& x : p) x = nd(rng);
        std::vector<std::uint16_t> copy(n, 0);
        Dev dp(n * 4 + 16), dm(n * 4 + 16), dv(n * 4 + 16), dg(n * 4 + 16), dc(n * 4 + 16);
        CUDA_OK(cudaMemcpy(dp.at<float>(off), p.data(), n * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dm.at<float>(off), m.data(), n * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dv.at<float>(off), v.data(), n * 4, cudaMemcpyHostToDevice));
        const AdamParams hp{
            (n % 2) ? OptimizerType::kAdamW : OptimizerType::kAdam, 1e-3, 0.9, 0.999, 1e-8, 0.01};
        for (int step = 1; step <= 10; ++step) {
          testing::RandomGrads g = testing::random_grads(rng, n, gd, 0.1f);
          const std::size_t gb = n * testing::dt_size(gd);
          void* dgp = gd == DType::kFp32 ? static_cast<void*>(dg.at<float>(off))
                                         : static_cast<void*>(dg.at<std::uint16_t>(off));
          CUDA_OK(cudaMemcpy(dgp, g.data(gd), gb, cudaMemcpyHostToDevice));
          AdamTensors tc{p.data(), m.data(), v.data(), g.data(gd), gd, copy.data(), cd, n};
          // grad_divisor 1..3 over the steps (ranks' average, uneven) on both kernels.
          const AdamStepOptions o{step, 0.5f, false, static_cast<float>(1 + step % 3)};
          ASSERT_TRUE(cpu.step(hp, tc, o).applied);
          AdamTensors td{dp.at<float>(off),
                         dm.at<float>(off),
                         dv.at<float>(off),
                         dgp,
                         gd,
                         dc.at<std::uint16_t>(off),
                         cd,
                         n};
          adam_step_cuda(hp, td, o, stream, nullptr);
        }
        CUDA_OK(cudaStreamSynchronize(stream));
        std::vector<float> gp(n), gm(n), gv(n);
        std::vector<std::uint16_t> gc(n);
        CUDA_OK(cudaMemcpy(gp.data(), dp.at<float>(off), n * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(gm.data(), dm.at<float>(off), n * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(gv.data(), dv.at<float>(off), n * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(gc.data(), dc.at<std::uint16_t>(off), n * 2, cudaMemcpyDeviceToHost));
        for (std::size_t i = 0; i < n; ++i) {
          ASSERT_EQ(testing::bits_of(gp[i]), testing::bits_of(p[i])) << what << " p[" << i << "]";
          ASSERT_EQ(testing::bits_of(gm[i]), testing::bits_of(m[i])) << what << " m[" << i << "]";
          ASSERT_EQ(testing::bits_of(gv[i]), testing::bits_of(v[i])) << what << " v[" << i << "]";
          ASSERT_EQ(gc[i], copy[i]) << what << " copy[" << i << "]";
        }
      }
    }
  }
  cudaStreamDestroy(stream);
}

TEST(AdamCuda, NonFiniteFlagSkipsTheUpdate) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const std::size_t n = 4099;
  std::vector<float> p(n, 1.0f), g(n, 0.1f);
  g[1234] = std::numeric_limits<float>::infinity();
  Dev dp(n * 4), dm(n * 4), dv(n * 4), dg(n * 4), flag(4);
  CUDA_OK(cudaMemcpy(dp.p, p.data(), n * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(dm.p, 0, n * 4));
  CUDA_OK(cudaMemset(dv.p, 0, n * 4));
  CUDA_OK(cudaMemcpy(dg.p, g.data(), n * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(flag.p, 0, 4));
  AdamTensors t{dp.at<float>(0), dm.at<float>(0), dv.at<float>(0), dg.p,
                DType::kFp32,    nullptr,         DType::kBf16,    n};
  EXPECT_THROW(adam_step_cuda(AdamParams{}, t, {1, 1.0f, true}, nullptr, nullptr), Error);
  adam_step_cuda(AdamParams{}, t, {1, 1.0f, true}, nullptr, flag.at<int>(0));
  CUDA_OK(cudaDeviceSynchronize());
  int h = 0;
  std::vector<float> out(n);
  CUDA_OK(cudaMemcpy(&h, flag.p, 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(out.data(), dp.p, n * 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(h, 1);
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], 1.0f) << i;
  // Finite gradients with a cleared flag: applied.
  g[1234] = 0.1f;
  CUDA_OK(cudaMemcpy(dg.p, g.data(), n * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(flag.p, 0, 4));
  adam_step_cuda(AdamParams{}, t, {1, 1.0f, true}, nullptr, flag.at<int>(0));
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(&h, flag.p, 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(out.data(), dp.p, n * 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(h, 0);
  EXPECT_NE(out[0], 1.0f);
}

// optimizer.update: device on a GPU — DeviceAdam (copies in, adam_step_cuda on its stream, copies
// out) against CpuAdam on the same host arrays, bit for bit, and a host function on a CUDA stream.
TEST(AdamCuda, DeviceAdamOnCudaMatchesCpu) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  auto dev = make_device(DeviceKind::kCuda);
  DeviceAdam dadam(*dev, 2, std::chrono::milliseconds(20000));
  CpuAdam cpu(2);
  std::mt19937_64 rng(testing::test_seed("AdamCuda.DeviceAdam"));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const AdamParams hp{OptimizerType::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  for (std::size_t n : {std::size_t(5), std::size_t(70001), std::size_t(4096)}) {
    std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
    for (auto& x : p) x = nd(rng);
    std::vector<float> p2 = p, m2 = m, v2 = v;
    std::vector<std::uint16_t> c1(n), c2(n);
    for (int step = 1; step <= 3; ++step) {
      testing::RandomGrads g = testing::random_grads(rng, n, DType::kBf16, 0.1f);
      AdamTensors a{p.data(),     m.data(),  v.data(),     g.data(DType::kBf16),
                    DType::kBf16, c1.data(), DType::kBf16, n};
      AdamTensors b{p2.data(),    m2.data(), v2.data(),    g.data(DType::kBf16),
                    DType::kBf16, c2.data(), DType::kBf16, n};
      cpu.step(hp, a, {step, 0.5f, false});
      dadam.step(hp, b, {step, 0.5f, false});
    }
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(testing::bits_of(p2[i]), testing::bits_of(p[i])) << "n=" << n << " p[" << i << "]";
      ASSERT_EQ(testing::bits_of(m2[i]), testing::bits_of(m[i])) << "n=" << n << " m[" << i << "]";
      ASSERT_EQ(testing::bits_of(v2[i]), testing::bits_of(v[i])) << "n=" << n << " v[" << i << "]";
      ASSERT_EQ(c2[i], c1[i]) << "n=" << n << " copy[" << i << "]";
    }
  }
  // A host function runs in stream order, and its exception fails the stream.
  auto s = dev->create_stream();
  int seen = 0;
  s->launch_host_func([&] { seen = 42; });
  s->synchronize(std::chrono::milliseconds(10000));
  EXPECT_EQ(seen, 42);
  s->launch_host_func([] { fail(ErrorCode::kDevice, "host function failed on purpose"); });
  EXPECT_THROW(s->synchronize(std::chrono::milliseconds(10000)), Error);
}

}  // namespace
}  // namespace strata
