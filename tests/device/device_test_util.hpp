// Helpers shared by the device tests (host-emulated and CUDA).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "strata/device.hpp"
#include "test_util.hpp"

namespace strata::testing {

// n random bytes to device memory and back through one stream: equal on return.
inline void device_round_trip(Device& dev, std::size_t n, std::uint64_t seed) {
  auto src = random_bytes(n, seed);
  std::vector<std::uint8_t> back(n, 0);
  auto mem = dev.allocate(n);
  auto stream = dev.create_stream();
  stream->memcpy_async(mem.get(), src.data(), n);
  stream->memcpy_async(back.data(), mem.get(), n);
  stream->synchronize(std::chrono::seconds(10));
  EXPECT_EQ(back, src);
}

}  // namespace strata::testing
