#include "tier/tier_store.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "core/checked_math.hpp"
#include "core/rethrow.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"
#include "strata/units.hpp"
#include "tier/store_impl.hpp"

namespace strata {

namespace {
const char* op_name(OpKind k) {
  switch (k) {
    case OpKind::kMove: return "tier store: moving";
    case OpKind::kPrefetch: return "tier store: prefetching";
    case OpKind::kEvict: return "tier store: evicting";
    case OpKind::kAcquire: return "tier store: acquiring";
    case OpKind::kRead: return "tier store: reading";
    case OpKind::kWrite: return "tier store: writing";
    case OpKind::kZero: return "tier store: zeroing";
    case OpKind::kReadPinned: return "tier store: reading the pinned version of";
    case OpKind::kWritePending: return "tier store: writing the pending version of";
    case OpKind::kCommit: return "tier store: committing the pending version of";
  }
  return "tier store:";
}
}  // namespace

// ---- Transfer
// ------------------------------------------------------------------------------------

void Transfer::State::finish(std::exception_ptr err, void* ptr) {
  {
    MutexLock lock(mutex);
    error = err;
    pointer = ptr;
    done = true;
  }
  cv.notify_all();
}

bool Transfer::ready() const {
  if (!state_) return true;
  MutexLock lock(state_->mutex);
  return state_->done;
}

void Transfer::wait(std::chrono::milliseconds timeout) const {
  if (!state_) return;
  UniqueLock lock(state_->mutex);
  if (!state_->cv.wait_for(lock, timeout, [&]() REQUIRES(state_->mutex) { return state_->done; })) {
    fail(ErrorCode::kTimeout,
         strcat("tier store: transfer not complete after ", timeout.count(), " ms"));
  }
  if (state_->error) rethrow_detached(state_->error);
}

void* Transfer::pointer() const {
  if (!state_) return nullptr;
  MutexLock lock(state_->mutex);
  return state_->pointer;
}

// ---- options
// -------------------------------------------------------------------------------------

TierStoreOptions TierStoreOptions::from(const Config& c, std::uint32_t rank,
                                        std::uint64_t nvme_capacity) {
  TierStoreOptions o;
  o.gpu_budget = c.tiers.gpu.budget;
  o.host_budget = c.tiers.host.budget;
  o.nvme_paths = c.tiers.nvme.paths;
  o.block_size = c.tiers.nvme.block_size;
  o.checksum = c.tiers.nvme.checksum;
  o.rank = rank;
  o.nvme_capacity = nvme_capacity;
  if (o.nvme_capacity == 0 && c.tiers.nvme.budget > 0) {
    o.nvme_capacity = c.tiers.nvme.budget / std::max<std::uint32_t>(1, c.ranks_per_node());
  }
  return o;
}

// ---- Impl: construction
// --------------------------------------------------------------------------

TierStore::Impl::Impl(const TierStoreOptions& options, Device& device, IoEngine* engine,
                      PinnedPool* pool)
    : options_(options), device_(device), engine_(engine), pool_(pool) {
  const std::uint64_t pool_bytes =
      pool ? std::uint64_t(pool->buffer_count()) * pool->buffer_size() : 0;
  if (pool_bytes > options_.host_budget) {
    fail(ErrorCode::kBudget,
         strcat("tier store: the pinned pool (", pool_bytes, " bytes) exceeds tiers.host.budget (",
                options_.host_budget, " bytes for this rank)"));
  }
  used_[ti(Tier::kCpu)] = pool_bytes;
  pinned_used_ = pool_bytes;
  if (options_.nvme_capacity > 0) {
    if (!engine_ || !pool_)
      fail(ErrorCode::kInvalidArgument,
           "tier store: an NVMe tier needs an I/O engine and a pinned pool");
    SwapSpaceOptions so;
    so.paths = options_.nvme_paths;
    so.capacity = options_.nvme_capacity;
    so.rank = options_.rank;
    so.block_size = options_.block_size;
    swap_ = std::make_unique<SwapSpace>(so, *engine_);
    align_ = swap_->alignment();
    if (pool_->buffer_size() % align_ != 0) {
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: tiers.host.buffer_size (", pool_->buffer_size(),
                  ") is not a multiple of the swap files' I/O alignment (", align_, ")"));
    }
  }
  const std::uint32_t movers = std::max<std::uint32_t>(1, options_.movers);
  window_ = pool ? std::max<std::uint32_t>(1, pool->buffer_count() / movers) : 1;
  admin_stream_ = device_.create_stream();
  for (std::uint32_t i = 0; i < movers; ++i) {
    auto ctx = std::make_unique<WorkerContext>();
    ctx->stream = device_.create_stream();
    for (std::uint32_t e = 0; e < window_; ++e) ctx->events.push_back(device_.create_event());
    contexts_.push_back(std::move(ctx));
  }
  for (auto& ctx : contexts_) workers_.emplace_back([this, c = ctx.get()] { worker_loop(*c); });
}

TierStore::Impl::~Impl() {
  try {
    wait_idle(options_.timeout);
  } catch (const std::exception& e) {
    log_error("tier store: shutting down with transfers in flight: ", e.what());
  }
  {
    MutexLock lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& w : workers_) w.join();
  // The movers' streams go first: destroying one waits for its queued work, and a copy that
  // timed out may still be queued there, into a quarantined buffer freed below (F11).
  contexts_.clear();
  MutexLock lock(mutex_);
  for (auto& [id, b] : bufs_) {
    drop_spare_locked(*b);
    for (Tier t : kTiers) drop_locked(*b, t);
    for (tier::QuarantinedHost& q : b->quarantine) {  // the streams are done: unlock, then unmap
      if (!q.locked) continue;
      if (q.by_device) {
        device_.unregister_host(q.mem.data());
      } else {
        ::munlock(q.mem.data(), q.mem.size());
      }
      pinned_used_ -= b->padded;
    }
  }
  bufs_.clear();
  host_cache_.clear();
  cached_ = 0;
}

