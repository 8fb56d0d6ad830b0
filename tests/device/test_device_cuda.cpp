// The CUDA device: copies both ways, events, allocation failure, and what a GPU's runtime makes
// of the calls (the fakecuda label runs this binary against the fake CUDA runtime, on GPUs from
// 1): no error left in the thread's last-error slot, the caller's current device unchanged, no
// context on a GPU nobody asked for, registration errors named, the producer-stream hand-off.
// Its own binary so that CTest reports SKIPPED (not a passing binary with a skipped case) on a
// machine without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "device/device_test_util.hpp"
#include "fakecuda/gpu_test_env.hpp"
#include "strata/device.hpp"
#include "strata/device_query.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

using namespace strata;
using namespace std::chrono_literals;
namespace st = strata::testing;

namespace strata {
bool cuda_smoke_test();  // src/cuda/device_query.cu
}  // namespace strata

namespace {

using st::device_round_trip;
using st::gpu_base;

int gpu_count() { return static_cast<int>(query_cuda_devices().devices.size()); }

// The thread's current device, as the runtime reports it.
int current_device() {
  int d = -1;
  EXPECT_EQ(cudaGetDevice(&d), cudaSuccess);
  return d;
}

}  // namespace

TEST(CudaDevice, RoundTripAndEvents) {
  if (gpu_count() <= gpu_base()) GTEST_SKIP() << "no GPU " << gpu_base();
  auto dev = make_device(DeviceKind::kCuda, gpu_base());
  device_round_trip(*dev, (5 << 20) + 123, 4);
  auto ev = dev->create_event();
  auto s = dev->create_stream();
  auto m = dev->allocate(1 << 20);
  s->memset_async(m.get(), 7, 1 << 20);
  s->record(*ev);
  ev->synchronize(10s);
  std::vector<std::uint8_t> back(1 << 20);
  s->memcpy_async(back.data(), m.get(), back.size());
  s->synchronize(10s);
  EXPECT_EQ(back[0], 7);
  EXPECT_EQ(back.back(), 7);
  EXPECT_THROW(dev->allocate(std::size_t(1) << 50), Error);
}

// F1: a query that answers "not ready" records cudaErrorNotReady in the thread's last-error slot;
// the device clears it, so the next launch check of this thread is not failed by it.
TEST(CudaDevice, PollingLeavesNoErrorBehind) {
  if (gpu_count() <= gpu_base()) GTEST_SKIP() << "no GPU " << gpu_base();
  auto dev = make_device(DeviceKind::kCuda, gpu_base());
  auto s = dev->create_stream();
  auto ev = dev->create_event();
  auto m = dev->allocate(64 << 20);
  (void)cudaGetLastError();
  for (int i = 0; i < 3; ++i) {
    s->memset_async(m.get(), i, 64 << 20);
    s->record(*ev);
    while (!ev->query()) std::this_thread::yield();
    EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "after Event::query, round " << i;
    s->memset_async(m.get(), i, 64 << 20);
    s->synchronize(10s);
    EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "after Stream::synchronize, round " << i;
    s->memset_async(m.get(), i, 64 << 20);
    s->record(*ev);
    ev->synchronize(10s);
    EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "after Event::synchronize, round " << i;
  }
}

// F3: every call leaves the caller's current device as it was.
TEST(CudaDevice, CallerCurrentDeviceIsRestored) {
  if (gpu_count() < gpu_base() + 2)
    GTEST_SKIP() << "needs GPUs " << gpu_base() << " and " << gpu_base() + 1;
  const int mine = gpu_base(), theirs = gpu_base() + 1;
  ASSERT_EQ(cudaSetDevice(theirs), cudaSuccess);  // the embedding framework's GPU
  auto dev = make_device(DeviceKind::kCuda, mine);
  EXPECT_EQ(current_device(), theirs) << "make_device";
  auto m = dev->allocate(1 << 20);
  EXPECT_EQ(current_device(), theirs) << "allocate";
  auto s = dev->create_stream();
  auto ev = dev->create_event();
  EXPECT_EQ(current_device(), theirs) << "create_stream / create_event";
  std::vector<std::uint8_t> host(1 << 20, 3), back(1 << 20);
  ASSERT_TRUE(dev->register_host(host.data(), host.size()));
  EXPECT_EQ(current_device(), theirs) << "register_host";
  s->memcpy_async(m.get(), host.data(), host.size());
  s->memset_async(m.get(), 5, 16);
  s->record(*ev);
  s->memcpy_async(back.data(), m.get(), back.size());
  EXPECT_EQ(current_device(), theirs) << "memcpy_async / memset_async / record";
  s->synchronize(10s);
  EXPECT_EQ(back[0], 5);
  EXPECT_EQ(back[16], 3);
  dev->unregister_host(host.data());
  m.reset();
  EXPECT_EQ(current_device(), theirs) << "unregister_host / free";
  ASSERT_EQ(cudaSetDevice(mine), cudaSuccess);
}

