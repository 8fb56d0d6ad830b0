// F9 (issue 27): the tier store's device copies are stream-ordered. A leg of several pieces NVMe
// -> GPU (a move, or a range read into device memory) queues every piece's copy and waits where a
// staging buffer is needed again or the leg ends: one host wait for a leg that fits the window,
// not one per piece. Counted by the fake CUDA runtime's "host_sync" (fakecuda.h); on a real GPU
// the cases check the bytes only. Its own binary (label gpu): SKIPPED without a GPU.
#include <gtest/gtest.h>

#include <vector>

#include "fakecuda/gpu_test_env.hpp"
#include "strata/device_query.hpp"
#include "tier/tier_test_util.hpp"

namespace strata {
namespace {

namespace st = strata::testing;

constexpr std::uint64_t kPiece = 64 << 10;
constexpr std::uint32_t kWindow = 4;  // pool buffers, one mover: the window of one transfer

int gpu_count() { return static_cast<int>(query_cuda_devices().devices.size()); }

st::RigOptions cuda_rig() {
  st::RigOptions o;
  o.make_device = [] { return make_device(DeviceKind::kCuda, st::gpu_base()); };
  o.pool_buffers = kWindow;
  o.pool_buffer_size = kPiece;
  o.movers = 1;
  return o;
}

// A buffer of `bytes` whose only valid copy is on NVMe.
BufferId on_nvme(st::StoreRig& rig, const std::vector<std::uint8_t>& data) {
  const BufferId id = rig.add("w", Tier::kCpu, data);
  rig.store->move(id, Tier::kNvme).wait();
  return id;
}

void reset_counters() {
  if (st::under_fakecuda()) fakecuda_reset_counters();
}

long host_syncs() { return st::under_fakecuda() ? fakecuda_counter("host_sync") : -1; }

TEST(TierSyncCuda, NvmeToGpuLegWaitsOnce) {
  if (gpu_count() <= st::gpu_base()) GTEST_SKIP() << "no GPU " << st::gpu_base();
  st::StoreRig rig(cuda_rig());
  const std::uint64_t bytes = 3 * kPiece - 100;  // 3 pieces: within the window
  const auto data = st::random_bytes(bytes, 91);
  const BufferId id = on_nvme(rig, data);
  reset_counters();
  rig.store->move(id, Tier::kGpu).wait();
  if (st::under_fakecuda()) {
    EXPECT_EQ(host_syncs(), 1) << "a 3-piece NVMe -> GPU leg waited once per piece";
  }
  EXPECT_EQ(rig.read(id, Tier::kGpu, bytes), data);
}

TEST(TierSyncCuda, RangeReadIntoDeviceMemoryWaitsOnce) {
  if (gpu_count() <= st::gpu_base()) GTEST_SKIP() << "no GPU " << st::gpu_base();
  st::StoreRig rig(cuda_rig());
  const std::uint64_t bytes = 3 * kPiece;
  const auto data = st::random_bytes(bytes, 92);
  const BufferId id = on_nvme(rig, data);
  const std::uint64_t off = 100, len = bytes - 300;  // both edges inside a piece
  st::CallerMemory dst(*rig.device, Tier::kGpu, len);
  reset_counters();
  rig.store->read(id, off, len, dst.data(), Tier::kGpu).wait();
  if (st::under_fakecuda()) {
    EXPECT_EQ(host_syncs(), 1) << "a 3-piece range read into device memory waited per piece";
  }
  EXPECT_EQ(dst.get(len), std::vector<std::uint8_t>(data.begin() + off, data.begin() + off + len));
}

// More pieces than the window: a piece's copy is waited for only when its staging buffer is
// needed for a later piece, and the leg's end is one wait for every copy still queued.
TEST(TierSyncCuda, LongLegWaitsOnlyForBuffersItReuses) {
  if (gpu_count() <= st::gpu_base()) GTEST_SKIP() << "no GPU " << st::gpu_base();
  st::StoreRig rig(cuda_rig());
  constexpr std::uint64_t kPieces = 10;
  const std::uint64_t bytes = kPieces * kPiece;
  const auto data = st::random_bytes(bytes, 93);
  const BufferId id = on_nvme(rig, data);
  reset_counters();
  rig.store->move(id, Tier::kGpu).wait();
  if (st::under_fakecuda()) {
    EXPECT_EQ(host_syncs(), static_cast<long>(kPieces - kWindow + 1))
        << "one wait per reused staging buffer and one at the end";
  }
  EXPECT_EQ(rig.read(id, Tier::kGpu, bytes), data);
}

}  // namespace
}  // namespace strata
