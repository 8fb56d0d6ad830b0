// TierStore internals: per-buffer state, the job queue and the mover threads (tier_store.cpp), and
// the data paths between tiers (tier_copy.cpp).
#pragma once

#include <algorithm>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/mutex.hpp"
#include "device/pinned_pool.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/io_engine.hpp"
#include "strata/io_file.hpp"
#include "tier/swap_space.hpp"
#include "tier/tier_store.hpp"

namespace strata {

struct Transfer::State {
  Mutex mutex;
  CondVar cv;
  bool done GUARDED_BY(mutex) = false;
  std::exception_ptr error GUARDED_BY(mutex);
  void* pointer GUARDED_BY(mutex) = nullptr;
  void finish(std::exception_ptr err, void* ptr);
};

namespace tier {

inline int ti(Tier t) { return static_cast<int>(t); }
inline constexpr Tier kTiers[3] = {Tier::kGpu, Tier::kCpu, Tier::kNvme};

struct Copy {
  IoBuffer host;        // Tier::kCpu storage
  DeviceMemory gpu;     // Tier::kGpu storage
  SwapExtent extent{};  // Tier::kNvme storage (length 0 = none)
  bool valid = false;
  std::uint32_t pins = 0;
  std::uint32_t write_pins = 0;
  bool locked = false;            // host: page-locked (BufferSpec::pinned)
  bool locked_by_device = false;  // ... through Device::register_host (else mlock)
};

struct QuarantinedHost {
  IoBuffer mem;
  bool locked = false, by_device = false;  // as the Copy it came from (unlocked at shutdown)
};

// A version that is not the block's committed contents. Pinned (copy-on-write preserved it): the
// swap slot the block had (NVMe, with its CRCs, or known zero), or a staging copy in memory.
// Pending (open_pending): a new swap slot (home nvme) or a second buffer in the home tier, written
// by write_pending, until commit or discard. A memory home's pending buffer is kept after the
// commit or discard as the block's spare (Buf::spare) for the next one.
struct Version {
  Tier where = Tier::kNvme;
  SwapExtent extent{};             // kNvme
  std::vector<std::uint32_t> crc;  // kNvme: per check unit (crc_unit()), when checksums are on
  bool zero = false;               // kNvme: reads as zeros (never written)
  IoBuffer host;                   // kCpu
  bool locked = false;             // kCpu: page-locked as the block's copies (BufferSpec::pinned)
  bool locked_by_device = false;   // ... through Device::register_host (else mlock)
  DeviceMemory gpu;                // kGpu
  // Pending only: byte ranges written so far, in order (a commit takes these; the rest of the
  // block stays as committed); a write that failed (commit refused); a device copy that did not
  // finish (its memory is never reused: quarantined when the version goes).
  std::vector<std::pair<std::uint64_t, std::uint64_t>> written;
  bool failed = false;
  bool unsafe = false;
};

// One snapshot's pin of a block; `data` null while the pinned version is the committed one.
// Shared between snapshots that pinned the same committed version.
struct VersionRef {
  SnapshotId snap = 0;
  std::shared_ptr<Version> data;
};

struct SnapshotRec {
  std::vector<BufferId> ids;  // blocks still pinned
  std::uint32_t reads = 0;    // read_pinned operations queued or running
};

struct Buf {
  BufferId id = 0;
  BufferSpec spec;
  std::uint64_t padded = 0;  // bytes rounded up to the swap alignment
  bool allowed[3] = {false, false, false};
  Copy copy[3];
  bool nvme_zero = false;          // the NVMe copy is valid and all zero (never written)
  std::vector<std::uint32_t> crc;  // per check unit of the NVMe copy, when checksums are on
  std::uint32_t queued = 0;        // jobs queued or running
  bool running = false;
  // Storage an unfinished (timed-out) transfer may still touch, kept until the store shuts down;
  // a host copy keeps its page lock (a late copy may still DMA into it) until then (F11).
  std::vector<QuarantinedHost> quarantine;
  std::vector<DeviceMemory> gpu_quarantine;
  std::vector<VersionRef> versions;  // pinned versions (tier_versions.cpp)
  std::shared_ptr<Version> pending;  // the pending version, if open (tier_versions.cpp)
  // A memory home's storage for the next pending version: the last pending version's buffer, or
  // the committed storage a commit swapped out (counted in the tier's use; dropped when the tier
  // needs room, fits_locked).
  std::shared_ptr<Version> spare;
};

enum class OpKind {
  kMove,
  kPrefetch,
  kEvict,
  kAcquire,
  kRead,
  kWrite,
  kZero,
  kReadPinned,
  kWritePending,
  kCommit
};

// Whether a job changes the buffer's contents (copy-on-write runs before it).
inline bool changes_contents(OpKind k, Access a) {
  return k == OpKind::kWrite || k == OpKind::kZero || (k == OpKind::kAcquire && a != Access::kRead);
}

struct Job {
  OpKind kind;
  Buf* buf;
  Tier tier;  // kRead/kWrite: the caller's memory (kCpu host, kGpu device)
  Access access;
  std::shared_ptr<Transfer::State> state;
  // kRead / kWrite: the byte range and the caller's memory.
  std::uint64_t offset = 0, bytes = 0;
  void* ptr = nullptr;
  bool padded = false;  // kRead: the caller's memory has room for the padded buffer
  SnapshotId snap = 0;  // kReadPinned
};

// A staging buffer for one piece of a transfer: a pinned pool buffer when one is free, else a
// transient page-aligned bounce buffer (pageable) counted against the host budget while it lives,
// so that holders of pool buffers (the stream loop's slots, the filler) never starve the store.
class Staging {
 public:
  Staging() = default;
  Staging(PinnedBuffer pinned) : pinned_(std::move(pinned)) {}  // NOLINT: implicit on purpose
  Staging(IoBuffer bounce, std::function<void()> on_release)
      : bounce_(std::move(bounce)), on_release_(std::move(on_release)) {}
  Staging(Staging&& o) noexcept { *this = std::move(o); }
  Staging& operator=(Staging&& o) noexcept {
    if (this != &o) {
      reset();
      pinned_ = std::move(o.pinned_);
      bounce_ = std::move(o.bounce_);
      on_release_ = std::move(o.on_release_);
      o.on_release_ = nullptr;
    }
    return *this;
  }
  ~Staging() { reset(); }
  void* data() const { return pinned_ ? pinned_.data() : bounce_.data(); }
  std::uint8_t* bytes() const { return static_cast<std::uint8_t*>(data()); }
  explicit operator bool() const { return pinned_ || bounce_; }
  // A transfer may still touch it: never reuse the memory (leaked, the accounting kept).
  void detach() {
    pinned_.detach();
    if (bounce_) {
      static_cast<void>(new IoBuffer(std::move(bounce_)));  // deliberately leaked
      on_release_ = nullptr;
    }
  }

