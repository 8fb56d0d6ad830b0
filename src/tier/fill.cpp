// Filling buffers from pieces in any order (see fill.hpp).
#include "tier/fill.hpp"

#include <algorithm>
#include <cstring>

#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::tier {

Filler::Filler(TierStore& store, std::vector<BufferId> buffers, std::chrono::milliseconds timeout)
    : store_(store), timeout_(timeout) {
  for (BufferId id : buffers) {
    const BufferInfo info = store_.info(id);
    Buf b;
    b.id = id;
    b.bytes = info.bytes;
    b.padded = store_.padded_bytes(id);
    b.nvme = info.home == Tier::kNvme;
    if (b.nvme && (!store_.pool() || store_.pool()->buffer_size() < b.padded))
      fail(ErrorCode::kInvalidArgument,
           strcat("filler: buffer '", info.name, "' (", b.padded,
                  " bytes, on nvme) does not fit a pinned pool buffer (",
                  store_.pool() ? store_.pool()->buffer_size() : 0, " bytes)"));
    bufs_.push_back(b);
  }
}

Filler::~Filler() { drain(); }

void Filler::begin() {
  drain();
  staged_.clear();
  for (Buf& b : bufs_) {
    b.filled = 0;
    b.touched = false;
    b.on_disk = false;
    b.staged = -1;
  }
  active_ = true;
}

void Filler::copy_in(void* dst, const void* src, std::uint64_t bytes, Tier src_memory) {
  if (src_memory == Tier::kCpu) {
    std::memcpy(dst, src, bytes);
    return;
  }
  if (!stream_) stream_ = store_.device().create_stream();
  stream_->memcpy_async(dst, src, bytes);
  stream_->synchronize(timeout_);
}

PinnedBuffer Filler::take_buffer() {
  PinnedPool& pool = *store_.pool();
  while (true) {
    PinnedBuffer b = pool.try_acquire();
    if (b) return b;
    if (!writing_.empty()) {
      retire_oldest_write();
      continue;
    }
    if (!staged_.empty()) {  // every buffer holds a partial chunk: write the oldest as it is
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
  if (b.on_disk) {
    store_.read(b.id, 0, 0, st.buf.data(), Tier::kCpu, true).wait(timeout_);
  } else {
    std::memset(st.buf.data(), 0, b.padded);
  }
  staged_.push_back(std::move(st));
  b.staged = static_cast<int>(staged_.size() - 1);
}

void Filler::fill(std::size_t k, std::uint64_t offset, std::uint64_t bytes, const void* src,
                  Tier src_memory) {
  if (!active_) fail(ErrorCode::kInvalidArgument, "filler: fill() outside begin()/end()");
  if (k >= bufs_.size()) fail(ErrorCode::kInvalidArgument, strcat("filler: no buffer ", k));
  Buf& b = bufs_[k];
  if (offset + bytes > b.bytes || b.filled + bytes > b.bytes)
    fail(ErrorCode::kInvalidArgument,
         strcat("filler: piece [", offset, ", ", offset + bytes, ") of buffer ", k, " beyond its ",
                b.bytes, " bytes or filled twice"));
  if (bytes == 0) return;
  try {
    if (!b.nvme) {
      if (!b.touched) {
        Transfer z = store_.zero(b.id);
        Transfer w = store_.write(b.id, offset, bytes, src, src_memory);
        z.wait(timeout_);
        w.wait(timeout_);
      } else {
        store_.write(b.id, offset, bytes, src, src_memory).wait(timeout_);
      }
      b.touched = true;
      b.filled += bytes;
      return;
    }
    if (b.staged < 0) stage(k);
    b.touched = true;
    copy_in(static_cast<unsigned char*>(staged_[static_cast<std::size_t>(b.staged)].buf.data()) +
                offset,
            src, bytes, src_memory);
    b.filled += bytes;
    if (b.filled == b.bytes) write_staged(static_cast<std::size_t>(b.staged), false);
    while (!writing_.empty() && writing_.front().t.ready()) retire_oldest_write();
  } catch (const std::exception& e) {
    failed(e, k, "filling");
  }
}

void Filler::end() {
  if (!active_) fail(ErrorCode::kInvalidArgument, "filler: end() without begin()");
  std::size_t k = 0;
  try {
    while (!staged_.empty()) {
      k = staged_.front().k;
      write_staged(0, false);
    }
    std::vector<std::pair<Transfer, std::size_t>> zeros;
    for (k = 0; k < bufs_.size(); ++k)
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
  staged_.clear();
  if (stream_) {
    try {
      stream_->synchronize(timeout_);
    } catch (...) {
    }
  }
  active_ = false;
}

void Filler::failed(const std::exception& e, std::size_t k, const char* doing) {
  drain();
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
