// TierStore: a rank's one storage layer. Named buffers (an FP32 master shard, a moment shard, a
// gradient chunk, the model-dtype parameters...) with a home tier, moved asynchronously between
// GPU memory (the Device), host memory and NVMe (the SwapSpace, through the IoEngine), within hard
// per-tier budgets, never losing or corrupting a byte. The engine (src/zero) keeps every byte of
// a rank's training state here; the streaming loop (tier/stream_loop.hpp) and the filler
// (tier/fill.hpp) move it through the pinned pool.
//
// Model. Each buffer has at most one copy per tier. A copy is *valid* when it holds the current
// contents. register_buffer() creates a zero-filled valid copy in the home tier (on NVMe: an
// extent known to be zero, no I/O). Operations, each asynchronous and returning a Transfer:
//   prefetch(id, t)  make the copy in t valid (copying from the nearest valid copy); keep others.
//   move(id, t)      prefetch, then drop the memory-tier (gpu/cpu) copies other than t. A valid
//                    NVMe copy is kept (it is clean: a later move to NVMe writes nothing).
//   evict(id, t)     drop the copy in t; when it is the only valid copy, first write it to the
//                    next lower allowed tier (gpu → cpu → nvme). A clean copy is not rewritten.
//   acquire(id, t, access)  prefetch, then pin the copy in t and return its address (t gpu or cpu).
//                    With Access::kWrite the other copies become invalid (the caller will modify
//                    it); this needs no pins on other tiers. release(id, t) unpins.
// Streaming (no copy is created: the caller's memory is the other end):
//   read(id, range, dst)   the current contents of a byte range into caller memory (host, or
//                    device memory of the store's Device), from the valid copy nearest to dst.
//                    From NVMe: the pieces holding the range are read and their CRCs checked;
//                    pieces wholly inside the range land straight in 4096-aligned host memory,
//                    the others (edges, the padded tail, device memory) pass a pool buffer.
//   write(id, range, src)  replaces a byte range: the home copy is written and becomes the only
//                    valid copy (the others are dropped). Home nvme: the whole buffer only, from
//                    4096-aligned host memory holding padded_bytes() (the padding is written too),
//                    or from device memory through the pool; fresh CRCs.
//   zero(id)         the contents become zero (an NVMe home is marked zero: no I/O).
// Operations on one buffer run one at a time in submission order; different buffers run in
// parallel on the mover threads (each with its own device stream: the store's copy streams). An
// operation that needs no data movement (acquiring a valid copy, dropping a clean one) on a
// buffer with nothing queued completes at once in the caller. Nothing reads a copy while a
// transfer into it is in flight: an acquire waits behind the transfer. A pinned copy is never
// dropped; a transfer that would drop it, or write a copy pinned on another tier, is failed
// (Error(kInvalidArgument) naming the buffer and the pins). A write or zero into a home copy that
// is pinned on its own tier is allowed (the pin holder coordinates with it, like a kWrite acquire).
// NVMe ⇄ GPU goes through the pinned pool in pieces of buffer_size, overlapping the NVMe leg of one
// piece with the PCIe leg of another. NVMe → GPU copies are stream-ordered: the mover waits for a
// piece's copy only when its staging buffer is needed again, and once at the leg's end (F9). Host ⇄
// NVMe goes directly from the host copy (page-aligned). A piece takes a pool buffer when one is
// free; when every one is held (by the stream loop's slots, the filler) it takes a transient
// page-aligned bounce buffer instead, counted against the host budget while it lives: holders of
// pool buffers never starve the store's own transfers.
//
// Budgets (checked when the transfer starts; failing = Error(kBudget) at the wait, nothing
// changed): gpu copies ≤ gpu_budget; host copies + the pinned pool ≤ host_budget; NVMe extents ≤
// the swap space reserved at construction. The engine passes per-rank budgets (DESIGN.md: every
// budget is enforced once, here).
// Checksums (checksum): CRC32C per check unit (the largest power of two up to 1 MiB that divides
// the pool's buffer size) of every NVMe write, verified on every read back (a read of part of a
// block reads and checks only the units it touches); a mismatch fails the transfer with
// Error(kChecksum) naming the buffer, the offset in the buffer and the swap file and offset. The
// destination stays invalid, the source stays valid.
//
// Failures of a transfer surface at its Transfer::wait(), never silently: I/O errors as IoError,
// device errors as Error(kDevice). A failed transfer leaves the source copy valid and the
// destination invalid. Waits take timeouts (Error(kTimeout)). The failed state: a transfer after
// which a buffer has no valid copy left (a write to NVMe that failed after the other copies were
// dropped) makes the store *failed*: every later operation throws Error(kIo) naming the buffer and
// the first error (failure() says it too); the contents are lost, restore a checkpoint.
//
// Ownership: the store borrows the Device, IoEngine and PinnedPool (they must outlive it; the
// engine and pool may be null when there is no NVMe tier and nothing is staged) and owns the
// SwapSpace (created at construction: swap files, fallocate) and every copy. The destructor waits
// for queued transfers (bounded), frees every copy and removes the swap files.
// Thread-safety: every member may be called concurrently from any thread. Addresses from acquire()
// stay valid until the matching release().
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/config.hpp"

