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

// --accumulate K: K micro-batches of --batch / K samples per step, their gradients summed in the
// engine. The stages accumulate in different orders (stages 0-1 per rank then reduced, 2-3
// reduced per micro-batch then summed) over the same micro-batches: their loss curves agree to
// rounding, learn, and differ from the one-micro-batch run's (other batches). K must divide
// --batch.
TEST(TrainCli, AccumulateSumsTheMicroBatches) {
  TempDir dir("strata-train");
  const std::string strata = binary_dir() + "/strata train ";
  std::vector<nlohmann::json> runs;
  for (int stage : {0, 1, 2, 3})
    runs.push_back(run_train(strata + write_config(dir, stage, "fp32") +
                             " --steps 12 --ranks 2 --hidden 16 --batch 12 --accumulate 3 --json"));
  for (const auto& j : runs) {
    ASSERT_EQ(j["steps"].size(), 12u) << j.dump();
    EXPECT_EQ(j["accumulate"], 3);
    EXPECT_LT(j["final_loss"].get<double>(), j["initial_loss"].get<double>());
    for (std::size_t s = 0; s < 12; ++s) {
      const double a = runs[0]["steps"][s]["loss"].get<double>();
      EXPECT_NEAR(j["steps"][s]["loss"].get<double>(), a, 1e-4 * a)
          << "stage " << j["stage"] << " step " << s + 1;
    }
  }
  auto one = run_train(strata + write_config(dir, 2, "fp32") +
                       " --steps 12 --ranks 2 --hidden 16 --batch 12 --json");
  EXPECT_NE(one["steps"][0]["loss"].get<double>(), runs[0]["steps"][0]["loss"].get<double>());
  std::string out;
  EXPECT_EQ(
      run_command(strata + write_config(dir, 2, "fp32") + " --batch 8 --accumulate 3 2>&1", &out),
      2)
      << out;
  EXPECT_NE(out.find("--accumulate 3 must be >= 1 and divide --batch 8"), std::string::npos) << out;
}

// train.accumulate (what `strata import-deepspeed` maps gradient_accumulation_steps to) is the
// default of --accumulate: the same run as the flag's; the flag overrides it; a value that does
// not divide --batch names the key and the file; out of range: file:line:col.
TEST(TrainCli, AccumulateFromTheConfig) {
  TempDir dir("strata-train");
  const std::string strata = binary_dir() + "/strata train ";
  const std::string args = " --steps 4 --ranks 2 --hidden 16 --batch 12 --json";
  auto flag = run_train(strata + write_config(dir, 2, "fp32") + args + " --accumulate 3");
  auto key = run_train(strata + write_config(dir, 2, "fp32") + " --set train.accumulate=3" + args);
  EXPECT_EQ(key["accumulate"], 3) << key.dump();
  ASSERT_EQ(key["steps"].size(), 4u);
  for (std::size_t s = 0; s < 4; ++s)
    EXPECT_EQ(key["steps"][s]["loss"].get<double>(), flag["steps"][s]["loss"].get<double>()) << s;
  auto over = run_train(strata + write_config(dir, 2, "fp32") + " --set train.accumulate=3" + args +
                        " --accumulate 2");
  EXPECT_EQ(over["accumulate"], 2) << over.dump();
  std::string out;
  EXPECT_EQ(run_command(
                strata + write_config(dir, 2, "fp32") + " --set train.accumulate=5 --batch 12 2>&1",
                &out),
            2)
      << out;
  EXPECT_NE(out.find("train.accumulate 5 ("), std::string::npos) << out;
  EXPECT_NE(out.find("must be >= 1 and divide --batch 12"), std::string::npos) << out;
  std::ofstream(dir.str() + "/acc.yaml") << "zero: {stage: 1}\ntrain:\n  accumulate: 0\n";
  EXPECT_EQ(run_command(strata + dir.str() + "/acc.yaml 2>&1", &out), 2) << out;
  EXPECT_NE(out.find("acc.yaml:3:15"), std::string::npos) << out;
  EXPECT_NE(out.find("train.accumulate"), std::string::npos) << out;
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
