#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "strata/cleanup.hpp"
#include "strata/error.hpp"
#include "strata/io_engine.hpp"
#include "strata/log.hpp"
#include "test_util.hpp"
#include "tier/swap_space.hpp"
#include "tier_test_util.hpp"

using namespace strata;
using namespace std::chrono_literals;
namespace st = strata::testing;
namespace fs = std::filesystem;

namespace {

std::unique_ptr<IoEngine> engine_for(const std::string& dir) {
  IoEngineOptions o;
  o.block_size = 64 << 10;
  o.direct_io = DirectIoMode::kOff;
  return make_io_engine(o, dir);
}

SwapSpaceOptions opts(std::vector<std::string> paths, std::uint64_t capacity) {
  SwapSpaceOptions o;
  o.paths = std::move(paths);
  o.capacity = capacity;
  o.rank = 3;
  o.block_size = 64 << 10;
  return o;
}

std::size_t entries(const std::string& dir) {
  return std::distance(fs::directory_iterator(dir), fs::directory_iterator());
}

}  // namespace

TEST(SwapSpace, CreatesPrivateFilesReservesAndRemoves) {
  st::TempDir dir("strata-swap");
  auto engine = engine_for(dir.str());
  std::string sdir, sfile;
  {
    SwapSpace swap(opts({dir.str()}, (3 << 20) + 5), *engine);
    ASSERT_EQ(swap.directories().size(), 1u);
    sdir = swap.directories()[0];
    sfile = swap.file_paths()[0];
    // The owner's pid is in the name (what a later run checks before removing leftovers).
    EXPECT_NE(sdir.find("/strata-swap-" + std::to_string(getpid()) + "-r3-"), std::string::npos)
        << sdir;
    EXPECT_EQ(sfile, sdir + "/swap.bin");
    struct stat st {};
    ASSERT_EQ(lstat(sdir.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
    ASSERT_EQ(lstat(sfile.c_str(), &st), 0);
    EXPECT_TRUE(S_ISREG(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_GE(std::uint64_t(st.st_size), (3u << 20) + 5);
    EXPECT_GE(std::uint64_t(st.st_blocks) * 512, (3u << 20) + 5);  // really reserved
    EXPECT_EQ(swap.capacity(), 3u * (1 << 20) + (64 << 10));
    EXPECT_EQ(swap.alignment() % 4096, 0u);
  }
  EXPECT_FALSE(fs::exists(sfile));
  EXPECT_FALSE(fs::exists(sdir));
  EXPECT_EQ(entries(dir.str()), 0u);
}

TEST(SwapSpace, StripesOverSeveralPathsAndLocatesOffsets) {
  st::TempDir a("strata-swap-a"), b("strata-swap-b");
  auto engine = engine_for(a.str());
  SwapSpace swap(opts({a.str(), b.str()}, 1 << 20), *engine);
  ASSERT_EQ(swap.file_paths().size(), 2u);
  auto e = swap.allocate(300 << 10, "test");
  auto data = st::random_bytes(e.length, 5);
  engine->wait_for(
      engine->submit(IoRequest{IoOp::kWrite, swap.file(), data.data(), e.length, e.offset}), 10s);
  // Every 64 KiB block is where locate() says.
  for (std::uint64_t off = 0; off < e.length; off += 64 << 10) {
    auto [path, foff] = swap.locate(e.offset + off);
    int fd = open(path.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    std::vector<std::uint8_t> got(4096);
    ASSERT_EQ(pread(fd, got.data(), got.size(), foff), 4096);
    close(fd);
    EXPECT_EQ(0, std::memcmp(got.data(), data.data() + off, 4096)) << off;
  }
  swap.free(e);
}

TEST(SwapSpace, FullSpaceIsABudgetError) {
  st::TempDir dir("strata-swap");
  auto engine = engine_for(dir.str());
  SwapSpace swap(opts({dir.str()}, 256 << 10), *engine);
  auto e1 = swap.allocate(200 << 10, "first");
  st::expect_error(ErrorCode::kBudget, "buffer 'second'",
                   [&] { swap.allocate(100 << 10, "buffer 'second'"); });
  swap.free(e1);
  EXPECT_EQ(swap.used(), 0u);
  swap.free(swap.allocate(256 << 10, "all"));
}

TEST(SwapSpace, PathsAreNormalisedFollowedSafelyOrCreated) {
  st::TempDir dir("strata-swap");
  auto engine = engine_for(dir.str());
  fs::create_directory(dir.path() / "real");
  fs::create_directory_symlink(dir.path() / "real", dir.path() / "link");
  // Our own symlink in a directory only we can write is followed to the real directory, with or
  // without a trailing slash.
  for (const std::string& p : {(dir.path() / "link").string(), (dir.path() / "link").string() + "/",
                               (dir.path() / "real").string() + "//"}) {
    SCOPED_TRACE(p);
    SwapSpace swap(opts({p}, 1 << 20), *engine);
    EXPECT_EQ(swap.directories()[0].rfind((dir.path() / "real").string() + "/strata-swap-", 0), 0u)
        << swap.directories()[0];
    EXPECT_EQ(entries((dir.path() / "real").string()), 1u);
  }
  EXPECT_EQ(entries((dir.path() / "real").string()), 0u);
  // A missing path is created (mode 0700), or refused with create_paths off.
  const std::string missing = (dir.path() / "missing" / "deeper").string();
  auto no_create = opts({missing}, 1 << 20);
  no_create.create_paths = false;
  try {
    SwapSpace swap(no_create, *engine);
    ADD_FAILURE() << "created a missing path with create_paths off";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), ENOENT);
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_NE(std::string(e.what()).find("tiers.nvme.paths"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir.path() / "missing"));
  {
    SwapSpace swap(opts({missing}, 1 << 20), *engine);
    struct stat st {};
    ASSERT_EQ(lstat(missing.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0700u);
  }
  EXPECT_EQ(entries(missing), 0u);
  { std::ofstream f(dir.path() / "file"); }
  try {
    SwapSpace swap(opts({(dir.path() / "file").string()}, 1 << 20), *engine);
    ADD_FAILURE() << "a file accepted as a swap directory";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), ENOTDIR);
    EXPECT_EQ(e.exit_code(), 2);
  }
  EXPECT_THROW(SwapSpace(opts({}, 1 << 20), *engine), Error);
  // A second path failing removes what the first one created (nothing is created before every
  // path has passed its checks).
  EXPECT_THROW(
      SwapSpace(opts({(dir.path() / "real").string(), (dir.path() / "file").string()}, 1 << 20),
                *engine),
      Error);
  EXPECT_EQ(entries((dir.path() / "real").string()), 0u);
}

TEST(SwapSpace, RefusesAParentOtherUsersCanWrite) {
  st::TempDir dir("strata-swap");
  auto engine = engine_for(dir.str());
  const std::string ww = (dir.path() / "ww").string();
  fs::create_directory(ww);
  chmod(ww.c_str(), 0777);
  try {
    SwapSpace swap(opts({ww + "/"}, 1 << 20), *engine);
    ADD_FAILURE() << "a world-writable swap parent was accepted";
  } catch (const IoError& e) {
    ADD_FAILURE() << e.what();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_NE(std::string(e.what()).find("tiers.nvme.paths: " + ww), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("writable by every user"), std::string::npos) << e.what();
  }
  EXPECT_EQ(entries(ww), 0u);
  // With the sticky bit (as /tmp) others cannot move or remove our entries: accepted.
  chmod(ww.c_str(), 01777);
  SwapSpace swap(opts({ww}, 1 << 20), *engine);
  EXPECT_EQ(entries(ww), 1u);
}

// issue 15: another user pre-created the shipped placeholder directory (world-writable) and, during
// a run, replaced the swap directories with symlinks so that strata deleted files elsewhere.
TEST(SwapSpace, Issue15AnotherUsersDirectoryIsRefusedAndOursCannotBeRedirected) {
  if (!st::can_switch_user()) GTEST_SKIP() << "needs root to act as user nobody";
  st::TempDir dir("strata-swap");
  chmod(dir.str().c_str(), 0755);
  const std::string shared = (dir.path() / "tmp").string();  // like /tmp
  fs::create_directory(shared);
  chmod(shared.c_str(), 01777);
  auto engine = engine_for(dir.str());
  const std::string trap = shared + "/strata-nvme";
  ASSERT_EQ(
      st::run_as_user(
          st::kNobodyUid, st::kNobodyGid,
          [&] { return mkdir(trap.c_str(), 0777) == 0 && chmod(trap.c_str(), 0777) == 0 ? 0 : 1; }),
      0);
  try {
    SwapSpace swap(opts({trap}, 1 << 20), *engine);
    ADD_FAILURE() << "swap created in a directory owned by another user";
  } catch (const IoError& e) {
    ADD_FAILURE() << e.what();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("owned by uid 65534"), std::string::npos) << e.what();
  }
  EXPECT_EQ(entries(trap), 0u);
  // In a sticky directory the attacker can neither move our run directory away (to put a symlink
  // in its place) nor plant anything in it; removal goes through our directory fds.
  const std::string victim = (dir.path() / "victim").string();
  fs::create_directory(victim);
  { std::ofstream(victim + "/swap.bin") << "not strata's"; }
  std::string run_dir;
  {
    SwapSpace swap(opts({shared}, 1 << 20), *engine);
    run_dir = swap.directories()[0];
    const int rc = st::run_as_user(st::kNobodyUid, st::kNobodyGid, [&] {
      int bad = 0;
      if (rename(run_dir.c_str(), (shared + "/moved").c_str()) == 0) bad |= 1;
      if (symlink(victim.c_str(), (run_dir + "/x").c_str()) == 0) bad |= 2;
      if (unlink((run_dir + "/swap.bin").c_str()) == 0) bad |= 4;
      return bad;
    });
    EXPECT_EQ(rc, 0) << "bitmask of attacks that succeeded";
  }
  EXPECT_FALSE(fs::exists(run_dir));
  std::ifstream in(victim + "/swap.bin");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(text, "not strata's");
}

// While a swap space exists its files are registered for removal on a signal; a process ended by
// SIGTERM through the CLI's handler (run_signal_cleanup, then the default action) leaves nothing.
TEST(SwapSpace, SignalHandlerRemovesTheFiles) {
  st::TempDir dir("strata-swap");
  const std::size_t before = registered_cleanup_entries();
  {
    auto engine = engine_for(dir.str());
    SwapSpace swap(opts({dir.str()}, 1 << 20), *engine);
    EXPECT_EQ(registered_cleanup_entries(), before + 2);  // the directory and swap.bin
  }
  EXPECT_EQ(registered_cleanup_entries(), before);
  std::cout.flush();
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    struct sigaction sa {};
    sa.sa_handler = [](int sig) {
      run_signal_cleanup();
      signal(sig, SIG_DFL);
      raise(sig);
    };
    sigaction(SIGTERM, &sa, nullptr);
    try {
      auto engine = engine_for(dir.str());
      SwapSpace swap(opts({dir.str()}, 1 << 20), *engine);
      kill(getpid(), SIGTERM);
      pause();
    } catch (...) {
    }
    _exit(3);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status)) << status;
  EXPECT_EQ(WTERMSIG(status), SIGTERM);
  EXPECT_EQ(entries(dir.str()), 0u);
}

