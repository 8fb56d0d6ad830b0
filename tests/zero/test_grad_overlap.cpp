// ZeRO-Offload's overlap at the engine's interface (stages 2-3, gradients on cpu or nvme, the
// host-emulated device): when a bucket's reduce-scatter completes, the rank's share is copied
// device→host (and spilled to NVMe) on the store's copy streams while the backward goes on.
//   - A share's device→host copy held back (WatchedDevice's gate): the set_gradient() calls of the
//     next buckets return while it is held; released, the step is bitwise the reference's.
//   - The held copy fails once released: the failure surfaces at the wait that observes it
//     (step(), or the set_gradient() that needs the copy's receive buffer), as Error(kDevice)
//     naming the gradient chunk, and the engine is failed for good.
//   - Every device→host copy delayed, 2 ranks, 2 steps: receive buffers are never reused while
//     their copy is in flight (bitwise the undelayed run).
// Each also with train.accumulate 2 (cases "_accumulate2"): the last micro-batch's shares are
// added into the chunks through the filler's staging buffer and a host function on its stream
// (tier/fill.hpp), held, failed and delayed the same way.
#include <gtest/gtest.h>

#include <bit>
#include <random>
#include <thread>

#include "../comm/comm_test_util.hpp"
#include "device_watch.hpp"
#include "engine_basics.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"
#include "zero/engine_access.hpp"
#include "zero/rank_storage.hpp"

namespace strata::testing {
namespace {

using namespace std::chrono_literals;

constexpr std::size_t kTensorsPerBucket = 8;
constexpr std::size_t kTensorElems = 256;
constexpr std::uint64_t kBucket = kTensorsPerBucket * kTensorElems;

Config overlap_config(int stage, Tier grads, const std::string& dir) {
  // Sub-groups of 1500 elements: chunks cut inside the buckets' shares.
  Config cfg = small_engine_config(stage, kBucket, 1500, 60.0);
  cfg.offload.optimizer = {Tier::kCpu, 1.0, false};
  cfg.offload.gradients = {grads, 1.0, false};
  cfg.offload.params = {stage == 3 ? Tier::kCpu : Tier::kGpu, 1.0, false};
  // Enough pool buffers for every gradient chunk one share touches: a filler that needs a pool
  // buffer while every one holds a chunk waits for the oldest chunk's copies (fill.hpp).
  use_test_swap(cfg, dir, 8, 16 << 10);
  return cfg;
}

// One rank with optimizer.overlap off on this device fills its gradient chunks straight from the
// hand-ins (plan's hand_in_to_chunks; test_zero.cpp, EngineGradientsInPlace); it takes the buckets
// tested here — a bucket its own share, copied out while the backward goes on — under overlap
// auto (and on a GPU). The state on the gpu then keeps the step serial (nothing to speculate):
// these tests are about the gradients' way.
Config one_rank_buckets(Config cfg) {
  cfg.optimizer.overlap = OptimizerOverlap::kAuto;
  cfg.offload.optimizer = {Tier::kGpu, 1.0, false};
  return cfg;
}

// One rank's engine (optionally on a WatchedDevice) and its gradients in device memory.
struct OverlapRank {
  std::unique_ptr<Engine> e;
  WatchedDevice* dev = nullptr;
  std::size_t tensors;
  std::vector<DeviceMemory> grads;