// ---- registration
// ---------------------------------------------------------------------------------

BufferId TierStore::Impl::register_buffer(const BufferSpec& spec) {
  if (spec.name.empty()) fail(ErrorCode::kInvalidArgument, "tier store: a buffer needs a name");
  if (spec.bytes == 0) {
    fail(ErrorCode::kInvalidArgument, strcat("tier store: buffer '", spec.name, "' has 0 bytes"));
  }
  auto b = std::make_unique<Buf>();
  b->spec = spec;
  b->padded = round_up(spec.bytes, align_);
  if (spec.allowed.empty()) {
    for (Tier t : kTiers) b->allowed[ti(t)] = true;
  } else {
    for (Tier t : spec.allowed) b->allowed[ti(t)] = true;
  }
  if (!swap_) b->allowed[ti(Tier::kNvme)] = false;
  if (!b->allowed[ti(spec.home)]) {
    fail(ErrorCode::kInvalidArgument,
         strcat("tier store: buffer '", spec.name, "': home tier ", tier_name(spec.home),
                spec.home == Tier::kNvme && !swap_ ? " has no swap space" : " is not allowed"));
  }
  Tier home = spec.home;
  IoBuffer reuse;
  {
    MutexLock lock(mutex_);
    for (auto& [id, other] : bufs_) {
      if (other->spec.name == spec.name) {
        fail(ErrorCode::kInvalidArgument,
             strcat("tier store: buffer '", spec.name, "' is already registered"));
      }
    }
    reserve_locked(*b, home, &reuse);  // nvme: allocates the extent
  }
  try {
    if (home == Tier::kCpu) {
      if (reuse) std::memset(reuse.data(), 0, b->padded);
      b->copy[ti(home)].host =
          reuse ? std::move(reuse) : IoBuffer::allocate(b->padded, HugePageMode::kTransparent);
      lock_host(*b);
    } else if (home == Tier::kGpu) {
      b->copy[ti(home)].gpu = device_.allocate(b->padded);
      if (!device_.alloc_zeroed()) {  // (the host device's untouched pages stay untouched)
        MutexLock lock(admin_mutex_);
        admin_stream_->memset_async(b->copy[ti(home)].gpu.get(), 0, b->padded);
        admin_stream_->synchronize(options_.timeout);
      }
    } else {
      b->nvme_zero = true;
    }
  } catch (const Error& e) {
    {
      MutexLock lock(mutex_);
      drop_locked(*b, home);
    }
    // Name the buffer and the tier (memory errors say which tier and buffer).
    throw Error(e.code(), strcat(e.what(), "; registering buffer '", spec.name, "' (", b->padded,
                                 " bytes) in the ", tier_name(home), " tier"));
  } catch (...) {
    MutexLock lock(mutex_);
    drop_locked(*b, home);
    throw;
  }
  b->copy[ti(home)].valid = true;
  MutexLock lock(mutex_);
  for (auto& [id, other] : bufs_) {
    if (other->spec.name == spec.name) {
      drop_locked(*b, home);
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: buffer '", spec.name, "' is already registered"));
    }
  }
  b->id = next_id_++;
  BufferId id = b->id;
  bufs_.emplace(id, std::move(b));
  return id;
}

void TierStore::Impl::unregister_buffer(BufferId id) {
  UniqueLock lock(mutex_);
  Buf& b = buf_locked(id);
  if (!state_cv_.wait_for(lock, options_.timeout, [&] { return b.queued == 0; })) {
    fail(ErrorCode::kTimeout,
         strcat("tier store: buffer '", b.spec.name, "' still has transfers after ",
                options_.timeout.count(), " ms"));
  }
  for (Tier t : kTiers) {
    if (b.copy[ti(t)].pins) {
      fail(ErrorCode::kInvalidArgument, strcat("tier store: cannot unregister buffer '",
                                               b.spec.name, "': acquired on ", tier_name(t)));
    }
  }
  if (!b.versions.empty())
    fail(ErrorCode::kInvalidArgument,
         strcat("tier store: cannot unregister buffer '", b.spec.name, "': snapshot ",
                b.versions.front().snap, " pins it; unpin it first"));
  if (b.pending) free_pending_locked(b);
  drop_spare_locked(b);
  for (Tier t : kTiers) drop_locked(b, t);
  bufs_.erase(id);
}

BufferId TierStore::Impl::find(const std::string& name) const {
  MutexLock lock(mutex_);
  for (auto& [id, b] : bufs_) {
    if (b->spec.name == name) return id;
  }
  fail(ErrorCode::kInvalidArgument, strcat("tier store: no buffer named '", name, "'"));
}

Buf& TierStore::Impl::buf_locked(BufferId id) const {
  auto it = bufs_.find(id);
  if (it == bufs_.end()) fail(ErrorCode::kInvalidArgument, strcat("tier store: no buffer ", id));
  return *it->second;
}

// ---- budgets and storage
// ----------------------------------------------------------------------------

void TierStore::Impl::reserve_locked(Buf& b, Tier t, IoBuffer* reuse) {
  if (t == Tier::kNvme) {
    if (b.copy[ti(t)].extent.length == 0) {
      b.copy[ti(t)].extent = swap_->allocate(b.padded, strcat("buffer '", b.spec.name, "'"));
      b.crc.assign(options_.checksum ? crc_units(b) : 0, 0);
    }
    return;
  }
  const std::uint64_t budget = t == Tier::kGpu ? options_.gpu_budget : options_.host_budget;
  if (t == Tier::kCpu) {
    // A cached mapping of exactly this size is reused (it moves from cached to used); others are
    // unmapped until the copy fits.
    auto exact = host_cache_.find(b.padded);
    const std::uint64_t reusable = exact != host_cache_.end() ? b.padded : 0;
    for (auto it = host_cache_.begin();
         it != host_cache_.end() && used_[ti(t)] + cached_ - reusable + b.padded > budget;) {
      if (it == exact) {
        ++it;
        continue;
      }
      cached_ -= it->first;
      it = host_cache_.erase(it);
    }
    if (used_[ti(t)] + b.padded <= budget && exact != host_cache_.end() && reuse) {
      *reuse = std::move(exact->second);
      host_cache_.erase(exact);
      cached_ -= b.padded;
    }
  }
  drop_spares_locked(t, b.padded, budget);
  if (used_[ti(t)] + b.padded > budget) {
    fail(ErrorCode::kBudget,
         strcat("tier store: buffer '", b.spec.name, "' (", b.padded,
                " bytes) does not fit in the ", tier_name(t), " tier: ", used_[ti(t)], " of ",
                budget, " bytes in use (tiers.", t == Tier::kGpu ? "gpu" : "host", ".budget",
                t == Tier::kCpu ? ", the pinned pool included" : "", ")"));
  }
  used_[ti(t)] += b.padded;
}

