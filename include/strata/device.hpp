// The compute device the tier store moves data to and from: a CUDA GPU, or a host-emulated device
// for machines without one (device memory is host memory, a stream is an ordered work queue on a
// worker thread, events behave the same). Both run the same code paths above this interface.
//
// Ownership: make_device() returns the owner. DeviceMemory, Stream and Event are RAII owners of
// their allocation / stream / event and must not outlive the Device that made them.
//
// Thread-safety: Device::alloc/free/create_* may be called from any thread. A Stream is meant to
// be fed by one thread at a time (like a CUDA stream); an Event may be waited on from any thread.
//
// Failure behaviour: every CUDA return code is checked. Synchronous calls throw
// Error(kOutOfMemory) for a failed allocation and Error(kDevice) otherwise, naming the call and the
// CUDA error string. Work queued on a stream reports its failure at the wait that observes it
// (Stream::synchronize, Event::synchronize) as Error(kDevice). No wait blocks forever: each takes
// a timeout and throws Error(kTimeout) past it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "strata/config.hpp"

namespace strata {

class Device;

// A recorded point in a stream. Waitable from any thread, reusable (record again).
class Event {
 public:
  virtual ~Event() = default;
  // True when all work queued before the last record() has finished (an event never recorded is
  // complete). Throws the stream's error if that work failed.
  virtual bool query() = 0;
  // Blocks until complete; throws Error(kTimeout) past `timeout`, Error(kDevice) on failure.
  virtual void synchronize(std::chrono::milliseconds timeout) = 0;
};

// An ordered queue of asynchronous device work.
class Stream {
 public:
  virtual ~Stream() = default;
  // Queues a copy of `bytes` bytes. Either pointer may be device memory (Device::alloc) or host
  // memory; host memory should be page-locked (Device::register_host / PinnedPool) for the copy to
  // be truly asynchronous on a GPU. Both ranges must stay valid until the copy is complete.
  virtual void memcpy_async(void* dst, const void* src, std::size_t bytes) = 0;
  // Queues filling `bytes` bytes of device memory with `value`.
  virtual void memset_async(void* dst, int value, std::size_t bytes) = 0;
  // Marks the current end of the queue in `event` (which must come from the same Device).
  virtual void record(Event& event) = 0;
  // Work queued after this call starts only after `event` completes.
  virtual void wait_event(Event& event) = 0;
  // Producer hand-off: work queued after this call starts only after everything queued so far on
  // `producer`, a native stream of the caller's (a cudaStream_t of this stream's device, e.g.
  // torch.cuda.current_stream().cuda_stream) — no host synchronisation. Without it a stream of
  // strata's (non-blocking) is ordered after nothing the caller queued. nullptr: on a GPU CUDA's
  // legacy default stream of this stream's device (torch's default stream); the host device has no
  // native streams and accepts only nullptr, a no-op there (host code is ordered by the call
  // itself); any other handle is Error(kInvalidArgument).
  virtual void wait_external(void* producer);
  // Queues a host function to run after the work queued so far (cudaLaunchHostFunc on a GPU; the
  // stream's worker thread on the host device). `fn` must not call the device API. An exception it
  // throws fails the stream like failed device work: reported at the next synchronize().
  virtual void launch_host_func(std::function<void()> fn) = 0;
  // The backend's stream for launching kernels on it: the cudaStream_t of a CUDA stream, nullptr
  // for the host device.
  virtual void* native_handle() const noexcept = 0;
  // Blocks until everything queued so far is done. Throws Error(kTimeout) past `timeout` and the
  // first error of queued work (Error(kDevice)); the stream stays unusable after such an error.
  virtual void synchronize(std::chrono::milliseconds timeout) = 0;
  // Synchronous forms: memcpy_async / memset_async, then synchronize(timeout). The caller waits
  // anyway, so the host device runs the work in the caller's thread once the stream is idle (no
  // hand-off to its worker and back: a gradient hand-in per tensor paid two thread wake-ups).
  virtual void copy(void* dst, const void* src, std::size_t bytes,
                    std::chrono::milliseconds timeout);
  virtual void fill(void* dst, int value, std::size_t bytes, std::chrono::milliseconds timeout);
};

// A device allocation, freed on destruction. Move-only.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(Device* device, void* ptr, std::size_t bytes)
      : device_(device), ptr_(ptr), bytes_(bytes) {}
  DeviceMemory(DeviceMemory&& other) noexcept { *this = std::move(other); }
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() { reset(); }
  void reset() noexcept;
  void* get() const noexcept { return ptr_; }
  std::size_t size() const noexcept { return bytes_; }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

