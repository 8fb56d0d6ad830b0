// Same numbers wherever the state lives: the Engine on the host-emulated device, for every
// placement of {optimizer, gradients, params} x {gpu, cpu, nvme} that a stage allows, stages 0-3,
// 1-4 in-process ranks, 10 steps of which two overflow (an inf, a NaN on the last rank: skipped
// everywhere), bitwise identical to the unsharded single-rank CpuAdam reference (the rank-ordered
// sum of the ranks' gradients, rounded to the gradient dtype as the collective does, grad_scale =
// 1 / (loss_scale * world), the dynamic loss scale backed off on each overflow). Plus: mixed
// fractions (part nvme, part gpu), 16-bit parameters and gradients with loss scaling, and several
// chunks per rank (a small pinned buffer) so the loop really streams. Every case is a named
// parameter (stage, placement, world, dtype).
#include <gtest/gtest.h>

#include "placement_util.hpp"
#include "strata/device.hpp"
#include "strata/log.hpp"
#include "zero/update_split.hpp"

namespace strata::testing {
namespace {

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
  std::vector<EngineStats> st(static_cast<std::size_t>(p.world));
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    const auto r = static_cast<std::size_t>(rank);
    got[r] = train(comm, p, dir.str(), &skipped[r], DeviceKind::kHost, &st[r]);
  }));
  std::uint64_t speculated = 0;
  for (const EngineStats& s : st) speculated += s.speculated_chunks;
  if (p.overlap) {
    EXPECT_GT(speculated, 0u) << "overlap on, yet no rank speculated a chunk";
  } else {
    EXPECT_EQ(speculated, 0u);
  }
  for (int r = 0; r < p.world; ++r) {
    EXPECT_EQ(skipped[static_cast<std::size_t>(r)], 2) << "rank " << r;
    const auto& g = got[static_cast<std::size_t>(r)];
    ASSERT_EQ(g.size(), want.size());
    for (std::size_t t = 0; t < g.size(); ++t)
      for (std::size_t i = 0; i < g[t].size(); ++i)
        ASSERT_EQ(std::bit_cast<std::uint32_t>(g[t][i]), std::bit_cast<std::uint32_t>(want[t][i]))
            << "rank " << r << " tensor " << t << " element " << i << ": " << g[t][i] << " vs "
            << want[t][i];
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, Placements, ::testing::ValuesIn(all_cases()), case_name);

// The speculative update against the serial one (overlap off) with clipping forced on chosen
// steps (clip_grad_norm before step(): every speculated chunk of those steps rolled back) besides
// the two overflow steps: bitwise identical parameters on every rank.
class Speculation : public ::testing::TestWithParam<Placement> {};

TEST_P(Speculation, BitwiseIdenticalToTheSerialStepWithClipping) {
  const Placement on = GetParam();
  Placement off = on;
  off.overlap = false;
  off.split = 0;  // the serial step on the CPU alone
  TempDir dir("strata-speculation");
  std::vector<std::vector<std::vector<float>>> got[2];
  EngineStats stats[2];
  for (int run = 0; run < 2; ++run) {
    const Placement& p = run ? on : off;
    auto comms = make_inprocess_communicators(p.world, 30.0);
    got[run].resize(static_cast<std::size_t>(p.world));
    std::vector<int> skipped(static_cast<std::size_t>(p.world), 0);
    std::vector<EngineStats> st(static_cast<std::size_t>(p.world));
    rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
      const auto r = static_cast<std::size_t>(rank);
      got[run][r] = train(comm, p, dir.str(), &skipped[r], DeviceKind::kHost, &st[r]);
    }));
    for (const EngineStats& s : st) stats[run].speculated_chunks += s.speculated_chunks;
  }
  // (Each rank checked its own counts in train(): five steps rolled back, 5 committed.)
  EXPECT_GT(stats[1].speculated_chunks, 0u);
  EXPECT_EQ(stats[0].speculated_chunks, 0u);
  for (int r = 0; r < on.world; ++r) {
    const auto& a = got[0][static_cast<std::size_t>(r)];
    const auto& b = got[1][static_cast<std::size_t>(r)];
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t t = 0; t < a.size(); ++t)
      for (std::size_t i = 0; i < a[t].size(); ++i)
        ASSERT_EQ(std::bit_cast<std::uint32_t>(a[t][i]), std::bit_cast<std::uint32_t>(b[t][i]))
            << "rank " << r << " tensor " << t << " element " << i;
  }
}

