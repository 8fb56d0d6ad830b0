// The offloaded optimizer state store: a rank's FP32 master weights and Adam moments, partly (the
// leading `nvme_elems` elements, offload.optimizer.fraction of them) in swap space on NVMe and the
// rest in host memory, updated by a pipelined step that streams the NVMe part through a fixed pool
// of pinned buffers (tiers.host.buffer_count × buffer_size, never more, whatever the state size).
//
// Layout. The caller's ranges (the engine's sub-groups) are cut into *chunks*: a chunk is the part
// of one range that fits a pinned buffer (master | exp_avg | exp_avg_sq, each padded to the swap
// alignment). Each NVMe chunk has its own swap extent and a CRC32C of its bytes, kept in memory
// (tiers.nvme.checksum); every read is verified, a mismatch is Error(kChecksum) naming the chunk,
// swap file and offset.
//
// The pipelined step (update()): for chunk i it reads chunk i+1.. (as many as free buffers allow)
// while `fn` updates chunk i on the calling thread, while chunk i−1.. is written back. Buffers:
//   1  serial: read, update, write, one chunk at a time (works, no overlap)
//   2  read of i+1 overlaps the update of i; the write of i−1 overlaps too when it is quick
//   ≥3 read ‖ update ‖ write
// The minimum is one buffer of 3 × alignment bytes (one padded element per array); below it the
// constructor throws Error(kInvalidArgument) saying the minimum. The pool is sized to the need
// when the whole NVMe state is smaller than buffer_count × buffer_size.
//
// Failure. Any I/O error (EIO, ENOSPC, short transfer, timeout) or checksum mismatch during
// update() stops the step: every request in flight is drained (buffers are never released with
// I/O in flight), then the error is rethrown — as IoError (same op, path, offset, errno; the
// context names the chunk, its element range, the pinned buffer and what was already applied) or
// Error(kChecksum). The store is then *failed*: chunks before the failing one are updated (and
// persisted), the rest are not, so the rank's optimizer state mixes two steps. Every later call
// throws Error(kIo) saying so; the caller must restore from the last checkpoint (or restart). This
// is the documented state of docs/offload.md; there is never a silent partial update.
//
// Ownership: owns the swap space (files removed at destruction), the pinned pool and the host part;
// shares the I/O engine (it must outlive the store: the store holds a shared_ptr).
// Thread-safety: one caller at a time (the engine's thread); the I/O engine's threads touch the
// pinned buffers only while requests are in flight.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/config.hpp"
#include "strata/io_engine.hpp"
#include "strata/partition.hpp"
#include "device/pinned_pool.hpp"
#include "tier/swap_space.hpp"
#include "zero/optimizer_state.hpp"

namespace strata {
class Device;
class PinnedPool;
class SwapSpace;
}  // namespace strata

namespace strata::zero {

struct OffloadStoreOptions {
  std::size_t nvme_elems = 0;  // leading elements on NVMe (rounded to whole elements)
  std::uint32_t buffer_count = 4;
  std::uint64_t buffer_size = 256ULL << 20;
  std::uint64_t pinned_budget = 8ULL << 30;
  std::vector<std::string> paths;
  std::uint64_t block_size = 1ULL << 20;
  std::uint64_t nvme_budget = 0;  // per rank; 0 = unlimited
  bool checksum = true;
  std::uint32_t rank = 0;
  std::chrono::milliseconds timeout{120000};  // bound on each I/O wait
  bool pipelined = true;  // false: serial read → update → write (the bench's reference)

