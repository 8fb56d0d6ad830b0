// make_plan(): the whole plan for a Config.
#include "core/checked_math.hpp"
#include "strata/plan.hpp"

#include <algorithm>

#include "strata/units.hpp"

namespace strata {

Plan make_plan(const Config& c) {
  Plan p;
  p.parameters = c.model.parameters;
  p.ranks = std::max<std::uint32_t>(c.world.ranks, 1);
  p.ranks_per_node = std::min(c.ranks_per_node(), p.ranks);
  p.nodes = c.nodes();
  p.bytes_per_param = bytes_per_param(c.precision);
  for (int s = 0; s <= 3; ++s) p.stages[s] = stage_footprint(c, s);
  p.configured = plan_layout(c, c.zero.stage, c.offload);
  p.configured_rung = evaluate_rung(c, c.zero.stage, c.offload);
  p.activations = estimate_activations(c, sat_add(p.configured.per_rank.gpu, p.configured_rung.gathered));
  p.recommendation = recommend(c);

  p.assumptions = {
      "model state only: parameters, gradients and optimizer state (FP32 master + Adam moments)",
      "activations are not in the tier figures (estimated separately when model.layers, "
      "hidden_size, heads, sequence_length and micro_batch are given)",
      "not included: allocator overhead and fragmentation, communication buckets, CUDA context "
      "and other runtime buffers; temporarily gathered stage-3 parameters only when "
      "model.largest_layer is given",
      "host budgets (tiers.host.budget, pinned_budget) and tiers.nvme.budget are per node; "
      "tiers.gpu.budget is per rank (one GPU per rank)",
      "sharded state is ceil(parameters / ranks) elements per rank",
      "network bytes are the ZeRO paper's per-rank volume; a ring collective sends (N-1)/N of it",
  };

  const auto& a = p.activations;
  const auto& gpu = p.configured.verdicts.front();
  if (a.available && gpu.fits() && !a.fits_without_checkpointing) {
    std::string note = "activations, not model state, are what does not fit on the gpu: " +
                       format_bytes(gpu.used) + " model state + " +
                       format_bytes(a.without_checkpointing) + " activations > budget " +
                       format_bytes(gpu.budget) + "; ";
    if (a.fits_with_checkpointing)
      note += "activation checkpointing (" + format_bytes(a.with_checkpointing) +
              ") makes it fit; a higher ZeRO stage does not shrink activations";
    else
      note += "even with activation checkpointing (" + format_bytes(a.with_checkpointing) +
              ") it does not fit: reduce model.micro_batch or the sequence length; a higher "
              "ZeRO stage does not shrink activations";
    p.notes.push_back(note);
  }
  if (!p.configured_fits())
    p.notes.push_back("the configured layout (" + p.configured.describe() +
                      ") does not fit: " + p.configured_rung.verdict + "; see the recommendation");
  if (c.zero.stage == 3 && c.model.largest_layer > 0)
    p.notes.push_back("stage 3 gathers whole layers on the gpu: " +
                      format_bytes(p.configured_rung.gathered) +
                      " (model.largest_layer x param bytes) at the peak, counted in the verdict "
                      "and the ladder, not in the model-state tables");
  return p;
}

}  // namespace strata
