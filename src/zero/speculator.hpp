// Speculator: the speculative update (optimizer.overlap; docs/offload.md, "The speculative
// update"). During the last micro-batch's backward, each chunk whose gradient is final is updated
// into pending versions of its state and parameters on a thread of its own, assuming no clipping
// and no overflow; at step() the ranks' decision settles it: commit (clip coefficient 1, finite,
// the loss scale and hyper-parameters as assumed: the chunks are done) or discard (the serial
// update runs). Either way the result is the serial step's, bit for bit. It also keeps the rules
// around that: the micro-batch the speculation starts in (train.accumulate, or what the loop ran
// last step), the speculation budget, and under optimizer.overlap auto a pause after repeated
// rollbacks.
//
// The orchestrator (Engine::Impl) calls a few named steps: before_hand_in / after_hand_in around
// each gradient hand-in, join before anything else reads the optimizer or the blocks the jobs
// write, settle at step() once the decision is known, cancel where the gradients or the state
// change under it (a micro-batch beyond, dropped gradients, a load, write_state,
// set_optimizer_step, a hyper-parameter change), end_step after each step.
//
// Ownership: borrows the config, layout, reducer, optimizer, store, loss scaler and parameter
// groups (the engine's; they outlive it); owns the speculation's state and its job thread (made
// when optimizer.overlap is not off at stages 2-3; destroyed first: it waits for the jobs).
// Thread-safety: every member function is called from the engine's thread. The jobs run
// OptimizerStep::speculate on the job thread and write `job_` (pending blocks, chunks, refused):
// from a post until join()/settle/cancel waited for the jobs, only the job thread touches `job_`
// (the wait orders it; no mutex). Failure: the constructor throws Error(kUnsupported) for
// optimizer.overlap on where nothing can be speculated; a failed job makes the step serial (its
// pending versions discarded, the committed state untouched, logged); settle's commit throws what
// the store throws; cancel and the setters' hooks never throw (errors logged).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "strata/config.hpp"
#include "strata/engine.hpp"
#include "tier/tier_store.hpp"
#include "zero/clock.hpp"
#include "zero/engine_layout.hpp"
#include "zero/gradient_reducer.hpp"
#include "zero/loss_scaler.hpp"
#include "zero/optimizer_step.hpp"
#include "zero/serial_jobs.hpp"

namespace strata::zero {

class Speculator {
 public:
  // Checks optimizer.overlap against what this rank can speculate (Error(kUnsupported)) and warns
  // where the rank's range lies in one bucket.
  Speculator(const Config& cfg, int rank, int world, const EngineLayout& layout,
             GradientReducer& reducer, OptimizerStep& optimizer, TierStore& store,
             const LossScaler& scaler, const std::vector<ParamGroupOptions>& groups);
  ~Speculator();  // waits for the jobs posted; pending versions are left to the store
  Speculator(const Speculator&) = delete;
  Speculator& operator=(const Speculator&) = delete;

  // ---- around a gradient hand-in of tensor `id`
  // A micro-batch beyond train.accumulate begins: its hand-in would add into the gradient chunks
  // the jobs may be reading, so the speculation is cancelled first (the step runs serially).
  void before_hand_in(TensorId id);
  // After each hand-in: speculates the chunks the last micro-batch completed (posted to the job
  // thread; a micro-batch beyond the expected count cancels instead).
  void after_hand_in();

  // ---- the step
  // The jobs posted so far finished; one that failed makes this step serial. Before anything else
  // reads the optimizer (its statistics, step counts) or the blocks the jobs write.
  void join() noexcept;
  void wait() const;  // the jobs posted so far finished (nothing settled)
  // Some chunk of this step was speculated (REQUIRES: joined).
  bool speculated() const { return !job_.chunks.empty(); }
  // The step's decision is known (`go`: the update runs; res: its clip coefficient): commits the
  // pending versions and returns, per chunk, the ones done, when the speculation's assumptions
  // held; else discards them (returns none). Counts the chunks in `res`. REQUIRES: joined.
  std::vector<bool> settle(bool go, StepResult& res);
  // The step failed: what it speculated is discarded and not counted as rolled back.
  void abandon_step() noexcept;
  // At step(): the loop ran `ran` micro-batches in it (the next step's speculation starts in the
  // last of as many). Before the reducer forgets them.
  void note_micro_batches(std::size_t ran);
  // After the step's outcome: the chunks discarded before step() are added to `res` (speculated
  // and rolled back); optimizer.overlap auto pauses after repeated rollbacks. `speculated`: what
  // speculated() said before settle.
  void end_step(bool speculated, StepResult& res);

