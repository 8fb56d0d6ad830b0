// OffloadStateStore and NvmeArray alone: the pipelined update against an in-memory model for every pool size,
// the fixed pool, acquire/release, and faults: EIO / ENOSPC / short read at every request of a
// step → IoError naming buffer, path and errno, the store refusing further steps; a flipped bit in
// the swap file → checksum error at swap-in.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <random>

#include "strata/error.hpp"
#include "strata/io_fault.hpp"
#include "test_util.hpp"
#include "zero/offload_store.hpp"

namespace strata::testing {
namespace {

using zero::OffloadStateStore;
using zero::OffloadStoreOptions;
using zero::StateView;

constexpr std::size_t kN = 11111;  // uneven: several chunks plus a short one, a resident tail

std::vector<Range> ranges_of(std::size_t n, std::size_t sg) {
  std::vector<Range> r;
  for (std::size_t b = 0; b < n; b += sg) r.push_back({b, std::min(sg, n - b)});
  return r;
}

struct Fixture {
  TempDir dir{"strata-offload-store"};
  std::vector<float> init;
  FaultInjectingIoEngine* faults = nullptr;
  std::unique_ptr<OffloadStateStore> store;

  explicit Fixture(std::uint32_t buffers, std::uint64_t buffer_size = 6 * 4096, double fraction = 0.8,
                   std::uint64_t seed = 7) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> d(-2, 2);
    init.resize(kN);
    for (auto& x : init) x = d(rng);
    OffloadStoreOptions o;
    o.nvme_elems = static_cast<std::size_t>(fraction * kN);
    o.buffer_count = buffers;
    o.buffer_size = buffer_size;
    o.paths = {dir.str()};
    o.timeout = std::chrono::milliseconds(20000);
    IoEngineOptions io;
    io.queue_depth = 4;
    auto fe = std::make_shared<FaultInjectingIoEngine>(make_thread_io_engine(io));
    faults = fe.get();
    store = std::make_unique<OffloadStateStore>(o, init, ranges_of(kN, 3000), fe);
  }
};

// The model's step: deterministic, element-wise, different per step.
void model_step(Range r, const StateView& v, int step) {
  for (std::size_t i = 0; i < r.count; ++i) {
    v.exp_avg[i] = v.exp_avg[i] * 0.5f + static_cast<float>(r.begin + i) * 1e-3f;
    v.exp_avg_sq[i] += static_cast<float>(step);
    v.master[i] = v.master[i] * 1.0001f - v.exp_avg[i];
  }
}

void expect_state(OffloadStateStore& s, const std::vector<float>& master, const std::vector<float>& m,
                  const std::vector<float>& v) {
  Range all{0, s.size()};
  StateView got = s.acquire(all);
  for (std::size_t i = 0; i < all.count; ++i) {
    ASSERT_EQ(got.master[i], master[i]) << i;
    ASSERT_EQ(got.exp_avg[i], m[i]) << i;
    ASSERT_EQ(got.exp_avg_sq[i], v[i]) << i;
  }
  s.release(all, false);
}

TEST(OffloadStore, PipelinedUpdateMatchesModelForEveryPool) {
  for (std::uint32_t buffers : {1u, 2u, 3u, 5u}) {
    for (std::uint64_t size : {3 * 4096ull, 7 * 4096ull}) {
      Fixture f(buffers, size);
      auto ranges = ranges_of(kN, 3000);
      std::vector<float> master = f.init, m(kN, 0), v(kN, 0);
      for (int step = 1; step <= 3; ++step) {
        f.store->update(ranges, [&](Range r, const StateView& sv) { model_step(r, sv, step); });
        model_step({0, kN}, {master.data(), m.data(), v.data(), kN}, step);
      }
      EXPECT_LE(f.store->pool_buffers(), buffers);
      EXPECT_LE(f.store->pool_buffer_size(), size);
      EXPECT_GT(f.store->chunk_count(), 4u);
      const auto& st = f.store->last_stats();
      EXPECT_EQ(st.chunks, f.store->chunk_count());
      EXPECT_GT(st.resident, 0u);
      EXPECT_GT(st.bytes_read, 0u);
      EXPECT_EQ(st.bytes_read, st.bytes_written);
      expect_state(*f.store, master, m, v);
    }
  }
}

TEST(OffloadStore, AcquireReleaseAcrossChunks) {
  Fixture f(2);
  std::vector<float> master = f.init, m(kN, 0), v(kN, 0);
  Range r{1000, 8000};  // spans several chunks and the resident tail
  StateView sv = f.store->acquire(r);
  model_step(r, sv, 9);
  f.store->release(r, true);
  model_step(r, {master.data() + r.begin, m.data() + r.begin, v.data() + r.begin, r.count}, 9);
  expect_state(*f.store, master, m, v);
}

struct FaultCase {
  IoFaultKind kind;
  IoOp op;
  int errnum;
};

// A fault at request k of a step, for every k: the step throws an IoError naming the pinned
// buffer, the swap path and errno, no request is left in flight, and the store is failed.
TEST(OffloadStore, FaultAtEveryRequestOfAStep) {
  const FaultCase cases[] = {{IoFaultKind::kError, IoOp::kRead, EIO},
                             {IoFaultKind::kError, IoOp::kWrite, EIO},
                             {IoFaultKind::kError, IoOp::kWrite, ENOSPC},
                             {IoFaultKind::kShortResult, IoOp::kRead, 0}};
  for (const FaultCase& fc : cases) {
    std::size_t chunks = 0;
    for (std::size_t k = 1;; ++k) {
      Fixture f(3);
      chunks = f.store->chunk_count();
      if (k > chunks) break;
      IoFault fault;
      fault.kind = fc.kind;
      fault.op = fc.op;
      fault.nth = k;  // counted from add_fault(): the k-th read/write of the step
      fault.errnum = fc.errnum == 0 ? EIO : fc.errnum;
      f.faults->add_fault(fault);
      auto ranges = ranges_of(kN, 3000);
      try {
        f.store->update(ranges, [&](Range r, const StateView& sv) { model_step(r, sv, 1); });
        FAIL() << "no error for fault at request " << k << " kind " << static_cast<int>(fc.kind) << " op " << static_cast<int>(fc.op) << " errnum " << fc.errnum;
      } catch (const IoError& e) {
        const std::string msg = e.what();
        EXPECT_EQ(e.errnum(), fc.errnum) << msg;
        EXPECT_NE(msg.find("pinned buffer"), std::string::npos) << msg;
        EXPECT_NE(msg.find(f.dir.str()), std::string::npos) << msg;
        EXPECT_NE(msg.find("partially updated"), std::string::npos) << msg;
      }
      EXPECT_TRUE(f.store->failed());
      try {
        f.store->update(ranges, [&](Range, const StateView&) {});
        FAIL() << "a failed store accepted another step";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kIo);
        EXPECT_NE(std::string(e.what()).find("restore the last checkpoint"), std::string::npos);
      }
    }
    EXPECT_GT(chunks, 4u);
  }
}

