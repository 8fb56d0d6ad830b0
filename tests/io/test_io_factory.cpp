// The factory (probe, forced kinds, fallback when io_uring setup fails), options, IoFile rules
// (O_NOFOLLOW, O_EXCL, mode 0600, O_DIRECT refused on tmpfs, fallocate ENOSPC) and IoBuffer.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "strata/error.hpp"
#include "strata/io_engine.hpp"
#include "strata/log.hpp"
#include "test_util.hpp"

namespace strata {
namespace {

using namespace std::chrono_literals;
using testing::TempDir;

// Captures warnings while alive.
class LogCapture {
 public:
  LogCapture() {
    set_log_sink([this](LogLevel level, std::string_view m) {
      if (level >= LogLevel::kWarn) lines_.emplace_back(m);
    });
  }
  ~LogCapture() { set_log_sink(nullptr); }
  std::string all() const {
    std::string s;
    for (auto& l : lines_) s += l + "\n";
    return s;
  }
  std::size_t count() const { return lines_.size(); }

 private:
  std::vector<std::string> lines_;
};

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name_); }

 private:
  const char* name_;
};

void round_trip(IoEngine& engine, const std::string& path) {
  FileId id = engine.open_file(path, {.create = true});
  IoBuffer w = IoBuffer::allocate(1 << 20), r = IoBuffer::allocate(1 << 20);
  auto data = testing::random_bytes(1 << 20, testing::test_seed("factory"));
  std::memcpy(w.data(), data.data(), data.size());
  engine.wait_for(engine.submit({IoOp::kWrite, id, w.data(), 1 << 20, 0}), 30s);
  engine.wait_for(engine.submit({IoOp::kRead, id, r.data(), 1 << 20, 0}), 30s);
  EXPECT_EQ(0, std::memcmp(w.data(), r.data(), 1 << 20));
}

TEST(IoFactory, OptionsFromConfig) {
  NvmeTierConfig c;
  c.engine = IoEngineKind::kThreads;
  c.block_size = 128 << 10;
  c.queue_depth = 64;
  c.io_threads = 3;
  c.direct_io = DirectIoMode::kRequired;
  c.sqpoll = true;
  IoEngineOptions o = IoEngineOptions::from(c);
  EXPECT_EQ(o.kind, IoEngineKind::kThreads);
  EXPECT_EQ(o.block_size, 128u << 10);
  EXPECT_EQ(o.queue_depth, 64u);
  EXPECT_EQ(o.io_threads, 3u);
  EXPECT_EQ(o.direct_io, DirectIoMode::kRequired);
  EXPECT_TRUE(o.sqpoll);
  o.block_size = 1000;
  EXPECT_THROW(o.validate(), Error);
  o.block_size = 4096;
  o.queue_depth = 0;
  EXPECT_THROW(o.validate(), Error);
}

TEST(IoFactory, AutoPicksIoUringWhenAvailable) {
  TempDir dir("strata-io-factory");
  IoUringProbe p = probe_io_uring({}, dir.str());
  if (!p.ok) GTEST_SKIP() << "io_uring unavailable here: " << p.reason;
  LogCapture logs;
  auto engine = make_io_engine({}, dir.str());
  EXPECT_EQ(engine->kind(), IoEngineKind::kIoUring);
  EXPECT_EQ(logs.count(), 0u) << logs.all();
  round_trip(*engine, dir.str() + "/a");
  // The probe leaves nothing behind.
  int n = 0;
  for (auto& e : std::filesystem::directory_iterator(dir.path())) n += e.path().filename() != "a";
  EXPECT_EQ(n, 0);
}

TEST(IoFactory, ForcedThreads) {
  TempDir dir("strata-io-factory");
  IoEngineOptions o;
  o.kind = IoEngineKind::kThreads;
  auto engine = make_io_engine(o, dir.str());
  EXPECT_EQ(engine->kind(), IoEngineKind::kThreads);
  EXPECT_STREQ(engine->name(), "threads");
  round_trip(*engine, dir.str() + "/t");
}