namespace strata {

class Device;
class IoEngine;
class PinnedPool;
class SwapSpace;

using BufferId = std::uint32_t;
// A set of pinned versions (pin_committed): a checkpoint's snapshot of a rank's state blocks.
using SnapshotId = std::uint64_t;

// kRead: the caller only reads. kWrite: the caller modifies (the other copies become invalid).
// kDiscard: the caller overwrites every byte: like kWrite, but the current contents are not
// brought in (no copy, no zero-fill; the bytes are undefined until written).
enum class Access { kRead, kWrite, kDiscard };

struct BufferSpec {
  std::string name;         // unique in the store
  std::uint64_t bytes = 0;  // > 0, any value (copies are padded to the I/O alignment)
  DType dtype = DType::kFp32;
  Tier home = Tier::kCpu;
  std::vector<Tier> allowed;  // empty = all tiers; must contain home
  // Host copies page-locked (offload.X.pin_memory): cudaHostRegister on a GPU (asynchronous device
  // copies), mlock on the host device; counted against pinned_budget with the pool.
  bool pinned = false;
};

struct TierStoreOptions {
  std::uint64_t gpu_budget = 80'000'000'000ULL;  // tiers.gpu.budget
  std::uint64_t host_budget = 512ULL << 30;      // tiers.host.budget (includes the pinned pool)
  std::uint64_t pinned_budget = ~0ULL;           // page-locked bytes: the pool + pinned host copies
  // NVMe swap space reserved for this rank at construction; 0 = no NVMe tier.
  std::uint64_t nvme_capacity = 0;
  std::vector<std::string> nvme_paths;    // tiers.nvme.paths
  std::uint64_t block_size = 1ULL << 20;  // tiers.nvme.block_size (stripe unit)
  bool checksum = true;                   // tiers.nvme.checksum
  std::uint32_t rank = 0;
  std::uint32_t movers = 2;                   // threads running transfers (>= 1)
  std::chrono::milliseconds timeout{120000};  // bound on internal waits (I/O, device, pool)

  // From the YAML. nvme_capacity: `nvme_capacity` if > 0, else tiers.nvme.budget divided among
  // the node's ranks (0 when both are 0).
  static TierStoreOptions from(const Config& config, std::uint32_t rank,
                               std::uint64_t nvme_capacity = 0);
};

// The handle of one asynchronous operation. Copyable (shared state); a default-constructed one is
// complete.
class Transfer {
 public:
  struct State;
  Transfer() = default;
  explicit Transfer(std::shared_ptr<State> state) : state_(std::move(state)) {}
  bool ready() const;
  // Blocks until done; rethrows the operation's error (every waiter gets it); Error(kTimeout) past
  // `timeout` (the operation keeps running).
  void wait(std::chrono::milliseconds timeout = std::chrono::minutes(2)) const;
  // For acquire(): the pinned address, after wait().
  void* pointer() const;

