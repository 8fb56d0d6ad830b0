// The engine's orchestrator (include/strata/engine.hpp for the contract). Engine::Impl holds what
// the loop registered before finalize() and, from finalize() on, a few collaborators that each own
// their state (docs/architecture.md, "The engine"):
//   EngineLayout     (engine_layout.hpp)     the partition, chunk grid, state buffers — const
//   GradientReducer  (gradient_reducer.hpp)  hand-in, buckets, reductions, the gradient chunks
//   ParamGatherer    (param_gatherer.hpp)    stage 3's gathers, release, replayed prefetch
//   OptimizerStep    (optimizer_step.hpp)    the statistics pass and Adam over the chunk grid
//   RankAgreement    (rank_agreement.hpp)    norm, overflow, outcome, start-up: all ranks alike
//   LossScaler       (loss_scaler.hpp)       the loss scale
//   HostCollectives  (host_collectives.hpp)  collectives on host arrays, staged
// over the rank's storage (RankStorage: device, I/O engine, pool, TierStore) and its runtime
// scratch (tier/scratch_arena.hpp). The files of Impl itself: engine.cpp (the API, finalize, the
// failed state), engine_step.cpp (the step), engine_state.cpp (parameters, optimizer state,
// the checkpoint seam).
//
// Thread-safety: one thread drives an Engine (engine.hpp); no member is shared with another
// thread except through the store, the filler and the communicator, which synchronize themselves.
#pragma once

#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "tier/scratch_arena.hpp"
#include "zero/async_checkpoint.hpp"
#include "zero/clock.hpp"
#include "zero/engine_layout.hpp"
#include "zero/gradient_reducer.hpp"
#include "zero/host_collectives.hpp"
#include "zero/loss_scaler.hpp"
#include "zero/optimizer_step.hpp"
#include "zero/param_gatherer.hpp"
#include "zero/rank_agreement.hpp"
#include "zero/rank_storage.hpp"
#include "zero/serial_jobs.hpp"
#include "zero/tier_state_store.hpp"

namespace strata {

struct Engine::Impl {
  Impl(const Config& c, Communicator& cm);
  ~Impl();

  // ---- fixed at construction
  const Config cfg;
  Communicator& comm;
  const int rank, world;

  // ---- registered before finalize()
  std::vector<TensorSpec> specs;
  // The initial values finalize() reads: the copies add_parameter made, or the caller's memory
  // (add_parameter_borrowed). Both dropped by finalize().
  std::vector<std::span<const float>> initial;
  std::vector<std::vector<float>> initial_copies;
  std::vector<GroupId> tensor_group;
  std::vector<ParamGroupOptions> groups;  // [0]: optimizer.lr / weight_decay; set_lr any time
  zero::StorageWrap wrap;                 // tests: per-rank fault injection (engine_access.hpp)

  // ---- built by finalize() (declared in build order: destroyed in reverse, storage last)
  std::unique_ptr<zero::RankStorage> storage;
  std::unique_ptr<zero::RankAgreement> agreement;
  std::unique_ptr<const zero::EngineLayout> layout;
  std::unique_ptr<ScratchArena> scratch;
  std::unique_ptr<zero::HostCollectives> host_comm;
  std::unique_ptr<zero::GradientReducer> reducer;
  std::unique_ptr<zero::ParamGatherer> gatherer;
  std::unique_ptr<zero::OptimizerStep> optimizer;
  std::unique_ptr<zero::TierStateStore> state;  // the checkpoint seam's host views
  std::unique_ptr<Stream> caller_handoff;       // waits for callers' streams (made on first use)
  // An asynchronous checkpoint save in flight (destroyed first: it waits for its writer).
  std::unique_ptr<zero::AsyncCheckpoint> saving;
  // The speculative update's thread (engine_speculate.cpp): Adam of the chunks whose gradients
  // are final runs there while the backward goes on. Only `optimizer->speculate` runs on it; the
  // engine's thread joins it (join_speculation) before anything else touches the optimizer or
  // the blocks it writes. Made by finalize() when optimizer.overlap is not off; ~Impl joins it
  // first.
  std::unique_ptr<zero::SerialJobs> spec_jobs;

