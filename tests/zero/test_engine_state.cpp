// The engine's embedder API beyond the basic loop: parameter groups (own lr, weight decay, betas
// and eps per group, lr and beta1 changed between steps as OneCycleLR does), clip_grad_norm with
// the loop's own max_norm, against the unsharded reference, and read_state /
// write_state of the FP32 master and moments, gathered across ranks, for stages 0-3 x 1-4 ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "core/numeric.hpp"
#include "engine_test_util.hpp"
#include "strata/error.hpp"
#include "strata/plan.hpp"
#include "test_util.hpp"
#include "zero/engine_access.hpp"

namespace strata::testing {
namespace {

using StateParam = StageWorld;

// Tensors alternate between group 0 (config lr / decay / betas / eps) and group 1 (its own); the
// lr of both and group 1's beta1 change after every step, as OneCycleLR would.
constexpr double kGroup1Lr = 3e-3, kGroup1Decay = 0.0, kGroup1Beta2 = 0.99, kGroup1Eps = 1e-6;
double lr_at(int step, GroupId g) { return (g == 0 ? 1e-2 : kGroup1Lr) / (1.0 + step); }
double beta1_at(int step) { return 0.85 + 0.02 * step; }

// The reference: per tensor CpuAdam with its group's hyper-parameters; `coef[s]` (when given)
// scales step s's averaged gradients (the clip coefficient).
std::vector<std::vector<float>> grouped_reference(const EngineCase& c, int world,
                                                  std::uint64_t seed,
                                                  std::vector<std::vector<float>>* m_out,
                                                  const std::vector<float>& coef = {}) {
  Config cfg = engine_config(c);
  CpuAdam adam(1);
  std::vector<std::vector<float>> master, m, v;
  for (std::size_t t = 0; t < c.sizes.size(); ++t) {
    master.push_back(initial_values(seed, t, c.sizes[t]));
    m.emplace_back(c.sizes[t], 0.0f);
    v.emplace_back(c.sizes[t], 0.0f);
  }
  for (int s = 0; s < c.steps; ++s)
    for (std::size_t t = 0; t < c.sizes.size(); ++t) {
      std::vector<std::vector<unsigned char>> per_rank;
      for (int r = 0; r < world; ++r)
        per_rank.push_back(grad_of(seed, r, s, t, c.sizes[t], c.grads));
      auto sum = reference_sum(per_rank, 0, c.sizes[t], c.grads);
      AdamParams hp = AdamParams::from_config(cfg.optimizer);
      const GroupId g = t % 2;
      hp.lr = lr_at(s, g);
      hp.weight_decay = g == 0 ? cfg.optimizer.weight_decay : kGroup1Decay;
      if (g == 1) {
        hp.beta1 = beta1_at(s);
        hp.beta2 = kGroup1Beta2;
        hp.eps = kGroup1Eps;
      }
      AdamTensors at{master[t].data(), m[t].data(), v[t].data(),  sum.data(),
                     c.grads,          nullptr,     DType::kFp32, c.sizes[t]};
      const float scale = coef.empty() ? 1.0f : coef[static_cast<std::size_t>(s)];
      adam.step(hp, at, AdamStepOptions{s + 1, scale, false, static_cast<float>(world)});
    }
  if (m_out) *m_out = m;
  return master;
}

class EngineGroups : public ::testing::TestWithParam<StateParam> {};

TEST_P(EngineGroups, PerGroupLrAndDecayMatchReference) {
  const StateParam p = GetParam();
  EngineCase c;
  c.stage = p.stage;
  const auto seed = test_seed("engine-groups");
  std::vector<std::vector<float>> want_m;
  auto want = grouped_reference(c, p.world, seed, &want_m);
  auto comms = make_inprocess_communicators(p.world, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Engine e(engine_config(c), comm);
    const GroupId g1 = e.add_param_group({kGroup1Lr, kGroup1Decay, 0.5, kGroup1Beta2, kGroup1Eps});
    EXPECT_EQ(g1, 1u);
    EXPECT_EQ(e.betas(0).second, engine_config(c).optimizer.beta2);  // unset: the config's
    std::vector<TensorId> ids;
    for (std::size_t t = 0; t < c.sizes.size(); ++t)
      ids.push_back(
          e.add_parameter("t" + std::to_string(t), initial_values(seed, t, c.sizes[t]), t % 2));
    e.finalize();
    EXPECT_EQ(e.num_groups(), 2u);
    EXPECT_EQ(e.group_of(ids[1]), 1u);
    for (int s = 0; s < c.steps; ++s) {
      e.set_lr(lr_at(s, 0), 0);
      e.set_lr(lr_at(s, 1), 1);
      e.set_betas(beta1_at(s), kGroup1Beta2, 1);
      for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
        auto g = grad_of(seed, rank, s, *it, c.sizes[*it], c.grads);
        e.gather({&*it, 1});
        e.set_gradient(*it, g.data());
        e.release({&*it, 1});
      }
      EXPECT_TRUE(e.step().applied);
    }
    EXPECT_EQ(e.optimizer_step(), c.steps);
    for (auto id : ids) {
      std::vector<float> master(c.sizes[id]), m(c.sizes[id]);
      e.read_state(id, StateKind::kMaster, master);
      e.read_state(id, StateKind::kExpAvg, m);
      expect_bitwise_equal({master}, {want[id]}, strcat("rank ", rank, " master of t", id));
      expect_bitwise_equal({m}, {want_m[id]}, strcat("rank ", rank, " exp_avg of t", id));
    }
  }));
}

