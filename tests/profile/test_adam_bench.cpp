// The Adam benchmark's byte accounting: what it says each pass moves, per case of grads dtype,
// copy and finite pre-pass (the stream reference writes the copy in its dtype since 48d3fdf; its
// GB/s kept counting 2 bytes for any copy until this test).
#include <gtest/gtest.h>

#include <string>

#include "profile/adam_bench.hpp"

namespace strata::profile {
namespace {

struct Case {
  const char* name;
  DType grads;
  bool copy;
  DType copy_dtype;
  bool check_finite;
  double bytes;  // per parameter, one Adam step
};

class AdamBenchBytes : public ::testing::TestWithParam<Case> {};

TEST_P(AdamBenchBytes, RatesFollowTheBytesEachPassMoves) {
  const Case& c = GetParam();
  AdamBenchOptions o;
  o.params = 10'007;  // uneven: vector tails on every path
  o.threads = 2;
  o.grads = c.grads;
  o.param_copy = c.copy;
  o.copy_dtype = c.copy_dtype;
  o.rounds = 1;
  o.check_finite = c.check_finite;
  const AdamBenchResult r = run_adam_bench(o);
  EXPECT_EQ(r.bytes_per_param, c.bytes);
  ASSERT_GT(r.adam_params_per_second, 0);
  ASSERT_GT(r.stream_params_per_second, 0);
  EXPECT_DOUBLE_EQ(r.adam_bytes_per_second / r.adam_params_per_second, c.bytes);
  const double stream = c.bytes - (c.check_finite ? (c.grads == DType::kFp32 ? 4.0 : 2.0) : 0.0);
  EXPECT_DOUBLE_EQ(r.stream_bytes_per_second / r.stream_params_per_second, stream);
  // The out-of-place step in the same rounds moves what the step in place moves.
  ASSERT_EQ(r.out_of_place_seconds.size(), 1u);
  ASSERT_GT(r.out_of_place_params_per_second, 0);
  EXPECT_DOUBLE_EQ(r.out_of_place_bytes_per_second / r.out_of_place_params_per_second, c.bytes);
  EXPECT_DOUBLE_EQ(r.out_of_place_ratio, r.out_of_place_seconds[0] / r.adam_seconds[0]);
  // Its floor, the stream reference out of place, in the same rounds: against the out-of-place
  // step (its fraction of bound) and the stream in place (the pattern's cost).
  ASSERT_EQ(r.out_of_place_stream_seconds.size(), 1u);
  EXPECT_DOUBLE_EQ(r.out_of_place_fraction_of_bound,
                   r.out_of_place_stream_seconds[0] / r.out_of_place_seconds[0]);
  EXPECT_DOUBLE_EQ(r.out_of_place_pattern_ratio,
                   r.out_of_place_stream_seconds[0] / r.stream_seconds[0]);
}

// Every pass runs once per round, alternating (ABCD, DCBA): each has one time per round.
TEST(AdamBench, EveryPassTimedEachRound) {
  AdamBenchOptions o;
  o.params = 4099;
  o.threads = 2;
  o.rounds = 4;
  const AdamBenchResult r = run_adam_bench(o);
  for (const auto* v :
       {&r.adam_seconds, &r.out_of_place_seconds, &r.stream_seconds, &r.out_of_place_stream_seconds,
        &r.adam_cpu_seconds, &r.out_of_place_stream_cpu_seconds})
    EXPECT_EQ(v->size(), 4u);
  EXPECT_LE(r.out_of_place_pattern_ratio_min, r.out_of_place_pattern_ratio);
  EXPECT_GE(r.out_of_place_pattern_ratio_max, r.out_of_place_pattern_ratio);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AdamBenchBytes,
    ::testing::Values(Case{"fp32_nocopy", DType::kFp32, false, DType::kBf16, false, 28},
                      Case{"fp32_copy_fp32", DType::kFp32, true, DType::kFp32, false, 32},
                      Case{"fp32_copy_bf16", DType::kFp32, true, DType::kBf16, false, 30},
                      Case{"bf16_copy_bf16", DType::kBf16, true, DType::kBf16, false, 28},
                      Case{"fp16_copy_fp32", DType::kFp16, true, DType::kFp32, false, 30},
                      Case{"fp32_copy_fp32_finite", DType::kFp32, true, DType::kFp32, true, 36},
                      Case{"bf16_nocopy_finite", DType::kBf16, false, DType::kBf16, true, 28}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace strata::profile
