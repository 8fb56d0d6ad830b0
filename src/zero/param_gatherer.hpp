// ParamGatherer: stage 3's parameters on demand. gather(ids) all-gathers whole tensors into
// device scratch until release(ids): the tensor's own slice is read from the param chunks
// (wherever they live) into a device send buffer, and the all-gather fills a device buffer with
// the whole tensor. After the first step the order of gather() calls is replayed: each call
// prefetches the next call's tensors; prefetch(ids) does the same on request. A failed read
// changes nothing: the gather can be retried.
//
// Ownership: borrows the layout, the communicator, the store and the scratch arena; owns the
// gathered buffers (scratch) and its copy stream. Thread-safety: one thread (the engine's).
// Failure: the store's, device's and communicator's errors propagate.
#pragma once

#include <chrono>
#include <memory>
#include <span>
#include <vector>

#include "strata/communicator.hpp"
#include "tier/scratch_arena.hpp"
#include "zero/engine_layout.hpp"
#include "zero/rank_resources.hpp"

namespace strata::zero {

class ParamGatherer : private RankResources {
 public:
  ParamGatherer(const EngineLayout& layout, Communicator& comm, TierStore& store,
                ScratchArena& scratch);
  ~ParamGatherer();  // waits for the gathers in flight (bounded), errors dropped
  ParamGatherer(const ParamGatherer&) = delete;
  ParamGatherer& operator=(const ParamGatherer&) = delete;

  void gather(std::span<const TensorId> ids);  // blocking; replays the recorded order
  void prefetch(std::span<const TensorId> ids);
  void release(std::span<const TensorId> ids);
  // A step begins: every gather is dropped (prefetches in flight read parameters Adam is about to
  // change) and the order recorded in the last step becomes the one replayed.
  void begin_step();
  void drop_all();

  bool ready(TensorId id) const { return gathered_[id].ready; }
  // The gathered tensor in device memory (null for an empty tensor). REQUIRES: ready(id).
  const unsigned char* data(TensorId id) const { return gathered_[id].buf.data(); }
  // Copies between host memory and a gathered tensor (model dtype, whole tensor).
  void read(TensorId id, void* host);
  void write_if_gathered(TensorId id, const void* host);

 private:
  struct Gathered {
    Scratch buf, send;
    std::unique_ptr<CommHandle> handle;
    bool ready = false;
  };
  void start(TensorId id);
  void start_io(TensorId id);  // the send slice and the collective
  void finish(TensorId id);
  void drop(TensorId id);
  void copy(void* dst, const void* src, std::size_t bytes);  // synchronous, on stream_

  std::unique_ptr<Stream> stream_;
  std::vector<Gathered> gathered_;
  std::vector<std::vector<TensorId>> trace_prev_, trace_cur_;  // gather() calls of a step
  std::size_t trace_pos_ = 0;
  bool trace_ok_ = true;
};

}  // namespace strata::zero
