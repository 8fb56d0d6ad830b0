// Exit codes as documented (docs/errors.md): every bad path or argument exits 2, on every
// command, with one "strata: error:" line; --help exits 0 (issue 15, point 6).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "test_util.hpp"

namespace strata::testing {
namespace {

struct RunResult {
  int rc;
  std::string out;
};
RunResult run(const std::string& args) {
  RunResult r;
  r.rc = run_command("timeout 60 " + strata_cli() + " " + args + " </dev/null", &r.out);
  return r;
}

// The bad paths every command that reads a config is given.
struct BadConfigs {
  TempDir dir{"strata-exit"};
  std::string missing = dir.str() + "/missing.yaml";
  std::string directory = dir.str();
  std::string fifo = dir.str() + "/fifo.yaml";
  std::string comma = dir.str() + "/comma.yaml";
  std::string unitless = dir.str() + "/unitless.yaml";
  BadConfigs() {
    ::mkfifo(fifo.c_str(), 0600);
    std::ofstream(comma) << "{model: {parameters: 7B}},";
    std::ofstream(unitless) << "model: {parameters: 7B}\ntiers: {gpu: {budget: 80}}\n";
  }
};

void expect_bad_input(const std::string& args, const std::string& needle) {
  SCOPED_TRACE(args);
  RunResult r = run(args);
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find(needle), std::string::npos) << r.out;
}

class ConfigCommand : public ::testing::TestWithParam<const char*> {};

TEST_P(ConfigCommand, BadConfigPathsAndArgumentsExitTwo) {
  if (!std::filesystem::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  const std::string cmd = GetParam();
  BadConfigs b;
  expect_bad_input(cmd + " " + b.missing, "no such file");
  expect_bad_input(cmd + " " + b.directory, "it is a directory");
  expect_bad_input(cmd + " " + b.fifo, "it is a FIFO");
  expect_bad_input(cmd + " /dev/zero", "character device");
  expect_bad_input(cmd + " " + b.comma, "unexpected ','");
  expect_bad_input(cmd + " " + b.unitless, "tiers.gpu.budget: '80' has no unit");
  expect_bad_input(cmd + " " + b.missing + " --no-such-option", "no-such-option");
  expect_bad_input(cmd + " " + source_dir() + "/configs/default.yaml --set zero.stage=9",
                   "out of range");
  RunResult help = run(cmd + " --help");
  EXPECT_EQ(help.rc, 0) << help.out;
}

INSTANTIATE_TEST_SUITE_P(Commands, ConfigCommand,
                         ::testing::Values("plan", "profile", "bench step", "train"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (auto& c : n)
                             if (c == ' ') c = '_';
                           return n;
                         });

TEST(ExitCodes, BenchAdam) {
  if (!std::filesystem::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  expect_bad_input("bench adam --params lots", "lots");
  expect_bad_input("bench adam --params 1M --grads fp8", "fp8");
  expect_bad_input("bench adam --params 1M --threads 5000", "1024");
  expect_bad_input("bench adam --bogus", "bogus");
  EXPECT_EQ(run("bench adam --help").rc, 0);
}

TEST(ExitCodes, BenchIo) {
  if (!std::filesystem::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  TempDir dir("strata-exit");
  expect_bad_input("bench io --dir " + dir.str() + "/missing --size 1MiB", "No such file");
  expect_bad_input("bench io --dir /proc --size 1MiB", "not on a disk");
  { std::ofstream(dir.str() + "/f") << "x"; }
  expect_bad_input("bench io --dir " + dir.str() + "/f --size 1MiB", "Not a directory");
  expect_bad_input("bench io --dir " + dir.str() + " --size 80", "has no unit");
  expect_bad_input("bench io", "--dir");
  EXPECT_EQ(run("bench io --help").rc, 0);
}

TEST(ExitCodes, Checkpoint) {
  if (!std::filesystem::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  TempDir dir("strata-exit");
  for (const char* sub : {"info", "verify"}) {
    expect_bad_input(std::string("checkpoint ") + sub + " " + dir.str() + "/missing", "missing");
    expect_bad_input(std::string("checkpoint ") + sub + " " + dir.str(), dir.str());  // no manifest
    expect_bad_input(std::string("checkpoint ") + sub + " " + dir.str() + " --bogus", "bogus");
  }
  expect_bad_input(
      "checkpoint export " + dir.str() + "/missing --out " + dir.str() + "/m.safetensors",
      "missing");
  expect_bad_input("checkpoint export " + dir.str(), "--out");
  expect_bad_input("checkpoint", "");
  EXPECT_EQ(run("checkpoint --help").rc, 0);
  EXPECT_EQ(run("checkpoint export --help").rc, 0);
}

TEST(ExitCodes, ImportDeepspeed) {
  if (!std::filesystem::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  TempDir dir("strata-exit");
  expect_bad_input("import-deepspeed " + dir.str() + "/missing.json", "missing.json");
  expect_bad_input("import-deepspeed " + dir.str(), dir.str());
  { std::ofstream(dir.str() + "/bad.json") << "{\"zero_optimization\": "; }
  expect_bad_input("import-deepspeed " + dir.str() + "/bad.json", "bad.json");
  expect_bad_input("import-deepspeed --bogus x.json", "bogus");
  EXPECT_EQ(run("import-deepspeed --help").rc, 0);
}

TEST(ExitCodes, InfoCleanAndTopLevel) {
  if (!std::filesystem::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  expect_bad_input("info --bogus", "bogus");
  expect_bad_input("no-such-command", "unknown command 'no-such-command'");
  expect_bad_input("", "");
  expect_bad_input("clean", "PATH");
  expect_bad_input("clean /nonexistent/strata/swap", "No such file");
  EXPECT_EQ(run("info --help").rc, 0);
  EXPECT_EQ(run("clean --help").rc, 0);
  EXPECT_EQ(run("--help").rc, 0);
}

// The bench group's help names every bench command there is (it once listed three of four).
TEST(ExitCodes, BenchHelpListsEveryBenchCommand) {
  if (!std::filesystem::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  RunResult top = run("--help");
  ASSERT_EQ(top.rc, 0) << top.out;
  EXPECT_NE(top.out.find("bench adam|checkpoint|io|step"), std::string::npos) << top.out;
  RunResult bench = run("bench --help");
  ASSERT_EQ(bench.rc, 0) << bench.out;
  for (const char* c : {"adam", "checkpoint", "io", "step"})
    EXPECT_NE(bench.out.find(std::string("\n  ") + c + " "), std::string::npos) << c << bench.out;
}

}  // namespace
}  // namespace strata::testing
