// Versioned state, the snapshot half (tier_store.hpp, "Versioned state"): a pinned version reads
// back unchanged however the block is rewritten, in every tier and mix of tiers; copy-on-write is
// counted and freed; faults leave the committed and the pinned versions untouched.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "strata/error.hpp"
#include "test_util.hpp"
#include "tier/stream_loop.hpp"
#include "tier/swap_space.hpp"
#include "tier/tier_store.hpp"
#include "tier_test_util.hpp"

using namespace strata;
namespace st = strata::testing;

namespace {

constexpr std::uint64_t kOddVersions =
    (200 << 10) + 13;  // 4 pieces of 64 KiB, the last one partial

enum class Rewrite { kAcquireWrite, kAcquireDiscard, kStreamWrite, kZero };
const char* rewrite_name(Rewrite r) {
  switch (r) {
    case Rewrite::kAcquireWrite: return "acquire_write";
    case Rewrite::kAcquireDiscard: return "acquire_discard";
    case Rewrite::kStreamWrite: return "stream_write";
    case Rewrite::kZero: return "zero";
  }
  return "?";
}

// How the block's committed contents are placed when it is pinned.
enum class Placement { kHome, kAlsoNvme, kAlsoCpu };

// Replaces the block's contents with `data` (zero: with zeros; `data` is set to them).
void rewrite(st::StoreRig& rig, BufferId id, Tier home, Rewrite how,
             std::vector<std::uint8_t>& data) {
  switch (how) {
    case Rewrite::kAcquireWrite:
      rig.write(id, home == Tier::kNvme ? Tier::kCpu : home, data);
      break;
    case Rewrite::kAcquireDiscard:
      rig.write(id, home == Tier::kNvme ? Tier::kCpu : home, data, 0, ~0ULL, true);
      break;
    case Rewrite::kStreamWrite: {
      IoBuffer src = IoBuffer::allocate(rig.store->padded_bytes(id), HugePageMode::kNone);
      std::memcpy(src.data(), data.data(), data.size());
      rig.store->write(id, 0, 0, src.data()).wait();
      break;
    }
    case Rewrite::kZero:
      rig.store->zero(id).wait();
      data.assign(data.size(), 0);
      break;
  }
}

// The pinned version of `id`, whole into host memory, and a range at an odd offset into `memory`.
std::vector<std::uint8_t> read_pinned(st::StoreRig& rig, SnapshotId s, BufferId id,
                                      std::uint64_t bytes, Tier memory = Tier::kCpu,
                                      std::uint64_t offset = 0) {
  st::CallerMemory out(*rig.device, memory, bytes);
  rig.store->read_pinned(s, id, offset, bytes, out.data(), memory).wait();
  return out.get(bytes);
}

std::vector<std::uint8_t> slice(const std::vector<std::uint8_t>& v, std::uint64_t at,
                                std::uint64_t n) {
  return {v.begin() + static_cast<std::ptrdiff_t>(at),
          v.begin() + static_cast<std::ptrdiff_t>(at + n)};
}

// Registers `name` at `home` holding `data` (written with write(): any home, NVMe included).
BufferId add(st::StoreRig& rig, const std::string& name, Tier home,
             const std::vector<std::uint8_t>& data) {
  const BufferId id = rig.store->register_buffer({name, data.size(), DType::kFp32, home, {}});
  IoBuffer src = IoBuffer::allocate(rig.store->padded_bytes(id), HugePageMode::kNone);
  std::memcpy(src.data(), data.data(), data.size());
  rig.store->write(id, 0, 0, src.data()).wait();
  return id;
}

constexpr Tier kOneHomeEach[] = {Tier::kNvme, Tier::kCpu, Tier::kGpu};

// Blocks "opt.0" .. "opt.2" homed on kOneHomeEach, holding random bytes of seeds seed.. (into
// `data`, in the blocks' order).
std::vector<BufferId> add_one_per_home(st::StoreRig& rig, std::uint64_t seed,
                                       std::vector<std::vector<std::uint8_t>>& data) {
  std::vector<BufferId> ids;
  for (std::size_t k = 0; k < 3; ++k) {
    data.push_back(st::random_bytes(kOddVersions, seed + k));
    ids.push_back(add(rig, "opt." + std::to_string(k), kOneHomeEach[k], data.back()));
  }
  return ids;
}

void place(st::StoreRig& rig, BufferId id, Tier home, Placement p) {
  if (p == Placement::kAlsoNvme && home != Tier::kNvme) rig.store->prefetch(id, Tier::kNvme).wait();
  if (p == Placement::kAlsoCpu && home != Tier::kCpu) rig.store->prefetch(id, Tier::kCpu).wait();
}

struct Case {
  Tier home;
  Rewrite how;
  Placement placement;
};

// One block "opt.0" in `home` holding random bytes, its committed version pinned.
struct PinnedBlock {
  std::vector<std::uint8_t> data;
  BufferId id;
  SnapshotId snap;
};
PinnedBlock pin_one(st::StoreRig& rig, Tier home, std::uint64_t seed) {
  PinnedBlock p{st::random_bytes(kOddVersions, seed), 0, 0};
  p.id = add(rig, "opt.0", home, p.data);
  const BufferId ids[] = {p.id};
  p.snap = rig.store->pin_committed(ids);
  return p;
}

// One block "opt.0" in `home` holding random bytes `a`; `b`: other random bytes of its size (seed
// + 1), for a pending version.
struct TwoVersions {
  std::vector<std::uint8_t> a, b;
  BufferId id;
};
TwoVersions two_versions(st::StoreRig& rig, Tier home, std::uint64_t seed) {
  TwoVersions v{st::random_bytes(kOddVersions, seed), st::random_bytes(kOddVersions, seed + 1), 0};
  v.id = add(rig, "opt.0", home, v.a);
  return v;
}

class PinnedVersion : public ::testing::TestWithParam<Case> {};

// The pinned version reads back unchanged after the block was rewritten (twice), from host and
// device memory, whole and in a range; the committed version is the new data; copy-on-write holds
// exactly one copy (NVMe: the old slot; memory: a staging copy in the block's tier) until unpin.
TEST_P(PinnedVersion, ReadsBackUnchangedAfterRewrites) {
  const Case c = GetParam();
  st::StoreRig rig;
  const std::uint64_t seed = st::test_seed("PinnedVersion");
  const auto old_data = st::random_bytes(kOddVersions, seed);
  const BufferId id = add(rig, "opt.0", c.home, old_data);
  place(rig, id, c.home, c.placement);
  const std::uint64_t swap_before = rig.store->usage(Tier::kNvme).used;
  const std::uint64_t host_before = rig.store->usage(Tier::kCpu).used;
  const std::uint64_t gpu_before = rig.store->usage(Tier::kGpu).used;
  const BufferId ids[] = {id};
  const SnapshotId s = rig.store->pin_committed(ids);
  const bool nvme_valid = rig.store->info(id).valid[int(Tier::kNvme)];
  const Tier cost_tier = nvme_valid                                   ? Tier::kNvme
                         : rig.store->info(id).valid[int(Tier::kCpu)] ? Tier::kCpu
                                                                      : Tier::kGpu;
  const std::uint64_t padded = rig.store->padded_bytes(id);
  EXPECT_EQ(rig.store->rewrite_cost(s)[cost_tier], padded);
  EXPECT_EQ(read_pinned(rig, s, id, kOddVersions),
            old_data);  // before any change: the committed one

  auto new_data = st::random_bytes(kOddVersions, seed + 1);
  rewrite(rig, id, c.home, c.how, new_data);
  VersionUsage u = rig.store->version_usage();
  EXPECT_EQ(u.snapshots, 1u);
  EXPECT_EQ(u.pinned_blocks, 1u);
  EXPECT_EQ(u.diverged_blocks, 1u);
  EXPECT_EQ(u.held[cost_tier], padded);
  EXPECT_EQ(rig.store->rewrite_cost(s)[cost_tier], 0u);
  EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), new_data);
  EXPECT_EQ(read_pinned(rig, s, id, kOddVersions), old_data);
  EXPECT_EQ(read_pinned(rig, s, id, 70000, Tier::kGpu, 65531), slice(old_data, 65531, 70000));

  auto newer = st::random_bytes(kOddVersions, seed + 2);  // a second rewrite copies nothing more
  rewrite(rig, id, c.home, Rewrite::kStreamWrite, newer);
  EXPECT_EQ(rig.store->version_usage().held[cost_tier], padded);
  EXPECT_EQ(read_pinned(rig, s, id, kOddVersions, Tier::kCpu), old_data);
  EXPECT_EQ(rig.read(id, Tier::kGpu, kOddVersions), newer);

  rig.store->unpin(s);
  u = rig.store->version_usage();
  EXPECT_EQ(u.snapshots, 0u);
  EXPECT_EQ(u.pinned_blocks, 0u);
  for (Tier t : st::kAllTiers) EXPECT_EQ(u.held[t], 0u) << tier_name(t);
  rig.store->move(id, c.home).wait();
  if (c.home != Tier::kNvme) rig.store->evict(id, Tier::kNvme).wait();
  EXPECT_LE(rig.store->usage(Tier::kNvme).used, swap_before);  // the old slot went back
  EXPECT_LE(rig.store->usage(Tier::kCpu).used, host_before);
  EXPECT_LE(rig.store->usage(Tier::kGpu).used, gpu_before);
  EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), newer);
  st::expect_error(ErrorCode::kInvalidArgument, "no snapshot",
                   [&] { rig.store->read_pinned(s, id, 0, 0, nullptr).wait(); });
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (Tier home : st::kAllTiers)
    for (Rewrite how :
         {Rewrite::kAcquireWrite, Rewrite::kAcquireDiscard, Rewrite::kStreamWrite, Rewrite::kZero})
      for (Placement p : {Placement::kHome, Placement::kAlsoNvme, Placement::kAlsoCpu})
        out.push_back({home, how, p});
  return out;
}
}  // namespace

