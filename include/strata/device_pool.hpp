// A caching pool of device buffers for runtime scratch (gradient buckets, receive buffers,
// gathered stage-3 layers): after the first step a steady-state step allocates and frees nothing.
// On a GPU, cudaMalloc and cudaFree synchronise the device (and take the driver's locks: with
// NCCL kernels in flight on several GPUs of one process that can hang); here they run only when no
// cached block fits (and on trim() / destruction).
//
// Reuse is ordered like CUDA's caching allocators: a lease given back with release_after(stream)
// becomes reusable only once the work queued on that stream so far has finished (an event,
// polled without blocking); a lease simply destroyed is reusable at once — its owner guarantees no
// queued work still uses it (e.g. it waited for the stream or the collective).
//
// Ownership: the pool owns every block; a Lease borrows one and must not outlive the pool.
// Thread-safety: all members may be called from any thread. Failure: acquire throws
// Error(kOutOfMemory) when the device has no room even after dropping every cached block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "strata/device.hpp"

namespace strata {

class DeviceBufferPool {
 public:
  struct Stats {
    std::uint64_t device_allocs = 0;  // Device::alloc calls made
    std::uint64_t device_frees = 0;   // Device::free calls made
    std::uint64_t cached_bytes = 0;   // in free blocks
    std::uint64_t leased_bytes = 0;   // in blocks out on lease or waiting for their stream
  };

  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept { *this = std::move(o); }
    Lease& operator=(Lease&& o) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { reset(); }
    void* get() const noexcept { return ptr_; }
    std::size_t size() const noexcept { return size_; }  // >= what was asked for
    explicit operator bool() const noexcept { return ptr_ != nullptr; }
    // Gives the block back at once. REQUIRES: no queued device work uses it.
    void reset() noexcept;
    // Gives the block back for reuse after the work queued on `last_user` so far has finished.
    void release_after(Stream& last_user);

   private:
    friend class DeviceBufferPool;
    DeviceBufferPool* pool_ = nullptr;
    void* ptr_ = nullptr;
    std::size_t size_ = 0;
  };

  // max_cached_bytes: free blocks beyond this are given back to the device at once.
  explicit DeviceBufferPool(Device& device, std::uint64_t max_cached_bytes = UINT64_MAX);
  ~DeviceBufferPool();  // REQUIRES: no lease out; waits for blocks released after a stream
  DeviceBufferPool(const DeviceBufferPool&) = delete;
  DeviceBufferPool& operator=(const DeviceBufferPool&) = delete;

  // A block of at least `bytes` (256-byte aligned; sizes are rounded up to a size class).
  Lease acquire(std::size_t bytes);
  // Gives every free block back to the device (blocks waiting for their stream stay).
  void trim();
  Stats stats() const;

 private:
  struct Waiting {
    void* ptr;
    std::size_t size;
    std::unique_ptr<Event> done;
  };
  static std::size_t size_class(std::size_t bytes);
  void give_back(void* ptr, std::size_t size) noexcept;
  void give_back_after(void* ptr, std::size_t size, Stream& s);
  void reap_locked();  // REQUIRES: mu_ held. Waiting blocks whose event completed -> free_
  void trim_locked();  // REQUIRES: mu_ held

  Device& device_;
  const std::uint64_t max_cached_;
  mutable std::mutex mu_;
  std::multimap<std::size_t, void*> free_;  // GUARDED_BY(mu_) size -> block
  std::vector<Waiting> waiting_;            // GUARDED_BY(mu_)
  Stats stats_;                             // GUARDED_BY(mu_)
};

}  // namespace strata
