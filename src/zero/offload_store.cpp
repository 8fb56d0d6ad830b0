// The offloaded optimizer state store and its pipelined step (see offload_store.hpp).
#include "zero/offload_store.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>

#include "strata/error.hpp"
#include "strata/log.hpp"
#include "strata/device.hpp"
#include "device/pinned_pool.hpp"
#include "tier/swap_space.hpp"
#include "core/crc32c.hpp"

namespace strata::zero {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
std::uint64_t round_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }
constexpr std::size_t kElemAlign = 1024;  // chunk sizes are multiples of this (every SIMD width)

}  // namespace

struct OffloadStateStore::Chunk {
  Range r;            // elements, in store space (all below nvme_elems)
  SwapExtent extent;  // master | m | v, each array_bytes(r.count)
  std::uint64_t bytes = 0;
  std::uint32_t crc = 0;
};

struct OffloadStateStore::Unit {
  Range r;
  std::ptrdiff_t chunk = -1;  // -1: host-resident
};

OffloadStoreOptions OffloadStoreOptions::from(const Config& c, std::uint32_t rank, std::size_t total) {
  OffloadStoreOptions o;
  if (c.offload.optimizer.tier == Tier::kNvme && c.offload.optimizer.fraction > 0) {
    const double want = std::ceil(c.offload.optimizer.fraction * static_cast<double>(total));
    o.nvme_elems = std::min<std::size_t>(total, round_up(static_cast<std::uint64_t>(want), kElemAlign));
  }
  o.buffer_count = c.tiers.host.buffer_count;
  o.buffer_size = c.tiers.host.buffer_size;
  o.pinned_budget = c.tiers.host.pinned_budget;
  o.paths = c.tiers.nvme.paths;
  o.block_size = c.tiers.nvme.block_size;
  o.nvme_budget = c.tiers.nvme.budget ? c.tiers.nvme.budget / std::max(1u, c.ranks_per_node()) : 0;
  o.checksum = c.tiers.nvme.checksum;
  o.rank = rank;
  return o;
}

std::size_t OffloadStateStore::array_bytes(std::size_t count) const {
  return round_up(count * sizeof(float), align_);
}

OffloadStateStore::OffloadStateStore(const OffloadStoreOptions& options, std::span<const float> init,
                                     std::vector<Range> ranges, std::shared_ptr<IoEngine> engine)
    : opt_(options), total_(init.size()), nvme_elems_(std::min(options.nvme_elems, init.size())),
      ranges_(std::move(ranges)), engine_(std::move(engine)) {
  if (!engine_) fail(ErrorCode::kInvalidArgument, "offload store: no I/O engine");
  std::size_t pos = 0;
  for (const Range& r : ranges_) {
    if (r.begin != pos)
      fail(ErrorCode::kInvalidArgument, strcat("offload store: ranges not consecutive at ", pos));
    pos = r.end();
  }
  if (pos != total_)
    fail(ErrorCode::kInvalidArgument,
         strcat("offload store: ranges cover ", pos, " of ", total_, " elements"));
  if (nvme_elems_ > 0 && opt_.paths.empty())
    fail(ErrorCode::kInvalidArgument,
         "offload.optimizer.tier is nvme but tiers.nvme.paths is empty: name a directory on NVMe");
  if (opt_.buffer_count < 1)
    fail(ErrorCode::kInvalidArgument, "offload store: tiers.host.buffer_count must be >= 1");

  host_master_.assign(init.begin() + static_cast<std::ptrdiff_t>(nvme_elems_), init.end());
  host_m_.assign(total_ - nvme_elems_, 0.0f);
  host_v_.assign(total_ - nvme_elems_, 0.0f);

  // Chunks: ranges cut at nvme_elems and at the buffer capacity.
  if (nvme_elems_ > 0) {
    // The alignment comes from the swap space, but its size from the chunks: probe with a file
    // alignment guess of 4096, the engine's maximum for real devices.
    align_ = 4096;
    const std::uint64_t min_buffer = 3 * align_;
    if (opt_.buffer_size < min_buffer)
      fail(ErrorCode::kInvalidArgument,
           strcat("offload store: tiers.host.buffer_size ", opt_.buffer_size,
                  " bytes is below the minimum the pipelined step needs: one buffer of ",
                  min_buffer, " bytes (3 arrays × ", align_, " B alignment) — set it to at least ",
                  min_buffer, " (1 buffer works serially, 3 or more overlap read, update and write)"));
    chunk_elems_ = (opt_.buffer_size / 3 / align_) * align_ / sizeof(float);
    chunk_elems_ = std::max<std::size_t>(1, chunk_elems_ / kElemAlign * kElemAlign);
  }
  std::uint64_t swap_need = 0, biggest = 0;
  std::vector<std::size_t> nvme_chunk_of_unit;
  for (const Range& r : ranges_) {
    std::size_t b = r.begin;
    while (b < r.end()) {
      if (b < nvme_elems_) {
        const std::size_t e = std::min({r.end(), nvme_elems_, b + chunk_elems_});
        Chunk c;
        c.r = {b, e - b};
        c.bytes = 3 * array_bytes(c.r.count);
        swap_need += c.bytes;
        biggest = std::max(biggest, c.bytes);
        units_.push_back({c.r, static_cast<std::ptrdiff_t>(chunks_.size())});
        chunks_.push_back(c);
        b = e;
      } else {
        units_.push_back({{b, r.end() - b}, -1});
        b = r.end();
      }
    }
  }
  if (chunks_.empty()) return;

  if (opt_.nvme_budget && swap_need > opt_.nvme_budget)
    fail(ErrorCode::kBudget,
         strcat("offload store rank ", opt_.rank, ": the optimizer state on NVMe needs ", swap_need,
                " bytes of swap space but tiers.nvme.budget leaves this rank ", opt_.nvme_budget));
  SwapSpaceOptions so;
  so.paths = opt_.paths;
  so.capacity = swap_need;
  so.rank = opt_.rank;
  so.block_size = opt_.block_size;
  swap_ = std::make_unique<SwapSpace>(so, *engine_);
  if (swap_->alignment() > align_)
    fail(ErrorCode::kUnsupported,
         strcat("offload store: swap alignment ", swap_->alignment(), " above 4096 is not supported"));
  for (std::size_t k = 0; k < chunks_.size(); ++k)
    chunks_[k].extent = swap_->allocate(chunks_[k].bytes, strcat("optimizer state chunk ", k));

  PinnedPoolOptions po;
  po.buffer_count = static_cast<std::uint32_t>(std::min<std::size_t>(opt_.buffer_count, chunks_.size()));
  po.buffer_size = round_up(std::min<std::uint64_t>(opt_.buffer_size, biggest), 4096);
  po.pinned_budget = opt_.pinned_budget;
  pool_ = std::make_unique<PinnedPool>(po, nullptr, engine_.get());
  log_debug("offload store rank ", opt_.rank, ": ", nvme_elems_, " of ", total_, " elements on NVMe in ",
            chunks_.size(), " chunks of <= ", chunk_elems_, " elements, pool ", po.buffer_count, " x ",
            po.buffer_size, " B, swap ", swap_->describe());

  // Initial contents: master from init, moments zero, written through the pool.
  OffloadStepStats keep = stats_;
  UpdateFn fill = [&](Range r, const StateView& v) {
    std::memcpy(v.master, init.data() + r.begin, r.count * sizeof(float));
    std::memset(v.exp_avg, 0, r.count * sizeof(float));
    std::memset(v.exp_avg_sq, 0, r.count * sizeof(float));
  };
  run(&fill, /*read=*/false, /*write=*/true, true);
  stats_ = keep;
}