  OverlapRank(const Config& cfg, Communicator& comm, std::size_t buckets, bool watched)
      : tensors(buckets * kTensorsPerBucket) {
    e = std::make_unique<Engine>(cfg, comm);
    if (watched) {
      zero::StorageWrap w;
      w.device = [this](std::unique_ptr<Device> d) {
        auto f = std::make_unique<WatchedDevice>(std::move(d), std::make_shared<AllocationMap>());
        dev = f.get();
        return std::unique_ptr<Device>(std::move(f));
      };
      zero::EngineAccess::set_storage_wrap(*e, std::move(w));
    }
    for (std::size_t t = 0; t < tensors; ++t) {
      std::vector<float> init(kTensorElems);
      for (std::size_t i = 0; i < init.size(); ++i)
        init[i] = 0.5f - 0.001f * static_cast<float>((t * 31 + i) % 997);
      e->add_parameter(strcat("t", t), init);
    }
    e->finalize();
  }
  // The gradients of `step` in device memory (a host→device copy: not counted as device→host).
  void make_grads(int rank, int step) {
    grads.clear();
    auto s = e->device().create_stream();
    std::vector<std::vector<float>> host(tensors);
    for (std::size_t t = 0; t < tensors; ++t) {
      std::mt19937 rng(static_cast<std::uint32_t>(step * 1000 + rank * 100 + t));
      std::normal_distribution<float> d(0, 1);
      host[t].resize(kTensorElems);
      for (auto& x : host[t]) x = d(rng);
      grads.push_back(e->device().allocate(kTensorElems * sizeof(float)));
      s->memcpy_async(grads.back().get(), host[t].data(), kTensorElems * sizeof(float));
    }
    s->synchronize(30s);
  }
  // Backward call i (0-based): tensors in reverse order (the last bucket completes first).
  void backward_call(std::size_t i) {
    const TensorId id = tensors - 1 - i;
    e->gather({&id, 1});
    e->set_gradient(id, grads[id].get());
    e->release({&id, 1});
  }
  std::vector<std::vector<float>> params() {
    std::vector<std::vector<float>> out;
    for (TensorId id = 0; id < tensors; ++id) {
      e->gather({&id, 1});
      std::vector<float> p(kTensorElems);
      e->read_param(id, p);
      e->release({&id, 1});
      out.push_back(std::move(p));
    }
    return out;
  }
};

// Waits (bounded) until `cond` holds: a condition, not a timing assumption.
template <typename F>
bool eventually(F cond) {
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (!cond()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// With train.accumulate K > 1, the K - 1 micro-batches of `step` before its last (their own
// gradients); the last one's are make_grads(rank, step).
void micro_batches_before(OverlapRank& r, const Config& cfg, int rank, int step) {
  for (std::uint32_t mb = 0; mb + 1 < cfg.train.accumulate; ++mb) {
    r.make_grads(rank, 100 + 10 * step + static_cast<int>(mb));
    for (std::size_t i = 0; i < r.tensors; ++i) r.backward_call(i);
  }
}

// The unwatched engine's parameters after `steps` steps (one rank).
std::vector<std::vector<float>> reference(const Config& cfg, std::size_t buckets, int steps) {
  auto comms = make_inprocess_communicators(1, 60.0);
  OverlapRank r(cfg, *comms[0], buckets, false);
  for (int s = 0; s < steps; ++s) {
    micro_batches_before(r, cfg, 0, s);
    r.make_grads(0, s);
    for (std::size_t i = 0; i < r.tensors; ++i) r.backward_call(i);
    r.e->step();
  }
  return r.params();
}

struct OverlapCase {
  int stage;
  Tier grads;
  std::uint32_t accumulate = 1;  // > 1: the last micro-batch's shares are added (element-wise)
};

std::string overlap_name(const ::testing::TestParamInfo<OverlapCase>& i) {
  return strcat("stage", i.param.stage, "_grads_", tier_name(i.param.grads),
                i.param.accumulate > 1 ? strcat("_accumulate", i.param.accumulate) : "");
}

class GradOverlap : public ::testing::TestWithParam<OverlapCase> {};

// Four buckets of eight tensors. The share copy of the first bucket retired (the last one in
// flat order) is held: the calls of the next bucket return while it is held (the one that
// completes that bucket would need its receive buffer: the gate opens before it). Accumulating,
// the last micro-batch's shares are added into the chunks (through the filler's staging buffer
// and a host function on its stream): held the same way, in that micro-batch.
TEST_P(GradOverlap, TheBackwardGoesOnWhileAShareIsCopiedOut) {
  const OverlapCase c = GetParam();
  TempDir dir("strata-overlap");
  Config cfg = one_rank_buckets(overlap_config(c.stage, c.grads, dir.str()));
  cfg.train.accumulate = c.accumulate;
  const auto want = reference(cfg, 4, 2);
  auto comms = make_inprocess_communicators(1, 60.0);
  OverlapRank r(cfg, *comms[0], 4, true);
  ASSERT_NE(r.dev, nullptr);
  micro_batches_before(r, cfg, 0, 0);
  r.make_grads(0, 0);
  std::size_t from = 0;
  if (c.accumulate > 1) {  // the micro-batch before finishes its round here (its last copies)
    r.backward_call(0);
    from = 1;
  }
  r.dev->hold(1, 1, false);
  // The call that completes the third bucket retires the first (two collectives in flight at
  // most) and queues its share's copy: from then on the copy is held on its stream. Waiting for
  // it to get there is a condition, not a timing assumption (a loaded machine may run the mover
  // late).
  const std::size_t retiring_call = 3 * kTensorsPerBucket - 1;
  std::size_t after_queued = 0;  // calls made (and returned) with the held copy on its stream
  for (std::size_t i = from; i + 1 < r.tensors; ++i) {
    r.backward_call(i);
    if (i == retiring_call) {
      ASSERT_TRUE(eventually([&] { return r.dev->held_entered() == 1; }))
          << "the share's copy never reached its stream";
    }
    if (i > retiring_call) ++after_queued;
  }
  EXPECT_EQ(r.dev->held_entered(), 1u);
  EXPECT_FALSE(r.dev->gate_timed_out()) << "a set_gradient() waited for the held copy";
  EXPECT_GE(after_queued, kTensorsPerBucket - 2)
      << "set_gradient() calls that returned while the share was being copied";
  const std::uint64_t queued = r.dev->d2h_queued();  // the first share's pieces, one per chunk
  r.dev->open();
  r.backward_call(r.tensors - 1);
  r.e->step();
  EXPECT_GT(r.dev->d2h_queued(), queued);  // the other shares
  // A second step, nothing held.
  micro_batches_before(r, cfg, 0, 1);
  r.make_grads(0, 1);
  for (std::size_t i = 0; i < r.tensors; ++i) r.backward_call(i);
  r.e->step();
  EXPECT_FALSE(r.dev->gate_timed_out());
  expect_bitwise_equal(r.params(), want, "after the overlapped steps");
}

// One rank's bucket buffers are its receive buffers: it makes one per bucket (up to its cap) in
// the first backward, so a later step whose shares' copies out run slower makes none (a
// steady-state step allocates no device memory: tests/zero/ test_steady_state_cuda.cpp found a
// cudaMalloc there when the count followed the copies' speed).
TEST(GradOverlapSchedule, OneRankMakesItsBucketBuffersInTheFirstBackward) {
  TempDir dir("strata-overlap");
  const Config cfg = one_rank_buckets(overlap_config(2, Tier::kGpu, dir.str()));
  auto comms = make_inprocess_communicators(1, 60.0);
  OverlapRank r(cfg, *comms[0], 4, true);
  ASSERT_NE(r.dev, nullptr);
  r.make_grads(0, 0);
  for (std::size_t i = 0; i < r.tensors; ++i) r.backward_call(i);
  EXPECT_EQ(zero::EngineAccess::reducer_buffers(*r.e).buckets, 4u) << "one per bucket";
  r.e->step();
  // The second backward with the first share's copy held until its last gradient: every later
  // bucket finds the earlier buffers still copying.
  r.make_grads(0, 1);
  r.dev->hold(1, 1, false);
  for (std::size_t i = 0; i + 1 < r.tensors; ++i) r.backward_call(i);
  r.dev->open();
  r.backward_call(r.tensors - 1);
  EXPECT_EQ(zero::EngineAccess::reducer_buffers(*r.e).buckets, 4u) << "none made in step 2";
  r.e->step();
  EXPECT_FALSE(r.dev->gate_timed_out());
}

// A completed collective is retired (its share's copy started) at the next hand-in, not when a
// later bucket needs its slot: two ranks (one has no collective), the first bucket (the last in
// flat order, rank 1's) handed in, its collective completed (a barrier after it on the same
// communicator returned), the next call — one that completes no bucket — starts its share's copy.
// The share's chunks are then final early, which is what the speculative update starts from.
// (Retired lazily, the copy waited for the third bucket's issue: the wait below would end unmet.)
// fn(config, communicators) at stages 2 and 3: gradients on cpu, `world` in-process ranks.
template <class Fn>
void at_stages_2_and_3(int world, Fn&& fn) {
  for (int stage : {2, 3}) {
    SCOPED_TRACE(strcat("stage ", stage));
    TempDir dir("strata-overlap");
    auto comms = make_inprocess_communicators(world, 60.0);
    const Config cfg = overlap_config(stage, Tier::kCpu, dir.str());
    fn(world == 1 ? one_rank_buckets(cfg) : cfg, comms);
  }
}

TEST(GradOverlapSchedule, ACompletedCollectiveIsRetiredAtTheNextHandIn) {
  at_stages_2_and_3(2, [](const Config& cfg, auto& comms) {
    rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
      OverlapRank r(cfg, comm, 4, true);
      r.make_grads(rank, 0);
      const std::uint64_t before = r.dev->d2h_queued();
      for (std::size_t i = 0; i < kTensorsPerBucket; ++i) r.backward_call(i);
      comm.barrier();  // in order after the reduce-scatter: that one completed
      r.backward_call(kTensorsPerBucket);
      if (rank == 1) {  // the last bucket in flat order lies in rank 1's half
        EXPECT_TRUE(eventually([&] { return r.dev->d2h_queued() > before; }))
            << "the first bucket's share was not copied out at the next hand-in";
      }
      for (std::size_t i = kTensorsPerBucket + 1; i < r.tensors; ++i) r.backward_call(i);
      r.e->step();
    }));
  });
}

// One rank reduces without a collective: a bucket is its own reduce-scatter, and its share's copy
// starts at the hand-in that completes it (no later call is made before the wait below; with a
// collective it waited for the next hand-in). No reduce-scatter is issued. (That the values are
// the reduction's: every one-rank bitwise test against torch, e.g. the placement matrices.)
TEST(GradOverlapSchedule, OneRankSharesABucketAtTheHandInThatCompletesIt) {
  at_stages_2_and_3(1, [](const Config& cfg, auto& comms) {
    OverlapRank r(cfg, *comms[0], 4, true);
    r.make_grads(0, 0);
    const std::uint64_t before = r.dev->d2h_queued();
    for (std::size_t i = 0; i < kTensorsPerBucket; ++i) r.backward_call(i);
    EXPECT_TRUE(eventually([&] { return r.dev->d2h_queued() > before; }))
        << "the first bucket's share was not copied out at the hand-in that completed it";
    for (std::size_t i = kTensorsPerBucket; i < r.tensors; ++i) r.backward_call(i);
    r.e->step();
    EXPECT_EQ(r.e->stats().buckets_reduced, 4u);
    const CommStats st = comms[0]->stats();
    EXPECT_EQ(st.calls[static_cast<std::size_t>(CollectiveKind::kReduceScatter)], 0u);
  });
}

// A chunk whose gradient is a plain copy into a memory home goes to the speculative update at the
// hand-in that queued its copy: the store runs the update's read of the chunk after the copy, so
// nothing waits for it to complete (the update started a bucket late when it waited: the exposed
// time of strata bench step --backward grew by one bucket's update). One rank, stage 2, gradients
// on cpu: the first bucket (the last in flat order) completes the last chunk ([7500, 8192) in
// chunks of 1500), and its share's first copy is held; the update has that chunk before the copy
// is let go. (Waiting for completed fills, it had nothing: the held piece's ticket is below the
// chunk's.) Bitwise the unwatched engine.
TEST(GradOverlapSchedule, AChunkCopiedInTheStoresOrderIsSpeculatedBeforeTheCopyCompletes) {
  TempDir dir("strata-overlap");
  Config cfg = overlap_config(2, Tier::kCpu, dir.str());
  cfg.optimizer.overlap = OptimizerOverlap::kOn;
  const auto want = reference(cfg, 4, 1);
  auto comms = make_inprocess_communicators(1, 60.0);
  OverlapRank r(cfg, *comms[0], 4, true);
  r.make_grads(0, 0);
  r.dev->hold(1, 1, false);
  for (std::size_t i = 0; i < kTensorsPerBucket; ++i) r.backward_call(i);
  EXPECT_GT(zero::EngineAccess::speculation_bytes(*r.e), 0u)
      << "the completed chunk waited for its copy";
  EXPECT_TRUE(eventually([&] { return r.dev->held_entered() == 1; }));
  for (std::size_t i = kTensorsPerBucket; i + 1 < r.tensors; ++i) r.backward_call(i);
  r.dev->open();
  r.backward_call(r.tensors - 1);
  const StepResult res = r.e->step();
  EXPECT_EQ(res.committed_chunks, zero::EngineAccess::chunks(*r.e).size());
  EXPECT_FALSE(r.dev->gate_timed_out());
  expect_bitwise_equal(r.params(), want, "after the overlapped step");
}

// A committed speculative step writes each element of the state once (issue 49): the update
// writes a chunk's new state into its pending buffer, and the commit swaps that buffer in as the
// chunk's home copy (no copy back); the old home buffer is kept as the spare the next step's
// pending version reuses. One rank, stage 2, state on cpu, two steps: after each commit every
// chunk's home copy is the buffer its pending version was, and the second step's pending buffers
// are the first step's former home copies. Bitwise the serial engine.
TEST(GradOverlapSchedule, ACommitSwapsThePendingStateInWithoutACopy) {
  TempDir dir("strata-overlap");
  Config cfg = overlap_config(2, Tier::kCpu, dir.str());
  Config serial = cfg;
  serial.optimizer.overlap = OptimizerOverlap::kOff;
  const auto want = reference(serial, 4, 2);
  cfg.optimizer.overlap = OptimizerOverlap::kOn;
  auto comms = make_inprocess_communicators(1, 60.0);
  OverlapRank r(cfg, *comms[0], 4, false);
  TierStore& store = zero::EngineAccess::storage(*r.e).store();
  const std::vector<zero::Chunk>& chunks = zero::EngineAccess::chunks(*r.e);
  auto home = [&](BufferId id) {
    void* p = store.acquire(id, Tier::kCpu, Access::kRead);
    store.release(id, Tier::kCpu);
    return p;
  };
  std::vector<void*> last_home;  // the home copies before the last commit
  for (int s = 0; s < 2; ++s) {
    SCOPED_TRACE(s);
    std::vector<void*> before, pending;
    for (const zero::Chunk& c : chunks) before.push_back(home(c.opt));
    r.make_grads(0, s);
    for (std::size_t i = 0; i < r.tensors; ++i) r.backward_call(i);
    (void)r.e->optimizer_step();  // waits for the speculative jobs
    for (std::size_t ci = 0; ci < chunks.size(); ++ci) {
      ASSERT_TRUE(store.has_pending(chunks[ci].opt)) << "chunk " << ci;
      pending.push_back(store.pending_view(chunks[ci].opt));
      EXPECT_NE(pending[ci], before[ci]) << "chunk " << ci << ": out of place";
      if (s > 0) {
        EXPECT_EQ(pending[ci], last_home[ci]) << "chunk " << ci << ": the spare reused";
      }
    }
    const StepResult res = r.e->step();
    ASSERT_EQ(res.committed_chunks, chunks.size());
    for (std::size_t ci = 0; ci < chunks.size(); ++ci)
      EXPECT_EQ(home(chunks[ci].opt), pending[ci]) << "chunk " << ci << ": swapped in, not copied";
    last_home = before;
  }
  expect_bitwise_equal(r.params(), want, "after the committed steps");
}

// Several ranks make their bucket and receive buffers up to the caps strata plan counts
// (min(ceil(F / B), 3) each: two collectives in flight and one bucket being filled; two in flight
// and one share being copied out) in the first backward, and none after: how many a later step
// would need otherwise follows how fast the collectives complete and the shares are copied out
// (a steady-state step would allocate device memory). Two ranks, four buckets, two steps.
TEST(GradOverlapSchedule, SeveralRanksMakeTheirBucketAndReceiveBuffersInTheFirstBackward) {
  at_stages_2_and_3(2, [](const Config& cfg, auto& comms) {
    rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
      OverlapRank r(cfg, comm, 4, false);
      for (int s = 0; s < 2; ++s) {
        r.make_grads(rank, s);
        for (std::size_t i = 0; i < r.tensors; ++i) r.backward_call(i);
        const zero::ReducerBuffers b = zero::EngineAccess::reducer_buffers(*r.e);
        EXPECT_EQ(b.buckets, 3u) << "rank " << rank << " step " << s;
        EXPECT_EQ(b.receives, 3u) << "rank " << rank << " step " << s;
        r.e->step();
      }
    }));
  });
}

