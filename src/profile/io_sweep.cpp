// NVMe read/write throughput through the strata I/O engines: block size x queue depth x engine x
// rings, on one test file per path (created with O_EXCL, removed afterwards).
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <random>

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

}  // namespace

std::vector<IoPoint> sweep_io(const Config& config, const std::string& dir, const Sizes& sizes,
                              const Progress& progress) {
  const NvmeTierConfig& nv = config.tiers.nvme;
  std::vector<IoEngineKind> kinds;
  {
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
  }

  // Points: the mode's grid plus the configured settings.
  struct Grid {
    IoEngineKind kind;
    std::uint64_t bs;
    std::uint32_t qd, rings;
  };
  std::vector<Grid> grid;
  for (auto kind : kinds)
    for (auto rings : sizes.rings)
      for (auto bs : sizes.block_sizes)
        for (auto qd : sizes.queue_depths) grid.push_back({kind, bs, qd, rings});
  {
    IoEngineKind ck = nv.engine == IoEngineKind::kAuto ? kinds.front() : nv.engine;
    if (std::find(kinds.begin(), kinds.end(), ck) == kinds.end()) ck = kinds.front();
    Grid g{ck, nv.block_size, nv.queue_depth, nv.io_threads};
    if (std::none_of(grid.begin(), grid.end(), [&](const Grid& x) {
          return x.kind == g.kind && x.bs == g.bs && x.qd == g.qd && x.rings == g.rings;
        }))
      grid.push_back(g);
  }

  std::uint64_t region = sizes.io_region;
  for (const auto& g : grid) region = std::max(region, g.bs);
  const std::uint64_t max_bs = region;
  std::random_device rd;
  FileGuard guard{strcat(dir, "/strata-profile-io-", ::getpid(), "-", rd(), ".bin")};
  IoBuffer buffer = IoBuffer::allocate(region);
  fill_random(buffer.data(), region, 0x5eed5eedULL);

  // Create and fill the file once (reads then read written data, not fallocated holes).
  {
    IoEngineOptions o = IoEngineOptions::from(nv);
    o.kind = kinds.front();
    o.block_size = std::min<std::uint64_t>(1ULL << 20, max_bs);
    o.queue_depth = 32;
    o.io_threads = 1;
    auto engine = make_engine(o.kind, o);
    IoFileOptions fo;
    fo.create = true;
    fo.exclusive = true;
    FileId f = engine->open_file(guard.path, fo);
    engine->wait_for(engine->submit({IoOp::kWrite, f, buffer.data(), region, 0}),
                     std::chrono::seconds(300));
    engine->unregister_file(f);
  }

  std::vector<IoPoint> out;
  std::size_t n = 0;
  for (const auto& g : grid) {
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
      IoPoint p;
      p.path = dir;
      p.engine = io_engine_name(g.kind);
      p.op = io_op_name(op);
      p.block_size = g.bs;
      p.queue_depth = g.qd;
      p.rings = g.rings;
      p.direct = direct;
      p.bytes = bytes;
      p.seconds = secs;
      p.bytes_per_second = secs > 0 ? static_cast<double>(bytes) / secs : 0;
      out.push_back(p);
      if (progress)
        progress(strcat("nvme ", dir, " [", n, "/", grid.size(), "] ", p.op, " ",
                        format_bytes(g.bs, true), " qd ", g.qd, " ", p.engine, " x", g.rings, ": ",
                        format_rate(p.bytes_per_second)));
    }
    engine->unregister_file(f);
  }
  return out;
}

}  // namespace strata::profile
