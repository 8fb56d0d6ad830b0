// The speculative update (docs/offload.md, "The speculative update"; issue 26): during the last
// micro-batch's backward, each chunk whose gradient is complete is updated into pending versions
// of its state and parameters, assuming no clipping and no overflow; step() commits them when the
// ranks' decision agrees (clip coefficient 1, finite, the loss scale and hyper-parameters as
// assumed) and runs the rest, else discards them and runs the serial update. Either way the result
// is the serial step's, bit for bit: the same Adam over the same committed state, gradients, step
// counts and grad scale (1 / loss scale, what the decision computes for a coefficient of 1).
#include <algorithm>

#include "strata/log.hpp"
#include "zero/engine_impl.hpp"

namespace strata {

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
}  // namespace

void Engine::Impl::check_overlap() const {
  if (cfg.optimizer.overlap != OptimizerOverlap::kOn) return;
  const char* why = nullptr;
  if (layout->stage() < 2)
    why = "zero.stage 0-1 reduce the gradients at step(): no gradient is final during the backward";
  else if (cfg.optimizer.update == OptimizerUpdate::kDevice)
    why = "optimizer.update: device is not speculated";
  bool any = false;
  for (std::size_t ci = 0; ci < layout->chunks().size() && !why && !any; ++ci)
    any = optimizer->can_speculate(ci);
  if (!why && !any)
    why =
        "no chunk of this rank's state can be speculated (state on gpu, gradients on nvme, or "
        "a chunk larger than a pinned buffer with every part staged)";
  if (why)
    fail(ErrorCode::kUnsupported,
         strcat("engine rank ", rank, ": optimizer.overlap: on is not supported here: ", why,
                "; use overlap: auto (serial where unsupported) or off"));
}

// A rank's gradients become final no finer than bucket by bucket: a range inside one bucket is
// final all at once, at the last hand-in, and nothing is updated during the backward — what the
// user asked overlap for. Said once, by each rank it concerns (rank 0's range is handed in last).
void Engine::Impl::warn_one_bucket() const {
  if (cfg.optimizer.overlap == OptimizerOverlap::kOff || layout->stage() < 2) return;
  const std::size_t b = std::max<std::uint64_t>(cfg.zero.reduce_bucket_size, 1);
  const std::size_t first = layout->own_begin(), count = layout->partition_size();
  if (count == 0 || first / b != (first + count - 1) / b) return;
  log_warn(
      "engine rank ", rank, ": optimizer.overlap: ", optimizer_overlap_name(cfg.optimizer.overlap),
      " with zero.reduce_bucket_size ", cfg.zero.reduce_bucket_size, ": this rank's ", count,
      " elements lie in one bucket, so its gradients become final all at once at the last "
      "hand-in and nothing is updated during the backward; a bucket a fraction of them "
      "(e.g. ",
      std::max<std::size_t>(count / 8, 1), ") lets the update start earlier (docs/offload.md)");
}

// A micro-batch beyond train.accumulate begins: its hand-in adds into the gradient chunks the
// speculation may still be reading, so the speculation is stopped (joined, discarded; the step
// runs serially) first.
void Engine::Impl::stop_speculation_before_next_micro_batch(TensorId id) {
  if (spec.started && !spec.off && reducer->starts_micro_batch(id)) cancel_speculation();
}

void Engine::Impl::after_hand_in() {
  last_grad = zero::Clock::now();
  if (cfg.optimizer.overlap == OptimizerOverlap::kOff || layout->stage() < 2) return;
  const std::size_t k = expected_micro_batches();
  const std::size_t micro = reducer->micro_batch();
  if (micro + 1 > k) {  // more micro-batches than train.accumulate: the gradients change again
    if (!spec.off) cancel_speculation();
    return;
  }
  if (micro + 1 != k || spec.off || spec_pause > 0) return;
  // At the backward's last gradient its last collectives are retired and every chunk is taken
  // (waiting for their fills); before, only the chunks whose fills completed (a converting or
  // accumulating fill completes on the filler's stream: the hand-in does not wait for it).
  const bool last = reducer->all_arrived();
  if (last) reducer->retire_all();
  speculate(reducer->take_filled_chunks(last));
}