// write_state of rank-independent random values, then read_state of every kind on every rank:
// each rank gets back exactly what was written, and the parameters follow the master.
TEST_P(EngineGroups, WriteThenReadStateRoundTrips) {
  const StateParam p = GetParam();
  EngineCase c;
  c.stage = p.stage;
  c.params = DType::kBf16;
  c.grads = DType::kBf16;
  const auto seed = test_seed("engine-state");
  auto comms = make_inprocess_communicators(p.world, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Engine e(engine_config(c), comm);
    std::vector<TensorId> ids;
    for (std::size_t t = 0; t < c.sizes.size(); ++t)
      ids.push_back(e.add_parameter("t" + std::to_string(t), initial_values(seed, t, c.sizes[t])));
    e.finalize();
    const StateKind kinds[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};
    for (auto id : ids)
      for (int k = 0; k < 3; ++k)
        e.write_state(id, kinds[k], initial_values(seed + 17 * (k + 1), id, c.sizes[id]));
    e.set_optimizer_step(7);
    for (auto id : ids) {
      for (int k = 0; k < 3; ++k) {
        std::vector<float> got(c.sizes[id]);
        e.read_state(id, kinds[k], got);
        expect_bitwise_equal({got}, {initial_values(seed + 17 * (k + 1), id, c.sizes[id])},
                             strcat("rank ", rank, " ", state_kind_name(kinds[k]), " of t", id));
      }
      e.gather({&id, 1});
      std::vector<float> param(c.sizes[id]);
      e.read_param(id, param);
      e.release({&id, 1});
      auto master = initial_values(seed + 17, id, c.sizes[id]);
      for (std::size_t i = 0; i < param.size(); ++i)
        ASSERT_EQ(param[i], bf16_to_float(float_to_bf16(master[i])))
            << "rank " << rank << " t" << id << " element " << i;
    }
    EXPECT_EQ(e.optimizer_step(), 7);
    std::vector<float> wrong(c.sizes[0] + 1);
    try {
      e.read_state(ids[0], StateKind::kMaster, wrong);
      ADD_FAILURE() << "a wrong size was accepted";
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), ErrorCode::kInvalidArgument);
    }
  }));
}

