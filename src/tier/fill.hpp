// Filling a set of TierStore buffers from pieces that arrive in any order (the backward's
// reduce-scatter buckets filling a rank's gradient partition), without ever holding more than the
// store's pinned pool for the buffers that live on NVMe.
//
// begin() starts a round: every buffer's contents are to be replaced; elements no piece fills are
// zero at end(). fill(k, offset, bytes, src) copies a piece (host or device memory) into buffer k:
//   - home gpu / cpu: straight into the copy (TierStore::write of the range, on a mover's stream;
//     the first piece of a round is preceded by TierStore::zero of the buffer);
//   - home nvme: assembled in a pinned pool buffer (zeroed first); when the buffer is complete it
//     is written (write-behind: the pool buffer returns when the write has landed). A buffer
//     whose pool buffer is needed before it is complete is written as it is and read back (CRC
//     checked) when its next piece arrives. end() writes what is still partial, and marks the
//     buffers that got no piece zero (no I/O).
// fill() returns once `src` may be reused. Every byte must be filled at most once per round.
//
// Failure: errors of the store (IoError, Error(kChecksum / kDevice / kTimeout / kBudget)) are
// rethrown by the fill()/end() that observes them, with the buffer named; before that every
// transfer of the filler is waited for (no pool buffer is given back with I/O in flight). The
// round is then broken: call begin() again before anything else (the buffers' contents are
// undefined; a buffer whose NVMe write failed has no valid copy and fails the store, see
// tier_store.hpp).
// Ownership: borrows the store (it must outlive the filler). Thread-safety: one thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "device/pinned_pool.hpp"
#include "tier/tier_store.hpp"

namespace strata {
class Stream;
}

namespace strata::tier {

class Filler {
 public:
  Filler(TierStore& store, std::vector<BufferId> buffers, std::chrono::milliseconds timeout);
  ~Filler();
  Filler(const Filler&) = delete;
  Filler& operator=(const Filler&) = delete;

  void begin();
  // src_memory: kCpu for host memory, kGpu for device memory of the store's Device.
  void fill(std::size_t k, std::uint64_t offset, std::uint64_t bytes, const void* src,
            Tier src_memory);
  void end();
  // Gives up the round (the caller failed elsewhere): waits for the writes in flight and returns
  // every pool buffer; the buffers' contents are undefined until the next round.
  void abandon() noexcept { drain(); }
  bool active() const { return active_; }

  std::size_t size() const { return bufs_.size(); }
  std::uint64_t bytes_written() const { return written_; }  // to NVMe, this filler's lifetime
  std::uint64_t partial_writes() const { return partial_writes_; }

 private:
  struct Buf {
    BufferId id = 0;
    std::uint64_t bytes = 0, padded = 0;
    bool nvme = false;
    std::uint64_t filled = 0;  // bytes received this round
    bool touched = false;      // got a piece this round
    bool on_disk = false;      // written partially this round: read back to continue
    int staged = -1;           // index into staged_ while assembled in a pool buffer
  };
  struct Staged {
    std::size_t k = 0;
    PinnedBuffer buf;
  };
  struct Writing {
    std::size_t k = 0;
    PinnedBuffer buf;
    Transfer t;
  };
  void stage(std::size_t k);
  void write_staged(std::size_t s, bool partial);
  PinnedBuffer take_buffer();
  void retire_oldest_write();
  void copy_in(void* dst, const void* src, std::uint64_t bytes, Tier src_memory);
  void drain() noexcept;
  [[noreturn]] void failed(const std::exception& e, std::size_t k, const char* doing);

  TierStore& store_;
  std::chrono::milliseconds timeout_;
  std::vector<Buf> bufs_;
  std::vector<Staged> staged_;      // buffers being assembled (nvme)
  std::deque<Writing> writing_;     // nvme writes in flight, oldest first
  std::vector<Transfer> direct_;    // memory-tier zero/range writes of this round
  std::unique_ptr<Stream> stream_;  // device → pinned copies
  bool active_ = false;
  std::uint64_t written_ = 0, partial_writes_ = 0;
};

}  // namespace strata::tier
