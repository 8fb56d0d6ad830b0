// FaultInjectingIoEngine: a decorator over any IoEngine (like leveldb's EnvWrapper) that injects
// failures into chosen requests. For tests of the I/O layer, the tier store and the optimizer
// step; linked into the library (strata::io) so any test can use it.
//
// Matching. Every IoRequest passed to submit()/submit_batch() gets a 1-based sequence number
// among the requests that match a fault's filter (op and/or file, if set). A fault fires for the
// matching requests number `nth`, nth+1, ..., nth+count-1 (count 0 = every one from nth on).
// Several faults may match one request; they apply in the order they were added (an error fault
// wins over the others).
//
// Effects, as observed at the wait/poll of the request's ticket (submit never throws for them):
//   kError        the request is not passed to the inner engine (nothing is read or written) and
//                 fails with IoError(op, path, offset, length, errnum) whose context says
//                 "injected fault". errnum is EIO by default (ENOSPC, ... as set).
//   kShortResult  only the first `short_bytes` bytes (rounded down to the file's alignment; 0 =
//                 half the request, aligned) are transferred by the inner engine; then the request
//                 fails with IoError errnum 0 and context "short read/short write: X of N bytes
//                 (injected)", as an engine does when it cannot complete a transfer. The bytes
//                 past X are untouched (read) / not written (write).
//   kDelay        the request runs normally, but its ticket is not reported done before `delay`
//                 after the inner completion (poll() returns false meanwhile; wait() honours its
//                 timeout).
//   kCorruptRead  a read completes normally, then bit `bit` of its buffer (bit index from the
//                 start of the request; default kRandomBit = a bit picked by `seed`) is flipped.
//                 Writes are not affected (they do not count as firing).
// Tickets, buffers, alignment checks, shutdown: as for the inner engine (io_engine.hpp). Requests
// of one batch are passed to the inner engine as one batch (minus kError ones).
// Thread-safety: every member is safe to call concurrently, including add_fault()/clear_faults()
// while I/O runs (a request is matched once, at submit).
#pragma once

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "strata/io_engine.hpp"

namespace strata {

enum class IoFaultKind { kError, kShortResult, kDelay, kCorruptRead };

struct IoFault {
  static constexpr std::uint64_t kRandomBit = ~0ULL;

  IoFaultKind kind = IoFaultKind::kError;
  // Filter (unset = any).
  std::optional<IoOp> op;
  std::optional<FileId> file;
  // Which matching requests: nth .. nth+count-1 (1-based); count 0 = all from nth on.
  std::uint64_t nth = 1;
  std::uint64_t count = 1;

  int errnum = EIO;                     // kError: EIO by default
  std::uint64_t short_bytes = 0;        // kShortResult
  std::chrono::milliseconds delay{50};  // kDelay
  std::uint64_t bit = kRandomBit;       // kCorruptRead
  std::uint64_t seed = 1;               // kCorruptRead with kRandomBit

  // Shorthands.
  static IoFault fail_nth(std::uint64_t nth, int errnum = EIO, std::optional<IoOp> op = {});
  static IoFault short_nth(std::uint64_t nth, std::uint64_t bytes = 0, std::optional<IoOp> op = {});
  static IoFault delay_nth(std::uint64_t nth, std::chrono::milliseconds delay,
                           std::optional<IoOp> op = {});
  static IoFault corrupt_nth_read(std::uint64_t nth, std::uint64_t bit = kRandomBit);
};

class FaultInjectingIoEngine : public IoEngineWrapper {
 public:
  explicit FaultInjectingIoEngine(std::unique_ptr<IoEngine> inner);
  ~FaultInjectingIoEngine() override;

  // Returns an id for fired(); faults stay until clear_faults().
  std::size_t add_fault(const IoFault& fault);
  void clear_faults();
  std::uint64_t fired(std::size_t fault_id) const;  // how many requests it has fired on
  std::uint64_t fired_total() const;

  // The rest is forwarded to the inner engine (IoEngineWrapper).
  const char* name() const override;
  IoTicket submit(const IoRequest& request) override;
  IoTicket submit_batch(std::span<const IoRequest> requests) override;
  bool wait(IoTicket ticket, std::chrono::nanoseconds timeout) override;
  bool poll(IoTicket ticket) override;
  bool wait_all(std::chrono::nanoseconds timeout) override;

 private:
  struct Pending;
  struct FaultState {
    IoFault fault;
    std::uint64_t matched = 0;
    std::uint64_t fired = 0;
  };
  bool finish(IoTicket ticket, std::chrono::steady_clock::time_point deadline);
  void apply_faults(const IoRequest& r, std::uint32_t align, std::size_t index, Pending& pending,
                    std::vector<IoRequest>& pass);  // REQUIRES: mu_ held

  std::string name_;
  mutable std::mutex mu_;
  std::vector<FaultState> faults_;
  std::unordered_map<IoTicket, std::shared_ptr<Pending>> pending_;
  IoTicket next_ticket_ = 1;
};

}  // namespace strata
