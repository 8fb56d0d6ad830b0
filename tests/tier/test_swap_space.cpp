#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "strata/error.hpp"
#include "strata/io_engine.hpp"
#include "tier/swap_space.hpp"
#include "test_util.hpp"
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
    EXPECT_NE(sdir.find("strata-swap-r3-"), std::string::npos);
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
  engine->wait_for(engine->submit(IoRequest{IoOp::kWrite, swap.file(), data.data(), e.length, e.offset}), 10s);
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
  try {
    swap.allocate(100 << 10, "buffer 'second'");
    FAIL() << "expected kBudget";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBudget);
    EXPECT_NE(std::string(e.what()).find("buffer 'second'"), std::string::npos) << e.what();
  }
  swap.free(e1);
  EXPECT_EQ(swap.used(), 0u);
  swap.free(swap.allocate(256 << 10, "all"));
}

TEST(SwapSpace, RefusesSymlinkedMissingAndNonDirectoryPaths) {
  st::TempDir dir("strata-swap");
  auto engine = engine_for(dir.str());
  fs::create_directory(dir.path() / "real");
  fs::create_directory_symlink(dir.path() / "real", dir.path() / "link");
  try {
    SwapSpace swap(opts({(dir.path() / "link").string()}, 1 << 20), *engine);
    FAIL() << "expected an error for a symlinked path";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("symbolic link"), std::string::npos) << e.what();
  }
  EXPECT_EQ(entries((dir.path() / "real").string()), 0u);
  EXPECT_THROW(SwapSpace(opts({(dir.path() / "missing").string()}, 1 << 20), *engine), IoError);
  { std::ofstream f(dir.path() / "file"); }
  EXPECT_THROW(SwapSpace(opts({(dir.path() / "file").string()}, 1 << 20), *engine), Error);
  EXPECT_THROW(SwapSpace(opts({}, 1 << 20), *engine), Error);
  // A second path failing removes what the first one created.
  EXPECT_THROW(SwapSpace(opts({(dir.path() / "real").string(), (dir.path() / "link").string()},
                              1 << 20), *engine), Error);
  EXPECT_EQ(entries((dir.path() / "real").string()), 0u);
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
