// Asynchronous checkpoints (Engine::save_checkpoint with SaveMode::kAsync): the checkpoint taken
// while training goes on is bitwise the blocking save of the same step (stages 0-3, 1 and 2
// ranks, optimizer state on cpu and on NVMe), the steps taken meanwhile are those of a run that
// never saved; a save while the previous one is still writing waits for it and commits it; a
// failure of the background writer is reported at the next call and leaves the previous
// checkpoint loadable and the training state untouched.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <latch>
#include <mutex>

#include "../comm/comm_test_util.hpp"
#include "checkpoint/format.hpp"
#include "ckpt_model.hpp"
#include "core/file_env.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"
#include "zero/engine_access.hpp"

namespace strata::testing {
namespace {

// snapshot_room 1: a step never waits for the writer (every rewritten NVMe block takes a new slot).
// `params`: the model dtype (precision.params).
Config async_config(int stage, Tier state, const std::string& swap, double room = 1.0,
                    DType params = DType::kFp32) {
  Config cfg = ckpt_config(stage, state == Tier::kNvme ? 1.0 : 0.0, swap);
  cfg.tiers.nvme.snapshot_room = room;
  cfg.precision.params = params;
  if (state == Tier::kCpu) cfg.offload.optimizer = {Tier::kCpu, 1.0, false};
  if (state == Tier::kNvme) cfg.tiers.host.buffer_size = 3 * 4096;  // several chunks per rank
  return cfg;
}

// Runs `fn` on an engine per rank (registered, finalized); returns each rank's parameters after.
using RankFn = std::function<void(int rank, Engine& e)>;
std::vector<std::vector<std::vector<float>>> with_engines(int world, int stage, Tier state,
                                                          const std::string& swap, const RankFn& fn,
                                                          double room = 1.0,
                                                          DType params = DType::kFp32) {
  auto comms = make_inprocess_communicators(world, 30.0);
  std::vector<std::vector<std::vector<float>>> out(static_cast<std::size_t>(world));
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Engine e(async_config(stage, state, swap, room, params), comm);
    ckpt_register(e, kCkptSizes);
    fn(rank, e);
    out[static_cast<std::size_t>(rank)] = read_params(e, kCkptSizes);
  }));
  return out;
}

// Everything a checkpoint restores, as a fresh engine sees it after loading `dir`: parameters,
// master weights and both moments of every tensor, and the step counters.
std::vector<std::vector<float>> loaded(int world, int stage, Tier state, const std::string& swap,
                                       const std::string& dir, DType params = DType::kFp32) {
  std::vector<std::vector<float>> got;
  with_engines(
      world, stage, state, swap,
      [&](int rank, Engine& e) {
        e.load_checkpoint(dir);
        std::vector<std::vector<float>> mine = read_params(e, kCkptSizes);
        for (std::size_t t = 0; t < kCkptSizes.size(); ++t)
          for (StateKind k : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
            std::vector<float> v(kCkptSizes[t]);
            e.read_state(static_cast<TensorId>(t), k, v);
            mine.push_back(v);
          }
        const EngineStats s = e.stats();
        mine.push_back({static_cast<float>(s.steps), static_cast<float>(s.applied_steps),
                        static_cast<float>(e.optimizer_step()), static_cast<float>(s.loss_scale)});
        if (rank == 0) got = mine;
      },
      1.0, params);
  return got;
}

// Holds every shard write until every rank has arrived (or a minute passed: a safety net that no
// assertion depends on), so that the steps after an asynchronous save run while its snapshot is
// entirely pinned: every rewritten block goes through copy-on-write.
class GatedFileEnv : public FileEnvWrapper {
 public:
  GatedFileEnv(FileEnv& target, int ranks) : FileEnvWrapper(target), ranks_(ranks) {}
  void arrive() {
    std::lock_guard<std::mutex> lock(mu_);
    if (++arrived_ >= ranks_) cv_.notify_all();
  }
  // A shard's writer waits before it creates the file, so before it has read any of the
  // snapshot (it reads each piece before the previous one is written).
  std::unique_ptr<WritableFile> create_file(const SafeDir& dir, std::string_view name, mode_t mode,
                                            WriteMode how) override {
    std::uint64_t serial = 0;
    int rank = 0;
    if (checkpoint::parse_shard_file_name(name, &serial, &rank)) wait();
    return std::make_unique<Gated>(FileEnvWrapper::create_file(dir, name, mode, how), *this);
  }

