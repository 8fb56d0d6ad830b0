// Checkpoint files go through one file seam (core/file_env.hpp, issue 22 point 2): a failed
// write, fsync or rename on one rank of a save (injected by that rank's FaultInjectingFileEnv)
// fails the save on every rank and leaves the previous checkpoint loadable; a failed read on one
// rank of a load fails it on every rank with nothing changed.
#include <gtest/gtest.h>

#include <atomic>

#include "../comm/comm_test_util.hpp"
#include "checkpoint/checkpoint.hpp"
#include "checkpoint/fake_rank.hpp"
#include "core/file_env.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

const std::vector<std::size_t> kFaultSizes{3000, 17, 1234, 640};
constexpr int kWorld = 3;
constexpr std::uint64_t kFirst = 11, kSecond = 22, kOwn = 5;  // seeds

// Every rank saves `seed`; rank `faulty` goes through `env`. Returns each rank's ErrorCode (-1:
// saved).
std::vector<int> save_all(const std::string& dir, std::uint64_t seed, int faulty, FileEnv* env) {
  std::vector<int> codes(kWorld, -2);
  auto comms = make_inprocess_communicators(kWorld, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    FakeRank f = make_fake_rank(kFaultSizes, kWorld, rank, 2, DType::kFp32, seed);
    if (rank == faulty) f.state.env = env;
    try {
      zero::save_checkpoint(dir, f.state, comm, {.block_elems = 256});
      codes[static_cast<std::size_t>(rank)] = -1;
    } catch (const Error& e) {
      codes[static_cast<std::size_t>(rank)] = static_cast<int>(e.code());
    }
  }));
  return codes;
}

// Every rank loads (rank `faulty` through `env`) and checks what it holds: `want`'s values after
// a load, its own after a failed one. Returns how many ranks loaded.
int load_all(const std::string& dir, std::uint64_t want, int faulty, FileEnv* env) {
  std::atomic<int> loaded{0};
  auto comms = make_inprocess_communicators(kWorld, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    FakeRank f = make_fake_rank(kFaultSizes, kWorld, rank, 2, DType::kFp32, kOwn);
    if (rank == faulty) f.state.env = env;
    try {
      zero::load_checkpoint(dir, f.state, comm);
      ++loaded;
      EXPECT_EQ(check_fake_rank(f, kFaultSizes, want, "after a load"), 0u);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kIo) << e.what();
      EXPECT_FALSE(f.state.restore_started) << e.what();
      EXPECT_EQ(check_fake_rank(f, kFaultSizes, kOwn, "after a failed load"), 0u);
    }
  }));
  return loaded.load();
}

struct SaveFault {
  const char* name;
  int rank;
  FileFault fault;
};

class CheckpointFileFaults : public ::testing::TestWithParam<SaveFault> {};

TEST_P(CheckpointFileFaults, FailTheSaveOnEveryRankAndKeepThePreviousCheckpoint) {
  const SaveFault& p = GetParam();
  TempDir dir("strata-ckpt-faults");
  ASSERT_EQ(save_all(dir.str(), kFirst, -1, nullptr), std::vector<int>(kWorld, -1));
  FaultInjectingFileEnv env(FileEnv::standard());
  const std::size_t id = env.add_fault(p.fault);
  const std::vector<int> codes = save_all(dir.str(), kSecond, p.rank, &env);
  EXPECT_EQ(env.fired(id), 1u) << "the fault was never reached";
  EXPECT_EQ(codes, std::vector<int>(kWorld, static_cast<int>(ErrorCode::kIo)));
  EXPECT_EQ(load_all(dir.str(), kFirst, -1, nullptr), kWorld);  // the first checkpoint, whole
  // And the directory takes the next save.
  ASSERT_EQ(save_all(dir.str(), kSecond, -1, nullptr), std::vector<int>(kWorld, -1));
  EXPECT_EQ(load_all(dir.str(), kSecond, -1, nullptr), kWorld);
}

INSTANTIATE_TEST_SUITE_P(
    Faults, CheckpointFileFaults,
    ::testing::Values(
        SaveFault{"ShardWriteOfRank1", 1, {FileOp::kWrite, "shard-", 2, 1, ENOSPC, {}}},
        SaveFault{"ShardSyncOfRank2", 2, {FileOp::kSync, "shard-", 1, 1, EIO, {}}},
        SaveFault{"ManifestWrite", 0, {FileOp::kWrite, "manifest.json.tmp", 1, 1, EIO, {}}},
        SaveFault{"ManifestSync", 0, {FileOp::kSync, "manifest.json.tmp", 1, 1, EIO, {}}},
        SaveFault{"ManifestRename", 0, {FileOp::kRename, "manifest.json.tmp", 1, 1, EXDEV, {}}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(CheckpointFileFaults, AFailedReadOnOneRankFailsTheLoadOnEveryRankChangingNothing) {
  TempDir dir("strata-ckpt-faults");
  ASSERT_EQ(save_all(dir.str(), kFirst, -1, nullptr), std::vector<int>(kWorld, -1));
  for (std::uint64_t nth : {1, 2, 3}) {  // the manifest, a shard header, a block
    SCOPED_TRACE(nth);
    FaultInjectingFileEnv env(FileEnv::standard());
    const std::size_t id = env.add_fault(FileFault::fail_nth(FileOp::kRead, nth));
    EXPECT_EQ(load_all(dir.str(), kFirst, 1, &env), 0);
    EXPECT_EQ(env.fired(id), 1u);
  }
  EXPECT_EQ(load_all(dir.str(), kFirst, -1, nullptr), kWorld);
}

TEST(CheckpointFileFaults, EveryFileOfASaveGoesThroughTheSeam) {
  TempDir dir("strata-ckpt-faults");
  std::vector<std::unique_ptr<FaultInjectingFileEnv>> envs;
  for (int r = 0; r < kWorld; ++r)
    envs.push_back(std::make_unique<FaultInjectingFileEnv>(FileEnv::standard()));
  auto comms = make_inprocess_communicators(kWorld, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    FakeRank f = make_fake_rank(kFaultSizes, kWorld, rank, 2, DType::kFp32, kFirst);
    f.state.env = envs[static_cast<std::size_t>(rank)].get();
    zero::save_checkpoint(dir.str(), f.state, comm, {.block_elems = 256});
  }));
  for (int r = 0; r < kWorld; ++r) {
    const FaultInjectingFileEnv& e = *envs[static_cast<std::size_t>(r)];
    EXPECT_GE(e.calls(FileOp::kWrite), 5u) << "rank " << r;  // 4 sections and the header
    EXPECT_EQ(e.calls(FileOp::kSync), r == 0 ? 2u : 1u) << "rank " << r;  // + the manifest
    EXPECT_EQ(e.calls(FileOp::kRename), r == 0 ? 1u : 0u) << "rank " << r;
    EXPECT_EQ(e.calls(FileOp::kSyncDir), r == 0 ? 1u : 0u) << "rank " << r;
  }
}

}  // namespace
}  // namespace strata::testing
