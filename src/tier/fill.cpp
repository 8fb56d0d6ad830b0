// Filling buffers from pieces in any order, asynchronously (see fill.hpp).
#include "tier/fill.hpp"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <utility>

#include "core/numeric.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::tier {

Filler::Filler(TierStore& store, std::vector<BufferId> buffers, std::chrono::milliseconds timeout,
               DeviceOp on_device, DType piece_dtype, DType buffer_dtype, std::size_t staging_bytes)
    : store_(store),
      timeout_(timeout),
      on_device_(std::move(on_device)),
      piece_dtype_(piece_dtype),
      buffer_dtype_(buffer_dtype),
      staging_bytes_(std::max(staging_bytes, dtype_size(piece_dtype))) {
  for (BufferId id : buffers) {
    const BufferInfo info = store_.info(id);
    Buf b;
    b.id = id;
    b.bytes = info.bytes;
    b.padded = store_.padded_bytes(id);
    b.home = info.home;
    if (b.nvme() && (!store_.pool() || store_.pool()->buffer_size() < b.padded))
      fail(ErrorCode::kInvalidArgument,
           strcat("filler: buffer '", info.name, "' (", b.padded,
                  " bytes, on nvme) does not fit a pinned pool buffer (",
                  store_.pool() ? store_.pool()->buffer_size() : 0, " bytes)"));
    bufs_.push_back(b);
  }
}

Filler::~Filler() {
  drain();
  if (!staging_locked_) return;
  store_.device().unregister_host(staging_.data());
  store_.unreserve_pinned(staging_.size());
}

void Filler::begin(Mode mode) {
  drain();
  mode_ = mode;
  for (Buf& b : bufs_) {
    b.filled = 0;
    b.touched = false;
    b.on_disk = false;
    b.staged = -1;
  }
  active_ = true;
}

PinnedBuffer Filler::take_buffer() {
  PinnedPool& pool = *store_.pool();
  collect();
  while (true) {
    PinnedBuffer b = pool.try_acquire();
    if (b) return b;
    if (!writing_.empty()) {
      retire_oldest_write();
      continue;
    }
    if (!staged_.empty()) {  // every buffer holds a partial chunk: write the oldest as it is
      if (staged_[0].copies > 0) {
        wait_copies(staged_[0].k);  // may write it (when it became full)
        continue;
      }
      write_staged(0, true);
      continue;
    }
    return pool.acquire(timeout_);  // held by someone else: bounded wait
  }
}

void Filler::retire_oldest_write() {
  Writing w = std::move(writing_.front());
  writing_.pop_front();
  try {
    w.t.wait(timeout_);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kTimeout) w.buf.detach();  // the write may still read it
    throw;
  }
  written_ += bufs_[w.k].padded;
}

// Writes staged_[s] (complete, or partial: read back later) and forgets it.
// REQUIRES: staged_[s].copies == 0.
void Filler::write_staged(std::size_t s, bool partial) {
  Staged st = std::move(staged_[s]);
  staged_.erase(staged_.begin() + static_cast<std::ptrdiff_t>(s));
  for (std::size_t i = 0; i < staged_.size(); ++i) bufs_[staged_[i].k].staged = static_cast<int>(i);
  Buf& b = bufs_[st.k];
  b.staged = -1;
  if (partial) {
    b.on_disk = true;
    ++partial_writes_;
  }
  Writing w;
  w.k = st.k;
  w.t = store_.write(b.id, 0, 0, st.buf.data(), Tier::kCpu);
  w.buf = std::move(st.buf);
  writing_.push_back(std::move(w));
}

void Filler::stage(std::size_t k) {
  Buf& b = bufs_[k];
  // A write of this buffer still in flight must land before it is read back or replaced.
  auto writing_k = [&] {
    return std::any_of(writing_.begin(), writing_.end(),
                       [&](const Writing& w) { return w.k == k; });
  };
  while (writing_k()) retire_oldest_write();
  Staged st;
  st.k = k;
  st.buf = take_buffer();
  if (b.on_disk || mode_ == Mode::kAccumulate) {  // continue from what the buffer holds
    store_.read(b.id, 0, 0, st.buf.data(), Tier::kCpu, true).wait(timeout_);
  } else {
    std::memset(st.buf.data(), 0, b.padded);
  }
  staged_.push_back(std::move(st));
  b.staged = static_cast<int>(staged_.size() - 1);
}

