// Engine checkpoints across world sizes and stages (issue 14.2): N ranks at stage s save, M ranks
// at stage s' load (resident or NVMe-offloaded state); every tensor's FP32 master and moments and
// the optimizer step arrive bitwise, and training on equals an M-rank run started from the same
// state (write_state + set_optimizer_step), bitwise, step after step.
#include <gtest/gtest.h>

#include <bit>
#include <random>

#include "../comm/comm_test_util.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"
#include "zero/engine_basics.hpp"

namespace strata::testing {
namespace {

const std::vector<std::size_t> kReshardSizes{4000, 17, 0, 2345, 1, 700};
constexpr StateKind kKinds[3] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};

struct EngineCase {
  int n, s, m, s2;
  DType params;
  double nvme;  // fraction of the loading side's optimizer state on NVMe
};

void PrintTo(const EngineCase& c, std::ostream* os) {
  *os << c.n << " ranks stage " << c.s << " -> " << c.m << " ranks stage " << c.s2 << ", params "
      << dtype_name(c.params) << ", nvme " << c.nvme;
}

std::string engine_case_name(const ::testing::TestParamInfo<EngineCase>& i) {
  const auto& c = i.param;
  return strcat("N", c.n, "s", c.s, "_to_M", c.m, "s", c.s2, "_", dtype_name(c.params),
                c.nvme > 0 ? "_nvme" : "");
}

Config config(int stage, DType params, double nvme, const std::string& swap) {
  Config cfg = base_engine_config(stage, 1000, 900, 60.0);
  cfg.precision.params = params;
  cfg.optimizer.weight_decay = 0.01;
  if (nvme > 0) {
    cfg.offload.optimizer = {Tier::kNvme, nvme, false};
    use_test_swap(cfg, swap, 2, 4 * 4096);
  }
  return cfg;
}

void add_tensors(Engine& e) {
  for (std::size_t t = 0; t < kReshardSizes.size(); ++t) {
    std::mt19937_64 rng(500 + t);
    std::uniform_real_distribution<float> d(-1, 1);
    std::vector<float> init(kReshardSizes[t]);
    for (auto& x : init) x = d(rng);
    e.add_parameter("block" + std::to_string(t), init);
  }
  e.finalize();
}

void train_step(Engine& e, int rank, int step) {
  for (std::size_t t = kReshardSizes.size(); t-- > 0;) {
    std::mt19937_64 rng(7 + 1000003ull * static_cast<std::uint64_t>(step) + 7919ull * t +
                        31ull * static_cast<std::uint64_t>(rank));
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> g(kReshardSizes[t]);
    for (auto& x : g) x = d(rng);
    e.set_gradient(t, g.data());
  }
  e.step();
}

// [tensor][kind] FP32 state, then the parameters as FP32: the whole model as bits.
using State = std::vector<std::vector<std::uint32_t>>;
State state_of(Engine& e) {
  State s;
  for (std::size_t t = 0; t < kReshardSizes.size(); ++t) {
    std::vector<float> v(kReshardSizes[t]);
    for (StateKind k : kKinds) {
      e.read_state(t, k, v);
      s.emplace_back();
      for (float x : v) s.back().push_back(std::bit_cast<std::uint32_t>(x));
    }
    TensorId id = t;
    e.gather({&id, 1});
    e.read_param(t, v);
    e.release({&id, 1});
    s.emplace_back();
    for (float x : v) s.back().push_back(std::bit_cast<std::uint32_t>(x));
  }
  s.push_back({static_cast<std::uint32_t>(e.optimizer_step())});
  return s;
}

class EngineReshard : public ::testing::TestWithParam<EngineCase> {};

TEST_P(EngineReshard, LoadsBitwiseAndTrainsOnLikeAFreshRunFromTheSameState) {
  const EngineCase c = GetParam();
  TempDir ckpt("strata-engine-reshard"), swap("strata-engine-reshard-swap");
  // N ranks train 5 steps and save.
  State saved;
  {
    auto comms = make_inprocess_communicators(c.n, 60.0);
    rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
      Engine e(config(c.s, c.params, 0, swap.str()), comm);
      add_tensors(e);
      for (int s = 0; s < 5; ++s) train_step(e, rank, s);
      e.save_checkpoint(ckpt.str());
      State st = state_of(e);
      if (rank == 0) saved = st;
    }));
  }
  // M ranks: A loads the checkpoint; B starts from the same state through write_state. Both train
  // 3 more steps with the same gradients.
  auto comms_a = make_inprocess_communicators(c.m, 60.0);
  auto comms_b = make_inprocess_communicators(c.m, 60.0);
  rethrow_any(run_ranks(comms_a, [&](int rank, Communicator& comm_a) {
    Communicator& comm_b = *comms_b[static_cast<std::size_t>(rank)];
    Engine a(config(c.s2, c.params, c.nvme, swap.str()), comm_a);
    Engine b(config(c.s2, c.params, 0, swap.str()), comm_b);
    add_tensors(a);
    add_tensors(b);
    a.load_checkpoint(ckpt.str());
    EXPECT_EQ(a.stats().steps, 5u);
    const State loaded = state_of(a);
    ASSERT_EQ(loaded, saved) << "rank " << rank << ": the loaded state differs from the saved one";
    std::size_t row = 0;
    for (std::size_t t = 0; t < kReshardSizes.size(); ++t, ++row) {
      for (StateKind k : kKinds) {
        const auto& bits = saved[row++];
        std::vector<float> v(bits.size());
        for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::bit_cast<float>(bits[i]);
        b.write_state(t, k, v);
      }
    }
    b.set_optimizer_step(static_cast<std::int64_t>(saved.back()[0]));
    ASSERT_EQ(state_of(b), saved);
    for (int s = 5; s < 8; ++s) {
      train_step(a, rank, s);
      train_step(b, rank, s);
      ASSERT_EQ(state_of(a), state_of(b)) << "rank " << rank << " after step " << s + 1;
    }
  }));
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, EngineReshard,
                         ::testing::Values(EngineCase{4, 3, 3, 1, DType::kFp32, 0},
                                           EngineCase{2, 1, 5, 3, DType::kFp32, 0.5},
                                           EngineCase{3, 2, 2, 2, DType::kBf16, 0},
                                           EngineCase{1, 3, 4, 2, DType::kFp16, 1.0},
                                           EngineCase{5, 1, 1, 3, DType::kFp32, 0},
                                           EngineCase{2, 2, 3, 0, DType::kBf16, 0}),
                         engine_case_name);

}  // namespace
}  // namespace strata::testing
