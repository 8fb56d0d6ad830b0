// The real step on a sample: a few sub-groups of the configured optimizer state (FP32 master and
// both moments) with their home on NVMe in the TierStore's swap space, updated by CpuAdam, serial
// (read i, Adam i, write i) and pipelined (read i+1 || Adam i || write i-1). The zero layer's
// Engine does not yet run an offloaded step, so the loop lives here (see docs/performance.md).
//
// Before the timed runs the legs are measured in isolation on the same buffers (tier-store read of
// a sub-group's state, its write-back, Adam in memory); those are the model's inputs.
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <thread>

#include "profile/profile_internal.hpp"
#include "strata/adam.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/io_engine.hpp"
#include "strata/log.hpp"
#include "device/pinned_pool.hpp"
#include "strata/plan.hpp"
#include "tier/tier_store.hpp"
#include "strata/units.hpp"
#include "profile/step_bench.hpp"

namespace strata::profile {
namespace {

constexpr auto kTimeout = std::chrono::milliseconds(300000);

// One sub-group: its state buffers in the store (master unless params are fp32, then the FP32
// parameters live in memory; m; v) and its gradients / parameter copy in host memory.
struct SubGroup {
  std::vector<BufferId> ids;  // [master,] exp_avg, exp_avg_sq
  std::vector<float> param_in_memory;  // when there is no master copy
  std::vector<std::uint8_t> grad;
  std::vector<std::uint8_t> param_copy;
};

}  // namespace

// The pinned pool a measurement can really page-lock: the configured buffer_count x buffer_size,
// unless RLIMIT_MEMLOCK is below it, when buffers are cut to a quarter of the limit each (whole
// MiB, at least 1 MiB) and at most `max_cut_buffers` of them, so that all of them lock. The
// reason says which, in words a user can act on.
PoolUse choose_pool(const Config& c, std::uint32_t max_buffers, std::uint32_t max_cut_buffers) {
  PoolUse u;
  u.configured_buffers = c.tiers.host.buffer_count;
  u.configured_buffer_size = c.tiers.host.buffer_size;
  u.buffers = std::min(u.configured_buffers, max_buffers);
  u.buffer_size = u.configured_buffer_size;
  struct rlimit rl {};
  const bool limited = ::getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY;
  u.memlock_limit = limited ? rl.rlim_cur : ~0ULL;
  if (limited && static_cast<std::uint64_t>(u.buffers) * u.buffer_size > u.memlock_limit / 4 * 3) {
    u.buffer_size = std::min<std::uint64_t>(u.buffer_size, u.memlock_limit / 4);
    u.buffer_size = std::max<std::uint64_t>(u.buffer_size / (1 << 20) * (1 << 20), 1 << 20);
    u.buffers = std::min(u.buffers, max_cut_buffers);
    u.reason = strcat("RLIMIT_MEMLOCK is ", format_bytes(u.memlock_limit, true),
                      ": this process cannot page-lock the configured ", u.configured_buffers,
                      " x ", format_bytes(u.configured_buffer_size, true),
                      ", so the pool was cut to fit; raise the limit (ulimit -l, systemd "
                      "LimitMEMLOCK=, docker --ulimit memlock=) to measure the configured pool");
  } else if (u.buffers < u.configured_buffers) {
    u.reason = strcat("the sample needs ", u.buffers, " of the configured ", u.configured_buffers,
                      " buffers");
  } else {
    u.reason = "as configured";
  }
  return u;
}

namespace {

class Sample {
 public:
  Sample(const Config& c, const std::vector<std::string>& paths, std::uint64_t elements,
         std::uint64_t sub_groups)
      : c_(c), elements_(elements), adam_(c.runtime.cpu_threads), hp_(AdamParams::from_config(c.optimizer)) {
    const BytesPerParam b = bytes_per_param(c.precision);
    has_master_ = b.master > 0;
    device_ = make_host_device();
    IoEngineOptions eo = IoEngineOptions::from(c.tiers.nvme);
    engine_ = make_io_engine(eo, paths.front());
    pool_use_ = choose_pool(c, 1, 1);
    PinnedPoolOptions po;
    po.buffer_count = 1;
    po.buffer_size = pool_use_.buffer_size;
    po.pinned_budget = po.buffer_size;
    pool_ = std::make_unique<PinnedPool>(po, device_.get(), engine_.get());
    TierStoreOptions so = TierStoreOptions::from(c, 0);
    so.nvme_paths = paths;
    so.host_budget = ~0ULL >> 2;
    so.gpu_budget = 0;
    const std::uint64_t per = (elements * 4 + (1 << 20)) / (1 << 20) * (1 << 20);
    so.nvme_capacity = per * 3 * sub_groups + (16ULL << 20);
    so.timeout = kTimeout;
    store_ = std::make_unique<TierStore>(so, *device_, *engine_, *pool_);

    const std::size_t gb = dtype_size(c.precision.grads);
    for (std::uint64_t g = 0; g < sub_groups; ++g) {
      SubGroup sg;
      const char* names[3] = {"master", "exp_avg", "exp_avg_sq"};
      for (int k = has_master_ ? 0 : 1; k < 3; ++k) {
        BufferSpec spec;
        spec.name = strcat("sample.", g, ".", names[k]);
        spec.bytes = elements * 4;
        spec.home = Tier::kNvme;
        spec.allowed = {Tier::kCpu, Tier::kNvme};
        sg.ids.push_back(store_->register_buffer(spec));
      }
      if (!has_master_) sg.param_in_memory.resize(elements);
      sg.grad.resize(elements * gb);
      fill_random(sg.grad.data(), sg.grad.size(), 100 + g);
      // Small finite gradients: clear the top exponent bits.
      if (gb == 2)
        for (std::size_t i = 1; i < sg.grad.size(); i += 2) sg.grad[i] &= 0x27;
      else
        for (std::size_t i = 3; i < sg.grad.size(); i += 4) sg.grad[i] &= 0x3c;
      if (c.precision.params != DType::kFp32) sg.param_copy.resize(elements * 2);
      groups_.push_back(std::move(sg));
    }
    // Initial state: random weights, small moments, written to NVMe (untimed).
    for (std::uint64_t g = 0; g < sub_groups; ++g) {
      auto ptrs = acquire(g, Access::kWrite);
      for (std::size_t k = 0; k < ptrs.size(); ++k) {
        auto* f = static_cast<float*>(ptrs[k]);
        std::uint32_t x = static_cast<std::uint32_t>(g * 7919 + k * 104729 + 1);
        for (std::uint64_t i = 0; i < elements; ++i) {
          x = x * 1664525u + 1013904223u;
          const float u = static_cast<float>(x >> 8) / 16777216.0f;  // [0, 1)
          f[i] = k == 0 && has_master_ ? u - 0.5f : u * 1e-3f;
        }
      }
      if (!has_master_)
        for (std::uint64_t i = 0; i < elements; ++i) groups_[g].param_in_memory[i] = 0.25f;
      release(g);
      write_back(g);
    }
  }