std::size_t Engine::Impl::expected_micro_batches() const {
  return micro_batches ? micro_batches : std::max<std::uint32_t>(1, cfg.train.accumulate);
}

// At step(): the loop ran `ran` micro-batches. A count other than the expected one (a loop that
// accumulates without saying so in train.accumulate) becomes the expectation, so that the next
// step's speculation starts in its last micro-batch instead of being discarded at the next one
// (or never starting); said once.
void Engine::Impl::note_micro_batches(std::size_t ran) {
  if (cfg.optimizer.overlap == OptimizerOverlap::kOff || layout->stage() < 2) return;
  if (ran != expected_micro_batches() && !said_micro_batches && rank == 0) {
    said_micro_batches = true;
    log_info("engine: the loop ran ", ran, " micro-batch(es) in a step where ",
             micro_batches ? "the last step ran " : "train.accumulate says ",
             expected_micro_batches(), ": the speculative update now starts in micro-batch ", ran,
             " (train.accumulate: ", ran, " says so from the start)");
  }
  micro_batches = ran;
}

// Every tensor with elements in chunk ci was handed in on this rank (so no rank skips it: its step
// count advances, as the speculation assumed).
bool Engine::Impl::chunk_used(std::size_t ci) const {
  const zero::Chunk& c = layout->chunks()[ci];
  const std::size_t b = layout->opt_begin() + c.r.begin, e = b + c.r.count;
  const Partition& part = layout->partition();
  const std::vector<bool>& used = reducer->used();
  for (std::size_t t = 0; t < part.num_tensors(); ++t) {
    const std::size_t tb = part.offset(t), te = tb + part.tensor(t).numel;
    if (tb >= e) break;
    if (te > b && te > tb && !used[t]) return false;
  }
  return true;
}

void Engine::Impl::speculate(const std::vector<std::size_t>& filled) {
  const std::uint64_t budget = cfg.optimizer.speculation_budget;
  const int stage = layout->stage();
  std::vector<std::size_t> go;
  std::vector<BufferId> open;
  std::uint64_t bytes = spec.bytes;
  bool params = spec.params_open;
  for (std::size_t ci : filled) {
    if (!optimizer->can_speculate(ci) || !chunk_used(ci)) continue;
    const zero::Chunk& c = layout->chunks()[ci];
    std::uint64_t cost = store().padded_bytes(c.opt);
    if (stage == 3) cost += store().padded_bytes(c.param);
    if (stage < 3 && !params) cost += store().padded_bytes(layout->params_buffer());
    if (budget && bytes + cost > budget) continue;  // waits for the decision
    if (stage < 3 && !params) open.push_back(layout->params_buffer());
    params = params || stage < 3;
    open.push_back(c.opt);
    if (stage == 3) open.push_back(c.param);
    bytes += cost;
    go.push_back(ci);
  }
  if (go.empty()) return;
  if (!spec.started) {
    spec.started = true;
    spec.scale = scaler.scale();
    spec.groups = groups;
  }
  spec.params_open = params;
  spec.bytes = bytes;
  // On the speculation thread, while the backward goes on: the pending versions are opened there
  // too (a block's first one is allocated and page-locked, which must not stall the hand-in). A
  // failure is found by join_speculation (the step then runs serially).
  const float grad_scale = static_cast<float>(1.0 / spec.scale);
  // The statistics' scale, as decide() will compute it if the loss scale stays spec.scale.
  const float stats_inv = static_cast<float>(1.0 / (spec.scale * world));
  spec_jobs->post(
      [this, go, open, grad_scale, stats_inv] { speculate_job(go, open, grad_scale, stats_inv); });
}