// Flips the bits of `mask` in the byte at `at` of `path`, behind the store's back.
void flip_bits(const std::string& path, std::uint64_t at, unsigned char mask) {
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  unsigned char b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(at)), 1);
  b ^= mask;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(at)), 1);
  ::fsync(fd);
  ::close(fd);
}

// `read_back` must fail with a checksum error naming the swap file and chunk k.
template <typename F>
void expect_checksum_error(F read_back, const std::string& path, std::size_t k) {
  try {
    read_back();
    FAIL() << "the flipped bit went unnoticed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kChecksum) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(strcat("chunk ", k)), std::string::npos) << e.what();
  }
}

TEST(OffloadStore, FlippedBitInSwapFileIsAChecksumError) {
  Fixture f(3);
  const std::size_t k = f.store->chunk_count() / 2;
  auto [path, offset] = f.store->chunk_location(k);
  ASSERT_NO_FATAL_FAILURE(flip_bits(path, offset + 4 * 37 + 1, 0x10));
  auto ranges = ranges_of(kN, 3000);
  expect_checksum_error(
      [&] { f.store->update(ranges, [&](Range r, const StateView& sv) { model_step(r, sv, 1); }); },
      path, k);
}

TEST(OffloadStore, MeasurePassesReportBytes) {
  Fixture f(4, 3 * 4096, 1.0);
  auto r = f.store->measure_read();
  EXPECT_EQ(r.bytes_read, f.store->swap_bytes());
  auto w = f.store->measure_write();
  EXPECT_EQ(w.bytes_written, f.store->swap_bytes());
  auto u = f.store->measure_update([](Range, const StateView& v) { v.master[0] += 1; });
  EXPECT_EQ(u.chunks, f.store->chunk_count());
  // The state written by measure_write is consistent: a step still verifies.
  f.store->update(ranges_of(kN, 3000), [&](Range r, const StateView& sv) { model_step(r, sv, 1); });
}

