// The engine's own step measured (see step_bench.hpp).
#include "profile/step_bench.hpp"

#include <stdlib.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "core/numeric.hpp"
#include "profile/profile_internal.hpp"
#include "strata/communicator.hpp"
#include "strata/device.hpp"
#include "strata/device_query.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"
#include "strata/profile.hpp"
#include "zero/engine_access.hpp"

namespace strata::profile {
namespace {

using zero::EngineAccess;
using zero::Measure;
using Clock = std::chrono::steady_clock;

// Resets the peak-RSS counter (VmHWM) of this process; false if the kernel refuses.
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

std::uint64_t peak_rss() {
  std::ifstream f("/proc/self/status");
  std::string key;
  while (f >> key) {
    if (key == "VmHWM:") {
      std::uint64_t kb = 0;
      f >> kb;
      return kb * 1024;
    }
    f.ignore(1 << 20, '\n');
  }
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<std::uint64_t>(u.ru_maxrss) * 1024;
}

// What the engine's layout gives the bench: the offloaded chunks and their bytes, the pinned
// pool, the I/O engine, where the update runs.
void describe_storage(Engine& e, const Config& cfg, StepBenchResult& res) {
  zero::RankStorage& storage = EngineAccess::storage(e);
  for (const zero::Chunk& c : EngineAccess::chunks(e)) {
    if (c.opt_tier == Tier::kGpu) continue;
    ++res.chunks;
    res.state_bytes += storage.store().padded_bytes(c.opt);
  }
  if (const PinnedPool* p = storage.pool()) {
    res.buffers = p->buffer_count();
    res.buffer_size = p->buffer_size();
    res.pool_bytes = static_cast<std::uint64_t>(res.buffers) * res.buffer_size;
  }
  res.io_engine = storage.io() ? storage.io()->name() : "none";
  res.update_on =
      cfg.optimizer.update == OptimizerUpdate::kDevice ? storage.device().name() : "cpu";
}

// The gradients the loop hands in (precision.grads), from host memory.
std::vector<unsigned char> make_grads(DType gdt, std::size_t n) {
  std::vector<unsigned char> grads(n * dtype_size(gdt));
  std::mt19937 rng(6);
  std::normal_distribution<float> d(0, 1e-2f);
  for (std::size_t i = 0; i < n; ++i) store_elem(grads.data(), i, gdt, d(rng));
  return grads;
}

// Every round's figures: the legs alone, the pipelined step (and its parts), the serial one.
struct Rounds {
  std::vector<double> read, update, write, io, engine_step, step, step_serial, compute, wait_read,
      wait_write, efficiency, device_efficiency;
};

template <class Step>
Rounds measure_rounds(Engine& e, const StepBenchOptions& o, Step&& step) {
  Rounds r;
  for (int round = 0; round < o.rounds; ++round) {
    r.read.push_back(EngineAccess::measure(e, Measure::kRead).t_total);
    r.update.push_back(EngineAccess::measure(e, Measure::kUpdate).t_total);
    r.write.push_back(EngineAccess::measure(e, Measure::kWrite).t_total);
    r.io.push_back(EngineAccess::measure(e, Measure::kIo).t_total);
    EngineAccess::set_pipelined(e, true);
    r.engine_step.push_back(step());
    const tier::StreamStats s = EngineAccess::last_update(e);
    r.step.push_back(s.t_total);
    r.compute.push_back(s.t_compute);
    r.wait_read.push_back(s.t_wait_in);
    r.wait_write.push_back(s.t_wait_out);
    r.efficiency.push_back(std::max({r.read.back(), r.update.back(), r.write.back()}) / s.t_total);
    r.device_efficiency.push_back(std::max(r.io.back(), r.update.back()) / s.t_total);
    if (o.serial) {
      EngineAccess::set_pipelined(e, false);
      step();
      r.step_serial.push_back(EngineAccess::last_update(e).t_total);
      EngineAccess::set_pipelined(e, true);
    }
  }
  return r;
}

void summarize(const Rounds& r, StepBenchResult& res) {
  res.t_read = median(r.read);
  res.t_update = median(r.update);
  res.t_write = median(r.write);
  res.t_step = median(r.step);
  res.t_engine_step = median(r.engine_step);
  res.t_step_serial = median(r.step_serial);
  res.t_update_in_step = median(r.compute);
  res.t_wait_read = median(r.wait_read);
  res.t_wait_write = median(r.wait_write);
  res.overlap_efficiency =
      res.t_step > 0 ? std::max({res.t_read, res.t_update, res.t_write}) / res.t_step : 0;
  res.overlap_efficiency_rounds = median(r.efficiency);
  res.t_io = median(r.io);
  res.device_efficiency = median(r.device_efficiency);
}

}  // namespace

// The one rank's communicator: NCCL (device buffers) when the engine will run on a CUDA device,
// else the in-process one. A single NCCL rank bootstraps through a file in a private directory.
std::unique_ptr<Communicator> one_rank(const Config& cfg) {
  const bool cuda =
      cfg.runtime.device == DeviceKind::kCuda ||
      (cfg.runtime.device == DeviceKind::kAuto && cuda_available() && nccl_available());
  if (!cuda) return std::move(make_inprocess_communicators(1, cfg.runtime.collective_timeout_s)[0]);
  char tmpl[] = "/tmp/strata-bench-XXXXXX";
  if (!::mkdtemp(tmpl))
    throw IoError("mkdtemp", tmpl, 0, 0, errno, "bench step: the NCCL bootstrap directory");
  const std::string dir = tmpl;
  NcclBootstrap b;
  b.file = dir + "/nccl-id";
  b.rank = 0;
  b.size = 1;
  std::unique_ptr<Communicator> c;
  try {
    // The GPU the engine's storage will use (LOCAL_RANK under a launcher), not GPU 0.
    const int ordinal = local_device_ordinal(0, static_cast<int>(cfg.ranks_per_node()),
                                             static_cast<int>(query_cuda_devices().devices.size()));
    c = make_nccl_communicator(b, ordinal, cfg.runtime.collective_timeout_s);
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    throw;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return c;
}

StepBenchResult run_step_bench(const StepBenchOptions& o) {
  if (o.elements == 0) fail(ErrorCode::kInvalidArgument, "bench step: no elements");
  if (o.rounds < 1) fail(ErrorCode::kInvalidArgument, "bench step: rounds must be >= 1");
  Config cfg = o.config;
  cfg.world.ranks = 1;
  cfg.world.ranks_per_node = 1;
  const std::size_t n = o.elements;
  StepBenchResult res;
  res.elements = n;
  res.threads = cfg.runtime.cpu_threads ? cfg.runtime.cpu_threads
                                        : std::max(1u, std::thread::hardware_concurrency());

  std::unique_ptr<Communicator> comm = one_rank(cfg);
  auto engine = std::make_unique<Engine>(cfg, *comm);
  {
    std::mt19937 rng(5);
    add_random_parameter(*engine, "state", n, 0.1f, rng);
  }
  engine->finalize();
  Engine& e = *engine;
  describe_storage(e, cfg, res);
  const zero::StorageReport rep = EngineAccess::report(e);
  const std::vector<unsigned char> grads = make_grads(cfg.precision.grads, n);
  // What scales with the model by design: the gradient source, and the parameters and gradients
  // in device memory (host memory on the host-emulated device).
  res.caller_held_bytes = grads.size();
  if (EngineAccess::storage(e).device().kind() == DeviceKind::kHost)
    res.caller_held_bytes += rep.bytes[0][0] + rep.bytes[0][1] + rep.bytes[0][3];
  auto step = [&] {
    e.set_gradient_host(0, grads.data());
    auto t0 = Clock::now();
    e.step();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };

  step();  // warm-up: page faults, thread pools
  const bool hwm = reset_peak_rss();
  if (!hwm) log_warn("bench step: cannot reset VmHWM; the peak RSS includes the setup");
  const Rounds rounds = measure_rounds(e, o, step);
  res.peak_rss_bytes = peak_rss();
  summarize(rounds, res);
  return res;
}

namespace {

struct OverlapRun {
  double step_s = 0, total_s = 0, exposed_s = 0;
  double hand_in_s = 0;  // in set_gradient_host, the caller's thread
  std::uint64_t rolled_back_steps = 0;
  StepResult last;
};

// One engine of the overlap bench: a warm-up step, then `rounds` simulated backwards + steps.
OverlapRun overlap_run(const OverlapBenchOptions& o, OptimizerOverlap overlap, bool clip,
                       double backward_s) {
  Config cfg = o.config;
  cfg.world.ranks = 1;
  cfg.world.ranks_per_node = 1;
  cfg.zero.stage = std::max(cfg.zero.stage, 2);
  cfg.optimizer.overlap = overlap;
  cfg.train.accumulate = 1;
  const std::size_t nt = std::max<std::size_t>(1, o.tensors), n = o.elements;
  cfg.zero.reduce_bucket_size = std::max<std::uint64_t>(1, n / nt);
  std::unique_ptr<Communicator> comm = one_rank(cfg);
  Engine e(cfg, *comm);
  std::mt19937 rng(5);
  for (std::size_t t = 0; t < nt; ++t)
    add_random_parameter(e, strcat("t", t), n / nt + (t + 1 == nt ? n % nt : 0), 0.1f, rng);
  e.finalize();
  const std::vector<unsigned char> grads = make_grads(cfg.precision.grads, n);
  const std::size_t es = dtype_size(cfg.precision.grads);
  const auto pause = std::chrono::duration<double>(backward_s / static_cast<double>(nt));
  auto one = [&](OverlapRun& r) {
    const auto t0 = Clock::now();
    r.hand_in_s = 0;
    // The k-th gradient (k = 1..nt) is handed in at k * T / nt: the hand-ins take their time
    // inside the backward (a GPU's copies run beside its compute); one that runs late delays the
    // next.
    for (std::size_t t = nt; t-- > 0;) {
      std::this_thread::sleep_until(
          t0 + std::chrono::duration_cast<Clock::duration>(pause * static_cast<double>(nt - t)));
      const auto h = Clock::now();
      e.set_gradient_host(t, grads.data() + t * (n / nt) * es);
      r.hand_in_s += std::chrono::duration<double>(Clock::now() - h).count();
    }
    if (clip) e.clip_grad_norm(1e-12);
    const auto t1 = Clock::now();
    r.last = e.step();
    r.step_s = std::chrono::duration<double>(Clock::now() - t1).count();
    r.total_s = std::chrono::duration<double>(Clock::now() - t0).count();
    r.exposed_s = r.last.exposed_s;
    if (r.last.rolled_back_chunks > 0) ++r.rolled_back_steps;
  };
  OverlapRun r;
  one(r);  // warm-up
  std::vector<double> step, total, exposed, hand_in;
  for (int i = 0; i < std::max(1, o.rounds); ++i) {
    one(r);
    step.push_back(r.step_s);
    total.push_back(r.total_s);
    exposed.push_back(r.exposed_s);
    hand_in.push_back(r.hand_in_s);
  }
  r.step_s = median(step);
  r.total_s = median(total);
  r.exposed_s = median(exposed);
  r.hand_in_s = median(hand_in);
  return r;
}

}  // namespace

OverlapBenchResult run_overlap_bench(const OverlapBenchOptions& o) {
  if (o.elements == 0) fail(ErrorCode::kInvalidArgument, "bench step: no elements");
  OverlapBenchResult res;
  res.elements = o.elements;
  double t = o.backward_s;
  if (t < 0) t = overlap_run(o, OptimizerOverlap::kOff, false, 0).step_s;
  res.backward_s = t;
  const OverlapRun serial = overlap_run(o, OptimizerOverlap::kOff, false, t);
  const OverlapRun on = overlap_run(o, OptimizerOverlap::kOn, false, t);
  const OverlapRun clipped = overlap_run(o, OptimizerOverlap::kOn, true, t);
  const OverlapRun auto_clipped = overlap_run(o, OptimizerOverlap::kAuto, true, t);
  res.serial_step_s = serial.step_s;
  res.serial_total_s = serial.total_s;
  res.serial_hand_in_s = serial.hand_in_s;
  res.overlapped_hand_in_s = on.hand_in_s;
  res.overlapped_step_s = on.step_s;
  res.overlapped_total_s = on.total_s;
  res.exposed_s = on.exposed_s;
  res.rollback_step_s = clipped.step_s;
  res.rollback_total_s = clipped.total_s;
  res.speculated_chunks = on.last.speculated_chunks;
  res.committed_chunks = on.last.committed_chunks;
  res.rolled_back_chunks = clipped.last.rolled_back_chunks;
  res.auto_clip_step_s = auto_clipped.step_s;
  res.auto_clip_total_s = auto_clipped.total_s;
  res.auto_clip_rolled_back_steps = auto_clipped.rolled_back_steps;
  return res;
}

}  // namespace strata::profile

namespace strata {

EngineBound measure_engine_bound(Engine& engine) {
  EngineBound b;
  b.t_io_s = zero::EngineAccess::measure(engine, zero::Measure::kIo).t_total;
  b.t_update_s = zero::EngineAccess::measure(engine, zero::Measure::kUpdate).t_total;
  const tier::StreamStats u = zero::EngineAccess::last_update(engine);
  b.last_loop_s = u.t_total;
  b.last_loop_compute_s = u.t_compute;
  b.last_loop_wait_read_s = u.t_wait_in;
  b.last_loop_wait_write_s = u.t_wait_out;
  b.last_loop_gate_s = u.t_gate;
  return b;
}

}  // namespace strata
