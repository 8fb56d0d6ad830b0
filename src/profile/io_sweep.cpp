// NVMe read/write throughput through the strata I/O engines: block size x queue depth x engine x
// rings, on one test file per path (created with O_EXCL, removed afterwards).
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <random>
#include <thread>

#include "profile/profile_internal.hpp"
#include "strata/error.hpp"
#include "strata/io_engine.hpp"
#include "strata/log.hpp"
#include "strata/units.hpp"

namespace strata::profile {
namespace {

// Removes the test file on every exit path.
struct FileGuard {
  std::string path;
  ~FileGuard() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove(path, ec);
  }
};

std::unique_ptr<IoEngine> make_engine(IoEngineKind kind, const IoEngineOptions& o) {
  return kind == IoEngineKind::kIoUring ? make_io_uring_engine(o) : make_thread_io_engine(o);
}

// Moves `region` bytes of the file repeatedly (wrapping) for about `budget_s` seconds, two chunks
// in flight, and returns {bytes, seconds}. At least one chunk completes.
std::pair<std::uint64_t, double> timed_transfer(IoEngine& engine, FileId file, IoOp op,
                                                std::uint8_t* buffer, std::uint64_t region,
                                                std::uint64_t chunk, double budget_s) {
  const auto timeout = std::chrono::seconds(120);
  std::uint64_t offset = 0, bytes = 0;
  struct InFlight {
    IoTicket ticket;
    std::uint64_t length;
  };
  std::vector<InFlight> flight;
  auto issue = [&] {
    const std::uint64_t len = std::min(chunk, region - offset);
    IoRequest r{op, file, buffer + offset, len, offset};
    flight.push_back({engine.submit(r), len});
    offset = (offset + len) % region;
  };
  Stopwatch sw;
  issue();
  issue();
  while (!flight.empty()) {
    engine.wait_for(flight.front().ticket, timeout);
    bytes += flight.front().length;
    flight.erase(flight.begin());
    if (sw.seconds() < budget_s) issue();
  }
  return {bytes, sw.seconds()};
}

// The engines to measure: both where the mode asks and io_uring works, else the configured one
// (the thread pool when io_uring does not work in `dir`).
std::vector<IoEngineKind> engines_to_measure(const NvmeTierConfig& nv, const std::string& dir,
                                             const Sizes& sizes) {
  std::vector<IoEngineKind> kinds;
  IoEngineOptions po = IoEngineOptions::from(nv);
  const bool uring = probe_io_uring(po, dir).ok;
  if (sizes.both_engines) {
    if (uring) kinds.push_back(IoEngineKind::kIoUring);
    kinds.push_back(IoEngineKind::kThreads);
  } else if (nv.engine == IoEngineKind::kThreads || !uring) {
    kinds.push_back(IoEngineKind::kThreads);
  } else {
    kinds.push_back(IoEngineKind::kIoUring);
  }
  if (!uring && nv.engine != IoEngineKind::kThreads)
    log_warn("profile: io_uring is not usable in ", dir, "; measuring the thread-pool engine only");
  return kinds;
}

struct Grid {
  IoEngineKind kind;
  std::uint64_t bs;
  std::uint32_t qd, rings;
};

// Points: the mode's grid plus the configured settings.
std::vector<Grid> sweep_grid(const NvmeTierConfig& nv, const std::vector<IoEngineKind>& kinds,
                             const Sizes& sizes) {
  std::vector<Grid> grid;
  for (auto kind : kinds)
    for (auto rings : sizes.rings)
      for (auto bs : sizes.block_sizes)
        for (auto qd : sizes.queue_depths) grid.push_back({kind, bs, qd, rings});
  IoEngineKind ck = nv.engine == IoEngineKind::kAuto ? kinds.front() : nv.engine;
  if (std::find(kinds.begin(), kinds.end(), ck) == kinds.end()) ck = kinds.front();
  Grid g{ck, nv.block_size, nv.queue_depth, nv.io_threads};
  if (std::none_of(grid.begin(), grid.end(), [&](const Grid& x) {
        return x.kind == g.kind && x.bs == g.bs && x.qd == g.qd && x.rings == g.rings;
      }))
    grid.push_back(g);
  return grid;
}

// Creates and fills the file once (reads then read written data, not fallocated holes).
void lay_out_file(const NvmeTierConfig& nv, IoEngineKind kind, const std::string& path,
                  const IoBuffer& buffer, std::uint64_t region) {
  IoEngineOptions o = IoEngineOptions::from(nv);
  o.kind = kind;
  o.block_size = std::min<std::uint64_t>(1ULL << 20, region);
  o.queue_depth = 32;
  o.io_threads = 1;
  auto engine = make_engine(o.kind, o);
  IoFileOptions fo;
  fo.create = true;
  fo.exclusive = true;
  FileId f = engine->open_file(path, fo);
  engine->wait_for(engine->submit({IoOp::kWrite, f, buffer.data(), region, 0}),
                   std::chrono::seconds(300));
  engine->unregister_file(f);
}

// Adds one timed transfer (a run) to its point.
void add_run(IoPoint& p, const std::string& dir, const Grid& g, IoOp op, bool direct,
             std::uint64_t bytes, double secs) {
  p.path = dir;
  p.engine = io_engine_name(g.kind);
  p.op = io_op_name(op);
  p.block_size = g.bs;
  p.queue_depth = g.qd;
  p.rings = g.rings;
  p.direct = direct;
  p.bytes += bytes;
  p.seconds += secs;
  p.runs_bps.push_back(secs > 0 ? static_cast<double>(bytes) / secs : 0);
  p.bytes_per_second = median(p.runs_bps);
}

}  // namespace

