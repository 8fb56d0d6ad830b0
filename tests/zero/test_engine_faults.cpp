// Faults at the one store: each rank's storage goes through its own fault-injecting wrapper
// (zero::EngineAccess::set_storage_wrap: a FaultInjectingDevice and a FaultInjectingIoEngine per
// rank). A refused budget at finalize() names the tier and the buffer; an I/O error (EIO, ENOSPC,
// a short read) at the step, a failed device copy, a flipped bit in a swap file each fail the call
// that observes them with an error naming the tier or buffer, the path and errno, and leave the
// engine failed (every later call: Error(kIo) "unusable after a failed call"); a failed gradient
// spill fails the backward; nothing is left in flight (the pool is whole again).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cstring>
#include <fstream>
#include <random>

#include "../comm/comm_test_util.hpp"
#include "device/pinned_pool.hpp"
#include "engine_basics.hpp"
#include "strata/device_fault.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "strata/io_fault.hpp"
#include "test_util.hpp"
#include "tier/swap_space.hpp"
#include "zero/engine_access.hpp"

namespace strata::testing {
namespace {

using zero::EngineAccess;

const std::vector<std::size_t> kSizes{3001, 7, 2120, 129};

Config fault_config(int stage, Tier opt, Tier grads, Tier params, const std::string& dir) {
  Config cfg = small_engine_config(stage, 1500, 2500, 5.0);
  cfg.offload.optimizer = {opt, 1.0, false};
  cfg.offload.gradients = {grads, 1.0, false};
  cfg.offload.params = {params, 1.0, false};
  use_test_swap(cfg, dir, 3, 16 << 10);
  return cfg;
}

// One rank's engine with its own wrappers; the raw pointers stay valid while the engine lives.
struct Rank {
  std::unique_ptr<Engine> e;
  FaultInjectingDevice* device = nullptr;
  FaultInjectingIoEngine* io = nullptr;

