// `strata plan` as a launch script uses it: --check exits 3 when the configured layout does not
// fit (0 when it does; the engine's runtime buffers and pinned pool included), the ladder table
// and its JSON, and a clear error without model.parameters.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

namespace {

struct CliRun {
  int rc;
  std::string out, err;
};

CliRun plan(const std::string& args, const strata::testing::TempDir& dir) {
  CliRun r;
  const std::string err = dir.str() + "/err.txt";
  r.rc = strata::testing::run_command(
      "(" + strata::testing::binary_dir() + "/strata plan " + args + " 2>" + err + ")", &r.out);
  std::ifstream in(err);
  r.err.assign(std::istreambuf_iterator<char>(in), {});
  return r;
}

std::string write(const strata::testing::TempDir& dir, const std::string& name,
                  const std::string& text) {
  const std::string path = dir.str() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// The 13B case on 8 x 80 GB, sequence 4096, micro-batch 4.
const char* k13B =
    "model: {parameters: 13B, layers: 40, hidden_size: 5120, heads: 40, sequence_length: 4096, "
    "micro_batch: 4}\nworld: {ranks: 8}\ntiers: {gpu: {budget: 80GB}, host: {budget: 512GiB}}\n";

// This machine's MemTotal in bytes (0: unreadable).
std::uint64_t mem_total() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  std::uint64_t kib = 0;
  while (in >> key >> kib >> unit)
    if (key == "MemTotal:") return kib * 1024;
  return 0;
}

}  // namespace

TEST(PlanCli, CheckExitsThreeWhenTheLayoutDoesNotFit) {
  strata::testing::TempDir dir;
  const std::string cfg = write(dir, "13b.yaml", k13B);
  CliRun r = plan(cfg + " --check --set zero.stage=1", dir);
  EXPECT_EQ(r.rc, 3) << r.err;
  EXPECT_NE(r.out.find("Verdict: DOES NOT FIT"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("does not fit: gpu needs 71.5 GB model state + 67.11 MB runtime buffers + "
                       "22.98 GB activations"),
            std::string::npos)
      << r.err;
  r = plan(cfg + " --check --set zero.stage=2", dir);
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("Verdict: fits with activation checkpointing"), std::string::npos) << r.out;
  // The runtime buffers decide: 800M-element gradient buckets (3 x 1.6 GB + 3 x 1.6 GB receive
  // buffers) do not fit beside 48.75 GB of model state and 22.98 GB of activations.
  r = plan(cfg + " --check --set zero.stage=2 --set zero.reduce_bucket_size=800M", dir);
  EXPECT_EQ(r.rc, 3) << r.err;
  EXPECT_NE(r.err.find("+ 9.67 GB runtime buffers +"), std::string::npos) << r.err;
  // Without --check the report exits 0 either way; --json keeps its one document with --check.
  EXPECT_EQ(plan(cfg + " --set zero.stage=1", dir).rc, 0);
  r = plan(cfg + " --json --check --set zero.stage=1", dir);
  EXPECT_EQ(r.rc, 3);
  auto j = nlohmann::json::parse(r.out);
  EXPECT_FALSE(j["configured_fits"].get<bool>());
}