void TierStore::Impl::unreserve_locked(Buf& b, Tier t) {
  if (t != Tier::kNvme) used_[ti(t)] -= b.padded;
}

void TierStore::Impl::unlock_host_locked(const Buf& b, const IoBuffer& mem, bool by_device) {
  if (by_device) {
    device_.unregister_host(mem.data());
  } else {
    ::munlock(mem.data(), mem.size());
  }
  pinned_used_ -= b.padded;
}

// Frees the copy's storage (the quarantine keeps storage a timed-out transfer may still touch).
void TierStore::Impl::drop_locked(Buf& b, Tier t) {
  tier::Copy& c = b.copy[ti(t)];
  c.valid = false;
  if (t == Tier::kCpu && c.host && c.locked) {
    unlock_host_locked(b, c.host, c.locked_by_device);
    c.locked = c.locked_by_device = false;
  }
  if (t == Tier::kCpu && c.host) {
    if (!stop_) {  // keep the mapping for the next copy of this size
      cached_ += c.host.size();
      host_cache_.emplace(c.host.size(), std::move(c.host));
    }
    c.host = IoBuffer();
    unreserve_locked(b, t);
  } else if (t == Tier::kGpu && c.gpu) {
    c.gpu.reset();
    unreserve_locked(b, t);
  } else if (t == Tier::kNvme && c.extent.length) {
    swap_->free(c.extent);
    c.extent = {};
    b.nvme_zero = false;
  }
}

void TierStore::Impl::quarantine_host_locked(Buf& b) {
  tier::Copy& c = b.copy[ti(Tier::kCpu)];
  b.quarantine.push_back({std::move(c.host), c.locked, c.locked_by_device});
  c.locked = c.locked_by_device = false;  // a new host copy gets its own lock
}

void TierStore::Impl::lock_host(Buf& b) {
  tier::Copy& c = b.copy[ti(Tier::kCpu)];
  if (!b.spec.pinned || c.locked || !c.host) return;
  const std::string what = strcat("buffer '", b.spec.name, "'");
  {
    MutexLock lock(mutex_);
    reserve_pinned_locked(b, what);
  }
  bool by_device = false;
  try {
    by_device = lock_pages(b, c.host, what);  // outside the store's lock: it may take a while
  } catch (...) {
    MutexLock lock(mutex_);
    pinned_used_ -= b.padded;
    throw;
  }
  MutexLock lock(mutex_);
  c.locked = true;
  c.locked_by_device = by_device;
}

bool TierStore::Impl::pinned_room_locked(std::uint64_t bytes) {
  drop_locked_spares_locked(bytes);
  return pinned_used_ + bytes <= options_.pinned_budget;
}

void TierStore::Impl::reserve_pinned_locked(const Buf& b, const std::string& what) {
  if (!pinned_room_locked(b.padded))
    fail(ErrorCode::kBudget, strcat("tier store: ", what, " (", b.padded,
                                    " bytes, pin_memory) does not fit in the pinned host memory: ",
                                    pinned_used_, " of ", options_.pinned_budget,
                                    " bytes in use (tiers.host.pinned_budget, the pool included)"));
  pinned_used_ += b.padded;
}

bool TierStore::Impl::lock_pages(const Buf& b, const IoBuffer& mem, const std::string& what) {
  const bool by_device = device_.register_host(mem.data(), b.padded);
  if (!by_device && ::mlock(mem.data(), b.padded) != 0) {
    const int err = errno;
    fail(ErrorCode::kOutOfMemory,
         strcat("tier store: mlock of ", what, " (", b.padded,
                " bytes, pin_memory) failed: ", std::strerror(err), " (errno ", err,
                "); raise RLIMIT_MEMLOCK (ulimit -l) or set pin_memory: false"));
  }
  return by_device;
}

std::string TierStore::Impl::where(const Buf& b) const {
  std::string s;
  for (Tier t : kTiers) {
    if (b.copy[ti(t)].pins)
      s += strcat(s.empty() ? "" : ", ", tier_name(t), " (", b.copy[ti(t)].pins, " pin(s))");
  }
  return s;
}

// ---- the job queue
// ---------------------------------------------------------------------------------

Transfer TierStore::Impl::submit(OpKind kind, BufferId id, Tier tier, Access access) {
  auto state = std::make_shared<Transfer::State>();
  {
    UniqueLock lock(mutex_);
    check_usable_locked();
    Buf& b = buf_locked(id);
    if (kind == OpKind::kAcquire && tier == Tier::kNvme) {
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: buffer '", b.spec.name, "': acquire needs the gpu or cpu tier"));
    }
    if (!b.allowed[ti(tier)]) {
      fail(ErrorCode::kInvalidArgument, strcat("tier store: buffer '", b.spec.name, "': tier ",
                                               tier_name(tier), " is not allowed"));
    }
    Job job{kind, &b, tier, access, state};
    if (b.queued == 0 && !b.running && try_inline_locked(job)) return Transfer(state);
    ++b.queued;
    queue_.push_back(std::move(job));
  }
  work_cv_.notify_one();
  return Transfer(state);
}