namespace {
std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  static const char* kPlace[] = {"home", "also_nvme", "also_cpu"};
  return std::string(tier_name(i.param.home)) + "_" + rewrite_name(i.param.how) + "_" +
         kPlace[static_cast<int>(i.param.placement)];
}
}  // namespace

INSTANTIATE_TEST_SUITE_P(EveryTier, PinnedVersion, ::testing::ValuesIn(all_cases()), case_name);

// A rank's state split over the tiers (offload fractions): one snapshot pins blocks of every home;
// a full rewrite of all of them leaves every pinned version intact; per-block unpin frees each.
TEST(PinnedVersions, MixedTiersOneSnapshot) {
  st::StoreRig rig;
  const std::uint64_t seed = st::test_seed("MixedTiersOneSnapshot");
  const Tier homes[] = {Tier::kGpu, Tier::kCpu, Tier::kNvme, Tier::kNvme, Tier::kCpu};
  std::vector<BufferId> ids;
  std::vector<std::vector<std::uint8_t>> old;
  for (std::size_t k = 0; k < std::size(homes); ++k) {
    old.push_back(st::random_bytes(kOddVersions - 977 * k, seed + k));
    ids.push_back(add(rig, "opt." + std::to_string(k), homes[k], old.back()));
  }
  const SnapshotId s = rig.store->pin_committed(ids);
  for (std::size_t k = 0; k < ids.size(); ++k) {
    auto fresh = st::random_bytes(old[k].size(), seed + 100 + k);
    rewrite(rig, ids[k], homes[k], Rewrite::kStreamWrite, fresh);
  }
  EXPECT_EQ(rig.store->version_usage().diverged_blocks, ids.size());
  for (std::size_t k = 0; k < ids.size(); ++k) {
    EXPECT_EQ(read_pinned(rig, s, ids[k], old[k].size()), old[k]) << k;
    rig.store->unpin(s, ids[k]);
    EXPECT_EQ(rig.store->version_usage().pinned_blocks, ids.size() - k - 1);
  }
  const VersionUsage u = rig.store->version_usage();
  for (Tier t : st::kAllTiers) EXPECT_EQ(u.held[t], 0u) << tier_name(t);
  rig.store->unpin(s);
  EXPECT_EQ(rig.store->version_usage().snapshots, 0u);
}