OffloadStateStore::~OffloadStateStore() {
  scratch_.clear();
  pool_.reset();  // no I/O is in flight outside run()/sync_io(), which drain before returning
  swap_.reset();
}

std::size_t OffloadStateStore::chunk_count() const { return chunks_.size(); }
std::uint32_t OffloadStateStore::pool_buffers() const { return pool_ ? pool_->buffer_count() : 0; }
std::uint64_t OffloadStateStore::pool_buffer_size() const { return pool_ ? pool_->buffer_size() : 0; }
std::uint64_t OffloadStateStore::swap_bytes() const {
  std::uint64_t b = 0;
  for (const Chunk& c : chunks_) b += c.bytes;
  return b;
}
std::pair<std::string, std::uint64_t> OffloadStateStore::chunk_location(std::size_t k) const {
  if (k >= chunks_.size()) fail(ErrorCode::kInvalidArgument, strcat("offload store: no chunk ", k));
  return swap_->locate(chunks_[k].extent.offset);
}

void OffloadStateStore::check_usable() const {
  if (!failure_.empty())
    fail(ErrorCode::kIo,
         strcat("offload store rank ", opt_.rank, ": unusable after a failed step (", failure_,
                "); restore the last checkpoint or restart"));
}

void OffloadStateStore::verify(const Chunk& c, const unsigned char* data, std::size_t k) const {
  if (!opt_.checksum) return;
  const std::uint32_t got = crc32c(data, c.bytes);
  if (got != c.crc) {
    auto [path, off] = swap_->locate(c.extent.offset);
    fail(ErrorCode::kChecksum,
         strcat("offload store rank ", opt_.rank, ": checksum mismatch reading optimizer state chunk ",
                k, " (elements [", c.r.begin, ", ", c.r.end(), ")) from ", path, " offset ", off,
                " length ", c.bytes, ": CRC32C ", got, " != written ", c.crc));
  }
}

// One synchronous chunk transfer through a pool buffer (acquire/release).
void OffloadStateStore::sync_io(IoOp op, std::size_t k, unsigned char* buf) {
  Chunk& c = chunks_[k];
  if (op == IoOp::kWrite && opt_.checksum) c.crc = crc32c(buf, c.bytes);
  IoTicket t = engine_->submit({op, swap_->file(), buf, c.bytes, c.extent.offset});
  if (!engine_->wait(t, opt_.timeout)) {
    // Never leave with the buffer in flight: wait once more, bounded, then fail.
    if (!engine_->wait(t, opt_.timeout)) {
      failure_ = strcat("I/O on chunk ", k, " did not complete");
      fail(ErrorCode::kTimeout, strcat("offload store: ", io_op_name(op), " of chunk ", k, " timed out"));
    }
  }
  if (op == IoOp::kRead) verify(c, buf, k);
}

StateView OffloadStateStore::acquire(Range r) {
  check_usable();
  if (acquired_) fail(ErrorCode::kInvalidArgument, "offload store: acquire() while a range is acquired");
  if (r.end() > total_)
    fail(ErrorCode::kInvalidArgument,
         strcat("optimizer state: range [", r.begin, ", ", r.end(), ") beyond ", total_));
  scratch_.assign(3 * r.count, 0.0f);
  float* out[3] = {scratch_.data(), scratch_.data() + r.count, scratch_.data() + 2 * r.count};
  for (std::size_t k = 0; k < chunks_.size(); ++k) {
    const Chunk& c = chunks_[k];
    const std::size_t b = std::max(c.r.begin, r.begin), e = std::min(c.r.end(), r.end());
    if (b >= e) continue;
    PinnedBuffer buf = pool_->acquire(opt_.timeout);
    sync_io(IoOp::kRead, k, buf.bytes());
    for (int a = 0; a < 3; ++a)
      std::memcpy(out[a] + (b - r.begin),
                  reinterpret_cast<const float*>(buf.bytes() + a * array_bytes(c.r.count)) + (b - c.r.begin),
                  (e - b) * sizeof(float));
  }
  if (r.end() > nvme_elems_) {
    const std::size_t b = std::max(r.begin, nvme_elems_);
    const float* src[3] = {host_master_.data(), host_m_.data(), host_v_.data()};
    for (int a = 0; a < 3; ++a)
      std::memcpy(out[a] + (b - r.begin), src[a] + (b - nvme_elems_), (r.end() - b) * sizeof(float));
  }
  acquired_ = true;
  return {out[0], out[1], out[2], r.count};
}

