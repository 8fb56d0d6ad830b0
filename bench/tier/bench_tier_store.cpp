// Host → NVMe → host round trips through the TierStore against the raw I/O engine on the same
// sizes, in the same iteration (the raw engine is the reference; counter store_vs_raw = store time
// / raw time). Both stream the data through a fixed number of 64 MiB host buffers, so peak RSS must
// stay at the pinned pool plus those buffers whatever the total (counters peak_rss_bytes and
// rss_bound_bytes). Directory: $STRATA_BENCH_DIR (default /tmp); files are removed afterwards.
//   bench_tier --benchmark_filter=RoundTrip
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include "core/crc32c.hpp"
#include "device/pinned_pool.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/io_engine.hpp"
#include "tier/tier_store.hpp"

using namespace strata;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::uint64_t kBuf = 64ULL << 20;  // caller buffer / store buffer size
constexpr std::uint32_t kPoolCount = 4;
constexpr std::uint64_t kPoolSize = 8ULL << 20;
constexpr int kWindow = 2;  // transfers in flight

std::string bench_dir() {
  const char* d = std::getenv("STRATA_BENCH_DIR");
  return d && *d ? d : "/tmp";
}

std::uint64_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  std::uint64_t size = 0, rss = 0;
  f >> size >> rss;
  return rss * static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
}