// Two snapshots of one committed version share its copy; it is freed with the last pin.
TEST(PinnedVersions, TwoSnapshotsShareOneCopy) {
  st::StoreRig rig;
  const auto a = st::random_bytes(kOddVersions, 7);
  const BufferId id = add(rig, "opt.0", Tier::kCpu, a);
  const BufferId ids[] = {id};
  const SnapshotId s1 = rig.store->pin_committed(ids), s2 = rig.store->pin_committed(ids);
  auto b = st::random_bytes(kOddVersions, 8);
  rig.write(id, Tier::kCpu, b);
  const std::uint64_t padded = rig.store->padded_bytes(id);
  EXPECT_EQ(rig.store->version_usage().held[Tier::kCpu], padded);
  rig.store->unpin(s1);
  EXPECT_EQ(rig.store->version_usage().held[Tier::kCpu], padded);
  EXPECT_EQ(read_pinned(rig, s2, id, kOddVersions), a);
  rig.store->unpin(s2);
  EXPECT_EQ(rig.store->version_usage().held[Tier::kCpu], 0u);
}

// Over budget the change is refused with nothing changed; after unpin it goes through.
TEST(PinnedVersions, CopyOverBudgetRefusedNothingChanged) {
  st::RigOptions o;
  o.host_budget = (256 << 10) + 4 * (64 << 10) + (64 << 10);  // the pool, the block, not a copy
  st::StoreRig rig(o);
  const PinnedBlock p = pin_one(rig, Tier::kCpu, 11);
  auto b = st::random_bytes(kOddVersions, 12);
  st::expect_error(ErrorCode::kBudget, "pinned version of buffer 'opt.0'",
                   [&] { rig.write(p.id, Tier::kCpu, b); });
  EXPECT_EQ(rig.read(p.id, Tier::kCpu, kOddVersions), p.data);
  EXPECT_EQ(read_pinned(rig, p.snap, p.id, kOddVersions), p.data);
  EXPECT_EQ(rig.store->rewrite_cost(p.snap)[Tier::kCpu], rig.store->padded_bytes(p.id));
  EXPECT_EQ(rig.store->version_usage().held[Tier::kCpu], 0u);
  rig.store->unpin(p.snap);
  rig.write(p.id, Tier::kCpu, b);
  EXPECT_EQ(rig.read(p.id, Tier::kCpu, kOddVersions), b);
}

// A full swap space refuses the new slot: the write fails, both versions stay as they were.
TEST(PinnedVersions, NewSlotOverCapacityRefused) {
  st::RigOptions o;
  o.nvme_capacity = 256 << 10;  // one block's slot
  st::StoreRig rig(o);
  const PinnedBlock p = pin_one(rig, Tier::kNvme, 21);
  auto b = st::random_bytes(kOddVersions, 22);
  st::expect_error(ErrorCode::kBudget, "snapshot",
                   [&] { rewrite(rig, p.id, Tier::kNvme, Rewrite::kStreamWrite, b); });
  EXPECT_EQ(rig.read(p.id, Tier::kCpu, kOddVersions), p.data);
  EXPECT_EQ(read_pinned(rig, p.snap, p.id, kOddVersions), p.data);
  EXPECT_TRUE(rig.store->failure().empty());
  rig.store->unpin(p.snap);
}

