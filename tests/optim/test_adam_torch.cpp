// CPU Adam/AdamW against PyTorch itself: the same random initial parameters and gradients go
// through torch.optim.Adam / AdamW (Debian's /usr/bin/python3, torch 1.13; single-tensor and
// foreach implementations) and through CpuAdam for >= 50 steps, over several hyper-parameter
// sets; the FP32 masters must agree to 1e-6 relative. Skipped when torch cannot be imported.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "optim/adam_test_util.hpp"
#include "strata/adam.hpp"
#include "test_util.hpp"

namespace strata {
namespace {

const char* kPython = "/usr/bin/python3";

bool torch_available() {
  std::string out;
  const std::string command = std::string(kPython).append(" -c 'import torch' 2>&1");
  return testing::run_command(command, &out) == 0;
}

template <class T>
void write_file(const std::string& path, const T* data, std::size_t n) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(data), std::streamsize(n * sizeof(T)));
  ASSERT_TRUE(f.good()) << path;
}
template <class T>
std::vector<T> read_file(const std::string& path, std::size_t n) {
  std::vector<T> v(n);
  std::ifstream f(path, std::ios::binary);
  f.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * sizeof(T)));
  EXPECT_TRUE(f.good()) << path;
  return v;
}

struct Case {
  std::string name;
  OptimizerType type;
  double lr, b1, b2, eps, wd;
  std::size_t n;
  int steps;
  DType gd;
  double scale;
  bool foreach;
};

