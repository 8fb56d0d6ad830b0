// CPU Adam/AdamW: double-precision reference on every path, bit-identical paths, lengths,
// alignment, thread counts, non-finite gradients, conversions, argument checks, $STRATA_ADAM_PATH.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.hpp"
#include "optim/adam_test_util.hpp"
#include "strata/adam.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata {
namespace {

using testing::random_grads;
using testing::RandomGrads;

struct State {
  std::vector<float> p, m, v;
  std::vector<std::uint16_t> copy16;
  std::vector<float> copy32;
};

State random_state(std::mt19937_64& rng, std::size_t n, bool moments) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  State s;
  s.p.resize(n);
  s.m.assign(n, 0.0f);
  s.v.assign(n, 0.0f);
  for (auto& x : s.p) x = nd(rng);
  if (moments) {
    for (auto& x : s.m) x = 0.01f * nd(rng);
    for (auto& x : s.v) x = 1e-4f * std::fabs(nd(rng));
  }
  s.copy16.assign(n, 0);
  s.copy32.assign(n, 0.0f);
  return s;
}

// 100 steps of every path against double-precision references (tests/optim/adam_test_util.hpp):
// - double math, torch's FP32-rounded constants, FP32 state rounded where torch stores it:
//   element-wise |x - ref| <= 1e-6 * max(|ref|, 1) (relative, with an absolute floor at the
//   parameters' scale: they are N(0, 1); near-zero elements carry the update's absolute rounding,
//   ~lr * 1e-7 per step, which no FP32 kernel avoids) and 2-norm relative error <= 1e-6;
// - state kept in double, and exact constants (the mathematical update): 2-norm relative error
//   <= 1e-5, printed. These differ from torch's FP32 algorithm itself by a few 1e-6 after 100
//   AdamW steps with weight decay (float(1 - lr*wd) and the separately rounded decay).
TEST(AdamCpu, MatchesDoubleReferenceOnEveryPath) {
  const std::uint64_t seed = testing::test_seed("AdamCpu.MatchesDoubleReferenceOnEveryPath");
  const std::size_t n = 2003;  // odd: tails on every path
  const int kSteps = 100;
  struct Case {
    OptimizerType type;
    double lr, b1, b2, eps, wd;
    DType gd;
    float scale;
  };
  const Case cases[] = {
      {OptimizerType::kAdam, 1e-3, 0.9, 0.999, 1e-8, 0.0, DType::kFp32, 1.0f},
      {OptimizerType::kAdam, 2e-3, 0.8, 0.99, 1e-6, 0.05, DType::kBf16, 0.5f},
      {OptimizerType::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01, DType::kFp32, 0.7f},
      {OptimizerType::kAdamW, 3e-3, 0.85, 0.995, 1e-8, 0.1, DType::kFp16, 1.0f / 1024},
      {OptimizerType::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.0, DType::kBf16, 1.0f},
  };
  for (AdamPath path : testing::supported_paths()) {
    CpuAdam opt(2, path);
    ASSERT_EQ(opt.path(), path);
    int ci = 0;
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(adam_path_name(path)) + " case " + std::to_string(ci++) + " " +
                   testing::dt_name(c.gd));
      std::mt19937_64 rng(seed + ci);
      State s = random_state(rng, n, false);
      std::vector<double> rp(s.p.begin(), s.p.end()), rm(n, 0.0), rv(n, 0.0);
      std::vector<double> dp(rp), dm(rm), dv(rv), xp(rp), xm(rm), xv(rv);
      const std::vector<float> p0 = s.p;
      AdamParams hp{c.type, c.lr, c.b1, c.b2, c.eps, c.wd};
      for (int step = 1; step <= kSteps; ++step) {
        // Gradients scaled up by 1/scale so that g * scale is O(0.1), like an unscaled loss.
        RandomGrads g = random_grads(rng, n, c.gd, 0.1f / c.scale);
        AdamTensors t{s.p.data(), s.m.data(), s.v.data(),   g.data(c.gd),
                      c.gd,       nullptr,    DType::kBf16, n};
        AdamStepOptions o{step, c.scale, true};
        ASSERT_TRUE(opt.step(hp, t, o).applied);
        testing::ref_adam_step(hp, step, c.scale, rp.data(), rm.data(), rv.data(), g.f32, true);
        testing::ref_adam_step(hp, step, c.scale, dp.data(), dm.data(), dv.data(), g.f32, false);
        testing::ref_adam_step(hp, step, c.scale, xp.data(), xm.data(), xv.data(), g.f32, false,
                               false);
      }
      const double e = testing::max_rel_err(s.p.data(), rp.data(), n, 1.0);
      const double en = testing::norm_rel_err(s.p.data(), rp.data(), n);
      const double ed = testing::norm_rel_err(s.p.data(), dp.data(), n);
      const double ex = testing::norm_rel_err(s.p.data(), xp.data(), n);
      const double e_floor = testing::max_rel_err(s.p.data(), rp.data(), n, 1e-3);
      EXPECT_LE(e, 1e-6) << "element-wise error vs FP32-storage double reference";
      EXPECT_LE(en, 1e-6) << "2-norm relative error vs FP32-storage double reference";
      EXPECT_LE(ed, 1e-5) << "2-norm relative error vs double-state reference";
      EXPECT_LE(ex, 1e-5) << "2-norm relative error vs exact-constant reference";
      EXPECT_LE(testing::norm_rel_err(s.m.data(), dm.data(), n), 1e-5);
      EXPECT_LE(testing::norm_rel_err(s.v.data(), dv.data(), n), 1e-5);
      // The test must be able to fail: the parameters moved.
      double moved = 0;
      for (std::size_t i = 0; i < n; ++i)
        moved = std::max(moved, double(std::fabs(s.p[i] - p0[i])));
      EXPECT_GT(moved, 10 * c.lr);
      std::printf(
          "[ref] %-6s case %d: elementwise %.3g (floor 1e-3: %.3g), 2-norm %.3g, vs double "
          "state %.3g, vs exact constants %.3g\n",
          adam_path_name(path), ci - 1, e, e_floor, en, ed, ex);
    }
  }
}

