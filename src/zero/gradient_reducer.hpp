// GradientReducer: the gradients of a step, from the loop's hand-in to the rank's gradient range
// in its tier. Stages 0-1: each gradient is copied into the flat gradients (device memory) and
// reduced at step() (all-reduce / reduce-scatter in place). Stages 2-3: gradients are copied into
// buckets of zero.reduce_bucket_size elements (runtime scratch); a complete bucket's
// reduce-scatter starts at once (at most two in flight) and, once it completed (looked at after
// each hand-in, without waiting), the rank's share of it is filled into the gradient chunks
// wherever they live (device memory, or device→host on the store's copy streams, spilled on to
// NVMe) — queued, not waited for: the backward goes on while the share is copied out, and its
// receive buffer is reused only once the copy completed. One rank (gradients not on NVMe) issues
// no collective: the bucket is its own share, filled from the bucket buffer at once. One rank with
// nothing speculated on the host-emulated device (plan's hand_in_to_chunks) has no bucket at all:
// each hand-in is filled straight into the gradient chunks and waited for (one copy, not two, and
// no bucket buffer beside the gradients).
//
// Buckets are issued in descending order on several ranks (a bucket completed early waits for the
// ones above it): the collectives match on every rank whatever order the hand-ins complete them.
//
// Accumulation over micro-batches: a tensor handed in again once every tensor arrived starts the
// next micro-batch. Gradients are handed in, bucketed and reduce-scattered in precision.grads and
// held in precision.grad_accum (the layout's grad_dtype(); converted where the two differ). Stages
// 0-1 add each later micro-batch's gradient into the flat gradients on the device (reduced once,
// at step(): DDP's no_sync). Stages 2-3 reduce-scatter every micro-batch's buckets; the first
// fills the rank's shares into the gradient chunks, each later one adds to them wherever they
// live (an accumulating round of the filler: on the device, in host memory, or read from NVMe and
// written back). Each add is one FP32 add rounded into the held dtype. docs/offload.md, "Gradient
// accumulation".
//
// Ownership: borrows the layout, the communicator, the store and the scratch arena; owns the
// buckets, receive buffers, the filler of the gradient chunks and its copy stream.
// Thread-safety: one thread (the engine's). Failure: hand_in() throws argument errors before
// anything changes; any later failure (copy, collective, spill) is thrown and leaves the round
// broken (the engine marks itself failed); reduce() returns its failure instead of throwing.
#pragma once

#include <chrono>
#include <cstddef>
#include <deque>
#include <exception>
#include <memory>
#include <vector>

#include "strata/communicator.hpp"
#include "tier/fill.hpp"
#include "tier/scratch_arena.hpp"
#include "zero/engine_layout.hpp"
#include "zero/rank_resources.hpp"

namespace strata::zero {

struct ReduceTimes {
  double reduce_s = 0;      // issue + waits of the reductions (and the hand-in copies)
  double grad_spill_s = 0;  // of which: filling the shares into the gradient chunks
};

class GradientReducer : private RankResources {
 public:
  struct Range {
    std::size_t begin = 0, count = 0;
  };

