#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <thread>

#include "io/engine_base.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"
#include "tier/swap_space.hpp"
#include "tier/tier_store.hpp"
#include "tier_test_util.hpp"

using namespace strata;
using namespace std::chrono_literals;
namespace st = strata::testing;

namespace {
constexpr std::uint64_t kOdd = (200 << 10) + 13;  // 4 pieces of 64 KiB, the last one partial
const std::vector<std::uint8_t> kZeros(kOdd, 0);
}  // namespace

TEST(TierStore, RegistersZeroFilledCopiesInEveryHomeTier) {
  st::StoreRig rig;
  for (Tier home : {Tier::kGpu, Tier::kCpu, Tier::kNvme}) {
    auto id = rig.store->register_buffer(
        {std::string("z-") + tier_name(home), kOdd, DType::kFp32, home, {}});
    auto i = rig.store->info(id);
    EXPECT_TRUE(i.valid[int(home)]);
    EXPECT_EQ(i.bytes, kOdd);
    EXPECT_EQ(rig.read(id, Tier::kCpu, kOdd), kZeros) << tier_name(home);
    EXPECT_EQ(rig.read(id, Tier::kGpu, kOdd), kZeros) << tier_name(home);
  }
  EXPECT_EQ(rig.engine->stats().bytes_read, 0u);  // the zero NVMe copy needs no I/O
  EXPECT_THROW(rig.store->register_buffer({"z-cpu", 10, DType::kFp32, Tier::kCpu, {}}), Error);
  EXPECT_THROW(rig.store->register_buffer({"empty", 0, DType::kFp32, Tier::kCpu, {}}), Error);
  EXPECT_THROW(rig.store->register_buffer({"bad", 10, DType::kFp32, Tier::kGpu, {Tier::kCpu}}),
               Error);
  EXPECT_EQ(rig.store->find("z-nvme"), rig.store->find("z-nvme"));
  EXPECT_THROW(rig.store->find("nope"), Error);
}

TEST(TierStore, EveryPathPreservesBytes) {
  st::StoreRig rig;
  auto data = st::random_bytes(kOdd, 42);
  auto id = rig.add("master", Tier::kCpu, data);

  rig.store->move(id, Tier::kNvme).wait();  // cpu → nvme
  auto i = rig.store->info(id);
  EXPECT_TRUE(i.valid[int(Tier::kNvme)]);
  EXPECT_FALSE(i.allocated[int(Tier::kCpu)]);
  EXPECT_FALSE(i.dirty);
  rig.store->move(id, Tier::kGpu).wait();  // nvme → gpu through the pinned pool
  EXPECT_EQ(rig.read(id, Tier::kGpu, kOdd), data);
  EXPECT_TRUE(rig.store->info(id).valid[int(Tier::kNvme)]);  // the clean copy stays

  data = st::random_bytes(kOdd, 43);
  rig.write(id, Tier::kGpu, data);  // the NVMe copy is stale now
  i = rig.store->info(id);
  EXPECT_FALSE(i.valid[int(Tier::kNvme)]);
  EXPECT_TRUE(i.dirty);
  rig.store->move(id, Tier::kNvme).wait();  // gpu → nvme through the pinned pool
  EXPECT_FALSE(rig.store->info(id).allocated[int(Tier::kGpu)]);
  rig.store->move(id, Tier::kCpu).wait();  // nvme → cpu
  EXPECT_EQ(rig.read(id, Tier::kCpu, kOdd), data);
  rig.store->prefetch(id, Tier::kGpu).wait();  // cpu → gpu, keeps cpu
  i = rig.store->info(id);
  EXPECT_TRUE(i.valid[int(Tier::kGpu)] && i.valid[int(Tier::kCpu)] && i.valid[int(Tier::kNvme)]);
  EXPECT_EQ(rig.read(id, Tier::kGpu, kOdd), data);
  rig.store->evict(id, Tier::kCpu).wait();
  rig.store->move(id, Tier::kCpu).wait();  // gpu → cpu
  EXPECT_EQ(rig.read(id, Tier::kCpu, kOdd), data);
  auto s = rig.store->stats();
  EXPECT_GT(s.bytes_to_nvme, 0u);
  EXPECT_GT(s.bytes_from_nvme, 0u);
  EXPECT_EQ(s.checksum_failures, 0u);
}

