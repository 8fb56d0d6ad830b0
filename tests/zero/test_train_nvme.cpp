// `strata train configs/nvme-offload.yaml`: runs with the optimizer state on NVMe (its swap path
// under /tmp, created if missing) and its loss curve equals the resident run's, step by step.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

namespace strata::testing {
namespace {

nlohmann::json run_json(const std::string& cmd) {
  std::string out;
  const int rc = run_command(cmd, &out);
  EXPECT_EQ(rc, 0) << cmd << "\n" << out;
  const std::size_t start = out.rfind('{', 0) == 0 ? 0 : out.find("\n{") + 1;
  const std::size_t end = out.rfind("\n}");
  try {
    return nlohmann::json::parse(out.substr(start, end + 2 - start));
  } catch (const std::exception& e) {
    ADD_FAILURE() << cmd << ": not one JSON document: " << e.what() << "\n" << out;
    return {};
  }
}

TEST(TrainNvme, LossCurveEqualsResidentRun) {
  TempDir swap("strata-train-nvme");
  const std::string base = binary_dir() + "/strata train " + source_dir() +
                           "/configs/nvme-offload.yaml --steps 25 --ranks 2 --hidden 48 --json"
                           " --set runtime.cpu_threads=1 --set runtime.collective_timeout_s=60";
  // The shipped config as it is (NVMe under /tmp/strata-nvme), and with the swap in a temp dir and
  // a tiny pool so that each rank streams several chunks through 2 buffers.
  auto nvme = run_json(base);
  auto small = run_json(base + " --set tiers.nvme.paths=[" + swap.str() +
                        "] --set tiers.host.buffer_count=2 --set zero.sub_group_size=700");
  auto resident = run_json(base + " --set offload.optimizer.tier=gpu");
  ASSERT_EQ(nvme["steps"].size(), 25u);
  ASSERT_EQ(resident["steps"].size(), 25u);
  ASSERT_EQ(small["steps"].size(), 25u);
  EXPECT_EQ(nvme["stage"], 3);
  for (std::size_t i = 0; i < 25; ++i) {
    EXPECT_EQ(nvme["steps"][i]["loss"].get<double>(), resident["steps"][i]["loss"].get<double>())
        << "step " << i + 1;
    EXPECT_EQ(small["steps"][i]["loss"].get<double>(), resident["steps"][i]["loss"].get<double>())
        << "step " << i + 1;
  }
  EXPECT_LT(nvme["final_loss"].get<double>(), nvme["initial_loss"].get<double>());
  // The per-run swap directories are gone.
  for (auto& e : std::filesystem::directory_iterator(swap.path()))
    ADD_FAILURE() << "left behind: " << e.path();
}

}  // namespace
}  // namespace strata::testing
