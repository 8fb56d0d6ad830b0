// Every class of bad input gives one ConfigError naming file, line, column, key path and cause.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <fstream>

#include "strata/config.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

using namespace strata;

namespace {

struct Expect {
  int line;    // 1-based, 0 = unknown
  int column;  // 1-based, 0 = unknown (checked only when line > 0)
  std::string key;
  std::vector<std::string> contains;
};

void expect_config_error(const std::string& yaml, const Expect& e,
                         const std::vector<std::string>& sets = {},
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
  expect_config_error("model: {parameters: 1B}\nzero:\n  stgae: 3\n",
                      {3, 3, "zero.stgae", {"unknown key 'stgae'", "did you mean 'stage'?"}});
  expect_config_error("model:\n  paramters: 1B\n",
                      {2, 3, "model.paramters", {"did you mean 'parameters'?"}});
  expect_config_error("model: {parameters: 1B}\nzeroo: {stage: 1}\n",
                      {2, 1, "zeroo", {"did you mean 'zero'?"}});
  expect_config_error("model: {parameters: 1B}\noffload: {optimizer: {tier: cpu, pin: true}}\n",
                      {2, 34, "offload.optimizer.pin", {"did you mean 'pin_memory'?"}});
  expect_config_error("model: {parameters: 1B}\nwibble: 1\n",
                      {2, 1, "wibble", {"unknown key", "valid keys: model"}});
}

TEST(ConfigErrors, WrongType) {
  expect_config_error("model: {parameters: 1B}\nzero: {stage: [1, 2]}\n",
                      {2, 15, "zero.stage", {"expected", "list"}});
  expect_config_error("model: {parameters: 1B}\ntiers: {nvme: {checksum: maybe}}\n",
                      {2, 26, "tiers.nvme.checksum", {"'maybe' is not a boolean"}});
  expect_config_error("model: {parameters: 1B}\nzero: 3\n", {2, 7, "zero", {"expected a mapping"}});
  expect_config_error("model: {parameters: 1B}\noptimizer: {lr: fast}\n",
                      {2, 17, "optimizer.lr", {"'fast' is not a number"}});
  expect_config_error("model: {parameters: 1B}\nprecision: {params: fp8}\n",
                      {2, 21, "precision.params", {"'fp8' is not one of: fp16, bf16, fp32"}});
  expect_config_error("model: {parameters: 1B}\noffload: {optimizer: {tier: nvm}}\n",
                      {2, 29, "offload.optimizer.tier", {"did you mean 'nvme'?"}});
  expect_config_error("model: {parameters: 1B}\nzero: {stage: }\n",
                      {2, 15, "zero.stage", {"no value"}});
  expect_config_error("model: {parameters: 1B}\noptimizer: {betas: 0.9}\n",
                      {2, 20, "optimizer.betas", {"two numbers"}});
  expect_config_error("model: {parameters: 1B}\nmodel: {parameters: 2B}\n",
                      {2, 1, "model", {"duplicate key"}});
}

TEST(ConfigErrors, OutOfRange) {
  expect_config_error("model: {parameters: 1B}\nzero: {stage: 4}\n",
                      {2, 15, "zero.stage", {"out of range", "[0, 3]"}});
  expect_config_error("model: {parameters: 1B}\nworld: {ranks: 0}\n",
                      {2, 16, "world.ranks", {"out of range"}});
  expect_config_error("model: {parameters: 1B}\nworld: {ranks: -2}\n",
                      {2, 16, "world.ranks", {">= 1"}});
  expect_config_error("model: {parameters: 1B}\nworld: {ranks: 4, ranks_per_node: 8}\n",
                      {2, 35, "world.ranks_per_node", {"must be <= world.ranks (4)"}});
  expect_config_error("model: {parameters: 1B}\noffload: {optimizer: {tier: cpu, fraction: 1.5}}\n",
                      {2, 44, "offload.optimizer.fraction", {"[0, 1]"}});
  expect_config_error(
      "model: {parameters: 1B}\noffload: {optimizer: {tier: cpu, fraction: -0.1}}\n",
      {2, 44, "offload.optimizer.fraction", {"[0, 1]"}});
  expect_config_error("model: {parameters: 1B}\ntiers: {nvme: {block_size: 6000B}}\n",
                      {2, 28, "tiers.nvme.block_size", {"not a multiple of 4096"}});
  expect_config_error("model: {parameters: 1B}\ntiers: {nvme: {queue_depth: 5000}}\n",
                      {2, 29, "tiers.nvme.queue_depth", {"out of range"}});
  expect_config_error("model: {parameters: 1B}\noptimizer: {betas: [0.9, 1.0]}\n",
                      {2, 20, "optimizer.betas", {"[0, 1)"}});
  expect_config_error(
      "model: {parameters: 1B}\ntiers: {host: {budget: 4GiB, pinned_budget: 8GiB}}\n",
      {2, 45, "tiers.host.pinned_budget", {"must be <= tiers.host.budget"}});
}

TEST(ConfigErrors, MalformedUnits) {
  expect_config_error("model: {parameters: 1B}\ntiers: {gpu: {budget: 4 GiBs}}\n",
                      {2, 23, "tiers.gpu.budget", {"unknown size unit 'GiBs'"}});
  expect_config_error("model: {parameters: 1B}\ntiers: {gpu: {budget: -1}}\n",
                      {2, 23, "tiers.gpu.budget", {"cannot be negative"}});
  expect_config_error("model: {parameters: 1e400}\n",
                      {1, 21, "model.parameters", {"out of range"}});
  expect_config_error("model: {parameters: 7.5X}\n",
                      {1, 21, "model.parameters", {"unknown count suffix"}});
  expect_config_error("model: {parameters: -1}\n", {1, 21, "model.parameters", {"negative"}});
  expect_config_error("model: {parameters: 1B}\ntiers: {host: {buffer_size: 1.5B}}\n",
                      {2, 29, "tiers.host.buffer_size", {"whole number"}});
}

TEST(ConfigErrors, ImpossibleCombinations) {
  // precision.grad_accum: the gradients' own dtype or fp32, nothing else.
  expect_config_error(
      "model: {parameters: 1B}\nprecision:\n  grads: bf16\n  grad_accum: fp16\n",
      {4,
       15,
       "precision.grad_accum",
       {"bf16 cannot be accumulated in fp16", "use precision.grad_accum bf16", "or fp32"}});
  expect_config_error("model: {parameters: 1B}\nprecision: {grads: fp32, grad_accum: bf16}\n",
                      {2, 38, "precision.grad_accum", {"fp32 cannot be accumulated in bf16"}});
  expect_config_error("model: {parameters: 1B}\nprecision: {grad_accum: fp8}\n",
                      {2, 25, "precision.grad_accum", {"'fp8' is not one of"}});
  expect_config_error(
      "model: {parameters: 1B}\nzero: {stage: 2}\noffload:\n  params: {tier: cpu}\n",
      {4, 18, "offload.params.tier", {"only at zero.stage 3", "zero.stage is 2"}});
  expect_config_error(
      "model: {parameters: 1B}\nzero: {stage: 1}\noffload: {gradients: {tier: cpu}}\n",
      {3, 29, "offload.gradients.tier", {"zero.stage >= 2"}});
  expect_config_error(
      "model: {parameters: 1B}\nzero: {stage: 0}\noffload: {optimizer: {tier: cpu}}\n",
      {3, 29, "offload.optimizer.tier", {"zero.stage >= 1"}});
  expect_config_error("model: {parameters: 1B}\noffload: {optimizer: {tier: nvme}}\n",
                      {2, 29, "offload.optimizer.tier", {"tiers.nvme.paths is empty"}});
  expect_config_error("model: {parameters: 1B, hidden_size: 100, heads: 3}\n",
                      {1, 50, "model.heads", {"multiple of model.heads"}});
}

TEST(ConfigErrors, BadDocuments) {
  expect_config_error("", {0, 0, "", {"empty"}});
  expect_config_error("# only a comment\n", {0, 0, "", {"empty"}});
  expect_config_error("- model\n- zero\n", {1, 1, "", {"must be a mapping", "list"}});
  expect_config_error("just a scalar\n", {1, 1, "", {"must be a mapping", "scalar"}});
  expect_config_error("model: {parameters: 1B\n", {2, 1, "", {"YAML syntax error"}});
  expect_config_error("model:\n  parameters: 1B\n   zero: 3\n", {3, 8, "", {"YAML syntax error"}});
  expect_config_error("model: {parameters: 1B}\n---\nzero: {stage: 1}\n",
                      {3, 1, "", {"more than one"}});
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
    EXPECT_EQ(std::string(e.what()), bad +
                                         ":2:8: zero.stgae: unknown key 'stgae' in 'zero'; did you "
                                         "mean 'stage'? (valid keys: stage, sub_group_size, "
                                         "reduce_bucket_size)");
  }
}

