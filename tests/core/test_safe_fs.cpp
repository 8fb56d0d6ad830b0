// SafeDir: directories walked by fd, refused when another user could redirect what strata
// creates or removes there. The attacks run as user `nobody` (skipped when not root).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <string>

#include "core/safe_fs.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

using namespace strata;
using strata::testing::kNobodyGid;
using strata::testing::kNobodyUid;
using strata::testing::TempDir;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Expects f() to throw Error(kInvalidArgument) whose message contains every needle.
template <typename F>
void expect_refused(F&& f, std::initializer_list<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "expected Error(kInvalidArgument)";
  } catch (const IoError& e) {
    ADD_FAILURE() << "expected Error(kInvalidArgument), got IoError: " << e.what();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_EQ(e.exit_code(), 2);
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "'" << n << "' not in: " << e.what();
  }
}

template <typename F>
int io_errno(F&& f) {
  try {
    f();
  } catch (const IoError& e) {
    return e.errnum();
  }
  return 0;
}

// A directory tree for the attacks: base (ours, 0755) / shared (root, 1777, like /tmp).
struct SharedTree {
  TempDir tmp{"strata-safefs"};
  std::string base = tmp.str();
  std::string shared = base + "/shared";
  SharedTree() {
    ::chmod(base.c_str(), 0755);
    ::mkdir(shared.c_str(), 0777);
    ::chmod(shared.c_str(), 01777);
  }
};

}  // namespace

struct NormalizeCase {
  const char* in;
  const char* out;
};
class NormalizePath : public ::testing::TestWithParam<NormalizeCase> {};
TEST_P(NormalizePath, RemovesTrailingRepeatedSlashesAndDots) {
  EXPECT_EQ(normalize_path(GetParam().in), GetParam().out);
}
INSTANTIATE_TEST_SUITE_P(
    Cases, NormalizePath,
    ::testing::Values(NormalizeCase{"", ""}, NormalizeCase{"/", "/"}, NormalizeCase{"//", "/"},
                      NormalizeCase{"link/", "link"}, NormalizeCase{"link//", "link"},
                      NormalizeCase{"/a//b/./c/", "/a/b/c"}, NormalizeCase{"./", "."},
                      NormalizeCase{"a/../b", "a/../b"}, NormalizeCase{"/tmp/x/.", "/tmp/x"}));

TEST(SafeFs, CreatesPrivateFilesAndDirectoriesRelativeToTheDirectoryFd) {
  TempDir tmp;
  SafeDir d = SafeDir::open(tmp.str() + "/./");
  EXPECT_EQ(d.path(), normalize_path(tmp.str()));
  {
    UniqueFd f = d.create_file("a.tmp", O_RDWR);
    ASSERT_TRUE(f);
    ASSERT_EQ(::write(f.get(), "xyz", 3), 3);
    struct stat st {};
    ASSERT_EQ(::fstat(f.get(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0600u);
  }
  // O_EXCL: an existing name is never reused, and that is a path error (exit code 2).
  try {
    d.create_file("a.tmp", O_RDWR);
    ADD_FAILURE() << "create_file over an existing file succeeded";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), EEXIST);
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_NE(std::string(e.what()).find(d.child_path("a.tmp")), std::string::npos) << e.what();
  }
  d.rename("a.tmp", "a");
  d.sync();
  EXPECT_EQ(read_file(tmp.str() + "/a"), "xyz");
  SafeDir sub = d.make_dir("sub");
  struct stat st {};
  ASSERT_TRUE(d.stat_entry("sub", &st));
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  EXPECT_EQ(sub.path(), d.child_path("sub"));
  auto names = d.entries();
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "sub"}));
  EXPECT_EQ(io_errno([&] { d.make_dir("sub"); }), EEXIST);
  d.remove_file("a");
  d.remove_dir("sub");
  EXPECT_FALSE(d.stat_entry("a", &st));
  EXPECT_EQ(d.try_remove("a", false), ENOENT);
  EXPECT_TRUE(d.entries().empty());
}

