// The planner and the engine agree: for several configs the engine is built (in-process ranks, the
// host-emulated device, every device allocation counted) and trained for two steps the way a loop
// does (gradients handed in tensor by tensor in backward order; at stage 3 one gather() per
// tensor, released after use), and what it holds equals `strata plan`'s per-rank figures for the
// same config, within padding (partition and tensor alignment, 4096-byte buffer padding, the
// 1024-element rounding of fractions):
//   - after finalize(): the TierStore's bytes per tier and per kind of state (parameters,
//     gradients, optimizer state with its FP32 master — fp32 parameters included), the pinned
//     pool (present exactly when the plan counts one), the runtime buffers (the norm exchange);
//   - finalize()'s device peak: gpu model state + norm + the broadcast staging;
//   - after the second step's backward: the rt.* buffers = the plan's buckets + receive buffers +
//     norm, and as many rt.bucket.<n> / rt.recv.<n> buffers as the plan counts;
//   - the second step's device peak: gpu model state + the plan's step runtime (buckets, receive,
//     norm, DeviceAdam scratch; stage 3: the gathered layers and send slices, no more than the plan
//     says on any rank, and at least one whole layer on the fullest rank where layers are equal);
//   - nothing exceeds a budget; and a gpu budget below the plan's figure by one bucket fails the
//     engine as the plan says (Error(kBudget)), while the plan's figure itself suffices.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <numeric>

#include "../comm/comm_test_util.hpp"
#include "engine_basics.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "strata/plan.hpp"
#include "test_util.hpp"
#include "zero/engine_access.hpp"

namespace strata::testing {
namespace {

// Counts the device memory a rank allocates (the TierStore's gpu copies, DeviceAdam's scratch:
// every device byte goes through Device::alloc), with a peak that can be restarted.
// Thread-safety: alloc/free from any thread (the store's movers), guarded by mu_.
class CountingDevice final : public DeviceWrapper {
 public:
  explicit CountingDevice(std::unique_ptr<Device> inner) : DeviceWrapper(std::move(inner)) {}
  void* alloc(std::size_t bytes) override {
    void* p = DeviceWrapper::alloc(bytes);
    std::lock_guard lock(mu_);
    sizes_[p] = bytes;
    current_ += bytes;
    peak_ = std::max(peak_, current_);
    return p;
  }
  void free(void* ptr) noexcept override {
    {
      std::lock_guard lock(mu_);
      if (auto it = sizes_.find(ptr); it != sizes_.end()) {
        current_ -= it->second;
        sizes_.erase(it);
      }
    }
    DeviceWrapper::free(ptr);
  }

  std::uint64_t peak() const {
    std::lock_guard lock(mu_);
    return peak_;
  }
  void restart_peak() {
    std::lock_guard lock(mu_);
    peak_ = current_;
  }

