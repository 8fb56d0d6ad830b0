#include "tier/extent_allocator.hpp"

#include "strata/error.hpp"

namespace strata::tier {

ExtentAllocator::ExtentAllocator(std::uint64_t capacity, std::uint64_t unit)
    : capacity_(capacity / unit * unit), unit_(unit) {
  if (unit == 0) fail(ErrorCode::kInvalidArgument, "extent allocator: unit must be > 0");
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

std::optional<Extent> ExtentAllocator::allocate(std::uint64_t bytes) {
  const std::uint64_t len = (std::max<std::uint64_t>(bytes, 1) + unit_ - 1) / unit_ * unit_;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < len) continue;
    Extent e{it->first, len};
    const std::uint64_t rest = it->second - len;
    const std::uint64_t rest_off = it->first + len;
    free_.erase(it);
    if (rest) free_.emplace(rest_off, rest);
    used_ += len;
    return e;
  }
  return std::nullopt;
}

void ExtentAllocator::free(const Extent& e) {
  if (e.length == 0 || e.length % unit_ || e.offset % unit_ || e.offset + e.length > capacity_) {
    fail(ErrorCode::kInternal,
         strcat("extent allocator: bad extent [", e.offset, ", +", e.length, ")"));
  }
  auto next = free_.lower_bound(e.offset);
  if (next != free_.end() && next->first < e.offset + e.length) {
    fail(ErrorCode::kInternal, strcat("extent allocator: freeing [", e.offset, ", +", e.length,
                                      ") which overlaps free space"));
  }
  std::uint64_t off = e.offset, len = e.length;
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > off) {
      fail(ErrorCode::kInternal, strcat("extent allocator: freeing [", e.offset, ", +", e.length,
                                        ") which overlaps free space"));
    }
    if (prev->first + prev->second == off) {
      off = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && next->first == e.offset + e.length) {
    len += next->second;
    free_.erase(next);
  }
  free_.emplace(off, len);
  used_ -= e.length;
}

std::uint64_t ExtentAllocator::largest_free() const {
  std::uint64_t m = 0;
  for (auto& [o, l] : free_) m = std::max(m, l);
  return m;
}

}  // namespace strata::tier
