// `strata profile` launched as 2 processes by mpirun: the collectives are measured over the real
// communicator (MPI), the node's disk and cores are shared by the two ranks at once, and a real
// 2-rank engine step (stage 2, the optimizer state on NVMe) runs beside the model's prediction from
// the profile's own legs. The test checks what the launch reports, not how close the prediction
// came: that is a timing figure (docs/performance.md, "profile engine check"), never a unit-test
// assertion. Skipped without MPI or mpirun.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

using nlohmann::json;
using strata::testing::TempDir;

namespace {

std::string mpiexec() {
  const char* e = std::getenv("STRATA_MPIEXEC");
  return e ? e : "";
}

}  // namespace

TEST(ProfileMpi, TwoProcessLaunchMeasuresAndChecksTheEngineStep) {
  if (mpiexec().empty()) GTEST_SKIP() << "no mpirun (or a build without MPI)";
  TempDir dir("strata-profile-mpi");
  const std::string nvme = dir.str() + "/nvme";
  std::filesystem::create_directory(nvme);
  const std::string cfg = dir.str() + "/c.yaml";
  std::ofstream(cfg) << "model: {parameters: 20M}\nworld: {ranks: 2, ranks_per_node: 2}\n"
                        "precision: {params: bf16, grads: bf16}\n"
                        "zero: {stage: 2, sub_group_size: 1M}\n"
                        "offload: {optimizer: {tier: nvme}}\n"
                        "runtime: {cpu_threads: 1}\n"
                        "tiers: {host: {buffer_count: 4, buffer_size: 2MiB}, nvme: {paths: [" +
                            nvme + "]}}\n";
  std::string out;
  const std::string cmd = "(" + mpiexec() + " --allow-run-as-root --oversubscribe -np 2 " +
                          strata::testing::binary_dir() + "/strata profile " + cfg +
                          " --quick --json 2>" + dir.str() + "/err.txt)";
  const int rc = strata::testing::run_command(cmd, &out);
  ASSERT_EQ(rc, 0) << cmd << "\n" << out;
  const json j = json::parse(out);  // one document: rank 0 alone prints
  EXPECT_EQ(j["launch"]["world"], 2);
  // The network leg is the real communicator's.
  ASSERT_GE(j["collectives"]["points"].size(), 2u);  // reduce-scatter and all-gather, per size
  for (const auto& c : j["collectives"]["points"]) EXPECT_EQ(c["backend"], "mpi");
  EXPECT_NE(j["model"]["bandwidths"]["network_source"].get<std::string>().find("measured: mpi"),
            std::string::npos);
  EXPECT_EQ(j["node_sharing"]["local_processes"], 2);
  const json& e = j["engine_check"];
  ASSERT_TRUE(e["ran"].get<bool>()) << e.dump();
  EXPECT_EQ(e["ranks"], 2);
  EXPECT_EQ(e["layout"], "stage 2, optimizer on nvme");
  EXPECT_GT(e["predicted_s"].get<double>(), 0.0);
  EXPECT_GT(e["measured_median_s"].get<double>(), 0.0);
  ASSERT_FALSE(e["measured_s"].empty());
  // The reported error is the one its own figures give (whatever they are).
  const double predicted = e["predicted_s"].get<double>();
  const double measured = e["measured_median_s"].get<double>();
  EXPECT_NEAR(e["error"].get<double>(), (predicted - measured) / measured, 1e-6) << e.dump();
}
