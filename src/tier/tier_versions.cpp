// The tier store's versioned state, the snapshot half (docs/versioned_state.md; the contract is in
// tier_store.hpp, "Versioned state"): pins of committed versions, copy-on-write before a change,
// reads of pinned versions, unpin.
#include <algorithm>
#include <cstring>

#include "core/crc32c.hpp"
#include "strata/error.hpp"
#include "tier/store_impl.hpp"

namespace strata {

using tier::Buf;
using tier::Job;
using tier::OpKind;
using tier::ti;
using tier::WorkerContext;

namespace {
constexpr Tier kTiers[3] = {Tier::kGpu, Tier::kCpu, Tier::kNvme};
}  // namespace

tier::SnapshotRec& TierStore::Impl::snapshot_locked(SnapshotId s) {
  auto it = snapshots_.find(s);
  if (it == snapshots_.end())
    fail(ErrorCode::kInvalidArgument, strcat("tier store: no snapshot ", s, " (unpinned?)"));
  return it->second;
}

bool TierStore::Impl::shares_committed(const Buf& b) {
  return std::any_of(b.versions.begin(), b.versions.end(),
                     [](const tier::VersionRef& r) { return !r.data; });
}

SnapshotId TierStore::Impl::pin_committed(std::span<const BufferId> ids) {
  UniqueLock lock(mutex_);
  if (stop_) fail(ErrorCode::kCancelled, "tier store: shutting down");
  if (!failure_.empty()) fail(ErrorCode::kIo, failure_);
  std::vector<Buf*> bufs;
  for (BufferId id : ids) {
    Buf& b = buf_locked(id);
    if (std::find(bufs.begin(), bufs.end(), &b) != bufs.end())
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: pin_committed: buffer '", b.spec.name, "' named twice"));
    bufs.push_back(&b);
  }
  const auto idle = [&]() REQUIRES(mutex_) {
    return std::all_of(bufs.begin(), bufs.end(), [](const Buf* b) { return b->queued == 0; });
  };
  if (!state_cv_.wait_for(lock, options_.timeout, idle))
    fail(ErrorCode::kTimeout, strcat("tier store: pin_committed: the blocks still have transfers "
                                     "after ",
                                     options_.timeout.count(), " ms"));
  for (const Buf* b : bufs) {
    for (Tier t : kTiers) {
      if (b->copy[ti(t)].write_pins)
        fail(ErrorCode::kInvalidArgument, strcat("tier store: cannot pin buffer '", b->spec.name,
                                                 "': it is acquired for "
                                                 "writing on ",
                                                 tier_name(t), "; release it first"));
    }
  }
  const SnapshotId s = next_snapshot_++;
  tier::SnapshotRec& rec = snapshots_[s];
  for (Buf* b : bufs) {
    b->versions.push_back({s, nullptr});
    rec.ids.push_back(b->id);
  }
  return s;
}

// ---- copy-on-write

void TierStore::Impl::adopt_version_locked(Buf& b, std::shared_ptr<tier::Version> v) {
  for (tier::VersionRef& r : b.versions)
    if (!r.data) r.data = v;
}

void TierStore::Impl::reserve_version_locked(const Buf& b, Tier t) {
  const std::uint64_t budget = t == Tier::kGpu ? options_.gpu_budget : options_.host_budget;
  if (t == Tier::kCpu && used_[ti(t)] + cached_ + b.padded > budget) {
    host_cache_.clear();  // cached mappings are the first to go
    cached_ = 0;
  }
  if (used_[ti(t)] + b.padded > budget)
    fail(ErrorCode::kBudget,
         strcat("tier store: keeping the pinned version of buffer '", b.spec.name, "' (snapshot ",
                b.versions.front().snap, ", ", b.padded,
                " bytes) before it is rewritten does not "
                "fit in the ",
                tier_name(t), " tier: ", used_[ti(t)], " of ", budget, " bytes in use (tiers.",
                t == Tier::kGpu ? "gpu" : "host",
                ".budget); nothing was changed: unpin the snapshot first"));
  used_[ti(t)] += b.padded;
  version_bytes_[ti(t)] += b.padded;
}

void TierStore::Impl::free_version_locked(const Buf& b, tier::Version& v) {
  if (v.where == Tier::kNvme) {
    if (v.extent.length) {
      version_bytes_[ti(Tier::kNvme)] -= v.extent.length;
      swap_->free(v.extent);
      v.extent = {};
    }
    return;
  }
  used_[ti(v.where)] -= b.padded;
  version_bytes_[ti(v.where)] -= b.padded;
  v.host = IoBuffer();
  v.gpu.reset();
}

// The block's valid NVMe copy becomes the pinned version (its slot, CRCs and zero flag); the block
// gets a new slot, invalid until written. The new slot is allocated first: a full swap space fails
// with nothing changed.
void TierStore::Impl::preserve_slot_locked(Buf& b) {
  tier::Copy& n = b.copy[ti(Tier::kNvme)];
  SwapExtent fresh =
      swap_->allocate(b.padded, strcat("a new version of buffer '", b.spec.name, "' (snapshot ",
                                       b.versions.front().snap, " pins the current one)"));
  auto v = std::make_shared<tier::Version>();
  v->where = Tier::kNvme;
  v->extent = n.extent;
  v->crc = std::move(b.crc);
  v->zero = b.nvme_zero;
  version_bytes_[ti(Tier::kNvme)] += v->extent.length;
  n.extent = fresh;
  n.valid = false;
  b.nvme_zero = false;
  b.crc.assign(options_.checksum ? pieces(b) : 0, 0);
  adopt_version_locked(b, std::move(v));
}

// The committed contents live only in memory (`src`, gpu or cpu): a staging copy in that tier.
void TierStore::Impl::preserve_copy(Buf& b, Tier src, WorkerContext& ctx) {
  const void* from = nullptr;
  {
    MutexLock lock(mutex_);
    reserve_version_locked(b, src);
    from = src == Tier::kGpu ? b.copy[ti(src)].gpu.get() : b.copy[ti(src)].host.data();
  }
  auto v = std::make_shared<tier::Version>();
  v->where = src;
  bool unsafe = false;
  try {
    if (src == Tier::kCpu) {
      v->host = IoBuffer::allocate(b.padded, HugePageMode::kTransparent);
      std::memcpy(v->host.data(), from, b.padded);
    } else {
      v->gpu = device_.allocate(b.padded);
      copy_device(v->gpu.get(), from, b.padded, ctx, &unsafe);
    }
  } catch (...) {
    MutexLock lock(mutex_);
    used_[ti(src)] -= b.padded;
    version_bytes_[ti(src)] -= b.padded;
    if (unsafe && v->gpu) b.gpu_quarantine.push_back(std::move(v->gpu));
    throw;
  }
  MutexLock lock(mutex_);
  adopt_version_locked(b, std::move(v));
}

void TierStore::Impl::preserve_pinned(Buf& b, WorkerContext& ctx) {
  Tier src = Tier::kCpu;
  {
    MutexLock lock(mutex_);
    if (!shares_committed(b)) return;
    if (b.copy[ti(Tier::kNvme)].valid) {
      preserve_slot_locked(b);
      return;
    }
    if (!b.copy[ti(Tier::kCpu)].valid) src = Tier::kGpu;
    if (!b.copy[ti(src)].valid)
      fail(ErrorCode::kInternal,
           strcat("tier store: buffer '", b.spec.name, "' has no valid copy"));
  }
  preserve_copy(b, src, ctx);
}

// ---- reads of pinned versions

Transfer TierStore::Impl::submit_read_pinned(SnapshotId s, BufferId id, std::uint64_t offset,
                                             std::uint64_t bytes, void* dst, Tier memory,
                                             bool padded) {
  auto state = std::make_shared<Transfer::State>();
  {
    MutexLock lock(mutex_);
    // (Allowed on a failed store: a pinned version predates the failure and is untouched by it.)
    if (stop_) fail(ErrorCode::kCancelled, "tier store: shutting down");
    Buf& b = buf_locked(id);
    tier::SnapshotRec& rec = snapshot_locked(s);
    if (std::none_of(b.versions.begin(), b.versions.end(),
                     [&](const tier::VersionRef& r) { return r.snap == s; }))
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: snapshot ", s, " does not pin buffer '", b.spec.name, "'"));
    if (bytes == 0 && offset <= b.spec.bytes) bytes = b.spec.bytes - offset;
    if (offset + bytes > b.spec.bytes || bytes == 0 || !dst || memory == Tier::kNvme)
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: read of bytes [", offset, ", ", offset + bytes,
                  ") of the pinned version of '", b.spec.name, "' (", b.spec.bytes, " bytes) into ",
                  dst ? tier_name(memory) : "a null pointer"));
    ++rec.reads;
    Job job{OpKind::kReadPinned, &b, memory, Access::kRead, state, offset, bytes, dst, padded, s};
    ++b.queued;
    queue_.push_back(std::move(job));
  }
  work_cv_.notify_one();
  return Transfer(state);
}

