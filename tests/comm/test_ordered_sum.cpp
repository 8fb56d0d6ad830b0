// The host reductions' summation order (comm/numeric.hpp).
#include <gtest/gtest.h>

#include "comm/numeric.hpp"

namespace strata::comm {
namespace {

TEST(Numeric, OrderedSumIsRankOrderedFp32) {
  // (1e8 + 1) + -1e8 = 0 in FP32 but 1 in other orders: the order is part of the contract.
  float a[1] = {1e8f}, b[1] = {1.0f}, c[1] = {-1e8f};
  const void* srcs[3] = {a, b, c};
  float out[1];
  ordered_sum(srcs, 3, out, 1, DType::kFp32);
  EXPECT_EQ(out[0], (1e8f + 1.0f) + -1e8f);
}

}  // namespace
}  // namespace strata::comm