  // From offload.optimizer and tiers.*: nvme_elems = fraction × total when the tier is nvme
  // (rounded up to a multiple of 1024 elements, at most `total`), else 0.
  static OffloadStoreOptions from(const Config& config, std::uint32_t rank, std::size_t total);
};

// Timings of the last update() or measure pass, in seconds.
struct OffloadStepStats {
  double t_step = 0;        // wall time of the whole call
  double t_update = 0;      // sum of the time spent in fn (and checksums) on the calling thread
  double t_wait_read = 0;   // time the calling thread waited for reads
  double t_wait_write = 0;  // time it waited for writes (to free a buffer or at the end)
  std::uint64_t bytes_read = 0, bytes_written = 0;
  std::size_t chunks = 0;        // NVMe chunks streamed
  std::size_t resident = 0;      // host-resident ranges updated in place
  std::uint32_t buffers = 0;     // pinned buffers used
  std::uint64_t buffer_size = 0;
};

class OffloadStateStore final : public OptimizerStateStore {
 public:
  // `init`: the rank's FP32 master weights (moments start at zero); `ranges`: the sub-groups the
  // caller will pass to update() (consecutive, covering [0, init.size())). Writes the NVMe part
  // once through the pool. Throws: Error(kInvalidArgument) (no path, buffer too small, ranges
  // not covering), Error(kBudget) (nvme budget), IoError / swap space errors.
  OffloadStateStore(const OffloadStoreOptions& options, std::span<const float> init,
                    std::vector<Range> ranges, std::shared_ptr<IoEngine> engine);
  ~OffloadStateStore() override;

  std::size_t size() const override { return total_; }
  // Synchronous access (checkpoints, tests): copies the range into host scratch; release(dirty)
  // writes it back (read-modify-write of the chunks it touches). One acquire at a time.
  StateView acquire(Range r) override;
  void release(Range r, bool dirty) override;
  // The pipelined step (see above). `ranges` must be the constructor's.
  void update(std::span<const Range> ranges, const UpdateFn& fn) override;

  // ---- measurement (strata bench step, the profiler) ----
  const OffloadStepStats& last_stats() const { return stats_; }
  // Reads every NVMe chunk (all buffers in flight, checksums verified); nothing changes.
  OffloadStepStats measure_read();
  // Runs fn over every chunk's range on one pinned buffer's contents (no I/O): the update alone.
  // The buffer holds a real chunk's state; nothing is written back.
  OffloadStepStats measure_update(const UpdateFn& fn);
  // Writes every NVMe chunk from the pinned buffers as they are (all buffers in flight) and
  // records the new checksums: the write alone. It replaces the state with buffer contents: for
  // benchmarks only.
  OffloadStepStats measure_write();
  // The step's I/O without the update: every chunk read and written back unchanged, pipelined
  // (the device's bound for the step when reads and writes share its bandwidth).
  OffloadStepStats measure_io();

  std::size_t nvme_elems() const { return nvme_elems_; }
  std::size_t chunk_count() const;
  std::uint32_t pool_buffers() const;
  std::uint64_t pool_buffer_size() const;
  std::uint64_t swap_bytes() const;
  const SwapSpace& swap_space() const { return *swap_; }
  // Swap file path and file offset of chunk k's extent (tests: flip a bit there).
  std::pair<std::string, std::uint64_t> chunk_location(std::size_t k) const;
  bool failed() const { return !failure_.empty(); }
  // Switches update() between the pipelined and the serial schedule (benchmarks).
  void set_pipelined(bool on) { opt_.pipelined = on; }
  const char* io_engine_name() const { return engine_->name(); }

 private:
  struct Chunk;
  struct Unit;
  struct Inflight;
  class Pipeline;
  void check_usable() const;
  std::size_t array_bytes(std::size_t count) const;
  void verify(const Chunk& c, const unsigned char* data, std::size_t k) const;
  void sync_io(IoOp op, std::size_t k, unsigned char* buf);
  OffloadStepStats run(const UpdateFn* fn, bool read, bool write, bool pipelined);

