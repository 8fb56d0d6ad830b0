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
#include <optional>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "core/crc32c.hpp"
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
  cfg.optimizer.overlap = OptimizerOverlap::kOff;  // the optimizer step alone: no backward
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

struct OverlapRun {  // one simulated backward + step()
  double backward_s = 0, step_s = 0, total_s = 0, exposed_s = 0;
  double hand_in_s = 0;  // in the hand-ins (GradientSource::hand_in), the caller's thread
  StepResult last;
  // Elements of the round's updates each side took (optimizer.update auto on a GPU: the split).
  std::uint64_t cpu_elements = 0, device_elements = 0;
};

// The gradients every engine of the overlap bench hands in (precision.grads, o.elements, from
// make_grads). With a CUDA engine they are device memory of its GPU, as a GPU backward leaves
// them: allocated once and filled once by a copy on `producer_`, a stream of the bench's own
// Device on that GPU (the simulated backward "produces" every gradient there), and each is handed
// in with set_gradient_async(id, grad, producer), as strata.torch hands in a GPU backward's: the
// engine's copy is ordered after the fill through the stream, and the hand-in does not wait for
// it (the gradients stay allocated for the bench's life, as the call requires). With the
// host-emulated device: host memory, set_gradient_host, as before. The same bits either way.
class GradientSource {
 public:
  // `engine`: one of the bench's engines (finalized), whose device says where the gradients go.
  GradientSource(Engine& engine, std::vector<unsigned char> host) : host_(std::move(host)) {
    if (engine.device().kind() != DeviceKind::kCuda) return;
    device_ = make_device(DeviceKind::kCuda, engine.device().ordinal());
    producer_ = device_->create_stream();
    mem_ = device_->allocate(host_.size());
    producer_->memcpy_async(mem_.get(), host_.data(), host_.size());
  }

  bool on_device() const { return device_ != nullptr; }
  std::uint64_t bytes() const { return host_.size(); }

  // Tensor `id`'s gradient, `offset` bytes into the gradients.
  void hand_in(Engine& e, TensorId id, std::size_t offset) const {
    if (on_device())
      e.set_gradient_async(id, static_cast<const unsigned char*>(mem_.get()) + offset,
                           producer_->native_handle());
    else
      e.set_gradient_host(id, host_.data() + offset);
  }

  // Device -> pinned host bandwidth of the GPU (after the fill, on the producer stream), copies of
  // min(bytes, 256 MiB); {0, 0} on the host-emulated device. {copy bytes, bytes per second}.
  std::pair<std::uint64_t, double> measure_d2h() const {
    if (!on_device()) return {0, 0.0};
    const std::size_t b = std::min<std::size_t>(host_.size(), std::size_t{256} << 20);
    return {b, measure_d2h_pinned(*device_, *producer_, mem_.get(), b)};
  }

 private:
  std::vector<unsigned char> host_;  // the values; the fill's source stays valid until the end
  std::unique_ptr<Device> device_;   // CUDA only: this GPU, for the bench's own memory and stream
  std::unique_ptr<Stream> producer_;
  DeviceMemory mem_;
};

// One engine of the overlap bench (one rank, stage >= 2, `tensors` gradients) and its simulated
// backward, handing in the gradients of a GradientSource (the engines share it).
class OverlapEngine {
 public:
  OverlapEngine(const OverlapBenchOptions& o, OptimizerOverlap overlap, bool clip)
      : cfg_(bench_config(o, overlap)),
        nt_(std::max<std::size_t>(1, o.tensors)),
        n_(o.elements),
        clip_(clip),
        comm_(one_rank(cfg_)),
        engine_(std::make_unique<Engine>(cfg_, *comm_)) {
    std::mt19937 rng(5);
    for (std::size_t t = 0; t < nt_; ++t)
      add_random_parameter(*engine_, strcat("t", t), n_ / nt_ + (t + 1 == nt_ ? n_ % nt_ : 0), 0.1f,
                           rng);
    engine_->finalize();
  }

  // The k-th gradient (k = 1..tensors) is handed in at k * T / tensors: the hand-ins take their
  // time inside the backward (a GPU's copies run beside its compute); one that runs late delays
  // the next. Then step() (after clip_grad_norm with a norm every step clips, if clip).
  OverlapRun round(double backward_s, const GradientSource& grads) {
    OverlapRun r;
    r.backward_s = backward_s;
    const auto pause = std::chrono::duration<double>(backward_s / static_cast<double>(nt_));
    const std::size_t es = dtype_size(cfg_.precision.grads);
    const auto before = EngineAccess::update_split_elements(*engine_);
    const auto t0 = Clock::now();
    for (std::size_t t = nt_; t-- > 0;) {
      std::this_thread::sleep_until(
          t0 + std::chrono::duration_cast<Clock::duration>(pause * static_cast<double>(nt_ - t)));
      const auto h = Clock::now();
      grads.hand_in(*engine_, t, t * (n_ / nt_) * es);
      r.hand_in_s += std::chrono::duration<double>(Clock::now() - h).count();
    }
    if (clip_) engine_->clip_grad_norm(1e-12);
    const auto t1 = Clock::now();
    r.last = engine_->step();
    r.step_s = std::chrono::duration<double>(Clock::now() - t1).count();
    r.total_s = std::chrono::duration<double>(Clock::now() - t0).count();
    r.exposed_s = r.last.exposed_s;
    const auto after = EngineAccess::update_split_elements(*engine_);
    r.cpu_elements = after.first - before.first;
    r.device_elements = after.second - before.second;
    return r;
  }

