// PollBackoff: how a thread waits between two polls of a completion it cannot block on with a
// deadline (a CUDA stream or event query, NCCL's asynchronous state). Completions on a GPU come
// microseconds after the work ends, so the first polls only yield the processor (a bounded spin:
// kSpin of wall time); after that the thread sleeps, 1 µs doubling up to `max_sleep` (Linux's
// timer slack makes any sleep ~50 µs, which a wait of milliseconds no longer notices). Nothing is
// slept on a wait that finishes within the spin, and a wait of any length costs one back-off
// sequence: there is no fixed sleep per poll.
// Thread-safety: one waiting thread per object (it is a local of the wait).
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

namespace strata {

class PollBackoff {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::microseconds kSpin{50};

  explicit PollBackoff(std::chrono::microseconds max_sleep = std::chrono::microseconds(64),
                       std::chrono::microseconds spin = kSpin)
      : max_sleep_(max_sleep), spin_until_(Clock::now() + spin) {}

  // Between two polls: a yield within the spin, a sleep after it.
  void pause() {
    if (spinning_ && Clock::now() < spin_until_) {
      std::this_thread::yield();
      return;
    }
    spinning_ = false;
    std::this_thread::sleep_for(sleep_);
    if (sleep_ < max_sleep_) sleep_ = std::min(sleep_ * 2, max_sleep_);
  }
  // Whether the last pause() (or the next one) sleeps rather than yields; for tests.
  bool sleeping() const { return !spinning_; }
  std::chrono::microseconds next_sleep() const { return sleep_; }

 private:
  std::chrono::microseconds max_sleep_;
  Clock::time_point spin_until_;
  bool spinning_ = true;
  std::chrono::microseconds sleep_{1};
};

}  // namespace strata