void OffloadStateStore::release(Range r, bool dirty) {
  if (!acquired_) fail(ErrorCode::kInvalidArgument, "offload store: release() without acquire()");
  acquired_ = false;
  if (!dirty) return;
  check_usable();
  const float* in[3] = {scratch_.data(), scratch_.data() + r.count, scratch_.data() + 2 * r.count};
  for (std::size_t k = 0; k < chunks_.size(); ++k) {
    const Chunk& c = chunks_[k];
    const std::size_t b = std::max(c.r.begin, r.begin), e = std::min(c.r.end(), r.end());
    if (b >= e) continue;
    PinnedBuffer buf = pool_->acquire(opt_.timeout);
    if (b != c.r.begin || e != c.r.end()) sync_io(IoOp::kRead, k, buf.bytes());
    for (int a = 0; a < 3; ++a)
      std::memcpy(reinterpret_cast<float*>(buf.bytes() + a * array_bytes(c.r.count)) + (b - c.r.begin),
                  in[a] + (b - r.begin), (e - b) * sizeof(float));
    sync_io(IoOp::kWrite, k, buf.bytes());
  }
  if (r.end() > nvme_elems_) {
    const std::size_t b = std::max(r.begin, nvme_elems_);
    float* dst[3] = {host_master_.data(), host_m_.data(), host_v_.data()};
    for (int a = 0; a < 3; ++a)
      std::memcpy(dst[a] + (b - nvme_elems_), in[a] + (b - r.begin), (r.end() - b) * sizeof(float));
  }
}

void OffloadStateStore::update(std::span<const Range> ranges, const UpdateFn& fn) {
  check_usable();
  bool same = ranges.size() == ranges_.size();
  for (std::size_t i = 0; same && i < ranges.size(); ++i)
    same = ranges[i].begin == ranges_[i].begin && ranges[i].count == ranges_[i].count;
  if (!same)
    fail(ErrorCode::kInvalidArgument, "offload store: update() with other ranges than at construction");
  stats_ = run(&fn, true, true, opt_.pipelined);
}

OffloadStepStats OffloadStateStore::measure_read() {
  check_usable();
  return run(nullptr, true, false, true);
}
OffloadStepStats OffloadStateStore::measure_write() {
  check_usable();
  return run(nullptr, false, true, true);
}
OffloadStepStats OffloadStateStore::measure_io() {
  check_usable();
  return run(nullptr, true, true, true);
}
OffloadStepStats OffloadStateStore::measure_update(const UpdateFn& fn) {
  check_usable();
  OffloadStepStats s;
  s.buffers = 1;
  s.buffer_size = pool_buffer_size();
  auto t0 = Clock::now();
  PinnedBuffer buf;
  if (!chunks_.empty()) {
    buf = pool_->acquire(opt_.timeout);
    sync_io(IoOp::kRead, 0, buf.bytes());
  }
  for (const Unit& u : units_) {
    auto t1 = Clock::now();
    if (u.chunk < 0) {
      const std::size_t o = u.r.begin - nvme_elems_;
      fn(u.r, {host_master_.data() + o, host_m_.data() + o, host_v_.data() + o, u.r.count});
      ++s.resident;
    } else {
      // Every chunk's update runs on the first chunk's state (the buffer is as large as any chunk).
      const std::size_t ab = array_bytes(u.r.count);
      auto* p = buf.bytes();
      fn(u.r, {reinterpret_cast<float*>(p), reinterpret_cast<float*>(p + ab),
               reinterpret_cast<float*>(p + 2 * ab), u.r.count});
      ++s.chunks;
    }
    s.t_update += since(t1);
  }
  s.t_step = since(t0);
  return s;
}

