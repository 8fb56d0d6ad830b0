// Loading, defaults, units, --set and to_yaml round trips.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <tuple>

#include "config/suggest.hpp"
#include "strata/config.hpp"
#include "strata/error.hpp"
#include "strata/plan.hpp"
#include "test_util.hpp"

using namespace strata;

namespace {
Config parse(const std::string& yaml, const std::vector<std::string>& sets = {}) {
  return parse_config(yaml, "test.yaml", sets);
}
// Every field a config file can set (besides to_yaml, which prints what a file would say), as
// one tuple: two configs are the same when their tuples compare equal; a failure prints both.
auto offload_fields(const OffloadTarget& o) { return std::tie(o.tier, o.fraction, o.pin_memory); }
auto fields(const Config& c) {
  return std::tuple_cat(
      std::tie(c.model.parameters, c.model.largest_layer, c.model.layers, c.model.micro_batch,
               c.precision.params, c.precision.grads, c.precision.grad_accum,
               c.precision.loss_scale.initial, c.precision.loss_scale.dynamic, c.optimizer.type,
               c.optimizer.lr, c.optimizer.beta1, c.optimizer.beta2, c.optimizer.eps, c.world.ranks,
               c.world.ranks_per_node, c.zero.stage, c.zero.sub_group_size),
      offload_fields(c.offload.optimizer), offload_fields(c.offload.gradients),
      offload_fields(c.offload.params),
      std::tie(c.tiers.gpu.budget, c.tiers.host.budget, c.tiers.host.budget_set,
               c.tiers.host.pinned_budget, c.tiers.host.buffer_size, c.tiers.nvme.paths,
               c.tiers.nvme.engine, c.tiers.nvme.block_size, c.tiers.nvme.direct_io,
               c.tiers.nvme.budget, c.runtime.device, c.runtime.communicator,
               c.runtime.collective_timeout_s, c.train.accumulate));
}
void expect_same(const Config& a, const Config& b) {
  EXPECT_EQ(to_yaml(a), to_yaml(b));
  EXPECT_EQ(fields(a), fields(b));
}
}  // namespace

// precision.grad_accum: auto (unset) holds the gradients in their own dtype; fp32 or the
// gradients' dtype given; to_yaml writes it back.
TEST(Config, GradAccum) {
  Config c = parse("model: {parameters: 1B}\nprecision: {grads: bf16}\n");
  EXPECT_FALSE(c.precision.grad_accum.has_value());
  EXPECT_EQ(c.precision.accum_dtype(), DType::kBf16);
  c = parse("model: {parameters: 1B}\nprecision: {grads: fp16, grad_accum: fp32}\n");
  EXPECT_EQ(c.precision.accum_dtype(), DType::kFp32);
  expect_same(c, parse_config(to_yaml(c), c.source));
  c = parse("model: {parameters: 1B}\nprecision: {grads: bf16, grad_accum: bf16}\n");
  EXPECT_EQ(c.precision.accum_dtype(), DType::kBf16);
  c = parse("model: {parameters: 1B}\nprecision: {grads: fp32, grad_accum: auto}\n");
  EXPECT_EQ(c.precision.accum_dtype(), DType::kFp32);
  expect_same(c, parse_config(to_yaml(c), c.source));
}

// tiers.host.budget not given stays not given through to_yaml (strata plan checks the machine's
// memory for it, not the 512 GiB default: ZeroOptimizer.config_yaml() planned as its config).
TEST(Config, AHostBudgetNotSetStaysNotSetThroughToYaml) {
  Config c = parse("model: {parameters: 1B}\n");
  ASSERT_FALSE(c.tiers.host.budget_set);
  const std::string y = to_yaml(c);
  EXPECT_NE(y.find("# budget: not set"), std::string::npos) << y;
  Config back = parse_config(y, c.source);
  EXPECT_FALSE(back.tiers.host.budget_set);
  expect_same(c, back);
  c = parse("model: {parameters: 1B}\ntiers: {host: {budget: 64GiB}}\n");
  back = parse_config(to_yaml(c), c.source);
  EXPECT_TRUE(back.tiers.host.budget_set);
  EXPECT_EQ(back.tiers.host.budget, 64ULL << 30);
  expect_same(c, back);
}

