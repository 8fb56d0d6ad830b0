// The planner's figures, checked against hand-computed values (docs/config.md "The plan"). What the
// engine really holds for the same configs is checked in tests/zero/test_plan_agreement.cpp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

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
// 1B parameters on 4 ranks at stage 3, the optimizer state and the parameters on NVMe, the
// gradients in host memory.
Config nvme_stage3_config() {
  Config c = config(1'000'000'000ULL, 4, 3);
  c.offload.optimizer.tier = Tier::kNvme;
  c.offload.params.tier = Tier::kNvme;
  c.offload.gradients.tier = Tier::kCpu;
  c.tiers.nvme.paths = {"/tmp/x"};
  return c;
}
// A transformer's shape, for the activation estimate.
void set_shape(Config& c, std::uint32_t layers, std::uint32_t hidden, std::uint32_t heads,
               std::uint32_t sequence, std::uint32_t micro_batch) {
  c.model.layers = layers;
  c.model.hidden_size = hidden;
  c.model.heads = heads;
  c.model.sequence_length = sequence;
  c.model.micro_batch = micro_batch;
}
constexpr std::uint64_t kGB = 1'000'000'000ULL;
constexpr std::uint64_t kMiB = 1ULL << 20;
constexpr std::uint64_t kStaging = (1ULL << 24) * 4;  // finalize()'s broadcast piece, 64 MiB
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
  // fp32 params keep an FP32 master beside them, as the engine does (and DeepSpeed's estimator
  // counts): 4 + 4 + 12 = 20.
  BytesPerParam f = bpp(DType::kFp32, DType::kFp32);
  EXPECT_EQ(f.master, 4u);
  EXPECT_EQ(f.moments, 8u);
  EXPECT_EQ(f.optimizer(), 12u);
  EXPECT_EQ(f.total(), 20u);
  EXPECT_EQ(bpp(DType::kFp32, DType::kFp16).total(), 18u);
}

