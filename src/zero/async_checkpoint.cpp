// An asynchronous checkpoint save in flight (see async_checkpoint.hpp).
#include "zero/async_checkpoint.hpp"

#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::zero {

AsyncCheckpoint::AsyncCheckpoint(TierStore& store, std::span<const Chunk> chunks, PendingSave save,
                                 RankState state, std::vector<unsigned char> params,
                                 std::chrono::milliseconds timeout)
    : store_(store), save_(std::move(save)), state_(std::move(state)), params_(std::move(params)) {
  state_.params = {params_.data(), params_.size()};
  try {
    std::vector<BufferId> ids;
    for (const Chunk& c : chunks) ids.push_back(c.opt);
    snap_ = store_.pin_committed(ids);
    pinned_ok_ = true;
    pinned_ =
        std::make_unique<PinnedStateStore>(store_, chunks, state_.store->size(), snap_, timeout);
    state_.store = pinned_.get();
  } catch (...) {  // reported by finish() on every rank: the others have begun the save too
    error_ = std::current_exception();
    unpin_all();
    MutexLock lock(mutex_);
    done_ = true;
    return;
  }
  thread_ = std::thread([this] { run(); });
}

AsyncCheckpoint::~AsyncCheckpoint() {
  const bool finished = !thread_.joinable();
  wait_local();
  if (!finished)
    log_warn("checkpoint: the asynchronous save into ", save_.path,
             " was not committed (wait_checkpoint() was not called); the previous checkpoint "
             "stays");
}

void AsyncCheckpoint::run() noexcept {
  try {
    header_crc_ = write_shard(save_, state_);
  } catch (...) {
    error_ = std::current_exception();
  }
  unpin_all();
  MutexLock lock(mutex_);
  done_ = true;
}

void AsyncCheckpoint::unpin_all() noexcept {
  if (!pinned_ok_) return;
  pinned_ok_ = false;
  try {
    store_.unpin(snap_);
  } catch (const std::exception& e) {
    log_error("checkpoint: releasing the snapshot of ", save_.path, " failed: ", e.what());
  }
}

bool AsyncCheckpoint::writing() const {
  MutexLock lock(mutex_);
  return !done_;
}

void AsyncCheckpoint::wait_local() {
  if (thread_.joinable()) thread_.join();
}

void AsyncCheckpoint::finish(Communicator& comm) {
  wait_local();
  finish_save(save_, state_, comm, error_, header_crc_);
}

VersionBytes AsyncCheckpoint::rewrite_cost() const {
  if (!writing()) return {};
  return store_.rewrite_cost(snap_);
}

}  // namespace strata::zero