TEST(IoFactory, SimulatedSetupFailureFallsBackWithOneLogLine) {
  TempDir dir("strata-io-factory");
  ScopedEnv env("STRATA_IO_URING_FAIL", "1");
  IoUringProbe p = probe_io_uring({}, dir.str());
  EXPECT_FALSE(p.ok);
  EXPECT_NE(p.reason.find("io_uring_setup"), std::string::npos) << p.reason;
  LogCapture logs;
  auto engine = make_io_engine({}, dir.str());
  EXPECT_EQ(engine->kind(), IoEngineKind::kThreads);
  ASSERT_EQ(logs.count(), 1u) << logs.all();
  EXPECT_NE(logs.all().find("io_uring unavailable"), std::string::npos) << logs.all();
  EXPECT_NE(logs.all().find("thread-pool"), std::string::npos) << logs.all();
  round_trip(*engine, dir.str() + "/f");
  // Direct construction fails cleanly too.
  strata::testing::expect_error(ErrorCode::kUnsupported, "", [&] { make_io_uring_engine({}); });
}

TEST(IoFactory, ForcedIoUringFailsLoudlyWhenUnavailable) {
  TempDir dir("strata-io-factory");
  ScopedEnv env("STRATA_IO_URING_FAIL", "1");
  IoEngineOptions o;
  o.kind = IoEngineKind::kIoUring;
  strata::testing::expect_error(ErrorCode::kUnsupported, "io_uring",
                                [&] { make_io_engine(o, dir.str()); });
}

// A directory that does not exist yet is probed where it will be created; a path that cannot be
// a directory is the caller's error, not "io_uring unavailable" (issue 15).
TEST(IoFactory, ProbeOfAMissingDirectoryUsesItsParentAndBadPathsAreNotIoUringsFault) {
  TempDir dir("strata-io-factory");
  const std::string missing = dir.str() + "/not/yet";
  IoUringProbe p = probe_io_uring({}, missing);
  EXPECT_FALSE(p.file_error);
  EXPECT_FALSE(std::filesystem::exists(dir.str() + "/not"));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  IoEngineOptions o;
  o.direct_io = DirectIoMode::kOff;
  EXPECT_NO_THROW(make_io_engine(o, missing));
  { std::ofstream(dir.str() + "/file") << "x"; }
  p = probe_io_uring({}, dir.str() + "/file");
  EXPECT_FALSE(p.ok);
  EXPECT_TRUE(p.file_error);
  EXPECT_NE(p.reason.find(dir.str() + "/file"), std::string::npos) << p.reason;
  LogCapture logs;
  try {
    make_io_engine(o, dir.str() + "/file/x");
    ADD_FAILURE() << "an engine for a path through a file";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), ENOTDIR) << e.what();
    EXPECT_EQ(e.exit_code(), 2);
  }
  EXPECT_EQ(logs.all().find("io_uring unavailable"), std::string::npos) << logs.all();
}

TEST(IoFactory, DirectIoRequiredOnTmpfsSaysSo) {
  const std::string shm = "/dev/shm";
  if (!std::filesystem::is_directory(shm) || !is_tmpfs(shm)) GTEST_SKIP() << "no tmpfs at /dev/shm";
  TempDir dir("strata-io-factory");
  IoEngineOptions o;
  o.direct_io = DirectIoMode::kRequired;
  try {
    make_io_engine(o, shm);
    ADD_FAILURE() << "O_DIRECT required on tmpfs accepted";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), EINVAL) << e.what();
    EXPECT_NE(std::string(e.what()).find("tmpfs has no direct I/O"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("io_uring unavailable"), std::string::npos) << e.what();
  }
}

