// The engine's internals (include/strata/engine.hpp for the contract), shared by engine.cpp (API,
// finalize), engine_layout.cpp (the chunk grid and its buffers in the TierStore),
// engine_grads.cpp (gradients, buckets, the reduction), engine_step.cpp (the step) and
// engine_params.cpp (parameters, stage-3 gathers, optimizer-state access, checkpoints).
//
// Storage: the engine owns no bytes of training state. Every array lives in the rank's TierStore
// (zero/rank_storage.hpp), cut on one grid of chunks over the rank's optimizer range:
//   opt.<k>    master | exp_avg | exp_avg_sq of chunk k (FP32), home per offload.optimizer
//   grad.<k>   stage >= 2: the reduced gradients of chunk k (precision.grads), offload.gradients
//   param.<k>  stage 3: the own parameters of chunk k (precision.params), offload.params
//   params     stages 0-2: every parameter (model dtype), gpu (param() points into it)
//   grads      stages 0-1: every gradient, gpu (all-reduced / reduce-scattered in place)
//   rt.*       runtime buffers on gpu: buckets, their receive buffers, stage-3 gathered tensors
//              and send slices, the norm exchange, collective staging
// A placement's leading `fraction` of the elements is on its tier, the rest on gpu (rounded up to
// 1024 elements). Chunks are cut at sub-groups, at the placement boundaries, and at what one
// pinned pool buffer can stage (master | m | v + gradients + parameters).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "core/numeric.hpp"
#include "strata/adam.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "tier/fill.hpp"
#include "tier/stream_loop.hpp"
#include "zero/checkpoint.hpp"
#include "zero/chunk.hpp"
#include "zero/rank_storage.hpp"
#include "zero/tier_state_store.hpp"

namespace strata {

namespace zero {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Gradient statistics over a stream of pieces, bitwise equal to one CpuAdam::grad_stats over their
// concatenation: pieces are cut at multiples of kStatsTileElems, a partial tile is carried.
class StatsStream {
 public:
  StatsStream(CpuAdam& adam, DType dtype, float scale);
  void feed(const void* grads, std::size_t n);
  AdamGradStats finish();

 private:
  CpuAdam& adam_;
  DType dt_;
  std::size_t es_;
  float scale_;
  std::vector<unsigned char> carry_;
  std::size_t carried_ = 0;
  AdamGradStats acc_;
};

}  // namespace zero

struct Engine::Impl {
  Impl(const Config& c, Communicator& cm);
  ~Impl();

  // ---- configuration ----
  Config cfg;
  Communicator& comm;
  int rank, world, stage;
  DType pdt, gdt;
  std::size_t pes, ges;
  std::vector<TensorSpec> specs;
  std::vector<std::vector<float>> initial;
  std::vector<ParamGroupOptions> groups;  // [0]: optimizer.lr / optimizer.weight_decay
  std::vector<GroupId> tensor_group;
  // Runs of the flat element space by group: {first flat element, group}.
  std::vector<std::pair<std::size_t, GroupId>> group_runs;
  zero::StorageWrap wrap;  // tests: per-rank fault injection (zero/engine_access.hpp)
  bool finalized = false;
  std::unique_ptr<Partition> part;
  std::size_t own_begin = 0, psize = 0;
  std::size_t opt_begin = 0, opt_count = 0;  // flat range this rank runs Adam on
  std::chrono::milliseconds timeout{300000};

  // ---- storage (declared first among the stateful members: destroyed last) ----
  std::unique_ptr<zero::RankStorage> storage;
  std::vector<zero::Chunk> chunks;
  std::size_t chunk_cap = 0;  // elements per chunk at most
  BufferId params_id = 0;     // stages 0-2
  BufferId grads_id = 0;      // stages 0-1
  BufferId norm_id = 0;       // rt.norm: 16 B send + 16 B per rank
  unsigned char* params_dev = nullptr;
  unsigned char* grads_dev = nullptr;
  unsigned char* norm_dev = nullptr;
  // Copies in and out of rt.norm for the few-byte exchanges, on the Device directly (not through
  // the store: a rank whose store failed must still tell the others). Made at finalize().
  std::unique_ptr<Stream> word_stream;
  std::vector<std::pair<BufferId, zero::BufferKind>> kinds;  // every registered state buffer
  std::unique_ptr<zero::TierStateStore> state;               // the checkpoint seam's host views

  // ---- compute ----
  std::unique_ptr<CpuAdam> adam;
  std::unique_ptr<DeviceAdam> device_adam;  // state on gpu, or optimizer.update: device
  bool update_on_device = false;            // optimizer.update: device (for host-placed state)