TEST(TierStore, CleanCopyIsNotWrittenAgain) {
  st::StoreRig rig;
  auto id = rig.store->register_buffer({"m1", kOdd, DType::kFp32, Tier::kCpu, {}});
  rig.write(id, Tier::kCpu, st::random_bytes(kOdd, 1));
  rig.store->evict(id, Tier::kCpu).wait();  // only copy: written down to NVMe
  const auto written = rig.engine->stats().bytes_written;
  EXPECT_GE(written, kOdd);
  rig.store->prefetch(id, Tier::kCpu).wait();
  rig.read(id, Tier::kCpu, kOdd);           // a read access does not dirty it
  rig.store->evict(id, Tier::kCpu).wait();  // clean: nothing written
  rig.store->prefetch(id, Tier::kGpu).wait();
  rig.store->move(id, Tier::kNvme).wait();  // clean again
  EXPECT_EQ(rig.engine->stats().bytes_written, written);
  EXPECT_GE(rig.store->stats().writes_skipped_clean, 2u);
}

TEST(TierStore, AcquireWaitsForTheMoveInFlight) {
  st::StoreRig rig;
  auto data = st::random_bytes(kOdd, 7);
  auto id = rig.add("m", Tier::kCpu, data);
  // Slow every NVMe read: the acquire below must wait behind the move, not see a partial copy.
  rig.fault->add_fault([] {
    IoFault f;
    f.kind = IoFaultKind::kDelay;
    f.op = IoOp::kRead;
    f.nth = 1;
    f.count = 0;
    f.delay = 30ms;
    return f;
  }());
  rig.store->move(id, Tier::kNvme);
  auto t = rig.store->move(id, Tier::kGpu);
  EXPECT_TRUE(rig.store->info(id).in_flight);
  EXPECT_EQ(rig.read(id, Tier::kGpu, kOdd), data);
  EXPECT_TRUE(t.ready());
}

