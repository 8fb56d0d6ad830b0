// What the `gpu` tests need to run against the fake CUDA runtime as well as on a GPU:
// - gpu_base(): the first ordinal a test uses ($STRATA_TEST_GPU_BASE, default 0). The fakecuda
//   label sets 1, so that nothing may assume GPU 0;
// - under_fakecuda(): the fake answers (its control API, fakecuda.h, is then usable);
// - a global environment that fails the binary when the fake was expected
//   ($STRATA_EXPECT_FAKECUDA) but the real runtime answers, and, at the end, when some call created
//   a context on a GPU below gpu_base() (GPU 0 touched although nothing asked for it).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "fakecuda/fakecuda.h"
#include "strata/communicator.hpp"
#include "strata/device_query.hpp"

namespace strata::testing {

inline bool under_fakecuda() { return fakecuda_active != nullptr && fakecuda_active() == 1; }

inline int gpu_base() {
  const char* v = std::getenv("STRATA_TEST_GPU_BASE");
  return v ? std::atoi(v) : 0;
}

// Why a test needing NCCL and `gpus` CUDA devices cannot run here; "" when it can.
inline std::string nccl_gpus_missing(int gpus) {
  if (!nccl_available()) return "built without NCCL";
  const int have = static_cast<int>(query_cuda_devices().devices.size());
  if (have < gpus) return std::to_string(gpus) + " GPU(s) needed, " + std::to_string(have);
  return "";
}

// For ranks that are threads: each takes its device from the config (rank % ranks_per_node), not
// from a launcher's local rank, so the launchers' local-rank variables are removed.
inline void forget_launcher_local_rank() {
  for (const char* v :
       {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    ::unsetenv(v);
}

class FakeCudaEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    if (std::getenv("STRATA_EXPECT_FAKECUDA") && !under_fakecuda())
      FAIL() << "STRATA_EXPECT_FAKECUDA is set but the fake CUDA runtime is not the one answering "
                "(LD_PRELOAD of libstrata_fakecuda.so missing?)";
  }
  void TearDown() override {
    if (!under_fakecuda()) return;
    for (int d = 0; d < gpu_base(); ++d)
      EXPECT_EQ(fakecuda_context_created(d), 0)
          << "a CUDA context was created on GPU " << d << ", which no test asked for (tests use "
          << "GPUs from " << gpu_base() << ")";
  }
};

inline const bool kFakeCudaEnvironmentRegistered =
    (::testing::AddGlobalTestEnvironment(new FakeCudaEnvironment), true);

}  // namespace strata::testing