Transfer TierStore::Impl::submit_stream(OpKind kind, BufferId id, std::uint64_t offset,
                                        std::uint64_t bytes, void* ptr, Tier memory, bool padded) {
  auto state = std::make_shared<Transfer::State>();
  {
    UniqueLock lock(mutex_);
    check_usable_locked();
    Buf& b = buf_locked(id);
    if (kind != OpKind::kZero) {
      const char* what = kind == OpKind::kRead ? "read" : "write";
      if (offset > b.spec.bytes)
        fail(ErrorCode::kInvalidArgument,
             strcat("tier store: ", what, " of buffer '", b.spec.name, "' at offset ", offset,
                    " beyond its ", b.spec.bytes, " bytes"));
      if (bytes == 0) bytes = b.spec.bytes - offset;
      if (offset + bytes > b.spec.bytes)
        fail(ErrorCode::kInvalidArgument,
             strcat("tier store: ", what, " of bytes [", offset, ", ", offset + bytes,
                    ") of buffer '", b.spec.name, "' beyond its ", b.spec.bytes, " bytes"));
      if (!ptr)
        fail(ErrorCode::kInvalidArgument,
             strcat("tier store: ", what, " of '", b.spec.name, "' with a null pointer"));
      if (memory == Tier::kNvme)
        fail(ErrorCode::kInvalidArgument,
             strcat("tier store: ", what, ": the caller's memory is host or device memory"));
      if (kind == OpKind::kWrite && b.spec.home == Tier::kNvme) {
        if (offset != 0 || bytes != b.spec.bytes)
          fail(ErrorCode::kInvalidArgument,
               strcat("tier store: buffer '", b.spec.name,
                      "' lives on nvme: write() replaces the whole buffer, not bytes [", offset,
                      ", ", offset + bytes, ")"));
        if (memory == Tier::kCpu && reinterpret_cast<std::uintptr_t>(ptr) % 4096 != 0)
          fail(ErrorCode::kInvalidArgument,
               strcat("tier store: write of '", b.spec.name,
                      "' to nvme from host memory that is not 4096-aligned"));
      }
    }
    Job job{kind, &b, memory, Access::kRead, state, offset, bytes, ptr, padded};
    ++b.queued;
    queue_.push_back(std::move(job));
  }
  work_cv_.notify_one();
  return Transfer(state);
}

void TierStore::Impl::worker_loop(WorkerContext& ctx) {
  UniqueLock lock(mutex_);
  for (;;) {
    auto it = queue_.end();
    work_cv_.wait(lock, [&]() REQUIRES(mutex_) {
      // The first queued job whose buffer is idle: jobs of one buffer run in submission order.
      it = std::find_if(queue_.begin(), queue_.end(), [](const Job& j) { return !j.buf->running; });
      return stop_ || it != queue_.end();
    });
    if (it == queue_.end()) return;  // stop_ and nothing runnable
    Job job = std::move(*it);
    queue_.erase(it);
    job.buf->running = true;
    ++running_;
    lock.unlock();
    run_job(job, ctx);
    lock.lock();
    job.buf->running = false;
    --job.buf->queued;
    --running_;
    state_cv_.notify_all();
    work_cv_.notify_all();  // a job of this buffer may be runnable now
  }
}

void TierStore::Impl::run_job(Job& job, WorkerContext& ctx) {
  Buf& b = *job.buf;
  const Tier t = job.tier;
  void* ptr = nullptr;
  std::exception_ptr err;
  try {
    // Copy-on-write of a pinned version, once its contents are no longer needed in place
    // (acquire for kWrite and partial writes load them first; stream_write preserves itself).
    if (job.kind == OpKind::kZero ||
        (job.kind == OpKind::kAcquire && job.access == Access::kDiscard))
      preserve_pinned(b, ctx);
    switch (job.kind) {
      case OpKind::kPrefetch: ensure_valid(b, t, ctx); break;
      case OpKind::kMove: {
        {
          MutexLock lock(mutex_);
          for (Tier u : {Tier::kGpu, Tier::kCpu}) {
            if (u != t && b.copy[ti(u)].pins) {
              fail(ErrorCode::kInvalidArgument,
                   strcat("tier store: cannot move buffer '", b.spec.name, "' to ", tier_name(t),
                          ": it is acquired on ", where(b), "; release it first"));
            }
          }
        }
        ensure_valid(b, t, ctx);
        MutexLock lock(mutex_);
        for (Tier u : {Tier::kGpu, Tier::kCpu}) {
          if (u != t) drop_locked(b, u);
        }
        break;
      }
      case OpKind::kEvict: evict_copy(b, t, ctx); break;
      case OpKind::kRead: stream_read(job, ctx); break;
      case OpKind::kWrite: stream_write(job, ctx); break;
      case OpKind::kZero: stream_zero(b, ctx); break;
      case OpKind::kReadPinned: run_read_pinned(job, ctx); break;
      case OpKind::kWritePending: run_write_pending(job, ctx); break;
      case OpKind::kCommit: run_commit(b, ctx); break;
      case OpKind::kAcquire: {
        if (job.access == Access::kDiscard) {
          {
            MutexLock lock(mutex_);
            check_writable_locked(b, t);
          }
          ensure_storage(b, t);
        } else {
          ensure_valid(b, t, ctx);
          if (job.access == Access::kWrite) preserve_pinned(b, ctx);
        }
        MutexLock lock(mutex_);
        ptr = pin_locked(b, t, job.access);
        break;
      }
    }
  } catch (const IoError& e) {
    err = std::make_exception_ptr(
        e.with_context(strcat(op_name(job.kind), " buffer '", b.spec.name, "'")));
  } catch (const Error& e) {
    err = std::make_exception_ptr(
        Error(e.code(), strcat(e.what(), "; ", op_name(job.kind), " buffer '", b.spec.name, "'")));
  } catch (...) {
    err = std::current_exception();
  }
  if (err) {
    renew_stream(ctx);
    MutexLock lock(mutex_);
    check_lost_locked(b, err);
  }
  if (job.kind == OpKind::kReadPinned) {  // before finish(): the reader may unpin at once
    MutexLock lock(mutex_);
    auto rec = snapshots_.find(job.snap);
    if (rec != snapshots_.end()) --rec->second.reads;
  }
  job.state->finish(err, ptr);
}