 private:
  struct Gated : WritableFile {
    Gated(std::unique_ptr<WritableFile> f, GatedFileEnv& env) : f_(std::move(f)), env_(env) {}
    const std::string& path() const override { return f_->path(); }
    void write_at(const void* d, std::uint64_t n, std::uint64_t off) override {
      env_.wait();
      f_->write_at(d, n, off);
    }
    void truncate(std::uint64_t size) override { f_->truncate(size); }
    void sync() override { f_->sync(); }
    bool direct() const override { return f_->direct(); }
    std::unique_ptr<WritableFile> f_;
    GatedFileEnv& env_;
  };
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::minutes(1), [&] { return arrived_ >= ranks_; });
  }
  std::mutex mu_;
  std::condition_variable cv_;
  int ranks_, arrived_ = 0;
};

struct Case {
  int stage, world;
  Tier state;
  DType params;
};

class AsyncCheckpoint : public ::testing::TestWithParam<Case> {};

// Save asynchronously at step 5, train 4 more steps while the writer is held back (every state
// block copy-on-write), commit: the checkpoint loads bitwise equal to a blocking save at step 5,
// and the training went on bitwise as a run that never saved. The save call copies no parameter
// bytes at any stage (stage 3: pinned parameter blocks; stages 0-2: the writer rounds the pinned
// master to the model dtype, which must give the parameters' bits: FP32, BF16 and FP16 models).
TEST_P(AsyncCheckpoint, EqualsBlockingSaveOfTheSameStep) {
  const Case c = GetParam();
  TempDir swap("strata-async-swap"), async_dir("strata-async"), blocking_dir("strata-blocking");
  auto engines = [&](const RankFn& fn) {
    return with_engines(c.world, c.stage, c.state, swap.str(), fn, 1.0, c.params);
  };
  const auto want = engines([&](int rank, Engine& e) {
    for (int s = 0; s < 9; ++s) ckpt_step(e, kCkptSizes, rank, s);
  });
  engines([&](int rank, Engine& e) {
    for (int s = 0; s < 5; ++s) ckpt_step(e, kCkptSizes, rank, s);
    e.save_checkpoint(blocking_dir.str(), SaveMode::kBlocking, "{\"at\":5}");
  });
  GatedFileEnv gate(FileEnv::standard(), c.world);
  std::vector<std::uint64_t> diverged(static_cast<std::size_t>(c.world));
  std::vector<std::size_t> copied(static_cast<std::size_t>(c.world), 1);
  std::vector<std::vector<std::vector<float>>> got;
  {
    ScopedFileEnv scoped(gate);
    got = engines([&](int rank, Engine& e) {
      for (int s = 0; s < 5; ++s) ckpt_step(e, kCkptSizes, rank, s);
      EXPECT_TRUE(zero::EngineAccess::params_follow_master(e));
      e.save_checkpoint(async_dir.str(), SaveMode::kAsync, "{\"at\":5}");
      EXPECT_TRUE(e.checkpoint_pending());
      copied[static_cast<std::size_t>(rank)] = zero::EngineAccess::checkpoint_param_copy_bytes(e);
      for (int s = 5; s < 9; ++s) ckpt_step(e, kCkptSizes, rank, s);
      diverged[static_cast<std::size_t>(rank)] =
          zero::EngineAccess::storage(e).store().version_usage().diverged_blocks;
      gate.arrive();
      e.wait_checkpoint();
      EXPECT_FALSE(e.checkpoint_pending());
      const VersionUsage u = zero::EngineAccess::storage(e).store().version_usage();
      EXPECT_EQ(u.snapshots, 0u);
      for (Tier t : {Tier::kGpu, Tier::kCpu, Tier::kNvme}) EXPECT_EQ(u.held[t], 0u);
    });
  }
  for (int r = 0; r < c.world; ++r) {
    expect_bitwise_equal(got[r], want[r], strcat("training went on, rank ", r));
    EXPECT_GT(diverged[static_cast<std::size_t>(r)], 0u) << "rank " << r;
    EXPECT_EQ(copied[static_cast<std::size_t>(r)], 0u) << "parameter bytes copied, rank " << r;
  }
  const auto from_async = loaded(c.world, c.stage, c.state, swap.str(), async_dir.str(), c.params);
  const auto from_blocking =
      loaded(c.world, c.stage, c.state, swap.str(), blocking_dir.str(), c.params);
  expect_bitwise_equal(from_async, from_blocking, "async vs blocking checkpoint");
}

