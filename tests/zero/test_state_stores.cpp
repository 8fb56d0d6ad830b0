// The two host views of a rank's optimizer state that checkpoints stream through
// (zero/tier_state_store.hpp: the committed state; zero/pinned_state_store.hpp: a snapshot), on
// chunks of uneven sizes on NVMe with 4 MiB pieces (1 MiB check units): ranges across chunk
// edges read back exactly, with the next range prefetched or not, also when the prefetched range
// is not the one acquired next; a snapshot's views keep the pinned contents while the blocks are
// rewritten, a range prefetched before the rewrite included.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "../tier/tier_test_util.hpp"
#include "core/numeric.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"
#include "zero/pinned_state_store.hpp"
#include "zero/tier_state_store.hpp"

namespace strata::testing {
namespace {

using checkpoint::StateView;
using zero::Chunk;
using zero::ParamBlocks;
using zero::PinnedStateStore;
using zero::TierStateStore;

constexpr std::size_t kCounts[3] = {(700 << 10) + 3, (300 << 10) + 17, (520 << 10) + 5};
constexpr auto kTimeout = std::chrono::seconds(30);

RigOptions rig_options() {
  RigOptions o;
  o.pool_buffer_size = 4 << 20;
  o.nvme_capacity = 96 << 20;
  return o;
}

// Chunks of kCounts elements, each block master | m | v on NVMe, random; `truth` mirrors them.
struct StateRig {
  StateRig() : rig(rig_options()) {
    std::size_t begin = 0;
    for (std::size_t k = 0; k < 3; ++k) {
      Chunk c;
      c.r = {begin, kCounts[k]};
      c.opt_tier = Tier::kNvme;
      c.opt = rig.store->register_buffer({"opt." + std::to_string(k),
                                          3 * kCounts[k] * sizeof(float),
                                          DType::kFp32,
                                          Tier::kNvme,
                                          {}});
      chunks.push_back(c);
      truth.emplace_back();
      rewrite(k, 100 + k);
      begin += kCounts[k];
    }
  }
  // New random contents for chunk k.
  void rewrite(std::size_t k, std::uint64_t seed) {
    const Chunk& c = chunks[k];
    const auto bytes = random_bytes(3 * c.r.count * sizeof(float), seed);
    truth[k].resize(3 * c.r.count);
    std::memcpy(truth[k].data(), bytes.data(), bytes.size());
    IoBuffer src = IoBuffer::allocate(rig.store->padded_bytes(c.opt), HugePageMode::kNone);
    std::memcpy(src.data(), bytes.data(), bytes.size());
    rig.store->write(c.opt, 0, 0, src.data()).wait();
  }
  std::size_t size() const { return chunks.back().r.end(); }

