// The engine check: a real multi-rank step of the public Engine (include/strata/engine.hpp) over
// the launch's communicator, on a sample model with the configured stage, precision, offload and
// tiers, timed on every rank (the slowest rank's time is the step's), against the cost model's
// prediction for the same model from this profile's measured legs (docs/profile.md).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>

#include "profile/profile_internal.hpp"
#include "profile/step_bench.hpp"
#include "strata/adam.hpp"
#include "strata/communicator.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"
#include "strata/plan.hpp"
#include "strata/units.hpp"

namespace strata::profile {
namespace {

// Small finite values of `dtype` (the loop hands in already-scaled gradients; these stay far
// from fp16's range even at the largest loss scale).
std::vector<std::uint8_t> small_values(DType dtype, std::size_t n, std::uint64_t seed) {
  std::vector<float> f(n);
  std::uint32_t x = static_cast<std::uint32_t>(seed * 2654435761u + 7u);
  for (auto& v : f) {
    x = x * 1664525u + 1013904223u;
    v = (static_cast<float>(x >> 8) / 8388608.0f - 1.0f) * 1e-3f;
  }
  std::vector<std::uint8_t> out(n * dtype_size(dtype));
  if (dtype == DType::kFp32)
    std::memcpy(out.data(), f.data(), n * 4);
  else if (dtype == DType::kFp16)
    convert_fp32_to_fp16(f.data(), reinterpret_cast<std::uint16_t*>(out.data()), n);
  else
    convert_fp32_to_bf16(f.data(), reinterpret_cast<std::uint16_t*>(out.data()), n);
  return out;
}

// The collectives one engine step issues, replayed on the same communicator with the same sizes
// and dtypes (stage 0: an all-reduce of everything; 1: a reduce-scatter of everything; 2-3: one
// reduce-scatter per reduce bucket; then the parameter all-gather, stage 3: one in forward and
// one in backward); median seconds of 3 (the slowest rank's).
double replay_collectives(const Config& cfg, Communicator& comm, std::uint64_t elements) {
  const int n = comm.size();
  const DType gd = cfg.precision.grads, pd = cfg.precision.params;
  const std::uint64_t shard = (elements + n - 1) / n;
  const std::uint64_t padded = shard * n;
  std::vector<std::uint8_t> grads(padded * dtype_size(gd)), params(padded * dtype_size(pd));
  std::vector<std::uint8_t> part(std::max<std::uint64_t>(shard, 1) * dtype_size(gd));
  std::vector<std::uint8_t> bucket_buf;
  std::vector<std::vector<std::uint8_t>> bucket_bufs;  // in flight until waited
  std::deque<std::vector<std::uint8_t>> recvs;         // (a deque: stable addresses)
  const std::uint64_t bucket = std::max<std::uint64_t>(cfg.zero.reduce_bucket_size, 1);
  std::vector<double> times;
  for (int rep = 0; rep < 3; ++rep) {
    bucket_buf.assign(std::min(bucket, padded) * dtype_size(gd), 0);
    comm.barrier();
    Stopwatch sw;
    if (cfg.zero.stage == 0) {
      comm.all_reduce(grads.data(), grads.data(), padded, gd);
    } else if (cfg.zero.stage == 1) {
      comm.reduce_scatter(grads.data(), part.data(), shard, gd);
    } else {
      // As the engine's backward does it: each bucket's gradients copied into a bucket buffer,
      // its reduce-scatter issued at once, all waited at the step.
      std::vector<std::unique_ptr<CommHandle>> inflight;
      for (std::uint64_t b = 0; b < padded; b += bucket) {
        const std::uint64_t len = std::min(bucket, padded - b);
        const std::uint64_t per = std::max<std::uint64_t>(len / n, 1);
        std::memcpy(bucket_buf.data(), grads.data() + b * dtype_size(gd), len * dtype_size(gd));
        recvs.emplace_back(per * dtype_size(gd));
        const std::vector<std::size_t> counts(static_cast<std::size_t>(n), per);
        inflight.push_back(
            comm.reduce_scatter_async(bucket_buf.data(), recvs.back().data(), counts, gd));
        for (auto& h : inflight) h->done();  // progress, as set_gradient's polls do
        bucket_bufs.push_back(std::move(bucket_buf));
        bucket_buf.assign(std::min(bucket, padded) * dtype_size(gd), 0);
      }
      for (auto& h : inflight) h->wait();
      bucket_bufs.clear();
      recvs.clear();
    }
    const int gathers = cfg.zero.stage == 0 ? 0 : cfg.zero.stage == 3 ? 2 : 1;
    for (int g = 0; g < gathers; ++g) comm.all_gather(params.data(), params.data(), shard, pd);
    times.push_back(max_over_ranks(comm, sw.seconds()));
  }
  return median(times);
}

// The engine's norm pass over the rank's gradient partition and the agreement on it (a 16-byte
// all-gather), and the copy of every gradient into the engine's buffers at set_gradient: median
// seconds of 3 each, measured alone.
double measure_grad_passes(const Config& cfg, Communicator& comm, std::uint64_t elements,
                           bool with_stats) {
  const DType gd = cfg.precision.grads;
  const std::uint64_t shard = (elements + comm.size() - 1) / comm.size();
  std::vector<std::uint8_t> src = small_values(gd, elements, 99), dst(src.size());
  CpuAdam adam(cfg.runtime.cpu_threads);
  std::vector<double> times;
  for (int rep = 0; rep < 3; ++rep) {
    comm.barrier();
    Stopwatch sw;
    std::memcpy(dst.data(), src.data(), src.size());
    if (with_stats)
      (void)adam.grad_stats(dst.data(), gd, shard, 1.0f, static_cast<float>(comm.size()));
    std::uint32_t mine[4] = {1, 2, 3, 4};
    std::vector<std::uint32_t> all(4 * static_cast<std::size_t>(comm.size()));
    comm.all_gather(mine, all.data(), 4, DType::kFp32);
    times.push_back(max_over_ranks(comm, sw.seconds()));
  }
  return median(times);
}

}  // namespace

// The zero layer's offloaded step on `elements` of optimizer state per rank, legs measured alone
// (run_step_bench, 3 rounds, every rank at once after a barrier), and the pipelined step they
// predict: chunks of the pinned pool as sub-groups, NVMe at the measured read || write rate.
struct StepLegs {
  bool measured = false;
  double predicted_s = 0;
  // The rest of a one-rank Engine::step() around its update loop (its local reduction; the
  // statistics pass runs inside the loop, as its gate under the first NVMe reads, when the
  // gradients need no pool slot): measured step() time minus the update loop's.
  double local_s = 0;
};
StepLegs zero_step_legs(const Config& cfg, Communicator& comm, std::uint64_t elements) {
  StepLegs out;
  StepBenchOptions o;
  o.config = cfg;
  o.elements = elements;
  o.rounds = 3;
  o.serial = false;
  StepBenchResult r;
  comm.barrier();
  try {
    r = run_step_bench(o);
  } catch (const Error& e) {
    log_warn("profile: engine check: the zero layer's step legs could not be measured: ", e.what());
    return out;
  }
  const auto max = [&](double v) { return max_over_ranks(comm, v); };
  const double t_read = max(r.t_read), t_update = max(r.t_update), t_write = max(r.t_write),
               t_io = max(r.t_io);
  Bandwidths bw;
  const double bytes = static_cast<double>(r.state_bytes);
  bw.nvme_read_bps = t_read > 0 ? bytes / t_read : 0;
  bw.nvme_write_bps = t_write > 0 ? bytes / t_write : 0;
  bw.nvme_mixed_bps = t_io > 0 ? 2 * bytes / t_io : 0;
  bw.cpu_adam_params_per_s = t_update > 0 ? static_cast<double>(elements) / t_update : 0;
  const std::uint64_t chunks = std::max<std::uint64_t>(r.chunks, 1);
  const std::uint64_t per_chunk = std::max<std::uint64_t>(elements / chunks, 1);
  const std::uint64_t bpe =
      std::max<std::uint64_t>(r.state_bytes / std::max<std::uint64_t>(elements, 1), 1);
  out.predicted_s = predict_sample(per_chunk, chunks, bpe, bw).pipelined_s;
  out.local_s = max(std::max(0.0, r.t_engine_step - r.t_step));
  out.measured = true;
  return out;
}

namespace {

// The engine's config for the check: the launch's ranks, `elements` parameters, the sample step's
// sub-groups (its legs are the prediction's inputs), a few reduce buckets, the pinned pool the
// sample step chose.
Config check_config(const Config& c, const std::vector<std::string>& paths, int n,
                    std::uint64_t elements, std::uint64_t sub_group) {
  Config cfg = c;
  cfg.world.ranks = static_cast<std::uint32_t>(n);
  cfg.world.ranks_per_node = std::min<std::uint32_t>(c.ranks_per_node(), cfg.world.ranks);
  cfg.model = ModelConfig{};
  cfg.model.parameters = elements;
  cfg.tiers.nvme.paths = paths;
  cfg.optimizer.overlap = OptimizerOverlap::kOff;  // the serial step, which the model predicts
  const std::uint64_t per_rank =
      std::max<std::uint64_t>(elements / static_cast<std::uint64_t>(n), 1);
  cfg.zero.sub_group_size = std::max<std::uint64_t>(std::min(sub_group, per_rank), 1);
  cfg.zero.reduce_bucket_size =
      std::min<std::uint64_t>(c.zero.reduce_bucket_size, std::max<std::uint64_t>(elements / 4, 1));
  const PoolUse pool = choose_pool(c, c.tiers.host.buffer_count, 3);
  cfg.tiers.host.buffer_count = pool.buffers;
  cfg.tiers.host.buffer_size = pool.buffer_size;
  cfg.tiers.host.pinned_budget = std::max<std::uint64_t>(
      cfg.tiers.host.pinned_budget, std::uint64_t(pool.buffers) * pool.buffer_size);
  return cfg;
}

// Runs `steps` + 1 engine steps the way a loop does (forward gathers, gradients handed in
// backward); the first is a warm-up. Fills the measured times and the engine's phase times.
void run_engine_steps(const Config& cfg, Communicator& comm, std::uint64_t elements, int steps,
                      EngineCheck& ec) {
  // Uneven tensors: 40 %, 30 %, 20 %, the rest.
  std::vector<std::uint64_t> sizes = {elements * 4 / 10, elements * 3 / 10, elements * 2 / 10};
  sizes.push_back(elements - sizes[0] - sizes[1] - sizes[2]);
  std::vector<double> step_s;
  EngineStats before, after;
  {
    Engine e(cfg, comm);
    std::vector<TensorId> ids;
    std::vector<std::vector<std::uint8_t>> grads;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      std::vector<float> init(sizes[t]);
      for (std::size_t i = 0; i < init.size(); ++i)
        init[i] = 0.01f * static_cast<float>((i * 7 + t) % 101) - 0.5f;
      ids.push_back(e.add_parameter(strcat("sample", t), init));
      grads.push_back(small_values(cfg.precision.grads, sizes[t], 1000 + 17 * t + comm.rank()));
    }
    e.finalize();
    for (int s = 0; s <= steps; ++s) {
      if (s == 1) before = e.stats();
      comm.barrier();
      Stopwatch sw;
      for (auto id : ids) {  // forward (stage 3 gathers; no-ops below)
        e.gather({&id, 1});
        e.release({&id, 1});
      }
      for (auto it = ids.rbegin(); it != ids.rend(); ++it) {  // backward
        TensorId id = *it;
        e.gather({&id, 1});
        e.set_gradient(id, grads[id].data());
        e.release({&id, 1});
      }
      const StepResult res = e.step();
      const double t = max_over_ranks(comm, sw.seconds());
      if (!res.applied)
        log_warn("profile: engine check step ", s, " was skipped (gradient overflow)");
      if (s > 0) step_s.push_back(t);
    }
    after = e.stats();
  }
  ec.ran = true;
  ec.measured_s = step_s;
  ec.measured_median_s = median(step_s);
  const double k = static_cast<double>(std::max(steps, 1));
  ec.reduce_s = max_over_ranks(comm, (after.reduce_s - before.reduce_s) / k);
  ec.norm_s = max_over_ranks(comm, (after.norm_s - before.norm_s) / k);
  ec.optimizer_s = max_over_ranks(comm, (after.optimizer_s - before.optimizer_s) / k);
  ec.gather_s = max_over_ranks(comm, (after.gather_s - before.gather_s) / k);
}

}  // namespace

