// Filling a set of TierStore buffers from pieces that arrive in any order (the backward's
// reduce-scatter buckets filling a rank's gradient partition), without ever holding more than the
// store's pinned pool for the buffers that live on NVMe, and without making the caller wait for
// the copies (ZeRO-Offload: the rank's share of a bucket goes device→host while the backward goes
// on).
//
// begin() starts a round: every buffer's contents are to be replaced; elements no piece fills are
// zero at end(). fill_async(k, offset, bytes, src) queues a piece (host or device memory) into
// buffer k and returns a ticket at once:
//   - home gpu / cpu: straight into the copy (TierStore::write of the range, on a mover's stream;
//     the first piece of a round is preceded by TierStore::zero of the buffer);
//   - home nvme: assembled in a pinned pool buffer (zeroed first); a piece in device memory is
//     copied into it on the filler's copy stream (an event marks its end), one in host memory at
//     once. When every byte of the buffer has arrived and its copies have completed, it is
//     written (write-behind: the pool buffer returns when the write has landed). A buffer whose
//     pool buffer is needed before it is complete is written as it is (after its copies) and read
//     back (CRC checked) when its next piece arrives. end() writes what is still partial, and
//     marks the buffers that got no piece zero (no I/O).
// Elements: the buffers hold `buffer_dtype`, the pieces arrive in `piece_dtype` (FP32 both by
// default; offsets and lengths are the buffer's bytes, a piece's source holds the same elements in
// piece_dtype). When the two differ, every piece is converted element by element (round to nearest
// even), as below.
// Accumulating rounds (begin(Mode::kAccumulate), gradient accumulation over micro-batches): every
// piece is added element by element to the buffer's current contents instead of replacing them
// (accumulate_elems, core/numeric.hpp: one FP32 add rounded into buffer_dtype); elements no piece
// reaches keep theirs, and end() zeroes nothing. An nvme buffer is read into its pool buffer when
// its first piece arrives (accumulating) and written back whole. Such a piece (and a converted
// one) is asynchronous when its source is device memory (the caller does not wait for the device,
// which a GPU's backward would otherwise idle on): into a gpu home it is added or converted on the
// filler's stream through `on_device`; into a cpu or nvme home it is copied into the filler's
// staging buffer (`staging_bytes` of host memory, allocated at the first such piece, page-locked
// through the device and counted against the store's pinned budget where it fits, pageable with a
// warning where not; a larger piece goes in parts of that size), then added or converted by a host
// function queued behind the copy on the same stream (the stream's worker; CUDA's callback thread)
// straight into the buffer's host memory (pinned by an acquire until it completes) or its pool
// buffer. The stream runs them in order, a host function before the next copy, so one staging
// buffer serves every piece and fill_async never waits for it. A piece from host memory is added
// or converted in the caller (it is complete when fill_async returns).
// Completion is collected, never pushed: done(t) / poll() look at what finished without blocking
// (and start the NVMe writes of buffers that became complete), wait(t) blocks. Tickets count up
// from 1 per filler; done(t) is true when the pieces of tickets <= t have all completed, i.e. when
// their sources may be reused. fill() is fill_async() + wait(). fill_async() itself blocks only
// when it needs a pool buffer and none is free (it retires writes, or writes a partial buffer
// after waiting for that buffer's copies), when a buffer's contents are read back (written
// partially before; an accumulating round's first piece of an nvme buffer), and for a converting
// round's first piece of a memory home (the zeroing around it).
// `src` must stay valid and unchanged until its ticket is done. Every byte must be filled at most
// once per round.
//
// Failure: errors of the store or the device (IoError, Error(kChecksum / kDevice / kTimeout /
// kBudget)) are rethrown by the fill_async()/fill()/done()/poll()/wait()/end() that observes them,
// with the buffer named; before that every transfer and copy of the filler is waited for (bounded:
// a pool buffer a copy or write may still touch is never given back). The round is then broken:
// call begin() again before anything else (the buffers' contents are undefined; a buffer whose
// NVMe write failed has no valid copy and fails the store, see tier_store.hpp).
// Ownership: borrows the store (it must outlive the filler). Thread-safety: one thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <vector>