INSTANTIATE_TEST_SUITE_P(Cases, GradOverlap,
                         ::testing::Values(OverlapCase{2, Tier::kCpu}, OverlapCase{2, Tier::kNvme},
                                           OverlapCase{3, Tier::kCpu}, OverlapCase{3, Tier::kNvme},
                                           OverlapCase{2, Tier::kCpu, 2},
                                           OverlapCase{3, Tier::kNvme, 2}),
                         overlap_name);

// A failed engine takes no other step.
void expect_failed_for_good(OverlapRank& r, CallSite where = CallSite::current()) {
  expect_error(
      ErrorCode::kIo, "unusable after a failed call",
      [&] {
        r.make_grads(0, 5);
        for (std::size_t i = 0; i < r.tensors; ++i) r.backward_call(i);
        r.e->step();
      },
      where);
}

// `fn` (step(), or the set_gradient() that waits for the copy) reports the failed share copy.
template <class Fn>
void expect_copy_error(Fn&& fn, CallSite where = CallSite::current()) {
  const std::string msg = expect_error(ErrorCode::kDevice, "injected by the test", fn, where);
  if (!msg.empty()) {
    EXPECT_NE(msg.find("'grad."), std::string::npos) << msg;
  }
}

// One rank over a watched device whose first device->host share copy is held, then fails.
class GradOverlapFaults : public ::testing::TestWithParam<OverlapCase> {
 protected:
  // The rank with `buckets` buckets and its gradients made; the copy held. Accumulating: in the
  // last micro-batch, from its second call (`first_`) on, the first made here.
  OverlapRank& start(std::size_t buckets) {
    const OverlapCase c = GetParam();
    Config cfg = one_rank_buckets(overlap_config(c.stage, c.grads, dir_.str()));
    cfg.train.accumulate = c.accumulate;
    rank_ = std::make_unique<OverlapRank>(cfg, *comms_[0], buckets, true);
    micro_batches_before(*rank_, cfg, 0, 0);
    rank_->make_grads(0, 0);
    if (c.accumulate > 1) {
      rank_->backward_call(0);
      first_ = 1;
    }
    rank_->dev->hold(1, 1, true);
    return *rank_;
  }