  ~Sample() {
    try {
      store_->wait_idle(kTimeout);
    } catch (const std::exception& e) {
      log_warn("profile: sample step cleanup: ", e.what());
    }
  }

  std::uint64_t bytes_per_element() const { return has_master_ ? 12 : 8; }
  const PoolUse& pool_use() const { return pool_use_; }
  std::size_t groups() const { return groups_.size(); }

  std::vector<Transfer> acquire_async(std::size_t g, Access access) {
    std::vector<Transfer> t;
    for (BufferId id : groups_[g].ids) t.push_back(store_->acquire_async(id, Tier::kCpu, access));
    return t;
  }
  static std::vector<void*> wait_ptrs(const std::vector<Transfer>& ts) {
    std::vector<void*> out;
    for (const auto& t : ts) {
      t.wait(kTimeout);
      out.push_back(t.pointer());
    }
    return out;
  }
  std::vector<void*> acquire(std::size_t g, Access access) { return wait_ptrs(acquire_async(g, access)); }
  void release(std::size_t g) {
    for (BufferId id : groups_[g].ids) store_->release(id, Tier::kCpu);
  }
  // Writes a dirty host copy back to NVMe and drops it (clean copies are just dropped).
  std::vector<Transfer> write_back_async(std::size_t g) {
    std::vector<Transfer> t;
    for (BufferId id : groups_[g].ids) t.push_back(store_->evict(id, Tier::kCpu));
    return t;
  }
  void write_back(std::size_t g) {
    for (auto& t : write_back_async(g)) t.wait(kTimeout);
  }

  void adam(std::size_t g, const std::vector<void*>& ptrs) {
    SubGroup& sg = groups_[g];
    AdamTensors t;
    std::size_t k = 0;
    t.param = has_master_ ? static_cast<float*>(ptrs[k++]) : sg.param_in_memory.data();
    t.exp_avg = static_cast<float*>(ptrs[k++]);
    t.exp_avg_sq = static_cast<float*>(ptrs[k++]);
    t.grad = sg.grad.data();
    t.grad_dtype = c_.precision.grads;
    t.param_copy = sg.param_copy.empty() ? nullptr : sg.param_copy.data();
    t.param_copy_dtype = c_.precision.params == DType::kFp32 ? DType::kBf16 : c_.precision.params;
    t.n = elements_;
    AdamStepOptions o;
    o.step = ++step_;
    o.check_finite = false;
    adam_.step(hp_, t, o);
    if (!std::isfinite(t.param[elements_ / 2]) || !std::isfinite(t.exp_avg_sq[elements_ - 1]))
      fail(ErrorCode::kNumeric, "profile sample step: Adam produced a non-finite value");
  }