 private:
  void reset() {
    pinned_.release();
    if (bounce_) {
      bounce_ = IoBuffer();
      if (on_release_) on_release_();
    }
    on_release_ = nullptr;
  }
  PinnedBuffer pinned_;
  IoBuffer bounce_;
  std::function<void()> on_release_;
};

// What one mover thread owns.
struct WorkerContext {
  std::unique_ptr<Stream> stream;
  std::vector<std::unique_ptr<Event>> events;
};

}  // namespace tier

// The tier store's own files (tier_*.cpp) name these unqualified.
using tier::Buf;
using tier::Job;
using tier::kTiers;
using tier::OpKind;
using tier::ti;
using tier::WorkerContext;

class TierStore::Impl {
 public:
  Impl(const TierStoreOptions& options, Device& device, IoEngine* engine, PinnedPool* pool);
  ~Impl();

  BufferId register_buffer(const BufferSpec& spec);
  void unregister_buffer(BufferId id);
  BufferId find(const std::string& name) const;
  Transfer submit(tier::OpKind kind, BufferId id, Tier tier, Access access);
  Transfer submit_stream(tier::OpKind kind, BufferId id, std::uint64_t offset, std::uint64_t bytes,
                         void* ptr, Tier memory, bool padded = false);
  std::uint64_t padded_bytes(BufferId id) const;
  PinnedPool* pool() const { return pool_; }
  Device& device() const { return device_; }
  std::string failure() const;
  void release(BufferId id, Tier tier, Access access);
  void wait_idle(std::chrono::milliseconds timeout);
  BufferInfo info(BufferId id) const;
  TierUsage usage(Tier tier) const;
  void reserve(Tier tier, std::uint64_t bytes, const std::string& what);
  void unreserve(Tier tier, std::uint64_t bytes) noexcept;
  bool try_reserve_pinned(std::uint64_t bytes);
  void unreserve_pinned(std::uint64_t bytes) noexcept;
  TierStoreStats stats() const;
  const SwapSpace* swap() const { return swap_.get(); }
  std::pair<std::uint64_t, std::uint64_t> nvme_extent(BufferId id) const;
  // ---- versions (tier_versions.cpp)
  SnapshotId pin_committed(std::span<const BufferId> ids);
  Transfer submit_read_pinned(SnapshotId s, BufferId id, std::uint64_t offset, std::uint64_t bytes,
                              void* dst, Tier memory, bool padded);
  void unpin(SnapshotId s, const BufferId* id);  // id null: every block left
  VersionUsage version_usage() const;
  VersionBytes rewrite_cost(SnapshotId s) const;
  void open_pending(std::span<const BufferId> ids);
  Transfer submit_write_pending(BufferId id, std::uint64_t offset, std::uint64_t bytes,
                                const void* src, Tier memory);
  void commit(std::span<const BufferId> ids);
  void discard(std::span<const BufferId> ids);
  bool has_pending(BufferId id) const;
  void* pending_view(BufferId id);