  Rank(const Config& cfg, Communicator& comm, bool finalize = true) {
    e = std::make_unique<Engine>(cfg, comm);
    zero::StorageWrap w;
    w.device = [this](std::unique_ptr<Device> d) {
      auto f = std::make_unique<FaultInjectingDevice>(std::move(d));
      device = f.get();
      return std::unique_ptr<Device>(std::move(f));
    };
    w.io = [this](std::unique_ptr<IoEngine> i) {
      auto f = std::make_unique<FaultInjectingIoEngine>(std::move(i));
      io = f.get();
      return std::unique_ptr<IoEngine>(std::move(f));
    };
    EngineAccess::set_storage_wrap(*e, std::move(w));
    for (std::size_t t = 0; t < kSizes.size(); ++t) {
      std::vector<float> init(kSizes[t], 0.25f + 0.01f * static_cast<float>(t));
      e->add_parameter(strata::strcat("t", t), init);
    }
    if (finalize) e->finalize();
  }
  void backward(int step) {
    for (std::size_t t = kSizes.size(); t-- > 0;) {
      std::mt19937 rng(static_cast<std::uint32_t>(step * 100 + t));
      std::normal_distribution<float> d(0, 1);
      std::vector<float> g(kSizes[t]);
      for (auto& x : g) x = d(rng);
      TensorId id = t;
      e->gather({&id, 1});
      e->set_gradient(id, g.data());
      e->release({&id, 1});
    }
  }
  // A failed engine takes no other step and saves no checkpoint.
  void expect_failed_for_good(CallSite where = CallSite::current()) {
    expect_error(
        ErrorCode::kIo, "unusable after a failed call",
        [&] {
          backward(99);
          e->step();
        },
        where);
    TempDir ckpt("strata-faults-ckpt");
    expect_error(
        ErrorCode::kIo, "", [&] { e->save_checkpoint(ckpt.str()); }, where);
  }
  void expect_pool_whole() {
    PinnedPool* p = EngineAccess::storage(*e).pool();
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p->available(), p->buffer_count()) << "a pinned buffer is still held";
  }
};

TEST(EngineFaults, BudgetsAreEnforcedAtFinalizeNamingTierAndBuffer) {
  TempDir dir("strata-faults");
  auto comms = make_inprocess_communicators(1, 5.0);
  struct Case {
    const char* name;
    Tier opt;
    std::function<void(Config&)> set;
    const char* tier;
  };
  const Case cases[] = {
      {"gpu", Tier::kGpu, [](Config& c) { c.tiers.gpu.budget = 40000; }, "gpu tier"},
      {"host", Tier::kCpu, [](Config& c) { c.tiers.host.budget = 60000; }, "cpu tier"},
      {"nvme", Tier::kNvme, [](Config& c) { c.tiers.nvme.budget = 50000; }, "nvme"},
      {"pinned", Tier::kNvme, [](Config& c) { c.tiers.host.pinned_budget = 20000; },
       "pinned_budget"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Config cfg = fault_config(1, c.opt, Tier::kGpu, Tier::kGpu, dir.str());
    c.set(cfg);
    expect_error(ErrorCode::kBudget, c.tier, [&] { Rank r(cfg, *comms[0]); });
  }
  // Within the budgets: nothing exceeds one.
  Config cfg = fault_config(3, Tier::kNvme, Tier::kCpu, Tier::kGpu, dir.str());
  Rank r(cfg, *comms[0]);
  for (int s = 0; s < 2; ++s) {
    r.backward(s);
    r.e->step();
  }
  const zero::StorageReport rep = EngineAccess::report(*r.e);
  for (int t = 0; t < 3; ++t)
    EXPECT_LE(rep.used[t], rep.budget[t]) << tier_name(static_cast<Tier>(t));
}

// The first device allocation is the ranks' agreement buffer, the second the 'params' buffer.
TEST(EngineFaults, AFailedDeviceAllocationNamesTheBuffer) {
  const std::pair<std::uint64_t, const char*> cases[] = {{1, "the ranks' agreement buffer"},
                                                         {2, "registering buffer 'params'"}};
  for (const auto& [nth, names] : cases) {
    SCOPED_TRACE(names);
    auto comms = make_inprocess_communicators(1, 5.0);
    Config cfg = fault_config(2, Tier::kGpu, Tier::kGpu, Tier::kGpu, "/tmp");
    Rank r(cfg, *comms[0], false);
    // The wrapper exists once finalize() built the device: fail one allocation then.
    zero::StorageWrap w;
    w.device = [nth = nth](std::unique_ptr<Device> d) {
      auto f = std::make_unique<FaultInjectingDevice>(std::move(d));
      f->add_fault({DeviceFaultKind::kAllocFail, nth, 1});
      return std::unique_ptr<Device>(std::move(f));
    };
    EngineAccess::set_storage_wrap(*r.e, std::move(w));
    const std::string msg = expect_error(ErrorCode::kOutOfMemory, names, [&] { r.e->finalize(); });
    EXPECT_NE(msg.find("gpu tier"), std::string::npos) << msg;
  }
}

// Start-up is agreed like a step (issue 25): one rank whose swap directory cannot be made (its
// path is a regular file: ENOTDIR) fails with its own IoError; every other rank fails in the
// same finalize() with Error(kComm) naming that rank, the error class and errno — not with a
// timeout in the initial broadcast (the collective timeout is far longer than the test).
TEST(EngineFaults, AStartUpFailureOnOneRankFailsEveryRankNamingIt) {
  for (const int world : {2, 3, 8}) {
    SCOPED_TRACE(strata::strcat("world ", world));
    TempDir dir("strata-startup");
    const std::string not_a_dir = dir.str() + "/plain-file";
    { std::ofstream(not_a_dir) << "x"; }
    const int bad = world - 1;
    auto comms = make_inprocess_communicators(world, 120.0);
    std::vector<std::string> errors(static_cast<std::size_t>(world));
    std::vector<ErrorCode> codes(static_cast<std::size_t>(world), ErrorCode::kInternal);
    run_ranks(comms, [&](int rank, Communicator& comm) {
      Config cfg = fault_config(2, Tier::kNvme, Tier::kCpu, Tier::kGpu,
                                rank == bad ? not_a_dir + "/swap" : dir.str());
      cfg.runtime.collective_timeout_s = 120.0;
      try {
        Rank r(cfg, comm);
        errors[static_cast<std::size_t>(rank)] = "finalize() succeeded";
      } catch (const Error& e) {
        errors[static_cast<std::size_t>(rank)] = e.what();
        codes[static_cast<std::size_t>(rank)] = e.code();
      }
    });
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE(strata::strcat("rank ", r));
      const std::string& what = errors[static_cast<std::size_t>(r)];
      if (r == bad) {
        EXPECT_EQ(codes[static_cast<std::size_t>(r)], ErrorCode::kIo) << what;
        EXPECT_NE(what.find("plain-file"), std::string::npos) << what;
        continue;
      }
      EXPECT_EQ(codes[static_cast<std::size_t>(r)], ErrorCode::kComm) << what;
      EXPECT_NE(what.find(strata::strcat("rank ", bad, " failed at start-up")), std::string::npos)
          << what;
      EXPECT_NE(what.find(std::strerror(ENOTDIR)), std::string::npos) << what;
    }
  }
}

struct IoCase {
  const char* name;
  IoFault fault;
  bool in_backward;  // the gradient spill fails: set_gradient / the reduction throws
};

std::string io_case_name(const ::testing::TestParamInfo<IoCase>& i) { return i.param.name; }

class EngineIoFaults : public ::testing::TestWithParam<IoCase> {};

// Stage 3, everything on NVMe: the first step is clean; the fault is armed before the second
// step() (or before its backward, for the gradient spill).
TEST_P(EngineIoFaults, FailTheStepNamingPathAndErrnoAndLeaveTheEngineFailed) {
  const IoCase c = GetParam();
  TempDir dir("strata-faults");
  auto comms = make_inprocess_communicators(1, 5.0);
  Rank r(fault_config(3, Tier::kNvme, Tier::kNvme, Tier::kNvme, dir.str()), *comms[0]);
  r.backward(0);
  r.e->step();
  ASSERT_NE(r.io, nullptr);
  std::size_t id = 0;
  try {
    if (c.in_backward) id = r.io->add_fault(c.fault);
    r.backward(1);
    ASSERT_FALSE(c.in_backward) << "the backward did not fail";
    id = r.io->add_fault(c.fault);
    r.e->step();
    FAIL() << "the step did not fail";
  } catch (const IoError& e) {
    EXPECT_GE(r.io->fired(id), 1u);
    const std::string what = e.what();
    EXPECT_NE(what.find(dir.str()), std::string::npos) << "names the swap path: " << what;
    if (c.fault.kind == IoFaultKind::kError) {
      EXPECT_EQ(e.errnum(), c.fault.errnum) << what;
    }
    EXPECT_NE(what.find("buffer '"), std::string::npos) << "names the buffer: " << what;
  } catch (const Error& e) {
    // A write that lost a chunk's only copy failed the store first: Error(kIo) carrying the I/O
    // error and the buffer.
    EXPECT_EQ(e.code(), ErrorCode::kIo) << e.what();
    EXPECT_NE(std::string(e.what()).find("lost its contents"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(dir.str()), std::string::npos) << e.what();
  }
  r.io->clear_faults();
  r.expect_pool_whole();
  r.expect_failed_for_good();
}

INSTANTIATE_TEST_SUITE_P(
    Faults, EngineIoFaults,
    ::testing::Values(
        IoCase{"eio_reading_the_state", IoFault::fail_nth(2, EIO, IoOp::kRead), false},
        IoCase{"enospc_writing_the_state_back", IoFault::fail_nth(3, ENOSPC, IoOp::kWrite), false},
        IoCase{"short_read", IoFault::short_nth(3, 0, IoOp::kRead), false},
        IoCase{"eio_spilling_gradients", IoFault::fail_nth(1, EIO, IoOp::kWrite), true}),
    io_case_name);

// A failed read of the own parameter slice in a stage-3 gather() changes nothing: the gather can be
// retried and training goes on.
TEST(EngineFaults, AFailedGatherReadCanBeRetried) {
  TempDir dir("strata-faults");
  auto comms = make_inprocess_communicators(1, 5.0);
  Rank r(fault_config(3, Tier::kGpu, Tier::kGpu, Tier::kNvme, dir.str()), *comms[0]);
  r.io->add_fault(IoFault::fail_nth(1, EIO, IoOp::kRead));
  TensorId id = 0;
  const std::string msg = expect_error<IoError>(ErrorCode::kIo, "buffer 'param.", [&] {
    r.e->gather({&id, 1});
  });
  EXPECT_NE(msg.find(errno_text(EIO)), std::string::npos) << msg;
  r.io->clear_faults();
  r.e->gather({&id, 1});
  std::vector<float> v(kSizes[0]);
  r.e->read_param(id, v);
  EXPECT_EQ(v[17], 0.25f);
  r.e->release({&id, 1});
  r.backward(0);
  EXPECT_TRUE(r.e->step().applied);
  r.expect_pool_whole();
}

// write_states into state on NVMe (several chunks), as a torch load_state_dict makes it: a read
// that fails before anything was written (the first chunk's) changes nothing and the engine goes
// on; a write that fails after the first chunk was rewritten leaves the state part old, part new:
// the call throws naming the swap path, and the engine is failed for good (docs/errors.md, rule 4).
TEST(EngineFaults, AStateWriteThatFailsPartWayLeavesTheEngineFailed) {
  TempDir dir("strata-faults");
  auto comms = make_inprocess_communicators(1, 5.0);
  Rank r(fault_config(2, Tier::kNvme, Tier::kGpu, Tier::kGpu, dir.str()), *comms[0]);
  ASSERT_GE(EngineAccess::chunks(*r.e).size(), 3u);
  std::vector<std::vector<float>> values;
  std::vector<StateWrite> writes;
  for (TensorId t = 0; t < kSizes.size(); ++t) values.emplace_back(kSizes[t], 0.5f + t);
  for (TensorId t = 0; t < kSizes.size(); ++t) writes.push_back({t, StateKind::kExpAvg, values[t]});
  std::vector<float> before(kSizes[2]), after(kSizes[2]);
  r.e->read_state(2, StateKind::kExpAvg, before);
  r.io->add_fault(IoFault::fail_nth(1, EIO, IoOp::kRead));
  const std::string msg =
      expect_error<IoError>(ErrorCode::kIo, dir.str(), [&] { r.e->write_states(writes); });
  EXPECT_NE(msg.find(errno_text(EIO)), std::string::npos) << msg;
  r.io->clear_faults();
  r.e->read_state(2, StateKind::kExpAvg, after);
  EXPECT_EQ(after, before) << "a write_states that failed before writing changed the state";
  r.backward(0);
  EXPECT_TRUE(r.e->step().applied) << "the engine is usable after a failure that changed nothing";
  const std::size_t id = r.io->add_fault(IoFault::fail_nth(2, ENOSPC, IoOp::kWrite));
  try {
    r.e->write_states(writes);
    FAIL() << "the write did not fail";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.str()), std::string::npos) << e.what();
    EXPECT_EQ(e.errnum(), ENOSPC) << e.what();
  } catch (const Error& e) {  // the write lost a chunk's only copy: the store failed first
    EXPECT_EQ(e.code(), ErrorCode::kIo) << e.what();
    EXPECT_NE(std::string(e.what()).find("lost its contents"), std::string::npos) << e.what();
  }
  EXPECT_GE(r.io->fired(id), 1u);
  r.io->clear_faults();
  r.expect_pool_whole();
  r.expect_failed_for_good();
  expect_error(ErrorCode::kIo, "write_states failed part-way",
               [&] { r.e->write_state(0, StateKind::kExpAvg, values[0]); });
}

