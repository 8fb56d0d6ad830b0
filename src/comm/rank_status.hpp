// Every rank's outcome of a phase, exchanged so that all ranks fail together: nothing hangs on a
// rank that gave up, and every rank can name the one that failed. One implementation for the
// engine's start-up and step (zero/rank_agreement.hpp) and the checkpoints' phases.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <vector>

#include "strata/error.hpp"

namespace strata {

// What one rank says: whether it failed, the class of its error, and one value (a checksum, a
// size, an errno).
struct RankStatus {
  bool failed = false;
  ErrorCode code = ErrorCode::kInternal;
  std::uint64_t extra = 0;
  // From an error: its code, and for an IoError its errno as `extra`.
  static RankStatus of(const std::exception_ptr& error);
};

// All-gathers `bytes` bytes per rank (host memory in and out; a multiple of 4) where the
// communicator's buffers live.
using WordExchange = std::function<void(const void* send, void* recv, std::size_t bytes)>;

// Every rank's status, in rank order (16 bytes per rank through `exchange`; world 1: no call).
std::vector<RankStatus> exchange_status(const RankStatus& mine, int world,
                                        const WordExchange& exchange);

// The first rank other than `rank` that failed, or -1.
int first_failed_peer(const std::vector<RankStatus>& all, int rank);

}  // namespace strata
