// Test wrappers that watch where the engine's bytes are, on the host-emulated device:
//   WatchedDevice   a Device that knows its allocations, so it tells a device→host copy (source in
//                   device memory, destination not) from the others; it counts them, and can hold
//                   chosen ones back behind a gate (optionally failing them when released) or
//                   delay every one. Set it up through zero::EngineAccess::set_storage_wrap.
//   DeviceOnlyComm  a Communicator that says its buffers are device memory (BufferLocation::
//                   kDevice, as NCCL does) and checks that every buffer handed to it lies in the
//                   WatchedDevice's allocations; a host buffer is counted and named (the
//                   collective still runs, on the in-process communicator it wraps, so that no
//                   rank hangs).
// The two share an AllocationMap: the device is made at finalize(), the communicator before.
// Thread-safety: every member may be called from any thread (streams run on worker threads).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "strata/communicator.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"

namespace strata::testing {

class AllocationMap {
 public:
  void add(const void* p, std::size_t n) {
    std::lock_guard lock(mu_);
    ranges_[reinterpret_cast<std::uintptr_t>(p)] = n;
  }
  void remove(const void* p) {
    std::lock_guard lock(mu_);
    ranges_.erase(reinterpret_cast<std::uintptr_t>(p));
  }
  // [p, p + n) lies inside one allocation.
  bool contains(const void* p, std::size_t n) const {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard lock(mu_);
    auto it = ranges_.upper_bound(a);
    if (it == ranges_.begin()) return false;
    --it;
    return a >= it->first && a + n <= it->first + it->second;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::uintptr_t, std::size_t> ranges_;  // guarded by mu_
};

class WatchedDevice final : public DeviceWrapper {
 public:
  struct Gate {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;          // guarded by mu
    bool timed_out = false;     // guarded by mu: opened by the safety timeout, not the test
    std::uint64_t entered = 0;  // guarded by mu: held copies that reached the gate
    std::uint64_t first = 0, count = 0;  // device→host copies [first, first + count) are held
    bool fail = false;                   // held copies fail once released
  };

  WatchedDevice(std::unique_ptr<Device> inner, std::shared_ptr<AllocationMap> map)
      : DeviceWrapper(std::move(inner)), map_(std::move(map)), gate_(std::make_shared<Gate>()) {}

  // Holds device→host copies nth..nth+count-1 (1-based, counted from now on) until open() (or a
  // 30 s safety timeout, which the test sees in gate_timed_out()); with fail they then fail.
  void hold(std::uint64_t nth, std::uint64_t count, bool fail) {
    std::lock_guard lock(gate_->mu);
    gate_->first = d2h_.load() + nth;
    gate_->count = count;
    gate_->fail = fail;
    gate_->open = false;
  }
  void open() {
    {
      std::lock_guard lock(gate_->mu);
      gate_->open = true;
    }
    gate_->cv.notify_all();
  }
  std::uint64_t held_entered() const {
    std::lock_guard lock(gate_->mu);
    return gate_->entered;
  }
  bool gate_timed_out() const {
    std::lock_guard lock(gate_->mu);
    return gate_->timed_out;
  }
  void delay_every_d2h(std::chrono::milliseconds d) { delay_ms_ = d.count(); }
  std::uint64_t d2h_queued() const { return d2h_.load(); }
  const AllocationMap& allocations() const { return *map_; }

  std::string name() const override { return DeviceWrapper::name() + " (watched)"; }
  void* alloc(std::size_t bytes) override {
    void* p = DeviceWrapper::alloc(bytes);
    map_->add(p, bytes);
    return p;
  }
  void free(void* ptr) noexcept override {
    map_->remove(ptr);
    DeviceWrapper::free(ptr);
  }
  std::unique_ptr<Stream> create_stream() override {
    return std::make_unique<WatchedStream>(*this, DeviceWrapper::create_stream());
  }