// Runs `steps` steps on fresh state with the given options; returns the final state.
// One step out of place (AdamTensors::param_out...): the new state goes to fresh arrays (64-byte
// aligned + misalign % 2 elements: the non-temporal stores' path, then plain stores), the inputs
// must come back unchanged; the result is copied over them for the next step.
void step_apart(CpuAdam& opt, const AdamParams& hp, AdamTensors t, const AdamStepOptions& o,
                std::size_t misalign) {
  const std::size_t n = t.n;
  const std::vector<float> p0(t.param, t.param + n), m0(t.exp_avg, t.exp_avg + n),
      v0(t.exp_avg_sq, t.exp_avg_sq + n);
  std::vector<float> out[3];
  float* at[3];
  for (int k = 0; k < 3; ++k) {
    out[k].assign(n + 32, -1.0f);
    std::size_t off = 0;
    while (reinterpret_cast<std::uintptr_t>(out[k].data() + off) % 64 != 0) ++off;
    at[k] = out[k].data() + off + misalign % 2;
  }
  t.param_out = at[0];
  t.exp_avg_out = at[1];
  t.exp_avg_sq_out = at[2];
  EXPECT_TRUE(opt.step(hp, t, o).applied);
  ASSERT_TRUE(std::equal(p0.begin(), p0.end(), t.param)) << "param changed in place";
  ASSERT_TRUE(std::equal(m0.begin(), m0.end(), t.exp_avg)) << "exp_avg changed in place";
  ASSERT_TRUE(std::equal(v0.begin(), v0.end(), t.exp_avg_sq)) << "exp_avg_sq changed in place";
  std::copy(at[0], at[0] + n, t.param);
  std::copy(at[1], at[1] + n, t.exp_avg);
  std::copy(at[2], at[2] + n, t.exp_avg_sq);
}

State run_steps(CpuAdam& opt, const AdamParams& hp, std::size_t n, DType gd, DType cd,
                bool with_copy, std::uint64_t seed, int steps, std::size_t misalign,
                bool apart = false) {
  std::mt19937_64 rng(seed);
  State s0 = random_state(rng, n + 3, true);
  // misalign: shift every array by a different number of elements (any alignment).
  const std::size_t op = misalign % 3, om = (misalign + 1) % 3, ov = (misalign + 2) % 3;
  std::vector<float> P(s0.p), M(s0.m), V(s0.v);
  // The copy: misalign 0 puts it on a 64-byte boundary (the non-temporal stores' path: every
  // vector aligned), 1 one element off it (plain stores).
  std::vector<std::uint16_t> C16(n + 64, 0);
  std::vector<float> C32(n + 32, 0.0f);
  auto to_64 = [](const auto* base) {
    std::size_t k = 0;
    while (reinterpret_cast<std::uintptr_t>(base + k) % 64 != 0) ++k;
    return k;
  };
  const std::size_t c16 = to_64(C16.data()) + misalign % 2, c32 = to_64(C32.data()) + misalign % 2;
  for (int step = 1; step <= steps; ++step) {
    RandomGrads g = random_grads(rng, n + 3, gd, 0.05f);
    const std::size_t og = misalign % 2;
    const void* gp = gd == DType::kFp32 ? static_cast<const void*>(g.f32.data() + og)
                                        : static_cast<const void*>(g.half.data() + og);
    void* cp = nullptr;
    if (with_copy)
      cp = cd == DType::kFp32 ? static_cast<void*>(C32.data() + c32)
                              : static_cast<void*>(C16.data() + c16);
    AdamTensors t{P.data() + op, M.data() + om, V.data() + ov, gp, gd, cp, cd, n};
    AdamStepOptions o{step, 0.75f, step % 2 == 0};
    if (apart) {
      step_apart(opt, hp, t, o, misalign);
    } else {
      EXPECT_TRUE(opt.step(hp, t, o).applied);
    }
  }
  State out;
  out.p.assign(P.begin() + op, P.begin() + op + n);
  out.m.assign(M.begin() + om, M.begin() + om + n);
  out.v.assign(V.begin() + ov, V.begin() + ov + n);
  out.copy16.assign(C16.begin() + c16, C16.begin() + c16 + n);
  out.copy32.assign(C32.begin() + c32, C32.begin() + c32 + n);
  return out;
}