TEST(Plan, StagesWithBf16ParamsAndFp32Grads) {
  Config c = config(1'000'000'000ULL, 4);
  c.precision.params = DType::kBf16;
  c.precision.grads = DType::kFp32;
  Plan p = make_plan(c);
  EXPECT_EQ(p.stages[0].bytes.total(), 18 * kGB);
  EXPECT_EQ(p.stages[1].bytes.total(), 9 * kGB);           // 2 + 4 + 12/4
  EXPECT_EQ(p.stages[2].bytes.total(), 6 * kGB);           // 2 + 16/4
  EXPECT_EQ(p.stages[3].bytes.total(), 4'500'000'000ULL);  // 18/4
  // fp32 everything: 20 B/param, stage 1 = 4 + 4 + 12/4.
  c.precision.params = DType::kFp32;
  Plan q = make_plan(c);
  EXPECT_EQ(q.stages[0].bytes.total(), 20 * kGB);
  EXPECT_EQ(q.stages[1].bytes.total(), 11 * kGB);
  EXPECT_EQ(q.stages[3].bytes.total(), 5 * kGB);
}

// precision.grad_accum fp32 with fp16 gradients: the held gradients take 4 B per element in
// every stage and tier; the buckets, receive buffers and stage 2-3 traffic stay 2 B; stage 0's
// all-reduce runs over the FP32 flat gradients.
TEST(Plan, GradAccumFp32HoldsGradientsInFp32) {
  Config c = config(1'000'000'000ULL, 4, 2);
  c.precision.grad_accum = DType::kFp32;
  c.offload.gradients = {Tier::kCpu, 1.0, false};
  EXPECT_EQ(bytes_per_param(c.precision).grads, 4u);
  EXPECT_EQ(bytes_per_param(c.precision).total(), 18u);
  Plan p = make_plan(c);
  EXPECT_EQ(p.stages[0].bytes.grads, 4 * kGB);
  EXPECT_EQ(p.stages[2].bytes.grads, kGB);  // 250M elements x 4 B
  Layout l = p.configured;
  EXPECT_EQ(l.on_host.grads, kGB);
  EXPECT_EQ(l.runtime.buckets, 2 * kGB);  // 2 buckets of 500M fp16 elements
  EXPECT_EQ(l.runtime.receive, 2 * 250'000'000ULL * 2);
  EXPECT_EQ(l.traffic.network, 4 * kGB);  // fp16 reduce-scatter + fp16 all-gather
  EXPECT_EQ(l.traffic.device_to_host, 250'000'000ULL * 2);
  c.zero.stage = 0;
  c.offload.gradients = {};
  EXPECT_EQ(make_plan(c).configured.traffic.network, 2 * 4 * kGB);  // FP32 all-reduce
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
  // The optimizer share is staged through the pinned pool: 4 x 256 MiB beside it.
  ASSERT_TRUE(l.pool.used);
  EXPECT_EQ(l.pool.bytes(), 4 * 256 * kMiB);
  EXPECT_EQ(l.per_rank.pinned_host, 1'500'000'000ULL + 4 * 256 * kMiB);
  EXPECT_EQ(l.per_rank.pageable_host, 0u);
  EXPECT_EQ(l.on_gpu.total(), 4 * kGB);  // 2 GB params + 0.5 GB grads + 1.5 GB optimizer
  // Runtime buffers: 2 buckets of 500M fp16 gradients (1B flat elements), 2 receive buffers of
  // the 250M-element partition, the norm exchange, the broadcast piece.
  EXPECT_EQ(l.runtime.bucket_count, 2u);
  EXPECT_EQ(l.runtime.buckets, 2 * kGB);
  EXPECT_EQ(l.runtime.receive, 2 * 250'000'000ULL * 2);
  EXPECT_EQ(l.runtime.norm, 16u * 5);
  EXPECT_EQ(l.runtime.staging, kStaging);
  EXPECT_EQ(l.per_rank.gpu, 4 * kGB + 3 * kGB + 80 + kStaging);
  EXPECT_EQ(l.per_rank.nvme, 0u);
  EXPECT_EQ(l.per_node.pinned_host, 4 * (1'500'000'000ULL + 4 * 256 * kMiB));  // 4 ranks
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
  Config c = nvme_stage3_config();
  Layout l = make_plan(c).configured;
  EXPECT_EQ(l.on_gpu.total(), 0u);
  EXPECT_EQ(l.per_rank.gpu, l.runtime.total());  // no layer size given: no gathers counted
  EXPECT_EQ(l.runtime.gathered, 0u);
  EXPECT_EQ(l.per_rank.nvme, 3'500'000'000ULL);         // 3 GB optimizer + 0.5 GB params
  EXPECT_EQ(l.per_rank.pageable_host, 500'000'000ULL);  // gradients
  EXPECT_EQ(l.pool.bytes(), 4ULL * (256ULL << 20));
  EXPECT_EQ(l.per_rank.pinned_host, l.pool.bytes());
  EXPECT_EQ(l.traffic.nvme_read, 4 * kGB);            // optimizer + params twice
  EXPECT_EQ(l.traffic.nvme_write, 3'500'000'000ULL);  // optimizer + params once
  EXPECT_EQ(l.traffic.device_to_host, 500'000'000ULL);
  EXPECT_EQ(l.traffic.host_to_device, 1 * kGB);  // params fetched for fwd + bwd
  EXPECT_EQ(l.traffic.network, 6 * kGB);         // 3 psi x 2 B
  EXPECT_TRUE(l.fits());
  // One rank: no network.
  c.world.ranks = 1;
  EXPECT_EQ(make_plan(c).configured.traffic.network, 0u);
}

// tiers.nvme.snapshot_room: swap for asynchronous checkpoints' pinned versions, a fraction of the
// optimizer state on nvme, counted in the nvme row and cut to what the budget leaves.
TEST(Plan, SnapshotRoomCountsInTheNvmeRow) {
  Config c = nvme_stage3_config();
  EXPECT_EQ(make_plan(c).configured.snapshot_room, 0u);  // default: none
  c.tiers.nvme.snapshot_room = 0.5;
  Layout l = make_plan(c).configured;
  EXPECT_EQ(l.snapshot_room, 1'500'000'256ULL);  // half of 3 GB, 4 KiB-aligned
  EXPECT_EQ(l.per_rank.nvme, 3'500'000'000ULL + l.snapshot_room);
  c.world.ranks_per_node = 1;
  c.tiers.nvme.budget = 4 * kGB;  // the state takes 3.5 GB: 0.5 GB left for the room
  l = make_plan(c).configured;
  EXPECT_EQ(l.snapshot_room, 500'000'000ULL);
  EXPECT_TRUE(l.fits());
}

// optimizer.overlap: the speculative update's pending versions, in the tiers of the state they
// shadow (host copies page-locked as the state is), the flat parameters' at stages 1-2 on the gpu;
// none where the engine does not speculate (off, stage < 2, gradients on nvme); each tier cut to
// the budget.
TEST(Plan, SpeculationCountsThePendingVersions) {
  Config c = config(1'000'000'000ULL, 4, 2);
  c.offload.optimizer = {Tier::kNvme, 1.0, true};
  c.offload.gradients.tier = Tier::kCpu;
  c.tiers.nvme.paths = {"/tmp/x"};
  const Layout off = make_plan(c).configured;
  EXPECT_EQ(off.speculation.total(), 0u);
  c.optimizer.overlap = OptimizerOverlap::kAuto;
  Layout l = make_plan(c).configured;
  EXPECT_EQ(l.speculation.nvme, off.on_nvme.optimizer);
  EXPECT_EQ(l.speculation.gpu, off.footprint.param_elements * 2);  // fp16 flat parameters
  EXPECT_EQ(l.per_rank.nvme, off.per_rank.nvme + l.speculation.nvme);
  EXPECT_EQ(l.per_rank.gpu, off.per_rank.gpu + l.speculation.gpu);
  c.optimizer.speculation_budget = 1'000'000;
  l = make_plan(c).configured;
  EXPECT_EQ(l.speculation.nvme, 1'000'000u);
  EXPECT_EQ(l.speculation.gpu, 1'000'000u);
  c.optimizer.speculation_budget = 0;
  c.offload.optimizer.tier = Tier::kCpu;  // pinned state, pinned pending copies
  l = make_plan(c).configured;
  EXPECT_EQ(l.speculation.pinned_host, l.on_host.optimizer);
  EXPECT_EQ(l.speculation.pageable_host, 0u);
  c.offload.optimizer.pin_memory = false;  // pageable state, pageable pending copies
  l = make_plan(c).configured;
  EXPECT_EQ(l.speculation.pageable_host, l.on_host.optimizer);
  EXPECT_EQ(l.speculation.pinned_host, 0u);
  c.offload.optimizer.pin_memory = true;
  c.offload.gradients.tier = Tier::kNvme;  // not speculated
  EXPECT_EQ(make_plan(c).configured.speculation.total(), 0u);
  c.offload.gradients.tier = Tier::kCpu;
  c.zero.stage = 1;
  EXPECT_EQ(make_plan(c).configured.speculation.total(), 0u);
}

TEST(Plan, VerdictNamesTheOverflowingTier) {
  Config c = config(7'500'000'000ULL, 8, 1);
  c.tiers.gpu.budget = 40 * kGB;
  Plan p = make_plan(c);
  EXPECT_FALSE(p.configured.fits());
  const TierVerdict& gpu = p.configured.verdicts[0];
  EXPECT_EQ(gpu.tier, "gpu");
  EXPECT_FALSE(gpu.fits());
  EXPECT_EQ(gpu.overflow(), 1'250'000'000ULL + 16 * 9 + kStaging);  // + norm + staging
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
  EXPECT_EQ(l.per_node.pinned_host, 8 * 4 * 256 * kMiB);  // the pool of each rank
  EXPECT_FALSE(l.verdicts[1].fits());
  EXPECT_EQ(l.verdicts[1].overflow(), 45 * kGB + 8 * 4 * 256 * kMiB - 40 * kGB);
}

TEST(Plan, RecommendsLowestStageThenLeastOffload) {
  Config c = config(7'500'000'000ULL, 8, 0);
  // 50M-element buckets: 3 x 100 MB + 3 x 100 MB receive buffers at stages 2-3, + 144 B norm +
  // 67.11 MB staging on every rung (stages 0-1: norm + staging).
  c.zero.reduce_bucket_size = 50'000'000;
  const std::uint64_t rt01 = 144 + kStaging, rt23 = 600'000'000ULL + rt01;
  auto rec = [&](std::uint64_t gpu_budget) {
    c.tiers.gpu.budget = gpu_budget;
    return recommend(c);
  };
  EXPECT_EQ(rec(80 * kGB).layout.describe(), "stage 1, no offload");   // 120 GB does not fit
  EXPECT_EQ(rec(120 * kGB).layout.describe(), "stage 1, no offload");  // + runtime buffers
  EXPECT_EQ(rec(120 * kGB + rt01).layout.describe(), "stage 0, no offload");
  EXPECT_EQ(rec(30 * kGB).layout.describe(), "stage 2, no offload");  // 28.125 GB + 667 MB
  EXPECT_EQ(rec(28'125'000'000ULL + rt23 - 1).layout.describe(), "stage 2, optimizer on cpu");
  // Stage 2 with the optimizer on the host (16.9 GB) comes before stage 3 (lowest stage first).
  Recommendation r = rec(20 * kGB);
  EXPECT_EQ(r.layout.describe(), "stage 2, optimizer on cpu");
  EXPECT_NE(r.reason.find("[stage 2, no offload: gpu needs 28.12 GB model state + 667.11 MB "
                          "runtime buffers = 28.79 GB per rank > budget 20 GB (over by 8.79 GB)]"),
            std::string::npos)
      << r.reason;
  EXPECT_NE(r.reason.find("[stage 0, no offload: gpu needs 120 GB"), std::string::npos) << r.reason;
  EXPECT_EQ(r.ladder.size(), ladder_rungs().size());
  EXPECT_FALSE(r.ladder[2].fits);
  EXPECT_TRUE(r.ladder[3].fits);
  EXPECT_EQ(r.ladder[3].gpu_total, 16'875'000'000ULL + rt23);
  EXPECT_EQ(rec(16 * kGB).layout.describe(),
            "stage 2, optimizer on cpu, gradients on cpu");  // 15.77 GB
  EXPECT_EQ(rec(10 * kGB).layout.describe(), "stage 3, optimizer on cpu");
  // No room on the host for 90 GB of optimizer state per node: nvme, which needs paths.
  c.tiers.host.budget = 50 * kGB;
  r = rec(10 * kGB);
  EXPECT_TRUE(r.found);
  EXPECT_EQ(r.layout.describe(), "stage 3, optimizer on nvme");
  EXPECT_NE(r.reason.find("needs tiers.nvme.paths"), std::string::npos) << r.reason;
  // A 1 GB gpu holds only the runtime buffers: everything off it; nothing at all with 667 MB.
  c.tiers.host.budget = 512 * kGB;
  EXPECT_EQ(rec(1 * kGB).layout.describe(),
            "stage 3, optimizer on cpu, gradients on cpu, params on cpu");
  r = rec(rt23 - 1);
  EXPECT_FALSE(r.found);
  // The advice names the knob that shrinks what overflows: the buckets and receive buffers.
  EXPECT_NE(r.reason.find("shrink zero.reduce_bucket_size (gradient buckets and receive buffers: "
                          "600 MB per rank)"),
            std::string::npos)
      << r.reason;
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
  for (const auto& [stage, o] : ladder_rungs())
    names.push_back(plan_layout(c, stage, o).describe());
  const std::vector<std::string> want = {
      "stage 0, no offload",
      "stage 1, no offload",
      "stage 2, no offload",
      "stage 2, optimizer on cpu",
      "stage 2, optimizer on cpu, gradients on cpu",
      "stage 3, no offload",
      "stage 3, optimizer on cpu",
      "stage 3, optimizer on cpu, gradients on cpu",
      "stage 3, optimizer on cpu, gradients on cpu, params on cpu",
      "stage 2, optimizer on nvme",
      "stage 2, optimizer on nvme, gradients on cpu",
      "stage 3, optimizer on nvme",
      "stage 3, optimizer on nvme, gradients on cpu",
      "stage 3, optimizer on nvme, gradients on cpu, params on cpu",
      "stage 3, optimizer on nvme, gradients on nvme, params on nvme"};
  EXPECT_EQ(names, want);
}

// The case: 13B parameters on 8 x 80 GB, sequence 4096, micro-batch 4 (40 layers, hidden
// 5120, 40 heads). Stage 1 holds 71.5 GB of model state (+ 67.11 MB of runtime buffers), + 22.98
// GB of activations even with checkpointing: it does not fit. Stage 2 holds 48.75 GB of model
// state + 8.07 GB of runtime buffers (5 + 3 GB of gradient buckets and receive buffers) + 22.98
// GB of activations = 79.8 GB: it fits with checkpointing, barely, and that is the recommendation
// (and the reason says why stage 1 fails). Larger buckets make stage 2 not fit.
TEST(Plan, RecommendationCountsActivations13B) {
  Config c = config(13'000'000'000ULL, 8, 1);
  set_shape(c, 40, 5120, 40, 4096, 4);
  Plan p = make_plan(c);
  EXPECT_TRUE(p.configured.fits());   // model state + runtime buffers alone: 71.57 GB
  EXPECT_FALSE(p.configured_fits());  // + activations
  EXPECT_EQ(p.configured_rung.activations, 22'984'785'920ULL);  // 40*2*s*b*h + one layer
  EXPECT_TRUE(p.configured_rung.checkpointing);
  const Recommendation& r = p.recommendation;
  ASSERT_TRUE(r.found);
  EXPECT_EQ(r.layout.describe(), "stage 2, no offload");
  EXPECT_TRUE(r.checkpointing);
  EXPECT_NE(r.reason.find("with activation checkpointing"), std::string::npos) << r.reason;
  EXPECT_NE(r.reason.find("[stage 1, no offload: gpu needs 71.5 GB model state + 67.11 MB runtime "
                          "buffers + 22.98 GB activations (with checkpointing) = 94.55 GB per rank "
                          "> budget 80 GB"),
            std::string::npos)
      << r.reason;
  const RuntimeBuffers& rt = r.ladder[2].layout.runtime;
  EXPECT_EQ(rt.bucket_count, 3u);  // 26 buckets: 2 in flight + 1 being filled
  EXPECT_EQ(rt.buckets, 3 * kGB);  // 500M fp16 gradients each
  EXPECT_EQ(rt.receive, 3 * kGB);  // 2 reduce-scatters in flight + 1 share copied out
  EXPECT_EQ(rt.total(), 6 * kGB + 144 + kStaging);
  EXPECT_EQ(r.ladder[2].gpu_total,
            48'750'000'000ULL + 6 * kGB + 144 + kStaging + 22'984'785'920ULL);
  // Largest layer below the bucket: the same 3 buckets.
  Config d = c;
  d.model.largest_layer = 315'000'000;
  EXPECT_EQ(make_plan(d).recommendation.ladder[2].layout.runtime.bucket_count, 3u);
  // 800M-element buckets: 4.8 + 4.8 GB of buckets and receive buffers push stage 2 over; stage 2
  // with the optimizer on the host is next.
  d = c;
  d.zero.reduce_bucket_size = 800'000'000;
  Recommendation big = recommend(d);
  EXPECT_FALSE(big.ladder[2].fits);
  EXPECT_NE(big.ladder[2].verdict.find("9.67 GB runtime buffers"), std::string::npos)
      << big.ladder[2].verdict;
  EXPECT_EQ(big.layout.describe(), "stage 2, optimizer on cpu");
  // Without the shape, activations are not counted and stage 1 is recommended (and says so).
  c.model.layers = 0;
  Recommendation q = recommend(c);
  EXPECT_EQ(q.layout.describe(), "stage 1, no offload");
  EXPECT_NE(q.reason.find("activations not counted"), std::string::npos) << q.reason;
}

// Stage 3's gathered layers count on the gpu of every stage-3 rung: the layer of the current
// gather() call and the prefetched next one, with the rank's send slices of both.
TEST(Plan, Stage3CountsTheGatheredLayers) {
  Config c = config(8'000'000'000ULL, 8, 3);
  const std::uint64_t state = 16 * kGB;  // 16 B x 1B elements per rank
  const RuntimeBuffers none = runtime_buffers(c, 3, c.offload);
  EXPECT_EQ(none.gathered, 0u);  // no layer size: not counted (and a note says so)
  c.tiers.gpu.budget = state + none.total();
  Plan fits = make_plan(c);
  EXPECT_TRUE(fits.configured_fits());
  bool noted = false;
  for (const auto& n : fits.notes)
    noted |= n.find("gathered layers are not counted") != std::string::npos;
  EXPECT_TRUE(noted);
  c.model.largest_layer = 500'000'000;
  const RuntimeBuffers rt = runtime_buffers(c, 3, c.offload);
  EXPECT_EQ(rt.layer, 500'000'000u);
  EXPECT_EQ(rt.gathered, 2 * 500'000'000ULL * 2);  // 2 fp16 layers
  EXPECT_EQ(rt.send, 2 * 500'000'000ULL * 2);      // a layer may lie wholly in one partition
  EXPECT_EQ(rt.bucket_count, 3u);                  // 2 in flight + 1 being filled
  Plan p = make_plan(c);
  EXPECT_FALSE(p.configured_fits());
  EXPECT_NE(p.configured_rung.verdict.find("runtime buffers"), std::string::npos)
      << p.configured_rung.verdict;
  // Stage 3 without offload no longer fits; stage 2 with optimizer and gradients on the host
  // (16 GB of parameters + the same buckets, no gathers) comes first on the ladder anyway.
  EXPECT_FALSE(p.recommendation.ladder[5].fits);
  EXPECT_EQ(p.recommendation.ladder[5].layout.per_rank.gpu, state + rt.total());
  EXPECT_EQ(p.recommendation.layout.describe(), "stage 2, optimizer on cpu, gradients on cpu");
  // From the shape when model.largest_layer is not given: one transformer block, 12h^2 + 13h.
  c.model.largest_layer = 0;
  c.model.hidden_size = 4096;
  const RuntimeBuffers est = runtime_buffers(c, 3, c.offload);
  EXPECT_TRUE(est.layer_estimated);
  EXPECT_EQ(est.layer, 12ULL * 4096 * 4096 + 13 * 4096);
  EXPECT_EQ(est.gathered, 2 * est.layer * 2);
}

// The runtime buffers by the engine's formulas (docs/config.md "Runtime buffers").
// Stages 2-3 on a GPU, gradients off it, accumulating or converting: the gradient filler's staging
// buffer, min(B, P, 64 MiB / hand-in bytes) hand-in elements of page-locked host memory, in the
// pool's pinned figure (hand-computed; P = 333376 for 1000003 parameters on 3 ranks).
TEST(Plan, ShareStagingFormula) {
  Config c = config(1'000'003ULL, 3, 2);
  c.runtime.device = DeviceKind::kCuda;
  c.offload.gradients.tier = Tier::kCpu;
  c.precision.grads = DType::kFp32;
  c.zero.reduce_bucket_size = 100'000;
  EXPECT_EQ(plan_pool(c, 2, c.offload).share_staging, 0u);  // accumulate 1, grad_accum = grads
  c.train.accumulate = 2;
  const PoolPlan p = plan_pool(c, 2, c.offload);
  EXPECT_EQ(p.share_staging, 100'000ULL * 4);  // B bounds it
  EXPECT_EQ(p.bytes(), std::uint64_t{p.buffers} * p.buffer_size + p.share_staging);
  c.zero.reduce_bucket_size = 500'000'000;  // P bounds it
  EXPECT_EQ(plan_pool(c, 3, c.offload).share_staging, 333'376ULL * 4);
  EXPECT_EQ(plan_pool(c, 1, c.offload).share_staging, 0u);  // stages 0-1: no shares
  c.model.parameters = 300'000'000;                         // 64 MiB bounds it
  c.train.accumulate = 1;
  c.precision.grads = DType::kBf16;  // converted into FP32
  c.precision.grad_accum = DType::kFp32;
  EXPECT_EQ(plan_pool(c, 2, c.offload).share_staging, 64ULL << 20);
  c.runtime.device = DeviceKind::kHost;  // pageable there: not in the pinned figure
  EXPECT_EQ(plan_pool(c, 2, c.offload).share_staging, 0u);
  c.runtime.device = DeviceKind::kCuda;
  c.offload.gradients.tier = Tier::kGpu;  // converted on the device
  EXPECT_EQ(plan_pool(c, 2, c.offload).share_staging, 0u);
}

TEST(Plan, RuntimeBuffersFormulas) {
  Config c = config(1'000'003ULL, 3, 2);
  c.zero.reduce_bucket_size = 100'000;
  c.precision.grads = DType::kFp32;
  // P = ceil(1000003 / 3) = 333335 rounded up to 64 = 333376; F = 1000128; 11 buckets.
  RuntimeBuffers r = runtime_buffers(c, 2, c.offload);
  EXPECT_EQ(r.bucket_count, 3u);
  EXPECT_EQ(r.buckets, 3 * 100'000ULL * 4);
  EXPECT_EQ(r.receive_count, 3u);
  EXPECT_EQ(r.receive, 3 * 100'000ULL * 4);
  EXPECT_EQ(r.norm, 16u * 4);
  EXPECT_EQ(r.staging, 1'000'128ULL * 4);  // the whole flat space fits one broadcast piece
  EXPECT_EQ(r.step(), r.buckets + r.receive + r.norm);
  EXPECT_EQ(r.total(), r.step() + r.staging);
  // Every tensor below the bucket (model.largest_layer < B): the same 3.
  c.model.largest_layer = 99'999;
  EXPECT_EQ(runtime_buffers(c, 2, c.offload).bucket_count, 3u);
  // One bucket larger than the model: one buffer of the flat gradients' size (F = 1000128), not of
  // B elements, and a receive buffer of the partition.
  c.zero.reduce_bucket_size = 500'000'000;
  r = runtime_buffers(c, 3, c.offload);
  EXPECT_EQ(r.bucket_count, 1u);
  EXPECT_EQ(r.buckets, 1'000'128ULL * 4);
  EXPECT_EQ(r.receive_count, 1u);
  EXPECT_EQ(r.receive, 333'376ULL * 4);
  EXPECT_EQ(r.gathered, 2 * 99'999ULL * 2);
  EXPECT_EQ(r.send, 2 * 99'999ULL * 2);
  // Stages 0-1 reduce in place: only the norm exchange and the staging. One rank: no staging.
  r = runtime_buffers(c, 1, c.offload);
  EXPECT_EQ(r.total(), 64 + 1'000'128ULL * 4);
  c.world.ranks = 1;
  EXPECT_EQ(runtime_buffers(c, 0, c.offload).total(), 32u);
  // Stages 0-1 on a GPU, accumulating or converting: one hand-in staging buffer of
  // min(F, B, 64 MiB / grad bytes) hand-in elements (F = 1000128 here; B = 500M).
  EXPECT_EQ(r.hand_in_staging, 0u);  // accumulate 1, grad_accum = grads: copied in place
  c.world.ranks = 3;
  c.train.accumulate = 2;
  EXPECT_EQ(runtime_buffers(c, 1, c.offload).hand_in_staging, 1'000'128ULL * 4);
  EXPECT_EQ(runtime_buffers(c, 1, c.offload).step(), 64 + 1'000'128ULL * 4);
  c.zero.reduce_bucket_size = 100'000;  // B bounds it
  EXPECT_EQ(runtime_buffers(c, 0, c.offload).hand_in_staging, 100'000ULL * 4);
  EXPECT_EQ(runtime_buffers(c, 2, c.offload).hand_in_staging, 0u);  // stages 2-3: buckets
  c.runtime.device = DeviceKind::kHost;                             // added in place, no staging
  EXPECT_EQ(runtime_buffers(c, 1, c.offload).hand_in_staging, 0u);
  c.runtime.device = DeviceKind::kCuda;
  c.train.accumulate = 1;
  c.precision.grads = DType::kBf16;  // converted into FP32: 64 MiB / 2 bytes bounds it
  c.precision.grad_accum = DType::kFp32;
  c.zero.reduce_bucket_size = 500'000'000;
  c.model.parameters = 100'000'000;
  EXPECT_EQ(runtime_buffers(c, 1, c.offload).hand_in_staging, (64ULL << 20) / 2 * 2);
  c = config(1'000'003ULL, 3, 2);
  c.world.ranks = 1;
  c.zero.reduce_bucket_size = 500'000'000;
  c.precision.grads = DType::kFp32;
  c.model.largest_layer = 99'999;
  // optimizer.update device with the optimizer on the host: the device copy of the largest host
  // chunk (the whole 333376-element partition, one sub-group, with a 256 MiB buffer).
  c.world.ranks = 3;
  c.optimizer.update = OptimizerUpdate::kDevice;
  c.offload.optimizer = {Tier::kCpu, 1.0, false};
  r = runtime_buffers(c, 2, c.offload);
  EXPECT_EQ(r.adam_scratch, 3 * (333'376ULL * 4) + 333'376ULL * 4 + 666'880);  // 666752 -> 256 B
  EXPECT_EQ(runtime_buffers(c, 2, OffloadConfig{}).adam_scratch, 0u);  // nothing on the host
  EXPECT_EQ(r.update_slots, 0u);                                       // no state on the gpu
  // optimizer.update auto: on a GPU the split's device side stages at most a chunk (window 0),
  // or what tiers.gpu.update_window holds; on the host-emulated device there is no split.
  c.optimizer.update = OptimizerUpdate::kAuto;
  c.runtime.device = DeviceKind::kCuda;
  EXPECT_EQ(runtime_buffers(c, 2, c.offload).adam_scratch, r.adam_scratch);
  c.tiers.gpu.update_window = 1 << 20;  // (1 MiB - 1280) / (12 + 4 + 2) = 58183 elements
  EXPECT_EQ(update_window_elements(1 << 20, 4, 2, 333'376), 58'183u);
  EXPECT_EQ(runtime_buffers(c, 2, c.offload).adam_scratch,
            3 * 232'960ULL + 232'960ULL + 116'480ULL);  // 58183 x 4 -> 232960, x 2 -> 116480
  EXPECT_LE(runtime_buffers(c, 2, c.offload).adam_scratch, c.tiers.gpu.update_window);
  EXPECT_EQ(update_window_elements(1, 4, 2, 10), 1u);  // never less than one element
  EXPECT_EQ(update_window_elements(0, 4, 2, 10), 10u);
  c.runtime.device = DeviceKind::kHost;
  EXPECT_EQ(runtime_buffers(c, 2, c.offload).adam_scratch, 0u);
  c.tiers.gpu.update_window = 0;
  // State on the gpu, its gradients in host memory: the device update stages the gradients of the
  // largest chunk (the partition) in tiers.host.buffer_count slots, each padded to 4096 B
  // (333376 x 4 = 1333504 -> 1335296); stage 3 with the parameters on the host too adds theirs
  // (666752 -> 667648).
  c.optimizer.update = OptimizerUpdate::kCpu;
  c.offload.optimizer = {Tier::kGpu, 1.0, false};
  c.offload.gradients = {Tier::kCpu, 1.0, false};
  c.tiers.host.buffer_count = 3;
  r = runtime_buffers(c, 2, c.offload);
  EXPECT_EQ(r.update_slots, 3 * 1'335'296ULL);
  EXPECT_EQ(r.step(), r.buckets + r.receive + r.norm + r.update_slots);
  c.offload.params = {Tier::kCpu, 1.0, false};
  EXPECT_EQ(runtime_buffers(c, 3, c.offload).update_slots, 3 * (1'335'296ULL + 667'648));
  EXPECT_EQ(runtime_buffers(c, 1, c.offload).update_slots, 0u);  // stages 0-1: flat gradients
  c.offload = OffloadConfig{};
  // Saturates rather than wrapping.
  Config big = config(100'000'000'000'000ULL, 1, 3);
  big.model.hidden_size = 1'000'000'000;
  big.zero.reduce_bucket_size = 100'000'000'000'000ULL;
  const RuntimeBuffers s = runtime_buffers(big, 3, big.offload);
  EXPECT_GT(s.total(), 1'000'000'000'000'000ULL);
  EXPECT_FALSE(make_plan(big).configured_fits());
}

// Where the master weights are the FP32 parameters (host device), the placement laid out decides
// at stage 2, not the config's: a rung that moves the state to cpu under optimizer.overlap on keeps
// a master of its own (the speculative update may run there), the config's own (state on the gpu)
// does not.
TEST(Plan, MasterInParamsFollowsTheLayoutsPlacement) {
  Config c = config(1'000'000ULL, 1, 2);
  c.precision.params = c.precision.grads = DType::kFp32;
  c.runtime.device = DeviceKind::kHost;
  c.optimizer.overlap = OptimizerOverlap::kOn;
  const Layout own = plan_layout(c, 2, c.offload);
  EXPECT_TRUE(own.master_in_params);
  EXPECT_EQ(own.on_gpu.optimizer, 8'000'000u);
  OffloadConfig cpu = c.offload;
  cpu.optimizer = {Tier::kCpu, 1.0, false};
  const Layout rung = plan_layout(c, 2, cpu);
  EXPECT_FALSE(rung.master_in_params);
  EXPECT_EQ(rung.on_host.optimizer, 12'000'000u);
  c.optimizer.overlap = OptimizerOverlap::kOff;  // nothing speculated: one copy again
  EXPECT_EQ(plan_layout(c, 2, cpu).on_host.optimizer, 8'000'000u);
  EXPECT_FALSE(plan_layout(c, 3, c.offload).master_in_params);  // stage 3: never
}

// One rank with no gradient on nvme reduces without a collective: a bucket buffer is its own
// receive buffer. It makes one per bucket up to six (two in flight, one being filled, three
// receive buffers' worth) and no receive buffer: with one bucket larger than the model, one buffer
// of the flat gradients, not that and a receive buffer of the same size (strata_host_stage2 in
// bench/python/bench_torch_loop.py: 0.45 GB counted twice).
TEST(Plan, RuntimeBuffersOneRank) {
  Config c = config(1'000'003ULL, 1, 2);
  c.precision.grads = DType::kFp32;
  c.zero.reduce_bucket_size = 500'000'000;  // F = 1000064: one bucket
  RuntimeBuffers r = runtime_buffers(c, 2, c.offload);
  EXPECT_EQ(r.bucket_count, 1u);
  EXPECT_EQ(r.buckets, 1'000'064ULL * 4);
  EXPECT_EQ(r.receive_count, 0u);
  EXPECT_EQ(r.receive, 0u);
  EXPECT_EQ(r.step(), r.buckets + r.norm);
  c.zero.reduce_bucket_size = 250'000;  // 5 buckets: 5 buffers
  r = runtime_buffers(c, 2, c.offload);
  EXPECT_EQ(r.bucket_count, 5u);
  EXPECT_EQ(r.buckets, 5 * 250'000ULL * 4);
  EXPECT_EQ(r.receive_count, 0u);
  c.zero.reduce_bucket_size = 100'000;  // 11 buckets: six
  EXPECT_EQ(runtime_buffers(c, 3, c.offload).bucket_count, 6u);
  EXPECT_EQ(runtime_buffers(c, 3, c.offload).receive, 0u);
  // Gradients on nvme (any share): filled from receive buffers, as on several ranks.
  c.offload.gradients = {Tier::kNvme, 0.25, false};
  r = runtime_buffers(c, 2, c.offload);
  EXPECT_EQ(r.bucket_count, 3u);
  EXPECT_EQ(r.receive_count, 3u);
  EXPECT_EQ(r.receive, 3 * 100'000ULL * 4);
  c.offload.gradients = {Tier::kCpu, 1.0, false};  // off the gpu, not on nvme: still six
  EXPECT_EQ(runtime_buffers(c, 2, c.offload).bucket_count, 6u);
  EXPECT_EQ(runtime_buffers(c, 2, c.offload).receive_count, 0u);
}

// The pinned pool is there whenever the engine makes one: state off the gpu, or a GPU device
// (runtime.device auto or cuda) even with nothing offloaded; not with everything on the
// host-emulated device's memory.
TEST(Plan, PinnedPoolWhereverTheEngineHasOne) {
  Config c = config(1'000'000'000ULL, 4, 2);
  PoolPlan p = plan_pool(c, 2, c.offload);
  EXPECT_TRUE(p.used);  // runtime.device auto: a GPU
  EXPECT_EQ(p.buffers, 4u);
  EXPECT_EQ(p.buffer_size, 256 * kMiB);
  EXPECT_NE(p.why.find("GPU"), std::string::npos) << p.why;
  c.runtime.device = DeviceKind::kHost;
  EXPECT_FALSE(plan_pool(c, 2, c.offload).used);
  EXPECT_EQ(make_plan(c).configured.per_rank.pinned_host, 0u);
  c.offload.optimizer = {Tier::kCpu, 1.0, false};  // CPU offload: a pool, nothing on nvme
  p = plan_pool(c, 2, c.offload);
  EXPECT_TRUE(p.used);
  EXPECT_EQ(p.bytes(), 4 * 256 * kMiB);
  const Layout l = make_plan(c).configured;
  EXPECT_EQ(l.per_rank.nvme, 0u);
  EXPECT_EQ(l.per_rank.pinned_host, 4 * 256 * kMiB);
  EXPECT_EQ(l.per_rank.pageable_host, 250'000'000ULL * 12);
  // Fewer chunks than buffers: one buffer per chunk. 1M elements per rank in sub-groups of 400K:
  // 3 chunks (a 1 MiB buffer stages 65536 elements of 12 + 2 + 2 B: 16 chunks).
  c.model.parameters = 4'000'000;
  c.zero.sub_group_size = 400'000;
  c.tiers.host.buffer_count = 8;
  EXPECT_EQ(plan_pool(c, 2, c.offload).buffers, 3u);
  c.tiers.host.buffer_size = kMiB;
  p = plan_pool(c, 2, c.offload);
  EXPECT_EQ(p.buffers, 8u);
  EXPECT_EQ(p.buffer_size, kMiB);
  // No chunk fills a buffer (the 1M-element partition is smaller than one 256 MiB buffer stages):
  // buffers sized to the largest chunk's staging, the gradients in and the parameters out of a
  // 400K-element chunk whose optimizer state is on the host, 2 x round_up(400000 x 2 B, 4096).
  c.tiers.host.buffer_size = 256 * kMiB;
  p = plan_pool(c, 2, c.offload);
  EXPECT_EQ(p.buffers, 3u);
  EXPECT_EQ(p.buffer_size, 2 * 802'816ULL);  // 800000 B rounded up to 4096, twice
}

TEST(Plan, ActivationEstimate) {
  Config c = config(7'500'000'000ULL, 8, 3);
  set_shape(c, 32, 4096, 32, 2048, 1);  // layers, hidden, heads, sequence, micro-batch
  c.tiers.gpu.budget = 40 * kGB;
  Plan p = make_plan(c);
  ASSERT_TRUE(p.activations.available);
  // s*b*h*(34 + 5*a*s/h) = 2048*4096*(34 + 5*32*2048/4096) = 8388608 * 114
  EXPECT_EQ(p.activations.per_layer, 956'301'312ULL);
  EXPECT_EQ(p.activations.without_checkpointing, 32ULL * 956'301'312ULL);
  EXPECT_EQ(p.activations.with_checkpointing, 32ULL * 2 * 2048 * 4096 + 956'301'312ULL);
  EXPECT_TRUE(p.configured.fits());                        // 15 GB of model state
  EXPECT_FALSE(p.activations.fits_without_checkpointing);  // + 30.6 GB > 40 GB
  EXPECT_TRUE(p.activations.fits_with_checkpointing);
  ASSERT_FALSE(p.notes.empty());
  EXPECT_NE(p.notes[0].find("activations, not model state"), std::string::npos) << p.notes[0];
  EXPECT_NE(p.notes[0].find("checkpointing (1.49 GB) makes it fit"), std::string::npos)
      << p.notes[0];

  c.model.micro_batch = 8;
  c.tiers.gpu.budget = 30 * kGB;  // 15 GB of model state + 7.68 GB of runtime buffers fit
  Plan q = make_plan(c);
  EXPECT_EQ(q.activations.with_checkpointing, 32ULL * 2 * 2048 * 4096 * 8 + 8 * 956'301'312ULL);
  EXPECT_FALSE(q.activations.fits_with_checkpointing);
  ASSERT_FALSE(q.notes.empty());
  EXPECT_NE(q.notes[0].find("even with activation checkpointing"), std::string::npos);

  c.model.layers = 0;  // no shape, no estimate
  EXPECT_FALSE(make_plan(c).activations.available);
}

TEST(Plan, AssumptionsSayWhatIsCounted) {
  Plan p = make_plan(config(1'000'000ULL, 1));
  std::string all;
  for (const auto& a : p.assumptions) all += a + "\n";
  for (const char* s : {"model state", "pinned staging pool", "runtime buffers", "activations",
                        "CUDA context", "NCCL", "allocator", "backward order"})
    EXPECT_NE(all.find(s), std::string::npos) << s;
}

// optimizer.overlap where rank 0's range lies in one reduce bucket: every gradient is final at the
// last hand-in and nothing is hidden; the plan says so (not with overlap off, not with smaller
// buckets, not at stages 0-1 where overlap does nothing anyway).
TEST(Plan, OverlapWithOneBucketPerRankIsNoted) {
  auto noted = [](const Config& c) {
    for (const auto& n : make_plan(c).notes)
      if (n.find("lie in one zero.reduce_bucket_size bucket") != std::string::npos) return true;
    return false;
  };
  Config c = config(20'000'000ULL, 2, 2);  // 10M per rank, the default bucket 500M
  c.optimizer.overlap = OptimizerOverlap::kOn;
  EXPECT_TRUE(noted(c));
  c.optimizer.overlap = OptimizerOverlap::kAuto;
  EXPECT_TRUE(noted(c));
  c.zero.reduce_bucket_size = 10'000'000;  // exactly rank 0's range: still one bucket
  EXPECT_TRUE(noted(c));
  c.zero.reduce_bucket_size = 9'999'999;
  EXPECT_FALSE(noted(c));
  c.zero.reduce_bucket_size = 500'000'000;
  c.optimizer.overlap = OptimizerOverlap::kOff;
  EXPECT_FALSE(noted(c));
  c.optimizer.overlap = OptimizerOverlap::kOn;
  c.zero.stage = 1;
  EXPECT_FALSE(noted(c));
}

namespace {
// A /proc/meminfo-format file saying MemTotal is `kib` kB (the machine the plan sees).
std::string fake_meminfo(const std::string& name, const std::string& total_line) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("strata-meminfo-" + std::to_string(::getpid()) + "-" + name))
                               .string();
  std::ofstream(path) << "MemFree:         1000 kB\n" << total_line << "\nMemAvailable: 2 kB\n";
  return path;
}
// MemTotal alone: no cgroup (the machine running the test may have one).
MachineMemory meminfo_only(const std::string& meminfo) {
  return read_machine_memory(meminfo, meminfo + ".no-cgroup", meminfo + ".no-mountinfo");
}
const char* const kOffloadedYaml =
    "model: {parameters: 1B}\nzero: {stage: 2}\noffload: {optimizer: {tier: cpu}}\n";
}  // namespace

// tiers.host.budget not set: `strata plan` checks host memory against the machine's (MemTotal),
// not the default 512 GiB, and says so; set, the configured value is used whatever the machine.
TEST(Plan, HostBudgetIsTheMachinesMemoryWhenNotSet) {
  const std::string small = fake_meminfo("8g", "MemTotal:        8388608 kB");
  const std::string large = fake_meminfo("64g", "MemTotal:       67108864 kB");
  const MachineMemory m8 = meminfo_only(small), m64 = meminfo_only(large);
  ASSERT_TRUE(m8.known) << m8.source;
  EXPECT_EQ(m8.total, 8ULL << 30);
  EXPECT_EQ(m64.total, 64ULL << 30);

  const Config unset = parse_config(kOffloadedYaml);
  EXPECT_FALSE(unset.tiers.host.budget_set);
  // 12 GB of optimizer state + the pinned pool in host memory: over 8 GiB, within 64 GiB.
  const Plan on8 = make_plan(unset, m8);
  EXPECT_EQ(on8.host_budget.source, HostBudget::Source::kMachine);
  EXPECT_EQ(on8.host_budget.bytes, 8ULL << 30);
  EXPECT_NE(on8.host_budget.text.find("the machine's 8 GiB"), std::string::npos)
      << on8.host_budget.text;
  EXPECT_NE(on8.host_budget.text.find("tiers.host.budget not set"), std::string::npos);
  EXPECT_FALSE(on8.configured_fits());
  EXPECT_NE(on8.configured_rung.verdict.find("host"), std::string::npos)
      << on8.configured_rung.verdict;
  const TierVerdict& host = on8.configured.verdicts[1];
  ASSERT_EQ(host.tier, "host");
  EXPECT_EQ(host.budget, 8ULL << 30);
  EXPECT_FALSE(host.fits());
  // The ladder's rungs are checked against the same budget.
  for (const Rung& r : on8.recommendation.ladder)
    EXPECT_EQ(r.layout.verdicts[1].budget, 8ULL << 30);

  const Plan on64 = make_plan(unset, m64);
  EXPECT_TRUE(on64.configured_fits()) << on64.configured_rung.verdict;
  EXPECT_EQ(on64.configured.verdicts[1].budget, 64ULL << 30);

  // Set in the config: the configured value, on either machine.
  const Config set = parse_config(std::string(kOffloadedYaml) + "tiers: {host: {budget: 64GiB}}\n");
  EXPECT_TRUE(set.tiers.host.budget_set);
  const Plan cfg = make_plan(set, m8);
  EXPECT_EQ(cfg.host_budget.source, HostBudget::Source::kConfig);
  EXPECT_EQ(cfg.configured.verdicts[1].budget, 64ULL << 30);
  EXPECT_TRUE(cfg.configured_fits()) << cfg.configured_rung.verdict;

  // The machine's memory unknown: the default, and the plan says it could not read it.
  const MachineMemory none = meminfo_only(small + ".missing");
  EXPECT_FALSE(none.known);
  const std::string bad = fake_meminfo("bad", "MemTotal: lots");
  EXPECT_FALSE(meminfo_only(bad).known);
  const Plan unknown = make_plan(unset, none);
  EXPECT_EQ(unknown.host_budget.source, HostBudget::Source::kDefault);
  EXPECT_EQ(unknown.configured.verdicts[1].budget, 512ULL << 30);
  EXPECT_NE(unknown.host_budget.text.find("could not be read"), std::string::npos)
      << unknown.host_budget.text;
  std::filesystem::remove(small);
  std::filesystem::remove(large);
  std::filesystem::remove(bad);
}

namespace {
// A path as mountinfo writes it: space, tab, newline and backslash as octal escapes.
std::string mount_escaped(const std::string& path) {
  std::string out;
  for (char c : path) {
    if (c == ' ' || c == '\t' || c == '\n' || c == '\\') {
      const int v = static_cast<unsigned char>(c);
      out += '\\';
      out += static_cast<char>('0' + v / 64);
      out += static_cast<char>('0' + v / 8 % 8);
      out += static_cast<char>('0' + v % 8);
    } else {
      out += c;
    }
  }
  return out;
}

// A fake /proc/self/cgroup, /proc/self/mountinfo and cgroup hierarchies under a temporary
// directory: cgroup v2 mounted at <dir>/v2 (from the hierarchy's root, or from `v2_root`), v1's
// memory controller at <dir>/v1; the paths in mountinfo escaped as the kernel writes them.
struct FakeCgroups {
  std::filesystem::path dir;
  explicit FakeCgroups(const std::string& name, const std::string& v2_root = "/")
      : dir(std::filesystem::temp_directory_path() /
            ("strata-cgroup-" + std::to_string(::getpid()) + "-" + name)) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "mountinfo")
        << "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        << "30 22 0:26 " << mount_escaped(v2_root) << " " << mount_escaped((dir / "v2").string())
        << " rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
        << "31 22 0:27 / " << mount_escaped((dir / "v1").string())
        << " rw - cgroup cgroup rw,memory\n";
  }
  ~FakeCgroups() { std::filesystem::remove_all(dir); }
  void cgroup_file(const std::string& lines) { std::ofstream(dir / "cgroup") << lines; }
  void limit(const std::string& rel, const std::string& file, const std::string& value) {
    std::filesystem::create_directories(dir / rel);
    std::ofstream(dir / rel / file) << value << "\n";
  }
  MachineMemory read(const std::string& meminfo) const {
    return read_machine_memory(meminfo, (dir / "cgroup").string(), (dir / "mountinfo").string());
  }
};
}  // namespace

// A cgroup memory limit below MemTotal (a container, a Slurm job) is what the plan checks host
// memory against: the lowest limit from the process's cgroup up to the hierarchy's root, cgroup
// v2 (memory.max) or v1 (memory.limit_in_bytes); "max" and v1's unlimited value are no limit, an
// unreadable limit leaves MemTotal and is named.
TEST(Plan, HostBudgetIsTheCgroupsMemoryLimitWhereLower) {
  const std::string node = fake_meminfo("64g-cgroup", "MemTotal:       67108864 kB");
  {
    SCOPED_TRACE("v2: the parent's limit binds the job's step");
    FakeCgroups cg("v2");
    cg.cgroup_file("0::/job/step\n");
    cg.limit("v2/job", "memory.max", "8589934592");
    cg.limit("v2/job/step", "memory.max", "max");
    const MachineMemory m = cg.read(node);
    ASSERT_TRUE(m.known) << m.source;
    EXPECT_EQ(m.total, 8ULL << 30);
    EXPECT_NE(m.source.find("v2/job/memory.max"), std::string::npos) << m.source;
    EXPECT_NE(m.source.find("below MemTotal's 64 GiB"), std::string::npos) << m.source;
    const Plan p = make_plan(parse_config(kOffloadedYaml), m);  // 12 GB of state on cpu
    EXPECT_EQ(p.host_budget.bytes, 8ULL << 30);
    EXPECT_NE(p.host_budget.text.find("cgroup"), std::string::npos) << p.host_budget.text;
    EXPECT_FALSE(p.configured_fits());
  }
  {
    SCOPED_TRACE("v1 memory controller, the lowest on the way up");
    FakeCgroups cg("v1");
    cg.cgroup_file("4:memory:/slurm/uid_1/job_2\n3:cpu,cpuacct:/slurm\n0::/\n");
    cg.limit("v1/slurm", "memory.limit_in_bytes", "9223372036854771712");
    cg.limit("v1/slurm/uid_1", "memory.limit_in_bytes", "6442450944");
    cg.limit("v1/slurm/uid_1/job_2", "memory.limit_in_bytes", "4294967296");
    const MachineMemory m = cg.read(node);
    EXPECT_EQ(m.total, 4ULL << 30) << m.source;
    EXPECT_NE(m.source.find("job_2/memory.limit_in_bytes"), std::string::npos) << m.source;
  }
  {
    SCOPED_TRACE("mount points with a space and a backslash (escaped in mountinfo)");
    FakeCgroups cg("a dir\\with space", "/my job");
    cg.cgroup_file("0::/my job/step\n");
    cg.limit("v2/step", "memory.max", "3221225472");
    const MachineMemory m = cg.read(node);
    EXPECT_EQ(m.total, 3ULL << 30) << m.source;
    EXPECT_NE(m.source.find("a dir\\with space/v2/step/memory.max"), std::string::npos) << m.source;
  }
  {
    SCOPED_TRACE("a container's namespace: the mount shows its own cgroup");
    FakeCgroups cg("ns", "/docker/abc");
    cg.cgroup_file("0::/docker/abc\n");
    cg.limit("v2", "memory.max", "2147483648");
    EXPECT_EQ(cg.read(node).total, 2ULL << 30);
  }
  {
    SCOPED_TRACE("no limit, or one above MemTotal: MemTotal");
    FakeCgroups cg("none");
    cg.cgroup_file("0::/user.slice\n4:memory:/user.slice\n");
    cg.limit("v2/user.slice", "memory.max", "99999999999999999999999");  // beyond 64 bits
    cg.limit("v2", "memory.max", "max");
    cg.limit("v1/user.slice", "memory.limit_in_bytes", "137438953472");  // 128 GiB
    const MachineMemory m = cg.read(node);
    EXPECT_EQ(m.total, 64ULL << 30);
    EXPECT_EQ(m.source, "MemTotal in " + node);
  }
  {
    SCOPED_TRACE("an unreadable limit: MemTotal, and said");
    FakeCgroups cg("bad");
    cg.cgroup_file("0::/job\n");
    cg.limit("v2/job", "memory.max", "lots");
    const MachineMemory m = cg.read(node);
    EXPECT_EQ(m.total, 64ULL << 30);
    EXPECT_NE(m.source.find("could not be read"), std::string::npos) << m.source;
  }
  std::filesystem::remove(node);
}
