// NCCL communicator, one rank (file bootstrap): collectives on device buffers. Needs a GPU and a
// build with NCCL; skipped otherwise.
#include <gtest/gtest.h>

#include "strata/communicator.hpp"
#include "strata/device_query.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

#ifdef STRATA_TEST_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace strata::testing {
namespace {

TEST(Nccl, SingleRankCollectives) {
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  if (query_cuda_devices().devices.empty()) GTEST_SKIP() << "no CUDA device";
#ifdef STRATA_TEST_HAVE_CUDA
  TempDir dir("strata-nccl");
  NcclBootstrap boot;
  boot.file = dir.str() + "/nccl-id";
  auto comm = make_nccl_communicator(boot, 0, 30.0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->buffer_location(), BufferLocation::kDevice);
  const std::size_t n = 1000;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i) * 0.5f - 7.0f;
  float* dev = nullptr;
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&out, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  comm->all_reduce(dev, out, n, DType::kFp32);
  std::vector<std::size_t> counts{n};
  comm->all_gather(dev, out, counts, DType::kFp32);
  comm->reduce_scatter(dev, out, counts, DType::kFp32);
  comm->broadcast(out, n, DType::kFp32, 0);
  comm->barrier();
  std::vector<float> back(n);
  ASSERT_EQ(cudaMemcpy(back.data(), out, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  EXPECT_EQ(comm->stats().calls[static_cast<std::size_t>(CollectiveKind::kAllReduce)], 1u);
  cudaFree(dev);
  cudaFree(out);
#endif
}

}  // namespace
}  // namespace strata::testing