void expect_same(const State& a, const State& b, const std::string& what) {
  ASSERT_EQ(a.p.size(), b.p.size());
  for (std::size_t i = 0; i < a.p.size(); ++i) {
    ASSERT_EQ(testing::bits_of(a.p[i]), testing::bits_of(b.p[i])) << what << " p[" << i << "]";
    ASSERT_EQ(testing::bits_of(a.m[i]), testing::bits_of(b.m[i])) << what << " m[" << i << "]";
    ASSERT_EQ(testing::bits_of(a.v[i]), testing::bits_of(b.v[i])) << what << " v[" << i << "]";
    ASSERT_EQ(a.copy16[i], b.copy16[i]) << what << " copy16[" << i << "]";
    ASSERT_EQ(testing::bits_of(a.copy32[i]), testing::bits_of(b.copy32[i]))
        << what << " copy32[" << i << "]";
  }
}

// All paths, every length class and alignment, give bit-identical results (same op order).
TEST(AdamCpu, PathsAreBitIdenticalForAnyLengthAndAlignment) {
  const std::uint64_t seed = testing::test_seed("AdamCpu.PathsAreBitIdentical");
  const std::size_t lengths[] = {0, 1, 7, 15, 16, 17, 33, 1001, 32768 * 2 + 17};
  const AdamParams hps[] = {{OptimizerType::kAdam, 1e-3, 0.9, 0.999, 1e-8, 0.02},
                            {OptimizerType::kAdamW, 2e-3, 0.9, 0.99, 1e-7, 0.1}};
  CpuAdam scalar(1, AdamPath::kScalar);
  for (AdamPath path : testing::supported_paths()) {
    if (path == AdamPath::kScalar) continue;  // the reference
    CpuAdam opt(2, path);
    for (std::size_t n : lengths) {
      for (DType gd : {DType::kFp32, DType::kBf16, DType::kFp16}) {
        for (DType cd : {DType::kBf16, DType::kFp16, DType::kFp32}) {
          // Long arrays (several tiles): one copy dtype per grad dtype keeps the test fast.
          if (n > 10000 && cd != (gd == DType::kFp32 ? DType::kFp16 : gd)) continue;
          for (std::size_t mis = 0; mis < 2; ++mis) {
            const AdamParams& hp = hps[(n + mis) % 2];
            const std::string what = std::string(adam_path_name(path)) + " n=" + std::to_string(n) +
                                     " grads " + testing::dt_name(gd) + " copy " +
                                     testing::dt_name(cd) + " misalign " + std::to_string(mis);
            State a = run_steps(opt, hp, n, gd, cd, true, seed + n, 3, mis);
            State b = run_steps(scalar, hp, n, gd, cd, true, seed + n, 3, mis);
            expect_same(a, b, what);
            // The copy is the rounded master.
            for (std::size_t i = 0; i < n; ++i) {
              if (cd == DType::kBf16)
                ASSERT_EQ(a.copy16[i], testing::ref_f_to_bf16(a.p[i])) << what << " i=" << i;
              else if (cd == DType::kFp16)
                ASSERT_EQ(a.copy16[i], testing::ref_f_to_fp16(a.p[i])) << what << " i=" << i;
              else
                ASSERT_EQ(testing::bits_of(a.copy32[i]), testing::bits_of(a.p[i]));
            }
          }
        }
      }
    }
  }
}