// A stream whose work failed stays failed (Stream::synchronize): the mover's next job gets a new
// one instead of the old error. A stream with work still in flight (a timed-out copy) is kept.
void TierStore::Impl::renew_stream(WorkerContext& ctx) noexcept {
  try {
    ctx.stream->synchronize(std::chrono::milliseconds(0));
    return;  // idle and healthy
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kTimeout) return;
  } catch (...) {
  }
  try {
    ctx.stream = device_.create_stream();
  } catch (const std::exception& e) {
    log_error("tier store: cannot replace a failed copy stream: ", e.what());
  }
}

void TierStore::Impl::check_lost_locked(Buf& b, const std::exception_ptr& err) {
  for (Tier t : kTiers)
    if (b.copy[ti(t)].valid) return;
  if (!failure_.empty()) return;
  std::string what = "unknown error";
  try {
    std::rethrow_exception(err);
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  failure_ = strcat("tier store rank ", options_.rank, ": failed: buffer '", b.spec.name,
                    "' lost its contents (", what,
                    "); the store refuses every operation — "
                    "restore the last checkpoint or restart");
  log_error(failure_);
}

void TierStore::Impl::check_writable_locked(Buf& b, Tier t) {
  for (Tier u : kTiers) {
    if (u != t && b.copy[ti(u)].pins) {
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: cannot acquire buffer '", b.spec.name, "' for writing on ",
                  tier_name(t), ": it is also acquired on ", where(b)));
    }
  }
}

void* TierStore::Impl::pin_locked(Buf& b, Tier t, Access access) {
  tier::Copy& c = b.copy[ti(t)];
  if (access != Access::kRead) {
    check_writable_locked(b, t);
    // The other copies are about to be stale: memory copies are freed, the NVMe extent kept.
    for (Tier u : {Tier::kGpu, Tier::kCpu}) {
      if (u != t) drop_locked(b, u);
    }
    b.copy[ti(Tier::kNvme)].valid = false;
    b.nvme_zero = false;
    c.valid = true;  // kDiscard: storage without loaded contents
    ++c.write_pins;
  }
  if (!c.valid)
    fail(ErrorCode::kInternal,
         strcat("tier store: pinning an invalid copy of '", b.spec.name, "'"));
  ++c.pins;
  return t == Tier::kGpu ? c.gpu.get() : c.host.data();
}

void TierStore::Impl::ensure_storage(Buf& b, Tier t) {
  IoBuffer reuse;
  {
    MutexLock lock(mutex_);
    const tier::Copy& c = b.copy[ti(t)];
    if (c.valid || c.host || c.gpu) return;
    reserve_locked(b, t, &reuse);
  }
  try {
    if (t == Tier::kCpu) {
      IoBuffer mem =
          reuse ? std::move(reuse) : IoBuffer::allocate(b.padded, HugePageMode::kTransparent);
      {
        MutexLock lock(mutex_);
        b.copy[ti(t)].host = std::move(mem);
      }
      lock_host(b);
    } else {
      DeviceMemory mem = device_.allocate(b.padded);
      MutexLock lock(mutex_);
      b.copy[ti(t)].gpu = std::move(mem);
    }
  } catch (...) {
    MutexLock lock(mutex_);
    unreserve_locked(b, t);
    throw;
  }
}

bool TierStore::Impl::try_inline_locked(Job& job) {
  Buf& b = *job.buf;
  const Tier t = job.tier;
  tier::Copy& c = b.copy[ti(t)];
  void* ptr = nullptr;
  try {
    switch (job.kind) {
      case OpKind::kPrefetch:
        if (!c.valid) return false;
        if (t == Tier::kNvme) ++stats_.writes_skipped_clean;
        break;
      case OpKind::kMove:
        if (!c.valid) return false;
        if (t == Tier::kNvme) ++stats_.writes_skipped_clean;
        for (Tier u : {Tier::kGpu, Tier::kCpu}) {
          if (u != t && b.copy[ti(u)].pins) {
            fail(ErrorCode::kInvalidArgument,
                 strcat("tier store: cannot move buffer '", b.spec.name, "' to ", tier_name(t),
                        ": it is acquired on ", where(b), "; release it first"));
          }
        }
        for (Tier u : {Tier::kGpu, Tier::kCpu}) {
          if (u != t) drop_locked(b, u);
        }
        break;
      case OpKind::kEvict: {
        if (c.pins) return false;  // the mover reports it, in order
        bool other_valid = false;
        for (Tier u : kTiers) other_valid |= (u != t && b.copy[ti(u)].valid);
        if (c.valid && !other_valid) return false;  // needs a write-down
        if (c.valid && t != Tier::kNvme && b.copy[ti(Tier::kNvme)].valid)
          ++stats_.writes_skipped_clean;
        drop_locked(b, t);
        break;
      }
      case OpKind::kAcquire:
        if (!c.valid) return false;
        if (job.access != Access::kRead && shares_committed(b)) return false;  // copy-on-write
        ptr = pin_locked(b, t, job.access);
        break;
      case OpKind::kRead:
      case OpKind::kWrite:
      case OpKind::kZero:
      case OpKind::kReadPinned:
      case OpKind::kWritePending:
      case OpKind::kCommit: return false;  // always on a mover (never inlined)
    }
  } catch (...) {
    job.state->finish(std::current_exception(), nullptr);
    return true;
  }
  job.state->finish(nullptr, ptr);
  return true;
}

void TierStore::Impl::release(BufferId id, Tier tier, Access access) {
  MutexLock lock(mutex_);
  Buf& b = buf_locked(id);
  tier::Copy& c = b.copy[ti(tier)];
  if (c.pins == 0) {
    fail(ErrorCode::kInvalidArgument, strcat("tier store: release of buffer '", b.spec.name,
                                             "' on ", tier_name(tier), " which is not acquired"));
  }
  --c.pins;
  if (access != Access::kRead && c.write_pins > 0) --c.write_pins;
  if (c.write_pins > c.pins) c.write_pins = c.pins;  // a writer's release ends the write
}

