// The checkpoint seam onto a rank's optimizer state (FP32 master weights and Adam's two moments):
// a small host-view interface. The state itself lives in the rank's TierStore, wherever
// offload.optimizer puts it (zero/tier_state_store.hpp adapts it); checkpoints
// (checkpoint/checkpoint.hpp) and Engine::read_state / write_state see it through this interface
// only.
#pragma once

#include <cstddef>

#include "strata/partition.hpp"

namespace strata::checkpoint {

struct StateView {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  std::size_t count = 0;
  // The parameters (model dtype) of the same elements, when the store holds them too (a snapshot
  // of the rank's state: RankState::params_in_store); else nullptr.
  const unsigned char* params = nullptr;
};

// Thread-safety: one user at a time, one range acquired at a time. acquire() may block (state on
// NVMe or in device memory is copied into host memory); failures throw strata::Error (IoError,
// Error(kChecksum / kDevice)).
class OptimizerStateStore {
 public:
  virtual ~OptimizerStateStore() = default;
  virtual std::size_t size() const = 0;  // elements
  // Host views of elements [r.begin, r.end()); valid until release(r, ...), and after a clean
  // release (dirty false) still readable until the first prefetch() or acquire() after the next
  // acquire() (a save writes one range out while the store reads the next).
  virtual StateView acquire(Range r) = 0;
  // dirty: the views were modified and must be stored back where the state lives.
  virtual void release(Range r, bool dirty) = 0;
  // A hint that the next acquire() will be of `r`: a store may start reading it now, while the
  // caller still uses the range it holds (a checkpoint save writes one range out while the next
  // is read). The state must not change meanwhile except through this store (a dirty release()
  // drops the prefetch): a caller that will not acquire `r` next drops it (drop_prefetch()) before
  // it lets go of the store. drop_prefetch() also gives back the host memory held for the views
  // of released ranges (REQUIRES: no range acquired). Default: nothing.
  virtual void prefetch(Range r) { (void)r; }
  virtual void drop_prefetch() noexcept {}
};

}  // namespace strata::checkpoint