 private:
  // ---- versions (tier_versions.cpp)
  // Whether a pin of `b` still shares its committed version (a change must preserve it first).
  static bool shares_committed(const tier::Buf& b);
  // Copy-on-write before a job that changes `b`'s contents (see tier_store.hpp); on a mover.
  void preserve_pinned(tier::Buf& b, tier::WorkerContext& ctx);
  // preserve_pinned()'s steps: NVMe valid (a slot swap, under the lock), or a memory copy.
  void preserve_slot_locked(tier::Buf& b) REQUIRES(mutex_);
  void preserve_copy(tier::Buf& b, Tier src, tier::WorkerContext& ctx);
  void adopt_version_locked(tier::Buf& b, std::shared_ptr<tier::Version> v) REQUIRES(mutex_);
  std::shared_ptr<tier::Version> nvme_version_locked(tier::Buf& b) REQUIRES(mutex_);
  void reserve_version_locked(const tier::Buf& b, Tier t) REQUIRES(mutex_);
  // tiers.gpu.budget or tiers.host.budget.
  std::uint64_t budget_of(Tier t) const {
    return t == Tier::kGpu ? options_.gpu_budget : options_.host_budget;
  }
  // Whether `bytes` more fit in memory tier t's budget; the host tier's cached mappings are
  // dropped first when they stand in the way.
  bool fits_locked(Tier t, std::uint64_t bytes) REQUIRES(mutex_);
  void free_version_locked(const tier::Buf& b, tier::Version& v) REQUIRES(mutex_);
  void unpin_one_locked(tier::Buf& b, SnapshotId s) REQUIRES(mutex_);
  void run_read_pinned(tier::Job& job, tier::WorkerContext& ctx);
  void read_version_nvme(tier::Buf& b, const tier::Version& v, tier::Job& job,
                         tier::WorkerContext& ctx);
  tier::SnapshotRec& snapshot_locked(SnapshotId s) REQUIRES(mutex_);
  // Throws Error(kCancelled) once the store shuts down, and its failure (kIo) once it has one.
  void check_usable_locked() const REQUIRES(mutex_) {
    if (stop_) fail(ErrorCode::kCancelled, "tier store: shutting down");
    if (!failure_.empty()) fail(ErrorCode::kIo, failure_);
  }
  // ---- pending versions (tier_versions.cpp)
  std::vector<tier::Buf*> distinct_locked(std::span<const BufferId> ids, const char* what)
      REQUIRES(mutex_);
  void wait_blocks_idle_locked(UniqueLock& lock, const std::vector<tier::Buf*>& bufs,
                               const char* what) REQUIRES(mutex_);
  std::shared_ptr<tier::Version> make_pending_locked(tier::Buf& b) REQUIRES(mutex_);
  void free_pending_locked(tier::Buf& b) REQUIRES(mutex_);
  void run_write_pending(tier::Job& job, tier::WorkerContext& ctx);
  void run_commit(tier::Buf& b, tier::WorkerContext& ctx);
  void commit_slot(tier::Buf& b, tier::Version& p, tier::WorkerContext& ctx);
  // A memory home's commit without a copy: the pending buffer becomes the home copy when it was
  // written whole and nothing holds the block; false (nothing changed) otherwise.
  bool commit_swap_locked(tier::Buf& b) REQUIRES(mutex_);
  // Page-locks a pending buffer of `b` as its copies are (lock_host), within the pinned budget;
  // nothing when `b` is not pinned.
  void lock_version_locked(const tier::Buf& b, tier::Version& v) REQUIRES(mutex_);
  // Frees a memory version's storage, unlocked first (its bytes stay counted by the caller).
  void release_memory_version_locked(const tier::Buf& b, tier::Version& v) REQUIRES(mutex_);
  // Undoes the page lock of host memory `mem` of block `b` (Device::register_host or mlock).
  void unlock_host_locked(const tier::Buf& b, const IoBuffer& mem, bool by_device) REQUIRES(mutex_);
  // Frees spares of tier t until `bytes` more fit in `budget` (or none is left).
  void drop_spares_locked(Tier t, std::uint64_t bytes, std::uint64_t budget) REQUIRES(mutex_);
  // Frees page-locked spares until `bytes` more fit in the pinned budget.
  void drop_locked_spares_locked(std::uint64_t bytes) REQUIRES(mutex_);
  // Frees b's spare (tier use and the spare count go down).
  void drop_spare_locked(tier::Buf& b) REQUIRES(mutex_);