 private:
  class WatchedStream final : public StreamWrapper {
   public:
    WatchedStream(WatchedDevice& dev, std::unique_ptr<Stream> inner)
        : StreamWrapper(std::move(inner)), dev_(dev) {}
    void memcpy_async(void* dst, const void* src, std::size_t bytes) override {
      if (bytes > 0 && dev_.map_->contains(src, bytes) && !dev_.map_->contains(dst, bytes)) {
        const std::uint64_t n = ++dev_.d2h_;
        const auto delay = std::chrono::milliseconds(dev_.delay_ms_.load());
        if (delay.count() > 0)
          inner().launch_host_func([delay] { std::this_thread::sleep_for(delay); });
        std::shared_ptr<Gate> g = dev_.gate_;
        bool held;
        {
          std::lock_guard lock(g->mu);
          held = g->count > 0 && n >= g->first && n < g->first + g->count;
        }
        if (held) inner().launch_host_func([g] { pass(*g); });
      }
      inner().memcpy_async(dst, src, bytes);
    }

   private:
    static void pass(Gate& g) {  // on the stream's worker
      std::unique_lock lock(g.mu);
      ++g.entered;
      g.cv.notify_all();
      if (!g.cv.wait_for(lock, std::chrono::seconds(30), [&] { return g.open; })) {
        g.timed_out = true;
        g.open = true;
      }
      if (g.fail)
        fail(ErrorCode::kDevice, "device: copy to the host failed (injected by the test)");
    }
    WatchedDevice& dev_;
  };

  std::shared_ptr<AllocationMap> map_;
  std::shared_ptr<Gate> gate_;
  std::atomic<std::uint64_t> d2h_{0};
  std::atomic<std::int64_t> delay_ms_{0};
};

class DeviceOnlyComm final : public Communicator {
 public:
  DeviceOnlyComm(std::unique_ptr<Communicator> inner, std::shared_ptr<AllocationMap> map)
      : Communicator(inner->timeout_s()), inner_(std::move(inner)), map_(std::move(map)) {}

  std::uint64_t host_buffers() const { return host_buffers_.load(); }
  std::string first_host_buffer() const {
    std::lock_guard lock(mu_);
    return first_;
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* backend_name() const override { return "device-only(inprocess)"; }
  BufferLocation buffer_location() const override { return BufferLocation::kDevice; }
  std::unique_ptr<CommHandle> all_reduce_async(const void* send, void* recv, std::size_t count,
                                               DType dtype) override {
    check("all_reduce send", send, count * dtype_size(dtype));
    check("all_reduce recv", recv, count * dtype_size(dtype));
    return inner_->all_reduce_async(send, recv, count, dtype);
  }
  std::unique_ptr<CommHandle> reduce_scatter_async(const void* send, void* recv,
                                                   std::span<const std::size_t> counts,
                                                   DType dtype) override {
    check("reduce_scatter send", send, total(counts) * dtype_size(dtype));
    check("reduce_scatter recv", recv,
          counts[static_cast<std::size_t>(rank())] * dtype_size(dtype));
    return inner_->reduce_scatter_async(send, recv, counts, dtype);
  }
  std::unique_ptr<CommHandle> all_gather_async(const void* send, void* recv,
                                               std::span<const std::size_t> counts,
                                               DType dtype) override {
    check("all_gather send", send, counts[static_cast<std::size_t>(rank())] * dtype_size(dtype));
    check("all_gather recv", recv, total(counts) * dtype_size(dtype));
    return inner_->all_gather_async(send, recv, counts, dtype);
  }
  std::unique_ptr<CommHandle> broadcast_async(void* buffer, std::size_t count, DType dtype,
                                              int root) override {
    check("broadcast buffer", buffer, count * dtype_size(dtype));
    return inner_->broadcast_async(buffer, count, dtype, root);
  }
  std::unique_ptr<CommHandle> barrier_async() override { return inner_->barrier_async(); }
  CommStats stats() const override { return inner_->stats(); }

 private:
  static std::size_t total(std::span<const std::size_t> c) {
    std::size_t n = 0;
    for (auto x : c) n += x;
    return n;
  }
  void check(const char* what, const void* p, std::size_t bytes) {
    if (bytes == 0 || map_->contains(p, bytes)) return;
    if (host_buffers_++ == 0) {
      std::lock_guard lock(mu_);
      first_ = strcat(what, " (", bytes, " bytes) is not device memory");
    }
  }
  std::unique_ptr<Communicator> inner_;
  std::shared_ptr<AllocationMap> map_;
  std::atomic<std::uint64_t> host_buffers_{0};
  mutable std::mutex mu_;
  std::string first_;  // guarded by mu_
};

}  // namespace strata::testing
