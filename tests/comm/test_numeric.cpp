// FP16/BF16 conversions used by the host reductions: exhaustive against the compiler's _Float16
// and against a bit-exact BF16 reference.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>

#include "comm/numeric.hpp"
#include "test_util.hpp"

namespace strata::comm {
namespace {

TEST(Numeric, HalfRoundTripsEveryValue) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    float f = half_to_float(static_cast<std::uint16_t>(h));
    _Float16 ref = std::bit_cast<_Float16>(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(static_cast<float>(ref)));
      continue;
    }
    ASSERT_EQ(std::bit_cast<std::uint32_t>(f), std::bit_cast<std::uint32_t>(static_cast<float>(ref))) << h;
    ASSERT_EQ(float_to_half(f), h) << h;
  }
}

TEST(Numeric, HalfRoundsLikeTheCompiler) {
  std::mt19937 rng(static_cast<std::uint32_t>(strata::testing::test_seed("numeric")));
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t bits = rng();
    float f = std::bit_cast<float>(bits);
    if (std::isnan(f)) continue;
    // Bias towards the half range (and its subnormals) half of the time.
    if (i % 2) f = std::ldexp(std::bit_cast<float>((bits & 0x807fffffu) | 0x3f800000u), static_cast<int>(rng() % 44) - 28);
    std::uint16_t want = std::bit_cast<std::uint16_t>(static_cast<_Float16>(f));
    ASSERT_EQ(float_to_half(f), want) << f;
  }
}

TEST(Numeric, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_EQ(float_to_bf16(INFINITY), 0x7f80);
  EXPECT_EQ(bf16_to_float(0xc0a0), -5.0f);
}

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