TEST(PlanCli, LadderTableAndRecommendation13B) {
  strata::testing::TempDir dir;
  const std::string cfg = write(dir, "13b.yaml", k13B);
  CliRun r = plan(cfg, dir);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("Recommendation: stage 2, no offload, with activation checkpointing"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("Every stage x offload rung"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("> stage 2, no offload"), std::string::npos) << r.out;
  // The runtime buffers as their own lines, and the pinned pool a GPU rank has without offload.
  EXPECT_NE(r.out.find("    runtime buffers        6.07 GB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("buckets             3 GB  3 x zero.reduce_bucket_size (500M)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("pinned staging pool: 1.07 GB per rank (4 x 256 MiB)"), std::string::npos)
      << r.out;
  r = plan(cfg + " --json", dir);
  ASSERT_EQ(r.rc, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["ladder"].size(), 15u);
  EXPECT_EQ(j["ladder"][1]["description"], "stage 1, no offload");
  EXPECT_FALSE(j["ladder"][1]["fits"].get<bool>());
  EXPECT_EQ(j["ladder"][1]["activations_per_rank_bytes"].get<std::uint64_t>(), 22'984'785'920ULL);
  EXPECT_TRUE(j["ladder"][2]["fits"].get<bool>());
  const std::uint64_t pools = 8ULL * 4 * (256ULL << 20);  // every rank's pinned pool
  const std::uint64_t runtime = 6'000'000'000ULL + 144 + (1ULL << 26);
  EXPECT_EQ(j["ladder"][2]["gpu_model_state_per_rank_bytes"].get<std::uint64_t>(),
            48'750'000'000ULL);
  EXPECT_EQ(j["ladder"][2]["runtime_buffers_per_rank_bytes"].get<std::uint64_t>(), runtime);
  EXPECT_EQ(j["ladder"][2]["gpu_per_rank_bytes"].get<std::uint64_t>(),
            48'750'000'000ULL + runtime + 22'984'785'920ULL);
  EXPECT_EQ(j["ladder"][2]["host_per_node_bytes"].get<std::uint64_t>(), pools);
  EXPECT_EQ(j["ladder"][3]["host_per_node_bytes"].get<std::uint64_t>(),
            8 * 19'500'000'000ULL + pools);
  const auto& rt = j["configured"]["runtime_buffers_per_rank_bytes"];
  EXPECT_EQ(rt["buckets"].get<std::uint64_t>(), 3'000'000'000ULL);
  EXPECT_EQ(rt["bucket_count"].get<int>(), 3);
  EXPECT_EQ(rt["receive"].get<std::uint64_t>(), 3'000'000'000ULL);
  EXPECT_EQ(rt["total"].get<std::uint64_t>(), runtime);
  EXPECT_EQ(j["configured"]["per_rank_bytes"]["gpu"].get<std::uint64_t>(),
            48'750'000'000ULL + runtime);
  EXPECT_TRUE(j["configured"]["pinned_pool_per_rank"]["used"].get<bool>());
  EXPECT_EQ(j["recommendation"]["layout"]["description"], "stage 2, no offload");
  EXPECT_TRUE(j["recommendation"]["activation_checkpointing"].get<bool>());
}

// model.parameters is optional in the config (the engine and `strata train` size themselves), but
// a plan needs it: exit 2 with the key named, nothing on stdout.
TEST(PlanCli, PlanWithoutModelParametersIsBadInput) {
  strata::testing::TempDir dir;
  CliRun r = plan(write(dir, "c.yaml", "world: {ranks: 8}\n"), dir);
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("model.parameters"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

// tiers.host.budget not set: `strata plan` checks host memory against this machine's MemTotal (not
// the 512 GiB default) and says so; set, the configured value.
TEST(PlanCli, HostBudgetIsTheMachinesMemoryWhenNotSet) {
  strata::testing::TempDir dir;
  const std::uint64_t total = mem_total();
  ASSERT_GT(total, 0u);
  // 30B parameters, the optimizer state in host memory: 360 GB, within the 512 GiB default.
  const std::string cfg = write(dir, "c.yaml",
                                "model: {parameters: 30B}\nzero: {stage: 2}\n"
                                "offload: {optimizer: {tier: cpu}}\ntiers: {gpu: {budget: 1TB}}\n");
  CliRun r = plan(cfg + " --json", dir);
  ASSERT_EQ(r.rc, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["host_budget"]["source"], "machine");
  EXPECT_EQ(j["host_budget"]["bytes"].get<std::uint64_t>(), total);
  const auto& host = j["configured"]["verdicts"][1];
  ASSERT_EQ(host["tier"], "host");
  EXPECT_EQ(host["budget_bytes"].get<std::uint64_t>(), total);
  EXPECT_EQ(j["configured_fits"].get<bool>(), host["used_bytes"].get<std::uint64_t>() <= total);
  r = plan(cfg, dir);
  EXPECT_NE(r.out.find("host budget: the machine's "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("MemTotal in /proc/meminfo; tiers.host.budget not set)"), std::string::npos)
      << r.out;
  r = plan(cfg + " --json --set tiers.host.budget=512GiB", dir);
  ASSERT_EQ(r.rc, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["host_budget"]["source"], "config");
  EXPECT_EQ(j["configured"]["verdicts"][1]["budget_bytes"].get<std::uint64_t>(), 512ULL << 30);
  EXPECT_TRUE(j["configured_fits"].get<bool>()) << j["configured_verdict"].dump();
}

// A CPU model's config (runtime.device host, FP32 parameters) at stage 1: the master weights are
// the parameters, said in the text and the JSON, and the host state is the moments only (8 B a
// parameter); with bf16 parameters (or auto's GPU) the master is the state's own (12 B).
// The plan says what it counted runtime.device as: auto is planned as a GPU, with what this
// machine would resolve it to (a GPU count, or why none answers: then the engine would run on the
// host device, which --set runtime.device=host plans); host and cuda need no probe.
TEST(PlanCli, SaysWhatTheDeviceIsPlannedAs) {
  strata::testing::TempDir dir;
  const std::string cfg = write(dir, "d.yaml", "model: {parameters: 1000000}\n");
  CliRun r = plan(cfg + " --json", dir);
  ASSERT_EQ(r.rc, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["device"]["configured"], "auto");
  EXPECT_EQ(j["device"]["planned_as"], "gpu");
  const std::string here = j["device"]["this_machine"].get<std::string>();
  EXPECT_FALSE(here.empty());
  r = plan(cfg, dir);
  EXPECT_NE(r.out.find("device: runtime.device auto, planned as a GPU; this machine: " + here),
            std::string::npos)
      << r.out;
  if (here.rfind("no GPU", 0) == 0) {
    EXPECT_NE(r.out.find("the engine would run on the host device here"), std::string::npos);
  }
  for (const char* kind : {"host", "cuda"}) {
    r = plan(cfg + " --json --set runtime.device=" + kind, dir);
    ASSERT_EQ(r.rc, 0) << r.err;
    j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["device"]["configured"], kind);
    EXPECT_EQ(j["device"]["planned_as"], std::string(kind) == "host" ? "host" : "gpu");
    EXPECT_EQ(j["device"]["this_machine"], "");
  }
  r = plan(cfg + " --set runtime.device=host", dir);
  EXPECT_NE(r.out.find("device: host-emulated (runtime.device host)"), std::string::npos) << r.out;
}

TEST(PlanCli, TheMasterWeightsAreTheParametersOfAnFp32ModelOnTheHost) {
  strata::testing::TempDir dir;
  const std::string base =
      "model: {parameters: 1000000}\nzero: {stage: 1}\noffload: {optimizer: {tier: cpu}}\n"
      "precision: {params: fp32, grads: fp32}\n"
      "tiers: {host: {budget: 64GiB}}\n";
  const std::string host = write(dir, "h.yaml", base + "runtime: {device: host}\n");
  CliRun r = plan(host + " --json", dir);
  ASSERT_EQ(r.rc, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j["configured"]["master_in_params"].get<bool>());
  EXPECT_EQ(j["configured"]["by_kind_per_rank_bytes"]["host"]["optimizer"].get<std::uint64_t>(),
            8'000'000u);
  r = plan(host, dir);
  EXPECT_NE(r.out.find("master weights = the parameters"), std::string::npos) << r.out;
  for (const std::string& other :
       {host + " --set precision.params=bf16", write(dir, "a.yaml", base)}) {
    r = plan(other + " --json", dir);
    ASSERT_EQ(r.rc, 0) << r.err;
    j = nlohmann::json::parse(r.out);
    EXPECT_FALSE(j["configured"]["master_in_params"].get<bool>()) << other;
    EXPECT_EQ(j["configured"]["by_kind_per_rank_bytes"]["host"]["optimizer"].get<std::uint64_t>(),
              12'000'000u)
        << other;
  }
}
