// The streaming API of the tier store, model-based: the one pipelined loop (tier/stream_loop.hpp)
// over items whose parts live on gpu, cpu and nvme, computed in host or device memory, for
// windows 1..5 and the serial schedule; the filler (tier/fill.hpp) with pieces in any order and
// gaps, pools of 1..5 buffers, two rounds; and their faults: an I/O error at every request of a
// run, a flipped bit, the sticky failed state of a store that lost a buffer's only copy. Every
// result is compared with a plain in-memory reference. Named parameters (gloo style) say the case.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <deque>
#include <numeric>
#include <random>
#include <thread>

#include "core/numeric.hpp"
#include "strata/device_fault.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"
#include "tier/fill.hpp"
#include "tier/stream_loop.hpp"
#include "tier/swap_space.hpp"
#include "tier_test_util.hpp"

using namespace strata;
using namespace std::chrono_literals;
namespace st = strata::testing;

namespace {

// A reference copy of every buffer, checked against the store through read().
struct Model {
  st::StoreRig& rig;
  std::vector<BufferId> ids;
  std::vector<std::vector<std::uint8_t>> ref;

  BufferId add(const std::string& name, std::uint64_t bytes, Tier home, std::uint64_t seed) {
    const BufferId id = rig.store->register_buffer({name, bytes, DType::kFp32, home, {home}});
    auto data = st::random_bytes(bytes, seed);
    st::CallerMemory cm(*rig.device, Tier::kCpu, rig.store->padded_bytes(id));
    cm.put(data);
    rig.store->write(id, 0, 0, cm.data(), Tier::kCpu).wait(30s);
    ids.push_back(id);
    ref.push_back(std::move(data));
    return id;
  }
  std::size_t index(BufferId id) const {
    return static_cast<std::size_t>(std::find(ids.begin(), ids.end(), id) - ids.begin());
  }
  void check(const std::string& what) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      st::CallerMemory cm(*rig.device, Tier::kCpu, rig.store->padded_bytes(ids[i]));
      rig.store->read(ids[i], 0, 0, cm.data(), Tier::kCpu).wait(30s);
      ASSERT_EQ(cm.get(ref[i].size()), ref[i])
          << what << ": buffer " << rig.store->info(ids[i]).name;
    }
  }
};

// The compute: every in/out part becomes f(its old bytes, item, the first part's bytes).
std::uint8_t mix(std::uint8_t old, std::size_t item, std::uint8_t first, std::size_t i) {
  return static_cast<std::uint8_t>(old * 3u + item * 7u + first + (i & 0xff));
}

// Copies between host and the compute's memory inside fn (device views need a stream).
struct Views {
  Device& device;
  tier::Where where;
  std::unique_ptr<Stream> stream = device.create_stream();
  std::vector<std::uint8_t> get(void* p, std::size_t n) {
    std::vector<std::uint8_t> v(n);
    if (where == tier::Where::kHost) {
      std::memcpy(v.data(), p, n);
    } else {
      stream->memcpy_async(v.data(), p, n);
      stream->synchronize(10s);
    }
    return v;
  }
  void put(void* p, const std::vector<std::uint8_t>& v) {
    if (where == tier::Where::kHost) {
      std::memcpy(p, v.data(), v.size());
    } else {
      stream->memcpy_async(p, v.data(), v.size());
      stream->synchronize(10s);
    }
  }
};

struct LoopCase {
  tier::Where where;
  std::uint32_t window;
  bool pipelined;
  bool staged = false;  // StreamOptions::stage_device_memory (kHost: gpu parts staged as on CUDA)
  bool gated = false;   // StreamOptions::gate: says yes after the first reads had time to land
};

std::string loop_name(const ::testing::TestParamInfo<LoopCase>& i) {
  return std::string(i.param.where == tier::Where::kHost ? "host" : "device") + "_window" +
         std::to_string(i.param.window) + (i.param.pipelined ? "_pipelined" : "_serial") +
         (i.param.staged ? "_staged" : "") + (i.param.gated ? "_gated" : "");
}

class StreamLoopModel : public ::testing::TestWithParam<LoopCase> {};

