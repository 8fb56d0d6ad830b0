// CUDA Adam/AdamW against the CPU kernel (bit for bit: same operation order, correctly rounded
// intrinsics), vectorized and misaligned (element-wise) variants, and the asynchronous
// non-finite flag, DeviceAdam on a CUDA device. Skipped without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.hpp"
#include "fakecuda/gpu_test_env.hpp"
#include "optim/accumulate.hpp"
#include "optim/adam_test_util.hpp"
#include "strata/adam.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata {
namespace {

using testing::gpu_base;

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// A GPU from gpu_base() on, made current for the raw-API parts of the tests.
bool have_device() {
  if (device_count() <= gpu_base()) return false;
  return cudaSetDevice(gpu_base()) == cudaSuccess;
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

// DeviceAdam on GPU gpu_base() beside a CpuAdam, two threads each, and normal(0, 1) values:
// SKIPPED (in SetUp) without a CUDA device.
class DeviceAdamVsCpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_device()) GTEST_SKIP() << "no CUDA device";
    dev = make_device(DeviceKind::kCuda, gpu_base());
    dadam_ = std::make_unique<DeviceAdam>(*dev, 2, std::chrono::milliseconds(20000));
  }
  std::unique_ptr<Device> dev;
  std::unique_ptr<DeviceAdam> dadam_;
  CpuAdam cpu{2};
  std::normal_distribution<float> nd{0.0f, 1.0f};
};

// optimizer.update: device on a GPU — DeviceAdam (copies in, adam_step_cuda on its stream, copies
// out) against CpuAdam on the same host arrays, bit for bit, and a host function on a CUDA stream.
TEST_F(DeviceAdamVsCpu, DeviceAdamOnCudaMatchesCpu) {
  std::mt19937_64 rng(testing::test_seed("AdamCuda.DeviceAdam"));
  DeviceAdam& dadam = *dadam_;
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

// F9 (issue 27): the parameter groups of one chunk are queued on DeviceAdam's stream and waited
// for once (the fake runtime's "host_sync": one, not one per group), bitwise what CpuAdam makes
// of each group with its own hyper-parameters.
TEST_F(DeviceAdamVsCpu, DeviceAdamGroupsOfAChunkWaitOnce) {
  std::mt19937_64 rng(testing::test_seed("AdamCuda.DeviceAdamGroups"));
  DeviceAdam& dadam = *dadam_;
  constexpr std::size_t kCuts[4] = {0, 1000, 2501, 3000};  // three groups, one misaligned
  constexpr std::size_t n = kCuts[3];
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  for (auto& x : p) x = nd(rng);
  testing::RandomGrads g = testing::random_grads(rng, n, DType::kFp32, 0.1f);
  const auto* gh = static_cast<const float*>(g.data(DType::kFp32));
  // Device copies of master | m | v | grad, and the bf16 param copy.
  auto dmem = dev->allocate(4 * n * sizeof(float) + n * sizeof(std::uint16_t));
  auto* dp = static_cast<float*>(dmem.get());
  float* arrays[4] = {dp, dp + n, dp + 2 * n, dp + 3 * n};
  auto* dcopy = reinterpret_cast<std::uint16_t*>(dp + 4 * n);
  auto s = dev->create_stream();
  const float* host_in[4] = {p.data(), m.data(), v.data(), gh};
  for (int k = 0; k < 4; ++k) s->memcpy_async(arrays[k], host_in[k], n * sizeof(float));
  s->synchronize(std::chrono::milliseconds(10000));
  auto group_params = [](int k) {
    return AdamParams{OptimizerType::kAdamW, 1e-3 * (k + 1), 0.9, 0.999, 1e-8, 0.01 * k};
  };
  std::vector<std::uint16_t> copy(n), want_copy(n);
  if (testing::under_fakecuda()) fakecuda_reset_counters();
  for (int k = 0; k < 3; ++k) {
    const std::size_t o = kCuts[k], len = kCuts[k + 1] - kCuts[k];
    dadam.enqueue_resident(group_params(k),
                           AdamTensors{arrays[0] + o, arrays[1] + o, arrays[2] + o, arrays[3] + o,
                                       DType::kFp32, dcopy + o, DType::kBf16, len},
                           {1, 1.0f, false});
  }
  dadam.wait();
  if (testing::under_fakecuda()) {
    EXPECT_EQ(fakecuda_counter("host_sync"), 1) << "one wait for the three groups' kernels";
  }
  std::vector<float> got_p(n);
  s->memcpy_async(got_p.data(), arrays[0], n * sizeof(float));
  s->memcpy_async(copy.data(), dcopy, n * sizeof(std::uint16_t));
  s->synchronize(std::chrono::milliseconds(10000));
  for (int k = 0; k < 3; ++k) {
    const std::size_t o = kCuts[k], len = kCuts[k + 1] - kCuts[k];
    cpu.step(group_params(k),
             AdamTensors{p.data() + o, m.data() + o, v.data() + o, gh + o, DType::kFp32,
                         want_copy.data() + o, DType::kBf16, len},
             {1, 1.0f, false});
  }
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(testing::bits_of(got_p[i]), testing::bits_of(p[i])) << "p[" << i << "]";
    ASSERT_EQ(copy[i], want_copy[i]) << "copy[" << i << "]";
  }
}

