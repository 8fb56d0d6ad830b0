// Both engines: random aligned round trips, striping, batches, concurrent submitters, registered
// buffers, short transfers / EAGAIN / EINTR / errors (raw-result hook), misalignment, timeouts,
// shutdown with requests in flight.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "io/engine_base.hpp"
#include "strata/error.hpp"
#include "strata/io_engine.hpp"
#include "test_util.hpp"

namespace strata {
namespace {

using namespace std::chrono_literals;
using testing::TempDir;

constexpr std::uint64_t kBlock = 64 << 10;

std::unique_ptr<IoEngine> make(IoEngineKind kind, IoEngineOptions o = {}) {
  o.kind = kind;
  return kind == IoEngineKind::kIoUring ? make_io_uring_engine(o) : make_thread_io_engine(o);
}

IoEngineOptions small_options(std::uint32_t qd = 8, std::uint32_t threads = 1) {
  IoEngineOptions o;
  o.block_size = kBlock;
  o.queue_depth = qd;
  o.io_threads = threads;
  o.direct_io = DirectIoMode::kAuto;
  return o;
}

std::shared_ptr<IoFile> open_file(const std::string& path,
                                  DirectIoMode mode = DirectIoMode::kAuto) {
  IoFileOptions fo;
  fo.create = true;
  fo.direct_io = mode;
  return std::make_shared<IoFile>(IoFile::open(path, fo));
}

class EngineTest : public ::testing::TestWithParam<IoEngineKind> {
 protected:
  void TearDown() override { io::set_raw_result_hook(nullptr); }
  TempDir dir_{"strata-io"};
};

std::string kind_name(const ::testing::TestParamInfo<IoEngineKind>& info) {
  return info.param == IoEngineKind::kIoUring ? "io_uring" : "threads";
}

TEST_P(EngineTest, RandomAlignedRoundTrip) {
  auto seed = testing::test_seed("RandomAlignedRoundTrip");
  std::mt19937_64 rng(seed);
  for (std::uint32_t threads : {1u, 3u}) {
    auto engine = make(GetParam(), small_options(4, threads));
    auto file = open_file(dir_.str() + "/rt" + std::to_string(threads));
    ASSERT_TRUE(file->direct()) << "ext4 /tmp should take O_DIRECT";
    FileId id = engine->register_file(file);
    const std::uint64_t a = engine->alignment(id);
    const std::uint64_t space = 3 * 1024 * 1024 + 5 * a;  // uneven
    IoBuffer ref = IoBuffer::allocate(space);
    auto data = testing::random_bytes(space, seed + threads);
    std::memcpy(ref.data(), data.data(), space);
    // Write everything in random aligned chunks.
    std::vector<IoTicket> tickets;
    for (std::uint64_t pos = 0; pos < space;) {
      std::uint64_t len = std::min<std::uint64_t>(space - pos, (1 + rng() % 70) * a);
      tickets.push_back(engine->submit({IoOp::kWrite, id, ref.bytes() + pos, len, pos}));
      pos += len;
    }
    for (auto t : tickets) ASSERT_TRUE(engine->wait(t, 30s));
    // Read random aligned ranges and compare.
    IoBuffer got = IoBuffer::allocate(space);
    for (int i = 0; i < 40; ++i) {
      std::uint64_t off = (rng() % (space / a)) * a;
      std::uint64_t len = std::min<std::uint64_t>(space - off, (1 + rng() % 100) * a);
      std::memset(got.data(), 0xA5, len);
      IoTicket t = engine->submit({IoOp::kRead, id, got.bytes(), len, off});
      ASSERT_TRUE(engine->wait(t, 30s));
      ASSERT_EQ(0, std::memcmp(got.bytes(), ref.bytes() + off, len))
          << "off " << off << " len " << len;
    }
    IoStats s = engine->stats();
    EXPECT_EQ(s.bytes_written, space);
    EXPECT_GT(s.bytes_read, 0u);
    EXPECT_GT(s.pieces, s.requests);  // requests were split at block_size
    EXPECT_EQ(s.failures, 0u);
  }
}

TEST_P(EngineTest, BatchAndWaitAllAndPoll) {
  auto engine = make(GetParam(), small_options());
  FileId id = engine->register_file(open_file(dir_.str() + "/batch"));
  const std::uint64_t n = 9, len = 3 * kBlock + 8192;
  IoBuffer buf = IoBuffer::allocate(n * len);
  auto data = testing::random_bytes(n * len, testing::test_seed("batch"));
  std::memcpy(buf.data(), data.data(), data.size());
  std::vector<IoRequest> reqs;
  for (std::uint64_t i = 0; i < n; ++i)
    reqs.push_back({IoOp::kWrite, id, buf.bytes() + i * len, len, i * len});
  IoTicket t = engine->submit_batch(reqs);
  ASSERT_TRUE(engine->wait(t, 30s));
  EXPECT_TRUE(engine->poll(t));  // retired tickets count as done
  IoBuffer back = IoBuffer::allocate(n * len);
  for (auto& r : reqs) {
    r.op = IoOp::kRead;
    r.buffer = back.bytes() + (static_cast<std::uint8_t*>(r.buffer) - buf.bytes());
  }
  // Reverse order, one ticket each, then wait_all.
  for (auto it = reqs.rbegin(); it != reqs.rend(); ++it) engine->submit(*it);
  ASSERT_TRUE(engine->wait_all(30s));
  EXPECT_EQ(0, std::memcmp(back.data(), buf.data(), n * len));
  IoTicket p = engine->submit(reqs[0]);
  bool done = false;
  for (int i = 0; i < 10000 && !done; ++i) {
    done = engine->poll(p);
    if (!done) std::this_thread::sleep_for(1ms);
  }
  EXPECT_TRUE(done);
  EXPECT_THROW(engine->wait(999999, 1ms), Error);  // never issued
}

TEST_P(EngineTest, StripedOverThreeFiles) {
  auto engine = make(GetParam(), small_options(8, 2));
  std::vector<std::shared_ptr<IoFile>> files;
  for (int i = 0; i < 3; ++i) files.push_back(open_file(dir_.str() + "/s" + std::to_string(i)));
  FileId id = engine->register_striped(files);
  EXPECT_NE(engine->describe_file(id).find("|"), std::string::npos);
  const std::uint64_t total = 10 * kBlock + 3 * 4096;  // last stripe partial
  IoBuffer buf = IoBuffer::allocate(total);
  auto data = testing::random_bytes(total, testing::test_seed("striped"));
  std::memcpy(buf.data(), data.data(), total);
  ASSERT_TRUE(engine->wait(engine->submit({IoOp::kWrite, id, buf.data(), total, 0}), 30s));
  // Each file holds its stripes: block b in file b%3 at (b/3)*kBlock.
  IoBuffer file_bytes = IoBuffer::allocate(kBlock);
  for (std::uint64_t b = 0; b * kBlock < total; ++b) {
    std::uint64_t len = std::min(kBlock, total - b * kBlock);
    ssize_t n = ::pread(files[b % 3]->fd(), file_bytes.data(), len, (b / 3) * kBlock);
    ASSERT_EQ(static_cast<ssize_t>(len), n);
    ASSERT_EQ(0, std::memcmp(file_bytes.data(), buf.bytes() + b * kBlock, len)) << "block " << b;
  }
  // Unaligned-to-stripe read through the striped space.
  IoBuffer back = IoBuffer::allocate(total);
  const std::uint64_t off = kBlock - 8192, len = 5 * kBlock;
  ASSERT_TRUE(engine->wait(engine->submit({IoOp::kRead, id, back.data(), len, off}), 30s));
  EXPECT_EQ(0, std::memcmp(back.data(), buf.bytes() + off, len));
}

TEST_P(EngineTest, ManyConcurrentSubmitters) {
  auto engine = make(GetParam(), small_options(16, 2));
  FileId id = engine->register_file(open_file(dir_.str() + "/conc"));
  const int kThreads = 8, kOps = 12;
  const std::uint64_t region = 2 * kBlock + 4096;
  std::atomic<int> bad{0};
  auto seed = testing::test_seed("concurrent");
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      IoBuffer w = IoBuffer::allocate(region), r = IoBuffer::allocate(region);
      for (int i = 0; i < kOps; ++i) {
        auto data = testing::random_bytes(region, seed + t * 1000 + i);
        std::memcpy(w.data(), data.data(), region);
        std::uint64_t off = t * region;
        try {
          engine->wait_for(engine->submit({IoOp::kWrite, id, w.data(), region, off}), 30s);
          engine->wait_for(engine->submit({IoOp::kRead, id, r.data(), region, off}), 30s);
        } catch (...) {
          ++bad;
          continue;
        }
        if (std::memcmp(w.data(), r.data(), region) != 0) ++bad;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(engine->stats().requests, static_cast<std::uint64_t>(2 * kThreads * kOps));
}

TEST_P(EngineTest, RegisteredBuffers) {
  auto engine = make(GetParam(), small_options());
  FileId id = engine->register_file(open_file(dir_.str() + "/fixed"));
  IoBuffer pool = IoBuffer::allocate(4 << 20);
  IoRegion region{pool.data(), pool.size()};
  engine->register_buffers(std::span<const IoRegion>(&region, 1));
  auto data = testing::random_bytes(1 << 20, testing::test_seed("fixed"));
  std::memcpy(pool.data(), data.data(), data.size());
  ASSERT_TRUE(engine->wait(engine->submit({IoOp::kWrite, id, pool.data(), 1 << 20, 0}), 30s));
  ASSERT_TRUE(
      engine->wait(engine->submit({IoOp::kRead, id, pool.bytes() + (2 << 20), 1 << 20, 0}), 30s));
  EXPECT_EQ(0, std::memcmp(pool.bytes() + (2 << 20), data.data(), data.size()));
  // Outside the region: normal I/O.
  IoBuffer other = IoBuffer::allocate(1 << 20);
  ASSERT_TRUE(engine->wait(engine->submit({IoOp::kRead, id, other.data(), 1 << 20, 0}), 30s));
  EXPECT_EQ(0, std::memcmp(other.data(), data.data(), data.size()));
  if (GetParam() == IoEngineKind::kIoUring)
    EXPECT_GE(engine->stats().fixed_pieces, 2 * (1u << 20) / kBlock);
  else
    EXPECT_EQ(engine->stats().fixed_pieces, 0u);
}

TEST_P(EngineTest, MisalignedRejectedBeforeSubmission) {
  auto engine = make(GetParam(), small_options());
  auto file = open_file(dir_.str() + "/mis");
  ASSERT_TRUE(file->direct());
  FileId id = engine->register_file(file);
  IoBuffer buf = IoBuffer::allocate(1 << 20);
  const std::uint64_t a = engine->alignment(id);
  ASSERT_GE(a, 512u);
  auto expect_invalid = [&](IoRequest r, const char* what) {
    strata::testing::expect_error(ErrorCode::kInvalidArgument, what, [&] { engine->submit(r); });
  };
  expect_invalid({IoOp::kWrite, id, buf.bytes() + 1, a, 0}, "buffer address");
  expect_invalid({IoOp::kWrite, id, buf.data(), a, 1}, "offset");
  expect_invalid({IoOp::kWrite, id, buf.data(), a + 1, 0}, "length");
  expect_invalid({IoOp::kWrite, id, buf.data(), 0, 0}, "zero length");
  expect_invalid({IoOp::kWrite, 777, buf.data(), a, 0}, "unknown file");
  // A batch with one bad request submits nothing.
  std::vector<IoRequest> batch = {{IoOp::kWrite, id, buf.data(), a, 0},
                                  {IoOp::kWrite, id, buf.data(), a, a + 1}};
  EXPECT_THROW(engine->submit_batch(batch), Error);
  EXPECT_EQ(engine->stats().pieces, 0u);
  EXPECT_EQ(file->size(), 0u);
}

TEST_P(EngineTest, ShortTransfersAndRetriesAreCompleted) {
  auto engine = make(GetParam(), small_options());
  FileId id = engine->register_file(open_file(dir_.str() + "/short"));
  std::atomic<int> calls{0};
  // First attempt of every piece: short by a non-aligned amount; second: -EAGAIN; third: -EINTR.
  io::set_raw_result_hook([&](const io::Piece& p, long r) -> long {
    int c = calls++;
    if (p.attempts == 0 && p.done == 0 && r > 0 && c % 2 == 0) {
      // pretend only part was transferred (kernel really did all; the engine redoes the rest)
      long part = std::min<long>(r, 12345);
      return part;
    }
    if (p.attempts == 0 && c % 2 == 1) return -EAGAIN;
    if (p.attempts == 1 && c % 3 == 0) return -EINTR;
    return r;
  });
  const std::uint64_t len = 5 * kBlock;
  IoBuffer w = IoBuffer::allocate(len), r = IoBuffer::allocate(len);
  auto data = testing::random_bytes(len, testing::test_seed("short"));
  std::memcpy(w.data(), data.data(), len);
  ASSERT_TRUE(engine->wait(engine->submit({IoOp::kWrite, id, w.data(), len, 0}), 30s));
  ASSERT_TRUE(engine->wait(engine->submit({IoOp::kRead, id, r.data(), len, 0}), 30s));
  io::set_raw_result_hook(nullptr);
  EXPECT_EQ(0, std::memcmp(w.data(), r.data(), len));
  EXPECT_GT(engine->stats().retries, 0u);
}

TEST_P(EngineTest, KernelErrorSurfacesAtWaitWithContext) {
  auto engine = make(GetParam(), small_options());
  auto file = open_file(dir_.str() + "/err");
  FileId id = engine->register_file(file);
  const std::uint64_t len = 4 * kBlock;
  IoBuffer w = IoBuffer::allocate(len);
  io::set_raw_result_hook(
      [&](const io::Piece& p, long r) -> long { return p.offset == 2 * kBlock ? -EIO : r; });
  IoTicket t = engine->submit({IoOp::kWrite, id, w.data(), len, 0});
  try {
    engine->wait(t, 30s);
    ADD_FAILURE() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), EIO);
    EXPECT_EQ(e.offset(), 2 * kBlock);
    EXPECT_EQ(e.length(), kBlock);
    EXPECT_EQ(e.path(), file->path());
    EXPECT_EQ(e.op(), "write");
  }
  io::set_raw_result_hook(nullptr);
  EXPECT_TRUE(engine->poll(t));  // retired
  EXPECT_EQ(engine->stats().failures, 1u);
}

TEST_P(EngineTest, ReadPastEndOfFileFails) {
  auto engine = make(GetParam(), small_options());
  auto file = open_file(dir_.str() + "/eof");
  FileId id = engine->register_file(file);
  IoBuffer b = IoBuffer::allocate(2 * kBlock);
  std::memset(b.data(), 7, 2 * kBlock);
  ASSERT_TRUE(engine->wait(engine->submit({IoOp::kWrite, id, b.data(), kBlock, 0}), 30s));
  try {
    engine->wait(engine->submit({IoOp::kRead, id, b.data(), 2 * kBlock, 0}), 30s);
    ADD_FAILURE() << "read past EOF succeeded";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), 0);
    EXPECT_NE(std::string(e.what()).find("short read"), std::string::npos) << e.what();
  }
}

