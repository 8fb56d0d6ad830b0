// Host views of a snapshot of the rank's optimizer state (checkpoint/optimizer_state.hpp) for the
// background checkpoint writer: acquire(r) reads the pinned versions (TierStore::read_pinned) of
// the chunks r touches into host scratch; release(r, false) frees nothing but lets the blocks the
// writer has passed go (unpinned: ranges are visited in ascending order). Read-only: a dirty
// release is refused (Error(kInvalidArgument)).
//
// Ownership: borrows the store and the chunk list (must outlive it); the snapshot is the caller's
// (unpin(s) of what is left is the caller's). Thread-safety: one user at a time.
#pragma once

#include <chrono>
#include <span>
#include <vector>

#include "checkpoint/optimizer_state.hpp"
#include "strata/io_file.hpp"
#include "tier/tier_store.hpp"
#include "zero/chunk.hpp"

namespace strata::zero {

class PinnedStateStore final : public OptimizerStateStore {
 public:
  PinnedStateStore(TierStore& store, std::span<const Chunk> chunks, std::size_t size,
                   SnapshotId snapshot, std::chrono::milliseconds timeout);
  std::size_t size() const override { return size_; }
  StateView acquire(Range r) override;
  void release(Range r, bool dirty) override;

 private:
  TierStore& store_;
  std::span<const Chunk> chunks_;
  std::size_t size_;
  SnapshotId snap_;
  std::chrono::milliseconds timeout_;
  std::vector<float> scratch_;  // master | m | v of the acquired range
  std::vector<bool> unpinned_;  // per chunk
  bool acquired_ = false;
  Range range_;
};

}  // namespace strata::zero
