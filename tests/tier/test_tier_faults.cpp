// Fault injection: I/O errors, short reads and corrupted swap data mid-move surface at the wait,
// and the source copy stays valid.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <random>
#include <set>

#include "strata/device.hpp"
#include "strata/device_fault.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"
#include "tier/fill.hpp"
#include "tier/swap_space.hpp"
#include "tier/tier_store.hpp"
#include "tier_test_util.hpp"

using namespace strata;
using namespace std::chrono_literals;
namespace st = strata::testing;

namespace {

constexpr std::uint64_t kOddFaults = (250 << 10) + 77;  // 4 pieces of 64 KiB

void flip_bit_in_swap(st::StoreRig& rig, BufferId id, std::uint64_t buffer_offset, int bit) {
  auto [ext, len] = rig.store->nvme_extent(id);
  ASSERT_GT(len, buffer_offset);
  auto [path, off] = rig.store->swap_space()->locate(ext + buffer_offset);
  int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  std::uint8_t byte = 0;
  ASSERT_EQ(pread(fd, &byte, 1, off), 1);
  byte ^= std::uint8_t(1u << bit);
  ASSERT_EQ(pwrite(fd, &byte, 1, off), 1);
  fsync(fd);
  close(fd);
}

}  // namespace

// The cpu tier and the (host-emulated) gpu tier reach NVMe by different paths (direct pieces;
// pinned pieces through the device stream): these tests run on each, as the memory side.
class MemoryTierFaults : public ::testing::TestWithParam<Tier> {
 protected:
  st::StoreRig rig;
};

TEST_P(MemoryTierFaults, ReadErrorMidMoveKeepsTheSource) {
  const Tier dst = GetParam();
  auto data = st::random_bytes(kOddFaults, 5);
  auto id = rig.add("m", Tier::kCpu, data);
  rig.store->move(id, Tier::kNvme).wait();
  auto f = rig.fault->add_fault(IoFault::fail_nth(3, EIO, IoOp::kRead));
  st::expect_error<IoError>(ErrorCode::kIo, st::errno_text(EIO),
                            [&] { rig.store->move(id, dst).wait(); });
  EXPECT_EQ(rig.fault->fired(f), 1u);
  auto i = rig.store->info(id);
  EXPECT_TRUE(i.valid[int(Tier::kNvme)]);
  EXPECT_FALSE(i.valid[int(dst)]);
  EXPECT_FALSE(i.allocated[int(dst)]);
  rig.fault->clear_faults();
  rig.store->move(id, dst).wait();
  EXPECT_EQ(rig.read(id, dst, kOddFaults), data) << tier_name(dst);
}

TEST_P(MemoryTierFaults, ShortReadMidMoveIsAnError) {
  const Tier dst = GetParam();
  auto data = st::random_bytes(kOddFaults, 6);
  auto id = rig.add("m", Tier::kCpu, data);
  rig.store->evict(id, Tier::kCpu).wait();
  rig.fault->add_fault(IoFault::short_nth(2, 4096, IoOp::kRead));
  EXPECT_THROW(rig.store->prefetch(id, dst).wait(), IoError);
  EXPECT_TRUE(rig.store->info(id).valid[int(Tier::kNvme)]);
  rig.fault->clear_faults();
  EXPECT_EQ(rig.read(id, dst, kOddFaults), data);
}

TEST_P(MemoryTierFaults, WriteErrorKeepsTheMemoryCopy) {
  const Tier src = GetParam();
  auto data = st::random_bytes(kOddFaults, 8);
  auto id = rig.add("w", src, data);
  rig.fault->add_fault(IoFault::fail_nth(2, ENOSPC, IoOp::kWrite));
  // cpu: evict writes it down to NVMe; gpu: a move to NVMe (evicting a GPU copy goes to cpu).
  auto down = [&] {
    return src == Tier::kCpu ? rig.store->evict(id, src) : rig.store->move(id, Tier::kNvme);
  };
  st::expect_error<IoError>(ErrorCode::kIo, st::errno_text(ENOSPC), [&] { down().wait(); });
  auto i = rig.store->info(id);
  EXPECT_TRUE(i.valid[int(src)]);
  EXPECT_FALSE(i.valid[int(Tier::kNvme)]);
  EXPECT_EQ(rig.read(id, src, kOddFaults), data);
  rig.fault->clear_faults();
  down().wait();
  EXPECT_FALSE(rig.store->info(id).allocated[int(src)]);
  EXPECT_EQ(rig.read(id, src == Tier::kCpu ? Tier::kGpu : Tier::kCpu, kOddFaults), data);
}