  std::size_t first_ = 0;  // the tests' first backward call
  TempDir dir_{"strata-overlap"};
  std::vector<std::unique_ptr<Communicator>> comms_ = make_inprocess_communicators(1, 60.0);
  std::unique_ptr<OverlapRank> rank_;
};

// Three buckets: no set_gradient() needs the failing copy's receive buffer; the failure surfaces
// at step().
TEST_P(GradOverlapFaults, AFailedShareCopySurfacesAtStep) {
  OverlapRank& r = start(3);
  for (std::size_t i = first_; i < r.tensors; ++i)
    ASSERT_NO_THROW(r.backward_call(i)) << "call " << i;
  ASSERT_TRUE(eventually([&] { return r.dev->held_entered() == 1; }));
  r.dev->open();
  expect_copy_error([&] { r.e->step(); });
  EXPECT_FALSE(r.dev->gate_timed_out());
  expect_failed_for_good(r);
}

// Four buckets: the call that completes the last bucket needs a receive buffer, waits for the
// failed copy and reports it. With gradients in memory one rank issues no collective and takes no
// receive buffer (its buckets are their own shares): the failure surfaces at the next call that
// observes the filler's failure, that last hand-in or step() — one of them, never neither.
TEST_P(GradOverlapFaults, AFailedShareCopySurfacesAtTheSetGradientThatWaitsForIt) {
  OverlapRank& r = start(4);
  for (std::size_t i = first_; i + 1 < r.tensors; ++i)
    ASSERT_NO_THROW(r.backward_call(i)) << "call " << i;
  ASSERT_TRUE(eventually([&] { return r.dev->held_entered() == 1; }));
  r.dev->open();
  if (GetParam().grads == Tier::kNvme) {
    expect_copy_error([&] { r.backward_call(r.tensors - 1); });
  } else {
    expect_copy_error([&] {
      r.backward_call(r.tensors - 1);
      r.e->step();
    });
  }
  expect_failed_for_good(r);
}