// An update out of place (a pending version's, the speculative update) is bitwise the update in
// place on every path, for any length (tails, several tiles) and alignment of the new arrays.
TEST(AdamCpu, OutOfPlaceIsBitwiseTheUpdateInPlace) {
  const std::uint64_t seed = testing::test_seed("AdamCpu.OutOfPlace");
  const AdamParams hp{OptimizerType::kAdamW, 2e-3, 0.9, 0.99, 1e-7, 0.1};
  for (AdamPath path : testing::supported_paths()) {
    CpuAdam opt(2, path);
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{17}, std::size_t{1001},
                          std::size_t{32768 * 2 + 17}}) {
      for (DType gd : {DType::kFp32, DType::kBf16, DType::kFp16}) {
        for (std::size_t mis = 0; mis < 2; ++mis) {
          const std::string what = std::string(adam_path_name(path)) + " n=" + std::to_string(n) +
                                   " grads " + testing::dt_name(gd) + " misalign " +
                                   std::to_string(mis);
          const State a = run_steps(opt, hp, n, gd, DType::kBf16, true, seed + n, 3, mis, true);
          const State b = run_steps(opt, hp, n, gd, DType::kBf16, true, seed + n, 3, mis);
          expect_same(a, b, what);
        }
      }
    }
  }
}