TEST(ConfigErrors, SetOverridesAreCheckedTheSameWay) {
  const std::string ok = "model: {parameters: 1B}\n";
  expect_config_error(ok, {0, 0, "zero.stage", {"out of range"}}, {"zero.stage=9"},
                      "--set zero.stage=9");
  expect_config_error(ok, {0, 0, "zero.stgae", {"did you mean 'stage'?"}}, {"zero.stgae=1"},
                      "--set zero.stgae=1");
  expect_config_error(ok, {0, 0, "tiers.gpu.budget", {"unknown size unit"}},
                      {"tiers.gpu.budget=4 GiBs"}, "--set tiers.gpu.budget=4 GiBs");
  expect_config_error(ok, {0, 0, "", {"KEY.PATH=VALUE"}}, {"zero.stage"}, "--set zero.stage");
  expect_config_error(ok, {0, 0, "zero.stage", {"no value"}}, {"zero.stage="}, "--set zero.stage=");
  expect_config_error(ok, {0, 0, "zero.stage", {"not valid YAML"}}, {"zero.stage=[1"},
                      "--set zero.stage=[1");
  expect_config_error(ok, {0, 0, "zero.stage.x", {"is a value"}}, {"zero.stage.x=1"},
                      "--set zero.stage.x=1");
  expect_config_error(ok, {0, 0, "offload.params.tier", {"only at zero.stage 3"}},
                      {"offload.params.tier=cpu"}, "--set offload.params.tier=cpu");
  expect_config_error(ok, {0, 0, "offload.optimizer.frac", {"did you mean 'fraction'?"}},
                      {"offload.optimizer={tier: cpu, frac: 1}"},
                      "--set offload.optimizer={tier: cpu, frac: 1}");
  // An error in the file itself still points into the file.
  expect_config_error("model: {parameters: 1B}\nzero: {stage: 9}\n",
                      {2, 15, "zero.stage", {"out of range"}}, {"tiers.gpu.budget=1GB"});
}

