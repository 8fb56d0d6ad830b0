// The tier store's versioned state (docs/versioned_state.md; the contract is in tier_store.hpp,
// "Versioned state"): pins of committed versions, copy-on-write before a change, reads of pinned
// versions, unpin; pending versions, their writes, commit and discard.
#include <algorithm>
#include <cstring>
#include <utility>

#include "core/crc32c.hpp"
#include "strata/error.hpp"
#include "tier/store_impl.hpp"

namespace strata {

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

std::vector<Buf*> TierStore::Impl::distinct_locked(std::span<const BufferId> ids,
                                                   const char* what) {
  std::vector<Buf*> bufs;
  for (BufferId id : ids) {
    Buf& b = buf_locked(id);
    if (std::find(bufs.begin(), bufs.end(), &b) != bufs.end())
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: ", what, ": buffer '", b.spec.name, "' named twice"));
    bufs.push_back(&b);
  }
  return bufs;
}

void TierStore::Impl::wait_blocks_idle_locked(UniqueLock& lock, const std::vector<Buf*>& bufs,
                                              const char* what) {
  const auto idle = [&]() REQUIRES(mutex_) {
    return std::all_of(bufs.begin(), bufs.end(), [](const Buf* b) { return b->queued == 0; });
  };
  if (!state_cv_.wait_for(lock, options_.timeout, idle))
    fail(ErrorCode::kTimeout,
         strcat("tier store: ", what, ": the blocks still have transfers after ",
                options_.timeout.count(), " ms"));
}

SnapshotId TierStore::Impl::pin_committed(std::span<const BufferId> ids) {
  UniqueLock lock(mutex_);
  check_usable_locked();
  const std::vector<Buf*> bufs = distinct_locked(ids, "pin_committed");
  wait_blocks_idle_locked(lock, bufs, "pin_committed");
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
  const std::uint64_t budget = budget_of(t);
  if (!fits_locked(t, b.padded))
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
  release_memory_version_locked(b, v);
}

// The block's valid NVMe copy becomes the pinned version (its slot, CRCs and zero flag); the block
// gets a new slot, invalid until written. The new slot is allocated first: a full swap space fails
// with nothing changed.
void TierStore::Impl::preserve_slot_locked(Buf& b) {
  tier::Copy& n = b.copy[ti(Tier::kNvme)];
  SwapExtent fresh =
      swap_->allocate(b.padded, strcat("a new version of buffer '", b.spec.name, "' (snapshot ",
                                       b.versions.front().snap, " pins the current one)"));
  std::shared_ptr<tier::Version> v = nvme_version_locked(b);
  n.extent = fresh;
  n.valid = false;
  b.nvme_zero = false;
  b.crc.assign(options_.checksum ? crc_units(b) : 0, 0);
  adopt_version_locked(b, std::move(v));
}

// The committed NVMe copy of `b` as a version: its slot, its checksums (moved out of `b`), counted
// in the versions' NVMe bytes.
std::shared_ptr<tier::Version> TierStore::Impl::nvme_version_locked(Buf& b) {
  auto v = std::make_shared<tier::Version>();
  v->where = Tier::kNvme;
  v->extent = b.copy[ti(Tier::kNvme)].extent;
  v->crc = std::move(b.crc);
  v->zero = b.nvme_zero;
  version_bytes_[ti(Tier::kNvme)] += v->extent.length;
  return v;
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

// The check units of the version's slot that the range touches, piece by piece through staging
// buffers, each CRC-checked against the version's.
void TierStore::Impl::read_version_nvme(Buf& b, const tier::Version& v, Job& job,
                                        WorkerContext& ctx) {
  const std::uint64_t piece = piece_size();
  const std::uint64_t first = job.offset / piece, last = (job.offset + job.bytes - 1) / piece;
  auto* out = static_cast<std::uint8_t*>(job.ptr);
  const std::string what = strcat("the pinned version (snapshot ", job.snap, ") of buffer");
  bool unsafe = false;
  for (std::uint64_t p = first; p <= last; ++p) {
    const std::uint64_t off = p * piece, len = std::min<std::uint64_t>(piece, b.padded - off);
    const std::uint64_t lo = std::max(job.offset, off);
    const std::uint64_t hi = std::min(job.offset + job.bytes, off + len);
    read_staged(b, v.crc, v.extent.offset, lo, hi, out + (lo - job.offset), job.tier, ctx, &unsafe,
                what);
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
  for (Tier t : kTiers) u.pending.bytes[ti(t)] = pending_bytes_[ti(t)];
  for (Tier t : kTiers) u.spare.bytes[ti(t)] = spare_bytes_[ti(t)];
  u.pending_blocks = pending_blocks_;
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

// ---- pending versions

std::shared_ptr<tier::Version> TierStore::Impl::make_pending_locked(Buf& b) {
  const Tier t = b.spec.home;
  if (t != Tier::kNvme && b.spare) {  // the last one's storage, still counted in the tier's use
    spare_bytes_[ti(t)] -= b.padded;
    pending_bytes_[ti(t)] += b.padded;
    return std::exchange(b.spare, nullptr);
  }
  auto p = std::make_shared<tier::Version>();
  p->where = t;
  if (t == Tier::kNvme) {
    p->extent = swap_->allocate(b.padded, strcat("the pending version of buffer '", b.spec.name,
                                                 "' (optimizer.speculation_budget)"));
    p->crc.assign(options_.checksum ? crc_units(b) : 0, 0);
    pending_bytes_[ti(t)] += p->extent.length;
    return p;
  }
  const std::uint64_t budget = budget_of(t);
  if (!fits_locked(t, b.padded))
    fail(ErrorCode::kBudget,
         strcat("tier store: a pending version of buffer '", b.spec.name, "' (", b.padded,
                " bytes) does not fit in the ", tier_name(t), " tier: ", used_[ti(t)], " of ",
                budget, " bytes in use (tiers.", t == Tier::kGpu ? "gpu" : "host",
                ".budget); nothing was opened"));
  if (t == Tier::kCpu) {
    p->host = IoBuffer::allocate(b.padded, HugePageMode::kTransparent);
    lock_version_locked(b, *p);  // once: the spare keeps its lock
  } else {
    p->gpu = device_.allocate(b.padded);
  }
  used_[ti(t)] += b.padded;
  pending_bytes_[ti(t)] += b.padded;
  return p;
}

void TierStore::Impl::lock_version_locked(const Buf& b, tier::Version& v) {
  if (!b.spec.pinned || v.where != Tier::kCpu) return;
  const std::string what = strcat("a pending version of buffer '", b.spec.name, "'");
  reserve_pinned_locked(b, what);
  try {
    v.locked_by_device = lock_pages(b, v.host, what);
  } catch (...) {
    pinned_used_ -= b.padded;
    throw;
  }
  v.locked = true;
}

void TierStore::Impl::release_memory_version_locked(const Buf& b, tier::Version& v) {
  if (v.host && v.locked) unlock_host_locked(b, v.host, v.locked_by_device);
  v.locked = v.locked_by_device = false;
  v.host = IoBuffer();
  v.gpu.reset();
}

void TierStore::Impl::drop_spare_locked(Buf& b) {
  if (!b.spare) return;
  const Tier t = b.spare->where;
  release_memory_version_locked(b, *b.spare);
  used_[ti(t)] -= b.padded;
  spare_bytes_[ti(t)] -= b.padded;
  b.spare.reset();
}

// The pending version goes; a memory home's buffer stays as the block's spare, unless a device
// copy may still touch it.
void TierStore::Impl::free_pending_locked(Buf& b) {
  tier::Version& p = *b.pending;
  if (p.where == Tier::kNvme) {
    if (p.extent.length) {
      pending_bytes_[ti(Tier::kNvme)] -= p.extent.length;
      if (!p.unsafe) swap_->free(p.extent);  // else a late write may still land in it: kept
    }
  } else {
    pending_bytes_[ti(p.where)] -= b.padded;
    if (p.unsafe) {  // a device copy may still touch it: kept (and counted) until shutdown
      if (p.host) b.quarantine.push_back({std::move(p.host), p.locked, p.locked_by_device});
      if (p.gpu) b.gpu_quarantine.push_back(std::move(p.gpu));
    } else {
      drop_spare_locked(b);  // none, unless a commit swapped one in since
      p.written.clear();
      p.failed = false;
      spare_bytes_[ti(p.where)] += b.padded;
      b.spare = b.pending;
    }
  }
  --pending_blocks_;
  b.pending.reset();
}

void TierStore::Impl::open_pending(std::span<const BufferId> ids) {
  MutexLock lock(mutex_);
  check_usable_locked();
  const std::vector<Buf*> bufs = distinct_locked(ids, "open_pending");
  for (const Buf* b : bufs)
    if (b->pending)
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: buffer '", b->spec.name, "' already has a pending version"));
  std::vector<Buf*> opened;
  try {
    for (Buf* b : bufs) {
      b->pending = make_pending_locked(*b);
      ++pending_blocks_;
      opened.push_back(b);
    }
  } catch (...) {
    for (Buf* b : opened) free_pending_locked(*b);
    throw;
  }
}

bool TierStore::Impl::has_pending(BufferId id) const {
  MutexLock lock(mutex_);
  return buf_locked(id).pending != nullptr;
}

void* TierStore::Impl::pending_view(BufferId id) {
  MutexLock lock(mutex_);
  check_usable_locked();
  Buf& b = buf_locked(id);
  if (!b.pending || b.pending->where == Tier::kNvme)
    fail(ErrorCode::kInvalidArgument,
         strcat("tier store: pending_view: buffer '", b.spec.name, "' ",
                b.pending ? "lives on nvme (its pending version is a swap slot)"
                          : "has no pending version"));
  return b.pending->where == Tier::kGpu ? b.pending->gpu.get() : b.pending->host.data();
}

Transfer TierStore::Impl::submit_write_pending(BufferId id, std::uint64_t offset,
                                               std::uint64_t bytes, const void* src, Tier memory) {
  auto state = std::make_shared<Transfer::State>();
  {
    MutexLock lock(mutex_);
    check_usable_locked();
    Buf& b = buf_locked(id);
    if (!b.pending)
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: write_pending: buffer '", b.spec.name, "' has no pending version"));
    if (bytes == 0 && offset <= b.spec.bytes) bytes = b.spec.bytes - offset;
    if (offset + bytes > b.spec.bytes || bytes == 0 || !src || memory == Tier::kNvme)
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: write of bytes [", offset, ", ", offset + bytes,
                  ") of the pending version of '", b.spec.name, "' (", b.spec.bytes,
                  " bytes) from ", src ? tier_name(memory) : "a null pointer"));
    if (b.spec.home == Tier::kNvme) {
      if (offset != 0 || bytes != b.spec.bytes)
        fail(ErrorCode::kInvalidArgument, strcat("tier store: buffer '", b.spec.name,
                                                 "' lives on nvme: its pending version is "
                                                 "written whole, not bytes [",
                                                 offset, ", ", offset + bytes, ")"));
      if (memory != Tier::kCpu)
        fail(ErrorCode::kUnsupported,
             strcat("tier store: the pending version of '", b.spec.name,
                    "' (on nvme) is written from host memory only, not device memory"));
      if (reinterpret_cast<std::uintptr_t>(src) % 4096 != 0)
        fail(ErrorCode::kInvalidArgument,
             strcat("tier store: write of the pending version of '", b.spec.name,
                    "' to nvme from host memory that is not 4096-aligned"));
    }
    Job job{OpKind::kWritePending, &b, memory, Access::kRead, state, offset, bytes,
            const_cast<void*>(src)};
    ++b.queued;
    queue_.push_back(std::move(job));
  }
  work_cv_.notify_one();
  return Transfer(state);
}

void TierStore::Impl::run_write_pending(Job& job, WorkerContext& ctx) {
  Buf& b = *job.buf;
  std::shared_ptr<tier::Version> p;
  {
    MutexLock lock(mutex_);
    p = b.pending;
  }
  if (!p)
    fail(ErrorCode::kInvalidArgument,
         strcat("tier store: buffer '", b.spec.name, "' has no pending version (discarded?)"));
  bool unsafe = false;
  try {
    if (p->where == Tier::kNvme) {
      copy_host_to_slot(b, static_cast<const std::uint8_t*>(job.ptr), p->extent, p->crc, &unsafe);
    } else {
      auto* base =
          static_cast<std::uint8_t*>(p->where == Tier::kGpu ? p->gpu.get() : p->host.data());
      if (base + job.offset != job.ptr)  // else written in place (pending_view): recorded only
        copy_memory(base + job.offset, job.ptr, job.bytes, p->where, job.tier, ctx, &unsafe);
    }
  } catch (...) {
    MutexLock lock(mutex_);
    p->failed = true;  // the committed version was not touched
    p->unsafe = p->unsafe || unsafe;
    throw;
  }
  MutexLock lock(mutex_);
  p->written.emplace_back(job.offset, job.bytes);
  ++stats_.writes;
}

void TierStore::Impl::commit(std::span<const BufferId> ids) {
  std::vector<Transfer> jobs;
  {
    UniqueLock lock(mutex_);
    check_usable_locked();
    const std::vector<Buf*> bufs = distinct_locked(ids, "commit");
    wait_blocks_idle_locked(lock, bufs, "commit");
    for (const Buf* b : bufs) {
      const char* why = !b->pending                   ? "has no pending version"
                        : b->pending->failed          ? "has a pending version whose write failed"
                        : b->pending->written.empty() ? "has a pending version never written"
                                                      : nullptr;
      if (!why && b->spec.home == Tier::kNvme && b->pending->written.size() != 1)
        why = "has a pending version (on nvme) not written whole";
      if (why)
        fail(ErrorCode::kInvalidArgument,
             strcat("tier store: commit refused: buffer '", b->spec.name, "' ", why,
                    "; nothing was committed"));
    }
    for (Buf* b : bufs) {
      auto state = std::make_shared<Transfer::State>();
      ++b->queued;
      queue_.push_back(Job{OpKind::kCommit, b, b->spec.home, Access::kRead, state});
      jobs.emplace_back(state);
    }
  }
  work_cv_.notify_all();
  std::exception_ptr first;
  for (const Transfer& t : jobs) {
    try {
      t.wait(options_.timeout);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

// On a mover, in the block's order. Memory homes: the written ranges go through stream_write (the
// copy-on-write of a pinned block, the budgets and the failure handling as for write()).
void TierStore::Impl::run_commit(Buf& b, WorkerContext& ctx) {
  std::shared_ptr<tier::Version> p;
  {
    MutexLock lock(mutex_);
    p = b.pending;
  }
  if (!p)
    fail(ErrorCode::kInternal, strcat("tier store: buffer '", b.spec.name,
                                      "' lost its "
                                      "pending version"));
  try {
    if (p->where == Tier::kNvme) {
      commit_slot(b, *p, ctx);
    } else {
      {
        MutexLock lock(mutex_);
        if (commit_swap_locked(b)) return;
      }
      auto* base =
          static_cast<std::uint8_t*>(p->where == Tier::kGpu ? p->gpu.get() : p->host.data());
      for (const auto& [off, len] : p->written) {
        Job w{OpKind::kWrite, &b, p->where, Access::kRead, nullptr, off, len, base + off};
        stream_write(w, ctx);
      }
    }
  } catch (...) {
    MutexLock lock(mutex_);
    if (b.pending == p) free_pending_locked(b);
    throw;
  }
  MutexLock lock(mutex_);
  if (b.pending == p) free_pending_locked(b);
}

namespace {
// Whether the ranges cover [0, bytes).
bool covers(std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges, std::uint64_t bytes) {
  std::sort(ranges.begin(), ranges.end());
  std::uint64_t end = 0;
  for (const auto& [off, len] : ranges) {
    if (off > end) return false;
    end = std::max(end, off + len);
  }
  return end >= bytes;
}
}  // namespace

// The pending buffer becomes the home copy; the old one goes to the snapshots still sharing the
// committed version (no data copied), else becomes the block's spare.
bool TierStore::Impl::commit_swap_locked(Buf& b) {
  tier::Version& p = *b.pending;
  const Tier t = b.spec.home;
  tier::Copy& c = b.copy[ti(t)];
  if (p.where != t || !c.valid || !covers(p.written, b.spec.bytes)) return false;
  for (Tier u : kTiers)
    if (b.copy[ti(u)].pins || b.copy[ti(u)].write_pins) return false;
  auto old = std::make_shared<tier::Version>();
  old->where = t;
  if (t == Tier::kCpu) {
    old->host = std::exchange(c.host, std::move(p.host));
    old->locked = std::exchange(c.locked, p.locked);
    old->locked_by_device = std::exchange(c.locked_by_device, p.locked_by_device);
  } else {
    old->gpu = std::exchange(c.gpu, std::move(p.gpu));
  }
  for (Tier u : kTiers)
    if (u != t) drop_locked(b, u);  // stale now
  pending_bytes_[ti(t)] -= b.padded;
  if (shares_committed(b)) {
    version_bytes_[ti(t)] += b.padded;
    adopt_version_locked(b, std::move(old));
  } else {
    drop_spare_locked(b);
    spare_bytes_[ti(t)] += b.padded;
    b.spare = std::move(old);
  }
  --pending_blocks_;
  b.pending.reset();
  ++stats_.writes;
  return true;
}

// The pending slot becomes the block's NVMe copy; the old slot goes to the snapshots still sharing
// the committed version (no data copied), else back to the extent allocator.
void TierStore::Impl::commit_slot(Buf& b, tier::Version& p, WorkerContext& ctx) {
  bool copy_first = false;
  {
    MutexLock lock(mutex_);
    require_unpinned_away_locked(b, "commit");
    if (b.copy[ti(Tier::kCpu)].pins)
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: cannot commit buffer '", b.spec.name, "': it is acquired on cpu"));
    copy_first = shares_committed(b) && !b.copy[ti(Tier::kNvme)].valid;
  }
  if (copy_first) preserve_pinned(b, ctx);  // the committed contents live in memory only
  MutexLock lock(mutex_);
  tier::Copy& n = b.copy[ti(Tier::kNvme)];
  if (shares_committed(b)) {  // the NVMe copy is valid: the pins keep its slot
    adopt_version_locked(b, nvme_version_locked(b));
  } else if (n.extent.length) {
    swap_->free(n.extent);
  }
  for (Tier u : {Tier::kGpu, Tier::kCpu}) drop_locked(b, u);
  pending_bytes_[ti(Tier::kNvme)] -= p.extent.length;
  n.extent = std::exchange(p.extent, SwapExtent{});
  b.crc = std::move(p.crc);
  n.valid = true;
  b.nvme_zero = false;
  ++stats_.writes;
}

void TierStore::Impl::discard(std::span<const BufferId> ids) {
  UniqueLock lock(mutex_);
  if (stop_) fail(ErrorCode::kCancelled, "tier store: shutting down");
  const std::vector<Buf*> bufs = distinct_locked(ids, "discard");
  wait_blocks_idle_locked(lock, bufs, "discard");
  for (Buf* b : bufs)
    if (b->pending) free_pending_locked(*b);
}

}  // namespace strata
