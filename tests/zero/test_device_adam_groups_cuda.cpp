// F9 (issue 27): the device update of a chunk that spans several parameter groups queues every
// group's kernel on DeviceAdam's stream and waits once. A step whose one chunk holds three groups
// makes exactly as many host waits as the same step with one group (the fake CUDA runtime's
// "host_sync"; the old code waited once per group: two more), and the parameters are bitwise the
// same (the three groups have the one group's hyper-parameters). Optimizer state on the GPU.
#include <gtest/gtest.h>

#include <bit>
#include <string>
#include <vector>

#include "fakecuda/gpu_test_env.hpp"
#include "placement_util.hpp"
#include "strata/device_query.hpp"

namespace strata::testing {
namespace {

constexpr std::size_t kLens[3] = {100, 150, 200};  // one chunk (sub-groups of ~640 elements)

std::vector<float> group_values(std::size_t n, std::uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

struct GroupRun {
  long host_syncs = -1;
  std::vector<std::vector<float>> params;
};

// One step on GPU 0 (state, gradients and parameters on the GPU, stage 1), the three tensors in
// one parameter group or in three.
GroupRun step_with_groups(bool three, const std::string& dir) {
  Placement p;
  p.stage = 1;
  Config cfg = placement_config(p, dir);
  cfg.runtime.device = DeviceKind::kCuda;
  cfg.precision.loss_scale.initial = 1;
  NcclBootstrap boot;
  boot.file = dir + (three ? "/nccl-id-3" : "/nccl-id-1");
  auto comm = make_nccl_communicator(boot, 0, 30.0);
  Engine e(cfg, *comm);
  std::vector<TensorId> ids;
  for (std::size_t t = 0; t < 3; ++t) {
    GroupId g = 0;
    if (three && t > 0) g = e.add_param_group({cfg.optimizer.lr, cfg.optimizer.weight_decay});
    ids.push_back(e.add_parameter(strcat("w", t), group_values(kLens[t], 1 + t, 1.0f), g));
  }
  e.finalize();
  for (std::size_t t = 0; t < 3; ++t) {
    const auto g = group_values(kLens[t], 10 + t, 0.5f);
    e.set_gradient_host(ids[t], g.data());
  }
  if (under_fakecuda()) fakecuda_reset_counters();
  EXPECT_TRUE(e.step().applied);
  GroupRun r;
  if (under_fakecuda()) r.host_syncs = fakecuda_counter("host_sync");
  for (std::size_t t = 0; t < 3; ++t) {
    std::vector<float> out(kLens[t]);
    e.read_param(ids[t], out);
    r.params.push_back(std::move(out));
  }
  return r;
}

TEST(DeviceAdamGroups, OneWaitPerChunkWhateverTheGroups) {
  if (const std::string why = nccl_gpus_missing(1); !why.empty()) GTEST_SKIP() << why;
  forget_launcher_local_rank();
  TempDir dir("strata-groups");
  const GroupRun one = step_with_groups(false, dir.str());
  const GroupRun three = step_with_groups(true, dir.str());
  if (under_fakecuda()) {
    EXPECT_EQ(three.host_syncs, one.host_syncs)
        << "a chunk of three parameter groups waited for each group's update";
  }
  for (std::size_t t = 0; t < 3; ++t)
    for (std::size_t i = 0; i < kLens[t]; ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(three.params[t][i]),
                std::bit_cast<std::uint32_t>(one.params[t][i]))
          << "tensor " << t << " element " << i;
}

}  // namespace
}  // namespace strata::testing