namespace {
// A pid that no process has now: a child that has been waited for.
long dead_pid() {
  pid_t pid = fork();
  if (pid == 0) _exit(0);
  waitpid(pid, nullptr, 0);
  return pid;
}
// A per-run directory as a killed run leaves it: its swap.bin holds `bytes`.
std::string make_leftover(const std::string& parent, const std::string& name, std::size_t bytes) {
  const std::string d = parent + "/" + name;
  fs::create_directory(d);
  chmod(d.c_str(), 0700);
  std::ofstream(d + "/swap.bin") << std::string(bytes, 'x');
  return d;
}
}  // namespace

TEST(SwapSpace, LeftoversOfDeadRunsAreRemovedByTheNextRun) {
  st::TempDir dir("strata-swap");
  const long dead = dead_pid();
  const long alive = getppid();
  const std::string d1 =
      make_leftover(dir.str(), "strata-swap-" + std::to_string(dead) + "-r0-0123abcd", 1 << 20);
  const std::string d2 = make_leftover(
      dir.str(), "strata-swap-r1-" + std::to_string(dead) + "-89abcdef", 4096);  // older name
  const std::string live =
      make_leftover(dir.str(), "strata-swap-" + std::to_string(alive) + "-r0-00000000", 100);
  const std::string other = make_leftover(dir.str(), "not-strata-" + std::to_string(dead), 100);
  std::ofstream(dir.str() + "/.strata-bench-io-" + std::to_string(dead) + "-0123456789abcdef")
      << "io";
  // The listing, without removing.
  auto found = find_swap_leftovers(dir.str(), false);
  ASSERT_EQ(found.size(), 4u);
  std::uint64_t would = 0;
  for (const auto& l : found) {
    SCOPED_TRACE(l.path);
    if (l.path == live) {
      EXPECT_EQ(l.status, SwapLeftover::Status::kRunning);
      EXPECT_EQ(l.pid, alive);
    } else {
      EXPECT_EQ(l.status, SwapLeftover::Status::kWouldRemove) << l.detail;
      EXPECT_EQ(l.pid, dead);
      would += l.bytes;
    }
  }
  EXPECT_GE(would, 1u << 20);
  EXPECT_TRUE(fs::exists(d1));
  // The next run removes what dead processes left, and says so.
  std::vector<std::string> logs;
  set_log_sink([&](LogLevel, std::string_view m) { logs.emplace_back(m); });
  {
    auto engine = engine_for(dir.str());
    SwapSpace swap(opts({dir.str()}, 1 << 20), *engine);
  }
  set_log_sink(nullptr);
  EXPECT_FALSE(fs::exists(d1));
  EXPECT_FALSE(fs::exists(d2));
  EXPECT_FALSE(
      fs::exists(dir.str() + "/.strata-bench-io-" + std::to_string(dead) + "-0123456789abcdef"));
  EXPECT_TRUE(fs::exists(live + "/swap.bin"));
  EXPECT_TRUE(fs::exists(other + "/swap.bin"));
  std::string all;
  for (auto& l : logs) all += l + "\n";
  EXPECT_NE(all.find("removed " + d1 + " left by process " + std::to_string(dead)),
            std::string::npos)
      << all;
  EXPECT_NE(all.find("freed 1 MiB"), std::string::npos) << all;
}