// write_state of one tensor moves that tensor's elements, not its chunk's: one chunk holds the
// whole rank's state here (sub-groups larger than the model), and writing the small tensor's
// three arrays reads and writes its own elements only (the range's three state arrays, and the
// parameters, the master's rounding). Reading and rewriting the whole chunk made a
// torch-style load_state_dict of a 113.6M-parameter model (588 write_state calls) take over ten
// minutes. The other tensors' state is untouched; stages 0-3, state on the gpu (its master the
// parameters at stages 0-2) and on cpu.
TEST(EngineState, WriteStateOfATensorMovesItsElementsNotItsChunk) {
  for (int stage = 0; stage <= 3; ++stage) {
    for (Tier opt : {Tier::kGpu, Tier::kCpu}) {
      if (stage == 0 && opt != Tier::kGpu) continue;
      SCOPED_TRACE(strcat("stage ", stage, ", state on ", tier_name(opt)));
      EngineCase c;
      c.stage = stage;
      c.sizes = {60000, 37, 50000};
      c.sub_group = 1 << 20;
      c.configure = [&](Config& cfg) {
        cfg.offload.optimizer = {opt, 1.0, false};
        if (stage == 3) cfg.offload.params = {opt, 1.0, false};
        cfg.runtime.device = DeviceKind::kHost;
      };
      const auto seed = test_seed("engine-state-range");
      auto comms = make_inprocess_communicators(1, 30.0);
      Engine e(engine_config(c), *comms[0]);
      for (std::size_t t = 0; t < c.sizes.size(); ++t)
        e.add_parameter("t" + std::to_string(t), initial_values(seed, t, c.sizes[t]));
      e.finalize();
      ASSERT_EQ(zero::EngineAccess::chunks(e).size(), 1u);
      const StateKind kinds[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};
      std::vector<float> before(c.sizes[2]);
      e.read_state(2, StateKind::kMaster, before);
      const TierStoreStats s0 = zero::EngineAccess::storage(e).store().stats();
      for (int k = 0; k < 3; ++k) e.write_state(1, kinds[k], initial_values(seed + k + 1, 1, 37));
      const TierStoreStats s1 = zero::EngineAccess::storage(e).store().stats();
      // Each call reads and writes the range's three arrays (12 B an element; the parameters too
      // where the master is theirs): 37 elements, against 1.3 MB for the chunk.
      EXPECT_LE(s1.bytes_from_gpu - s0.bytes_from_gpu, 3u * 12 * 37) << "the chunk read back";
      EXPECT_LE(s1.bytes_to_gpu - s0.bytes_to_gpu, 4u * 12 * 37) << "the chunk rewritten";
      for (int k = 0; k < 3; ++k) {
        std::vector<float> got(37);
        e.read_state(1, kinds[k], got);
        expect_bitwise_equal({got}, {initial_values(seed + k + 1, 1, 37)}, "t1");
      }
      std::vector<float> after(c.sizes[2]);
      e.read_state(2, StateKind::kMaster, after);
      expect_bitwise_equal({after}, {before}, "t2, not written");
    }
  }
}

