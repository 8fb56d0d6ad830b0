// `strata train` end to end: the loss falls under every stage with in-process ranks (and under
// mpirun when MPI is built), --json is one document, bad input exits 2.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

namespace strata::testing {
namespace {

// The shipped default configuration with the train-relevant keys overridden.
std::string write_config(const TempDir&, int stage, const std::string& dtype) {
  return source_dir() + "/configs/default.yaml --set precision.params=" + dtype +
         " --set precision.grads=" + dtype + " --set optimizer.lr=0.01" +
         " --set optimizer.weight_decay=0 --set zero.stage=" + std::to_string(stage) +
         " --set zero.reduce_bucket_size=300 --set zero.sub_group_size=500" +
         " --set runtime.collective_timeout_s=60 --set runtime.cpu_threads=1";
}

// run_command captures stdout and stderr together: the JSON document is the part from the first
// line that starts with '{' (stderr carries only log lines).
nlohmann::json run_train(const std::string& cmd) {
  std::string out;
  int rc = run_command(cmd, &out);
  EXPECT_EQ(rc, 0) << cmd << "\n" << out;
  std::size_t start =
      out.rfind('{', 0) == 0 ? 0 : (out.find("\n{") == std::string::npos ? 0 : out.find("\n{") + 1);
  std::size_t end = out.rfind("\n}");
  try {
    return nlohmann::json::parse(
        out.substr(start, end == std::string::npos ? std::string::npos : end + 2 - start));
  } catch (const std::exception& e) {
    ADD_FAILURE() << cmd << ": not one JSON document: " << e.what() << "\n" << out;
    return {};
  }
}

TEST(TrainCli, LossFallsUnderEveryStage) {
  TempDir dir("strata-train");
  const std::string strata = binary_dir() + "/strata";
  for (int stage = 0; stage <= 3; ++stage) {
    for (const char* dt : {"fp32", "bf16"}) {
      auto j = run_train(strata + " train " + write_config(dir, stage, dt) +
                         " --steps 30 --ranks 3 --hidden 16 --json");
      ASSERT_TRUE(j.contains("final_loss")) << j.dump();
      EXPECT_EQ(j["stage"], stage);
      EXPECT_EQ(j["ranks"], 3);
      EXPECT_LT(j["final_loss"].get<double>(), 0.7 * j["initial_loss"].get<double>())
          << "stage " << stage << " " << dt;
      EXPECT_EQ(j["steps"].size(), 30u);
    }
  }
}

TEST(TrainCli, Fp16SkipsOverflowsAndStillLearns) {
  TempDir dir("strata-train");
  auto j =
      run_train(binary_dir() + "/strata train " + write_config(dir, 2, "fp16") +
                " --steps 40 --ranks 2 --hidden 16 --json --set precision.loss_scale.initial=1e9");
  ASSERT_TRUE(j.contains("skipped_steps")) << j.dump();
  EXPECT_GT(j["skipped_steps"].get<int>(), 0);  // 1e9 overflows fp16 until it backs off
  EXPECT_LT(j["final_loss"].get<double>(), j["initial_loss"].get<double>());
}

TEST(TrainCli, BadInputExitsTwo) {
  TempDir dir("strata-train");
  std::string out;
  EXPECT_EQ(run_command(binary_dir() + "/strata train " + dir.str() + "/missing.yaml 2>&1", &out),
            2)
      << out;
  EXPECT_EQ(
      run_command(
          binary_dir() + "/strata train " + write_config(dir, 1, "fp32") + " --steps 0 2>&1", &out),
      2)
      << out;
}

TEST(TrainCli, UnderMpirun) {
  const char* mpirun = std::getenv("STRATA_MPIEXEC");
  if (!mpirun || !*mpirun) GTEST_SKIP() << "no MPI in this build";
  TempDir dir("strata-train");
  auto j =
      run_train(std::string(mpirun) + " --allow-run-as-root --oversubscribe -np 2 " + binary_dir() +
                "/strata train " + write_config(dir, 3, "fp32") + " --steps 20 --hidden 16 --json");
  ASSERT_TRUE(j.contains("communicator")) << j.dump();
  EXPECT_EQ(j["communicator"], "mpi");
  EXPECT_EQ(j["ranks"], 2);
  EXPECT_LT(j["final_loss"].get<double>(), j["initial_loss"].get<double>());
}

}  // namespace
}  // namespace strata::testing