// ---- issue 15: bounded inputs -------------------------------------------------------------------

// A file holding "," (or a trailing comma) made yaml-cpp's LoadAll allocate without bound.
TEST(ConfigErrors, Issue15StrayFlowIndicatorsAreSyntaxErrors) {
  expect_config_error(",", {1, 1, "", {"YAML syntax error", "unexpected ','"}});
  expect_config_error("{model: {parameters: 7B}},",
                      {1, 26, "", {"unexpected ','", "trailing comma"}});
  expect_config_error("model: {parameters: 7B}\n]", {2, 1, "", {"YAML syntax error"}});
  expect_config_error("model: {parameters: 7B}}\n", {1, 24, "", {"YAML syntax error"}});
  expect_config_error("model: {parameters: 7B}\n---\n,\n", {3, 1, "", {"unexpected ','"}});
  // The same guard for --set values.
  expect_config_error("model: {parameters: 1B}\n",
                      {0, 0, "zero.stage", {"not valid YAML", "unexpected ','"}},
                      {"zero.stage=[3],"}, "--set zero.stage=[3],");
  expect_config_error("model: {parameters: 1B}\n",
                      {0, 0, "zero.stage", {"not valid YAML", "unexpected ','"}}, {"zero.stage=,"},
                      "--set zero.stage=,");
}

