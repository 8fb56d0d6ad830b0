// Every class of bad input gives one ConfigError naming file, line, column, key path and cause.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>

#include "strata/config.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

using namespace strata;

namespace {

struct Expect {
  int line;     // 1-based, 0 = unknown
  int column;   // 1-based, 0 = unknown (checked only when line > 0)
  std::string key;
  std::vector<std::string> contains;
};

void expect_error(const std::string& yaml, const Expect& e, const std::vector<std::string>& sets = {},
                  const std::string& file = "bad.yaml") {
  SCOPED_TRACE(yaml);
  try {
    parse_config(yaml, "bad.yaml", sets);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& err) {
    EXPECT_EQ(err.code(), ErrorCode::kConfig);
    EXPECT_EQ(err.exit_code(), 2);
    EXPECT_EQ(err.file(), file) << err.what();
    EXPECT_EQ(err.line(), e.line) << err.what();
    if (e.line > 0) {
      EXPECT_EQ(err.column(), e.column) << err.what();
    }
    EXPECT_EQ(err.key_path(), e.key) << err.what();
    for (const auto& s : e.contains)
      EXPECT_NE(std::string(err.what()).find(s), std::string::npos) << err.what() << " lacks " << s;
    // what() is FILE:LINE:COL: KEY: message
    std::string prefix = file;
    if (e.line > 0) prefix += ":" + std::to_string(e.line) + ":" + std::to_string(e.column);
    EXPECT_EQ(std::string(err.what()).rfind(prefix + ": ", 0), 0u) << err.what();
  }
}

}  // namespace

TEST(ConfigErrors, UnknownKeySuggestsClosest) {
  expect_error("model: {parameters: 1B}\nzero:\n  stgae: 3\n",
               {3, 3, "zero.stgae", {"unknown key 'stgae'", "did you mean 'stage'?"}});
  expect_error("model:\n  paramters: 1B\n",
               {2, 3, "model.paramters", {"did you mean 'parameters'?"}});
  expect_error("model: {parameters: 1B}\nzeroo: {stage: 1}\n",
               {2, 1, "zeroo", {"did you mean 'zero'?"}});
  expect_error("model: {parameters: 1B}\noffload: {optimizer: {tier: cpu, pin: true}}\n",
               {2, 34, "offload.optimizer.pin", {"did you mean 'pin_memory'?"}});
  expect_error("model: {parameters: 1B}\nwibble: 1\n", {2, 1, "wibble", {"unknown key", "valid keys: model"}});
}

TEST(ConfigErrors, WrongType) {
  expect_error("model: {parameters: 1B}\nzero: {stage: [1, 2]}\n", {2, 15, "zero.stage", {"expected", "list"}});
  expect_error("model: {parameters: 1B}\ntiers: {nvme: {checksum: maybe}}\n",
               {2, 26, "tiers.nvme.checksum", {"'maybe' is not a boolean"}});
  expect_error("model: {parameters: 1B}\nzero: 3\n", {2, 7, "zero", {"expected a mapping"}});
  expect_error("model: {parameters: 1B}\noptimizer: {lr: fast}\n", {2, 17, "optimizer.lr", {"'fast' is not a number"}});
  expect_error("model: {parameters: 1B}\nprecision: {params: fp8}\n",
               {2, 21, "precision.params", {"'fp8' is not one of: fp16, bf16, fp32"}});
  expect_error("model: {parameters: 1B}\noffload: {optimizer: {tier: nvm}}\n",
               {2, 29, "offload.optimizer.tier", {"did you mean 'nvme'?"}});
  expect_error("model: {parameters: 1B}\nzero: {stage: }\n", {2, 15, "zero.stage", {"no value"}});
  expect_error("model: {parameters: 1B}\noptimizer: {betas: 0.9}\n", {2, 20, "optimizer.betas", {"two numbers"}});
  expect_error("model: {parameters: 1B}\nmodel: {parameters: 2B}\n", {2, 1, "model", {"duplicate key"}});
}

