#include <gtest/gtest.h>

#include <map>
#include <random>

#include "strata/error.hpp"
#include "test_util.hpp"
#include "tier/extent_allocator.hpp"

using namespace strata;
using namespace strata::tier;

TEST(ExtentAllocator, AllocatesRoundsAndCoalesces) {
  ExtentAllocator a(40960, 4096);
  auto e1 = a.allocate(1);
  auto e2 = a.allocate(5000);
  auto e3 = a.allocate(4096);
  ASSERT_TRUE(e1 && e2 && e3);
  EXPECT_EQ(e1->length, 4096u);
  EXPECT_EQ(e2->length, 8192u);
  EXPECT_EQ(a.used(), 16384u);
  EXPECT_FALSE(a.allocate(40960));
  a.free(*e1);
  a.free(*e3);
  EXPECT_EQ(a.free_extents(), 2u);  // [0,4096) and [12288, end)
  a.free(*e2);
  EXPECT_EQ(a.free_extents(), 1u);
  EXPECT_EQ(a.largest_free(), 40960u);
  EXPECT_THROW(a.free(*e2), Error);  // double free
}

// Random allocate/free against a reference: no overlaps, accounting exact, full coalescing.
TEST(ExtentAllocator, RandomizedAgainstReference) {
  for (std::uint64_t seed :
       {std::uint64_t(1), std::uint64_t(2), strata::testing::test_seed("extent allocator")}) {
    std::mt19937_64 rng(seed);
    ExtentAllocator a(1 << 20, 512);
    std::map<std::uint64_t, std::uint64_t> live;
    std::uint64_t used = 0;
    for (int i = 0; i < 5000; ++i) {
      if (live.empty() || rng() % 3) {
        auto e = a.allocate(1 + rng() % 40000);
        if (!e) continue;
        auto next = live.lower_bound(e->offset);
        if (next != live.end()) {
          ASSERT_LE(e->offset + e->length, next->first) << seed;
        }
        if (next != live.begin()) {
          auto prev = std::prev(next);
          ASSERT_LE(prev->first + prev->second, e->offset) << seed;
        }
        ASSERT_LE(e->offset + e->length, 1u << 20);
        live.emplace(e->offset, e->length);
        used += e->length;
      } else {
        auto it = live.begin();
        std::advance(it, rng() % live.size());
        a.free(Extent{it->first, it->second});
        used -= it->second;
        live.erase(it);
      }
      ASSERT_EQ(a.used(), used);
    }
    for (auto& [o, l] : live) a.free(Extent{o, l});
    EXPECT_EQ(a.free_extents(), 1u);
    EXPECT_EQ(a.used(), 0u);
  }
}