// F1: a stream query that answered "not ready" leaves cudaErrorNotReady in the thread's
// last-error slot; the launch check must not mistake it for a failed launch.
TEST(AdamCuda, LaunchAfterANotReadyQuery) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const std::size_t n = 1 << 22;
  Dev dp(n * 4), dm(n * 4), dv(n * 4), dg(n * 4);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));
  CUDA_OK(cudaMemsetAsync(dp.p, 0, n * 4, s));
  CUDA_OK(cudaMemsetAsync(dm.p, 0, n * 4, s));
  CUDA_OK(cudaMemsetAsync(dv.p, 0, n * 4, s));
  CUDA_OK(cudaMemsetAsync(dg.p, 0, n * 4, s));
  cudaError_t q = cudaStreamQuery(s);  // the engine thread always polls first
  if (q != cudaErrorNotReady) GTEST_SKIP() << "the memsets finished before the query";
  AdamTensors t{dp.at<float>(0), dm.at<float>(0), dv.at<float>(0), dg.p,
                DType::kFp32,    nullptr,         DType::kBf16,    n};
  EXPECT_NO_THROW(adam_step_cuda(AdamParams{}, t, {1, 1.0f, false}, s, nullptr));
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaStreamDestroy(s));
}

// F2: the kernel goes to the stream's device whatever the calling thread's current device is,
// and the caller's device is left as it was.
TEST(AdamCuda, LaunchesOnTheStreamsDevice) {
  if (device_count() < gpu_base() + 2 || !have_device())
    GTEST_SKIP() << "needs GPUs " << gpu_base() << " and " << gpu_base() + 1;
  auto dev = make_device(DeviceKind::kCuda, gpu_base());
  const std::size_t n = 1000;
  std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f), g(n, 0.25f);
  std::vector<float> p2 = p, m2 = m, v2 = v;
  auto mem = dev->allocate(4 * n * 4);
  auto* base = static_cast<float*>(mem.get());
  AdamTensors d{base, base + n, base + 2 * n, base + 3 * n, DType::kFp32, nullptr, DType::kBf16, n};
  auto s = dev->create_stream();
  s->memcpy_async(d.param, p.data(), n * 4);
  s->memcpy_async(d.exp_avg, m.data(), n * 4);
  s->memcpy_async(d.exp_avg_sq, v.data(), n * 4);
  s->memcpy_async(const_cast<void*>(d.grad), g.data(), n * 4);
  CUDA_OK(cudaSetDevice(gpu_base() + 1));  // the caller works on another GPU
  const AdamParams hp{OptimizerType::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  ASSERT_NO_THROW(adam_step_cuda(hp, d, {1, 1.0f, false}, s->native_handle(), nullptr));
  int cur = -1;
  CUDA_OK(cudaGetDevice(&cur));
  EXPECT_EQ(cur, gpu_base() + 1) << "adam_step_cuda changed the caller's device";
  std::vector<float> out(n);
  s->memcpy_async(out.data(), d.param, n * 4);
  s->synchronize(std::chrono::milliseconds(20000));
  CpuAdam cpu(1);
  AdamTensors h{p2.data(), m2.data(), v2.data(), g.data(), DType::kFp32, nullptr, DType::kBf16, n};
  cpu.step(hp, h, {1, 1.0f, false});
  for (std::size_t i = 0; i < n; ++i)
    ASSERT_EQ(testing::bits_of(out[i]), testing::bits_of(p2[i])) << i;
  CUDA_OK(cudaSetDevice(gpu_base()));
}

