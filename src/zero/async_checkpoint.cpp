// An asynchronous checkpoint save in flight (see async_checkpoint.hpp).
#include "zero/async_checkpoint.hpp"

#include "strata/error.hpp"
#include "strata/log.hpp"
#include "zero/clock.hpp"

namespace strata::zero {

AsyncCheckpoint::AsyncCheckpoint(TierStore& store, std::span<const Chunk> chunks,
                                 ParamBlocks params, checkpoint::PendingSave save,
                                 checkpoint::RankState state, std::vector<unsigned char> copy,
                                 std::chrono::milliseconds timeout)
    : store_(store), save_(std::move(save)), state_(std::move(state)), params_(std::move(copy)) {
  state_.params = {params_.data(), params_.size()};
  state_.params_in_store = params.in_snapshot();
  try {
    if (params.in_snapshot() && !params_.empty())
      fail(ErrorCode::kInternal, "checkpoint: the parameters both copied and in the snapshot");
    std::vector<BufferId> ids;
    for (const Chunk& c : chunks) {
      ids.push_back(c.opt);
      if (params.source == ParamBlocks::Source::kBlocks) ids.push_back(c.param);
    }
    // The parameters that are master weights (Chunk::master_in_params) change without the store
    // (the next step updates them in place; the loop writes them: load_state_dict, an EMA swap):
    // the rank's range of them is copied now, not pinned (a pinned version of `params` would copy
    // every rank's share at stages 1-2).
    MasterCopy master = MasterCopy::of(store_, chunks, timeout);
    snap_ = store_.pin_committed(ids);
    pinned_ok_ = true;
    pinned_ = std::make_unique<PinnedStateStore>(
        store_, chunks, params, state_.store->size(), snap_, timeout, [this] { yield_to_step(); },
        std::move(master));
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
  if (finished_) return;
  wait_local();
  commit_if_durable();
  try {
    if (error_) std::rethrow_exception(error_);
    if (commit_error_) std::rethrow_exception(commit_error_);
  } catch (const std::exception& e) {
    log_error("checkpoint: the asynchronous save into ", save_.path,
              " failed (the previous checkpoint stays): ", e.what());
    return;
  }
  if (!committed_)
    log_warn("checkpoint: the asynchronous save into ", save_.path,
             " was not committed (no wait_checkpoint() nor step after its writers finished); the "
             "previous checkpoint stays");
}

void AsyncCheckpoint::run() noexcept {
  const auto t0 = Clock::now();
  try {
    header_crc_ = checkpoint::write_shard(save_, state_);
  } catch (...) {
    error_ = std::current_exception();
  }
  unpin_all();
  MutexLock lock(mutex_);
  stats_.write_s = seconds_since(t0);
  done_ = true;
  durable_ = !error_;
}

void AsyncCheckpoint::yield_to_step() {
  UniqueLock lock(mutex_);
  if (!step_running_) return;
  const auto t0 = Clock::now();
  ++stats_.pauses;
  step_ended_.wait_for(lock, kMaxYield,
                       [this]() NO_THREAD_SAFETY_ANALYSIS { return !step_running_; });
  stats_.paused_s += seconds_since(t0);
}

void AsyncCheckpoint::set_step_running(bool running) {
  {
    MutexLock lock(mutex_);
    step_running_ = running;
  }
  if (!running) step_ended_.notify_all();
}

AsyncCheckpoint::WriterStats AsyncCheckpoint::writer_stats() const {
  MutexLock lock(mutex_);
  return stats_;
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
  set_step_running(false);
  if (thread_.joinable()) thread_.join();
}

bool AsyncCheckpoint::durable() const {
  MutexLock lock(mutex_);
  return durable_;
}

bool AsyncCheckpoint::commit_if_durable() {
  if (!everywhere_) return false;
  if (committed_) return true;
  wait_local();  // (the writer has finished: durable everywhere)
  committed_ = true;
  commit_error_ = checkpoint::commit_durable_save(save_, state_);
  return true;
}

void AsyncCheckpoint::finish(Communicator& comm) {
  wait_local();
  finished_ = true;  // whatever the collective below throws, the destructor has nothing to do
  if (commit_if_durable()) {
    checkpoint::finish_committed_save(save_, state_, comm, commit_error_);
    return;
  }
  checkpoint::finish_save(save_, state_, comm, error_, header_crc_);
}

VersionBytes AsyncCheckpoint::rewrite_cost() const {
  if (!writing()) return {};
  return store_.rewrite_cost(snap_);
}

}  // namespace strata::zero