#include "device/pinned_pool.hpp"
#include "strata/io_file.hpp"
#include "tier/tier_store.hpp"

namespace strata {
class Event;
class Stream;
}  // namespace strata

namespace strata::tier {

class Filler {
 public:
  using Ticket = std::uint64_t;
  // The staging buffer's bytes by default, and the most the engine gives it (min(share, this);
  // plan/runtime.cpp counts it as kShareStagingBytes: the plan layer includes no engine source).
  static constexpr std::size_t kStagingMax = std::size_t{64} << 20;
  enum class Mode { kReplace, kAccumulate };
  // add: dst[i] = round(dst[i] + src[i]), else dst[i] = round(src[i]) (n elements, dst in
  // buffer_dtype, src in piece_dtype, both in device memory), in `stream`'s order (the filler's
  // copy stream); may return before it is done on a CUDA device (the stream orders it).
  using DeviceOp =
      std::function<void(Stream& stream, void* dst, const void* src, std::size_t n, bool add)>;

  // `on_device`: needed only for accumulating (or converting) pieces into buffers whose home is
  // gpu.
  Filler(TierStore& store, std::vector<BufferId> buffers, std::chrono::milliseconds timeout,
         DeviceOp on_device = nullptr, DType piece_dtype = DType::kFp32,
         DType buffer_dtype = DType::kFp32, std::size_t staging_bytes = kStagingMax);
  ~Filler();
  Filler(const Filler&) = delete;
  Filler& operator=(const Filler&) = delete;

  void begin(Mode mode = Mode::kReplace);
  Mode mode() const { return mode_; }
  // src_memory: kCpu for host memory, kGpu for device memory of the store's Device.
  // REQUIRES: active(); the piece lies in buffer k and was not filled before this round;
  // accumulating or converting: offset and bytes are whole elements of buffer_dtype.
  Ticket fill_async(std::size_t k, std::uint64_t offset, std::uint64_t bytes, const void* src,
                    Tier src_memory);
  void fill(std::size_t k, std::uint64_t offset, std::uint64_t bytes, const void* src,
            Tier src_memory) {
    wait(fill_async(k, offset, bytes, src, src_memory));
  }
  // True when every piece of ticket <= t has completed (non-blocking; collects what finished).
  bool done(Ticket t);
  void poll() { (void)done(0); }
  // True when this round's pieces of buffer k are all the store's own operations (a plain copy
  // into a memory home): an operation submitted on the buffer later (a read) runs after them
  // without waiting for done(). False for an nvme home (assembled in a pool buffer, written once
  // complete) and for adding or converting rounds (on the filler's stream, outside the store).
  bool in_store_order(std::size_t k) const { return !element_wise() && !bufs_.at(k).nvme(); }
  // Blocks until done(t) (each wait bounded by the timeout).
  void wait(Ticket t);
  // Waits for every piece, writes the partial buffers, zeroes the untouched ones, waits for the
  // writes.
  void end();
  // Gives up the round (the caller failed elsewhere): waits for the copies and writes in flight
  // and returns every pool buffer; the buffers' contents are undefined until the next round.
  void abandon() noexcept { drain(); }
  // abandon(), and the error of the first piece that had failed (named as done() would throw it),
  // or null: what the caller saw may be its consequence (a store that refuses work because a
  // failed copy left a buffer without contents).
  std::exception_ptr abandon_for_cause() noexcept;
  bool active() const { return active_; }

  std::size_t size() const { return bufs_.size(); }
  std::uint64_t bytes_written() const { return written_; }  // to NVMe, this filler's lifetime
  std::uint64_t partial_writes() const { return partial_writes_; }
  std::size_t pending() const { return pieces_.size(); }  // pieces queued, not yet collected

