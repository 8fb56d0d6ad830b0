// The ZeRO engine over in-process ranks: stages 0-3 x world sizes 1-4 against the unsharded
// single-rank reference (bitwise), bytes per step against the ZeRO analysis, overflow agreement,
// clipping, overlap of the bucketed reduce-scatter, misuse, and a dead rank.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <utility>

#include "checkpoint/format.hpp"
#include "engine_test_util.hpp"
#include "strata/error.hpp"
#include "strata/plan.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

struct Param {
  int stage;
  int world;
  DType params;
  DType grads;
};

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  auto dn = [](DType t) {
    return t == DType::kFp32 ? "fp32" : t == DType::kFp16 ? "fp16" : "bf16";
  };
  return strcat("stage", info.param.stage, "_world", info.param.world, "_", dn(info.param.params),
                "_", dn(info.param.grads));
}

// The engine case a parameter names: its stage and its parameter and gradient dtypes.
EngineCase param_case(const Param& p) {
  EngineCase c;
  c.stage = p.stage;
  c.params = p.params;
  c.grads = p.grads;
  return c;
}

class EngineMatchesReference : public ::testing::TestWithParam<Param> {};

// Every rank's train_rank(c) against the unsharded reference, bitwise.
void expect_ranks_match_reference(const EngineCase& c, int world, const char* seed_name) {
  const auto seed = test_seed(seed_name);
  auto want = reference_params(c, world, seed);
  auto comms = make_inprocess_communicators(world, 30.0);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    got[static_cast<std::size_t>(rank)] = train_rank(comm, c, seed);
  }));
  for (int r = 0; r < world; ++r)
    expect_bitwise_equal(got[static_cast<std::size_t>(r)], want, strcat("rank ", r));
}

TEST_P(EngineMatchesReference, AfterSteps) {
  const Param p = GetParam();
  expect_ranks_match_reference(param_case(p), p.world, "engine");
}

std::vector<Param> all_params() {
  std::vector<Param> v;
  for (int stage = 0; stage <= 3; ++stage)
    for (int world = 1; world <= 4; ++world)
      v.push_back({stage, world, DType::kFp32, DType::kFp32});
  for (int stage = 0; stage <= 3; ++stage) {
    v.push_back({stage, 3, DType::kFp16, DType::kFp16});
    v.push_back({stage, 2, DType::kBf16, DType::kBf16});
  }
  return v;
}
INSTANTIATE_TEST_SUITE_P(Stages, EngineMatchesReference, ::testing::ValuesIn(all_params()),
                         param_name);

// discard_gradients() drops a partial backward (at stages 2-3 with some buckets' reduce-scatters
// already issued): the steps that follow equal the reference, as if it never happened.
class EngineDiscard : public ::testing::TestWithParam<Param> {};

TEST_P(EngineDiscard, DroppedGradientsLeaveNoTrace) {
  const Param p = GetParam();
  EngineCase c;
  c.stage = p.stage;
  c.discard_first = true;
  expect_ranks_match_reference(c, p.world, "engine-discard");
}

std::vector<Param> discard_params() {
  std::vector<Param> v;
  for (int stage = 0; stage <= 3; ++stage)
    for (int world : {1, 2, 4}) v.push_back({stage, world, DType::kFp32, DType::kFp32});
  return v;
}
INSTANTIATE_TEST_SUITE_P(Stages, EngineDiscard, ::testing::ValuesIn(discard_params()), param_name);

// Unused parameters (skip_gradient; torch's grad None, DDP's find_unused_parameters): tensor 0 is
// never used, tensor 3 not at steps 0 and 2 on any rank (its own step count falls behind the
// global one: its bias correction differs), tensor 6 at step 1 only on rank 0 and at step 3 on
// every rank but rank 0 (the others contribute zeros), the empty tensor 1 never. Bitwise against
// AdamW with per-tensor step counts; each tensor's optimizer_step(id) is checked too.
bool unused_case_uses(int rank, int step, std::size_t t) {
  if (t == 0 || t == 1) return false;
  if (t == 3) return step == 1 || step == 3;
  if (t == 6 && step == 1) return rank == 0;
  if (t == 6 && step == 3) return rank != 0;
  return true;
}

class EngineUnused : public ::testing::TestWithParam<Param> {};

