// The engine's orchestrator (include/strata/engine.hpp for the contract). Engine::Impl holds what
// the loop registered before finalize() and, from finalize() on, a few collaborators that each own
// their state (docs/architecture.md, "The engine"):
//   EngineLayout     (engine_layout.hpp)     the partition, chunk grid, state buffers — const
//   GradientReducer  (gradient_reducer.hpp)  hand-in, buckets, reductions, the gradient chunks
//   ParamGatherer    (param_gatherer.hpp)    stage 3's gathers, release, replayed prefetch
//   OptimizerStep    (optimizer_step.hpp)    the statistics pass and Adam over the chunk grid
//   Speculator       (speculator.hpp)        the speculative update during the backward
//   RankAgreement    (rank_agreement.hpp)    norm, overflow, outcome, start-up: all ranks alike
//   LossScaler       (loss_scaler.hpp)       the loss scale
//   HostCollectives  (host_collectives.hpp)  collectives on host arrays, staged
// over the rank's storage (RankStorage: device, I/O engine, pool, TierStore) and its runtime
// scratch (tier/scratch_arena.hpp). The files of Impl itself: engine.cpp (the API, finalize, the
// failed state), engine_step.cpp (the step), engine_state.cpp (parameters, optimizer state,
// the checkpoint seam).
//
// Thread-safety: one thread drives an Engine (engine.hpp); no member is shared with another
// thread except through the store, the filler and the communicator, which synchronize themselves,
// and the Speculator's jobs (speculator.hpp), joined before the engine's thread touches what they
// use.
#pragma once

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
#include "zero/speculator.hpp"
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
  // The speculative update (speculator.hpp): Adam of the chunks whose gradients are final runs
  // on its thread while the backward goes on; the engine's thread joins it before anything else
  // touches the optimizer or the blocks it writes. Borrows the scaler and groups below: ~Impl
  // destroys it first.
  std::unique_ptr<zero::Speculator> speculator;

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
  zero::Clock::time_point last_grad{};     // the last gradient handed in
  std::string loaded_client_state;         // of the checkpoint last loaded
  std::vector<unsigned char> ckpt_params;  // the checkpoint seam's parameters, during a call
  bool params_follow_master = true;        // stages 0-2: params == round(master) (engine_state.cpp)
  // Set when a call failed after it began changing state: the rank's state may mix two steps.
  std::string broken;

  // ---- engine.cpp
  bool finalized() const { return layout != nullptr; }
  void require_finalized(const char* what) const;
  // Throws Error(kIo) "unusable after a failed call" once the engine failed; the first call to
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
  // A setter changes a group's hyper-parameters (Speculator::before_group_change; nothing is
  // speculated before finalize()).
  void before_group_change(bool changes) noexcept {
    if (speculator) speculator->before_group_change(changes);
  }

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

  // ---- engine_state.cpp
  const void* param(TensorId id) const;
  const void* gradient(TensorId id) const;
  void read_param(TensorId id, std::span<float> out);
  void gather(std::span<const TensorId> ids);
  void prefetch(std::span<const TensorId> ids);
  void release(std::span<const TensorId> ids);
  void read_state(TensorId id, StateKind kind, std::span<float> out);
  void write_states(std::span<const StateWrite> writes, const char* what);
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