// The pipeline. read/write select which legs run (both for a step); fn may be null (no update).
OffloadStepStats OffloadStateStore::run(const UpdateFn* fn, bool read, bool write, bool pipelined) {
  OffloadStepStats s;
  s.buffers = pool_buffers();
  s.buffer_size = pool_buffer_size();
  auto t0 = Clock::now();

  struct Slot {
    std::size_t unit = 0, chunk = 0;
    PinnedBuffer buf;
    IoTicket ticket = 0;
  };
  std::deque<Slot> reads, writes;  // in flight, oldest first
  std::vector<std::size_t> nv;     // units on NVMe, in order
  for (std::size_t i = 0; i < units_.size(); ++i)
    if (units_[i].chunk >= 0) nv.push_back(i);
  std::size_t next_issue = 0;  // index into nv
  std::size_t done_units = 0;  // units fully processed (updated; their write submitted)
  std::size_t persisted = 0;   // chunks whose write completed
  const char* phase = "reading";
  std::size_t phase_chunk = 0;
  std::uint32_t phase_buffer = 0;

  auto wait_ticket = [&](IoTicket t) {
    if (!engine_->wait(t, opt_.timeout) && !engine_->wait(t, opt_.timeout))
      fail(ErrorCode::kTimeout, strcat("offload store: I/O did not complete within ",
                                       opt_.timeout.count(), " ms"));
  };
  std::size_t lost_writes = 0;
  auto retire_write = [&](bool block) -> bool {
    if (writes.empty()) return false;
    Slot w = std::move(writes.front());
    writes.pop_front();
    phase = "writing";
    phase_chunk = w.chunk;
    phase_buffer = w.buf.index();
    try {
      if (block) {
        auto t = Clock::now();
        wait_ticket(w.ticket);
        s.t_wait_write += since(t);
      } else if (!engine_->poll(w.ticket)) {
        writes.push_front(std::move(w));
        return false;
      }
    } catch (const IoError&) {
      ++lost_writes;  // retired with its error: the buffer is free again
      throw;
    }
    ++persisted;
    s.bytes_written += chunks_[w.chunk].bytes;
    return true;
  };
  auto get_buffer = [&](bool must) -> PinnedBuffer {
    while (true) {
      PinnedBuffer b = pool_->try_acquire();
      if (b) return b;
      if (retire_write(false)) continue;
      if (!must) return {};
      if (!writes.empty()) {
        retire_write(true);
        continue;
      }
      return pool_->acquire(opt_.timeout);  // cannot happen with reads drained; bounded anyway
    }
  };
  // Issues reads (or, without reads, just claims buffers) ahead of unit position `upto`.
  auto issue = [&](std::size_t need_through) {
    while (next_issue < nv.size()) {
      const bool must = next_issue <= need_through;
      if (!must && (!pipelined || !read)) break;
      PinnedBuffer b = get_buffer(must);
      if (!b) break;
      Slot sl;
      sl.unit = nv[next_issue];
      sl.chunk = static_cast<std::size_t>(units_[sl.unit].chunk);
      const Chunk& c = chunks_[sl.chunk];
      if (read) {
        phase = "reading";
        phase_chunk = sl.chunk;
        phase_buffer = b.index();
        sl.ticket = engine_->submit({IoOp::kRead, swap_->file(), b.bytes(), c.bytes, c.extent.offset});
      }
      sl.buf = std::move(b);
      reads.push_back(std::move(sl));
      ++next_issue;
    }
  };

  try {
    std::size_t nvi = 0;  // position in nv of the next NVMe unit
    for (std::size_t ui = 0; ui < units_.size(); ++ui) {
      const Unit& u = units_[ui];
      if (u.chunk < 0) {
        if (fn) {
          auto t = Clock::now();
          const std::size_t o = u.r.begin - nvme_elems_;
          (*fn)(u.r, {host_master_.data() + o, host_m_.data() + o, host_v_.data() + o, u.r.count});
          s.t_update += since(t);
        }
        ++s.resident;
        ++done_units;
        continue;
      }
      issue(nvi);
      Slot sl = std::move(reads.front());
      reads.pop_front();
      const Chunk& c = chunks_[sl.chunk];
      phase = "reading";
      phase_chunk = sl.chunk;
      phase_buffer = sl.buf.index();
      if (read) {
        auto t = Clock::now();
        wait_ticket(sl.ticket);
        s.t_wait_read += since(t);
        s.bytes_read += c.bytes;
      }
      // Keep the I/O busy while this chunk is updated.
      issue(nvi);
      auto t = Clock::now();
      if (read) verify(c, sl.buf.bytes(), sl.chunk);
      phase = "updating";
      if (fn) {
        const std::size_t ab = array_bytes(c.r.count);
        auto* p = sl.buf.bytes();
        (*fn)(c.r, {reinterpret_cast<float*>(p), reinterpret_cast<float*>(p + ab),
                    reinterpret_cast<float*>(p + 2 * ab), c.r.count});
      }
      if (write) {
        if (opt_.checksum) chunks_[sl.chunk].crc = crc32c(sl.buf.bytes(), c.bytes);
        s.t_update += since(t);
        phase = "writing";
        sl.ticket = engine_->submit({IoOp::kWrite, swap_->file(), sl.buf.bytes(), c.bytes, c.extent.offset});
        writes.push_back(std::move(sl));
        if (!pipelined) retire_write(true);
      } else {
        s.t_update += since(t);
      }
      ++s.chunks;
      ++done_units;
      ++nvi;
    }
    while (!writes.empty()) retire_write(true);
  } catch (const std::exception& e) {
    // Drain: never give a buffer back with I/O in flight. Later errors are secondary.
    auto drain = [&](std::deque<Slot>& q, bool is_write) {
      for (Slot& sl : q) {
        if (!sl.ticket) continue;
        try {
          if (!engine_->wait(sl.ticket, opt_.timeout) && !engine_->wait(sl.ticket, opt_.timeout))
            log_error("offload store: I/O of chunk ", sl.chunk, " still in flight after the drain");
          if (is_write) ++persisted;
        } catch (const std::exception&) {
          if (is_write) ++lost_writes;
        }
      }
      q.clear();
    };
    drain(reads, false);
    drain(writes, true);
    const std::size_t total_units = units_.size();
    std::string state;
    if (fn && write) {
      state = strcat("rank ", opt_.rank, " state: ", done_units, " of ", total_units,
                     " pieces of the step updated (", persisted, " NVMe chunks persisted",
                     lost_writes ? strcat(", ", lost_writes, " writes lost") : std::string(),
                     "), the rest not — the optimizer state is partially updated; "
                     "restore the last checkpoint or restart");
      failure_ = strcat("step failed ", phase, " chunk ", phase_chunk);
    } else if (write) {
      state = "the store's NVMe contents are incomplete";
      failure_ = strcat("write pass failed at chunk ", phase_chunk);
    } else {
      state = "nothing was changed";
    }
    const Chunk& c = chunks_.empty() ? Chunk{} : chunks_[std::min(phase_chunk, chunks_.size() - 1)];
    const std::string where =
        strcat("optimizer step ", phase, " chunk ", phase_chunk, " (elements [", c.r.begin, ", ",
               c.r.end(), "), pinned buffer ", phase_buffer, ", swap offset ", c.extent.offset, "); ", state);
    if (const auto* io = dynamic_cast<const IoError*>(&e))
      throw io->with_context(where);
    if (const auto* er = dynamic_cast<const Error*>(&e)) throw Error(er->code(), strcat(er->what(), "; ", where));
    throw Error(ErrorCode::kInternal, strcat(e.what(), "; ", where));
  }
  s.t_step = since(t0);
  return s;
}

namespace {
void create_swap_dirs(const std::vector<std::string>& paths) {
  for (const auto& p : paths) {
    std::error_code ec;
    if (!std::filesystem::exists(p, ec)) {
      if (::mkdir(p.c_str(), 0700) != 0 && errno != EEXIST)
        throw IoError("mkdir", p, 0, 0, errno, "creating the tiers.nvme.paths directory");
      log_info("offload: created swap directory ", p);
    }
  }
}
}  // namespace

