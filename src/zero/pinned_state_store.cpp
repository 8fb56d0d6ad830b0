// Host views of a snapshot of the optimizer state (see pinned_state_store.hpp).
#include "zero/pinned_state_store.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/numeric.hpp"
#include "strata/adam.hpp"
#include "strata/error.hpp"
#include "zero/engine_layout.hpp"

namespace strata::zero {

MasterCopy MasterCopy::of(TierStore& store, std::span<const Chunk> chunks,
                          std::chrono::milliseconds timeout) {
  MasterCopy m;
  const Chunk *first = nullptr, *last = nullptr;
  for (const Chunk& c : chunks) {
    if (!c.master_in_params) continue;
    if (!first) first = &c;
    last = &c;
  }
  if (!first) return m;
  m.params = first->params;
  m.offset = first->master_at;
  m.bytes = last->master_at + 4 * std::uint64_t{last->r.count} - first->master_at;
  m.data = IoBuffer::allocate(std::max<std::uint64_t>(m.bytes, 1), HugePageMode::kNone);
  get_bytes(store, m.params, m.offset, m.bytes, m.data.data(), timeout);
  return m;
}

PinnedStateStore::PinnedStateStore(TierStore& store, std::span<const Chunk> chunks,
                                   ParamBlocks params, std::size_t size, SnapshotId snapshot,
                                   std::chrono::milliseconds timeout,
                                   std::function<void()> before_read, MasterCopy master)
    : store_(store),
      chunks_(chunks),
      pblocks_(params),
      size_(size),
      snap_(snapshot),
      timeout_(timeout),
      before_read_(std::move(before_read)),
      unpinned_(chunks.size(), false),
      master_(std::move(master)) {}

void PinnedStateStore::check_range(Range r) const {
  if (r.end() > size_)
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint snapshot: range [", r.begin, ", ", r.end(), ") beyond ", size_));
}

void PinnedStateStore::start_reads(Range r) {
  next_.settle();
  if (before_read_) before_read_();
  next_.start(chunks_, r, timeout_,
              [this](BufferId id, std::uint64_t offset, std::uint64_t bytes, float* dst) {
                if (master_.bytes == 0 || id != master_.params)
                  return store_.read_pinned(snap_, id, offset, bytes, dst, Tier::kCpu, false);
                if (offset < master_.offset || offset - master_.offset + bytes > master_.bytes ||
                    master_.data.size() == 0)
                  fail(ErrorCode::kInternal,
                       strcat("checkpoint snapshot: master bytes [", offset, ", ", offset + bytes,
                              ") outside the copy of [", master_.offset, ", ",
                              master_.offset + master_.bytes, ")"));
                std::memcpy(dst, master_.data.bytes() + (offset - master_.offset), bytes);
                return Transfer();  // complete
              });
}

checkpoint::StateView PinnedStateStore::acquire(Range r) {
  if (acquired_)
    fail(ErrorCode::kInvalidArgument, "checkpoint snapshot: acquire() while a range is acquired");
  check_range(r);
  if (!next_.holds(r)) start_reads(r);
  current_.swap(next_);
  next_.settle();  // the range acquired before: never taken for a prefetch of it
  current_.wait();
  params_current_ ^= 1;  // the range before's stay readable (OptimizerStateStore)
  if (pblocks_.source == ParamBlocks::Source::kBlocks) read_params(r);
  if (pblocks_.source == ParamBlocks::Source::kFromMaster) round_master(current_.array(0), r.count);
  acquired_ = true;
  range_ = r;
  return {current_.array(0), current_.array(1), current_.array(2), r.count,
          pblocks_.in_snapshot() ? params_[params_current_].bytes() : nullptr};
}

void PinnedStateStore::prefetch(Range r) {
  check_range(r);
  start_reads(r);
}

void PinnedStateStore::drop_prefetch() noexcept {
  next_.free();
  if (acquired_) return;
  current_.free();
  for (IoBuffer& p : params_) p = IoBuffer();
}

const void* PinnedStateStore::read_block(BufferId id) {
  const std::uint64_t padded = store_.padded_bytes(id);
  if (block_.size() < padded) block_ = IoBuffer::allocate(padded, HugePageMode::kNone);
  store_.read_pinned(snap_, id, 0, 0, block_.data(), Tier::kCpu, true).wait(timeout_);
  return block_.data();
}

unsigned char* PinnedStateStore::params(std::size_t bytes) {
  IoBuffer& p = params_[params_current_];
  if (p.size() < bytes) {
    p = IoBuffer();
    p = IoBuffer::allocate(bytes);
  }
  return p.bytes();
}

void PinnedStateStore::read_params(Range r) {
  const std::size_t pes = pblocks_.elem_bytes;
  unsigned char* out = params(r.count * pes);  // every element is copied below
  for (const Chunk& c : chunks_) {
    const std::size_t b = std::max(c.r.begin, r.begin), e = std::min(c.r.end(), r.end());
    if (b >= e) continue;
    const auto* block = static_cast<const unsigned char*>(read_block(c.param));
    std::memcpy(out + (b - r.begin) * pes, block + (b - c.r.begin) * pes, (e - b) * pes);
  }
}

// The parameters as the update writes them from these master weights: store_elem's rounding
// (core/numeric.hpp), made with the kernels' vectorized conversion (strata/adam.hpp: the same bits,
// except that an FP16 NaN keeps its payload there; those are set to store_elem's sign | 0x7E00).
void PinnedStateStore::round_master(const float* master, std::size_t n) {
  if (dtype_size(pblocks_.dtype) != pblocks_.elem_bytes)
    fail(ErrorCode::kInternal, "checkpoint snapshot: parameter dtype and element size disagree");
  if (n == 0) return;  // (an empty range: no buffer, nothing to convert)
  unsigned char* out = params(n * pblocks_.elem_bytes);
  auto* half = reinterpret_cast<std::uint16_t*>(out);
  switch (pblocks_.dtype) {
    case DType::kFp32: std::memcpy(out, master, n * sizeof(float)); break;
    case DType::kBf16: convert_fp32_to_bf16(master, half, n); break;
    case DType::kFp16:
      convert_fp32_to_fp16(master, half, n);
      for (std::size_t i = 0; i < n; ++i)
        if (std::isnan(master[i])) half[i] = float_to_half(master[i]);
      break;
  }
}

void PinnedStateStore::release(Range r, bool dirty) {
  if (!acquired_ || r.begin != range_.begin || r.count != range_.count)
    fail(ErrorCode::kInvalidArgument,
         "checkpoint snapshot: release() of a range that is not acquired");
  acquired_ = false;
  if (dirty)
    fail(ErrorCode::kInvalidArgument, "checkpoint snapshot: the pinned state is read-only");
  // The writer visits ranges in ascending order: chunks that end here are done with.
  // The copy of the masters that are the parameters goes once the last chunk it holds does (a
  // range prefetched after this one read from it already: a memcpy, done at the read's start).
  bool masters_left = false;
  for (std::size_t k = 0; k < chunks_.size(); ++k) {
    const Chunk& c = chunks_[k];
    if (!unpinned_[k] && c.r.end() > r.end()) masters_left = masters_left || c.master_in_params;
    if (unpinned_[k] || c.r.end() > r.end()) continue;
    store_.unpin(snap_, c.opt);
    if (pblocks_.source == ParamBlocks::Source::kBlocks) store_.unpin(snap_, c.param);
    unpinned_[k] = true;
  }
  if (!masters_left && master_.data.size() > 0) master_.data = IoBuffer();
}

}  // namespace strata::zero