void TierStore::Impl::wait_idle(std::chrono::milliseconds timeout) {
  UniqueLock lock(mutex_);
  if (!state_cv_.wait_for(lock, timeout,
                          [&]() REQUIRES(mutex_) { return queue_.empty() && running_ == 0; })) {
    fail(ErrorCode::kTimeout, strcat("tier store: ", queue_.size() + running_,
                                     " transfer(s) still pending after ", timeout.count(), " ms"));
  }
}

// ---- operations
// ------------------------------------------------------------------------------------

// The tier to copy `t`'s copy from (the nearest valid one), with the target reserved; nullopt
// when `t`'s copy is valid already. REQUIRES: mutex_ held.
std::optional<Tier> TierStore::Impl::choose_source_locked(Buf& b, Tier t, IoBuffer* reuse) {
  if (b.copy[ti(t)].valid) {
    if (t == Tier::kNvme) ++stats_.writes_skipped_clean;
    return std::nullopt;
  }
  static constexpr Tier kPrefer[3][2] = {
      {Tier::kCpu, Tier::kNvme}, {Tier::kGpu, Tier::kNvme}, {Tier::kCpu, Tier::kGpu}};
  std::optional<Tier> src;
  for (Tier s : kPrefer[ti(t)]) {
    if (b.copy[ti(s)].valid) {
      src = s;
      break;
    }
  }
  if (!src)
    fail(ErrorCode::kInternal, strcat("tier store: buffer '", b.spec.name, "' has no valid copy"));
  if (b.copy[ti(*src)].write_pins) {
    fail(ErrorCode::kInvalidArgument,
         strcat("tier store: buffer '", b.spec.name, "' is acquired for writing on ",
                tier_name(*src), "; release it before copying it to ", tier_name(t)));
  }
  reserve_locked(b, t, reuse);  // memory tiers: budget; nvme: the extent (kept once allocated)
  return src;
}

// Allocates the memory of `t`'s copy when it has none (outside the lock, installed under it:
// info() reads it). Returns true when the new memory is zero-filled already.
bool TierStore::Impl::allocate_copy(Buf& b, Tier t, IoBuffer reuse) {
  tier::Copy& d = b.copy[ti(t)];
  bool fresh = false;
  if (t == Tier::kCpu && !d.host) {
    fresh = !reuse;
    if (reuse && b.padded > b.spec.bytes) {  // no stale bytes of another buffer in the padding
      std::memset(reuse.bytes() + b.spec.bytes, 0, b.padded - b.spec.bytes);
    }
    IoBuffer mem =
        reuse ? std::move(reuse) : IoBuffer::allocate(b.padded, HugePageMode::kTransparent);
    {
      MutexLock lock(mutex_);
      d.host = std::move(mem);
    }
    lock_host(b);
  }
  if (t == Tier::kGpu && !d.gpu) {
    DeviceMemory mem = device_.allocate(b.padded);
    MutexLock lock(mutex_);
    d.gpu = std::move(mem);
  }
  return fresh;
}

// Copies `src`'s bytes into `t`'s copy (an NVMe copy that was never written: zeros). *unsafe is
// true while a failed transfer may still write into the destination.
void TierStore::Impl::transfer(Buf& b, Tier t, Tier src, bool fresh, WorkerContext& ctx,
                               bool* unsafe) {
  tier::Copy& d = b.copy[ti(t)];
  const tier::Copy& s = b.copy[ti(src)];
  if (src == Tier::kNvme && b.nvme_zero) {
    if (t == Tier::kCpu) {
      if (!fresh) std::memset(d.host.data(), 0, b.padded);
    } else {  // gpu
      *unsafe = true;
      ctx.stream->memset_async(d.gpu.get(), 0, b.padded);
      ctx.stream->synchronize(options_.timeout);
      *unsafe = false;
    }
  } else if (t == Tier::kNvme) {
    if (src == Tier::kCpu)
      copy_host_to_nvme(b, s.host.bytes(), unsafe);
    else
      copy_gpu_to_nvme(b, static_cast<const std::uint8_t*>(s.gpu.get()), ctx, unsafe);
  } else if (src == Tier::kNvme) {
    if (t == Tier::kCpu)
      copy_nvme_to_host(b, d.host.bytes(), unsafe);
    else
      copy_nvme_to_gpu(b, static_cast<std::uint8_t*>(d.gpu.get()), ctx, unsafe);
  } else {
    void* dst = t == Tier::kGpu ? d.gpu.get() : d.host.data();
    const void* from = src == Tier::kGpu ? s.gpu.get() : s.host.data();
    copy_device(dst, from, b.spec.bytes, ctx, unsafe);
    MutexLock lock(mutex_);
    (t == Tier::kGpu ? stats_.bytes_to_gpu : stats_.bytes_from_gpu) += b.spec.bytes;
  }
}

// After a failed copy into `t`: memory a transfer may still write into is quarantined, an NVMe
// extent kept but marked invalid, a memory copy dropped (or its reservation returned).
// REQUIRES: mutex_ held.
void TierStore::Impl::undo_copy_locked(Buf& b, Tier t, bool unsafe) {
  tier::Copy& d = b.copy[ti(t)];
  if (unsafe) {  // a transfer may still write into it: keep the memory alive, account it gone
    if (t == Tier::kCpu && d.host) quarantine_host_locked(b);
    if (t == Tier::kGpu && d.gpu) b.gpu_quarantine.push_back(std::move(d.gpu));
  }
  if (t == Tier::kNvme) {
    d.valid = false;  // keep the extent; its contents are unknown
    b.nvme_zero = false;
  } else {
    if (d.host || d.gpu) {
      drop_locked(b, t);
    } else {
      unreserve_locked(b, t);
    }
  }
}

