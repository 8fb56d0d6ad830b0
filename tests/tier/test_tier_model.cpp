// Model-based randomized test: thousands of random register / move / prefetch / evict / acquire /
// write / read operations over the three tiers, several in flight at once, and the streaming
// read / write / zero against host and device memory, checked against a plain in-memory
// reference. Fixed seeds plus one random seed (printed; STRATA_TEST_SEED reproduces it).
// Also: concurrent users of one store (label tsan).
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>

#include "strata/error.hpp"
#include "test_util.hpp"
#include "tier/tier_store.hpp"
#include "tier_test_util.hpp"

using namespace strata;
using namespace std::chrono_literals;
namespace st = strata::testing;

namespace {

struct ModelBuf {
  BufferId id;
  std::string name;
  std::vector<std::uint8_t> ref;
  std::vector<Tier> allowed;
};

bool expected_failure(const Error& e) {
  // Budget refusals and refused evictions (only copy, nowhere lower) are legitimate outcomes.
  return e.code() == ErrorCode::kBudget || e.code() == ErrorCode::kInvalidArgument;
}

void run_model(std::uint64_t seed, int ops) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  st::RigOptions o;
  o.gpu_budget = 700 << 10;
  o.host_budget = (256 << 10) + (900 << 10);
  o.nvme_capacity = 4 << 20;
  o.direct_io = (seed & 1) ? DirectIoMode::kOff : DirectIoMode::kAuto;
  st::StoreRig rig(o);
  std::vector<ModelBuf> bufs;
  int registered = 0, successes = 0, failures = 0;
  auto pick_tier = [&](const ModelBuf& b) { return b.allowed[rng() % b.allowed.size()]; };
  auto check = [&](ModelBuf& b) {
    // Read it back from a random memory tier it may use.
    std::vector<Tier> mem;
    for (Tier t : b.allowed) {
      if (t != Tier::kNvme) mem.push_back(t);
    }
    const Tier t = mem[rng() % mem.size()];
    try {
      ASSERT_EQ(rig.read(b.id, t, b.ref.size()), b.ref) << b.name << " on " << tier_name(t);
    } catch (const Error& e) {
      ASSERT_TRUE(expected_failure(e)) << e.what();
    }
  };
  for (int op = 0; op < ops; ++op) {
    const int kind = bufs.size() < 3 ? 0 : int(rng() % 100);
    if (kind < 4 && bufs.size() < 8) {  // register
      ModelBuf b;
      b.name = "buf" + std::to_string(registered++);
      const std::uint64_t n = 1 + rng() % (160 << 10);
      const Tier home = st::kAllTiers[rng() % 3];
      b.allowed = {home};
      for (Tier t : st::kAllTiers) {
        if (t != home && rng() % 4) b.allowed.push_back(t);
      }
      if (b.allowed.size() == 1 && home == Tier::kNvme) b.allowed.push_back(Tier::kCpu);
      try {
        b.id = rig.store->register_buffer({b.name, n, DType::kFp32, home, b.allowed});
      } catch (const Error& e) {
        ASSERT_EQ(e.code(), ErrorCode::kBudget) << e.what();
        continue;
      }
      b.ref.assign(n, 0);
      bufs.push_back(std::move(b));
    } else if (kind < 6 && bufs.size() > 3) {  // unregister
      const std::size_t i = rng() % bufs.size();
      ASSERT_NO_FATAL_FAILURE(check(bufs[i]));
      rig.store->unregister_buffer(bufs[i].id);
      bufs.erase(bufs.begin() + i);
    } else if (kind < 25) {  // write a random range
      ModelBuf& b = bufs[rng() % bufs.size()];
      Tier t = pick_tier(b);
      if (t == Tier::kNvme) continue;
      const bool whole = rng() % 5 == 0;  // overwrite everything, without loading (kDiscard)
      const std::uint64_t at = whole ? 0 : rng() % b.ref.size();
      const std::uint64_t n = whole ? b.ref.size() : 1 + rng() % (b.ref.size() - at);
      auto fresh = st::random_bytes(n, rng());
      std::vector<std::uint8_t> next = b.ref;
      std::copy(fresh.begin(), fresh.end(), next.begin() + at);
      try {
        rig.write(b.id, t, next, at, n, whole);
        b.ref = std::move(next);
        ++successes;
      } catch (const Error& e) {
        ASSERT_TRUE(expected_failure(e)) << e.what();
        ++failures;
      }
    } else if (kind < 35) {  // read and compare
      ASSERT_NO_FATAL_FAILURE(check(bufs[rng() % bufs.size()]));
    } else if (kind < 48) {  // streaming: read / write a range against caller memory, or zero
      ModelBuf& b = bufs[rng() % bufs.size()];
      const BufferInfo info = rig.store->info(b.id);
      const int what = int(rng() % 3);
      const bool whole = info.home == Tier::kNvme || rng() % 4 == 0;
      const std::uint64_t at = whole ? 0 : rng() % b.ref.size();
      const std::uint64_t n = whole ? b.ref.size() : 1 + rng() % (b.ref.size() - at);
      const Tier mem = rng() % 2 ? Tier::kCpu : Tier::kGpu;  // the caller's memory
      st::CallerMemory cm(*rig.device, mem, rig.store->padded_bytes(b.id));
      try {
        if (what == 0) {
          rig.store->read(b.id, at, whole ? 0 : n, cm.data(), mem).wait(30s);
          auto got = cm.get(n);
          ASSERT_TRUE(
              std::equal(got.begin(), got.end(), b.ref.begin() + static_cast<std::ptrdiff_t>(at)))
              << b.name << " read [" << at << ", " << at + n << ") into " << tier_name(mem);
        } else if (what == 1) {
          auto fresh = st::random_bytes(n, rng());
          cm.put(fresh);
          rig.store->write(b.id, at, whole ? 0 : n, cm.data(), mem).wait(30s);
          std::copy(fresh.begin(), fresh.end(), b.ref.begin() + static_cast<std::ptrdiff_t>(at));
        } else {
          rig.store->zero(b.id).wait(30s);
          std::fill(b.ref.begin(), b.ref.end(), 0);
        }
        ++successes;
      } catch (const Error& e) {
        ASSERT_TRUE(expected_failure(e)) << e.what();
        ++failures;
      }
    } else {  // a burst of asynchronous moves, on random buffers (repeats included)
      std::vector<std::pair<Transfer, int>> inflight;
      const int burst = 1 + int(rng() % 4);
      for (int k = 0; k < burst; ++k) {
        ModelBuf& b = bufs[rng() % bufs.size()];
        const Tier t = pick_tier(b);
        const int what = int(rng() % 3);
        Transfer tr = what == 0   ? rig.store->move(b.id, t)
                      : what == 1 ? rig.store->prefetch(b.id, t)
                                  : rig.store->evict(b.id, t);
        inflight.emplace_back(tr, what);
      }
      for (auto& [tr, what] : inflight) {
        try {
          tr.wait(30s);
          ++successes;
        } catch (const Error& e) {
          ASSERT_TRUE(expected_failure(e)) << e.what();
          ++failures;
        }
      }
    }
    ASSERT_LE(rig.store->usage(Tier::kGpu).used, o.gpu_budget);
    ASSERT_LE(rig.store->usage(Tier::kCpu).used, o.host_budget);
  }
  for (auto& b : bufs) ASSERT_NO_FATAL_FAILURE(check(b));
  rig.store->wait_idle();
  EXPECT_GT(successes, ops / 4);
  EXPECT_EQ(rig.store->stats().checksum_failures, 0u);
  std::cerr << "[model] seed " << seed << ": " << successes << " ok, " << failures << " refused, "
            << rig.store->stats().bytes_to_nvme << " B to NVMe, "
            << rig.store->stats().writes_skipped_clean << " clean write-backs skipped\n";
}

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr int kOps = 500;  // sanitizer builds run 5-20x slower
#else
constexpr int kOps = 1500;
#endif

}  // namespace

