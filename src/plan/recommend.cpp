// The one recommender: "the lowest stage, then the least offload, that fits", walked over the
// ladder documented in plan.hpp and docs/config.md, counting the engine's runtime buffers (stage-3
// gathers among them), its pinned pool and the activations.
#include <algorithm>

#include "core/checked_math.hpp"
#include "strata/plan.hpp"
#include "strata/units.hpp"

namespace strata {
namespace {

OffloadTarget on(Tier t) { return OffloadTarget{t, 1.0, false}; }

OffloadConfig offload_of(Tier optimizer, Tier gradients, Tier params) {
  OffloadConfig o;
  if (optimizer != Tier::kGpu) o.optimizer = on(optimizer);
  if (gradients != Tier::kGpu) o.gradients = on(gradients);
  if (params != Tier::kGpu) o.params = on(params);
  return o;
}

bool uses_nvme(const OffloadConfig& o) {
  auto nv = [](const OffloadTarget& t) { return t.tier == Tier::kNvme && t.fraction > 0; };
  return nv(o.optimizer) || nv(o.gradients) || nv(o.params);
}

// "gpu needs 71.50 GB model state + 67.11 MB runtime buffers + 22.98 GB activations (with
// checkpointing) = 94.55 GB per rank > budget 80 GB (over by 14.55 GB)".
std::string gpu_text(const Rung& r, std::uint64_t budget) {
  const std::uint64_t state = r.layout.on_gpu.total(), runtime = r.layout.runtime.total();
  std::string s = "gpu needs " + format_bytes(state) + " model state";
  if (runtime) s += " + " + format_bytes(runtime) + " runtime buffers";
  if (r.activations)
    s += " + " + format_bytes(r.activations) + " activations" +
         (r.checkpointing ? " (with checkpointing)" : "");
  if (runtime || r.activations) s += " = " + format_bytes(r.gpu_total);
  s += " per rank";
  if (!fits_budget(r.gpu_total, budget))
    s += " > budget " + format_bytes(budget) +
         (r.gpu_total == kSaturated ? std::string(" (beyond 2^64 bytes)")
                                    : " (over by " + format_bytes(r.gpu_total - budget) + ")");
  return s;
}

}  // namespace

std::vector<std::pair<int, OffloadConfig>> ladder_rungs() {
  constexpr Tier G = Tier::kGpu, C = Tier::kCpu, N = Tier::kNvme;
  return {
      {0, offload_of(G, G, G)}, {1, offload_of(G, G, G)}, {2, offload_of(G, G, G)},
      {2, offload_of(C, G, G)}, {2, offload_of(C, C, G)}, {3, offload_of(G, G, G)},
      {3, offload_of(C, G, G)}, {3, offload_of(C, C, G)}, {3, offload_of(C, C, C)},
      {2, offload_of(N, G, G)}, {2, offload_of(N, C, G)}, {3, offload_of(N, G, G)},
      {3, offload_of(N, C, G)}, {3, offload_of(N, C, C)}, {3, offload_of(N, N, N)},
  };
}

Rung evaluate_rung(const Config& c, int stage, const OffloadConfig& offload) {
  Rung r;
  r.layout = plan_layout(c, stage, offload);
  const std::uint64_t held = r.layout.per_rank.gpu;  // model state + runtime buffers
  const ActivationEstimate a = estimate_activations(c, held);
  if (a.available) {
    r.checkpointing = !a.fits_without_checkpointing;
    r.activations = r.checkpointing ? a.with_checkpointing : a.without_checkpointing;
  }
  r.gpu_total = sat_add(held, r.activations);  // saturated: never fits
  const std::uint64_t gpu_budget = c.tiers.gpu.budget;
  std::string over;
  if (!fits_budget(r.gpu_total, gpu_budget)) over = gpu_text(r, gpu_budget);
  for (const auto& v : r.layout.verdicts) {
    if (v.tier == "gpu" || v.fits()) continue;
    if (!over.empty()) over += "; ";
    over += v.tier + " needs " + format_bytes(v.used) + " per " + v.scope + " > budget " +
            format_bytes(v.budget) + " (over by " + format_bytes(v.overflow()) + ")";
  }
  r.fits = over.empty();
  if (r.fits) {
    r.verdict = "fits";
    if (r.checkpointing) r.verdict += " with activation checkpointing";
    if (uses_nvme(offload) && c.tiers.nvme.paths.empty()) r.verdict += " (needs tiers.nvme.paths)";
  } else {
    r.verdict = over;
  }
  return r;
}

Recommendation recommend(const Config& c) {
  Recommendation rec;
  for (const auto& [stage, offload] : ladder_rungs())
    rec.ladder.push_back(evaluate_rung(c, stage, offload));
  const auto it =
      std::find_if(rec.ladder.begin(), rec.ladder.end(), [](const Rung& r) { return r.fits; });
  if (it == rec.ladder.end()) {
    const Rung& last = rec.ladder.back();
    rec.reason =
        "nothing fits: even " + last.layout.describe() + " overflows: " + last.verdict +
        "; add ranks, raise the budgets" +
        (last.layout.runtime.buckets + last.layout.runtime.receive > 0
             ? ", shrink zero.reduce_bucket_size (gradient buckets and receive buffers: " +
                   format_bytes(last.layout.runtime.buckets + last.layout.runtime.receive) +
                   " per rank)"
             : "") +
        (c.model.has_shape() ? ", or shrink model.micro_batch / sequence_length" : "");
    return rec;
  }
  rec.found = true;
  rec.layout = it->layout;
  rec.checkpointing = it->checkpointing;
  rec.reason = it->layout.describe() +
               (it->checkpointing ? " with activation checkpointing" : std::string()) +
               " is the first rung of the ladder (lowest stage, then least offload; every rung "
               "off NVMe before any on NVMe) whose " +
               (c.model.has_shape() ? "model state, runtime buffers and activations fit"
                                    : "model state and runtime buffers fit") +
               " every budget";
  if (!c.model.has_shape())
    rec.reason +=
        " (activations not counted: give model.layers, hidden_size, heads, "
        "sequence_length and micro_batch)";
  if (it != rec.ladder.begin()) {
    rec.reason += "; rejected before it:";
    for (auto r = rec.ladder.begin(); r != it; ++r)
      rec.reason += " [" + r->layout.describe() + ": " + r->verdict + "]";
  }
  if (uses_nvme(it->layout.offload) && c.tiers.nvme.paths.empty())
    rec.reason += "; it needs tiers.nvme.paths";
  return rec;
}

}  // namespace strata