NvmeArray::NvmeArray(const OffloadStoreOptions& options, std::size_t elems, std::size_t elem_size,
                     std::shared_ptr<IoEngine> engine, std::string label)
    : opt_(options), elems_(elems), es_(elem_size), engine_(std::move(engine)), label_(std::move(label)) {
  if (!engine_) fail(ErrorCode::kInvalidArgument, strcat("nvme ", label_, ": no I/O engine"));
  if (opt_.paths.empty())
    fail(ErrorCode::kInvalidArgument,
         strcat("offload: ", label_, " on nvme but tiers.nvme.paths is empty: name a directory on NVMe"));
  if (opt_.buffer_size < 4096 || opt_.buffer_count < 1)
    fail(ErrorCode::kInvalidArgument,
         strcat("nvme ", label_, ": tiers.host.buffer_size ", opt_.buffer_size,
                " bytes is below the minimum of 4096 (one buffer of 4096 B)"));
  if (elems_ == 0) return;
  chunk_elems_ = std::max<std::size_t>(1, (opt_.buffer_size / 4096 * 4096) / es_);
  std::uint64_t need = 0, biggest = 0;
  for (std::size_t b = 0; b < elems_; b += chunk_elems_) {
    Chunk c;
    c.r = {b, std::min(chunk_elems_, elems_ - b)};
    c.bytes = round_up(c.r.count * es_, 4096);
    need += c.bytes;
    biggest = std::max(biggest, c.bytes);
    chunks_.push_back(c);
  }
  if (opt_.nvme_budget && need > opt_.nvme_budget)
    fail(ErrorCode::kBudget, strcat("nvme ", label_, " rank ", opt_.rank, ": need ", need,
                                    " bytes of swap space but tiers.nvme.budget leaves this rank ",
                                    opt_.nvme_budget));
  SwapSpaceOptions so;
  so.paths = opt_.paths;
  so.capacity = need;
  so.rank = opt_.rank;
  so.block_size = opt_.block_size;
  swap_ = std::make_unique<SwapSpace>(so, *engine_);
  if (swap_->alignment() > 4096)
    fail(ErrorCode::kUnsupported,
         strcat("nvme ", label_, ": swap alignment ", swap_->alignment(), " above 4096 is not supported"));
  for (std::size_t k = 0; k < chunks_.size(); ++k)
    chunks_[k].extent = swap_->allocate(chunks_[k].bytes, strcat(label_, " chunk ", k));
  PinnedPoolOptions po;
  po.buffer_count = static_cast<std::uint32_t>(std::min<std::size_t>(opt_.buffer_count, chunks_.size()));
  po.buffer_size = biggest;
  po.pinned_budget = opt_.pinned_budget;
  pool_ = std::make_unique<PinnedPool>(po, nullptr, engine_.get());
}

NvmeArray::~NvmeArray() {
  drain();
  if (stuck_) {
    log_error("nvme ", label_, " rank ", opt_.rank,
              ": I/O timed out earlier; leaking the pinned pool rather than freeing memory the "
              "device may still write");
    (void)pool_.release();
  }
}

void NvmeArray::check_usable() const {
  if (stuck_)
    fail(ErrorCode::kIo, strcat("nvme ", label_, " rank ", opt_.rank,
                                ": unusable after an I/O timeout; restart the job"));
}

std::uint64_t NvmeArray::swap_bytes() const {
  std::uint64_t b = 0;
  for (const Chunk& c : chunks_) b += c.bytes;
  return b;
}

std::pair<std::string, std::uint64_t> NvmeArray::chunk_location(std::size_t k) const {
  if (k >= chunks_.size()) fail(ErrorCode::kInvalidArgument, strcat("nvme ", label_, ": no chunk ", k));
  return swap_->locate(chunks_[k].extent.offset);
}

std::string NvmeArray::where(std::size_t k) const {
  const Chunk& c = chunks_[k];
  return strcat("nvme ", label_, " rank ", opt_.rank, " chunk ", k, " (elements [", c.r.begin, ", ",
                c.r.end(), "))");
}

IoTicket NvmeArray::submit(IoOp op, std::size_t k, unsigned char* buf) {
  const Chunk& c = chunks_[k];
  return engine_->submit({op, swap_->file(), buf, c.bytes, c.extent.offset});
}

// Waits for (and retires) ticket t of chunk k: IoError gains the chunk in its context.
void NvmeArray::wait(IoTicket t, std::size_t k) {
  try {
    if (!engine_->wait(t, opt_.timeout) && !engine_->wait(t, opt_.timeout)) {
      // The transfer may still land in its buffer: the pool is never reused or freed (see drain).
      stuck_ = true;
      auto [path, off] = swap_->locate(chunks_[k].extent.offset);
      fail(ErrorCode::kTimeout, strcat(where(k), ": I/O at ", path, " offset ", off,
                                       " did not complete within 2 x ", opt_.timeout.count(),
                                       " ms; the array is unusable"));
    }
  } catch (const IoError& e) {
    throw e.with_context(where(k));
  }
}

void NvmeArray::verify(std::size_t k, const unsigned char* data) const {
  if (!opt_.checksum) return;
  const Chunk& c = chunks_[k];
  const std::uint32_t got = crc32c(data, c.bytes);
  if (got != c.crc) {
    auto [path, off] = swap_->locate(c.extent.offset);
    fail(ErrorCode::kChecksum, strcat(where(k), ": checksum mismatch reading ", path, " offset ", off,
                                      " length ", c.bytes, ": CRC32C ", got, " != written ", c.crc));
  }
}

// Drops a speculative read: waits for it (its error does not matter: nobody needs the data).
// Past the timeout the transfer may still land in the buffer: the array becomes unusable.
void NvmeArray::discard(Slot&& a) {
  Slot s = std::move(a);
  bool done = false;
  try {
    done = engine_->wait(s.ticket, opt_.timeout) || engine_->wait(s.ticket, opt_.timeout);
  } catch (const std::exception&) {
    done = true;  // retired with its error
  }
  if (!done) {
    stuck_ = true;
    (void)s.buf.detach();  // never handed out again (the pool is leaked at destruction)
    fail(ErrorCode::kTimeout, strcat(where(s.k), ": a read-ahead did not complete within 2 x ",
                                     opt_.timeout.count(), " ms; the array is unusable"));
  }
}

