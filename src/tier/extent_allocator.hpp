// First-fit extent allocator over [0, capacity) in units of `unit` bytes, with coalescing of freed
// neighbours. Not thread-safe (the owner locks).
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace strata::tier {

struct Extent {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;  // a multiple of the allocator's unit
};

class ExtentAllocator {
 public:
  ExtentAllocator(std::uint64_t capacity, std::uint64_t unit);
  // `bytes` rounded up to the unit; nullopt when no free extent is large enough.
  std::optional<Extent> allocate(std::uint64_t bytes);
  // Throws Error(kInternal) for an extent that is not allocated (double free, overlap).
  void free(const Extent& extent);
  std::uint64_t capacity() const { return capacity_; }
  std::uint64_t used() const { return used_; }
  std::uint64_t largest_free() const;
  std::uint64_t unit() const { return unit_; }
  std::size_t free_extents() const { return free_.size(); }

 private:
  std::uint64_t capacity_;
  std::uint64_t unit_;
  std::uint64_t used_ = 0;
  std::map<std::uint64_t, std::uint64_t> free_;  // offset -> length, disjoint, not adjacent
};

}  // namespace strata::tier