  OffloadStoreOptions opt_;
  std::size_t total_ = 0, nvme_elems_ = 0, chunk_elems_ = 0;
  std::vector<Range> ranges_;
  std::shared_ptr<IoEngine> engine_;
  std::unique_ptr<SwapSpace> swap_;
  std::unique_ptr<PinnedPool> pool_;
  std::uint32_t align_ = 4096;
  std::vector<float> host_master_, host_m_, host_v_;  // elements [nvme_elems, total)
  std::vector<Chunk> chunks_;
  std::vector<Unit> units_;
  std::vector<float> scratch_;  // acquire(): master | m | v
  bool acquired_ = false;
  OffloadStepStats stats_;
  std::string failure_;
};

// The NVMe share of a rank's reduced gradient partition (offload.gradients.tier nvme, stage >= 2)
// or of its stage-3 parameter partition (offload.params.tier nvme): the leading `elems` elements
// (`elem_size` bytes each, the model's dtype) in swap space, in chunks of one pinned buffer each
// (same swap space / pinned pool / CRC32C machinery as the store).
//
// Streaming. put() writes everything (all pool buffers in flight). get() and set() go through the
// *current* chunk, held in a pinned buffer, and are pipelined with the caller's work when its
// accesses ascend, as the optimizer step's do:
//   - read-ahead: a get() that loads chunk k also submits reads of k+1, k+2, ... into the free
//     pool buffers, so the next sub-group's gradients arrive while Adam runs on this one;
//   - write-behind: leaving a modified chunk submits its write and moves on without waiting; the
//     buffer returns to the pool when the write completes (waited for when a buffer is needed, by
//     flush() and put());
//   - a set() that starts at a chunk's first element starts that chunk without reading it (the
//     step overwrites every parameter in order), and reads it only if the chunk is left, read, or
//     written out before it is wholly overwritten.
// A chunk with a write in flight is never read ahead (no stale read). With one buffer everything
// is serial. Non-ascending access works too; speculative reads are then discarded.
//
// Failure: IoError (path, offset, length, errno; the context names the array and chunk) or
// Error(kChecksum) naming chunk, path and offset, raised by the get/set/flush/put that needs the
// failed transfer — for a write-behind that is the next call that waits for it (at the latest
// flush()). The optimizer state is untouched by get() failures before the step's update of that
// piece; a failed parameter write-behind leaves the engine's step failed as documented in
// docs/offload.md. No buffer is ever returned to the pool with I/O in flight, also on errors and
// in the destructor (which waits, bounded by the timeout, and logs what it gives up on).
// Ownership and thread-safety: as OffloadStateStore.
class NvmeArray {
 public:
  // `label` names the array in errors and logs ("gradients", "parameters").
  NvmeArray(const OffloadStoreOptions& options, std::size_t elems, std::size_t elem_size,
            std::shared_ptr<IoEngine> engine, std::string label = "gradients");
  ~NvmeArray();
  std::size_t elems() const { return elems_; }
  void put(const unsigned char* src);                  // elements [0, elems)
  void get(Range r, unsigned char* dst);               // r within [0, elems)
  // Stores r (see Streaming); flush() writes the current chunk when modified and waits for every
  // write-behind, after which everything set() is on NVMe.
  void set(Range r, const unsigned char* src);
  void flush();

  // Filling: replaces the whole contents from pieces that arrive in any order (the backward's
  // reduce-scatter buckets), without ever holding more than the pool. Each chunk is assembled in
  // a pinned buffer (zeroed first) and written as soon as all its elements have arrived; a chunk
  // whose buffer is needed before it is complete is written as it is and read back (and completed)
  // when the rest arrives. end_fill() writes what is still partial and every chunk that got
  // nothing, with zeros where nothing arrived, and waits for all writes. Every element must be
  // filled at most once between begin_fill() and end_fill(); get/set/put/flush are refused in
  // between. Errors as for put(); after one, begin_fill() again (or put()) before anything else.
  void begin_fill();
  void fill(Range r, const unsigned char* src);
  void end_fill();
  bool filling() const { return filling_; }

  std::uint64_t swap_bytes() const;                    // bytes of swap space held
  std::uint64_t bytes_written() const { return written_; }
  std::uint64_t bytes_read() const { return read_; }  // completed reads, read-ahead included
  std::size_t chunk_count() const { return chunks_.size(); }
  // Swap file path and file offset of chunk k's extent (tests: flip a bit there).
  std::pair<std::string, std::uint64_t> chunk_location(std::size_t k) const;

