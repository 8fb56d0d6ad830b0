// Where a rank's optimizer state (FP32 master weights and Adam's two moments) lives, behind a
// small interface: the step acquires one sub-group, runs Adam on it and releases it (dirty)
// before the next, or hands all its ranges to update(). Two implementations: the resident host
// store here, and the NVMe-offloaded store with the pipelined update (zero/offload_store.hpp).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "strata/partition.hpp"

namespace strata::zero {

struct StateView {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  std::size_t count = 0;
};

// Thread-safety: one user at a time. acquire() may block (a streaming store waits for its read);
// failures throw strata::Error.
class OptimizerStateStore {
 public:
  virtual ~OptimizerStateStore() = default;
  virtual std::size_t size() const = 0;  // elements
  // The state of elements [r.begin, r.end()); valid until release(r, ...).
  virtual StateView acquire(Range r) = 0;
  // dirty: the view was modified and must be kept (written back by a streaming store).
  virtual void release(Range r, bool dirty) = 0;

  // One optimizer pass: fn(r, view) for pieces r covering `ranges` in order (a streaming store may
  // cut a range into several pieces that fit its buffers; each piece's view holds exactly r's
  // elements), every piece kept (dirty). Default: acquire / fn / release per range. A streaming
  // store overlaps reading the next pieces and writing the previous ones with fn.
  using UpdateFn = std::function<void(Range r, const StateView& view)>;
  virtual void update(std::span<const Range> ranges, const UpdateFn& fn) {
    for (const Range& r : ranges) {
      StateView v = acquire(r);
      fn(r, v);
      release(r, true);
    }
  }
};

// Host-resident store: master = `master_init`, moments zero.
std::unique_ptr<OptimizerStateStore> make_resident_state_store(std::span<const float> master_init);

}  // namespace strata::zero
