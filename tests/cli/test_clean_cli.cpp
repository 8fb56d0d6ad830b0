// `strata clean` and clean shutdown: what killed runs leave is found and removed; SIGTERM/SIGINT
// remove swap files and end the process by that signal (issue 15, point 4).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "test_util.hpp"

namespace strata::testing {
namespace {

namespace fs = std::filesystem;

long dead_pid() {
  pid_t pid = fork();
  if (pid == 0) _exit(0);
  waitpid(pid, nullptr, 0);
  return pid;
}

std::string make_leftover(const std::string& parent, long pid, std::size_t bytes) {
  const std::string d = parent + "/strata-swap-" + std::to_string(pid) + "-r0-deadbeef";
  fs::create_directory(d);
  std::ofstream(d + "/swap.bin") << std::string(bytes, 'x');
  return d;
}

std::size_t count_entries(const std::string& dir) {
  return std::distance(fs::directory_iterator(dir), fs::directory_iterator());
}

TEST(CleanCli, DryRunListsThenCleanRemoves) {
  if (!fs::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  TempDir dir("strata-clean");
  const long dead = dead_pid();
  const std::string d = make_leftover(dir.str(), dead, 1 << 20);
  const std::string live = make_leftover(dir.str(), getpid(), 10);
  std::string out;
  ASSERT_EQ(
      run_command(strata_cli() + " clean --dry-run --json " + dir.str() + "/ 2>/dev/null", &out), 0)
      << out;
  auto j = nlohmann::json::parse(out);
  EXPECT_TRUE(j["dry_run"].get<bool>());
  ASSERT_EQ(j["entries"].size(), 2u) << out;
  std::uint64_t would = 0;
  for (const auto& e : j["entries"]) {
    if (e["path"] == d) {
      EXPECT_EQ(e["status"], "would remove");
      EXPECT_EQ(e["pid"].get<long>(), dead);
      would = e["bytes"].get<std::uint64_t>();
    } else {
      EXPECT_EQ(e["path"], live);
      EXPECT_EQ(e["status"], "kept: running");
    }
  }
  EXPECT_GE(would, 1u << 20);
  EXPECT_EQ(j["would_free_bytes"].get<std::uint64_t>(), would);
  EXPECT_TRUE(fs::exists(d + "/swap.bin"));
  ASSERT_EQ(run_command(strata_cli() + " clean " + dir.str(), &out), 0) << out;
  EXPECT_NE(out.find("removed: " + d), std::string::npos) << out;
  EXPECT_NE(out.find("freed 1 MiB"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(d));
  EXPECT_TRUE(fs::exists(live + "/swap.bin"));
  ASSERT_EQ(run_command(strata_cli() + " clean " + dir.str() + " --json 2>/dev/null", &out), 0)
      << out;
  EXPECT_EQ(nlohmann::json::parse(out)["freed_bytes"].get<std::uint64_t>(), 0u);
}

TEST(CleanCli, RefusesUnsafePaths) {
  if (!fs::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  TempDir dir("strata-clean");
  const std::string ww = dir.str() + "/ww";
  fs::create_directory(ww);
  chmod(ww.c_str(), 0777);
  make_leftover(ww, dead_pid(), 10);
  std::string out;
  EXPECT_EQ(run_command(strata_cli() + " clean " + ww, &out), 2) << out;
  EXPECT_NE(out.find("writable by every user"), std::string::npos) << out;
  EXPECT_EQ(count_entries(ww), 1u);
}

// Starts the CLI with `args`, waits until `dir` holds a strata-swap-* directory, sends `sig`.
// Returns the wait status.
int run_and_signal(const std::vector<std::string>& args, const std::string& dir, int sig) {
  const pid_t pid = spawn_quiet(args);
  if (pid < 0) return -1;
  bool seen = false;
  for (int i = 0; i < 1500 && !seen; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (auto& e : fs::directory_iterator(dir))
      if (e.path().filename().string().rfind("strata-swap-", 0) == 0 &&
          fs::exists(e.path() / "swap.bin"))
        seen = true;
  }
  EXPECT_TRUE(seen) << "no swap directory appeared";
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  kill(pid, sig);
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

// issue 15: SIGTERM and SIGINT left every swap directory behind.
TEST(CleanShutdown, TrainRemovesItsSwapOnSigtermAndSigint) {
  if (!fs::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  for (int sig : {SIGTERM, SIGINT}) {
    SCOPED_TRACE(sig);
    TempDir swap("strata-shutdown");
    const int status =
        run_and_signal({strata_cli(), "train", source_dir() + "/configs/nvme-offload.yaml",
                        "--steps", "1000000", "--ranks", "2", "--hidden", "48", "--set",
                        "tiers.nvme.paths=[" + swap.str() + "]", "--set", "runtime.cpu_threads=1"},
                       swap.str(), sig);
    ASSERT_TRUE(WIFSIGNALED(status)) << "status " << status;
    EXPECT_EQ(WTERMSIG(status), sig);
    for (auto& e : fs::directory_iterator(swap.path()))
      ADD_FAILURE() << "left behind: " << e.path();
  }
}

// `bench step` measures in a child process: a SIGTERM to the command reaches the child too
// (PR_SET_PDEATHSIG), which removes its swap.
TEST(CleanShutdown, BenchStepChildRemovesItsSwapWhenTheCommandIsKilled) {
  if (!fs::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  TempDir swap("strata-shutdown");
  const int status = run_and_signal(
      {strata_cli(), "bench", "step", source_dir() + "/bench/step/step.yaml", "--params", "4M",
       "--rounds", "1000", "--no-scaling", "--set", "tiers.nvme.paths=[" + swap.str() + "]",
       "--set", "tiers.host.buffer_size=1MiB"},
      swap.str(), SIGTERM);
  ASSERT_TRUE(WIFSIGNALED(status)) << "status " << status;
  EXPECT_EQ(WTERMSIG(status), SIGTERM);
  // The child ends a moment later.
  for (int i = 0; i < 1500 && count_entries(swap.str()) > 0; ++i)  // (a hang guard: 30 s)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  for (auto& e : fs::directory_iterator(swap.path())) ADD_FAILURE() << "left behind: " << e.path();
}

// A run killed with SIGKILL leaves its swap; the next run under the same path removes it.
TEST(CleanShutdown, NextRunRemovesWhatAKilledRunLeft) {
  if (!fs::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  TempDir swap("strata-shutdown");
  const std::vector<std::string> args = {strata_cli(),
                                         "train",
                                         source_dir() + "/configs/nvme-offload.yaml",
                                         "--steps",
                                         "1000000",
                                         "--ranks",
                                         "1",
                                         "--hidden",
                                         "48",
                                         "--set",
                                         "tiers.nvme.paths=[" + swap.str() + "]",
                                         "--set",
                                         "runtime.cpu_threads=1"};
  const int status = run_and_signal(args, swap.str(), SIGKILL);
  ASSERT_TRUE(WIFSIGNALED(status));
  ASSERT_EQ(count_entries(swap.str()), 1u);
  const std::string left = fs::directory_iterator(swap.path())->path().string();
  std::string out;
  ASSERT_EQ(run_command(strata_cli() + " train " + source_dir() +
                            "/configs/nvme-offload.yaml --steps 1 --ranks 1 "
                            "--hidden 48 --set tiers.nvme.paths=[" +
                            swap.str() + "] --set runtime.cpu_threads=1",
                        &out),
            0)
      << out;
  EXPECT_NE(out.find("removed " + left), std::string::npos) << out;
  EXPECT_EQ(count_entries(swap.str()), 0u);
}

// A killed `bench io` leaves its file (issue 25.6); the next `bench io` in that --dir removes it,
// as a swap space removes what killed runs left. A file of a live process is kept.
TEST(CleanShutdown, NextBenchIoRemovesWhatAKilledOneLeft) {
  if (!fs::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  TempDir dir("strata-bench-left");
  const std::string dead =
      dir.str() + "/.strata-bench-io-" + std::to_string(dead_pid()) + "-0123abcd";
  const std::string live =
      dir.str() + "/.strata-bench-io-" + std::to_string(getpid()) + "-0123abcd";
  std::ofstream(dead) << std::string(1 << 20, 'x');
  std::ofstream(live) << "y";
  std::string out;
  ASSERT_EQ(run_command(strata_cli() + " bench io --dir " + dir.str() +
                            " --size 1MiB --block-size 128KiB"
                            " --queue-depth 2 --rw write --engine threads --direct-io off",
                        &out),
            0)
      << out;
  EXPECT_NE(out.find("removed " + dead), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_EQ(count_entries(dir.str()), 1u);
}

}  // namespace
}  // namespace strata::testing