EngineCheck run_engine_check(const Config& c, const std::vector<std::string>& paths,
                             Communicator& comm, const Bandwidths& bw, const SampleStep& sample,
                             std::uint64_t elements, std::uint64_t sub_group, int steps,
                             const Progress& progress) {
  EngineCheck ec;
  const int n = comm.size();
  ec.ranks = n;
  ec.backend = comm.backend_name();
  ec.elements = elements;
  const Config cfg = check_config(c, paths, n, elements, sub_group);
  const Layout layout = plan_layout(cfg, cfg.zero.stage, cfg.offload);
  ec.layout = layout.describe();
  if (progress)
    progress(strcat("engine check: ", n, " ranks over ", ec.backend, ", ", ec.layout, ", ",
                    format_count(elements), " parameters, ", steps, " steps"));

  // The legs the engine adds to the optimizer step, measured alone with the real communicator.
  const double network = replay_collectives(cfg, comm, elements);
  const bool all_nvme =
      cfg.offload.optimizer.tier == Tier::kNvme && cfg.offload.optimizer.fraction >= 1.0;
  const StepLegs legs =
      all_nvme ? zero_step_legs(cfg, comm, layout.footprint.optimizer_elements) : StepLegs{};
  const double grad_passes =
      measure_grad_passes(cfg, comm, elements, !legs.measured) + legs.local_s;

  run_engine_steps(cfg, comm, elements, steps, ec);

  // The prediction from the profile's legs: the optimizer step from the sample step's rates (the
  // engine keeps its state in host memory, so its "gpu" optimizer share runs at the CPU Adam
  // rate over memory), + the step's collectives and the gradient passes measured alone above.
  Bandwidths b = bw;
  if (b.gpu_adam_params_per_s <= 0) b.gpu_adam_params_per_s = b.memory_adam_rate();
  ec.prediction = predict_step(cfg, layout, b);
  ec.prediction.network_s = network;
  double optimizer = std::max(ec.prediction.pipelined_s, 0.0);
  // With the whole optimizer partition on NVMe the engine runs the zero layer's offloaded step
  // (its own chunks of the pinned pool): predict from that step's legs, measured alone just
  // before the engine steps by every rank at the same time (so the ranks share the disk and the
  // cores as they do in the step), with the same model as the sample step.
  if (legs.measured) {
    optimizer = legs.predicted_s;
    ec.optimizer_from =
        "the zero layer's step legs (read, update, read || write), all ranks at once";
  } else {
    ec.optimizer_from = "the sample step's legs";
  }
  (void)sample;
  ec.predicted_optimizer_s = optimizer;
  ec.predicted_s = optimizer + network + grad_passes;
  ec.grad_passes_s = grad_passes;
  ec.error =
      ec.measured_median_s > 0 ? (ec.predicted_s - ec.measured_median_s) / ec.measured_median_s : 0;
  return ec;
}

}  // namespace strata::profile
