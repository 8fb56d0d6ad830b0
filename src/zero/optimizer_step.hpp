// OptimizerStep: Adam over the rank's chunk grid, and the gradient statistics the step's
// decision needs. Both run the one pipelined loop (tier/stream_loop.hpp): chunks whose state is on
// cpu or nvme run CpuAdam on the host (state read ahead from NVMe into pinned buffers, gradients
// copied device→host, parameters written behind host→device in the model dtype, overlapping the
// next chunk); chunks on gpu run the device kernel on device memory. With state on NVMe and the
// gradients readable in place, the decision (norm, overflow, loss scale) runs as the host loop's
// gate: the first reads are in flight while the statistics and the ranks' agreement run (a
// skipped step cancels them). The statistics are then read from the gradients in place, with no
// second loop on the store.
//
// Ownership: borrows the layout, the store, the device and the parameter groups (the engine's:
// set_lr between steps); owns the CPU and device Adam and the step count.
// Thread-safety: one thread (the engine's). Failure: the loop's errors propagate (naming the
// chunk, buffer and slot); the engine decides whether that is a failed state.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "checkpoint/optimizer_state.hpp"
#include "strata/adam.hpp"
#include "strata/engine.hpp"
#include "tier/stream_loop.hpp"
#include "zero/engine_layout.hpp"
#include "zero/update_split.hpp"

namespace strata::zero {

// Statistics of tiles (CpuAdam::kStatsTileElems elements of the rank's gradient range, in the
// statistics' order) computed ahead, during the backward, by the speculative update: those of the
// tiles that lie whole inside one speculated chunk, for one scale (`inv`).
struct AheadStats {
  float inv = 0;
  std::size_t total = 0;             // elements of the gradient range
  std::vector<std::size_t> offsets;  // where each chunk's gradient begins in it, `total` last
  std::vector<double> sums;          // per tile
  std::vector<std::uint8_t> known;   // per tile: 0 not computed, 1 finite, 2 not finite
  bool covers(std::size_t begin, std::size_t n) const;  // every tile of [begin, begin + n) known
};

// Gradient statistics over a stream of pieces, bitwise equal to one CpuAdam::grad_stats over their
// concatenation: pieces are cut at multiples of kStatsTileElems, a partial tile is carried; the
// tiles `ahead` knows are added from it (in their place in the order), not computed again.
class StatsStream {
 public:
  StatsStream(CpuAdam& adam, DType dtype, float scale, const AheadStats* ahead = nullptr);
  void feed(const void* grads, std::size_t n);
  // The next n elements, every tile of them known ahead (REQUIRES: ahead->covers them, and the
  // stream is at a tile's start).
  void skip(std::size_t n);
  AdamGradStats finish();
  std::size_t known_used() const { return known_used_; }  // tiles added from `ahead`

 private:
  void feed_tiles(const unsigned char* p, std::size_t n);  // from a tile's start
  void add_known(std::size_t tile);

  CpuAdam& adam_;
  const DType dtype_;
  const std::size_t elem_bytes_;
  const float scale_;
  const AheadStats* const ahead_;
  std::vector<unsigned char> carry_;
  std::size_t carried_ = 0;
  std::size_t pos_ = 0;  // elements fed (carried ones included)
  std::size_t known_used_ = 0;
  AdamGradStats acc_;
};

class OptimizerStep {
 public:
  OptimizerStep(const EngineLayout& layout, TierStore& store,
                const std::vector<ParamGroupOptions>& groups);
  ~OptimizerStep();

  // The statistics of the rank's gradients (finite, sum of squares), times `inv`: their own loop,
  // or, inside run()'s gate, read in place (no second loop on the store while the update's runs).
  AdamGradStats grad_stats(float inv);
  // Runs Adam over the chunks if `decide` says so (it sets *grad_scale before returning true);
  // returns whether the update ran. `decide` runs once: before the loop, or as its gate.
  // `done`: per chunk index (empty: none), chunks whose update is already applied (a committed
  // speculative update): skipped by the loops.
  bool run(const std::function<bool()>& decide, const float& grad_scale,
           const std::vector<bool>& done = {});

