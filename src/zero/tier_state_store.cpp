// Host views of the optimizer state in the TierStore (see tier_state_store.hpp).
#include "zero/tier_state_store.hpp"

#include <algorithm>
#include <cstring>

#include "strata/error.hpp"
#include "strata/io_file.hpp"
#include "zero/engine_layout.hpp"

namespace strata::zero {

TierStateStore::TierStateStore(TierStore& store, std::span<const Chunk> chunks, std::size_t size,
                               std::chrono::milliseconds timeout)
    : store_(store), chunks_(chunks), size_(size), timeout_(timeout) {}

// A chunk's master | m | v into / from `out` / `in` (3 x r.count): its state block whole (padded:
// an NVMe home reads and writes aligned), and the master from / into the parameters where they
// are its master (state_place; the block then holds m | v).
void TierStateStore::load(std::size_t k, std::vector<float>& out) {
  const Chunk& c = chunks_[k];
  const std::size_t lead = c.master_in_params ? c.r.count : 0, n = 3 * c.r.count - lead;
  const std::uint64_t padded = store_.padded_bytes(c.opt);
  IoBuffer buf = IoBuffer::allocate(padded, HugePageMode::kNone);
  store_.read(c.opt, 0, 0, buf.data(), Tier::kCpu, true).wait(timeout_);
  out.resize(3 * c.r.count);
  std::memcpy(out.data() + lead, buf.data(), n * sizeof(float));
  if (lead) get_bytes(store_, c.params, c.master_at, lead * sizeof(float), out.data(), timeout_);
}

void TierStateStore::store_chunk(std::size_t k, const std::vector<float>& in) {
  const Chunk& c = chunks_[k];
  const std::size_t lead = c.master_in_params ? c.r.count : 0, n = 3 * c.r.count - lead;
  const std::uint64_t padded = store_.padded_bytes(c.opt);
  IoBuffer buf = IoBuffer::allocate(padded, HugePageMode::kNone);  // zero padding
  std::memcpy(buf.data(), in.data() + lead, n * sizeof(float));
  store_.write(c.opt, 0, 0, buf.data(), Tier::kCpu).wait(timeout_);
  if (lead) put_bytes(store_, c.params, c.master_at, lead * sizeof(float), in.data(), timeout_);
}

void TierStateStore::check_range(Range r) const {
  if (r.end() > size_)
    fail(ErrorCode::kInvalidArgument,
         strcat("optimizer state: range [", r.begin, ", ", r.end(), ") beyond ", size_));
}

void TierStateStore::start_reads(RangeReads& reads, Range r) {
  reads.start(chunks_, r, timeout_,
              [this](BufferId id, std::uint64_t offset, std::uint64_t bytes, float* dst) {
                return store_.read(id, offset, bytes, dst, Tier::kCpu);
              });
}

checkpoint::StateView TierStateStore::acquire(Range r) {
  if (acquired_)
    fail(ErrorCode::kInvalidArgument, "optimizer state: acquire() while a range is acquired");
  check_range(r);
  if (!next_.holds(r)) {
    next_.settle();
    start_reads(next_, r);
  }
  current_.swap(next_);
  next_.settle();  // the range acquired before: never taken for a prefetch of it
  current_.wait();
  acquired_ = true;
  range_ = r;
  return {current_.array(0), current_.array(1), current_.array(2), r.count};
}

void TierStateStore::prefetch(Range r) {
  check_range(r);
  next_.settle();
  start_reads(next_, r);
}

void TierStateStore::drop_prefetch() noexcept {
  next_.free();
  if (!acquired_) current_.free();  // (the store lives as long as the engine)
}

void TierStateStore::release(Range r, bool dirty) {
  if (!acquired_ || r.begin != range_.begin || r.count != range_.count)
    fail(ErrorCode::kInvalidArgument, "optimizer state: release() of a range that is not acquired");
  acquired_ = false;
  if (!dirty) return;
  next_.settle();  // read before this write
  const float* in[3] = {current_.array(0), current_.array(1), current_.array(2)};
  std::vector<float> chunk;
  for (std::size_t k = 0; k < chunks_.size(); ++k) {
    const Chunk& c = chunks_[k];
    const std::size_t b = std::max(c.r.begin, r.begin), e = std::min(c.r.end(), r.end());
    if (b >= e) continue;
    if (c.opt_tier != Tier::kNvme) {
      // In memory: only the range's elements of each array (state_place), written in place. The
      // whole chunk read and rewritten for each range made a torch-style load_state_dict of a
      // 113.6M-parameter model (588 write_state calls into one chunk) take over ten minutes.
      for (int a = 0; a < 3; ++a) {
        const StatePlace at = state_place(c, a);
        put_bytes(store_, at.id, at.offset + (b - c.r.begin) * sizeof(float),
                  (e - b) * sizeof(float), in[a] + (b - r.begin), timeout_);
      }
      continue;
    }
    if (b != c.r.begin || e != c.r.end()) {
      load(k, chunk);
    } else {
      chunk.assign(3 * c.r.count, 0.0f);
    }
    for (int a = 0; a < 3; ++a)
      std::memcpy(chunk.data() + a * c.r.count + (b - c.r.begin), in[a] + (b - r.begin),
                  (e - b) * sizeof(float));
    store_chunk(k, chunk);
  }
}

}  // namespace strata::zero
