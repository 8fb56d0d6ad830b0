// Host views of a snapshot of the rank's optimizer state (checkpoint/optimizer_state.hpp) for the
// background checkpoint writer: acquire(r) reads the pinned versions (TierStore::read_pinned) of
// the chunks r touches into host scratch (or takes the reads prefetch(r) started), with the
// parameters of r (model dtype, StateView::params) from the pinned parameter blocks (stage 3, each
// chunk's param block) or made from the pinned master weights (stages 0-2: the model-dtype rounding
// the update writes, store_elem); release(r, false) frees nothing but lets the blocks the writer
// has passed go (unpinned: ranges are visited in ascending order; the parameters, where they are
// master weights (Chunk::master_in_params), are not in the snapshot: the save's call copied the
// rank's range of them, MasterCopy, freed after the last chunk they hold). Read-only: a dirty
// release is refused (Error(kInvalidArgument)).
//
// Ownership: borrows the store and the chunk list (must outlive it); the snapshot is the caller's
// (unpin(s) of what is left is the caller's). Thread-safety: one user at a time.
#pragma once

#include <chrono>
#include <functional>
#include <span>
#include <vector>

#include "checkpoint/optimizer_state.hpp"
#include "strata/io_file.hpp"
#include "tier/tier_store.hpp"
#include "zero/chunk.hpp"
#include "zero/range_reads.hpp"

namespace strata::zero {

// Where the snapshot's parameters come from:
//   kNone        the snapshot does not hold them (StateView::params is null; the caller copied)
//   kBlocks      each chunk's pinned `param` block (stage 3)
//   kFromMaster  the pinned FP32 master weights rounded to `dtype` with store_elem
//                (core/numeric.hpp), bitwise what every path that writes the parameters of stages
//                0-2 writes (the update's kernels, a skipped run, initialize, write_state): valid
//                only while the engine knows that the rank's parameters follow its master
//                (engine_state.cpp, "params_follow_master").
struct ParamBlocks {
  enum class Source { kNone, kBlocks, kFromMaster };
  Source source = Source::kNone;
  DType dtype = DType::kFp32;
  std::size_t elem_bytes = 0;
  bool in_snapshot() const { return source != Source::kNone; }
};

// The master weights that are the parameters (Chunk::master_in_params), copied at the save's call:
// bytes [offset, offset + bytes) of buffer `params` (the rank's aliased chunks: their masters lie
// one after the other there). Only the rank's own range, not the whole flat parameters (which the
// store's copy-on-write of `params` would have copied: every rank's share at stages 1-2).
struct MasterCopy {
  BufferId params = 0;
  std::uint64_t offset = 0, bytes = 0;
  IoBuffer data;
  // The copy of the chunks' masters, made now (a read of `params`; none aliased: empty).
  static MasterCopy of(TierStore& store, std::span<const Chunk> chunks,
                       std::chrono::milliseconds timeout);
};

class PinnedStateStore final : public checkpoint::OptimizerStateStore {
 public:
  // `before_read`: called before each range's reads start (the writer's pause for steps: in
  // prefetch(), or in acquire() of a range not prefetched); may be empty. `master`: the aliased
  // chunks' master weights (read from it, not from the snapshot; freed once the writer passed
  // the last such chunk).
  PinnedStateStore(TierStore& store, std::span<const Chunk> chunks, ParamBlocks params,
                   std::size_t size, SnapshotId snapshot, std::chrono::milliseconds timeout,
                   std::function<void()> before_read = {}, MasterCopy master = {});
  std::size_t size() const override { return size_; }
  checkpoint::StateView acquire(Range r) override;
  void release(Range r, bool dirty) override;
  void prefetch(Range r) override;
  void drop_prefetch() noexcept override;

 private:
  TierStore& store_;
  const void* read_block(BufferId id);  // the pinned version of the whole block, into block_
  void read_params(Range r);            // into params() (kBlocks)
  void round_master(const float* master, std::size_t n);  // into params() (kFromMaster)
  void check_range(Range r) const;
  void start_reads(Range r);  // before_read_, then the reads of r into next_

  std::span<const Chunk> chunks_;
  ParamBlocks pblocks_;
  std::size_t size_;
  SnapshotId snap_;
  std::chrono::milliseconds timeout_;
  std::function<void()> before_read_;
  RangeReads current_;  // master | m | v of the acquired range
  RangeReads next_;     // the prefetched range
  // The parameters of the acquired range and of the one before it (page-aligned, kept between
  // ranges: a checkpoint's direct file is written straight from them).
  IoBuffer params_[2];
  int params_current_ = 0;
  unsigned char* params(std::size_t bytes);  // the acquired range's, at least `bytes`
  IoBuffer block_;                           // a whole pinned block read back
  std::vector<bool> unpinned_;               // per chunk
  MasterCopy master_;                        // the aliased chunks' masters (freed when passed)
  bool acquired_ = false;
  Range range_;
};

}  // namespace strata::zero