TEST(Config, MinimalConfigGetsEveryDefault) {
  Config c = parse("model: {parameters: 7.5B}\n");
  Config d;  // the defaults written in config.hpp
  d.model.parameters = 7'500'000'000ULL;
  d.source = "test.yaml";
  expect_same(c, d);
  EXPECT_EQ(c.source, "test.yaml");
  EXPECT_EQ(c.zero.stage, 2);
  EXPECT_EQ(c.tiers.gpu.budget, 80'000'000'000ULL);
  EXPECT_EQ(c.tiers.host.budget, 512ULL << 30);
  EXPECT_EQ(c.tiers.host.buffer_size, 256ULL << 20);
  EXPECT_TRUE(c.tiers.nvme.paths.empty());
  EXPECT_EQ(c.ranks_per_node(), 1u);
  EXPECT_EQ(c.nodes(), 1u);
}

TEST(Config, ReadsTheDesignExample) {
  Config c = parse(R"(
model:
  parameters: 7.5B
  largest_layer: 200M
  layers: 32
  hidden_size: 4096
  heads: 32
  sequence_length: 2048
  micro_batch: 1
precision: {params: bf16, grads: fp32, loss_scale: {dynamic: false, initial: 1024}}
optimizer:
  type: adam
  lr: 3.0e-4
  betas: [0.8, 0.95]
  eps: 1.0e-6
  weight_decay: 0.1
  grad_clip: 1.0
  update: device
world: {ranks: 16, ranks_per_node: 8}
zero: {stage: 3, sub_group_size: 50M, reduce_bucket_size: 1e8}
offload:
  optimizer: {tier: nvme, fraction: 0.75}
  gradients: {tier: host, pin_memory: true}
  params:    nvme
tiers:
  gpu:  {budget: 40GB}
  host: {budget: 256GiB, pinned_budget: 16GiB, buffer_count: 8, buffer_size: 64MiB}
  nvme:
    paths: [/mnt/a, /mnt/b]
    engine: threads
    block_size: 512KiB
    queue_depth: 64
    io_threads: 4
    direct_io: required
    checksum: false
    sqpoll: true
    budget: 2TB
runtime: {device: host, communicator: inprocess, collective_timeout_s: 12.5, cpu_threads: 2}
train: {accumulate: 4}
)");
  EXPECT_EQ(c.train.accumulate, 4u);
  EXPECT_EQ(c.model.parameters, 7'500'000'000ULL);
  EXPECT_EQ(c.model.largest_layer, 200'000'000ULL);
  EXPECT_TRUE(c.model.has_shape());
  EXPECT_EQ(c.precision.params, DType::kBf16);
  EXPECT_EQ(c.precision.grads, DType::kFp32);
  EXPECT_FALSE(c.precision.loss_scale.dynamic);
  EXPECT_EQ(c.precision.loss_scale.initial, 1024.0);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdam);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.grad_clip, 1.0);
  EXPECT_EQ(c.optimizer.update, OptimizerUpdate::kDevice);
  EXPECT_EQ(c.world.ranks, 16u);
  EXPECT_EQ(c.nodes(), 2u);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.sub_group_size, 50'000'000ULL);
  EXPECT_EQ(c.zero.reduce_bucket_size, 100'000'000ULL);
  EXPECT_EQ(c.offload.optimizer.tier, Tier::kNvme);
  EXPECT_DOUBLE_EQ(c.offload.optimizer.fraction, 0.75);
  EXPECT_EQ(c.offload.gradients.tier, Tier::kCpu);  // host = cpu
  EXPECT_TRUE(c.offload.gradients.pin_memory);
  EXPECT_EQ(c.offload.params.tier, Tier::kNvme);
  EXPECT_EQ(c.tiers.gpu.budget, 40'000'000'000ULL);
  EXPECT_EQ(c.tiers.host.pinned_budget, 16ULL << 30);
  EXPECT_EQ(c.tiers.host.buffer_count, 8u);
  EXPECT_EQ(c.tiers.nvme.paths, (std::vector<std::string>{"/mnt/a", "/mnt/b"}));
  EXPECT_EQ(c.tiers.nvme.engine, IoEngineKind::kThreads);
  EXPECT_EQ(c.tiers.nvme.block_size, 512ULL << 10);
  EXPECT_EQ(c.tiers.nvme.queue_depth, 64u);
  EXPECT_EQ(c.tiers.nvme.direct_io, DirectIoMode::kRequired);
  EXPECT_FALSE(c.tiers.nvme.checksum);
  EXPECT_TRUE(c.tiers.nvme.sqpoll);
  EXPECT_EQ(c.tiers.nvme.budget, 2'000'000'000'000ULL);
  EXPECT_EQ(c.runtime.device, DeviceKind::kHost);
  EXPECT_EQ(c.runtime.communicator, CommBackend::kInProcess);
  EXPECT_DOUBLE_EQ(c.runtime.collective_timeout_s, 12.5);

  // Round trip: to_yaml() reads back to the same Config, and is stable.
  Config back = parse(to_yaml(c));
  expect_same(c, back);
  EXPECT_EQ(to_yaml(back), to_yaml(c));
}

