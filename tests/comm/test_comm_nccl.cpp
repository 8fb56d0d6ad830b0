// NCCL communicator: collectives on device buffers, one rank (file bootstrap) and two ranks as
// threads on two GPUs; a timed-out collective fails every other in-flight one (F13); a stale
// bootstrap file of an earlier run is not read (F16); the caller's current device is kept (F3).
// Needs GPUs and a build with NCCL, skipped otherwise; the fakecuda label runs it against the
// fake CUDA runtime + NCCL on GPUs from 1.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <thread>

#include "fakecuda/gpu_test_env.hpp"
#include "strata/communicator.hpp"
#include "strata/device_query.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

#ifdef STRATA_TEST_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace strata::testing {
namespace {

int gpus() { return static_cast<int>(query_cuda_devices().devices.size()); }

#ifdef STRATA_TEST_HAVE_CUDA
// Device buffer of n floats on GPU `dev` holding `values` (the caller's device is kept).
float* device_floats(int dev, const std::vector<float>& values) {
  int prev = 0;
  EXPECT_EQ(cudaGetDevice(&prev), cudaSuccess);
  EXPECT_EQ(cudaSetDevice(dev), cudaSuccess);
  float* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, values.size() * 4), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, values.data(), values.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaSetDevice(prev), cudaSuccess);
  return p;
}

std::vector<float> host_floats(const float* p, std::size_t n) {
  std::vector<float> back(n);
  EXPECT_EQ(cudaMemcpy(back.data(), p, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return back;
}

// Runs fn(rank) on `world` threads; rethrows the first failure.
void on_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}
#endif

TEST(Nccl, SingleRankCollectives) {
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  if (gpus() <= gpu_base()) GTEST_SKIP() << "no CUDA device " << gpu_base();
#ifdef STRATA_TEST_HAVE_CUDA
  TempDir dir("strata-nccl");
  NcclBootstrap boot;
  boot.file = dir.str() + "/nccl-id";
  auto comm = make_nccl_communicator(boot, gpu_base(), 30.0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->buffer_location(), BufferLocation::kDevice);
  const std::size_t n = 1000;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i) * 0.5f - 7.0f;
  float* dev = device_floats(gpu_base(), host);
  float* out = device_floats(gpu_base(), std::vector<float>(n, 0.0f));
  comm->all_reduce(dev, out, n, DType::kFp32);
  std::vector<std::size_t> counts{n};
  comm->all_gather(dev, out, counts, DType::kFp32);
  comm->reduce_scatter(dev, out, counts, DType::kFp32);
  comm->broadcast(out, n, DType::kFp32, 0);
  comm->barrier();
  EXPECT_EQ(host_floats(out, n), host);
  EXPECT_EQ(comm->stats().calls[static_cast<std::size_t>(CollectiveKind::kAllReduce)], 1u);
  cudaFree(dev);
  cudaFree(out);
#endif
}

// Two ranks on GPUs base and base + 1: SKIPPED (in SetUp) without NCCL or without those GPUs.
class NcclTwoGpus : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
    if (gpus() < gpu_base() + 2)
      GTEST_SKIP() << "needs GPUs " << gpu_base() << ", " << gpu_base() + 1;
  }
};

