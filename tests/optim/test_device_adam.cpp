// DeviceAdam on the host-emulated device (the same code path as on a GPU: device buffers, copies
// in, the update on the stream, copies out): bitwise identical to CpuAdam over steps with growing
// and shrinking sizes, fp32/bf16/fp16 gradients and a bf16 param copy; and the faults of the
// fault-injecting device (failed allocation, failed copy, failed kernel, delayed copies) surface as
// errors from step(), never as a silently wrong result.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "optim/adam_test_util.hpp"
#include "strata/adam.hpp"
#include "strata/device.hpp"
#include "strata/device_fault.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata {
namespace {

struct Arrays {
  std::vector<float> p, m, v;
  std::vector<std::uint16_t> copy;
  AdamTensors tensors(const testing::RandomGrads& g, DType gdt) {
    AdamTensors t;
    t.param = p.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.grad = g.data(gdt);
    t.grad_dtype = gdt;
    t.param_copy = copy.data();
    t.param_copy_dtype = DType::kBf16;
    t.n = p.size();
    return t;
  }
};

Arrays random_arrays(std::mt19937_64& rng, std::size_t n) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Arrays a;
  a.p.resize(n);
  a.m.resize(n);
  a.v.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    a.p[i] = nd(rng);
    a.m[i] = 0.01f * nd(rng);
    a.v[i] = 1e-4f * std::fabs(nd(rng));
  }
  a.copy.assign(n, 0x7fff);
  return a;
}

constexpr auto kTimeout = std::chrono::milliseconds(20000);

TEST(DeviceAdam, HostDeviceIsBitwiseCpuAdam) {
  auto dev = make_host_device();
  DeviceAdam dadam(*dev, 2, kTimeout);
  CpuAdam cpu(2);
  std::mt19937_64 rng(testing::test_seed("device-adam"));
  AdamParams hp{OptimizerType::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  std::int64_t step = 0;
  for (std::size_t n : {1000u, 37u, 70001u, 5u, 4096u}) {
    for (DType gdt : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      Arrays a = random_arrays(rng, n);
      Arrays b = a;
      auto g = testing::random_grads(rng, n, gdt, 0.5f);
      ++step;
      // Averaged over a few ranks (grad_divisor), uneven: the divisor reaches the device kernel.
      AdamStepOptions o{step, 0.75f, false, static_cast<float>(1 + step % 4)};
      cpu.step(hp, a.tensors(g, gdt), o);
      dadam.step(hp, b.tensors(g, gdt), o);
      ASSERT_EQ(0, std::memcmp(a.p.data(), b.p.data(), n * 4)) << "n " << n;
      ASSERT_EQ(0, std::memcmp(a.m.data(), b.m.data(), n * 4)) << "n " << n;
      ASSERT_EQ(0, std::memcmp(a.v.data(), b.v.data(), n * 4)) << "n " << n;
      ASSERT_EQ(0, std::memcmp(a.copy.data(), b.copy.data(), n * 2)) << "n " << n;
    }
  }
  EXPECT_GE(dadam.device_bytes(), 70001u * (3 * 4 + 4 + 2));
  // The device arrays never alias the host ones: the host arrays are untouched until copy-back.
  EXPECT_EQ(dadam.device().kind(), DeviceKind::kHost);
}

TEST(DeviceAdam, RejectsCheckFinite) {
  auto dev = make_host_device();
  DeviceAdam dadam(*dev, 1, kTimeout);
  std::mt19937_64 rng(1);
  Arrays a = random_arrays(rng, 10);
  auto g = testing::random_grads(rng, 10, DType::kFp32, 0.5f);
  EXPECT_THROW(dadam.step({}, a.tensors(g, DType::kFp32), AdamStepOptions{1, 1.0f, true}), Error);
}

// Each fault of the fault-injecting device makes step() throw the right error; delays do not
// change the result.
TEST(DeviceAdam, DeviceFaultsSurfaceFromStep) {
  struct Case {
    DeviceFaultKind kind;
    std::uint64_t nth;
    ErrorCode want;
  };
  const Case cases[] = {{DeviceFaultKind::kAllocFail, 1, ErrorCode::kOutOfMemory},
                        {DeviceFaultKind::kCopyFail, 1, ErrorCode::kDevice},       // a copy in
                        {DeviceFaultKind::kCopyFail, 7, ErrorCode::kDevice},       // a copy back
                        {DeviceFaultKind::kHostFuncFail, 1, ErrorCode::kDevice}};  // the kernel
  std::mt19937_64 rng(testing::test_seed("device-adam-faults"));
  AdamParams hp{OptimizerType::kAdam, 1e-3, 0.9, 0.999, 1e-8, 0.0};
  for (const Case& c : cases) {
    auto fd = std::make_unique<FaultInjectingDevice>(make_host_device());
    FaultInjectingDevice* faults = fd.get();
    DeviceAdam dadam(*fd, 1, kTimeout);
    const std::size_t id = faults->add_fault({c.kind, c.nth, 1, {}});
    Arrays a = random_arrays(rng, 3000);
    auto g = testing::random_grads(rng, 3000, DType::kFp32, 0.5f);
    try {
      dadam.step(hp, a.tensors(g, DType::kFp32), AdamStepOptions{1, 1.0f, false});
      FAIL() << "fault kind " << static_cast<int>(c.kind) << " nth " << c.nth << " went unnoticed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), c.want) << e.what();
      EXPECT_NE(std::string(e.what()).find("injected"), std::string::npos) << e.what();
    }
    EXPECT_EQ(faults->fired(id), 1u);
  }
  // Delayed copies: same bits as CpuAdam.
  auto fd = std::make_unique<FaultInjectingDevice>(make_host_device());
  fd->add_fault({DeviceFaultKind::kDelay, 1, 0, std::chrono::milliseconds(2)});
  DeviceAdam dadam(*fd, 1, kTimeout);
  CpuAdam cpu(1);
  Arrays a = random_arrays(rng, 5000);
  Arrays b = a;
  auto g = testing::random_grads(rng, 5000, DType::kBf16, 0.5f);
  cpu.step(hp, a.tensors(g, DType::kBf16), AdamStepOptions{3, 1.0f, false});
  dadam.step(hp, b.tensors(g, DType::kBf16), AdamStepOptions{3, 1.0f, false});
  EXPECT_EQ(0, std::memcmp(a.p.data(), b.p.data(), 5000 * 4));
  EXPECT_EQ(0, std::memcmp(a.copy.data(), b.copy.data(), 5000 * 2));
}

}  // namespace
}  // namespace strata
