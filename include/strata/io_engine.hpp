// IoEngine: asynchronous file I/O for the NVMe tier. Two implementations behind one interface:
//   io_uring  (liburing; rings driven by their own threads, registered buffers/files)
//   threads   (pread/pwrite worker pool; where io_uring is blocked or broken)
// make_io_engine() picks one (probing io_uring with a real write/read round trip) and logs why.
//
// Model. The caller opens IoFiles (io_file.hpp), registers them (or a striped set of them) and
// gets a FileId. It submits IoRequests (op, file, buffer, length, offset), singly or as a batch,
// and gets one IoTicket per submit call. Each request is split into block_size pieces; up to
// queue_depth pieces are in flight per ring/worker, the rest wait in the engine's queue.
//
// Contract.
// - Buffer ownership: the caller owns every buffer. From submit() until the ticket is retired
//   (wait()/poll() returned true or threw for it, or wait_all() returned or threw) the engine may
//   read (write requests) or fill (read requests) it: the caller must keep it alive and must not
//   touch it. A ticket is never reported done while any piece of it is still in the kernel, also
//   when one piece already failed, so after the wait the buffer is the caller's again.
// - Thread-safety: every member function may be called concurrently from any number of threads
//   (many submitters and waiters). Each ticket should be waited/polled by one thread; a ticket
//   already retired (or retired by wait_all) counts as done: wait/poll return true at once.
// - Alignment: when the file (any file of a striped set) is O_DIRECT, buffer address, offset and
//   length must be multiples of alignment(file) (statx DIOALIGN, else 4096). Violations, unknown
//   file ids, zero length, a read-only file written, or offset+length past a striped file's
//   capacity are rejected by submit() with Error(kInvalidArgument) before anything of the call
//   (of any request of the batch) is submitted. Buffered files take any alignment.
// - Completion handling: short transfers are completed by resubmitting the rest (under O_DIRECT
//   the whole aligned remainder); -EAGAIN and -EINTR are retried (counted in stats().retries).
//   A read that hits end of file (0 bytes) fails with IoError errnum 0 ("short read").
// - Failures surface at the wait/poll that observes the ticket, as IoError(op "read"/"write",
//   path of the file that failed, file offset, length of the failing piece, errno), never at
//   submit (submit throws only for invalid arguments or Error(kCancelled) after shutdown).
//   For a batch, the first failing request (in batch order) is the one thrown.
// - Timeouts: wait(ticket, timeout) and wait_all(timeout) return false when the deadline passes
//   (the ticket stays valid; wait again). wait_for()/wait_all_for() throw Error(kTimeout) instead.
// - Shutdown (shutdown() or destructor) with requests in flight: stops accepting submissions,
//   drains what is queued and in the kernel for up to `shutdown_timeout`, then cancels the rest
//   (IORING_OP_ASYNC_CANCEL; queued, unsubmitted pieces are dropped). Cancelled tickets throw
//   Error(kCancelled) at their wait. Waits never block forever; the destructor returns once the
//   kernel has released every buffer (it waits for cancelled pieces' completions, bounded).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/config.hpp"
#include "strata/io_file.hpp"

namespace strata {

struct IoEngineOptions {
  IoEngineKind kind = IoEngineKind::kAuto;  // kAuto: io_uring if the probe passes, else threads
  std::uint64_t block_size = 1ULL << 20;    // split unit and stripe unit; multiple of 4096
  std::uint32_t queue_depth = 32;           // pieces in flight per ring / worker pool, 1..4096
  // io_uring: number of rings, each driven by its own thread (pieces go round-robin).
  // threads: io_threads x queue_depth pread/pwrite workers (capped at 256), so that queue_depth
  // means "pieces in flight" for both engines.
  std::uint32_t io_threads = 1;
  DirectIoMode direct_io = DirectIoMode::kAuto;  // used by open_file() and the probe
  bool sqpoll = false;                           // io_uring: kernel submission-queue polling thread
  std::chrono::milliseconds shutdown_timeout{30000};

