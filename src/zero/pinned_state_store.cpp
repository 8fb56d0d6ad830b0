// Host views of a snapshot of the optimizer state (see pinned_state_store.hpp).
#include "zero/pinned_state_store.hpp"

#include <algorithm>
#include <cstring>

#include "strata/error.hpp"

namespace strata::zero {

PinnedStateStore::PinnedStateStore(TierStore& store, std::span<const Chunk> chunks,
                                   std::size_t size, SnapshotId snapshot,
                                   std::chrono::milliseconds timeout)
    : store_(store),
      chunks_(chunks),
      size_(size),
      snap_(snapshot),
      timeout_(timeout),
      unpinned_(chunks.size(), false) {}

StateView PinnedStateStore::acquire(Range r) {
  if (acquired_)
    fail(ErrorCode::kInvalidArgument, "checkpoint snapshot: acquire() while a range is acquired");
  if (r.end() > size_)
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint snapshot: range [", r.begin, ", ", r.end(), ") beyond ", size_));
  scratch_.assign(3 * r.count, 0.0f);
  float* out[3] = {scratch_.data(), scratch_.data() + r.count, scratch_.data() + 2 * r.count};
  IoBuffer buf;
  for (std::size_t k = 0; k < chunks_.size(); ++k) {
    const Chunk& c = chunks_[k];
    const std::size_t b = std::max(c.r.begin, r.begin), e = std::min(c.r.end(), r.end());
    if (b >= e) continue;
    const std::uint64_t padded = store_.padded_bytes(c.opt);
    if (buf.size() < padded) buf = IoBuffer::allocate(padded, HugePageMode::kNone);
    store_.read_pinned(snap_, c.opt, 0, 0, buf.data(), Tier::kCpu, true).wait(timeout_);
    const auto* chunk = static_cast<const float*>(buf.data());
    for (int a = 0; a < 3; ++a)
      std::memcpy(out[a] + (b - r.begin), chunk + a * c.r.count + (b - c.r.begin),
                  (e - b) * sizeof(float));
  }
  acquired_ = true;
  range_ = r;
  return {out[0], out[1], out[2], r.count};
}

void PinnedStateStore::release(Range r, bool dirty) {
  if (!acquired_ || r.begin != range_.begin || r.count != range_.count)
    fail(ErrorCode::kInvalidArgument,
         "checkpoint snapshot: release() of a range that is not acquired");
  acquired_ = false;
  if (dirty)
    fail(ErrorCode::kInvalidArgument, "checkpoint snapshot: the pinned state is read-only");
  // The writer visits ranges in ascending order: chunks that end here are done with.
  for (std::size_t k = 0; k < chunks_.size(); ++k) {
    if (unpinned_[k] || chunks_[k].r.end() > r.end()) continue;
    store_.unpin(snap_, chunks_[k].opt);
    unpinned_[k] = true;
  }
}

}  // namespace strata::zero
