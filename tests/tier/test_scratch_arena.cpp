// ScratchArena: runtime scratch in device memory, counted against the gpu budget, reused within
// the peak it ever had live.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "strata/device_fault.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"
#include "tier/scratch_arena.hpp"
#include "tier/tier_store.hpp"
#include "tier_test_util.hpp"

using namespace strata;
namespace st = strata::testing;

namespace {

std::uint64_t gpu_used(const TierStore& s) { return s.usage(Tier::kGpu).used; }

// A repeating pattern (a step's buckets and gathers) allocates only in its first round; the arena
// never holds more than its peak live bytes; the budget counts live and kept blocks alike.
TEST(ScratchArena, ARepeatingPatternAllocatesOnlyOnce) {
  st::StoreRig rig;
  ScratchArena arena(*rig.store, *rig.device);
  const std::uint64_t base = gpu_used(*rig.store);
  const std::size_t sizes[] = {4096, 1000, 4096, 333};
  for (int round = 0; round < 3; ++round) {
    std::vector<Scratch> live;
    for (std::size_t s : sizes) {
      live.push_back(arena.take(s, "test"));
      std::memset(live.back().data(), round + 1, s);  // host-emulated device memory is writable
    }
    live.erase(live.begin());  // give one back mid-round, take another of its size
    live.push_back(arena.take(sizes[0], "test"));
    const ScratchStats st = arena.stats();
    EXPECT_EQ(st.allocations, 4u) << "round " << round;
    EXPECT_EQ(st.live_bytes, 4096u + 1000 + 4096 + 333);
    EXPECT_EQ(gpu_used(*rig.store) - base, st.live_bytes + st.kept_bytes);
  }
  const ScratchStats st = arena.stats();
  EXPECT_EQ(st.live_bytes, 0u);
  EXPECT_EQ(st.kept_bytes, st.peak_live_bytes);
  arena.trim();
  EXPECT_EQ(arena.stats().kept_bytes, 0u);
  EXPECT_EQ(gpu_used(*rig.store), base);
}

// Sizes that do not repeat: kept blocks are freed so that live + kept stays within the peak.
TEST(ScratchArena, KeptBlocksStayWithinThePeak) {
  st::StoreRig rig;
  ScratchArena arena(*rig.store, *rig.device);
  for (std::size_t s = 1000; s < 1100; ++s) {
    Scratch a = arena.take(s, "test");
    Scratch b = arena.take(2 * s, "test");
    const ScratchStats st = arena.stats();
    EXPECT_LE(st.live_bytes + st.kept_bytes, st.peak_live_bytes);
  }
  EXPECT_LE(arena.stats().kept_bytes, arena.stats().peak_live_bytes);
  EXPECT_GT(arena.stats().frees, 0u);
}

// Over the gpu budget: Error(kBudget) naming the scratch and the budget key, nothing held; kept
// blocks are given back first to make room.
TEST(ScratchArena, OverTheBudgetNamesTheScratchAndHoldsNothing) {
  st::RigOptions o;
  o.gpu_budget = 64 << 10;
  st::StoreRig rig(o);
  ScratchArena arena(*rig.store, *rig.device);
  { Scratch a = arena.take(24 << 10, "gradient bucket"); }  // kept
  Scratch b = arena.take(48 << 10, "gathered parameters");  // too small: freed to make room
  EXPECT_EQ(arena.stats().kept_bytes, 0u);
  try {
    (void)arena.take(32 << 10, "gradient receive buffer");
    FAIL() << "expected kBudget";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBudget) << e.what();
    EXPECT_NE(std::string(e.what()).find("scratch gradient receive buffer"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("tiers.gpu.budget"), std::string::npos) << e.what();
  }
  EXPECT_EQ(arena.stats().live_bytes, 48u << 10);
  EXPECT_EQ(gpu_used(*rig.store), 48u << 10);
}

// Varying requests one at a time (stage-3 gathers of single tensors): a kept block of another
// varying request that holds a request with little to spare serves it, so the loop allocates in its
// first round only; a block far larger than a request is not given to it.
TEST(ScratchArena, VaryingSizesReuseALargerKeptBlock) {
  st::StoreRig rig;
  ScratchArena arena(*rig.store, *rig.device);
  const std::size_t sizes[] = {12004, 28, 8480, 516, 4000, 4};
  for (int round = 0; round < 3; ++round) {
    for (std::size_t s : sizes) {
      Scratch a = arena.take(s, "test", true);
      EXPECT_GE(a.size(), s);
      std::memset(a.data(), round + 1, a.size());
    }
    EXPECT_EQ(arena.stats().allocations, 1u) << "round " << round;
    EXPECT_EQ(arena.stats().frees, 0u) << "round " << round;
  }
  arena.trim();
  { Scratch big = arena.take(std::size_t{8} << 20, "test", true); }  // kept
  Scratch small = arena.take(100, "test", true);
  EXPECT_EQ(small.size(), 100u) << "an 8 MiB block given to a 100-byte request";
  // A fixed-size request takes only a block of its own size.
  { Scratch g = arena.take(5000, "test", true); }  // kept
  Scratch fixed = arena.take(4000, "test");
  EXPECT_EQ(fixed.size(), 4000u);
}

// A failed device allocation: the device's error, nothing reserved.
TEST(ScratchArena, AFailedAllocationReservesNothing) {
  st::RigOptions o;
  o.fault_device = true;
  st::StoreRig rig(o);
  ScratchArena arena(*rig.store, *rig.device);
  const std::uint64_t base = gpu_used(*rig.store);
  rig.fdev->add_fault({DeviceFaultKind::kAllocFail, 1, 2});  // the take and its retry
  try {
    (void)arena.take(1000, "test");
    FAIL() << "expected kOutOfMemory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory) << e.what();
  }
  EXPECT_EQ(gpu_used(*rig.store), base);
  EXPECT_EQ(arena.stats().live_bytes, 0u);
  Scratch ok = arena.take(1000, "test");
  EXPECT_TRUE(ok);
}

}  // namespace