  static IoEngineOptions from(const NvmeTierConfig& config);
  // Throws Error(kInvalidArgument) for out-of-range values.
  void validate() const;
};

enum class IoOp { kRead, kWrite };
const char* io_op_name(IoOp op);  // "read" | "write"

using FileId = std::uint32_t;
using IoTicket = std::uint64_t;  // 0 is never a valid ticket

struct IoRequest {
  IoOp op = IoOp::kRead;
  FileId file = 0;
  void* buffer = nullptr;
  std::uint64_t length = 0;
  std::uint64_t offset = 0;  // logical offset (for a striped file: in the striped space)
};

// A memory region handed to register_buffers(): requests whose buffer lies entirely inside one
// region use READ_FIXED/WRITE_FIXED on io_uring (no per-I/O page pinning).
struct IoRegion {
  void* base = nullptr;
  std::size_t length = 0;
};

struct IoStats {
  std::uint64_t bytes_read = 0;  // completed successfully
  std::uint64_t bytes_written = 0;
  std::uint64_t requests = 0;      // IoRequests completed (success or failure)
  std::uint64_t pieces = 0;        // block-size pieces submitted to the kernel / workers
  std::uint64_t retries = 0;       // resubmissions: short transfers, EAGAIN, EINTR
  std::uint64_t failures = 0;      // requests that failed
  std::uint64_t fixed_pieces = 0;  // pieces that used a registered buffer
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;

  virtual IoEngineKind kind() const = 0;  // kIoUring or kThreads (never kAuto)
  virtual const char* name() const = 0;   // "io_uring", "threads", "fault(io_uring)"...
  virtual const IoEngineOptions& options() const = 0;

  // Opens `path` with this engine's direct_io mode (IoFileOptions::direct_io is overridden)
  // and registers it. Convenience for open + register_file.
  FileId open_file(const std::string& path, IoFileOptions file_options = {});

  // Registers a file; the engine shares ownership until unregister_file(). Thread-safe.
  virtual FileId register_file(std::shared_ptr<IoFile> file) = 0;
  // One logical space over several files in block_size stripes: logical block b lives in
  // files[b % n] at offset (b / n) * block_size. Capacity is unbounded by the engine (files grow
  // on write), but every file must share the same O_DIRECT-ness. Throws kInvalidArgument for an
  // empty list.
  virtual FileId register_striped(std::vector<std::shared_ptr<IoFile>> files) = 0;
  // Drops the engine's reference. Requests on it must be complete (else kInvalidArgument).
  virtual void unregister_file(FileId id) = 0;
  // Alignment required for requests on `id` (max over a striped set); kInvalidArgument if unknown.
  virtual std::uint32_t alignment(FileId id) const = 0;
  // Path for messages ("a|b|c" for a striped set).
  virtual std::string describe_file(FileId id) const = 0;

  // Registers memory regions for fixed-buffer I/O (called once by the pinned pool; a later call
  // replaces the set and requires that no request is in flight). Failure to register with the
  // kernel (e.g. RLIMIT_MEMLOCK) is logged and I/O continues without fixed buffers. The thread
  // engine accepts and ignores it. The regions must stay mapped until replaced or the engine dies.
  virtual void register_buffers(std::span<const IoRegion> regions) = 0;

  // Submits one request / a batch; the batch is one ticket done when all its requests are.
  virtual IoTicket submit(const IoRequest& request) = 0;
  virtual IoTicket submit_batch(std::span<const IoRequest> requests) = 0;

  // true: done (retired); throws its IoError/kCancelled if it failed. false: timed out.
  virtual bool wait(IoTicket ticket, std::chrono::nanoseconds timeout) = 0;
  // Like wait() with a zero timeout.
  virtual bool poll(IoTicket ticket) = 0;
  // Waits for every ticket submitted before the call and retires them all. Throws the failure
  // of the lowest-numbered failed ticket among them (all of them are retired anyway).
  virtual bool wait_all(std::chrono::nanoseconds timeout) = 0;

  void wait_for(IoTicket ticket, std::chrono::nanoseconds timeout);  // throws kTimeout
  void wait_all_for(std::chrono::nanoseconds timeout);               // throws kTimeout