// Pieces of the version's slot through staging buffers, each CRC-checked against the version's.
void TierStore::Impl::read_version_nvme(Buf& b, const tier::Version& v, Job& job,
                                        WorkerContext& ctx) {
  const std::uint64_t piece = piece_size();
  const std::uint64_t first = job.offset / piece, last = (job.offset + job.bytes - 1) / piece;
  auto* out = static_cast<std::uint8_t*>(job.ptr);
  bool unsafe = false;
  for (std::uint64_t p = first; p <= last; ++p) {
    const std::uint64_t off = p * piece, len = std::min<std::uint64_t>(piece, b.padded - off);
    tier::Staging pb = take_staging();
    const IoTicket t = engine_->submit(
        IoRequest{IoOp::kRead, swap_->file(), pb.data(), len, v.extent.offset + off});
    if (!engine_->wait(t, options_.timeout)) {
      pb.detach();  // the kernel may still write into it
      fail(ErrorCode::kTimeout,
           strcat("tier store: NVMe read of the pinned version of '", b.spec.name,
                  "' not complete after ", options_.timeout.count(), " ms"));
    }
    const std::uint32_t got = v.crc.empty() ? 0 : crc32c(pb.data(), len);
    if (!v.crc.empty() && got != v.crc[p]) {
      const auto [path, file_off] = swap_->locate(v.extent.offset + off);
      {
        MutexLock lock(mutex_);
        ++stats_.checksum_failures;
      }
      fail(ErrorCode::kChecksum,
           strcat("checksum mismatch reading the pinned version of buffer '", b.spec.name,
                  "' (snapshot ", job.snap, ") from NVMe at buffer offset ", off, " (", len,
                  " bytes; swap file ", path, " offset ", file_off, ")"));
    }
    const std::uint64_t lo = std::max(job.offset, off);
    const std::uint64_t hi = std::min(job.offset + job.bytes, off + len);
    copy_memory(out + (lo - job.offset), pb.bytes() + (lo - off), hi - lo, job.tier, Tier::kCpu,
                ctx, &unsafe);
  }
}

