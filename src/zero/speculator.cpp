// The speculative update (speculator.hpp; docs/offload.md, "The speculative update"; issue 26):
// during the last micro-batch's backward, each chunk whose gradient is complete is updated into
// pending versions of its state and parameters, assuming no clipping and no overflow; step()
// commits them when the ranks' decision agrees (clip coefficient 1, finite, the loss scale and
// hyper-parameters as assumed) and runs the rest, else discards them and runs the serial update.
// Either way the result is the serial step's, bit for bit: the same Adam over the same committed
// state, gradients, step counts and grad scale (1 / loss scale, what the decision computes for a
// coefficient of 1).
#include "zero/speculator.hpp"

#include <algorithm>

#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::zero {

namespace {
constexpr std::size_t kAutoWindow = 4;  // auto: the last speculated steps looked at
constexpr std::size_t kAutoMaxRollbacks = 2;
constexpr int kAutoPause = 16;  // steps without speculating after that many rollbacks

bool same_groups(const std::vector<ParamGroupOptions>& a, const std::vector<ParamGroupOptions>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].lr != b[i].lr || a[i].weight_decay != b[i].weight_decay || a[i].beta1 != b[i].beta1 ||
        a[i].beta2 != b[i].beta2 || a[i].eps != b[i].eps)
      return false;
  return true;
}

// optimizer.overlap not off, stages 2-3, and some chunk of the rank's state can be speculated:
// where none can (overlap auto with the state on the gpu, say), nothing follows the hand-ins (the
// last one does not wait for the fills a speculation would read).
bool any_speculable(const EngineLayout& layout, const OptimizerStep& opt) {
  for (std::size_t ci = 0; ci < layout.chunks().size(); ++ci)
    if (opt.can_speculate(ci)) return true;
  return false;
}

bool overlap_enabled(const Config& cfg, const EngineLayout& layout, const OptimizerStep& opt) {
  return cfg.optimizer.overlap != OptimizerOverlap::kOff && layout.stage() >= 2 &&
         any_speculable(layout, opt);
}
}  // namespace

Speculator::Speculator(const Config& cfg, int rank, int world, const EngineLayout& layout,
                       GradientReducer& reducer, OptimizerStep& optimizer, TierStore& store,
                       const LossScaler& scaler, const std::vector<ParamGroupOptions>& groups)
    : cfg_(cfg),
      rank_(rank),
      world_(world),
      layout_(layout),
      reducer_(reducer),
      optimizer_(optimizer),
      store_(store),
      scaler_(scaler),
      groups_(groups),
      enabled_(overlap_enabled(cfg, layout, optimizer)) {
  check_overlap();
  warn_one_bucket();
  if (enabled_) jobs_ = std::make_unique<SerialJobs>();
}

Speculator::~Speculator() = default;

void Speculator::check_overlap() const {
  if (cfg_.optimizer.overlap != OptimizerOverlap::kOn) return;
  const char* why = nullptr;
  if (layout_.stage() < 2)
    why = "zero.stage 0-1 reduce the gradients at step(): no gradient is final during the backward";
  else if (cfg_.optimizer.update == OptimizerUpdate::kDevice)
    why = "optimizer.update: device is not speculated";
  if (!why && !any_speculable(layout_, optimizer_))
    why =
        "no chunk of this rank's state can be speculated (state on gpu, gradients on nvme, or "
        "a chunk larger than a pinned buffer with every part staged)";
  if (why)
    fail(ErrorCode::kUnsupported,
         strcat("engine rank ", rank_, ": optimizer.overlap: on is not supported here: ", why,
                "; use overlap: auto (serial where unsupported) or off"));
}

// A rank's gradients become final no finer than bucket by bucket: a range inside one bucket is
// final all at once, at the last hand-in, and nothing is updated during the backward — what the
// user asked overlap for. Said once, by each rank it concerns (rank 0's range is handed in last).
void Speculator::warn_one_bucket() const {
  if (!enabled_) return;
  const std::size_t b = std::max<std::uint64_t>(cfg_.zero.reduce_bucket_size, 1);
  const std::size_t first = layout_.own_begin(), count = layout_.partition_size();
  if (count == 0 || first / b != (first + count - 1) / b) return;
  log_warn("engine rank ", rank_,
           ": optimizer.overlap: ", optimizer_overlap_name(cfg_.optimizer.overlap),
           " with zero.reduce_bucket_size ", cfg_.zero.reduce_bucket_size, ": this rank's ", count,
           " elements lie in one bucket, so its gradients become final all at once at the last "
           "hand-in and nothing is updated during the backward; a bucket a fraction of them "
           "(e.g. ",
           std::max<std::size_t>(count / 8, 1),
           ") lets the update start earlier (docs/offload.md)");
}