 private:
  std::shared_ptr<State> state_;
};

struct BufferInfo {
  std::string name;
  std::uint64_t bytes = 0;
  DType dtype = DType::kFp32;
  Tier home = Tier::kCpu;
  bool valid[3] = {false, false, false};      // indexed by Tier: holds the current contents
  bool allocated[3] = {false, false, false};  // has storage in the tier
  std::uint32_t pins[3] = {0, 0, 0};
  bool in_flight = false;  // an operation is queued or running
  bool dirty = false;      // the contents are not on NVMe (a write-back would write)
};

struct TierUsage {
  std::uint64_t used = 0;    // bytes held by copies (and the pinned pool for cpu)
  std::uint64_t budget = 0;  // capacity for nvme
  // cpu only: freed host copies kept mapped for reuse (no page faults on the next copy of the
  // same size). They count against the budget and are unmapped first when room is needed.
  std::uint64_t cached = 0;
  // cpu only: page-locked bytes counted against pinned_budget (the pool, pin_memory copies and
  // their spares, reserve_pinned).
  std::uint64_t pinned = 0;
};

struct TierStoreStats {
  std::uint64_t bytes_to_nvme = 0, bytes_from_nvme = 0;
  std::uint64_t bytes_to_gpu = 0, bytes_from_gpu = 0;
  std::uint64_t writes_skipped_clean = 0;  // write-backs avoided because the NVMe copy was valid
  std::uint64_t checksum_failures = 0;
  std::uint64_t reads = 0, writes = 0;  // streaming read() / write() calls completed
};

// Bytes per tier (indexed by Tier) held or needed by versions.
struct VersionBytes {
  std::uint64_t bytes[3] = {0, 0, 0};
  std::uint64_t operator[](Tier t) const { return bytes[static_cast<int>(t)]; }
};

// What versions other than the committed ones hold (docs/versioned_state.md).
struct VersionUsage {
  VersionBytes held;                  // storage of pinned versions that were rewritten since
  std::uint32_t snapshots = 0;        // live snapshots
  std::uint64_t pinned_blocks = 0;    // (snapshot, block) pairs still pinned
  std::uint64_t diverged_blocks = 0;  // of them, holding their own storage (rewritten since)
  VersionBytes pending;               // storage of open pending versions (open_pending)
  std::uint64_t pending_blocks = 0;   // blocks with an open pending version
  // Memory kept from pending versions for the next ones (cpu / gpu homes; counted in the tier's
  // use, freed first when the tier needs room).
  VersionBytes spare;
};

class TierStore {
 public:
  // `engine` and `pool` may be null without an NVMe tier (nvme_capacity 0); without a pool,
  // nothing can be staged (GPU ⇄ NVMe, ranged NVMe reads, tier/stream_loop.hpp on the host).
  TierStore(const TierStoreOptions& options, Device& device, IoEngine* engine, PinnedPool* pool);
  TierStore(const TierStoreOptions& options, Device& device, IoEngine& engine, PinnedPool& pool)
      : TierStore(options, device, &engine, &pool) {}
  ~TierStore();
  TierStore(const TierStore&) = delete;
  TierStore& operator=(const TierStore&) = delete;

  // Throws Error(kInvalidArgument) for a duplicate name, 0 bytes, home not allowed, and
  // Error(kBudget) when the home tier cannot hold it.
  BufferId register_buffer(const BufferSpec& spec);
  // Waits for the buffer's queued operations (bounded); fails if it is pinned.
  void unregister_buffer(BufferId id);
  BufferId find(const std::string& name) const;  // Error(kInvalidArgument) if unknown

  Transfer move(BufferId id, Tier to);
  Transfer prefetch(BufferId id, Tier to);
  Transfer evict(BufferId id, Tier from);
  Transfer acquire_async(BufferId id, Tier tier, Access access);
  // acquire_async + wait: the address of the pinned copy.
  void* acquire(BufferId id, Tier tier, Access access,
                std::chrono::milliseconds timeout = std::chrono::minutes(2));
  // `access`: what the acquire being ended asked for. A writer's release ends its write (the block
  // may be pinned by a snapshot again while readers still hold it); kRead, also when the caller
  // does not know: the write of the last holder ends with it.
  void release(BufferId id, Tier tier, Access access = Access::kRead);

