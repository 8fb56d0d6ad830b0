// The CUDA device: copies both ways, events, allocation failure. Its own binary so that CTest
// reports SKIPPED (not a passing binary with a skipped case) on a machine without a GPU.
#include <gtest/gtest.h>

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

TEST(CudaDevice, RoundTripAndEvents) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  auto dev = make_device(DeviceKind::kCuda);
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
