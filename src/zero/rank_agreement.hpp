// RankAgreement: what every rank must decide alike — one implementation for the step, the
// checkpoints and start-up. A few words per rank are all-gathered through a small buffer of
// device memory made once (collectives run where the buffers live) and copied on a stream of the
// agreement's own, not through the store: a rank whose store failed still takes part, so the
// others learn of its failure in the same call instead of waiting out the collective timeout.
//   agree_step      the gradient statistics: global sum of squares (summed in rank order:
//                   identical on every rank), overflow anywhere, a rank that failed before it
//   agree_used      which tensors some rank used (after agree_step, when some rank skipped one)
//   agree_outcome   after the update: did every rank's go through
//   agree_start     after a rank built its storage: did every rank's (disk, memlock, budgets)
//   exchange        any few words (the checkpoint's agreement), <= kMaxExchangeBytes per rank
// agree_step also carries one bit per rank for an asynchronous checkpoint in flight ("my shard is
// durable", set_checkpoint_hooks): no collective of its own, none from the writer thread.
// Every call is collective: every rank calls it in the same order.
//
// Ownership: borrows the communicator and the device; owns the word buffer and its stream.
// Thread-safety: one thread (the engine's). Failure: the communicator's and device's errors
// propagate (kTimeout / kComm / kDevice); the fail_* helpers throw Error(kComm) naming the peer.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "strata/adam.hpp"
#include "strata/communicator.hpp"
#include "strata/device.hpp"

namespace strata::zero {

struct StepAgreement {
  bool finite = true;        // no rank saw inf/NaN
  double sum_sq = 0;         // over every rank, in rank order
  int failed_peer = -1;      // the first other rank that failed before the agreement, or -1
  bool any_skipped = false;  // some rank skipped a tensor's gradient (agree_used follows)
};

class RankAgreement {
 public:
  static constexpr std::size_t kMaxExchangeBytes = 16;

  RankAgreement(Communicator& comm, Device& device, std::chrono::milliseconds timeout);
  RankAgreement(const RankAgreement&) = delete;
  RankAgreement& operator=(const RankAgreement&) = delete;

  // Device bytes the agreement holds (its word buffer: 16 B to send + 16 B per rank).
  std::size_t device_bytes() const { return words_.size(); }

  // failed_here: this rank's reduction or statistics failed (`local` is then ignored);
  // skipped_here: this rank skipped some tensor's gradient.
  StepAgreement agree_step(const AdamGradStats& local, bool failed_here, bool skipped_here = false);
  // Per tensor, whether any rank used it (every rank's `used`, OR-ed): a bit per tensor from every
  // rank, through a device buffer made for the call.
  std::vector<bool> agree_used(const std::vector<bool>& used);
  // Returns the first other rank whose update failed, or -1.
  int agree_outcome(bool ok_here);
  // Start-up: `failure` is this rank's error (null: it started). Throws Error(kComm) naming the
  // first other rank that failed, its error class and errno, when this rank did not fail; this
  // rank's own failure is the caller's to rethrow.
  void agree_start(const std::exception_ptr& failure);
  // An asynchronous checkpoint's part in the step's exchanges (all run on this thread):
  //   durable     asked at each agree_step: this rank's shard is durable (the bit it sends);
  //   everywhere  runs in the agree_step in which every rank's bit was set — the same agree_step
  //               on every rank;
  //   step_ended  runs at agree_outcome (the step's I/O is over: the writer may go on).
  // Empty functions: no save (the bit is 0). Set and cleared by every rank at the same call (save /
  // finish), so that every rank's words mean the same.
  struct CheckpointHooks {
    std::function<bool()> durable;
    std::function<void()> everywhere;
    std::function<void()> step_ended;
  };
  void set_checkpoint_hooks(CheckpointHooks hooks);
  // `bytes` (a multiple of 4, <= kMaxExchangeBytes) per rank: recv gets every rank's, in order.
  void exchange(const void* send, void* recv, std::size_t bytes);

  // Error(kComm): `peer` failed in this step's `phase`; this rank stops too.
  [[noreturn]] void fail_for_peer(int peer, const char* phase) const;

 private:
  Communicator& comm_;
  const int rank_, world_;
  const std::chrono::milliseconds timeout_;
  Device& device_;
  std::unique_ptr<Stream> stream_;
  DeviceMemory words_;  // [0, 16): this rank's words; [16, 16 + 16 × world): everyone's
  CheckpointHooks ckpt_;
};

}  // namespace strata::zero
