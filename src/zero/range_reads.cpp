// The reads of one range of a rank's optimizer state (see range_reads.hpp).
#include "zero/range_reads.hpp"

#include <algorithm>
#include <utility>

#include "strata/error.hpp"
#include "strata/log.hpp"
#include "zero/engine_layout.hpp"

namespace strata::zero {
namespace {
constexpr std::size_t kPage = 4096;
}  // namespace

void RangeReads::start(std::span<const Chunk> chunks, Range r, std::chrono::milliseconds timeout,
                       const ReadFn& read) {
  if (!reads_.empty()) fail(ErrorCode::kInternal, "optimizer state: reads started twice");
  started_ = true;
  timeout_ = timeout;
  range_ = r;
  stride_ = (r.count * sizeof(float) + kPage - 1) / kPage * kPage;
  if (scratch_.size() < 3 * stride_) {  // kept for the next range (no zeroing: every byte is read)
    scratch_ = IoBuffer();
    scratch_ = IoBuffer::allocate(3 * stride_);
  }
  // Only the range's elements of each array (state_place: master | m | v of a chunk lie one after
  // the other, or the master in the parameters): reading the whole chunk for each piece of a save
  // made a save of a chunk of C elements in pieces of P read C * C / P elements (61.8 s for a
  // 1.87 GB shard, against 5.2 s to write it).
  for (const Chunk& c : chunks) {
    const std::size_t b = std::max(c.r.begin, r.begin), e = std::min(c.r.end(), r.end());
    if (b >= e) continue;
    for (int a = 0; a < 3; ++a) {
      const StatePlace at = state_place(c, a);
      reads_.push_back(read(at.id, at.offset + (b - c.r.begin) * sizeof(float),
                            (e - b) * sizeof(float), array(a) + (b - r.begin)));
    }
  }
}

void RangeReads::wait() {
  std::vector<Transfer> reads = std::move(reads_);
  reads_.clear();
  wait_all(reads, timeout_);  // every read, also after one failed: they write into the scratch
}

void RangeReads::settle() noexcept {
  bool running = false;  // a read that did not finish in time may still write into the scratch
  for (Transfer& t : reads_) {
    try {
      t.wait(timeout_);
    } catch (const Error& e) {  // dropped: nobody reads this range
      running = running || e.code() == ErrorCode::kTimeout;
    } catch (...) {
    }
  }
  if (running) {  // never freed under the kernel: leaked, said once
    log_error("optimizer state: a prefetched read did not finish in ", timeout_.count(),
              " ms; its ", scratch_.size(), "-byte buffer is left allocated");
    new IoBuffer(std::move(scratch_));
  }
  reads_.clear();
  started_ = false;
}

void RangeReads::free() noexcept {
  settle();
  scratch_ = IoBuffer();
}

void RangeReads::swap(RangeReads& other) noexcept {
  std::swap(scratch_, other.scratch_);
  std::swap(stride_, other.stride_);
  std::swap(reads_, other.reads_);
  std::swap(range_, other.range_);
  std::swap(started_, other.started_);
  std::swap(timeout_, other.timeout_);
}

}  // namespace strata::zero