TEST_P(StreamLoopModel, RandomItemsMatchTheModel) {
  const LoopCase c = GetParam();
  const std::uint64_t seed = st::test_seed("stream loop model");
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  st::RigOptions ro;
  ro.pool_buffers = 5;
  ro.pool_buffer_size = 128 << 10;
  ro.movers = 3;
  st::StoreRig rig(ro);
  Model m{rig};
  // Two big buffers parts of which are ranged (home gpu and cpu: ranges need a memory home).
  const BufferId big_gpu = m.add("big.gpu", 200'003, Tier::kGpu, rng());
  const BufferId big_cpu = m.add("big.cpu", 150'001, Tier::kCpu, rng());
  std::vector<tier::StreamItem> items;
  for (int i = 0; i < 23; ++i) {
    tier::StreamItem it;
    // Part 0: a whole chunk (in + out) on a random tier, of uneven size (0 < n <= 30000).
    const BufferId own =
        m.add("chunk." + std::to_string(i), 1 + rng() % 30000, st::kAllTiers[rng() % 3], rng());
    it.parts.push_back({own, 0, 0, true, true});
    // Part 1: an input range of a big buffer's first half (outputs go to the second halves: a
    // read-ahead never races an earlier item's write).
    const BufferId src = rng() % 2 ? big_gpu : big_cpu;
    const std::uint64_t half = m.ref[m.index(src)].size() / 2;
    const std::uint64_t n = 1 + rng() % 20000, at = rng() % (half - n);
    it.parts.push_back({src, at, n, true, false});
    // Part 2 (sometimes): an output only, whole or a range of a big buffer's second half.
    if (rng() % 2) {
      if (rng() % 2) {
        const BufferId out =
            m.add("out." + std::to_string(i), 1 + rng() % 20000, st::kAllTiers[rng() % 3], rng());
        it.parts.push_back({out, 0, 0, false, true});
      } else {
        const BufferId dst = rng() % 2 ? big_gpu : big_cpu;
        const std::uint64_t dsz = m.ref[m.index(dst)].size();
        // Disjoint output ranges per item keep the reference order-independent.
        const std::uint64_t slot = (dsz - dsz / 2) / 23;
        it.parts.push_back({dst, dsz / 2 + slot * static_cast<std::uint64_t>(i),
                            1 + rng() % (slot - 1), false, true});
      }
    }
    items.push_back(std::move(it));
  }
  // The reference, computed in item order (outputs of an item never feed a later input).
  auto expected = m.ref;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const auto& ps = items[i].parts;
    const auto& in1 = m.ref[m.index(ps[1].id)];
    const std::uint8_t first = in1[ps[1].offset];
    auto& own = expected[m.index(ps[0].id)];
    for (std::size_t k = 0; k < own.size(); ++k) own[k] = mix(own[k], i, first, k);
    if (ps.size() > 2) {
      auto& out = expected[m.index(ps[2].id)];
      const std::uint64_t n = ps[2].bytes ? ps[2].bytes : out.size();
      for (std::uint64_t k = 0; k < n; ++k) out[ps[2].offset + k] = mix(0, i, first, k);
    }
  }
  Views v{*rig.device, c.where};
  tier::StreamOptions o;
  o.where = c.where;
  o.window = c.window;
  o.pipelined = c.pipelined;
  o.stage_device_memory = c.staged;
  o.what = "model loop";
  int gates = 0;
  std::size_t computed = 0;
  if (c.gated)
    o.gate = [&] {
      EXPECT_EQ(computed, 0u) << "the gate ran after a compute";
      ++gates;
      std::this_thread::sleep_for(20ms);
      return true;
    };
  auto fn = [&](std::size_t i, std::span<void* const> views) {
    ++computed;
    const auto& ps = items[i].parts;
    const std::uint8_t first = v.get(views[1], 1)[0];
    const auto& in1 = m.ref[m.index(ps[1].id)];
    ASSERT_EQ(v.get(views[1], ps[1].bytes),
              std::vector<std::uint8_t>(
                  in1.begin() + static_cast<std::ptrdiff_t>(ps[1].offset),
                  in1.begin() + static_cast<std::ptrdiff_t>(ps[1].offset + ps[1].bytes)))
        << "item " << i << ": input range";
    const std::size_t n0 = m.ref[m.index(ps[0].id)].size();
    auto own = v.get(views[0], n0);
    ASSERT_EQ(own, m.ref[m.index(ps[0].id)]) << "item " << i << ": chunk contents";
    for (std::size_t k = 0; k < own.size(); ++k) own[k] = mix(own[k], i, first, k);
    v.put(views[0], own);
    if (ps.size() > 2) {
      const std::uint64_t n = ps[2].bytes ? ps[2].bytes : m.ref[m.index(ps[2].id)].size();
      std::vector<std::uint8_t> out(n);
      for (std::uint64_t k = 0; k < n; ++k) out[k] = mix(0, i, first, k);
      v.put(views[2], out);
    }
  };
  // What must be staged in: the host-emulated device's memory is viewed in place by kHost
  // compute unless staged; nvme always passes a slot; kDevice compute stages every non-gpu part.
  std::uint64_t staged_in = 0;
  for (const auto& it : items)
    for (const auto& p : it.parts) {
      if (!p.in) continue;
      const Tier home = rig.store->info(p.id).home;
      const bool staged = c.where == tier::Where::kHost
                              ? home == Tier::kNvme || (home == Tier::kGpu && c.staged)
                              : home != Tier::kGpu;
      if (staged) staged_in += p.bytes ? p.bytes : rig.store->info(p.id).bytes;
    }
  const tier::StreamStats s = tier::run_stream(*rig.store, items, fn, o);
  EXPECT_EQ(s.items, items.size());
  EXPECT_EQ(s.bytes_in, staged_in);
  EXPECT_EQ(gates, c.gated ? 1 : 0);
  EXPECT_FALSE(s.cancelled);
  m.ref = expected;
  ASSERT_NO_FATAL_FAILURE(m.check("after the loop"));
  EXPECT_EQ(rig.pool->available(), rig.pool->buffer_count());
  if (c.where == tier::Where::kHost) {
    EXPECT_LE(s.slots, ro.pool_buffers);
  }
  EXPECT_TRUE(rig.store->failure().empty());
}

INSTANTIATE_TEST_SUITE_P(Cases, StreamLoopModel,
                         ::testing::Values(LoopCase{tier::Where::kHost, 1, true},
                                           LoopCase{tier::Where::kHost, 2, true},
                                           LoopCase{tier::Where::kHost, 3, true},
                                           LoopCase{tier::Where::kHost, 5, true},
                                           LoopCase{tier::Where::kHost, 4, false},
                                           LoopCase{tier::Where::kHost, 3, true, true},
                                           LoopCase{tier::Where::kHost, 4, false, true},
                                           LoopCase{tier::Where::kDevice, 1, true},
                                           LoopCase{tier::Where::kDevice, 3, true},
                                           LoopCase{tier::Where::kDevice, 3, false},
                                           LoopCase{tier::Where::kHost, 3, true, false, true},
                                           LoopCase{tier::Where::kHost, 4, false, true, true},
                                           LoopCase{tier::Where::kDevice, 3, true, false, true}),
                         loop_name);

// ---- the filler
// ----------------------------------------------------------------------------------

struct FillCase {
  std::uint32_t pool;
  bool device_source;
};

std::string fill_name(const ::testing::TestParamInfo<FillCase>& i) {
  return "pool" + std::to_string(i.param.pool) +
         (i.param.device_source ? "_from_device" : "_from_host");
}

class FillerModel : public ::testing::TestWithParam<FillCase> {
 protected:
  // The case's pool: GetParam().pool buffers of 64 KiB.
  static st::RigOptions pool_options() {
    st::RigOptions ro;
    ro.pool_buffers = GetParam().pool;
    ro.pool_buffer_size = 64 << 10;
    return ro;
  }
  // One test's store on the case's pool, its model and its seeded generator (the test traces the
  // seed); with `copy_delay`, on a fault-injecting device that delays every device copy by it.
  static st::RigOptions run_options(std::chrono::milliseconds copy_delay) {
    st::RigOptions ro = pool_options();
    ro.fault_device = copy_delay.count() > 0;
    return ro;
  }
  struct Run {
    explicit Run(const char* what, std::chrono::milliseconds copy_delay = 0ms)
        : seed(st::test_seed(what)), rng(seed), rig(run_options(copy_delay)), m{rig} {
      if (copy_delay.count() > 0) rig.fdev->add_fault({DeviceFaultKind::kDelay, 1, 0, copy_delay});
    }
    std::uint64_t seed;
    std::mt19937_64 rng;
    st::StoreRig rig;
    Model m;
  };
};

// The filler model's gradient chunks: 9 buffers of random sizes up to 60 KiB, homes cycling
// through the three tiers, random contents.
std::vector<BufferId> add_grad_buffers(Model& m, std::mt19937_64& rng) {
  std::vector<BufferId> bufs;
  for (int k = 0; k < 9; ++k)
    bufs.push_back(
        m.add("grad." + std::to_string(k), 1 + rng() % (60 << 10), st::kAllTiers[k % 3], rng()));
  return bufs;
}

struct Piece {
  std::size_t k;
  std::uint64_t at, n;
};
// Every buffer but `skip` cut at random points into pieces of 1 to max_n units of `unit` bytes
// (offsets and lengths in units), in random order.
std::vector<Piece> cut_pieces(const Model& m, std::size_t skip, std::uint64_t unit,
                              std::uint64_t max_n, std::mt19937_64& rng) {
  std::vector<Piece> pieces;
  for (std::size_t k = 0; k < m.ref.size(); ++k) {
    if (k == skip) continue;
    const std::uint64_t size = m.ref[k].size() / unit;
    for (std::uint64_t at = 0; at < size;) {
      const std::uint64_t n = std::min<std::uint64_t>(size - at, 1 + rng() % max_n);
      pieces.push_back({k, at, n});
      at += n;
    }
  }
  std::shuffle(pieces.begin(), pieces.end(), rng);
  return pieces;
}

// One round's pieces of bytes: buffer round + 3 gets nothing (zero, no I/O) and a tenth of the
// pieces are left out (gaps).
std::vector<Piece> random_pieces(const Model& m, int round, std::mt19937_64& rng) {
  std::vector<Piece> pieces = cut_pieces(m, static_cast<std::size_t>(round) + 3, 1, 9000, rng);
  pieces.resize(pieces.size() * 9 / 10);
  return pieces;
}

TEST_P(FillerModel, PiecesInAnyOrderWithGaps) {
  const FillCase c = GetParam();
  Run run("filler model");
  SCOPED_TRACE(::testing::Message() << "seed " << run.seed);
  auto& [seed, rng, rig, m] = run;
  const std::vector<BufferId> bufs = add_grad_buffers(m, rng);
  tier::Filler filler(*rig.store, bufs, 20s);
  for (int round = 0; round < 2; ++round) {
    const std::vector<Piece> pieces = random_pieces(m, round, rng);
    for (auto& r : m.ref) std::fill(r.begin(), r.end(), 0);
    filler.begin();
    const Tier mem = c.device_source ? Tier::kGpu : Tier::kCpu;
    for (const Piece& p : pieces) {
      auto data = st::random_bytes(p.n, rng());
      st::CallerMemory src(*rig.device, mem, p.n);
      src.put(data);
      filler.fill(p.k, p.at, p.n, src.data(), mem);
      std::copy(data.begin(), data.end(), m.ref[p.k].begin() + static_cast<std::ptrdiff_t>(p.at));
    }
    filler.end();
    ASSERT_NO_FATAL_FAILURE(m.check("round " + std::to_string(round)));
    EXPECT_EQ(rig.pool->available(), rig.pool->buffer_count());
  }
  if (c.pool == 1) {
    EXPECT_GT(filler.partial_writes(), 0u);  // one buffer: chunks left half-done
  }
}

// The converting tests' FP32 buffers: 9 of up to `max_elems` elements, random contents; homes
// cycle through the tiers, or (pieces from host memory, which the filler does not convert into
// device memory: the engine's are device memory) through cpu and nvme.
std::vector<BufferId> add_fp32_buffers(Model& m, std::mt19937_64& rng, bool device_source,
                                       std::uint64_t max_elems) {
  std::vector<BufferId> bufs;
  for (int k = 0; k < 9; ++k) {
    const Tier home = device_source ? st::kAllTiers[k % 3] : (k % 2 ? Tier::kNvme : Tier::kCpu);
    bufs.push_back(m.add("grad." + std::to_string(k), 4 * (1 + rng() % max_elems), home, rng()));
  }
  return bufs;
}

// gpu homes: the host-emulated device's memory is host memory, converted there after the stream.
void convert_after_stream(Stream& s, void* dst, const void* src, std::size_t n, bool add) {
  s.synchronize(20s);
  accumulate_elems(dst, DType::kFp32, src, DType::kBf16, n, add);
}

// Converting rounds (bf16 pieces into FP32 buffers, precision.grad_accum fp32): every piece is
// converted in place, in any order; what no piece reaches is zero at end() though the buffers held
// random bytes — the bytes around a buffer's first piece included (in host memory only those are
// zeroed, the piece writes its own).
TEST_P(FillerModel, ConvertingPiecesInAnyOrderWithGaps) {
  const FillCase c = GetParam();
  Run run("filler converting");
  SCOPED_TRACE(::testing::Message() << "seed " << run.seed);
  auto& [seed, rng, rig, m] = run;
  const std::vector<BufferId> bufs = add_fp32_buffers(m, rng, c.device_source, 15 << 10);
  tier::Filler filler(*rig.store, bufs, 20s, convert_after_stream, DType::kBf16, DType::kFp32);
  for (int round = 0; round < 2; ++round) {
    // Buffer round + 3 gets no piece (zero); gaps, the first piece of a buffer among them.
    std::vector<Piece> pieces = cut_pieces(m, static_cast<std::size_t>(round) + 3, 4, 2000, rng);
    pieces.resize(pieces.size() * 9 / 10);
    for (auto& r : m.ref) std::fill(r.begin(), r.end(), 0);
    filler.begin();
    const Tier mem = c.device_source ? Tier::kGpu : Tier::kCpu;
    std::normal_distribution<float> d(0, 3);
    for (const Piece& p : pieces) {
      std::vector<std::uint8_t> half(p.n * 2);
      for (std::uint64_t i = 0; i < p.n; ++i) store_elem(half.data(), i, DType::kBf16, d(rng));
      st::CallerMemory src(*rig.device, mem, half.size());
      src.put(half);
      filler.fill(p.k, p.at * 4, p.n * 4, src.data(), mem);
      accumulate_elems(m.ref[p.k].data() + p.at * 4, DType::kFp32, half.data(), DType::kBf16, p.n,
                       false);
    }
    filler.end();
    ASSERT_NO_FATAL_FAILURE(m.check("round " + std::to_string(round)));
    EXPECT_EQ(rig.pool->available(), rig.pool->buffer_count());
  }
}

INSTANTIATE_TEST_SUITE_P(Pools, FillerModel,
                         ::testing::Values(FillCase{1, false}, FillCase{2, true},
                                           FillCase{3, false}, FillCase{5, true}),
                         fill_name);

// A queued piece's source, kept until its ticket is done, then scribbled over.
struct PendingSource {
  tier::Filler::Ticket t;
  std::unique_ptr<st::CallerMemory> src;
  std::uint64_t bytes;
  void scribble() const { src->put(std::vector<std::uint8_t>(bytes, 0xEE)); }
};

// Asynchronous filling: every piece's source is kept until its ticket is done, then scribbled
// over at once (a ticket reported done before its copy had read the source would show in the
// buffers); device copies are delayed so that pieces stay in flight while later ones are queued,
// pool buffers run out, partial buffers are written and read back. At most 6 pieces in flight.
// (That the caller does not wait is shown deterministically at the engine, with a held copy:
// tests/zero/test_grad_overlap.cpp.)
TEST_P(FillerModel, AsynchronousPiecesKeepTheirSourceUntilDone) {
  const FillCase c = GetParam();
  Run run("filler async model", 2ms);  // every device copy delayed
  SCOPED_TRACE(::testing::Message() << "seed " << run.seed);
  auto& [seed, rng, rig, m] = run;
  const std::vector<BufferId> bufs = add_grad_buffers(m, rng);
  tier::Filler filler(*rig.store, bufs, 20s);
  const Tier mem = c.device_source ? Tier::kGpu : Tier::kCpu;
  std::deque<PendingSource> pending;
  for (int round = 0; round < 2; ++round) {
    const std::vector<Piece> pieces = random_pieces(m, round, rng);
    for (auto& r : m.ref) std::fill(r.begin(), r.end(), 0);
    filler.begin();
    for (const auto& [k, at, n] : pieces) {
      auto data = st::random_bytes(n, rng());
      auto src = std::make_unique<st::CallerMemory>(*rig.device, mem, n);
      src->put(data);
      const tier::Filler::Ticket t = filler.fill_async(k, at, n, src->data(), mem);
      ASSERT_TRUE(pending.empty() || t > pending.back().t);
      pending.push_back({t, std::move(src), n});
      std::copy(data.begin(), data.end(), m.ref[k].begin() + static_cast<std::ptrdiff_t>(at));
      if (pending.size() > 6) filler.wait(pending.front().t);
      while (!pending.empty() && filler.done(pending.front().t)) {
        pending.front().scribble();
        pending.pop_front();
      }
    }
    filler.end();
    for (const PendingSource& p : pending) {
      EXPECT_TRUE(filler.done(p.t));
      p.scribble();
    }
    pending.clear();
    EXPECT_EQ(filler.pending(), 0u);
    ASSERT_NO_FATAL_FAILURE(m.check("round " + std::to_string(round)));
    EXPECT_EQ(rig.pool->available(), rig.pool->buffer_count());
  }
}

// Asynchronous converting and adding (precision.grad_accum fp32; gradient accumulation): a
// converting round, then an accumulating one, of bf16 pieces into FP32 buffers, every device copy
// delayed; each piece's source is scribbled over as soon as its ticket is done. A staging buffer
// of 2 KiB: a piece of more than 1024 elements goes in parts, each part's copy queued behind the
// last one's add. Bitwise the element-wise reference; nothing left held: every
// pool buffer back, no buffer's copy still acquired (a converted piece holds one until done).
TEST_P(FillerModel, AsynchronousConvertingAndAddingKeepTheirSourceUntilDone) {
  const FillCase c = GetParam();
  Run run("filler async converting", 1ms);  // every device copy delayed
  SCOPED_TRACE(::testing::Message() << "seed " << run.seed);
  auto& [seed, rng, rig, m] = run;
  const std::vector<BufferId> bufs = add_fp32_buffers(m, rng, c.device_source, 6 << 10);
  tier::Filler filler(*rig.store, bufs, 20s, convert_after_stream, DType::kBf16, DType::kFp32,
                      2048);
  const Tier mem = c.device_source ? Tier::kGpu : Tier::kCpu;
  std::deque<PendingSource> pending;
  std::normal_distribution<float> d(0, 3);
  for (int round = 0; round < 2; ++round) {
    // The converting round leaves buffer 4 and gaps zero; the adding round reaches every byte.
    std::vector<Piece> pieces = cut_pieces(m, round == 0 ? 4 : m.ref.size(), 4, 2000, rng);
    if (round == 0) pieces.resize(pieces.size() * 9 / 10);
    if (round == 0)
      for (auto& r : m.ref) std::fill(r.begin(), r.end(), 0);
    filler.begin(round == 0 ? tier::Filler::Mode::kReplace : tier::Filler::Mode::kAccumulate);
    for (const Piece& p : pieces) {
      std::vector<std::uint8_t> half(p.n * 2);
      for (std::uint64_t i = 0; i < p.n; ++i) store_elem(half.data(), i, DType::kBf16, d(rng));
      auto src = std::make_unique<st::CallerMemory>(*rig.device, mem, half.size());
      src->put(half);
      const auto t = filler.fill_async(p.k, p.at * 4, p.n * 4, src->data(), mem);
      pending.push_back({t, std::move(src), half.size()});
      accumulate_elems(m.ref[p.k].data() + p.at * 4, DType::kFp32, half.data(), DType::kBf16, p.n,
                       round == 1);
      while (!pending.empty() && filler.done(pending.front().t)) {
        pending.front().scribble();
        pending.pop_front();
      }
    }
    filler.end();
    EXPECT_EQ(filler.pending(), 0u);
    pending.clear();
    ASSERT_NO_FATAL_FAILURE(m.check("round " + std::to_string(round)));
    EXPECT_EQ(rig.pool->available(), rig.pool->buffer_count());
  }
  for (BufferId id : bufs) {  // no copy left acquired
    const BufferInfo info = rig.store->info(id);
    EXPECT_EQ(info.pins[0] + info.pins[1] + info.pins[2], 0u) << info.name;
  }
}

// A device copy that fails while the caller goes on: reported by the call that observes it (here
// end()), naming the buffer; every pool buffer back, the next round works.
TEST(FillerFaults, AFailedAsynchronousCopyIsReportedNamingTheBuffer) {
  st::RigOptions ro;
  ro.pool_buffers = 2;
  ro.fault_device = true;
  st::StoreRig rig(ro);
  Model m{rig};
  const BufferId a = m.add("grad.a", 20000, Tier::kNvme, 1);
  const BufferId b = m.add("grad.b", 20000, Tier::kCpu, 2);
  tier::Filler filler(*rig.store, {a, b}, 20s);
  st::CallerMemory src(*rig.device, Tier::kGpu, 20000);
  src.put(st::random_bytes(20000, 3));
  // The first piece's copy is held back, the second fails: neither call waits for them.
  rig.fdev->add_fault({DeviceFaultKind::kDelay, 1, 1, 200ms});
  rig.fdev->add_fault({DeviceFaultKind::kCopyFail, 2, 1});
  filler.begin();
  const auto t1 = filler.fill_async(0, 0, 10000, src.data(), Tier::kGpu);
  const auto t2 =
      filler.fill_async(0, 10000, 10000, static_cast<char*>(src.data()) + 10000, Tier::kGpu);
  EXPECT_LT(t1, t2);
  st::expect_error(ErrorCode::kDevice, "'grad.a'", [&] { filler.end(); });
  EXPECT_EQ(rig.pool->available(), rig.pool->buffer_count());
  EXPECT_EQ(filler.pending(), 0u);
  // The next round (a new copy stream) fills both.
  rig.fdev->clear_faults();
  filler.begin();
  filler.fill(0, 0, 20000, src.data(), Tier::kGpu);
  filler.fill(1, 0, 20000, src.data(), Tier::kGpu);
  filler.end();
  m.ref[0] = m.ref[1] = src.get(20000);
  ASSERT_NO_FATAL_FAILURE(m.check("after the failed round"));
  EXPECT_EQ(rig.pool->available(), rig.pool->buffer_count());
}

// ---- faults
// ----------------------------------------------------------------------------------------

// Items of NVMe chunks, read-modify-written by the loop.
struct NvmeLoop {
  st::StoreRig rig;
  Model m{rig};
  std::vector<tier::StreamItem> items;
  explicit NvmeLoop(std::uint64_t seed, const st::RigOptions& o) : rig(o) {
    std::mt19937_64 rng(seed);
    for (int i = 0; i < 7; ++i) {
      const BufferId id = m.add("c" + std::to_string(i), 1 + rng() % 40000, Tier::kNvme, rng());
      items.push_back({{{id, 0, 0, true, true}}});
    }
  }
  tier::StreamStats run(tier::Where where = tier::Where::kHost) {
    Views v{*rig.device, where};
    tier::StreamOptions o;
    o.where = where;
    o.window = 3;
    o.what = "fault loop";
    return tier::run_stream(
        *rig.store, items,
        [&](std::size_t i, std::span<void* const> views) {
          auto b = v.get(views[0], m.ref[i].size());
          for (auto& x : b) x = static_cast<std::uint8_t>(x + 1);
          v.put(views[0], b);
        },
        o);
  }
};

TEST(StreamLoopFaults, AnIoErrorAtEveryRequestStopsTheLoopAndDrains) {
  st::RigOptions ro;
  ro.pool_buffer_size = 64 << 10;
  // A clean run counts the requests.
  std::uint64_t requests = 0;
  {
    NvmeLoop l(7, ro);
    const auto f = l.rig.fault->add_fault({IoFaultKind::kDelay, {}, {}, 1, 0, EIO, 0, 0ms});
    l.run();
    requests = l.rig.fault->fired(f);
  }
  ASSERT_GT(requests, 10u);
  for (std::uint64_t nth = 1; nth <= requests; ++nth) {
    SCOPED_TRACE(::testing::Message() << "EIO at request " << nth);
    NvmeLoop l(7, ro);
    l.rig.fault->add_fault(IoFault::fail_nth(nth, EIO));
    try {
      l.run();
      FAIL() << "no error";
    } catch (const Error& e) {
      // The IoError itself, or (when a write lost a chunk first) the failed store's Error(kIo)
      // carrying it.
      EXPECT_EQ(e.code(), ErrorCode::kIo) << e.what();
      EXPECT_NE(std::string(e.what()).find("Input/output error"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("fault loop failed"), std::string::npos) << e.what();
    }
    EXPECT_EQ(l.rig.pool->available(), l.rig.pool->buffer_count()) << "a slot was not given back";
    l.rig.fault->clear_faults();
    const std::string failure = l.rig.store->failure();
    if (failure.empty()) {
      // Nothing was lost: every chunk holds either the old or the new contents, and can be read.
      for (std::size_t i = 0; i < l.m.ids.size(); ++i) {
        st::CallerMemory cm(*l.rig.device, Tier::kCpu, l.rig.store->padded_bytes(l.m.ids[i]));
        l.rig.store->read(l.m.ids[i], 0, 0, cm.data(), Tier::kCpu).wait(30s);
        auto got = cm.get(l.m.ref[i].size());
        auto bumped = l.m.ref[i];
        for (auto& x : bumped) x = static_cast<std::uint8_t>(x + 1);
        EXPECT_TRUE(got == l.m.ref[i] || got == bumped) << "chunk " << i;
      }
    } else {
      // A write lost a chunk's only copy: the store is failed for good, naming the buffer.
      EXPECT_NE(failure.find("lost its contents"), std::string::npos) << failure;
      st::expect_error(ErrorCode::kIo, "", [&] { l.rig.store->zero(l.m.ids[0]); });
    }
  }
}

TEST(StreamLoopFaults, AFlippedBitIsAChecksumErrorNamingTheBuffer) {
  for (tier::Where where : {tier::Where::kHost, tier::Where::kDevice}) {
    NvmeLoop l(11, {});
    auto [ext, len] = l.rig.store->nvme_extent(l.m.ids[4]);
    auto [path, off] = l.rig.store->swap_space()->locate(ext + 100);
    const int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    std::uint8_t byte = 0;
    ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(off)), 1);
    byte ^= 0x10;
    ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(off)), 1);
    ::close(fd);
    st::expect_error(ErrorCode::kChecksum, "'c4'", [&] { l.run(where); });
    EXPECT_EQ(l.rig.pool->available(), l.rig.pool->buffer_count());
    EXPECT_TRUE(l.rig.store->failure().empty());  // the chunk's copy is still there (bad bits)
  }
}