TEST(EngineFaults, AFailedDeviceCopyFailsTheStep) {
  // Optimizer on cpu, gradients on gpu: the update copies each chunk's gradients device→host
  // (staged as on CUDA: the host device's memory could be viewed in place), so the step makes
  // copies whatever the backward's share copies already did.
  auto comms = make_inprocess_communicators(1, 5.0);
  Rank r(fault_config(2, Tier::kCpu, Tier::kGpu, Tier::kGpu, "/tmp"), *comms[0]);
  zero::EngineAccess::set_stage_device_memory(*r.e, true);
  r.backward(0);
  r.e->step();
  r.backward(1);
  ASSERT_NE(r.device, nullptr);
  r.device->add_fault({DeviceFaultKind::kCopyFail, 1, 1});
  expect_error(ErrorCode::kDevice, "buffer '", [&] { r.e->step(); });
  r.device->clear_faults();
  r.expect_pool_whole();
  r.expect_failed_for_good();
}

TEST(EngineFaults, AFlippedBitInASwapFileIsAChecksumError) {
  TempDir dir("strata-faults");
  auto comms = make_inprocess_communicators(1, 5.0);
  Rank r(fault_config(1, Tier::kNvme, Tier::kGpu, Tier::kGpu, dir.str()), *comms[0]);
  r.backward(0);
  r.e->step();
  TierStore& store = EngineAccess::storage(*r.e).store();
  const BufferId chunk = EngineAccess::chunks(*r.e).at(1).opt;
  auto [ext, len] = store.nvme_extent(chunk);
  ASSERT_GT(len, 64u);
  auto [path, off] = store.swap_space()->locate(ext + 40);
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  std::uint8_t byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(off)), 1);
  byte ^= 0x04;
  ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(off)), 1);
  ::close(fd);
  r.backward(1);
  const std::string msg = expect_error(ErrorCode::kChecksum, "'opt.1'", [&] { r.e->step(); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  r.expect_pool_whole();
  r.expect_failed_for_good();
}

// A rank whose I/O fails in a step tells the others in the same step (the agreement on the norm
// carries a failed flag; after the update every rank exchanges whether its update went through):
// every rank's step() throws in that step — the failing rank its own error, the others
// Error(kComm) naming it — instead of the others completing the step and waiting out the
// collective timeout in the next one. Every engine is failed afterwards. The fault is armed after
// the backward, on the last rank, so it fires in the step.
struct PeerCase {
  int stage;
  int world;
  Tier opt, grads;
  const char* phase;  // where the peer's failure is reported
  std::string name;
  IoOp op = IoOp::kRead;  // the failing request
};

class PeerFaults : public ::testing::TestWithParam<PeerCase> {};

TEST_P(PeerFaults, AFailingRankStopsEveryRankInTheSameStep) {
  const PeerCase c = GetParam();
  TempDir dir("strata-faults");
  auto comms = make_inprocess_communicators(c.world, 30.0);
  std::vector<std::string> errors(static_cast<std::size_t>(c.world));
  std::vector<ErrorCode> codes(static_cast<std::size_t>(c.world), ErrorCode::kInternal);
  std::vector<int> failed_at(static_cast<std::size_t>(c.world), -1);
  const int bad = c.world - 1;
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Config cfg = fault_config(c.stage, c.opt, c.grads, Tier::kGpu, dir.str());
    cfg.runtime.collective_timeout_s = 30.0;  // a hang would show as kTimeout, after 30 s
    Rank r(cfg, comm);
    const auto k = static_cast<std::size_t>(rank);
    for (int step = 0; step < 3 && failed_at[k] < 0; ++step) {
      try {
        r.backward(step);
        if (rank == bad && step == 1) r.io->add_fault(IoFault::fail_nth(1, EIO, c.op));
        r.e->step();
      } catch (const Error& e) {
        errors[k] = e.what();
        codes[k] = e.code();
        failed_at[k] = step;
      }
    }
    r.expect_failed_for_good();
  }));
  const auto b = static_cast<std::size_t>(bad);
  EXPECT_EQ(codes[b], ErrorCode::kIo) << errors[b];
  EXPECT_NE(errors[b].find("Input/output error"), std::string::npos) << errors[b];
  for (int r = 0; r < c.world; ++r) {
    const auto k = static_cast<std::size_t>(r);
    EXPECT_EQ(failed_at[k], 1) << "rank " << r << ": " << errors[k];
    if (r == bad) continue;
    EXPECT_EQ(codes[k], ErrorCode::kComm)
        << "rank " << r << ": " << errors[k] << "\n(the failing rank " << bad << " at step "
        << failed_at[b] << ": " << errors[b] << ")";
    EXPECT_NE(errors[k].find(strcat("rank ", bad, " failed in this step's ", c.phase)),
              std::string::npos)
        << "rank " << r << ": " << errors[k];
    EXPECT_NE(errors[k].find("load_checkpoint"), std::string::npos) << errors[k];
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PeerFaults,
    ::testing::Values(
        // State on NVMe: the first read is the update's (issued before the agreement, under it).
        PeerCase{1, 2, Tier::kNvme, Tier::kGpu, "update", "stage1_opt_nvme_world2"},
        PeerCase{2, 3, Tier::kNvme, Tier::kCpu, "update", "stage2_opt_nvme_world3"},
        PeerCase{3, 4, Tier::kNvme, Tier::kGpu, "update", "stage3_opt_nvme_world4"},
        // Gradients on NVMe: the first read is the fill's or the statistics pass's.
        PeerCase{2, 2, Tier::kCpu, Tier::kNvme, "gradient reduction or statistics",
                 "stage2_grads_nvme_world2"},
        PeerCase{3, 3, Tier::kNvme, Tier::kNvme, "gradient reduction or statistics",
                 "stage3_opt_grads_nvme_world3"},
        // The step's last gradient spills fail: the fill's error is carried into the agreement.
        PeerCase{2, 2, Tier::kCpu, Tier::kNvme, "gradient reduction or statistics",
                 "stage2_grads_nvme_spill_world2", IoOp::kWrite},
        // The update's write-back fails.
        PeerCase{1, 3, Tier::kNvme, Tier::kGpu, "update", "stage1_opt_nvme_writeback_world3",
                 IoOp::kWrite}),
    [](const ::testing::TestParamInfo<PeerCase>& i) { return i.param.name; });