TEST(SafeFs, NamesMustBeOneComponent) {
  TempDir tmp;
  SafeDir d = SafeDir::open(tmp.str());
  for (const char* bad : {"", ".", "..", "a/b", "/etc/passwd"}) {
    SCOPED_TRACE(bad);
    expect_refused([&] { d.create_file(bad, O_RDWR); }, {"single file name"});
    EXPECT_EQ(d.try_remove(bad, false), EINVAL);
  }
}

TEST(SafeFs, MissingOrNonDirectoryPathsArePathErrors) {
  TempDir tmp;
  try {
    SafeDir::open(tmp.str() + "/missing/x", {.role = "tiers.nvme.paths"});
    ADD_FAILURE() << "opened a missing directory";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), ENOENT);
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_NE(std::string(e.what()).find("tiers.nvme.paths"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(tmp.str() + "/missing"), std::string::npos) << e.what();
  }
  write_file(tmp.str() + "/file", "x");
  EXPECT_EQ(io_errno([&] { SafeDir::open(tmp.str() + "/file"); }), ENOTDIR);
  EXPECT_EQ(io_errno([&] { SafeDir::open(tmp.str() + "/file/"); }), ENOTDIR);
  expect_refused([&] { SafeDir::open(""); }, {"empty path"});
}

TEST(SafeFs, CreateMakesMissingDirectoriesPrivate) {
  TempDir tmp;
  SafeDir d = SafeDir::open(tmp.str() + "/a/b/c/", {.create = true});
  EXPECT_EQ(d.path(), tmp.str() + "/a/b/c");
  for (const char* p : {"/a", "/a/b", "/a/b/c"}) {
    struct stat st {};
    ASSERT_EQ(::lstat((tmp.str() + p).c_str(), &st), 0) << p;
    EXPECT_TRUE(S_ISDIR(st.st_mode)) << p;
    EXPECT_EQ(st.st_mode & 07777, 0700u) << p;
  }
  // Opening again creates nothing and succeeds.
  EXPECT_EQ(SafeDir::open(tmp.str() + "/a/b/c", {.create = true}).path(), d.path());
}

TEST(SafeFs, RelativePathsResolveFromTheWorkingDirectory) {
  TempDir tmp;
  ::mkdir((tmp.str() + "/rel").c_str(), 0700);
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof cwd), nullptr);
  ASSERT_EQ(::chdir(tmp.str().c_str()), 0);
  std::string got;
  try {
    got = SafeDir::open("rel/").path();
  } catch (...) {
    ASSERT_EQ(::chdir(cwd), 0);
    throw;
  }
  ASSERT_EQ(::chdir(cwd), 0);
  EXPECT_EQ(got, tmp.str() + "/rel");
}

TEST(SafeFs, FollowsOurOwnSymlinksToTheRealDirectory) {
  TempDir tmp;
  ::mkdir((tmp.str() + "/real").c_str(), 0700);
  ASSERT_EQ(::symlink("real", (tmp.str() + "/link").c_str()), 0);
  ASSERT_EQ(::symlink((tmp.str() + "/link").c_str(), (tmp.str() + "/abs").c_str()), 0);
  for (const char* p : {"/link", "/link/", "/abs//", "/abs/../real"}) {
    SCOPED_TRACE(p);
    EXPECT_EQ(SafeDir::open(tmp.str() + p).path(), tmp.str() + "/real");
  }
  ASSERT_EQ(::symlink("loop", (tmp.str() + "/loop").c_str()), 0);
  EXPECT_EQ(io_errno([&] { SafeDir::open(tmp.str() + "/loop"); }), ELOOP);
  // A file opened by name is never opened through a symlink.
  SafeDir d = SafeDir::open(tmp.str());
  write_file(tmp.str() + "/real/f", "data");
  ASSERT_EQ(::symlink("real/f", (tmp.str() + "/flink").c_str()), 0);
  EXPECT_EQ(io_errno([&] { d.open_file("flink", O_RDONLY); }), ELOOP);
  EXPECT_EQ(io_errno([&] { d.create_file("flink", O_RDWR); }), EEXIST);
  const int dir_errno = io_errno([&] { d.open_dir("link"); });  // O_DIRECTORY | O_NOFOLLOW
  EXPECT_TRUE(dir_errno == ENOTDIR || dir_errno == ELOOP) << dir_errno;
}