TEST(Config, Units) {
  EXPECT_EQ(parse("model: {parameters: 350M}").model.parameters, 350'000'000ULL);
  EXPECT_EQ(parse("model: {parameters: 7.5e9}").model.parameters, 7'500'000'000ULL);
  EXPECT_EQ(parse("model: {parameters: 1200}").model.parameters, 1200ULL);
  EXPECT_EQ(parse("model: {parameters: 1}\ntiers: {gpu: {budget: 4GiB}}").tiers.gpu.budget,
            4ULL << 30);
  EXPECT_EQ(parse("model: {parameters: 1}\ntiers: {gpu: {budget: 80GB}}").tiers.gpu.budget,
            80'000'000'000ULL);
  EXPECT_EQ(parse("model: {parameters: 1}\ntiers: {gpu: {budget: 1MB}}").tiers.gpu.budget,
            1'000'000ULL);
  EXPECT_EQ(
      parse("model: {parameters: 1}\ntiers: {host: {buffer_size: 512MiB}}").tiers.host.buffer_size,
      512ULL << 20);
}

TEST(Config, RandomRoundTrips) {
  std::mt19937_64 rng(strata::testing::test_seed("config round trip"));
  for (int i = 0; i < 50; ++i) {
    Config c;
    c.model.parameters = 1 + rng() % 1'000'000'000'000ULL;
    c.model.layers = rng() % 100;
    c.precision.params = static_cast<DType>(rng() % 3);
    c.precision.grads = static_cast<DType>(rng() % 3);
    c.optimizer.lr = std::uniform_real_distribution<double>(0, 1)(rng);
    c.optimizer.beta2 = std::uniform_real_distribution<double>(0, 0.99999)(rng);
    c.world.ranks = 1 + rng() % 1024;
    c.world.ranks_per_node = rng() % (c.world.ranks + 1);
    c.zero.stage = 3;
    c.offload.optimizer = {static_cast<Tier>(rng() % 3),
                           std::uniform_real_distribution<double>(0, 1)(rng),
                           static_cast<bool>(rng() % 2)};
    c.offload.params.tier = static_cast<Tier>(rng() % 3);
    c.tiers.nvme.paths = {"/tmp/a b", "/tmp/\"q\":x"};
    c.tiers.nvme.block_size = 4096 * (1 + rng() % 1000);
    c.tiers.host.buffer_size = 4096 * (1 + rng() % 100000);
    c.tiers.nvme.budget = rng() % 1'000'000'000'000'000ULL;
    c.runtime.collective_timeout_s = 0.001 + rng() % 1000;
    c.source = "test.yaml";
    Config back = parse(to_yaml(c));
    expect_same(c, back);
  }
}

// issue 15: paths are bytes; to_yaml must not turn non-UTF-8 bytes into U+FFFD.
TEST(Config, PathsSurviveToYamlByteForByte) {
  Config c;
  c.tiers.nvme.paths = {"/mnt/nvme\xff\xfe\x80/swap", "/tmp/caf\xc3\xa9",
                        "/a\"b\\c\td\ne\x01\x7f",     "/x: #y [z], {w}",
                        " lead and trail ",           "'single'"};
  const std::string y = to_yaml(c);
  Config back = parse(y);
  ASSERT_EQ(back.tiers.nvme.paths.size(), c.tiers.nvme.paths.size()) << y;
  for (std::size_t i = 0; i < c.tiers.nvme.paths.size(); ++i)
    EXPECT_EQ(back.tiers.nvme.paths[i], c.tiers.nvme.paths[i]) << i << "\n" << y;
  EXPECT_EQ(to_yaml(back), y);
}

// issue 15: the activation estimate wrapped for large shapes. At the top of every range it
// saturates instead (and never fits); inside the ranges the plan's figures are exact.
TEST(Config, Issue15ActivationEstimateNeverWraps) {
  Config c = parse_config(
      "model: {parameters: 100T, layers: 1048576, hidden_size: 1048576, heads: 65536,\n"
      "        sequence_length: 16777216, micro_batch: 65536}\nworld: {ranks: 4096}\n");
  const ActivationEstimate a = estimate_activations(c, 0);
  ASSERT_TRUE(a.available);
  EXPECT_EQ(a.per_layer, std::numeric_limits<std::uint64_t>::max());
  EXPECT_EQ(a.without_checkpointing, std::numeric_limits<std::uint64_t>::max());
  EXPECT_FALSE(a.fits_without_checkpointing);
  EXPECT_FALSE(a.fits_with_checkpointing);
  // A shape whose figure fits 64 bits is exact: 34*s*b*h + 5*a*s^2*b per layer.
  Config d = parse_config(
      "model: {parameters: 7B, layers: 32, hidden_size: 4096, heads: 32,\n"
      "        sequence_length: 2048, micro_batch: 1}\n");
  const ActivationEstimate e = estimate_activations(d, 0);
  EXPECT_EQ(e.per_layer, 34ULL * 2048 * 4096 + 5ULL * 32 * 2048 * 2048);
  EXPECT_EQ(e.without_checkpointing, 32 * e.per_layer);
  // The largest model the ranges allow plans without wrapping: per-node bytes grow with it.
  Config big = parse_config(
      "model: {parameters: 100T}\nworld: {ranks: 4096, ranks_per_node: 4096}\n"
      "zero: {stage: 0}\n");
  const Plan p = make_plan(big);
  EXPECT_EQ(p.configured.on_gpu.total(), 1'600'000'000'000'000ULL);
  EXPECT_EQ(p.configured.per_rank.gpu, 1'600'000'000'000'000ULL + p.configured.runtime.total());
  EXPECT_EQ(p.configured.per_node.gpu, p.configured.per_rank.gpu * 4096);
  EXPECT_FALSE(p.configured.fits());
}

// to_yaml writes sizes with units (a size without one is refused by the loader).
TEST(Config, ToYamlWritesSizesWithUnits) {
  Config c;
  c.tiers.host.budget = 512ULL << 30;
  c.tiers.host.budget_set = true;
  c.tiers.gpu.budget = 80'000'000'000ULL;
  c.tiers.nvme.budget = 4097;
  const std::string y = to_yaml(c);
  EXPECT_NE(y.find("budget: 512GiB"), std::string::npos) << y;
  EXPECT_NE(y.find("budget: 80GB"), std::string::npos) << y;
  EXPECT_NE(y.find("budget: 4097B"), std::string::npos) << y;
  EXPECT_NE(y.find("buffer_size: 256MiB"), std::string::npos) << y;
  EXPECT_EQ(parse(y).tiers.nvme.budget, 4097u);
}

TEST(Config, SetOverrides) {
  const std::string base = "model: {parameters: 1B}\nzero: {stage: 1}\n";
  Config c =
      parse(base, {"model.parameters=7.5B", "zero.stage=3", "tiers.nvme.paths=[/a,/b]",
                   "offload.params.tier=nvme", "offload.optimizer={tier: cpu, fraction: 0.5}",
                   "tiers.gpu.budget=40GB", "precision.loss_scale.dynamic=false"});
  EXPECT_EQ(c.model.parameters, 7'500'000'000ULL);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.tiers.nvme.paths, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(c.offload.params.tier, Tier::kNvme);
  EXPECT_EQ(c.offload.optimizer.tier, Tier::kCpu);
  EXPECT_DOUBLE_EQ(c.offload.optimizer.fraction, 0.5);
  EXPECT_EQ(c.tiers.gpu.budget, 40'000'000'000ULL);
  EXPECT_FALSE(c.precision.loss_scale.dynamic);
  // The later --set wins; a shorthand scalar target can be refined by a key inside it.
  Config d = parse("model: {parameters: 1B}\nzero: {stage: 2}\noffload: {optimizer: cpu}\n",
                   {"zero.stage=1", "zero.stage=2", "offload.optimizer.fraction=0.25"});
  EXPECT_EQ(d.zero.stage, 2);
  EXPECT_EQ(d.offload.optimizer.tier, Tier::kCpu);
  EXPECT_DOUBLE_EQ(d.offload.optimizer.fraction, 0.25);
}

TEST(Config, Suggestions) {
  using config_detail::closest;
  using config_detail::edit_distance;
  EXPECT_EQ(edit_distance("stgae", "stage"), 1u);
  EXPECT_EQ(edit_distance("", "abc"), 3u);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(closest("stgae", {"stage", "sub_group_size", "reduce_bucket_size"}), "stage");
  EXPECT_EQ(closest("paramters", {"parameters", "largest_layer", "layers"}), "parameters");
  EXPECT_EQ(closest("zzzzzzzz", {"stage", "sub_group_size"}), "");
}

TEST(Config, ShippedConfigsLoadAndPlan) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(strata::testing::source_dir()) / "configs";
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".yaml") continue;
    SCOPED_TRACE(e.path().string());
    Config c = load_config(e.path().string());
    Plan p = make_plan(c);
    EXPECT_GT(p.configured.per_rank.total(), 0u);
    expect_same(c, parse_config(to_yaml(c), c.source));
    ++n;
  }
  EXPECT_GE(n, 4);
  // The default config is fully written out: every key of to_yaml appears in it.
  std::ifstream in(dir / "default.yaml");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  std::istringstream lines(to_yaml(load_config((dir / "default.yaml").string())));
  for (std::string line; std::getline(lines, line);) {
    auto colon = line.find(':');
    auto start = line.find_first_not_of(' ');
    std::string key = line.substr(start, colon - start);
    if (key.rfind("optimizer", 0) == 0 || key == "gradients" || key == "params") continue;
    EXPECT_NE(text.find(key + ":"), std::string::npos) << key;
  }
}
