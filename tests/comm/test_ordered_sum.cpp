// The host reductions' summation order (comm/numeric.hpp).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

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

// One rank's sum is its values bit for bit, in every dtype, also in place: a 16-bit NaN with a
// payload and -0 included (a conversion through FP32 would quiet a signalling NaN).
TEST(Numeric, OneRankSumIsItsOwnValues) {
  const std::uint16_t half[5] = {0x7d01, 0x8000, 0x3c00, 0xfbff, 0x0001};  // sNaN fp16, -0, ...
  const std::uint16_t bf[5] = {0x7f81, 0x8000, 0x3f80, 0xff7f, 0x0001};    // sNaN bf16, -0, ...
  const float f[3] = {-0.0f, 1.5f, 3e38f};
  std::uint16_t out16[5];
  float out32[3];
  for (DType t : {DType::kFp16, DType::kBf16}) {
    const std::uint16_t* in = t == DType::kFp16 ? half : bf;
    const void* srcs[1] = {in};
    ordered_sum(srcs, 1, out16, 5, t);
    EXPECT_EQ(std::memcmp(out16, in, sizeof out16), 0) << dtype_name(t);
    std::memcpy(out16, in, sizeof out16);
    const void* self[1] = {out16};
    ordered_sum(self, 1, out16, 5, t);  // in place
    EXPECT_EQ(std::memcmp(out16, in, sizeof out16), 0) << dtype_name(t) << " in place";
  }
  const void* srcs[1] = {f};
  ordered_sum(srcs, 1, out32, 3, DType::kFp32);
  EXPECT_EQ(std::memcmp(out32, f, sizeof out32), 0);
}

}  // namespace
}  // namespace strata::comm
