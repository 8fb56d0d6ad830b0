// The offloaded optimizer step benchmark (see step_bench.hpp).
#include "profile/step_bench.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "strata/adam.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"
#include "strata/partition.hpp"
#include "zero/offload_store.hpp"

namespace strata::profile {
namespace {

using zero::OffloadStateStore;
using zero::OffloadStepStats;
using zero::OffloadStoreOptions;
using zero::StateView;

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

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

}  // namespace

StepBenchResult run_step_bench(const StepBenchOptions& o) {
  if (o.elements == 0) fail(ErrorCode::kInvalidArgument, "bench step: no elements");
  if (o.rounds < 1) fail(ErrorCode::kInvalidArgument, "bench step: rounds must be >= 1");
  const Config& cfg = o.config;
  const std::size_t n = o.elements;
  StepBenchResult res;
  res.elements = n;
  res.threads = cfg.runtime.cpu_threads ? cfg.runtime.cpu_threads : std::max(1u, std::thread::hardware_concurrency());

  Partition part({{"state", n}}, 1, cfg.zero.sub_group_size);
  std::vector<Range> ranges = part.sub_groups(0, n);
  OffloadStoreOptions so = OffloadStoreOptions::from(cfg, 0, n);
  so.nvme_elems = n;
  std::unique_ptr<OffloadStateStore> store;
  {
    std::vector<float> init(n);
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> d(-0.1f, 0.1f);
    for (auto& x : init) x = d(rng);
    std::shared_ptr<IoEngine> engine = make_io_engine(IoEngineOptions::from(cfg.tiers.nvme), so.paths.empty() ? "/tmp" : so.paths.front());
    store = std::make_unique<OffloadStateStore>(so, init, ranges, std::move(engine));
  }
  res.state_bytes = store->swap_bytes();
  res.buffers = store->pool_buffers();
  res.buffer_size = store->pool_buffer_size();
  res.pool_bytes = static_cast<std::uint64_t>(res.buffers) * res.buffer_size;
  res.chunks = store->chunk_count();
  res.io_engine = store->io_engine_name();

  // What the caller holds: the rank's gradients and the updated parameters in the model dtype.
  const DType gdt = cfg.precision.grads, pdt = cfg.precision.params;
  std::vector<unsigned char> grads(n * dtype_size(gdt)), params(n * dtype_size(pdt));
  {
    std::vector<float> g(std::min<std::size_t>(n, 1 << 20));
    std::mt19937 rng(6);
    std::normal_distribution<float> d(0, 1e-2f);
    for (auto& x : g) x = d(rng);
    for (std::size_t b = 0; b < n; b += g.size()) {
      const std::size_t c = std::min(g.size(), n - b);
      auto* dst = grads.data() + b * dtype_size(gdt);
      if (gdt == DType::kFp32) std::memcpy(dst, g.data(), c * 4);
      else if (gdt == DType::kBf16) convert_fp32_to_bf16(g.data(), reinterpret_cast<std::uint16_t*>(dst), c);
      else convert_fp32_to_fp16(g.data(), reinterpret_cast<std::uint16_t*>(dst), c);
    }
  }
  res.caller_held_bytes = grads.size() + params.size();
  CpuAdam adam(cfg.runtime.cpu_threads);
  // optimizer.update: device — the update copies each chunk to runtime.device and back.
  std::unique_ptr<Device> device;
  std::unique_ptr<DeviceAdam> dadam;
  res.update_on = "cpu";
  if (cfg.optimizer.update == OptimizerUpdate::kDevice) {
    device = zero::make_optimizer_device(cfg);
    dadam = std::make_unique<DeviceAdam>(*device, cfg.runtime.cpu_threads, std::chrono::milliseconds(120000));
    res.update_on = device->name();
  }
  const AdamParams hp = AdamParams::from_config(cfg.optimizer);
  std::int64_t step = 0;
  auto fn = [&](Range r, const StateView& v) {
    AdamTensors t;
    t.param = v.master;
    t.exp_avg = v.exp_avg;
    t.exp_avg_sq = v.exp_avg_sq;
    t.grad = grads.data() + r.begin * dtype_size(gdt);
    t.grad_dtype = gdt;
    t.param_copy = params.data() + r.begin * dtype_size(pdt);
    t.param_copy_dtype = pdt;
    t.n = r.count;
    if (dadam) dadam->step(hp, t, AdamStepOptions{step, 1.0f, false});
    else adam.step(hp, t, AdamStepOptions{step, 1.0f, false});
  };

  ++step;
  store->update(ranges, fn);  // warm-up: page faults of the caller's arrays, thread pool
  const bool hwm = reset_peak_rss();
  if (!hwm) log_warn("bench step: cannot reset VmHWM; the peak RSS includes the setup");
  std::vector<double> tr, tu, tw, ts, tss, tin, twr, tww, tio, eff, deff;
  for (int round = 0; round < o.rounds; ++round) {
    tr.push_back(store->measure_read().t_step);
    tu.push_back(store->measure_update(fn).t_step);
    tw.push_back(store->measure_write().t_step);
    tio.push_back(store->measure_io().t_step);
    ++step;
    store->set_pipelined(true);
    store->update(ranges, fn);
    const OffloadStepStats& s = store->last_stats();
    ts.push_back(s.t_step);
    tin.push_back(s.t_update);
    twr.push_back(s.t_wait_read);
    tww.push_back(s.t_wait_write);
    eff.push_back(std::max({tr.back(), tu.back(), tw.back()}) / s.t_step);
    deff.push_back(std::max(tio.back(), tu.back()) / s.t_step);
    if (o.serial) {
      ++step;
      store->set_pipelined(false);
      store->update(ranges, fn);
      tss.push_back(store->last_stats().t_step);
      store->set_pipelined(true);
    }
  }
  res.peak_rss_bytes = peak_rss();
  res.t_read = median(tr);
  res.t_update = median(tu);
  res.t_write = median(tw);
  res.t_step = median(ts);
  res.t_step_serial = median(tss);
  res.t_update_in_step = median(tin);
  res.t_wait_read = median(twr);
  res.t_wait_write = median(tww);
  res.overlap_efficiency = std::max({res.t_read, res.t_update, res.t_write}) / res.t_step;
  res.overlap_efficiency_rounds = median(eff);
  res.t_io = median(tio);
  res.device_efficiency = median(deff);
  return res;
}

}  // namespace strata::profile