// I/O faults: a failed rewrite of a pinned NVMe block, a failed and a corrupted read of the pinned
// version: each reported; the pinned version reads back unchanged afterwards.
TEST(PinnedVersions, IoFaultsLeavePinnedVersionIntact) {
  st::StoreRig rig;
  const PinnedBlock p = pin_one(rig, Tier::kNvme, 31);
  // Failed and corrupted reads of the pinned version (still the committed one, then a new one).
  for (int round = 0; round < 2; ++round) {
    rig.fault->add_fault(IoFault::fail_nth(1, EIO, IoOp::kRead));
    st::expect_error<IoError>(ErrorCode::kIo, "",
                              [&] { read_pinned(rig, p.snap, p.id, kOddVersions); });
    rig.fault->clear_faults();
    rig.fault->add_fault(IoFault::corrupt_nth_read(1));
    st::expect_error(ErrorCode::kChecksum, "buffer 'opt.0'",
                     [&] { read_pinned(rig, p.snap, p.id, kOddVersions); });
    rig.fault->clear_faults();
    EXPECT_EQ(read_pinned(rig, p.snap, p.id, kOddVersions), p.data);
    EXPECT_TRUE(rig.store->failure().empty());
    if (round == 1) break;
    auto fresh = st::random_bytes(kOddVersions, 33);
    rewrite(rig, p.id, Tier::kNvme, Rewrite::kStreamWrite, fresh);
    EXPECT_EQ(rig.read(p.id, Tier::kCpu, kOddVersions),
              fresh);  // the committed version, untouched too
  }
  // A failed rewrite of the block (its write to the new slot).
  rig.fault->add_fault(IoFault::fail_nth(2, EIO, IoOp::kWrite));
  auto b = st::random_bytes(kOddVersions, 32);
  st::expect_error<IoError>(ErrorCode::kIo, st::errno_text(EIO),
                            [&] { rewrite(rig, p.id, Tier::kNvme, Rewrite::kStreamWrite, b); });
  rig.fault->clear_faults();
  EXPECT_FALSE(rig.store->failure().empty());  // the block lost its committed contents...
  EXPECT_EQ(read_pinned(rig, p.snap, p.id, kOddVersions), p.data);  // ... not its pinned version
  rig.store->unpin(p.snap);
  EXPECT_EQ(rig.store->version_usage().held[Tier::kNvme], 0u);
}

// A device fault during the copy-on-write of a gpu block fails the change with nothing changed;
// the retry preserves the version and applies the change.
TEST(PinnedVersions, DeviceFaultDuringCopyChangesNothing) {
  st::RigOptions o;
  o.fault_device = true;
  st::StoreRig rig(o);
  const PinnedBlock p = pin_one(rig, Tier::kGpu, 41);
  auto b = st::random_bytes(kOddVersions, 42);
  rig.fdev->add_fault({DeviceFaultKind::kCopyFail, 1, 1});
  IoBuffer src = IoBuffer::allocate(rig.store->padded_bytes(p.id), HugePageMode::kNone);
  std::memcpy(src.data(), b.data(), b.size());
  st::expect_error(ErrorCode::kDevice, "",
                   [&] { rig.store->write(p.id, 0, 0, src.data()).wait(); });
  rig.fdev->clear_faults();
  EXPECT_EQ(rig.store->version_usage().held[Tier::kGpu], 0u);
  EXPECT_EQ(rig.store->rewrite_cost(p.snap)[Tier::kGpu], rig.store->padded_bytes(p.id));
  EXPECT_EQ(rig.read(p.id, Tier::kCpu, kOddVersions), p.data);
  EXPECT_EQ(read_pinned(rig, p.snap, p.id, kOddVersions), p.data);
  rig.store->write(p.id, 0, 0, src.data()).wait();
  EXPECT_EQ(read_pinned(rig, p.snap, p.id, kOddVersions), p.data);
  EXPECT_EQ(rig.read(p.id, Tier::kCpu, kOddVersions), b);
  rig.store->unpin(p.snap);
}

TEST(PinnedVersions, Refusals) {
  st::StoreRig rig;
  const BufferId id = add(rig, "opt.0", Tier::kCpu, st::random_bytes(kOddVersions, 51));
  rig.store->acquire(id, Tier::kCpu, Access::kWrite);
  const BufferId ids[] = {id};
  st::expect_error(ErrorCode::kInvalidArgument, "acquired for writing",
                   [&] { rig.store->pin_committed(ids); });
  rig.store->release(id, Tier::kCpu);
  const BufferId twice[] = {id, id};
  st::expect_error(ErrorCode::kInvalidArgument, "named twice",
                   [&] { rig.store->pin_committed(twice); });
  const SnapshotId s = rig.store->pin_committed(ids);
  st::expect_error(ErrorCode::kInvalidArgument, "snapshot",
                   [&] { rig.store->unregister_buffer(id); });
  const BufferId other = add(rig, "opt.1", Tier::kCpu, st::random_bytes(100, 52));
  std::vector<std::uint8_t> out(100);
  st::expect_error(ErrorCode::kInvalidArgument, "does not pin buffer 'opt.1'",
                   [&] { rig.store->read_pinned(s, other, 0, 0, out.data()); });
  st::expect_error(ErrorCode::kInvalidArgument, "of the pinned version of 'opt.0'",
                   [&] { rig.store->read_pinned(s, id, kOddVersions, 1, out.data()); });
  rig.store->unpin(s, id);
  st::expect_error(ErrorCode::kInvalidArgument, "does not pin",
                   [&] { rig.store->read_pinned(s, id, 0, 0, out.data()); });
  rig.store->unpin(s);
  st::expect_error(ErrorCode::kInvalidArgument, "no snapshot", [&] { rig.store->unpin(s); });
  rig.store->unregister_buffer(id);
}