TEST_P(EngineUnused, SkippedTensorsMatchAdamWWithTheirOwnStepCounts) {
  const Param p = GetParam();
  EngineCase c = param_case(p);
  c.steps = 5;
  c.uses = unused_case_uses;
  expect_ranks_match_reference(c, p.world, "engine-unused");
  if (p.stage == 3) return;
  c.skip_late = true;  // the buckets complete in another order on each rank
  expect_ranks_match_reference(c, p.world, "engine-unused-late");
}

std::vector<Param> unused_params() {
  std::vector<Param> v;
  for (int stage = 0; stage <= 3; ++stage)
    for (int world : {1, 2, 4}) v.push_back({stage, world, DType::kFp32, DType::kFp32});
  v.push_back({2, 2, DType::kBf16, DType::kBf16});
  v.push_back({3, 2, DType::kFp16, DType::kFp16});
  return v;
}
INSTANTIATE_TEST_SUITE_P(Stages, EngineUnused, ::testing::ValuesIn(unused_params()), param_name);

// The same with the optimizer state (and at stages 2-3 the gradients) on NVMe, several chunks per
// rank: a skipped tensor's state streams through unchanged.
class EngineUnusedNvme : public ::testing::TestWithParam<Param> {};

TEST_P(EngineUnusedNvme, SkippedTensorsStreamThroughUnchanged) {
  const Param p = GetParam();
  TempDir dir("strata-unused");
  EngineCase c;
  c.stage = p.stage;
  c.steps = 5;
  c.uses = unused_case_uses;
  c.configure = [&](Config& cfg) {
    cfg.offload.optimizer = {Tier::kNvme, 1.0, false};
    if (p.stage >= 2) cfg.offload.gradients = {Tier::kNvme, 1.0, false};
    use_test_swap(cfg, dir.str(), 3, 16 << 10);
  };
  c.skip_late = p.stage < 3;
  expect_ranks_match_reference(c, p.world, "engine-unused-nvme");
}

std::vector<Param> unused_nvme_params() {
  std::vector<Param> v;
  for (int stage = 1; stage <= 3; ++stage)
    for (int world : {1, 2}) v.push_back({stage, world, DType::kFp32, DType::kFp32});
  return v;
}
INSTANTIATE_TEST_SUITE_P(Stages, EngineUnusedNvme, ::testing::ValuesIn(unused_nvme_params()),
                         param_name);

// Steps [from, to) of the unused case's loop on one engine (every tensor gathered for its
// gradient; the unused ones skipped).
// `uses(rank, s, id)` says whether this rank hands the gradient in; a tensor some rank uses is
// gathered on every rank (stage 3's gathers are collective).
void unused_steps(Engine& e, const EngineCase& c, std::uint64_t seed, int rank, int from, int to,
                  const std::function<bool(int, std::size_t)>& uses,
                  const std::function<bool(int, std::size_t)>& anywhere) {
  for (int s = from; s < to; ++s) {
    for (TensorId id = c.sizes.size(); id-- > 0;) {
      if (anywhere(s, id)) e.gather({&id, 1});
      if (uses(s, id)) {
        auto g = grad_of(seed, rank, s, id, c.sizes[id], c.grads);
        e.set_gradient(id, g.data());
      } else {
        e.skip_gradient(id);
      }
      if (anywhere(s, id)) e.release({&id, 1});
    }
    e.step();
  }
}

void unused_steps(Engine& e, const EngineCase& c, std::uint64_t seed, int rank, int from, int to) {
  unused_steps(
      e, c, seed, rank, from, to, [&](int s, std::size_t id) { return c.uses(rank, s, id); },
      [&](int s, std::size_t id) { return used_anywhere(c, 2, s, id); });
}

std::unique_ptr<Engine> unused_engine(const EngineCase& c, Communicator& comm, std::uint64_t seed) {
  auto e = std::make_unique<Engine>(engine_config(c), comm);
  for (std::size_t t = 0; t < c.sizes.size(); ++t)
    e->add_parameter("t" + std::to_string(t), initial_values(seed, t, c.sizes[t]));
  e->finalize();
  return e;
}