TEST(IoFile, CreateModeExclusiveNoFollow) {
  TempDir dir("strata-io-file");
  std::string path = dir.str() + "/f";
  IoFile f = IoFile::open(path, {.create = true, .exclusive = true});
  struct stat st {};
  ASSERT_EQ(0, ::stat(path.c_str(), &st));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_TRUE(f.direct());
  EXPECT_EQ(f.alignment() % 512, 0u);
  try {
    IoFile::open(path, {.create = true, .exclusive = true});
    ADD_FAILURE() << "O_EXCL ignored";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), EEXIST);
    EXPECT_EQ(e.path(), path);
  }
  std::string link = dir.str() + "/link";
  ASSERT_EQ(0, ::symlink(path.c_str(), link.c_str()));
  try {
    IoFile::open(link, {});
    ADD_FAILURE() << "followed a symlink";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), ELOOP);
  }
  EXPECT_THROW(IoFile::open(dir.str() + "/missing", {}), IoError);
  f.allocate(1 << 20);
  EXPECT_EQ(f.size(), 1u << 20);
}

TEST(IoFile, FallocateEnospcNamesSizes) {
  // tmpfs checks the size against its limit before allocating anything (ext4 would fill the disk
  // first), so the ENOSPC path is exercised there.
  if (!is_tmpfs("/dev/shm")) GTEST_SKIP() << "/dev/shm is not tmpfs";
  std::string path = "/dev/shm/strata-io-test-enospc-" + std::to_string(::getpid());
  IoFile f = IoFile::open(path, {.create = true, .direct_io = DirectIoMode::kOff});
  ::unlink(path.c_str());
  const std::uint64_t huge = 1ULL << 50;  // 1 PiB, beyond the tmpfs size
  try {
    f.allocate(huge);
    ADD_FAILURE() << "fallocate of 1 PiB succeeded";
  } catch (const IoError& e) {
    ASSERT_EQ(e.errnum(), ENOSPC) << e.what();
    std::string m = e.what();
    EXPECT_NE(m.find(std::to_string(huge)), std::string::npos) << m;
    EXPECT_NE(m.find("free"), std::string::npos) << m;
  }
}

TEST(IoFile, ODirectRefusedOnTmpfs) {
  if (!is_tmpfs("/dev/shm")) GTEST_SKIP() << "/dev/shm is not tmpfs";
  std::string path = "/dev/shm/strata-io-test-odirect-" + std::to_string(::getpid());
  {
    LogCapture logs;
    IoFile f =
        IoFile::open(path, {.create = true, .exclusive = true, .direct_io = DirectIoMode::kAuto});
    EXPECT_FALSE(f.direct());
    EXPECT_EQ(f.alignment(), 1u);
    EXPECT_EQ(logs.count(), 1u);
    EXPECT_NE(logs.all().find("buffered"), std::string::npos) << logs.all();
  }
  try {
    IoFile::open(path, {.direct_io = DirectIoMode::kRequired});
    ADD_FAILURE() << "O_DIRECT required accepted on tmpfs";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), EINVAL);
    EXPECT_NE(std::string(e.what()).find("required"), std::string::npos) << e.what();
  }
  IoFile off = IoFile::open(path, {.direct_io = DirectIoMode::kOff});
  EXPECT_FALSE(off.direct());
  ::unlink(path.c_str());
}

TEST(IoBuffer, AlignedAndUsable) {
  for (std::size_t n : {std::size_t{1}, std::size_t{4096}, std::size_t{3} << 20}) {
    IoBuffer b = IoBuffer::allocate(n);
    ASSERT_TRUE(b);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % (2 << 20), 0u);
    EXPECT_EQ(b.size(), n);
    std::memset(b.data(), 0x3c, n);
    EXPECT_EQ(b.bytes()[n - 1], 0x3c);
    IoBuffer moved = std::move(b);
    EXPECT_FALSE(b);
    EXPECT_EQ(moved.size(), n);
  }
  EXPECT_THROW(IoBuffer::allocate(0), Error);
}

}  // namespace
}  // namespace strata
