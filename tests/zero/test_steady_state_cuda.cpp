// F5/F8 (issue 27): once its first steps have run, a training step makes no cudaMalloc and no
// cudaFree (each synchronises the device, and with NCCL kernels in flight on several GPUs of one
// process they can hang) and registers no host memory: gradient buckets, receive buffers and the
// stage-3 gathered tensors come back from the rank's ScratchArena (tier/scratch_arena.hpp), the
// staging buffers from the pinned pool. Counted by the fake CUDA runtime over three steps after
// three warm-up steps; stages 0-3, state and gradients on the GPU and on pinned host memory. On a
// real GPU the test checks the numbers only (the runtime counts nothing there).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fakecuda/gpu_test_env.hpp"
#include "placement_util.hpp"
#include "strata/device_query.hpp"

namespace strata::testing {
namespace {

struct SteadyCase {
  int stage;
  Tier opt, grads;
};

std::string steady_name(const ::testing::TestParamInfo<SteadyCase>& i) {
  return strcat("stage", i.param.stage, "_opt_", tier_name(i.param.opt), "_grads_",
                tier_name(i.param.grads));
}

class SteadyState : public ::testing::TestWithParam<SteadyCase> {};

// One step: the forward gathers each tensor (stage 3), the backward hands the gradients in from
// device buffers the loop allocated once.
void one_step(Engine& e, const std::vector<TensorId>& ids, const std::vector<DeviceMemory>& grads) {
  for (TensorId id : ids) {
    e.gather({&id, 1});
    e.release({&id, 1});
  }
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    e.gather({&*it, 1});
    e.set_gradient(*it, grads[*it].get());
    e.release({&*it, 1});
  }
  EXPECT_TRUE(e.step().applied);
}

TEST_P(SteadyState, AStepAllocatesAndFreesNoDeviceMemory) {
  if (const std::string why = nccl_gpus_missing(1); !why.empty()) GTEST_SKIP() << why;
  forget_launcher_local_rank();
  TempDir dir("strata-steady");
  Placement p;
  p.stage = GetParam().stage;
  p.opt = GetParam().opt;
  p.grads = GetParam().grads;
  Config cfg = placement_config(p, dir.str());
  cfg.runtime.device = DeviceKind::kCuda;
  cfg.precision.loss_scale.initial = 1;
  NcclBootstrap boot;
  boot.file = dir.str() + "/nccl-id";
  auto comm = make_nccl_communicator(boot, 0, 30.0);
  Engine e(cfg, *comm);
  std::vector<TensorId> ids;
  for (std::size_t t = 0; t < kSizes.size(); ++t)
    ids.push_back(e.add_parameter(strcat("t", t), initial(t)));
  e.finalize();
  auto stream = e.device().create_stream();
  std::vector<DeviceMemory> grads;
  for (std::size_t t = 0; t < kSizes.size(); ++t) {
    const auto g = gradient(0, 1, 0, t, DType::kFp32, 0, 0);
    grads.push_back(e.device().allocate(std::max<std::size_t>(g.size(), 4)));
    if (!g.empty()) stream->memcpy_async(grads.back().get(), g.data(), g.size());
  }
  stream->synchronize(std::chrono::seconds(30));
  for (int s = 0; s < 3; ++s) one_step(e, ids, grads);  // warm-up: arenas and pools fill
  if (!under_fakecuda()) return;
  fakecuda_reset_counters();
  for (int s = 0; s < 3; ++s) one_step(e, ids, grads);
  EXPECT_EQ(fakecuda_counter("malloc"), 0) << "cudaMalloc in a steady-state step";
  EXPECT_EQ(fakecuda_counter("free"), 0) << "cudaFree in a steady-state step";
  EXPECT_EQ(fakecuda_counter("host_register"), 0) << "cudaHostRegister in a steady-state step";
  EXPECT_EQ(fakecuda_counter("host_unregister"), 0);
}

INSTANTIATE_TEST_SUITE_P(Stages, SteadyState,
                         ::testing::Values(SteadyCase{0, Tier::kGpu, Tier::kGpu},
                                           SteadyCase{1, Tier::kCpu, Tier::kGpu},
                                           SteadyCase{2, Tier::kGpu, Tier::kGpu},
                                           SteadyCase{2, Tier::kCpu, Tier::kCpu},
                                           SteadyCase{3, Tier::kGpu, Tier::kGpu},
                                           SteadyCase{3, Tier::kNvme, Tier::kCpu}),
                         steady_name);

}  // namespace
}  // namespace strata::testing
