// PollBackoff: how a thread waits between two polls of a completion it cannot block on with a
// deadline (a CUDA stream or event query, NCCL's asynchronous state). Completions on a GPU come
// microseconds after the work ends, so the first polls spin (a CPU pause between two polls, for
// kSpin of wall time); after that the thread sleeps, 1 µs doubling up to `max_sleep` (Linux's
// timer slack makes any sleep ~50 µs, which a wait of milliseconds no longer notices). Nothing is
// slept on a wait that finishes within the spin, and a wait of any length costs one back-off
// sequence: there is no fixed sleep per poll.
// The spin does not sched_yield(): beside a CPU-bound neighbour (a data loader, strata's own CPU
// Adam, a busy loop) a yield hands the processor over for a whole scheduler slice, milliseconds,
// and every wait became that long — the fake-CUDA placement cases of two ranks beside two busy
// loops took 38 s with a 50 µs yield spin and 7.4 s with this 10 µs pause spin (18.4 s against
// 16.2 s on a quiet machine, where the yield let the fake's stream thread, pinned to the same CPU,
// run at once).
// Thread-safety: one waiting thread per object (it is a local of the wait).
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

namespace strata {

class PollBackoff {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::microseconds kSpin{10};

  explicit PollBackoff(std::chrono::microseconds max_sleep = std::chrono::microseconds(64),
                       std::chrono::microseconds spin = kSpin)
      : max_sleep_(max_sleep), spin_until_(Clock::now() + spin) {}

  // Between two polls: a CPU pause within the spin, a sleep after it.
  void pause() {
    if (spinning_ && Clock::now() < spin_until_) {
      relax();
      return;
    }
    spinning_ = false;
    std::this_thread::sleep_for(sleep_);
    if (sleep_ < max_sleep_) sleep_ = std::min(sleep_ * 2, max_sleep_);
  }
  // Whether the last pause() (or the next one) sleeps rather than spins; for tests.
  bool sleeping() const { return !spinning_; }
  std::chrono::microseconds next_sleep() const { return sleep_; }

 private:
  static void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  std::chrono::microseconds max_sleep_;
  Clock::time_point spin_until_;
  bool spinning_ = true;
  std::chrono::microseconds sleep_{1};
};

}  // namespace strata