TEST(ConfigErrors, Issue15ConfigTextIsAtMostOneMiB) {
  std::string big = "model: {parameters: 1B}\n";
  big += "#" + std::string((1 << 20), 'x') + "\n";
  expect_config_error(big, {0, 0, "", {"at most 1048576 bytes"}});
}

TEST(ConfigErrors, Issue15ConfigMustBeARegularFileOfAtMostOneMiB) {
  strata::testing::TempDir dir;
  auto expect_file_error = [](const std::string& path, const std::string& what) {
    SCOPED_TRACE(path);
    try {
      load_config(path);
      ADD_FAILURE() << "no error for " << path;
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.exit_code(), 2);
      EXPECT_EQ(e.file(), path);
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  // A FIFO without a writer blocked forever; /dev/zero never ended.
  const std::string fifo = dir.str() + "/fifo.yaml";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_file_error(fifo, "it is a FIFO; a config must be a regular file");
  expect_file_error("/dev/zero", "it is a character device");
  expect_file_error(dir.str(), "it is a directory");
  const std::string big = dir.str() + "/big.yaml";
  {
    std::ofstream out(big);
    out << "model: {parameters: 1B}\n#" << std::string(1 << 20, 'x') << "\n";
  }
  expect_file_error(big, "a config is at most 1048576 bytes");
  // Exactly 1 MiB is fine.
  const std::string edge = dir.str() + "/edge.yaml";
  {
    std::string text = "model: {parameters: 1B}\n#";
    text += std::string((1 << 20) - text.size() - 1, 'x') + "\n";
    ASSERT_EQ(text.size(), 1u << 20);
    std::ofstream(edge) << text;
  }
  EXPECT_EQ(load_config(edge).model.parameters, 1'000'000'000ULL);
}

// Every numeric key has a range that makes derived figures fit their types (docs/config.md).
TEST(ConfigErrors, Issue15RangesKeepArithmeticInBounds) {
  // 2^60 parameters made every tier plan at 0 B (16 B x 2^60 wraps).
  expect_config_error("model:\n  parameters: 1152921504606846976\n",
                      {2, 15, "model.parameters", {"out of range", "[0, 100000000000000]"}});
  expect_config_error("model: {parameters: 101T}\n", {1, 21, "model.parameters", {"out of range"}});
  EXPECT_EQ(parse_config("model: {parameters: 100T}\n").model.parameters, 100'000'000'000'000ULL);
  // 1e10 s overflowed the int64 nanoseconds and every collective timed out at once.
  expect_config_error("runtime: {collective_timeout_s: 1e10}\n",
                      {1, 33, "runtime.collective_timeout_s", {"out of range", "[0.001, 1e+06]"}});
  expect_config_error("runtime: {collective_timeout_s: 0}\n",
                      {1, 33, "runtime.collective_timeout_s", {"out of range"}});
  EXPECT_DOUBLE_EQ(
      parse_config("runtime: {collective_timeout_s: 1e6}\n").runtime.collective_timeout_s, 1e6);
  // 4096 was valid by the docs and refused by CpuAdam at run time.
  expect_config_error("runtime: {cpu_threads: 4096}\n",
                      {1, 24, "runtime.cpu_threads", {"[0, 1024]"}});
  EXPECT_EQ(parse_config("runtime: {cpu_threads: 1024}\n").runtime.cpu_threads, 1024u);
  // train.accumulate (issue 24.6: DeepSpeed's gradient_accumulation_steps): 1..65536.
  expect_config_error("train: {accumulate: 0}\n", {1, 21, "train.accumulate", {"[1, 65536]"}});
  expect_config_error("train:\n  accumulate: 65537\n", {2, 15, "train.accumulate", {"[1, 65536]"}});
  expect_config_error("train: {accumulate: two}\n", {1, 21, "train.accumulate", {}});
  expect_config_error("train: {acumulate: 2}\n", {1, 9, "train.acumulate", {"accumulate"}});
  EXPECT_EQ(parse_config("train: {accumulate: 65536}\n").train.accumulate, 65536u);
  EXPECT_EQ(parse_config("{}\n").train.accumulate, 1u);
  expect_config_error("model: {sequence_length: 16777217}\n",
                      {1, 26, "model.sequence_length", {"out of range"}});
  expect_config_error("model: {hidden_size: 64, heads: 128}\n",
                      {1, 33, "model.heads", {"<= model.hidden_size"}});
  expect_config_error("world: {ranks: 8192, ranks_per_node: 8192}\n",
                      {1, 38, "world.ranks_per_node", {"[0, 4096]"}});
  expect_config_error("world: {ranks: 2000000}\n", {1, 16, "world.ranks", {"out of range"}});
  expect_config_error("tiers: {host: {buffer_size: 128GiB}}\n",
                      {1, 29, "tiers.host.buffer_size", {"out of range"}});
  expect_config_error("tiers: {nvme: {block_size: 2GiB}}\n",
                      {1, 28, "tiers.nvme.block_size", {"out of range"}});
  expect_config_error("precision: {loss_scale: {initial: 1e40}}\n",
                      {1, 35, "precision.loss_scale.initial", {"out of range"}});
  expect_config_error("optimizer: {eps: 0}\n",
                      {1, 18, "optimizer.eps", {"out of range", "(0, 1]"}});
  expect_config_error("optimizer: {lr: 1e9}\n", {1, 17, "optimizer.lr", {"out of range"}});
  expect_config_error("zero: {sub_group_size: 1e15}\n",
                      {1, 24, "zero.sub_group_size", {"out of range"}});
}

// ---- issue 16 point 7: sizes need a unit; model.parameters is optional
// ----------------------------

TEST(ConfigErrors, Issue16ByteSizesNeedAUnit) {
  expect_config_error("tiers:\n  gpu: {budget: 80}\n",
                      {2, 17, "tiers.gpu.budget", {"'80' has no unit", "80B", "80GB"}});
  expect_config_error("tiers: {host: {buffer_size: 1M}}\n",
                      {1, 29, "tiers.host.buffer_size", {"did you mean 1MiB (or 1MB)?"}});
  expect_config_error("tiers: {nvme: {block_size: 4k}}\n",
                      {1, 28, "tiers.nvme.block_size", {"did you mean 4KiB (or 4kB)?"}});
  expect_config_error("model: {parameters: 1B}\n", {0, 0, "tiers.gpu.budget", {"has no unit"}},
                      {"tiers.gpu.budget=80"}, "--set tiers.gpu.budget=80");
  // 0 needs no unit; a unit of bytes is explicit.
  EXPECT_EQ(parse_config("tiers: {nvme: {budget: 0}}\n").tiers.nvme.budget, 0u);
  EXPECT_EQ(parse_config("tiers: {gpu: {budget: 80B}}\n").tiers.gpu.budget, 80u);
}

TEST(ConfigErrors, Issue16ModelParametersIsOptional) {
  const Config c = parse_config("zero: {stage: 1}\n");
  EXPECT_EQ(c.model.parameters, 0u);
  EXPECT_EQ(c.zero.stage, 1);
  EXPECT_EQ(parse_config("model: {parameters: 0}\n").model.parameters, 0u);
  // largest_layer is checked against parameters only when parameters is known.
  EXPECT_EQ(parse_config("model: {largest_layer: 200M}\n").model.largest_layer, 200'000'000u);
  expect_config_error("model: {parameters: 100M, largest_layer: 200M}\n",
                      {1, 42, "model.largest_layer", {"larger than model.parameters"}});
}
