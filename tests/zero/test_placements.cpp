// Same numbers wherever the state lives: the Engine on the host-emulated device, for every placement
// of {optimizer, gradients, params} x {gpu, cpu, nvme} that a stage allows, stages 0-3, 1-4
// in-process ranks, 22 steps of which two overflow (an inf, a NaN on the last rank: skipped
// everywhere), bitwise identical to the unsharded single-rank CpuAdam reference (the rank-ordered
// sum of the ranks' gradients, rounded to the gradient dtype as the collective does, grad_scale =
// 1 / (loss_scale * world), the dynamic loss scale backed off on each overflow). Plus: mixed
// fractions (part nvme, part gpu), 16-bit parameters and gradients with loss scaling, and several
// chunks per rank (a small pinned buffer) so the loop really streams. Every case is a named
// parameter (stage, placement, world, dtype).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include "../comm/comm_test_util.hpp"
#include "core/numeric.hpp"
#include "strata/adam.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

struct Placement {
  int stage = 0;
  Tier opt = Tier::kGpu, grads = Tier::kGpu, params = Tier::kGpu;
  double fraction = 1.0;  // of each offloaded kind
  int world = 1;
  DType pdt = DType::kFp32, gdt = DType::kFp32;
};

std::string case_name(const ::testing::TestParamInfo<Placement>& i) {
  const Placement& p = i.param;
  std::string s = strata::strcat("stage", p.stage, "_opt_", tier_name(p.opt), "_grads_", tier_name(p.grads), "_params_",
                         tier_name(p.params), "_world", p.world);
  if (p.fraction < 1) s += strata::strcat("_fraction", static_cast<int>(p.fraction * 100));
  if (p.pdt != DType::kFp32 || p.gdt != DType::kFp32) s += strata::strcat("_", dtype_name(p.pdt), "_", dtype_name(p.gdt));
  return s;
}

// Every placement a stage allows (config validation: optimizer off gpu from stage 1, gradients
// from 2, parameters at 3), for 1-4 ranks; then the extra cases.
std::vector<Placement> all_cases() {
  const Tier tiers[3] = {Tier::kGpu, Tier::kCpu, Tier::kNvme};
  std::vector<Placement> v;
  for (int stage = 0; stage <= 3; ++stage)
    for (Tier o : tiers)
      for (Tier g : tiers)
        for (Tier p : tiers) {
          if ((stage < 1 && o != Tier::kGpu) || (stage < 2 && g != Tier::kGpu) || (stage < 3 && p != Tier::kGpu))
            continue;
          for (int world = 1; world <= 4; ++world) v.push_back({stage, o, g, p, 1.0, world});
        }
  // Part of each kind on its tier, the rest on gpu.
  v.push_back({3, Tier::kNvme, Tier::kNvme, Tier::kNvme, 0.5, 3});
  v.push_back({3, Tier::kCpu, Tier::kNvme, Tier::kCpu, 0.3, 2});
  v.push_back({2, Tier::kNvme, Tier::kCpu, Tier::kGpu, 0.6, 4});
  v.push_back({1, Tier::kNvme, Tier::kGpu, Tier::kGpu, 0.5, 1});
  // 16-bit parameters and gradients: loss scaling, overflow backs the scale off.
  for (int stage = 0; stage <= 3; ++stage) {
    const Tier t = stage == 0 ? Tier::kGpu : Tier::kNvme;
    v.push_back({stage, t, stage >= 2 ? Tier::kCpu : Tier::kGpu, stage == 3 ? Tier::kNvme : Tier::kGpu, 1.0, 3,
                 DType::kBf16, DType::kFp16});
  }
  v.push_back({3, Tier::kGpu, Tier::kGpu, Tier::kGpu, 1.0, 2, DType::kFp16, DType::kBf16});
  return v;
}

const std::vector<std::size_t> kSizes{3001, 7, 0, 2120, 129, 1000, 1};
constexpr int kSteps = 22;