// F17, issue 47 point 6: NaN results have the CPU kernels' bits on the GPU, in the fp16 / bf16 /
// fp32 copy and in p, m, v. A GPU's arithmetic gives the canonical NaN 0x7fffffff (an H200 wrote
// 0x7e00 for the fp16 copy of element 1 where the CPU writes 0xfe00); the kernel computes an
// element whose update is NaN again with x86's NaN rules (optim/adam_nan.hpp). One NaN source per
// element: where two NaNs meet in one operation, the CPU's own bits depend on its compiler's
// choice of operand order.
struct NanCase {
  std::vector<float> p, m, v;
  std::vector<unsigned char> g;  // in the gradient dtype
};

NanCase nan_case(DType gd) {
  const std::size_t n = 13;  // vec4: three iterations and an element-wise tail
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  NanCase c{
      std::vector<float>(n, 0.25f), std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f), {}};
  c.p[0] = qnan;
  c.p[1] = -qnan;
  c.p[2] = 1.5f;
  c.p[3] = testing::float_of(0xffc01234u);  // a negative quiet NaN with a payload
  c.p[4] = testing::float_of(0xff800001u);  // a negative signalling NaN
  c.m[5] = -qnan;
  c.v[6] = -qnan;
  c.p[10] = -inf;
  c.p[12] = -qnan;  // the tail
  std::vector<float> g(n, 0.5f);
  g[7] = inf;  // check_finite off: inf / inf in the update, x86's NaN 0xffc00000
  g[8] = -inf;
  c.g.resize(n * testing::dt_size(gd));
  for (std::size_t i = 0; i < n; ++i) store_elem(c.g.data(), i, gd, g[i]);
  // 9: a negative signalling NaN gradient with a payload, in the gradient's own dtype.
  if (gd == DType::kFp32) {
    const std::uint32_t b = 0xff800101u;
    std::memcpy(c.g.data() + 9 * 4, &b, 4);
  } else {
    const std::uint16_t b = gd == DType::kBf16 ? 0xff81 : 0xfd01;
    std::memcpy(c.g.data() + 9 * 2, &b, 2);
  }
  return c;
}

void expect_same_bits(const void* gpu, const void* cpu, std::size_t n, std::size_t elem,
                      const std::string& what) {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t a = 0, b = 0;
    std::memcpy(&a, static_cast<const char*>(gpu) + i * elem, elem);
    std::memcpy(&b, static_cast<const char*>(cpu) + i * elem, elem);
    EXPECT_EQ(a, b) << what << " element " << i << std::hex << ": gpu 0x" << a << ", cpu 0x" << b;
  }
}