  // ---- stage 2/3 buckets ----
  std::size_t bucket_elems = 0, nbuckets = 0;
  std::vector<std::size_t> bucket_expected, bucket_pending;
  std::vector<bool> bucket_issued;
  struct DevBuf {
    BufferId id = 0;
    unsigned char* ptr = nullptr;
  };
  std::vector<DevBuf> bucket_of;     // per bucket: its device buffer while it fills / reduces
  std::vector<DevBuf> free_buckets;  // reusable bucket buffers (rt.bucket.<n>)
  std::vector<DevBuf> free_recvs;    // reusable receive buffers (rt.recv.<n>)
  std::size_t dev_bufs_made = 0;
  struct InFlight {
    std::unique_ptr<CommHandle> handle;
    std::size_t bucket = 0;
    DevBuf recv;
    std::size_t share_begin = 0, share_count = 0;  // the rank's share, partition elements
  };
  std::deque<InFlight> inflight;  // collectives in flight, oldest first (at most 2)
  // Receive buffers whose share is being copied into the gradient chunks (device→host on the
  // store's copy streams while the backward goes on): back to free_recvs once their ticket is
  // done, never reused in flight.
  struct Copying {
    DevBuf recv;
    tier::Filler::Ticket ticket = 0;
  };
  std::deque<Copying> copying;
  std::size_t recvs_made = 0;
  std::unique_ptr<tier::Filler> grad_fill;  // stage >= 2: into the grad.<k> chunks
  std::vector<bool> arrived;

  // ---- stage 3 gathers ----
  struct Gathered {
    DevBuf buf, send;
    std::unique_ptr<CommHandle> handle;
    bool ready = false;
  };
  std::vector<Gathered> gathered;
  std::vector<std::vector<TensorId>> trace_prev, trace_cur;
  std::size_t trace_pos = 0;
  bool trace_ok = true;

  // ---- loss scale, counters ----
  bool scaling = false;
  double scale = 1.0;
  std::uint32_t good_steps = 0;
  std::int64_t adam_step = 0;
  EngineStats st;
  tier::StreamStats last_update;     // the last step's update loop (host part)
  bool pipelined = true;             // false: the loops run serially (benchmarks' reference)
  bool stage_device_memory = false;  // tests: stage gpu-home parts on the host device too
  std::vector<unsigned char> ckpt_params;
  // Set when a step failed after it began changing state: the rank's state may mix two steps.
  std::string broken;

  // ---- engine.cpp ----
  void require_finalized(const char* what) const;
  // Throws Error(kIo) "unusable after a failed step" once the engine failed; the first call to
  // find the store failed (by a share's copy that ran on its own) throws that failure instead.
  void require_usable(const char* what);
  // The engine failed (its state may mix two steps): remembered, and the fill's pool buffers let
  // go.
  void mark_broken(const std::string& what) noexcept;
  // A call failed with `e` after it began changing state: the engine is marked failed and the
  // error to report is returned — the gradient filler's first failed copy when there is one (the
  // cause: `e` may be the store refusing work because of it), else `e`.
  std::exception_ptr fail_call(const std::exception& e) noexcept;
  void check_id(TensorId id, const char* what) const;
  void finalize();
  template <typename F>
  void for_each_group_run(std::size_t flat_b, std::size_t n, F&& fn) const;

  // ---- engine_layout.cpp ----
  void build_layout();  // chunks, storage needs, buffers
  zero::StorageNeeds storage_needs() const;
  // pinned: a cpu home is page-locked (offload.X.pin_memory).
  BufferId add_buffer(const std::string& name, std::uint64_t bytes, Tier home,
                      zero::BufferKind kind, bool pinned = false);
  void initialize_state(std::vector<float>& init);  // master, params from the FP32 initial values
  zero::StorageReport report() const;
  const zero::Chunk& chunk_at(std::size_t element) const;  // chunk holding an optimizer element
  TierStore& store() { return storage->store(); }
  // Synchronous host transfers of a byte range (nvme homes: whole buffers through an aligned copy).
  void put(BufferId id, std::uint64_t offset, std::uint64_t bytes, const void* host);
  void get(BufferId id, std::uint64_t offset, std::uint64_t bytes, void* host);
  DevBuf make_dev_buf(const std::string& name, std::uint64_t bytes);
  void free_dev_buf(DevBuf& b);