// write_states of every tensor's three arrays with the state on NVMe (several chunks, tensors
// sharing a chunk and one across chunks): each chunk the rank holds is read once and written once
// (a write_state per array reads and rewrites its chunk: a torch-style load_state_dict of a
// 113.6M-parameter model took 222 s that way), a later write of the same array wins, every rank
// reads back what was written, bitwise, and the bf16 parameters follow the master. A batch with
// one wrong size is refused whole: nothing changed. Stages 1-3, 1 and 2 ranks.
TEST(EngineState, WriteStatesReadAndWriteEachNvmeChunkOnce) {
  for (int stage = 1; stage <= 3; ++stage) {
    for (int world : {1, 2}) {
      SCOPED_TRACE(strcat("stage ", stage, ", ", world, " ranks"));
      TempDir dir("strata-write-states");
      EngineCase c;
      c.stage = stage;
      c.params = DType::kBf16;
      c.sizes = {30000, 37, 25000, 9001};
      c.sub_group = 16000;
      c.configure = [&](Config& cfg) {
        cfg.offload.optimizer = {Tier::kNvme, 1.0, false};
        cfg.runtime.device = DeviceKind::kHost;
        use_test_swap(cfg, dir.str(), 4, 1 << 20);
      };
      const auto seed = test_seed("engine-write-states");
      const StateKind kinds[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};
      auto value = [&](std::size_t t, int k) {
        return initial_values(seed + 31 * k, t, c.sizes[t]);
      };
      auto comms = make_inprocess_communicators(world, 30.0);
      rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
        Engine e(engine_config(c), comm);
        for (std::size_t t = 0; t < c.sizes.size(); ++t)
          e.add_parameter("t" + std::to_string(t), initial_values(seed, t, c.sizes[t]));
        e.finalize();
        std::vector<std::vector<float>> values;  // 3 per tensor, then t0's exp_avg again
        std::vector<StateWrite> writes;
        for (std::size_t t = 0; t < c.sizes.size(); ++t)
          for (int k = 0; k < 3; ++k) values.push_back(value(t, k + 1));
        values.push_back(value(0, 9));
        for (std::size_t i = 0; i < values.size(); ++i)
          writes.push_back({i < 12 ? i / 3 : 0, kinds[i < 12 ? i % 3 : 1], values[i]});
        std::uint64_t chunk_bytes = 0;
        zero::RankStorage& storage = zero::EngineAccess::storage(e);
        for (const zero::Chunk& ch : zero::EngineAccess::chunks(e))
          chunk_bytes += storage.store().padded_bytes(ch.opt);
        ASSERT_GE(zero::EngineAccess::chunks(e).size(), 2u);
        const TierStoreStats s0 = storage.store().stats();
        e.write_states(writes);
        const TierStoreStats s1 = storage.store().stats();
        // (each array's read rounded out to 4 KiB units at both ends: 6 units a chunk at most)
        const std::uint64_t slack = 6 * 4096 * zero::EngineAccess::chunks(e).size();
        EXPECT_LE(s1.bytes_from_nvme - s0.bytes_from_nvme, chunk_bytes + slack)
            << "a chunk read twice";
        EXPECT_LE(s1.bytes_to_nvme - s0.bytes_to_nvme, chunk_bytes) << "a chunk written twice";
        const std::vector<float> t1_master = value(1, 1);
        std::vector<StateWrite> refused = {{1, StateKind::kMaster, value(1, 5)},
                                           {2, StateKind::kExpAvg, t1_master}};  // wrong size
        try {
          e.write_states(refused);
          ADD_FAILURE() << "a batch with a wrong size was accepted";
        } catch (const Error& err) {
          EXPECT_EQ(err.code(), ErrorCode::kInvalidArgument);
        }
        for (TensorId t = 0; t < c.sizes.size(); ++t) {
          for (int k = 0; k < 3; ++k) {
            std::vector<float> got(c.sizes[t]);
            e.read_state(t, kinds[k], got);
            expect_bitwise_equal({got}, {value(t, t == 0 && k == 1 ? 9 : k + 1)},
                                 strcat("rank ", rank, " ", state_kind_name(kinds[k]), " of t", t));
          }
          std::vector<float> param(c.sizes[t]);
          e.gather({&t, 1});
          e.read_param(t, param);
          e.release({&t, 1});
          const std::vector<float> master = value(t, 1);
          for (std::size_t i = 0; i < param.size(); ++i)
            ASSERT_EQ(param[i], bf16_to_float(float_to_bf16(master[i])))
                << "rank " << rank << " t" << t << " element " << i;
        }
      }));
    }
  }
}