  // ---- scheduling (tier_store.cpp)
  void worker_loop(tier::WorkerContext& ctx);
  void run_job(tier::Job& job, tier::WorkerContext& ctx);
  void renew_stream(tier::WorkerContext& ctx) noexcept;  // after a failed job
  // Completes `job` in the caller when it needs no data movement (mutex_ held, buffer idle).
  // Returns false when a mover must run it. Failures are stored in the job's state.
  bool try_inline_locked(tier::Job& job) REQUIRES(mutex_);
  // The pin step of an acquire whose copy is valid (mutex_ held); returns the address.
  void* pin_locked(tier::Buf& b, Tier t, Access access) REQUIRES(mutex_);
  // Throws unless `t` may be acquired for writing (no pins on other tiers); mutex_ held.
  void check_writable_locked(tier::Buf& b, Tier t) REQUIRES(mutex_);
  // Storage for the copy in `t` (gpu/cpu) without contents, within the budget (Access::kDiscard).
  void ensure_storage(tier::Buf& b, Tier t);
  tier::Buf& buf_locked(BufferId id) const REQUIRES(mutex_);
  // Operations; run on a mover thread, the buffer is exclusively theirs (running).
  void ensure_valid(tier::Buf& b, Tier t, tier::WorkerContext& ctx);
  // ensure_valid()'s steps.
  std::optional<Tier> choose_source_locked(tier::Buf& b, Tier t, IoBuffer* reuse) REQUIRES(mutex_);
  bool allocate_copy(tier::Buf& b, Tier t, IoBuffer reuse);
  void transfer(tier::Buf& b, Tier t, Tier src, bool fresh, tier::WorkerContext& ctx, bool* unsafe);
  void undo_copy_locked(tier::Buf& b, Tier t, bool unsafe) REQUIRES(mutex_);
  void evict_copy(tier::Buf& b, Tier from, tier::WorkerContext& ctx);
  void drop_locked(tier::Buf& b, Tier t) REQUIRES(mutex_);
  // Moves the host copy (a timed-out transfer may still touch it) into b.quarantine with its page
  // lock; pinned_used_ keeps counting it.
  void quarantine_host_locked(tier::Buf& b) REQUIRES(mutex_);
  void require_unpinned_away_locked(const tier::Buf& b, const char* verb) const REQUIRES(mutex_);
  // After a write or zero: `only` becomes the one valid copy (the memory copies besides it are
  // dropped; NVMe storage is reserved when it is `only`). `zeros`: the NVMe copy reads as zeros
  // without having been written.
  void keep_only_locked(tier::Buf& b, Tier only, bool zeros = false) REQUIRES(mutex_);
  void* copy_address(tier::Buf& b, Tier t);  // of a memory copy; takes mutex_
  // Page-locks the host copy of a pinned buffer (mutex_ not held), within pinned_budget.
  void lock_host(tier::Buf& b);
  // The pinned budget has room for `bytes` once page-locked spares are dropped (as many as needed).
  bool pinned_room_locked(std::uint64_t bytes) REQUIRES(mutex_);
  // The pinned budget's room for b's padded bytes, page-locked spares freed first, then counted;
  // Error(kBudget) naming `what` when it does not fit.
  void reserve_pinned_locked(const tier::Buf& b, const std::string& what) REQUIRES(mutex_);
  // Page-locks b's padded bytes at `mem` (room reserved): Device::register_host, else mlock;
  // true when the device took it. Error(kOutOfMemory) naming `what` when mlock fails.
  bool lock_pages(const tier::Buf& b, const IoBuffer& mem, const std::string& what);
  // Streaming operations (read / write / zero), on a mover.
  void stream_read(tier::Job& job, tier::WorkerContext& ctx);
  void stream_write(tier::Job& job, tier::WorkerContext& ctx);
  void stream_zero(tier::Buf& b, tier::WorkerContext& ctx);
  // Bytes [offset, offset + bytes) of the NVMe copy into dst (host or device), through pool pieces.
  void read_nvme_range(tier::Buf& b, std::uint64_t offset, std::uint64_t bytes, void* dst,
                       Tier memory, tier::WorkerContext& ctx, bool* unsafe);
  // A staging buffer for one piece (see tier::Staging): never blocks on the pool.
  tier::Staging take_staging();
  // Copies between memory locations on the mover's stream (any of host/device on either side).
  void copy_memory(void* dst, const void* src, std::size_t bytes, Tier dst_mem, Tier src_mem,
                   tier::WorkerContext& ctx, bool* unsafe);
  // mutex_ held: after a failed transfer, fail the store if the buffer has no valid copy left.
  void check_lost_locked(tier::Buf& b, const std::exception_ptr& err) REQUIRES(mutex_);
  // mutex_ held; budget check. For the cpu tier, a cached mapping of the right size is moved into
  // *reuse when given.
  void reserve_locked(tier::Buf& b, Tier t, IoBuffer* reuse = nullptr) REQUIRES(mutex_);
  void unreserve_locked(tier::Buf& b, Tier t) REQUIRES(mutex_);
  std::string where(const tier::Buf& b) const;