INSTANTIATE_TEST_SUITE_P(Cases, GradOverlapFaults,
                         ::testing::Values(OverlapCase{2, Tier::kCpu}, OverlapCase{2, Tier::kNvme},
                                           OverlapCase{3, Tier::kNvme},
                                           OverlapCase{2, Tier::kCpu, 2},
                                           OverlapCase{3, Tier::kNvme, 2}),
                         overlap_name);

// Two ranks, every device→host copy delayed, eight buckets: a receive buffer reused while its
// share was still being copied would change the numbers.
TEST_P(GradOverlap, DelayedCopiesNeverLoseAShare) {
  const OverlapCase c = GetParam();
  TempDir dir("strata-overlap");
  Config cfg = overlap_config(c.stage, c.grads, dir.str());
  cfg.train.accumulate = c.accumulate;
  constexpr int kWorld = 2, kSteps = 2;
  constexpr std::size_t kBuckets = 8;
  std::vector<std::vector<std::vector<float>>> got(kWorld), want(kWorld);
  for (bool delayed : {false, true}) {
    auto comms = make_inprocess_communicators(kWorld, 60.0);
    auto& out = delayed ? got : want;
    rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
      OverlapRank r(cfg, comm, kBuckets, delayed);
      if (delayed) r.dev->delay_every_d2h(3ms);
      for (int s = 0; s < kSteps; ++s) {
        micro_batches_before(r, cfg, rank, s);
        r.make_grads(rank, s);
        for (std::size_t i = 0; i < r.tensors; ++i) r.backward_call(i);
        r.e->step();
      }
      out[static_cast<std::size_t>(rank)] = r.params();
    }));
  }
  for (int rank = 0; rank < kWorld; ++rank)
    expect_bitwise_equal(got[static_cast<std::size_t>(rank)], want[static_cast<std::size_t>(rank)],
                         strcat("rank ", rank, " with delayed copies"));
}

}  // namespace
}  // namespace strata::testing