// The read-ahead does not stall behind a completed write: with w = 3 slots, once item i-2's
// write is done its slot goes back and item i+1 is read while item i computes. (A completed write
// used to keep its slot until a slot was needed and none was free: the read of i+1 waited for the
// loop to reach it, and the disk idled while fn ran.)
TEST(StreamLoopSchedule, ACompletedWriteFreesItsSlotForTheNextReadAhead) {
  st::RigOptions ro;
  ro.pool_buffers = 3;
  ro.pool_buffer_size = 64 << 10;
  st::StoreRig rig(ro);
  constexpr std::size_t kItems = 10, kBytes = 16 << 10;  // a multiple of 4096: nothing padded
  std::vector<BufferId> ids;
  std::vector<tier::StreamItem> items;
  for (std::size_t i = 0; i < kItems; ++i) {
    ids.push_back(rig.store->register_buffer(
        {"c" + std::to_string(i), kBytes, DType::kFp32, Tier::kNvme, {Tier::kNvme}}));
    st::CallerMemory m(*rig.device, Tier::kCpu, kBytes);  // 4096-aligned, as NVMe writes need
    m.put(std::vector<std::uint8_t>(kBytes, static_cast<std::uint8_t>(i + 1)));
    rig.store->write(ids.back(), 0, 0, m.data(), Tier::kCpu).wait(10s);
    items.push_back({{{ids.back(), 0, 0, true, true}}});
  }
  const std::uint64_t base = rig.store->stats().bytes_from_nvme;
  tier::StreamOptions o;
  o.window = 3;
  std::vector<std::string> late;
  auto wait_until = [](auto&& cond) {
    // A hang guard, not a timing check: what is awaited arrives, however loaded the machine.
    for (int k = 0; k < 30000 && !cond(); ++k) std::this_thread::sleep_for(1ms);
    return cond();
  };
  tier::run_stream(
      *rig.store, items,
      [&](std::size_t i, std::span<void* const> v) {
        EXPECT_EQ(static_cast<std::uint8_t*>(v[0])[kBytes - 1], i + 1) << "item " << i;
        static_cast<std::uint8_t*>(v[0])[0] = 0xee;
        // The write of item i - 2 completed during item i - 1's compute (below): item i + 1's
        // read was issued before this compute, not when the loop reaches it.
        if (i >= 2 && i + 1 < kItems) {
          const std::uint64_t want = base + (i + 2) * kBytes;  // items 0..i+1 read
          if (late.empty() &&
              !wait_until([&] { return rig.store->stats().bytes_from_nvme >= want; }))
            late.push_back(std::to_string(i + 1));
        }
        // Let the write of item i - 1 complete before this compute ends.
        if (i >= 1) wait_until([&] { return !rig.store->info(ids[i - 1]).in_flight; });
      },
      o);
  EXPECT_TRUE(late.empty()) << "read-ahead stalled for items " << ::testing::PrintToString(late);
  for (std::size_t i = 0; i < kItems; ++i) {
    st::CallerMemory m(*rig.device, Tier::kCpu, kBytes);
    rig.store->read(ids[i], 0, 0, m.data(), Tier::kCpu).wait(10s);
    const auto got = m.get(kBytes);
    EXPECT_EQ(got[0], 0xee) << "item " << i;
    EXPECT_EQ(got[kBytes - 1], i + 1) << "item " << i;
  }
}

