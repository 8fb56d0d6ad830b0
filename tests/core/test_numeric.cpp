// The one copy of the FP16/BF16 conversions (core/numeric.hpp): exhaustive against the compiler's
// _Float16 and against a bit-exact BF16 reference.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>

#include "core/numeric.hpp"
#include "test_util.hpp"

namespace strata {
namespace {

TEST(Numeric, HalfRoundTripsEveryValue) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    float f = half_to_float(static_cast<std::uint16_t>(h));
    _Float16 ref = std::bit_cast<_Float16>(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(static_cast<float>(ref)));
      continue;
    }
    ASSERT_EQ(std::bit_cast<std::uint32_t>(f),
              std::bit_cast<std::uint32_t>(static_cast<float>(ref)))
        << h;
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
    if (i % 2)
      f = std::ldexp(std::bit_cast<float>((bits & 0x807fffffu) | 0x3f800000u),
                     static_cast<int>(rng() % 44) - 28);
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

TEST(Numeric, NanAndInfinity) {
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0xffc00001u)), 0x7fc0);  // NaN: torch's quiet NaN
  EXPECT_EQ(float_to_half(NAN), 0x7e00);
  EXPECT_EQ(float_to_half(-INFINITY), 0xfc00);
  EXPECT_EQ(float_to_half(70000.0f), 0x7c00);  // overflow rounds to infinity
  EXPECT_EQ(float_to_bf16(-INFINITY), 0xff80);
}

TEST(Numeric, LoadStoreElem) {
  std::uint16_t h[2];
  float f[2];
  for (DType t : {DType::kFp16, DType::kBf16, DType::kFp32}) {
    void* base = t == DType::kFp32 ? static_cast<void*>(f) : static_cast<void*>(h);
    store_elem(base, 1, t, -2.5f);
    EXPECT_EQ(load_elem(base, 1, t), -2.5f) << static_cast<int>(t);
    EXPECT_EQ(dtype_size(t), t == DType::kFp32 ? 4u : 2u);
  }
}

}  // namespace
}  // namespace strata