// One step of the case on the CPU kernels and on the GPU (arrays `off` elements into their
// allocations: 0 vec4, 1 element-wise), every output compared bit for bit.
void run_nan_case(DType gd, DType cd, const AdamParams& hp, std::size_t off,
                  const std::string& what) {
  NanCase c = nan_case(gd);
  const std::size_t n = c.p.size(), gs = testing::dt_size(gd), cs = testing::dt_size(cd);
  NanCase h = c;
  std::vector<unsigned char> cpu_copy(n * cs), gpu_copy(n * cs);
  CpuAdam cpu(1);
  cpu.step(hp, {h.p.data(), h.m.data(), h.v.data(), h.g.data(), gd, cpu_copy.data(), cd, n},
           {1, 1.0f, false});
  Dev dp((n + off) * 4), dm((n + off) * 4), dv((n + off) * 4), dg((n + off) * gs),
      dc((n + off) * cs);
  char* g = static_cast<char*>(dg.p) + off * gs;
  char* cp = static_cast<char*>(dc.p) + off * cs;
  CUDA_OK(cudaMemcpy(dp.at<float>(off), c.p.data(), n * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dm.at<float>(off), c.m.data(), n * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dv.at<float>(off), c.v.data(), n * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(g, c.g.data(), n * gs, cudaMemcpyHostToDevice));
  adam_step_cuda(hp, {dp.at<float>(off), dm.at<float>(off), dv.at<float>(off), g, gd, cp, cd, n},
                 {1, 1.0f, false}, nullptr, nullptr);
  CUDA_OK(cudaMemcpy(c.p.data(), dp.at<float>(off), n * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(c.m.data(), dm.at<float>(off), n * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(c.v.data(), dv.at<float>(off), n * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(gpu_copy.data(), cp, n * cs, cudaMemcpyDeviceToHost));
  expect_same_bits(gpu_copy.data(), cpu_copy.data(), n, cs,
                   what + " " + testing::dt_name(cd) + " copy");
  expect_same_bits(c.p.data(), h.p.data(), n, 4, what + " p");
  expect_same_bits(c.m.data(), h.m.data(), n, 4, what + " m");
  expect_same_bits(c.v.data(), h.v.data(), n, 4, what + " v");
}

TEST(AdamCuda, NanCopiesMatchTheCpu) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const AdamParams plain{OptimizerType::kAdam, 1e-3, 0.9, 0.999, 1e-8, 0.0};
  const AdamParams adamw{OptimizerType::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  const AdamParams l2{OptimizerType::kAdam, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  for (DType gd : {DType::kFp32, DType::kBf16, DType::kFp16})
    for (DType cd : {DType::kFp16, DType::kBf16, DType::kFp32})
      for (const AdamParams* hp : {&plain, &adamw, &l2})
        for (std::size_t off : {std::size_t(0), std::size_t(1)})
          run_nan_case(gd, cd, *hp, off,
                       std::string("grad ") + testing::dt_name(gd) +
                           (hp == &plain   ? " adam"
                            : hp == &adamw ? " adamw"
                                           : " adam+l2") +
                           " off=" + std::to_string(off));
}

// Values of `dt` for the accumulation test: ordinary numbers, infinities, and NaNs of both signs
// with payloads in the dtype's own encoding (index -> float, or raw bits where `raw` is set).
std::vector<unsigned char> accumulate_values(DType dt, const std::vector<float>& x,
                                             const std::vector<std::uint32_t>& raw) {
  std::vector<unsigned char> out(x.size() * testing::dt_size(dt));
  for (std::size_t i = 0; i < x.size(); ++i) {
    store_elem(out.data(), i, dt, x[i]);
    if (raw[i] == 0) continue;
    if (dt == DType::kFp32) {
      std::memcpy(out.data() + 4 * i, &raw[i], 4);
    } else {  // the top half of the fp32 pattern for bf16; an fp16 NaN of the same sign
      const std::uint16_t h = dt == DType::kBf16
                                  ? std::uint16_t(raw[i] >> 16)
                                  : std::uint16_t(((raw[i] >> 16) & 0x8000u) | 0x7d01u);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

// The gradient accumulation kernel (accumulate_cuda) against the CPU's (accumulate_elems), bit for
// bit, NaN results included: x86's NaN of dst + src, and the CPU's widening of an fp16 NaN.
TEST(AccumulateCuda, NanResultsMatchTheCpu) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const float inf = std::numeric_limits<float>::infinity();
  // One NaN source per element (two NaNs meeting: the CPU's bits depend on its compiler).
  const std::vector<float> dx = {1.5f, 0.0f, 2.0f, inf, 3.0f, 0.5f, -inf, 0.25f};
  const std::vector<std::uint32_t> draw = {0, 0xffc01234u, 0, 0, 0, 0, 0, 0x7fa00001u};
  const std::vector<float> sx = {0.25f, 1.0f, 0.0f, -inf, 0.0f, 0.5f, 1.0f, 1e-3f};
  const std::vector<std::uint32_t> sraw = {0, 0, 0xff812345u, 0, 0xffc00000u, 0, 0, 0};
  const std::pair<DType, DType> pairs[] = {{DType::kFp32, DType::kFp32},
                                           {DType::kBf16, DType::kBf16},
                                           {DType::kFp16, DType::kFp16},
                                           {DType::kFp32, DType::kBf16},
                                           {DType::kFp32, DType::kFp16}};
  const std::size_t n = dx.size();
  for (const auto& [dd, sd] : pairs) {
    for (bool add : {true, false}) {
      const std::string what = std::string(testing::dt_name(dd)) + " += " + testing::dt_name(sd) +
                               (add ? " add" : " convert");
      std::vector<unsigned char> cpu = accumulate_values(dd, dx, draw);
      const std::vector<unsigned char> src = accumulate_values(sd, sx, sraw);
      std::vector<unsigned char> gpu(cpu.size());
      Dev ddst(cpu.size()), dsrc(src.size());
      CUDA_OK(cudaMemcpy(ddst.p, cpu.data(), cpu.size(), cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(dsrc.p, src.data(), src.size(), cudaMemcpyHostToDevice));
      accumulate_cuda(ddst.p, dd, dsrc.p, sd, n, add, nullptr);
      CUDA_OK(cudaMemcpy(gpu.data(), ddst.p, gpu.size(), cudaMemcpyDeviceToHost));
      accumulate_elems(cpu.data(), dd, src.data(), sd, n, add);
      expect_same_bits(gpu.data(), cpu.data(), n, testing::dt_size(dd), what);
    }
  }
}

}  // namespace
}  // namespace strata