void TierStore::Impl::run_read_pinned(Job& job, WorkerContext& ctx) {
  Buf& b = *job.buf;
  std::shared_ptr<tier::Version> v;
  {
    MutexLock lock(mutex_);
    auto it = std::find_if(b.versions.begin(), b.versions.end(),
                           [&](const tier::VersionRef& r) { return r.snap == job.snap; });
    if (it == b.versions.end())
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: snapshot ", job.snap, " no longer pins '", b.spec.name, "'"));
    v = it->data;
  }
  if (!v) {  // still the committed contents: an ordinary read, in the block's order
    stream_read(job, ctx);
    return;
  }
  bool unsafe = false;
  auto* dst = static_cast<std::uint8_t*>(job.ptr);
  if (v->where != Tier::kNvme) {
    const auto* base =
        static_cast<const std::uint8_t*>(v->where == Tier::kGpu ? v->gpu.get() : v->host.data());
    copy_memory(dst, base + job.offset, job.bytes, job.tier, v->where, ctx, &unsafe);
  } else if (v->zero) {
    if (job.tier == Tier::kCpu) {
      std::memset(dst, 0, job.bytes);
    } else {
      ctx.stream->memset_async(dst, 0, job.bytes);
      ctx.stream->synchronize(options_.timeout);
    }
  } else {
    read_version_nvme(b, *v, job, ctx);
  }
}

