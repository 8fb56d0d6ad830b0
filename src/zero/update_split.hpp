// UpdateSplit: where a chunk's Adam runs when the state lives in host memory (issue 49): the
// device's Adam kernel takes the chunk's leading elements (copied host → device, updated, copied
// back: DeviceAdam, on its own stream) while the CPU updates the rest, both at once; the share is
// chosen so that both sides finish together, from the rates each side reached on the chunks
// before (elements per second, the link's copies included on the device side). Adam is
// element-wise and the device kernel is bitwise the CPU kernel, so any split gives the serial
// step's bits. optimizer.update: auto on a CUDA device; tests force the share per chunk (all CPU,
// all device, alternating, the tail on the device) on the host-emulated device, whose "device"
// Adam is CpuAdam on the stream's worker.
//
// The device side's memory is DeviceAdam's staging: a chunk's master | m | v | gradients | param
// copy for the elements it takes, at most `window_elements` (the largest chunk by default).
//
// Ownership: borrows the device; owns its DeviceAdam. Thread-safety: one caller at a time (the
// engine's thread, or the speculation's while the engine waits for it). Failure: the device's
// errors propagate from run() after the CPU side finished (the caller's step fails).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "strata/adam.hpp"

namespace strata::zero {

class UpdateSplit {
 public:
  // forced: the device's share of chunk i in [0, 1] (tests); empty: chosen from the rates.
  UpdateSplit(Device& device, unsigned cpu_threads, std::chrono::milliseconds timeout,
              std::size_t window_elements, std::function<double(std::size_t)> forced = {});

  // How many leading elements of chunk `chunk` (n elements) the device updates.
  std::size_t device_share(std::size_t chunk, std::size_t n) const;
  DeviceAdam& device() { return *device_; }
  // queue_device() enqueues the device's part (device_n elements), run_cpu() runs the CPU's
  // (n - device_n) meanwhile; then waits for the device and updates the rates.
  void run(std::size_t device_n, std::size_t n, const std::function<void()>& queue_device,
           const std::function<void()>& run_cpu);

  // Elements each side updated since construction.
  std::uint64_t cpu_elements() const { return cpu_elements_; }
  std::uint64_t device_elements() const { return device_elements_; }

 private:
  const std::function<double(std::size_t)> forced_;
  const std::size_t window_;
  std::unique_ptr<DeviceAdam> device_;
  double cpu_rate_ = 0, device_rate_ = 0;  // elements per second, 0 before the first measure
  std::uint64_t cpu_elements_ = 0, device_elements_ = 0;
};

}  // namespace strata::zero