  // Streaming (see the model above). `offset`/`bytes` select a byte range of the contents (bytes
  // 0 = to the end); `memory` says whether the caller's pointer is host memory (kCpu) or device
  // memory of this store's Device (kGpu). The caller's memory must stay valid until the wait.
  // padded: `dst` (host) has room for padded_bytes(): a whole NVMe buffer is read straight into it,
  // padding included.
  Transfer read(BufferId id, std::uint64_t offset, std::uint64_t bytes, void* dst,
                Tier memory = Tier::kCpu, bool padded = false);
  Transfer write(BufferId id, std::uint64_t offset, std::uint64_t bytes, const void* src,
                 Tier memory = Tier::kCpu);
  Transfer zero(BufferId id);
  // The buffer's size rounded up to the swap alignment: what an NVMe copy occupies.
  std::uint64_t padded_bytes(BufferId id) const;

  // Memory held outside the store's buffers (tier/scratch_arena.hpp: runtime scratch) counted
  // against a memory tier's budget, so that one budget covers state and scratch alike.
  // reserve: Error(kBudget) naming `what`, the tier, the bytes in use and the budget key when
  // `bytes` do not fit (nothing reserved); tier gpu or cpu. unreserve gives back what reserve took.
  void reserve(Tier tier, std::uint64_t bytes, const std::string& what);
  void unreserve(Tier tier, std::uint64_t bytes) noexcept;
  // Page-locked host memory outside the store's buffers (tier/fill.hpp's staging buffer), counted
  // against pinned_budget and the host tier's budget. try_reserve_pinned: false (nothing reserved)
  // when `bytes` do not fit after page-locked spares are dropped. unreserve_pinned gives back what
  // try_reserve_pinned took.
  bool try_reserve_pinned(std::uint64_t bytes);
  void unreserve_pinned(std::uint64_t bytes) noexcept;
  // Waits until no operation is queued or running.
  void wait_idle(std::chrono::milliseconds timeout = std::chrono::minutes(2));

  BufferInfo info(BufferId id) const;
  TierUsage usage(Tier tier) const;
  TierStoreStats stats() const;
  const SwapSpace* swap_space() const;  // null without an NVMe tier
  PinnedPool* pool() const;             // null without one
  Device& device() const;
  // Empty while usable; else what failed the store (see "The failed state").
  std::string failure() const;
  // Where the buffer's NVMe extent lies (tests): {swap offset, length}; {0,0} if none.
  std::pair<std::uint64_t, std::uint64_t> nvme_extent(BufferId id) const;

  // ---- Versioned state (docs/versioned_state.md): the snapshot half.
  // A block has one *committed* version (its contents as every other operation sees them) and may
  // have *pinned* ones. pin_committed(ids) pins the committed version of every block at once: the
  // contents after every operation submitted before the call (it waits, bounded, for the blocks'
  // queued operations). Refused (Error(kInvalidArgument), nothing pinned) for an unknown or
  // repeated id, or a block acquired for writing (its contents may change under the pin).
  // Copy-on-write: an operation that changes a pinned block's contents (write, zero, an acquire
  // for kWrite / kDiscard) first preserves the pinned version, once per pin:
  //   - the block's NVMe copy is valid: the pinned version keeps that swap slot (and its CRCs);
  //     the block gets a new slot (SwapSpace::allocate). No data is copied.
  //   - else (the contents live in gpu / host memory only): the valid memory copy (host preferred)
  //     is copied into a staging buffer of the same tier, counted against that tier's budget.
  // Budget policy: when the new slot or the staging copy does not fit, the changing operation
  // fails with Error(kBudget) naming the block and the snapshot, nothing changed (committed and
  // pinned versions as they were). A caller that must not fail waits for the snapshot's reader to
  // unpin first: rewrite_cost(s) says what rewriting every block still shared would take, per tier
  // (the engine compares it with the tiers' headroom before a step).
  // read_pinned: the pinned version's bytes [offset, offset + bytes) (bytes 0 = to the end) into
  // the caller's memory, as read() (NVMe: CRC-checked); runs in the block's order with its other
  // operations. unpin(s, id) ends one block's pin (the reader is done with it), unpin(s) the rest
  // of the snapshot; both wait (bounded) for the snapshot's reads in flight, then free what the
  // pinned versions held (slots back to the extent allocator, staging memory to the budget).
  // A failed operation never touches a pinned version: the pin stays readable, also once the store
  // is failed (read_pinned and unpin are the operations a failed store still runs: a checkpoint of
  // the step before the failure can be finished). unregister_buffer() of a pinned block is
  // refused.
  SnapshotId pin_committed(std::span<const BufferId> ids);
  Transfer read_pinned(SnapshotId s, BufferId id, std::uint64_t offset, std::uint64_t bytes,
                       void* dst, Tier memory = Tier::kCpu, bool padded = false);
  void unpin(SnapshotId s, BufferId id);
  void unpin(SnapshotId s);
  VersionUsage version_usage() const;
  // Bytes per tier that rewriting every block of `s` still sharing its committed version would
  // hold (nvme: new slots; gpu / cpu: staging copies).
  VersionBytes rewrite_cost(SnapshotId s) const;

