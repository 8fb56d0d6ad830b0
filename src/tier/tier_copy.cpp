// The data paths of the tier store. NVMe I/O is cut into pieces of the pinned pool's buffer size;
// each check unit of an NVMe copy (crc_unit(): at most 1 MiB, a divisor of the piece size) has its
// own CRC32C (when checksums are on), computed before the write and verified after every read. GPU
// ⇄ NVMe goes through pinned pool buffers with a window of pieces in flight, so the NVMe leg of one
// piece overlaps the PCIe leg of the next.
#include <cstring>
#include <deque>
#include <utility>

#include "core/crc32c.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"
#include "tier/store_impl.hpp"

namespace strata {

namespace {

// Waits for every ticket (all of them, also after a failure, so no buffer is still in use when
// this returns); rethrows the first failure. A ticket that does not finish within `timeout` sets
// *unsafe (its buffer may still be written by the kernel) and becomes Error(kTimeout).
class TicketSet {
 public:
  TicketSet(IoEngine& engine, std::chrono::milliseconds timeout)
      : engine_(engine), timeout_(timeout) {}
  ~TicketSet() {
    bool unsafe = false;
    drain(&unsafe);
  }
  void add(IoTicket t) { tickets_.push_back(t); }
  // Waits for the oldest ticket; returns its index in submission order.
  void wait_front(bool* unsafe) {
    IoTicket t = tickets_.front();
    tickets_.pop_front();
    wait_one(t, unsafe);
  }
  void drain(bool* unsafe) {
    while (!tickets_.empty()) {
      try {
        wait_front(unsafe);
      } catch (...) {
        if (!error_) error_ = std::current_exception();
      }
    }
  }
  void finish(bool* unsafe) {
    drain(unsafe);
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }
  std::size_t size() const { return tickets_.size(); }

 private:
  void wait_one(IoTicket t, bool* unsafe) {
    if (!engine_.wait(t, timeout_)) {
      *unsafe = true;
      fail(ErrorCode::kTimeout,
           strcat("tier store: I/O not complete after ", timeout_.count(), " ms"));
    }
  }
  IoEngine& engine_;
  std::chrono::milliseconds timeout_;
  std::deque<IoTicket> tickets_;
  std::exception_ptr error_;
};

// The staging buffer for the next piece of a GPU <-> NVMe pipeline: a free pool buffer (when
// there is a pool) at once while the window has room and an event is free; else the oldest piece
// in flight is retired to make room; with nothing in flight, `take` (a pool buffer or a bounce
// buffer, never blocking). Returns an empty buffer once `error` is set.
template <typename Window, typename Events, typename Retire, typename Take>
tier::Staging next_staging_buffer(PinnedPool* pool, std::size_t window_cap, Window& window,
                                  const Events& free_events, Retire& retire_front,
                                  std::exception_ptr& error, Take&& take) {
  tier::Staging pb;
  while (!pb) {
    if (pool && window.size() < window_cap && !free_events.empty()) {
      PinnedBuffer p = pool->try_acquire();
      if (p) pb = tier::Staging(std::move(p));
    }
    if (pb) break;
    if (!window.empty()) {
      retire_front();
      if (error) break;
    } else {
      try {
        pb = take();
      } catch (...) {
        error = std::current_exception();
        break;
      }
    }
  }
  return pb;
}

}  // namespace

void TierStore::Impl::verify_units(Buf& b, const std::vector<std::uint32_t>& crc,
                                   std::uint64_t slot, std::uint64_t off, const void* data,
                                   std::uint64_t len, const std::string& what) {
  if (crc.empty()) return;
  const std::uint64_t unit = crc_unit();
  const auto* p = static_cast<const std::uint8_t*>(data);
  for (std::uint64_t done = 0; done < len; done += unit) {
    const std::uint64_t n = std::min(unit, len - done);
    const std::size_t u = static_cast<std::size_t>((off + done) / unit);
    const std::uint32_t got = crc32c(p + done, n);
    if (got == crc[u]) continue;
    const auto [path, file_off] = swap_->locate(slot + off + done);
    {
      MutexLock lock(mutex_);
      ++stats_.checksum_failures;
    }
    fail(ErrorCode::kChecksum,
         strcat("checksum mismatch reading ", what, " '", b.spec.name,
                "' back from NVMe at buffer offset ", off + done, " (", n, " bytes; swap file ",
                path, " offset ", file_off, "): CRC32C stored 0x", std::hex, crc[u], ", read 0x",
                got, std::dec));
  }
}

void TierStore::Impl::verify_piece(Buf& b, std::size_t piece, const void* data, std::uint64_t len) {
  if (!options_.checksum) return;
  verify_units(b, b.crc, b.copy[ti(Tier::kNvme)].extent.offset, piece * piece_size(), data, len,
               "buffer");
}

void TierStore::Impl::checksum_units(std::vector<std::uint32_t>& crc, std::uint64_t off,
                                     const void* data, std::uint64_t len) const {
  if (crc.empty()) return;
  const std::uint64_t unit = crc_unit();
  const auto* p = static_cast<const std::uint8_t*>(data);
  for (std::uint64_t done = 0; done < len; done += unit)
    crc[static_cast<std::size_t>((off + done) / unit)] =
        crc32c(p + done, std::min(unit, len - done));
}

void TierStore::Impl::copy_host_to_nvme(Buf& b, const std::uint8_t* src, bool* unsafe) {
  copy_host_to_slot(b, src, b.copy[ti(Tier::kNvme)].extent, b.crc, unsafe);
}

void TierStore::Impl::copy_host_to_slot(Buf& b, const std::uint8_t* src, const SwapExtent& slot,
                                        std::vector<std::uint32_t>& crc, bool* unsafe) {
  const std::uint64_t base = slot.offset;
  TicketSet set(*engine_, options_.timeout);
  const std::size_t n = pieces(b);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t off = i * piece_size();
    set.add(
        engine_->submit(IoRequest{IoOp::kWrite, swap_->file(), const_cast<std::uint8_t*>(src + off),
                                  piece_len(b, i), base + off}));
  }
  // The checksums are computed while the writes are in flight (the engine and this thread only
  // read the host copy, which nothing can modify during the transfer).
  checksum_units(crc, 0, src, b.padded);
  set.finish(unsafe);
  MutexLock lock(mutex_);
  stats_.bytes_to_nvme += b.padded;
}