// On the speculation thread. REQUIRES: spec.chunks, spec.pending and spec.refused are touched by
// no other thread until the jobs are joined (settle_jobs).
void Engine::Impl::speculate_job(const std::vector<std::size_t>& go,
                                 const std::vector<BufferId>& open, float grad_scale,
                                 float stats_inv) {
  if (spec.refused) return;  // an earlier open did not fit: the flat parameters may not be open
  try {
    store().open_pending(open);  // all or none
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kBudget) throw;
    spec.refused = true;  // no room: these chunks and the later ones wait for the decision
    return;
  }
  spec.pending.insert(spec.pending.end(), open.begin(), open.end());
  spec.chunks.insert(spec.chunks.end(), go.begin(), go.end());
  optimizer->speculate(go, grad_scale, stats_inv);
}

bool Engine::Impl::settle_jobs() noexcept {
  if (!spec_jobs) return false;
  spec_jobs->wait();
  const std::exception_ptr e = spec_jobs->take_error();
  if (!e) return false;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    // The committed versions are untouched: the step runs serially (and meets a real failure
    // itself).
    log_warn("engine rank ", rank,
             ": speculative update failed, the step runs serially: ", x.what());
  } catch (...) {
    log_warn("engine rank ", rank, ": speculative update failed, the step runs serially");
  }
  return true;
}

void Engine::Impl::join_speculation() noexcept {
  if (settle_jobs()) cancel_speculation();
}

std::vector<bool> Engine::Impl::settle_speculation(bool go, StepResult& res) {
  const bool keep = go && !spec.off && res.clip_coef == 1.0 && scaler.scale() == spec.scale &&
                    same_groups(groups, spec.groups);
  const auto n = static_cast<std::uint32_t>(spec.chunks.size());
  res.speculated_chunks = n;
  std::vector<bool> done;
  if (keep) {
    store().commit(spec.pending);
    done.assign(layout->chunks().size(), false);
    for (std::size_t ci : spec.chunks) done[ci] = true;
    res.committed_chunks = n;
  } else {
    res.rolled_back_chunks = n;
  }
  spec.chunks.clear();        // counted above
  cancel_speculation(false);  // discard (what was not committed), clear
  return done;
}

void Engine::Impl::before_group_change(bool changes) noexcept {
  join_speculation();
  if (changes && spec.started) cancel_speculation();
}

void Engine::Impl::before_state_change() noexcept { cancel_speculation(spec.started); }

void Engine::Impl::cancel_speculation(bool off) noexcept {
  settle_jobs();  // nothing writes the pending versions any more
  spec_discarded += static_cast<std::uint32_t>(spec.chunks.size());
  if (!spec.pending.empty()) {
    try {
      store().discard(spec.pending);
    } catch (const std::exception& e) {
      log_error("engine rank ", rank, ": discarding the speculative update: ", e.what());
    }
  }
  if (optimizer) optimizer->clear_ahead_stats();  // none before finalize() or after its failure
  spec = Speculation{};
  spec.off = off;
}

void Engine::Impl::end_speculation_step(bool speculated, bool rolled_back) {
  optimizer->clear_ahead_stats();
  spec = Speculation{};
  if (spec_pause > 0) {
    if (--spec_pause == 0) spec_history.clear();  // auto: try again
    return;
  }
  if (!speculated || cfg.optimizer.overlap != OptimizerOverlap::kAuto) return;
  spec_history.push_back(rolled_back);
  if (spec_history.size() > kAutoWindow) spec_history.pop_front();
  if (static_cast<std::size_t>(std::count(spec_history.begin(), spec_history.end(), true)) >=
      kAutoMaxRollbacks) {
    spec_pause = kAutoPause;
    if (rank == 0)
      log_info("engine: speculative update paused for ", kAutoPause, " steps (", kAutoMaxRollbacks,
               " of the last ", spec_history.size(), " rolled back)");
  }
}

}  // namespace strata