void TierStore::Impl::ensure_valid(Buf& b, Tier t, WorkerContext& ctx) {
  IoBuffer reuse;  // a cached host mapping taken with the reservation
  std::optional<Tier> src;
  {
    MutexLock lock(mutex_);
    src = choose_source_locked(b, t, &reuse);
  }
  if (!src) return;
  bool unsafe = false;
  try {
    const bool fresh = allocate_copy(b, t, std::move(reuse));
    transfer(b, t, *src, fresh, ctx, &unsafe);
  } catch (...) {
    MutexLock lock(mutex_);
    undo_copy_locked(b, t, unsafe);
    throw;
  }
  MutexLock lock(mutex_);
  b.copy[ti(t)].valid = true;
  if (t == Tier::kNvme) b.nvme_zero = false;
}

void TierStore::Impl::evict_copy(Buf& b, Tier from, WorkerContext& ctx) {
  Tier target = from;
  bool need_copy = false;
  {
    MutexLock lock(mutex_);
    tier::Copy& c = b.copy[ti(from)];
    if (c.pins) {
      fail(ErrorCode::kInvalidArgument,
           strcat("tier store: cannot evict buffer '", b.spec.name, "' from ", tier_name(from),
                  ": it is acquired on ", where(b), "; release it first"));
    }
    bool other_valid = false;
    for (Tier u : kTiers) other_valid |= (u != from && b.copy[ti(u)].valid);
    if (c.valid && !other_valid) {
      bool found = false;
      for (int u = ti(from) + 1; u < 3; ++u) {
        if (b.allowed[u]) {
          target = static_cast<Tier>(u);
          found = true;
          break;
        }
      }
      if (!found) {
        fail(ErrorCode::kInvalidArgument,
             strcat("tier store: cannot evict buffer '", b.spec.name, "' from ", tier_name(from),
                    ": it is the only copy and no lower tier is allowed"));
      }
      need_copy = true;
    } else if (c.valid && from != Tier::kNvme && b.copy[ti(Tier::kNvme)].valid) {
      ++stats_.writes_skipped_clean;
    }
  }
  if (need_copy) ensure_valid(b, target, ctx);
  MutexLock lock(mutex_);
  drop_locked(b, from);
}

// ---- queries
// ----------------------------------------------------------------------------------------

BufferInfo TierStore::Impl::info(BufferId id) const {
  MutexLock lock(mutex_);
  const Buf& b = buf_locked(id);
  BufferInfo i;
  i.name = b.spec.name;
  i.bytes = b.spec.bytes;
  i.dtype = b.spec.dtype;
  i.home = b.spec.home;
  for (Tier t : kTiers) {
    const tier::Copy& c = b.copy[ti(t)];
    i.valid[ti(t)] = c.valid;
    i.pins[ti(t)] = c.pins;
    i.allocated[ti(t)] = t == Tier::kCpu   ? bool(c.host)
                         : t == Tier::kGpu ? bool(c.gpu)
                                           : c.extent.length > 0;
  }
  i.in_flight = b.queued > 0;
  i.dirty = !b.copy[ti(Tier::kNvme)].valid;
  return i;
}

bool TierStore::Impl::fits_locked(Tier t, std::uint64_t bytes) {
  const std::uint64_t budget = budget_of(t);
  if (t == Tier::kCpu && used_[ti(t)] + cached_ + bytes > budget) {
    host_cache_.clear();  // cached mappings are the first to go
    cached_ = 0;
  }
  drop_spares_locked(t, bytes, budget);
  return used_[ti(t)] + bytes <= budget;
}

// Spares (kept pending-version buffers) go before anything is refused for room.
void TierStore::Impl::drop_spares_locked(Tier t, std::uint64_t bytes, std::uint64_t budget) {
  for (auto it = bufs_.begin(); it != bufs_.end() && used_[ti(t)] + bytes > budget; ++it)
    if (it->second->spare && it->second->spare->where == t) drop_spare_locked(*it->second);
}

void TierStore::Impl::drop_locked_spares_locked(std::uint64_t bytes) {
  for (auto it = bufs_.begin(); it != bufs_.end() && pinned_used_ + bytes > options_.pinned_budget;
       ++it)
    if (it->second->spare && it->second->spare->locked) drop_spare_locked(*it->second);
}

void TierStore::Impl::reserve(Tier t, std::uint64_t bytes, const std::string& what) {
  if (t == Tier::kNvme)
    fail(ErrorCode::kInvalidArgument, strcat("tier store: ", what, ": nvme cannot be reserved"));
  MutexLock lock(mutex_);
  const std::uint64_t budget = budget_of(t);
  if (!fits_locked(t, bytes))
    fail(ErrorCode::kBudget,
         strcat("tier store: ", what, " (", bytes, " bytes) does not fit in the ", tier_name(t),
                " tier: ", used_[ti(t)], " of ", budget, " bytes in use (tiers.",
                t == Tier::kGpu ? "gpu" : "host", ".budget)"));
  used_[ti(t)] += bytes;
}

void TierStore::Impl::unreserve(Tier t, std::uint64_t bytes) noexcept {
  if (t == Tier::kNvme) return;
  MutexLock lock(mutex_);
  used_[ti(t)] -= std::min(bytes, used_[ti(t)]);
}

bool TierStore::Impl::try_reserve_pinned(std::uint64_t bytes) {
  MutexLock lock(mutex_);
  if (!pinned_room_locked(bytes) || !fits_locked(Tier::kCpu, bytes)) return false;
  pinned_used_ += bytes;
  used_[ti(Tier::kCpu)] += bytes;
  return true;
}

void TierStore::Impl::unreserve_pinned(std::uint64_t bytes) noexcept {
  MutexLock lock(mutex_);
  pinned_used_ -= std::min(bytes, pinned_used_);
  used_[ti(Tier::kCpu)] -= std::min(bytes, used_[ti(Tier::kCpu)]);
}