// Two ranks (threads) on GPUs base and base+1: sums, uneven gathers, and the calling thread's
// current device left alone (F3: NCCL needs its device current only during the calls).
TEST_F(NcclTwoGpus, TwoRanksOnTwoGpus) {
#ifdef STRATA_TEST_HAVE_CUDA
  TempDir dir("strata-nccl2");
  on_ranks(2, [&](int r) {
    const int other = gpu_base() + 1 - r;  // the thread's own current GPU: the other rank's
    ASSERT_EQ(cudaSetDevice(other), cudaSuccess);
    const NcclBootstrap boot{nullptr, dir.str() + "/nccl-id", r, 2};  // rank r of 2, by file
    auto comm = make_nccl_communicator(boot, gpu_base() + r, 60.0);
    const std::size_t n = 301;
    std::vector<float> mine(n);
    for (std::size_t i = 0; i < n; ++i) mine[i] = static_cast<float>(i + 1000 * r);
    float* in = device_floats(gpu_base() + r, mine);
    float* out = device_floats(gpu_base() + r, std::vector<float>(n, 0.0f));
    comm->all_reduce(in, out, n, DType::kFp32);
    std::vector<float> sum = host_floats(out, n);
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(sum[i], static_cast<float>(2 * i + 1000)) << i;
    std::vector<std::size_t> counts{100, 201};
    float* gathered = device_floats(gpu_base() + r, std::vector<float>(n, 0.0f));
    comm->all_gather(in + (r == 0 ? 0 : 100), gathered, counts, DType::kFp32);
    std::vector<float> g = host_floats(gathered, n);
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(g[i], static_cast<float>(i + (i < 100 ? 0 : 1000))) << i;
    int cur = -1;
    ASSERT_EQ(cudaGetDevice(&cur), cudaSuccess);
    EXPECT_EQ(cur, other) << "the communicator changed the caller's current device";
    comm.reset();
    cudaFree(in);
    cudaFree(out);
    cudaFree(gathered);
  });
#endif
}

// F13: after one collective timed out (its peer never joined) and the communicator was aborted,
// every other in-flight collective fails too; none reports success for data that never arrived.
TEST_F(NcclTwoGpus, AbortFailsEveryInFlightCollective) {
#ifdef STRATA_TEST_HAVE_CUDA
  TempDir dir("strata-nccl-abort");
  std::unique_ptr<Communicator> idle;  // rank 1: joins, then never takes part
  on_ranks(2, [&](int r) {
    const NcclBootstrap boot{nullptr, dir.str() + "/nccl-id", r, 2};  // rank r of 2, by file
    auto comm = make_nccl_communicator(boot, gpu_base() + r, 3.0);
    if (r == 1) {
      idle = std::move(comm);
      return;
    }
    float* a = device_floats(gpu_base(), std::vector<float>(64, 1.0f));
    float* b = device_floats(gpu_base(), std::vector<float>(64, 1.0f));
    auto h1 = comm->all_reduce_async(a, a, 64, DType::kFp32);
    // h2's own deadline is later than h1's: when h1 times out and aborts, h2 is still in time
    // (whatever it reports is then about the abort, not about its own deadline).
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    auto h2 = comm->all_reduce_async(b, b, 64, DType::kFp32);
    EXPECT_THROW(h1->wait(), Error);
    try {
      h2->wait();
      ADD_FAILURE() << "a collective of an aborted communicator reported success";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kComm) << e.what();
    }
    h1.reset();
    h2.reset();
    comm.reset();
    cudaFree(a);
    cudaFree(b);
  });
  idle.reset();
#endif
}

// F16: a bootstrap file left by an earlier run (its writer is gone) is not taken for this run's:
// rank 1, started first, waits for rank 0's fresh id instead of waiting forever on a dead root.
TEST_F(NcclTwoGpus, StaleBootstrapFileIsIgnored) {
#ifdef STRATA_TEST_HAVE_CUDA
  TempDir dir("strata-nccl-stale");
  const std::string file = dir.str() + "/nccl-id";
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ASSERT_GT(dead, 0);
  ASSERT_EQ(::waitpid(dead, nullptr, 0), dead);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  {
    std::ofstream f(file, std::ios::binary);
    const auto junk = random_bytes(128, 7);
    f.write(reinterpret_cast<const char*>(junk.data()), 128);
    f << "owner " << host << " " << dead << " 1\n";
  }
  std::atomic<bool> rank1_started{false};
  on_ranks(2, [&](int r) {
    if (r == 0) {
      while (!rank1_started) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 1 reads first
    } else {
      rank1_started = true;
    }
    const NcclBootstrap boot{nullptr, file, r, 2};  // rank r of 2, by file
    auto comm = make_nccl_communicator(boot, gpu_base() + r, 10.0);
    comm->barrier();
  });
#endif
}

}  // namespace
}  // namespace strata::testing