// Waits for the oldest write-behind; its buffer goes back to the pool.
void NvmeArray::retire_oldest_write() {
  Slot w = std::move(behind_.front());
  behind_.pop_front();
  wait(w.ticket, w.k);  // retired by the engine even when it throws: the buffer may be released
  written_ += chunks_[w.k].bytes;
}

// A free pool buffer: a free one, else the oldest write-behind's once it lands, else the newest
// read-ahead's (discarded), else — while filling — the oldest partial chunk's, written as it is
// (it is read back when the rest of it arrives). The caller holds no current chunk buffer it
// could want back.
PinnedBuffer NvmeArray::take_buffer() {
  for (;;) {
    if (PinnedBuffer b = pool_->try_acquire()) return b;
    if (!behind_.empty()) {
      retire_oldest_write();
      continue;
    }
    if (!ahead_.empty()) {
      Slot a = std::move(ahead_.back());
      ahead_.pop_back();
      discard(std::move(a));
      continue;
    }
    if (!staged_.empty()) {
      Slot old = std::move(staged_.front());
      staged_.pop_front();
      fill_on_disk_[old.k] = true;
      write_staged(std::move(old));
      continue;
    }
    return pool_->acquire(opt_.timeout);  // bounded; only when the pool is smaller than one slot
  }
}

// Brings elements [filled_, end) of a fresh current chunk in from NVMe, so the whole chunk is valid.
void NvmeArray::materialize() {
  const std::size_t k = cur_.k;
  const Chunk& c = chunks_[k];
  PinnedBuffer tmp = take_buffer();
  wait(submit(IoOp::kRead, k, tmp.bytes()), k);
  read_ += c.bytes;
  verify(k, tmp.bytes());
  std::memcpy(cur_.buf.bytes() + filled_ * es_, tmp.bytes() + filled_ * es_, (c.r.count - filled_) * es_);
  fresh_ = false;
}

// Leaves the current chunk: a modified one is written behind, a clean one's buffer is freed.
void NvmeArray::leave_current() {
  if (!cur_.buf) return;
  if (fresh_ && filled_ < chunks_[cur_.k].r.count) materialize();
  fresh_ = false;
  Slot s = std::move(cur_);
  cur_ = Slot{};
  if (!dirty_) return;
  dirty_ = false;
  Chunk& c = chunks_[s.k];
  std::memset(s.buf.bytes() + c.r.count * es_, 0, c.bytes - c.r.count * es_);
  if (opt_.checksum) c.crc = crc32c(s.buf.bytes(), c.bytes);
  s.ticket = submit(IoOp::kWrite, s.k, s.buf.bytes());
  behind_.push_back(std::move(s));
}

// Reads ahead of the current chunk into free buffers (never a chunk with a write in flight), and
// retires write-behinds that have landed on the way.
void NvmeArray::read_ahead() {
  std::size_t next = ahead_.empty() ? cur_.k + 1 : ahead_.back().k + 1;
  while (next < chunks_.size()) {
    for (const Slot& w : behind_)
      if (w.k == next) return;
    PinnedBuffer b = pool_->try_acquire();
    while (!b && !behind_.empty()) {
      bool landed;
      try {
        landed = engine_->poll(behind_.front().ticket);
      } catch (const IoError& e) {  // the write failed: retired with its error
        const std::size_t k = behind_.front().k;
        behind_.pop_front();
        throw e.with_context(where(k));
      } catch (...) {
        behind_.pop_front();
        throw;
      }
      if (!landed) break;
      Slot w = std::move(behind_.front());
      behind_.pop_front();
      written_ += chunks_[w.k].bytes;
      b = std::move(w.buf);
    }
    if (!b) return;
    Slot a;
    a.k = next;
    a.ticket = submit(IoOp::kRead, next, b.bytes());
    a.buf = std::move(b);
    ahead_.push_back(std::move(a));
    ++next;
  }
}

// Makes chunk k current. for_write with `from` == 0: a set() starting at the chunk's first
// element, which needs no read.
void NvmeArray::load(std::size_t k, bool for_write, std::size_t from) {
  if (cur_.buf && cur_.k == k) {
    if (fresh_ && !(for_write && from == filled_)) materialize();
    return;
  }
  leave_current();
  // From the read-ahead: discard what precedes k (a skip), or everything when k is not there.
  std::size_t i = 0;
  while (i < ahead_.size() && ahead_[i].k != k) ++i;
  const bool hit = i < ahead_.size();
  if (!hit) i = ahead_.size();
  for (std::size_t j = 0; j < i; ++j) {
    Slot a = std::move(ahead_.front());
    ahead_.pop_front();
    discard(std::move(a));
  }
  if (hit) {
    Slot a = std::move(ahead_.front());
    ahead_.pop_front();
    wait(a.ticket, k);
    read_ += chunks_[k].bytes;
    verify(k, a.buf.bytes());
    a.ticket = 0;
    cur_ = std::move(a);
  } else {
    // Written behind and not yet landed: its buffer holds exactly the chunk.
    for (auto it = behind_.begin(); it != behind_.end(); ++it) {
      if (it->k != k) continue;
      Slot w = std::move(*it);
      behind_.erase(it);
      wait(w.ticket, k);
      written_ += chunks_[k].bytes;
      w.ticket = 0;
      cur_ = std::move(w);
      break;
    }
    if (!cur_.buf) {
      Slot s;
      s.k = k;
      s.buf = take_buffer();
      if (for_write && from == 0 && pool_->buffer_count() > 1) {  // (1 buffer: no room to merge)
        fresh_ = true;
        filled_ = 0;
      } else {
        wait(submit(IoOp::kRead, k, s.buf.bytes()), k);
        read_ += chunks_[k].bytes;
        verify(k, s.buf.bytes());
      }
      cur_ = std::move(s);
    }
  }
  if (!for_write) read_ahead();
}