// add_parameter_borrowed reads the caller's memory at finalize() (no copy of the model at
// start-up: what the values say then is what the engine starts from, rank 0's on every rank);
// add_parameter copies at the call. gradient(id): stages 0-1 the held gradient, as handed in;
// stages 2-3 nullptr.
TEST_P(EngineGroups, BorrowedInitialValuesAndHeldGradients) {
  const StateParam p = GetParam();
  EngineCase c;
  c.stage = p.stage;
  const auto seed = test_seed("engine-borrowed");
  auto comms = make_inprocess_communicators(p.world, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Engine e(engine_config(c), comm);
    std::vector<std::vector<float>> values;
    for (std::size_t t = 0; t < c.sizes.size(); ++t)
      values.push_back(initial_values(seed + static_cast<std::uint64_t>(rank), t, c.sizes[t]));
    for (std::size_t t = 0; t < c.sizes.size(); ++t) {
      const std::string name = "t" + std::to_string(t);
      if (t % 2) {
        e.add_parameter_borrowed(name, values[t]);
      } else {
        e.add_parameter(name, values[t]);
      }
    }
    for (auto& v : values)  // changed after the calls: only the borrowed ones see it
      for (float& x : v) x = x * 2.0f + 1.0f;
    e.finalize();
    for (TensorId id = 0; id < c.sizes.size(); ++id) {
      std::vector<float> want = initial_values(seed, id, c.sizes[id]);  // rank 0's
      if (id % 2)
        for (float& x : want) x = x * 2.0f + 1.0f;
      std::vector<float> got(c.sizes[id]);
      e.read_state(id, StateKind::kMaster, got);
      expect_bitwise_equal({got}, {want}, strcat("rank ", rank, " master of t", id));
      const auto g = grad_of(seed, rank, 0, id, c.sizes[id], c.grads);
      e.set_gradient(id, g.data());
      const void* held = e.gradient(id);
      if (c.stage >= 2) {
        EXPECT_EQ(held, nullptr);
      } else {
        ASSERT_NE(held, nullptr);
        if (!g.empty()) {
          EXPECT_EQ(std::memcmp(held, g.data(), g.size()), 0) << "rank " << rank << " t" << id;
        }
      }
    }
  }));
}

// Stages 0-1, FP32 parameters, state in memory (on the gpu with an even number of ranks; on cpu
// with one rank, optimizer.overlap auto, and with three, optimizer.update device), the host
// device: the parameters are the FP32 master (one copy of the weights, docs/offload.md). A write
// into param()'s memory is the master's, as AdamW's parameters are: read_state sees it and the
// next step updates from it (the reference from the written values, bitwise). Stage 2 too where
// nothing can be speculated (the state on the gpu, or updated by the device); with it on cpu under
// optimizer.overlap auto, and at stage 3, the master is the state's own.
TEST_P(EngineGroups, TheParametersAreTheMasterAtStagesZeroAndOne) {
  const StateParam p = GetParam();
  EngineCase c;
  c.stage = p.stage;
  c.configure = [&](Config& cfg) {
    cfg.offload.optimizer = {p.world % 2 ? Tier::kCpu : Tier::kGpu, 1.0, false};
    if (p.world == 1) cfg.optimizer.overlap = OptimizerOverlap::kAuto;
    if (p.world == 3) cfg.optimizer.update = OptimizerUpdate::kDevice;
    cfg.runtime.device = DeviceKind::kHost;
  };
  const Config cfg = engine_config(c);
  const auto seed = test_seed("engine-params-master");
  // The written values (the same on every rank) and the reference's step from them.
  std::vector<std::vector<float>> written, want;
  for (std::size_t t = 0; t < c.sizes.size(); ++t) {
    written.push_back(initial_values(seed + 5, t, c.sizes[t]));
    std::vector<std::vector<unsigned char>> per_rank;
    for (int r = 0; r < p.world; ++r)
      per_rank.push_back(grad_of(seed, r, 0, t, c.sizes[t], c.grads));
    auto sum = reference_sum(per_rank, 0, c.sizes[t], c.grads);
    std::vector<float> w = written[t], m(c.sizes[t]), v(c.sizes[t]);
    AdamTensors at{w.data(), m.data(), v.data(),     sum.data(),
                   c.grads,  nullptr,  DType::kFp32, c.sizes[t]};
    CpuAdam(1).step(AdamParams::from_config(cfg.optimizer), at,
                    AdamStepOptions{1, 1.0f, false, static_cast<float>(p.world)});
    want.push_back(w);
  }
  auto comms = make_inprocess_communicators(p.world, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Engine e(cfg, comm);
    for (std::size_t t = 0; t < c.sizes.size(); ++t)
      e.add_parameter("t" + std::to_string(t), initial_values(seed, t, c.sizes[t]));
    e.finalize();
    const bool aliased = p.stage < 2 || (p.stage == 2 && p.world != 1);
    ASSERT_EQ(e.params_are_master(), aliased);
    if (!aliased) return;
    for (TensorId id = 0; id < c.sizes.size(); ++id) {
      if (c.sizes[id])
        std::memcpy(const_cast<void*>(e.param(id)), written[id].data(), 4 * c.sizes[id]);
    }
    for (TensorId id = 0; id < c.sizes.size(); ++id) {
      std::vector<float> master(c.sizes[id]);
      e.read_state(id, StateKind::kMaster, master);
      expect_bitwise_equal({master}, {written[id]}, strcat("rank ", rank, " master of t", id));
      e.set_gradient(id, grad_of(seed, rank, 0, id, c.sizes[id], c.grads).data());
    }
    ASSERT_TRUE(e.step().applied);
    for (TensorId id = 0; id < c.sizes.size(); ++id) {
      std::vector<float> master(c.sizes[id]), param(c.sizes[id]);
      e.read_state(id, StateKind::kMaster, master);
      e.read_param(id, param);
      expect_bitwise_equal({master}, {want[id]}, strcat("rank ", rank, " master of t", id));
      expect_bitwise_equal({param}, {want[id]}, strcat("rank ", rank, " params of t", id));
    }
  }));
}