// Thread counts 1..3 (and tiles split among them) do not change the result.
TEST(AdamCpu, ThreadCountsGiveIdenticalResults) {
  const std::uint64_t seed = testing::test_seed("AdamCpu.ThreadCounts");
  const AdamParams hp{OptimizerType::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  const std::size_t n = 3 * 32768 + 4099;
  CpuAdam one(1);
  State ref = run_steps(one, hp, n, DType::kBf16, DType::kBf16, true, seed, 4, 1);
  for (unsigned threads : {2u, 3u}) {
    CpuAdam opt(threads);
    EXPECT_EQ(opt.threads(), threads);
    State s = run_steps(opt, hp, n, DType::kBf16, DType::kBf16, true, seed, 4, 1);
    expect_same(s, ref, "threads=" + std::to_string(threads));
  }
}

// A single inf/NaN anywhere (or an overflow caused by grad_scale) leaves everything untouched.
TEST(AdamCpu, NonFiniteGradientLeavesStateUntouched) {
  const std::uint64_t seed = testing::test_seed("AdamCpu.NonFinite");
  std::mt19937_64 rng(seed);
  const AdamParams hp{OptimizerType::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  for (AdamPath path : testing::supported_paths()) {
    CpuAdam opt(3, path);
    for (DType gd : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      for (int kind = 0; kind < 4; ++kind) {
        const std::size_t n = 40000 + (rng() % 1000);  // two tiles
        State s = random_state(rng, n, true);
        RandomGrads g = random_grads(rng, n, gd, 0.1f);
        const std::size_t bad = rng() % n;
        float scale = 1.0f;
        const float bad_value = kind == 0   ? std::numeric_limits<float>::infinity()
                                : kind == 1 ? -std::numeric_limits<float>::infinity()
                                            : std::numeric_limits<float>::quiet_NaN();
        if (kind < 3) {
          g.f32[bad] = bad_value;
          if (gd == DType::kBf16) g.half[bad] = testing::ref_f_to_bf16(bad_value);
          if (gd == DType::kFp16) g.half[bad] = testing::ref_f_to_fp16(bad_value);
        } else {
          // finite gradient that overflows once multiplied by grad_scale
          g.f32[bad] = 60000.0f;
          if (gd == DType::kBf16) g.half[bad] = testing::ref_f_to_bf16(60000.0f);
          if (gd == DType::kFp16) g.half[bad] = testing::ref_f_to_fp16(60000.0f);
          scale = 1e35f;
          for (std::size_t i = 0; i < n; ++i)
            if (i != bad) {
              g.f32[i] = 0.0f;
              if (gd != DType::kFp32) g.half[i] = 0;
            }
        }
        State before = s;
        AdamTensors t{s.p.data(), s.m.data(),      s.v.data(),   g.data(gd),
                      gd,         s.copy16.data(), DType::kBf16, n};
        const std::string what = std::string(adam_path_name(path)) + " " + testing::dt_name(gd) +
                                 " kind " + std::to_string(kind) + " at " + std::to_string(bad);
        EXPECT_FALSE(opt.step(hp, t, {7, scale, true}).applied) << what;
        expect_same(s, before, what);
        AdamGradStats st = opt.grad_stats(g.data(gd), gd, n, scale);
        EXPECT_FALSE(st.finite) << what;
        // Without the check the update goes through (and the bad element is corrupted).
        EXPECT_TRUE(opt.step(hp, t, {7, scale, false}).applied) << what;
        EXPECT_FALSE(std::isfinite(s.p[bad]) && std::isfinite(s.v[bad])) << what;
      }
    }
  }
}

// grad_divisor: every path computes (g / N) * scale per element, bit for bit against a scalar
// reference written out here, for any length (vector bodies and tails) and every grad dtype; 1 is
// no division; grad_stats divides the same way; a divisor <= 0, inf or NaN is refused.
TEST(AdamCpu, GradDivisorDividesBeforeScaling) {
  std::mt19937_64 rng(testing::test_seed("AdamCpu.GradDivisor"));
  const AdamParams hp{OptimizerType::kAdamW, 1e-3, 0.0, 0.999, 1e-8, 0.0};  // beta1 0: m = g
  for (AdamPath path : testing::supported_paths()) {
    CpuAdam opt(2, path);
    for (DType gd : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      for (std::size_t n : {std::size_t(1), std::size_t(19), std::size_t(70001)}) {
        for (float divisor : {1.0f, 2.0f, 3.0f, 7.0f}) {
          RandomGrads g = random_grads(rng, n, gd, 0.3f);
          std::vector<float> p(n, 0.5f), m(n, 0.0f), v(n, 0.0f);
          AdamTensors t{p.data(), m.data(), v.data(), g.data(gd), gd, nullptr, DType::kBf16, n};
          AdamStepOptions o{1, 0.25f, true};
          o.grad_divisor = divisor;
          ASSERT_TRUE(opt.step(hp, t, o).applied);
          double ref_sq = 0;
          for (std::size_t i = 0; i < n; ++i) {
            const float gs = divisor == 1.0f ? g.f32[i] * 0.25f : (g.f32[i] / divisor) * 0.25f;
            const float want = gs + 0.0f;  // m = g * 1 + 0 * 0: a -0 gradient gives +0
            ASSERT_EQ(testing::bits_of(m[i]), testing::bits_of(want))
                << adam_path_name(path) << " " << testing::dt_name(gd) << " n=" << n
                << " N=" << divisor << " i=" << i;
            ref_sq += double(gs) * double(gs);
          }
          const AdamGradStats st = opt.grad_stats(g.data(gd), gd, n, 0.25f, divisor);
          EXPECT_TRUE(st.finite);
          EXPECT_NEAR(st.sum_sq, ref_sq, 1e-5 * ref_sq + 1e-30);
        }
      }
    }
    std::vector<float> p(8, 0.5f), m(8, 0.0f), v(8, 0.0f), g(8, 1.0f);
    AdamTensors t{p.data(), m.data(), v.data(), g.data(), DType::kFp32, nullptr, DType::kBf16, 8};
    for (float bad : {0.0f, -2.0f, INFINITY, NAN}) {
      AdamStepOptions o;
      o.grad_divisor = bad;
      EXPECT_THROW(opt.step(hp, t, o), Error) << bad;
      EXPECT_THROW(opt.grad_stats(g.data(), DType::kFp32, 8, 1.0f, bad), Error) << bad;
      EXPECT_EQ(p[0], 0.5f);
    }
  }
}

TEST(AdamCpu, GradStatsSumOfSquares) {
  const std::uint64_t seed = testing::test_seed("AdamCpu.GradStats");
  std::mt19937_64 rng(seed);
  for (AdamPath path : testing::supported_paths()) {
    CpuAdam opt(2, path);
    for (DType gd : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(77), std::size_t(200003)}) {
        RandomGrads g = random_grads(rng, n, gd, 0.3f);
        double ref = 0;
        for (float x : g.f32) ref += double(x * 0.5f) * double(x * 0.5f);
        AdamGradStats st = opt.grad_stats(g.data(gd), gd, n, 0.5f);
        EXPECT_TRUE(st.finite);
        EXPECT_NEAR(st.sum_sq, ref, 1e-5 * ref + 1e-30) << adam_path_name(path) << " n=" << n;
      }
    }
  }
}

