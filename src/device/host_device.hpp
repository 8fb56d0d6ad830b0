// The host-emulated device (internal): device memory is page-aligned host memory, a stream is an
// ordered work queue served by one worker thread, an event is a counter the worker advances.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "strata/device.hpp"

namespace strata::device {

// A host stream as the device sees it: free() queues the release of memory behind its work.
class HostStreamBase : public Stream {
 public:
  virtual void defer(std::function<void()> fn) = 0;  // runs after the work queued so far
};

class HostDevice final : public Device {
 public:
  explicit HostDevice(std::uint64_t total_memory);
  ~HostDevice() override;
  DeviceKind kind() const override { return DeviceKind::kHost; }
  std::string name() const override { return "host-emulated"; }
  std::uint64_t total_memory() const override { return total_; }
  void* alloc(std::size_t bytes) override;  // zero-filled
  bool alloc_zeroed() const override { return true; }
  void free(void* ptr) noexcept override;
  std::unique_ptr<Stream> create_stream() override;
  std::unique_ptr<Event> create_event() override;
  bool register_host(void*, std::size_t) override { return false; }
  void unregister_host(void*) noexcept override {}
  std::uint64_t allocated() const;

  // The live streams of this device (free() orders the release of memory after their queued work).
  struct StreamSet {
    std::mutex mutex;
    std::set<HostStreamBase*> streams;  // guarded by mutex
  };

 private:
  const std::uint64_t total_;
  std::shared_ptr<StreamSet> streams_ = std::make_shared<StreamSet>();
  mutable std::mutex mutex_;
  std::map<void*, std::size_t> allocations_;  // guarded by mutex_
  std::uint64_t allocated_ = 0;               // guarded by mutex_
};

}  // namespace strata::device