  // ---- changed by steps
  zero::LossScaler scaler;
  EngineStats st;  // counters and the orchestrator's own timings
  // The step's decision when clip_grad_norm() took it before step(): step() uses it as it is.
  struct EarlyDecision {
    bool go = false;        // the update runs (no overflow)
    StepResult res;         // norm, overflow, clip coefficient
    float grad_scale = 0;   // clip coefficient / loss scale
    double loss_scale = 1;  // the scale the gradients carry
  };
  std::optional<EarlyDecision> early;
  // The speculative update of this step (engine_speculate.cpp): chunks updated into pending
  // versions during the backward, on the assumptions it made (loss scale, hyper-parameters).
  struct Speculation {
    std::vector<std::size_t> chunks;        // speculated, in order
    std::vector<BufferId> pending;          // blocks with a pending version (opt, parameters)
    bool params_open = false;               // stages 1-2: the flat parameters' pending version
    std::uint64_t bytes = 0;                // padded bytes of the pending versions
    double scale = 0;                       // the loss scale assumed
    std::vector<ParamGroupOptions> groups;  // the hyper-parameters assumed
    bool off = false;      // this step runs serially (a failure, a micro-batch beyond K, a change)
    bool started = false;  // scale and groups taken (the step's first speculated chunks)
    bool refused = false;  // a pending version did not fit: nothing more this step (spec thread)
  };
  Speculation spec;
  std::deque<bool> spec_history;  // optimizer.overlap auto: the last speculated steps rolled back?
  int spec_pause = 0;             // ... steps left without speculating
  // The micro-batches the loop ran in its last step (0: no step yet, train.accumulate assumed):
  // the speculation starts in the last of them.
  std::size_t micro_batches = 0;
  // Chunks speculated in this step and discarded before step() (a change of the state or the
  // hyper-parameters, a micro-batch beyond, dropped gradients, a failed job): step() reports them
  // rolled back.
  std::uint32_t spec_discarded = 0;
  bool said_micro_batches = false;
  zero::Clock::time_point last_grad{};     // the last gradient handed in
  std::string loaded_client_state;         // of the checkpoint last loaded
  std::vector<unsigned char> ckpt_params;  // the checkpoint seam's parameters, during a call
  bool params_follow_master = true;        // stages 0-2: params == round(master) (engine_state.cpp)
  // Set when a call failed after it began changing state: the rank's state may mix two steps.
  std::string broken;

  // ---- engine.cpp
  bool finalized() const { return layout != nullptr; }
  void require_finalized(const char* what) const;
  // Throws Error(kIo) "unusable after a failed step" once the engine failed; the first call to
  // find the store failed (by a share's copy that ran on its own) throws that failure instead.
  void require_usable(const char* what);
  // The engine failed (its state may mix two steps): remembered, the filler's pool buffers let go.
  void mark_broken(const std::string& what) noexcept;
  // A call failed with `e` after it began changing state: the engine is marked failed and the
  // error to report is returned — the gradient filler's first failed copy when there is one (the
  // cause: `e` may be the store refusing work because of it), else `e`.
  std::exception_ptr fail_call(const std::exception& e) noexcept;
  void check_id(TensorId id, const char* what) const;
  void finalize();
  void build_collaborators();  // local only: no collective (the start-up agreement follows)
  void initialize_state();     // rank 0's initial values everywhere
  TierStore& store() { return storage->store(); }
  zero::StorageReport report() const;
  // The hand-off from a caller's stream (set_gradient / step with a StreamHandle): returns once
  // the work queued on `caller` so far is complete. Changes nothing; throws what the wait threw.
  void wait_for_caller(StreamHandle caller, const char* what);
  EngineStats stats() const;