Filler::Ticket Filler::fill_async(std::size_t k, std::uint64_t offset, std::uint64_t bytes,
                                  const void* src, Tier src_memory) {
  if (!active_) fail(ErrorCode::kInvalidArgument, "filler: fill() outside begin()/end()");
  if (k >= bufs_.size()) fail(ErrorCode::kInvalidArgument, strcat("filler: no buffer ", k));
  Buf& b = bufs_[k];
  if (offset + bytes > b.bytes || b.filled + bytes > b.bytes)
    fail(ErrorCode::kInvalidArgument,
         strcat("filler: piece [", offset, ", ", offset + bytes, ") of buffer ", k, " beyond its ",
                b.bytes, " bytes or filled twice"));
  Piece p;
  p.k = k;
  try {
    if (bytes == 0) {
      p.done = true;
    } else if (element_wise()) {
      combine_piece(b, k, offset, bytes, src, src_memory);  // queues its own pieces
      collect();
      return next_ticket_ - 1;
    } else if (!b.nvme()) {  // on the store's movers, in submission order per buffer
      if (!b.touched) p.zero = store_.zero(b.id);
      p.write = store_.write(b.id, offset, bytes, src, src_memory);
      b.touched = true;
      b.filled += bytes;
    } else {
      if (b.staged < 0) stage(k);
      b.touched = true;
      Staged& s = staged_[static_cast<std::size_t>(b.staged)];
      auto* dst = static_cast<unsigned char*>(s.buf.data()) + offset;
      if (src_memory == Tier::kCpu) {
        std::memcpy(dst, src, bytes);
        p.done = true;
      } else {
        if (!stream_) stream_ = store_.device().create_stream();
        p.event = take_event();
        stream_->memcpy_async(dst, src, bytes);
        stream_->record(*p.event);
        ++s.copies;
      }
      b.filled += bytes;
      if (b.filled == b.bytes) s.full = true;
      if (s.full && s.copies == 0) write_staged(static_cast<std::size_t>(b.staged), false);
    }
    // Numbered only now: what ran above (stage(), take_buffer()) may have collected pieces, and
    // tickets below next_ticket_ must all be queued.
    queue(std::move(p));
  } catch (const std::exception& e) {
    if (!active_) throw;  // failed() ran already (the round was drained, the error named)
    failed(e, k, "filling");
  }
  const Ticket ticket = next_ticket_ - 1;
  collect();
  return ticket;
}

void Filler::queue(Piece p) {
  p.ticket = next_ticket_++;
  pieces_.push_back(std::move(p));
}

std::unique_ptr<Event> Filler::take_event() {
  if (free_events_.empty()) return store_.device().create_event();
  std::unique_ptr<Event> e = std::move(free_events_.back());
  free_events_.pop_back();
  return e;
}

// An accumulating or converting piece: on the device (gpu home), from device memory through the
// staging buffer (cpu or nvme home, asynchronous), or from host memory in the caller. An nvme home
// assembles in its pool buffer (read from NVMe first when accumulating or written partially
// before, else zeroed). Queues the piece(s).
void Filler::combine_piece(Buf& b, std::size_t k, std::uint64_t offset, std::uint64_t bytes,
                           const void* src, Tier src_memory) {
  const std::size_t es = dtype_size(buffer_dtype_);
  if (offset % es || bytes % es)
    fail(ErrorCode::kInvalidArgument,
         strcat("filler: piece [", offset, ", ", offset + bytes, ") is not whole ",
                dtype_name(buffer_dtype_), " elements"));
  if (b.home == Tier::kGpu && src_memory != Tier::kGpu)
    fail(ErrorCode::kInvalidArgument,
         "filler: adding or converting into device memory from host memory");
  if (b.home == Tier::kGpu && !on_device_)
    fail(ErrorCode::kInvalidArgument,
         "filler: adding or converting into device memory needs a DeviceOp");
  const std::size_t n = bytes / es;
  const bool first = mode_ == Mode::kReplace && !b.touched;  // the rest becomes zero
  b.filled += bytes;
  b.touched = true;
  if (b.nvme() && b.staged < 0) stage(k);
  if (first && !b.nvme()) zero_around(b, offset, bytes);
  if (!stream_ && src_memory == Tier::kGpu) stream_ = store_.device().create_stream();
  if (b.home == Tier::kGpu)
    combine_on_device(b, k, offset, n, src);
  else if (src_memory == Tier::kGpu)
    combine_from_device(b, k, offset, n, src);
  else
    combine_from_host(b, k, offset, n, src);
  if (!b.nvme()) return;
  Staged& s = staged_[static_cast<std::size_t>(b.staged)];
  if (b.filled == b.bytes) s.full = true;
  if (s.full && s.copies == 0) write_staged(static_cast<std::size_t>(b.staged), false);
}

