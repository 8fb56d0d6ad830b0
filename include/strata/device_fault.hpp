// A Device wrapper that injects faults, for tests of everything above the device (the tier store,
// the device-side optimizer update): failed allocations (Error(kOutOfMemory)), failed copies and
// failed host functions (the stream reports Error(kDevice) at its next synchronize, as a real
// asynchronous failure does), and delayed copies. Everything else is forwarded to the inner device.
//
// Matching: a fault applies to operations of its kind, counted from add_fault(): the nth up to
// nth+count-1 (1-based; count 0 = every one from nth on).
// Ownership: owns the inner device. Thread-safety: as the inner device; the fault table is
// guarded by a mutex.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "strata/device.hpp"

namespace strata {

enum class DeviceFaultKind {
  kAllocFail,     // Device::alloc throws Error(kOutOfMemory)
  kCopyFail,      // Stream::memcpy_async does not copy; the stream fails with Error(kDevice)
  kHostFuncFail,  // Stream::launch_host_func does not run fn; the stream fails with Error(kDevice)
  kDelay,         // Stream::memcpy_async is preceded by a `delay` of stream time
};

struct DeviceFault {
  DeviceFaultKind kind = DeviceFaultKind::kCopyFail;
  std::uint64_t nth = 1;
  std::uint64_t count = 1;
  std::chrono::milliseconds delay{50};
};

class FaultInjectingDevice final : public DeviceWrapper {
 public:
  explicit FaultInjectingDevice(std::unique_ptr<Device> inner);
  ~FaultInjectingDevice() override;

  std::size_t add_fault(const DeviceFault& fault);  // an id for fired()
  void clear_faults();
  std::uint64_t fired(std::size_t id) const;  // operations it has fired on

  std::string name() const override;
  void* alloc(std::size_t bytes) override;
  std::unique_ptr<Stream> create_stream() override;

  // For the wrapped streams: whether the next operation of `kind` is hit (and the fault's delay).
  bool hit(DeviceFaultKind kind, std::chrono::milliseconds* delay = nullptr);

 private:
  struct State {
    DeviceFault fault;
    std::uint64_t matched = 0, fired = 0;
  };
  mutable std::mutex mu_;
  std::vector<State> faults_;
};

}  // namespace strata
