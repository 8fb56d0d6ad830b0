// The step cost model on synthetic bandwidths, against numbers worked out by hand (see the
// comments), and the I/O recommendation on synthetic sweep points.
#include <gtest/gtest.h>

#include <limits>

#include "profile/profile_internal.hpp"
#include "strata/config.hpp"
#include "strata/error.hpp"
#include "strata/plan.hpp"
#include "strata/profile.hpp"
#include "test_util.hpp"

using namespace strata;

namespace {

// 1M parameters, fp16/fp16, stage 2, optimizer state on NVMe, sub-groups of 300K elements.
Config nvme_config(std::uint32_t ranks = 1, double fraction = 1.0) {
  return parse_config(R"(
model: {parameters: 1000000}
world: {ranks: )" + std::to_string(ranks) +
                      R"(, ranks_per_node: )" + std::to_string(ranks) + R"(}
zero: {stage: 2, sub_group_size: 300000}
offload:
  optimizer: {tier: nvme, fraction: )" +
                      std::to_string(fraction) + R"(}
tiers:
  nvme: {paths: [/nonexistent/strata]}
)");
}

Bandwidths synthetic() {
  Bandwidths bw;
  bw.nvme_read_bps = 100e6;
  bw.nvme_write_bps = 50e6;
  bw.cpu_adam_params_per_s = 10e6;
  return bw;
}

// A predicted step of `chunks` sub-groups whose pipelined time is w, over `elements`.
StepPrediction step_of(std::uint64_t chunks, double w, std::uint64_t elements = 0) {
  StepPrediction p;
  p.sub_groups = chunks;
  p.pipelined_s = w;
  p.optimizer_elements = elements;
  return p;
}

}  // namespace

TEST(CostModel, PlanTrafficOverSubGroupsSerialAndPipelined) {
  const Config c = nvme_config();
  const Plan plan = make_plan(c);
  // The plan's bytes: 12 B of optimizer state per element read and written, 2 B of gradients
  // down, 2 B of parameters up.
  ASSERT_EQ(plan.configured.traffic.nvme_read, 12'000'000u);
  ASSERT_EQ(plan.configured.traffic.nvme_write, 12'000'000u);
  ASSERT_EQ(plan.configured.traffic.device_to_host, 2'000'000u);
  ASSERT_EQ(plan.configured.traffic.host_to_device, 2'000'000u);

  const StepPrediction p = predict_step(c, plan.configured, synthetic());
  // 1M elements / 300K = 3 full sub-groups + one of 100K.
  EXPECT_EQ(p.optimizer_elements, 1'000'000u);
  EXPECT_EQ(p.offloaded_elements, 1'000'000u);
  EXPECT_EQ(p.sub_groups, 4u);
  ASSERT_EQ(p.legs.size(), 2u);
  EXPECT_EQ(p.legs_count[0], 3u);
  EXPECT_EQ(p.legs_count[1], 1u);
  // Full sub-group: 3.6 MB read at 100 MB/s = 36 ms, written at 50 MB/s = 72 ms, Adam 300K at
  // 10M/s = 30 ms. Partial: 12, 24, 10 ms.
  EXPECT_NEAR(p.legs[0].nvme_read_s, 0.036, 1e-12);
  EXPECT_NEAR(p.legs[0].nvme_write_s, 0.072, 1e-12);
  EXPECT_NEAR(p.legs[0].adam_s, 0.030, 1e-12);
  EXPECT_NEAR(p.legs[1].nvme_read_s, 0.012, 1e-12);
  EXPECT_NEAR(p.legs[1].nvme_write_s, 0.024, 1e-12);
  EXPECT_NEAR(p.legs[1].adam_s, 0.010, 1e-12);
  // Serial: 3 x 138 + 46 = 460 ms. Pipelined (reads and writes share the disk): first sub-group
  // 138 ms, then 2 x max(36 + 72, 30) = 216 ms, then max(12 + 24, 10) = 36 ms: 390 ms.
  EXPECT_NEAR(p.serial_s, 0.460, 1e-12);
  EXPECT_NEAR(p.pipelined_s, 0.390, 1e-12);
  EXPECT_NEAR(p.adam_s, 0.100, 1e-12);
  EXPECT_NEAR(p.nvme_read_s, 0.120, 1e-12);
  EXPECT_NEAR(p.nvme_write_s, 0.240, 1e-12);
  EXPECT_NEAR(p.overhead_serial_s, 0.360, 1e-12);
  EXPECT_NEAR(p.overhead_pipelined_s, 0.290, 1e-12);
  EXPECT_EQ(p.network_s, 0.0);
  // No GPU bandwidth: the PCIe legs are not counted, and a note says so.
  EXPECT_EQ(p.h2d_s, 0.0);
  ASSERT_FALSE(p.notes.empty());
  EXPECT_NE(p.notes[0].find("host<->device"), std::string::npos);
}