void TierStore::Impl::copy_nvme_to_host(Buf& b, std::uint8_t* dst, bool* unsafe) {
  const std::uint64_t base = b.copy[ti(Tier::kNvme)].extent.offset;
  TicketSet set(*engine_, options_.timeout);
  const std::size_t n = pieces(b);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t off = i * piece_size();
    set.add(engine_->submit(
        IoRequest{IoOp::kRead, swap_->file(), dst + off, piece_len(b, i), base + off}));
  }
  // Verify each piece as it lands, while the later ones are still being read.
  for (std::size_t i = 0; i < n; ++i) {
    set.wait_front(unsafe);  // throws: the destructor drains the rest
    verify_piece(b, i, dst + i * piece_size(), piece_len(b, i));
  }
  MutexLock lock(mutex_);
  stats_.bytes_from_nvme += b.padded;
}

// One copy, one wait: the copy is a whole leg (the caller hands the bytes on next). Legs of
// several pieces queue them all and wait once (read_nvme_to_gpu).
void TierStore::Impl::copy_device(void* dst, const void* src, std::size_t bytes, WorkerContext& ctx,
                                  bool* unsafe) {
  *unsafe = true;
  ctx.stream->memcpy_async(dst, src, bytes);
  ctx.stream->synchronize(options_.timeout);
  *unsafe = false;
}