void NvmeArray::drain() noexcept {
  // Never give a buffer back with I/O in flight. A write-behind that fails here was never waited
  // for by anyone: say so.
  auto finish = [&](std::deque<Slot>& q, bool writes) {
    for (Slot& s : q) {
      try {
        if (!engine_->wait(s.ticket, opt_.timeout) && !engine_->wait(s.ticket, opt_.timeout)) {
          log_error(where(s.k), ": I/O still in flight after 2 x ", opt_.timeout.count(),
                    " ms; leaking its pinned buffer");
          stuck_ = true;
          (void)s.buf.detach();
        } else if (writes)
          written_ += chunks_[s.k].bytes;
      } catch (const std::exception& e) {
        if (writes) log_error(where(s.k), ": write-behind failed and nobody waited for it: ", e.what());
      }
    }
    q.clear();
  };
  finish(ahead_, false);
  finish(behind_, true);
  cur_ = Slot{};
  dirty_ = fresh_ = false;
}

void NvmeArray::put(const unsigned char* src) {
  check_usable();
  for (Slot& s : staged_) s.buf.release();  // an unfinished fill is abandoned: put replaces all
  staged_.clear();
  filling_ = false;
  // Whatever is in flight targets the old contents: let it land first (writes must not reorder).
  while (!behind_.empty()) retire_oldest_write();
  drain();
  check_usable();
  std::deque<Slot> q;
  try {
    for (std::size_t k = 0; k < chunks_.size(); ++k) {
      Chunk& c = chunks_[k];
      PinnedBuffer b = pool_->try_acquire();
      while (!b) {
        Slot w = std::move(q.front());
        q.pop_front();
        wait(w.ticket, w.k);
        written_ += chunks_[w.k].bytes;
        b = std::move(w.buf);
      }
      std::memcpy(b.bytes(), src + c.r.begin * es_, c.r.count * es_);
      std::memset(b.bytes() + c.r.count * es_, 0, c.bytes - c.r.count * es_);
      if (opt_.checksum) c.crc = crc32c(b.bytes(), c.bytes);
      Slot s;
      s.k = k;
      s.ticket = submit(IoOp::kWrite, k, b.bytes());
      s.buf = std::move(b);
      q.push_back(std::move(s));
    }
    while (!q.empty()) {
      Slot w = std::move(q.front());
      q.pop_front();
      wait(w.ticket, w.k);
      written_ += chunks_[w.k].bytes;
    }
  } catch (...) {
    behind_ = std::move(q);
    drain();
    throw;
  }
}

void NvmeArray::flush() {
  require_mode("flush", false);
  if (cur_.buf && dirty_) {
    const std::size_t k = cur_.k;
    leave_current();  // written behind; wait for it below and keep its buffer as the current chunk
    Slot w = std::move(behind_.back());
    behind_.pop_back();
    wait(w.ticket, k);
    written_ += chunks_[k].bytes;
    w.ticket = 0;
    cur_ = std::move(w);
  }
  while (!behind_.empty()) retire_oldest_write();
}

// check_usable(), then that the array is (filling) or is not (!filling) between begin_fill() and
// end_fill(); `call` names the refused call.
void NvmeArray::require_mode(const char* call, bool filling) const {
  check_usable();
  if (filling_ != filling)
    fail(ErrorCode::kInvalidArgument,
         strcat("nvme ", label_, ": ", call, filling ? "() without begin_fill()" : "() while filling"));
}

// Checks r against the array, then calls fn(k, chunk, pos, end) for each piece [pos, end) of r
// that lies in chunk k, in ascending order.
template <typename F>
void NvmeArray::for_each_piece(Range r, F&& fn) {
  if (r.end() > elems_)
    fail(ErrorCode::kInvalidArgument, strcat("nvme ", label_, ": range [", r.begin, ", ", r.end(),
                                             ") beyond ", elems_));
  for (std::size_t pos = r.begin; pos < r.end();) {
    const std::size_t k = pos / chunk_elems_;
    const Chunk& c = chunks_[k];
    const std::size_t e = std::min(r.end(), c.r.end());
    fn(k, c, pos, e);
    pos = e;
  }
}

void NvmeArray::begin_fill() {
  check_usable();
  // (A fill left unfinished by an error is abandoned.) Writes in flight target the old contents: let them land; reads ahead are of no use now.
  while (!behind_.empty()) retire_oldest_write();
  drain();
  check_usable();
  for (Slot& s : staged_) s.buf.release();
  staged_.clear();
  fill_count_.assign(chunks_.size(), 0);
  fill_on_disk_.assign(chunks_.size(), false);
  filling_ = true;
}

// Writes an assembled (or partial) chunk behind.
void NvmeArray::write_staged(Slot&& s) {
  Chunk& c = chunks_[s.k];
  if (opt_.checksum) c.crc = crc32c(s.buf.bytes(), c.bytes);
  s.ticket = submit(IoOp::kWrite, s.k, s.buf.bytes());
  behind_.push_back(std::move(s));
}

void NvmeArray::fill(Range r, const unsigned char* src) {
  require_mode("fill", true);
  for_each_piece(r, [&](std::size_t k, const Chunk& c, std::size_t pos, std::size_t e) {
    auto it = std::find_if(staged_.begin(), staged_.end(), [&](const Slot& s) { return s.k == k; });
    if (it == staged_.end()) {
      Slot s;
      s.k = k;
      bool has_contents = false;
      // Written partially and still in flight: wait for that write; its buffer holds the chunk.
      for (auto w = behind_.begin(); w != behind_.end(); ++w) {
        if (w->k != k) continue;
        Slot pending = std::move(*w);
        behind_.erase(w);
        wait(pending.ticket, k);
        written_ += c.bytes;
        pending.ticket = 0;
        s = std::move(pending);
        has_contents = true;
        break;
      }
      if (!s.buf) s.buf = take_buffer();
      if (has_contents) {
        // the buffer is the partial chunk as written
      } else if (fill_on_disk_[k]) {  // continue what was written partially
        wait(submit(IoOp::kRead, k, s.buf.bytes()), k);
        read_ += c.bytes;
        verify(k, s.buf.bytes());
      } else {
        std::memset(s.buf.bytes(), 0, c.bytes);
      }
      staged_.push_back(std::move(s));
      it = staged_.end() - 1;
    }
    std::memcpy(it->buf.bytes() + (pos - c.r.begin) * es_, src + (pos - r.begin) * es_, (e - pos) * es_);
    fill_count_[k] += e - pos;
    if (fill_count_[k] > c.r.count)
      fail(ErrorCode::kInvalidArgument, strcat(where(k), ": filled more than once"));
    if (fill_count_[k] == c.r.count) {
      Slot done = std::move(*it);
      staged_.erase(it);
      write_staged(std::move(done));
    }
  });
}

