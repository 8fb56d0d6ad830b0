// `strata bench step`: one JSON document with every leg, the pipelined and serial steps, overlap
// figures and the 1x / 4x peak RSS; bad input exits 2.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

namespace strata::testing {
namespace {

TEST(BenchStepCli, JsonHasEveryFigure) {
  TempDir swap("strata-bench-step");
  std::string out;
  const std::string cmd =
      binary_dir() + "/strata bench step " + source_dir() +
      "/bench/step/step.yaml --params 600K --rounds 1 --json --set tiers.nvme.paths=[" +
      swap.str() + "] --set tiers.host.buffer_size=1MiB --set tiers.host.buffer_count=3";
  ASSERT_EQ(run_command(cmd, &out), 0) << out;
  // stdout and stderr come together: the document is the part from the line starting with '{'.
  const std::size_t start = out.rfind('{', 0) == 0 ? 0 : out.find("\n{") + 1;
  auto j = nlohmann::json::parse(out.substr(start, out.rfind("\n}") + 2 - start));
  const auto& s = j["step"];
  for (const char* k :
       {"t_read_s", "t_update_s", "t_write_s", "t_step_s", "t_step_serial_s", "t_io_s"})
    EXPECT_GT(s[k].get<double>(), 0.0) << k;
  EXPECT_EQ(s["elements"].get<std::uint64_t>(), 600000u);
  EXPECT_EQ(s["buffers"].get<std::uint32_t>(), 3u);
  EXPECT_LE(s["buffer_size"].get<std::uint64_t>(), 1u << 20);
  EXPECT_GT(j["state_over_pool"].get<double>(), 2.0);
  EXPECT_GT(s["overlap_efficiency"].get<double>(), 0.0);
  EXPECT_GT(j["rss_ratio_4x_vs_1x"].get<double>(), 0.5);
  EXPECT_EQ(j["step_4x"]["elements"].get<std::uint64_t>(), 2400000u);
  // Swap files are gone.
  for (auto& e : std::filesystem::directory_iterator(swap.path()))
    ADD_FAILURE() << "left behind: " << e.path();
}

// optimizer.update: device (the host-emulated device here): same figures, and the JSON says where
// Adam ran.
TEST(BenchStepCli, DeviceUpdate) {
  TempDir swap("strata-bench-step");
  std::string out;
  const std::string cmd = binary_dir() + "/strata bench step " + source_dir() +
                          "/bench/step/step.yaml --params 300K --rounds 1 --no-scaling --json "
                          "--set tiers.nvme.paths=[" +
                          swap.str() +
                          "] --set tiers.host.buffer_size=1MiB --set tiers.host.buffer_count=3" +
                          " --set optimizer.update=device --set runtime.device=host";
  ASSERT_EQ(run_command(cmd, &out), 0) << out;
  const std::size_t start = out.rfind('{', 0) == 0 ? 0 : out.find("\n{") + 1;
  auto j = nlohmann::json::parse(out.substr(start, out.rfind("\n}") + 2 - start));
  EXPECT_EQ(j["step"]["update_on"].get<std::string>(), "host-emulated");
  EXPECT_GT(j["step"]["t_update_s"].get<double>(), 0.0);
  EXPECT_GT(j["step"]["t_step_s"].get<double>(), 0.0);
}

// The optimizer step alone (no --backward) of a config that speculates at a stage that cannot
// (step.yaml is stage 1): measured serially, as the step it is, not refused ("optimizer.overlap:
// on is not supported here").
TEST(BenchStepCli, AConfigWithOverlapOnIsMeasuredSerially) {
  TempDir swap("strata-bench-step");
  std::string out;
  const std::string cmd = binary_dir() + "/strata bench step " + source_dir() +
                          "/bench/step/step.yaml --params 200K --rounds 1 --no-scaling --json "
                          "--set tiers.nvme.paths=[" +
                          swap.str() +
                          "] --set tiers.host.buffer_size=1MiB --set tiers.host.buffer_count=3" +
                          " --set optimizer.overlap=on";
  ASSERT_EQ(run_command(cmd, &out), 0) << out;
  EXPECT_EQ(out.find("not supported"), std::string::npos) << out;
}

// --backward: the speculative update's figures, in one JSON document (values not checked: no
// assertion on timing; the chunk counts are the engine's).
TEST(BenchStepCli, BackwardOverlapFields) {
  TempDir swap("strata-bench-step");
  std::string out;
  const std::string cmd = binary_dir() + "/strata bench step " + source_dir() +
                          "/bench/step/step.yaml --params 200K --rounds 1 --json --backward 0.02 "
                          "--tensors 8 --set tiers.nvme.paths=[" +
                          swap.str() +
                          "] --set tiers.host.buffer_size=1MiB --set tiers.host.buffer_count=3";
  ASSERT_EQ(run_command(cmd, &out), 0) << out;
  const std::size_t start = out.rfind('{', 0) == 0 ? 0 : out.find("\n{") + 1;
  auto j = nlohmann::json::parse(out.substr(start, out.rfind("\n}") + 2 - start));
  const auto& o = j["overlap"];
  for (const char* k :
       {"serial_step_s", "serial_total_s", "overlapped_step_s", "overlapped_total_s", "exposed_s",
        "serial_clip_step_s", "serial_clip_total_s", "rollback_step_s", "rollback_total_s",
        "auto_clip_step_s", "auto_clip_total_s"})
    EXPECT_GE(o[k].get<double>(), 0.0) << k;
  // Ratios of rounds against the serial round beside them: positive (a total is never 0).
  for (const char* k : {"total_ratio", "serial_total_ratio", "rollback_ratio", "auto_clip_ratio"})
    EXPECT_GT(o[k].get<double>(), 0.0) << k;
  EXPECT_GE(o["exposed_ratio"].get<double>(), 0.0);
  EXPECT_EQ(o["rounds"].get<int>(), 1);
  for (const char* k : {"backward_s_rounds", "serial_step_s_rounds", "exposed_s_rounds",
                        "overlapped_total_s_rounds"})
    EXPECT_EQ(o[k].size(), 1u) << k;
  EXPECT_DOUBLE_EQ(o["backward_s_rounds"][0].get<double>(), 0.02);
  EXPECT_DOUBLE_EQ(o["backward_s"].get<double>(), 0.02);
  EXPECT_EQ(o["elements"].get<std::uint64_t>(), 200000u);
  EXPECT_GT(o["speculated_chunks"].get<std::uint64_t>(), 0u);
  EXPECT_EQ(o["committed_chunks"], o["speculated_chunks"]);
  EXPECT_EQ(o["rolled_back_chunks"], o["speculated_chunks"]);
  // auto, clipping forced: the warm-up step and the round roll back; the next would not speculate.
  EXPECT_EQ(o["auto_clip_rolled_back_steps"].get<std::uint64_t>(), 2u);
  // The hand-ins: every bf16 gradient once per round, from host memory on the host-emulated
  // device, from device memory with a device -> host bandwidth beside them on a GPU
  // (tests/fakecuda/bench_step_device_grads.sh); the speculative update bitwise the serial one.
  EXPECT_EQ(o["hand_in_bytes"].get<std::uint64_t>(), 400000u);
  if (o["gradients"] == "host") {
    EXPECT_EQ(o["d2h_bytes_per_second"].get<double>(), 0.0);
  } else {
    EXPECT_EQ(o["gradients"], "device");
    EXPECT_GT(o["d2h_bytes_per_second"].get<double>(), 0.0);
  }
  EXPECT_TRUE(o["overlapped_equals_serial"].get<bool>());
  std::string bad;
  EXPECT_EQ(run_command(binary_dir() + "/strata bench step " + source_dir() +
                            "/bench/step/step.yaml --backward soon 2>&1",
                        &bad),
            2)
      << bad;
}

// issue 15: `bench step` did not create its swap directory (and blamed io_uring), and ran a size
// the machine could not hold until the OOM killer came.
TEST(BenchStepCli, Issue15CreatesItsSwapDirectoryAndRefusesWhatTheMachineCannotHold) {
  TempDir swap("strata-bench-step");
  const std::string fresh = swap.str() + "/new/swap";
  std::string out;
  const std::string base =
      binary_dir() + "/strata bench step " + source_dir() + "/bench/step/step.yaml";
  ASSERT_EQ(
      run_command(base + " --params 100K --rounds 1 --no-scaling --set tiers.nvme.paths=[" + fresh +
                      "] --set tiers.host.buffer_size=1MiB --set tiers.host.buffer_count=2",
                  &out),
      0)
      << out;
  EXPECT_TRUE(std::filesystem::is_directory(fresh)) << out;
  EXPECT_TRUE(std::filesystem::is_empty(fresh)) << out;
  EXPECT_EQ(out.find("io_uring unavailable"), std::string::npos) << out;
  // Progress on stderr, one line per run.
  EXPECT_NE(out.find("bench step: run 1 of 1: 100K params"), std::string::npos) << out;
  EXPECT_NE(out.find("bench step: run 1 of 1 done in"), std::string::npos) << out;
  // 90T parameters: refused before anything is allocated, naming memory and disk.
  EXPECT_EQ(run_command(base + " --params 90T --set tiers.nvme.paths=[" + fresh + "]", &out), 2)
      << out;
  EXPECT_NE(out.find("of host memory and"), std::string::npos) << out;
  EXPECT_NE(out.find("of disk under " + fresh), std::string::npos) << out;
  EXPECT_TRUE(std::filesystem::is_empty(fresh));
}

TEST(BenchStepCli, BadInputExits2) {
  std::string out;
  EXPECT_EQ(run_command(binary_dir() + "/strata bench step " + source_dir() +
                            "/bench/step/step.yaml --params 1M --set tiers.host.buffer_size=4KiB",
                        &out),
            2)
      << out;
}

}  // namespace
}  // namespace strata::testing