namespace {

// One pinned piece in flight through a GPU ⇄ NVMe pipeline.
struct Slot {
  tier::Staging buf;
  Event* event = nullptr;
  std::size_t piece = 0;
  std::uint64_t len = 0;
  IoTicket ticket = 0;
  int stage = 0;  // see the two pipelines
};

// One direction of the GPU ⇄ NVMe pipeline: what happens to a slot at each step.
template <typename Start, typename Ready, typename Advance, typename Finish, typename Settle,
          typename Flush>
struct PieceLeg {
  Start start;      // puts the slot's piece in flight in stage 0
  Ready ready;      // stage 0 has finished (never blocks)
  Advance advance;  // stage 0 -> 1
  Finish finish;    // waits until the slot is done with its buffer; throws on failure
  Settle settle;    // after a failure: nothing still in flight may touch the slot's buffer
  Flush flush;      // once every piece was started: may complete the whole window at once
};
// Spelled out: clang before 17 deduces no aggregate's template arguments (the thread-safety
// check compiles this file with clang).
template <typename Start, typename Ready, typename Advance, typename Finish, typename Settle,
          typename Flush>
PieceLeg(Start, Ready, Advance, Finish, Settle, Flush)
    -> PieceLeg<Start, Ready, Advance, Finish, Settle, Flush>;

// GPU → NVMe, after slot `s` failed or was drained after another's failure: a device copy that
// may still write its buffer, or a write that may still read it, keeps the buffer detached:
// never back to the pool (F10).
void settle_gpu_to_nvme_slot(Slot& s, IoEngine& engine, std::chrono::milliseconds timeout,
                             bool* unsafe) {
  if (s.stage == 0) {
    try {
      s.event->synchronize(timeout);
    } catch (...) {
      *unsafe = true;
      s.buf.detach();
    }
  } else if (s.ticket) {
    try {
      if (!engine.wait(s.ticket, timeout)) s.buf.detach();
    } catch (...) {
      s.buf.detach();
    }
  }
}

// NVMe → GPU, after slot `s` failed or was drained after another's failure: nothing still in
// flight may touch its buffer afterwards. A read that may still write it, or a device copy that
// may still read it, keeps the buffer detached: never back to the pool (F10).
void settle_nvme_to_gpu_slot(Slot& s, IoEngine& engine, std::chrono::milliseconds timeout,
                             bool* unsafe) {
  if (s.stage == 0 && s.ticket) {
    try {
      if (!engine.wait(s.ticket, timeout)) s.buf.detach();
    } catch (...) {
      s.buf.detach();
    }
  } else if (s.stage == 1) {
    try {
      s.event->synchronize(timeout);
    } catch (...) {
      *unsafe = true;
      s.buf.detach();
    }
  }
}

}  // namespace