Config placement_config(const Placement& p, const std::string& dir) {
  Config cfg;
  cfg.zero.stage = p.stage;
  cfg.zero.reduce_bucket_size = 1500;
  cfg.zero.sub_group_size = 2500;  // cut inside the chunks
  cfg.precision.params = p.pdt;
  cfg.precision.grads = p.gdt;
  cfg.precision.loss_scale.initial = 1024;
  cfg.optimizer.type = OptimizerType::kAdamW;
  cfg.optimizer.lr = 1e-2;
  cfg.optimizer.weight_decay = 0.01;
  cfg.runtime.cpu_threads = 1;
  cfg.runtime.collective_timeout_s = 30.0;
  cfg.runtime.device = DeviceKind::kHost;
  cfg.offload.optimizer = {p.opt, p.fraction, false};
  cfg.offload.gradients = {p.grads, p.fraction, false};
  cfg.offload.params = {p.params, p.fraction, false};
  cfg.tiers.host.buffer_count = 3;
  cfg.tiers.host.buffer_size = 16 << 10;  // ~640 elements per chunk: several chunks per rank
  cfg.tiers.nvme.paths = {dir};
  cfg.tiers.nvme.engine = IoEngineKind::kThreads;
  cfg.tiers.nvme.queue_depth = 4;
  cfg.tiers.nvme.direct_io = DirectIoMode::kOff;  // the page cache: CI's disk is not what is tested
  return cfg;
}

std::vector<float> initial(std::size_t t) {
  std::mt19937_64 rng(77 + t);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> v(kSizes[t]);
  for (auto& x : v) x = d(rng);
  return v;
}

// Rank-distinct gradients (in the gradient dtype); steps 4 and 11 carry an inf / a NaN on the last
// rank.
std::vector<unsigned char> gradient(int rank, int world, int step, std::size_t t, DType dt) {
  std::mt19937_64 rng(0x5eed ^ (static_cast<std::uint64_t>(rank) << 40) ^ (static_cast<std::uint64_t>(step) << 20) ^ t);
  std::normal_distribution<float> d(0.0f, 0.5f);
  std::vector<unsigned char> g(kSizes[t] * elem_size(dt));
  for (std::size_t i = 0; i < kSizes[t]; ++i) store_elem(g.data(), i, dt, d(rng));
  if (kSizes[t] > 3 && rank == world - 1 && (step == 4 || step == 11) && t == 3)
    store_elem(g.data(), kSizes[t] / 2, dt, step == 4 ? std::numeric_limits<float>::infinity() : std::nanf(""));
  return g;
}

std::vector<std::vector<float>> train(Communicator& comm, const Placement& p, const std::string& dir, int* skipped) {
  Engine e(placement_config(p, dir), comm);
  std::vector<TensorId> ids;
  for (std::size_t t = 0; t < kSizes.size(); ++t) ids.push_back(e.add_parameter(strata::strcat("t", t), initial(t)));
  e.finalize();
  for (int s = 0; s < kSteps; ++s) {
    for (auto id : ids) {  // forward: gathered one at a time (stage 3), read through param()
      e.gather({&id, 1});
      if (kSizes[id]) {
        EXPECT_NE(e.param(id), nullptr);
      }
      e.release({&id, 1});
    }
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) {  // backward
      e.gather({&*it, 1});
      auto g = gradient(comm.rank(), comm.size(), s, *it, p.gdt);
      e.set_gradient(*it, g.data());
      e.release({&*it, 1});
    }
    if (!e.step().applied) ++*skipped;
  }
  std::vector<std::vector<float>> out;
  for (auto id : ids) {
    e.gather({&id, 1});
    std::vector<float> v(kSizes[id]);
    e.read_param(id, v);
    out.push_back(std::move(v));
    e.release({&id, 1});
  }
  return out;
}