// A checkpoint keeps each tensor's own step count, resharded (saved by 2 ranks at stage 2, loaded
// by 1, 2 and 4 ranks at stages 0, 3 and 1): the resumed steps equal the uninterrupted run's,
// bitwise. A checkpoint whose counts are all equal (no "step" per tensor in the manifest, as one
// written before them) loads with every count = the global one.
TEST(EngineUnusedCheckpoint, EachTensorsCountSurvivesAndReshards) {
  TempDir dir("strata-unused-ckpt"), even("strata-unused-even");
  const auto seed = test_seed("engine-unused-ckpt");
  EngineCase c;
  c.stage = 2;
  c.steps = 5;
  c.uses = unused_case_uses;
  std::vector<std::vector<float>> want;
  std::vector<std::int64_t> want_counts;
  auto comms = make_inprocess_communicators(2, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    auto e = unused_engine(c, comm, seed);
    unused_steps(*e, c, seed, rank, 0, 3);
    e->save_checkpoint(dir.str());
    unused_steps(*e, c, seed, rank, 3, 5);
    if (rank == 0) want = read_params(*e, c.sizes);
    for (TensorId id = 0; rank == 0 && id < c.sizes.size(); ++id)
      want_counts.push_back(e->optimizer_step(id));
  }));
  ASSERT_NE(want_counts[3], want_counts[2]);  // the counts differ at the save and after it
  const std::string manifest = dir.str() + "/manifest.json";
  std::ifstream in(manifest, std::ios::binary);
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  const auto saved = checkpoint::parse_manifest(text, manifest);
  EXPECT_EQ(saved.adam_step, 3);
  EXPECT_EQ(saved.tensor_steps, (std::vector<std::int64_t>{0, 0, 3, 1, 3, 3, 3, 3}));
  for (const auto& [world, stage] : {std::pair{1, 0}, {2, 3}, {4, 1}}) {
    EngineCase d = c;
    d.stage = stage;
    auto cs = make_inprocess_communicators(world, 30.0);
    rethrow_any(run_ranks(cs, [&](int rank, Communicator& comm) {
      auto e = unused_engine(d, comm, seed + 1);  // other initial values: the load brings them
      e->load_checkpoint(dir.str());
      EXPECT_EQ(e->optimizer_step(3), 1);
      EXPECT_EQ(e->optimizer_step(0), 0);
      EXPECT_EQ(e->optimizer_step(5), 3);
      // Ranks 0 and 1 hand in what they did in the saving run, the others nothing (one rank: what
      // either used, so that the same tensors are skipped; only 2 ranks give the same sums).
      unused_steps(
          *e, d, seed, rank, 3, 5,
          [&](int s, std::size_t id) {
            return world == 1 ? used_anywhere(d, 2, s, id) : rank < 2 && d.uses(rank, s, id);
          },
          [&](int s, std::size_t id) { return used_anywhere(d, 2, s, id); });
      if (world == 2) expect_bitwise_equal(read_params(*e, d.sizes), want, strcat("stage ", stage));
      for (TensorId id = 0; id < d.sizes.size(); ++id)
        EXPECT_EQ(e->optimizer_step(id), want_counts[id]) << "tensor " << id << " world " << world;
    }));
  }
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    EngineCase u = c;
    u.uses = [](int, int, std::size_t) { return true; };
    auto e = unused_engine(u, comm, seed);
    unused_steps(*e, u, seed, rank, 0, 2);
    e->save_checkpoint(even.str());
    auto f = unused_engine(c, comm, seed);
    unused_steps(*f, c, seed, rank, 0, 3);
    EXPECT_NE(f->optimizer_step(3), f->optimizer_step(2));
    f->load_checkpoint(even.str());
    for (TensorId id = 0; id < c.sizes.size(); ++id) EXPECT_EQ(f->optimizer_step(id), 2);
  }));
}