// grad_stats_continue over tile-aligned parts is bitwise one grad_stats over the whole array
// (how the engine checks gradients spilled to NVMe), also across threads counts; an inf in any
// part clears the finite flag.
TEST(AdamCpu, GradStatsContinueIsBitwiseOnePass) {
  std::mt19937_64 rng(testing::test_seed("AdamCpu.GradStatsContinue"));
  const std::size_t tile = CpuAdam::kStatsTileElems;
  const std::size_t n = 5 * tile + 1234;  // uneven: a short last part
  for (DType gd : {DType::kFp32, DType::kBf16}) {
    RandomGrads g = random_grads(rng, n, gd, 0.3f);
    const std::size_t es = gd == DType::kFp32 ? 4 : 2;
    const auto* base = static_cast<const unsigned char*>(g.data(gd));
    CpuAdam whole_adam(2), part_adam(1);
    const AdamGradStats whole = whole_adam.grad_stats(g.data(gd), gd, n, 0.25f);
    for (std::size_t part_tiles : {std::size_t(1), std::size_t(2), std::size_t(4)}) {
      AdamGradStats r;
      for (std::size_t b = 0; b < n; b += part_tiles * tile) {
        const std::size_t len = std::min(part_tiles * tile, n - b);
        r = part_adam.grad_stats_continue(r, base + b * es, gd, len, 0.25f);
      }
      EXPECT_TRUE(r.finite);
      EXPECT_EQ(std::bit_cast<std::uint64_t>(r.sum_sq), std::bit_cast<std::uint64_t>(whole.sum_sq))
          << testing::dt_name(gd) << " parts of " << part_tiles << " tiles";
    }
    // Tile by tile (the statistics computed ahead): the sums added in order, the same bits.
    std::vector<double> sums(CpuAdam::tiles_of(n), -1.0);
    std::vector<std::uint8_t> finite(sums.size(), 7);
    part_adam.grad_stats_tiles(g.data(gd), gd, n, sums.data(), finite.data(), 0.25f);
    double total = 0.0;
    for (double s : sums) total += s;
    EXPECT_EQ(std::bit_cast<std::uint64_t>(total), std::bit_cast<std::uint64_t>(whole.sum_sq))
        << testing::dt_name(gd) << " tile by tile";
    EXPECT_EQ(finite, std::vector<std::uint8_t>(sums.size(), 1));
  }
  std::vector<float> bad(2 * tile, 0.5f);
  bad[tile + 3] = std::numeric_limits<float>::infinity();
  CpuAdam a(2);
  AdamGradStats r = a.grad_stats_continue({}, bad.data(), DType::kFp32, tile);
  EXPECT_TRUE(r.finite);
  r = a.grad_stats_continue(r, bad.data() + tile, DType::kFp32, tile);
  EXPECT_FALSE(r.finite);
  r = a.grad_stats_continue(r, bad.data(), DType::kFp32, tile);
  EXPECT_FALSE(r.finite) << "the flag is sticky";
  std::vector<double> sums(2);
  std::vector<std::uint8_t> finite(2);
  a.grad_stats_tiles(bad.data(), DType::kFp32, 2 * tile, sums.data(), finite.data());
  EXPECT_EQ(finite, (std::vector<std::uint8_t>{1, 0})) << "the inf is in the second tile";
}

// The bandwidth reference (`strata bench adam`'s bound) writes what step() writes: p, m, v and the
// updated-parameter copy in its dtype — for every grad dtype x copy dtype, every path, an uneven
// length (vector body and scalar tail), in place and out of place (the new p, m, v into the out
// arrays, the inputs unchanged: the bound of the speculative update's pattern). (It used to skip
// an fp32 copy and a 16-bit copy of fp32 grads, so the bound moved 4 or 2 bytes per parameter
// fewer than the Adam it was compared with.)
TEST(AdamCpu, StreamReferenceWritesEveryArrayStepWrites) {
  constexpr std::size_t n = 1000 + 13;
  for (AdamPath path : testing::supported_paths()) {
    CpuAdam a(2, path);
    for (bool out_of_place : {false, true}) {
      for (DType gd : {DType::kFp32, DType::kBf16, DType::kFp16}) {
        for (DType cd : {DType::kFp32, DType::kBf16, DType::kFp16}) {
          SCOPED_TRACE(::testing::Message()
                       << adam_path_name(path) << " grads " << dtype_name(gd) << " copy "
                       << dtype_name(cd) << (out_of_place ? " out of place" : " in place"));
          std::mt19937_64 rng(42);
          State s = random_state(rng, n, true);
          const State before = s;
          State o = random_state(rng, n, true);  // the out arrays (out of place)
          const RandomGrads g = random_grads(rng, n, gd, 0.5f);
          AdamTensors t{s.p.data(),
                        s.m.data(),
                        s.v.data(),
                        g.data(gd),
                        gd,
                        cd == DType::kFp32 ? static_cast<void*>(s.copy32.data())
                                           : static_cast<void*>(s.copy16.data()),
                        cd,
                        n};
          if (out_of_place) {
            t.param_out = o.p.data();
            t.exp_avg_out = o.m.data();
            t.exp_avg_sq_out = o.v.data();
          }
          a.stream_reference(t);
          const State& w = out_of_place ? o : s;  // where the new state went
          for (std::size_t i = 0; i < n; ++i) {
            // 16-bit grads are widened as bf16 bits (trivial arithmetic, whatever the dtype).
            const std::uint16_t gbits = gd == DType::kFp32 ? 0 : g.half[i];
            const float gv = gd == DType::kFp32 ? g.f32[i] : bf16_to_float(gbits);
            ASSERT_EQ(w.p[i], before.p[i] + gv) << i;
            ASSERT_EQ(w.m[i], before.m[i] + gv) << i;
            ASSERT_EQ(w.v[i], before.v[i] + gv) << i;
            if (out_of_place) {
              ASSERT_EQ(s.p[i], before.p[i]) << i << ": an input written";
              ASSERT_EQ(s.m[i], before.m[i]) << i << ": an input written";
              ASSERT_EQ(s.v[i], before.v[i]) << i << ": an input written";
            }
            if (cd == DType::kFp32) {
              ASSERT_EQ(s.copy32[i], gd == DType::kFp32 ? w.p[i] : gv) << i;
            } else {
              ASSERT_EQ(s.copy16[i], gd == DType::kFp32 ? float_to_bf16(w.p[i]) : gbits) << i;
            }
          }
        }
      }
    }
  }
}