INSTANTIATE_TEST_SUITE_P(StagesRanksTiers, AsyncCheckpoint, ::testing::ValuesIn([] {
                           std::vector<Case> v;
                           for (int stage = 0; stage <= 3; ++stage)
                             for (int world : {1, 2})
                               for (Tier t : {Tier::kCpu, Tier::kNvme})
                                 for (DType d : {DType::kFp32, DType::kBf16, DType::kFp16})
                                   v.push_back({stage, world, t, d});
                           return v;
                         }()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return strcat("stage", i.param.stage, "_ranks", i.param.world, "_",
                                         tier_name(i.param.state), "_", dtype_name(i.param.params));
                         });

}  // namespace

// The fallback: a checkpoint whose parameters are not their master's rounding (saved blocking
// after a write into the parameters' memory behind the engine's back, as a Python `.data` view
// allows) is loaded; the rank whose range holds that parameter (every rank at stage 0) no longer
// knows that its parameters follow its master, so its asynchronous save copies them in the call
// and saves the loaded parameters, bitwise what a blocking save of the same state saves (without
// the fallback it would save the master's rounding); the other ranks copy nothing. Loading a
// checkpoint whose parameters follow their master makes the call copy nothing again.
TEST(AsyncCheckpointSaves, ParametersNotTheMastersRoundingAreCopied) {
  for (int stage = 0; stage <= 2; ++stage) {
    SCOPED_TRACE(strcat("stage ", stage));
    TempDir swap("strata-async-swap"), odd("strata-odd"), async_dir("strata-async"),
        ref("strata-ref"), clean("strata-clean"), again("strata-again");
    const int world = 2;
    auto comms = make_inprocess_communicators(world, 30.0);
    std::vector<int> follows(world, -1);
    std::vector<std::size_t> copied(world, 0), expected(world, 0), copied_clean(world, 1);
    int owner = -1;
    rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
      Config cfg = async_config(stage, Tier::kCpu, swap.str(), 1.0, DType::kBf16);
      cfg.runtime.device = DeviceKind::kHost;  // param() is host memory
      Engine e(cfg, comm);
      ckpt_register(e, kCkptSizes);
      const Partition& part = e.partition();
      const std::size_t psize = part.partition_size(), elem = part.offset(0) + 7;
      if (rank == 0) owner = static_cast<int>(elem / psize);
      for (int s = 0; s < 2; ++s) ckpt_step(e, kCkptSizes, rank, s);
      e.save_checkpoint(clean.str());
      // Every rank's copy of parameter 7 of tensor 0 becomes 3.0 behind the engine's back.
      auto* p = static_cast<std::uint16_t*>(const_cast<void*>(e.param(0)));
      ASSERT_NE(p[7], 0x4040);
      p[7] = 0x4040;  // bf16 3.0
      e.save_checkpoint(odd.str());
      e.load_checkpoint(odd.str());
      follows[static_cast<std::size_t>(rank)] = zero::EngineAccess::params_follow_master(e);
      e.save_checkpoint(async_dir.str(), SaveMode::kAsync);
      copied[static_cast<std::size_t>(rank)] = zero::EngineAccess::checkpoint_param_copy_bytes(e);
      expected[static_cast<std::size_t>(rank)] = (stage == 0 ? part.flat_size() : psize) * 2;
      e.save_checkpoint(ref.str());  // waits for the asynchronous one first
      e.load_checkpoint(clean.str());
      EXPECT_TRUE(zero::EngineAccess::params_follow_master(e));
      e.save_checkpoint(again.str(), SaveMode::kAsync);
      copied_clean[static_cast<std::size_t>(rank)] =
          zero::EngineAccess::checkpoint_param_copy_bytes(e);
      e.wait_checkpoint();
    }));
    ASSERT_GE(owner, 0);
    for (int r = 0; r < world; ++r) {
      const std::size_t i = static_cast<std::size_t>(r);
      const bool holds = stage == 0 || r == owner;  // the changed parameter is in its range
      EXPECT_EQ(follows[i], holds ? 0 : 1) << "rank " << r;
      EXPECT_EQ(copied[i], holds ? expected[i] : 0u) << "rank " << r;
      EXPECT_EQ(copied_clean[i], 0u) << "rank " << r;
    }
    const auto from_odd = loaded(world, stage, Tier::kCpu, swap.str(), odd.str(), DType::kBf16);
    EXPECT_EQ(from_odd[0][7], 3.0f);  // the write behind the engine's back was saved
    expect_bitwise_equal(
        loaded(world, stage, Tier::kCpu, swap.str(), async_dir.str(), DType::kBf16), from_odd,
        "asynchronous save after the load");
    expect_bitwise_equal(loaded(world, stage, Tier::kCpu, swap.str(), ref.str(), DType::kBf16),
                         from_odd, "blocking save after the load");
    expect_bitwise_equal(loaded(world, stage, Tier::kCpu, swap.str(), again.str(), DType::kBf16),
                         loaded(world, stage, Tier::kCpu, swap.str(), clean.str(), DType::kBf16),
                         "asynchronous save after loading the clean checkpoint");
  }
}