  // One optimizer step over the sample, legs one after another.
  double serial() {
    Stopwatch sw;
    for (std::size_t g = 0; g < groups(); ++g) {
      auto ptrs = acquire(g, Access::kWrite);
      adam(g, ptrs);
      release(g);
      write_back(g);
    }
    return sw.seconds();
  }

  // Read i+1 || Adam i || write i-1.
  double pipelined() {
    Stopwatch sw;
    std::vector<Transfer> next = acquire_async(0, Access::kWrite);
    std::vector<Transfer> writes;
    for (std::size_t g = 0; g < groups(); ++g) {
      auto ptrs = wait_ptrs(next);
      if (g + 1 < groups()) next = acquire_async(g + 1, Access::kWrite);
      adam(g, ptrs);
      release(g);
      // The write-back of i-1 must be done before its memory is needed again; keep one in flight.
      for (auto& t : writes) t.wait(kTimeout);
      writes = write_back_async(g);
    }
    for (auto& t : writes) t.wait(kTimeout);
    return sw.seconds();
  }

  // Leg bandwidths in isolation: {read bytes/s, write bytes/s, Adam params/s, CPU-seconds per
  // NVMe byte, CPU-seconds per Adam element}.
  std::array<double, 5> legs() {
    double read_s = 0, write_s = 0, io_cpu = 0, adam_cpu = 0;
    std::vector<double> adam_rates;
    const double bytes = static_cast<double>(elements_ * bytes_per_element());
    for (std::size_t g = 0; g < groups(); ++g) {
      double c0 = cpu_seconds();
      Stopwatch r;
      auto ptrs = acquire(g, Access::kWrite);
      read_s += r.seconds();
      double c1 = cpu_seconds();
      io_cpu += c1 - c0;
      Stopwatch a;
      adam(g, ptrs);
      adam_rates.push_back(static_cast<double>(elements_) / a.seconds());
      c0 = cpu_seconds();
      adam_cpu += c0 - c1;
      release(g);
      Stopwatch w;
      write_back(g);
      write_s += w.seconds();
      io_cpu += cpu_seconds() - c0;
    }
    const double total = bytes * static_cast<double>(groups());
    return {total / read_s, total / write_s, median(adam_rates), io_cpu / (2 * total),
            adam_cpu / static_cast<double>(elements_ * groups())};
  }

  // The pipeline's NVMe steady state alone: the write-back of sub-group g while g+1 is read.
  // Returns read + write bytes per second.
  double mixed() {
    double secs = 0;
    const double bytes = static_cast<double>(elements_ * bytes_per_element());
    auto cur = acquire(0, Access::kWrite);
    for (std::size_t g = 0; g + 1 < groups(); ++g) {
      release(g);
      Stopwatch sw;
      auto w = write_back_async(g);
      auto next = acquire_async(g + 1, Access::kWrite);
      for (auto& t : w) t.wait(kTimeout);
      wait_ptrs(next);
      secs += sw.seconds();
    }
    release(groups() - 1);
    write_back(groups() - 1);
    return secs > 0 ? 2 * bytes * static_cast<double>(groups() - 1) / secs : 0;
  }

  // User + system CPU time of this process (every thread).
  static double cpu_seconds() {
    struct rusage u {};
    ::getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  }