  // ---- the speculative update (docs/offload.md, "The speculative update")
  // Whether chunk `ci` can be speculated: its Adam runs on the host (state on cpu / nvme,
  // optimizer.update cpu), its gradient is not on nvme, and its item fits one pool slot with
  // every part staged.
  bool can_speculate(std::size_t ci) const;
  // Adam over `chunks` as the next update would run it with `grad_scale` (step counts one ahead;
  // no tensor skipped), the state and parameters written to the blocks' pending versions (the
  // caller opened them: opt, and the parameters). Throws what the loop throws.
  // `stats_inv`: the statistics' scale the decision will use if the loss scale stays; the
  // statistics of the chunks' whole tiles are computed too (AheadStats), so that the decision
  // reads only what was not speculated.
  void speculate(std::span<const std::size_t> chunks, float grad_scale, float stats_inv);
  // Where host-state chunks are updated (update_split.hpp): tests force the device's share per
  // chunk (`share` empty: the CPU alone again). The split's counts: elements per side so far.
  void force_update_split(std::function<double(std::size_t)> share);
  std::uint64_t cpu_elements() const { return split_ ? split_->cpu_elements() : 0; }
  std::uint64_t device_elements() const { return split_ ? split_->device_elements() : 0; }
  // The split's view of the backward (update_split.hpp; no split: nothing): when it is expected
  // to end (none: after it), and the chunks posted to the speculation (their elements queued for
  // the CPU until speculate() updated them; cleared once the jobs were joined).
  void set_backward_end(std::optional<std::chrono::steady_clock::time_point> end) {
    if (split_) split_->set_backward_end(end);
  }
  void queue_speculation(std::span<const std::size_t> chunks);
  void clear_speculation_queue() {
    if (split_) split_->clear_queue();
  }
  // Forgets the statistics computed ahead (the speculation was cancelled or settled).
  void clear_ahead_stats() { ahead_stats_ = AheadStats{}; }
  // Tiles the decisions took from the statistics computed ahead, so far (tests).
  std::uint64_t tiles_known_ahead() const { return tiles_known_ahead_; }

  // Adam's step count: the updates applied (the global one), and each tensor's own — the global
  // one less the updates that skipped the tensor, or what set_step_count(id, ...) set.
  std::int64_t step_count() const { return adam_step_; }
  std::int64_t step_count(TensorId id) const { return counts_.empty() ? adam_step_ : counts_[id]; }
  // Sets the global count and every tensor's.
  void set_step_count(std::int64_t step) {
    adam_step_ = step;
    counts_.clear();
  }
  void set_step_count(TensorId id, std::int64_t step);
  // Every tensor's own count (empty: all equal the global one), for checkpoints; `counts` empty or
  // one per tensor.
  const std::vector<std::int64_t>& step_counts() const { return counts_; }
  void set_step_counts(std::int64_t global, std::vector<std::int64_t> counts);
  // The tensors the next update skips (no rank used them; empty: none), set by the decision.
  void set_skipped(std::vector<bool> skipped) { skipped_ = std::move(skipped); }
  // The gradients were dropped (discard_gradients, a load): their decision with them.
  void clear_skipped() { skipped_.clear(); }
  double seconds() const { return optimizer_s_; }  // in Adam's loops, decision excluded
  const tier::StreamStats& last_update() const { return last_update_; }
  void set_pipelined(bool on) { pipelined_ = on; }
  void set_stage_device_memory(bool on) { stage_device_memory_ = on; }

  // Measurements (EngineAccess::measure): the update's host loop with its parts trimmed, and Adam
  // alone on one chunk's staged data reused for every chunk.
  tier::StreamStats measure_io(bool read_only, bool write_only, bool pipelined);
  tier::StreamStats measure_adam(bool pipelined);