// ---- the gate
// ----------------------------------------------------------------------------------------

// NVMe chunks of distinct bytes for the gate's tests (a multiple of 4096 each: nothing padded).
struct GateRig {
  st::StoreRig rig;
  std::vector<BufferId> ids;
  std::vector<tier::StreamItem> items;
  static constexpr std::size_t kItems = 8, kBytes = 16 << 10;
  static st::RigOptions options() {
    st::RigOptions ro;
    ro.pool_buffers = 3;
    return ro;
  }
  GateRig() : rig(options()) {
    for (std::size_t i = 0; i < kItems; ++i) {
      ids.push_back(rig.store->register_buffer(
          {"c" + std::to_string(i), kBytes, DType::kFp32, Tier::kNvme, {Tier::kNvme}}));
      st::CallerMemory m(*rig.device, Tier::kCpu, kBytes);
      m.put(std::vector<std::uint8_t>(kBytes, static_cast<std::uint8_t>(i + 1)));
      rig.store->write(ids.back(), 0, 0, m.data(), Tier::kCpu).wait(10s);
      items.push_back({{{ids.back(), 0, 0, true, true}}});
    }
  }
  std::uint8_t first_byte(std::size_t i) {
    st::CallerMemory m(*rig.device, Tier::kCpu, kBytes);
    rig.store->read(ids[i], 0, 0, m.data(), Tier::kCpu).wait(10s);
    return m.get(1)[0];
  }
};