TEST(CostModel, DuplexNvmeAndPcieLegs) {
  const Config c = nvme_config();
  Bandwidths bw = synthetic();
  bw.nvme_duplex = true;
  bw.h2d_bps = 100e6;
  bw.d2h_bps = 200e6;
  const StepPrediction p = predict_step(c, make_plan(c).configured, bw);
  // Full: + h2d 600 KB / 100 MB/s = 6 ms, d2h 600 KB / 200 MB/s = 3 ms -> sum 147 ms,
  // slot max(max(36, 72), max(6, 3), 30) = 72 ms. Partial: 2 + 1 ms -> sum 49 ms, slot 24 ms.
  EXPECT_NEAR(p.legs[0].h2d_s, 0.006, 1e-12);
  EXPECT_NEAR(p.legs[0].d2h_s, 0.003, 1e-12);
  EXPECT_NEAR(p.serial_s, 3 * 0.147 + 0.049, 1e-12);
  EXPECT_NEAR(p.pipelined_s, 0.147 + 2 * 0.072 + 0.024, 1e-12);
  EXPECT_TRUE(p.notes.empty());
}

TEST(CostModel, PartialOffloadRunsTheGpuShareBeside) {
  const Config c = nvme_config(1, 0.5);
  Bandwidths bw = synthetic();
  bw.h2d_bps = bw.d2h_bps = 1e12;  // negligible
  bw.gpu_adam_params_per_s = 1e6;  // 500K on the GPU: 0.5 s, longer than the CPU pipeline
  const StepPrediction p = predict_step(c, make_plan(c).configured, bw);
  EXPECT_EQ(p.offloaded_elements, 500'000u);
  EXPECT_EQ(p.sub_groups, 2u);  // 300K + 200K
  // CPU pipeline: 3.6 MB + 2.4 MB of state; serial = 0.138 + 0.092 (+ PCIe ~0) + GPU 0.5.
  EXPECT_NEAR(p.serial_s, 0.138 + 0.092 + 0.5, 1e-5);
  EXPECT_NEAR(p.pipelined_s, 0.5, 1e-12);
  EXPECT_NEAR(p.adam_s, 0.05 + 0.5, 1e-12);
}

TEST(CostModel, CollectivesUseBusBandwidth) {
  const Config c = nvme_config(4);
  Bandwidths bw = synthetic();
  bw.reduce_scatter_busbw = 100e6;
  bw.all_gather_busbw = 200e6;
  const Plan plan = make_plan(c);
  // Stage 2 on 4 ranks: 2 MB of fp16 gradients reduce-scattered, 2 MB of parameters gathered;
  // each takes S (n-1)/n / busbw: 1.5 MB / 100 MB/s + 1.5 MB / 200 MB/s = 22.5 ms.
  ASSERT_EQ(plan.configured.traffic.network, 4'000'000u);
  const StepPrediction p = predict_step(c, plan.configured, bw);
  EXPECT_NEAR(p.network_s, 0.0225, 1e-12);
  // 250K elements per rank: one sub-group, no overlap: 30 + 60 (write) + 25 ms + network.
  EXPECT_EQ(p.sub_groups, 1u);
  EXPECT_NEAR(p.pipelined_s, p.serial_s, 1e-12);
  EXPECT_NEAR(p.overhead_pipelined_s, 0.030 + 0.060 + 0.0225, 1e-9);
}

TEST(CostModel, NothingOffloaded) {
  Config c = parse_config("model: {parameters: 1000000}\n");
  Bandwidths bw = synthetic();
  StepPrediction p = predict_step(c, make_plan(c).configured, bw);
  EXPECT_EQ(p.sub_groups, 0u);
  EXPECT_EQ(p.serial_s, 0.0);
  EXPECT_EQ(p.overhead_pipelined_s, 0.0);
  bw.gpu_adam_params_per_s = 1e8;  // 1M elements: 10 ms, no overhead
  p = predict_step(c, make_plan(c).configured, bw);
  EXPECT_NEAR(p.pipelined_s, 0.01, 1e-12);
  EXPECT_EQ(p.overhead_pipelined_s, 0.0);  // exactly: rounding residue is not an overhead
  EXPECT_EQ(p.overhead_serial_s, 0.0);
}

// The step hidden behind a backward of T: W = 8 s over n = 4 chunks (2 s each). The update ends
// max over j < n of ((j + 1) W - j T) / n after the last gradient.
TEST(CostModel, OverlapExposesTheLastChunkOrWhatTheBackwardCannotHide) {
  StepPrediction p = step_of(4, 8);
  // The backward is the longer: only the last chunk's update is left (W / n).
  OverlapPrediction v = predict_overlap(p, 20);
  EXPECT_EQ(v.chunks, 4u);
  EXPECT_DOUBLE_EQ(v.optimizer_s, 8);
  EXPECT_DOUBLE_EQ(v.exposed_s, 2);
  EXPECT_DOUBLE_EQ(v.backward_and_step_s, 22);
  EXPECT_DOUBLE_EQ(v.serial_s, 28);
  // The update is the longer: W - T (n - 1) / n = 8 - 4 x 3 / 4 = 5 (the chunks queue up).
  v = predict_overlap(p, 4);
  EXPECT_DOUBLE_EQ(v.exposed_s, 5);
  EXPECT_DOUBLE_EQ(v.backward_and_step_s, 9);
  // Equal: W / n either way; no backward: the whole step; one chunk: the whole step.
  EXPECT_DOUBLE_EQ(predict_overlap(p, 8).exposed_s, 2);
  EXPECT_DOUBLE_EQ(predict_overlap(p, 0).exposed_s, 8);
  p.sub_groups = 1;
  EXPECT_DOUBLE_EQ(predict_overlap(p, 100).exposed_s, 8);
  p.sub_groups = 0;  // an empty partition counts as one chunk
  EXPECT_DOUBLE_EQ(predict_overlap(p, 1).exposed_s, 8);
  strata::testing::expect_error(ErrorCode::kInvalidArgument, "backward time",
                                [&] { predict_overlap(p, -1); });
  strata::testing::expect_error(ErrorCode::kInvalidArgument, "finite", [&] {
    predict_overlap(p, std::numeric_limits<double>::infinity());
  });
}

// The engine's schedule (overlap_shape): a rank's gradients become final bucket by bucket, during
// the part of the backward that hands its range in. W = 8 s over 8 chunks of a range of 8000.
TEST(CostModel, OverlapCountsTheBucketsAndTheRanksWindow) {
  const StepPrediction p = step_of(8, 8, 8000);
  OverlapShape s;
  s.bucket_elements = 4000;  // two pieces of four chunks: the last four after the last gradient
  OverlapPrediction v = predict_overlap(p, 20, s);
  EXPECT_EQ(v.chunks, 8u);
  EXPECT_EQ(v.pieces, 2u);
  EXPECT_DOUBLE_EQ(v.window_s, 20);
  EXPECT_DOUBLE_EQ(v.exposed_s, 4);
  s.bucket_elements = 3000;  // ceil(8000 / 3000) = 3 pieces
  EXPECT_EQ(predict_overlap(p, 20, s).pieces, 3u);
  s.bucket_elements = 500'000'000;  // one bucket (the default's size): final at the last gradient
  v = predict_overlap(p, 20, s);
  EXPECT_EQ(v.pieces, 1u);
  EXPECT_DOUBLE_EQ(v.exposed_s, 8);
  EXPECT_DOUBLE_EQ(v.backward_and_step_s, v.serial_s);
  s.bucket_elements = 1;  // no finer than a chunk
  EXPECT_EQ(predict_overlap(p, 20, s).pieces, 8u);
  // Four ranks of equal ranges: rank 0's is handed in during the last 20 / 4 = 5 s, and its update
  // needs W - T' (n - 1) / n = 8 - 5 x 7 / 8 after the last gradient.
  s.bucket_elements = 0;
  s.model_elements = 32000;
  v = predict_overlap(p, 20, s);
  EXPECT_DOUBLE_EQ(v.window_s, 5);
  EXPECT_DOUBLE_EQ(v.exposed_s, 8 - 5.0 * 7 / 8);
  EXPECT_DOUBLE_EQ(v.backward_and_step_s, 20 + v.exposed_s);
  s.stage = 1;  // reduced at step(): nothing is final during the backward
  EXPECT_DOUBLE_EQ(predict_overlap(p, 20, s).exposed_s, 8);
  // From the config.
  Config c;
  c.zero.stage = 3;
  c.model.parameters = 123456;
  c.zero.reduce_bucket_size = 789;
  s = overlap_shape(c);
  EXPECT_EQ(s.stage, 3);
  EXPECT_EQ(s.model_elements, 123456u);
  EXPECT_EQ(s.bucket_elements, 789u);
  EXPECT_EQ(s.param_commit_bytes, 0u);  // stage 3's parameter blocks are swapped at the commit
  c.zero.stage = 2;  // the rank's share of the flat parameters (fp16 by default) is copied in
  c.world.ranks = 4;
  EXPECT_EQ(overlap_shape(c).param_commit_bytes, 123456u / 4 * 2);
}

// The speculation writes memory-resident state out of place: W_s = W + (f - 1) x its Adam time;
// state on the GPU is not speculated (its update runs after the decision); the commit then copies
// the new parameters in. W = 8 s over 4 chunks, of which 6 s Adam over host-memory state.
TEST(CostModel, OverlapUpdatesMemoryStateOutOfPlaceAndCommitsTheParameters) {
  StepPrediction p = step_of(4, 8);
  p.adam_memory_s = 6;
  Bandwidths bw;
  bw.cpu_adam_out_of_place_factor = 1.5;
  bw.host_copy_bps = 1e9;
  OverlapShape s;
  s.param_commit_bytes = 2'000'000'000;  // 2 s
  OverlapPrediction v = predict_overlap(p, 20, s, bw);
  EXPECT_DOUBLE_EQ(v.optimizer_s, 8);
  EXPECT_DOUBLE_EQ(v.speculative_s, 8 + 0.5 * 6);
  EXPECT_DOUBLE_EQ(v.commit_s, 2);
  EXPECT_DOUBLE_EQ(v.exposed_s, 11.0 / 4 + 2);  // the last chunk, then the commit
  EXPECT_DOUBLE_EQ(predict_overlap(p, 4, s, bw).exposed_s, (4 * 11.0 - 3 * 4) / 4 + 2);
  EXPECT_DOUBLE_EQ(v.serial_s, 28);  // the serial step: in place, no commit
  // State on the GPU: its 9 s update waits for the decision; the commit copies the parameters of
  // the speculated (offloaded) half only.
  p.adam_gpu_s = 9;
  p.optimizer_elements = 1000;
  p.offloaded_elements = 500;
  EXPECT_DOUBLE_EQ(predict_overlap(p, 20, s, bw).exposed_s, 9 + 1);
  p.adam_gpu_s = 0;
  p.optimizer_elements = p.offloaded_elements = 0;
  // Not measured: in place, nothing copied (a GPU's device-to-device commit is not counted).
  v = predict_overlap(p, 20, s, Bandwidths{});
  EXPECT_DOUBLE_EQ(v.speculative_s, 8);
  EXPECT_DOUBLE_EQ(v.exposed_s, 2);
  // Stages 0-1: the serial step, as measured in place.
  s.stage = 1;
  v = predict_overlap(p, 20, s, bw);
  EXPECT_DOUBLE_EQ(v.exposed_s, 8);
  EXPECT_DOUBLE_EQ(v.commit_s, 0);
}

// optimizer.update auto on a GPU: the out-of-place Adam of memory-resident state (here 6 x 1.5 =
// 9 s for 900 elements: 100 elements/s) shared with the device at in / h2d + 1 / rate + out / d2h
// per element (28 / 280 + 1 / 1000 + 14 / 1400 = 0.111 s: 9 elements/s): both finish together.
TEST(CostModel, OverlapSharesTheMemoryStateUpdateWithTheDevice) {
  StepPrediction p = step_of(4, 8);
  p.adam_memory_s = 6;
  Bandwidths bw;
  bw.cpu_adam_out_of_place_factor = 1.5;
  bw.cpu_adam_memory_params_per_s = 150;  // 900 elements in 6 s (in place)
  bw.h2d_bps = 280;
  bw.d2h_bps = 1400;
  bw.gpu_adam_params_per_s = 1000;
  OverlapShape s;
  s.split = true;
  s.split_in_bytes = 28;
  s.split_out_bytes = 14;
  const OverlapPrediction v = predict_overlap(p, 20, s, bw);
  const double r_dev = 1 / (0.1 + 0.001 + 0.01), r_cpu = 100;
  const double both = r_dev / (r_dev + r_cpu);
  // Four pieces: the CPU updates the three final during the 20 s backward (675 elements) in 6.75
  // s, so the device shares only the last piece's (after the backward: both finish together).
  ASSERT_EQ(v.pieces, 4u);
  EXPECT_NEAR(v.device_share, both / 4, 1e-12);
  // A 6.5 s backward: the CPU does 650 of the 675 in it; the device the other 25, and its share
  // of the last piece.
  EXPECT_NEAR(predict_overlap(p, 6.5, s, bw).device_share, (25 + both * 225) / 900, 1e-12);
  // A 2 s backward: the CPU falls far behind; the device takes its together-share throughout.
  EXPECT_NEAR(predict_overlap(p, 2, s, bw).device_share, both, 1e-12);
  EXPECT_NEAR(v.speculative_s, 8 + 3 - 9 + 900 / (r_dev + r_cpu), 1e-9);
  EXPECT_LT(v.speculative_s, predict_overlap(p, 20, OverlapShape{}, bw).speculative_s);
  // The GPU's rates not measured (a host without one): no split.
  bw.gpu_adam_params_per_s = 0;
  EXPECT_DOUBLE_EQ(predict_overlap(p, 20, s, bw).device_share, 0);
  EXPECT_DOUBLE_EQ(predict_overlap(p, 20, s, bw).speculative_s, 11);
  // overlap_shape: auto on a GPU splits; cpu, or the host device, does not.
  Config c;
  c.optimizer.update = OptimizerUpdate::kAuto;
  c.runtime.device = DeviceKind::kCuda;
  c.precision.params = DType::kBf16;
  c.precision.grads = DType::kBf16;
  EXPECT_TRUE(overlap_shape(c).split);
  EXPECT_EQ(overlap_shape(c).split_in_bytes, 14u);
  EXPECT_EQ(overlap_shape(c).split_out_bytes, 14u);
  c.runtime.device = DeviceKind::kHost;
  EXPECT_FALSE(overlap_shape(c).split);
  c.runtime.device = DeviceKind::kCuda;
  c.optimizer.update = OptimizerUpdate::kCpu;
  EXPECT_FALSE(overlap_shape(c).split);
}

// Optimizer state in host memory runs at the memory rate (arrays beyond the caches), state on
// NVMe at the staged rate of the sample step (its pool buffers).
TEST(CostModel, MemoryResidentStateRunsAtTheMemoryRate) {
  Config c = nvme_config(1, 0.5);  // half on NVMe; the rest to the cpu tier below
  c.offload.optimizer.tier = Tier::kCpu;
  Bandwidths bw = synthetic();
  bw.cpu_adam_memory_params_per_s = 5e6;  // half the staged rate
  StepPrediction p = predict_step(c, make_plan(c).configured, bw);
  ASSERT_EQ(p.offloaded_elements, 500'000u);
  EXPECT_NEAR(p.adam_memory_s, 0.1, 1e-12);  // 500K at 5M/s
  EXPECT_NEAR(p.adam_s, 0.1 + p.adam_gpu_s, 1e-12);
  EXPECT_NEAR(p.legs[0].adam_s, 0.06, 1e-12);  // 300K of them
  bw.cpu_adam_memory_params_per_s = 0;         // not measured: the staged rate
  p = predict_step(c, make_plan(c).configured, bw);
  EXPECT_NEAR(p.adam_memory_s, 0.05, 1e-12);
}

TEST(CostModel, Sample) {
  Bandwidths bw;
  bw.nvme_read_bps = 12e3;         // 1000 x 12 B: 1 s
  bw.nvme_write_bps = 6e3;         // 2 s
  bw.cpu_adam_params_per_s = 500;  // 2 s
  StepPrediction p = predict_sample(1000, 4, 12, bw);
  EXPECT_NEAR(p.serial_s, 20.0, 1e-12);
  EXPECT_NEAR(p.pipelined_s, 5.0 + 3 * 3.0, 1e-12);  // slot max(1 + 2, 2)
  bw.nvme_duplex = true;
  p = predict_sample(1000, 4, 12, bw);
  EXPECT_NEAR(p.pipelined_s, 5.0 + 3 * 2.0, 1e-12);  // slot max(max(1, 2), 2)
  EXPECT_THROW(predict_sample(0, 4, 12, bw), Error);
  // The CPU as a shared resource: (24000 B x 1e-4 s/B + 1000 x 4e-3 s) / 2 cores = 3.2 s per
  // sub-group, more than the disk's 3 s: it bounds the slot; the serial time does not change.
  bw.nvme_duplex = false;
  bw.cores = 2;
  bw.cpu_s_per_nvme_byte = 1e-4;
  bw.cpu_s_per_adam_element = 4e-3;
  p = predict_sample(1000, 4, 12, bw);
  EXPECT_NEAR(p.legs[0].cpu_s, 3.2, 1e-12);
  EXPECT_NEAR(p.pipelined_s, 5.0 + 3 * 3.2, 1e-12);
  EXPECT_NEAR(p.serial_s, 20.0, 1e-12);
  // Measured mixed read + write rate: 24000 B at 4800 B/s = 5 s per slot.
  bw.nvme_mixed_bps = 4800;
  p = predict_sample(1000, 4, 12, bw);
  EXPECT_NEAR(p.pipelined_s, 5.0 + 3 * 5.0, 1e-12);
}

namespace {
IoPoint io_pt(const char* engine, const char* op, std::uint64_t bs, std::uint32_t qd,
              std::uint32_t rings, std::vector<double> runs) {
  IoPoint p;
  p.path = "/d";
  p.engine = engine;
  p.op = op;
  p.block_size = bs;
  p.queue_depth = qd;
  p.rings = rings;
  p.runs_bps = runs;
  p.bytes_per_second = profile::median(runs);
  return p;
}
NvmeTierConfig io_config(std::uint64_t bs, std::uint32_t qd, std::uint32_t rings) {
  NvmeTierConfig n;
  n.block_size = bs;
  n.queue_depth = qd;
  n.io_threads = rings;
  return n;
}
}  // namespace

// The documented rule: the configured setting stays when it is within the noise band of the best
// (twice the median pass-to-pass spread, in [5%, 25%]); otherwise the lightest setting in the band.
TEST(ProfileRecommend, KeepsTheConfiguredSettingWithinNoiseElseTheLightestNearTheBest) {
  const std::uint64_t M = 1 << 20;
  std::vector<IoPoint> pts = {
      io_pt("io_uring", "read", M, 32, 1, {2000e6, 2100e6}),
      io_pt("io_uring", "write", M, 32, 1, {1000e6, 1040e6}),
      io_pt("io_uring", "read", 8 * M, 32, 2, {2150e6, 2200e6}),
      io_pt("io_uring", "write", 8 * M, 32, 2, {1060e6, 1100e6}),
      io_pt("threads", "read", M, 8, 1, {1000e6, 1010e6}),
      io_pt("threads", "write", M, 8, 1, {500e6, 505e6}),
      io_pt("io_uring", "read", M, 128, 1, {3000e6, 3000e6}),  // no write: not a candidate
  };
  // Configured 1 MiB qd 32 x1, 5 % below the best: within the band, kept.
  auto rec = profile::recommend_io(pts, io_config(M, 32, 1), "io_uring");
  ASSERT_EQ(rec.size(), 1u);
  EXPECT_TRUE(rec[0].configured_kept);
  EXPECT_EQ(rec[0].block_size, M);
  EXPECT_EQ(rec[0].rings, 1u);
  EXPECT_GE(rec[0].noise, 0.05);
  EXPECT_LE(rec[0].noise, 0.25);
  EXPECT_NE(rec[0].reason.find("configured setting is within the noise band"), std::string::npos);
  // Configured threads 1 MiB qd 8 (half the best): not kept; the lightest in the band is
  // io_uring 1 MiB qd 32 x1 (8 MiB x 32 x 2 is better by less than the band).
  rec = profile::recommend_io(pts, io_config(M, 8, 1), "threads");
  EXPECT_FALSE(rec[0].configured_kept);
  EXPECT_EQ(rec[0].engine, "io_uring");
  EXPECT_EQ(rec[0].block_size, M);
  EXPECT_EQ(rec[0].queue_depth, 32u);
  // Stable: the same measurements with the recommendation configured keep it.
  rec = profile::recommend_io(pts, io_config(rec[0].block_size, rec[0].queue_depth, rec[0].rings),
                              "io_uring");
  EXPECT_TRUE(rec[0].configured_kept);
  // Much better than anything: it wins even over the configured one.
  pts.push_back(io_pt("threads", "read", 2 * M, 16, 1, {4000e6, 4050e6}));
  pts.push_back(io_pt("threads", "write", 2 * M, 16, 1, {2000e6, 2010e6}));
  rec = profile::recommend_io(pts, io_config(M, 32, 1), "io_uring");
  EXPECT_FALSE(rec[0].configured_kept);
  EXPECT_EQ(rec[0].engine, "threads");
  EXPECT_EQ(rec[0].block_size, 2 * M);
  // A noisy sweep widens the band (capped at 25 %).
  for (auto& p : pts) p.runs_bps = {p.runs_bps.front() * 0.5, p.runs_bps.front() * 1.5};
  rec = profile::recommend_io(pts, io_config(M, 32, 1), "io_uring");
  EXPECT_DOUBLE_EQ(rec[0].noise, 0.25);
}

// The profile's placement is the plan's recommendation (one recommender), with each rung's
// predicted overhead beside it.
TEST(ProfileRecommend, PlacementIsThePlansRecommendation) {
  Config c = nvme_config();
  c.tiers.gpu.budget = 1'000'000'000;
  Bandwidths bw = synthetic();
  bw.h2d_bps = bw.d2h_bps = 1e12;
  for (std::uint64_t gpu : {1'000'000'000ULL, 10'000'000ULL, 3'000'000ULL}) {
    c.tiers.gpu.budget = gpu;
    const Recommendation plan = recommend(c);
    auto rec = profile::recommend_placement(c, bw, 10.0, true);
    ASSERT_EQ(rec.found, plan.found) << gpu;
    ASSERT_EQ(rec.considered.size(), plan.ladder.size());
    if (plan.found) {
      EXPECT_EQ(rec.choice.description, plan.layout.describe()) << gpu;
    }
    for (std::size_t i = 0; i < rec.considered.size(); ++i) {
      EXPECT_EQ(rec.considered[i].fits, plan.ladder[i].fits);
      EXPECT_EQ(rec.considered[i].verdict, plan.ladder[i].verdict);
    }
  }
  // Above the target: said, with the faster rung that fits further down the ladder.
  c.tiers.gpu.budget = 1'000'000'000;
  auto rec = profile::recommend_placement(c, bw, 0.0, true);
  ASSERT_TRUE(rec.found);
  EXPECT_EQ(rec.choice.description, recommend(c).layout.describe());
}

// The sample's pinned pool: the configured one unless a page-lock limit that applies is below it;
// CAP_IPC_LOCK lifts RLIMIT_MEMLOCK (root on a node usually holds it), so the pool is not cut then.
TEST(ProfilePool, CutOnlyWhereThePageLockLimitApplies) {
  Config c = nvme_config();
  c.tiers.host.buffer_count = 4;
  c.tiers.host.buffer_size = 64ull << 20;
  PageLockLimit lock;
  lock.rlimit = 8ull << 20;
  lock.cap_ipc_lock = true;  // applies = false: lifted
  PoolUse u = profile::choose_pool(c, 4, 3, lock);
  EXPECT_EQ(u.buffers, 4u);
  EXPECT_EQ(u.buffer_size, 64ull << 20);
  EXPECT_EQ(u.reason, "as configured");
  EXPECT_EQ(u.memlock_limit, ~0ULL);
  lock.cap_ipc_lock = false;  // 8 MiB applies: three buffers of 2 MiB
  lock.applies = true;
  lock.bytes = lock.rlimit;
  u = profile::choose_pool(c, 4, 3, lock);
  EXPECT_EQ(u.buffers, 3u);
  EXPECT_EQ(u.buffer_size, 2ull << 20);
  EXPECT_NE(u.reason.find("RLIMIT_MEMLOCK"), std::string::npos) << u.reason;
  lock.bytes = lock.rlimit = 1ull << 30;  // room for the configured 256 MiB
  u = profile::choose_pool(c, 4, 3, lock);
  EXPECT_EQ(u.buffers, 4u);
  EXPECT_EQ(u.buffer_size, 64ull << 20);
}