// A converting (replacing) round's first piece of a memory home: the rest of the buffer becomes
// zero, as a replacing copy does (a gpu home whole, in the store's order, before the piece's op;
// in host memory all but the piece's own bytes, which it writes: a first piece that covers the
// buffer costs no pass over it).
void Filler::zero_around(const Buf& b, std::uint64_t offset, std::uint64_t bytes) {
  if (b.home == Tier::kGpu) {
    store_.zero(b.id).wait(timeout_);
    return;
  }
  auto* base = static_cast<unsigned char*>(store_.acquire(b.id, b.home, Access::kWrite, timeout_));
  std::memset(base, 0, offset);
  std::memset(base + offset + bytes, 0, b.bytes - offset - bytes);
  store_.release(b.id, b.home, Access::kWrite);
}

// Into a gpu home on the filler's stream; the copy stays acquired until the piece completes.
void Filler::combine_on_device(Buf& b, std::size_t k, std::uint64_t offset, std::size_t n,
                               const void* src) {
  Piece p;
  p.k = k;
  auto* base =
      static_cast<unsigned char*>(store_.acquire(b.id, Tier::kGpu, Access::kWrite, timeout_));
  p.pinned = Tier::kGpu;
  try {
    on_device_(*stream_, base + offset, src, n, mode_ == Mode::kAccumulate);
    p.event = take_event();
    stream_->record(*p.event);
  } catch (...) {
    release_piece(p, false);
    throw;
  }
  queue(std::move(p));
}

// From device memory into host memory (cpu or nvme home): each part (at most the staging buffer)
// is copied into the staging buffer and added or converted by a host function behind it on the
// filler's stream (the stream's order keeps the next copy out until it has run).
void Filler::combine_from_device(Buf& b, std::size_t k, std::uint64_t offset, std::size_t n,
                                 const void* src) {
  const std::size_t pes = dtype_size(piece_dtype_), bes = dtype_size(buffer_dtype_);
  const std::size_t part = staging_bytes_ / pes;
  const bool add = mode_ == Mode::kAccumulate;
  const DType dd = buffer_dtype_, sd = piece_dtype_;
  unsigned char* stage = staging();
  for (std::size_t at = 0; at < n; at += part) {
    const std::size_t m = std::min(part, n - at);
    Piece p;
    p.k = k;
    p.staging = true;
    try {
      unsigned char* dst = host_target(b, offset + at * bes, p);
      stream_->memcpy_async(stage, static_cast<const unsigned char*>(src) + at * pes, m * pes);
      stream_->launch_host_func(
          [dst, dd, stage, sd, m, add] { accumulate_elems(dst, dd, stage, sd, m, add); });
      p.event = take_event();
      stream_->record(*p.event);
    } catch (...) {
      release_piece(p, false);
      throw;
    }
    if (b.nvme()) ++staged_[static_cast<std::size_t>(b.staged)].copies;
    queue(std::move(p));
  }
}

// Where a part at `offset` of buffer b lands in host memory: its pool buffer (nvme), or its host
// copy, acquired for the piece (cpu).
unsigned char* Filler::host_target(Buf& b, std::uint64_t offset, Piece& p) {
  if (b.nvme())
    return static_cast<unsigned char*>(staged_[static_cast<std::size_t>(b.staged)].buf.data()) +
           offset;
  auto* base =
      static_cast<unsigned char*>(store_.acquire(b.id, Tier::kCpu, Access::kWrite, timeout_));
  p.pinned = Tier::kCpu;
  return base + offset;
}

// From host memory, in the caller (complete when it returns).
void Filler::combine_from_host(Buf& b, std::size_t k, std::uint64_t offset, std::size_t n,
                               const void* src) {
  Piece p;
  p.k = k;
  p.done = true;
  const bool add = mode_ == Mode::kAccumulate;
  unsigned char* dst = host_target(b, offset, p);
  accumulate_elems(dst, buffer_dtype_, src, piece_dtype_, n, add);
  release_piece(p, false);
  queue(std::move(p));
}

unsigned char* Filler::staging() {
  if (!staging_) {
    staging_ = IoBuffer::allocate(staging_bytes_);
    lock_staging();
  }
  return staging_.bytes();
}