  // ---- engine_grads.cpp ----
  void set_gradient(TensorId id, const void* grad, Tier memory);
  void check_all_arrived();
  void reset_buckets();
  void issue_bucket(std::size_t k);
  // The oldest collective completed: its bucket buffer freed, its share's copy queued (not
  // waited for).
  void retire_oldest();
  // Receive buffers whose copy completed go back to free_recvs; all: wait for every copy.
  void collect_copies(bool all);
  DevBuf take_recv();  // a free receive buffer (made, or waited for: at most kMaxRecvBuffers)
  // Step part 1: every gradient reduced into the rank's gradient range. Stages 2-3 (whose
  // collectives set_gradient issued) do not throw: a failure waiting for them or for the rank's
  // copies and spills is returned, for the ranks to learn it together in agree().
  std::exception_ptr reduce();
  std::size_t bucket_begin(std::size_t b) const { return b * bucket_elems; }
  std::size_t bucket_len(std::size_t b) const {
    return std::min(bucket_elems, part->flat_size() - bucket_begin(b));
  }

  // ---- engine_step.cpp ----
  StepResult step();
  AdamGradStats local_grad_stats(float inv);  // the stats pass (streamed)
  // Step part 2. failed_here: this rank's reduction or statistics failed (its local is unset).
  // Returns the first other rank that failed, or -1.
  int agree(const AdamGradStats& local, bool failed_here, bool* finite, double* sum_sq);
  // After the update (applied, skipped or failed): whether every rank's went through; returns the
  // first other rank whose did not, or -1. Every rank that passed agree() calls it once.
  int agree_outcome(bool ok_here);
  // Error(kComm): `peer` failed in this step's `phase`; this rank stops too (its engine is failed).
  [[noreturn]] void fail_for_peer(int peer, const char* phase) const;
  void apply_loss_scale(bool finite, StepResult& res);                   // step part 3
  bool update(const std::function<bool()>& decide, const float& grad_scale);  // step part 4
  bool decide_under_reads(std::span<const tier::StreamItem> host_items);
  void gather_params();                                                  // step part 5
  AdamStepOptions step_options(float grad_scale) const;
  void adam_chunk(const zero::Chunk& c, const zero::StateView& v, const void* grad,
                  void* param_copy, bool on_device, float grad_scale);
  std::vector<tier::StreamItem> update_items(bool device) const;
  std::vector<tier::StreamItem> stats_items() const;
  tier::StreamOptions stream_options(tier::Where where, const char* what) const;

  // ---- engine_params.cpp ----
  const void* param(TensorId id) const;
  void read_param(TensorId id, std::span<float> out);
  void start_gather(TensorId id);
  void start_gather_io(TensorId id);  // the send slice and the collective
  void finish_gather(TensorId id);
  void drop(TensorId id);
  void gather(std::span<const TensorId> ids);
  void prefetch(std::span<const TensorId> ids);
  void release(std::span<const TensorId> ids);
  // Parameters [b, b + n) of the own partition (stage 3), model dtype, from / into the chunks.
  void read_own(std::size_t b, std::size_t n, unsigned char* host);
  void write_own(std::size_t b, std::size_t n, const unsigned char* host);
  // Collectives on host arrays, staged through device memory (collectives run where the
  // buffers live: the host-emulated device's memory, or CUDA memory for NCCL).
  void broadcast_host(void* data, std::size_t count, DType dt, int root);
  void all_gather_host(const void* send, void* recv, std::span<const std::size_t> counts, DType dt);
  // `bytes` bytes per rank (a multiple of 4), host memory in and out, staged through device
  // memory (rt.norm when bytes <= 16: nothing is allocated). The checkpoint's agreement.
  void all_gather_bytes(const void* send, void* recv, std::size_t bytes);
  void read_state(TensorId id, StateKind kind, std::span<float> out);
  void write_state(TensorId id, StateKind kind, std::span<const float> in);
  zero::RankState rank_state();
  void after_load(const zero::RankState& r);
};

template <typename F>
void Engine::Impl::for_each_group_run(std::size_t flat_b, std::size_t n, F&& fn) const {
  auto it = std::upper_bound(group_runs.begin(), group_runs.end(), flat_b,
                             [](std::size_t x, const auto& run) { return x < run.first; });
  --it;  // group_runs[0].first == 0 <= flat_b
  for (std::size_t pos = flat_b; pos < flat_b + n; ++it) {
    const std::size_t stop =
        std::next(it) == group_runs.end() ? flat_b + n : std::min(flat_b + n, std::next(it)->first);
    if (stop > pos) fn(pos - flat_b, stop - pos, it->second);
    pos = std::max(pos, stop);
  }
}

}  // namespace strata