// Samples RSS every millisecond while alive.
class RssSampler {
 public:
  RssSampler()
      : base_(rss_bytes()), peak_(base_), t_([this] {
          while (!stop_) {
            std::uint64_t r = rss_bytes();
            std::uint64_t p = peak_.load();
            while (r > p && !peak_.compare_exchange_weak(p, r)) {
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
        }) {}
  ~RssSampler() {
    stop_ = true;
    t_.join();
  }
  std::uint64_t base() const { return base_; }
  std::uint64_t growth() const { return peak_.load() - base_; }

 private:
  std::uint64_t base_;
  std::atomic<std::uint64_t> peak_;
  std::atomic<bool> stop_{false};
  std::thread t_;
};

void fill(std::uint8_t* p, std::uint64_t n, std::uint64_t tag) {
  auto* w = reinterpret_cast<std::uint64_t*>(p);
  for (std::uint64_t i = 0; i < n / 8; i += 512) w[i] = tag * 1000003 + i;  // one word per 4 KiB
}
bool check(const std::uint8_t* p, std::uint64_t n, std::uint64_t tag) {
  auto* w = reinterpret_cast<const std::uint64_t*>(p);
  for (std::uint64_t i = 0; i < n / 8; i += 512) {
    if (w[i] != tag * 1000003 + i) return false;
  }
  return true;
}

IoEngineOptions io_options() {
  IoEngineOptions o;
  o.block_size = 1 << 20;
  o.queue_depth = 32;
  o.direct_io = DirectIoMode::kAuto;
  return o;
}

// The reference: the same streaming pattern straight on the engine, kWindow buffers.
double raw_round_trip(IoEngine& engine, const std::string& dir, std::uint64_t total,
                      RssSampler* rss, std::uint64_t* rss_growth) {
  IoFileOptions fo;
  fo.create = true;
  fo.exclusive = true;
  const std::string path = dir + "/strata-bench-raw-" + std::to_string(getpid());
  auto file = std::make_shared<IoFile>(IoFile::open(path, fo));
  file->allocate(total);
  FileId fid = engine.register_file(file);
  std::vector<IoBuffer> bufs;
  for (int i = 0; i < kWindow; ++i)
    bufs.push_back(IoBuffer::allocate(kBuf, HugePageMode::kTransparent));
  const std::uint64_t n = total / kBuf;
  std::vector<IoTicket> t(kWindow, 0);
  const auto start = Clock::now();
  for (std::uint64_t i = 0; i < n; ++i) {
    auto& slot = t[i % kWindow];
    if (slot) engine.wait_for(slot, std::chrono::minutes(2));
    fill(bufs[i % kWindow].bytes(), kBuf, i);
    slot = engine.submit(IoRequest{IoOp::kWrite, fid, bufs[i % kWindow].data(), kBuf, i * kBuf});
  }
  engine.wait_all_for(std::chrono::minutes(2));
  std::fill(t.begin(), t.end(), 0);
  for (std::uint64_t i = 0; i < n + kWindow; ++i) {
    if (i >= kWindow) {  // consume i - kWindow
      const std::uint64_t j = i - kWindow;
      engine.wait_for(t[j % kWindow], std::chrono::minutes(2));
      if (!check(bufs[j % kWindow].bytes(), kBuf, j))
        throw Error(ErrorCode::kInternal, "raw: bad data");
    }
    if (i < n)
      t[i % kWindow] =
          engine.submit(IoRequest{IoOp::kRead, fid, bufs[i % kWindow].data(), kBuf, i * kBuf});
  }
  const double s = std::chrono::duration<double>(Clock::now() - start).count();
  *rss_growth = rss->growth();
  engine.unregister_file(fid);
  file.reset();
  unlink(path.c_str());
  return s;
}

double store_round_trip(Device& dev, IoEngine& engine, PinnedPool& pool, const std::string& dir,
                        std::uint64_t total, bool checksum, RssSampler* rss,
                        std::uint64_t* rss_growth) {
  TierStoreOptions so;
  so.nvme_paths = {dir};
  so.nvme_capacity = total;
  so.block_size = 1 << 20;
  so.checksum = checksum;
  so.host_budget = kPoolCount * kPoolSize + (kWindow + 2) * kBuf;  // hard cap: the RSS bound
  so.movers = 2;
  TierStore store(so, dev, engine, pool);
  const std::uint64_t n = total / kBuf;
  std::vector<BufferId> ids;
  for (std::uint64_t i = 0; i < n; ++i) {
    ids.push_back(store.register_buffer(
        {"b" + std::to_string(i), kBuf, DType::kFp32, Tier::kNvme, {Tier::kCpu, Tier::kNvme}}));
  }
  std::vector<Transfer> t(kWindow);
  const auto start = Clock::now();
  for (std::uint64_t i = 0; i < n; ++i) {  // host → NVMe
    t[i % kWindow].wait();
    auto* p = static_cast<std::uint8_t*>(store.acquire(ids[i], Tier::kCpu, Access::kDiscard));
    fill(p, kBuf, i);
    store.release(ids[i], Tier::kCpu);
    t[i % kWindow] = store.evict(ids[i], Tier::kCpu);
  }
  for (auto& x : t) x.wait();
  for (std::uint64_t i = 0; i < n + kWindow; ++i) {  // NVMe → host
    if (i >= kWindow) {
      const std::uint64_t j = i - kWindow;
      t[j % kWindow].wait();
      auto* p = static_cast<std::uint8_t*>(store.acquire(ids[j], Tier::kCpu, Access::kRead));
      const bool ok = check(p, kBuf, j);
      store.release(ids[j], Tier::kCpu);
      if (!ok) throw Error(ErrorCode::kInternal, "store: bad data");
      store.evict(ids[j], Tier::kCpu);  // clean: dropped, not written
    }
    if (i < n) t[i % kWindow] = store.prefetch(ids[i], Tier::kCpu);
  }
  store.wait_idle();
  const double s = std::chrono::duration<double>(Clock::now() - start).count();
  *rss_growth = rss->growth();
  return s;
}

void BM_RoundTrip(benchmark::State& state) {
  const std::uint64_t total = std::uint64_t(state.range(0)) << 30;
  const bool checksum = state.range(1) != 0;
  const std::string dir = bench_dir();
  auto dev = make_host_device();
  auto engine = make_io_engine(io_options(), dir);
  PinnedPoolOptions po;
  po.buffer_count = kPoolCount;
  po.buffer_size = kPoolSize;
  PinnedPool pool(po, dev.get(), engine.get());
  double raw_s = 0, store_s = 0;
  std::uint64_t raw_rss = 0, store_rss = 0;
  int iteration = 0;
  for (auto _ : state) {
    // Alternate which one goes first, so that drift in the shared disk's speed cancels out.
    double s = 0;
    for (int k = 0; k < 2; ++k) {
      RssSampler rss;
      std::uint64_t growth = 0;
      if ((k + iteration) % 2 == 0) {
        raw_s += raw_round_trip(*engine, dir, total, &rss, &growth);
        raw_rss = std::max(raw_rss, growth);
      } else {
        s = store_round_trip(*dev, *engine, pool, dir, total, checksum, &rss, &growth);
        store_s += s;
        store_rss = std::max(store_rss, growth);
      }
    }
    ++iteration;
    state.SetIterationTime(s);
  }
  const double iters = double(state.iterations());
  state.counters["bytes_per_second"] = 2.0 * total * iters / store_s;
  state.counters["raw_bytes_per_second"] = 2.0 * total * iters / raw_s;
  state.counters["store_vs_raw"] = store_s / raw_s;
  state.counters["peak_rss_bytes"] = double(store_rss);
  state.counters["raw_peak_rss_bytes"] = double(raw_rss);
  state.counters["rss_bound_bytes"] = double(kPoolCount * kPoolSize + (kWindow + 2) * kBuf);
  state.SetLabel(std::string(engine->name()) + (checksum ? " crc32c" : " no-checksum"));
}

void BM_Crc32c(benchmark::State& state) {
  std::vector<std::uint8_t> data(8 << 20);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = std::uint8_t(i * 131 + 7);
  const bool hw = state.range(0) != 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(hw ? crc32c_hw(data.data(), data.size())
                                : crc32c_portable(data.data(), data.size()));
  }
  state.counters["bytes_per_second"] =
      benchmark::Counter(double(data.size()) * state.iterations(), benchmark::Counter::kIsRate);
  state.SetLabel(hw ? "sse4.2" : "portable");
}

}  // namespace

BENCHMARK(BM_RoundTrip)
    ->ArgsProduct({{1, 2, 4, 8}, {1, 0}})
    ->ArgNames({"GiB", "checksum"})
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Crc32c)->Arg(1)->Arg(0);

BENCHMARK_MAIN();