  // ---- Versioned state: the pending half (the speculative update, issue 26).
  // open_pending(ids) gives every block a *pending* version beside its committed one, storage
  // only (its bytes are undefined until written): home nvme a new swap slot (SwapSpace::allocate),
  // home cpu / gpu a second buffer of the block's padded size counted against that tier's budget.
  // All or none: Error(kBudget) when one does not fit, Error(kInvalidArgument) for an unknown or
  // repeated id or a block that already has one; nothing opened then.
  // write_pending(id, ...) writes a byte range of the pending version from the caller's memory (as
  // write(), in the block's order with its other operations); home nvme: the whole block only,
  // from 4096-aligned host memory holding padded_bytes() (device memory: Error(kUnsupported)).
  // Every other operation (read, acquire, pin_committed, read_pinned...) sees the committed
  // version: a pending one is never read before it is committed. A failed write_pending leaves
  // the committed version untouched and the store usable; the pending version is marked failed.
  // pending_view(id): a memory home's pending version itself (cpu: host memory, page-locked as the
  // block's copies when BufferSpec::pinned; gpu: device memory), valid until the commit or
  // discard; the caller writes it directly and then declares each range with
  // write_pending(id, offset, bytes, pending_view(id) + offset): nothing is copied then, the
  // range is recorded. Home nvme or no pending version: Error(kInvalidArgument).
  // commit(ids): each block's pending version becomes its committed one, in the block's order
  // (after its queued operations): nvme: the pending slot becomes the block's NVMe copy (no data
  // copied; the old slot is freed, or kept by the snapshots that pin it), the memory copies
  // dropped; cpu / gpu, written whole ([0, bytes)) and no copy of the block acquired: the pending
  // buffer becomes the home copy (no data copied; the old buffer goes to the snapshots that pin
  // it, else is kept for the block's next pending version), the other tiers' copies dropped;
  // cpu / gpu otherwise: the written ranges are copied into the home copy (copy-on-write first for
  // a pinned block, as for write()), the rest of the block keeps its committed bytes. Refused,
  // nothing changed, when a block has no pending version, or one whose write failed, or (nvme)
  // one not wholly written (Error(kInvalidArgument)). A commit job that fails (I/O, budget of a
  // copy-on-write) throws; the blocks committed before it stay committed, the failing one keeps
  // its old version and its pending one is freed. discard(ids) frees the pending versions (after
  // the blocks' queued operations), committed versions unchanged; blocks without one are skipped.
  void open_pending(std::span<const BufferId> ids);
  Transfer write_pending(BufferId id, std::uint64_t offset, std::uint64_t bytes, const void* src,
                         Tier memory = Tier::kCpu);
  void commit(std::span<const BufferId> ids);
  void discard(std::span<const BufferId> ids);
  bool has_pending(BufferId id) const;
  void* pending_view(BufferId id);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
