// EngineLayout: where a rank's training state lives — fixed once finalize() built it. The
// partition of the flat element space over the ranks, the chunk grid over the rank's optimizer
// range (each chunk's tier homes and its buffers in the rank's TierStore), the model-dtype
// parameters and flat gradients of stages 0-2, and the parameter groups' runs over the flat space.
//
// Storage (the engine owns no bytes of training state; every array is a TierStore buffer):
//   opt.<k>    master | exp_avg | exp_avg_sq of chunk k (FP32), home per offload.optimizer; a
//              chunk in memory whose master weights are the parameters (plan's
//              master_in_params: stages 0-1 and stage 2 without speculation, FP32 parameters, the
//              host device) holds exp_avg | exp_avg_sq only, its master being its elements of
//              `params` (state_place)
//   grad.<k>   stage >= 2: the reduced gradients of chunk k (grad_dtype()), offload.gradients
//   param.<k>  stage 3: the own parameters of chunk k (precision.params), offload.params
//   params     stages 0-2: every parameter (model dtype), gpu (Engine::param() points into it)
//   grads      stages 0-1: every gradient (grad_dtype()), gpu (all-reduced / reduce-scattered in
//              place)
// Gradients are handed in, bucketed and reduce-scattered (stages 2-3) in precision.grads
// (hand_in_dtype()) and held, accumulated and read by the step in precision.grad_accum
// (grad_dtype(): precision.grads unless grad_accum is fp32).
// Runtime scratch (buckets, receive buffers, gathered tensors, exchanges) is not state: it comes
// from the rank's ScratchArena (tier/scratch_arena.hpp). A placement's leading `fraction` of the
// elements is on its tier, the rest on gpu (rounded up to 1024 elements). Chunks are cut at
// sub-groups, at the placement boundaries, and at what one pinned pool buffer can stage
// (master | m | v + gradients + parameters).
//
// Thread-safety: const after construction; every member may be read from any thread.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "strata/config.hpp"
#include "strata/partition.hpp"
#include "tier/tier_store.hpp"
#include "zero/chunk.hpp"
#include "zero/rank_storage.hpp"

namespace strata {
class Stream;
using TensorId = std::size_t;
using GroupId = std::size_t;
class ScratchArena;
}  // namespace strata

namespace strata::zero {

// Elements [begin, begin + out.size()) of the flat space (FP32) into `out`.
using FlatValues = std::function<void(std::size_t begin, std::span<float> out)>;

// Where one tensor meets this rank's optimizer range (stage 0: the whole tensor).
struct TensorShare {
  std::vector<std::size_t> counts;  // per rank (stages 1-3), for the all-gather
  Range local;                      // elements of the rank's optimizer range it covers
  std::size_t from = 0;             // first of those elements within the tensor
};

class EngineLayout {
 public:
  // Builds the partition and the chunk grid, opens `storage` with what they need and registers
  // the state buffers (zero-filled). Throws Error(kBudget) naming the tier and buffer when a
  // budget cannot hold them, Error(kInvalidArgument) for a pinned buffer too small for a chunk.
  EngineLayout(const Config& config, int rank, int world, std::vector<TensorSpec> specs,
               std::vector<GroupId> tensor_groups, RankStorage& storage);
  EngineLayout(const EngineLayout&) = delete;
  EngineLayout& operator=(const EngineLayout&) = delete;

  // Writes the initial values (the flat space, FP32, read a piece at a time from `values`): the
  // parameters in the model dtype, the FP32 master; the moments stay zero (as registered). Once,
  // right after construction. Memory homes are written piece by piece, an NVMe home through one
  // bounce buffer of its size (a chunk: at most what a pinned buffer stages).
  void initialize(const FlatValues& values) const;