// Where the master weights are the parameters (FP32, the host device, state in memory, stages
// 0-2): a write into the parameters' memory after an asynchronous save was called and before the
// next step (a torch loop's load_state_dict or an EMA swap for an eval) is not in the checkpoint:
// the call copies them, so the checkpoint loads bitwise as a blocking save of the same step, though
// its writer ran after the write. The call copies the rank's own range of them, not the store's
// whole `params` buffer (every rank's share at stages 1-2): no version of it is held in the store,
// and the call's copy is the rank's aliased chunks' elements.
TEST(AsyncCheckpointSaves, AWriteIntoMasterParametersAfterTheCallIsNotSaved) {
  for (int stage = 0; stage <= 2; ++stage) {
    SCOPED_TRACE(strcat("stage ", stage));
    TempDir swap("strata-async-swap"), async_dir("strata-async"), blocking_dir("strata-blocking");
    const int world = 2;
    with_engines(world, stage, Tier::kCpu, swap.str(), [&](int rank, Engine& e) {
      for (int s = 0; s < 3; ++s) ckpt_step(e, kCkptSizes, rank, s);
      e.save_checkpoint(blocking_dir.str());
    });
    GatedFileEnv gate(FileEnv::standard(), world);
    {
      ScopedFileEnv scoped(gate);
      with_engines(world, stage, Tier::kCpu, swap.str(), [&](int rank, Engine& e) {
        ASSERT_TRUE(e.params_are_master());
        for (int s = 0; s < 3; ++s) ckpt_step(e, kCkptSizes, rank, s);
        e.save_checkpoint(async_dir.str(), SaveMode::kAsync);
        const VersionUsage u = zero::EngineAccess::storage(e).store().version_usage();
        EXPECT_EQ(u.held[Tier::kGpu] + u.held[Tier::kCpu], 0u) << "a copy of the flat parameters";
        auto* p = static_cast<float*>(const_cast<void*>(e.param(0)));
        for (std::size_t i = 0; i < kCkptSizes[0]; ++i) p[i] = 0.5f + static_cast<float>(i);
        gate.arrive();
        e.wait_checkpoint();
      });
    }
    expect_bitwise_equal(loaded(world, stage, Tier::kCpu, swap.str(), async_dir.str()),
                         loaded(world, stage, Tier::kCpu, swap.str(), blocking_dir.str()),
                         "asynchronous save, parameters written after the call");
  }
}

