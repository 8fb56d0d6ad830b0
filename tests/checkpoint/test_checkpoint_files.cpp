// Checkpoint files cannot be redirected (issue 15.3): a checkpoint directory that another user can
// write (no sticky bit) or owns is refused with the reason; symbolic links planted at the names a
// save creates (manifest.json.tmp, a shard) redirect nothing; a symlinked manifest or shard is not
// followed on load. The attacker is user `nobody` (tests skip when not running as root).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include "../comm/comm_test_util.hpp"
#include "checkpoint/ckpt_test_util.hpp"
#include "checkpoint/fake_rank.hpp"
#include "checkpoint/format.hpp"
#include "strata/cleanup.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

namespace fs = std::filesystem;
const std::vector<std::size_t> kFileSizes{1000, 3, 257};

void save(const std::string& dir, std::uint64_t seed, int world = 2) {
  auto comms = make_inprocess_communicators(world, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    FakeRank f = make_fake_rank(kFileSizes, world, rank, 1, DType::kFp32, seed);
    checkpoint::save_checkpoint(dir, f.state, comm);
  }));
}

// Loads into one rank; returns the error message ("" when it loaded the values of `seed`).
std::string load(const std::string& dir, std::uint64_t seed) {
  auto comms = make_inprocess_communicators(1, 30.0);
  FakeRank f = make_fake_rank(kFileSizes, 1, 0, 3, DType::kFp32, 0);
  try {
    checkpoint::load_checkpoint(dir, f.state, *comms[0]);
  } catch (const Error& e) {
    return e.what();
  }
  EXPECT_EQ(check_fake_rank(f, kFileSizes, seed, "load"), 0u);
  return "";
}