// A block held for reading for a long time (the engine's flat parameters, Engine::param) and
// written in between by acquires that end: once the writer released saying its access, the block
// can be pinned, and the next write preserves the pinned version. A writer still holding it keeps
// the pin refused; one whose release does not say it wrote, until the last holder lets go.
TEST(PinnedVersions, AWritersReleaseEndsItsWriteWhileAReaderHoldsTheBlock) {
  st::StoreRig rig;
  const auto data = st::random_bytes(kOddVersions, 53);
  const BufferId id = add(rig, "params", Tier::kCpu, data);
  rig.store->acquire(id, Tier::kCpu, Access::kRead);  // held throughout
  const BufferId ids[] = {id};
  rig.store->acquire(id, Tier::kCpu, Access::kWrite);
  st::expect_error(ErrorCode::kInvalidArgument, "acquired for writing",
                   [&] { rig.store->pin_committed(ids); });
  rig.store->release(id, Tier::kCpu, Access::kWrite);
  const SnapshotId s = rig.store->pin_committed(ids);
  auto* p = static_cast<std::uint8_t*>(rig.store->acquire(id, Tier::kCpu, Access::kWrite));
  p[0] ^= 0xFF;
  rig.store->release(id, Tier::kCpu, Access::kWrite);
  EXPECT_EQ(read_pinned(rig, s, id, kOddVersions), data);
  rig.store->unpin(s);
  rig.store->acquire(id, Tier::kCpu, Access::kWrite);
  rig.store->release(id, Tier::kCpu);  // not said: the write lasts while the reader holds on
  st::expect_error(ErrorCode::kInvalidArgument, "acquired for writing",
                   [&] { rig.store->pin_committed(ids); });
  rig.store->release(id, Tier::kCpu);
  rig.store->unpin(rig.store->pin_committed(ids));
  rig.store->unregister_buffer(id);
}

// A reader of the pinned versions runs while another thread rewrites the blocks over and over:
// every read is the pinned data (TSan: the copy-on-write against the reads).
TEST(PinnedVersions, ConcurrentReaderAndWriter) {
  st::StoreRig rig;
  std::vector<std::vector<std::uint8_t>> old;
  const std::vector<BufferId> ids = add_one_per_home(rig, 60, old);
  const SnapshotId s = rig.store->pin_committed(ids);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    IoBuffer src = IoBuffer::allocate(rig.store->padded_bytes(ids[0]), HugePageMode::kNone);
    for (int round = 0; !stop && round < 50; ++round) {
      for (BufferId id : ids) {
        std::memset(src.data(), round, kOddVersions);
        rig.store->write(id, 0, 0, src.data()).wait();
      }
    }
  });
  for (int i = 0; i < 6; ++i)
    for (std::size_t k = 0; k < 3; ++k)
      EXPECT_EQ(read_pinned(rig, s, ids[k], kOddVersions), old[k]);
  stop = true;
  writer.join();
  rig.store->unpin(s);
}

// ---- pending versions (the speculative update's half)

namespace {

// Writes `data` (whole) into the pending version of `id` from 4096-aligned host memory.
Transfer write_pending(st::StoreRig& rig, BufferId id, const std::vector<std::uint8_t>& data,
                       std::uint64_t at = 0, std::uint64_t n = 0) {
  static thread_local IoBuffer src;
  src = IoBuffer::allocate(rig.store->padded_bytes(id), HugePageMode::kNone);
  std::memcpy(src.data(), data.data() + at, n ? n : data.size());
  return rig.store->write_pending(id, at, n, src.data());
}

std::uint64_t pending_held(st::StoreRig& rig, Tier t) {
  return rig.store->version_usage().pending[t];
}

class PendingVersion : public ::testing::TestWithParam<Tier> {};

std::string home_name(const ::testing::TestParamInfo<Tier>& i) { return tier_name(i.param); }

// A pending version is written beside the committed one, never read before commit; commit makes
// it the contents (its storage counted in the home tier until then), discard drops it.
TEST_P(PendingVersion, CommitReplacesDiscardKeeps) {
  const Tier home = GetParam();
  st::StoreRig rig;
  const auto [a, b, id] = two_versions(rig, home, 71);
  const BufferId ids[] = {id};
  for (const bool keep : {false, true}) {
    rig.store->open_pending(ids);
    EXPECT_TRUE(rig.store->has_pending(id));
    EXPECT_GE(pending_held(rig, home), rig.store->padded_bytes(id));
    write_pending(rig, id, b).wait();
    EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), a);  // the committed version, untouched
    if (keep) {
      rig.store->commit(ids);
    } else {
      rig.store->discard(ids);
    }
    EXPECT_FALSE(rig.store->has_pending(id));
    EXPECT_EQ(pending_held(rig, home), 0u);
    EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), keep ? b : a);
  }
  EXPECT_EQ(rig.store->version_usage().pending_blocks, 0u);
  EXPECT_TRUE(rig.store->failure().empty());
}