// Bytes each rank sends per step: 2Ψ(N-1)/N for stages 0-2, 3Ψ(N-1)/N for stage 3 (gathering in
// forward and backward), up to padding and the 16(N-1)-byte norm exchange; and `strata plan`'s
// link figure agrees.
TEST(EngineBytes, PerStepMatchZeroAnalysis) {
  for (int world : {2, 4}) {
    std::vector<double> per_stage(4);
    for (int stage = 0; stage <= 3; ++stage) {
      EngineCase c;
      c.stage = stage;
      c.params = DType::kFp16;
      c.grads = DType::kFp16;
      c.steps = 1;
      c.sizes = {20000, 3, 15001, 0, 9000};
      c.bucket = 4096;
      c.sub_group = 10000;
      auto comms = make_inprocess_communicators(world, 30.0);
      std::vector<std::uint64_t> bytes(static_cast<std::size_t>(world));
      std::size_t flat = 0;
      rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
        Engine e(engine_config(c), comm);
        std::vector<TensorId> ids;
        for (std::size_t t = 0; t < c.sizes.size(); ++t)
          ids.push_back(e.add_parameter("t", initial_values(1, t, c.sizes[t])));
        e.finalize();
        if (rank == 0) flat = e.partition().flat_size();
        auto before = comm.stats().total_bytes_sent();
        e.gather(ids);
        e.release(ids);
        e.gather(ids);
        for (auto id : ids) {
          auto g = grad_of(1, rank, 0, id, c.sizes[id], c.grads);
          e.set_gradient(id, g.data());
        }
        e.release(ids);
        e.step();
        bytes[static_cast<std::size_t>(rank)] = comm.stats().total_bytes_sent() - before;
      }));
      const double psi = 20000 + 3 + 15001 + 9000;
      const double k = stage == 3 ? 3 : 2;
      const double want = k * psi * 2 * (world - 1) / world;
      const double slack = k * static_cast<double>(flat - 44004) * 2 + 16.0 * (world - 1);
      // strata plan's per-rank network figure is the paper's volume; a ring sends (N-1)/N of it.
      Config pc = engine_config(c);
      pc.model.parameters = 44004;
      pc.world.ranks = static_cast<std::uint32_t>(world);
      const double planned =
          static_cast<double>(plan_layout(pc, stage, pc.offload).traffic.network) * (world - 1) /
          world;
      EXPECT_NEAR(planned, want, 1.0) << "stage " << stage;
      for (int r = 0; r < world; ++r) {
        double b = static_cast<double>(bytes[static_cast<std::size_t>(r)]);
        EXPECT_NEAR(b, want, slack) << "stage " << stage << " world " << world << " rank " << r;
        EXPECT_NEAR(b, planned, slack) << "stage " << stage << " world " << world << " rank " << r;
      }
      per_stage[static_cast<std::size_t>(stage)] = static_cast<double>(bytes[0]);
    }
    EXPECT_NEAR(per_stage[3] / per_stage[2], 1.5, 0.02) << "world " << world;
    EXPECT_NEAR(per_stage[1] / per_stage[0], 1.0, 0.02) << "world " << world;
  }
}

// An overflow on one rank skips the step on every rank, backs the loss scale off everywhere and
// leaves the parameters untouched; good steps grow the scale after growth_interval.
TEST(EngineOverflow, SkipsAgreeAcrossRanks) {
  const int world = 3;
  for (int stage : {0, 1, 2, 3}) {
    EngineCase c;
    c.stage = stage;
    c.params = DType::kFp16;
    c.grads = DType::kFp16;
    Config cfg = engine_config(c);
    cfg.precision.loss_scale.growth_interval = 2;
    auto comms = make_inprocess_communicators(world, 30.0);
    std::vector<std::vector<StepResult>> res(world);
    std::vector<EngineStats> stats(world);
    rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
      Engine e(cfg, comm);
      std::vector<TensorId> ids;
      for (std::size_t t = 0; t < c.sizes.size(); ++t)
        ids.push_back(e.add_parameter("t", initial_values(7, t, c.sizes[t])));
      e.finalize();
      for (int s = 0; s < 4; ++s) {
        e.gather(ids);
        std::vector<std::vector<float>> before;
        for (auto id : ids) {
          std::vector<float> v(c.sizes[id]);
          e.read_param(id, v);
          before.push_back(v);
        }
        for (auto id : ids) {
          auto g = grad_of(7, rank, s, id, c.sizes[id], c.grads);
          if (s == 1 && rank == 2 && id == 6) store_elem(g.data(), 17, c.grads, INFINITY);
          e.set_gradient(id, g.data());
        }
        e.release(ids);
        res[rank].push_back(e.step());
        e.gather(ids);
        for (auto id : ids) {
          std::vector<float> v(c.sizes[id]);
          e.read_param(id, v);
          if (s == 1) {
            EXPECT_EQ(v, before[id]) << "skipped step changed tensor " << id;
          } else if (c.sizes[id] > 2) {
            EXPECT_NE(v, before[id]) << "step " << s << " did not update tensor " << id;
          }
        }
        e.release(ids);
      }
      stats[rank] = e.stats();
    }));
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE(strcat("stage ", stage, " rank ", r));
      EXPECT_TRUE(res[r][0].applied);
      EXPECT_FALSE(res[r][1].applied);
      EXPECT_TRUE(res[r][1].overflow);
      EXPECT_EQ(res[r][0].loss_scale, 1024.0);
      EXPECT_EQ(res[r][1].loss_scale, 512.0);
      EXPECT_EQ(res[r][2].loss_scale, 512.0);
      EXPECT_EQ(res[r][3].loss_scale, 1024.0);  // two good steps: growth
      EXPECT_EQ(stats[r].skipped_steps, 1u);
      EXPECT_EQ(stats[r].applied_steps, 3u);
      EXPECT_EQ(res[r][3].grad_norm, res[0][3].grad_norm);
    }
  }
}