// The unsharded reference.
std::vector<std::vector<float>> reference(const Placement& p, int* skipped) {
  const Config cfg = placement_config(p, "");
  const bool scaling = p.gdt != DType::kFp32;
  double scale = scaling ? cfg.precision.loss_scale.initial : 1.0;
  CpuAdam adam(1);
  const AdamParams hp = AdamParams::from_config(cfg.optimizer);
  std::vector<std::vector<float>> master, m, v;
  std::vector<std::vector<unsigned char>> copy;
  for (std::size_t t = 0; t < kSizes.size(); ++t) {
    master.push_back(initial(t));
    m.emplace_back(kSizes[t], 0.0f);
    v.emplace_back(kSizes[t], 0.0f);
    copy.emplace_back(kSizes[t] * elem_size(p.pdt));
    for (std::size_t i = 0; i < kSizes[t]; ++i) store_elem(copy[t].data(), i, p.pdt, master[t][i]);
  }
  std::int64_t step = 0;
  for (int s = 0; s < kSteps; ++s) {
    std::vector<std::vector<unsigned char>> sums;
    bool finite = true;
    const float inv = static_cast<float>(1.0 / (scale * p.world));
    for (std::size_t t = 0; t < kSizes.size(); ++t) {
      std::vector<std::vector<unsigned char>> per_rank;
      for (int r = 0; r < p.world; ++r) per_rank.push_back(gradient(r, p.world, s, t, p.gdt));
      sums.push_back(reference_sum(per_rank, 0, kSizes[t], p.gdt));
      for (std::size_t i = 0; i < kSizes[t]; ++i) finite = finite && std::isfinite(load_elem(sums[t].data(), i, p.gdt) * inv);
    }
    if (!finite) {
      ++*skipped;
      if (scaling) scale = std::max(cfg.precision.loss_scale.min_scale, scale * cfg.precision.loss_scale.backoff_factor);
      continue;
    }
    ++step;
    for (std::size_t t = 0; t < kSizes.size(); ++t) {
      AdamTensors at{master[t].data(), m[t].data(), v[t].data(), sums[t].data(), p.gdt, copy[t].data(), p.pdt, kSizes[t]};
      adam.step(hp, at, AdamStepOptions{step, inv, false});
    }
  }
  std::vector<std::vector<float>> out;
  for (std::size_t t = 0; t < kSizes.size(); ++t) {
    out.emplace_back(kSizes[t]);
    for (std::size_t i = 0; i < kSizes[t]; ++i) out[t][i] = load_elem(copy[t].data(), i, p.pdt);
  }
  return out;
}

class Placements : public ::testing::TestWithParam<Placement> {};

TEST_P(Placements, BitwiseIdenticalToTheUnshardedReference) {
  const Placement p = GetParam();
  TempDir dir("strata-placement");
  int want_skipped = 0;
  const auto want = reference(p, &want_skipped);
  ASSERT_EQ(want_skipped, 2);
  auto comms = make_inprocess_communicators(p.world, 30.0);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(p.world));
  std::vector<int> skipped(static_cast<std::size_t>(p.world), 0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    got[static_cast<std::size_t>(rank)] = train(comm, p, dir.str(), &skipped[static_cast<std::size_t>(rank)]);
  }));
  for (int r = 0; r < p.world; ++r) {
    EXPECT_EQ(skipped[static_cast<std::size_t>(r)], 2) << "rank " << r;
    const auto& g = got[static_cast<std::size_t>(r)];
    ASSERT_EQ(g.size(), want.size());
    for (std::size_t t = 0; t < g.size(); ++t)
      for (std::size_t i = 0; i < g[t].size(); ++i)
        ASSERT_EQ(std::bit_cast<std::uint32_t>(g[t][i]), std::bit_cast<std::uint32_t>(want[t][i]))
            << "rank " << r << " tensor " << t << " element " << i << ": " << g[t][i] << " vs " << want[t][i];
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, Placements, ::testing::ValuesIn(all_cases()), case_name);

}  // namespace
}  // namespace strata::testing
