// PinnedPool: the fixed pool of page-locked host staging buffers, buffer_count × buffer_size,
// never proportional to the model and never growing. Each buffer is its own 2 MiB-aligned
// anonymous mapping with MADV_HUGEPAGE (IoBuffer), so requests built on it are physically
// contiguous and merge in the block layer. Buffers are page-locked once at construction:
// cudaHostRegister through the Device when it is a GPU, mlock otherwise; and registered with the
// I/O engine once (fixed-buffer I/O on io_uring).
//
// Ownership: the pool owns the memory. acquire() hands out a PinnedBuffer lease (move-only) that
// returns its buffer to the pool on destruction. Every lease must be gone before the pool is
// destroyed (the destructor waits up to 10 s for stragglers, then logs an error). The Device and
// IoEngine passed in must outlive the pool.
//
// Thread-safety: acquire/try_acquire/available and lease destruction may be called concurrently
// from any thread.
//
// Failure behaviour (all at construction, nothing later grows or shrinks the pool):
// - buffer_count × buffer_size over pinned_budget: Error(kBudget) naming the three values.
// - RLIMIT_MEMLOCK below the pool size (and no CAP_IPC_LOCK), or mlock/cudaHostRegister refused:
//   Error(kOutOfMemory) saying how much must be locked, the current limit and what to raise
//   (`ulimit -l`, memlock in /etc/security/limits.conf, LimitMEMLOCK= for systemd services,
//   --ulimit memlock=-1 for containers) or which tiers.host keys to lower.
// - acquire() when every buffer is leased waits up to `timeout`, then throws Error(kTimeout)
//   naming the pool size; try_acquire() returns an empty lease instead.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "strata/config.hpp"
#include "strata/io_file.hpp"

namespace strata {

class Device;
class IoEngine;
class PinnedPool;

struct PinnedPoolOptions {
  std::uint32_t buffer_count = 4;
  std::uint64_t buffer_size = 256ULL << 20;  // multiple of 4096
  std::uint64_t pinned_budget = 8ULL << 30;  // hard cap on buffer_count × buffer_size
  HugePageMode huge_pages = HugePageMode::kTransparent;
  static PinnedPoolOptions from(const HostTierConfig& host);
};

// A leased pool buffer. Returned to the pool on destruction or release().
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept { *this = std::move(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { release(); }

  void release() noexcept;
  // Forgets the buffer without returning it to the pool: for a buffer a timed-out transfer may
  // still write. The pool never hands it out again, and at its destruction neither unregisters
  // nor unmaps it (a late DMA must find the memory mapped and pinned): that slab is leaked.
  void detach() noexcept;
  void* data() const noexcept { return data_; }
  std::uint8_t* bytes() const noexcept { return static_cast<std::uint8_t*>(data_); }
  std::size_t size() const noexcept { return size_; }
  std::uint32_t index() const noexcept { return index_; }
  explicit operator bool() const noexcept { return pool_ != nullptr; }

 private:
  friend class PinnedPool;
  PinnedBuffer(PinnedPool* pool, std::uint32_t index, void* data, std::size_t size)
      : pool_(pool), index_(index), data_(data), size_(size) {}
  PinnedPool* pool_ = nullptr;
  std::uint32_t index_ = 0;
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

class PinnedPool {
 public:
  // `device` (may be null) page-locks with cudaHostRegister when it is a GPU; otherwise mlock.
  // `engine` (may be null) gets the buffers registered once.
  PinnedPool(const PinnedPoolOptions& options, Device* device, IoEngine* engine);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  PinnedBuffer acquire(std::chrono::milliseconds timeout);
  PinnedBuffer try_acquire();

  std::uint32_t buffer_count() const noexcept { return static_cast<std::uint32_t>(slabs_.size()); }
  std::size_t buffer_size() const noexcept { return buffer_size_; }
  std::uint32_t available() const;
  // How the memory is page-locked: "cudaHostRegister" or "mlock".
  const char* lock_method() const noexcept { return device_locked_ ? "cudaHostRegister" : "mlock"; }

 private:
  friend class PinnedBuffer;
  void give_back(std::uint32_t index) noexcept;
  void abandon(std::uint32_t index) noexcept;
  PinnedBuffer take_locked();  // mutex_ held, free_ not empty

  std::size_t buffer_size_ = 0;
  Device* device_ = nullptr;
  bool device_locked_ = false;
  std::vector<IoBuffer> slabs_;
  std::vector<bool> locked_;  // slab i is page-locked (undo in the destructor)
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::uint32_t> free_;  // guarded by mutex_: indices of idle buffers
  std::vector<bool> abandoned_;      // guarded by mutex_: slab i was detached (never reused)
};

}  // namespace strata
