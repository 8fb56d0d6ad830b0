// Shared machinery of the io_uring and thread-pool engines: the file table, validation, splitting
// requests into block-size pieces, tickets, waiting and error reporting. A concrete engine only
// executes pieces (dispatch()) and calls complete_piece() for each.
#pragma once

#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "core/mutex.hpp"
#include "strata/io_engine.hpp"

namespace strata::io {

// One ticket: a request or a batch.
struct Op {
  IoTicket id = 0;
  std::atomic<std::uint32_t> remaining{0};  // pieces not yet completed
  std::uint32_t requests = 0;
  Mutex error_mu;
  std::exception_ptr error GUARDED_BY(error_mu);  // first failure (lowest request index)
  std::uint32_t error_index GUARDED_BY(error_mu) = ~0u;
  std::atomic<std::uint64_t> bytes{0};  // bytes completed successfully
  IoOp kind = IoOp::kRead;
  bool done = false;  // guarded by EngineBase::mu_
  bool cancelled GUARDED_BY(error_mu) = false;
  // File-table entries this op uses (keeps the files alive until the op is done).
  std::vector<std::shared_ptr<void>> files;
  std::vector<std::atomic<std::uint64_t>*> in_flight;
};

// How many times an engine resubmits a piece that made no progress (a write that wrote nothing,
// -EAGAIN, -EINTR) before failing it.
constexpr std::uint32_t kMaxRetries = 1000;

// One block-size (or smaller) piece of a request, executed as one kernel I/O.
struct Piece {
  Op* op = nullptr;  // kept alive by the ticket table until done
  std::uint32_t request_index = 0;
  IoOp kind = IoOp::kRead;
  const IoFile* file = nullptr;  // kept alive by the engine's file table
  int fixed_file = -1;           // io_uring registered-file slot, -1 = none
  int buf_index = -1;            // io_uring registered-buffer index, -1 = none
  std::uint8_t* buffer = nullptr;
  std::uint64_t length = 0;
  std::uint64_t offset = 0;  // physical offset in `file`
  std::uint64_t done = 0;    // bytes already transferred (short-transfer resubmission)
  std::uint32_t attempts = 0;
};

// Test hook (internal): lets a test rewrite the raw result of a piece's kernel I/O before the
// engine interprets it (simulate short transfers, -EAGAIN, -EINTR, errors). Called on the
// executing thread with the result as returned (bytes or -errno); returns the result to use.
// For a shortened result, the engine treats the bytes past the returned count as not transferred.
using RawResultHook = std::function<long(const Piece&, long result)>;
void set_raw_result_hook(RawResultHook hook);  // nullptr clears; not for concurrent engines
long apply_raw_result_hook(const Piece& piece, long result);
bool raw_result_hook_set();

// True when STRATA_IO_URING_FAIL is set to a non-empty value other than "0".
bool io_uring_fail_simulated();

class EngineBase : public IoEngine {
 public:
  explicit EngineBase(const IoEngineOptions& options);
  ~EngineBase() override;

  const IoEngineOptions& options() const override { return options_; }
  FileId register_file(std::shared_ptr<IoFile> file) override;
  FileId register_striped(std::vector<std::shared_ptr<IoFile>> files) override;
  void unregister_file(FileId id) override;
  std::uint32_t alignment(FileId id) const override;
  std::string describe_file(FileId id) const override;
  void register_buffers(std::span<const IoRegion> regions) override;
  IoTicket submit(const IoRequest& request) override;
  IoTicket submit_batch(std::span<const IoRequest> requests) override;
  bool wait(IoTicket ticket, std::chrono::nanoseconds timeout) override;
  bool poll(IoTicket ticket) override;
  bool wait_all(std::chrono::nanoseconds timeout) override;
  IoStats stats() const override;

 protected:
  // Executes pieces asynchronously; each must eventually reach complete_piece() (or
  // cancel_piece()). Called without locks held.
  virtual void dispatch(std::vector<Piece>& pieces) = 0;
  // Backend registration hooks (io_uring: register with every ring). Called under files_mu_.
  virtual int on_file_registered(int /*slot*/, int /*fd*/) { return -1; }
  virtual void on_file_unregistered(int /*slot*/) {}
  // Returns true if the backend registered the regions for fixed I/O.
  virtual bool on_buffers_registered(std::span<const IoRegion> /*regions*/) { return false; }

  // Piece bookkeeping for the backends.
  void complete_piece(Piece& piece, std::exception_ptr error);
  void fail_piece(Piece& piece, int errnum, const char* context);
  void cancel_piece(Piece& piece);
  void count_retry() { retries_.fetch_add(1, std::memory_order_relaxed); }
  // Stops submissions (submit throws kCancelled afterwards).
  void stop_accepting() { accepting_.store(false); }
  bool accepting() const { return accepting_.load(); }

  IoEngineOptions options_;

 private:
  struct FileEntry {
    std::vector<std::shared_ptr<IoFile>> files;  // 1 = plain file, >1 = striped
    std::vector<int> fixed_slots;                // per file; -1 = not registered
    std::uint32_t alignment = 1;
    bool read_only = false;
    std::atomic<std::uint64_t> in_flight{0};
  };
  struct Region {
    std::uint8_t* begin;
    std::uint8_t* end;
    int index;
  };

  FileId add_entry(std::vector<std::shared_ptr<IoFile>> files);
  // submit_batch()'s steps.
  std::vector<std::shared_ptr<FileEntry>> entries_of(
      std::span<const IoRequest> requests, std::shared_ptr<const std::vector<Region>>& regions);
  static void validate(std::span<const IoRequest> requests,
                       const std::vector<std::shared_ptr<FileEntry>>& entries);
  std::vector<Piece> split(Op* op, std::span<const IoRequest> requests,
                           const std::vector<std::shared_ptr<FileEntry>>& entries,
                           const std::vector<Region>* regions) const;
  static int region_index(const std::vector<Region>* regions, std::uint8_t* buffer,
                          std::uint64_t len);
  void finish_op(Op* op);
  bool retire(IoTicket ticket, std::chrono::steady_clock::time_point deadline) EXCLUDES(mu_);
  std::shared_ptr<Op> take_done(UniqueLock& lock, IoTicket ticket,
                                std::chrono::steady_clock::time_point deadline, bool* timed_out)
      REQUIRES(mu_);

  mutable Mutex files_mu_;
  std::unordered_map<FileId, std::shared_ptr<FileEntry>> files_ GUARDED_BY(files_mu_);
  FileId next_file_ GUARDED_BY(files_mu_) = 1;
  int next_slot_ GUARDED_BY(files_mu_) = 0;
  std::vector<int> free_slots_ GUARDED_BY(files_mu_);

  std::shared_ptr<const std::vector<Region>> regions_ GUARDED_BY(files_mu_);

  mutable Mutex mu_;
  CondVar cv_;
  std::uint32_t waiters_ GUARDED_BY(mu_) = 0;  // threads blocked on cv_ (no waiter: no wake)
  std::unordered_map<IoTicket, std::shared_ptr<Op>> ops_ GUARDED_BY(mu_);
  IoTicket next_ticket_ GUARDED_BY(mu_) = 1;
  std::atomic<bool> accepting_{true};

  std::atomic<std::uint64_t> bytes_read_{0}, bytes_written_{0}, requests_{0}, pieces_{0},
      retries_{0}, failures_{0}, fixed_pieces_{0};
};

}  // namespace strata::io