  StoreRig rig;
  std::vector<Chunk> chunks;
  std::vector<std::vector<float>> truth;
};

void expect_view(const StateView& v, const std::vector<std::vector<float>>& want, Range r) {
  ASSERT_EQ(v.count, r.count);
  const float* arrays[3] = {v.master, v.exp_avg, v.exp_avg_sq};
  for (int a = 0; a < 3; ++a)
    EXPECT_EQ(std::memcmp(want[a].data(), arrays[a], r.count * sizeof(float)), 0)  // bits: NaNs
        << "array " << a << " of [" << r.begin << ", " << r.end() << ")";
}

// Arrays master, m, v of elements [r.begin, r.end()) as `truth` (per chunk: master | m | v) holds
// them.
std::vector<std::vector<float>> expected(const std::vector<Chunk>& chunks,
                                         const std::vector<std::vector<float>>& truth, Range r) {
  std::vector<std::vector<float>> out(3);
  for (std::size_t k = 0; k < chunks.size(); ++k) {
    const Range& cr = chunks[k].r;
    const std::size_t b = std::max(cr.begin, r.begin), e = std::min(cr.end(), r.end());
    if (b >= e) continue;
    for (std::size_t a = 0; a < 3; ++a) {
      const float* p = truth[k].data() + a * cr.count + (b - cr.begin);
      out[a].insert(out[a].end(), p, p + (e - b));
    }
  }
  return out;
}

// Ranges of uneven sizes over the whole state, across the chunks' edges.
std::vector<Range> ranges(std::size_t size) {
  std::vector<Range> out;
  for (std::size_t b = 0, n = 333333; b < size; b += n, n = n * 3 / 2)
    out.push_back({b, std::min(n, size - b)});
  return out;
}

TEST(StateStores, CommittedRangesWithAndWithoutPrefetch) {
  StateRig s;
  TierStateStore store(*s.rig.store, s.chunks, s.size(), kTimeout);
  const std::vector<Range> rs = ranges(s.size());
  for (int mode = 0; mode < 3; ++mode) {  // no prefetch; the next range; another range
    for (std::size_t i = 0; i < rs.size(); ++i) {
      const StateView v = store.acquire(rs[i]);
      if (mode == 1 && i + 1 < rs.size()) store.prefetch(rs[i + 1]);
      if (mode == 2) store.prefetch(rs[(i + 2) % rs.size()]);  // not what comes next
      expect_view(v, expected(s.chunks, s.truth, rs[i]), rs[i]);
      store.release(rs[i], false);
    }
  }
  // The same range again after the state changed: read anew each time, never an earlier range's
  // reads taken for a prefetch (the loop above left one of rs[1]: dropped as the contract says).
  store.drop_prefetch();
  for (std::uint64_t round = 0; round < 3; ++round) {
    for (std::size_t k = 0; k < s.chunks.size(); ++k) s.rewrite(k, 500 + 10 * round + k);
    const StateView v = store.acquire(rs[1]);
    expect_view(v, expected(s.chunks, s.truth, rs[1]), rs[1]);
    store.release(rs[1], false);
  }
  expect_error(ErrorCode::kInvalidArgument, "beyond", [&] { store.prefetch({s.size() - 1, 2}); });
}

TEST(StateStores, SnapshotKeepsThePinnedContentsAPrefetchedRangeIncluded) {
  StateRig s;
  std::vector<BufferId> ids;
  for (const Chunk& c : s.chunks) ids.push_back(c.opt);
  const SnapshotId snap = s.rig.store->pin_committed(ids);
  const std::vector<std::vector<float>> pinned_truth = s.truth;
  int reads_started = 0;
  PinnedStateStore store(*s.rig.store, s.chunks, ParamBlocks{}, s.size(), snap, kTimeout,
                         [&] { ++reads_started; });
  const std::vector<Range> rs = ranges(s.size());
  for (std::size_t i = 0; i < rs.size(); ++i) {
    const StateView v = store.acquire(rs[i]);
    if (i + 1 < rs.size()) store.prefetch(rs[i + 1]);
    for (std::size_t k = 0; k < s.chunks.size(); ++k) s.rewrite(k, 1000 * (i + 1) + k);
    expect_view(v, expected(s.chunks, pinned_truth, rs[i]), rs[i]);
    EXPECT_EQ(v.params, nullptr);
    store.release(rs[i], false);
  }
  EXPECT_EQ(reads_started, static_cast<int>(rs.size()));  // once per range: prefetch or acquire
  s.rig.store->unpin(snap);
}

// A snapshot's parameters made from its pinned master (stages 0-2): store_elem's rounding of every
// element, bitwise, NaNs with random payloads included (the state is random bytes); the views
// start on a page (the checkpoint writer's O_DIRECT writes go straight from them).
TEST(StateStores, SnapshotParametersAreTheMastersRoundingBitwise) {
  for (const DType dt : {DType::kFp16, DType::kBf16, DType::kFp32}) {
    SCOPED_TRACE(dtype_name(dt));
    StateRig s;
    std::vector<BufferId> ids;
    for (const Chunk& c : s.chunks) ids.push_back(c.opt);
    const SnapshotId snap = s.rig.store->pin_committed(ids);
    const ParamBlocks params{ParamBlocks::Source::kFromMaster, dt, dtype_size(dt)};
    PinnedStateStore store(*s.rig.store, s.chunks, params, s.size(), snap, kTimeout);
    const StateView empty = store.acquire({5, 0});  // first, an empty range: nothing to allocate
    EXPECT_EQ(empty.count, 0u);
    store.release({5, 0}, false);
    std::size_t nans = 0;
    for (const Range r : ranges(s.size())) {
      const StateView v = store.acquire(r);
      const std::vector<float> master = expected(s.chunks, s.truth, r)[0];
      std::vector<unsigned char> want(r.count * dtype_size(dt));
      for (std::size_t i = 0; i < r.count; ++i) {
        store_elem(want.data(), i, dt, master[i]);
        nans += std::isnan(master[i]) ? 1 : 0;
      }
      ASSERT_NE(v.params, nullptr);
      EXPECT_EQ(std::memcmp(v.params, want.data(), want.size()), 0)
          << "[" << r.begin << ", " << r.end() << ")";
      for (const void* p :
           {static_cast<const void*>(v.master), static_cast<const void*>(v.exp_avg),
            static_cast<const void*>(v.exp_avg_sq), static_cast<const void*>(v.params)})
        EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 4096, 0u);
      store.release(r, false);
    }
    EXPECT_GT(nans, 0u) << "the random state should hold NaNs";
    store.drop_prefetch();
    s.rig.store->unpin(snap);
  }
}

}  // namespace
}  // namespace strata::testing
