// The checkpoint seam over the TierStore: host views of a rank's optimizer state, whichever tier
// each chunk lives in (checkpoint/optimizer_state.hpp). acquire(r) reads the elements of r from
// the chunks it touches (NVMe: CRC-checked; gpu: device→host copies) into host scratch, or takes
// the reads prefetch(r) started; release(r, dirty) writes them back (a chunk only partly inside r
// is read, patched and written whole).
//
// Ownership: borrows the store and the chunk list (the engine's; they must outlive it).
// Thread-safety: one user at a time, one range acquired at a time. Failure: the store's errors
// (IoError, Error(kChecksum / kDevice / kIo)) propagate; a failed release leaves the state as the
// store left it (see tier_store.hpp, "The failed state").
#pragma once

#include <chrono>
#include <span>
#include <vector>

#include "checkpoint/optimizer_state.hpp"
#include "tier/tier_store.hpp"
#include "zero/chunk.hpp"
#include "zero/range_reads.hpp"

namespace strata::zero {

class TierStateStore final : public checkpoint::OptimizerStateStore {
 public:
  TierStateStore(TierStore& store, std::span<const Chunk> chunks, std::size_t size,
                 std::chrono::milliseconds timeout);
  std::size_t size() const override { return size_; }
  checkpoint::StateView acquire(Range r) override;
  void release(Range r, bool dirty) override;
  void prefetch(Range r) override;
  void drop_prefetch() noexcept override;

 private:
  // Chunk k's master | m | v into `out` (3 × count floats, padded room).
  void load(std::size_t k, std::vector<float>& out);
  void store_chunk(std::size_t k, const std::vector<float>& in);
  void check_range(Range r) const;
  void start_reads(RangeReads& reads, Range r);

  TierStore& store_;
  std::span<const Chunk> chunks_;
  std::size_t size_;
  std::chrono::milliseconds timeout_;
  RangeReads current_;  // the acquired range
  RangeReads next_;     // the prefetched one
  bool acquired_ = false;
  Range range_;
};

}  // namespace strata::zero
