// The real step on a sample: a one-rank Engine holding `sub_groups` sub-groups of `elements`
// parameters with its optimizer state (FP32 master and both moments) on NVMe in its TierStore's
// swap space, stepped by Engine::step() — the one pipelined loop training runs (src/tier/
// stream_loop) — serially (read i, Adam i, write i) and pipelined (read i+1 || Adam i || write
// i-1). Before the timed steps the legs are measured alone through the same loop and slots
// (zero/engine_access.hpp): the state's read, its write-back, Adam in memory, and a read and a
// write-back at once; those are the model's inputs.
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "core/numeric.hpp"
#include "profile/profile_internal.hpp"
#include "strata/communicator.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"
#include "strata/units.hpp"
#include "zero/engine_access.hpp"

namespace strata::profile {
namespace {

using zero::EngineAccess;
using zero::Measure;

}  // namespace

// The pinned pool a measurement can really page-lock: the configured buffer_count x buffer_size,
// unless RLIMIT_MEMLOCK applies (no CAP_IPC_LOCK) and is below it, when buffers are cut to a
// quarter of the limit each (whole MiB, at least 1 MiB) and at most `max_cut_buffers` of them, so
// that all of them lock. The reason says which, in words a user can act on.
PoolUse choose_pool(const Config& c, std::uint32_t max_buffers, std::uint32_t max_cut_buffers,
                    const PageLockLimit& lock) {
  PoolUse u;
  u.configured_buffers = c.tiers.host.buffer_count;
  u.configured_buffer_size = c.tiers.host.buffer_size;
  u.buffers = std::min(u.configured_buffers, max_buffers);
  u.buffer_size = u.configured_buffer_size;
  u.memlock_limit = lock.bytes;  // ~0 with CAP_IPC_LOCK: the pinned pool locks past the limit
  if (lock.applies &&
      static_cast<std::uint64_t>(u.buffers) * u.buffer_size > u.memlock_limit / 4 * 3) {
    u.buffer_size = std::min<std::uint64_t>(u.buffer_size, u.memlock_limit / 4);
    u.buffer_size = std::max<std::uint64_t>(u.buffer_size / (1 << 20) * (1 << 20), 1 << 20);
    u.buffers = std::min(u.buffers, max_cut_buffers);
    u.reason = strcat("RLIMIT_MEMLOCK is ", format_bytes(u.memlock_limit, true),
                      ": this process cannot page-lock the configured ", u.configured_buffers,
                      " x ", format_bytes(u.configured_buffer_size, true),
                      ", so the pool was cut to fit; raise the limit (ulimit -l, systemd "
                      "LimitMEMLOCK=, docker --ulimit memlock=) to measure the configured pool");
  } else if (u.buffers < u.configured_buffers) {
    u.reason = strcat("the sample uses ", u.buffers, " of the configured ", u.configured_buffers,
                      " buffers");
  } else {
    u.reason = "as configured";
  }
  return u;
}

namespace {

// User + system CPU time of this process (every thread).
double cpu_seconds() {
  struct rusage u {};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// The sample: one rank's engine with everything of the optimizer on NVMe.
class Sample {
 public:
  Sample(const Config& c, const std::vector<std::string>& paths, std::uint64_t elements,
         std::uint64_t sub_groups)
      : elements_(elements), sub_groups_(sub_groups) {
    Config e = c;
    e.world.ranks = 1;
    e.world.ranks_per_node = 1;
    e.zero.stage = 1;
    e.optimizer.overlap = OptimizerOverlap::kOff;  // the serial step (stage 1 has no overlap)
    e.zero.sub_group_size = elements;
    e.offload.optimizer = {Tier::kNvme, 1.0, false};
    e.offload.gradients = {Tier::kGpu, 1.0, false};
    e.offload.params = {Tier::kGpu, 1.0, false};
    e.tiers.nvme.paths = paths;
    // The pool is page-locked: within RLIMIT_MEMLOCK (reported with the reason).
    pool_ = choose_pool(c, c.tiers.host.buffer_count, 3);
    e.tiers.host.buffer_size = pool_.buffer_size;
    e.tiers.host.buffer_count = pool_.buffers;
    e.tiers.host.pinned_budget = std::max<std::uint64_t>(
        e.tiers.host.pinned_budget, e.tiers.host.buffer_size * e.tiers.host.buffer_count);
    e.tiers.host.budget = std::max(e.tiers.host.budget, e.tiers.host.pinned_budget);
    e.runtime.device = DeviceKind::kHost;
    comms_ = make_inprocess_communicators(1, e.runtime.collective_timeout_s);
    engine_ = std::make_unique<Engine>(e, *comms_[0]);
    const std::uint64_t n = elements * sub_groups;
    std::mt19937 rng(5);
    add_random_parameter(*engine_, "sample", n, 0.5f, rng);
    engine_->finalize();
    grads_.resize(n * dtype_size(e.precision.grads));
    std::normal_distribution<float> g(0, 1e-2f);
    for (std::uint64_t i = 0; i < n; ++i) store_elem(grads_.data(), i, e.precision.grads, g(rng));
    for (const zero::Chunk& ch : EngineAccess::chunks(*engine_)) {
      state_bytes_ += EngineAccess::storage(*engine_).store().padded_bytes(ch.opt);
      ++chunks_;
    }
  }
  // The loop's unit: the engine's chunks (what one pinned buffer stages).
  std::uint64_t chunks() const { return chunks_; }

  std::uint64_t bytes_per_element() const { return 12; }  // FP32 master + two moments
  std::uint64_t state_bytes() const { return state_bytes_; }
  const PoolUse& pool() const { return pool_; }

  // One engine step (the update loop's time, serial or pipelined).
  double step(bool pipelined) {
    EngineAccess::set_pipelined(*engine_, pipelined);
    engine_->set_gradient_host(0, grads_.data());
    engine_->step();
    const double t = EngineAccess::last_update(*engine_).t_total;
    EngineAccess::set_pipelined(*engine_, true);
    if (!std::isfinite(t)) fail(ErrorCode::kNumeric, "profile sample step: no time measured");
    return t;
  }

  // Leg bandwidths in isolation: {read bytes/s, write bytes/s, Adam params/s, CPU-seconds per
  // NVMe byte, CPU-seconds per Adam element}.
  // REQUIRES: sync is callable (a no-op for one process).
  std::array<double, 5> legs(const std::function<void()>& sync) {
    const double bytes = static_cast<double>(state_bytes_);
    const double n = static_cast<double>(elements_ * sub_groups_);
    sync();
    double c0 = cpu_seconds();
    const double read_s = EngineAccess::measure(*engine_, Measure::kRead).t_total;
    double c1 = cpu_seconds();
    const double io_cpu_read = c1 - c0;
    sync();
    c1 = cpu_seconds();
    const double adam_s = EngineAccess::measure(*engine_, Measure::kUpdate).t_total;
    c0 = cpu_seconds();
    const double adam_cpu = c0 - c1;
    // Writing the slots' contents would replace the state: write back what was just read.
    sync();
    c0 = cpu_seconds();
    const double io_s = EngineAccess::measure(*engine_, Measure::kIo).t_total;
    c1 = cpu_seconds();
    const double write_s = std::max(io_s - read_s, 1e-9);
    mixed_ = io_s > 0 ? 2 * bytes / io_s : 0;
    return {bytes / read_s, bytes / write_s, n / adam_s, (io_cpu_read + (c1 - c0)) / (3 * bytes),
            adam_cpu / n};
  }
  double mixed() const { return mixed_; }

 private:
  std::uint64_t elements_, sub_groups_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::unique_ptr<Engine> engine_;
  std::vector<unsigned char> grads_;
  std::uint64_t state_bytes_ = 0, chunks_ = 0;
  double mixed_ = 0;
  PoolUse pool_;
};

SampleRun summarize(const char* mode, std::vector<double> times, double predicted) {
  SampleRun r;
  r.mode = mode;
  r.measured_s = times;
  r.repeats = static_cast<std::uint32_t>(times.size());
  r.measured_median_s = median(std::move(times));
  r.predicted_s = predicted;
  r.error = r.measured_median_s > 0 ? (predicted - r.measured_median_s) / r.measured_median_s : 0;
  return r;
}

}  // namespace

SampleStep run_sample_step(const Config& c, const std::vector<std::string>& paths,
                           std::uint64_t elements, std::uint64_t sub_groups, std::uint32_t repeats,
                           const Progress& progress, const std::function<void()>& sync_ranks) {
  const std::function<void()> sync = sync_ranks ? sync_ranks : [] {};
  SampleStep s;
  s.elements_per_sub_group = elements;
  s.sub_groups = sub_groups;
  s.implementation =
      "zero layer: Engine::step() of one rank with its optimizer state on NVMe, the one pipelined "
      "loop (src/tier/stream_loop.cpp); legs measured alone through the same loop";
  Sample sample(c, paths, elements, sub_groups);
  s.nvme_bytes_per_element = sample.bytes_per_element();
  s.pool = sample.pool();
  if (progress)
    progress(strcat("sample step: ", sub_groups, " sub-groups x ", format_count(elements),
                    " elements (", format_bytes(sample.state_bytes(), true),
                    " on NVMe): measuring legs"));
  sync();
  sample.step(false);  // warm-up: the swap files' metadata, allocator, thread pools
  // Each repeat measures the legs alone, then a serial and a pipelined step, so that the inputs of
  // the prediction and the measured steps see the same (drifting) machine; under a launch every
  // measurement starts on all ranks together (sync), as the ranks' steps do in training.
  std::vector<double> ser, pip, io_cpu, adam_cpu;
  const std::uint32_t n = std::max(1u, repeats);
  for (std::uint32_t i = 0; i < n; ++i) {
    auto legs = sample.legs(sync);
    s.tier_read_runs.push_back(legs[0]);
    s.tier_write_runs.push_back(legs[1]);
    s.adam_runs.push_back(legs[2]);
    io_cpu.push_back(legs[3]);
    if (sub_groups > 1) s.tier_mixed_runs.push_back(sample.mixed());
    adam_cpu.push_back(legs[4]);
    sync();
    ser.push_back(sample.step(false));
    sync();
    pip.push_back(sample.step(true));
    if (progress)
      progress(strcat("sample step ", i + 1, "/", n, ": serial ", ser.back(), " s, pipelined ",
                      pip.back(), " s"));
  }
  s.tier_read_bps = median(s.tier_read_runs);
  s.tier_write_bps = median(s.tier_write_runs);
  s.adam_params_per_s = median(s.adam_runs);
  s.tier_mixed_bps = median(s.tier_mixed_runs);
  Bandwidths bw;
  bw.nvme_read_bps = s.tier_read_bps;
  bw.nvme_write_bps = s.tier_write_bps;
  bw.cpu_adam_params_per_s = s.adam_params_per_s;
  bw.nvme_mixed_bps = s.tier_mixed_bps;
  s.cpu_s_per_nvme_byte = bw.cpu_s_per_nvme_byte = median(io_cpu);
  s.cpu_s_per_adam_element = bw.cpu_s_per_adam_element = median(adam_cpu);
  bw.cores = std::max(1u, std::thread::hardware_concurrency());
  // The model on the loop's own unit, the engine's chunks.
  const std::uint64_t chunks = std::max<std::uint64_t>(1, sample.chunks());
  const StepPrediction pred =
      predict_sample(std::max<std::uint64_t>(1, elements * sub_groups / chunks), chunks,
                     s.nvme_bytes_per_element, bw);
  s.serial = summarize("serial", ser, pred.serial_s);
  s.pipelined = summarize("pipelined", pip, pred.pipelined_s);
  s.ran = true;
  // The sample step is the engine's step: there is no second loop to report.
  s.engine_ran = false;
  return s;
}

}  // namespace strata::profile
