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
// During the backward (the speculative update) the device's kernels share the GPU with the
// backward's, so the device takes a chunk's work only where the CPU would not finish it, and the
// work queued behind it, before the backward is expected to end (split_elements): the time left
// in the backward is a term of the choice, set by the speculation from the last step's backward.
// After it (the serial step, the backward's last chunks) both sides finish together.
//
// Ownership: borrows the device; owns its DeviceAdam. Thread-safety: one caller at a time (the
// engine's thread, or the speculation's while the engine waits for it). Failure: the device's
// errors propagate from run() after the CPU side finished (the caller's step fails).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "strata/adam.hpp"

namespace strata::zero {

// How many of a chunk's n elements the device takes, both rates known (elements per second, > 0):
// `left_s` seconds of the backward left (<= 0: none) and `queued` elements queued for the CPU
// behind this chunk (updated after it, by the CPU alone as far as this choice knows). None where
// the CPU finishes the chunk and the queue within left_s; else the least share that lets both
// sides finish the chunk in the time the queue leaves; else (no time left, or not even both sides
// together can finish in it) the share with which both finish together, n * d / (c + d).
std::size_t split_elements(std::size_t n, double cpu_rate, double device_rate, double left_s,
                           std::size_t queued);

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

  // When the backward is expected to end, or none (after it): from the engine's thread, read by
  // device_share on the speculation's (atomic).
  void set_backward_end(std::optional<std::chrono::steady_clock::time_point> end);
  // Elements queued for the CPU's update (the speculation's jobs posted and not yet updated):
  // `delta` added; clear_queue() when the jobs were joined.
  void queue(std::int64_t delta) { queued_ += delta; }
  void clear_queue() { queued_ = 0; }

  // Elements each side updated since construction.
  std::uint64_t cpu_elements() const { return cpu_elements_; }
  std::uint64_t device_elements() const { return device_elements_; }

 private:
  const std::function<double(std::size_t)> forced_;
  const std::size_t window_;
  std::unique_ptr<DeviceAdam> device_;
  double cpu_rate_ = 0, device_rate_ = 0;  // elements per second, 0 before the first measure
  std::atomic<std::int64_t> end_ns_{0};    // the backward's expected end (steady_clock), 0: none
  std::atomic<std::int64_t> queued_{0};    // elements queued for the CPU, this chunk's included
  std::uint64_t cpu_elements_ = 0, device_elements_ = 0;
};

}  // namespace strata::zero