// Memory homes: a pending version written in ranges commits those ranges only (nvme pending
// versions are written whole: PendingVersions.Refusals).
TEST(PendingVersions, RangesCommitOnlyWhatWasWritten) {
  for (const Tier home : {Tier::kGpu, Tier::kCpu}) {
    SCOPED_TRACE(tier_name(home));
    st::StoreRig rig;
    const auto [a, b, id] = two_versions(rig, home, 73);
    const BufferId ids[] = {id};
    rig.store->open_pending(ids);
    write_pending(rig, id, b, 1000, 5000).wait();
    write_pending(rig, id, b, 90000, 7).wait();
    rig.store->commit(ids);
    auto want = a;
    std::memcpy(want.data() + 1000, b.data() + 1000, 5000);
    std::memcpy(want.data() + 90000, b.data() + 90000, 7);
    EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), want);
  }
}

// A snapshot pinned while a pending version exists keeps the old contents after the commit (nvme:
// the old slot, no copy); the committed version is the new one; unpin frees the old one.
TEST_P(PendingVersion, ComposesWithAPin) {
  const Tier home = GetParam();
  st::StoreRig rig;
  const auto [a, b, id] = two_versions(rig, home, 75);
  const BufferId ids[] = {id};
  rig.store->open_pending(ids);
  write_pending(rig, id, b).wait();
  const SnapshotId s = rig.store->pin_committed(ids);
  rig.store->commit(ids);
  EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), b);
  EXPECT_EQ(read_pinned(rig, s, id, kOddVersions), a);
  EXPECT_GE(rig.store->version_usage().held[home], rig.store->padded_bytes(id));
  rig.store->unpin(s);
  EXPECT_EQ(rig.store->version_usage().held[home], 0u);
  EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), b);
}

INSTANTIATE_TEST_SUITE_P(EveryTier, PendingVersion,
                         ::testing::Values(Tier::kGpu, Tier::kCpu, Tier::kNvme), home_name);

}  // namespace

// A failed write of a pending version (I/O error, corrupted data is caught at the read after the
// commit) leaves the committed version and the store usable; commit is refused, discard works.
TEST(PendingVersions, FailedWriteLeavesCommittedUntouched) {
  st::StoreRig rig;
  const auto [a, b, id] = two_versions(rig, Tier::kNvme, 81);
  const BufferId ids[] = {id};
  rig.store->open_pending(ids);
  rig.fault->add_fault(IoFault::fail_nth(2, EIO, IoOp::kWrite));
  st::expect_error<IoError>(ErrorCode::kIo, st::errno_text(EIO),
                            [&] { write_pending(rig, id, b).wait(); });
  rig.fault->clear_faults();
  EXPECT_TRUE(rig.store->failure().empty());
  EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), a);
  st::expect_error(ErrorCode::kInvalidArgument, "whose write failed",
                   [&] { rig.store->commit(ids); });
  EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), a);
  rig.store->discard(ids);
  EXPECT_EQ(pending_held(rig, Tier::kNvme), 0u);
  rig.store->open_pending(ids);
  write_pending(rig, id, b).wait();
  rig.store->commit(ids);
  EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), b);
}

// A device fault while a gpu block's pending version is written: the same.
TEST(PendingVersions, DeviceFaultLeavesCommittedUntouched) {
  st::RigOptions o;
  o.fault_device = true;
  st::StoreRig rig(o);
  const auto [a, b, id] = two_versions(rig, Tier::kGpu, 83);
  const BufferId ids[] = {id};
  rig.store->open_pending(ids);
  rig.fdev->add_fault({DeviceFaultKind::kCopyFail, 1, 1});
  st::expect_error(ErrorCode::kDevice, "", [&] { write_pending(rig, id, b).wait(); });
  rig.fdev->clear_faults();
  EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), a);
  st::expect_error(ErrorCode::kInvalidArgument, "whose write failed",
                   [&] { rig.store->commit(ids); });
  rig.store->discard(ids);
  EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), a);
  EXPECT_TRUE(rig.store->failure().empty());
}

// Budgets: a pending copy that does not fit the host budget, or a slot the swap space cannot hold,
// is refused with nothing opened (all or none over the ids).
TEST(PendingVersions, OverBudgetRefusedNothingOpened) {
  st::RigOptions o;
  o.host_budget = (256 << 10) + 4 * (64 << 10) + (64 << 10);  // the pool and one block
  o.nvme_capacity = 256 << 10;                                // one block's slot
  st::StoreRig rig(o);
  const BufferId cpu = add(rig, "opt.0", Tier::kCpu, st::random_bytes(kOddVersions, 85));
  const BufferId nvme = add(rig, "opt.1", Tier::kNvme, st::random_bytes(kOddVersions, 86));
  for (BufferId id : {cpu, nvme}) {
    const BufferId ids[] = {id};
    st::expect_error(ErrorCode::kBudget, "", [&] { rig.store->open_pending(ids); });
    EXPECT_FALSE(rig.store->has_pending(id));
  }
  EXPECT_EQ(rig.store->version_usage().pending_blocks, 0u);
  for (Tier t : {Tier::kCpu, Tier::kNvme}) EXPECT_EQ(pending_held(rig, t), 0u);
}