// Pieces [first, end) of `b` pass through pinned staging buffers in two stages, up to window_
// pieces (and one event each) in flight; a piece moves to stage 1 as soon as its stage 0 is seen
// done, in order. Once every piece was started the leg's flush may complete the window at once
// (one wait for the lot); what it left is retired piece by piece. The first failure stops new
// pieces; the ones in flight are drained (each settled), and the failure is rethrown.
template <typename Leg>
void TierStore::Impl::run_piece_pipeline(Buf& b, std::size_t first, std::size_t end,
                                         WorkerContext& ctx, Leg leg) {
  std::deque<Slot> window;
  std::vector<Event*> free_events;
  for (auto& e : ctx.events) free_events.push_back(e.get());
  std::exception_ptr error;
  auto retire_front = [&] {
    Slot& s = window.front();
    try {
      if (error) fail(ErrorCode::kCancelled, "draining after an earlier failure");
      leg.finish(s);
    } catch (...) {
      if (!error) error = std::current_exception();
      leg.settle(s);
    }
    free_events.push_back(s.event);
    window.pop_front();
  };

  for (std::size_t i = first; i < end && !error; ++i) {
    tier::Staging pb = next_staging_buffer(pool_, window_, window, free_events, retire_front, error,
                                           [this] { return take_staging(); });
    if (error) break;
    try {
      Slot s{std::move(pb), free_events.back(), i, piece_len(b, i), 0, 0};
      free_events.pop_back();
      leg.start(s);
      window.push_back(std::move(s));
      for (auto& w : window) {
        if (w.stage == 0) {
          if (!leg.ready(w)) break;
          leg.advance(w);
        }
      }
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (!error) {
    try {
      leg.flush(window);
    } catch (...) {
      error = std::current_exception();
    }
  }
  while (!window.empty()) retire_front();
  if (error) std::rethrow_exception(error);
}

// Stage 0: device→pinned copy queued (event); stage 1: NVMe write submitted (ticket).
void TierStore::Impl::copy_gpu_to_nvme(Buf& b, const std::uint8_t* src, WorkerContext& ctx,
                                       bool* unsafe) {
  const std::uint64_t base = b.copy[ti(Tier::kNvme)].extent.offset;
  const auto timeout = options_.timeout;
  auto start = [&](Slot& s) {  // the device copy into the pinned buffer, zero padding after it
    const std::uint64_t off = s.piece * piece_size();
    const std::uint64_t real = std::min<std::uint64_t>(s.len, b.spec.bytes - off);
    if (real < s.len) std::memset(s.buf.bytes() + real, 0, s.len - real);
    ctx.stream->memcpy_async(s.buf.data(), src + off, real);
    ctx.stream->record(*s.event);
  };
  auto copied = [](Slot& s) { return s.event->query(); };
  auto to_write = [&](Slot& s) {  // stage 0 → 1
    s.event->synchronize(timeout);
    s.ticket = engine_->submit(
        IoRequest{IoOp::kWrite, swap_->file(), s.buf.data(), s.len, base + s.piece * piece_size()});
    s.stage = 1;
    // Checksummed while the write is in flight (both only read the pinned buffer).
    checksum_units(b.crc, s.piece * piece_size(), s.buf.data(), s.len);
  };
  auto finish = [&](Slot& s) {
    if (s.stage == 0) to_write(s);
    if (!engine_->wait(s.ticket, timeout)) {
      *unsafe = true;
      fail(ErrorCode::kTimeout, "tier store: NVMe write not complete in time");
    }
  };
  auto settle = [&](Slot& s) { settle_gpu_to_nvme_slot(s, *engine_, timeout, unsafe); };
  // Each piece's copy is waited for where its bytes are needed: before its NVMe write.
  auto flush = [](std::deque<Slot>&) {};
  run_piece_pipeline(b, 0, pieces(b), ctx,
                     PieceLeg{start, copied, to_write, finish, settle, flush});
  MutexLock lock(mutex_);
  stats_.bytes_to_nvme += b.padded;
  stats_.bytes_from_gpu += b.spec.bytes;
}

// Stage 0: NVMe read submitted (ticket); stage 1: pinned→device copy queued (event); stage 2: the
// copy is known complete. Stream-ordered: a piece's copy is waited for only when its buffer is
// needed for a later piece; once every piece was started one wait (the newest copy's event: the
// stream runs them in order) completes all the copies still queued.
void TierStore::Impl::read_nvme_to_gpu(Buf& b, std::uint64_t offset, std::uint64_t bytes,
                                       std::uint8_t* dst, WorkerContext& ctx, bool* unsafe) {
  if (bytes == 0) return;
  const std::uint64_t base = b.copy[ti(Tier::kNvme)].extent.offset;
  const auto timeout = options_.timeout;
  auto start = [&](Slot& s) {
    s.ticket = engine_->submit(
        IoRequest{IoOp::kRead, swap_->file(), s.buf.data(), s.len, base + s.piece * piece_size()});
  };
  auto read = [&](Slot& s) { return engine_->poll(s.ticket); };
  auto to_device = [&](Slot& s) {  // stage 0 (read done) → 1
    s.ticket = 0;
    verify_piece(b, s.piece, s.buf.data(), s.len);
    const std::uint64_t off = s.piece * piece_size();
    const std::uint64_t lo = std::max(offset, off), hi = std::min(offset + bytes, off + s.len);
    ctx.stream->memcpy_async(dst + (lo - offset), s.buf.bytes() + (lo - off), hi - lo);
    ctx.stream->record(*s.event);
    s.stage = 1;
  };
  auto read_done = [&](Slot& s) {  // stage 0 → 1, waiting for the read
    if (!engine_->wait(s.ticket, timeout)) {
      *unsafe = true;
      fail(ErrorCode::kTimeout, "tier store: NVMe read not complete in time");
    }
    to_device(s);
  };
  auto finish = [&](Slot& s) {
    if (s.stage == 0) read_done(s);
    if (s.stage == 1) s.event->synchronize(timeout);
    s.stage = 2;
  };
  auto settle = [&](Slot& s) { settle_nvme_to_gpu_slot(s, *engine_, timeout, unsafe); };
  auto flush = [&](std::deque<Slot>& window) {
    for (Slot& s : window)
      if (s.stage == 0) read_done(s);
    if (window.empty()) return;
    try {
      window.back().event->synchronize(timeout);
    } catch (...) {  // any copy of the window may still be queued: no buffer goes back (F10)
      *unsafe = true;
      for (Slot& s : window) {
        if (s.stage == 1) s.buf.detach();
        s.stage = 2;
      }
      throw;
    }
    for (Slot& s : window) s.stage = 2;
  };
  const std::uint64_t piece = piece_size();
  run_piece_pipeline(b, static_cast<std::size_t>(offset / piece),
                     static_cast<std::size_t>((offset + bytes - 1) / piece + 1), ctx,
                     PieceLeg{start, read, to_device, finish, settle, flush});
}

void TierStore::Impl::copy_nvme_to_gpu(Buf& b, std::uint8_t* dst, WorkerContext& ctx,
                                       bool* unsafe) {
  read_nvme_to_gpu(b, 0, b.spec.bytes, dst, ctx, unsafe);
  MutexLock lock(mutex_);
  stats_.bytes_from_nvme += b.padded;
  stats_.bytes_to_gpu += b.spec.bytes;
}

}  // namespace strata