// A second save while the first one's writer is still at work (every shard write delayed) waits
// for it and commits it before it begins: both checkpoints load as blocking saves of their steps.
TEST(AsyncCheckpointSaves, SaveWhileThePreviousIsWritingWaitsForIt) {
  TempDir swap("strata-async-swap"), first("strata-async-1"), second("strata-async-2"),
      ref1("strata-ref-1"), ref2("strata-ref-2");
  with_engines(2, 2, Tier::kNvme, swap.str(), [&](int rank, Engine& e) {
    for (int s = 0; s < 4; ++s) ckpt_step(e, kCkptSizes, rank, s);
    e.save_checkpoint(ref1.str());
    ckpt_step(e, kCkptSizes, rank, 4);
    e.save_checkpoint(ref2.str());
  });
  FaultInjectingFileEnv slow(FileEnv::standard());
  slow.add_fault(FileFault::delay_every(FileOp::kWrite, std::chrono::milliseconds(20)));
  {
    ScopedFileEnv scoped(slow);
    with_engines(2, 2, Tier::kNvme, swap.str(), [&](int rank, Engine& e) {
      for (int s = 0; s < 4; ++s) ckpt_step(e, kCkptSizes, rank, s);
      e.save_checkpoint(first.str(), SaveMode::kAsync);
      EXPECT_FALSE(std::filesystem::exists(first.path() / "manifest.json"));
      ckpt_step(e, kCkptSizes, rank, 4);
      e.save_checkpoint(second.str(), SaveMode::kAsync);
      // The first save was waited for and committed before the second began.
      EXPECT_TRUE(std::filesystem::exists(first.path() / "manifest.json"));
      EXPECT_TRUE(e.checkpoint_pending());
      ckpt_step(e, kCkptSizes, rank, 5);
      e.wait_checkpoint();
    });
  }
  EXPECT_GT(slow.calls(FileOp::kWrite), 0u);
  expect_bitwise_equal(loaded(2, 2, Tier::kNvme, swap.str(), first.str()),
                       loaded(2, 2, Tier::kNvme, swap.str(), ref1.str()), "first save");
  expect_bitwise_equal(loaded(2, 2, Tier::kNvme, swap.str(), second.str()),
                       loaded(2, 2, Tier::kNvme, swap.str(), ref2.str()), "second save");
}