TEST(ConfigErrors, OutOfRange) {
  expect_error("model: {parameters: 1B}\nzero: {stage: 4}\n", {2, 15, "zero.stage", {"out of range", "[0, 3]"}});
  expect_error("model: {parameters: 1B}\nworld: {ranks: 0}\n", {2, 16, "world.ranks", {"out of range"}});
  expect_error("model: {parameters: 1B}\nworld: {ranks: -2}\n", {2, 16, "world.ranks", {">= 1"}});
  expect_error("model: {parameters: 1B}\nworld: {ranks: 4, ranks_per_node: 8}\n",
               {2, 35, "world.ranks_per_node", {"must be <= world.ranks (4)"}});
  expect_error("model: {parameters: 1B}\noffload: {optimizer: {tier: cpu, fraction: 1.5}}\n",
               {2, 44, "offload.optimizer.fraction", {"[0, 1]"}});
  expect_error("model: {parameters: 1B}\noffload: {optimizer: {tier: cpu, fraction: -0.1}}\n",
               {2, 44, "offload.optimizer.fraction", {"[0, 1]"}});
  expect_error("model: {parameters: 1B}\ntiers: {nvme: {block_size: 6000}}\n",
               {2, 28, "tiers.nvme.block_size", {"not a multiple of 4096"}});
  expect_error("model: {parameters: 1B}\ntiers: {nvme: {queue_depth: 5000}}\n",
               {2, 29, "tiers.nvme.queue_depth", {"out of range"}});
  expect_error("model: {parameters: 1B}\noptimizer: {betas: [0.9, 1.0]}\n",
               {2, 20, "optimizer.betas", {"[0, 1)"}});
  expect_error("model: {parameters: 1B}\ntiers: {host: {budget: 4GiB, pinned_budget: 8GiB}}\n",
               {2, 45, "tiers.host.pinned_budget", {"must be <= tiers.host.budget"}});
}

TEST(ConfigErrors, MalformedUnits) {
  expect_error("model: {parameters: 1B}\ntiers: {gpu: {budget: 4 GiBs}}\n",
               {2, 23, "tiers.gpu.budget", {"unknown size unit 'GiBs'"}});
  expect_error("model: {parameters: 1B}\ntiers: {gpu: {budget: -1}}\n",
               {2, 23, "tiers.gpu.budget", {"cannot be negative"}});
  expect_error("model: {parameters: 1e400}\n", {1, 21, "model.parameters", {"out of range"}});
  expect_error("model: {parameters: 7.5X}\n", {1, 21, "model.parameters", {"unknown count suffix"}});
  expect_error("model: {parameters: -1}\n", {1, 21, "model.parameters", {"negative"}});
  expect_error("model: {parameters: 1B}\ntiers: {host: {buffer_size: 1.5B}}\n",
               {2, 29, "tiers.host.buffer_size", {"whole number"}});
}

TEST(ConfigErrors, ImpossibleCombinations) {
  expect_error("model: {parameters: 1B}\nzero: {stage: 2}\noffload:\n  params: {tier: cpu}\n",
               {4, 18, "offload.params.tier", {"only at zero.stage 3", "zero.stage is 2"}});
  expect_error("model: {parameters: 1B}\nzero: {stage: 1}\noffload: {gradients: {tier: cpu}}\n",
               {3, 29, "offload.gradients.tier", {"zero.stage >= 2"}});
  expect_error("model: {parameters: 1B}\nzero: {stage: 0}\noffload: {optimizer: {tier: cpu}}\n",
               {3, 29, "offload.optimizer.tier", {"zero.stage >= 1"}});
  expect_error("model: {parameters: 1B}\noffload: {optimizer: {tier: nvme}}\n",
               {2, 29, "offload.optimizer.tier", {"tiers.nvme.paths is empty"}});
  expect_error("zero: {stage: 1}\n", {1, 1, "model.parameters", {"required"}});
  expect_error("model: {parameters: 1B, hidden_size: 100, heads: 3}\n",
               {1, 50, "model.heads", {"multiple of model.heads"}});
}