TEST(AdamCpu, ConversionsAreExactRoundToNearestEven) {
  const std::uint64_t seed = testing::test_seed("AdamCpu.Conversions");
  std::mt19937_64 rng(seed);
  // Every 16-bit pattern decodes exactly.
  std::vector<std::uint16_t> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = std::uint16_t(i);
  std::vector<float> out(all.size());
  convert_bf16_to_fp32(all.data(), out.data(), all.size());
  for (std::size_t i = 0; i < all.size(); ++i)
    ASSERT_EQ(testing::bits_of(out[i]), testing::bits_of(testing::ref_bf16_to_f(all[i]))) << i;
  convert_fp16_to_fp32(all.data(), out.data(), all.size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    const float r = testing::ref_fp16_to_f(all[i]);
    if (std::isnan(r))
      ASSERT_TRUE(std::isnan(out[i])) << i;
    else
      ASSERT_EQ(testing::bits_of(out[i]), testing::bits_of(r)) << i;
  }
  // Encoding: random bit patterns (all exponents: denormals, ties, overflow) plus specials. The
  // public converters run the best path; the other paths' encoders are compared bit for bit in
  // PathsAreBitIdenticalForAnyLengthAndAlignment.
  std::vector<float> src(100003);
  for (auto& x : src) x = testing::float_of(std::uint32_t(rng()));
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            65504.0f,
                            65520.0f,
                            65519.99f,
                            1e-8f,
                            5.96e-8f,
                            2.98e-8f,
                            std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::denorm_min(),
                            testing::float_of(0x3F808000u),
                            testing::float_of(0x3F818000u),
                            testing::float_of(0x7F7FFFFFu),
                            testing::float_of(0x00012345u)};
  for (std::size_t i = 0; i < sizeof(specials) / sizeof(specials[0]); ++i) src[i * 7] = specials[i];
  std::vector<std::uint16_t> h(src.size());
  convert_fp32_to_bf16(src.data() + 1, h.data(), src.size() - 1);  // misaligned source
  for (std::size_t i = 0; i + 1 < src.size(); ++i)
    ASSERT_EQ(h[i], testing::ref_f_to_bf16(src[i + 1])) << std::hex << testing::bits_of(src[i + 1]);
  // The one scalar copy (core/numeric.hpp, used by the tails, the engine and the reductions)
  // gives the vector lanes' bits.
  for (std::size_t i = 0; i + 1 < src.size(); ++i)
    ASSERT_EQ(h[i], float_to_bf16(src[i + 1])) << std::hex << testing::bits_of(src[i + 1]);
  for (std::size_t i = 0; i < all.size(); ++i) {
    ASSERT_EQ(testing::bits_of(bf16_to_float(all[i])),
              testing::bits_of(testing::ref_bf16_to_f(all[i])));
    if (!std::isnan(testing::ref_fp16_to_f(all[i]))) {
      ASSERT_EQ(testing::bits_of(half_to_float(all[i])),
                testing::bits_of(testing::ref_fp16_to_f(all[i])));
    }
  }
  convert_fp32_to_fp16(src.data() + 1, h.data(), src.size() - 1);
  for (std::size_t i = 0; i + 1 < src.size(); ++i) {
    if (std::isnan(src[i + 1]))
      ASSERT_EQ(h[i] & 0x7E00, 0x7E00);
    else
      ASSERT_EQ(h[i], testing::ref_f_to_fp16(src[i + 1]))
          << std::hex << testing::bits_of(src[i + 1]);
    if (!std::isnan(src[i + 1])) {
      ASSERT_EQ(h[i], float_to_half(src[i + 1]));
    }
  }
}

