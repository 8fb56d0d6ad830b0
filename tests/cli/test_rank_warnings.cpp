// `strata train` with in-process ranks says each warning once, naming the ranks (issue 25,
// point 6): eight ranks whose swap lives on tmpfs (no direct I/O) used to print the tmpfs warning
// once per rank and file.
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "test_util.hpp"

namespace strata::testing {
namespace {

bool on_tmpfs(const char* dir) {
  struct statfs st {};
  return ::statfs(dir, &st) == 0 && static_cast<unsigned long>(st.f_type) == TMPFS_MAGIC;
}

TEST(RankWarnings, TrainSaysATmpfsWarningOnceForEightRanks) {
  const std::string cli = binary_dir() + "/strata";
  if (!std::filesystem::exists(cli)) GTEST_SKIP() << "no strata CLI built";
  if (!on_tmpfs("/dev/shm")) GTEST_SKIP() << "/dev/shm is not tmpfs here";
  TempDir dir("strata-rankwarn");
  const std::string shm = "/dev/shm/strata-rankwarn-" + std::to_string(::getpid());
  // Made before the run: otherwise the ranks that probe io_uring before the first one created it
  // probe its parent, a warning about another directory (its own line, naming those ranks).
  ASSERT_TRUE(std::filesystem::create_directory(shm));
  std::filesystem::permissions(shm, std::filesystem::perms::owner_all);
  const std::string config = dir.str() + "/t.yaml";
  std::ofstream(config) << "model: {parameters: 20K, largest_layer: 10K}\n"
                           "world: {ranks: 8}\nzero: {stage: 2}\n"
                           "offload: {optimizer: {tier: nvme}}\n"
                           "tiers:\n  host: {pinned_budget: 64MiB, buffer_count: 2, "
                           "buffer_size: 1MiB}\n  nvme: {paths: ["
                        << shm << "], direct_io: auto}\n";
  std::string out;
  const int rc = run_command("timeout 300 " + cli + " train " + config + " --steps 2 2>&1", &out);
  std::filesystem::remove_all(shm);
  ASSERT_EQ(rc, 0) << out;
  std::istringstream lines(out);
  int tmpfs_lines = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.find("tmpfs has no direct I/O") == std::string::npos) continue;
    ++tmpfs_lines;
    EXPECT_TRUE(line.starts_with("strata: warning (ranks 0-7): io: ")) << line;
  }
  // One line for the io_uring probe file and one for the swap files, not one per rank and file.
  EXPECT_GE(tmpfs_lines, 1) << out;
  EXPECT_LE(tmpfs_lines, 2) << out;
}

}  // namespace
}  // namespace strata::testing