 private:
  bool gated(std::span<const tier::StreamItem> host_items) const;
  AdamGradStats grad_stats_in_place(float inv);
  bool run_loops(const std::vector<tier::StreamItem>& host_items, bool gate,
                 const std::function<bool()>& decided, const float& grad_scale);
  bool in_gate(const std::function<bool()>& decided);
  // out: the new state's arrays (an update out of place), nullptr: in place.
  // One chunk's arrays for Adam: the state (read; written where `out` is null), its gradients,
  // its parameters in the model dtype (written), the pending state (out of place) or null.
  struct ChunkArrays {
    checkpoint::StateView v;
    const unsigned char* grad;
    unsigned char* param_copy;
    const checkpoint::StateView* out;
  };
  AdamParams group_params(GroupId gid) const;
  AdamTensors chunk_tensors(const ChunkArrays& a, std::size_t ro, std::size_t rn) const;
  void run_part(const AdamParams& hp, const ChunkArrays& a, std::size_t ro, std::size_t rn,
                std::int64_t step, float grad_scale, bool on_device);
  AdamStepOptions options(std::int64_t step, float grad_scale) const;
  std::size_t chunk_index(const Chunk& c) const { return &c - layout_.chunks().data(); }
  void adam_chunk(const Chunk& c, const checkpoint::StateView& v, const void* grad,
                  void* param_copy, bool on_device, float grad_scale,
                  const checkpoint::StateView* out = nullptr);
  void adam_run(const AdamParams& hp, const AdamTensors& t, std::int64_t step, float grad_scale,
                bool on_device);
  void params_from_master(const AdamTensors& t, bool on_device);
  // Runs of [flat_b, flat_b + n) by the step number of this update (0: skipped); fn(offset, count,
  // step). A tensor's run takes the padding after it.
  void for_each_count_run(
      std::size_t flat_b, std::size_t n,
      const std::function<void(std::size_t, std::size_t, std::int64_t)>& fn) const;
  std::int64_t update_step(TensorId id) const;
  void count_update();  // the decision said go: the counts advance
  std::vector<tier::StreamItem> update_items(bool device, const std::vector<bool>& done = {}) const;
  std::vector<const Chunk*> update_chunks(bool device, const std::vector<bool>& done) const;
  tier::StreamItem chunk_item(const Chunk& c) const;
  void run_chunk(const Chunk& c, std::span<void* const> v, bool device, float grad_scale);
  static checkpoint::StateView state_view(const Chunk& c, void* opt, void* params);
  std::vector<tier::StreamItem> stats_items() const;
  std::vector<std::size_t> stats_offsets(const std::vector<tier::StreamItem>& items) const;
  const AheadStats* usable_ahead(float inv) const;
  void compute_ahead(std::size_t ci, const void* grad, float inv);
  tier::StreamOptions stream_options(tier::Where where, const char* what) const;
  tier::StreamOptions speculative_options() const;

  const EngineLayout& layout_;
  TierStore& store_;
  const std::vector<ParamGroupOptions>& groups_;
  const bool update_on_device_;  // optimizer.update: device (for host-placed state)
  const std::unique_ptr<CpuAdam> adam_;
  const std::unique_ptr<DeviceAdam> device_adam_;  // state on gpu, or update_on_device_
  std::unique_ptr<UpdateSplit> split_;  // host-state chunks shared with the device (or null)
  const bool grads_on_nvme_;            // stages 2-3: some gradient chunk lives on nvme
  std::int64_t adam_step_ = 0;
  std::vector<std::int64_t> counts_;     // per tensor; empty: every tensor's is adam_step_
  std::vector<bool> skipped_;            // this step's skipped tensors; empty: none
  std::unique_ptr<Stream> copy_stream_;  // params_from_master on a CUDA device (made on first use)
  double optimizer_s_ = 0;
  tier::StreamStats last_update_;     // the last step's host loop
  bool pipelined_ = true;             // false: the loops run serially (benchmarks' reference)
  bool stage_device_memory_ = false;  // tests: stage gpu-home parts on the host device too
  bool gating_ = false;               // the decision runs as the host loop's gate
  std::int64_t ahead_ = 0;            // 1 while speculating: the counts the next update uses
  std::vector<bool> done_;            // run(): chunks already updated (committed speculation)
  // Written by speculate() (the speculation thread), read by the decision after the engine joined
  // it, cleared by the engine when the speculation ends.
  AheadStats ahead_stats_;
  std::uint64_t tiles_known_ahead_ = 0;
};

}  // namespace strata::zero