// The gate runs once, before the first compute, while the first window's reads go on: they
// complete without the loop waiting for them. Then the loop computes and writes every item.
TEST(StreamLoopGate, RunsOnceBeforeTheFirstComputeWhileTheFirstReadsGoOn) {
  GateRig g;
  const std::uint64_t base = g.rig.store->stats().bytes_from_nvme;
  const std::uint64_t written = g.rig.store->stats().bytes_to_nvme;
  int gates = 0;
  std::size_t computed_at_gate = 99;
  std::uint64_t read_during_gate = 0;
  std::size_t computed = 0;
  tier::StreamOptions o;
  o.window = 3;
  o.gate = [&] {
    ++gates;
    computed_at_gate = computed;
    // The first window (3 items) was issued before the gate: it arrives while the gate waits.
    for (int k = 0; k < 30000; ++k) {  // (a hang guard: they arrive, however slowly)
      read_during_gate = g.rig.store->stats().bytes_from_nvme - base;
      if (read_during_gate >= 3 * GateRig::kBytes) break;
      std::this_thread::sleep_for(1ms);
    }
    return true;
  };
  const auto s = tier::run_stream(
      *g.rig.store, g.items,
      [&](std::size_t i, std::span<void* const> v) {
        EXPECT_EQ(static_cast<std::uint8_t*>(v[0])[GateRig::kBytes - 1], i + 1) << "item " << i;
        static_cast<std::uint8_t*>(v[0])[0] = static_cast<std::uint8_t>(0xa0 + i);
        ++computed;
      },
      o);
  EXPECT_EQ(gates, 1);
  EXPECT_EQ(computed_at_gate, 0u);
  EXPECT_EQ(read_during_gate, 3 * GateRig::kBytes)
      << "the window's reads did not run under the gate";
  EXPECT_FALSE(s.cancelled);
  EXPECT_GT(s.t_gate, 0.0);
  EXPECT_EQ(s.items, GateRig::kItems);
  EXPECT_EQ(computed, GateRig::kItems);
  EXPECT_EQ(g.rig.store->stats().bytes_to_nvme - written, GateRig::kItems * GateRig::kBytes);
  for (std::size_t i = 0; i < GateRig::kItems; ++i)
    EXPECT_EQ(g.first_byte(i), 0xa0 + i) << "item " << i;
  EXPECT_EQ(g.rig.pool->available(), g.rig.pool->buffer_count());
}

