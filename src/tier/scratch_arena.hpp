// ScratchArena: runtime scratch in device memory — what a rank's engine needs while it runs and
// not between steps (gradient buckets and their receive buffers, stage-3 gathered tensors and
// their send slices, the staging of collectives on host arrays, the few-byte exchanges). Scratch
// is not training state, so it is not a TierStore buffer: no name, no home, no copies in other
// tiers, no pins. Its memory comes from the Device and is counted against the gpu budget through
// TierStore::reserve for as long as the arena holds it: one budget covers state and scratch.
//
// Reuse (leveldb's arena is the shape; here blocks come and go): a block given back is kept for
// the next request it fits with little to spare (reuse_limit), as long as what the arena holds
// (live + kept) stays within the most it ever had live at once. A loop that repeats — the same
// buckets each step, the same layers gathered in the same order — allocates nothing after its first
// step, and the arena never holds more device memory than its peak demand. A request no kept block
// fits frees kept blocks until that bound holds again, then allocates.
//
// Ownership: borrows the store and the device (both must outlive it). Every Scratch must be given
// back (destroyed or reset) before the arena is destroyed; the destructor frees the kept blocks.
// Thread-safety: every member may be called from any thread (one mutex, never held across a
// device allocation or free). Failure: take() throws Error(kBudget) naming the scratch and the gpu
// budget, or the device's Error(kOutOfMemory / kDevice); nothing is held then.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string_view>

#include "core/mutex.hpp"
#include "strata/config.hpp"

namespace strata {

class Device;
class TierStore;
class ScratchArena;

// One block of scratch, given back to its arena on destruction. Move-only.
class Scratch {
 public:
  Scratch() = default;
  Scratch(Scratch&& other) noexcept { *this = std::move(other); }
  Scratch& operator=(Scratch&& other) noexcept;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { reset(); }
  void reset() noexcept;  // gives the block back (no-op when empty)
  unsigned char* data() const noexcept { return ptr_; }
  std::size_t size() const noexcept { return bytes_; }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

 private:
  friend class ScratchArena;
  Scratch(ScratchArena* arena, unsigned char* ptr, std::size_t bytes, bool varying)
      : arena_(arena), ptr_(ptr), bytes_(bytes), varying_(varying) {}
  ScratchArena* arena_ = nullptr;
  unsigned char* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  bool varying_ = false;
};

struct ScratchStats {
  std::uint64_t live_bytes = 0;       // held by Scratch handles
  std::uint64_t kept_bytes = 0;       // given back, kept for reuse
  std::uint64_t peak_live_bytes = 0;  // the most live at once (bounds live + kept)
  std::uint64_t allocations = 0;      // Device::alloc calls since construction
  std::uint64_t frees = 0;            // Device::free calls since construction
};

class ScratchArena {
 public:
  ScratchArena(TierStore& store, Device& device);
  ~ScratchArena();
  ScratchArena(const ScratchArena&) = delete;
  ScratchArena& operator=(const ScratchArena&) = delete;

  // A block of at least `bytes` (>= 1; contents undefined; size() says how much) of device
  // memory. `what` names it in errors. A kept block of exactly `bytes` is reused; a `varying`
  // request (its size changes from call to call: stage-3 gathers of tensors one at a time) also
  // takes a kept block of another varying request of up to reuse_limit(bytes).
  Scratch take(std::size_t bytes, std::string_view what, bool varying = false);
  // Frees every kept block (e.g. before a phase that needs the device memory for something else).
  void trim() noexcept;
  ScratchStats stats() const;

 private:
  friend class Scratch;
  struct Kept {
    unsigned char* ptr;
    bool varying;
  };
  void give_back(unsigned char* ptr, std::size_t bytes, bool varying) noexcept EXCLUDES(mu_);
  std::multimap<std::size_t, Kept>::iterator find_kept_locked(std::size_t bytes, bool varying)
      REQUIRES(mu_);
  void* allocate(std::size_t bytes, std::string_view what);
  static std::size_t reuse_limit(std::size_t bytes);
  // Removes kept blocks until live + kept + `incoming` fits in `bound`; returns them (freed by
  // the caller outside the mutex).
  std::multimap<std::size_t, Kept> shed_locked(std::uint64_t incoming, std::uint64_t bound)
      REQUIRES(mu_);
  void free_blocks(const std::multimap<std::size_t, Kept>& blocks) noexcept;

  TierStore& store_;
  Device& device_;
  mutable Mutex mu_;
  std::multimap<std::size_t, Kept> kept_ GUARDED_BY(mu_);  // size -> block
  ScratchStats stats_ GUARDED_BY(mu_);
};

}  // namespace strata
