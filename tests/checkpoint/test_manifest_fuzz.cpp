// Issue 15.2 at the Engine: every byte of a manifest flipped, and the manifest truncated at every
// length: each variant either loads bitwise the checkpoint's state or fails on both ranks with a
// strata error (kChecksum / kInvalidArgument) naming manifest.json, the engine unchanged (FP32
// master, moments, parameters, optimizer step, step counters, loss scale).
// The engine is compared after every load that succeeds, and after each run of up to
// kFailuresPerSnapshot failed loads (and at the end): nothing but a load changes it between two
// comparisons, so a failed load that changed anything fails the next comparison, which names the
// variants it covers. (A comparison after every failed load was nine tenths of the test's time.)
#include <gtest/gtest.h>

#include <bit>
#include <filesystem>
#include <random>

#include "../comm/comm_test_util.hpp"
#include "checkpoint/ckpt_test_util.hpp"
#include "strata/build_info.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"
#include "zero/engine_basics.hpp"

namespace strata::testing {
namespace {

const std::vector<std::size_t> kFuzzSizes{300, 17, 0, 129};
constexpr int kFailuresPerSnapshot = 64;

Config small_config() {
  Config cfg = base_engine_config(2, 100, 64, 60.0);
  cfg.precision.params = DType::kBf16;
  return cfg;
}

void one_step(Engine& e, int rank, int step) {
  for (std::size_t t = kFuzzSizes.size(); t-- > 0;) {
    std::mt19937_64 rng(1000003ull * static_cast<std::uint64_t>(step) + 7919ull * t +
                        static_cast<std::uint64_t>(rank));
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> g(kFuzzSizes[t]);
    for (auto& x : g) x = d(rng);
    e.set_gradient(t, g.data());
  }
  e.step();
}

// Everything load_checkpoint may change, as bits.
std::vector<std::uint64_t> snapshot(Engine& e) {
  std::vector<std::uint64_t> s;
  for (std::size_t t = 0; t < kFuzzSizes.size(); ++t) {
    std::vector<float> v(kFuzzSizes[t]);
    for (StateKind k : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
      e.read_state(t, k, v);
      for (float x : v) s.push_back(std::bit_cast<std::uint32_t>(x));
    }
    e.read_param(t, v);
    for (float x : v) s.push_back(std::bit_cast<std::uint32_t>(x));
  }
  const EngineStats st = e.stats();
  s.push_back(static_cast<std::uint64_t>(e.optimizer_step()));
  s.push_back(st.steps);
  s.push_back(st.applied_steps);
  s.push_back(st.skipped_steps);
  s.push_back(std::bit_cast<std::uint64_t>(e.loss_scale()));
  return s;
}

// Runs every `stride`-th variant on `world` ranks: variants 0..n-1 flip byte v (one bit, cycling
// through the eight); n..2n-1 truncate the manifest to v - n bytes.
void fuzz(int world, std::size_t stride) {
  TempDir dir("strata-manifest-fuzz");
  const auto mpath = dir.path() / "manifest.json";
  auto comms = make_inprocess_communicators(world, 60.0);
  std::string manifest;
  std::vector<int> failures(static_cast<std::size_t>(world), 0),
      loads(static_cast<std::size_t>(world), 0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Engine e(small_config(), comm);
    for (std::size_t t = 0; t < kFuzzSizes.size(); ++t) {
      std::vector<float> init(kFuzzSizes[t]);
      for (std::size_t i = 0; i < init.size(); ++i)
        init[i] = static_cast<float>((i * 37 + t * 11) % 101) / 50.0f - 1;
      e.add_parameter("t" + std::to_string(t), init);
    }
    e.finalize();
    for (int s = 0; s < 4; ++s) one_step(e, rank, s);
    e.save_checkpoint(dir.str());
    const auto saved = snapshot(e);
    for (int s = 4; s < 6; ++s) one_step(e, rank, s);
    auto current = snapshot(e);
    ASSERT_NE(current, saved);
    if (rank == 0) manifest = read_file(mpath);
    if (world > 1) comm.barrier();
    const std::size_t n = manifest.size();
    std::size_t unchecked_from = 0;  // the first variant since the engine was last compared
    int unchecked = 0;               // failed loads since then
    auto engine_unchanged = [&](std::size_t last) {
      const bool same = snapshot(e) == current;
      EXPECT_TRUE(same) << "a variant in " << unchecked_from << ".." << last
                        << " failed but changed the engine";
      unchecked_from = last + 1;
      unchecked = 0;
      return same;
    };
    for (std::size_t v = 0; v < 2 * n; v += stride) {
      if (rank == 0) {
        std::string text = manifest;
        if (v < n)
          text[v] = static_cast<char>(text[v] ^ (1 << (v % 8)));
        else
          text.resize(v - n);
        write_file(mpath, text);
      }
      // (The snapshot's collectives keep rank 0 from rewriting the file before every rank read it.)
      if (world > 1) comm.barrier();
      try {
        e.load_checkpoint(dir.str());
        ++loads[static_cast<std::size_t>(rank)];
        ASSERT_EQ(snapshot(e), saved) << "variant " << v << " loaded another state";
        // (The failed loads since the last comparison go unchecked: a load that succeeds fails
        // the test anyway, below.)
        current = saved;
        unchecked_from = v + 1;
        unchecked = 0;
      } catch (const Error& err) {
        ++failures[static_cast<std::size_t>(rank)];
        const bool code_ok =
            err.code() == ErrorCode::kChecksum || err.code() == ErrorCode::kInvalidArgument;
        EXPECT_TRUE(code_ok) << "variant " << v << ": " << err.what();
        EXPECT_NE(std::string(err.what()).find("manifest.json"), std::string::npos) << err.what();
        if (++unchecked == kFailuresPerSnapshot && !engine_unchanged(v)) return;
      }
    }
    if (unchecked > 0 && !engine_unchanged(2 * n - 1)) return;
    // The engine still trains, and the intact manifest loads.
    if (world > 1) comm.barrier();
    if (rank == 0) write_file(mpath, manifest);
    if (world > 1) comm.barrier();
    e.load_checkpoint(dir.str());
    EXPECT_EQ(snapshot(e), saved);
    one_step(e, rank, 4);
  }));
  for (int r = 1; r < world; ++r) EXPECT_EQ(failures[static_cast<std::size_t>(r)], failures[0]);
  // The seal covers every byte: no variant loads.
  EXPECT_EQ(loads[0], 0);
  std::printf(
      "%d rank(s): %zu manifest bytes, every %zu-th of %zu variants: %d failed cleanly, %d "
      "loaded\n",
      world, manifest.size(), stride, 2 * manifest.size(), failures[0], loads[0]);
}

const bool kSanitized = !std::string(build::kSanitize).empty();

// Every variant on one rank (no collectives: fast); every 7th on two ranks, which must agree.
TEST(ManifestFuzz, EveryByteFlippedAndEveryTruncationLoadsAllOrNothing) {
  fuzz(1, kSanitized ? 3 : 1);
}
TEST(ManifestFuzz, TwoRanksFailTogether) { fuzz(2, kSanitized ? 31 : 7); }

}  // namespace
}  // namespace strata::testing