  virtual IoStats stats() const = 0;
  // See the contract above. Idempotent; submit() afterwards throws Error(kCancelled).
  virtual void shutdown() = 0;
};

// Decorator (like leveldb's EnvWrapper, and DeviceWrapper in device.hpp): every call is forwarded
// to the owned inner engine; a wrapper overrides only what it changes (FaultInjectingIoEngine).
// REQUIRES: inner is not null.
class IoEngineWrapper : public IoEngine {
 public:
  explicit IoEngineWrapper(std::unique_ptr<IoEngine> inner) : inner_(std::move(inner)) {}
  IoEngine& inner() const { return *inner_; }

  IoEngineKind kind() const override { return inner_->kind(); }
  const char* name() const override { return inner_->name(); }
  const IoEngineOptions& options() const override { return inner_->options(); }
  FileId register_file(std::shared_ptr<IoFile> file) override {
    return inner_->register_file(std::move(file));
  }
  FileId register_striped(std::vector<std::shared_ptr<IoFile>> files) override {
    return inner_->register_striped(std::move(files));
  }
  void unregister_file(FileId id) override { inner_->unregister_file(id); }
  std::uint32_t alignment(FileId id) const override { return inner_->alignment(id); }
  std::string describe_file(FileId id) const override { return inner_->describe_file(id); }
  void register_buffers(std::span<const IoRegion> regions) override {
    inner_->register_buffers(regions);
  }
  IoTicket submit(const IoRequest& request) override { return inner_->submit(request); }
  IoTicket submit_batch(std::span<const IoRequest> requests) override {
    return inner_->submit_batch(requests);
  }
  bool wait(IoTicket ticket, std::chrono::nanoseconds timeout) override {
    return inner_->wait(ticket, timeout);
  }
  bool poll(IoTicket ticket) override { return inner_->poll(ticket); }
  bool wait_all(std::chrono::nanoseconds timeout) override { return inner_->wait_all(timeout); }
  IoStats stats() const override { return inner_->stats(); }
  void shutdown() override { inner_->shutdown(); }

 private:
  std::unique_ptr<IoEngine> inner_;
};

// io_uring probe: sets up a ring with this engine's flags and does a real write + read round
// trip (O_DIRECT per options.direct_io) of a temporary file in `dir` (removed afterwards).
struct IoUringProbe {
  bool ok = false;
  std::string reason;  // why not (errno text and which step), empty when ok
  // Set when the probe file could not be created for a reason that is not io_uring's (the
  // directory is unusable, unsafe, or refuses O_DIRECT with direct_io: required): the same
  // failure would meet any engine, so make_io_engine() throws it instead of falling back.
  std::exception_ptr file_error;
};
// Writes and reads back 4 KiB through a fresh ring, on a file created (O_EXCL, unlinked at once)
// in `dir` opened safely (src/core/safe_fs.hpp); a `dir` that does not exist yet is probed in
// its nearest existing ancestor, the file system it will be created on.
IoUringProbe probe_io_uring(const IoEngineOptions& options, const std::string& dir);

// Builds the engine for options.kind:
//   kAuto      probe io_uring in `probe_dir`; on failure use threads and log_warn one line with
//              the reason ("io_uring unavailable (<reason>); using the thread-pool engine").
//   kIoUring   probe; on failure throw Error(kUnsupported) with the reason.
//   (either)   a probe whose file could not be created (IoUringProbe::file_error) throws that
//              error (IoError naming the path and errno, or Error(kInvalidArgument) for an
//              unsafe directory): a bad directory is not reported as "io_uring unavailable".
//   kThreads   the thread-pool engine, no probe.
// Test hook: environment STRATA_IO_URING_FAIL=1 makes every io_uring setup (probe and ring
// creation) fail with ENOSYS, as in a seccomp-filtered container.
std::unique_ptr<IoEngine> make_io_engine(const IoEngineOptions& options,
                                         const std::string& probe_dir);
// The concrete engines, without probing (tests, benchmarks). make_io_uring_engine throws
// Error(kUnsupported) if a ring cannot be created.
std::unique_ptr<IoEngine> make_io_uring_engine(const IoEngineOptions& options);
std::unique_ptr<IoEngine> make_thread_io_engine(const IoEngineOptions& options);

}  // namespace strata