// F4: freeing and unregistering from a thread that never used CUDA must not create a context on
// that thread's default GPU 0 (a stray context per rank on a multi-GPU node).
TEST(CudaDevice, FreeFromAFreshThreadTouchesNoOtherGpu) {
  if (!st::under_fakecuda() || gpu_base() < 1)
    GTEST_SKIP() << "needs the fake runtime, GPUs from 1";
  if (gpu_count() <= gpu_base()) GTEST_SKIP() << "no GPU " << gpu_base();
  auto dev = make_device(DeviceKind::kCuda, gpu_base());
  auto m = dev->allocate(1 << 20);
  std::vector<std::uint8_t> host(1 << 16);
  ASSERT_TRUE(dev->register_host(host.data(), host.size()));
  std::thread t([&] {
    m.reset();
    dev->unregister_host(host.data());
  });
  t.join();
  EXPECT_EQ(fakecuda_registered_ranges(), 0);
  for (int d = 0; d < gpu_base(); ++d)
    EXPECT_EQ(fakecuda_context_created(d), 0) << "a context was created on GPU " << d;
}

// F12: a registration failure says what failed (not always "out of memory"), and no failing call
// leaves its error in the thread's slot for a later, unrelated check.
TEST(CudaDevice, FailuresAreNamedAndCleared) {
  if (gpu_count() <= gpu_base()) GTEST_SKIP() << "no GPU " << gpu_base();
  auto dev = make_device(DeviceKind::kCuda, gpu_base());
  std::vector<std::uint8_t> host(1 << 16);
  ASSERT_TRUE(dev->register_host(host.data(), host.size()));
  try {
    dev->register_host(host.data(), host.size());
    ADD_FAILURE() << "registering a registered range succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("AlreadyRegistered"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  dev->unregister_host(host.data());
  auto s = dev->create_stream();
  EXPECT_THROW(s->memset_async(host.data(), 0, 16), Error);  // host memory: not for memset
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "memset_async's error left in the slot";
  EXPECT_THROW(dev->allocate(std::size_t(1) << 50), Error);
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "alloc's error left in the slot";
  s->synchronize(10s);
}

// F7 (the device part): a stream of strata's is ordered after work the caller queued on its own
// stream, without a host synchronisation.
TEST(CudaDevice, ProducerStreamHandOff) {
  if (gpu_count() <= gpu_base()) GTEST_SKIP() << "no GPU " << gpu_base();
  auto dev = make_device(DeviceKind::kCuda, gpu_base());
  const std::size_t n = 1 << 20;
  auto grad = dev->allocate(n);
  std::vector<std::uint8_t> src(n), dst(n, 0);
  for (std::size_t i = 0; i < n; ++i) src[i] = static_cast<std::uint8_t>(i * 7 + 1);
  ASSERT_TRUE(dev->register_host(src.data(), n));
  ASSERT_TRUE(dev->register_host(dst.data(), n));
  int prev = 0;
  ASSERT_EQ(cudaGetDevice(&prev), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(gpu_base()), cudaSuccess);
  cudaStream_t user = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking), cudaSuccess);
  // The "backward": held back by a host function until the mover's copy is queued.
  std::atomic<bool> go{false};
  ASSERT_EQ(cudaLaunchHostFunc(
                user,
                [](void* p) {
                  while (!static_cast<std::atomic<bool>*>(p)->load()) {
                  }
                },
                &go),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(grad.get(), src.data(), n, cudaMemcpyDefault, user), cudaSuccess);
  auto mover = dev->create_stream();
  mover->wait_external(user);
  mover->memcpy_async(dst.data(), grad.get(), n);
  go = true;
  mover->synchronize(10s);
  EXPECT_EQ(dst, src) << "the mover copied the gradient before the producer wrote it";
  ASSERT_EQ(cudaStreamSynchronize(user), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(user), cudaSuccess);
  dev->unregister_host(src.data());
  dev->unregister_host(dst.data());
  mover->wait_external(nullptr);  // the legacy stream: accepted
  mover->synchronize(10s);
  ASSERT_EQ(cudaSetDevice(prev), cudaSuccess);
}

// A sticky device fault fails the stream's wait with Error(kDevice), never a hang or a success.
TEST(CudaDevice, DeviceFaultSurfacesAtTheWait) {
  if (!st::under_fakecuda()) GTEST_SKIP() << "needs the fake runtime's fault injection";
  const int victim = gpu_base() + 1;
  if (gpu_count() <= victim) GTEST_SKIP() << "needs GPU " << victim;
  auto dev = make_device(DeviceKind::kCuda, victim);
  auto s = dev->create_stream();
  auto m = dev->allocate(4096);
  fakecuda_fail_next_kernel(victim);
  // The fault comes from a kernel: the probe kernel of device_query, on this device.
  int prev = 0;
  ASSERT_EQ(cudaGetDevice(&prev), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(victim), cudaSuccess);
  EXPECT_TRUE(cuda_smoke_test() == false);
  ASSERT_EQ(cudaSetDevice(prev), cudaSuccess);
  EXPECT_THROW(
      {
        s->memset_async(m.get(), 1, 4096);
        s->synchronize(10s);
      },
      Error);
}