 private:
  Device* device_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual DeviceKind kind() const = 0;  // kCuda or kHost
  // "cuda:0 NVIDIA H200" or "host-emulated".
  virtual std::string name() const = 0;
  // Memory the device has (for the host device: the value it was created with).
  virtual std::uint64_t total_memory() const = 0;
  // The CUDA ordinal of a GPU (what query_pointer reports for its memory); -1 for the host device.
  virtual int ordinal() const { return -1; }

  // Device memory of `bytes` bytes (256-byte aligned at least). Throws Error(kOutOfMemory).
  DeviceMemory allocate(std::size_t bytes) { return DeviceMemory(this, alloc(bytes), bytes); }
  virtual void* alloc(std::size_t bytes) = 0;
  virtual void free(void* ptr) noexcept = 0;
  // Whether alloc() returns zero-filled memory (the host device: fresh anonymous pages), so that
  // a caller that needs zeros need not write them. False for a GPU.
  virtual bool alloc_zeroed() const { return false; }

  virtual std::unique_ptr<Stream> create_stream() = 0;
  virtual std::unique_ptr<Event> create_event() = 0;

  // Page-locks host memory for fast asynchronous copies (cudaHostRegister). Returns false when
  // this device has no such notion (host device): the caller then uses mlock itself.
  virtual bool register_host(void* ptr, std::size_t bytes) = 0;
  virtual void unregister_host(void* ptr) noexcept = 0;
};

// Decorators (like leveldb's EnvWrapper): every call is forwarded to the owned inner stream /
// device; a wrapper overrides only what it changes (the fault-injecting device, the tests'
// counting and watching devices). REQUIRES: inner is not null.
class StreamWrapper : public Stream {
 public:
  explicit StreamWrapper(std::unique_ptr<Stream> inner) : inner_(std::move(inner)) {}
  void memcpy_async(void* dst, const void* src, std::size_t bytes) override {
    inner_->memcpy_async(dst, src, bytes);
  }
  void memset_async(void* dst, int value, std::size_t bytes) override {
    inner_->memset_async(dst, value, bytes);
  }
  void record(Event& event) override { inner_->record(event); }
  void wait_event(Event& event) override { inner_->wait_event(event); }
  void wait_external(void* producer) override { inner_->wait_external(producer); }
  void launch_host_func(std::function<void()> fn) override {
    inner_->launch_host_func(std::move(fn));
  }
  void* native_handle() const noexcept override { return inner_->native_handle(); }
  void synchronize(std::chrono::milliseconds timeout) override { inner_->synchronize(timeout); }

 protected:
  Stream& inner() { return *inner_; }

 private:
  std::unique_ptr<Stream> inner_;
};

class DeviceWrapper : public Device {
 public:
  explicit DeviceWrapper(std::unique_ptr<Device> inner) : inner_(std::move(inner)) {}
  Device& inner() { return *inner_; }

  DeviceKind kind() const override { return inner_->kind(); }
  std::string name() const override { return inner_->name(); }
  std::uint64_t total_memory() const override { return inner_->total_memory(); }
  int ordinal() const override { return inner_->ordinal(); }
  void* alloc(std::size_t bytes) override { return inner_->alloc(bytes); }
  void free(void* ptr) noexcept override { inner_->free(ptr); }
  bool alloc_zeroed() const override { return inner_->alloc_zeroed(); }
  std::unique_ptr<Stream> create_stream() override { return inner_->create_stream(); }
  std::unique_ptr<Event> create_event() override { return inner_->create_event(); }
  bool register_host(void* ptr, std::size_t bytes) override {
    return inner_->register_host(ptr, bytes);
  }
  void unregister_host(void* ptr) noexcept override { inner_->unregister_host(ptr); }

 private:
  std::unique_ptr<Device> inner_;
};

// Probing factory. kAuto: the CUDA device when this build has CUDA and a GPU answers, else the
// host-emulated device; kCuda without a usable GPU throws Error(kUnsupported) saying why; kHost
// always works. The choice is logged. `host_memory` is the host device's total_memory().
std::unique_ptr<Device> make_device(DeviceKind kind, int ordinal = 0,
                                    std::uint64_t host_memory = 1ULL << 40);

// The GPU of this process on its node, for the device, the communicator, the profiler and the
// step bench alike: LOCAL_RANK (torchrun), OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID,
// SLURM_LOCALID (the first one set to a number >= 0), else rank % ranks_per_node; modulo
// device_count (>= 1).
int local_device_ordinal(int rank, int ranks_per_node, int device_count);

// The host-emulated device, directly (tests).
std::unique_ptr<Device> make_host_device(std::uint64_t total_memory = 1ULL << 40);

}  // namespace strata
