// The gradient statistics computed ahead (zero/optimizer_step.hpp: AheadStats, StatsStream): the
// speculative update computes the statistics of the tiles that lie whole inside each chunk it
// updates, during the backward; the decision then adds them in their place and computes only the
// rest. The result must be bitwise one CpuAdam::grad_stats over the whole range — for chunks of
// uneven sizes (tiles across chunk edges, a short last tile), any subset of chunks known, pieces
// read or skipped — and a non-finite gradient in a known tile must still fail the check. And in
// the engine: speculated steps report the serial steps' norms and update bit for bit, with the
// decision taking tiles from the speculation.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "../comm/comm_test_util.hpp"
#include "engine_basics.hpp"
#include "strata/adam.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"
#include "zero/engine_access.hpp"
#include "zero/optimizer_step.hpp"

namespace strata::testing {
namespace {

using zero::AheadStats;
using zero::StatsStream;

constexpr std::size_t kTile = CpuAdam::kStatsTileElems;

// A gradient range cut into chunks: `offsets` as AheadStats keeps them.
struct Range {
  std::vector<float> g;
  std::vector<std::size_t> offsets{0};
};

Range make_range(std::mt19937_64& rng, const std::vector<std::size_t>& sizes) {
  Range r;
  for (std::size_t s : sizes) r.offsets.push_back(r.offsets.back() + s);
  r.g.resize(r.offsets.back());
  std::normal_distribution<float> d(0.0f, 0.5f);
  for (float& x : r.g) x = d(rng);
  return r;
}

// What OptimizerStep::compute_ahead does for chunk ci: its whole tiles (and the short last one).
void know_chunk(CpuAdam& adam, const Range& r, std::size_t ci, float inv, AheadStats& a) {
  if (a.known.empty()) {
    a.inv = inv;
    a.offsets = r.offsets;
    a.total = r.offsets.back();
    a.sums.assign(CpuAdam::tiles_of(a.total), 0.0);
    a.known.assign(a.sums.size(), 0);
  }
  const std::size_t begin = r.offsets[ci], end = r.offsets[ci + 1];
  const std::size_t first = (begin + kTile - 1) / kTile;
  const std::size_t stop = end == a.total ? CpuAdam::tiles_of(end) : end / kTile;
  if (stop <= first) return;
  std::vector<std::uint8_t> finite(stop - first);
  adam.grad_stats_tiles(r.g.data() + first * kTile, DType::kFp32,
                        std::min(stop * kTile, end) - first * kTile, a.sums.data() + first,
                        finite.data(), inv);
  for (std::size_t t = first; t < stop; ++t) a.known[t] = finite[t - first] ? 1 : 2;
}

// The decision's pass: chunks every tile of which is known are skipped, the others fed.
AdamGradStats decide(CpuAdam& adam, const Range& r, float inv, const AheadStats* a) {
  StatsStream s(adam, DType::kFp32, inv, a);
  for (std::size_t ci = 0; ci + 1 < r.offsets.size(); ++ci) {
    const std::size_t b = r.offsets[ci], n = r.offsets[ci + 1] - b;
    if (a && a->covers(b, n))
      s.skip(n);
    else
      s.feed(r.g.data() + b, n);
  }
  return s.finish();
}

std::uint64_t bits(double x) { return std::bit_cast<std::uint64_t>(x); }

TEST(StatsAhead, AnyChunksKnownGiveTheBitsOfOnePass) {
  std::mt19937_64 rng(test_seed("StatsAhead.AnyChunksKnown"));
  const float inv = 1.0f / 384.0f;
  // Uneven chunks (tiles across edges, one chunk inside a tile, a short last tile), aligned ones.
  for (const std::vector<std::size_t>& sizes :
       {std::vector<std::size_t>{3 * kTile + 5, 100, 2 * kTile - 105, kTile + 77, 4 * kTile + 999},
        std::vector<std::size_t>{2 * kTile, 3 * kTile, kTile, 2 * kTile + 1234},
        std::vector<std::size_t>{0, kTile, 0, 17}}) {
    const Range r = make_range(rng, sizes);
    CpuAdam adam(2);
    const AdamGradStats whole = adam.grad_stats(r.g.data(), DType::kFp32, r.g.size(), inv);
    const std::size_t chunks = sizes.size();
    for (std::uint32_t mask = 0; mask < (1u << chunks); ++mask) {
      AheadStats a;
      for (std::size_t ci = 0; ci < chunks; ++ci)
        if (mask & (1u << ci)) know_chunk(adam, r, ci, inv, a);
      const AdamGradStats got = decide(adam, r, inv, a.known.empty() ? nullptr : &a);
      EXPECT_TRUE(got.finite);
      EXPECT_EQ(bits(got.sum_sq), bits(whole.sum_sq)) << "chunks known: mask " << mask;
    }
  }
}

// An inf in a tile known ahead (the chunk is skipped, not read again) fails the check; so does
// one in a tile across a chunk edge, which is never known ahead.
TEST(StatsAhead, ANonFiniteKnownTileFailsTheCheck) {
  std::mt19937_64 rng(test_seed("StatsAhead.NonFinite"));
  const std::vector<std::size_t> sizes{2 * kTile, kTile + 300, 2 * kTile - 300};
  for (std::size_t at : {kTile + 7, 2 * kTile + 301, 3 * kTile + 250}) {
    Range r = make_range(rng, sizes);
    r.g[at] = std::numeric_limits<float>::infinity();
    CpuAdam adam(2);
    AheadStats a;
    for (std::size_t ci = 0; ci < sizes.size(); ++ci) know_chunk(adam, r, ci, 1.0f, a);
    EXPECT_FALSE(decide(adam, r, 1.0f, &a).finite) << "inf at " << at;
    EXPECT_FALSE(adam.grad_stats(r.g.data(), DType::kFp32, r.g.size()).finite);
  }
}

// Skipping what was not computed ahead is a bug of the caller, refused by name.
TEST(StatsAhead, SkippingAnUnknownRangeIsRefused) {
  std::mt19937_64 rng(test_seed("StatsAhead.Refused"));
  const Range r = make_range(rng, {kTile + 10, 2 * kTile});
  CpuAdam adam(1);
  AheadStats a;
  know_chunk(adam, r, 1, 1.0f, a);  // chunk 1's whole tiles: not the one across the edge
  StatsStream s(adam, DType::kFp32, 1.0f, &a);
  expect_error(ErrorCode::kInternal, "not known ahead", [&] { s.skip(kTile); });
  StatsStream none(adam, DType::kFp32, 1.0f);
  expect_error(ErrorCode::kInternal, "not known ahead", [&] { none.skip(kTile); });
}

// ---- the engine: the speculative update computes them, the decision uses them

const std::vector<std::size_t> kEngineSizes{70001, 90000, 33, 40000};  // ~100k elements per rank

// Two ranks at stage 2, state and gradients in host memory, chunks of 50000 elements (each holds
// one whole tile or two and cuts others), five steps; steps 1 and 3 clipped through
// clip_grad_norm (the coefficient is the norm's, the speculation rolled back), the others
// committed. Returns per rank: the parameters' bits, then each step's norm's bits.
std::vector<std::vector<std::uint64_t>> run_engine(bool overlap, const std::string& dir,
                                                   std::uint64_t* known_ahead) {
  auto comms = make_inprocess_communicators(2, 30.0);
  std::vector<std::vector<std::uint64_t>> out(2);
  std::vector<std::uint64_t> known(2, 0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Config cfg = small_engine_config(2, 30000, 50000, 30.0);
    use_reference_adamw(cfg);
    use_test_swap(cfg, dir, 3, 2 << 20);
    cfg.offload.optimizer = {Tier::kCpu, 1.0, false};
    cfg.offload.gradients = {Tier::kCpu, 1.0, false};
    cfg.optimizer.overlap = overlap ? OptimizerOverlap::kOn : OptimizerOverlap::kOff;
    Engine e(cfg, comm);
    for (std::size_t t = 0; t < kEngineSizes.size(); ++t)
      e.add_parameter(strcat("t", t), std::vector<float>(kEngineSizes[t], 0.5f));
    e.finalize();
    auto& mine = out[static_cast<std::size_t>(rank)];
    for (int step = 0; step < 5; ++step) {
      for (std::size_t t = kEngineSizes.size(); t-- > 0;) {
        std::mt19937 rng(static_cast<std::uint32_t>(1000 * step + 10 * t + rank));
        std::normal_distribution<float> d(0.0f, 1.0f);
        std::vector<float> g(kEngineSizes[t]);
        for (float& x : g) x = d(rng);
        e.set_gradient(t, g.data());
      }
      double norm = 0;
      if (step == 1 || step == 3) norm = e.clip_grad_norm(1e-3);
      const StepResult r = e.step();
      EXPECT_TRUE(r.applied);
      if (step != 1 && step != 3) norm = r.grad_norm;
      mine.push_back(std::bit_cast<std::uint64_t>(norm));
    }
    for (const auto& p : read_params(e, kEngineSizes))
      for (float x : p) mine.push_back(std::bit_cast<std::uint32_t>(x));
    known[static_cast<std::size_t>(rank)] = zero::EngineAccess::stats_tiles_known_ahead(e);
  }));
  *known_ahead = known[0] + known[1];
  return out;
}

TEST(StatsAhead, TheEnginesNormAndUpdateAreTheSerialOnes) {
  TempDir dir("strata-stats-ahead");
  std::uint64_t known_serial = 0, known_speculated = 0;
  const auto serial = run_engine(false, dir.str(), &known_serial);
  const auto speculated = run_engine(true, dir.str(), &known_speculated);
  EXPECT_EQ(known_serial, 0u);
  // Five steps x two ranks x the tiles that lie whole inside a chunk (at least one per chunk).
  EXPECT_GE(known_speculated, 10u) << "the decision never used the statistics computed ahead";
  for (std::size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(serial[r].size(), speculated[r].size());
    for (std::size_t i = 0; i < serial[r].size(); ++i)
      ASSERT_EQ(serial[r][i], speculated[r][i])
          << "rank " << r << (i < 5 ? " step norm " : " parameter bits ") << i;
  }
}

}  // namespace
}  // namespace strata::testing