// Within the store's pinned budget: reserved, then registered (given back when the device does not
// page-lock, as the host-emulated one). Without room it stays pageable: the copies stay correct
// (on a GPU cudaMemcpyAsync into pageable memory goes through the driver's own staging, slower).
void Filler::lock_staging() {
  const std::size_t bytes = staging_.size();
  if (!store_.try_reserve_pinned(bytes)) {
    if (store_.device().kind() != DeviceKind::kHost)
      log_warn("filler: the gradient share staging buffer (", bytes,
               " bytes) does not fit in tiers.host.pinned_budget; it stays pageable (slower "
               "device copies; strata plan counts it with the pinned pool)");
    return;
  }
  try {
    staging_locked_ = store_.device().register_host(staging_.data(), bytes);
  } catch (...) {
    store_.unreserve_pinned(bytes);
    throw;
  }
  if (!staging_locked_) store_.unreserve_pinned(bytes);
}

namespace {
// Staging memory a copy may still write after a timeout: never unmapped (reachable, not a leak).
void keep_for_ever(IoBuffer mem) {
  static std::mutex mutex;
  static auto* kept = new std::vector<IoBuffer>;
  const std::lock_guard<std::mutex> lock(mutex);
  kept->push_back(std::move(mem));
}
}  // namespace

// A copy into the staging buffer did not finish: its memory is kept for ever (still page-locked:
// unregistering memory a copy may still touch is not safe either; its pinned reservation is kept
// too); the next piece makes another.
void Filler::abandon_staging() noexcept {
  if (!staging_) return;
  log_error("filler: a copy into the staging buffer did not finish; its memory is not reused");
  try {
    keep_for_ever(std::move(staging_));
  } catch (...) {
  }
  staging_ = IoBuffer();
  staging_locked_ = false;
}

// Gives back the copy a piece acquired (not when `stuck`: a host function may still write it).
void Filler::release_piece(Piece& p, bool stuck) noexcept {
  if (stuck) return;
  if (p.pinned == Tier::kNvme) return;
  try {
    store_.release(bufs_[p.k].id, p.pinned, Access::kWrite);  // (every piece's acquire writes)
  } catch (const std::exception& e) {
    log_error("filler: releasing buffer ", p.k, ": ", e.what());
  }
  p.pinned = Tier::kNvme;
}

bool Filler::finish(Piece& p, bool block) {
  if (p.done) return true;
  if (p.event) {
    if (block) {
      p.event->synchronize(timeout_);
    } else if (!p.event->query()) {
      return false;
    }
  } else {
    if (!block && !(p.zero.ready() && p.write.ready())) return false;
    p.zero.wait(timeout_);
    p.write.wait(timeout_);
  }
  completed(p);
  return true;
}

// A piece finished: its source may be reused; a staged buffer whose last copy it was and that has
// all its bytes is written.
void Filler::completed(Piece& p) {
  p.done = true;
  release_piece(p, false);
  if (!p.event) return;
  free_events_.push_back(std::move(p.event));
  Buf& b = bufs_[p.k];
  if (b.staged < 0) return;  // cannot happen: a staged buffer waits for its copies
  Staged& s = staged_[static_cast<std::size_t>(b.staged)];
  if (--s.copies == 0 && s.full) write_staged(static_cast<std::size_t>(b.staged), false);
}

void Filler::collect() {
  for (Piece& p : pieces_) {
    try {
      finish(p, false);
    } catch (const std::exception& e) {
      failed(e, p.k, "copying into");
    }
  }
  while (!pieces_.empty() && pieces_.front().done) {
    done_through_ = pieces_.front().ticket;
    pieces_.pop_front();
  }
  if (pieces_.empty()) done_through_ = next_ticket_ - 1;
  while (!writing_.empty() && writing_.front().t.ready()) {
    const std::size_t k = writing_.front().k;
    try {
      retire_oldest_write();
    } catch (const std::exception& e) {
      failed(e, k, "writing");
    }
  }
}

void Filler::wait_copies(std::size_t k) {
  for (Piece& p : pieces_) {
    if (p.k != k || p.done) continue;
    try {
      finish(p, true);
    } catch (const std::exception& e) {
      failed(e, p.k, "copying into");
    }
  }
}

bool Filler::done(Ticket t) {
  if (!active_) return t <= done_through_;
  collect();
  return t <= done_through_;
}

void Filler::wait(Ticket t) {
  for (Piece& p : pieces_) {
    if (p.ticket > t) break;
    if (p.done) continue;
    try {
      finish(p, true);
    } catch (const std::exception& e) {
      failed(e, p.k, "copying into");
    }
  }
  if (active_) collect();
}