 private:
  mutable std::mutex mu_;
  std::map<void*, std::size_t> sizes_;    // GUARDED_BY(mu_)
  std::uint64_t current_ = 0, peak_ = 0;  // GUARDED_BY(mu_)
};

struct AgreeCase {
  const char* name;
  int stage, world;
  OffloadTarget opt, grads, params;
  DType pdt, gdt;
  std::vector<std::size_t> sizes;  // tensors; each is one layer (one gather() call at stage 3)
  bool largest_layer = false;      // model.largest_layer = the largest tensor
  bool update_on_device = false;   // optimizer.update: device
  bool equal_layers = false;       // stage 3: the fullest rank gathers between one and two layers
  std::uint64_t bucket = 0;        // zero.reduce_bucket_size; 0 = kBucket (several buckets)
  bool accum_fp32 = false;         // precision.grad_accum fp32: 16-bit gradients held in FP32
  // optimizer.overlap: off (the default) on one rank fills the gradient chunks straight from the
  // hand-ins (no bucket buffer: plan's hand_in_to_chunks); auto keeps the buckets (the state on
  // the gpu: nothing is speculated).
  OptimizerOverlap overlap = OptimizerOverlap::kOff;
};

std::string agree_name(const ::testing::TestParamInfo<AgreeCase>& i) { return i.param.name; }

constexpr std::uint64_t kPage = 4096;
constexpr std::uint64_t kBucket = 200'000;  // zero.reduce_bucket_size: several buckets

// The elements a placement puts off the gpu, as the plan rounds them.
std::uint64_t share_of(std::uint64_t elements, const OffloadTarget& t) {
  return static_cast<std::uint64_t>(std::llround(static_cast<double>(elements) * t.fraction));
}

std::vector<std::size_t> uneven(std::size_t total) {
  return {total / 2 + 3, total / 3, total - (total / 2 + 3) - total / 3};
}

Config case_config(const AgreeCase& c, const std::string& swap_dir) {
  Config cfg;
  cfg.model.parameters = std::accumulate(c.sizes.begin(), c.sizes.end(), std::uint64_t{0});
  if (c.largest_layer) cfg.model.largest_layer = *std::max_element(c.sizes.begin(), c.sizes.end());
  cfg.world.ranks = static_cast<std::uint32_t>(c.world);
  cfg.world.ranks_per_node = static_cast<std::uint32_t>(c.world);
  cfg.zero.stage = c.stage;
  cfg.zero.sub_group_size = 400'000;
  cfg.zero.reduce_bucket_size = c.bucket ? c.bucket : kBucket;
  cfg.precision.params = c.pdt;
  cfg.precision.grads = c.gdt;
  if (c.accum_fp32) cfg.precision.grad_accum = DType::kFp32;
  cfg.offload.optimizer = c.opt;
  cfg.offload.gradients = c.grads;
  cfg.offload.params = c.params;
  if (c.update_on_device) cfg.optimizer.update = OptimizerUpdate::kDevice;
  cfg.optimizer.overlap = c.overlap;
  cfg.tiers.gpu.budget = 256ULL << 20;
  cfg.tiers.host.budget = 512ULL << 20;
  cfg.tiers.host.pinned_budget = 64ULL << 20;
  use_test_swap(cfg, swap_dir, 3, 1 << 20);
  cfg.runtime.device = DeviceKind::kHost;
  cfg.runtime.cpu_threads = 1;
  cfg.runtime.collective_timeout_s = 60;
  return cfg;
}

// What one rank saw.
struct RankSeen {
  zero::StorageReport after_finalize, after_backward;
  std::size_t chunks = 0;
  std::uint64_t finalize_peak = 0, step_peak = 0;
  std::uint64_t bucket_buffers = 0, recv_buffers = 0;  // made by the gradient reducer
  ScratchStats scratch_after_backward;                 // the runtime scratch then
};

// One rank: finalize, two steps of a loop (forward gathers at stage 3, backward in reverse order).
RankSeen run_rank(const Config& cfg, const std::vector<std::size_t>& sizes, Communicator& comm) {
  RankSeen seen;
  CountingDevice* dev = nullptr;
  Engine e(cfg, comm);
  std::vector<TensorId> ids;
  for (std::size_t t = 0; t < sizes.size(); ++t)
    ids.push_back(e.add_parameter(strata::strcat("t", t), std::vector<float>(sizes[t], 0.25f)));
  zero::EngineAccess::set_storage_wrap(e,
                                       {[&](std::unique_ptr<Device> d) -> std::unique_ptr<Device> {
                                          auto c = std::make_unique<CountingDevice>(std::move(d));
                                          dev = c.get();
                                          return c;
                                        },
                                        nullptr});
  e.finalize();
  seen.finalize_peak = dev->peak();
  seen.after_finalize = zero::EngineAccess::report(e);
  seen.chunks = zero::EngineAccess::chunks(e).size();
  const std::size_t ges = dtype_size(cfg.precision.grads);
  for (int step = 0; step < 2; ++step) {
    if (step == 1) dev->restart_peak();  // buckets exist from the first step on
    for (TensorId id : ids) {            // forward
      e.gather({&id, 1});
      e.release({&id, 1});
    }
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) {  // backward
      const TensorId id = *it;
      e.gather({&id, 1});
      std::vector<unsigned char> g(sizes[id] * ges, 0);  // zeros: finite in every dtype
      e.set_gradient_host(id, g.data());
      e.release({&id, 1});
    }
    if (step == 1) {
      seen.after_backward = zero::EngineAccess::report(e);
      const zero::ReducerBuffers made = zero::EngineAccess::reducer_buffers(e);
      seen.bucket_buffers = made.buckets;
      seen.recv_buffers = made.receives;
      seen.scratch_after_backward = zero::EngineAccess::scratch(e);
    }
    EXPECT_TRUE(e.step().applied);
  }
  seen.step_peak = dev->peak();
  return seen;
}

class PlanAgreement : public ::testing::TestWithParam<AgreeCase> {};

TEST_P(PlanAgreement, EngineHoldsWhatThePlanSays) {
  const AgreeCase c = GetParam();
  TempDir dir("strata-agree");
  const Config cfg = case_config(c, dir.str());
  const Plan plan = make_plan(cfg);
  const Layout& l = plan.configured;
  const RuntimeBuffers& rt = l.runtime;
  ASSERT_TRUE(l.fits()) << "the test's budgets must hold the plan";

  auto comms = make_inprocess_communicators(c.world, 60.0);
  std::vector<RankSeen> seen(static_cast<std::size_t>(c.world));
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    seen[static_cast<std::size_t>(rank)] = run_rank(cfg, c.sizes, comm);
  }));

  const BytesPerParam b = bytes_per_param(cfg.precision);
  EXPECT_EQ(b.optimizer(), 12u) << "the engine keeps master | m | v in FP32 for every dtype";
  // ... except state in memory whose master weights are the FP32 parameters (stages 0-2 with
  // optimizer.overlap off, as here; the host device): the moments only.
  const std::uint64_t off =
      c.opt.tier == Tier::kGpu ? 0 : share_of(l.footprint.optimizer_elements, c.opt);
  const bool aliased = c.stage <= 2 && c.pdt == DType::kFp32 &&
                       (c.opt.tier != Tier::kNvme || off < l.footprint.optimizer_elements);
  EXPECT_EQ(l.master_in_params, aliased);
  if (aliased) {
    EXPECT_EQ(l.on_gpu.optimizer, (l.footprint.optimizer_elements - off) * b.moments);
    if (c.opt.tier == Tier::kCpu) {
      EXPECT_EQ(l.on_host.optimizer, off * b.moments);
    }
  }
  const StateBytes* plan_tier[3] = {&l.on_gpu, &l.on_host, &l.on_nvme};
  // Padding: the flat space's alignment (tensor and partition alignment), each placement's
  // 1024-element rounding.
  const std::uint64_t align_elems =
      c.sizes.size() * Partition::kDefaultTensorAlign +
      static_cast<std::uint64_t>(c.world) * Partition::kDefaultPartitionAlign + 1024;
  std::uint64_t gather_peak_max = 0;
  for (int r = 0; r < c.world; ++r) {
    SCOPED_TRACE(strata::strcat("rank ", r));
    const RankSeen& s = seen[static_cast<std::size_t>(r)];
    const zero::StorageReport& rep = s.after_finalize;
    const std::uint64_t chunk_pad = (s.chunks + 1) * kPage;  // each chunk buffer padded to 4096 B

    // Model state per tier and kind.
    const std::uint64_t bpe[3] = {b.params, b.grads, b.optimizer()};
    std::uint64_t gpu_state_slack = 0;
    for (int t = 0; t < 3; ++t) {
      const std::uint64_t want[3] = {plan_tier[t]->params, plan_tier[t]->grads,
                                     plan_tier[t]->optimizer};
      for (int k = 0; k < 3; ++k) {
        const std::uint64_t slack = align_elems * bpe[k] + chunk_pad;
        if (t == 0) gpu_state_slack += slack;
        EXPECT_NEAR(static_cast<double>(rep.bytes[t][k]), static_cast<double>(want[k]),
                    static_cast<double>(slack))
            << tier_name(static_cast<Tier>(t)) << " tier, "
            << (k == 0   ? "parameters"
                : k == 1 ? "gradients"
                         : "optimizer state");
      }
    }
    const std::uint64_t gpu_state = rep.bytes[0][0] + rep.bytes[0][1] + rep.bytes[0][2];

    // The pinned pool: there exactly when the plan counts it; as large, within a page per buffer.
    EXPECT_EQ(rep.pool > 0, l.pool.used) << l.pool.why;
    EXPECT_NEAR(static_cast<double>(rep.pool), static_cast<double>(l.pool.bytes()),
                static_cast<double>(l.pool.buffers * kPage));

    // Runtime buffers after finalize(): the norm exchange (the broadcast's staging given back).
    EXPECT_EQ(rep.bytes[0][3], rt.norm);

    // finalize(): gpu state + norm + the broadcast's staging piece (nothing else on the device).
    EXPECT_NEAR(static_cast<double>(s.finalize_peak),
                static_cast<double>(l.on_gpu.total() + rt.norm + rt.staging),
                static_cast<double>(gpu_state_slack + 2 * kPage));

    // After the second backward: the buckets, their receive buffers and the norm, no more. The
    // third receive buffer exists only when a share's copy out was still running when the next
    // collective needed one (timing): the plan counts it (an upper bound), the engine may not.
    // One rank (gradients not on nvme) has no collective: a bucket buffer is its own receive
    // buffer, one per bucket up to a cap of six (made in the first backward), as many as the plan
    // counts, and no receive buffer.
    // One rank with optimizer.overlap off fills the chunks straight from the hand-ins: neither.
    const bool own_recv = c.world == 1 && c.stage >= 2 && c.grads.tier != Tier::kNvme;
    const bool direct = own_recv && c.overlap == OptimizerOverlap::kOff;
    const std::uint64_t recv_each = rt.receive_count ? rt.receive / rt.receive_count : 0;
    const std::uint64_t buffers = rt.buckets + s.recv_buffers * recv_each;
    if (direct) {
      EXPECT_EQ(s.bucket_buffers, 0u) << "one rank, nothing speculated: no bucket buffer";
      EXPECT_EQ(s.recv_buffers, 0u);
      EXPECT_EQ(rt.bucket_count, 0u);
      EXPECT_EQ(rt.buckets + rt.receive, 0u);
    } else if (own_recv) {
      EXPECT_EQ(s.recv_buffers, 0u);
      EXPECT_EQ(rt.receive_count, 0u);
      EXPECT_EQ(s.bucket_buffers, rt.bucket_count);
    } else {
      EXPECT_EQ(s.bucket_buffers, rt.bucket_count);
      EXPECT_LE(s.recv_buffers, rt.receive_count);
      EXPECT_GE(s.recv_buffers, std::min<std::uint64_t>(rt.receive_count, 2));
    }
    // The runtime scratch live after the backward (blocks given back and kept for reuse, e.g. the
    // released gathers, are reported but not live: they are part of the peak below).
    const std::uint64_t rt_now = s.after_backward.bytes[0][3] - s.scratch_after_backward.kept_bytes;
    EXPECT_EQ(rt_now, s.scratch_after_backward.live_bytes + rt.norm);
    EXPECT_NEAR(static_cast<double>(rt_now), static_cast<double>(buffers + rt.norm),
                static_cast<double>((rt.bucket_count + 1) * kPage +
                                    rt.receive_count * (align_elems * b.grads + kPage)));

    // The second step's device peak: gpu state + the plan's step runtime. Stage 3's gathers: what
    // remains of the peak above state and the buffers after the backward.
    const std::uint64_t held = gpu_state + rt_now;
    const std::uint64_t gathers = s.step_peak - std::min(s.step_peak, held);
    if (c.stage == 3) {
      EXPECT_LE(gathers, rt.gathered + rt.send + 4 * kPage + rt.adam_scratch + rt.update_slots);
      gather_peak_max = std::max(gather_peak_max, gathers);
    } else {
      // The step's scratch: the device update's copy, or its slots for gpu state's parts off it.
      EXPECT_NEAR(static_cast<double>(gathers),
                  static_cast<double>(rt.adam_scratch + rt.update_slots), 4.0 * 256);
    }
    EXPECT_LE(s.step_peak, l.on_gpu.total() + rt.step() + gpu_state_slack +
                               (rt.bucket_count + rt.receive_count + 5) * kPage);

    // TierStore usage = state + pool + runtime, within every budget.
    std::uint64_t host_state = 0;
    for (int k = 0; k < 4; ++k) host_state += rep.bytes[1][k];
    EXPECT_EQ(rep.used[1], host_state + rep.pool);
    for (int t = 0; t < 3; ++t)
      EXPECT_LE(rep.used[t], rep.budget[t]) << tier_name(static_cast<Tier>(t));
  }
  if (c.equal_layers) {
    // The fullest rank holds one whole layer and its send slice while it gathers, and a second
    // pair when the replayed prefetch of the next layer overlaps the current one. Whether (and how
    // far) it overlaps is timing, so the peak is asserted as a bound: at least one layer, never
    // more than the plan's two (rt.gathered + rt.send count both).
    const std::uint64_t one_layer = (rt.gathered + rt.send) / 2;
    EXPECT_GE(gather_peak_max + 4 * kPage, one_layer) << "no rank ever held a whole layer";
    EXPECT_LE(gather_peak_max, rt.gathered + rt.send + 4 * kPage) << "more than the plan's two";
  }
}