// Without snapshot room (tiers.nvme.snapshot_room 0, the default) the first step after an
// asynchronous save waits for its writer instead of taking new slots: nothing diverges, the
// checkpoint is the blocking save's, the training that went on is that of a run that never saved.
TEST(AsyncCheckpointSaves, WithoutSnapshotRoomTheStepWaitsForTheWriter) {
  TempDir swap("strata-async-swap"), dir("strata-async"), ref("strata-ref");
  const auto want = with_engines(2, 2, Tier::kNvme, swap.str(), [&](int rank, Engine& e) {
    for (int s = 0; s < 4; ++s) ckpt_step(e, kCkptSizes, rank, s);
    e.save_checkpoint(ref.str());
    for (int s = 4; s < 7; ++s) ckpt_step(e, kCkptSizes, rank, s);
  });
  FaultInjectingFileEnv slow(FileEnv::standard());
  slow.add_fault(FileFault::delay_every(FileOp::kWrite, std::chrono::milliseconds(5)));
  std::vector<std::uint64_t> diverged(2);
  std::vector<std::vector<std::vector<float>>> got;
  {
    ScopedFileEnv scoped(slow);
    got = with_engines(
        2, 2, Tier::kNvme, swap.str(),
        [&](int rank, Engine& e) {
          for (int s = 0; s < 4; ++s) ckpt_step(e, kCkptSizes, rank, s);
          e.save_checkpoint(dir.str(), SaveMode::kAsync);
          for (int s = 4; s < 7; ++s) ckpt_step(e, kCkptSizes, rank, s);
          diverged[static_cast<std::size_t>(rank)] =
              zero::EngineAccess::storage(e).store().version_usage().diverged_blocks;
          e.wait_checkpoint();
        },
        0.0);
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(diverged[static_cast<std::size_t>(r)], 0u) << "rank " << r;
    expect_bitwise_equal(got[r], want[r], strcat("training went on, rank ", r));
  }
  expect_bitwise_equal(loaded(2, 2, Tier::kNvme, swap.str(), dir.str()),
                       loaded(2, 2, Tier::kNvme, swap.str(), ref.str()), "async vs blocking");
}

// Every rank's shard fsync fails in the background: the save call returns, training goes on
// untouched, wait_checkpoint() throws the writer's IoError (path, errno) on every rank, and the
// checkpoint committed before it loads.
TEST(AsyncCheckpointSaves, WriterFailureReportedAtTheNextCall) {
  for (FileOp op : {FileOp::kSync, FileOp::kWrite}) {
    TempDir swap("strata-async-swap"), dir("strata-async"), ref("strata-ref");
    const auto want = with_engines(2, 1, Tier::kCpu, swap.str(), [&](int rank, Engine& e) {
      for (int s = 0; s < 7; ++s) ckpt_step(e, kCkptSizes, rank, s);
    });
    FaultInjectingFileEnv faulty(FileEnv::standard());
    std::vector<std::string> errors(2);
    std::vector<std::vector<std::vector<float>>> got;
    {
      ScopedFileEnv scoped(faulty);
      got = with_engines(2, 1, Tier::kCpu, swap.str(), [&](int rank, Engine& e) {
        for (int s = 0; s < 2; ++s) ckpt_step(e, kCkptSizes, rank, s);
        e.save_checkpoint(dir.str(), SaveMode::kAsync);  // committed by the next call
        e.save_checkpoint(ref.str());                    // the same step, blocking: the reference
        ckpt_step(e, kCkptSizes, rank, 2);
        if (rank == 0) {
          FileFault f = FileFault::fail_nth(op, 1, EIO);
          f.name = "shard-";
          f.count = 0;
          faulty.add_fault(f);
        }
        ckpt_step(e, kCkptSizes, rank,
                  3);  // (both ranks' faults are in place after this collective)
        e.save_checkpoint(dir.str(), SaveMode::kAsync);
        for (int s = 4; s < 7; ++s) ckpt_step(e, kCkptSizes, rank, s);
        errors[static_cast<std::size_t>(rank)] =
            expect_error<IoError>(ErrorCode::kIo, errno_text(EIO), [&] { e.wait_checkpoint(); });
        EXPECT_FALSE(e.checkpoint_pending());
        e.wait_checkpoint();  // reported once
      });
    }
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(errors[r].find(dir.str()), std::string::npos) << errors[r];
      EXPECT_NE(errors[r].find("injected fault"), std::string::npos) << errors[r];
      expect_bitwise_equal(got[r], want[r], strcat("training untouched, rank ", r));
    }
    expect_bitwise_equal(loaded(2, 1, Tier::kCpu, swap.str(), dir.str()),
                         loaded(2, 1, Tier::kCpu, swap.str(), ref.str()),
                         strcat("previous checkpoint after a failed ", file_op_name(op)));
  }
}