// ---- the speculative update (optimizer.overlap on)

namespace {

Config speculating_config(const std::string& dir, bool overlap) {
  Config cfg = fault_config(2, Tier::kNvme, Tier::kCpu, Tier::kGpu, dir);
  cfg.optimizer.overlap = overlap ? OptimizerOverlap::kOn : OptimizerOverlap::kOff;
  return cfg;
}

// Every tensor's parameters and optimizer state, FP32 bits.
std::vector<std::uint32_t> everything(Engine& e) {
  std::vector<std::uint32_t> out;
  for (TensorId t = 0; t < kSizes.size(); ++t) {
    std::vector<float> v(kSizes[t]);
    e.read_param(t, v);
    for (float x : v) out.push_back(std::bit_cast<std::uint32_t>(x));
    for (StateKind k : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
      e.read_state(t, k, v);
      for (float x : v) out.push_back(std::bit_cast<std::uint32_t>(x));
    }
  }
  return out;
}

}  // namespace

// A failed write of a speculative update's pending version (NVMe state): the speculation is
// dropped and that step runs serially; the engine stays usable and equals the serial engine bit
// for bit.
TEST(EngineFaults, AFailedSpeculativeWriteFallsBackToTheSerialStep) {
  TempDir dir("strata-faults"), dir2("strata-faults");
  auto comms = make_inprocess_communicators(1, 5.0);
  auto comms2 = make_inprocess_communicators(1, 5.0);
  Rank spec(speculating_config(dir.str(), true), *comms[0]);
  Rank serial(speculating_config(dir2.str(), false), *comms2[0]);
  for (int step = 0; step < 5; ++step) {
    std::size_t id = 0;
    if (step == 2) id = spec.io->add_fault(IoFault::fail_nth(1, EIO, IoOp::kWrite));
    spec.backward(step);
    serial.backward(step);
    const StepResult r = spec.e->step();
    serial.e->step();
    if (step == 2) {
      EXPECT_EQ(spec.io->fired(id), 1u);
      // What the failed speculation had taken is reported rolled back; nothing committed.
      EXPECT_EQ(r.committed_chunks, 0u);
      EXPECT_EQ(r.rolled_back_chunks, r.speculated_chunks);
    } else {
      EXPECT_GT(r.committed_chunks, 0u) << "step " << step;
    }
  }
  EXPECT_EQ(everything(*spec.e), everything(*serial.e));
  spec.expect_pool_whole();
}

