// Runtime scratch in device memory, counted against the gpu budget (see scratch_arena.hpp).
#include "tier/scratch_arena.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "core/move_handle.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "tier/tier_store.hpp"

namespace strata {

Scratch& Scratch::operator=(Scratch&& other) noexcept {
  return move_assign_handle(*this, other, &Scratch::reset, &Scratch::arena_, &Scratch::ptr_,
                            &Scratch::bytes_, &Scratch::varying_);
}

void Scratch::reset() noexcept {
  if (ptr_ != nullptr) arena_->give_back(ptr_, bytes_, varying_);
  arena_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

ScratchArena::ScratchArena(TierStore& store, Device& device) : store_(store), device_(device) {}

ScratchArena::~ScratchArena() { trim(); }

Scratch ScratchArena::take(std::size_t bytes, std::string_view what, bool varying) {
  bytes = std::max<std::size_t>(bytes, 1);
  std::multimap<std::size_t, ScratchArena::Kept> shed;
  {
    MutexLock lock(mu_);
    if (auto it = find_kept_locked(bytes, varying); it != kept_.end()) {
      const std::size_t size = it->first;
      unsigned char* p = it->second.ptr;
      kept_.erase(it);
      stats_.kept_bytes -= size;
      stats_.live_bytes += size;
      stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
      return Scratch(this, p, size, varying);
    }
    const std::uint64_t bound = std::max(stats_.peak_live_bytes, stats_.live_bytes + bytes);
    shed = shed_locked(bytes, bound);
  }
  free_blocks(shed);
  void* p = nullptr;
  try {
    p = allocate(bytes, what);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kBudget && e.code() != ErrorCode::kOutOfMemory) throw;
    trim();  // kept blocks hold budget and device memory: give them all back, then try once more
    p = allocate(bytes, what);
  }
  MutexLock lock(mu_);
  ++stats_.allocations;
  stats_.live_bytes += bytes;
  stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
  return Scratch(this, static_cast<unsigned char*>(p), bytes, varying);
}

// A kept block of exactly `bytes`, or for a varying request the smallest kept block of another
// varying request that holds `bytes` with little to spare: a loop whose requests vary in size
// reuses its blocks instead of freeing one to allocate another (only so many are kept: the peak
// bound), and the fixed-size requests (buckets, receive buffers) keep their exact sizes.
std::multimap<std::size_t, ScratchArena::Kept>::iterator ScratchArena::find_kept_locked(
    std::size_t bytes, bool varying) {
  auto it = kept_.lower_bound(bytes);
  if (it != kept_.end() && it->first == bytes) return it;
  if (!varying) return kept_.end();
  for (; it != kept_.end() && it->first <= reuse_limit(bytes); ++it)
    if (it->second.varying) return it;
  return kept_.end();
}

// The largest kept block a request of `bytes` may take: a quarter more, or 1 MiB more for small
// requests (what a reused block wastes stays small against the memory it saves).
std::size_t ScratchArena::reuse_limit(std::size_t bytes) {
  return bytes + std::max<std::size_t>(bytes / 4, std::size_t{1} << 20);
}

// Device memory counted against the gpu budget: both or neither.
void* ScratchArena::allocate(std::size_t bytes, std::string_view what) {
  store_.reserve(Tier::kGpu, bytes, strcat("scratch ", what));
  try {
    return device_.alloc(bytes);
  } catch (...) {
    store_.unreserve(Tier::kGpu, bytes);
    throw;
  }
}

std::multimap<std::size_t, ScratchArena::Kept> ScratchArena::shed_locked(std::uint64_t incoming,
                                                                         std::uint64_t bound) {
  std::multimap<std::size_t, ScratchArena::Kept> out;
  while (!kept_.empty() && stats_.live_bytes + stats_.kept_bytes + incoming > bound) {
    auto largest = std::prev(kept_.end());
    stats_.kept_bytes -= largest->first;
    out.insert(*largest);
    kept_.erase(largest);
  }
  return out;
}

void ScratchArena::free_blocks(
    const std::multimap<std::size_t, ScratchArena::Kept>& blocks) noexcept {
  for (const auto& [bytes, k] : blocks) {
    device_.free(k.ptr);
    store_.unreserve(Tier::kGpu, bytes);
  }
  MutexLock lock(mu_);
  stats_.frees += blocks.size();
}

void ScratchArena::give_back(unsigned char* ptr, std::size_t bytes, bool varying) noexcept {
  MutexLock lock(mu_);
  stats_.live_bytes -= bytes;
  try {
    kept_.emplace(bytes, Kept{ptr, varying});
    stats_.kept_bytes += bytes;
  } catch (...) {  // no memory for the map node: free the block at once
    device_.free(ptr);
    store_.unreserve(Tier::kGpu, bytes);
    ++stats_.frees;
  }
}

void ScratchArena::trim() noexcept {
  std::multimap<std::size_t, ScratchArena::Kept> all;
  {
    MutexLock lock(mu_);
    all.swap(kept_);
    stats_.kept_bytes = 0;
  }
  free_blocks(all);
}

ScratchStats ScratchArena::stats() const {
  MutexLock lock(mu_);
  return stats_;
}

}  // namespace strata
