// Stage 3's parameters on demand (see param_gatherer.hpp).
#include "zero/param_gatherer.hpp"

#include <algorithm>

#include "strata/device.hpp"
#include "strata/error.hpp"
#include "zero/engine_layout.hpp"

namespace strata::zero {

ParamGatherer::ParamGatherer(const EngineLayout& layout, Communicator& comm, TierStore& store,
                             ScratchArena& scratch)
    : RankResources(layout, comm, store, scratch),
      stream_(store.device().create_stream()),
      gathered_(layout.stage() == 3 ? layout.tensors() : 0) {}

ParamGatherer::~ParamGatherer() {
  for (auto& g : gathered_) {
    if (!g.handle) continue;
    try {
      g.handle->wait();
    } catch (const std::exception&) {
    }
  }
}

void ParamGatherer::copy(void* dst, const void* src, std::size_t bytes) {
  copy_sync(*stream_, dst, src, bytes, timeout_);
}

void ParamGatherer::start(TensorId id) {
  Gathered& g = gathered_[id];
  if (g.ready || g.handle) return;
  const std::size_t n = layout_.tensor(id).numel;
  if (n == 0) {
    g.ready = true;
    return;
  }
  g.buf = scratch_.take(n * layout_.param_elem_bytes(), "gathered parameters", true);
  try {
    start_io(id);
  } catch (...) {  // a failed read changes nothing: the gather can be retried
    g.send.reset();
    g.buf.reset();
    throw;
  }
}

void ParamGatherer::start_io(TensorId id) {
  Gathered& g = gathered_[id];
  const std::size_t pes = layout_.param_elem_bytes();
  const TensorShare share = layout_.share(id);
  const unsigned char* send = g.buf.data();  // a rank with no share sends nothing
  if (const std::size_t mine = share.local.count) {
    const std::size_t b = share.local.begin;
    g.send = scratch_.take(mine * pes, "gather send slice", true);
    std::vector<Transfer> reads;
    layout_.for_each_chunk_piece(b, mine, [&](std::size_t ci, std::size_t pos, std::size_t stop) {
      const Chunk& c = layout_.chunks()[ci];
      reads.push_back(store_.read(c.param, (pos - c.r.begin) * pes, (stop - pos) * pes,
                                  g.send.data() + (pos - b) * pes, Tier::kGpu));
    });
    wait_all(reads, timeout_);  // every read lands (or fails) before the buffer may be reused
    send = g.send.data();
  }
  g.handle = comm_.all_gather_async(send, g.buf.data(), share.counts, layout_.param_dtype());
}

void ParamGatherer::finish(TensorId id) {
  Gathered& g = gathered_[id];
  if (!g.handle) return;
  auto h = std::move(g.handle);
  h->wait();
  g.ready = true;
  g.send.reset();
}

void ParamGatherer::drop(TensorId id) {
  finish(id);
  Gathered& g = gathered_[id];
  g.ready = false;
  g.buf.reset();
}

void ParamGatherer::gather(std::span<const TensorId> ids) {
  std::vector<TensorId> call(ids.begin(), ids.end());
  for (auto id : ids) start(id);
  // Replay of the previous step's gather order: prefetch the next call's tensors.
  if (trace_ok_ && trace_pos_ < trace_prev_.size() && trace_prev_[trace_pos_] == call) {
    ++trace_pos_;
    if (trace_pos_ < trace_prev_.size())
      for (auto id : trace_prev_[trace_pos_]) start(id);
  } else {
    trace_ok_ = false;
  }
  trace_cur_.push_back(std::move(call));
  for (auto id : ids) finish(id);
}

void ParamGatherer::prefetch(std::span<const TensorId> ids) {
  for (auto id : ids) start(id);
}

void ParamGatherer::release(std::span<const TensorId> ids) {
  for (auto id : ids) drop(id);
}

void ParamGatherer::drop_all() {
  for (std::size_t i = 0; i < gathered_.size(); ++i) drop(i);
}

void ParamGatherer::begin_step() {
  drop_all();
  trace_prev_ = std::move(trace_cur_);
  trace_cur_.clear();
  trace_pos_ = 0;
  trace_ok_ = true;
}

void ParamGatherer::read(TensorId id, void* host) {
  copy(host, gathered_[id].buf.data(), layout_.tensor(id).numel * layout_.param_elem_bytes());
}

void ParamGatherer::write_if_gathered(TensorId id, const void* host) {
  finish(id);
  Gathered& g = gathered_[id];
  if (g.ready && g.buf)
    copy(g.buf.data(), host, layout_.tensor(id).numel * layout_.param_elem_bytes());
}

}  // namespace strata::zero
