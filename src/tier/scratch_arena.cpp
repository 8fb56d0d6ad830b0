// Runtime scratch in device memory, counted against the gpu budget (see scratch_arena.hpp).
#include "tier/scratch_arena.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "strata/device.hpp"
#include "strata/error.hpp"
#include "tier/tier_store.hpp"

namespace strata {

Scratch& Scratch::operator=(Scratch&& other) noexcept {
  if (this != &other) {
    reset();
    arena_ = std::exchange(other.arena_, nullptr);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void Scratch::reset() noexcept {
  if (ptr_ != nullptr) arena_->give_back(ptr_, bytes_);
  arena_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

ScratchArena::ScratchArena(TierStore& store, Device& device) : store_(store), device_(device) {}

ScratchArena::~ScratchArena() { trim(); }

Scratch ScratchArena::take(std::size_t bytes, std::string_view what) {
  bytes = std::max<std::size_t>(bytes, 1);
  std::multimap<std::size_t, unsigned char*> shed;
  {
    MutexLock lock(mu_);
    // The smallest kept block that holds `bytes` with little to spare: a loop whose requests vary
    // in size (stage-3 gathers of tensors one at a time) reuses its blocks instead of freeing one
    // to allocate another (within the peak bound below, only so many blocks are kept).
    if (auto it = kept_.lower_bound(bytes); it != kept_.end() && it->first <= reuse_limit(bytes)) {
      const std::size_t size = it->first;
      unsigned char* p = it->second;
      kept_.erase(it);
      stats_.kept_bytes -= size;
      stats_.live_bytes += size;
      stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
      return Scratch(this, p, size);
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
  return Scratch(this, static_cast<unsigned char*>(p), bytes);
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

std::multimap<std::size_t, unsigned char*> ScratchArena::shed_locked(std::uint64_t incoming,
                                                                     std::uint64_t bound) {
  std::multimap<std::size_t, unsigned char*> out;
  while (!kept_.empty() && stats_.live_bytes + stats_.kept_bytes + incoming > bound) {
    auto largest = std::prev(kept_.end());
    stats_.kept_bytes -= largest->first;
    out.insert(*largest);
    kept_.erase(largest);
  }
  return out;
}

void ScratchArena::free_blocks(const std::multimap<std::size_t, unsigned char*>& blocks) noexcept {
  for (const auto& [bytes, p] : blocks) {
    device_.free(p);
    store_.unreserve(Tier::kGpu, bytes);
  }
  MutexLock lock(mu_);
  stats_.frees += blocks.size();
}

void ScratchArena::give_back(unsigned char* ptr, std::size_t bytes) noexcept {
  MutexLock lock(mu_);
  stats_.live_bytes -= bytes;
  try {
    kept_.emplace(bytes, ptr);
    stats_.kept_bytes += bytes;
  } catch (...) {  // no memory for the map node: free the block at once
    device_.free(ptr);
    store_.unreserve(Tier::kGpu, bytes);
    ++stats_.frees;
  }
}

void ScratchArena::trim() noexcept {
  std::multimap<std::size_t, unsigned char*> all;
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
