// DeviceBufferPool (include/strata/device_pool.hpp): size-classed free lists over Device::alloc.
#include "strata/device_pool.hpp"

#include <chrono>
#include <exception>

#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata {

DeviceBufferPool::Lease& DeviceBufferPool::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    reset();
    pool_ = o.pool_;
    ptr_ = o.ptr_;
    size_ = o.size_;
    o.pool_ = nullptr;
    o.ptr_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

void DeviceBufferPool::Lease::reset() noexcept {
  if (pool_ && ptr_) pool_->give_back(ptr_, size_);
  pool_ = nullptr;
  ptr_ = nullptr;
  size_ = 0;
}

void DeviceBufferPool::Lease::release_after(Stream& last_user) {
  if (!pool_ || !ptr_) return;
  pool_->give_back_after(ptr_, size_, last_user);
  pool_ = nullptr;
  ptr_ = nullptr;
  size_ = 0;
}

DeviceBufferPool::DeviceBufferPool(Device& device, std::uint64_t max_cached_bytes)
    : device_(device), max_cached_(max_cached_bytes) {}

DeviceBufferPool::~DeviceBufferPool() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Waiting& w : waiting_) {
    try {
      w.done->synchronize(std::chrono::seconds(60));
      device_.free(w.ptr);
    } catch (const std::exception& e) {
      // Its stream failed or is stuck: the block may still be written; never free it under it.
      log_error("device buffer pool: a block released after a stream is not reusable (", e.what(),
                "): left allocated");
    }
  }
  waiting_.clear();
  trim_locked();
  if (stats_.leased_bytes)
    log_error("device buffer pool destroyed with ", stats_.leased_bytes, " bytes still leased");
}

// Below 1 MiB: powers of two from 512 B; above: multiples of 2 MiB (a block is at most 2 MiB
// bigger than asked for, and one size serves every request in its class).
std::size_t DeviceBufferPool::size_class(std::size_t bytes) {
  if (bytes <= 512) return 512;
  if (bytes <= (std::size_t(1) << 20)) {
    std::size_t c = 512;
    while (c < bytes) c <<= 1;
    return c;
  }
  const std::size_t unit = std::size_t(2) << 20;
  return (bytes + unit - 1) / unit * unit;
}

DeviceBufferPool::Lease DeviceBufferPool::acquire(std::size_t bytes) {
  const std::size_t want = size_class(bytes);
  Lease l;
  l.pool_ = this;
  l.size_ = want;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reap_locked();
    auto it = free_.find(want);
    if (it != free_.end()) {
      l.ptr_ = it->second;
      free_.erase(it);
      stats_.cached_bytes -= want;
      stats_.leased_bytes += want;
      return l;
    }
  }
  void* p = nullptr;
  try {
    p = device_.alloc(want);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kOutOfMemory) throw;
    trim();  // the cached blocks of other sizes may be what is missing
    p = device_.alloc(want);
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.device_allocs;
  stats_.leased_bytes += want;
  l.ptr_ = p;
  return l;
}

void DeviceBufferPool::give_back(void* ptr, std::size_t size) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.leased_bytes -= size;
  if (stats_.cached_bytes + size > max_cached_) {
    ++stats_.device_frees;
    device_.free(ptr);
    return;
  }
  free_.emplace(size, ptr);
  stats_.cached_bytes += size;
}

void DeviceBufferPool::give_back_after(void* ptr, std::size_t size, Stream& s) {
  auto ev = device_.create_event();
  s.record(*ev);
  std::lock_guard<std::mutex> lock(mu_);
  waiting_.push_back(Waiting{ptr, size, std::move(ev)});
}

void DeviceBufferPool::reap_locked() {
  for (std::size_t i = 0; i < waiting_.size();) {
    Waiting& w = waiting_[i];
    bool done = false;
    try {
      done = w.done->query();
    } catch (const std::exception& e) {
      log_error("device buffer pool: the stream a block was released after failed (", e.what(),
                "): the block is dropped, not reused");
      stats_.leased_bytes -= w.size;
      waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    if (!done) {
      ++i;
      continue;
    }
    stats_.leased_bytes -= w.size;
    free_.emplace(w.size, w.ptr);
    stats_.cached_bytes += w.size;
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

void DeviceBufferPool::trim() {
  std::lock_guard<std::mutex> lock(mu_);
  reap_locked();
  trim_locked();
}

void DeviceBufferPool::trim_locked() {
  for (auto& [size, ptr] : free_) {
    device_.free(ptr);
    ++stats_.device_frees;
  }
  free_.clear();
  stats_.cached_bytes = 0;
}

DeviceBufferPool::Stats DeviceBufferPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace strata