void Filler::end() {
  if (!active_) fail(ErrorCode::kInvalidArgument, "filler: end() without begin()");
  wait(next_ticket_ - 1);
  std::size_t k = 0;
  try {
    while (!staged_.empty()) {
      k = staged_.front().k;
      write_staged(0, false);
    }
    std::vector<std::pair<Transfer, std::size_t>> zeros;
    for (k = 0; k < bufs_.size() && mode_ == Mode::kReplace; ++k)
      if (!bufs_[k].touched) zeros.emplace_back(store_.zero(bufs_[k].id), k);
    for (auto& [t, i] : zeros) {
      k = i;
      t.wait(timeout_);
    }
    while (!writing_.empty()) {
      k = writing_.front().k;
      retire_oldest_write();
    }
  } catch (const std::exception& e) {
    failed(e, k, "finishing");
  }
  active_ = false;
}

void Filler::drain() noexcept {
  bool stuck = false;  // a copy or write may still touch memory: its pool buffer is not reused
  auto note = [&](const Error& e) {
    if (e.code() == ErrorCode::kTimeout) stuck = true;
  };
  first_error_ = nullptr;
  for (Piece& p : pieces_) {
    if (p.done) continue;
    try {
      if (p.event) {
        p.event->synchronize(timeout_);
      } else {
        p.zero.wait(timeout_);
        p.write.wait(timeout_);
      }
    } catch (const Error& e) {
      note(e);
      if (!first_error_) {
        first_error_ = std::current_exception();
        first_error_k_ = p.k;
      }
    } catch (...) {
    }
  }
  done_through_ = next_ticket_ - 1;
  for (auto& w : writing_) {
    try {
      w.t.wait(timeout_);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kTimeout) {
        log_error("filler: a write of buffer ", w.k,
                  " did not finish; its pool buffer is not reused");
        w.buf.detach();
      }
    } catch (...) {
    }
  }
  writing_.clear();
  if (stream_) {
    try {
      stream_->synchronize(timeout_);
    } catch (const Error& e) {
      note(e);
      if (e.code() != ErrorCode::kTimeout) {
        stream_.reset();  // a failed stream stays failed: the next round gets a new one
        free_events_.clear();
      }
    } catch (...) {
    }
  }
  // What unfinished pieces hold, once nothing runs on the stream; after a timeout a copy or host
  // function may still touch it: the acquires stay, the staging buffer is abandoned.
  bool staging_used = false;
  for (Piece& p : pieces_) {
    if (p.done) continue;
    staging_used = staging_used || p.staging;
    release_piece(p, stuck);
  }
  pieces_.clear();
  if (stuck && staging_used) abandon_staging();
  if (stuck) {
    log_error("filler: a device copy did not finish; its pool buffers are not reused");
    for (Staged& s : staged_) s.buf.detach();
  }
  staged_.clear();
  active_ = false;
}

std::exception_ptr Filler::abandon_for_cause() noexcept {
  drain();
  std::exception_ptr cause = std::exchange(first_error_, nullptr);
  if (!cause) return nullptr;
  try {
    try {
      std::rethrow_exception(cause);
    } catch (const std::exception& c) {
      name_and_throw(c, first_error_k_, "copying into");
    }
  } catch (...) {
    return std::current_exception();
  }
  return cause;
}

void Filler::failed(const std::exception& e, std::size_t k, const char* doing) {
  drain();
  // The first piece that failed is the cause; what the caller saw may be its consequence (the
  // store refusing work once a failed copy left a buffer without contents).
  if (first_error_) {
    std::exception_ptr cause = std::exchange(first_error_, nullptr);
    try {
      std::rethrow_exception(cause);
    } catch (const std::exception& c) {
      if (&c != &e) name_and_throw(c, first_error_k_, "copying into");
    }
  }
  name_and_throw(e, k, doing);
}

void Filler::name_and_throw(const std::exception& e, std::size_t k, const char* doing) {
  std::string name = "?";
  try {
    if (k < bufs_.size()) name = store_.info(bufs_[k].id).name;
  } catch (...) {
  }
  const std::string where = strcat("filler ", doing, " buffer '", name, "'");
  if (const auto* io = dynamic_cast<const IoError*>(&e)) throw io->with_context(where);
  if (const auto* er = dynamic_cast<const Error*>(&e))
    throw Error(er->code(), strcat(er->what(), "; ", where));
  throw Error(ErrorCode::kInternal, strcat(e.what(), "; ", where));
}

}  // namespace strata::tier