// An asynchronous checkpoint taken between the backward and step(), while the speculative update's
// pending versions exist: it holds the state before the step (its pins keep the committed slots
// the commit replaces); the step commits; both equal the serial engine's, bit for bit.
TEST(EngineFaults, ACheckpointPinnedWhileSpeculating) {
  TempDir dir("strata-faults"), dir2("strata-faults"), ckpt("strata-ckpt"), ckpt2("strata-ckpt");
  auto comms = make_inprocess_communicators(1, 5.0);
  auto comms2 = make_inprocess_communicators(1, 5.0);
  Config with_room = speculating_config(dir.str(), true);
  with_room.tiers.nvme.snapshot_room = 1.0;  // the step need not wait for the writer
  Rank spec(with_room, *comms[0]);
  Rank serial(speculating_config(dir2.str(), false), *comms2[0]);
  for (int step = 0; step < 4; ++step) {
    spec.backward(step);
    serial.backward(step);
    if (step == 2) {
      spec.e->save_checkpoint(ckpt.str(), SaveMode::kAsync);
      serial.e->save_checkpoint(ckpt2.str(), SaveMode::kBlocking);
    }
    const StepResult r = spec.e->step();
    serial.e->step();
    EXPECT_GT(r.committed_chunks, 0u) << "step " << step;
    if (step == 2) spec.e->wait_checkpoint();
  }
  EXPECT_EQ(everything(*spec.e), everything(*serial.e));
  TempDir dir3("strata-faults"), dir4("strata-faults");
  Rank a(speculating_config(dir3.str(), false), *comms[0]);
  Rank b(speculating_config(dir4.str(), false), *comms2[0]);
  a.e->load_checkpoint(ckpt.str());
  b.e->load_checkpoint(ckpt2.str());
  EXPECT_EQ(everything(*a.e), everything(*b.e));
}

}  // namespace
}  // namespace strata::testing