  GradientReducer(const EngineLayout& layout, Communicator& comm, TierStore& store,
                  ScratchArena& scratch);
  ~GradientReducer();  // waits for the collectives in flight (bounded), errors dropped
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Argument checks (unknown id is the caller's): a gradient handed in again before every tensor
  // arrived in this micro-batch, a null pointer (Error(kInvalidArgument)). Nothing changes.
  // grad == nullptr with `zeros`: hand_in_zero's check.
  void check_hand_in(TensorId id, const void* grad, bool zeros = false) const;
  // Copies tensor `id`'s gradient (grad dtype; `memory` kGpu = device memory, kCpu = host) and
  // starts the reductions it completes. REQUIRES: check_hand_in passed.
  // With `producer` (device memory on a GPU: Engine::set_gradient_async) the copy is queued on
  // stream() after the producer's queued work and not waited for: the hand-in waits for the GPU
  // only where a bucket completes (its collective or copy out reads what the copies wrote) and
  // reduce() waits for the rest; `grad` must stay valid until then (the caller's contract).
  void hand_in(TensorId id, const void* grad, Tier memory, const void* const* producer = nullptr);
  // The stream the hand-in copies run on (Engine::gradient_stream()).
  Stream& stream() { return *stream_; }
  // Tensor `id` has no gradient on this rank in this micro-batch (the loss did not use it): it
  // arrives as zeros (nothing is added in a later micro-batch). REQUIRES: check_hand_in passed.
  void hand_in_zero(TensorId id);
  // Per tensor: whether this rank handed in a gradient (not hand_in_zero) in any micro-batch of
  // the step.
  const std::vector<bool>& used() const { return used_; }
  bool all_used() const { return n_used_ == used_.size(); }
  // Error(kInvalidArgument) naming the tensors whose gradients did not arrive in this step's (last)
  // micro-batch.
  void check_all_arrived() const;
  // Every gradient reduced into the rank's gradient range (stages 0-1: the collective; 2-3: the
  // collectives in flight retired, the chunks completed). Stages 2-3 return a failure instead of
  // throwing it (the rank must still take part in the step's agreement).
  std::exception_ptr reduce();
  // A new step: nothing arrived, every bucket empty.
  void reset();
  // The step's gradients dropped (torch's zero_grad between backward and step): the collectives in
  // flight complete (nothing new starts), the filler's round is given up (the chunks' contents are
  // undefined until the next step's first micro-batch replaces them), then reset(). Throws what a
  // collective's completion throws.
  void discard();

  // The failed state: lets the filler's pool buffers go; the cause, if a copy failed first.
  void abandon() noexcept;
  std::exception_ptr abandon_for_cause() noexcept;

  // Stages 2-3, the speculative update (issue 26): the micro-batch being handed in (0: the first),
  // and the chunks whose gradient this micro-batch completed since the last call (every element
  // of the chunk's range filled in this micro-batch: their buckets retired), once per chunk and
  // micro-batch, in the order they were filled, each with its fills complete or queued in the
  // store (a plain copy into a memory home: the store runs a later read of the chunk after it):
  // with `wait` every such chunk (waiting for the fills that are neither), else those whose fills
  // have completed or are queued in the store, the rest kept for a later call. Which chunks over
  // the micro-batch: those whose buckets retired during the hand-ins, in the same order on every
  // step with the same hand-in order (how they are split between calls follows the fills' speed
  // when adding or converting).
  std::size_t micro_batch() const { return micro_; }
  // Whether handing in tensor `id` now starts the next micro-batch (it arrived in this one).
  bool starts_micro_batch(TensorId id) const { return arrived_[id]; }
  std::vector<std::size_t> take_filled_chunks(bool wait);
  // Every tensor of this micro-batch arrived: its last collectives are retired now (waited for;
  // their shares' fills started), not at reduce(), so that the chunks they complete are known
  // before step() (the speculative update starts them at once). Stages 2-3.
  bool all_arrived() const { return n_arrived_ == arrived_.size(); }
  std::size_t arrived() const { return n_arrived_; }  // tensors of this micro-batch so far
  // Some gradient of the step was handed in (a step's backward began).
  bool in_step() const { return any_arrived(); }
  void retire_all();

  const ReduceTimes& times() const { return times_; }
  std::uint64_t buckets_reduced() const { return buckets_reduced_; }  // since construction
  std::size_t bucket_buffers() const { return buckets_made_; }        // made so far (tests, plan)
  std::size_t receive_buffers() const { return recvs_made_; }

 private:
  struct InFlight {
    std::unique_ptr<CommHandle> handle;
    std::size_t bucket = 0;
    Scratch recv;
    std::size_t share_begin = 0, share_count = 0;  // the rank's share, partition elements
  };
  struct Copying {  // a buffer whose share is being filled into the chunks
    Scratch buf;
    tier::Filler::Ticket ticket = 0;
    bool bucket = false;  // a bucket buffer (one rank: share_bucket), not a receive buffer
  };

  bool any_arrived() const { return micro_ > 0 || n_arrived_ > 0; }
  void start_micro_batch();
  void accumulate_flat(std::size_t off, std::size_t n, const unsigned char* src, Tier memory,
                       bool add);
  void hand_in_bucketed(std::size_t off, std::size_t n, const unsigned char* src);
  void hand_in_direct(std::size_t off, std::size_t n, const unsigned char* src);
  void count_filled(std::size_t ci, std::size_t n, tier::Filler::Ticket last);
  void reset_micro_batch();
  void mark_arrived(TensorId id);
  void bucket_complete(std::size_t k);
  Scratch& bucket_buffer(std::size_t k);
  void issue_bucket(std::size_t k);
  void share_bucket(std::size_t k, std::size_t mine);
  void retire_oldest();
  void start_share(Scratch buf, std::size_t begin, std::size_t count, bool bucket);
  void wait_oldest_copy();
  void retire_done();  // the completed collectives, oldest first, without waiting
  void collect_copies(bool all);
  Scratch take_recv();
  void finish_round();
  // On stream_: synchronous, or queued in an asynchronous hand-in (async_).
  void copy(void* dst, const void* src, std::size_t bytes);
  void fill(void* dst, std::size_t bytes);  // zeros, as copy()
  void sync_hand_ins();  // waits for the copies asynchronous hand-ins queued (unsynced_)
  std::size_t bucket_begin(std::size_t b) const { return b * bucket_elems_; }
  std::size_t bucket_len(std::size_t b) const;

  // One rank, nothing speculated, the host-emulated device (plan's hand_in_to_chunks): each
  // hand-in is filled straight into the gradient chunks and waited for; no bucket.
  const bool direct_;
  const std::size_t bucket_elems_, nbuckets_;
  const std::vector<std::size_t> bucket_expected_;     // elements of tensors per bucket
  const std::vector<std::vector<Range>> bucket_gaps_;  // per bucket: elements of no tensor
  const bool retire_early_;   // completed collectives retired at each hand-in (no grads on nvme)
  const bool share_buckets_;  // one rank, retire_early_: no collective (share_bucket)
  std::unique_ptr<Stream> stream_;
  bool async_ = false;     // inside an asynchronous hand-in: copy() queues without waiting
  bool unsynced_ = false;  // stream_ holds copies nobody waited for yet
  std::unique_ptr<tier::Filler> fill_;  // stage >= 2: into the grad.<k> chunks

  std::vector<bool> arrived_;  // in the current micro-batch
  std::vector<bool> used_;     // a gradient (not zeros) in some micro-batch of the step
  std::size_t n_used_ = 0;
  // Several ranks: buckets are issued in descending order (the backward's), whatever order they
  // complete in, so that every rank issues the same collectives in the same order even when a
  // tensor is used on some ranks only (its zeros complete its bucket at step() there).
  std::size_t next_issue_ = 0;  // buckets [0, next_issue_) are not issued yet
  std::size_t n_arrived_ = 0;
  std::size_t micro_ = 0;  // the current micro-batch of the step (0: the first)
  std::vector<std::size_t> bucket_pending_;
  std::vector<bool> bucket_issued_;
  std::vector<Scratch> bucket_of_;     // per bucket: its buffer while it fills / reduces
  std::vector<Scratch> free_buckets_;  // reusable bucket buffers
  std::vector<Scratch> free_recvs_;    // reusable receive buffers
  std::deque<InFlight> inflight_;      // collectives in flight, oldest first (at most 2)
  std::deque<Copying> copying_;
  std::size_t buckets_made_ = 0, recvs_made_ = 0;
  // take_filled_chunks(): elements filled per chunk in this micro-batch; chunks filled whole, with
  // the ticket of their last piece, not yet taken.
  std::vector<std::size_t> chunk_filled_;
  const std::vector<std::size_t> chunk_expected_;  // direct_: elements of tensors per chunk
  std::deque<std::pair<std::size_t, tier::Filler::Ticket>> filled_;
  ReduceTimes times_;
  std::uint64_t buckets_reduced_ = 0;
};

}  // namespace strata::zero
