// PollBackoff (core/poll_backoff.hpp): the waits of CUDA and NCCL polls (F9, issue 27) spin (a
// CPU pause, not a sched_yield) within the spin and then sleep 1 µs doubling up to the cap — never
// a fixed sleep per poll. What each pause does, not how long it takes (no assertion here depends
// on timing: the spins are 0 or an hour).
#include <gtest/gtest.h>

#include "core/poll_backoff.hpp"

namespace strata {
namespace {

using std::chrono::microseconds;

TEST(PollBackoff, SpinsWithoutSleepingWithinTheSpin) {
  PollBackoff b(microseconds(64), std::chrono::hours(1));
  for (int i = 0; i < 100; ++i) b.pause();
  EXPECT_FALSE(b.sleeping());
  EXPECT_EQ(b.next_sleep(), microseconds(1)) << "a pause within the spin slept";
}

TEST(PollBackoff, SleepsDoubleUpToTheCapAfterTheSpin) {
  PollBackoff b(microseconds(8), microseconds(0));
  const microseconds want[] = {microseconds(2), microseconds(4), microseconds(8), microseconds(8),
                               microseconds(8)};
  for (microseconds w : want) {
    b.pause();
    EXPECT_TRUE(b.sleeping());
    EXPECT_EQ(b.next_sleep(), w);
  }
}

TEST(PollBackoff, AnOddCapIsNotPassed) {
  PollBackoff b(microseconds(100), microseconds(0));
  for (int i = 0; i < 10; ++i) b.pause();
  EXPECT_EQ(b.next_sleep(), microseconds(100));
}

}  // namespace
}  // namespace strata