TEST(AdamCpu, InvalidArgumentsThrowBeforeTouchingState) {
  std::vector<float> p(64, 1.0f), m(64, 0.5f), v(64, 0.25f), g(64, 0.1f);
  CpuAdam opt(2);
  AdamParams hp;
  auto expect_invalid = [&](const AdamParams& h, const AdamTensors& t, const AdamStepOptions& o) {
    strata::testing::expect_error(ErrorCode::kInvalidArgument, "", [&] { opt.step(h, t, o); });
    for (std::size_t i = 0; i < 64; ++i) {
      ASSERT_EQ(p[i], 1.0f);
      ASSERT_EQ(m[i], 0.5f);
      ASSERT_EQ(v[i], 0.25f);
    }
  };
  const AdamTensors ok{p.data(),     m.data(), v.data(),     g.data(),
                       DType::kFp32, nullptr,  DType::kBf16, 64};
  AdamTensors t = ok;
  t.exp_avg = nullptr;
  expect_invalid(hp, t, {});
  expect_invalid(hp, ok, {0, 1.0f, true});
  AdamParams bad = hp;
  bad.beta1 = 1.0;
  expect_invalid(bad, ok, {});
  bad = hp;
  bad.lr = -1;
  expect_invalid(bad, ok, {});
  t = ok;
  t.exp_avg = p.data() + 10;  // overlaps param
  expect_invalid(hp, t, {});
  t = ok;
  t.param = reinterpret_cast<float*>(reinterpret_cast<char*>(p.data()) + 1);
  t.n = 8;
  expect_invalid(hp, t, {});
  t = ok;
  t.param_copy = m.data();  // copy over a moment
  t.param_copy_dtype = DType::kFp32;
  expect_invalid(hp, t, {});
  // Out of place: all three new arrays or none, overlapping nothing (the stream reference too).
  std::vector<float> po(64), mo(64), vo(64);
  t = ok;
  t.param_out = po.data();
  expect_invalid(hp, t, {});
  t.exp_avg_out = mo.data();
  t.exp_avg_sq_out = p.data();  // over param
  expect_invalid(hp, t, {});
  strata::testing::expect_error(ErrorCode::kInvalidArgument, "", [&] { opt.stream_reference(t); });
  // Allowed: the copy written over the 16-bit gradient buffer.
  std::vector<std::uint16_t> gh(64, 0x3DCD);  // bf16 0.1
  t = ok;
  t.grad = gh.data();
  t.grad_dtype = DType::kBf16;
  t.param_copy = gh.data();
  t.param_copy_dtype = DType::kBf16;
  EXPECT_TRUE(opt.step(hp, t, {}).applied);
  EXPECT_NE(p[0], 1.0f);
  EXPECT_EQ(gh[0], testing::ref_f_to_bf16(p[0]));
  // n == 0 with null pointers is a no-op.
  EXPECT_TRUE(opt.step(hp, AdamTensors{}, {}).applied);
}

TEST(AdamCpu, PathCanBeForcedByEnvironment) {
  const char* old = std::getenv("STRATA_ADAM_PATH");
  const std::string saved = old ? old : "";
  for (AdamPath p : testing::supported_paths()) {
    setenv("STRATA_ADAM_PATH", adam_path_name(p), 1);
    EXPECT_EQ(adam_default_path(), p);
    CpuAdam opt(1);
    EXPECT_EQ(opt.path(), p);
  }
  setenv("STRATA_ADAM_PATH", "sse9", 1);
  strata::testing::expect_error(ErrorCode::kInvalidArgument, "STRATA_ADAM_PATH",
                                [&] { adam_default_path(); });
  if (old)
    setenv("STRATA_ADAM_PATH", saved.c_str(), 1);
  else
    unsetenv("STRATA_ADAM_PATH");
  EXPECT_EQ(CpuAdam(1, AdamPath::kScalar).path(), AdamPath::kScalar);
}

TEST(AdamCpu, CudaEntryWithoutCudaBuildThrowsUnsupported) {
  if (adam_cuda_available()) GTEST_SKIP() << "CUDA build: covered by test_optim_cuda";
  strata::testing::expect_error(ErrorCode::kUnsupported, "", [&] {
    adam_step_cuda(AdamParams{}, AdamTensors{}, AdamStepOptions{}, nullptr, nullptr);
  });
}

}  // namespace
}  // namespace strata