TEST(SwapSpace, LeftoverLockedByALiveOwnerIsKept) {
  // A run in another pid namespace: its pid looks dead here, but it holds the directory's lock.
  st::TempDir dir("strata-swap");
  const std::string d =
      make_leftover(dir.str(), "strata-swap-" + std::to_string(dead_pid()) + "-r0-0000aaaa", 10);
  const int fd = open(d.c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(flock(fd, LOCK_EX), 0);
  auto found = find_swap_leftovers(dir.str(), true);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].status, SwapLeftover::Status::kRunning) << found[0].detail;
  EXPECT_TRUE(fs::exists(d + "/swap.bin"));
  close(fd);
  found = find_swap_leftovers(d, true);  // a per-run directory named directly
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].status, SwapLeftover::Status::kRemoved) << found[0].detail;
  EXPECT_FALSE(fs::exists(d));
}

TEST(SwapSpace, LeftoverOfAnotherUser) {
  if (!st::can_switch_user()) GTEST_SKIP() << "needs root to act as user nobody";
  st::TempDir dir("strata-swap");
  chmod(dir.str().c_str(), 0755);
  const std::string d =
      make_leftover(dir.str(), "strata-swap-" + std::to_string(dead_pid()) + "-r0-0000bbbb", 10);
  ASSERT_EQ(chown(d.c_str(), st::kNobodyUid, st::kNobodyGid), 0);
  ASSERT_EQ(chown((d + "/swap.bin").c_str(), st::kNobodyUid, st::kNobodyGid), 0);
  // nobody may not remove it from a directory it cannot write...
  const int rc = st::run_as_user(st::kNobodyUid, st::kNobodyGid, [&] {
    try {
      auto found = find_swap_leftovers(dir.str(), true);
      return found.size() == 1 && found[0].status == SwapLeftover::Status::kFailed ? 0 : 1;
    } catch (...) {
      return 2;
    }
  });
  EXPECT_EQ(rc, 0);
  // ...root may.
  auto found = find_swap_leftovers(dir.str(), true);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].status, SwapLeftover::Status::kRemoved) << found[0].detail;
  EXPECT_EQ(found[0].uid, st::kNobodyUid);
  EXPECT_FALSE(fs::exists(d));
}