  // ---- changes under the speculation
  // Drops this step's pending versions (errors logged); `off`: the rest of the step runs serially.
  void cancel(bool off = true) noexcept;
  // A setter changes a group's hyper-parameters (`changes`: to another value). The jobs posted
  // read them: joined first; chunks already speculated with the old values are discarded and the
  // rest of the step runs serially (else a change and its undo inside one backward would commit
  // chunks of the value in between).
  void before_group_change(bool changes) noexcept;
  // write_state / set_optimizer_step change what the speculation read: what it speculated is
  // discarded, and a step whose speculation had started runs serially (between steps nothing had:
  // the next step speculates as usual).
  void before_state_change() noexcept;

  std::uint64_t bytes() const { return bytes_; }  // padded bytes of the pending versions (tests)

 private:
  // What the jobs write (the job thread, between a post and the wait that joins it).
  struct JobState {
    std::vector<std::size_t> chunks;  // speculated, in order
    std::vector<BufferId> pending;    // blocks with a pending version (opt, parameters)
    bool refused = false;             // a pending version did not fit: nothing more this step
  };

  void check_overlap() const;
  void warn_one_bucket() const;
  std::size_t expected_micro_batches() const;
  bool chunk_used(std::size_t ci) const;  // every tensor of the chunk used on this rank
  void speculate(const std::vector<std::size_t>& filled);
  void run_job(const std::vector<std::size_t>& go, const std::vector<BufferId>& open,
               float grad_scale, float stats_inv);
  bool settle_jobs() noexcept;  // waits for the jobs; whether one failed (logged)
  void time_backward();         // at each hand-in of the speculated micro-batch
  void reset_step(bool off) noexcept;

  const Config& cfg_;
  const int rank_, world_;
  const EngineLayout& layout_;
  GradientReducer& reducer_;
  OptimizerStep& optimizer_;
  TierStore& store_;
  const LossScaler& scaler_;
  const std::vector<ParamGroupOptions>& groups_;
  const bool enabled_;  // optimizer.overlap not off, stages 2-3, a chunk can be speculated

  // ---- this step's speculation (the engine's thread)
  JobState job_;
  bool params_open_ = false;                // stages 1-2: the flat parameters' pending version
  std::uint64_t bytes_ = 0;                 // padded bytes of the pending versions
  double scale_ = 0;                        // the loss scale assumed
  std::vector<ParamGroupOptions> assumed_;  // the hyper-parameters assumed
  bool off_ = false;      // this step runs serially (a failure, a micro-batch beyond K, a change)
  bool started_ = false;  // scale and groups taken (the step's first speculated chunks)
  Clock::time_point backward_begin_{};  // the speculated micro-batch's first hand-in
  // Chunks speculated in this step and discarded before step() (a change of the state or the
  // hyper-parameters, a micro-batch beyond, dropped gradients, a failed job): step() reports them
  // rolled back.
  std::uint32_t discarded_ = 0;

  // ---- across steps
  std::deque<bool> history_;  // optimizer.overlap auto: the last speculated steps rolled back?
  int pause_ = 0;             // ... steps left without speculating
  // The micro-batches the loop ran in its last step (0: no step yet, train.accumulate assumed).
  std::size_t micro_batches_ = 0;
  bool said_micro_batches_ = false;
  // The last step's speculated backward, first hand-in to last (0: none yet): with this step's
  // first hand-in, when the update split expects the backward to end (OptimizerStep's
  // set_backward_end).
  double last_backward_s_ = 0;

  // Last: destroyed first, it waits for the jobs (which use the members above). Null when
  // disabled.
  std::unique_ptr<SerialJobs> jobs_;
};

}  // namespace strata::zero