TEST(AdamTorch, MasterMatchesTorchOptim) {
  if (!torch_available()) GTEST_SKIP() << kPython << " cannot import torch";
  const std::uint64_t seed = testing::test_seed("AdamTorch.MasterMatchesTorchOptim");
  testing::TempDir dir("strata-adam-torch");
  const std::vector<Case> cases = {
      {"adam_fp32", OptimizerType::kAdam, 1e-3, 0.9, 0.999, 1e-8, 0.0, 4099, 60, DType::kFp32, 1.0,
       false},
      {"adam_l2_bf16", OptimizerType::kAdam, 3e-3, 0.8, 0.99, 1e-6, 0.01, 2049, 55, DType::kBf16,
       1.0, true},
      {"adam_l2_fp16_scaled", OptimizerType::kAdam, 1e-3, 0.9, 0.999, 1e-8, 0.1, 777, 50,
       DType::kFp16, 1.0 / 1024, false},
      {"adamw_fp32_scaled", OptimizerType::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3001, 60,
       DType::kFp32, 0.7, true},
      {"adamw_nowd_bf16", OptimizerType::kAdamW, 2e-3, 0.9, 0.999, 1e-8, 0.0, 1, 50, DType::kBf16,
       1.0, false},
      {"adamw_wd_fp16", OptimizerType::kAdamW, 2e-3, 0.85, 0.995, 1e-7, 0.1, 4097, 50, DType::kFp16,
       0.25, true},
      {"adamw_wd_fp32_single", OptimizerType::kAdamW, 1e-2, 0.5, 0.9, 1e-3, 0.05, 17, 80,
       DType::kFp32, 1.0, false},
  };
  std::mt19937_64 rng(seed);
  std::ofstream list(dir.str() + "/cases.txt");
  std::vector<std::vector<float>> inits;
  std::vector<std::vector<testing::RandomGrads>> all_grads;
  for (const Case& c : cases) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> init(c.n);
    for (auto& x : init) x = nd(rng);
    std::vector<testing::RandomGrads> grads;
    std::vector<std::uint8_t> raw;
    for (int s = 0; s < c.steps; ++s) {
      grads.push_back(testing::random_grads(rng, c.n, c.gd, float(0.05 / c.scale)));
      const auto* b = static_cast<const std::uint8_t*>(grads.back().data(c.gd));
      raw.insert(raw.end(), b, b + c.n * testing::dt_size(c.gd));
    }
    write_file(dir.str() + "/" + c.name + ".init", init.data(), c.n);
    write_file(dir.str() + "/" + c.name + ".grads", raw.data(), raw.size());
    char line[512];
    std::snprintf(line, sizeof line, "%s %s %.17g %.17g %.17g %.17g %.17g %zu %d %s %.17g %d\n",
                  c.name.c_str(), c.type == OptimizerType::kAdam ? "adam" : "adamw", c.lr, c.b1,
                  c.b2, c.eps, c.wd, c.n, c.steps, testing::dt_name(c.gd), c.scale,
                  c.foreach ? 1 : 0);
    list << line;
    inits.push_back(std::move(init));
    all_grads.push_back(std::move(grads));
  }
  // Conversions too: torch's bf16/fp16 casts of random finite floats vs ours.
  std::vector<float> conv(20011);
  for (auto& x : conv) {
    do x = testing::float_of(std::uint32_t(rng()));
    while (std::isnan(x));
  }
  write_file(dir.str() + "/convert.f32", conv.data(), conv.size());
  list.close();

  std::string out;
  const std::string cmd = std::string(kPython) + " " + testing::source_dir() +
                          "/scripts/adam_torch_ref.py check " + dir.str() + " 2>&1";
  ASSERT_EQ(testing::run_command(cmd, &out), 0) << cmd << "\n" << out;

  for (AdamPath path : testing::supported_paths()) {
    CpuAdam opt(2, path);
    for (std::size_t ci = 0; ci < cases.size(); ++ci) {
      const Case& c = cases[ci];
      SCOPED_TRACE(std::string(adam_path_name(path)) + " " + c.name);
      std::vector<float> p = inits[ci], m(c.n, 0.0f), v(c.n, 0.0f);
      const AdamParams hp{c.type, c.lr, c.b1, c.b2, c.eps, c.wd};
      for (int s = 0; s < c.steps; ++s) {
        AdamTensors t{p.data(), m.data(), v.data(),     all_grads[ci][s].data(c.gd),
                      c.gd,     nullptr,  DType::kBf16, c.n};
        ASSERT_TRUE(opt.step(hp, t, {s + 1, float(c.scale), true}).applied);
      }
      const std::vector<float> ref = read_file<float>(dir.str() + "/" + c.name + ".torch", c.n);
      double max_rel = 0, max_rel_floor = 0;
      std::size_t exact = 0, unmoved = 0;
      for (std::size_t i = 0; i < c.n; ++i) {
        const double d = std::fabs(double(p[i]) - double(ref[i]));
        max_rel = std::max(max_rel, d / std::max(std::fabs(double(ref[i])), 1e-30));
        max_rel_floor = std::max(max_rel_floor, d / std::max(std::fabs(double(ref[i])), 1e-3));
        exact += p[i] == ref[i];
        unmoved += ref[i] == inits[ci][i];
      }
      // torch really ran: (nearly) every element moved. A random walk of 50-80 Adam steps lands
      // exactly on its start now and then (about one run in twenty had one such element of 3001),
      // so a few are allowed.
      EXPECT_LE(unmoved, c.n < 100 ? c.n - 1 : c.n / 100)
          << "torch left " << unmoved << " of " << c.n << " elements unchanged";
      std::printf("[torch] %-6s %-22s max rel %.3g (floor 1e-3: %.3g), bit-exact %zu/%zu\n",
                  adam_path_name(path), c.name.c_str(), max_rel, max_rel_floor, exact, c.n);
      EXPECT_LE(max_rel_floor, 1e-6);
    }
  }
  const auto bf = read_file<std::uint16_t>(dir.str() + "/convert.bf16", conv.size());
  const auto hf = read_file<std::uint16_t>(dir.str() + "/convert.fp16", conv.size());
  std::vector<std::uint16_t> ours(conv.size());
  convert_fp32_to_bf16(conv.data(), ours.data(), conv.size());
  for (std::size_t i = 0; i < conv.size(); ++i) ASSERT_EQ(ours[i], bf[i]) << "bf16 " << conv[i];
  convert_fp32_to_fp16(conv.data(), ours.data(), conv.size());
  for (std::size_t i = 0; i < conv.size(); ++i) ASSERT_EQ(ours[i], hf[i]) << "fp16 " << conv[i];
}

