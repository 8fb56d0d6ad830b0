// The reads of one range of a rank's optimizer state (master | m | v of the elements [r.begin,
// r.end()), whichever chunks they lie in) into host scratch of their own: started at once, waited
// for later. Each array of the scratch starts on a page (an IoBuffer, kept between ranges): a
// checkpoint's direct file is written straight from it. The two host views of the state that
// checkpoints stream through (TierStateStore: the committed state; PinnedStateStore: a snapshot)
// use two of them, so that the next range is read while the caller writes out the current one
// (OptimizerStateStore::prefetch).
//
// Ownership: owns the scratch; the chunk list is the caller's. Thread-safety: one user at a time.
// The destructor waits for reads still in flight (they write into the scratch) and drops their
// errors.
#pragma once

#include <chrono>
#include <functional>
#include <span>
#include <vector>

#include "strata/io_file.hpp"
#include "strata/partition.hpp"
#include "tier/tier_store.hpp"
#include "zero/chunk.hpp"

namespace strata::zero {

class RangeReads {
 public:
  // Issues one read: bytes [offset, offset + bytes) of buffer `id` (a chunk's state block, or the
  // parameters that are its master: state_place) into `dst`.
  using ReadFn =
      std::function<Transfer(BufferId id, std::uint64_t offset, std::uint64_t bytes, float* dst)>;
  RangeReads() = default;
  ~RangeReads() { settle(); }
  RangeReads(const RangeReads&) = delete;
  RangeReads& operator=(const RangeReads&) = delete;

  // REQUIRES: nothing in flight (settle() or wait() ran). Starts the reads of `r`; `timeout`
  // bounds each wait for them.
  void start(std::span<const Chunk> chunks, Range r, std::chrono::milliseconds timeout,
             const ReadFn& read);
  // Waits for every read, also after one failed; rethrows the first failure.
  void wait();
  // Waits for what is in flight and forgets the range (errors dropped; a read not finished in
  // time leaves its scratch allocated, never freed under it).
  void settle() noexcept;
  // settle(), then gives the scratch's memory back.
  void free() noexcept;
  bool holds(Range r) const {
    return started_ && r.begin == range_.begin && r.count == range_.count;
  }
  bool started() const { return started_; }
  float* array(int a) {
    return reinterpret_cast<float*>(scratch_.bytes() + static_cast<std::size_t>(a) * stride_);
  }
  void swap(RangeReads& other) noexcept;

 private:
  IoBuffer scratch_;        // master | m | v of range_, each at a multiple of stride_
  std::size_t stride_ = 0;  // bytes: range_.count floats rounded up to a page
  std::vector<Transfer> reads_;
  Range range_;
  bool started_ = false;
  std::chrono::milliseconds timeout_{0};
};

}  // namespace strata::zero
