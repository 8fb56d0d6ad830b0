// `strata bench io` end to end (skipped when the CLI is not built in this build directory).
#include <gtest/gtest.h>

#include <filesystem>

#include "test_util.hpp"

namespace strata {
namespace {

std::string cli() { return testing::binary_dir() + "/strata"; }

TEST(BenchIoCli, JsonForBothEngines) {
  if (testing::binary_dir().empty() || !std::filesystem::exists(cli())) GTEST_SKIP() << "no strata CLI built";
  testing::TempDir dir("strata-io-cli");
  for (const char* engine : {"io_uring", "threads"}) {
    for (const char* rw : {"write", "read"}) {
      std::string out;
      int rc = testing::run_command(cli() + " bench io --dir " + dir.str() +
                                        " --size 8MiB --block-size 128KiB --queue-depth 4 --rw " +
                                        rw + " --engine " + engine + " --direct-io auto --json 2>/dev/null",
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
  if (testing::binary_dir().empty() || !std::filesystem::exists(cli())) GTEST_SKIP() << "no strata CLI built";
  testing::TempDir dir("strata-io-cli");
  std::string out;
  EXPECT_EQ(testing::run_command(cli() + " bench io --dir " + dir.str() + " --rw sideways", &out), 2) << out;
  EXPECT_EQ(testing::run_command(cli() + " bench io --dir " + dir.str() + " --size 1000", &out), 2) << out;
  EXPECT_EQ(testing::run_command(cli() + " bench io --dir " + dir.str() + "/missing", &out), 2) << out;
}

}  // namespace
}  // namespace strata