  Engine& engine() { return *engine_; }

  // CRC32C of the FP32 master weights, tensor by tensor in order.
  std::uint32_t master_crc32c() {
    std::uint32_t crc = 0;
    std::vector<float> buf;
    for (TensorId t = 0; t < nt_; ++t) {
      buf.resize(engine_->numel(t));
      engine_->read_state(t, StateKind::kMaster, buf);
      crc = crc32c(buf.data(), buf.size() * sizeof(float), crc);
    }
    return crc;
  }

 private:
  static Config bench_config(const OverlapBenchOptions& o, OptimizerOverlap overlap) {
    Config cfg = o.config;
    cfg.world.ranks = 1;
    cfg.world.ranks_per_node = 1;
    cfg.zero.stage = std::max(cfg.zero.stage, 2);
    cfg.optimizer.overlap = overlap;
    cfg.train.accumulate = 1;
    const std::size_t nt = std::max<std::size_t>(1, o.tensors);
    cfg.zero.reduce_bucket_size = std::max<std::uint64_t>(1, o.elements / nt);
    return cfg;
  }

  const Config cfg_;
  const std::size_t nt_, n_;
  const bool clip_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Engine> engine_;
};

// One variant's rounds, each with the serial round run just before it.
struct Paired {
  std::vector<OverlapRun> serial, runs;
  std::uint64_t rolled_back_steps = 0;  // of the variant's warm-up step and rounds
  std::uint32_t master_crc32c = 0;      // the variant's, after its steps
};

// The variant (overlap, clip) alternating with the serial engine, round by round, both with the
// same T. With o.backward_s < 0 (auto), T follows the serial step: each round's is the serial
// step of the round before (t carries it from one variant to the next).
Paired alternate(const OverlapBenchOptions& o, const GradientSource& grads, OverlapEngine& serial,
                 double& t, OptimizerOverlap overlap, bool clip) {
  Paired p;
  OverlapEngine v(o, overlap, clip);
  if (v.round(t, grads).last.rolled_back_chunks > 0) ++p.rolled_back_steps;  // warm-up
  for (int i = 0; i < std::max(1, o.rounds); ++i) {
    p.serial.push_back(serial.round(t, grads));
    p.runs.push_back(v.round(t, grads));
    if (o.backward_s < 0) t = p.serial.back().step_s;
    if (p.runs.back().last.rolled_back_chunks > 0) ++p.rolled_back_steps;
  }
  p.master_crc32c = v.master_crc32c();
  return p;
}

template <class F>
double median_of(const std::vector<OverlapRun>& runs, F f) {
  std::vector<double> v;
  for (const OverlapRun& r : runs) v.push_back(f(r));
  return median(v);
}

// The median over the rounds of f(variant round, the serial round just before it).
template <class F>
double median_ratio(const Paired& p, F f) {
  std::vector<double> v;
  for (std::size_t i = 0; i < p.runs.size(); ++i) v.push_back(f(p.runs[i], p.serial[i]));
  return median(v);
}

// The ratios of the result, each the median over the rounds of one against the serial round run
// just before it.
void ratios(const Paired& on, const Paired& clipped, const Paired& auto_clip,
            OverlapBenchResult& res) {
  auto bound = [](const OverlapRun& r, const OverlapRun& s) {
    return std::max(r.backward_s, s.step_s);
  };
  res.exposed_ratio = median_ratio(
      on, [](const OverlapRun& r, const OverlapRun& s) { return r.exposed_s / s.step_s; });
  res.total_ratio = median_ratio(
      on, [&](const OverlapRun& r, const OverlapRun& s) { return r.total_s / bound(r, s); });
  res.serial_total_ratio = median_ratio(
      on, [&](const OverlapRun& r, const OverlapRun& s) { return s.total_s / bound(r, s); });
  auto of_serial = [](const OverlapRun& r, const OverlapRun& s) { return r.total_s / s.total_s; };
  res.rollback_ratio = median_ratio(clipped, of_serial);
  res.auto_clip_ratio = median_ratio(auto_clip, of_serial);
  std::vector<double> serial, overlapped;
  for (std::size_t i = 0; i < std::min(on.runs.size(), auto_clip.runs.size()); ++i) {
    serial.push_back(clipped.serial[i].step_s / on.serial[i].step_s);
    overlapped.push_back(auto_clip.runs[i].total_s / on.runs[i].total_s);
  }
  res.clip_serial_ratio = median(serial);
  res.clip_overlapped_ratio = median(overlapped);
}

