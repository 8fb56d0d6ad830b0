// What a Communicator backend builds on (the layer-level header for backends, in src/comm and
// outside it: python/src's c10d communicator): byte accounting, count checks, a ready handle, and
// through comm/numeric.hpp the rank-ordered host reduction.
#pragma once

#include <atomic>
#include <cstddef>
#include <exception>
#include <functional>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "comm/numeric.hpp"
#include "strata/communicator.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::comm {

// Counters a backend updates as it issues collectives (one thread issues; stats() may be read
// from another, hence relaxed atomics).
class StatsCounter {
 public:
  void add(CollectiveKind kind, std::uint64_t bytes) {
    bytes_[static_cast<std::size_t>(kind)].fetch_add(bytes, std::memory_order_relaxed);
    calls_[static_cast<std::size_t>(kind)].fetch_add(1, std::memory_order_relaxed);
  }
  CommStats snapshot() const {
    CommStats s;
    for (std::size_t i = 0; i < kCollectiveKinds; ++i) {
      s.bytes_sent[i] = bytes_[i].load(std::memory_order_relaxed);
      s.calls[i] = calls_[i].load(std::memory_order_relaxed);
    }
    return s;
  }

 private:
  std::atomic<std::uint64_t> bytes_[kCollectiveKinds]{};
  std::atomic<std::uint64_t> calls_[kCollectiveKinds]{};
};

inline std::size_t sum_counts(std::span<const std::size_t> counts) {
  return std::accumulate(counts.begin(), counts.end(), std::size_t{0});
}

// Bytes a bandwidth-optimal algorithm sends from `rank` (see communicator.hpp).
inline std::uint64_t scatter_gather_bytes(std::span<const std::size_t> counts, int rank, DType t) {
  return (sum_counts(counts) - counts[static_cast<std::size_t>(rank)]) * dtype_size(t);
}
// Equal split of `count` into n chunks (the first count % n chunks one element longer).
inline std::vector<std::size_t> split_counts(std::size_t count, int n) {
  std::vector<std::size_t> c(static_cast<std::size_t>(n), count / static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < count % static_cast<std::size_t>(n); ++i) ++c[i];
  return c;
}

inline void check_counts(const char* op, std::span<const std::size_t> counts, int size) {
  if (counts.size() != static_cast<std::size_t>(size))
    fail(ErrorCode::kInvalidArgument,
         strcat(op, ": ", counts.size(), " counts for ", size, " ranks"));
}

// Before a reduce-scatter / all-gather with counts[r] elements at rank r: one count per rank
// (else Error(kInvalidArgument) naming the collective), and the bytes `rank` sends counted.
inline void count_per_rank(StatsCounter& stats, CollectiveKind kind,
                           std::span<const std::size_t> counts, int rank, int size, DType t) {
  check_counts(collective_name(kind), counts, size);
  stats.add(kind, scatter_gather_bytes(counts, rank, t));
}

// A handle's destructor when its caller never waited: waits (the collective must not be left
// half-done on its buffers) and logs a failure instead of throwing from the destructor.
inline void wait_unwaited(CommHandle& handle, bool waited) noexcept {
  if (waited) return;
  try {
    handle.wait();
  } catch (const std::exception& e) {
    log_error("unwaited collective failed: ", e.what());
  }
}

// A handle whose work already finished (or failed) when it was created.
class ReadyHandle final : public CommHandle {
 public:
  explicit ReadyHandle(std::exception_ptr error = nullptr) : error_(std::move(error)) {}
  void wait() override {
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }
  bool done() override { return true; }

 private:
  std::exception_ptr error_;
};

}  // namespace strata::comm