TEST(TierModel, FixedSeeds) {
  run_model(1, kOps);
  run_model(2, kOps);
}

TEST(TierModel, RandomSeed) { run_model(st::test_seed("tier model"), kOps); }

TEST(TierModel, ConcurrentUsers) {
  st::RigOptions o;
  o.movers = 3;
  st::StoreRig rig(o);
  const std::uint64_t n = (96 << 10) + 5;
  auto shared_data = st::random_bytes(n, 99);
  auto shared = rig.store->register_buffer({"shared", n, DType::kFp16, Tier::kCpu, {}});
  rig.write(shared, Tier::kCpu, shared_data);
  std::atomic<int> mismatches{0};
  std::atomic<int> unexpected{0};
  std::vector<std::thread> threads;
  const std::uint64_t seed = st::test_seed("tier concurrency");
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      auto own = rig.store->register_buffer(
          {"own" + std::to_string(t), n - t * 1000, DType::kFp32, Tier::kNvme, {}});
      std::vector<std::uint8_t> ref(n - t * 1000, 0);
      for (int i = 0; i < 60; ++i) {
        try {
          const Tier tt = st::kAllTiers[rng() % 3];
          switch (rng() % 5) {
            case 0: {
              ref = st::random_bytes(ref.size(), rng());
              rig.write(own, tt == Tier::kNvme ? Tier::kCpu : tt, ref);
              break;
            }
            case 1: rig.store->move(own, tt).wait(30s); break;
            case 2:
              if (rig.read(own, tt == Tier::kNvme ? Tier::kGpu : tt, ref.size()) != ref)
                ++mismatches;
              break;
            case 3:
              if (rig.read(shared, tt == Tier::kNvme ? Tier::kCpu : tt, n) != shared_data)
                ++mismatches;
              break;
            case 4:
              try {
                rig.store->evict(shared, tt).wait(30s);  // may be pinned by another thread
              } catch (const Error& e) {
                if (e.code() != ErrorCode::kInvalidArgument) throw;
              }
              break;
          }
          (void)rig.store->info(own);
          (void)rig.store->usage(Tier::kCpu);
        } catch (const std::exception& e) {
          ++unexpected;
          ADD_FAILURE() << e.what();
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(unexpected.load(), 0);
  EXPECT_EQ(rig.read(shared, Tier::kGpu, n), shared_data);
}
