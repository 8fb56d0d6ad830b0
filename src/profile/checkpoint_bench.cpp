// Checkpoint saves measured (see checkpoint_bench.hpp).
#include "profile/checkpoint_bench.hpp"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "core/checked_math.hpp"
#include "core/file_env.hpp"
#include "core/safe_fs.hpp"
#include "profile/profile_internal.hpp"
#include "strata/communicator.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "strata/io_engine.hpp"
#include "strata/io_file.hpp"
#include "zero/engine_access.hpp"

namespace strata::profile {
namespace {

using zero::EngineAccess;

constexpr std::uint64_t kPieceBytes = 4ull << 20;  // the raw write's piece (a checkpoint piece)
constexpr std::uint64_t kRawSlots = 64;            // read slots of the raw references
constexpr int kMaxBusySteps = 100000;              // steps per round while a writer runs, at most

Config bench_config(const CheckpointBenchOptions& o) {
  Config cfg = o.config;
  cfg.world.ranks = 1;
  cfg.world.ranks_per_node = 1;
  if (cfg.zero.stage < 1) cfg.zero.stage = 1;  // the optimizer state leaves the gpu at stage >= 1
  if (cfg.zero.stage < 2 && cfg.optimizer.overlap == OptimizerOverlap::kOn)
    cfg.optimizer.overlap = OptimizerOverlap::kAuto;  // serial at stage 1, as `auto` says
  cfg.offload.optimizer.tier = o.state;
  cfg.offload.optimizer.fraction = 1.0;
  cfg.offload.optimizer.pin_memory = o.state == Tier::kCpu;
  if (o.state == Tier::kNvme && cfg.tiers.nvme.paths.empty())
    fail(ErrorCode::kInvalidArgument,
         "bench checkpoint: state on nvme needs tiers.nvme.paths (a directory on NVMe)");
  // A writer that has not finished when a step needs room waits: room for every block.
  if (o.state == Tier::kNvme)
    cfg.tiers.nvme.snapshot_room = std::max(cfg.tiers.nvme.snapshot_room, 1.0);
  return cfg;
}

double cpu_now() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

double time_of(const std::function<void()>& fn) {
  const Stopwatch w;
  fn();
  return w.seconds();
}

// A new file `name` of `dir` for the raw references, through `engine` (O_DIRECT per its options).
std::shared_ptr<IoFile> raw_file(IoEngine& engine, const SafeDir& dir, const std::string& name) {
  dir.try_remove(name, false);
  IoFileOptions fo;
  fo.create = fo.exclusive = true;
  fo.direct_io = engine.options().direct_io;
  return std::make_shared<IoFile>(IoFile::open_at(dir.fd(), name, dir.child_path(name), fo));
}

// Requests of kPieceBytes (the last one padded to the alignment) over [0, bytes) of `file`; reads
// go round a ring of slots of `buffer` (kPieceBytes each), writes all come from its first slot.
void add_requests(std::vector<IoRequest>& out, IoOp op, FileId file, std::uint64_t bytes,
                  const IoBuffer& buffer) {
  const std::uint64_t slots = buffer.size() / kPieceBytes;
  for (std::uint64_t off = 0, i = 0; off < bytes; off += kPieceBytes, ++i) {
    unsigned char* slot = buffer.bytes() + (op == IoOp::kRead ? i % slots : 0) * kPieceBytes;
    out.push_back(
        {op, file, slot, round_up(std::min(kPieceBytes, bytes - off), kDirectAlignment), off});
  }
}

// The references: `write_bytes` written sequentially into a new file of `dir` through the I/O
// engine (the NVMe tier's options: io_uring where it works, O_DIRECT, its queue depth), kPieceBytes
// requests all submitted at once, then fdatasynced: the disk's sequential write bound, as fio
// measures it. With `read_bytes` (state on NVMe: what the writer reads), the same time also reads
// that many bytes of another file, written beforehand (not timed): the disk's bound for moving
// what the writer moves. The files are removed. Returns the seconds.
double raw_transfer(IoEngine& engine, const SafeDir& dir, std::uint64_t write_bytes,
                    std::uint64_t read_bytes, const IoBuffer& buffer) {
  const std::string wname = strcat(".strata-bench-raw-", ::getpid());
  const std::string rname = strcat(".strata-bench-raw-source-", ::getpid());
  std::vector<IoRequest> requests;
  std::shared_ptr<IoFile> source;
  FileId rid = 0;
  if (read_bytes > 0) {
    source = raw_file(engine, dir, rname);
    rid = engine.register_file(source);
    add_requests(requests, IoOp::kWrite, rid, read_bytes, buffer);
    engine.wait_for(engine.submit_batch(requests), std::chrono::minutes(30));
    requests.clear();
    add_requests(requests, IoOp::kRead, rid, read_bytes, buffer);
  }
  const std::shared_ptr<IoFile> file = raw_file(engine, dir, wname);
  const FileId wid = engine.register_file(file);
  add_requests(requests, IoOp::kWrite, wid, write_bytes, buffer);
  const Stopwatch w;
  engine.wait_for(engine.submit_batch(requests), std::chrono::minutes(30));
  file->sync();
  const double s = w.seconds();
  engine.unregister_file(wid);
  file->close();
  dir.try_remove(wname, false);
  if (source) {
    engine.unregister_file(rid);
    source->close();
    dir.try_remove(rname, false);
  }
  return s;
}

struct Samples {
  std::vector<double> blocking, async_call, writer, raw, copy, idle, busy, writer_busy;
  std::vector<double> writer_cpu, idle_cpu;
  double paused = 0;
  std::uint64_t pauses = 0;
};

// One round: idle steps, a blocking save, an asynchronous save on an idle loop and the raw write
// (alternated), an asynchronous save with steps taken while its writer works.
void round(Engine& e, const CheckpointBenchOptions& o, const SafeDir& dir,
           const std::function<void()>& step, IoEngine& engine, const IoBuffer& buffer,
           const CheckpointBenchResult& r, Samples& s) {
  for (int i = 0; i < o.steps; ++i) {
    const double c0 = cpu_now();
    s.idle.push_back(time_of(step));
    s.idle_cpu.push_back(cpu_now() - c0);
  }
  s.blocking.push_back(time_of([&] { e.save_checkpoint(o.dir, SaveMode::kBlocking); }));
  const double c0 = cpu_now();
  s.async_call.push_back(time_of([&] { e.save_checkpoint(o.dir, SaveMode::kAsync); }));
  s.writer.push_back(EngineAccess::wait_checkpoint_writer(e).write_s);
  s.writer_cpu.push_back(cpu_now() - c0);
  e.wait_checkpoint();
  s.raw.push_back(raw_transfer(engine, dir, r.shard_bytes, 0, buffer));
  if (r.state_read_bytes > 0)
    s.copy.push_back(raw_transfer(engine, dir, r.shard_bytes, r.state_read_bytes, buffer));
  s.async_call.push_back(time_of([&] { e.save_checkpoint(o.dir, SaveMode::kAsync); }));
  // A step that begins while the writer works counts as busy.
  for (int i = 0; i < kMaxBusySteps && EngineAccess::checkpoint_writing(e); ++i)
    s.busy.push_back(time_of(step));
  const auto w = EngineAccess::wait_checkpoint_writer(e);
  s.writer_busy.push_back(w.write_s);
  s.paused += w.paused_s;
  s.pauses += w.pauses;
  e.wait_checkpoint();
}

void summarize(const Samples& s, int rounds, CheckpointBenchResult& r) {
  r.blocking_save_s = median(s.blocking);
  r.async_blocked_s = median(s.async_call);
  r.blocked_ratio = r.blocking_save_s > 0 ? r.async_blocked_s / r.blocking_save_s : 0;
  r.writer_s = median(s.writer);
  r.writer_bytes_per_s = r.writer_s > 0 ? static_cast<double>(r.shard_bytes) / r.writer_s : 0;
  r.raw_write_s = median(s.raw);
  r.raw_write_bytes_per_s =
      r.raw_write_s > 0 ? static_cast<double>(r.shard_bytes) / r.raw_write_s : 0;
  r.writer_vs_raw =
      r.raw_write_bytes_per_s > 0 ? r.writer_bytes_per_s / r.raw_write_bytes_per_s : 0;
  r.raw_move_s = s.copy.empty() ? r.raw_write_s : median(s.copy);
  r.writer_vs_move = r.writer_s > 0 ? r.raw_move_s / r.writer_s : 0;
  r.idle_step_s = median(s.idle);
  r.busy_step_s = median(s.busy);
  r.busy_steps = s.busy.size();
  r.busy_slowdown = r.idle_step_s > 0 && !s.busy.empty() ? r.busy_step_s / r.idle_step_s : 0;
  r.writer_busy_s = median(s.writer_busy);
  // The steps' share: a round's busy steps and the writer share the disk and the CPUs. At worst
  // the steps wait for every second the writer holds what they use, one after the other: the
  // disk's time for what the writer moves (raw_move_s) when the steps' state is on NVMe (a step
  // whose state is in host memory does no disk I/O), and the writer's CPU time (checksums, the
  // copies out of the pinned versions; measured alone on the idle loop).
  r.writer_cpu_s = median(s.writer_cpu);
  const double busy_per_round = static_cast<double>(r.busy_steps) / rounds * r.idle_step_s;
  const double shared = (r.state_read_bytes > 0 ? r.raw_move_s : 0) + r.writer_cpu_s;
  r.predicted_busy_slowdown = busy_per_round > 0 ? 1 + shared / busy_per_round : 0;
  r.writer_paused_s = s.paused;
  r.busy_vs_predicted =
      r.predicted_busy_slowdown > 0 ? r.busy_slowdown / r.predicted_busy_slowdown : 0;
  const auto [fastest, slowest] = std::minmax_element(s.idle.begin(), s.idle.end());
  r.idle_step_spread = r.idle_step_s > 0 ? (*slowest - *fastest) / r.idle_step_s : 0;
  r.idle_step_cpu_s = median(s.idle_cpu);
  r.writer_pauses = s.pauses;
}

}  // namespace

CheckpointBenchResult run_checkpoint_bench(const CheckpointBenchOptions& o) {
  if (o.elements < 1) fail(ErrorCode::kInvalidArgument, "bench checkpoint: --params must be >= 1");
  if (o.rounds < 1 || o.steps < 1)
    fail(ErrorCode::kInvalidArgument, "bench checkpoint: --rounds and --steps must be >= 1");
  if (o.state != Tier::kNvme && o.state != Tier::kCpu)
    fail(ErrorCode::kInvalidArgument, "bench checkpoint: the state lives on nvme or cpu");
  const Config cfg = bench_config(o);
  SafeDirOptions dopt;
  dopt.create = true;
  dopt.role = "bench checkpoint --dir";
  const SafeDir dir = SafeDir::open(o.dir, dopt);
  CheckpointBenchResult res;
  res.state = tier_name(o.state);
  res.params = o.elements;
  res.shard_bytes = o.elements * (dtype_size(cfg.precision.params) + 12);
  res.state_read_bytes = o.state == Tier::kNvme ? o.elements * 12 : 0;
  const std::unique_ptr<Communicator> comm = one_rank(cfg);
  Engine e(cfg, *comm);
  {
    std::mt19937 rng(23);
    add_random_parameter(e, "state", o.elements, 0.1f, rng);
  }
  e.finalize();
  // Zero gradients: Adam's work and the I/O are those of any gradient.
  const std::vector<unsigned char> grads(o.elements * dtype_size(cfg.precision.grads), 0);
  const auto step = [&] {
    e.set_gradient_host(0, grads.data());
    e.step();
  };
  step();  // warm-up: page faults, thread pools
  const std::unique_ptr<IoEngine> engine =
      make_io_engine(IoEngineOptions::from(cfg.tiers.nvme), dir.path());
  const IoBuffer buffer = IoBuffer::allocate(kRawSlots * kPieceBytes);
  std::memset(buffer.data(), 0x5a, buffer.size());
  Samples s;
  for (int r = 0; r < o.rounds; ++r) round(e, o, dir, step, *engine, buffer, res, s);
  summarize(s, o.rounds, res);
  return res;
}

}  // namespace strata::profile
