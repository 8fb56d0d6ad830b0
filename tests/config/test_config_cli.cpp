// `strata plan` as a user runs it: exit codes, stderr messages, --json, --set.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

namespace {

std::string strata_bin() { return strata::testing::binary_dir() + "/strata"; }

struct CliRun {
  int rc;
  std::string out;  // stdout only
  std::string err;  // stderr only
};

CliRun run(const std::string& args) {
  CliRun r;
  // run_command appends 2>&1; split the streams with subshells.
  r.rc =
      strata::testing::run_command("(" + strata_bin() + " plan " + args + " 2>/dev/null)", &r.out);
  strata::testing::run_command("(" + strata_bin() + " plan " + args + " 2>&1 >/dev/null)", &r.err);
  return r;
}

std::string write(const strata::testing::TempDir& dir, const std::string& name,
                  const std::string& text) {
  std::string path = dir.str() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

void expect_config_error(const CliRun& r, const std::string& location, const std::string& text) {
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_NE(r.err.find("strata: error: " + location), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(text), std::string::npos) << r.err;
  // One line, no stack trace or abort message.
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.err.find("terminate"), std::string::npos) << r.err;
}

}  // namespace

TEST(PlanCli, PrintsTheTablesForTheDefaultConfig) {
  ASSERT_TRUE(std::filesystem::exists(strata_bin())) << strata_bin();
  CliRun r = run(strata::testing::source_dir() + "/configs/default.yaml");
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const char* s : {"Model state per rank by ZeRO stage", "per node", "nvme read", "network",
                        "Verdict:", "Recommendation:", "Assumptions:", "GB"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
}

TEST(PlanCli, JsonHasTheRequiredFiguresInBytes) {
  strata::testing::TempDir dir;
  std::string cfg = write(dir, "c.yaml", "model: {parameters: 7.5B}\nworld: {ranks: 8}\n");
  CliRun r = run(cfg + " --json --set zero.stage=1");
  ASSERT_EQ(r.rc, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);  // exactly one JSON document on stdout
  const std::uint64_t want[4] = {120'000'000'000ULL, 41'250'000'000ULL, 28'125'000'000ULL,
                                 15'000'000'000ULL};
  for (int s = 0; s < 4; ++s)
    EXPECT_EQ(j["stages"][s]["per_rank_bytes"]["total"].get<std::uint64_t>(), want[s]);
  EXPECT_EQ(j["configured"]["stage"], 1);
  // The gpu holds the model state and the engine's runtime buffers (at stage 1: the norm exchange
  // and finalize()'s 64 MiB broadcast staging).
  EXPECT_EQ(j["configured"]["by_kind_per_rank_bytes"]["gpu"]["total"].get<std::uint64_t>(),
            want[1]);
  EXPECT_EQ(
      j["configured"]["per_rank_bytes"]["gpu"].get<std::uint64_t>(),
      want[1] + j["configured"]["runtime_buffers_per_rank_bytes"]["total"].get<std::uint64_t>());
  EXPECT_EQ(j["bytes_per_param"]["total"], 16);
  EXPECT_TRUE(j["configured"]["fits"].get<bool>());
  EXPECT_EQ(j["recommendation"]["layout"]["stage"], 1);  // stage 0 needs 120 GB > 80 GB
}

TEST(PlanCli, BadInputExitsTwoWithOneMessage) {
  strata::testing::TempDir dir;
  std::string typo = write(dir, "typo.yaml", "model: {parameters: 1B}\nzero:\n  stgae: 3\n");
  expect_config_error(run(typo), typo + ":3:3: zero.stgae:", "did you mean 'stage'?");
  std::string unit =
      write(dir, "unit.yaml", "model: {parameters: 1B}\ntiers: {gpu: {budget: 4 GiBs}}\n");
  expect_config_error(run(unit), unit + ":2:23: tiers.gpu.budget:", "unknown size unit");
  std::string list = write(dir, "list.yaml", "- a\n- b\n");
  expect_config_error(run(list), list + ":1:1:", "must be a mapping");
  std::string syntax = write(dir, "syntax.yaml", "model: {parameters: 1B\n");
  expect_config_error(run(syntax), syntax + ":", "YAML syntax error");
  std::string empty = write(dir, "empty.yaml", "");
  expect_config_error(run(empty), empty + ":", "empty");
  expect_config_error(run(dir.str() + "/nope.yaml"), dir.str() + "/nope.yaml:", "no such file");
  std::string combo =
      write(dir, "combo.yaml", "model: {parameters: 1B}\noffload: {params: {tier: nvme}}\n");
  expect_config_error(run(combo), combo + ":2:", "offload.params.tier");
  std::string good = write(dir, "good.yaml", "model: {parameters: 1B}\n");
  expect_config_error(run(good + " --set zero.stage=7"),
                      "--set zero.stage=7: zero.stage:", "out of range");
  expect_config_error(run(good + " --set world.rank=2"),
                      "--set world.rank=2: world.rank:", "did you mean 'ranks'?");
  // --json does not change where errors go.
  expect_config_error(run(typo + " --json"), typo + ":3:3:", "stgae");
}
