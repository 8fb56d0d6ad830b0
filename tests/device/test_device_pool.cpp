// DeviceBufferPool: no device allocation or free in a steady state; a block released after a
// stream is not handed out again before that stream's work finished; the cache bound.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "strata/device.hpp"
#include "strata/device_pool.hpp"
#include "strata/error.hpp"

using namespace strata;
using namespace std::chrono_literals;

TEST(DeviceBufferPool, SteadyStateAllocatesNothing) {
  auto dev = make_host_device(1ULL << 30);
  DeviceBufferPool pool(*dev);
  const std::size_t sizes[] = {1000, 3 << 20, (5 << 20) + 7, 100, 1000};
  std::uint64_t after_first = 0;
  for (int step = 0; step < 5; ++step) {
    std::vector<DeviceBufferPool::Lease> leases;
    for (std::size_t s : sizes) {
      leases.push_back(pool.acquire(s));
      ASSERT_GE(leases.back().size(), s);
      ASSERT_NE(leases.back().get(), nullptr);
    }
    leases.clear();
    if (step == 0) after_first = pool.stats().device_allocs;
    EXPECT_EQ(pool.stats().device_allocs, after_first) << "step " << step;
    EXPECT_EQ(pool.stats().device_frees, 0u) << "step " << step;
    EXPECT_EQ(pool.stats().leased_bytes, 0u);
  }
  EXPECT_EQ(after_first, 5u);
  pool.trim();
  EXPECT_EQ(pool.stats().device_frees, 5u);
  EXPECT_EQ(pool.stats().cached_bytes, 0u);
}

TEST(DeviceBufferPool, ReleasedAfterAStreamWaitsForIt) {
  auto dev = make_host_device(1ULL << 30);
  DeviceBufferPool pool(*dev);
  auto s = dev->create_stream();
  std::atomic<bool> go{false};
  s->launch_host_func([&] {
    while (!go.load()) std::this_thread::yield();
  });
  auto a = pool.acquire(1 << 20);
  void* pa = a.get();
  a.release_after(*s);  // the stream's work (still blocked) may use it
  auto b = pool.acquire(1 << 20);
  EXPECT_NE(b.get(), pa) << "a block was reused while the stream it was released after ran";
  EXPECT_EQ(pool.stats().device_allocs, 2u);
  go = true;
  s->synchronize(10s);
  b.reset();
  auto c = pool.acquire(1 << 20);
  auto d = pool.acquire(1 << 20);
  EXPECT_EQ(pool.stats().device_allocs, 2u) << "both blocks are reusable once the stream is done";
  EXPECT_TRUE((c.get() == pa) != (d.get() == pa));
}

TEST(DeviceBufferPool, CacheBound) {
  auto dev = make_host_device(1ULL << 30);
  DeviceBufferPool pool(*dev, 1 << 20);
  auto a = pool.acquire(4 << 20);
  a.reset();
  EXPECT_EQ(pool.stats().device_frees, 1u);
  EXPECT_EQ(pool.stats().cached_bytes, 0u);
  auto b = pool.acquire(1000);
  b.reset();
  EXPECT_EQ(pool.stats().cached_bytes, 1024u);
}

TEST(DeviceBufferPool, OutOfMemoryDropsTheCacheFirst) {
  auto dev = make_host_device(8 << 20);
  DeviceBufferPool pool(*dev);
  pool.acquire(6 << 20).reset();  // cached: 6 MiB of the 8
  auto big = pool.acquire(4 << 20);
  EXPECT_NE(big.get(), nullptr);
  EXPECT_EQ(pool.stats().device_frees, 1u);
  EXPECT_THROW(pool.acquire(6 << 20), Error);
}