TEST_P(MemoryTierFaults, FlippedBitInTheSwapFileIsAChecksumError) {
  const Tier dst = GetParam();
  auto data = st::random_bytes(kOddFaults, 12);
  auto id = rig.add("moment1", Tier::kCpu, data);
  rig.store->move(id, Tier::kNvme).wait();
  flip_bit_in_swap(rig, id, (128 << 10) + 999, 3);  // third piece
  const std::string m =
      st::expect_error(ErrorCode::kChecksum, "'moment1'", [&] { rig.store->move(id, dst).wait(); });
  EXPECT_NE(m.find("buffer offset 131072"), std::string::npos) << m;
  EXPECT_NE(m.find("swap.bin"), std::string::npos) << m;
  EXPECT_EQ(rig.store->stats().checksum_failures, 1u);
  EXPECT_FALSE(rig.store->info(id).valid[int(dst)]);
  flip_bit_in_swap(rig, id, (128 << 10) + 999, 3);  // repaired
  rig.store->move(id, dst).wait();
  EXPECT_EQ(rig.read(id, dst, kOddFaults), data);
}

INSTANTIATE_TEST_SUITE_P(Tiers, MemoryTierFaults, ::testing::Values(Tier::kCpu, Tier::kGpu),
                         [](const auto& info) { return std::string(tier_name(info.param)); });

// Pieces larger than a check unit (4 MiB pieces, 1 MiB units): a read of part of a piece reads
// and checks only the units it touches, so a flipped bit in another unit does not fail it, and
// the one that touches that unit does (naming the unit's offset).
TEST(TierFaults, APartialReadChecksOnlyTheUnitsItReads) {
  st::RigOptions o;
  o.pool_buffer_size = 4 << 20;
  o.nvme_capacity = 64 << 20;
  st::StoreRig rig(o);
  const std::uint64_t mib = 1 << 20, n = 3 * mib + 12345;
  auto data = st::random_bytes(n, 14);
  auto id = rig.add("moment2", Tier::kCpu, data);
  rig.store->move(id, Tier::kNvme).wait();
  flip_bit_in_swap(rig, id, 2 * mib + 77, 5);  // the third unit
  std::vector<std::uint8_t> out(300000);
  const auto before = rig.store->stats().bytes_from_nvme;
  rig.store->read(id, 1000, out.size(), out.data()).wait();
  EXPECT_TRUE(std::equal(out.begin(), out.end(), data.begin() + 1000));
  EXPECT_EQ(rig.store->stats().bytes_from_nvme - before, mib);  // one unit, not the 4 MiB piece
  std::vector<std::uint8_t> across(mib + 300000);               // the second unit into the third
  const std::string m = st::expect_error(ErrorCode::kChecksum, "'moment2'", [&] {
    rig.store->read(id, mib + 5, across.size(), across.data()).wait();
  });
  EXPECT_NE(m.find("buffer offset 2097152"), std::string::npos) << m;
  EXPECT_EQ(rig.store->stats().checksum_failures, 1u);
}

TEST(TierFaults, CorruptedReadIsCaughtAndUncheckedWhenChecksumsAreOff) {
  {
    st::StoreRig rig;
    auto id = rig.store->register_buffer({"c", kOddFaults, DType::kFp32, Tier::kCpu, {}});
    rig.write(id, Tier::kCpu, st::random_bytes(kOddFaults, 13));
    rig.store->evict(id, Tier::kCpu).wait();
    rig.fault->add_fault(IoFault::corrupt_nth_read(2));
    st::expect_error(ErrorCode::kChecksum, "", [&] { rig.store->prefetch(id, Tier::kGpu).wait(); });
  }
  st::RigOptions o;
  o.checksum = false;
  st::StoreRig rig(o);
  auto data = st::random_bytes(kOddFaults, 14);
  auto id = rig.add("c", Tier::kCpu, data);
  rig.store->evict(id, Tier::kCpu).wait();
  rig.fault->add_fault(IoFault::corrupt_nth_read(1, 100));
  rig.store->prefetch(id, Tier::kCpu).wait();  // nothing checks: the corruption goes through
  EXPECT_NE(rig.read(id, Tier::kCpu, kOddFaults), data);
}

// F10 (issue 27): a device->host copy into a pool buffer that timed out is still queued; its
// buffer must not go back to the pool (another transfer would own it when the late copy lands).
TEST(TierFaults, TimedOutDeviceCopyKeepsItsPoolBuffer) {
  st::RigOptions o;
  o.fault_device = true;
  o.pool_buffers = 2;
  o.timeout = 200ms;
  st::StoreRig rig(o);
  const BufferId id = rig.store->register_buffer({"w", 64 << 10, DType::kFp32, Tier::kGpu, {}});
  // The copy waits 3 s of stream time; the store gives up after 200 ms.
  rig.fdev->add_fault({DeviceFaultKind::kDelay, 1, 1, std::chrono::milliseconds(3000)});
  EXPECT_THROW(rig.store->move(id, Tier::kNvme).wait(), Error);
  EXPECT_LT(rig.pool->available(), 2u)
      << "the pool buffer of the timed-out device->host copy was given back while the copy is "
         "still queued";
}