 private:
  struct Buf {
    BufferId id = 0;
    std::uint64_t bytes = 0, padded = 0;
    Tier home = Tier::kCpu;  // the store's home of the buffer (fixed)
    bool nvme() const { return home == Tier::kNvme; }
    std::uint64_t filled = 0;  // bytes queued this round
    bool touched = false;      // got a piece this round
    bool on_disk = false;      // written partially this round: read back to continue
    int staged = -1;           // index into staged_ while assembled in a pool buffer
  };
  struct Staged {
    std::size_t k = 0;
    PinnedBuffer buf;
    std::uint32_t copies = 0;  // device copies into buf not yet completed
    bool full = false;         // every byte queued: written once copies reaches 0
  };
  struct Writing {
    std::size_t k = 0;
    PinnedBuffer buf;
    Transfer t;
  };
  // One queued piece: store transfers (memory homes), or work on stream_ (a device copy into a
  // staged buffer; an element-wise piece from device memory).
  struct Piece {
    Ticket ticket = 0;
    std::size_t k = 0;
    Transfer zero, write;
    std::unique_ptr<Event> event;  // recorded after the piece's work on stream_
    bool staging = false;          // element-wise from device memory: its copy uses staging_
    Tier pinned = Tier::kNvme;     // kCpu / kGpu: the buffer's copy there is acquired until done
    bool done = false;
  };
  void queue(Piece p);  // numbers p with the next ticket
  std::unique_ptr<Event> take_event();
  void stage(std::size_t k);
  bool element_wise() const { return mode_ == Mode::kAccumulate || piece_dtype_ != buffer_dtype_; }
  void combine_piece(Buf& b, std::size_t k, std::uint64_t offset, std::uint64_t bytes,
                     const void* src, Tier src_memory);
  void zero_around(const Buf& b, std::uint64_t offset, std::uint64_t bytes);
  void combine_on_device(Buf& b, std::size_t k, std::uint64_t offset, std::size_t n,
                         const void* src);
  void combine_from_device(Buf& b, std::size_t k, std::uint64_t offset, std::size_t n,
                           const void* src);
  void combine_from_host(Buf& b, std::size_t k, std::uint64_t offset, std::size_t n,
                         const void* src);
  unsigned char* host_target(Buf& b, std::uint64_t offset, Piece& p);
  unsigned char* staging();  // made at the first call
  void lock_staging();  // page-locks staging_ within the pinned budget, else leaves it pageable
  void release_piece(Piece& p, bool stuck) noexcept;  // its pin
  void abandon_staging() noexcept;
  void write_staged(std::size_t s, bool partial);
  PinnedBuffer take_buffer();
  void retire_oldest_write();
  // Completes `p` if it has finished (or, with block, once it has); rethrows its error.
  bool finish(Piece& p, bool block);
  void completed(Piece& p);
  void collect();                   // non-blocking progress (throws the first error)
  void wait_copies(std::size_t k);  // every queued piece of buffer k completed
  void drain() noexcept;
  // Drains, then throws the first failed piece's error (the cause), else `e`, naming the buffer.
  [[noreturn]] void failed(const std::exception& e, std::size_t k, const char* doing);
  [[noreturn]] void name_and_throw(const std::exception& e, std::size_t k, const char* doing);

  TierStore& store_;
  std::chrono::milliseconds timeout_;
  DeviceOp on_device_;
  const DType piece_dtype_, buffer_dtype_;
  Mode mode_ = Mode::kReplace;
  const std::size_t staging_bytes_;
  IoBuffer staging_;
  bool staging_locked_ = false;  // page-locked by the device (register_host), pinned bytes reserved
  std::vector<Buf> bufs_;
  std::vector<Staged> staged_;   // buffers being assembled (nvme)
  std::deque<Writing> writing_;  // nvme writes in flight, oldest first
  std::deque<Piece> pieces_;     // queued pieces, ticket order, not yet collected
  std::vector<std::unique_ptr<Event>> free_events_;
  std::unique_ptr<Stream> stream_;  // device → pinned copies
  std::exception_ptr first_error_;  // drain(): the first failed piece's error (ticket order)
  std::size_t first_error_k_ = 0;
  Ticket next_ticket_ = 1;
  Ticket done_through_ = 0;  // every piece of ticket <= this has completed
  bool active_ = false;
  std::uint64_t written_ = 0, partial_writes_ = 0;
};

}  // namespace strata::tier