// A micro-batch beyond train.accumulate begins: its hand-in adds into the gradient chunks the
// speculation may still be reading, so the speculation is stopped (joined, discarded; the step
// runs serially) first.
void Speculator::before_hand_in(TensorId id) {
  if (started_ && !off_ && reducer_.starts_micro_batch(id)) cancel();
}

void Speculator::after_hand_in() {
  if (!enabled_) return;
  const std::size_t k = expected_micro_batches();
  const std::size_t micro = reducer_.micro_batch();
  if (micro + 1 > k) {  // more micro-batches than train.accumulate: the gradients change again
    if (!off_) cancel();
    return;
  }
  if (micro + 1 != k) return;
  time_backward();
  if (off_ || pause_ > 0) return;
  // At the backward's last gradient its last collectives are retired and every chunk is taken
  // (waiting for their fills); before, only the chunks whose fills completed (a converting or
  // accumulating fill completes on the filler's stream: the hand-in does not wait for it).
  const bool last = reducer_.all_arrived();
  if (last) reducer_.retire_all();
  speculate(reducer_.take_filled_chunks(last));
}

// The update split's time left in the backward (update_split.hpp): at the speculated
// micro-batch's first hand-in, its end expected as far as the last step's backward lasted; at its
// last, over (and this one's length kept for the next step).
void Speculator::time_backward() {
  const Clock::time_point now = Clock::now();
  if (reducer_.arrived() == 1) {
    backward_begin_ = now;
    if (last_backward_s_ > 0)
      optimizer_.set_backward_end(now + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(last_backward_s_)));
  }
  if (reducer_.all_arrived()) {
    last_backward_s_ = std::chrono::duration<double>(now - backward_begin_).count();
    optimizer_.set_backward_end(std::nullopt);
  }
}

std::size_t Speculator::expected_micro_batches() const {
  return micro_batches_ ? micro_batches_ : std::max<std::uint32_t>(1, cfg_.train.accumulate);
}

// At step(): the loop ran `ran` micro-batches. A count other than the expected one (a loop that
// accumulates without saying so in train.accumulate) becomes the expectation, so that the next
// step's speculation starts in its last micro-batch instead of being discarded at the next one
// (or never starting); said once.
void Speculator::note_micro_batches(std::size_t ran) {
  if (!enabled_) return;
  if (ran != expected_micro_batches() && !said_micro_batches_ && rank_ == 0) {
    said_micro_batches_ = true;
    log_info("engine: the loop ran ", ran, " micro-batch(es) in a step where ",
             micro_batches_ ? "the last step ran " : "train.accumulate says ",
             expected_micro_batches(), ": the speculative update now starts in micro-batch ", ran,
             " (train.accumulate: ", ran, " says so from the start)");
  }
  micro_batches_ = ran;
}

// Every tensor with elements in chunk ci was handed in on this rank (so no rank skips it: its step
// count advances, as the speculation assumed).
bool Speculator::chunk_used(std::size_t ci) const {
  const Chunk& c = layout_.chunks()[ci];
  const std::size_t b = layout_.opt_begin() + c.r.begin, e = b + c.r.count;
  const Partition& part = layout_.partition();
  const std::vector<bool>& used = reducer_.used();
  for (std::size_t t = 0; t < part.num_tensors(); ++t) {
    const std::size_t tb = part.offset(t), te = tb + part.tensor(t).numel;
    if (tb >= e) break;
    if (te > b && te > tb && !used[t]) return false;
  }
  return true;
}

void Speculator::speculate(const std::vector<std::size_t>& filled) {
  const std::uint64_t budget = cfg_.optimizer.speculation_budget;
  const int stage = layout_.stage();
  std::vector<std::size_t> go;
  std::vector<BufferId> open;
  std::uint64_t bytes = bytes_;
  bool params = params_open_;
  for (std::size_t ci : filled) {
    if (!optimizer_.can_speculate(ci) || !chunk_used(ci)) continue;
    const Chunk& c = layout_.chunks()[ci];
    std::uint64_t cost = store_.padded_bytes(c.opt);
    if (stage == 3) cost += store_.padded_bytes(c.param);
    if (stage < 3 && !params) cost += store_.padded_bytes(layout_.params_buffer());
    if (budget && bytes + cost > budget) continue;  // waits for the decision
    if (stage < 3 && !params) open.push_back(layout_.params_buffer());
    params = params || stage < 3;
    open.push_back(c.opt);
    if (stage == 3) open.push_back(c.param);
    bytes += cost;
    go.push_back(ci);
  }
  if (go.empty()) return;
  if (!started_) {
    started_ = true;
    scale_ = scaler_.scale();
    assumed_ = groups_;
  }
  params_open_ = params;
  bytes_ = bytes;
  // On the job thread, while the backward goes on: the pending versions are opened there too (a
  // block's first one is allocated and page-locked, which must not stall the hand-in). A failure
  // is found by join() (the step then runs serially).
  const float grad_scale = static_cast<float>(1.0 / scale_);
  // The statistics' scale, as the decision will compute it if the loss scale stays scale_.
  const float stats_inv = static_cast<float>(1.0 / (scale_ * world_));
  optimizer_.queue_speculation(go);  // for the update split's choice (until updated)
  jobs_->post(
      [this, go, open, grad_scale, stats_inv] { run_job(go, open, grad_scale, stats_inv); });
}