// false: nothing computed, nothing written, every slot back; the contents are the old ones.
TEST(StreamLoopGate, NoCancelsTheRunBeforeAnyCompute) {
  GateRig g;
  const std::uint64_t written = g.rig.store->stats().bytes_to_nvme;
  tier::StreamOptions o;
  o.window = 3;
  o.gate = [] { return false; };
  std::size_t computed = 0;
  const auto s = tier::run_stream(
      *g.rig.store, g.items, [&](std::size_t, std::span<void* const>) { ++computed; }, o);
  EXPECT_TRUE(s.cancelled);
  EXPECT_EQ(s.items, 0u);
  EXPECT_EQ(computed, 0u);
  EXPECT_EQ(g.rig.store->stats().bytes_to_nvme, written);
  EXPECT_EQ(g.rig.pool->available(), g.rig.pool->buffer_count());
  for (std::size_t i = 0; i < GateRig::kItems; ++i) EXPECT_EQ(g.first_byte(i), i + 1);
  // With no items the gate is still asked, once.
  int asked = 0;
  o.gate = [&] { return ++asked, false; };
  EXPECT_TRUE(tier::run_stream(
                  *g.rig.store, {}, [](std::size_t, std::span<void* const>) {}, o)
                  .cancelled);
  EXPECT_EQ(asked, 1);
}