TierUsage TierStore::Impl::usage(Tier t) const {
  MutexLock lock(mutex_);
  if (t == Tier::kNvme) {
    return swap_ ? TierUsage{swap_->used(), swap_->capacity()} : TierUsage{};
  }
  if (t == Tier::kGpu) return TierUsage{used_[ti(t)], options_.gpu_budget, 0};
  return TierUsage{used_[ti(t)], options_.host_budget, cached_, pinned_used_};
}

std::uint64_t TierStore::Impl::padded_bytes(BufferId id) const {
  MutexLock lock(mutex_);
  return buf_locked(id).padded;
}

std::string TierStore::Impl::failure() const {
  MutexLock lock(mutex_);
  return failure_;
}

TierStoreStats TierStore::Impl::stats() const {
  MutexLock lock(mutex_);
  return stats_;
}

std::pair<std::uint64_t, std::uint64_t> TierStore::Impl::nvme_extent(BufferId id) const {
  MutexLock lock(mutex_);
  const auto& e = buf_locked(id).copy[ti(Tier::kNvme)].extent;
  return {e.offset, e.length};
}

// ---- TierStore
// ----------------------------------------------------------------------------------------

TierStore::TierStore(const TierStoreOptions& options, Device& device, IoEngine* engine,
                     PinnedPool* pool)
    : impl_(std::make_unique<Impl>(options, device, engine, pool)) {}
TierStore::~TierStore() = default;
BufferId TierStore::register_buffer(const BufferSpec& spec) { return impl_->register_buffer(spec); }
void TierStore::unregister_buffer(BufferId id) { impl_->unregister_buffer(id); }
BufferId TierStore::find(const std::string& name) const { return impl_->find(name); }
Transfer TierStore::move(BufferId id, Tier to) {
  return impl_->submit(OpKind::kMove, id, to, Access::kRead);
}
Transfer TierStore::prefetch(BufferId id, Tier to) {
  return impl_->submit(OpKind::kPrefetch, id, to, Access::kRead);
}
Transfer TierStore::evict(BufferId id, Tier from) {
  return impl_->submit(OpKind::kEvict, id, from, Access::kRead);
}
Transfer TierStore::acquire_async(BufferId id, Tier tier, Access access) {
  return impl_->submit(OpKind::kAcquire, id, tier, access);
}
void* TierStore::acquire(BufferId id, Tier tier, Access access, std::chrono::milliseconds timeout) {
  Transfer t = acquire_async(id, tier, access);
  t.wait(timeout);
  return t.pointer();
}
void TierStore::release(BufferId id, Tier tier, Access access) { impl_->release(id, tier, access); }
Transfer TierStore::read(BufferId id, std::uint64_t offset, std::uint64_t bytes, void* dst,
                         Tier memory, bool padded) {
  return impl_->submit_stream(OpKind::kRead, id, offset, bytes, dst, memory, padded);
}
Transfer TierStore::write(BufferId id, std::uint64_t offset, std::uint64_t bytes, const void* src,
                          Tier memory) {
  return impl_->submit_stream(OpKind::kWrite, id, offset, bytes, const_cast<void*>(src), memory);
}
Transfer TierStore::zero(BufferId id) {
  return impl_->submit_stream(OpKind::kZero, id, 0, 0, nullptr, Tier::kCpu);
}
std::uint64_t TierStore::padded_bytes(BufferId id) const { return impl_->padded_bytes(id); }
PinnedPool* TierStore::pool() const { return impl_->pool(); }
Device& TierStore::device() const { return impl_->device(); }
std::string TierStore::failure() const { return impl_->failure(); }
void TierStore::wait_idle(std::chrono::milliseconds timeout) { impl_->wait_idle(timeout); }
BufferInfo TierStore::info(BufferId id) const { return impl_->info(id); }
TierUsage TierStore::usage(Tier tier) const { return impl_->usage(tier); }
void TierStore::reserve(Tier tier, std::uint64_t bytes, const std::string& what) {
  impl_->reserve(tier, bytes, what);
}
void TierStore::unreserve(Tier tier, std::uint64_t bytes) noexcept {
  impl_->unreserve(tier, bytes);
}
bool TierStore::try_reserve_pinned(std::uint64_t bytes) { return impl_->try_reserve_pinned(bytes); }
void TierStore::unreserve_pinned(std::uint64_t bytes) noexcept { impl_->unreserve_pinned(bytes); }
TierStoreStats TierStore::stats() const { return impl_->stats(); }
const SwapSpace* TierStore::swap_space() const { return impl_->swap(); }
std::pair<std::uint64_t, std::uint64_t> TierStore::nvme_extent(BufferId id) const {
  return impl_->nvme_extent(id);
}
SnapshotId TierStore::pin_committed(std::span<const BufferId> ids) {
  return impl_->pin_committed(ids);
}
Transfer TierStore::read_pinned(SnapshotId s, BufferId id, std::uint64_t offset,
                                std::uint64_t bytes, void* dst, Tier memory, bool padded) {
  return impl_->submit_read_pinned(s, id, offset, bytes, dst, memory, padded);
}
void TierStore::unpin(SnapshotId s, BufferId id) { impl_->unpin(s, &id); }
void TierStore::unpin(SnapshotId s) { impl_->unpin(s, nullptr); }
VersionUsage TierStore::version_usage() const { return impl_->version_usage(); }
VersionBytes TierStore::rewrite_cost(SnapshotId s) const { return impl_->rewrite_cost(s); }
void TierStore::open_pending(std::span<const BufferId> ids) { impl_->open_pending(ids); }
Transfer TierStore::write_pending(BufferId id, std::uint64_t offset, std::uint64_t bytes,
                                  const void* src, Tier memory) {
  return impl_->submit_write_pending(id, offset, bytes, src, memory);
}
void TierStore::commit(std::span<const BufferId> ids) { impl_->commit(ids); }
void TierStore::discard(std::span<const BufferId> ids) { impl_->discard(ids); }
bool TierStore::has_pending(BufferId id) const { return impl_->has_pending(id); }
void* TierStore::pending_view(BufferId id) { return impl_->pending_view(id); }

}  // namespace strata