// The medians of the result: each variant's times, the chunk counts, the ratios, the rounds of
// overlap on one by one.
void summarize_overlap(const Paired& on, const Paired& clipped, const Paired& auto_clip,
                       OverlapBenchResult& res) {
  std::vector<OverlapRun> clip_serial = clipped.serial;
  clip_serial.insert(clip_serial.end(), auto_clip.serial.begin(), auto_clip.serial.end());
  res.serial_clip_step_s = median_of(clip_serial, [](const OverlapRun& r) { return r.step_s; });
  res.serial_clip_total_s = median_of(clip_serial, [](const OverlapRun& r) { return r.total_s; });
  const std::vector<OverlapRun>& all_serial = on.serial;
  res.backward_s = median_of(on.runs, [](const OverlapRun& r) { return r.backward_s; });
  res.serial_step_s = median_of(all_serial, [](const OverlapRun& r) { return r.step_s; });
  res.serial_total_s = median_of(all_serial, [](const OverlapRun& r) { return r.total_s; });
  res.serial_hand_in_s = median_of(all_serial, [](const OverlapRun& r) { return r.hand_in_s; });
  res.overlapped_hand_in_s = median_of(on.runs, [](const OverlapRun& r) { return r.hand_in_s; });
  res.overlapped_step_s = median_of(on.runs, [](const OverlapRun& r) { return r.step_s; });
  res.overlapped_total_s = median_of(on.runs, [](const OverlapRun& r) { return r.total_s; });
  res.exposed_s = median_of(on.runs, [](const OverlapRun& r) { return r.exposed_s; });
  res.rollback_step_s = median_of(clipped.runs, [](const OverlapRun& r) { return r.step_s; });
  res.rollback_total_s = median_of(clipped.runs, [](const OverlapRun& r) { return r.total_s; });
  res.auto_clip_step_s = median_of(auto_clip.runs, [](const OverlapRun& r) { return r.step_s; });
  res.auto_clip_total_s = median_of(auto_clip.runs, [](const OverlapRun& r) { return r.total_s; });
  res.auto_clip_rolled_back_steps = auto_clip.rolled_back_steps;
  res.speculated_chunks = on.runs.back().last.speculated_chunks;
  res.committed_chunks = on.runs.back().last.committed_chunks;
  res.rolled_back_chunks = clipped.runs.back().last.rolled_back_chunks;
  res.update_cpu_elements = on.runs.back().cpu_elements;
  res.update_device_elements = on.runs.back().device_elements;
  ratios(on, clipped, auto_clip, res);
  for (std::size_t i = 0; i < on.runs.size(); ++i) {
    res.backward_s_rounds.push_back(on.runs[i].backward_s);
    res.serial_step_s_rounds.push_back(on.serial[i].step_s);
    res.exposed_s_rounds.push_back(on.runs[i].exposed_s);
    res.overlapped_total_s_rounds.push_back(on.runs[i].total_s);
  }
}

// The hand-ins against the link: where the gradients live, the bytes per round and their rates
// (after summarize_overlap), and the device -> host bandwidth, measured now (after every round).
void hand_in_figures(const GradientSource& grads, OverlapBenchResult& res) {
  res.gradients = grads.on_device() ? "device" : "host";
  res.hand_in_bytes = grads.bytes();
  const auto rate = [&](double s) {
    return s > 0 ? static_cast<double>(res.hand_in_bytes) / s : 0;
  };
  res.serial_hand_in_bytes_per_second = rate(res.serial_hand_in_s);
  res.overlapped_hand_in_bytes_per_second = rate(res.overlapped_hand_in_s);
  std::tie(res.d2h_copy_bytes, res.d2h_bytes_per_second) = grads.measure_d2h();
}

}  // namespace

OverlapBenchResult run_overlap_bench(const OverlapBenchOptions& o) {
  if (o.elements == 0) fail(ErrorCode::kInvalidArgument, "bench step: no elements");
  OverlapBenchResult res;
  res.elements = o.elements;
  res.rounds = std::max(1, o.rounds);
  std::optional<GradientSource> grads;  // outlives every engine
  double t = std::max(o.backward_s, 0.0);
  Paired on, clipped, auto_clip;
  {
    OverlapEngine serial(o, OptimizerOverlap::kOff, false);
    grads.emplace(serial.engine(), make_grads(o.config.precision.grads, o.elements));
    const double warm = serial.round(t, *grads).step_s;  // warm-up
    if (o.backward_s < 0) t = warm;
    on = alternate(o, *grads, serial, t, OptimizerOverlap::kOn, false);
    // Both engines took the warm-up step and o.rounds more, from the same gradients.
    res.serial_master_crc32c = serial.master_crc32c();
    res.overlapped_equals_serial = on.master_crc32c == res.serial_master_crc32c;
  }
  {
    // Clipping forced: against the serial step that clips too (the same work, overlap off).
    OverlapEngine serial(o, OptimizerOverlap::kOff, true);
    serial.round(t, *grads);  // warm-up
    clipped = alternate(o, *grads, serial, t, OptimizerOverlap::kOn, true);
    auto_clip = alternate(o, *grads, serial, t, OptimizerOverlap::kAuto, true);
  }
  summarize_overlap(on, clipped, auto_clip, res);
  hand_in_figures(*grads, res);
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