// An exception from the gate comes out as it is (not wrapped as a transfer's), after the reads in
// flight were waited for and the slots given back.
TEST(StreamLoopGate, AnErrorInTheGateComesOutAsItIsAfterTheDrain) {
  GateRig g;
  tier::StreamOptions o;
  o.window = 3;
  o.gate = []() -> bool { throw Error(ErrorCode::kTimeout, "the ranks did not agree"); };
  try {
    tier::run_stream(
        *g.rig.store, g.items, [](std::size_t, std::span<void* const>) {}, o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_STREQ(e.what(), "the ranks did not agree");
  }
  EXPECT_EQ(g.rig.pool->available(), g.rig.pool->buffer_count());
  for (std::size_t i = 0; i < GateRig::kItems; ++i) EXPECT_EQ(g.first_byte(i), i + 1);
}

// A cancelled run still reports a failed read of its window (nothing fails silently).
TEST(StreamLoopGate, AFailedReadOfACancelledRunIsReported) {
  GateRig g;
  g.rig.fault->add_fault(IoFault::fail_nth(2, EIO, IoOp::kRead));
  tier::StreamOptions o;
  o.window = 3;
  o.what = "gated loop";
  o.gate = [] { return false; };
  try {
    tier::run_stream(
        *g.rig.store, g.items, [](std::size_t, std::span<void* const>) {}, o);
    FAIL() << "the failed read was not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo) << e.what();
    EXPECT_NE(std::string(e.what()).find("Input/output error"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("gated loop failed reading"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(g.rig.pool->available(), g.rig.pool->buffer_count());
  EXPECT_TRUE(g.rig.store->failure().empty());
}

// The host-emulated device's memory is host memory: kHost compute sees a gpu-home part at its
// own address (no copy through the pool); staged, it sees a pool slot holding the same bytes.
TEST(StreamLoopViews, HostDeviceMemoryIsViewedInPlaceUnlessStaged) {
  st::RigOptions ro;
  st::StoreRig rig(ro);
  const BufferId id =
      rig.store->register_buffer({"g", 5000 * 4, DType::kFp32, Tier::kGpu, {Tier::kGpu}});
  std::vector<std::uint8_t> data(5000 * 4);
  std::mt19937 rng(7);
  for (auto& b : data) b = static_cast<std::uint8_t>(rng());
  rig.store->write(id, 0, data.size(), data.data(), Tier::kCpu).wait(10s);
  void* home = rig.store->acquire(id, Tier::kGpu, Access::kRead, 10s);
  rig.store->release(id, Tier::kGpu);
  for (const bool staged : {false, true}) {
    SCOPED_TRACE(staged ? "staged" : "in place");
    std::vector<tier::StreamItem> items{{{{id, 4000, 8000, true, false}}}};
    tier::StreamOptions o;
    o.stage_device_memory = staged;
    void* seen = nullptr;
    std::vector<std::uint8_t> got;
    const auto s = tier::run_stream(
        *rig.store, items,
        [&](std::size_t, std::span<void* const> v) {
          seen = v[0];
          got.assign(static_cast<std::uint8_t*>(v[0]), static_cast<std::uint8_t*>(v[0]) + 8000);
        },
        o);
    EXPECT_EQ(got, std::vector<std::uint8_t>(data.begin() + 4000, data.begin() + 12000));
    if (staged) {
      EXPECT_NE(seen, static_cast<std::uint8_t*>(home) + 4000);
      EXPECT_EQ(s.bytes_in, 8000u);
      EXPECT_EQ(s.slots, std::min<std::uint32_t>(o.window, rig.pool->buffer_count()));
    } else {
      EXPECT_EQ(seen, static_cast<std::uint8_t*>(home) + 4000);
      EXPECT_EQ(s.bytes_in, 0u);
      EXPECT_EQ(s.slots, 0u);
    }
    EXPECT_EQ(rig.pool->available(), rig.pool->buffer_count());
    EXPECT_EQ(rig.store->info(id).pins[static_cast<int>(Tier::kGpu)], 0u);
  }
}

TEST(StreamLoopFaults, AFailedDeviceCopyFailsTheLoop) {
  // Items on gpu computed on the host: each is staged by a device→host copy.
  st::RigOptions ro;
  st::StoreRig rig(ro);
  auto* fdev = new FaultInjectingDevice(make_host_device());
  std::unique_ptr<Device> dev(fdev);
  TierStoreOptions so;
  so.host_budget = 64 << 20;
  TierStore store(so, *dev, nullptr, rig.pool.get());
  const BufferId id = store.register_buffer({"g", 5000, DType::kFp32, Tier::kGpu, {Tier::kGpu}});
  fdev->add_fault({DeviceFaultKind::kCopyFail, 1, 1});
  std::vector<tier::StreamItem> items{{{{id, 0, 0, true, true}}}};
  tier::StreamOptions o;
  o.stage_device_memory = true;  // (viewed in place otherwise: no copy to fail)
  st::expect_error(ErrorCode::kDevice, "", [&] {
    tier::run_stream(
        store, items, [](std::size_t, std::span<void* const>) {}, o);
  });
  EXPECT_EQ(rig.pool->available(), rig.pool->buffer_count());
}

}  // namespace

// A streamed write or zero replaces the home copy: refused, naming the buffer and the pin, while
// a copy on another memory tier is acquired; accepted (and read back) once it is released.
TEST(StreamRefusals, WriteAndZeroWhileAcquiredElsewhereAreRefused) {
  NvmeLoop l(5, {});
  const BufferId id = l.rig.store->register_buffer(
      {"x2", 12345, DType::kFp32, Tier::kNvme, {Tier::kNvme, Tier::kCpu}});
  l.rig.store->zero(id).wait(30s);
  const std::uint64_t padded = l.rig.store->padded_bytes(id);
  st::CallerMemory src(*l.rig.device, Tier::kCpu, padded);
  std::vector<std::uint8_t> fresh(12345);
  for (std::size_t i = 0; i < fresh.size(); ++i) fresh[i] = static_cast<std::uint8_t>(i * 7 + 3);
  std::memset(src.data(), 0, padded);
  std::memcpy(src.data(), fresh.data(), fresh.size());
  l.rig.store->acquire(id, Tier::kCpu, Access::kRead);
  for (const char* op : {"write", "zero"}) {
    SCOPED_TRACE(op);
    try {
      if (std::string(op) == "write") {
        l.rig.store->write(id, 0, 0, src.data(), Tier::kCpu).wait(30s);
      } else {
        l.rig.store->zero(id).wait(30s);
      }
      FAIL() << "accepted while acquired on cpu";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::string("cannot ") + op + " buffer 'x2'"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("acquired on"), std::string::npos) << e.what();
    }
  }
  l.rig.store->release(id, Tier::kCpu);
  EXPECT_TRUE(l.rig.store->failure().empty()) << l.rig.store->failure();
  l.rig.store->write(id, 0, 0, src.data(), Tier::kCpu).wait(30s);
  st::CallerMemory dst(*l.rig.device, Tier::kCpu, padded);
  l.rig.store->read(id, 0, 0, dst.data(), Tier::kCpu).wait(30s);
  EXPECT_EQ(dst.get(fresh.size()), fresh);
}
