#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "device/pinned_pool.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/io_engine.hpp"
#include "test_util.hpp"

using namespace strata;
using namespace std::chrono_literals;
namespace st = strata::testing;

namespace {
PinnedPoolOptions small(std::uint32_t count = 3, std::uint64_t size = 64 << 10) {
  PinnedPoolOptions o;
  o.buffer_count = count;
  o.buffer_size = size;
  o.pinned_budget = 1 << 20;
  return o;
}
}  // namespace

TEST(PinnedPool, HandsOutAlignedBuffersAndWaitsWithTimeout) {
  auto dev = make_host_device();
  PinnedPool pool(small(), dev.get(), nullptr);
  EXPECT_EQ(pool.buffer_count(), 3u);
  EXPECT_EQ(pool.buffer_size(), 64u << 10);
  EXPECT_STREQ(pool.lock_method(), "mlock");
  std::vector<PinnedBuffer> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(pool.acquire(1s));
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(held.back().data()) % (2 << 20), 0u);
    std::memset(held.back().data(), i + 1, held.back().size());
  }
  EXPECT_EQ(pool.available(), 0u);
  EXPECT_FALSE(pool.try_acquire());
  const auto t0 = std::chrono::steady_clock::now();
  st::expect_error(ErrorCode::kTimeout, "3 buffers of 65536 bytes", [&] { pool.acquire(50ms); });
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 45ms);
  // Distinct memory: every buffer still holds its own pattern.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(held[i].bytes()[1000], i + 1);
  // A waiter is woken by a release from another thread.
  std::thread releaser([&] {
    std::this_thread::sleep_for(20ms);
    held.pop_back();
  });
  auto b = pool.acquire(5s);
  EXPECT_TRUE(b);
  releaser.join();
  held.clear();
  b.release();
  EXPECT_EQ(pool.available(), 3u);
}

TEST(PinnedPool, BudgetIsHard) {
  auto o = small(5, 256 << 10);  // 1.25 MiB > 1 MiB
  try {
    PinnedPool pool(o, nullptr, nullptr);
    FAIL() << "expected kBudget";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBudget);
    const std::string m = e.what();
    EXPECT_NE(m.find("1310720"), std::string::npos) << m;
    EXPECT_NE(m.find("pinned_budget = 1048576"), std::string::npos) << m;
  }
  auto bad = small(2, 5000);
  EXPECT_THROW(PinnedPool(bad, nullptr, nullptr), Error);
  auto zero = small(0, 4096);
  EXPECT_THROW(PinnedPool(zero, nullptr, nullptr), Error);
}

TEST(PinnedPool, RegistersWithTheIoEngine) {
  st::TempDir dir("strata-pool");
  IoEngineOptions io;
  io.block_size = 64 << 10;
  auto engine = make_io_engine(io, dir.str());
  PinnedPool pool(small(2, 128 << 10), nullptr, engine.get());
  auto fid = engine->open_file(dir.str() + "/f", IoFileOptions{.create = true});
  auto b = pool.acquire(1s);
  auto data = st::random_bytes(b.size(), 9);
  std::memcpy(b.data(), data.data(), data.size());
  engine->wait_for(engine->submit(IoRequest{IoOp::kWrite, fid, b.data(), b.size(), 0}), 10s);
  std::memset(b.data(), 0, b.size());
  engine->wait_for(engine->submit(IoRequest{IoOp::kRead, fid, b.data(), b.size(), 0}), 10s);
  EXPECT_EQ(0, std::memcmp(b.data(), data.data(), data.size()));
  b.release();
  engine->unregister_file(fid);
}

// RLIMIT_MEMLOCK too low (and no CAP_IPC_LOCK): a clear error naming what to raise. Runs in a
// child process, which drops CAP_IPC_LOCK (root has it) and lowers the limit.
TEST(PinnedPool, MemlockLimitTooLowSaysWhatToRaise) {
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(pipefd[0]);
    __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[2]{};
    std::string msg = "no-error";
    if (syscall(SYS_capget, &hdr, data) == 0) {
      data[0].effective &= ~(1u << CAP_IPC_LOCK);
      data[0].permitted &= ~(1u << CAP_IPC_LOCK);
      syscall(SYS_capset, &hdr, data);
    }
    rlimit lim{64 << 10, 64 << 10};
    setrlimit(RLIMIT_MEMLOCK, &lim);
    try {
      PinnedPoolOptions o;
      o.buffer_count = 2;
      o.buffer_size = 1 << 20;
      o.pinned_budget = 4 << 20;
      PinnedPool pool(o, nullptr, nullptr);
    } catch (const Error& e) {
      msg = std::string(error_code_name(e.code())) + "|" + e.what();
    }
    (void)!write(pipefd[1], msg.data(), msg.size());
    _exit(0);
  }
  close(pipefd[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(pipefd[0], buf, sizeof buf)) > 0) out.append(buf, n);
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_NE(out.find("RLIMIT_MEMLOCK"), std::string::npos) << out;
  EXPECT_NE(out.find("ulimit -l"), std::string::npos) << out;
  EXPECT_NE(out.find("limits.conf"), std::string::npos) << out;
  EXPECT_NE(out.find("2097152 bytes"), std::string::npos) << out;
}

TEST(PinnedPool, ConcurrentLeasesAreExclusive) {
  PinnedPool pool(small(3, 16 << 10), nullptr, nullptr);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        auto b = pool.acquire(10s);
        const auto v = static_cast<std::uint8_t>(t * 31 + i);
        std::memset(b.data(), v, b.size());
        std::this_thread::yield();
        for (std::size_t k = 0; k < b.size(); k += 509) {
          if (b.bytes()[k] != v) ++bad;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(pool.available(), 3u);
}

// F11: a buffer detached because a timed-out transfer may still write it is never handed out
// again, and the pool's destruction neither unpins nor unmaps it: the late write lands in mapped
// memory nobody else owns (it used to be munmapped under it: SIGSEGV, or another mapping's data).
TEST(PinnedPool, DetachedBufferOutlivesThePool) {
  auto dev = make_host_device();
  void* late = nullptr;
  std::size_t size = 0;
  {
    PinnedPool pool(small(2), dev.get(), nullptr);
    PinnedBuffer b = pool.acquire(1s);
    late = b.data();
    size = b.size();
    b.detach();
    EXPECT_EQ(pool.available(), 1u);
    PinnedBuffer other = pool.acquire(1s);
    EXPECT_NE(other.data(), late);
    EXPECT_FALSE(pool.try_acquire()) << "a detached buffer was handed out again";
  }
  std::memset(late, 0x5A, size);  // the stalled DMA completes after the pool is gone
  EXPECT_EQ(static_cast<unsigned char*>(late)[size - 1], 0x5A);
}