 private:
  struct Chunk {
    Range r;
    SwapExtent extent;
    std::uint64_t bytes = 0;
    std::uint32_t crc = 0;
  };
  struct Slot {  // a pinned buffer with a chunk's bytes, or a transfer of them in flight
    std::size_t k = 0;
    PinnedBuffer buf;
    IoTicket ticket = 0;  // 0: nothing in flight
  };
  std::string where(std::size_t k) const;
  IoTicket submit(IoOp op, std::size_t k, unsigned char* buf);
  void wait(IoTicket t, std::size_t k);
  void verify(std::size_t k, const unsigned char* data) const;
  void load(std::size_t k, bool for_write, std::size_t from);
  void leave_current();
  void materialize();
  void read_ahead();
  PinnedBuffer take_buffer();
  void discard(Slot&& a);
  void retire_oldest_write();
  void drain() noexcept;
  void check_usable() const;
  void require_mode(const char* call, bool filling) const;
  template <typename F>
  void for_each_piece(Range r, F&& fn);

  OffloadStoreOptions opt_;
  std::size_t elems_, es_, chunk_elems_ = 0;
  std::shared_ptr<IoEngine> engine_;
  std::string label_;
  std::unique_ptr<SwapSpace> swap_;
  std::unique_ptr<PinnedPool> pool_;
  std::vector<Chunk> chunks_;
  // The current chunk (cur_.k valid when cur_.buf): dirty_ when modified; fresh_ when started by a
  // set() at its first element without reading it, valid up to element filled_ (chunk-relative).
  Slot cur_;
  bool dirty_ = false, fresh_ = false;
  std::size_t filled_ = 0;
  std::deque<Slot> ahead_;   // reads in flight, ascending chunks
  std::deque<Slot> behind_;  // writes in flight, oldest first
  std::uint64_t written_ = 0, read_ = 0;
  bool stuck_ = false;  // an I/O wait timed out: the transfer may still be running
  // Filling state: elements received per chunk, and the chunks being assembled.
  bool filling_ = false;
  std::vector<std::size_t> fill_count_;
  std::vector<bool> fill_on_disk_;  // written partially during this fill: read back to continue
  std::deque<Slot> staged_;         // chunks being assembled, oldest first
  void write_staged(Slot&& s);
};

// The gradient spill for a rank: null unless stage >= 2 and offload.gradients.tier is nvme with a
// fraction > 0 (then fraction × partition elements, rounded up to 1024, at most the partition).
std::unique_ptr<NvmeArray> make_nvme_gradients(const Config& config, int rank, std::size_t partition,
                                                   std::size_t elem_size);
// The same for the stage-3 parameter partition (offload.params.tier nvme; model dtype).
std::unique_ptr<NvmeArray> make_nvme_params(const Config& config, int rank, std::size_t partition,
                                            std::size_t elem_size);

// Test seam (fault injection into an Engine): when set, every I/O engine that make_state_store,
// make_nvme_gradients and make_nvme_params create is passed through `wrap` together with what it
// is for ("optimizer", "gradients", "parameters") and the rank; its result is used instead. Set it
// before the engines are built and reset it (nullptr) afterwards; thread-safe.
using OffloadIoWrapper =
    std::function<std::shared_ptr<IoEngine>(std::unique_ptr<IoEngine>, const std::string& what, int rank)>;
void set_offload_io_wrapper(OffloadIoWrapper wrap);

// The device for optimizer.update: device (make_device(runtime.device)), passed through the device
// wrapper when one is set (test seam, like set_offload_io_wrapper).
std::unique_ptr<Device> make_optimizer_device(const Config& config);
using DeviceWrapper = std::function<std::unique_ptr<Device>(std::unique_ptr<Device>)>;
void set_optimizer_device_wrapper(DeviceWrapper wrap);

// The store the engine uses for a rank: resident when offload.optimizer puts nothing on NVMe, else
// an OffloadStateStore (its I/O engine from tiers.nvme, probed in the first path; missing swap
// directories are created, mode 0700).
std::unique_ptr<OptimizerStateStore> make_state_store(const Config& config, int rank,
                                                      std::span<const float> init,
                                                      std::vector<Range> ranges);

}  // namespace strata::zero