// ---- unpin and usage

void TierStore::Impl::unpin_one_locked(Buf& b, SnapshotId s) {
  auto it = std::find_if(b.versions.begin(), b.versions.end(),
                         [&](const tier::VersionRef& r) { return r.snap == s; });
  if (it == b.versions.end())
    fail(ErrorCode::kInvalidArgument,
         strcat("tier store: snapshot ", s, " does not pin buffer '", b.spec.name, "'"));
  if (it->data && it->data.use_count() == 1) free_version_locked(b, *it->data);
  b.versions.erase(it);
}

void TierStore::Impl::unpin(SnapshotId s, const BufferId* id) {
  UniqueLock lock(mutex_);
  snapshot_locked(s);
  if (!state_cv_.wait_for(lock, options_.timeout, [&]() REQUIRES(mutex_) {
        auto it = snapshots_.find(s);
        return it == snapshots_.end() || it->second.reads == 0;
      }))
    fail(ErrorCode::kTimeout, strcat("tier store: unpin: snapshot ", s, " still has reads after ",
                                     options_.timeout.count(), " ms"));
  tier::SnapshotRec& rec = snapshot_locked(s);
  if (id) {
    auto pos = std::find(rec.ids.begin(), rec.ids.end(), *id);
    if (pos == rec.ids.end())
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: snapshot ", s, " does not pin buffer ", *id));
    unpin_one_locked(buf_locked(*id), s);
    rec.ids.erase(pos);
    return;
  }
  for (BufferId b : rec.ids) unpin_one_locked(buf_locked(b), s);
  snapshots_.erase(s);
}

VersionUsage TierStore::Impl::version_usage() const {
  MutexLock lock(mutex_);
  VersionUsage u;
  for (Tier t : kTiers) u.held.bytes[ti(t)] = version_bytes_[ti(t)];
  u.snapshots = static_cast<std::uint32_t>(snapshots_.size());
  for (const auto& [s, rec] : snapshots_) {
    for (BufferId id : rec.ids) {
      const Buf& b = buf_locked(id);
      ++u.pinned_blocks;
      for (const tier::VersionRef& r : b.versions)
        if (r.snap == s && r.data) ++u.diverged_blocks;
    }
  }
  return u;
}

VersionBytes TierStore::Impl::rewrite_cost(SnapshotId s) const {
  MutexLock lock(mutex_);
  auto it = snapshots_.find(s);
  VersionBytes cost;
  if (it == snapshots_.end()) return cost;
  for (BufferId id : it->second.ids) {
    const Buf& b = buf_locked(id);
    if (std::none_of(b.versions.begin(), b.versions.end(),
                     [&](const tier::VersionRef& r) { return r.snap == s && !r.data; }))
      continue;
    const Tier where = b.copy[ti(Tier::kNvme)].valid  ? Tier::kNvme
                       : b.copy[ti(Tier::kCpu)].valid ? Tier::kCpu
                                                      : Tier::kGpu;
    cost.bytes[ti(where)] += b.padded;
  }
  return cost;
}

}  // namespace strata
