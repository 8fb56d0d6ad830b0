// `strata bench io` end to end (skipped when the CLI is not built in this build directory).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "test_util.hpp"

namespace strata {
namespace {

std::string cli() { return testing::binary_dir() + "/strata"; }

TEST(BenchIoCli, JsonForBothEngines) {
  if (testing::binary_dir().empty() || !std::filesystem::exists(cli()))
    GTEST_SKIP() << "no strata CLI built";
  testing::TempDir dir("strata-io-cli");
  for (const char* engine : {"io_uring", "threads"}) {
    for (const char* rw : {"write", "read"}) {
      std::string out;
      int rc =
          testing::run_command(cli() + " bench io --dir " + dir.str() +
                                   " --size 8MiB --block-size 128KiB --queue-depth 4 --rw " + rw +
                                   " --engine " + engine + " --direct-io auto --json 2>/dev/null",
                               &out);
      ASSERT_EQ(rc, 0) << out;
      EXPECT_NE(out.find("\"bytes_per_second\""), std::string::npos) << out;
      EXPECT_NE(out.find(std::string("\"engine\": \"") + engine + "\""), std::string::npos) << out;
      EXPECT_NE(out.find("\"size_bytes\": 8388608"), std::string::npos) << out;
    }
  }
  // Temporary files are removed.
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(BenchIoCli, BadInputExitsTwo) {
  if (testing::binary_dir().empty() || !std::filesystem::exists(cli()))
    GTEST_SKIP() << "no strata CLI built";
  testing::TempDir dir("strata-io-cli");
  std::string out;
  EXPECT_EQ(testing::run_command(cli() + " bench io --dir " + dir.str() + " --rw sideways", &out),
            2)
      << out;
  EXPECT_EQ(testing::run_command(cli() + " bench io --dir " + dir.str() + " --size 1000", &out), 2)
      << out;
  EXPECT_EQ(testing::run_command(cli() + " bench io --dir " + dir.str() + "/missing", &out), 2)
      << out;
  // The real cause, not "io_uring unavailable" (issue 15).
  EXPECT_NE(out.find("No such file or directory"), std::string::npos) << out;
  EXPECT_EQ(out.find("io_uring unavailable"), std::string::npos) << out;
  EXPECT_EQ(testing::run_command(cli() + " bench io --dir /proc --size 1MiB", &out), 2) << out;
  EXPECT_NE(out.find("/proc is on a proc file system, not on a disk"), std::string::npos) << out;
  EXPECT_EQ(testing::run_command(cli() + " bench io --dir " + dir.str() + " --size 1M", &out), 2)
      << out;
  EXPECT_NE(out.find("did you mean 1MiB (or 1MB)?"), std::string::npos) << out;
  EXPECT_EQ(
      testing::run_command(cli() + " bench io --dir " + dir.str() + " --queue-depth -1", &out), 2)
      << out;
  EXPECT_EQ(testing::run_command(cli() + " bench io --dir " + dir.str() + " --bogus", &out), 2)
      << out;
  EXPECT_EQ(testing::run_command(cli() + " bench io --dir " + dir.str() + " --engine fast", &out),
            2)
      << out;
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// issue 15: `bench io --file EXISTING --rw read` overwrote the user's file with random data.
TEST(BenchIoCli, NeverOverwritesAnExistingFileUnlessTold) {
  if (testing::binary_dir().empty() || !std::filesystem::exists(cli()))
    GTEST_SKIP() << "no strata CLI built";
  testing::TempDir dir("strata-io-cli");
  const std::string mine = dir.str() + "/mine.dat";
  const std::string precious(1 << 20, 'p');
  std::ofstream(mine, std::ios::binary) << precious;
  const std::string base = cli() + " bench io --dir " + dir.str() + " --file " + mine +
                           " --block-size 64KiB --queue-depth 2 --direct-io off --engine threads";
  std::string out;
  // Write, or a read that would have to lay the file out first: refused, file untouched.
  EXPECT_EQ(testing::run_command(base + " --size 1MiB --rw write", &out), 2) << out;
  EXPECT_NE(out.find("--overwrite"), std::string::npos) << out;
  EXPECT_EQ(testing::run_command(base + " --size 2MiB --rw read", &out), 2) << out;
  EXPECT_NE(out.find("fewer than --size"), std::string::npos) << out;
  EXPECT_EQ(read_all(mine), precious);
  // A read of what is there only reads.
  EXPECT_EQ(testing::run_command(base + " --size 1MiB --rw read", &out), 0) << out;
  EXPECT_EQ(read_all(mine), precious);
  // --overwrite allows it; the file is the user's and stays.
  EXPECT_EQ(testing::run_command(base + " --size 1MiB --rw write --overwrite", &out), 0) << out;
  EXPECT_TRUE(std::filesystem::exists(mine));
  EXPECT_NE(read_all(mine), precious);
  // A --file that bench io creates is removed afterwards, unless --keep.
  const std::string fresh = dir.str() + "/fresh.dat";
  const std::string base2 =
      cli() + " bench io --dir " + dir.str() + " --file " + fresh +
      " --size 1MiB --block-size 64KiB --direct-io off --engine threads --rw write";
  EXPECT_EQ(testing::run_command(base2, &out), 0) << out;
  EXPECT_FALSE(std::filesystem::exists(fresh));
  EXPECT_EQ(testing::run_command(base2 + " --keep", &out), 0) << out;
  EXPECT_EQ(std::filesystem::file_size(fresh), 1u << 20);
}

// issue 15: Ctrl-C left the 8 GiB benchmark file behind. SIGINT and SIGTERM remove it and end the
// process by that signal (exit status 128 + signal in a shell).
TEST(BenchIoCli, InterruptRemovesTheBenchmarkFile) {
  if (testing::binary_dir().empty() || !std::filesystem::exists(cli()))
    GTEST_SKIP() << "no strata CLI built";
  for (int sig : {SIGINT, SIGTERM}) {
    SCOPED_TRACE(sig);
    testing::TempDir dir("strata-io-cli");
    std::vector<std::string> args = {cli(),     "--log-level",  "error",   "bench",
                                     "io",      "--dir",        dir.str(), "--size",
                                     "2GiB",    "--block-size", "4KiB",    "--queue-depth",
                                     "1",       "--direct-io",  "off",     "--engine",
                                     "threads", "--rw",         "write"};
    const pid_t pid = testing::spawn_quiet(args, /*keep_stderr=*/true);
    ASSERT_GT(pid, 0);
    // Wait for the benchmark file, then interrupt.
    bool seen = false;
    for (int i = 0; i < 600 && !seen; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      seen = !std::filesystem::is_empty(dir.path());
    }
    EXPECT_TRUE(seen) << "no benchmark file appeared";
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_EQ(kill(pid, sig), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "status " << status;
    EXPECT_EQ(WTERMSIG(status), sig);
    for (auto& e : std::filesystem::directory_iterator(dir.path()))
      ADD_FAILURE() << "left behind: " << e.path();
  }
}

}  // namespace
}  // namespace strata
