// The placement matrix on a CUDA device (scripts/gpu_check.sh; SKIPPED without a GPU or NCCL):
// every placement a stage allows with runtime.device cuda and NCCL communicators (one rank per
// GPU, threads of this process, file bootstrap), the state in device memory, pinned host memory
// and NVMe, gradients handed in from device memory. One and two ranks are compared bitwise with the
// unsharded CpuAdam reference (a sum of two is the same in any order; the CUDA Adam kernel follows
// CpuAdam's operation order); more ranks (NCCL's own reduction order) within 1e-6 relative.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <thread>

#include "fakecuda/gpu_test_env.hpp"
#include "placement_util.hpp"
#include "strata/device_query.hpp"

namespace strata::testing {
namespace {

int gpus() { return static_cast<int>(query_cuda_devices().devices.size()); }

std::vector<Placement> cuda_cases() {
  std::vector<Placement> v;
  const int n = std::min(4, std::max(1, gpus()));
  for (const Placement& p : all_cases()) {
    if (p.fraction < 1) continue;
    if (p.world == 1 || (p.world == n && n > 1) || (p.world == 2 && n >= 2)) v.push_back(p);
  }
  return v;
}

class PlacementsCuda : public ::testing::TestWithParam<Placement> {};

TEST_P(PlacementsCuda, MatchTheUnshardedReference) {
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  const Placement p = GetParam();
  if (gpus() < p.world) GTEST_SKIP() << p.world << " GPUs needed, " << gpus() << " present";
  // Ranks are threads here: the engine's device is rank % world.ranks_per_node (placement_config
  // sets both to the world), not a launcher's LOCAL_RANK.
  forget_launcher_local_rank();
  TempDir dir("strata-placement-cuda");
  int want_skipped = 0;
  const auto want = reference(p, &want_skipped);
  std::vector<std::unique_ptr<Communicator>> comms(static_cast<std::size_t>(p.world));
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(p.world));
  std::vector<int> skipped(static_cast<std::size_t>(p.world), 0);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(p.world));
  std::vector<std::thread> threads;
  for (int r = 0; r < p.world; ++r) {
    threads.emplace_back([&, r] {
      try {
        NcclBootstrap boot;
        boot.file = dir.str() + "/nccl-id";
        boot.rank = r;
        boot.size = p.world;
        auto comm = make_nccl_communicator(boot, r, 60.0);
        got[static_cast<std::size_t>(r)] =
            train(*comm, p, dir.str(), &skipped[static_cast<std::size_t>(r)], DeviceKind::kCuda);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  rethrow_any(errors);
  for (int r = 0; r < p.world; ++r) {
    EXPECT_EQ(skipped[static_cast<std::size_t>(r)], want_skipped) << "rank " << r;
    const auto& g = got[static_cast<std::size_t>(r)];
    ASSERT_EQ(g.size(), want.size());
    for (std::size_t t = 0; t < g.size(); ++t)
      for (std::size_t i = 0; i < g[t].size(); ++i) {
        if (p.world <= 2) {
          ASSERT_EQ(std::bit_cast<std::uint32_t>(g[t][i]), std::bit_cast<std::uint32_t>(want[t][i]))
              << "rank " << r << " tensor " << t << " element " << i << ": " << g[t][i] << " vs "
              << want[t][i];
        } else {
          ASSERT_NEAR(g[t][i], want[t][i], 1e-6 * std::max(1.0f, std::fabs(want[t][i])))
              << "rank " << r << " tensor " << t << " element " << i;
        }
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, PlacementsCuda, ::testing::ValuesIn(cuda_cases()), case_name);

// The update shared between the CPU and the GPU's Adam kernel (zero/update_split.hpp), on a CUDA
// engine: forced all CPU, all device, alternating, the chunks final last on the device, a share
// inside every chunk, and optimizer.update auto (the split the rates choose), speculated (K = 2)
// and serial, state in host memory (pinned or not) and on NVMe: bitwise the unsharded reference
// on one and two GPUs.
std::vector<Placement> split_cuda_cases() {
  std::vector<Placement> v;
  for (const Placement& s :
       std::initializer_list<Placement>{{2, Tier::kCpu, Tier::kGpu, Tier::kGpu, 1.0, 1},
                                        {2, Tier::kNvme, Tier::kCpu, Tier::kGpu, 1.0, 2},
                                        {3, Tier::kCpu, Tier::kGpu, Tier::kCpu, 1.0, 2},
                                        {1, Tier::kCpu, Tier::kGpu, Tier::kGpu, 1.0, 1}})
    for (int split : {1, 2, 3, 4, 5, 6}) {
      v.push_back(s);
      v.back().split = split;
      v.back().overlap = s.stage >= 2;
      v.back().accumulate = s.stage >= 2 ? 2 : 1;
      v.back().pin = s.world == 2 && s.opt == Tier::kCpu;
    }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Split, PlacementsCuda, ::testing::ValuesIn(split_cuda_cases()), case_name);

}  // namespace
}  // namespace strata::testing