// 16-bit parameters, state on nvme (a part of it: its chunks), and a runtime.device auto (the
// plan's GPU) keep a master of their own; the plan says so too. State on gpu or cpu (host memory
// on the host device) does not.
TEST(EngineParamsMaster, OnlyFp32ParametersOnTheHostDeviceWithStateOnCpu) {
  TempDir dir("strata-params-master");
  struct Case {
    DType params;
    OffloadTarget opt;
    bool want;       // Engine::params_are_master: every element's master is the parameters
    bool plan_says;  // Layout::master_in_params: some share's is
  };
  const Case cases[] = {{DType::kFp32, {Tier::kCpu, 1.0, false}, true, true},
                        {DType::kBf16, {Tier::kCpu, 1.0, false}, false, false},
                        {DType::kFp32, {Tier::kNvme, 1.0, false}, false, false},
                        {DType::kFp32, {Tier::kGpu, 1.0, false}, true, true},
                        {DType::kFp32, {Tier::kNvme, 0.5, false}, false, true}};
  for (const Case& k : cases) {
    EngineCase c;
    c.stage = 1;
    c.params = k.params;
    c.grads = k.params;
    c.configure = [&](Config& cfg) {
      cfg.offload.optimizer = k.opt;
      cfg.runtime.device = DeviceKind::kHost;
      use_test_swap(cfg, dir.str(), 1, 1 << 20);
    };
    Config cfg = engine_config(c);
    cfg.model.parameters = 1000;
    SCOPED_TRACE(strcat(dtype_name(k.params), " state on ", tier_name(k.opt.tier)));
    EXPECT_EQ(make_plan(cfg).configured.master_in_params, k.plan_says);
    auto comms = make_inprocess_communicators(1, 30.0);
    Engine e(cfg, *comms[0]);
    e.add_parameter("t", initial_values(1, 0, 1000));
    e.finalize();
    EXPECT_EQ(e.params_are_master(), k.want);
  }
  Config cfg;  // runtime.device auto: the plan is for a GPU's machine
  cfg.zero.stage = 1;
  cfg.model.parameters = 1000;
  cfg.offload.optimizer = {Tier::kCpu, 1.0, false};
  EXPECT_FALSE(make_plan(cfg).configured.master_in_params);
}