const OffloadTarget kGpu{Tier::kGpu, 1.0, false};
const OffloadTarget kCpuAll{Tier::kCpu, 1.0, false};
const OffloadTarget kNvmeAll{Tier::kNvme, 1.0, false};
const std::vector<std::size_t> kUneven = uneven(1'500'000);
const std::vector<std::size_t> kEqual(12, 125'000);  // 12 layers, each below the bucket

INSTANTIATE_TEST_SUITE_P(
    Configs, PlanAgreement,
    ::testing::Values(
        AgreeCase{"stage0_world2_no_offload", 0, 2, kGpu, kGpu, kGpu, DType::kFp16, DType::kFp16,
                  kUneven},
        AgreeCase{"stage1_world3_optimizer_nvme", 1, 3, kNvmeAll, kGpu, kGpu, DType::kBf16,
                  DType::kFp32, kUneven},
        AgreeCase{"stage2_world4_optimizer_nvme_gradients_cpu", 2, 4, kNvmeAll, kCpuAll, kGpu,
                  DType::kFp16, DType::kFp16, kUneven},
        AgreeCase{"stage2_world2_optimizer_cpu_half",
                  2,
                  2,
                  {Tier::kCpu, 0.5, false},
                  kGpu,
                  kGpu,
                  DType::kBf16,
                  DType::kBf16,
                  kUneven},
        AgreeCase{"stage2_world1_fp32_optimizer_cpu", 2, 1, kCpuAll, kGpu, kGpu, DType::kFp32,
                  DType::kFp32, kUneven},
        AgreeCase{"stage2_world2_optimizer_cpu_update_on_device", 2, 2, kCpuAll, kGpu, kGpu,
                  DType::kFp16, DType::kFp16, kUneven, false, true},
        AgreeCase{"stage3_world2_everything_nvme", 3, 2, kNvmeAll, kNvmeAll, kNvmeAll, DType::kBf16,
                  DType::kBf16, kUneven, true},
        AgreeCase{"stage3_world4_mixed",
                  3,
                  4,
                  {Tier::kNvme, 0.7, false},
                  kCpuAll,
                  {Tier::kNvme, 0.5, false},
                  DType::kFp16,
                  DType::kFp16,
                  kUneven,
                  true},
        AgreeCase{"stage3_world2_fp32_equal_layers_no_offload", 3, 2, kGpu, kGpu, kGpu,
                  DType::kFp32, DType::kFp32, kEqual, true, false, true},
        // A bucket larger than the model (DeepSpeed's 500M for a small model): one
        // buffer of the flat gradients' size, not of 500M elements.
        AgreeCase{"stage2_world3_bucket_larger_than_model", 2, 3, kCpuAll, kGpu, kGpu, DType::kFp16,
                  DType::kFp16, kUneven, false, false, false, 500'000'000},
        // The same on one rank (under optimizer.overlap auto, where one rank keeps its buckets):
        // one bucket buffer, its own receive buffer (not a second one).
        AgreeCase{"stage2_world1_bucket_larger_than_model", 2, 1, kGpu, kGpu, kGpu, DType::kFp32,
                  DType::kFp32, kUneven, false, false, false, 500'000'000, false,
                  OptimizerOverlap::kAuto},
        // One rank, five buckets: five buffers (below the cap of six).
        AgreeCase{"stage2_world1_five_buckets", 2, 1, kGpu, kCpuAll,
                  kGpu, DType::kBf16, DType::kBf16, kUneven, false, false, false, 320'000, false,
                  OptimizerOverlap::kAuto},
        // One rank, overlap off: the hand-ins go straight into the gradient chunks (on cpu,
        // converted and held in FP32; stage 3 on the gpu): no bucket buffer on either side.
        AgreeCase{"stage2_world1_bf16_hand_in_to_chunks_cpu", 2, 1, kCpuAll, kCpuAll, kGpu,
                  DType::kBf16, DType::kBf16, kUneven, false, false, false, 320'000, true},
        AgreeCase{"stage3_world1_fp32_hand_in_to_chunks", 3, 1, kCpuAll, kGpu, kCpuAll,
                  DType::kFp32, DType::kFp32, kUneven, true},
        // 16-bit gradients held in FP32 (precision.grad_accum): the flat gradients
        // (stage 0), the gradient chunks on nvme (stage 2) and cpu (stage 3).
        AgreeCase{"stage0_world2_fp16_accum_fp32", 0, 2, kGpu, kGpu, kGpu, DType::kFp16,
                  DType::kFp16, kUneven, false, false, false, 0, true},
        // State on the gpu, its gradients not: the device update stages them (update slots).
        AgreeCase{"stage2_world1_optimizer_gpu_gradients_nvme", 2, 1, kGpu, kNvmeAll, kGpu,
                  DType::kBf16, DType::kBf16, kUneven},
        AgreeCase{"stage2_world2_bf16_gradients_nvme_accum_fp32", 2, 2, kNvmeAll, kNvmeAll, kGpu,
                  DType::kBf16, DType::kBf16, kUneven, false, false, false, 0, true},
        AgreeCase{"stage3_world2_fp16_gradients_cpu_accum_fp32", 3, 2, kCpuAll, kCpuAll, kGpu,
                  DType::kFp16, DType::kFp16, kUneven, true, false, false, 0, true},
        // FP32 parameters on the host device at stages 0-1: the cpu share's master weights are
        // the parameters (8 bytes a parameter on cpu, not 12); half on cpu, the rest on the gpu
        // keeping its master.
        AgreeCase{"stage1_world2_fp32_optimizer_cpu_master_in_params", 1, 2, kCpuAll, kGpu, kGpu,
                  DType::kFp32, DType::kFp32, kUneven},
        AgreeCase{"stage0_world1_fp32_optimizer_cpu_half_master_in_params",
                  0,
                  1,
                  {Tier::kCpu, 0.5, false},
                  kGpu,
                  kGpu,
                  DType::kFp32,
                  DType::kFp32,
                  kUneven},
        // Half on nvme: that half keeps its master (12 bytes a parameter there), the rest not.
        AgreeCase{"stage1_world2_fp32_optimizer_nvme_half_master_in_params",
                  1,
                  2,
                  {Tier::kNvme, 0.5, false},
                  kGpu,
                  kGpu,
                  DType::kFp32,
                  DType::kFp32,
                  kUneven}),
    agree_name);

// The gpu verdict is the engine's: with tiers.gpu.budget at the plan's figure the engine trains;
// one gradient bucket less and the plan says "does not fit" and the engine fails with kBudget.
// With gradients in memory one rank reduces without a collective (a bucket buffer is its own
// receive buffer, one per bucket up to six, as the plan counts them); with gradients on nvme it
// reduces through receive buffers as several ranks do. The plan's figure is tight either way.
TEST(PlanAgreementBudget, GpuBudgetAtThePlansFigure) {
  for (const OffloadTarget& grads : {kGpu, kNvmeAll}) {
    SCOPED_TRACE(grads.tier == Tier::kNvme ? "gradients on nvme" : "gradients on the gpu");
    TempDir dir("strata-agree");
    AgreeCase c{"budget", 2, 1, kGpu, grads, kGpu, DType::kFp16, DType::kFp16, kUneven};
    c.overlap = OptimizerOverlap::kAuto;  // one rank's buckets (overlap off: none to take away)
    Config cfg = case_config(c, dir.str());
    const Plan p = make_plan(cfg);
    const std::uint64_t slack = 16 * kPage;  // buffer padding and alignment
    cfg.tiers.gpu.budget = p.configured.per_rank.gpu + slack;
    ASSERT_TRUE(make_plan(cfg).configured_fits());
    auto comms = make_inprocess_communicators(1, 30.0);
    rethrow_any(
        run_ranks(comms, [&](int, Communicator& comm) { (void)run_rank(cfg, c.sizes, comm); }));

    cfg.tiers.gpu.budget = p.configured.per_rank.gpu - kBucket * 2;  // one fp16 bucket less
    const Plan q = make_plan(cfg);
    EXPECT_FALSE(q.configured_fits());
    EXPECT_NE(q.configured_rung.verdict.find("runtime buffers"), std::string::npos)
        << q.configured_rung.verdict;
    try {
      rethrow_any(
          run_ranks(comms, [&](int, Communicator& comm) { (void)run_rank(cfg, c.sizes, comm); }));
      ADD_FAILURE() << "the engine trained in a gpu budget the plan says is too small";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kBudget) << e.what();
    }
  }
}

}  // namespace
}  // namespace strata::testing