TEST(ConfigErrors, BadDocuments) {
  expect_error("", {0, 0, "", {"empty"}});
  expect_error("# only a comment\n", {0, 0, "", {"empty"}});
  expect_error("- model\n- zero\n", {1, 1, "", {"must be a mapping", "list"}});
  expect_error("just a scalar\n", {1, 1, "", {"must be a mapping", "scalar"}});
  expect_error("model: {parameters: 1B\n", {2, 1, "", {"YAML syntax error"}});
  expect_error("model:\n  parameters: 1B\n   zero: 3\n", {3, 8, "", {"YAML syntax error"}});
  expect_error("model: {parameters: 1B}\n---\nzero: {stage: 1}\n", {3, 1, "", {"more than one"}});
}

TEST(ConfigErrors, BadFiles) {
  strata::testing::TempDir dir;
  auto expect_file_error = [](const std::string& path, const std::string& what) {
    try {
      load_config(path);
      ADD_FAILURE() << "no error for " << path;
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.file(), path);
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_file_error(dir.str() + "/missing.yaml", "no such file");
  expect_file_error(dir.str(), "directory");
  const std::string empty = dir.str() + "/empty.yaml";
  std::ofstream(empty).close();
  expect_file_error(empty, "empty");
  if (geteuid() != 0) {  // root reads anything
    const std::string locked = dir.str() + "/locked.yaml";
    std::ofstream(locked) << "model: {parameters: 1B}\n";
    chmod(locked.c_str(), 0);
    expect_file_error(locked, "cannot read");
  }
  const std::string bad = dir.str() + "/bad.yaml";
  std::ofstream(bad) << "model: {parameters: 1B}\nzero: {stgae: 1}\n";
  try {
    load_config(bad);
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), bad + ":2:8: zero.stgae: unknown key 'stgae' in 'zero'; did you "
                                           "mean 'stage'? (valid keys: stage, sub_group_size, "
                                           "reduce_bucket_size)");
  }
}

TEST(ConfigErrors, SetOverridesAreCheckedTheSameWay) {
  const std::string ok = "model: {parameters: 1B}\n";
  expect_error(ok, {0, 0, "zero.stage", {"out of range"}}, {"zero.stage=9"}, "--set zero.stage=9");
  expect_error(ok, {0, 0, "zero.stgae", {"did you mean 'stage'?"}}, {"zero.stgae=1"}, "--set zero.stgae=1");
  expect_error(ok, {0, 0, "tiers.gpu.budget", {"unknown size unit"}}, {"tiers.gpu.budget=4 GiBs"},
               "--set tiers.gpu.budget=4 GiBs");
  expect_error(ok, {0, 0, "", {"KEY.PATH=VALUE"}}, {"zero.stage"}, "--set zero.stage");
  expect_error(ok, {0, 0, "zero.stage", {"no value"}}, {"zero.stage="}, "--set zero.stage=");
  expect_error(ok, {0, 0, "zero.stage", {"not valid YAML"}}, {"zero.stage=[1"}, "--set zero.stage=[1");
  expect_error(ok, {0, 0, "zero.stage.x", {"is a value"}}, {"zero.stage.x=1"}, "--set zero.stage.x=1");
  expect_error(ok, {0, 0, "offload.params.tier", {"only at zero.stage 3"}}, {"offload.params.tier=cpu"},
               "--set offload.params.tier=cpu");
  expect_error(ok, {0, 0, "offload.optimizer.frac", {"did you mean 'fraction'?"}},
               {"offload.optimizer={tier: cpu, frac: 1}"}, "--set offload.optimizer={tier: cpu, frac: 1}");
  // An error in the file itself still points into the file.
  expect_error("model: {parameters: 1B}\nzero: {stage: 9}\n", {2, 15, "zero.stage", {"out of range"}},
               {"tiers.gpu.budget=1GB"});
}
