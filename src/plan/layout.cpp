// Per-rank model state of a stage, its placement in tiers, link traffic and budget verdicts.
#include <algorithm>
#include <cmath>

#include "core/checked_math.hpp"
#include "strata/plan.hpp"

namespace strata {

BytesPerParam bytes_per_param(const PrecisionConfig& p) {
  BytesPerParam b;
  b.params = dtype_size(p.params);
  b.grads = dtype_size(p.accum_dtype());  // held in precision.grad_accum (handed in as grads)
  b.master = 4;       // the engine's FP32 master copy, kept whatever precision.params is
  b.moments = 2 * 4;  // Adam/AdamW: exp_avg + exp_avg_sq in fp32
  return b;
}

std::uint64_t TierBytes::host() const { return sat_add(pinned_host, pageable_host); }
std::uint64_t TierBytes::total() const { return sat_add(gpu, host(), nvme); }

TierBytes& TierBytes::operator+=(const TierBytes& o) {
  gpu += o.gpu;
  pinned_host += o.pinned_host;
  pageable_host += o.pageable_host;
  nvme += o.nvme;
  return *this;
}

StageFootprint stage_footprint(const Config& c, int stage) {
  const std::uint64_t psi = c.model.parameters;
  const std::uint64_t n = std::max<std::uint32_t>(c.world.ranks, 1);
  const std::uint64_t shard = (psi + n - 1) / n;
  const BytesPerParam b = bytes_per_param(c.precision);
  StageFootprint f;
  f.stage = stage;
  f.optimizer_elements = stage >= 1 ? shard : psi;
  f.grad_elements = stage >= 2 ? shard : psi;
  f.param_elements = stage >= 3 ? shard : psi;
  f.bytes.params = f.param_elements * b.params;
  f.bytes.grads = f.grad_elements * b.grads;
  f.bytes.optimizer = f.optimizer_elements * b.optimizer();
  return f;
}

namespace {

std::uint64_t share(std::uint64_t elements, const OffloadTarget& t) {
  if (t.tier == Tier::kGpu) return 0;
  const double f = std::clamp(t.fraction, 0.0, 1.0);
  return std::min<std::uint64_t>(
      elements, static_cast<std::uint64_t>(std::llround(static_cast<double>(elements) * f)));
}

std::string target_text(const char* what, const OffloadTarget& t) {
  std::string s = std::string(what) + " on " + tier_name(t.tier);
  if (t.fraction < 1.0) {
    char buf[32];
    std::snprintf(buf, sizeof buf, " (%g%%)", t.fraction * 100.0);
    s += buf;
  }
  return s;
}

// The swap space RankStorage reserves beside the state for asynchronous checkpoints' pinned
// versions: tiers.nvme.snapshot_room of the optimizer state on nvme (4 KiB-aligned), within what
// the rank's share of tiers.nvme.budget leaves.
std::uint64_t snapshot_room(const Config& c, const Layout& l) {
  if (l.per_rank.nvme == 0 || l.on_nvme.optimizer == 0) return 0;
  const double want = static_cast<double>(l.on_nvme.optimizer) * c.tiers.nvme.snapshot_room;
  std::uint64_t room = (static_cast<std::uint64_t>(want) + 4095) / 4096 * 4096;
  const std::uint64_t budget = c.tiers.nvme.budget / std::max<std::uint32_t>(1, c.ranks_per_node());
  if (budget > 0) room = std::min(room, budget > l.per_rank.nvme ? budget - l.per_rank.nvme : 0);
  return room;
}

// The pending versions the speculative update may hold per rank (zero/speculator.cpp): stages
// 2-3, host-updated state, no gradients on nvme; each tier at most optimizer.speculation_budget.
TierBytes speculation_room(const Config& c, const Layout& l, std::uint64_t params_bytes) {
  TierBytes t;
  if (c.optimizer.overlap == OptimizerOverlap::kOff || l.stage < 2 ||
      c.optimizer.update == OptimizerUpdate::kDevice || l.on_nvme.grads > 0)
    return t;
  const std::uint64_t opt_off = l.on_host.optimizer + l.on_nvme.optimizer;
  if (opt_off == 0) return t;
  // Host pending copies are page-locked as the state they shadow (kept as spares between steps).
  (c.offload.optimizer.pin_memory ? t.pinned_host : t.pageable_host) = l.on_host.optimizer;
  t.nvme = l.on_nvme.optimizer;
  if (l.stage < 3) {
    t.gpu = params_bytes;  // the flat parameters' pending version
  } else {
    // The parameters of the speculated chunks, in the parameters' tier.
    const BytesPerParam b = bytes_per_param(c.precision);
    const std::uint64_t p = opt_off / b.optimizer() * b.params;
    const Tier pt = l.offload.params.fraction > 0 ? l.offload.params.tier : Tier::kGpu;
    (pt == Tier::kGpu ? t.gpu : pt == Tier::kCpu ? t.pageable_host : t.nvme) += p;
  }
  if (const std::uint64_t b = c.optimizer.speculation_budget; b > 0)
    for (std::uint64_t* v : {&t.gpu, &t.pinned_host, &t.pageable_host, &t.nvme})
      *v = std::min(*v, b);
  return t;
}

}  // namespace

bool Layout::fits() const {
  return std::all_of(verdicts.begin(), verdicts.end(),
                     [](const TierVerdict& v) { return v.fits(); });
}

std::string Layout::describe() const {
  std::string s = "stage " + std::to_string(stage);
  std::vector<std::string> parts;
  auto off = [](const OffloadTarget& t) { return t.tier != Tier::kGpu && t.fraction > 0; };
  if (off(offload.optimizer)) parts.push_back(target_text("optimizer", offload.optimizer));
  if (off(offload.gradients)) parts.push_back(target_text("gradients", offload.gradients));
  if (off(offload.params)) parts.push_back(target_text("params", offload.params));
  if (parts.empty()) return s + ", no offload";
  for (const auto& p : parts) s += ", " + p;
  return s;
}

namespace {

// Traffic per rank per optimizer step (docs/config.md, "Bytes per step"), given the elements of
// each kind that leave the gpu.
LinkTraffic plan_traffic(const Config& c, int stage, const OffloadConfig& offload,
                         std::uint64_t opt_off, std::uint64_t grad_off, std::uint64_t param_off) {
  const BytesPerParam b = bytes_per_param(c.precision);
  const std::uint64_t opt_nvme = offload.optimizer.tier == Tier::kNvme ? opt_off : 0;
  const std::uint64_t grad_nvme = offload.gradients.tier == Tier::kNvme ? grad_off : 0;
  const std::uint64_t param_nvme = offload.params.tier == Tier::kNvme ? param_off : 0;
  LinkTraffic t;
  // Offloaded gradients are read twice by the step: the norm/overflow pass and the update.
  t.nvme_read = opt_nvme * b.optimizer() + 2 * grad_nvme * b.grads + 2 * param_nvme * b.params;
  t.nvme_write = opt_nvme * b.optimizer() + grad_nvme * b.grads + param_nvme * b.params;
  // Gradients leave the gpu for the off-gpu optimizer share or their own offload; updated
  // parameters come back for the off-gpu optimizer share; offloaded stage-3 parameters are
  // fetched for the forward and the backward pass.
  // Stages 2-3 reduce and copy out in precision.grads (converted to grad_accum on arrival);
  // stages 0-1 all-reduce / reduce-scatter the flat gradients in grad_accum.
  const std::uint64_t wire = stage >= 2 ? dtype_size(c.precision.grads) : b.grads;
  t.device_to_host = std::max(opt_off, grad_off) * wire +
                     (param_off > opt_off ? (param_off - opt_off) * b.params : 0);
  t.host_to_device =
      2 * param_off * b.params + (opt_off > param_off ? (opt_off - param_off) * b.params : 0);
  const std::uint64_t psi = c.model.parameters;
  if (c.world.ranks > 1) {
    if (stage == 0)
      t.network = 2 * psi * wire;  // all-reduce of gradients
    else if (stage < 3)
      t.network = psi * wire + psi * b.params;  // reduce-scatter + all-gather
    else
      t.network = psi * wire + 2 * psi * b.params;  // + forward/backward gathers
  }
  return t;
}

}  // namespace

bool master_in_params(const Config& c, int stage, const OffloadTarget& o, DeviceKind device) {
  if (stage > 2 || c.precision.params != DType::kFp32 || device != DeviceKind::kHost) return false;
  // Stage 2: not where the speculative update may run (it writes the state's pending versions and
  // commits them by swapping the buffers): the state's share off the gpu never is.
  return stage < 2 || c.optimizer.overlap == OptimizerOverlap::kOff ||
         c.optimizer.update == OptimizerUpdate::kDevice || o.tier == Tier::kGpu || o.fraction <= 0;
}

bool hand_in_to_chunks(const Config& c, int stage, int ranks, bool grads_on_nvme,
                       DeviceKind device) {
  return stage >= 2 && ranks == 1 && !grads_on_nvme && device == DeviceKind::kHost &&
         c.optimizer.overlap == OptimizerOverlap::kOff;
}

Layout plan_layout(const Config& c, int stage, const OffloadConfig& offload) {
  const BytesPerParam b = bytes_per_param(c.precision);
  Layout l;
  l.stage = stage;
  l.offload = offload;
  l.footprint = stage_footprint(c, stage);
  const StageFootprint& f = l.footprint;

  // Elements of each kind that leave the gpu.
  const std::uint64_t opt_off = share(f.optimizer_elements, offload.optimizer);
  const std::uint64_t grad_off = share(f.grad_elements, offload.gradients);
  const std::uint64_t param_off = share(f.param_elements, offload.params);

  // moved_bpe: bytes per element of the share off the gpu (gpu_bpe: of the rest). The optimizer
  // state's master weights are the parameters in memory (the moments alone) where
  // master_in_params says so.
  auto place = [&](std::uint64_t elements, std::uint64_t off, std::uint64_t gpu_bpe,
                   const OffloadTarget& t, std::uint64_t StateBytes::*kind,
                   std::uint64_t moved_bpe) {
    l.on_gpu.*kind = (elements - off) * gpu_bpe;
    const std::uint64_t moved = off * moved_bpe;
    if (t.tier == Tier::kCpu) {
      l.on_host.*kind = moved;
      (t.pin_memory ? l.per_rank.pinned_host : l.per_rank.pageable_host) += moved;
    } else if (t.tier == Tier::kNvme) {
      l.on_nvme.*kind = moved;
      l.per_rank.nvme += moved;
    }
    l.per_rank.gpu += (elements - off) * gpu_bpe;
  };
  place(f.param_elements, param_off, b.params, offload.params, &StateBytes::params, b.params);
  place(f.grad_elements, grad_off, b.grads, offload.gradients, &StateBytes::grads, b.grads);
  const bool alias = master_in_params(c, stage, offload.optimizer, c.runtime.device);
  const bool alias_off = alias && offload.optimizer.tier == Tier::kCpu;
  l.master_in_params = alias && (opt_off < f.optimizer_elements || (alias_off && opt_off > 0));
  place(f.optimizer_elements, opt_off, alias ? b.moments : b.optimizer(), offload.optimizer,
        &StateBytes::optimizer, alias_off ? b.moments : b.optimizer());

  // What the engine holds besides the model state (runtime.cpp): the pinned staging pool in host
  // memory, the runtime buffers in device memory.
  l.pool = plan_pool(c, stage, offload);
  l.per_rank.pinned_host = sat_add(l.per_rank.pinned_host, l.pool.bytes());
  l.runtime = runtime_buffers(c, stage, offload);
  l.per_rank.gpu = sat_add(l.per_rank.gpu, l.runtime.total());
  l.snapshot_room = snapshot_room(c, l);
  l.per_rank.nvme = sat_add(l.per_rank.nvme, l.snapshot_room);
  l.speculation = speculation_room(c, l, f.param_elements * b.params);
  l.per_rank += l.speculation;

  const std::uint32_t rpn = std::min(c.ranks_per_node(), std::max<std::uint32_t>(c.world.ranks, 1));
  l.per_node.gpu = sat_mul(l.per_rank.gpu, rpn);
  l.per_node.pinned_host = sat_mul(l.per_rank.pinned_host, rpn);
  l.per_node.pageable_host = sat_mul(l.per_rank.pageable_host, rpn);
  l.per_node.nvme = sat_mul(l.per_rank.nvme, rpn);

  l.traffic = plan_traffic(c, stage, offload, opt_off, grad_off, param_off);

  l.verdicts.push_back({"gpu", "rank", l.per_rank.gpu, c.tiers.gpu.budget, true});
  l.verdicts.push_back({"host", "node", l.per_node.host(), c.tiers.host.budget, true});
  l.verdicts.push_back(
      {"pinned_host", "node", l.per_node.pinned_host, c.tiers.host.pinned_budget, true});
  l.verdicts.push_back(
      {"nvme", "node", l.per_node.nvme, c.tiers.nvme.budget, c.tiers.nvme.budget > 0});
  return l;
}

}  // namespace strata
