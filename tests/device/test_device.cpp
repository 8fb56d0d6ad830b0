#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "device/device_test_util.hpp"
#include "strata/device.hpp"
#include "strata/device_query.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

using namespace strata;
using namespace std::chrono_literals;
namespace st = strata::testing;

namespace {

using st::device_round_trip;

}  // namespace

TEST(HostDevice, CopiesInStreamOrder) {
  auto dev = make_host_device();
  EXPECT_EQ(dev->kind(), DeviceKind::kHost);
  device_round_trip(*dev, 12345, 1);
  // Ordered queue: a later memset must not overtake an earlier copy.
  auto mem = dev->allocate(3 << 20);
  auto src = st::random_bytes(3 << 20, 2);
  std::vector<std::uint8_t> back(3 << 20);
  auto s = dev->create_stream();
  s->memcpy_async(mem.get(), src.data(), src.size());
  s->memset_async(mem.get(), 0x5A, 100);
  s->memcpy_async(back.data(), mem.get(), back.size());
  s->synchronize(10s);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(back[i], 0x5A);
  EXPECT_EQ(0, std::memcmp(back.data() + 100, src.data() + 100, src.size() - 100));
}

TEST(HostDevice, EventsOrderTwoStreams) {
  auto dev = make_host_device();
  auto a = dev->create_stream();
  auto b = dev->create_stream();
  auto ev = dev->create_event();
  EXPECT_TRUE(ev->query());  // never recorded
  const std::size_t n = 8 << 20;
  auto src = st::random_bytes(n, 3);
  auto mem = dev->allocate(n);
  std::vector<std::uint8_t> back(n);
  a->memcpy_async(mem.get(), src.data(), n);
  a->record(*ev);
  b->wait_event(*ev);
  b->memcpy_async(back.data(), mem.get(), n);
  b->synchronize(10s);
  ev->synchronize(1s);
  EXPECT_TRUE(ev->query());
  EXPECT_EQ(back, src);
}

TEST(HostDevice, AllocationBeyondCapacityFails) {
  auto dev = make_host_device(1 << 20);
  auto m = dev->allocate(600 << 10);
  st::expect_error(ErrorCode::kOutOfMemory, "614400", [&] { auto m2 = dev->allocate(600 << 10); });
  m.reset();
  auto m3 = dev->allocate(900 << 10);  // freed memory is available again
  EXPECT_TRUE(m3);
}

TEST(HostDevice, SynchronizeTimesOutWhileBlocked) {
  auto dev = make_host_device();
  auto a = dev->create_stream();
  auto b = dev->create_stream();
  auto never = dev->create_event();
  auto gate = dev->create_stream();
  // `b` waits for an event recorded behind a long copy on `a`: synchronize with a tiny timeout
  // must throw kTimeout instead of blocking.
  const std::size_t n = 16 << 20;
  std::vector<std::uint8_t> x(n, 1), y(n);
  for (int i = 0; i < 4; ++i) a->memcpy_async(y.data(), x.data(), n);
  a->record(*never);
  b->wait_event(*never);
  try {
    b->synchronize(std::chrono::milliseconds(0));
    // The copies may legitimately have finished already on a fast machine.
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
  }
  b->synchronize(30s);
}

TEST(DeviceFactory, ProbesAndForces) {
  auto host = make_device(DeviceKind::kHost);
  EXPECT_EQ(host->kind(), DeviceKind::kHost);
  auto any = make_device(DeviceKind::kAuto);
  EXPECT_EQ(any->kind(), cuda_available() ? DeviceKind::kCuda : DeviceKind::kHost);
  if (!cuda_available()) {
    st::expect_error(ErrorCode::kUnsupported, "", [&] { make_device(DeviceKind::kCuda); });
  }
}