// F10 with F9's stream-ordered legs: an NVMe -> GPU leg queues every piece's copy and waits once
// at its end; when that wait times out every piece's copy may still be queued, so none of their
// pool buffers may go back to the pool (3 pieces in flight: 1 of 4 buffers left).
TEST(TierFaults, TimedOutLegKeepsEveryQueuedPieceBuffer) {
  st::RigOptions o;
  o.fault_device = true;
  o.pool_buffers = 4;
  o.movers = 1;  // the window: all 4 pool buffers
  // The store's timeout bounds the set-up's NVMe write too: 200 ms was exceeded there once, on 2
  // cores running two test suites and two busy loops.
  o.timeout = 1s;
  st::StoreRig rig(o);
  const auto data = st::random_bytes(3 * (64 << 10), 15);  // 3 pieces
  const BufferId id = rig.add("w", Tier::kCpu, data);
  rig.store->move(id, Tier::kNvme).wait();
  // The first piece's copy waits 5 s of stream time (the later ones queue behind it); the store
  // gives up after 1 s.
  rig.fdev->add_fault({DeviceFaultKind::kDelay, 1, 1, std::chrono::milliseconds(5000)});
  EXPECT_THROW(rig.store->move(id, Tier::kGpu).wait(), Error);
  EXPECT_EQ(rig.pool->available(), 1u)
      << "a pool buffer of a piece whose copy may still be queued was given back";
}

namespace {

// Says yes to every registration (as cudaHostRegister does) without doing one, and remembers the
// ranges: the host-emulated device declines, so the store's pinned host copies would take the
// mlock path instead of the device's.
class RegisteringDevice final : public DeviceWrapper {
 public:
  using DeviceWrapper::DeviceWrapper;
  bool register_host(void* ptr, std::size_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ranges_.insert(ptr).second) ++twice_;
    return true;
  }
  void unregister_host(void* ptr) noexcept override {
    std::lock_guard<std::mutex> lock(mu_);
    if (ranges_.erase(ptr) == 0) ++unknown_;
  }
  std::size_t registered() {
    std::lock_guard<std::mutex> lock(mu_);
    return ranges_.size();
  }
  int twice() {
    std::lock_guard<std::mutex> lock(mu_);
    return twice_;
  }
  int unknown() {
    std::lock_guard<std::mutex> lock(mu_);
    return unknown_;
  }

 private:
  std::mutex mu_;
  std::set<void*> ranges_;
  int twice_ = 0, unknown_ = 0;
};

// The rig's device wrapped in a RegisteringDevice, *reg pointing at it once the rig is made.
void watch_registrations(st::RigOptions& o, RegisteringDevice*& reg) {
  o.wrap_device = [&reg](std::unique_ptr<Device> d) {
    auto r = std::make_unique<RegisteringDevice>(std::move(d));
    reg = r.get();
    return r;
  };
}

}  // namespace

// F11 (issue 27): a pinned host copy whose device->host copy timed out is quarantined with its
// registration, which is undone when the store shuts down, after the late copy ran (the movers'
// streams drain before any buffer is freed): never unmapped while registered, never written
// after it was freed.
TEST(TierFaults, TimedOutCopyIntoAPinnedHostCopyKeepsItsRegistrationUntilShutdown) {
  RegisteringDevice* reg = nullptr;
  st::RigOptions o;
  o.fault_device = true;
  o.timeout = 200ms;
  watch_registrations(o, reg);
  st::StoreRig rig(o);
  const std::size_t pool_ranges = reg->registered();
  const BufferId id =
      rig.store->register_buffer({"w", 64 << 10, DType::kFp32, Tier::kGpu, {}, /*pinned=*/true});
  // The device->host copy waits 1.5 s of stream time; the store gives up after 200 ms.
  rig.fdev->add_fault({DeviceFaultKind::kDelay, 1, 1, std::chrono::milliseconds(1500)});
  EXPECT_THROW(rig.store->move(id, Tier::kCpu).wait(), Error);
  EXPECT_EQ(reg->registered(), pool_ranges + 1) << "the quarantined copy stays registered";
  rig.store.reset();
  EXPECT_EQ(reg->registered(), pool_ranges) << "a quarantined copy left registered at shutdown";
  EXPECT_EQ(reg->unknown(), 0) << "unregistered a range that was never registered";
  EXPECT_EQ(reg->twice(), 0);
}

