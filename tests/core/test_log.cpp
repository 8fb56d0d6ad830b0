// Warnings of several in-process ranks are said once, naming the ranks (issue 25, point 6):
// RankLogGroup / RankLogScope (strata/log.hpp). Nothing here depends on timing: a warning is
// printed when the last rank gives it, or at flush().
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "core/mutex.hpp"
#include "strata/log.hpp"

namespace strata {
namespace {

// Captures what the sink gets; restores the default sink and level on destruction.
class Captured {
 public:
  Captured() {
    set_log_level(LogLevel::kInfo);
    set_log_sink([this](LogLevel level, std::string_view m) {
      MutexLock lock(mu_);
      lines_.push_back(strcat(log_level_name(level), ": ", m));
    });
  }
  ~Captured() { set_log_sink(nullptr); }
  std::vector<std::string> lines() {
    MutexLock lock(mu_);
    return lines_;
  }

 private:
  Mutex mu_;
  std::vector<std::string> lines_ GUARDED_BY(mu_);
};

// Runs `body(rank)` on `world` threads, each in a RankLogScope of `group`.
template <typename F>
void on_ranks(RankLogGroup& group, int world, F body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      RankLogScope scope(group, r);
      body(r);
    });
  for (auto& t : threads) t.join();
}

TEST(RankWarnings, EveryRanksWarningIsOneLineNamingTheRanks) {
  Captured log;
  RankLogGroup group(8, 8);
  on_ranks(group, 8, [](int r) {
    log_warn("io: /nvme/strata-swap-4242-r", r, "-", 0x1a2b3c00 + r,
             "/swap.bin: tmpfs has no direct I/O; using buffered I/O");
  });
  // Printed when the eighth rank gave it, before any flush.
  const std::vector<std::string> lines = log.lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0],
            "warning: (ranks 0-7) io: /nvme/strata-swap-4242-*-*/swap.bin: tmpfs has no direct "
            "I/O; using buffered I/O");
}

// A swap directory's random hexadecimal suffix may have no digit ("cfbcaadb"): still the same
// warning (CI once printed rank 7's apart from ranks 0-6 for that).
TEST(RankWarnings, AHexSuffixWithoutDigitsIsStillTheSameWarning) {
  Captured log;
  RankLogGroup group(3, 3);
  const char* suffix[] = {"9a015978", "cfbcaadb", "0718288d"};
  on_ranks(group, 3, [&](int r) {
    log_warn("io: /dev/shm/strata-swap-32278-r", r, "-", suffix[r],
             "/swap.bin: tmpfs has no direct I/O; using buffered I/O");
  });
  const std::vector<std::string> lines = log.lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0],
            "warning: (ranks 0-2) io: /dev/shm/strata-swap-32278-*-*/swap.bin: tmpfs has no "
            "direct I/O; using buffered I/O");
}

TEST(RankWarnings, SomeRanksWarningIsNamedWithThemAtFlush) {
  Captured log;
  {
    RankLogGroup group(8, 8);
    on_ranks(group, 8, [](int r) {
      if (r == 2 || r == 5 || r == 6) log_warn("swap space: cannot remove x left by process 17");
      if (r == 3) log_warn("only three");
    });
    EXPECT_TRUE(log.lines().empty());  // held: not every rank has said it
    group.flush();
    std::vector<std::string> lines = log.lines();
    std::sort(lines.begin(), lines.end());  // in the order first given: the threads' order
    ASSERT_EQ(lines.size(), 2u);
    EXPECT_EQ(lines[0], "warning: (rank 3) only three");
    EXPECT_EQ(lines[1], "warning: (ranks 2, 5-6) swap space: cannot remove x left by process 17");
    on_ranks(group, 8, [](int r) {
      if (r == 0) log_warn("left for the destructor");
    });
  }
  ASSERT_EQ(log.lines().size(), 3u);
  EXPECT_EQ(log.lines()[2], "warning: (rank 0) left for the destructor");
}

TEST(RankWarnings, DifferentWarningsStayApartAndARepeatCountsAgain) {
  Captured log;
  RankLogGroup group(2, 2);
  on_ranks(group, 2, [](int r) {
    log_warn("io: io_uring unavailable (ENOMEM); using the thread-pool engine");
    log_warn("io: io_uring unavailable (ENOMEM); using the thread-pool engine");
    log_warn(r == 0 ? "alpha" : "beta");  // no digits: not the same warning
    log_info("info ", r, " is not held");
  });
  group.flush();
  std::vector<std::string> lines = log.lines();
  const auto count = [&](const std::string& s) {
    return std::count(lines.begin(), lines.end(), s);
  };
  EXPECT_EQ(count("warning: (ranks 0-1) io: io_uring unavailable (ENOMEM); using the thread-pool "
                  "engine"),
            2);
  EXPECT_EQ(count("warning: (rank 0) alpha"), 1);
  EXPECT_EQ(count("warning: (rank 1) beta"), 1);
  EXPECT_EQ(count("info: info 0 is not held"), 1);
  EXPECT_EQ(count("info: info 1 is not held"), 1);
  EXPECT_EQ(lines.size(), 6u);
}

TEST(RankWarnings, OneRankOfALargerWorldSaysWhichAtOnce) {
  Captured log;
  RankLogGroup group(1, 4);  // one rank per process (mpirun)
  {
    RankLogScope scope(group, 3);
    log_warn("train: world.ranks is 8 but mpirun started 4 ranks; using 4");
    ASSERT_EQ(log.lines().size(), 1u);
    EXPECT_EQ(log.lines()[0],
              "warning: (rank 3) train: world.ranks is 8 but mpirun started 4 ranks; using 4");
  }
  log_warn("outside any scope");  // as before
  RankLogGroup single(1, 1);
  RankLogScope scope(single, 0);
  log_warn("a world of one");
  ASSERT_EQ(log.lines().size(), 3u);
  EXPECT_EQ(log.lines()[1], "warning: outside any scope");
  EXPECT_EQ(log.lines()[2], "warning: a world of one");
}

}  // namespace
}  // namespace strata
