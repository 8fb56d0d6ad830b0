// `strata bench checkpoint` on a tiny model (a smoke test: the command runs, for both placements,
// and reports every field, consistent with each other; no figure is checked — speed is never
// checked in tests), its --help, and its refusals.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

namespace strata::testing {
namespace {

using nlohmann::json;

int run_bench(const std::string& args, std::string* out) {
  return run_command("{ " + strata_cli() + " bench checkpoint " + args + " 2>/dev/null; }", out);
}

}  // namespace

TEST(BenchCheckpointCli, TinyRunReportsEveryField) {
  TempDir swap("strata-bench-ckpt-swap"), dir("strata-bench-ckpt");
  std::string out;
  const int rc =
      run_bench(source_dir() + "/configs/default.yaml --params 20000 --rounds 1 --steps 2" +
                    " --set tiers.nvme.paths=[" + swap.str() + "] --set runtime.cpu_threads=1" +
                    " --set tiers.host.buffer_size=64KiB --dir " + dir.str() + " --json",
                &out);
  ASSERT_EQ(rc, 0) << out;
  const json j = json::parse(out);
  ASSERT_EQ(j["results"].size(), 2u) << out;
  EXPECT_EQ(j["results"][0]["state"], "nvme");
  EXPECT_EQ(j["results"][1]["state"], "cpu");
  for (const json& r : j["results"]) {
    EXPECT_EQ(r["params"], 20000);
    EXPECT_EQ(r["shard_bytes"], 20000u * (2 + 12)) << "fp16 parameters + three FP32 arrays";
    for (const char* k : {"blocking_save_s", "async_blocked_s", "writer_s", "raw_write_s",
                          "idle_step_s", "writer_bytes_per_s", "raw_write_bytes_per_s"})
      EXPECT_GT(r[k].get<double>(), 0) << k << " in " << r.dump();
    EXPECT_DOUBLE_EQ(r["blocked_ratio"].get<double>(),
                     r["async_blocked_s"].get<double>() / r["blocking_save_s"].get<double>());
    EXPECT_DOUBLE_EQ(
        r["writer_vs_raw"].get<double>(),
        r["writer_bytes_per_s"].get<double>() / r["raw_write_bytes_per_s"].get<double>());
    // State on NVMe: the writer's reads (12 B per parameter) are in the second reference.
    const bool nvme = r["state"] == "nvme";
    EXPECT_EQ(r["state_read_bytes"], nvme ? 20000u * 12 : 0u);
    EXPECT_GT(r["raw_move_s"].get<double>(), 0);
    if (!nvme) {
      EXPECT_DOUBLE_EQ(r["raw_move_s"].get<double>(), r["raw_write_s"].get<double>());
    }
    EXPECT_DOUBLE_EQ(r["writer_vs_move"].get<double>(),
                     r["raw_move_s"].get<double>() / r["writer_s"].get<double>());
    // The steps' share (one round): the disk's time for what the writer moves if the steps use
    // the disk (state on NVMe), and the writer's CPU time, over the busy steps' idle time.
    const double predicted = r["predicted_busy_slowdown"].get<double>();
    const int busy = r["busy_steps"].get<int>();
    if (busy > 0) {
      const double shared =
          (nvme ? r["raw_move_s"].get<double>() : 0) + r["writer_cpu_s"].get<double>();
      EXPECT_NEAR(predicted, 1 + shared / (busy * r["idle_step_s"].get<double>()),
                  1e-9 * predicted);
    } else {
      EXPECT_EQ(predicted, 0);
    }
    if (predicted > 0) {
      EXPECT_DOUBLE_EQ(r["busy_vs_predicted"].get<double>(),
                       r["busy_slowdown"].get<double>() / predicted);
    }
    for (const char* k : {"busy_step_s", "busy_slowdown", "writer_paused_s", "writer_busy_s",
                          "idle_step_spread", "idle_step_cpu_s", "writer_cpu_s"})
      EXPECT_GE(r[k].get<double>(), 0) << k;
    EXPECT_GE(r["busy_steps"].get<int>(), 0);
    EXPECT_GE(r["writer_pauses"].get<int>(), 0);
  }
  // The bench's checkpoints and raw file are gone; the directory given stays.
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

// A config with optimizer.overlap: on at stage 1 (which cannot speculate) is benched as `auto`
// says (serially there), not refused.
TEST(BenchCheckpointCli, OverlapOnAtStageOneRunsSerially) {
  TempDir swap("strata-bench-ckpt-swap"), dir("strata-bench-ckpt");
  std::string out;
  const int rc = run_bench(source_dir() + "/configs/default.yaml --params 20000 --rounds 1" +
                               " --steps 2 --state cpu --set zero.stage=1" +
                               " --set optimizer.overlap=on --set runtime.cpu_threads=1" +
                               " --dir " + dir.str() + " --json",
                           &out);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(json::parse(out)["results"].size(), 1u) << out;
}

TEST(BenchCheckpointCli, HelpAndRefusals) {
  std::string out;
  ASSERT_EQ(run_bench("--help", &out), 0);
  for (const char* k : {"--params", "--state", "--dir", "--rounds", "--steps", "--json", "--set"})
    EXPECT_NE(out.find(k), std::string::npos) << k << "\n" << out;
  const std::string cfg = source_dir() + "/configs/default.yaml";
  EXPECT_EQ(run_bench(cfg + " --state nvme --params 1000", &out), 2) << out;  // no nvme paths
  EXPECT_EQ(run_bench(cfg + " --state disk --params 1000", &out), 2) << out;
  EXPECT_EQ(run_bench(cfg + " --state cpu --params 0", &out), 2) << out;
}

}  // namespace strata::testing