std::vector<IoPoint> sweep_io(const Config& config, const std::string& dir, const Sizes& sizes,
                              const Progress& progress) {
  const NvmeTierConfig& nv = config.tiers.nvme;
  const std::vector<IoEngineKind> kinds = engines_to_measure(nv, dir, sizes);
  const std::vector<Grid> grid = sweep_grid(nv, kinds, sizes);
  std::uint64_t region = sizes.io_region;
  for (const auto& g : grid) region = std::max(region, g.bs);
  std::random_device rd;
  FileGuard guard{strcat(dir, "/strata-profile-io-", ::getpid(), "-", rd(), ".bin")};
  IoBuffer buffer = IoBuffer::allocate(region);
  fill_random(buffer.data(), region, 0x5eed5eedULL);
  lay_out_file(nv, kinds.front(), guard.path, buffer, region);

  // Every point in each pass; odd passes walk the grid backwards, so a drift over the sweep (page
  // cache, thermal, other load) does not favour the points measured first.
  std::vector<IoPoint> out(grid.size() * 2);
  const std::uint32_t passes = std::max(1u, sizes.io_passes);
  std::size_t n = 0;
  for (std::uint32_t pass = 0; pass < passes; ++pass) {
    for (std::size_t k = 0; k < grid.size(); ++k) {
      const std::size_t gi = pass % 2 ? grid.size() - 1 - k : k;
      const Grid& g = grid[gi];
      ++n;
      IoEngineOptions o = IoEngineOptions::from(nv);
      o.kind = g.kind;
      o.block_size = g.bs;
      o.queue_depth = g.qd;
      o.io_threads = g.rings;
      auto engine = make_engine(g.kind, o);
      FileId f = engine->open_file(guard.path, {});
      const bool direct = engine->alignment(f) > 1;
      // Two chunks in flight, each filling the queue depth once, so the engine never runs dry.
      const std::uint64_t chunk =
          std::clamp<std::uint64_t>(g.bs * g.qd, g.bs, std::max(region / 2, g.bs)) / g.bs * g.bs;
      for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
        auto [bytes, secs] =
            timed_transfer(*engine, f, op, buffer.bytes(), region, chunk, sizes.io_point_s);
        IoPoint& p = out[gi * 2 + (op == IoOp::kRead ? 1 : 0)];
        add_run(p, dir, g, op, direct, bytes, secs);
        if (progress)
          progress(strcat("nvme ", dir, " [", n, "/", grid.size() * passes, "] ", p.op, " ",
                          format_bytes(g.bs, true), " qd ", g.qd, " ", p.engine, " x", g.rings,
                          ": ", format_rate(p.runs_bps.back())));
      }
      engine->unregister_file(f);
    }
  }
  return out;
}

StreamRates measure_streams(const Config& config, const std::string& dir, std::uint32_t streams,
                            std::uint64_t region, double seconds) {
  const NvmeTierConfig& nv = config.tiers.nvme;
  IoEngineOptions o = IoEngineOptions::from(nv);
  if (o.kind == IoEngineKind::kAuto)
    o.kind = probe_io_uring(o, dir).ok ? IoEngineKind::kIoUring : IoEngineKind::kThreads;
  region = std::max<std::uint64_t>(region / nv.block_size * nv.block_size, nv.block_size);
  const std::uint64_t chunk =
      std::clamp<std::uint64_t>(nv.block_size * nv.queue_depth, nv.block_size,
                                std::max(region / 2, nv.block_size)) /
      nv.block_size * nv.block_size;
  struct Stream {
    FileGuard guard;
    IoBuffer buffer;
    std::unique_ptr<IoEngine> engine;
    FileId file{};
  };
  std::random_device rd;
  std::vector<Stream> ss(streams);
  for (std::uint32_t i = 0; i < streams; ++i) {
    Stream& st = ss[i];
    st.guard.path = strcat(dir, "/strata-profile-streams-", ::getpid(), "-", rd(), "-", i, ".bin");
    st.buffer = IoBuffer::allocate(region);
    fill_random(st.buffer.data(), region, 0x57ea + i);
    st.engine = make_engine(o.kind, o);
    IoFileOptions fo;
    fo.create = true;
    fo.exclusive = true;
    st.file = st.engine->open_file(st.guard.path, fo);
    st.engine->wait_for(st.engine->submit({IoOp::kWrite, st.file, st.buffer.data(), region, 0}),
                        std::chrono::seconds(300));
  }
  // {single stream, all streams at once} for one op.
  auto run = [&](IoOp op, std::uint32_t k) {
    std::vector<std::pair<std::uint64_t, double>> res(k);
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(k);
    for (std::uint32_t i = 0; i < k; ++i)
      threads.emplace_back([&, i] {
        try {
          res[i] = timed_transfer(*ss[i].engine, ss[i].file, op, ss[i].buffer.bytes(), region,
                                  chunk, seconds);
        } catch (...) {
          errors[i] = std::current_exception();
        }
      });
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    std::uint64_t bytes = 0;
    double secs = 0;
    for (const auto& [b, t] : res) {
      bytes += b;
      secs = std::max(secs, t);
    }
    return secs > 0 ? static_cast<double>(bytes) / secs : 0.0;
  };
  StreamRates r;
  r.streams = streams;
  r.single_write = run(IoOp::kWrite, 1);
  r.aggregate_write = run(IoOp::kWrite, streams);
  r.single_read = run(IoOp::kRead, 1);
  r.aggregate_read = run(IoOp::kRead, streams);
  for (auto& st : ss) st.engine->unregister_file(st.file);
  return r;
}

}  // namespace strata::profile