void NvmeArray::end_fill() {
  require_mode("end_fill", true);
  while (!staged_.empty()) {
    Slot s = std::move(staged_.front());
    staged_.pop_front();
    write_staged(std::move(s));
  }
  for (std::size_t k = 0; k < chunks_.size(); ++k) {
    if (fill_count_[k] > 0 || fill_on_disk_[k]) continue;
    Slot s;  // nothing arrived for this chunk (padding only): zeros
    s.k = k;
    s.buf = take_buffer();
    std::memset(s.buf.bytes(), 0, chunks_[k].bytes);
    write_staged(std::move(s));
  }
  while (!behind_.empty()) retire_oldest_write();
  filling_ = false;
}

void NvmeArray::get(Range r, unsigned char* dst) {
  require_mode("get", false);
  for_each_piece(r, [&](std::size_t k, const Chunk& c, std::size_t pos, std::size_t e) {
    load(k, false, pos - c.r.begin);
    std::memcpy(dst + (pos - r.begin) * es_, cur_.buf.bytes() + (pos - c.r.begin) * es_, (e - pos) * es_);
  });
}

void NvmeArray::set(Range r, const unsigned char* src) {
  require_mode("set", false);
  for_each_piece(r, [&](std::size_t k, const Chunk& c, std::size_t pos, std::size_t e) {
    load(k, true, pos - c.r.begin);
    std::memcpy(cur_.buf.bytes() + (pos - c.r.begin) * es_, src + (pos - r.begin) * es_, (e - pos) * es_);
    if (fresh_) filled_ = e - c.r.begin;
    dirty_ = true;
  });
}

namespace {
std::mutex wrapper_mu;
OffloadIoWrapper& wrapper() {
  static OffloadIoWrapper w;
  return w;
}
std::shared_ptr<IoEngine> offload_io_engine(const Config& config, const std::string& dir,
                                            const char* what, int rank) {
  std::unique_ptr<IoEngine> e = make_io_engine(IoEngineOptions::from(config.tiers.nvme), dir);
  OffloadIoWrapper w;
  {
    std::lock_guard<std::mutex> lock(wrapper_mu);
    w = wrapper();
  }
  if (w) return w(std::move(e), what, rank);
  return std::shared_ptr<IoEngine>(std::move(e));
}
}  // namespace

void set_offload_io_wrapper(OffloadIoWrapper wrap) {
  std::lock_guard<std::mutex> lock(wrapper_mu);
  wrapper() = std::move(wrap);
}

namespace {
DeviceWrapper& device_wrapper() {
  static DeviceWrapper w;
  return w;
}
}  // namespace

void set_optimizer_device_wrapper(DeviceWrapper wrap) {
  std::lock_guard<std::mutex> lock(wrapper_mu);
  device_wrapper() = std::move(wrap);
}

std::unique_ptr<Device> make_optimizer_device(const Config& config) {
  std::unique_ptr<Device> d = make_device(config.runtime.device);
  DeviceWrapper w;
  {
    std::lock_guard<std::mutex> lock(wrapper_mu);
    w = device_wrapper();
  }
  return w ? w(std::move(d)) : std::move(d);
}

namespace {
std::unique_ptr<NvmeArray> make_nvme_array(const Config& config, const OffloadTarget& g, int rank,
                                           std::size_t partition, std::size_t elem_size,
                                           const char* label) {
  if (g.tier != Tier::kNvme || g.fraction <= 0 || partition == 0) return nullptr;
  OffloadStoreOptions o = OffloadStoreOptions::from(config, static_cast<std::uint32_t>(rank), partition);
  const double want = std::ceil(g.fraction * static_cast<double>(partition));
  const std::size_t elems = std::min<std::size_t>(partition, round_up(static_cast<std::uint64_t>(want), kElemAlign));
  create_swap_dirs(o.paths);
  return std::make_unique<NvmeArray>(o, elems, elem_size,
                                     offload_io_engine(config, o.paths.front(), label, rank), label);
}
}  // namespace

std::unique_ptr<NvmeArray> make_nvme_gradients(const Config& config, int rank, std::size_t partition,
                                               std::size_t elem_size) {
  if (config.zero.stage < 2) return nullptr;
  return make_nvme_array(config, config.offload.gradients, rank, partition, elem_size, "gradients");
}
std::unique_ptr<NvmeArray> make_nvme_params(const Config& config, int rank, std::size_t partition,
                                            std::size_t elem_size) {
  if (config.zero.stage < 3) return nullptr;
  return make_nvme_array(config, config.offload.params, rank, partition, elem_size, "parameters");
}

std::unique_ptr<OptimizerStateStore> make_state_store(const Config& config, int rank,
                                                      std::span<const float> init,
                                                      std::vector<Range> ranges) {
  OffloadStoreOptions o = OffloadStoreOptions::from(config, static_cast<std::uint32_t>(rank), init.size());
  if (o.nvme_elems == 0) return make_resident_state_store(init);
  create_swap_dirs(o.paths);
  return std::make_unique<OffloadStateStore>(o, init, std::move(ranges),
                                             offload_io_engine(config, o.paths.front(), "optimizer", rank));
}

}  // namespace strata::zero