  // ---- data paths (tier_copy.cpp); the destination's storage exists. Throw on failure; never
  // return while the device or the kernel may still touch a buffer (unless `*unsafe` is set).
  void copy_host_to_nvme(tier::Buf& b, const std::uint8_t* src, bool* unsafe);
  // The same into another slot of the block's size (a pending version), its CRCs into `crc`.
  void copy_host_to_slot(tier::Buf& b, const std::uint8_t* src, const SwapExtent& slot,
                         std::vector<std::uint32_t>& crc, bool* unsafe);
  void copy_nvme_to_host(tier::Buf& b, std::uint8_t* dst, bool* unsafe);
  void copy_gpu_to_nvme(tier::Buf& b, const std::uint8_t* src, tier::WorkerContext& ctx,
                        bool* unsafe);
  void copy_nvme_to_gpu(tier::Buf& b, std::uint8_t* dst, tier::WorkerContext& ctx, bool* unsafe);
  // Bytes [offset, offset + bytes) of the NVMe copy into device memory (dst: the range's first
  // byte) through staging pieces, the device copies stream-ordered: one wait for the whole range
  // when it fits the window.
  void read_nvme_to_gpu(tier::Buf& b, std::uint64_t offset, std::uint64_t bytes, std::uint8_t* dst,
                        tier::WorkerContext& ctx, bool* unsafe);
  // The pipeline both GPU ⇄ NVMe copies run over pieces [first, end), `leg` being one direction
  // (tier_copy.cpp).
  template <typename Leg>
  void run_piece_pipeline(tier::Buf& b, std::size_t first, std::size_t end,
                          tier::WorkerContext& ctx, Leg leg);
  void copy_device(void* dst, const void* src, std::size_t bytes, tier::WorkerContext& ctx,
                   bool* unsafe);
  // CRC32C is kept per check unit (crc_unit() bytes, a divisor of the piece size of at most
  // 1 MiB), so that a read of part of a piece reads and checks only the units it touches, not the
  // whole piece (the pool's buffer size: 256 MiB in configs/default.yaml).
  // Verifies the units of bytes [off, off + len) of `b`'s NVMe copy (off a multiple of the unit;
  // len one, or reaching the end of the padded buffer) against `crc`: Error(kChecksum) naming the
  // buffer, the offset and the swap file.
  void verify_units(tier::Buf& b, const std::vector<std::uint32_t>& crc, std::uint64_t slot,
                    std::uint64_t off, const void* data, std::uint64_t len,
                    const std::string& what);
  void verify_piece(tier::Buf& b, std::size_t piece, const void* data, std::uint64_t len);
  // Bytes [lo, hi) of an NVMe slot (inside one piece) through a staging buffer, only the check
  // units they touch read and verified (tier_stream.cpp). Returns the bytes read.
  std::uint64_t read_staged(tier::Buf& b, const std::vector<std::uint32_t>& crc, std::uint64_t slot,
                            std::uint64_t lo, std::uint64_t hi, std::uint8_t* dst, Tier memory,
                            tier::WorkerContext& ctx, bool* unsafe, const std::string& what);
  // The CRCs of the units of bytes [off, off + len) into `crc` (when checksums are on).
  void checksum_units(std::vector<std::uint32_t>& crc, std::uint64_t off, const void* data,
                      std::uint64_t len) const;
  std::uint64_t crc_unit() const { return std::gcd(piece_size(), std::uint64_t{1} << 20); }
  std::size_t crc_units(const tier::Buf& b) const {
    return static_cast<std::size_t>((b.padded + crc_unit() - 1) / crc_unit());
  }
  // [lo, hi) widened to whole check units, hi at most the padded end of `b`.
  std::pair<std::uint64_t, std::uint64_t> unit_span(const tier::Buf& b, std::uint64_t lo,
                                                    std::uint64_t hi) const {
    const std::uint64_t u = crc_unit();
    return {lo / u * u, std::min<std::uint64_t>((hi + u - 1) / u * u, b.padded)};
  }
  std::uint64_t piece_size() const { return pool_ ? pool_->buffer_size() : (1ULL << 20); }
  std::size_t pieces(const tier::Buf& b) const {
    return static_cast<std::size_t>((b.padded + piece_size() - 1) / piece_size());
  }
  // Bytes of piece i of b (the last one may be shorter).
  std::uint64_t piece_len(const tier::Buf& b, std::size_t i) const {
    return std::min<std::uint64_t>(piece_size(), b.padded - i * piece_size());
  }