// offload.gradients / offload.params on NVMe (NvmeArray): put() then get() of uneven ranges (crossing chunks, repeated) gives
// the bytes back; the swap space holds exactly the padded chunks; a range beyond the share throws.
TEST(NvmeArray, RoundTripAndSwapBytes) {
  TempDir dir("strata-grad-spill");
  OffloadStoreOptions o;
  o.buffer_count = 2;
  o.buffer_size = 8192;  // 2048 fp32 gradients per chunk
  o.paths = {dir.str()};
  o.timeout = std::chrono::milliseconds(20000);
  const std::size_t n = 5003;
  IoEngineOptions io;
  io.queue_depth = 4;
  auto fe = std::make_shared<FaultInjectingIoEngine>(make_thread_io_engine(io));
  zero::NvmeArray g(o, n, sizeof(float), fe);
  EXPECT_EQ(g.swap_bytes(), 8192u + 8192u + 4096u);  // 2048 + 2048 + 907 elements, 4 KiB aligned
  std::mt19937_64 rng(test_seed("grad-spill"));
  std::uniform_real_distribution<float> d(-3, 3);
  for (int round = 0; round < 2; ++round) {
    std::vector<float> src(n);
    for (auto& x : src) x = d(rng);
    g.put(reinterpret_cast<const unsigned char*>(src.data()));
    EXPECT_EQ(g.bytes_written(), (round + 1) * g.swap_bytes());
    for (Range r : {Range{0, 100}, Range{100, 3000}, Range{3100, 1903}, Range{2047, 2}, Range{0, n}}) {
      std::vector<float> out(r.count, -1.0f);
      g.get(r, reinterpret_cast<unsigned char*>(out.data()));
      ASSERT_EQ(0, std::memcmp(out.data(), src.data() + r.begin, r.count * sizeof(float)))
          << "round " << round << " range " << r.begin << "+" << r.count;
    }
  }
  // set(): ascending pieces across chunk edges, read-modify-write, then flush(); get() sees them.
  std::vector<float> all(n);
  g.get({0, n}, reinterpret_cast<unsigned char*>(all.data()));
  for (Range r : {Range{10, 2100}, Range{2110, 5}, Range{4000, 1003}}) {
    std::vector<float> v(r.count);
    for (auto& x : v) x = d(rng);
    std::copy(v.begin(), v.end(), all.begin() + static_cast<std::ptrdiff_t>(r.begin));
    g.set(r, reinterpret_cast<const unsigned char*>(v.data()));
  }
  g.flush();
  std::vector<float> back(n);
  g.get({0, n}, reinterpret_cast<unsigned char*>(back.data()));
  EXPECT_EQ(0, std::memcmp(back.data(), all.data(), n * sizeof(float)));
  EXPECT_THROW(g.get({n - 1, 2}, nullptr), Error);
}

// ---- NvmeArray streaming: read-ahead, write-behind, fresh chunks, faults ----

