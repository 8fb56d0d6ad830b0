// The step cost model: plan bytes per link + measured bandwidths -> optimizer-step time and
// per-step transfer overhead, serial and pipelined (docs/profile.md, "The cost model").
#include <algorithm>
#include <cmath>

#include "strata/error.hpp"
#include "strata/profile.hpp"
#include "strata/units.hpp"

namespace strata {

const char* profile_mode_name(ProfileMode m) {
  switch (m) {
    case ProfileMode::kTiny: return "tiny";
    case ProfileMode::kQuick: return "quick";
    case ProfileMode::kDefault: return "default";
    case ProfileMode::kFull: return "full";
  }
  return "?";
}

double SubGroupLegs::slot(bool nvme_duplex) const {
  const double nvme = nvme_mixed_s > 0 ? nvme_mixed_s
                      : nvme_duplex    ? std::max(nvme_read_s, nvme_write_s)
                                       : nvme_read_s + nvme_write_s;
  // Gradients down and parameters up share one PCIe link only in the sense of one copy engine
  // each way; a GPU has both, so the larger direction bounds.
  const double pcie = std::max(h2d_s, d2h_s);
  return std::max({nvme, pcie, adam_s, cpu_s});
}

namespace {

// a − b, or 0 when b covers a up to rounding: a and b are sums over sub-groups in different
// orders and can differ by an ulp, which must not print as a 4e-16 s overhead.
double excess(double a, double b) {
  const double d = a - b;
  return d <= 1e-9 * std::max(std::fabs(a), std::fabs(b)) ? 0.0 : d;
}

double seconds(double bytes, double rate) { return rate > 0 ? bytes / rate : 0.0; }

// Wall time the CPU needs for a sub-group when the legs overlap: Adam's CPU-seconds and the I/O's,
// over the cores. Adam's share is capped at its own wall time (it cannot need the cores for longer
// than it runs; a noisy CPU-time sample must not invent overhead).
double cpu_bound(double nvme_bytes, double elements, double adam_s, const Bandwidths& bw) {
  const double adam = std::min(elements * bw.cpu_s_per_adam_element / bw.cores, adam_s);
  return adam + nvme_bytes * bw.cpu_s_per_nvme_byte / bw.cores;
}

// Fill in serial/pipelined from the per-shape legs (full sub-groups first, then the partial one).
void finish_pipeline(StepPrediction& p, bool duplex) {
  p.serial_s = 0;
  p.pipelined_s = 0;
  bool first = true;
  for (std::size_t i = 0; i < p.legs.size(); ++i) {
    const auto& l = p.legs[i];
    const auto n = p.legs_count[i];
    if (n == 0) continue;
    p.serial_s += static_cast<double>(n) * l.sum();
    p.nvme_read_s += static_cast<double>(n) * l.nvme_read_s;
    p.nvme_write_s += static_cast<double>(n) * l.nvme_write_s;
    p.h2d_s += static_cast<double>(n) * l.h2d_s;
    p.d2h_s += static_cast<double>(n) * l.d2h_s;
    if (first) {
      // The first sub-group's legs run one after another (fill + drain); each further one adds
      // its busiest resource's time.
      p.pipelined_s += l.sum() + static_cast<double>(n - 1) * l.slot(duplex);
      first = false;
    } else {
      p.pipelined_s += static_cast<double>(n) * l.slot(duplex);
    }
  }
}

// Every byte the plan moves over a tier link per step is spread over the optimizer's sub-groups
// in proportion to their elements (the legs of a full sub-group, and of the remainder); with
// nothing of the optimizer offloaded, the transfers form one group of their own.
void spread_legs(StepPrediction& p, const LinkTraffic& t, const Bandwidths& bw, double adam_rate) {
  const bool any_transfer = t.nvme_read || t.nvme_write || t.host_to_device || t.device_to_host;
  const std::uint64_t spread = p.offloaded_elements ? p.offloaded_elements : (any_transfer ? 1 : 0);
  if (spread) {
    const std::uint64_t sg = p.offloaded_elements ? p.sub_group_elements : 1;
    const std::uint64_t full = spread / sg, rem = spread % sg;
    auto legs_for = [&](std::uint64_t e) {
      const double share = static_cast<double>(e) / static_cast<double>(spread);
      SubGroupLegs l;
      l.elements = p.offloaded_elements ? e : 0;
      l.nvme_read_s = seconds(share * static_cast<double>(t.nvme_read), bw.nvme_read_bps);
      l.nvme_write_s = seconds(share * static_cast<double>(t.nvme_write), bw.nvme_write_bps);
      l.nvme_mixed_s =
          seconds(share * static_cast<double>(t.nvme_read + t.nvme_write), bw.nvme_mixed_bps);
      l.h2d_s = seconds(share * static_cast<double>(t.host_to_device), bw.h2d_bps);
      l.d2h_s = seconds(share * static_cast<double>(t.device_to_host), bw.d2h_bps);
      l.adam_s = seconds(static_cast<double>(l.elements), adam_rate);
      if (bw.cores > 0)
        l.cpu_s = cpu_bound(share * static_cast<double>(t.nvme_read + t.nvme_write),
                            static_cast<double>(l.elements), l.adam_s, bw);
      return l;
    };
    if (full) {
      p.legs.push_back(legs_for(sg));
      p.legs_count.push_back(full);
    }
    if (rem) {
      p.legs.push_back(legs_for(rem));
      p.legs_count.push_back(1);
    }
    p.sub_groups = full + (rem ? 1 : 0);
  }
}

// Says which legs were not counted because their rate was not measured.
void note_unmeasured(StepPrediction& p, const LinkTraffic& t, const Bandwidths& bw,
                     std::uint64_t on_gpu) {
  if ((t.nvme_read || t.nvme_write) && (bw.nvme_read_bps <= 0 || bw.nvme_write_bps <= 0))
    p.notes.push_back("NVMe bandwidth not measured: NVMe legs not counted");
  if ((t.host_to_device || t.device_to_host) && (bw.h2d_bps <= 0 || bw.d2h_bps <= 0))
    p.notes.push_back("no GPU measured: host<->device legs (" +
                      format_bytes(t.host_to_device + t.device_to_host) + " per step) not counted");
  if (p.offloaded_elements && bw.cpu_adam_params_per_s <= 0)
    p.notes.push_back("CPU Adam not measured: its time is not counted");
  if (on_gpu && bw.gpu_adam_params_per_s <= 0)
    p.notes.push_back("no GPU measured: Adam on the GPU share (" + format_count(on_gpu) +
                      " elements) not counted");
}

// Collectives: reduce-scatter of the gradients (psi * grad bytes: precision.grads at stages 2-3,
// the held precision.grad_accum at 0-1), the rest of the plan's network bytes are parameter
// all-gathers (stage 0: the all-reduce's all-gather half). Time = S * (n-1)/n / busbw
// (nccl-tests' definition of bus bandwidth).
void add_network(StepPrediction& p, const Config& c, const LinkTraffic& t, const Bandwidths& bw,
                 const BytesPerParam& b, int stage) {
  const std::uint32_t n = c.world.ranks;
  const std::uint64_t gb = stage >= 2 ? dtype_size(c.precision.grads) : b.grads;
  if (n > 1 && t.network > 0) {
    const double rs =
        static_cast<double>(std::min<std::uint64_t>(t.network, c.model.parameters * gb));
    const double ag = static_cast<double>(t.network) - rs;
    const double f = static_cast<double>(n - 1) / static_cast<double>(n);
    p.network_s = seconds(rs * f, bw.reduce_scatter_busbw) + seconds(ag * f, bw.all_gather_busbw);
    if (bw.reduce_scatter_busbw <= 0 || bw.all_gather_busbw <= 0)
      p.notes.push_back("collective bandwidth not measured: network time not counted");
  }
}

}  // namespace

StepPrediction predict_step(const Config& c, const Layout& layout, const Bandwidths& bw) {
  StepPrediction p;
  const BytesPerParam b = bytes_per_param(c.precision);
  const std::uint64_t opt_bpe = std::max<std::uint64_t>(b.optimizer(), 1);
  p.optimizer_elements = layout.footprint.optimizer_elements;
  const std::uint64_t off_cpu = layout.on_host.optimizer / opt_bpe;
  const std::uint64_t off_nvme = layout.on_nvme.optimizer / opt_bpe;
  p.offloaded_elements = off_cpu + off_nvme;
  const std::uint64_t on_gpu =
      p.optimizer_elements - std::min(p.optimizer_elements, p.offloaded_elements);
  p.sub_group_elements = std::max<std::uint64_t>(c.zero.sub_group_size, 1);
  const LinkTraffic& t = layout.traffic;
  // Memory-resident state at the memory rate, NVMe state (through the pool) at the staged one;
  // the sub-groups mix them in proportion (the rate they average to).
  p.adam_memory_s = seconds(static_cast<double>(off_cpu), bw.memory_adam_rate());
  const double cpu_adam =
      p.adam_memory_s + seconds(static_cast<double>(off_nvme), bw.cpu_adam_params_per_s);
  spread_legs(p, t, bw, cpu_adam > 0 ? static_cast<double>(p.offloaded_elements) / cpu_adam : 0.0);
  finish_pipeline(p, bw.nvme_duplex);
  const double gpu_adam = seconds(static_cast<double>(on_gpu), bw.gpu_adam_params_per_s);
  p.adam_s = cpu_adam + gpu_adam;
  p.adam_gpu_s = gpu_adam;
  // The GPU share of the optimizer runs beside the CPU pipeline.
  p.serial_s += gpu_adam;
  p.pipelined_s = std::max(p.pipelined_s, gpu_adam);

  note_unmeasured(p, t, bw, on_gpu);
  add_network(p, c, t, bw, b, layout.stage);
  p.overhead_serial_s = excess(p.serial_s, p.adam_s) + p.network_s;
  p.overhead_pipelined_s = excess(p.pipelined_s, p.adam_s) + p.network_s;
  return p;
}

StepPrediction predict_sample(std::uint64_t elements, std::uint64_t sub_groups,
                              std::uint64_t bytes_per_element_nvme, const Bandwidths& bw) {
  if (elements == 0 || sub_groups == 0)
    fail(ErrorCode::kInvalidArgument, "predict_sample: elements and sub_groups must be > 0");
  StepPrediction p;
  p.optimizer_elements = p.offloaded_elements = elements * sub_groups;
  p.sub_group_elements = elements;
  p.sub_groups = sub_groups;
  SubGroupLegs l;
  l.elements = elements;
  const double bytes = static_cast<double>(elements * bytes_per_element_nvme);
  l.nvme_read_s = seconds(bytes, bw.nvme_read_bps);
  l.nvme_write_s = seconds(bytes, bw.nvme_write_bps);
  l.nvme_mixed_s = seconds(2 * bytes, bw.nvme_mixed_bps);
  l.adam_s = seconds(static_cast<double>(elements), bw.cpu_adam_params_per_s);
  if (bw.cores > 0) l.cpu_s = cpu_bound(2 * bytes, static_cast<double>(elements), l.adam_s, bw);
  p.legs.push_back(l);
  p.legs_count.push_back(sub_groups);
  finish_pipeline(p, bw.nvme_duplex);
  p.adam_s = static_cast<double>(sub_groups) * l.adam_s;
  p.overhead_serial_s = excess(p.serial_s, p.adam_s);
  p.overhead_pipelined_s = excess(p.pipelined_s, p.adam_s);
  return p;
}

OverlapShape overlap_shape(const Config& config) {
  OverlapShape s;
  s.stage = config.zero.stage;
  s.model_elements = config.model.parameters;
  s.bucket_elements = config.zero.reduce_bucket_size;
  if (s.stage == 2)
    s.param_commit_bytes = config.model.parameters /
                           std::max<std::uint32_t>(config.world.ranks, 1) *
                           dtype_size(config.precision.params);
  s.split = update_split(config);
  s.split_in_bytes = 12 + dtype_size(config.precision.accum_dtype());
  s.split_out_bytes = 12 + dtype_size(config.precision.params);
  return s;
}

namespace {
// The speculative update's time with the Adam of memory-resident state (its out-of-place time
// `adam_s`, of `elements`) shared with the device at the shape's bytes per element; sets
// o.device_share. Without a split, or the GPU's rates: unchanged.
double split_update(double w, double adam_s, std::uint64_t elements, const OverlapShape& shape,
                    const Bandwidths& bw, OverlapPrediction& o) {
  if (!shape.split || adam_s <= 0 || elements == 0 || bw.h2d_bps <= 0 || bw.d2h_bps <= 0 ||
      bw.gpu_adam_params_per_s <= 0)
    return w;
  const double per = static_cast<double>(shape.split_in_bytes) / bw.h2d_bps +
                     1.0 / bw.gpu_adam_params_per_s +
                     static_cast<double>(shape.split_out_bytes) / bw.d2h_bps;
  const double r_dev = 1.0 / per, r_cpu = static_cast<double>(elements) / adam_s;
  const double both = r_dev / (r_dev + r_cpu);  // both sides finish together
  // The device's share as UpdateSplit chooses it (zero/update_split.hpp): of the pieces final
  // during the backward (all but the last), only what the CPU cannot update within its window
  // (at most the share with which both finish together); the last piece, after it, shared so
  // that both finish together. The update's time is the same either way (the device helps
  // exactly where the CPU falls behind).
  const double e = static_cast<double>(elements), n = static_cast<double>(o.pieces);
  const double during = e * (n - 1) / n;
  const double excess = std::max(0.0, during - o.window_s * r_cpu);
  o.device_share = (std::min(excess, both * during) + both * e / n) / e;
  return w - adam_s + e / (r_dev + r_cpu);
}
}  // namespace

OverlapPrediction predict_overlap(const StepPrediction& step, double backward_s,
                                  const OverlapShape& shape, const Bandwidths& bw) {
  if (!(backward_s >= 0) || !std::isfinite(backward_s))
    fail(ErrorCode::kInvalidArgument,
         strcat("profile: backward time ", backward_s, " s: must be a finite number >= 0"));
  OverlapPrediction o;
  o.backward_s = backward_s;
  o.chunks = std::max<std::uint64_t>(step.sub_groups, 1);
  o.pieces = o.chunks;
  const std::uint64_t range = step.optimizer_elements;
  if (shape.bucket_elements > 0 && range > 0)
    o.pieces = std::clamp<std::uint64_t>((range - 1) / shape.bucket_elements + 1, 1, o.chunks);
  o.window_s = backward_s;
  if (shape.model_elements > range && range > 0)
    o.window_s =
        backward_s * static_cast<double>(range) / static_cast<double>(shape.model_elements);
  o.optimizer_s = step.pipelined_s;
  if (shape.stage < 2) {
    o.speculative_s = o.exposed_s = o.optimizer_s;
  } else {
    const double f = bw.cpu_adam_out_of_place_factor > 0 ? bw.cpu_adam_out_of_place_factor : 1.0;
    o.speculative_s = o.optimizer_s + (f - 1) * step.adam_memory_s;
    const double memory_elements = step.adam_memory_s * bw.memory_adam_rate();  // off_cpu
    o.speculative_s =
        split_update(o.speculative_s, f * step.adam_memory_s,
                     static_cast<std::uint64_t>(std::llround(memory_elements)), shape, bw, o);
    const double n = static_cast<double>(o.pieces), w = o.speculative_s, t = o.window_s;
    // ((j + 1) W - j T') / n is linear in j: its maximum over [0, n - 1] is at an end.
    o.exposed_s = std::max(std::max(w / n, (n * w - (n - 1) * t) / n), step.adam_gpu_s);
    // The parameters of the speculated chunks: those of state off the GPU.
    const double spec_share = step.optimizer_elements > 0
                                  ? static_cast<double>(step.offloaded_elements) /
                                        static_cast<double>(step.optimizer_elements)
                                  : 1.0;
    o.commit_s =
        seconds(spec_share * static_cast<double>(shape.param_commit_bytes), bw.host_copy_bps);
    o.exposed_s += o.commit_s;
  }
  o.backward_and_step_s = backward_s + o.exposed_s;
  o.serial_s = backward_s + o.optimizer_s;
  return o;
}

}  // namespace strata