TEST(HostDevice, ConcurrentStreams) {
  auto dev = make_host_device();
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto s = dev->create_stream();
      for (int i = 0; i < 50; ++i) {
        const std::size_t n = 1000 + 977 * i + t;
        auto src = st::random_bytes(n, t * 1000 + i);
        std::vector<std::uint8_t> back(n);
        auto m = dev->allocate(n);
        s->memcpy_async(m.get(), src.data(), n);
        s->memcpy_async(back.data(), m.get(), n);
        s->synchronize(10s);
        if (back != src) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

// The host device has no native streams: a hand-off from one is refused, nullptr is a no-op.
TEST(HostDevice, ExternalProducerStream) {
  auto dev = make_host_device(1 << 20);
  auto s = dev->create_stream();
  s->wait_external(nullptr);
  int dummy = 0;
  EXPECT_THROW(s->wait_external(&dummy), Error);
  s->synchronize(std::chrono::seconds(10));
}

// One local-ordinal rule for storage, profile, bench and the communicator (F6).
TEST(DeviceFactory, LocalDeviceOrdinal) {
  const char* vars[] = {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                        "SLURM_LOCALID"};
  for (const char* v : vars) ::unsetenv(v);
  EXPECT_EQ(local_device_ordinal(5, 4, 8), 1);  // rank % ranks_per_node
  EXPECT_EQ(local_device_ordinal(3, 4, 2), 1);  // ... modulo the devices
  EXPECT_EQ(local_device_ordinal(3, 0, 0), 0);
  ::setenv("SLURM_LOCALID", "2", 1);
  EXPECT_EQ(local_device_ordinal(0, 1, 4), 2);
  ::setenv("LOCAL_RANK", "3", 1);  // torchrun's first
  EXPECT_EQ(local_device_ordinal(0, 1, 4), 3);
  EXPECT_EQ(local_device_ordinal(0, 1, 2), 1);
  ::setenv("LOCAL_RANK", "x", 1);  // not a number: the next one
  EXPECT_EQ(local_device_ordinal(0, 1, 4), 2);
  for (const char* v : vars) ::unsetenv(v);
}

// Like cudaFree (which synchronises the device), freeing device memory never pulls it from under
// work already queued on a stream: a copy queued before the free still reads the data. (An idle
// stream beside it releases its share at once, without its worker: the busy one still holds it.)
TEST(HostDevice, FreeWaitsForQueuedWork) {
  auto dev = make_host_device(1 << 24);
  auto idle = dev->create_stream();
  auto s = dev->create_stream();
  const std::size_t n = 1 << 20;
  std::vector<std::uint8_t> want(n, 0x3C), back(n, 0);
  auto m = dev->allocate(n);
  std::memcpy(m.get(), want.data(), n);  // host device memory is host memory
  std::atomic<bool> go{false};
  s->launch_host_func([&] {
    while (!go.load()) std::this_thread::yield();
  });
  s->memcpy_async(back.data(), m.get(), n);
  m.reset();                      // freed while the copy is queued
  auto other = dev->allocate(n);  // would likely reuse the freed block
  std::memset(other.get(), 0, n);
  go = true;
  s->synchronize(std::chrono::seconds(10));
  EXPECT_EQ(back, want) << "the queued copy read memory freed (and reused) after it was queued";
}

// copy() and fill() are synchronous and in stream order: after the work queued before them, also
// on the host device, which runs them in the caller's thread once the stream is idle.
TEST(HostDevice, SynchronousCopyAndFillFollowQueuedWork) {
  auto dev = make_host_device();
  const std::size_t n = 6 << 20;
  auto src = st::random_bytes(n, 7);
  auto mem = dev->allocate(n);
  std::vector<std::uint8_t> back(n);
  auto s = dev->create_stream();
  for (int i = 0; i < 3; ++i) s->memcpy_async(mem.get(), src.data(), n);  // queued, not waited
  s->fill(mem.get(), 0x33, 1000, 10s);
  s->copy(back.data(), mem.get(), n, 10s);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(back[i], 0x33) << i;
  EXPECT_EQ(0, std::memcmp(back.data() + 1000, src.data() + 1000, n - 1000));
  // Work queued after a synchronous copy runs after it.
  s->memset_async(mem.get(), 0x44, 10);
  s->copy(back.data(), mem.get(), 20, 10s);
  EXPECT_EQ(back[9], 0x44);
  EXPECT_EQ(back[10], 0x33);
  s->copy(back.data(), mem.get(), 0, 10s);  // nothing to do
}

TEST(HostDevice, SynchronousCopyReportsTheStreamsFailure) {
  auto dev = make_host_device();
  auto s = dev->create_stream();
  std::vector<std::uint8_t> a(64, 1), b(64, 2);
  s->launch_host_func([] { throw std::runtime_error("queued work failed"); });
  st::expect_error(ErrorCode::kDevice, "queued work failed",
                   [&] { s->copy(b.data(), a.data(), 64, 10s); });
  EXPECT_EQ(b[0], 2);  // a failed stream runs nothing more
  st::expect_error(ErrorCode::kDevice, "queued work failed",
                   [&] { s->fill(b.data(), 0, 64, 10s); });
  EXPECT_EQ(b[0], 2);
}