TEST(EngineClip, ClipsToGlobalNorm) {
  const int world = 2;
  EngineCase c;
  c.stage = 2;
  c.steps = 1;
  const auto seed = test_seed("engine.clip");
  // Reference norm of the averaged gradient.
  double sum_sq = 0;
  for (std::size_t t = 0; t < c.sizes.size(); ++t) {
    std::vector<std::vector<unsigned char>> per;
    for (int r = 0; r < world; ++r) per.push_back(grad_of(seed, r, 0, t, c.sizes[t], c.grads));
    auto s = reference_sum(per, 0, c.sizes[t], c.grads);
    for (std::size_t i = 0; i < c.sizes[t]; ++i) {
      double g = load_elem(s.data(), i, c.grads) * 0.5;
      sum_sq += g * g;
    }
  }
  const double norm = std::sqrt(sum_sq);
  c.clip = norm / 4;
  auto comms = make_inprocess_communicators(world, 30.0);
  std::vector<std::vector<StepResult>> res(world);
  rethrow_any(run_ranks(
      comms, [&](int rank, Communicator& comm) { train_rank(comm, c, seed, &res[rank]); }));
  for (int r = 0; r < world; ++r) {
    EXPECT_NEAR(res[r][0].grad_norm, norm, 1e-4 * norm);
    EXPECT_NEAR(res[r][0].clip_coef, 0.25, 1e-4);
    EXPECT_EQ(res[r][0].clip_coef, res[0][0].clip_coef);
  }
}

// Stage 2 with per-tensor gradients: buckets are reduce-scattered during "backward", before step().
TEST(EngineOverlap, BucketsLeaveBeforeStep) {
  auto comms = make_inprocess_communicators(2, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    EngineCase c;
    c.stage = 2;
    Engine e(engine_config(c), comm);
    std::vector<TensorId> ids;
    for (std::size_t t = 0; t < c.sizes.size(); ++t)
      ids.push_back(e.add_parameter("t", initial_values(3, t, c.sizes[t])));
    e.finalize();
    auto rs = [&] {
      return comm.stats().calls[static_cast<std::size_t>(CollectiveKind::kReduceScatter)];
    };
    const auto start = rs();
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
      auto g = grad_of(3, rank, 0, *it, c.sizes[*it], c.grads);
      e.set_gradient(*it, g.data());
      if (*it == 6) {
        EXPECT_GE(rs() - start, 2u) << "301 elements in buckets of 100: some must have left";
      }
    }
    e.step();
  }));
}

TEST(EngineMisuse, ClearErrors) {
  auto comms = make_inprocess_communicators(1, 5.0);
  EngineCase c;
  c.stage = 3;
  Engine e(engine_config(c), *comms[0]);
  std::vector<float> init(10, 0.5f);
  auto id = e.add_parameter("w", init);
  auto other = e.add_parameter("v", init);
  EXPECT_THROW(e.step(), Error);  // before finalize
  e.finalize();
  EXPECT_THROW(e.add_parameter("late", init), Error);
  EXPECT_THROW(e.param(id), Error);  // stage 3, not gathered
  EXPECT_THROW(e.param(7), Error);
  std::vector<float> g(10, 1.0f);
  e.set_gradient(id, g.data());
  // Again before 'v' arrived: not a second micro-batch (it would drop or double a gradient).
  expect_error(ErrorCode::kInvalidArgument, "before micro-batch 1 handed in every gradient ('v'",
               [&] { e.set_gradient(id, g.data()); });
  e.set_gradient(other, g.data());
  e.set_gradient(id, g.data());  // micro-batch 2 (accumulation)
  expect_error(ErrorCode::kInvalidArgument, "in micro-batch 2", [&] { e.step(); });
  e.set_gradient(other, g.data());
  e.step();
  try {
    e.step();
    ADD_FAILURE() << "step without gradients succeeded";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("'w'"), std::string::npos) << err.what();
  }
  Config bad = engine_config(c);
  bad.zero.stage = 4;
  EXPECT_THROW(Engine(bad, *comms[0]), Error);
}