TEST(PendingVersions, Refusals) {
  st::StoreRig rig;
  const BufferId id = add(rig, "opt.0", Tier::kNvme, st::random_bytes(kOddVersions, 87));
  const BufferId ids[] = {id};
  std::vector<std::uint8_t> b = st::random_bytes(kOddVersions, 88);
  st::expect_error(ErrorCode::kInvalidArgument, "no pending version",
                   [&] { write_pending(rig, id, b); });
  st::expect_error(ErrorCode::kInvalidArgument, "no pending version",
                   [&] { rig.store->commit(ids); });
  rig.store->open_pending(ids);
  st::expect_error(ErrorCode::kInvalidArgument, "already has",
                   [&] { rig.store->open_pending(ids); });
  st::expect_error(ErrorCode::kInvalidArgument, "never written", [&] { rig.store->commit(ids); });
  st::expect_error(ErrorCode::kInvalidArgument, "written whole",
                   [&] { write_pending(rig, id, b, 0, 4096); });
  rig.store->discard(ids);
  rig.store->discard(ids);  // nothing left: a no-op
  EXPECT_EQ(rig.store->version_usage().pending_blocks, 0u);
}

// The one loop with the version selector: the update reads committed and writes pending; the
// committed contents stay until the commit.
TEST(PendingVersions, StreamWritesThePendingVersion) {
  st::RigOptions o;
  o.pool_buffer_size = 256 << 10;  // one block per slot
  st::StoreRig rig(o);
  std::vector<std::vector<std::uint8_t>> old;
  const std::vector<BufferId> ids = add_one_per_home(rig, 90, old);
  rig.store->open_pending(ids);
  std::vector<tier::StreamItem> items;
  for (BufferId id : ids) items.push_back({{{id, 0, 0, true, true, true}}});
  tier::StreamOptions so;
  so.window = 2;
  tier::run_stream(
      *rig.store, items,
      [](std::size_t, std::span<void* const> v) {
        auto* p = static_cast<std::uint8_t*>(v[0]);
        for (std::uint64_t i = 0; i < kOddVersions; ++i)
          p[i] = static_cast<std::uint8_t>(p[i] ^ 0x5a);
      },
      so);
  for (std::size_t k = 0; k < 3; ++k) EXPECT_EQ(rig.read(ids[k], Tier::kCpu, kOddVersions), old[k]);
  rig.store->commit(ids);
  for (std::size_t k = 0; k < 3; ++k) {
    auto want = old[k];
    for (auto& x : want) x = static_cast<std::uint8_t>(x ^ 0x5a);
    EXPECT_EQ(rig.read(ids[k], Tier::kCpu, kOddVersions), want);
  }
}

// With out_views the compute reads the committed copy in place and writes the pending version's
// memory directly (memory homes; nvme stays staged): nothing is staged or copied, the commit swaps
// the buffers and keeps the old one as the spare the next pending version reuses.
TEST(PendingVersions, OutViewsUpdateOutOfPlaceAndCommitBySwap) {
  st::RigOptions o;
  o.pool_buffer_size = 256 << 10;
  st::StoreRig rig(o);
  std::vector<std::vector<std::uint8_t>> now;
  const std::vector<BufferId> ids = add_one_per_home(rig, 95, now);
  std::vector<tier::StreamItem> items;
  for (BufferId id : ids) items.push_back({{{id, 0, 0, true, true, true}}});
  tier::StreamOptions so;
  so.out_views = true;
  const std::uint64_t padded = rig.store->padded_bytes(ids[1]);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    rig.store->open_pending(ids);
    EXPECT_EQ(rig.store->version_usage().spare[Tier::kCpu], 0u) << "the spare is reused";
    const auto s = tier::run_stream(
        *rig.store, items,
        [&](std::size_t i, std::span<void* const> v) {
          ASSERT_EQ(v.size(), 2u);
          EXPECT_EQ(v[0] != v[1], kOneHomeEach[i] != Tier::kNvme) << tier_name(kOneHomeEach[i]);
          const auto* in = static_cast<const std::uint8_t*>(v[0]);
          auto* out = static_cast<std::uint8_t*>(v[1]);
          for (std::uint64_t j = 0; j < kOddVersions; ++j)
            out[j] = static_cast<std::uint8_t>(in[j] + 1 + round);
        },
        so);
    EXPECT_EQ(s.bytes_in, kOddVersions) << "only the nvme block is staged";
    for (std::size_t k = 0; k < 3; ++k)
      EXPECT_EQ(rig.read(ids[k], Tier::kCpu, kOddVersions), now[k]);
    rig.store->commit(ids);
    for (std::size_t k = 0; k < 3; ++k) {
      for (auto& x : now[k]) x = static_cast<std::uint8_t>(x + 1 + round);
      EXPECT_EQ(rig.read(ids[k], Tier::kCpu, kOddVersions), now[k]) << tier_name(kOneHomeEach[k]);
    }
    const VersionUsage u = rig.store->version_usage();
    EXPECT_EQ(u.spare[Tier::kCpu], padded);
    EXPECT_EQ(u.spare[Tier::kGpu], padded);
    EXPECT_EQ(u.pending[Tier::kCpu] + u.pending[Tier::kGpu] + u.pending[Tier::kNvme], 0u);
  }
}