// Counts ordering hazards at the engine interface: a read or write submitted for bytes that a
// write (or, for writes, a read) still in flight covers — the device may then reorder them. A
// request is in flight from submit() until a wait()/poll() retires it.
class HazardCheckingIoEngine : public FaultInjectingIoEngine {
 public:
  using FaultInjectingIoEngine::FaultInjectingIoEngine;
  IoTicket submit(const IoRequest& r) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [t, f] : flight_)
        if (f.file == r.file && f.offset < r.offset + r.length && r.offset < f.offset + f.length &&
            (f.op == IoOp::kWrite || r.op == IoOp::kWrite))
          ++hazards_;
    }
    const IoTicket t = FaultInjectingIoEngine::submit(r);
    std::lock_guard<std::mutex> lock(mu_);
    flight_[t] = r;
    return t;
  }
  bool wait(IoTicket t, std::chrono::nanoseconds timeout) override {
    return retire(t, [&] { return FaultInjectingIoEngine::wait(t, timeout); });
  }
  bool poll(IoTicket t) override {
    return retire(t, [&] { return FaultInjectingIoEngine::poll(t); });
  }
  std::uint64_t hazards() const {
    std::lock_guard<std::mutex> lock(mu_);
    return hazards_;
  }

 private:
  template <typename F>
  bool retire(IoTicket t, F f) {
    bool done = true;
    try {
      done = f();
    } catch (...) {
      forget(t);
      throw;
    }
    if (done) forget(t);
    return done;
  }
  void forget(IoTicket t) {
    std::lock_guard<std::mutex> lock(mu_);
    flight_.erase(t);
  }
  mutable std::mutex mu_;
  std::map<IoTicket, IoRequest> flight_;
  std::uint64_t hazards_ = 0;
};

struct ArrayFixture {
  TempDir dir{"strata-nvme-array"};
  HazardCheckingIoEngine* faults = nullptr;
  std::unique_ptr<zero::NvmeArray> a;
  static constexpr std::size_t kElems = 5003;  // 1024 fp32 per 4 KiB chunk: 4 full + 907

  explicit ArrayFixture(std::uint32_t buffers) {
    OffloadStoreOptions o;
    o.buffer_count = buffers;
    o.buffer_size = 4096;
    o.paths = {dir.str()};
    o.timeout = std::chrono::milliseconds(20000);
    IoEngineOptions io;
    io.queue_depth = 4;
    auto fe = std::make_shared<HazardCheckingIoEngine>(make_thread_io_engine(io));
    faults = fe.get();
    a = std::make_unique<zero::NvmeArray>(o, kElems, sizeof(float), fe, "parameters");
  }
  std::uint64_t pieces() const { return faults->stats().pieces; }
};

unsigned char* bytes_of(float* p) { return reinterpret_cast<unsigned char*>(p); }

// Random get / set / ascending sweeps / flush / put against an in-memory model, for every pool
// size: whatever the access order, every get sees the last set.
TEST(NvmeArray, RandomAccessMatchesModelForEveryPool) {
  const std::size_t n = ArrayFixture::kElems;
  for (std::uint32_t buffers : {1u, 2u, 3u, 5u}) {
    ArrayFixture f(buffers);
    std::mt19937_64 rng(test_seed("nvme-array-model") + buffers);
    std::uniform_real_distribution<float> d(-5, 5);
    std::vector<float> model(n);
    for (auto& x : model) x = d(rng);
    f.a->put(bytes_of(model.data()));
    auto random_range = [&] {
      std::size_t b = rng() % n;
      std::size_t len = 1 + rng() % std::min<std::size_t>(2500, n - b);
      return Range{b, len};
    };
    for (int op = 0; op < 400; ++op) {
      const unsigned kind = static_cast<unsigned>(rng() % 20);
      if (kind < 7) {  // get
        Range r = random_range();
        std::vector<float> out(r.count);
        f.a->get(r, bytes_of(out.data()));
        ASSERT_EQ(0, std::memcmp(out.data(), model.data() + r.begin, r.count * sizeof(float)))
            << "buffers " << buffers << " op " << op << " get " << r.begin << "+" << r.count;
      } else if (kind < 12) {  // set
        Range r = random_range();
        std::vector<float> v(r.count);
        for (auto& x : v) x = d(rng);
        std::copy(v.begin(), v.end(), model.begin() + static_cast<std::ptrdiff_t>(r.begin));
        f.a->set(r, bytes_of(v.data()));
      } else if (kind < 15) {  // ascending sweep of sets or gets in uneven pieces, as the step does
        const bool sets = kind < 14;
        for (std::size_t b = 0; b < n;) {
          const std::size_t len = std::min<std::size_t>(n - b, 1 + rng() % 1500);
          if (sets) {
            std::vector<float> v(len);
            for (auto& x : v) x = d(rng);
            std::copy(v.begin(), v.end(), model.begin() + static_cast<std::ptrdiff_t>(b));
            f.a->set({b, len}, bytes_of(v.data()));
          } else {
            std::vector<float> out(len);
            f.a->get({b, len}, bytes_of(out.data()));
            ASSERT_EQ(0, std::memcmp(out.data(), model.data() + b, len * sizeof(float)))
                << "buffers " << buffers << " op " << op << " sweep at " << b;
          }
          b += len;
        }
      } else if (kind < 18) {
        f.a->flush();
      } else {
        for (auto& x : model) x = d(rng);
        f.a->put(bytes_of(model.data()));
      }
    }
    f.a->flush();
    std::vector<float> all(n);
    f.a->get({0, n}, bytes_of(all.data()));
    EXPECT_EQ(0, std::memcmp(all.data(), model.data(), n * sizeof(float))) << "buffers " << buffers;
    EXPECT_EQ(f.faults->hazards(), 0u) << "buffers " << buffers << ": a request overlapped a write in flight";
  }
}

