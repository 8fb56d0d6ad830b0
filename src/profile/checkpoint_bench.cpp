// Checkpoint saves measured (see checkpoint_bench.hpp).
#include "profile/checkpoint_bench.hpp"

#include <unistd.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "core/file_env.hpp"
#include "core/safe_fs.hpp"
#include "profile/profile_internal.hpp"
#include "strata/communicator.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "zero/engine_access.hpp"

namespace strata::profile {
namespace {

using zero::EngineAccess;

constexpr std::uint64_t kPieceBytes = 4ull << 20;  // the raw write's piece (a checkpoint piece)
constexpr int kMaxBusySteps = 100000;              // steps per round while a writer runs, at most

Config bench_config(const CheckpointBenchOptions& o) {
  Config cfg = o.config;
  cfg.world.ranks = 1;
  cfg.world.ranks_per_node = 1;
  if (cfg.zero.stage < 1) cfg.zero.stage = 1;  // the optimizer state leaves the gpu at stage >= 1
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

double time_of(const std::function<void()>& fn) {
  const Stopwatch w;
  fn();
  return w.seconds();
}

// `bytes` written sequentially into a new file of `dir` through the file seam, in kPieceBytes
// pieces, then fdatasynced; the file is removed. Returns the seconds.
double raw_write(const SafeDir& dir, std::uint64_t bytes, const std::vector<unsigned char>& piece) {
  const std::string name = strcat(".strata-bench-raw-", ::getpid());
  dir.try_remove(name, false);
  const Stopwatch w;
  {
    const std::unique_ptr<WritableFile> f = FileEnv::current().create_file(dir, name);
    for (std::uint64_t off = 0; off < bytes; off += kPieceBytes)
      f->write_at(piece.data(), std::min<std::uint64_t>(kPieceBytes, bytes - off), off);
    f->sync();
  }
  const double s = w.seconds();
  dir.try_remove(name, false);
  return s;
}

struct Samples {
  std::vector<double> blocking, async_call, writer, raw, idle, busy, writer_busy;
  double paused = 0;
  std::uint64_t pauses = 0;
};

// One round: idle steps, a blocking save, an asynchronous save on an idle loop and the raw write
// (alternated), an asynchronous save with steps taken while its writer works.
void round(Engine& e, const CheckpointBenchOptions& o, const SafeDir& dir,
           const std::function<void()>& step, const std::vector<unsigned char>& piece,
           std::uint64_t bytes, Samples& s) {
  for (int i = 0; i < o.steps; ++i) s.idle.push_back(time_of(step));
  s.blocking.push_back(time_of([&] { e.save_checkpoint(o.dir, SaveMode::kBlocking); }));
  s.async_call.push_back(time_of([&] { e.save_checkpoint(o.dir, SaveMode::kAsync); }));
  s.writer.push_back(EngineAccess::wait_checkpoint_writer(e).write_s);
  e.wait_checkpoint();
  s.raw.push_back(raw_write(dir, bytes, piece));
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

void summarize(const Samples& s, CheckpointBenchResult& r) {
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
  r.idle_step_s = median(s.idle);
  r.busy_step_s = median(s.busy);
  r.busy_steps = s.busy.size();
  r.busy_slowdown = r.idle_step_s > 0 && !s.busy.empty() ? r.busy_step_s / r.idle_step_s : 0;
  r.writer_busy_s = median(s.writer_busy);
  r.writer_paused_s = s.paused;
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
  res.elements = o.elements;
  res.shard_bytes = o.elements * (dtype_size(cfg.precision.params) + 12);
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
  const std::vector<unsigned char> piece(kPieceBytes, 0x5a);
  Samples s;
  for (int r = 0; r < o.rounds; ++r) round(e, o, dir, step, piece, res.shard_bytes, s);
  summarize(s, res);
  return res;
}

}  // namespace strata::profile