TEST_P(EngineTest, WaitTimesOutAndShutdownDrains) {
  auto engine = make(GetParam(), small_options(2));
  FileId id = engine->register_file(open_file(dir_.str() + "/slow"));
  // Completions are held (on the ring/worker thread) until the gate opens: the first write
  // cannot be done before it, however the threads are scheduled.
  std::atomic<bool> gate_closed{true};
  io::set_raw_result_hook([&](const io::Piece&, long r) -> long {
    while (gate_closed) std::this_thread::sleep_for(1ms);
    return r;
  });
  const std::uint64_t len = 8 * kBlock;
  IoBuffer w = IoBuffer::allocate(len);
  std::memset(w.data(), 0x5a, len);
  IoTicket t = engine->submit({IoOp::kWrite, id, w.data(), len, 0});
  EXPECT_FALSE(engine->wait(t, 1ms));
  EXPECT_THROW(engine->wait_for(t, 1ms), Error);
  IoTicket t2 = engine->submit({IoOp::kWrite, id, w.data(), len, len});
  gate_closed = false;
  engine->shutdown();  // drains both
  EXPECT_TRUE(engine->wait(t, 1s));
  EXPECT_TRUE(engine->wait(t2, 1s));
  strata::testing::expect_error(ErrorCode::kCancelled, "", [&] {
    engine->submit({IoOp::kWrite, id, w.data(), len, 0});
  });
}