// The step's access pattern: an ascending get sweep reads each chunk exactly once, with the next
// chunks' reads submitted ahead; an ascending set sweep from element 0 reads nothing and leaves
// its writes in flight (write-behind) until flush().
TEST(NvmeArray, AscendingSweepsReadAheadAndWriteBehind) {
  const std::size_t n = ArrayFixture::kElems;
  ArrayFixture f(3);
  const std::size_t chunks = f.a->chunk_count();
  ASSERT_EQ(chunks, 5u);
  std::mt19937_64 rng(test_seed("nvme-array-sweep"));
  std::uniform_real_distribution<float> d(-5, 5);
  std::vector<float> src(n);
  for (auto& x : src) x = d(rng);
  f.a->put(bytes_of(src.data()));
  const std::uint64_t after_put = f.pieces();
  ASSERT_EQ(after_put, chunks);  // one 4 KiB piece per chunk

  std::vector<float> out(n);
  f.a->get({0, 10}, bytes_of(out.data()));
  EXPECT_EQ(f.pieces() - after_put, 3u) << "chunk 0 plus 2 reads ahead (3 buffers)";
  for (std::size_t b = 10; b < n; b += 700)
    f.a->get({b, std::min<std::size_t>(700, n - b)}, bytes_of(out.data() + b));
  EXPECT_EQ(0, std::memcmp(out.data(), src.data(), n * sizeof(float)));
  EXPECT_EQ(f.a->bytes_read(), f.a->swap_bytes()) << "each chunk read exactly once";
  EXPECT_EQ(f.pieces() - after_put, chunks);

  const std::uint64_t read_before = f.a->bytes_read(), written_before = f.a->bytes_written();
  const std::uint64_t pieces_before = f.pieces();
  std::vector<float> upd(n);
  for (auto& x : upd) x = d(rng);
  for (std::size_t b = 0; b < 2100; b += 700) f.a->set({b, 700}, bytes_of(upd.data() + b));
  EXPECT_EQ(f.pieces() - pieces_before, 2u) << "chunks 0 and 1 written behind, nothing read";
  EXPECT_EQ(f.a->bytes_written(), written_before) << "no write waited for yet";
  for (std::size_t b = 2100; b < n; b += 700)
    f.a->set({b, std::min<std::size_t>(700, n - b)}, bytes_of(upd.data() + b));
  f.a->flush();
  EXPECT_EQ(f.a->bytes_read(), read_before) << "a sweep of sets from element 0 reads nothing";
  EXPECT_EQ(f.a->bytes_written() - written_before, f.a->swap_bytes());
  std::vector<float> back(n);
  f.a->get({0, n}, bytes_of(back.data()));
  EXPECT_EQ(0, std::memcmp(back.data(), upd.data(), n * sizeof(float)));

  // A set that does not start a chunk at its first element reads it (read-modify-write).
  const std::uint64_t r0 = f.a->bytes_read();
  std::vector<float> mid(100, 1.5f);
  f.a->set({1024 + 300, 100}, bytes_of(mid.data()));
  f.a->flush();
  EXPECT_GT(f.a->bytes_read(), r0);
  std::copy(mid.begin(), mid.end(), upd.begin() + 1324);
  f.a->get({0, n}, bytes_of(back.data()));
  EXPECT_EQ(0, std::memcmp(back.data(), upd.data(), n * sizeof(float)));
}