TEST(TierStore, BudgetsAreEnforced) {
  st::RigOptions o;
  o.gpu_budget = 300 << 10;
  o.host_budget = (256 << 10) + (300 << 10);  // the pool (256 KiB) counts
  o.nvme_capacity = 512 << 10;
  st::StoreRig rig(o);
  auto a = rig.store->register_buffer({"a", kOdd, DType::kFp32, Tier::kCpu, {}});
  auto b = rig.store->register_buffer({"b", kOdd, DType::kFp32, Tier::kNvme, {}});
  auto data = st::random_bytes(kOdd, 3);
  rig.write(a, Tier::kCpu, data);
  try {  // the host tier has room for one
    rig.store->prefetch(b, Tier::kCpu).wait();
    FAIL() << "expected kBudget";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBudget) << e.what();
    EXPECT_NE(std::string(e.what()).find("'b'"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(rig.store->info(b).allocated[int(Tier::kCpu)]);
  rig.store->move(a, Tier::kGpu).wait();
  EXPECT_EQ(rig.store->usage(Tier::kCpu).used, 256u << 10);
  st::expect_error(ErrorCode::kBudget, "", [&] { rig.store->prefetch(b, Tier::kGpu).wait(); });
  EXPECT_EQ(rig.read(a, Tier::kGpu, kOdd), data);
  EXPECT_LE(rig.store->usage(Tier::kGpu).used, o.gpu_budget);
  // NVMe: 512 KiB hold two of these; a third does not fit.
  rig.store->move(a, Tier::kNvme).wait();
  st::expect_error(ErrorCode::kBudget, "", [&] {
    rig.store->register_buffer({"c", kOdd, DType::kFp32, Tier::kNvme, {}});
  });
  st::expect_error(ErrorCode::kBudget, "", [&] {
    rig.store->register_buffer({"huge", 1 << 20, DType::kFp32, Tier::kCpu, {}});
  });
  EXPECT_EQ(rig.read(a, Tier::kCpu, kOdd), data);
}

TEST(TierStore, PinnedCopiesAreProtected) {
  st::StoreRig rig;
  auto data = st::random_bytes(kOdd, 9);
  auto id = rig.add("p", Tier::kCpu, data);
  rig.store->acquire(id, Tier::kCpu, Access::kRead);
  EXPECT_THROW(rig.store->evict(id, Tier::kCpu).wait(), Error);
  EXPECT_THROW(rig.store->move(id, Tier::kGpu).wait(), Error);
  rig.store->prefetch(id, Tier::kGpu).wait();  // copying from a read-pinned copy is fine
  EXPECT_THROW(rig.store->acquire(id, Tier::kGpu, Access::kWrite), Error);
  EXPECT_THROW(rig.store->unregister_buffer(id), Error);
  rig.store->release(id, Tier::kCpu);
  EXPECT_THROW(rig.store->release(id, Tier::kCpu), Error);
  // A writer blocks copies out of its tier until released.
  rig.store->acquire(id, Tier::kCpu, Access::kWrite);
  EXPECT_FALSE(rig.store->info(id).valid[int(Tier::kGpu)]);
  EXPECT_THROW(rig.store->prefetch(id, Tier::kNvme).wait(), Error);
  rig.store->release(id, Tier::kCpu);
  rig.store->prefetch(id, Tier::kNvme).wait();
  EXPECT_THROW(rig.store->acquire(id, Tier::kNvme, Access::kRead), Error);
  // An NVMe-only buffer cannot be evicted from NVMe; a gpu-less buffer cannot go to the GPU.
  auto n =
      rig.store->register_buffer({"n", 5000, DType::kFp16, Tier::kNvme, {Tier::kNvme, Tier::kCpu}});
  EXPECT_THROW(rig.store->evict(n, Tier::kNvme).wait(), Error);
  EXPECT_THROW(rig.store->move(n, Tier::kGpu), Error);
  rig.store->unregister_buffer(n);
  rig.store->unregister_buffer(id);
  EXPECT_EQ(rig.store->usage(Tier::kNvme).used, 0u);
}

// Holders of pool buffers (the stream loop's slots, the filler) never starve the store: with every
// pool buffer taken, a GPU -> NVMe move goes through bounce buffers counted against the host
// budget; when they do not fit, it fails with kBudget and keeps the source.
TEST(TierStore, AHeldPoolDoesNotStarveTheStore) {
  st::RigOptions o;
  o.timeout = 2000ms;
  o.host_budget = (4 << 16) + (64 << 10);  // the pool + one bounce buffer
  st::StoreRig rig(o);
  auto data = st::random_bytes(kOdd, 11);
  auto id = rig.add("g", Tier::kGpu, data);
  std::vector<PinnedBuffer> hog;
  for (std::uint32_t i = 0; i < rig.pool->buffer_count(); ++i) hog.push_back(rig.pool->acquire(1s));
  rig.store->move(id, Tier::kNvme).wait(10s);
  EXPECT_EQ(rig.store->usage(Tier::kCpu).used, std::uint64_t(4) << 16);  // bounce buffers returned
  rig.store->move(id, Tier::kGpu).wait(10s);
  data = st::random_bytes(kOdd, 12);
  rig.write(id, Tier::kGpu, data);  // the NVMe copy is stale again
  // No room for a bounce buffer beside a host copy: kBudget, the source kept.
  auto h = rig.store->register_buffer({"h", 64 << 10, DType::kFp32, Tier::kCpu, {}});
  st::expect_error(ErrorCode::kBudget, "", [&] { rig.store->move(id, Tier::kNvme).wait(10s); });
  EXPECT_TRUE(rig.store->info(id).valid[int(Tier::kGpu)]);
  rig.store->unregister_buffer(h);
  hog.clear();
  rig.store->move(id, Tier::kNvme).wait(10s);
  rig.store->move(id, Tier::kGpu).wait(10s);
  EXPECT_EQ(rig.read(id, Tier::kGpu, kOdd), data);
}

TEST(TierStore, OptionsFromConfig) {
  Config c;
  c.world.ranks = 8;
  c.world.ranks_per_node = 4;
  c.tiers.nvme.budget = 4000;
  c.tiers.nvme.paths = {"/x", "/y"};
  c.tiers.gpu.budget = 123;
  auto o = TierStoreOptions::from(c, 2);
  EXPECT_EQ(o.nvme_capacity, 1000u);
  EXPECT_EQ(o.gpu_budget, 123u);
  EXPECT_EQ(o.rank, 2u);
  EXPECT_EQ(o.nvme_paths.size(), 2u);
  EXPECT_EQ(TierStoreOptions::from(c, 0, 777).nvme_capacity, 777u);
}

TEST(TierStore, FreedHostCopiesAreReusedWithinTheBudget) {
  st::RigOptions o;
  o.host_budget = (256 << 10) + 2 * (kOdd + 4096);
  st::StoreRig rig(o);
  auto a = rig.store->register_buffer({"a", kOdd, DType::kFp32, Tier::kCpu, {}});
  auto b = rig.store->register_buffer({"b", kOdd, DType::kFp32, Tier::kNvme, {}});
  auto c = rig.store->register_buffer({"c", 9000, DType::kFp32, Tier::kNvme, {}});
  auto data = st::random_bytes(kOdd, 21);
  rig.write(a, Tier::kCpu, data);
  rig.store->evict(a, Tier::kCpu).wait();
  auto u = rig.store->usage(Tier::kCpu);
  EXPECT_EQ(u.used, 256u << 10);
  EXPECT_GT(u.cached, kOdd);
  // b reuses a's old mapping: it must read as zeros, not as a's bytes.
  EXPECT_EQ(rig.read(b, Tier::kCpu, kOdd), kZeros);
  EXPECT_EQ(rig.store->usage(Tier::kCpu).cached, 0u);
  rig.write(b, Tier::kCpu, data);
  rig.store->move(b, Tier::kNvme).wait();  // cached again
  // c (another size) needs room: the cached mapping is unmapped to stay within the budget.
  rig.store->prefetch(a, Tier::kCpu).wait();
  rig.store->prefetch(c, Tier::kCpu).wait();
  u = rig.store->usage(Tier::kCpu);
  EXPECT_LE(u.used + u.cached, o.host_budget);
  EXPECT_EQ(rig.read(a, Tier::kCpu, kOdd), data);
  EXPECT_EQ(rig.read(b, Tier::kGpu, kOdd), data);
}

TEST(TierStore, DiscardAcquireLoadsNothingAndInlineOpsDoNotWaitForMovers) {
  st::StoreRig rig;
  auto id = rig.store->register_buffer({"grad", kOdd, DType::kFp16, Tier::kCpu, {}});
  auto data = st::random_bytes(kOdd, 31);
  rig.write(id, Tier::kCpu, data);
  rig.store->evict(id, Tier::kCpu).wait();
  const auto before = rig.engine->stats();
  auto fresh = st::random_bytes(kOdd, 32);
  auto* p = static_cast<std::uint8_t*>(rig.store->acquire(id, Tier::kCpu, Access::kDiscard));
  std::memcpy(p, fresh.data(), kOdd);
  rig.store->release(id, Tier::kCpu);
  EXPECT_EQ(rig.engine->stats().bytes_read, before.bytes_read);  // nothing was brought in
  EXPECT_TRUE(rig.store->info(id).dirty);
  rig.store->move(id, Tier::kNvme).wait();
  EXPECT_EQ(rig.read(id, Tier::kGpu, kOdd), fresh);
  // While a slow transfer of another buffer occupies the movers, a valid copy is acquired at once.
  st::RigOptions o;
  o.movers = 1;
  st::StoreRig one(o);
  auto slow = one.store->register_buffer({"slow", kOdd, DType::kFp32, Tier::kCpu, {}});
  auto fast = one.store->register_buffer({"fast", 4096, DType::kFp32, Tier::kCpu, {}});
  one.write(slow, Tier::kCpu, data);
  // The eviction's write cannot complete until the gate opens (its completion is held on the
  // engine's thread), so the one mover is busy for as long as the test needs, however the threads
  // are scheduled.
  std::atomic<bool> gate_closed{true};
  io::set_raw_result_hook([&](const io::Piece&, long r) -> long {
    while (gate_closed) std::this_thread::sleep_for(1ms);
    return r;
  });
  auto t = one.store->evict(slow, Tier::kCpu);
  auto inline_op = std::async(std::launch::async, [&] {
    one.store->acquire(fast, Tier::kCpu, Access::kRead);
    one.store->release(fast, Tier::kCpu);
  });
  // (A hang guard, not a timing check: an acquire that waited for the mover never returns.)
  const bool returned = inline_op.wait_for(60s) == std::future_status::ready;
  EXPECT_TRUE(returned) << "acquire of a valid copy waited for the busy mover";
  EXPECT_FALSE(t.ready());
  gate_closed = false;
  inline_op.get();
  t.wait();
  io::set_raw_result_hook(nullptr);
}

// pin_memory: host copies page-locked (mlock on the host device), counted against pinned_budget
// with the pool; over it, kBudget naming the buffer; dropping a copy unlocks it.
TEST(TierStore, PinnedHostCopiesCountAgainstThePinnedBudget) {
  st::StoreRig rig;
  TierStoreOptions so;
  so.host_budget = 64 << 20;
  so.pinned_budget = (4 << 16) + (200 << 10);  // the pool + 200 KiB
  TierStore store(so, *rig.device, nullptr, rig.pool.get());
  BufferSpec a{"a", 150 << 10, DType::kFp32, Tier::kCpu, {Tier::kCpu, Tier::kGpu}, true};
  const BufferId ida = store.register_buffer(a);
  BufferSpec b{"b", 100 << 10, DType::kFp32, Tier::kCpu, {}, true};
  st::expect_error(ErrorCode::kBudget, "'b'", [&] { store.register_buffer(b); });
  b.pinned = false;  // pageable: fits the host budget
  store.register_buffer(b);
  store.move(ida, Tier::kGpu).wait(10s);  // drops (and unlocks) a's host copy
  b.name = "c";
  b.pinned = true;
  store.register_buffer(b);  // now there is room
}