  TierStoreOptions options_;
  Device& device_;
  IoEngine* engine_;  // null without an NVMe tier
  PinnedPool* pool_;  // null without staging
  std::unique_ptr<SwapSpace> swap_;
  std::uint32_t align_ = 4096;
  std::uint32_t window_ = 1;  // pinned buffers one transfer may hold

  mutable Mutex mutex_;
  CondVar work_cv_;   // a job was queued or stop_
  CondVar state_cv_;  // a job finished
  std::unordered_map<BufferId, std::unique_ptr<tier::Buf>> bufs_ GUARDED_BY(mutex_);
  std::deque<tier::Job> queue_ GUARDED_BY(mutex_);
  std::uint32_t running_ GUARDED_BY(mutex_) = 0;
  BufferId next_id_ GUARDED_BY(mutex_) = 1;
  std::uint64_t used_[3] GUARDED_BY(mutex_) = {0, 0, 0};
  TierStoreStats stats_ GUARDED_BY(mutex_);
  // Freed host copies by size, for reuse (see TierUsage::cached).
  std::multimap<std::uint64_t, IoBuffer> host_cache_ GUARDED_BY(mutex_);
  std::uint64_t cached_ GUARDED_BY(mutex_) = 0;  // bytes in host_cache_
  bool stop_ GUARDED_BY(mutex_) = false;
  std::string failure_ GUARDED_BY(mutex_);
  std::uint64_t pinned_used_ GUARDED_BY(mutex_) = 0;
  std::map<SnapshotId, tier::SnapshotRec> snapshots_ GUARDED_BY(mutex_);
  SnapshotId next_snapshot_ GUARDED_BY(mutex_) = 1;
  std::uint64_t version_bytes_[3] GUARDED_BY(mutex_) = {0, 0, 0};
  std::uint64_t pending_bytes_[3] GUARDED_BY(mutex_) = {0, 0, 0};
  std::uint64_t pending_blocks_ GUARDED_BY(mutex_) = 0;
  std::uint64_t spare_bytes_[3] GUARDED_BY(mutex_) = {0, 0, 0};  // Buf::spare, per tier

  Mutex admin_mutex_;
  std::unique_ptr<Stream> admin_stream_ GUARDED_BY(admin_mutex_);
  std::vector<std::unique_ptr<tier::WorkerContext>> contexts_;
  std::vector<std::thread> workers_;
};

}  // namespace strata