TEST(SwapSpace, RefusesUnwritablePath) {
  st::TempDir dir("strata-swap");
  auto engine = engine_for(dir.str());
  const std::string ro = (dir.path() / "ro").string();
  fs::create_directory(ro);
  bool immutable = false;
  if (geteuid() == 0) {
    // Root ignores permission bits; an immutable directory is unwritable even for root.
    std::string out;
    immutable = st::run_command("chattr +i " + ro, &out) == 0;
    if (!immutable) GTEST_SKIP() << "root without chattr +i: " << out;
  } else {
    chmod(ro.c_str(), 0500);
  }
  try {
    SwapSpace swap(opts({ro}, 1 << 20), *engine);
    ADD_FAILURE() << "expected an error for an unwritable path";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(ro), std::string::npos) << e.what();
    EXPECT_TRUE(e.errnum() == EACCES || e.errnum() == EPERM) << e.what();
  }
  std::string out;
  if (immutable) st::run_command("chattr -i " + ro, &out);
  chmod(ro.c_str(), 0700);
}

TEST(SwapSpace, DiskTooSmallFailsAtStartWithSizes) {
  st::TempDir dir("strata-swap");
  auto engine = engine_for(dir.str());
  // More than any disk here: refused before anything is written, sizes in the message.
  try {
    SwapSpace swap(opts({dir.str()}, 1ULL << 52), *engine);
    FAIL() << "expected ENOSPC";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), ENOSPC);
    const std::string m = e.what();
    EXPECT_NE(m.find("4503599627370496 bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("are free"), std::string::npos) << m;
  }
  EXPECT_EQ(entries(dir.str()), 0u);
}

// A real small file system: two paths on one 3 MiB tmpfs, 2 MiB each. Each passes the free-space
// check alone; the second fallocate fails with ENOSPC, and the first file is removed again.
TEST(SwapSpace, DiskTooSmallOnARealFileSystem) {
  st::TempDir dir("strata-swap");
  const std::string mnt = (dir.path() / "small").string();
  st::TmpfsMount tmpfs(mnt, "3m");
  if (!tmpfs.ok()) GTEST_SKIP() << "cannot mount tmpfs (needs root)";
  fs::create_directory(mnt + "/a");
  fs::create_directory(mnt + "/b");
  auto engine = engine_for(dir.str());
  try {
    SwapSpace swap(opts({mnt + "/a", mnt + "/b"}, 4 << 20), *engine);
    FAIL() << "expected ENOSPC";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), ENOSPC) << e.what();
    EXPECT_NE(std::string(e.what()).find("2097152"), std::string::npos) << e.what();
  }
  EXPECT_EQ(entries(mnt + "/a"), 0u);
  EXPECT_EQ(entries(mnt + "/b"), 0u);
}