TEST(SafeFs, RefusesWorldWritableDirectoryWithoutStickyBit) {
  TempDir tmp;
  const std::string ww = tmp.str() + "/ww";
  ::mkdir(ww.c_str(), 0700);
  ::chmod(ww.c_str(), 0777);
  expect_refused([&] { SafeDir::open(ww + "/", {.role = "tiers.nvme.paths"}); },
                 {"tiers.nvme.paths", ww, "writable by every user", "0777", "sticky"});
  // ... also as a directory on the way to the one asked for.
  ::mkdir((ww + "/sub").c_str(), 0700);
  expect_refused([&] { SafeDir::open(ww + "/sub"); }, {ww + " is writable by every user"});
  ::chmod(ww.c_str(), 01777);  // sticky, like /tmp: fine
  EXPECT_EQ(SafeDir::open(ww + "/sub").path(), ww + "/sub");
  EXPECT_EQ(SafeDir::open(ww).path(), ww);
}

TEST(SafeFs, GroupWritableIsRefusedUnlessTheGroupIsOurs) {
  TempDir tmp;
  const std::string g = tmp.str() + "/g";
  ::mkdir(g.c_str(), 0700);
  ::chmod(g.c_str(), 0770);
  EXPECT_EQ(SafeDir::open(g).path(), g);  // our own group
  if (!strata::testing::can_switch_user()) GTEST_SKIP() << "needs root to chgrp";
  ASSERT_EQ(::chown(g.c_str(), ::geteuid(), kNobodyGid), 0);
  expect_refused([&] { SafeDir::open(g); }, {"writable by group 65534", "0770"});
}

// Read-only: an unsafe directory opens (reports only), and nothing can be written through it.
TEST(SafeFs, ReadOnlyOpensUnsafeDirectoriesAndRefusesEveryWrite) {
  TempDir tmp;
  const std::string ww = tmp.str() + "/ww";
  ::mkdir(ww.c_str(), 0700);
  ::mkdir((ww + "/sub").c_str(), 0700);
  write_file(ww + "/f", "data");
  ::chmod(ww.c_str(), 0777);
  expect_refused([&] { SafeDir::open(ww); }, {"writable by every user"});
  const SafeDir d = SafeDir::open(ww + "/", {.role = "checkpoint info", .read_only = true});
  EXPECT_EQ(d.path(), ww);
  EXPECT_TRUE(d.read_only());
  {
    UniqueFd fd = d.open_file("f", O_RDONLY);
    char buf[8] = {};
    EXPECT_EQ(::read(fd.get(), buf, sizeof buf), 4);
    EXPECT_EQ(std::string(buf), "data");
  }
  auto expect_internal = [](auto&& f, const std::string& what) {
    SCOPED_TRACE(what);
    strata::testing::expect_error(ErrorCode::kInternal, "opened read-only", [&] { f(); });
  };
  expect_internal([&] { d.create_file("new", O_WRONLY); }, "create_file");
  expect_internal([&] { d.open_file("f", O_WRONLY); }, "open_file O_WRONLY");
  expect_internal([&] { d.open_file("f", O_RDONLY | O_TRUNC); }, "open_file O_TRUNC");
  expect_internal([&] { d.make_dir("newdir"); }, "make_dir");
  expect_internal([&] { d.rename("f", "g"); }, "rename");
  expect_internal([&] { d.remove_file("f"); }, "remove_file");
  EXPECT_EQ(d.try_remove("f", false), EROFS);
  EXPECT_EQ(read_file(ww + "/f"), "data");  // nothing changed
  EXPECT_FALSE(std::ifstream(ww + "/new").good());
  const SafeDir sub = d.open_dir("sub");  // read-only too
  EXPECT_TRUE(sub.read_only());
  expect_internal([&] { sub.create_file("x", O_WRONLY); }, "create_file in open_dir's result");
  expect_internal([&] { SafeDir::open(ww, {.create = true, .read_only = true}); },
                  "read_only with create");
}

// ---- attacks by another local user -------------------------------------------------------------