// The loop clips to its own max_norm (torch.nn.utils.clip_grad_norm_ between backward and step):
// clip_grad_norm returns the global norm of the averaged gradients on every rank, and the update
// is the reference's with torch's coefficient min(1, max / (norm + 1e-6)) in fp32. Step 0's
// max_norm clips, step 1's does not (max_norm far above the norm), step 2 only reads the norm.
TEST_P(EngineGroups, ClipGradNormClipsWithTheGlobalNorm) {
  const StateParam p = GetParam();
  EngineCase c;
  c.stage = p.stage;
  const auto seed = test_seed("engine-clip");
  const double max_norm[] = {0.05, 1e6, HUGE_VAL};
  std::vector<double> norms(static_cast<std::size_t>(c.steps));
  std::vector<float> coef;
  for (int s = 0; s < c.steps; ++s) {  // the reference norm: of sum / world, in double
    double sq = 0;
    for (std::size_t t = 0; t < c.sizes.size(); ++t) {
      std::vector<std::vector<unsigned char>> per_rank;
      for (int r = 0; r < p.world; ++r)
        per_rank.push_back(grad_of(seed, r, s, t, c.sizes[t], c.grads));
      const auto sum = reference_sum(per_rank, 0, c.sizes[t], c.grads);
      for (std::size_t i = 0; i < c.sizes[t]; ++i) {
        const double g = load_elem(sum.data(), i, c.grads) / static_cast<float>(p.world);
        sq += g * g;
      }
    }
    norms[static_cast<std::size_t>(s)] = std::sqrt(sq);
  }
  std::vector<std::vector<double>> got_norms(static_cast<std::size_t>(p.world));
  auto comms = make_inprocess_communicators(p.world, 30.0);
  std::vector<std::vector<std::vector<float>>> masters(static_cast<std::size_t>(p.world));
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Engine e(engine_config(c), comm);
    e.add_param_group({kGroup1Lr, kGroup1Decay, 0.5, kGroup1Beta2, kGroup1Eps});
    std::vector<TensorId> ids;
    for (std::size_t t = 0; t < c.sizes.size(); ++t)
      ids.push_back(
          e.add_parameter("t" + std::to_string(t), initial_values(seed, t, c.sizes[t]), t % 2));
    e.finalize();
    for (int s = 0; s < c.steps; ++s) {
      e.set_lr(lr_at(s, 0), 0);
      e.set_lr(lr_at(s, 1), 1);
      e.set_betas(beta1_at(s), kGroup1Beta2, 1);
      for (auto id : ids) {
        auto g = grad_of(seed, rank, s, id, c.sizes[id], c.grads);
        e.gather({&id, 1});
        e.set_gradient(id, g.data());
        e.release({&id, 1});
      }
      const double norm = e.clip_grad_norm(max_norm[s]);
      got_norms[static_cast<std::size_t>(rank)].push_back(norm);
      auto g = grad_of(seed, rank, s, 0, c.sizes[0], c.grads);
      expect_error(ErrorCode::kInvalidArgument, "after clip_grad_norm",
                   [&] { e.set_gradient(ids[0], g.data()); });
      const StepResult r = e.step();
      EXPECT_TRUE(r.applied);
      EXPECT_EQ(r.grad_norm, norm);
    }
    for (auto id : ids) {
      std::vector<float> master(c.sizes[id]);
      e.read_state(id, StateKind::kMaster, master);
      masters[static_cast<std::size_t>(rank)].push_back(master);
    }
  }));
  for (int s = 0; s < c.steps; ++s) {
    const double norm = got_norms[0][static_cast<std::size_t>(s)];
    EXPECT_NEAR(norm, norms[static_cast<std::size_t>(s)], 1e-6 * norm) << "step " << s;
    for (int r = 1; r < p.world; ++r)
      EXPECT_EQ(got_norms[static_cast<std::size_t>(r)][static_cast<std::size_t>(s)], norm);
    const float n = static_cast<float>(norm);
    coef.push_back(std::min(1.0f, static_cast<float>(max_norm[s]) / (n + 1e-6f)));
  }
  EXPECT_LT(coef[0], 1.0f);  // step 0 did clip
  EXPECT_EQ(coef[1], 1.0f);
  auto want = grouped_reference(c, p.world, seed, nullptr, coef);
  for (int r = 0; r < p.world; ++r)
    expect_bitwise_equal(masters[static_cast<std::size_t>(r)], want, strcat("rank ", r, " master"));
}