// On the job thread. REQUIRES: job_ is touched by no other thread until the jobs are joined
// (settle_jobs).
void Speculator::run_job(const std::vector<std::size_t>& go, const std::vector<BufferId>& open,
                         float grad_scale, float stats_inv) {
  if (job_.refused) return;  // an earlier open did not fit: the flat parameters may not be open
  try {
    store_.open_pending(open);  // all or none
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kBudget) throw;
    job_.refused = true;  // no room: these chunks and the later ones wait for the decision
    return;
  }
  job_.pending.insert(job_.pending.end(), open.begin(), open.end());
  job_.chunks.insert(job_.chunks.end(), go.begin(), go.end());
  optimizer_.speculate(go, grad_scale, stats_inv);
}

void Speculator::wait() const {
  if (jobs_) jobs_->wait();
}

bool Speculator::settle_jobs() noexcept {
  if (!jobs_) return false;
  jobs_->wait();
  const std::exception_ptr e = jobs_->take_error();
  if (!e) return false;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    // The committed versions are untouched: the step runs serially (and meets a real failure
    // itself).
    log_warn("engine rank ", rank_,
             ": speculative update failed, the step runs serially: ", x.what());
  } catch (...) {
    log_warn("engine rank ", rank_, ": speculative update failed, the step runs serially");
  }
  return true;
}

void Speculator::join() noexcept {
  if (settle_jobs()) cancel();
}

std::vector<bool> Speculator::settle(bool go, StepResult& res) {
  const bool keep = go && !off_ && res.clip_coef == 1.0 && scaler_.scale() == scale_ &&
                    same_groups(groups_, assumed_);
  const auto n = static_cast<std::uint32_t>(job_.chunks.size());
  res.speculated_chunks = n;
  std::vector<bool> done;
  if (keep) {
    store_.commit(job_.pending);
    done.assign(layout_.chunks().size(), false);
    for (std::size_t ci : job_.chunks) done[ci] = true;
    res.committed_chunks = n;
  } else {
    res.rolled_back_chunks = n;
  }
  job_.chunks.clear();  // counted above
  cancel(false);        // discard (what was not committed), clear
  return done;
}

void Speculator::abandon_step() noexcept {
  cancel(false);
  discarded_ = 0;
}

void Speculator::before_group_change(bool changes) noexcept {
  join();
  if (changes && started_) cancel();
}

void Speculator::before_state_change() noexcept { cancel(started_); }

void Speculator::cancel(bool off) noexcept {
  settle_jobs();  // nothing writes the pending versions any more
  discarded_ += static_cast<std::uint32_t>(job_.chunks.size());
  if (!job_.pending.empty()) {
    try {
      store_.discard(job_.pending);
    } catch (const std::exception& e) {
      log_error("engine rank ", rank_, ": discarding the speculative update: ", e.what());
    }
  }
  reset_step(off);
}

// Forgets this step's speculation (its pending versions committed or discarded by the caller).
void Speculator::reset_step(bool off) noexcept {
  optimizer_.clear_ahead_stats();
  optimizer_.clear_speculation_queue();  // the jobs were joined (or nothing was posted)
  optimizer_.set_backward_end(std::nullopt);
  job_ = JobState{};
  params_open_ = false;
  bytes_ = 0;
  scale_ = 0;
  assumed_.clear();
  started_ = false;
  off_ = off;
}

void Speculator::end_step(bool speculated, StepResult& res) {
  res.speculated_chunks += discarded_;  // discarded before step(): rolled back too
  res.rolled_back_chunks += discarded_;
  const bool any = speculated || discarded_ > 0, rolled_back = res.rolled_back_chunks > 0;
  discarded_ = 0;
  reset_step(false);
  if (pause_ > 0) {
    if (--pause_ == 0) history_.clear();  // auto: try again
    return;
  }
  if (!any || cfg_.optimizer.overlap != OptimizerOverlap::kAuto) return;
  history_.push_back(rolled_back);
  if (history_.size() > kAutoWindow) history_.pop_front();
  if (static_cast<std::size_t>(std::count(history_.begin(), history_.end(), true)) >=
      kAutoMaxRollbacks) {
    pause_ = kAutoPause;
    if (rank_ == 0)
      log_info("engine: speculative update paused for ", kAutoPause, " steps (", kAutoMaxRollbacks,
               " of the last ", history_.size(), " rolled back)");
  }
}

}  // namespace strata::zero
