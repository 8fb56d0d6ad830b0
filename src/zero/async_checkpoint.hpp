// An asynchronous checkpoint save in flight (Engine::save_checkpoint with SaveMode::kAsync; see
// engine.hpp). Built on the engine thread after the ranks agreed on the save (checkpoint
// begin_save): it pins the committed version of every optimizer-state block of the rank
// (TierStore::pin_committed: training goes on, copy-on-write keeps the pinned bytes) and starts a
// writer thread that streams the rank's shard from the pinned versions through the checkpoint's
// file seam (checkpoint write_shard: blocks, CRCs, fdatasync), unpinning each block once it has
// been read. The parameters (model dtype) are not copied during the save call either: at stage 3
// each chunk's param block is pinned too and read by the writer; at stages 0-2 they live in one
// flat device buffer that the update writes in place while the layout holds it for the model's use
// (the store cannot pin it), but they are exactly the model-dtype rounding of the FP32 master
// weights (every path that writes them writes store_elem(master); engine_state.cpp,
// "params_follow_master"), so the writer makes them from the pinned master (ParamBlocks::
// kFromMaster). Only where the engine knows that they may differ (a checkpoint whose parameters
// were not its master's rounding was loaded; a write_state of the master failed part-way) does
// the caller copy the rank's slice into host memory (`copy`: 2-4 bytes per parameter). Where the
// FP32 master weights are the parameters (Chunk::master_in_params) the call copies the rank's
// range of them (MasterCopy, 4 bytes per element): the update and the loop write them in place.
//
// The step's own I/O goes first: the engine marks the time a step runs (set_step_running: from
// the step's start to its outcome agreement — the gradients' and the update's streams); the writer
// pauses before it starts reading each piece (up to 8 MiB of each section) while it is marked, at
// most kMaxYield a piece, so that back-to-back steps still let it progress. The writer reads one
// piece ahead and writes the one before on a thread of its own (checkpoint write_shard).
//
// Failure: anything failing after begin_save (the pin, the writer) is kept and reported by
// finish() on every rank (the previous checkpoint stays); the training state is never touched.
// Ownership: borrows the store and the chunks (must outlive it); owns the thread, the snapshot and
// the parameters' copy.
// Thread-safety: one engine thread calls every member; the writer thread runs only run() and
// touches only the store (thread-safe), its own PinnedStateStore and the immutable save data.
// The destructor waits for the writer and unpins; it commits (rank 0) when every rank's shard was
// known durable, and logs (error) a failure of the writer or of that commit; otherwise the save is
// left uncommitted (a warning; its shard is removed by the next save into that directory).
#pragma once

#include <chrono>
#include <exception>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.hpp"
#include "core/mutex.hpp"
#include "tier/tier_store.hpp"
#include "zero/chunk.hpp"
#include "zero/pinned_state_store.hpp"

namespace strata::zero {

class AsyncCheckpoint {
 public:
  // `state`: the rank's seam as rank_state() made it (its store is replaced by the pinned views);
  // `params.in_snapshot()`: the writer reads the parameters from the snapshot (pinned blocks or
  // the pinned master), else `copy` holds them (owned from now on).
  AsyncCheckpoint(TierStore& store, std::span<const Chunk> chunks, ParamBlocks params,
                  checkpoint::PendingSave save, checkpoint::RankState state,
                  std::vector<unsigned char> copy, std::chrono::milliseconds timeout);
  ~AsyncCheckpoint();
  AsyncCheckpoint(const AsyncCheckpoint&) = delete;
  AsyncCheckpoint& operator=(const AsyncCheckpoint&) = delete;

  const std::string& path() const { return save_.path; }
  bool writing() const;  // the writer thread has not finished
  // Waits for the writer (this rank only, no collective) and unpins what it still pinned.
  void wait_local();
  // wait_local(), then the collective finish_save: throws (on every rank) when any rank failed.
  void finish(Communicator& comm);
  // This rank's shard is written and durable (the writer finished without failure).
  bool durable() const;
  // Every rank's shard is durable (the step agreement said so): commit_if_durable() may commit.
  void mark_durable_everywhere() { everywhere_ = true; }
  // Rank 0 commits the manifest once every rank's shard is durable (not collective; a failure is
  // kept for finish()). Returns whether the save is committed (or its commit failed).
  bool commit_if_durable();
  // A step runs (its I/O goes first) or ended; wait_local() ends a pause too.
  void set_step_running(bool running);
  static constexpr std::chrono::milliseconds kMaxYield{100};
  struct WriterStats {
    double write_s = 0;   // the writer thread's time, pauses included
    double paused_s = 0;  // of it, paused for steps
    std::uint32_t pauses = 0;
  };
  WriterStats writer_stats() const;
  // What rewriting the blocks still pinned would hold (TierStore::rewrite_cost).
  VersionBytes rewrite_cost() const;
  // Parameter bytes the save call copied (`copy`): 0 unless the snapshot cannot hold them.
  std::size_t param_copy_bytes() const { return params_.size(); }

 private:
  void run() noexcept;   // the writer thread
  void yield_to_step();  // the writer thread, before each piece
  void unpin_all() noexcept;

  TierStore& store_;
  checkpoint::PendingSave save_;
  checkpoint::RankState state_;
  std::vector<unsigned char> params_;  // the parameters when the snapshot does not hold them
  std::unique_ptr<PinnedStateStore> pinned_;
  SnapshotId snap_ = 0;
  bool pinned_ok_ = false;
  mutable Mutex mutex_;
  bool done_ GUARDED_BY(mutex_) = false;
  bool durable_ GUARDED_BY(mutex_) = false;
  bool step_running_ GUARDED_BY(mutex_) = false;
  WriterStats stats_ GUARDED_BY(mutex_);
  CondVar step_ended_;
  bool everywhere_ = false;          // engine thread: every rank's shard durable
  bool committed_ = false;           // engine thread: commit_if_durable() ran
  std::exception_ptr commit_error_;  // engine thread: rank 0's commit failed
  bool finished_ = false;            // engine thread: finish() ran
  std::exception_ptr error_;         // the pin's or the writer's; read after join()
  std::uint32_t header_crc_ = 0;     // the writer's; read after join()
  std::thread thread_;
};

}  // namespace strata::zero