TEST_P(EngineTest, ShutdownTimeoutCancelsQueued) {
  IoEngineOptions o = small_options(1);
  o.shutdown_timeout = 30ms;
  auto engine = make(GetParam(), o);
  FileId id = engine->register_file(open_file(dir_.str() + "/cancel"));
  std::atomic<int> ran{0};
  io::set_raw_result_hook([&](const io::Piece&, long r) -> long {
    ++ran;
    std::this_thread::sleep_for(50ms);
    return r;
  });
  // 64 pieces at >= 50 ms each, queue depth 1: draining them all takes >= 3.2 s, 100 times the
  // timeout, so shutdown() returns by cancelling (not by draining) however the threads run.
  const std::uint64_t len = 64 * kBlock;
  IoBuffer w = IoBuffer::allocate(len);
  std::memset(w.data(), 1, len);
  IoTicket t = engine->submit({IoOp::kWrite, id, w.data(), len, 0});
  engine->shutdown();
  EXPECT_LT(ran.load(), 64) << "shutdown drained everything instead of cancelling";
  strata::testing::expect_error(ErrorCode::kCancelled, "", [&] { engine->wait(t, 5s); });
}

TEST_P(EngineTest, BufferedFileOnTmpfs) {
  if (!is_tmpfs("/dev/shm")) GTEST_SKIP() << "/dev/shm is not tmpfs";
  TempDir shm_dir("strata-io");
  std::string path = "/dev/shm/strata-io-test-" + std::to_string(::getpid()) + "-" +
                     std::to_string(static_cast<int>(GetParam()));
  auto file = open_file(path, DirectIoMode::kAuto);
  ::unlink(path.c_str());
  EXPECT_FALSE(file->direct());
  EXPECT_EQ(file->alignment(), 1u);
  auto engine = make(GetParam(), small_options());
  FileId id = engine->register_file(file);
  std::vector<std::uint8_t> w = testing::random_bytes(100001, 3), r(100001);  // odd size, unaligned
  ASSERT_TRUE(engine->wait(engine->submit({IoOp::kWrite, id, w.data(), w.size(), 3}), 30s));
  ASSERT_TRUE(engine->wait(engine->submit({IoOp::kRead, id, r.data(), r.size(), 3}), 30s));
  EXPECT_EQ(w, r);
}

INSTANTIATE_TEST_SUITE_P(Engines, EngineTest,
                         ::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kThreads),
                         kind_name);

}  // namespace
}  // namespace strata
