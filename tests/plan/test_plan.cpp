// The planner's figures, checked against hand-computed values (docs/config.md "The plan").
#include <gtest/gtest.h>

#include "strata/config.hpp"
#include "strata/plan.hpp"

using namespace strata;

namespace {
Config config(std::uint64_t params, std::uint32_t ranks, int stage = 2) {
  Config c;
  c.model.parameters = params;
  c.world.ranks = ranks;
  c.zero.stage = stage;
  return c;
}
constexpr std::uint64_t kGB = 1'000'000'000ULL;
}  // namespace

TEST(Plan, ZeroPaperTableOn8Ranks) {
  Plan p = make_plan(config(7'500'000'000ULL, 8));
  EXPECT_EQ(p.bytes_per_param.total(), 16u);
  EXPECT_EQ(p.stages[0].bytes.total(), 120'000'000'000ULL);
  EXPECT_EQ(p.stages[1].bytes.total(), 41'250'000'000ULL);
  EXPECT_EQ(p.stages[2].bytes.total(), 28'125'000'000ULL);
  EXPECT_EQ(p.stages[3].bytes.total(), 15'000'000'000ULL);
}

TEST(Plan, ZeroPaperTableOn64Ranks) {
  Plan p = make_plan(config(7'500'000'000ULL, 64));
  EXPECT_EQ(p.stages[0].bytes.total(), 120'000'000'000ULL);
  EXPECT_EQ(p.stages[1].bytes.total(), 31'406'250'000ULL);
  EXPECT_EQ(p.stages[2].bytes.total(), 16'640'625'000ULL);
  EXPECT_EQ(p.stages[3].bytes.total(), 1'875'000'000ULL);
}

TEST(Plan, BytesPerParamFromDtypes) {
  auto bpp = [](DType p, DType g) {
    PrecisionConfig pc;
    pc.params = p;
    pc.grads = g;
    return bytes_per_param(pc);
  };
  EXPECT_EQ(bpp(DType::kFp16, DType::kFp16).total(), 16u);
  EXPECT_EQ(bpp(DType::kBf16, DType::kFp32).total(), 18u);
  EXPECT_EQ(bpp(DType::kBf16, DType::kBf16).total(), 16u);
  EXPECT_EQ(bpp(DType::kFp16, DType::kFp32).total(), 18u);
  // fp32 params are their own master copy: 4 + 4 + 8.
  BytesPerParam f = bpp(DType::kFp32, DType::kFp32);
  EXPECT_EQ(f.master, 0u);
  EXPECT_EQ(f.moments, 8u);
  EXPECT_EQ(f.total(), 16u);
  EXPECT_EQ(bpp(DType::kFp32, DType::kFp16).total(), 14u);
}

TEST(Plan, StagesWithBf16ParamsAndFp32Grads) {
  Config c = config(1'000'000'000ULL, 4);
  c.precision.params = DType::kBf16;
  c.precision.grads = DType::kFp32;
  Plan p = make_plan(c);
  EXPECT_EQ(p.stages[0].bytes.total(), 18 * kGB);
  EXPECT_EQ(p.stages[1].bytes.total(), 9 * kGB);   // 2 + 4 + 12/4
  EXPECT_EQ(p.stages[2].bytes.total(), 6 * kGB);   // 2 + 16/4
  EXPECT_EQ(p.stages[3].bytes.total(), 4'500'000'000ULL);  // 18/4
  // fp32 everything: 16 B/param, stage 1 = 4 + 4 + 8/4.
  c.precision.params = DType::kFp32;
  Plan q = make_plan(c);
  EXPECT_EQ(q.stages[0].bytes.total(), 16 * kGB);
  EXPECT_EQ(q.stages[1].bytes.total(), 10 * kGB);
  EXPECT_EQ(q.stages[3].bytes.total(), 4 * kGB);
}

TEST(Plan, UnevenShardsRoundUp) {
  Plan p = make_plan(config(1'000'000'007ULL, 8));
  EXPECT_EQ(p.stages[3].param_elements, 125'000'001ULL);
  EXPECT_EQ(p.stages[3].bytes.total(), 125'000'001ULL * 16);
  EXPECT_EQ(p.stages[1].bytes.params, 1'000'000'007ULL * 2);
}

TEST(Plan, PartialPinnedCpuOffloadAtStage2) {
  Config c = config(1'000'000'000ULL, 4, 2);
  c.offload.optimizer = {Tier::kCpu, 0.5, true};
  Layout l = make_plan(c).configured;
  EXPECT_EQ(l.on_host.optimizer, 1'500'000'000ULL);  // 125M elements x 12 B
  EXPECT_EQ(l.per_rank.pinned_host, 1'500'000'000ULL);
  EXPECT_EQ(l.per_rank.pageable_host, 0u);
  EXPECT_EQ(l.per_rank.gpu, 4 * kGB);  // 2 GB params + 0.5 GB grads + 1.5 GB optimizer
  EXPECT_EQ(l.per_rank.nvme, 0u);
  EXPECT_EQ(l.swap_pool, 0u);
  EXPECT_EQ(l.per_node.pinned_host, 6 * kGB);  // 4 ranks on the node
  EXPECT_EQ(l.traffic.device_to_host, 250'000'000ULL);  // grads of the cpu share
  EXPECT_EQ(l.traffic.host_to_device, 250'000'000ULL);  // updated params of the cpu share
  EXPECT_EQ(l.traffic.nvme_read, 0u);
  EXPECT_EQ(l.traffic.network, 4 * kGB);  // psi x 2 (reduce-scatter) + psi x 2 (all-gather)
  EXPECT_EQ(l.describe(), "stage 2, optimizer on cpu (50%)");
}

// Gradients on NVMe: written once during the backward, read twice by the step (norm, update).
TEST(Plan, NvmeGradientsAreReadTwice) {
  Config c = config(1'000'000'000ULL, 4, 2);
  c.offload.optimizer.tier = Tier::kNvme;
  c.offload.gradients.tier = Tier::kNvme;
  c.tiers.nvme.paths = {"/tmp/x"};
  Layout l = make_plan(c).configured;
  // 250M elements per rank: 3 GB of optimizer state, 0.5 GB of fp16 gradients.
  EXPECT_EQ(l.traffic.nvme_read, 3 * kGB + 2 * 500'000'000ULL);
  EXPECT_EQ(l.traffic.nvme_write, 3 * kGB + 500'000'000ULL);
}

TEST(Plan, NvmeOffloadAtStage3) {
  Config c = config(1'000'000'000ULL, 4, 3);
  c.offload.optimizer.tier = Tier::kNvme;
  c.offload.params.tier = Tier::kNvme;
  c.offload.gradients.tier = Tier::kCpu;
  c.tiers.nvme.paths = {"/tmp/x"};
  Layout l = make_plan(c).configured;
  EXPECT_EQ(l.per_rank.gpu, 0u);
  EXPECT_EQ(l.per_rank.nvme, 3'500'000'000ULL);           // 3 GB optimizer + 0.5 GB params
  EXPECT_EQ(l.per_rank.pageable_host, 500'000'000ULL);    // gradients
  EXPECT_EQ(l.swap_pool, 4ULL * (256ULL << 20));
  EXPECT_EQ(l.per_rank.pinned_host, l.swap_pool);
  EXPECT_EQ(l.traffic.nvme_read, 4 * kGB);                // optimizer + params twice
  EXPECT_EQ(l.traffic.nvme_write, 3'500'000'000ULL);      // optimizer + params once
  EXPECT_EQ(l.traffic.device_to_host, 500'000'000ULL);
  EXPECT_EQ(l.traffic.host_to_device, 1 * kGB);           // params fetched for fwd + bwd
  EXPECT_EQ(l.traffic.network, 6 * kGB);                  // 3 psi x 2 B
  EXPECT_TRUE(l.fits());
  // One rank: no network.
  c.world.ranks = 1;
  EXPECT_EQ(make_plan(c).configured.traffic.network, 0u);
}

TEST(Plan, VerdictNamesTheOverflowingTier) {
  Config c = config(7'500'000'000ULL, 8, 1);
  c.tiers.gpu.budget = 40 * kGB;
  Plan p = make_plan(c);
  EXPECT_FALSE(p.configured.fits());
  const TierVerdict& gpu = p.configured.verdicts[0];
  EXPECT_EQ(gpu.tier, "gpu");
  EXPECT_FALSE(gpu.fits());
  EXPECT_EQ(gpu.overflow(), 1'250'000'000ULL);
  for (std::size_t i = 1; i < p.configured.verdicts.size(); ++i)
    EXPECT_TRUE(p.configured.verdicts[i].fits());
  EXPECT_FALSE(p.configured.verdicts[3].limited);  // nvme: no budget by default
  // A per-node host budget: 16 ranks, 8 per node, everything on pageable host.
  Config h = config(7'500'000'000ULL, 16, 2);
  h.world.ranks_per_node = 8;
  h.offload.optimizer.tier = Tier::kCpu;
  h.tiers.host.budget = 40 * kGB;
  Layout l = make_plan(h).configured;
  EXPECT_EQ(l.per_node.pageable_host, 8 * (7'500'000'000ULL / 16) * 12);
  EXPECT_FALSE(l.verdicts[1].fits());
  EXPECT_EQ(l.verdicts[1].overflow(), 45 * kGB - 40 * kGB);
}

TEST(Plan, RecommendsLowestStageThenLeastOffload) {
  Config c = config(7'500'000'000ULL, 8, 0);
  auto rec = [&](std::uint64_t gpu_budget) {
    c.tiers.gpu.budget = gpu_budget;
    return recommend(c);
  };
  EXPECT_EQ(rec(80 * kGB).layout.describe(), "stage 1, no offload");  // 120 GB does not fit
  EXPECT_EQ(rec(120 * kGB).layout.describe(), "stage 0, no offload");
  EXPECT_EQ(rec(30 * kGB).layout.describe(), "stage 2, no offload");
  // Stage 2 with the optimizer on the host (16.9 GB) comes before stage 3 (lowest stage first).
  Recommendation r = rec(20 * kGB);
  EXPECT_EQ(r.layout.describe(), "stage 2, optimizer on cpu");
  EXPECT_NE(r.reason.find("[stage 2, no offload: gpu needs 28.12 GB model state per rank > budget "
                          "20 GB (over by 8.12 GB)]"),
            std::string::npos)
      << r.reason;
  EXPECT_NE(r.reason.find("[stage 0, no offload: gpu needs 120 GB"), std::string::npos) << r.reason;
  EXPECT_EQ(r.ladder.size(), ladder_rungs().size());
  EXPECT_FALSE(r.ladder[2].fits);
  EXPECT_TRUE(r.ladder[3].fits);
  EXPECT_EQ(rec(16 * kGB).layout.describe(), "stage 2, optimizer on cpu, gradients on cpu");  // 15 GB
  EXPECT_EQ(rec(10 * kGB).layout.describe(), "stage 3, optimizer on cpu");
  // No room on the host for 90 GB of optimizer state per node: nvme, which needs paths.
  c.tiers.host.budget = 50 * kGB;
  r = rec(10 * kGB);
  EXPECT_TRUE(r.found);
  EXPECT_EQ(r.layout.describe(), "stage 3, optimizer on nvme");
  EXPECT_NE(r.reason.find("needs tiers.nvme.paths"), std::string::npos) << r.reason;
  // Nothing fits a 1 GB gpu... except everything on nvme; nothing at all with 1 MB.
  c.tiers.host.budget = 512 * kGB;
  EXPECT_EQ(rec(1 * kGB).layout.describe(), "stage 3, optimizer on cpu, gradients on cpu, params on cpu");
  c.tiers.host.budget = 20 * kGB;  // 30 GB of params + grads per node no longer fit on the host
  EXPECT_EQ(rec(1 * kGB).layout.describe(),
            "stage 3, optimizer on nvme, gradients on nvme, params on nvme");
  c.tiers.nvme.budget = 100 * kGB;  // 120 GB per node on nvme
  r = rec(1 * kGB);
  EXPECT_FALSE(r.found);
  EXPECT_NE(r.reason.find("nothing fits"), std::string::npos);
}

// The ladder's order as documented: stages rise before offload is added within a stage, NVMe comes
// after every host rung, stage 1 with offload is not a rung.
TEST(Plan, LadderOrder) {
  std::vector<std::string> names;
  Config c = config(1'000'000ULL, 8, 2);
  for (const auto& [stage, o] : ladder_rungs()) names.push_back(plan_layout(c, stage, o).describe());
  const std::vector<std::string> want = {
      "stage 0, no offload", "stage 1, no offload", "stage 2, no offload",
      "stage 2, optimizer on cpu", "stage 2, optimizer on cpu, gradients on cpu",
      "stage 3, no offload", "stage 3, optimizer on cpu", "stage 3, optimizer on cpu, gradients on cpu",
      "stage 3, optimizer on cpu, gradients on cpu, params on cpu", "stage 2, optimizer on nvme",
      "stage 2, optimizer on nvme, gradients on cpu", "stage 3, optimizer on nvme",
      "stage 3, optimizer on nvme, gradients on cpu",
      "stage 3, optimizer on nvme, gradients on cpu, params on cpu",
      "stage 3, optimizer on nvme, gradients on nvme, params on nvme"};
  EXPECT_EQ(names, want);
}

// The case: 13B parameters on 8 x 80 GB, sequence 4096, micro-batch 4 (40 layers, hidden
// 5120, 40 heads). Stage 1 holds 71.5 GB of model state, + 22.98 GB of activations even with
// checkpointing: it does not fit. Stage 2 (48.75 GB + 22.98 GB = 71.73 GB) fits with
// checkpointing, and that is the recommendation (and the reason says why stage 1 fails).
TEST(Plan, RecommendationCountsActivations13B) {
  Config c = config(13'000'000'000ULL, 8, 1);
  c.model.layers = 40;
  c.model.hidden_size = 5120;
  c.model.heads = 40;
  c.model.sequence_length = 4096;
  c.model.micro_batch = 4;
  Plan p = make_plan(c);
  EXPECT_TRUE(p.configured.fits());         // model state alone: 71.5 GB
  EXPECT_FALSE(p.configured_fits());        // + activations
  EXPECT_EQ(p.configured_rung.activations, 22'984'785'920ULL);  // 40*2*s*b*h + one layer
  EXPECT_TRUE(p.configured_rung.checkpointing);
  const Recommendation& r = p.recommendation;
  ASSERT_TRUE(r.found);
  EXPECT_EQ(r.layout.describe(), "stage 2, no offload");
  EXPECT_TRUE(r.checkpointing);
  EXPECT_NE(r.reason.find("with activation checkpointing"), std::string::npos) << r.reason;
  EXPECT_NE(r.reason.find("[stage 1, no offload: gpu needs 71.5 GB model state + 22.98 GB "
                          "activations (with checkpointing) = 94.48 GB per rank > budget 80 GB"),
            std::string::npos)
      << r.reason;
  EXPECT_EQ(r.ladder[2].gpu_total, 48'750'000'000ULL + 22'984'785'920ULL);
  // Without the shape, activations are not counted and stage 1 is recommended (and says so).
  c.model.layers = 0;
  Recommendation q = recommend(c);
  EXPECT_EQ(q.layout.describe(), "stage 1, no offload");
  EXPECT_NE(q.reason.find("activations not counted"), std::string::npos) << q.reason;
}

// Stage 3's gathered largest layer counts on the gpu of every stage-3 rung.
TEST(Plan, Stage3CountsTheGatheredLargestLayer) {
  Config c = config(8'000'000'000ULL, 8, 3);
  c.tiers.gpu.budget = 16 * kGB + 1;  // 16 GB of model state at stage 3
  EXPECT_TRUE(make_plan(c).configured_fits());
  c.model.largest_layer = 500'000'000;  // + 1 GB of fp16 parameters
  Plan p = make_plan(c);
  EXPECT_EQ(p.configured_rung.gathered, 1'000'000'000ULL);
  EXPECT_FALSE(p.configured_fits());
  EXPECT_NE(p.configured_rung.verdict.find("+ 1 GB gathered largest layer"), std::string::npos)
      << p.configured_rung.verdict;
  // Stage 3 without offload no longer fits; stage 2 with optimizer and gradients on the host
  // (16 GB, no gather) comes first on the ladder anyway.
  EXPECT_FALSE(p.recommendation.ladder[5].fits);
  EXPECT_NE(p.recommendation.ladder[5].verdict.find("gathered largest layer"), std::string::npos);
  EXPECT_EQ(p.recommendation.layout.describe(), "stage 2, optimizer on cpu, gradients on cpu");
}

TEST(Plan, ActivationEstimate) {
  Config c = config(7'500'000'000ULL, 8, 3);
  c.model.layers = 32;
  c.model.hidden_size = 4096;
  c.model.heads = 32;
  c.model.sequence_length = 2048;
  c.model.micro_batch = 1;
  c.tiers.gpu.budget = 40 * kGB;
  Plan p = make_plan(c);
  ASSERT_TRUE(p.activations.available);
  // s*b*h*(34 + 5*a*s/h) = 2048*4096*(34 + 5*32*2048/4096) = 8388608 * 114
  EXPECT_EQ(p.activations.per_layer, 956'301'312ULL);
  EXPECT_EQ(p.activations.without_checkpointing, 32ULL * 956'301'312ULL);
  EXPECT_EQ(p.activations.with_checkpointing, 32ULL * 2 * 2048 * 4096 + 956'301'312ULL);
  EXPECT_TRUE(p.configured.fits());  // 15 GB of model state
  EXPECT_FALSE(p.activations.fits_without_checkpointing);  // + 30.6 GB > 40 GB
  EXPECT_TRUE(p.activations.fits_with_checkpointing);
  ASSERT_FALSE(p.notes.empty());
  EXPECT_NE(p.notes[0].find("activations, not model state"), std::string::npos) << p.notes[0];
  EXPECT_NE(p.notes[0].find("checkpointing (1.49 GB) makes it fit"), std::string::npos) << p.notes[0];

  c.model.micro_batch = 8;
  c.tiers.gpu.budget = 20 * kGB;
  Plan q = make_plan(c);
  EXPECT_EQ(q.activations.with_checkpointing, 32ULL * 2 * 2048 * 4096 * 8 + 8 * 956'301'312ULL);
  EXPECT_FALSE(q.activations.fits_with_checkpointing);
  ASSERT_FALSE(q.notes.empty());
  EXPECT_NE(q.notes[0].find("even with activation checkpointing"), std::string::npos);

  c.model.layers = 0;  // no shape, no estimate
  EXPECT_FALSE(make_plan(c).activations.available);
}

TEST(Plan, AssumptionsSayModelStateOnly) {
  Plan p = make_plan(config(1'000'000ULL, 1));
  std::string all;
  for (const auto& a : p.assumptions) all += a + "\n";
  for (const char* s : {"model state only", "activations", "gathered", "allocator", "runtime buffers"})
    EXPECT_NE(all.find(s), std::string::npos) << s;
}