template <typename F>
void expect_error(F&& f, int exit_code, const std::vector<std::string>& words) {
  try {
    f();
    ADD_FAILURE() << "not refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), exit_code) << e.what();
    for (const auto& w : words)
      EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

// A sticky, world-writable directory like /tmp, inside a private temp dir.
struct Shared {
  TempDir tmp{"strata-ckpt-files"};
  std::string shared = tmp.str() + "/shared";
  Shared() {
    ::chmod(tmp.str().c_str(), 0755);
    ::mkdir(shared.c_str(), 0777);
    ::chmod(shared.c_str(), 01777);
  }
};

// Once the `strata` command's signal handler has run its cleanup (the process is ending, other
// threads still run), a save that creates its files afterwards removes them itself and fails with
// kCancelled: nothing it created outlives the process. In a child process (the flag is for
// good).
TEST(CheckpointFiles, NoFileCreatedAfterTheSignalCleanupOutlivesIt) {
  TempDir dir("strata-ckpt-ending");
  const std::string ckpt = dir.str() + "/c";
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 0;
    run_signal_cleanup(true);
    if (!signal_cleanup_ending()) code = 3;
    try {
      save(ckpt, 1, 1);
      code = 4;  // saved: refused nothing
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kCancelled) code = 5;
    } catch (...) {
      code = 6;
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: flag not set, 4: saved, 5/6: another error";
  std::vector<std::string> left;
  if (fs::exists(ckpt))
    for (const auto& f : fs::directory_iterator(ckpt))
      if (f.path().filename().string().rfind("shard-", 0) == 0) left.push_back(f.path());
  EXPECT_TRUE(left.empty()) << left.front();
  EXPECT_FALSE(signal_cleanup_ending());  // this process: untouched
}

// A creation in progress on another thread when the signal cleanup runs (a shard created just
// after its removal pass, before its owner checks the flag): run_signal_cleanup(true) returns only
// once the owner is done (CleanupCreation released), so the owner's removal comes before the
// process ends. In a child process (the flag is for good).
TEST(CheckpointFiles, SignalCleanupWaitsForACreationInProgress) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::atomic<bool> holding{false}, released{false};
    std::thread owner([&] {
      {
        const CleanupCreation creating;
        holding = true;
        while (!signal_cleanup_ending()) std::this_thread::yield();  // the handler's pass began
      }
      released = true;
    });
    while (!holding) std::this_thread::yield();
    run_signal_cleanup(true);
    const int code = released ? 0 : 3;
    owner.join();
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: the cleanup returned while a creation was in progress";
}

TEST(CheckpointFiles, UnsafeDirectoriesAreRefusedWithTheReason) {
  TempDir tmp("strata-ckpt-files");
  // Writable by others, no sticky bit: refused for saving and for loading.
  const std::string open = tmp.str() + "/open";
  ::mkdir(open.c_str(), 0700);
  save(open + "/ckpt", 3);
  ::chmod(open.c_str(), 0777);
  expect_error([&] { save(open + "/ckpt2", 3); }, 2,
               {"checkpoint directory", open, "writable", "0777"});
  EXPECT_NE(load(open + "/ckpt", 3).find("writable"), std::string::npos);
  ::chmod(open.c_str(), 0700);
  EXPECT_EQ(load(open + "/ckpt", 3), "");
  // The checkpoint directory itself writable by others.
  ::chmod((open + "/ckpt").c_str(), 0777);
  EXPECT_NE(load(open + "/ckpt", 3).find("writable"), std::string::npos);
}

TEST(CheckpointFiles, DirectoryOfAnotherUserIsRefused) {
  if (!can_switch_user()) GTEST_SKIP() << "needs root to act as user nobody";
  Shared t;
  // nobody pre-creates the checkpoint directory (world-writable, or private to it).
  const std::string trap = t.shared + "/ckpt";
  ASSERT_EQ(
      run_as_user(kNobodyUid, kNobodyGid,
                  [&] {
                    return ::mkdir(trap.c_str(), 0777) == 0 && ::chmod(trap.c_str(), 0777) == 0 ? 0
                                                                                                : 1;
                  }),
      0);
  expect_error([&] { save(trap, 3); }, 2, {"checkpoint directory", trap, "owned by uid 65534"});
  expect_error([&] { save(trap + "/", 3); }, 2, {"owned by uid 65534"});
  EXPECT_TRUE(fs::is_empty(trap)) << "something was written into another user's directory";
  // A symlink to our own directory, planted by nobody, is not followed.
  const std::string mine = t.tmp.str() + "/mine";
  ::mkdir(mine.c_str(), 0700);
  save(mine, 4);
  const std::string link = t.shared + "/link";
  ASSERT_EQ(
      run_as_user(kNobodyUid, kNobodyGid, [&] { return ::symlink(mine.c_str(), link.c_str()); }),
      0);
  EXPECT_NE(load(link, 4).find("symbolic link"), std::string::npos) << load(link, 4);
  expect_error([&] { save(link + "/", 5); }, 2, {"symbolic link"});
  EXPECT_EQ(load(mine, 4), "");
}

// In our own (safe) directory nobody cannot plant anything; links that are there anyway (planted
// before, or by the owner) at the names a save creates redirect nothing: they are removed (the
// link, never its target) and the files created afresh (O_EXCL | O_NOFOLLOW).
TEST(CheckpointFiles, PlantedSymlinksRedirectNothing) {
  Shared t;
  const std::string dir = t.shared + "/ckpt";
  save(dir, 6);
  const std::string victim = t.tmp.str() + "/precious";
  write_file(victim, "precious data");
  if (can_switch_user()) {  // nobody cannot plant a link into our private directory
    EXPECT_NE(run_as_user(
                  kNobodyUid, kNobodyGid,
                  [&] { return ::symlink(victim.c_str(), (dir + "/manifest.json.tmp").c_str()); }),
              0);
  }
  ASSERT_EQ(::symlink(victim.c_str(), (dir + "/manifest.json.tmp").c_str()), 0);
  ASSERT_EQ(::symlink(victim.c_str(), (dir + "/" + checkpoint::shard_file_name(2, 0)).c_str()), 0);
  ASSERT_EQ(::symlink(victim.c_str(), (dir + "/" + checkpoint::shard_file_name(2, 1)).c_str()), 0);
  save(dir, 7);
  EXPECT_EQ(read_file(victim), "precious data");
  EXPECT_FALSE(fs::is_symlink(dir + "/manifest.json.tmp"));
  for (const auto& p : shard_files(dir)) EXPECT_FALSE(fs::is_symlink(p)) << p;
  EXPECT_EQ(load(dir, 7), "");
  // A symlinked manifest or shard is not followed on load (ELOOP: exit 2).
  const std::string other = t.tmp.str() + "/other";
  save(other, 8);
  fs::rename(dir + "/manifest.json", dir + "/manifest.saved");
  fs::create_symlink(other + "/manifest.json", dir + "/manifest.json");
  EXPECT_NE(load(dir, 8).find("Too many levels of symbolic links"), std::string::npos)
      << load(dir, 8);
  fs::remove(dir + "/manifest.json");
  fs::rename(dir + "/manifest.saved", dir + "/manifest.json");
  const auto shards = shard_files(dir);
  fs::rename(shards[0], dir + "/saved.bin");
  fs::create_symlink(dir + "/saved.bin", shards[0]);
  EXPECT_NE(load(dir, 7).find("Too many levels of symbolic links"), std::string::npos)
      << load(dir, 7);
  fs::remove(shards[0]);
  fs::rename(dir + "/saved.bin", shards[0]);
  EXPECT_EQ(load(dir, 7), "");
}

TEST(CheckpointFiles, FilesArePrivate) {
  TempDir tmp("strata-ckpt-files");
  const std::string dir = tmp.str() + "/new/ckpt";
  save(dir, 9);
  struct stat st {};
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  for (const auto& p : shard_files(dir)) {
    ASSERT_EQ(::stat(p.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << p;
  }
  ASSERT_EQ(::stat((dir + "/manifest.json").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

}  // namespace
}  // namespace strata::testing