 private:
  const Config& c_;
  std::uint64_t elements_;
  bool has_master_ = true;
  CpuAdam adam_;
  AdamParams hp_;
  std::int64_t step_ = 0;
  std::unique_ptr<Device> device_;
  std::unique_ptr<IoEngine> engine_;
  std::unique_ptr<PinnedPool> pool_;
  std::unique_ptr<TierStore> store_;  // destroyed before the pool, engine and device
  std::vector<SubGroup> groups_;
  PoolUse pool_use_;
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

// The zero layer's offloaded step on the same sample (below).
void run_engine_step(const Config& c, const std::vector<std::string>& paths, std::uint64_t elements,
                     std::uint32_t repeats, SampleStep& s, const Progress& progress);

SampleStep run_sample_step(const Config& c, const std::vector<std::string>& paths,
                           std::uint64_t elements, std::uint64_t sub_groups, std::uint32_t repeats,
                           const Progress& progress) {
  SampleStep s;
  s.elements_per_sub_group = elements;
  s.sub_groups = sub_groups;
  s.implementation =
      "profile layer: TierStore (optimizer state homed on NVMe swap) + CpuAdam, serial and "
      "pipelined loops in src/profile/sample_step.cpp";
  Sample sample(c, paths, elements, sub_groups);
  s.nvme_bytes_per_element = sample.bytes_per_element();
  s.pool = sample.pool_use();
  if (progress)
    progress(strcat("sample step: ", sub_groups, " sub-groups x ", format_count(elements),
                    " elements (", format_bytes(elements * s.nvme_bytes_per_element * sub_groups, true),
                    " on NVMe): measuring legs"));
  sample.serial();  // warm-up: page cache of the swap files' metadata, allocator, thread pools
  // Each repeat measures the legs alone, then a serial and a pipelined step, so that the inputs of
  // the prediction and the measured steps see the same (drifting) machine.
  std::vector<double> ser, pip, io_cpu, adam_cpu;
  const std::uint32_t n = std::max(1u, repeats);
  for (std::uint32_t i = 0; i < n; ++i) {
    auto legs = sample.legs();
    s.tier_read_runs.push_back(legs[0]);
    s.tier_write_runs.push_back(legs[1]);
    s.adam_runs.push_back(legs[2]);
    io_cpu.push_back(legs[3]);
    if (sub_groups > 1) s.tier_mixed_runs.push_back(sample.mixed());
    adam_cpu.push_back(legs[4]);
    ser.push_back(sample.serial());
    pip.push_back(sample.pipelined());
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
  const StepPrediction pred = predict_sample(elements, sub_groups, s.nvme_bytes_per_element, bw);
  s.serial = summarize("serial", ser, pred.serial_s);
  s.pipelined = summarize("pipelined", pip, pred.pipelined_s);
  s.ran = true;
  run_engine_step(c, paths, elements * sub_groups, repeats, s, progress);
  return s;
}

void run_engine_step(const Config& c, const std::vector<std::string>& paths, std::uint64_t elements,
                     std::uint32_t repeats, SampleStep& s, const Progress& progress) {
  StepBenchOptions o;
  o.config = c;
  o.config.tiers.nvme.paths = paths;
  // The store page-locks its pool: keep it within RLIMIT_MEMLOCK (and say so).
  s.engine_pool = choose_pool(c, c.tiers.host.buffer_count, 3);
  o.config.tiers.host.buffer_size = s.engine_pool.buffer_size;
  o.config.tiers.host.buffer_count = s.engine_pool.buffers;
  o.config.tiers.host.pinned_budget =
      std::max<std::uint64_t>(o.config.tiers.host.pinned_budget,
                              o.config.tiers.host.buffer_size * o.config.tiers.host.buffer_count);
  o.elements = elements;
  o.rounds = static_cast<int>(std::max(1u, repeats));
  o.serial = true;
  StepBenchResult r;
  try {
    if (progress) progress("engine step (zero layer's offloaded step) on the same sample");
    r = run_step_bench(o);
  } catch (const Error& e) {
    s.engine_skipped = std::string("skipped: the zero layer's offloaded step failed: ") + e.what();
    log_warn("profile: ", s.engine_skipped);
    return;
  }
  s.engine_ran = true;
  s.engine_chunks = r.chunks;
  s.engine_buffers = r.buffers;
  s.engine_buffer_size = r.buffer_size;
  if (r.buffers != s.engine_pool.buffers || r.buffer_size != s.engine_pool.buffer_size)
    s.engine_pool.reason += strcat("; the store allocated ", r.buffers, " x ",
                                   format_bytes(r.buffer_size, true), " of it");
  s.engine_pool.buffers = r.buffers;
  s.engine_pool.buffer_size = r.buffer_size;
  s.engine_read_s = r.t_read;
  s.engine_update_s = r.t_update;
  s.engine_write_s = r.t_write;
  // The model on the engine's own unit (its chunks), from its legs alone.
  Bandwidths bw;
  const double bytes = static_cast<double>(r.state_bytes);
  bw.nvme_read_bps = r.t_read > 0 ? bytes / r.t_read : 0;
  bw.nvme_write_bps = r.t_write > 0 ? bytes / r.t_write : 0;
  bw.cpu_adam_params_per_s = r.t_update > 0 ? static_cast<double>(elements) / r.t_update : 0;
  const std::uint64_t chunks = std::max<std::uint64_t>(r.chunks, 1);
  const std::uint64_t per_chunk = std::max<std::uint64_t>(elements / chunks, 1);
  const std::uint64_t bpe = std::max<std::uint64_t>(r.state_bytes / std::max<std::uint64_t>(elements, 1), 1);
  const StepPrediction pred = predict_sample(per_chunk, chunks, bpe, bw);
  // zero::run_step_bench reports medians over its rounds, not each round: say so (repeats), with
  // no per-repeat list.
  s.engine_serial = summarize("serial", {r.t_step_serial}, pred.serial_s);
  s.engine_pipelined = summarize("pipelined", {r.t_step}, pred.pipelined_s);
  for (SampleRun* run : {&s.engine_serial, &s.engine_pipelined}) {
    run->measured_s.clear();
    run->repeats = static_cast<std::uint32_t>(o.rounds);
  }
}

}  // namespace strata::profile
