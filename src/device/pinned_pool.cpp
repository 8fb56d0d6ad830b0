#include "device/pinned_pool.hpp"

#include <sys/mman.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "core/move_handle.hpp"
#include "core/page_lock.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/io_engine.hpp"
#include "strata/log.hpp"
#include "strata/units.hpp"

namespace strata {
namespace {

std::string limit_text(rlim_t v) {
  return v == RLIM_INFINITY ? std::string("unlimited") : strcat(v, " bytes");
}

std::string raise_hint() {
  return "raise the locked-memory limit (`ulimit -l unlimited` in the launching shell, "
         "'<user> - memlock unlimited' in /etc/security/limits.conf, LimitMEMLOCK=infinity for a "
         "systemd service, --ulimit memlock=-1 for a container) or lower tiers.host.buffer_count / "
         "tiers.host.buffer_size";
}

}  // namespace

PinnedPoolOptions PinnedPoolOptions::from(const HostTierConfig& host) {
  PinnedPoolOptions o;
  o.buffer_count = host.buffer_count;
  o.buffer_size = host.buffer_size;
  o.pinned_budget = host.pinned_budget;
  return o;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  return move_assign_handle(*this, other, &PinnedBuffer::release, &PinnedBuffer::pool_,
                            &PinnedBuffer::index_, &PinnedBuffer::data_, &PinnedBuffer::size_);
}

void PinnedBuffer::release() noexcept {
  if (pool_) pool_->give_back(index_);
  pool_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

PinnedPool::PinnedPool(const PinnedPoolOptions& options, Device* device, IoEngine* engine)
    : buffer_size_(options.buffer_size), device_(device) {
  if (options.buffer_count == 0 || options.buffer_size == 0 || options.buffer_size % 4096 != 0) {
    fail(ErrorCode::kInvalidArgument,
         strcat("pinned pool: tiers.host.buffer_count (", options.buffer_count,
                ") must be >= 1 and tiers.host.buffer_size (", options.buffer_size,
                ") a positive multiple of 4096"));
  }
  const std::uint64_t total = std::uint64_t(options.buffer_count) * options.buffer_size;
  if (total > options.pinned_budget) {
    fail(ErrorCode::kBudget,
         strcat("pinned pool: tiers.host.buffer_count × buffer_size = ", options.buffer_count,
                " × ", options.buffer_size, " = ", total, " bytes (", format_bytes(total, true),
                ") exceeds tiers.host.pinned_budget = ", options.pinned_budget, " bytes (",
                format_bytes(options.pinned_budget, true), ")"));
  }
  device_locked_ = device_ && device_->kind() == DeviceKind::kCuda;
  if (!device_locked_) {
    const PageLockLimit lim = page_lock_limit();  // CAP_IPC_LOCK lifts RLIMIT_MEMLOCK
    if (lim.applies && total > lim.bytes) {
      fail(ErrorCode::kOutOfMemory,
           strcat("pinned pool: ", total, " bytes (", format_bytes(total, true),
                  ") must be page-locked but RLIMIT_MEMLOCK is ", limit_text(lim.bytes), ": ",
                  raise_hint()));
    }
  }
  slabs_.reserve(options.buffer_count);
  locked_.assign(options.buffer_count, false);
  try {
    for (std::uint32_t i = 0; i < options.buffer_count; ++i) {
      slabs_.push_back(IoBuffer::allocate(buffer_size_, options.huge_pages));
      void* p = slabs_.back().data();
      if (device_locked_) {
        device_->register_host(p, buffer_size_);  // throws with the memlock hint
      } else if (mlock(p, buffer_size_) != 0) {
        const int err = errno;
        rlimit lim{};
        getrlimit(RLIMIT_MEMLOCK, &lim);
        fail(ErrorCode::kOutOfMemory,
             strcat("pinned pool: mlock of buffer ", i, " (", buffer_size_, " bytes; pool ", total,
                    " bytes) failed: ", std::strerror(err), " (errno ", err,
                    "); RLIMIT_MEMLOCK is ", limit_text(lim.rlim_cur), ": ", raise_hint()));
      }
      locked_[i] = true;
    }
  } catch (...) {
    for (std::size_t i = 0; i < slabs_.size(); ++i) {
      if (!locked_[i]) continue;
      if (device_locked_)
        device_->unregister_host(slabs_[i].data());
      else
        munlock(slabs_[i].data(), buffer_size_);
    }
    throw;
  }
  if (engine) {
    std::vector<IoRegion> regions;
    for (auto& s : slabs_) regions.push_back(IoRegion{s.data(), buffer_size_});
    engine->register_buffers(regions);
  }
  free_.reserve(slabs_.size());
  for (std::uint32_t i = slabs_.size(); i-- > 0;) free_.push_back(i);
  abandoned_.assign(slabs_.size(), false);
  log_debug("pinned pool: ", slabs_.size(), " × ", format_bytes(buffer_size_, true),
            " locked with ", lock_method());
}

namespace {

// Slabs a transfer may still write after their pool is gone: kept mapped (reachable, so not a
// leak report) for the life of the process.
void bury(IoBuffer slab) {
  static std::mutex mu;
  static auto* graveyard = new std::vector<IoBuffer>();
  std::lock_guard lock(mu);
  graveyard->push_back(std::move(slab));
}

}  // namespace

PinnedPool::~PinnedPool() {
  std::vector<bool> out(slabs_.size(), true);  // leased or detached at the end
  {
    std::unique_lock lock(mutex_);
    auto settled = [&] {
      std::size_t gone = 0;
      for (bool a : abandoned_) gone += a ? 1 : 0;
      return free_.size() + gone == slabs_.size();
    };
    if (!cv_.wait_for(lock, std::chrono::seconds(10), settled))
      log_error("pinned pool destroyed with ", slabs_.size() - free_.size(),
                " buffer(s) still leased: they stay mapped and page-locked");
    for (std::uint32_t i : free_) out[i] = false;
  }
  for (std::size_t i = 0; i < slabs_.size(); ++i) {
    if (out[i]) {  // a transfer may still read or write it: never unpin or unmap under it
      bury(std::move(slabs_[i]));
      continue;
    }
    if (!locked_[i]) continue;
    if (device_locked_)
      device_->unregister_host(slabs_[i].data());
    else
      munlock(slabs_[i].data(), buffer_size_);
  }
}

void PinnedBuffer::detach() noexcept {
  if (pool_) pool_->abandon(index_);
  pool_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

void PinnedPool::abandon(std::uint32_t index) noexcept {
  {
    std::lock_guard lock(mutex_);
    abandoned_[index] = true;
  }
  cv_.notify_all();
}

PinnedBuffer PinnedPool::take_locked() {
  const std::uint32_t i = free_.back();
  free_.pop_back();
  return PinnedBuffer(this, i, slabs_[i].data(), buffer_size_);
}

PinnedBuffer PinnedPool::acquire(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!cv_.wait_for(lock, timeout, [&] { return !free_.empty(); })) {
    fail(ErrorCode::kTimeout,
         strcat("pinned pool exhausted: all ", slabs_.size(), " buffers of ", buffer_size_,
                " bytes stayed in use for ", timeout.count(),
                " ms (the pool never grows; raise tiers.host.buffer_count within "
                "tiers.host.pinned_budget or release buffers sooner)"));
  }
  return take_locked();
}

PinnedBuffer PinnedPool::try_acquire() {
  std::lock_guard lock(mutex_);
  if (free_.empty()) return {};
  return take_locked();
}

std::uint32_t PinnedPool::available() const {
  std::lock_guard lock(mutex_);
  return static_cast<std::uint32_t>(free_.size());
}

void PinnedPool::give_back(std::uint32_t index) noexcept {
  {
    std::lock_guard lock(mutex_);
    free_.push_back(index);
  }
  cv_.notify_all();
}

}  // namespace strata