TEST(SafeFsAttack, DirectoryOwnedByAnotherUserIsRefused) {
  if (!strata::testing::can_switch_user()) GTEST_SKIP() << "needs root to act as user nobody";
  SharedTree t;
  // The reproducer: another user pre-creates the placeholder directory, world-writable.
  const std::string trap = t.shared + "/strata-nvme";
  ASSERT_EQ(strata::testing::run_as_user(kNobodyUid, kNobodyGid,
                                         [&] {
                                           if (::mkdir(trap.c_str(), 0777) != 0) return 1;
                                           return ::chmod(trap.c_str(), 0777) == 0 ? 0 : 2;
                                         }),
            0);
  expect_refused([&] { SafeDir::open(trap, {.role = "tiers.nvme.paths"}); },
                 {"tiers.nvme.paths", trap, "owned by uid 65534"});
  expect_refused([&] { SafeDir::open(trap + "/", {.create = true}); }, {"owned by uid 65534"});
  // Private to nobody does not help either: its owner can still swap entries.
  ASSERT_EQ(strata::testing::run_as_user(kNobodyUid, kNobodyGid,
                                         [&] { return ::chmod(trap.c_str(), 0700) == 0 ? 0 : 1; }),
            0);
  expect_refused([&] { SafeDir::open(trap); }, {"owned by uid 65534"});
}

TEST(SafeFsAttack, SymlinkPlantedByAnotherUserIsNotFollowedEvenWithTrailingSlash) {
  if (!strata::testing::can_switch_user()) GTEST_SKIP() << "needs root to act as user nobody";
  SharedTree t;
  const std::string victim = t.base + "/victim";
  ::mkdir(victim.c_str(), 0700);
  const std::string link = t.shared + "/link";
  ASSERT_EQ(strata::testing::run_as_user(kNobodyUid, kNobodyGid,
                                         [&] { return ::symlink(victim.c_str(), link.c_str()); }),
            0);
  for (const std::string& p : {link, link + "/", link + "//", link + "/."}) {
    SCOPED_TRACE(p);
    expect_refused([&] { SafeDir::open(p, {.role = "tiers.nvme.paths"}); },
                   {"refusing to follow the symbolic link", link, "owned by uid 65534"});
  }
}

TEST(SafeFsAttack, PlantedSymlinkAtATempFileNameRedirectsNothing) {
  if (!strata::testing::can_switch_user()) GTEST_SKIP() << "needs root to act as user nobody";
  SharedTree t;
  const std::string victim = t.base + "/precious";
  write_file(victim, "precious data");
  const std::string planted = t.shared + "/manifest.json.tmp";
  ASSERT_EQ(strata::testing::run_as_user(
                kNobodyUid, kNobodyGid, [&] { return ::symlink(victim.c_str(), planted.c_str()); }),
            0);
  SafeDir d = SafeDir::open(t.shared);
  EXPECT_EQ(io_errno([&] { d.create_file("manifest.json.tmp", O_WRONLY | O_TRUNC); }), EEXIST);
  EXPECT_EQ(io_errno([&] { d.open_file("manifest.json.tmp", O_WRONLY | O_TRUNC); }), ELOOP);
  // Removing the name removes the link, never its target.
  d.remove_file("manifest.json.tmp");
  EXPECT_EQ(read_file(victim), "precious data");
}

TEST(SafeFsAttack, AnotherUserCannotMoveOrEmptyOurDirectoryInAStickyParent) {
  if (!strata::testing::can_switch_user()) GTEST_SKIP() << "needs root to act as user nobody";
  SharedTree t;
  SafeDir shared = SafeDir::open(t.shared);
  SafeDir run = shared.make_dir("strata-swap-1-r0-abc");
  run.create_file("swap.bin", O_RDWR);
  const std::string rp = run.path();
  const int rc = strata::testing::run_as_user(kNobodyUid, kNobodyGid, [&] {
    int bad = 0;
    if (::rename(rp.c_str(), (t.shared + "/moved").c_str()) == 0) bad |= 1;
    if (::rmdir(rp.c_str()) == 0) bad |= 2;
    if (::unlink((rp + "/swap.bin").c_str()) == 0) bad |= 4;
    if (::symlink("/etc", (rp + "/x").c_str()) == 0) bad |= 8;
    return bad;
  });
  EXPECT_EQ(rc, 0) << "bitmask of attacks that succeeded";
  run.remove_file("swap.bin");
  shared.remove_dir("strata-swap-1-r0-abc");
}
