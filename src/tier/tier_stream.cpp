// The tier store's streaming operations: read() / write() / zero() of a buffer's contents against
// the caller's memory (host or device), run on a mover thread in the buffer's order (see
// tier_store.hpp, "Streaming").
#include <cstring>
#include <exception>
#include <vector>

#include "strata/error.hpp"
#include "strata/log.hpp"
#include "tier/store_impl.hpp"

namespace strata {

namespace {
constexpr Tier kMemTiers[2] = {Tier::kGpu, Tier::kCpu};
void* copy_ptr(tier::Copy& c, Tier t) { return t == Tier::kGpu ? c.gpu.get() : c.host.data(); }
}  // namespace

void TierStore::Impl::keep_only_locked(Buf& b, Tier only, bool zeros) {
  for (Tier u : kMemTiers)
    if (u != only) drop_locked(b, u);
  if (only == Tier::kNvme)
    reserve_locked(b, Tier::kNvme);
  else
    b.copy[ti(Tier::kNvme)].valid = false;
  b.copy[ti(only)].valid = true;
  b.nvme_zero = zeros;
}

void* TierStore::Impl::copy_address(Buf& b, Tier t) {
  MutexLock lock(mutex_);
  return copy_ptr(b.copy[ti(t)], t);
}

tier::Staging TierStore::Impl::take_staging() {
  if (pool_) {
    PinnedBuffer p = pool_->try_acquire();
    if (p) return tier::Staging(std::move(p));
  }
  const std::uint64_t bytes = piece_size();
  {
    MutexLock lock(mutex_);
    if (used_[ti(Tier::kCpu)] + bytes > options_.host_budget)
      fail(ErrorCode::kBudget,
           strcat("tier store: a staging buffer of ", bytes,
                  " bytes does not fit in the host tier (", used_[ti(Tier::kCpu)], " of ",
                  options_.host_budget, " bytes in use) and every pool buffer is taken"));
    used_[ti(Tier::kCpu)] += bytes;
  }
  return tier::Staging(IoBuffer::allocate(bytes, HugePageMode::kNone), [this, bytes] {
    MutexLock lock(mutex_);
    used_[ti(Tier::kCpu)] -= bytes;
  });
}

void TierStore::Impl::copy_memory(void* dst, const void* src, std::size_t bytes, Tier dst_mem,
                                  Tier src_mem, WorkerContext& ctx, bool* unsafe) {
  if (bytes == 0) return;
  if (dst_mem == Tier::kCpu && src_mem == Tier::kCpu) {
    std::memcpy(dst, src, bytes);
    return;
  }
  copy_device(dst, src, bytes, ctx, unsafe);
}

// Bytes [lo, hi) of `b`'s NVMe slot at `slot` (inside one piece) through a staging buffer: only
// the check units they touch are read, each verified against `crc` (none when it is empty), then
// the bytes are copied to `dst` in `memory`. Returns the bytes read. `what` names the slot in
// messages ("buffer", "the pinned version (snapshot N) of buffer").
std::uint64_t TierStore::Impl::read_staged(Buf& b, const std::vector<std::uint32_t>& crc,
                                           std::uint64_t slot, std::uint64_t lo, std::uint64_t hi,
                                           std::uint8_t* dst, Tier memory, WorkerContext& ctx,
                                           bool* unsafe, const std::string& what) {
  const auto [ulo, uhi] = unit_span(b, lo, hi);
  tier::Staging pb = take_staging();
  const IoTicket t =
      engine_->submit(IoRequest{IoOp::kRead, swap_->file(), pb.data(), uhi - ulo, slot + ulo});
  if (!engine_->wait(t, options_.timeout)) {
    pb.detach();  // the kernel may still write into it
    *unsafe = true;
    fail(ErrorCode::kTimeout, strcat("tier store: NVMe read of ", what, " '", b.spec.name,
                                     "' not complete after ", options_.timeout.count(), " ms"));
  }
  verify_units(b, crc, slot, ulo, pb.data(), uhi - ulo, what);
  copy_memory(dst, pb.bytes() + (lo - ulo), hi - lo, memory, Tier::kCpu, ctx, unsafe);
  return uhi - ulo;
}

// A device destination takes the GPU ⇄ NVMe piece pipeline (stream-ordered copies, one wait at
// the end). Host: pieces wholly inside the range whose destination is 4096-aligned are read
// straight into it (all in flight at once); the others (the range's edges, the padded last piece)
// go through a pool buffer, one at a time. Every piece's CRC is checked.
void TierStore::Impl::read_nvme_range(Buf& b, std::uint64_t offset, std::uint64_t bytes, void* dst,
                                      Tier memory, WorkerContext& ctx, bool* unsafe) {
  const std::uint64_t base = b.copy[ti(Tier::kNvme)].extent.offset;
  const std::uint64_t piece = piece_size();
  const std::uint64_t first = offset / piece, last = (offset + bytes - 1) / piece;
  if (memory == Tier::kGpu) {
    read_nvme_to_gpu(b, offset, bytes, static_cast<std::uint8_t*>(dst), ctx, unsafe);
    MutexLock lock(mutex_);
    stats_.bytes_from_nvme += (last - first + 1) * piece;
    return;
  }
  auto* out = static_cast<std::uint8_t*>(dst);
  struct Direct {
    std::uint64_t p, len;
    IoTicket t;
  };
  std::vector<Direct> direct;
  std::uint64_t read_bytes = 0;
  std::exception_ptr error;
  auto settle = [&] {  // waits for every direct read (also after an error)
    for (Direct& d : direct) {
      try {
        if (!engine_->wait(d.t, options_.timeout)) {
          *unsafe = true;
          fail(ErrorCode::kTimeout,
               strcat("tier store: NVMe read of buffer '", b.spec.name, "' not complete after ",
                      options_.timeout.count(), " ms"));
        }
        if (!error)
          verify_piece(b, static_cast<std::size_t>(d.p), out + (d.p * piece - offset), d.len);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    direct.clear();
  };
  try {
    for (std::uint64_t p = first; p <= last; ++p) {
      const std::uint64_t off = p * piece;
      const std::uint64_t len = std::min<std::uint64_t>(piece, b.padded - off);
      const bool inside = off >= offset && off + len <= offset + bytes;
      if (memory == Tier::kCpu && inside &&
          reinterpret_cast<std::uintptr_t>(out + (off - offset)) % 4096 == 0) {
        direct.push_back({p, len,
                          engine_->submit(IoRequest{IoOp::kRead, swap_->file(),
                                                    out + (off - offset), len, base + off})});
        read_bytes += len;
        continue;
      }
      const std::uint64_t lo = std::max(offset, off), hi = std::min(offset + bytes, off + len);
      read_bytes +=
          read_staged(b, b.crc, base, lo, hi, out + (lo - offset), memory, ctx, unsafe, "buffer");
    }
  } catch (...) {
    error = std::current_exception();
  }
  settle();
  if (error) std::rethrow_exception(error);
  MutexLock lock(mutex_);
  stats_.bytes_from_nvme += read_bytes;
}

void TierStore::Impl::stream_read(Job& job, WorkerContext& ctx) {
  Buf& b = *job.buf;
  Tier src = Tier::kNvme;
  bool found = false;
  const void* from = nullptr;
  bool zero = false;
  {
    MutexLock lock(mutex_);
    const Tier order[3] = {job.tier == Tier::kGpu ? Tier::kGpu : Tier::kCpu,
                           job.tier == Tier::kGpu ? Tier::kCpu : Tier::kGpu, Tier::kNvme};
    for (Tier t : order) {
      if (b.copy[ti(t)].valid) {
        src = t;
        found = true;
        break;
      }
    }
    if (!found)
      fail(ErrorCode::kInternal,
           strcat("tier store: buffer '", b.spec.name, "' has no valid copy"));
    if (src != Tier::kNvme) from = copy_ptr(b.copy[ti(src)], src);
    zero = src == Tier::kNvme && b.nvme_zero;
  }
  bool unsafe = false;
  auto* dst = static_cast<std::uint8_t*>(job.ptr);
  const bool whole = job.offset == 0 && job.bytes == b.spec.bytes;
  if (src != Tier::kNvme) {
    copy_memory(dst, static_cast<const std::uint8_t*>(from) + job.offset, job.bytes, job.tier, src,
                ctx, &unsafe);
    if (src == Tier::kGpu && job.tier == Tier::kCpu) {
      MutexLock lock(mutex_);
      stats_.bytes_from_gpu += job.bytes;
    }
  } else if (zero) {
    if (job.tier == Tier::kCpu) {
      std::memset(dst, 0, job.bytes);
    } else {
      ctx.stream->memset_async(dst, 0, job.bytes);
      ctx.stream->synchronize(options_.timeout);
    }
  } else if (whole && job.padded && job.tier == Tier::kCpu &&
             reinterpret_cast<std::uintptr_t>(dst) % 4096 == 0) {
    copy_nvme_to_host(b, dst, &unsafe);  // the caller's memory has room for the padding
  } else if (whole && job.tier == Tier::kGpu && pool_) {
    copy_nvme_to_gpu(b, dst, ctx, &unsafe);
  } else {
    read_nvme_range(b, job.offset, job.bytes, dst, job.tier, ctx, &unsafe);
  }
  MutexLock lock(mutex_);
  ++stats_.reads;
}

// REQUIRES: mutex_ held. A streamed write or zero replaces the buffer's contents at its home:
// refused (kInvalidArgument) while a copy on another memory tier is acquired.
void TierStore::Impl::require_unpinned_away_locked(const Buf& b, const char* verb) const {
  for (Tier u : kMemTiers) {
    if (u != b.spec.home && b.copy[ti(u)].pins) {
      fail(ErrorCode::kInvalidArgument, strcat("tier store: cannot ", verb, " buffer '",
                                               b.spec.name, "': it is acquired on ", where(b)));
    }
  }
}

void TierStore::Impl::stream_write(Job& job, WorkerContext& ctx) {
  Buf& b = *job.buf;
  const Tier home = b.spec.home;
  const bool whole = job.offset == 0 && job.bytes == b.spec.bytes;
  bool need_load = false;
  {
    MutexLock lock(mutex_);
    require_unpinned_away_locked(b, "write");
    need_load = home != Tier::kNvme && !b.copy[ti(home)].valid && !whole;
  }
  if (need_load) ensure_valid(b, home, ctx);  // before the copy-on-write: it may need the slot
  preserve_pinned(b, ctx);
  {
    MutexLock lock(mutex_);
    if (home == Tier::kNvme) {
      // The other copies are stale from here on; the write makes the NVMe copy the only one.
      keep_only_locked(b, Tier::kNvme);
      b.copy[ti(Tier::kNvme)].valid = false;  // until the write lands
    }
  }
  bool unsafe = false;
  if (home == Tier::kNvme) {
    if (job.tier == Tier::kCpu) {
      copy_host_to_nvme(b, static_cast<const std::uint8_t*>(job.ptr), &unsafe);
    } else {
      copy_gpu_to_nvme(b, static_cast<const std::uint8_t*>(job.ptr), ctx, &unsafe);
    }
    MutexLock lock(mutex_);
    b.copy[ti(Tier::kNvme)].valid = true;
    ++stats_.writes;
    return;
  }
  if (!need_load) ensure_storage(b, home);
  void* base = copy_address(b, home);
  try {
    copy_memory(static_cast<std::uint8_t*>(base) + job.offset, job.ptr, job.bytes, home, job.tier,
                ctx, &unsafe);
  } catch (...) {
    MutexLock lock(mutex_);
    // The home copy holds a partial write: not the contents any more.
    b.copy[ti(home)].valid = false;
    if (unsafe) {
      log_error("tier store: a copy into buffer '", b.spec.name,
                "' did not finish; its memory is kept");
      if (home == Tier::kCpu && !b.copy[ti(home)].pins) quarantine_host_locked(b);
      if (home == Tier::kGpu && !b.copy[ti(home)].pins)
        b.gpu_quarantine.push_back(std::move(b.copy[ti(home)].gpu));
    }
    throw;
  }
  MutexLock lock(mutex_);
  keep_only_locked(b, home);
  ++stats_.writes;
  if (home == Tier::kGpu && job.tier == Tier::kCpu) stats_.bytes_to_gpu += job.bytes;
}

void TierStore::Impl::stream_zero(Buf& b, WorkerContext& ctx) {
  const Tier home = b.spec.home;
  {
    MutexLock lock(mutex_);
    require_unpinned_away_locked(b, "zero");
    if (home == Tier::kNvme) {
      keep_only_locked(b, Tier::kNvme, /*zeros=*/true);
      return;
    }
  }
  ensure_storage(b, home);
  void* base = copy_address(b, home);
  if (home == Tier::kCpu) {
    std::memset(base, 0, b.padded);
  } else {
    ctx.stream->memset_async(base, 0, b.padded);
    ctx.stream->synchronize(options_.timeout);
  }
  MutexLock lock(mutex_);
  keep_only_locked(b, home);
}

}  // namespace strata