// One rank, one 10-element parameter "w" (0.5), 16-bit gradients and parameters (`dtype`) held in
// precision.grad_accum fp32 (`fp32`) or in their own dtype, at `stage` (2: gradient chunks on cpu).
struct AccumulatingEngine {
  AccumulatingEngine(int stage, DType dtype, bool fp32)
      : comms(make_inprocess_communicators(1, 5.0)) {
    EngineCase c;
    c.stage = stage;
    c.grads = dtype;
    c.params = dtype;
    Config cfg = engine_config(c);
    if (fp32) cfg.precision.grad_accum = DType::kFp32;
    if (stage == 2) cfg.offload.gradients.tier = Tier::kCpu;
    engine = std::make_unique<Engine>(cfg, *comms[0]);
    id = engine->add_parameter("w", std::vector<float>(10, 0.5f));
    engine->finalize();
  }
  std::vector<std::unique_ptr<Communicator>> comms;
  std::unique_ptr<Engine> engine;
  TensorId id = 0;
};

// 16-bit gradients accumulate in precision.grad_accum: bf16 1 + 2^-8 is a tie that rounds to 1
// in bf16 (the gradients' own dtype, the default) and stays 1 + 2^-8 in fp32, which the step's
// norm reads — at stage 0 (the flat gradients) and stage 2 (the gradient chunks, on cpu).
TEST(EngineAccumulation, SixteenBitGradientsSumInGradAccum) {
  for (int stage : {0, 2})
    for (bool fp32 : {false, true}) {
      SCOPED_TRACE(strcat("stage ", stage, fp32 ? " grad_accum fp32" : " grad_accum bf16"));
      AccumulatingEngine a(stage, DType::kBf16, fp32);
      const std::vector<std::uint16_t> one(10, 0x3f80), tiny(10, 0x3b80);  // bf16 1, 2^-8
      a.engine->set_gradient(a.id, one.data());
      a.engine->set_gradient(a.id, tiny.data());  // micro-batch 2
      const StepResult r = a.engine->step();
      EXPECT_TRUE(r.applied);
      EXPECT_NEAR(r.grad_norm, std::sqrt(10.0) * (fp32 ? 1.00390625 : 1.0), 1e-9);
    }
}

// Nothing saturates: two finite fp16 micro-batches whose sum exceeds fp16's range (2 x 40000 >
// 65504) overflow to inf when held in fp16 — the step is skipped and the loss scale backs off, as
// for an inf handed in — and stay finite held in fp32 (the step applies). Stages 0 and 2.
TEST(EngineAccumulation, Fp16SumThatOverflowsSkipsTheStep) {
  for (int stage : {0, 2})
    for (bool fp32 : {false, true}) {
      SCOPED_TRACE(strcat("stage ", stage, fp32 ? " grad_accum fp32" : " grad_accum fp16"));
      AccumulatingEngine a(stage, DType::kFp16, fp32);
      const double scale = a.engine->loss_scale();
      const std::vector<std::uint16_t> big(10, 0x78e2);  // fp16 40000
      a.engine->set_gradient(a.id, big.data());
      a.engine->set_gradient(a.id, big.data());  // micro-batch 2
      const StepResult r = a.engine->step();
      EXPECT_EQ(r.applied, fp32);
      EXPECT_EQ(a.engine->loss_scale(), fp32 ? scale : scale / 2);
    }
}

// A rank that dies mid-training makes the others' step() fail (they return: nothing hangs past
// the collective timeout), naming it. No elapsed-time assertion: the timeout is long enough that
// a loaded machine does not time out a healthy collective first.
TEST(EngineFaults, DeadRankFailsOthersWithinTimeout) {
  for (int stage : {1, 3}) {
    const double timeout = 2.0;
    auto comms = make_inprocess_communicators(3, timeout);
    comms[1] = make_faulty_communicator(std::move(comms[1]), {FaultSpec::Mode::kError, 6, 0});
    EngineCase c;
    c.stage = stage;
    c.steps = 4;
    c.timeout_s = timeout;
    auto errors = run_ranks(comms, [&](int, Communicator& comm) { train_rank(comm, c, 5); });
    for (int r : {0, 2}) {
      ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << "stage " << stage << " rank " << r;
      try {
        std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("rank(s) 1"), std::string::npos) << e.what();
      }
    }
    EXPECT_TRUE(errors[1]);
  }
}

}  // namespace
}  // namespace strata::testing