std::vector<Placement> clip_cases() {
  std::vector<Placement> v;
  for (const Placement& s :
       std::initializer_list<Placement>{{2, Tier::kCpu, Tier::kGpu, Tier::kGpu, 1.0, 2},
                                        {2, Tier::kNvme, Tier::kCpu, Tier::kGpu, 1.0, 1},
                                        {3, Tier::kNvme, Tier::kCpu, Tier::kNvme, 1.0, 3},
                                        {3, Tier::kCpu, Tier::kGpu, Tier::kCpu, 1.0, 4}}) {
    v.push_back(s);
    v.back().accumulate = 1 + static_cast<int>(v.size()) % 3;
    v.back().overlap = v.back().force_clip = true;
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Clip, Speculation, ::testing::ValuesIn(clip_cases()), case_name);

// The update shared between the CPU and the device (zero/update_split.hpp; optimizer.update auto
// on a GPU): every forced assignment — all CPU, all device, alternating chunks, the chunks final
// last on the device, a share inside every chunk — speculated or serial, bitwise the serial CPU
// step (stages 2-3, 1-4 ranks, accumulation, clipping forced, the overflow steps, state on cpu and
// nvme). The device here is the host-emulated one (its Adam: CpuAdam on the stream's worker).
std::vector<Placement> split_cases() {
  std::vector<Placement> v;
  for (const Placement& c : clip_cases())
    for (int split = 1; split <= 5; ++split) {
      v.push_back(c);
      v.back().split = split;
    }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Split, Speculation, ::testing::ValuesIn(split_cases()), case_name);

// The serial step alone with the update shared (overlap off), against the unsharded reference.
std::vector<Placement> serial_split_cases() {
  std::vector<Placement> v;
  for (const Placement& s :
       std::initializer_list<Placement>{{1, Tier::kCpu, Tier::kGpu, Tier::kGpu, 1.0, 1},
                                        {1, Tier::kNvme, Tier::kGpu, Tier::kGpu, 1.0, 2},
                                        {2, Tier::kNvme, Tier::kCpu, Tier::kGpu, 1.0, 3},
                                        {3, Tier::kCpu, Tier::kCpu, Tier::kNvme, 1.0, 2}})
    for (int split : {2, 3, 5}) {
      v.push_back(s);
      v.back().split = split;
    }
  return v;
}

INSTANTIATE_TEST_SUITE_P(SerialSplit, Placements, ::testing::ValuesIn(serial_split_cases()),
                         case_name);

// optimizer.overlap: on where nothing can be speculated is refused at finalize(), naming why;
// auto there trains serially.
TEST(Speculation, OnRefusedWhereUnsupported) {
  TempDir dir("strata-speculation");
  for (const Placement& base :
       std::initializer_list<Placement>{{1, Tier::kCpu, Tier::kGpu, Tier::kGpu, 1.0, 1},
                                        {2, Tier::kGpu, Tier::kGpu, Tier::kGpu, 1.0, 1},
                                        {2, Tier::kCpu, Tier::kNvme, Tier::kGpu, 1.0, 1}}) {
    Placement p = base;
    p.overlap = true;
    auto comms = make_inprocess_communicators(1, 30.0);
    Config cfg = placement_config(p, dir.str());
    {
      Engine e(cfg, *comms[0]);
      e.add_parameter("t", initial(0));
      expect_error(ErrorCode::kUnsupported, "optimizer.overlap: on is not supported",
                   [&] { e.finalize(); });
    }
    cfg.optimizer.overlap = OptimizerOverlap::kAuto;
    Engine e(cfg, *comms[0]);
    e.add_parameter("t", initial(0));
    e.finalize();
    std::vector<float> g(kSizes[0], 0.25f);
    e.set_gradient_host(0, g.data());
    const StepResult r = e.step();
    EXPECT_TRUE(r.applied);
    EXPECT_EQ(r.speculated_chunks, 0u);
  }
}

// A rank's range inside one reduce bucket becomes final all at once, at the last hand-in: overlap
// then hides nothing, and finalize() says so (on and auto, not off; not with smaller buckets).
TEST(Speculation, ARangeInOneBucketIsSaid) {
  TempDir dir("strata-speculation");
  Placement p{2, Tier::kCpu, Tier::kCpu, Tier::kGpu, 1.0, 1};
  p.overlap = true;
  struct Case {
    OptimizerOverlap overlap;
    std::uint64_t bucket;
    bool said;
  };
  for (const Case& c :
       {Case{OptimizerOverlap::kOn, 1 << 20, true}, Case{OptimizerOverlap::kAuto, 1 << 20, true},
        Case{OptimizerOverlap::kOff, 1 << 20, false}, Case{OptimizerOverlap::kOn, 1500, false}}) {
    Config cfg = placement_config(p, dir.str());
    cfg.optimizer.overlap = c.overlap;
    cfg.zero.reduce_bucket_size = c.bucket;
    auto comms = make_inprocess_communicators(1, 30.0);
    std::string logs;
    set_log_sink([&](LogLevel, std::string_view m) { logs += std::string(m) + "\n"; });
    {
      Engine e(cfg, *comms[0]);
      for (std::size_t t = 0; t < kSizes.size(); ++t)
        e.add_parameter("t" + std::to_string(t), initial(t));
      e.finalize();
    }
    set_log_sink(nullptr);
    const bool said = logs.find("lie in one bucket") != std::string::npos;
    EXPECT_EQ(said, c.said) << optimizer_overlap_name(c.overlap) << ", bucket " << c.bucket << ":\n"
                            << logs;
  }
}

// The split's share before and after measuring both sides (the rates decide: only bounds are
// timing-free), the window bound, the counts per side, and a forced share out of [0, 1] refused.
TEST(UpdateSplitUnit, SharesAreBoundedAndCounted) {
  auto device = make_host_device();
  zero::UpdateSplit auto_split(*device, 1, std::chrono::seconds(30), 600);
  EXPECT_EQ(auto_split.device_share(0, 1000), 250u) << "the first chunk: a quarter";
  EXPECT_EQ(auto_split.device_share(0, 4000), 600u) << "the window bounds the device's part";
  int device_runs = 0, cpu_runs = 0;
  auto_split.run(
      250, 1000, [&] { ++device_runs; }, [&] { ++cpu_runs; });
  EXPECT_EQ(device_runs, 1);
  EXPECT_EQ(cpu_runs, 1);
  EXPECT_EQ(auto_split.cpu_elements(), 750u);
  EXPECT_EQ(auto_split.device_elements(), 250u);
  EXPECT_LE(auto_split.device_share(1, 1000), 600u);
  zero::UpdateSplit forced(*device, 1, std::chrono::seconds(30), 1000,
                           [](std::size_t i) { return i == 0 ? 1.0 : 1.5; });
  EXPECT_EQ(forced.device_share(0, 1000), 1000u);
  expect_error(ErrorCode::kInternal, "share 1.5 of chunk 1", [&] { forced.device_share(1, 10); });
  // A CPU side that throws: the device's queued part is waited for, the error propagates.
  EXPECT_THROW(forced.run(
                   1, 2, [] {}, [] { fail(ErrorCode::kIo, "cpu side"); }),
               Error);
}

// The time left in the backward (issue 49, point 1): the device takes a chunk's work only where
// the CPU would not finish it, and what is queued behind it, before the backward ends — the least
// that lets both finish in time — and with no time left (or too little for both) the share with
// which both finish together. 1000 elements, CPU 100/s, device 300/s: together 750 on the device.
TEST(UpdateSplitUnit, TheDeviceTakesOnlyWhatTheCpuCannotFinishBeforeTheBackwardEnds) {
  using zero::split_elements;
  EXPECT_EQ(split_elements(1000, 100, 300, 0, 0), 750u) << "after the backward: together";
  EXPECT_EQ(split_elements(1000, 100, 300, -1, 0), 750u);
  EXPECT_EQ(split_elements(1000, 100, 300, 20, 0), 0u) << "the CPU alone has 20 s";
  EXPECT_EQ(split_elements(1000, 100, 300, 10, 0), 0u) << "exactly in time";
  EXPECT_EQ(split_elements(1000, 100, 300, 5, 0), 500u) << "the CPU does 500 in 5 s";
  EXPECT_EQ(split_elements(1000, 100, 300, 3, 0), 700u) << "700 on the device: 2.33 s";
  EXPECT_EQ(split_elements(1000, 100, 300, 2, 0), 750u) << "not even both in 2 s: together";
  // 300 elements queued behind take 3 of the 5 s: 2 s for this chunk, too little for both.
  EXPECT_EQ(split_elements(1000, 100, 300, 5, 300), 750u);
  EXPECT_EQ(split_elements(1000, 100, 300, 8, 300), 500u) << "5 s for this chunk";
  EXPECT_EQ(split_elements(1000, 100, 300, 5, 600), 750u) << "the queue outlasts the backward";
  EXPECT_EQ(split_elements(0, 100, 300, 5, 0), 0u);
}

}  // namespace
}  // namespace strata::testing