// An asynchronous save followed by steps only (no wait_checkpoint, no other save): rank 0 commits
// it at the start of the step after the one whose agreement carried every rank's "my shard is
// durable" — the run has a committed checkpoint without any checkpoint call. It used to be
// committed only by the next save / wait_checkpoint / load.
TEST(AsyncCheckpointSaves, CommittedByTheStepsAfterTheWritersFinish) {
  TempDir swap("strata-async-swap"), dir("strata-async"), ref("strata-ref");
  with_engines(2, 2, Tier::kNvme, swap.str(), [&](int rank, Engine& e) {
    for (int s = 0; s < 3; ++s) ckpt_step(e, kCkptSizes, rank, s);
    e.save_checkpoint(ref.str());
  });
  std::vector<int> committed_after(2, -1), before(2, -1);
  with_engines(2, 2, Tier::kNvme, swap.str(), [&](int rank, Engine& e) {
    for (int s = 0; s < 3; ++s) ckpt_step(e, kCkptSizes, rank, s);
    e.save_checkpoint(dir.str(), SaveMode::kAsync);
    zero::EngineAccess::wait_checkpoint_writer(e);  // this rank's shard is durable
    before[static_cast<std::size_t>(rank)] =
        std::filesystem::exists(dir.path() / "manifest.json") ? 1 : 0;
    ckpt_step(e, kCkptSizes, rank, 3);  // its agreement: every rank's shard durable
    ckpt_step(e, kCkptSizes, rank, 4);  // rank 0 commits at its start (before its collectives)
    committed_after[static_cast<std::size_t>(rank)] =
        std::filesystem::exists(dir.path() / "manifest.json") ? 1 : 0;
    EXPECT_TRUE(e.checkpoint_pending());  // until a call reports the commit on every rank
    e.wait_checkpoint();
    EXPECT_FALSE(e.checkpoint_pending());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(before[static_cast<std::size_t>(r)], 0) << "rank " << r;
    EXPECT_EQ(committed_after[static_cast<std::size_t>(r)], 1) << "rank " << r;
  }
  expect_bitwise_equal(loaded(2, 2, Tier::kNvme, swap.str(), dir.str()),
                       loaded(2, 2, Tier::kNvme, swap.str(), ref.str()), "committed by the steps");
}

// An engine dropped with its asynchronous save still pending: the destructor waits for the writer
// and, when a step agreement already said every shard is durable, rank 0 commits it; without such
// an agreement the save stays uncommitted and the previous checkpoint loads.
TEST(AsyncCheckpointSaves, DestructorCommitsWhatEveryRankMadeDurable) {
  TempDir swap("strata-async-swap"), dir("strata-async"), ref1("strata-ref1");
  with_engines(2, 1, Tier::kCpu, swap.str(), [&](int rank, Engine& e) {
    for (int s = 0; s < 2; ++s) ckpt_step(e, kCkptSizes, rank, s);
    e.save_checkpoint(ref1.str());
  });
  with_engines(2, 1, Tier::kCpu, swap.str(), [&](int rank, Engine& e) {
    for (int s = 0; s < 2; ++s) ckpt_step(e, kCkptSizes, rank, s);
    e.save_checkpoint(dir.str(), SaveMode::kAsync);
    zero::EngineAccess::wait_checkpoint_writer(e);
    ckpt_step(e, kCkptSizes, rank, 2);  // the agreement says durable everywhere; no commit yet
  });                                   // the destructors: rank 0 commits
  expect_bitwise_equal(loaded(2, 1, Tier::kCpu, swap.str(), dir.str()),
                       loaded(2, 1, Tier::kCpu, swap.str(), ref1.str()), "committed on drop");
  with_engines(2, 1, Tier::kCpu, swap.str(), [&](int rank, Engine& e) {
    for (int s = 0; s < 3; ++s) ckpt_step(e, kCkptSizes, rank, s);
    e.save_checkpoint(dir.str(), SaveMode::kAsync);  // no step after it: not known durable
  });
  expect_bitwise_equal(loaded(2, 1, Tier::kCpu, swap.str(), dir.str()),
                       loaded(2, 1, Tier::kCpu, swap.str(), ref1.str()), "uncommitted on drop");
}

// The names and sizes of the files in `dir`.
std::vector<std::pair<std::string, std::uintmax_t>> listing(const std::filesystem::path& dir) {
  std::vector<std::pair<std::string, std::uintmax_t>> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    out.emplace_back(e.path().filename().string(), e.file_size());
  std::sort(out.begin(), out.end());
  return out;
}

// Issue 48 point 9 (F): two runs saving into one directory. Run A's asynchronous save is pending
// (its shards written, not yet committed); run B (2 ranks of its own) saves into the same
// directory, blocking and then asynchronously: each is refused on every rank of B, rank 0 naming
// the directory as in use by another run and A's pid (here this process), and nothing in the
// directory changes (B used to go on, and one run's commit removed the other's shards: the loser
// saw a ChecksumError). A then commits, and its checkpoint loads as A's blocking save of that step.
TEST(AsyncCheckpointSaves, ADirectoryInUseByAnotherRunIsRefused) {
  TempDir swap("strata-async-swap"), swap_b("strata-async-swap-b"), dir("strata-async"),
      ref("strata-ref");
  with_engines(2, 1, Tier::kCpu, swap.str(), [&](int rank, Engine& e) {
    for (int s = 0; s < 2; ++s) ckpt_step(e, kCkptSizes, rank, s);
    e.save_checkpoint(ref.str());
  });
  std::vector<std::string> refusals;
  std::latch written(2);
  with_engines(2, 1, Tier::kCpu, swap.str(), [&](int rank, Engine& e) {
    for (int s = 0; s < 2; ++s) ckpt_step(e, kCkptSizes, rank, s);
    e.save_checkpoint(dir.str(), SaveMode::kAsync);
    zero::EngineAccess::wait_checkpoint_writer(e);  // this rank's shard is written
    written.count_down();
    if (rank == 0) {
      written.wait();  // every shard of A is written: the directory no longer changes
      const auto before = listing(dir.path());
      for (SaveMode mode : {SaveMode::kBlocking, SaveMode::kAsync}) {
        std::vector<std::string> got(2);
        with_engines(2, 1, Tier::kCpu, swap_b.str(), [&](int r, Engine& b) {
          ckpt_step(b, kCkptSizes, r, 0);
          try {
            b.save_checkpoint(dir.str(), mode);
            got[static_cast<std::size_t>(r)] = "saved";
          } catch (const Error& err) {
            EXPECT_EQ(err.code(), ErrorCode::kInvalidArgument) << err.what();
            got[static_cast<std::size_t>(r)] = err.what();
          }
        });
        refusals.push_back(got[0]);
        EXPECT_NE(got[1], "saved");
      }
      EXPECT_EQ(listing(dir.path()), before);
    }
    e.wait_checkpoint();
  });
  ASSERT_EQ(refusals.size(), 2u);
  const std::string in_use = "checkpoint save into " +
                             std::filesystem::canonical(dir.path()).string() +
                             ": the directory is in use by another run saving into it (pid " +
                             std::to_string(::getpid()) + ", this process";
  for (const std::string& r : refusals) EXPECT_NE(r.find(in_use), std::string::npos) << r;
  expect_bitwise_equal(loaded(2, 1, Tier::kCpu, swap.str(), dir.str()),
                       loaded(2, 1, Tier::kCpu, swap.str(), ref.str()), "A's checkpoint");
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "writer.pid"));  // released with the save
}

}  // namespace strata::testing