// A spare is memory held for the next pending version, never a reason to refuse: a copy that
// needs the room gets it (the spare is freed). (The pinned budget frees page-locked spares the same
// way: drop_locked_spares_locked, not exercised here.)
TEST(PendingVersions, SparesGiveWayToCopies) {
  st::RigOptions o;
  const std::uint64_t block = (kOddVersions + 4095) / 4096 * 4096;  // padded
  const std::uint64_t pool = 4 * (64 << 10);
  o.host_budget = pool + 3 * block;  // two blocks and a spare
  st::StoreRig rig(o);
  const auto [a, b, id] = two_versions(rig, Tier::kCpu, 101);
  const BufferId ids[] = {id};
  rig.store->open_pending(ids);
  write_pending(rig, id, b).wait();
  rig.store->commit(ids);
  ASSERT_EQ(rig.store->version_usage().spare[Tier::kCpu], block);
  const BufferId other = add(rig, "opt.1", Tier::kCpu, a);  // fits beside the spare
  EXPECT_EQ(rig.store->version_usage().spare[Tier::kCpu], block);
  const BufferId third = add(rig, "opt.2", Tier::kCpu, a);  // only without it
  EXPECT_EQ(rig.store->version_usage().spare[Tier::kCpu], 0u);
  EXPECT_EQ(rig.read(third, Tier::kCpu, kOddVersions), a);
  EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), b);
  EXPECT_EQ(rig.read(other, Tier::kCpu, kOddVersions), a);
}

// The commit copies instead of swapping when the block is acquired (a view of the home copy must
// stay valid) or written in part; pending_view is refused for nvme and without a pending version.
TEST(PendingVersions, CommitCopiesWhenTheHomeCopyIsHeld) {
  st::StoreRig rig;
  const auto [a, b, id] = two_versions(rig, Tier::kCpu, 97);
  const BufferId ids[] = {id};
  st::expect_error(ErrorCode::kInvalidArgument, "has no pending version",
                   [&] { rig.store->pending_view(id); });
  rig.store->open_pending(ids);
  std::memcpy(rig.store->pending_view(id), b.data(), b.size());
  rig.store->write_pending(id, 0, 0, rig.store->pending_view(id)).wait();
  auto* view = static_cast<std::uint8_t*>(rig.store->acquire(id, Tier::kCpu, Access::kRead));
  rig.store->commit(ids);
  EXPECT_EQ(std::vector<std::uint8_t>(view, view + kOddVersions), b) << "the held view";
  rig.store->release(id, Tier::kCpu);
  EXPECT_EQ(rig.read(id, Tier::kCpu, kOddVersions), b);
  const BufferId nv = add(rig, "opt.1", Tier::kNvme, st::random_bytes(kOddVersions, 99));
  const BufferId nids[] = {nv};
  rig.store->open_pending(nids);
  st::expect_error(ErrorCode::kInvalidArgument, "lives on nvme",
                   [&] { rig.store->pending_view(nv); });
  rig.store->discard(nids);
}

// Pieces larger than a check unit (4 MiB pieces, 1 MiB units): a range of a pinned version in
// another slot reads back exactly, wherever it starts and ends (inside a unit, on a unit's edge,
// across units and pieces, up to the block's odd end).
TEST(PinnedVersions, RangesOfAVersionReadOnlyTheirUnits) {
  st::RigOptions o;
  o.pool_buffer_size = 4 << 20;
  o.nvme_capacity = 64 << 20;
  st::StoreRig rig(o);
  const std::uint64_t n = (5 << 20) + 4321;  // two pieces, the second partial
  const auto a = st::random_bytes(n, 61);
  const BufferId id = add(rig, "opt.big", Tier::kNvme, a);
  const BufferId ids[] = {id};
  const SnapshotId s = rig.store->pin_committed(ids);
  auto b = st::random_bytes(n, 62);
  rewrite(rig, id, Tier::kNvme, Rewrite::kStreamWrite, b);  // the pinned version moves out
  const std::uint64_t mib = 1 << 20;
  const std::pair<std::uint64_t, std::uint64_t> ranges[] = {
      {100, 300000}, {mib, mib}, {mib - 7, 2 * mib + 14}, {3 * mib + 5, 2 * mib}, {n - 9, 9}};
  for (const auto& [at, len] : ranges)
    EXPECT_EQ(read_pinned(rig, s, id, len, Tier::kCpu, at), slice(a, at, len)) << at << "+" << len;
  EXPECT_EQ(rig.read(id, Tier::kCpu, n), b);
  rig.store->unpin(s);
}
