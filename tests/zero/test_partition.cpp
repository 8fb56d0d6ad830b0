// Partition layout: alignment, equal partitions, and the tensor <-> partition maps covering every
// element exactly once, for random tensor lists (with empty and tiny tensors) and world sizes.
#include <gtest/gtest.h>

#include <random>

#include "strata/error.hpp"
#include "strata/partition.hpp"
#include "test_util.hpp"

namespace strata {
namespace {

TEST(Partition, LayoutAndMapsCoverEveryElementOnce) {
  std::mt19937_64 rng(strata::testing::test_seed("partition"));
  for (int iter = 0; iter < 200; ++iter) {
    std::vector<TensorSpec> specs;
    const int nt = static_cast<int>(rng() % 12);
    for (int i = 0; i < nt; ++i) {
      std::size_t n = rng() % 4 == 0 ? rng() % 3 : rng() % 5000;  // 0, 1, 2 often
      specs.push_back({"t" + std::to_string(i), n});
    }
    const int world = 1 + static_cast<int>(rng() % 7);
    const std::size_t sg = 1 + rng() % 700;
    Partition p(specs, world, sg);
    std::size_t numel = 0;
    for (auto& s : specs) numel += s.numel;
    EXPECT_EQ(p.numel(), numel);
    EXPECT_EQ(p.partition_size() % Partition::kDefaultPartitionAlign, 0u);
    EXPECT_GE(p.flat_size(), numel);
    EXPECT_EQ(p.flat_size(), p.partition_size() * static_cast<std::size_t>(world));
    // owner of each flat element, from the slices; -1 = padding
    std::vector<int> seen(p.flat_size(), -1);
    for (std::size_t t = 0; t < specs.size(); ++t) {
      EXPECT_EQ(p.offset(t) % Partition::kDefaultTensorAlign, 0u);
      if (t > 0) {
        EXPECT_GE(p.offset(t), p.offset(t - 1) + specs[t - 1].numel);
      }
      std::size_t covered = 0;
      for (auto& s : p.slices(t)) {
        EXPECT_EQ(s.tensor_offset, covered);
        EXPECT_GT(s.count, 0u);
        EXPECT_LE(s.partition_offset + s.count, p.partition_size());
        for (std::size_t i = 0; i < s.count; ++i) {
          std::size_t flat = p.partition_begin(s.rank) + s.partition_offset + i;
          ASSERT_EQ(flat, p.offset(t) + s.tensor_offset + i);
          ASSERT_EQ(seen[flat], -1);
          seen[flat] = static_cast<int>(t);
          ASSERT_EQ(p.owner(flat), s.rank);
        }
        covered += s.count;
      }
      EXPECT_EQ(covered, specs[t].numel);
    }
    // owned_slices(r) is exactly the slices whose owner is r
    std::size_t owned_total = 0;
    for (int r = 0; r < world; ++r)
      for (auto& s : p.owned_slices(r)) {
        EXPECT_EQ(s.rank, r);
        for (std::size_t i = 0; i < s.count; ++i)
          ASSERT_EQ(seen[p.partition_begin(r) + s.partition_offset + i],
                    static_cast<int>(s.tensor));
        owned_total += s.count;
      }
    EXPECT_EQ(owned_total, numel);
    // counts_in sums to the range length
    std::size_t a = rng() % (p.flat_size() + 1), b = rng() % (p.flat_size() + 1);
    if (a > b) std::swap(a, b);
    std::size_t sum = 0;
    for (auto c : p.counts_in(a, b)) sum += c;
    EXPECT_EQ(sum, b - a);
    // sub-groups tile the partition
    std::size_t pos = 0;
    for (auto& r : p.partition_sub_groups()) {
      EXPECT_EQ(r.begin, pos);
      EXPECT_LE(r.count, sg);
      pos = r.end();
    }
    EXPECT_EQ(pos, p.partition_size());
  }
}

TEST(Partition, RejectsBadArguments) {
  EXPECT_THROW(Partition({}, 0, 10), Error);
  EXPECT_THROW(Partition({}, 2, 0), Error);
  Partition p({{"a", 10}}, 2, 4);
  EXPECT_THROW(p.partition_begin(2), Error);
  EXPECT_THROW(p.owner(p.flat_size()), Error);
  EXPECT_EQ(p.partition_size(), 64u);
}

}  // namespace
}  // namespace strata