  const Config& config() const { return cfg_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int stage() const { return stage_; }
  DType param_dtype() const { return param_dtype_; }
  DType grad_dtype() const { return grad_dtype_; }        // held and read: precision.accum_dtype()
  DType hand_in_dtype() const { return hand_in_dtype_; }  // handed in, reduced: precision.grads
  std::size_t param_elem_bytes() const { return param_elem_; }
  std::size_t grad_elem_bytes() const { return grad_elem_; }
  std::size_t hand_in_elem_bytes() const { return hand_in_elem_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  const Partition& partition() const { return *partition_; }
  std::size_t tensors() const { return partition_->num_tensors(); }
  const TensorSpec& tensor(TensorId id) const { return partition_->tensor(id); }
  std::size_t flat_size() const { return partition_->flat_size(); }
  std::size_t own_begin() const { return own_begin_; }  // flat offset of the own partition
  std::size_t partition_size() const { return partition_size_; }
  std::size_t opt_begin() const { return opt_begin_; }  // the rank's optimizer range:
  std::size_t opt_count() const { return opt_count_; }  // stage 0 all, else the partition
  TensorShare share(TensorId id) const;

  const std::vector<Chunk>& chunks() const { return chunks_; }
  std::size_t chunk_cap() const { return chunk_cap_; }  // elements per chunk at most
  const Chunk& chunk_at(std::size_t element) const;     // chunk holding an optimizer element
  std::size_t chunk_index(std::size_t element) const { return &chunk_at(element) - chunks_.data(); }
  bool any_chunk_on(Tier opt_tier) const;
  bool any_grad_chunk_on(Tier grad_tier) const;  // some chunk's gradients live there
  bool params_are_master() const;  // every chunk's master is the parameters (master_in_params)

  BufferId params_buffer() const { return params_id_; }  // stages 0-2
  BufferId grads_buffer() const { return grads_id_; }    // stages 0-1
  unsigned char* params_device() const { return params_dev_; }
  unsigned char* grads_device() const { return grads_dev_; }

  // Calls fn(offset into the run, count, group) for each parameter group's run within the flat
  // elements [flat_b, flat_b + n).
  template <typename F>
  void for_each_group_run(std::size_t flat_b, std::size_t n, F&& fn) const;
  // Calls fn(chunk index, first, end) for each chunk's piece of the optimizer-range elements
  // [b, b + n), in order.
  template <typename F>
  void for_each_chunk_piece(std::size_t b, std::size_t n, F&& fn) const;

  // Bytes of each kind in each tier, the pool, and the store's usage (against `strata plan`).
  StorageReport report(RankStorage& storage, const ScratchArena& scratch) const;

 private:
  void cut_chunks(std::uint64_t buffer_size, bool staging);
  std::size_t staged_chunk_cap(std::uint64_t buffer_size) const;
  StorageNeeds storage_needs(bool cuda) const;
  std::uint64_t speculation_nvme_bytes(std::uint64_t nvme_opt_bytes) const;
  void register_buffers();
  void write_initial(BufferId id, std::size_t first, std::size_t count, DType dtype,
                     const FlatValues& values) const;
  BufferId add_buffer(const std::string& name, std::uint64_t bytes, Tier home, BufferKind kind,
                      bool pinned = false);
  TierStore& store() const { return store_; }

  const Config cfg_;
  const int rank_, world_, stage_;
  const DType param_dtype_, grad_dtype_, hand_in_dtype_;
  const std::size_t param_elem_, grad_elem_, hand_in_elem_;
  const std::chrono::milliseconds timeout_;
  const std::unique_ptr<const Partition> partition_;
  const std::size_t own_begin_, partition_size_, opt_begin_, opt_count_;
  // Runs of the flat element space by group: {first flat element, group}.
  const std::vector<std::pair<std::size_t, GroupId>> group_runs_;
  // Set by the constructor, const afterwards (the grid is cut before the store exists: declared
  // first).
  std::vector<Chunk> chunks_;
  std::size_t chunk_cap_ = 0;
  TierStore& store_;
  BufferId params_id_ = 0, grads_id_ = 0;
  unsigned char* params_dev_ = nullptr;  // acquired (kRead pin) for the layout's lifetime
  unsigned char* grads_dev_ = nullptr;
  std::vector<std::pair<BufferId, BufferKind>> kinds_;  // every registered state buffer
};

template <typename F>
void EngineLayout::for_each_group_run(std::size_t flat_b, std::size_t n, F&& fn) const {
  auto it = std::upper_bound(group_runs_.begin(), group_runs_.end(), flat_b,
                             [](std::size_t x, const auto& run) { return x < run.first; });
  --it;  // group_runs_[0].first == 0 <= flat_b
  for (std::size_t pos = flat_b; pos < flat_b + n; ++it) {
    const std::size_t stop = std::next(it) == group_runs_.end()
                                 ? flat_b + n
                                 : std::min(flat_b + n, std::next(it)->first);
    if (stop > pos) fn(pos - flat_b, stop - pos, it->second);
    pos = std::max(pos, stop);
  }
}

template <typename F>
void EngineLayout::for_each_chunk_piece(std::size_t b, std::size_t n, F&& fn) const {
  for (std::size_t pos = b; pos < b + n;) {
    const std::size_t ci = chunk_index(pos);
    const std::size_t stop = std::min(b + n, chunks_[ci].r.end());
    fn(ci, pos, stop);
    pos = stop;
  }
}

// Synchronous host transfers of a byte range of a store buffer (nvme homes: the whole buffer
// through an aligned copy, read-patch-write for a part).
void put_bytes(TierStore& store, BufferId id, std::uint64_t offset, std::uint64_t bytes,
               const void* host, std::chrono::milliseconds timeout);
void get_bytes(TierStore& store, BufferId id, std::uint64_t offset, std::uint64_t bytes, void* host,
               std::chrono::milliseconds timeout);
// A synchronous copy on `stream` (host or device memory on either side); 0 bytes: nothing.
// Waits for every transfer, then rethrows the first failure (none is left writing into its
// destination after a return or a throw).
void wait_all(std::vector<Transfer>& transfers, std::chrono::milliseconds timeout);

void copy_sync(Stream& stream, void* dst, const void* src, std::size_t bytes,
               std::chrono::milliseconds timeout);

}  // namespace strata::zero