std::vector<StateParam> state_params() {
  std::vector<StateParam> v;
  for (int stage = 0; stage <= 3; ++stage)
    for (int world : {1, 2, 3, 4}) v.push_back({stage, world});
  return v;
}
INSTANTIATE_TEST_SUITE_P(Stages, EngineGroups, ::testing::ValuesIn(state_params()),
                         stage_world_name);

// A checkpoint keeps every group's lr / weight decay / betas / eps and the embedder's client state;
// a new engine's load restores them (torch's load_state_dict does the same for its groups).
TEST(EngineCheckpointExtras, GroupsAndClientStateRoundTrip) {
  TempDir dir("strata-ckpt-extras");
  const std::string client = R"({"step": 7, "data": "pos \u00e9"})";
  auto comms = make_inprocess_communicators(2, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Engine e(engine_config(EngineCase{}), comm);
    e.add_param_group({kGroup1Lr, kGroup1Decay, 0.5, kGroup1Beta2, kGroup1Eps});
    e.add_parameter("a", std::vector<float>(40, 0.5f), 0);
    e.add_parameter("b", std::vector<float>(30, 0.25f), 1);
    e.finalize();
    e.set_lr(0.123, 1);
    e.set_betas(0.7, 0.8, 0);
    expect_error(ErrorCode::kInvalidArgument, "UTF-8",
                 [&] { e.save_checkpoint(dir.str(), std::string("\xff\xfe", 2)); });
    e.save_checkpoint(dir.str(), rank == 0 ? client : "another rank's");
    Engine f(engine_config(EngineCase{}), comm);
    f.add_param_group({1.0, 0.0});
    f.add_parameter("a", std::vector<float>(40, 0.0f), 0);
    f.add_parameter("b", std::vector<float>(30, 0.0f), 1);
    f.finalize();
    EXPECT_EQ(f.checkpoint_client_state(), "");
    f.load_checkpoint(dir.str());
    EXPECT_EQ(f.checkpoint_client_state(), client) << "rank " << rank;
    EXPECT_EQ(f.lr(1), 0.123);
    EXPECT_EQ(f.weight_decay(1), kGroup1Decay);
    EXPECT_EQ(f.betas(0), std::make_pair(0.7, 0.8));
    EXPECT_EQ(f.betas(1), std::make_pair(0.5, kGroup1Beta2));
    EXPECT_EQ(f.eps(1), kGroup1Eps);
    EXPECT_EQ(f.lr(0), e.lr(0));
  }));
}

TEST(EngineGroupsMisuse, ClearErrors) {
  auto comms = make_inprocess_communicators(1, 10.0);
  Engine e(engine_config(EngineCase{}), *comms[0]);
  auto code = [](auto&& fn) -> std::optional<ErrorCode> {
    try {
      fn();
    } catch (const Error& err) {
      return err.code();
    }
    return std::nullopt;
  };
  std::vector<float> x(4, 1.0f);
  EXPECT_EQ(code([&] { e.add_parameter("x", x, 1); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code([&] { e.add_param_group({-1.0, 0.0}); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code([&] { e.add_param_group({1e-3, 0.0, 1.0}); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code([&] { e.set_betas(0.9, -0.1); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code([&] { e.set_eps(NAN); }), ErrorCode::kInvalidArgument);
  e.set_betas(0.8, 0.95);
  EXPECT_EQ(e.betas(), std::make_pair(0.8, 0.95));
  EXPECT_EQ(code([&] { e.set_lr(1e-3, 5); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code([&] { e.set_lr(-1.0); }), ErrorCode::kInvalidArgument);
  e.set_lr(0.5);
  EXPECT_EQ(e.lr(), 0.5);
}

}  // namespace
}  // namespace strata::testing
