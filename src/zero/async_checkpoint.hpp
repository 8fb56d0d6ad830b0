// An asynchronous checkpoint save in flight (Engine::save_checkpoint with SaveMode::kAsync; see
// engine.hpp). Built on the engine thread after the ranks agreed on the save (checkpoint
// begin_save): it pins the committed version of every optimizer-state block of the rank
// (TierStore::pin_committed: training goes on, copy-on-write keeps the pinned bytes) and starts a
// writer thread that streams the rank's shard from the pinned versions through the checkpoint's
// file seam (checkpoint write_shard: blocks, CRCs, fdatasync), unpinning each block once it has
// been read. The parameters (model dtype) were copied into host memory by the caller.
// finish() — on the engine thread, every rank alike — waits for the writer and runs the
// collective finish_save: rank 0 commits the manifest only when every rank's shard is durable.
//
// Failure: anything failing after begin_save (the pin, the writer) is kept and reported by
// finish() on every rank (the previous checkpoint stays); the training state is never touched.
// Ownership: borrows the store (must outlive it); owns the thread, the snapshot and the params.
// Thread-safety: one engine thread calls every member; the writer thread runs only run() and
// touches only the store (thread-safe), its own PinnedStateStore and the immutable save data.
// The destructor waits for the writer and unpins (the save is left uncommitted if finish() was
// not called: its shard is removed by the next save into that directory).
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
  // `state`: the rank's seam as rank_state() made it (its store is replaced by the pinned views,
  // its params by `params`, which it owns from now on).
  AsyncCheckpoint(TierStore& store, std::span<const Chunk> chunks, PendingSave save,
                  RankState state, std::vector<unsigned char> params,
                  std::chrono::milliseconds timeout);
  ~AsyncCheckpoint();
  AsyncCheckpoint(const AsyncCheckpoint&) = delete;
  AsyncCheckpoint& operator=(const AsyncCheckpoint&) = delete;

  const std::string& path() const { return save_.path; }
  bool writing() const;  // the writer thread has not finished
  // Waits for the writer (this rank only, no collective) and unpins what it still pinned.
  void wait_local();
  // wait_local(), then the collective finish_save: throws (on every rank) when any rank failed.
  void finish(Communicator& comm);
  // What rewriting the blocks still pinned would hold (TierStore::rewrite_cost).
  VersionBytes rewrite_cost() const;

 private:
  void run() noexcept;  // the writer thread
  void unpin_all() noexcept;

  TierStore& store_;
  PendingSave save_;
  RankState state_;
  std::vector<unsigned char> params_;
  std::unique_ptr<PinnedStateStore> pinned_;
  SnapshotId snap_ = 0;
  bool pinned_ok_ = false;
  mutable Mutex mutex_;
  bool done_ GUARDED_BY(mutex_) = false;
  std::exception_ptr error_;      // the pin's or the writer's; read after join()
  std::uint32_t header_crc_ = 0;  // the writer's; read after join()
  std::thread thread_;
};

}  // namespace strata::zero