  // ---- engine_step.cpp
  // `memory`: what the caller says it is; on a GPU the memory is checked (memory_checks.hpp) and
  // host memory takes the host path whatever was said. `producer` (device memory on a GPU): the
  // asynchronous hand-in (Engine::set_gradient_async).
  void set_gradient(TensorId id, const void* grad, Tier memory,
                    const StreamHandle* producer = nullptr);
  Tier gradient_memory(TensorId id, const void* grad, Tier said) const;
  void skip_gradient(TensorId id);
  // Some rank skipped a tensor's gradient: which tensors every rank skipped (one exchange).
  std::vector<bool> agree_skipped();
  StepResult step();
  // REQUIRES: finalized, usable, every gradient arrived.
  double clip_grad_norm(double max_norm);
  // Parts 2-3 of a step: the statistics, the ranks' agreement, the loss scale; sets *grad_scale.
  // `local`: this rank's failure so far (it still joins the agreement, then rethrows it).
  bool decide(std::exception_ptr& local, StepResult& res, float* grad_scale, bool* agreed);
  void finish_update(bool ok_here);  // the outcome exchange after the update
  void publish_params();             // stages 1-2: the all-gather of the updated parameters
  void all_gather_params();          // every rank's partition of the flat parameters
  void end_step(bool applied, StepResult& res);

  // ---- engine_speculate.cpp (docs/offload.md, "The speculative update")
  // finalize(): Error(kUnsupported) for optimizer.overlap on where nothing can be speculated.
  void check_overlap() const;
  // finalize(): a warning where overlap is asked for and the rank's range lies in one bucket.
  void warn_one_bucket() const;
  // After each gradient hand-in: speculate the chunks the last micro-batch completed.
  void after_hand_in();
  void speculate(const std::vector<std::size_t>& filled);
  void speculate_job(const std::vector<std::size_t>& go, const std::vector<BufferId>& open,
                     float grad_scale, float stats_inv);
  bool chunk_used(std::size_t ci) const;  // every tensor of the chunk used on this rank
  // The step's decision is known: commit (returns the chunks done) or discard.
  std::vector<bool> settle_speculation(bool go, StepResult& res);
  // Drops this step's pending versions (errors logged); `off`: the step runs serially.
  void cancel_speculation(bool off = true) noexcept;
  // A setter changes a group's hyper-parameters (`changes`: to another value). The jobs posted
  // read them: joined first; chunks already speculated with the old values are discarded and the
  // rest of the step runs serially (else a change and its undo inside one backward would commit
  // chunks of the value in between).
  void before_group_change(bool changes) noexcept;
  // write_state / set_optimizer_step change what the speculation read: what it speculated is
  // discarded, and a step whose speculation had started runs serially (between steps nothing had:
  // the next step speculates as usual).
  void before_state_change() noexcept;
  void stop_speculation_before_next_micro_batch(TensorId id);
  std::size_t expected_micro_batches() const;
  void note_micro_batches(std::size_t ran);
  // The speculative jobs posted so far finished; one that failed makes this step serial (its
  // pending versions discarded, the committed state untouched). REQUIRES: the engine's thread.
  void join_speculation() noexcept;
  bool settle_jobs() noexcept;  // waits for the jobs; whether one failed (logged)
  void end_speculation_step(bool speculated, bool rolled_back);

  // ---- engine_state.cpp
  const void* param(TensorId id) const;
  const void* gradient(TensorId id) const;
  void read_param(TensorId id, std::span<float> out);
  void gather(std::span<const TensorId> ids);
  void prefetch(std::span<const TensorId> ids);
  void release(std::span<const TensorId> ids);
  void read_state(TensorId id, StateKind kind, std::span<float> out);
  void write_state(TensorId id, StateKind kind, std::span<const float> in);
  void write_params(TensorId id, std::span<const float> in, const zero::TensorShare& share);
  // Parameters [b, b + n) of the own partition (stage 3), model dtype, from / into the chunks.
  void read_own(std::size_t b, std::size_t n, unsigned char* host);
  void write_own(std::size_t b, std::size_t n, const unsigned char* host);
  checkpoint::RankState rank_state(bool copy_params = true);

  // ---- engine_checkpoint.cpp
  void save(const std::string& dir, SaveMode mode, std::string_view client_state,
            const CheckpointModel* model);
  // Waits for the save in flight and commits it (collective); throws its failure.
  void finish_saving();
  // Before a change of the optimizer state: commits an asynchronous save every rank's shard of
  // which is durable (rank 0), and waits for this rank's writer when rewriting the blocks it
  // still pins would not fit in the tiers' budgets (local, no collective). `step`: a step begins
  // (the writer pauses until its outcome agreement).
  void make_room_for_update(bool step = false);
  void after_load(const checkpoint::RankState& r);
  void restore_groups(const std::vector<checkpoint::GroupEntry>& saved);
};

}  // namespace strata
