// The planner and the engine agree: for several configs the engine is built (in-process ranks, the
// host-emulated device) and, after finalize(), the bytes its TierStore holds per tier and per kind
// of state (parameters, gradients, optimizer state) equal `strata plan`'s per-rank figures for the
// same config within padding (partition alignment, 4096-byte chunk padding, the 1024-element
// rounding of fractions); the pinned pool equals the plan's swap pool when the plan counts one;
// the engine's own runtime buffers are small; nothing exceeds a budget.
#include <gtest/gtest.h>

#include <random>

#include "../comm/comm_test_util.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "strata/plan.hpp"
#include "test_util.hpp"
#include "zero/engine_access.hpp"

namespace strata::testing {
namespace {

struct AgreeCase {
  const char* name;
  int stage, world;
  OffloadTarget opt, grads, params;
  DType pdt, gdt;
};

std::string agree_name(const ::testing::TestParamInfo<AgreeCase>& i) { return i.param.name; }

class PlanAgreement : public ::testing::TestWithParam<AgreeCase> {};

constexpr std::uint64_t kParams = 1'500'000;

TEST_P(PlanAgreement, TierStoreUsageEqualsThePlanWithinPadding) {
  const AgreeCase c = GetParam();
  TempDir dir("strata-agree");
  Config cfg;
  cfg.model.parameters = kParams;
  cfg.world.ranks = static_cast<std::uint32_t>(c.world);
  cfg.world.ranks_per_node = static_cast<std::uint32_t>(c.world);
  cfg.zero.stage = c.stage;
  cfg.zero.sub_group_size = 400'000;
  cfg.zero.reduce_bucket_size = 200'000;
  cfg.precision.params = c.pdt;
  cfg.precision.grads = c.gdt;
  cfg.offload.optimizer = c.opt;
  cfg.offload.gradients = c.grads;
  cfg.offload.params = c.params;
  cfg.tiers.gpu.budget = 64ULL << 20;
  cfg.tiers.host.budget = 256ULL << 20;
  cfg.tiers.host.pinned_budget = 64ULL << 20;
  cfg.tiers.host.buffer_count = 3;
  cfg.tiers.host.buffer_size = 1 << 20;
  cfg.tiers.nvme.paths = {dir.str()};
  cfg.tiers.nvme.engine = IoEngineKind::kThreads;
  cfg.tiers.nvme.direct_io = DirectIoMode::kOff;
  cfg.runtime.device = DeviceKind::kHost;
  cfg.runtime.cpu_threads = 1;
  const Plan plan = make_plan(cfg);
  const Layout& l = plan.configured;

  // Three tensors of uneven sizes adding up to model.parameters.
  const std::vector<std::size_t> sizes{kParams / 2 + 3, kParams / 3,
                                       kParams - (kParams / 2 + 3) - kParams / 3};
  auto comms = make_inprocess_communicators(c.world, 30.0);
  std::vector<zero::StorageReport> reps(static_cast<std::size_t>(c.world));
  std::vector<std::size_t> nchunks(static_cast<std::size_t>(c.world));
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Engine e(cfg, comm);
    for (std::size_t t = 0; t < sizes.size(); ++t)
      e.add_parameter(strata::strcat("t", t), std::vector<float>(sizes[t], 0.5f));
    e.finalize();
    reps[static_cast<std::size_t>(rank)] = zero::EngineAccess::report(e);
    nchunks[static_cast<std::size_t>(rank)] = zero::EngineAccess::chunks(e).size();
  }));

  const BytesPerParam b = bytes_per_param(cfg.precision);
  // The engine keeps an FP32 master copy whatever precision.params is (the plan omits it for fp32
  // parameters): compare the optimizer state at 12 B per element.
  ASSERT_NE(c.pdt, DType::kFp32) << "the plan counts no master for fp32 parameters";
  const StateBytes* plan_tier[3] = {&l.on_gpu, &l.on_host, &l.on_nvme};
  for (int r = 0; r < c.world; ++r) {
    SCOPED_TRACE(strata::strcat("rank ", r));
    const zero::StorageReport& rep = reps[static_cast<std::size_t>(r)];
    // Padding: the flat space's alignment (tensor and partition alignment, per rank), each chunk
    // buffer padded to 4096 B, and each placement's 1024-element rounding.
    const std::uint64_t align_elems =
        3 * Partition::kDefaultTensorAlign +
        static_cast<std::uint64_t>(c.world) * Partition::kDefaultPartitionAlign + 1024;
    const std::uint64_t chunk_pad = (nchunks[static_cast<std::size_t>(r)] + 1) * 4096;
    for (int t = 0; t < 3; ++t) {
      const char* tn = tier_name(static_cast<Tier>(t));
      const std::uint64_t want[3] = {plan_tier[t]->params, plan_tier[t]->grads,
                                     plan_tier[t]->optimizer};
      const std::uint64_t bpe[3] = {b.params, b.grads, b.optimizer()};
      for (int k = 0; k < 3; ++k) {
        const double got = static_cast<double>(rep.bytes[t][k]);
        const double slack = static_cast<double>(align_elems * bpe[k] + chunk_pad);
        EXPECT_NEAR(got, static_cast<double>(want[k]), slack) << tn << " tier, "
                                                              << (k == 0   ? "parameters"
                                                                  : k == 1 ? "gradients"
                                                                           : "optimizer state");
      }
    }
    // The pinned pool: the plan's swap pool when the plan counts one (state on NVMe), within the
    // padding of a chunk (chunks hold whole multiples of 1024 elements: a buffer is sized to the
    // largest chunk it stages).
    if (l.swap_pool) {
      const double per_buffer_pad =
          1024.0 * static_cast<double>(12 + b.params + b.grads) + 3 * 4096;
      EXPECT_LE(rep.pool, l.swap_pool);
      EXPECT_NEAR(static_cast<double>(rep.pool), static_cast<double>(l.swap_pool),
                  cfg.tiers.host.buffer_count * per_buffer_pad);
    }
    // Runtime buffers after finalize(): only the norm exchange.
    EXPECT_LE(rep.bytes[0][3], 4096u);
    // Usage = state + pool + runtime, and within every budget.
    std::uint64_t host_state = 0;
    for (int k = 0; k < 4; ++k) host_state += rep.bytes[1][k];
    EXPECT_EQ(rep.used[1], host_state + rep.pool);
    for (int t = 0; t < 3; ++t)
      EXPECT_LE(rep.used[t], rep.budget[t]) << tier_name(static_cast<Tier>(t));
  }
}