// An injected fault at the k-th read or write after put(), for every k of a get sweep, a set sweep
// and a flush: an IoError naming the array, the chunk, the swap path and errno — never a silent
// loss: reading everything back afterwards returns the model or a checksum error.
TEST(NvmeArray, FaultAtEveryRequestOfTheSweeps) {
  const std::size_t n = ArrayFixture::kElems;
  const FaultCase cases[] = {{IoFaultKind::kError, IoOp::kRead, EIO},
                             {IoFaultKind::kShortResult, IoOp::kRead, 0},
                             {IoFaultKind::kError, IoOp::kWrite, EIO},
                             {IoFaultKind::kError, IoOp::kWrite, ENOSPC}};
  for (const FaultCase& fc : cases) {
    for (std::uint64_t k = 1; k <= 5; ++k) {
      ArrayFixture f(3);
      std::mt19937_64 rng(test_seed("nvme-array-fault") + k);
      std::uniform_real_distribution<float> d(-5, 5);
      std::vector<float> model(n), upd(n), out(n);
      for (auto& x : model) x = d(rng);
      for (auto& x : upd) x = d(rng);
      f.a->put(bytes_of(model.data()));
      IoFault fault;
      fault.kind = fc.kind;
      fault.op = fc.op;
      fault.nth = k;
      fault.errnum = fc.errnum == 0 ? EIO : fc.errnum;
      const std::size_t id = f.faults->add_fault(fault);
      bool threw = false;
      std::size_t set_upto = 0;  // elements of upd handed to set()
      try {
        for (std::size_t b = 0; b < n; b += 900)
          f.a->get({b, std::min<std::size_t>(900, n - b)}, bytes_of(out.data() + b));
        for (std::size_t b = 0; b < n; b += 900) {
          const std::size_t len = std::min<std::size_t>(900, n - b);
          f.a->set({b, len}, bytes_of(upd.data() + b));
          set_upto = b + len;
        }
        f.a->flush();
      } catch (const IoError& e) {
        threw = true;
        const std::string msg = e.what();
        EXPECT_EQ(e.errnum(), fc.errnum) << msg;
        EXPECT_NE(msg.find("nvme parameters"), std::string::npos) << msg;
        EXPECT_NE(msg.find("chunk"), std::string::npos) << msg;
        EXPECT_NE(msg.find(f.dir.str()), std::string::npos) << msg;
      }
      EXPECT_EQ(threw, f.faults->fired(id) > 0) << "kind " << static_cast<int>(fc.kind) << " k " << k;
      EXPECT_TRUE(threw) << "fault " << k << " of op " << static_cast<int>(fc.op) << " never surfaced";
      f.faults->clear_faults();
      // What is on NVMe now: each chunk is either its old or its new contents, or unreadable.
      std::vector<float> now(model);
      std::copy(upd.begin(), upd.begin() + static_cast<std::ptrdiff_t>(set_upto), now.begin());
      try {
        f.a->flush();
        f.a->get({0, n}, bytes_of(out.data()));
        for (std::size_t c = 0; c * 1024 < n; ++c) {
          const std::size_t b = c * 1024, len = std::min<std::size_t>(1024, n - b);
          const bool is_new = std::memcmp(out.data() + b, now.data() + b, len * sizeof(float)) == 0;
          const bool is_old = std::memcmp(out.data() + b, model.data() + b, len * sizeof(float)) == 0;
          EXPECT_TRUE(is_new || is_old) << "chunk " << c << " holds neither old nor new data";
        }
      } catch (const Error& e) {
        EXPECT_TRUE(e.code() == ErrorCode::kChecksum || e.code() == ErrorCode::kIo) << e.what();
      }
    }
  }
}