// Data-parallel averaging as torch does it: the ranks' FP32 gradients summed in rank order, then
// divided by N (DDP's all-reduce + division by the world size), then unscaled. CpuAdam with
// AdamStepOptions::grad_divisor = N must match torch bit for bit, for N = 1..4, on every CPU
// path: the first moment (a pure function of the averaged gradients) and the master weights.
// Multiplying by float(1/N) instead, as the engine did, differs for N = 3 (checked too, so the
// test tells the two apart).
TEST(AdamTorch, AveragedGradientsMatchTorchBitwiseForEveryWorldSize) {
  if (!torch_available()) GTEST_SKIP() << kPython << " cannot import torch";
  const std::uint64_t seed = testing::test_seed("AdamTorch.AveragedGradients");
  testing::TempDir dir("strata-adam-torch-avg");
  const std::size_t n = 4099;
  const int steps = 20;
  const double scale =
      1.0 / 1024;  // a loss scale of 1024 (a power of two, as dynamic scaling uses)
  std::mt19937_64 rng(seed);
  std::ofstream list(dir.str() + "/cases.txt");
  std::vector<float> init(n);
  {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& x : init) x = nd(rng);
  }
  // grads[N][step][rank]
  std::vector<std::vector<std::vector<std::vector<float>>>> grads(5);
  for (int ranks = 1; ranks <= 4; ++ranks) {
    const std::string name = "avg_n" + std::to_string(ranks);
    std::vector<float> raw;
    grads[ranks].resize(steps);
    for (int s = 0; s < steps; ++s)
      for (int r = 0; r < ranks; ++r) {
        grads[ranks][s].push_back(testing::random_grads(rng, n, DType::kFp32, 50.0f).f32);
        raw.insert(raw.end(), grads[ranks][s].back().begin(), grads[ranks][s].back().end());
      }
    write_file(dir.str() + "/" + name + ".init", init.data(), n);
    write_file(dir.str() + "/" + name + ".grads", raw.data(), raw.size());
    char line[512];
    std::snprintf(line, sizeof line, "%s adamw 0.001 0.9 0.999 1e-08 0.01 %zu %d fp32 %.17g 0 %d\n",
                  name.c_str(), n, steps, scale, ranks);
    list << line;
  }
  list.close();
  std::string out;
  const std::string cmd = std::string(kPython) + " " + testing::source_dir() +
                          "/scripts/adam_torch_ref.py check " + dir.str() + " 2>&1";
  ASSERT_EQ(testing::run_command(cmd, &out), 0) << cmd << "\n" << out;

  const AdamParams hp{OptimizerType::kAdamW, 1e-3, 0.9, 0.999, 1e-8, 0.01};
  // Runs the steps with the rank-ordered sum; `divide`: grad_divisor = N, else grad_scale / N.
  auto run = [&](CpuAdam& opt, int ranks, bool divide, std::vector<float>& p,
                 std::vector<float>& m) {
    p = init;
    m.assign(n, 0.0f);
    std::vector<float> v(n, 0.0f), sum(n);
    for (int s = 0; s < steps; ++s) {
      sum = grads[ranks][s][0];
      for (int r = 1; r < ranks; ++r)
        for (std::size_t i = 0; i < n; ++i) sum[i] += grads[ranks][s][r][i];
      AdamTensors t{p.data(),     m.data(), v.data(),     sum.data(),
                    DType::kFp32, nullptr,  DType::kBf16, n};
      AdamStepOptions o{s + 1, float(scale), true};
      if (divide)
        o.grad_divisor = float(ranks);
      else
        o.grad_scale = float(scale * (1.0 / ranks));
      ASSERT_TRUE(opt.step(hp, t, o).applied);
    }
  };
  for (AdamPath path : testing::supported_paths()) {
    CpuAdam opt(2, path);
    for (int ranks = 1; ranks <= 4; ++ranks) {
      const std::string name = "avg_n" + std::to_string(ranks);
      SCOPED_TRACE(std::string(adam_path_name(path)) + " " + name);
      const auto ref_p = read_file<float>(dir.str() + "/" + name + ".torch", n);
      const auto ref_m = read_file<float>(dir.str() + "/" + name + ".exp_avg", n);
      std::vector<float> p, m;
      run(opt, ranks, true, p, m);
      std::size_t moved = 0;
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(testing::bits_of(m[i]), testing::bits_of(ref_m[i]))
            << "exp_avg element " << i << ": " << m[i] << " vs torch " << ref_m[i];
        ASSERT_EQ(testing::bits_of(p[i]), testing::bits_of(ref_p[i]))
            << "master element " << i << ": " << p[i] << " vs torch " << ref_p[i];
        moved += ref_p[i] != init[i];
      }
      EXPECT_GT(moved, n - n / 100) << "torch did not run";
      // The multiply-by-1/N averaging this replaced: equal for powers of two, not for N = 3.
      run(opt, ranks, false, p, m);
      std::size_t differ = 0;
      for (std::size_t i = 0; i < n; ++i)
        differ += testing::bits_of(m[i]) != testing::bits_of(ref_m[i]);
      std::printf(
          "[torch] %-6s N=%d: bitwise equal; multiplying by float(1/N) instead differs in "
          "%zu of %zu first moments\n",
          adam_path_name(path), ranks, differ, n);
      if (ranks == 3)
        EXPECT_GT(differ, 0u);
      else
        EXPECT_EQ(differ, 0u);
    }
  }
}

}  // namespace
}  // namespace strata
