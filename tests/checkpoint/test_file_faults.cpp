// Checkpoint files go through one file seam (core/file_env.hpp, issue 22 point 2): a failed
// write, fsync or rename on one rank of a save (injected by that rank's FaultInjectingFileEnv)
// fails the save on every rank and leaves the previous checkpoint loadable; a failed read on one
// rank of a load fails it on every rank with nothing changed. A direct file (shards are written
// with O_DIRECT) holds exactly what concurrent aligned and unaligned writes put there.
#include <fcntl.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

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
      checkpoint::save_checkpoint(dir, f.state, comm, {.block_elems = 256});
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
      checkpoint::load_checkpoint(dir, f.state, comm);
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

// Whether this process has `path` open with O_DIRECT (its /proc/self/fdinfo flags).
bool open_with_o_direct(const std::string& path) {
  for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(fd.path(), ec) != path) continue;
    std::ifstream info("/proc/self/fdinfo/" + fd.path().filename().string());
    std::string key;
    unsigned long flags = 0;
    while (info >> key)
      if (key == "flags:" && info >> std::oct >> flags && (flags & O_DIRECT)) return true;
  }
  return false;
}

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
    checkpoint::save_checkpoint(dir.str(), f.state, comm, {.block_elems = 256});
  }));
  for (int r = 0; r < kWorld; ++r) {
    const FaultInjectingFileEnv& e = *envs[static_cast<std::size_t>(r)];
    EXPECT_GE(e.calls(FileOp::kWrite), 5u) << "rank " << r;  // 4 sections and the header
    EXPECT_EQ(e.calls(FileOp::kSync), r == 0 ? 2u : 1u) << "rank " << r;  // + the manifest
    EXPECT_EQ(e.calls(FileOp::kRename), r == 0 ? 1u : 0u) << "rank " << r;
    EXPECT_EQ(e.calls(FileOp::kSyncDir), r == 0 ? 1u : 0u) << "rank " << r;
  }
}

// A direct file (WriteMode::kDirect) written from several threads at once: writes whose buffer,
// offset and length are page multiples go through the O_DIRECT descriptor, the others through
// the page cache, and the file holds exactly what was written (random bytes, uneven pieces).
TEST(FileSeam, DirectFileTakesAlignedWritesPastTheCacheAndEveryOtherWriteThroughIt) {
  TempDir dir("strata-direct-file");
  const SafeDir d = SafeDir::open(dir.str());
  const std::unique_ptr<WritableFile> file =
      FileEnv::standard().create_file(d, "shard", 0600, WriteMode::kDirect);
  if (!file->direct()) GTEST_SKIP() << dir.str() << " refuses O_DIRECT (tmpfs?)";
  EXPECT_TRUE(open_with_o_direct(file->path())) << "no O_DIRECT descriptor of " << file->path();
  constexpr std::uint64_t kPage = kDirectAlignment, kSize = 64 * kPage;
  std::vector<unsigned char> want(kSize);
  std::mt19937 rng(7);
  for (auto& b : want) b = static_cast<unsigned char>(rng());
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  const std::unique_ptr<unsigned char, Free> src(
      static_cast<unsigned char*>(std::aligned_alloc(kPage, kSize + kPage)));
  std::memcpy(src.get(), want.data(), kSize);
  // [offset, length) pieces: aligned (direct), unaligned length, unaligned offset, and one from
  // an unaligned buffer at an aligned offset; together they cover the file once.
  const std::vector<std::pair<std::uint64_t, std::uint64_t>> pieces = {
      {0, 8 * kPage},
      {8 * kPage, 3 * kPage + 100},
      {11 * kPage + 100, kPage - 100},
      {12 * kPage, 20 * kPage},
      {32 * kPage, 32 * kPage}};
  std::vector<std::thread> writers;
  for (const auto& [off, len] : pieces)
    writers.emplace_back([&, off = off, len = len] { file->write_at(src.get() + off, len, off); });
  for (std::thread& t : writers) t.join();
  // An unaligned buffer at an aligned offset, over bytes written already (goes buffered).
  std::vector<unsigned char> copy(1 + 2 * kPage);
  std::memcpy(copy.data() + 1, want.data() + 4 * kPage, 2 * kPage);
  file->write_at(copy.data() + 1, 2 * kPage, 4 * kPage);
  file->sync();
  const std::unique_ptr<RandomAccessFile> in = FileEnv::standard().open_file(d, "shard");
  ASSERT_EQ(static_cast<std::uint64_t>(in->status().st_size), kSize);
  std::vector<unsigned char> got(kSize);
  in->read_at(got.data(), kSize, 0);
  EXPECT_TRUE(got == want) << "the direct file does not hold what was written";
}

}  // namespace
}  // namespace strata::testing