const OffloadTarget kGpu{Tier::kGpu, 1.0, false};
const OffloadTarget kCpuAll{Tier::kCpu, 1.0, false};
const OffloadTarget kNvmeAll{Tier::kNvme, 1.0, false};

INSTANTIATE_TEST_SUITE_P(
    Configs, PlanAgreement,
    ::testing::Values(AgreeCase{"stage0_world2_no_offload", 0, 2, kGpu, kGpu, kGpu, DType::kFp16,
                                DType::kFp16},
                      AgreeCase{"stage1_world3_optimizer_nvme", 1, 3, kNvmeAll, kGpu, kGpu,
                                DType::kBf16, DType::kFp32},
                      AgreeCase{"stage2_world4_optimizer_nvme_gradients_cpu", 2, 4, kNvmeAll,
                                kCpuAll, kGpu, DType::kFp16, DType::kFp16},
                      AgreeCase{"stage2_world2_optimizer_cpu_half",
                                2,
                                2,
                                {Tier::kCpu, 0.5, false},
                                kGpu,
                                kGpu,
                                DType::kBf16,
                                DType::kBf16},
                      AgreeCase{"stage3_world2_everything_nvme", 3, 2, kNvmeAll, kNvmeAll, kNvmeAll,
                                DType::kBf16, DType::kBf16},
                      AgreeCase{"stage3_world4_mixed",
                                3,
                                4,
                                {Tier::kNvme, 0.7, false},
                                kCpuAll,
                                {Tier::kNvme, 0.5, false},
                                DType::kFp16,
                                DType::kFp16}),
    agree_name);

}  // namespace
}  // namespace strata::testing