// The filler's staging buffer (an adding piece from device memory into a cpu home goes through it,
// here in three parts) is page-locked within the store's pinned budget and counted there until the
// filler goes; one byte short of room, it stays pageable (not registered, nothing counted). The
// sums are the same either way.
TEST(TierFaults, TheFillersStagingBufferIsPageLockedOnlyWithinThePinnedBudget) {
  constexpr std::uint64_t kStaging = 8 << 10;
  constexpr std::size_t kN = 5000;  // floats: 20000 bytes
  for (const bool room : {true, false}) {
    SCOPED_TRACE(room ? "room" : "one byte short");
    RegisteringDevice* reg = nullptr;
    st::RigOptions o;
    watch_registrations(o, reg);
    const std::uint64_t pool = std::uint64_t{o.pool_buffers} * o.pool_buffer_size;
    o.pinned_budget = pool + kStaging - (room ? 0 : 1);
    st::StoreRig rig(o);
    const std::size_t pool_ranges = reg->registered();
    ASSERT_EQ(rig.store->usage(Tier::kCpu).pinned, pool);
    std::vector<float> a(kN), b(kN), sum(kN);
    std::mt19937 rng(room ? 3 : 4);
    std::normal_distribution<float> d(0, 5);
    for (std::size_t i = 0; i < kN; ++i) {
      a[i] = d(rng);
      b[i] = d(rng);
      sum[i] = a[i] + b[i];
    }
    const auto bytes_of = [](const std::vector<float>& v) {
      std::vector<std::uint8_t> out(v.size() * sizeof(float));
      std::memcpy(out.data(), v.data(), out.size());
      return out;
    };
    const BufferId id = rig.add("grad", Tier::kCpu, bytes_of(a));
    {
      tier::Filler filler(*rig.store, {id}, 20s, nullptr, DType::kFp32, DType::kFp32, kStaging);
      st::CallerMemory src(*rig.device, Tier::kGpu, kN * sizeof(float));
      src.put(bytes_of(b));
      filler.begin(tier::Filler::Mode::kAccumulate);
      filler.fill(0, 0, kN * sizeof(float), src.data(), Tier::kGpu);
      filler.end();
      EXPECT_EQ(reg->registered(), pool_ranges + (room ? 1 : 0));
      EXPECT_EQ(rig.store->usage(Tier::kCpu).pinned, pool + (room ? kStaging : 0));
    }
    EXPECT_EQ(reg->registered(), pool_ranges) << "the filler left its staging buffer registered";
    EXPECT_EQ(rig.store->usage(Tier::kCpu).pinned, pool) << "the filler kept its reservation";
    EXPECT_EQ(rig.read(id, Tier::kCpu, kN * sizeof(float)), bytes_of(sum));
    rig.store.reset();
    EXPECT_EQ(reg->unknown(), 0);
    EXPECT_EQ(reg->twice(), 0);
  }
}

// A pinned (pin_memory) host block's pending version is page-locked as the block's copies are,
// once: the commit swaps it in as the home copy, the old one is kept locked as the spare and
// reused by the next pending version; every lock is undone once (unregister, shutdown).
TEST(TierFaults, PendingVersionsOfAPinnedBlockAreLockedOnceAndUnlockedOnce) {
  RegisteringDevice* reg = nullptr;
  st::RigOptions o;
  watch_registrations(o, reg);
  st::StoreRig rig(o);
  const std::size_t pool_ranges = reg->registered();
  const BufferId id =
      rig.store->register_buffer({"w", 64 << 10, DType::kFp32, Tier::kCpu, {}, /*pinned=*/true});
  rig.write(id, Tier::kCpu, st::random_bytes(64 << 10, 5));
  const BufferId ids[] = {id};
  for (int round = 0; round < 3; ++round) {
    rig.store->open_pending(ids);
    const auto b = st::random_bytes(64 << 10, 6 + round);
    std::memcpy(rig.store->pending_view(id), b.data(), b.size());
    rig.store->write_pending(id, 0, 0, rig.store->pending_view(id)).wait();
    rig.store->commit(ids);
    EXPECT_EQ(rig.read(id, Tier::kCpu, 64 << 10), b) << "round " << round;
    EXPECT_EQ(reg->registered(), pool_ranges + 2) << "round " << round << ": copy and spare";
  }
  rig.store->unregister_buffer(id);
  EXPECT_EQ(reg->registered(), pool_ranges);
  rig.store.reset();
  EXPECT_EQ(reg->unknown(), 0);
  EXPECT_EQ(reg->twice(), 0);
}