TEST(NvmeArray, FlippedBitInSwapFileIsAChecksumError) {
  const std::size_t n = ArrayFixture::kElems;
  ArrayFixture f(2);
  std::vector<float> src(n, 0.25f);
  f.a->put(bytes_of(src.data()));
  const std::size_t k = 3;
  auto [path, offset] = f.a->chunk_location(k);
  ASSERT_NO_FATAL_FAILURE(flip_bits(path, offset + 77, 0x01));
  std::vector<float> out(n);
  expect_checksum_error([&] { f.a->get({0, n}, bytes_of(out.data())); }, path, k);
}

// Filling (the backward's gradient spill): pieces in random order, some never sent (zeros), for
// every pool size, three rounds; get/set/flush are refused while filling. With slow writes, a
// chunk written partially is still in flight when the rest of it arrives (it must not be read
// back before its write lands).
TEST(NvmeArray, FillInAnyOrderWithGapsMatchesModel) {
  const std::size_t n = ArrayFixture::kElems;
  for (std::uint32_t variant = 0; variant < 6; ++variant) {
    const std::uint32_t buffers = std::array<std::uint32_t, 6>{1, 2, 3, 5, 3, 5}[variant];
    const bool slow_writes = variant >= 4;
    ArrayFixture f(buffers);
    if (slow_writes) {
      IoFault slow = IoFault::delay_nth(1, std::chrono::milliseconds(3), IoOp::kWrite);
      slow.count = 0;  // every write
      f.faults->add_fault(slow);
    }
    std::mt19937_64 rng(test_seed("nvme-array-fill") + variant);
    std::uniform_real_distribution<float> d(-5, 5);
    for (int round = 0; round < 3; ++round) {
      std::vector<float> model(n, 0.0f);
      std::vector<Range> pieces;
      for (std::size_t b = 0; b < n;) {
        const std::size_t len = std::min<std::size_t>(n - b, 1 + rng() % 1800);
        pieces.push_back({b, len});
        b += len;
      }
      std::shuffle(pieces.begin(), pieces.end(), rng);
      f.a->begin_fill();
      EXPECT_THROW(f.a->get({0, 1}, nullptr), Error);
      for (std::size_t i = 0; i < pieces.size(); ++i) {
        if (i % 7 == 3) continue;  // a gap: stays zero
        const Range r = pieces[i];
        std::vector<float> v(r.count);
        for (auto& x : v) x = d(rng);
        std::copy(v.begin(), v.end(), model.begin() + static_cast<std::ptrdiff_t>(r.begin));
        f.a->fill(r, bytes_of(v.data()));
      }
      f.a->end_fill();
      std::vector<float> out(n, -1.0f);
      f.a->get({0, n}, bytes_of(out.data()));
      ASSERT_EQ(0, std::memcmp(out.data(), model.data(), n * sizeof(float)))
          << "buffers " << buffers << " slow writes " << slow_writes << " round " << round;
      ASSERT_EQ(f.faults->hazards(), 0u)
          << "buffers " << buffers << " round " << round << ": a request overlapped a write in flight";
    }
  }
}

// A write fault during a fill surfaces from fill() or end_fill() as an IoError naming the chunk.
TEST(NvmeArray, WriteFaultDuringFill) {
  const std::size_t n = ArrayFixture::kElems;
  for (std::uint64_t k = 1; k <= 5; ++k) {
    ArrayFixture f(2);
    f.faults->add_fault(IoFault::fail_nth(k, EIO, IoOp::kWrite));
    std::vector<float> v(n, 1.25f);
    try {
      f.a->begin_fill();
      for (std::size_t b = n; b > 0;) {  // descending pieces, as buckets arrive in a backward
        const std::size_t len = std::min<std::size_t>(b, 1500);
        b -= len;
        f.a->fill({b, len}, bytes_of(v.data() + b));
      }
      f.a->end_fill();
      FAIL() << "write fault " << k << " went unnoticed";
    } catch (const IoError& e) {
      EXPECT_EQ(e.errnum(), EIO) << e.what();
      EXPECT_NE(std::string(e.what()).find("chunk"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace strata::testing
