// make_plan(): the whole plan for a Config.
#include "strata/plan.hpp"

#include <algorithm>

#include "core/checked_math.hpp"
#include "plan/plan_internal.hpp"
#include "strata/units.hpp"

namespace strata {

namespace {

// optimizer.overlap where rank 0's range (the first elements, handed in last: the step waits for
// it) lies in one bucket: it becomes final at the last hand-in, nothing is hidden (the engine
// warns too).
void note_overlap_in_one_bucket(const Config& c, Plan& p) {
  if (c.optimizer.overlap == OptimizerOverlap::kOff || c.zero.stage < 2 || c.model.parameters == 0)
    return;
  const std::uint64_t part = partition_elements(c);
  if (part > std::max<std::uint64_t>(c.zero.reduce_bucket_size, 1)) return;
  p.notes.push_back(std::string("optimizer.overlap: ") +
                    optimizer_overlap_name(c.optimizer.overlap) + ": rank 0's " +
                    format_count(part) + " elements lie in one zero.reduce_bucket_size bucket (" +
                    format_count(c.zero.reduce_bucket_size) +
                    "): its gradients become final all at once at the last hand-in, and "
                    "nothing is updated during the backward; a bucket a fraction of them "
                    "lets the update start earlier");
}

// The host budget as the config has it: set, or the 512 GiB default.
HostBudget configured_host_budget(const Config& c) {
  const std::uint64_t hb = c.tiers.host.budget;
  if (c.tiers.host.budget_set)
    return {HostBudget::Source::kConfig, hb, format_bytes(hb) + " (tiers.host.budget)"};
  return {HostBudget::Source::kDefault, hb,
          "the default " + format_bytes(hb) +
              " (tiers.host.budget not set; the machine's memory was not consulted)"};
}

}  // namespace

const char* host_budget_source_name(HostBudget::Source s) {
  switch (s) {
    case HostBudget::Source::kConfig: return "config";
    case HostBudget::Source::kMachine: return "machine";
    case HostBudget::Source::kDefault: break;
  }
  return "default";
}

Plan make_plan(const Config& c, const MachineMemory& machine) {
  if (c.tiers.host.budget_set) return make_plan(c);
  if (!machine.known) {
    Plan p = make_plan(c);
    p.host_budget.text = "the default " + format_bytes(c.tiers.host.budget) +
                         " (tiers.host.budget not set, and the machine's memory could not be "
                         "read: " +
                         machine.source + ")";
    return p;
  }
  Config resolved = c;
  resolved.tiers.host.budget = machine.total;
  Plan p = make_plan(resolved);
  p.host_budget = {HostBudget::Source::kMachine, machine.total,
                   "the machine's " + format_bytes(machine.total, true) + " (" +
                       format_bytes(machine.total) + "; " + machine.source +
                       "; tiers.host.budget not set)"};
  return p;
}

Plan make_plan(const Config& c) {
  Plan p;
  p.host_budget = configured_host_budget(c);
  p.parameters = c.model.parameters;
  p.ranks = std::max<std::uint32_t>(c.world.ranks, 1);
  p.ranks_per_node = std::min(c.ranks_per_node(), p.ranks);
  p.nodes = c.nodes();
  p.bytes_per_param = bytes_per_param(c.precision);
  for (int s = 0; s <= 3; ++s) p.stages[s] = stage_footprint(c, s);
  p.configured = plan_layout(c, c.zero.stage, c.offload);
  p.configured_rung = evaluate_rung(c, c.zero.stage, c.offload);
  p.activations = estimate_activations(c, p.configured.per_rank.gpu);
  p.recommendation = recommend(c);

  const RuntimeBuffers& rt = p.configured.runtime;
  p.assumptions = {
      "per rank, what the engine's storage holds: model state (parameters, gradients, FP32 master "
      "+ Adam moments), the pinned staging pool (host) and the engine's runtime buffers (gpu: "
      "gradient buckets and receive buffers, stage-3 gathered layers, norm exchange, collective "
      "staging), each by the engine's own formula (docs/config.md)",
      "activations are not in the tier figures (estimated separately when model.layers, "
      "hidden_size, heads, sequence_length and micro_batch are given) but are in the gpu verdict",
      "not included: the CUDA context, NCCL's own buffers, allocator overhead and fragmentation",
      "gradients are handed in tensor by tensor in backward order (the bucket count assumes it); "
      "stage 3 gathers one layer (model.largest_layer) per gather() call and releases it before "
      "the call after next",
      "host budgets (tiers.host.budget, pinned_budget) and tiers.nvme.budget are per node; "
      "tiers.gpu.budget is per rank (one GPU per rank)",
      "sharded state is ceil(parameters / ranks) elements per rank",
      "network bytes are the ZeRO paper's per-rank volume; a ring collective sends (N-1)/N of it",
  };

  const auto& a = p.activations;
  const auto& gpu = p.configured.verdicts.front();
  if (a.available && gpu.fits() && !a.fits_without_checkpointing) {
    std::string note = "activations, not model state, are what does not fit on the gpu: " +
                       format_bytes(gpu.used) + " model state and runtime buffers + " +
                       format_bytes(a.without_checkpointing) + " activations > budget " +
                       format_bytes(gpu.budget) + "; ";
    if (a.fits_with_checkpointing)
      note += "activation checkpointing (" + format_bytes(a.with_checkpointing) +
              ") makes it fit; a higher ZeRO stage does not shrink activations";
    else
      note +=
          "even with activation checkpointing (" + format_bytes(a.with_checkpointing) +
          ") this layout does not fit: " +
          (p.recommendation.found ? "a layout that keeps less on the gpu makes room for them (the "
                                    "recommendation: " +
                                        p.recommendation.layout.describe() + ")"
                                  : std::string("no rung of the ladder makes room for them")) +
          ", or reduce model.micro_batch or the sequence length";
    p.notes.push_back(note);
  }
  if (!p.configured_fits())
    p.notes.push_back("the configured layout (" + p.configured.describe() +
                      ") does not fit: " + p.configured_rung.verdict + "; see the recommendation");
  if (c.zero.stage == 3 && rt.layer == 0)
    p.notes.push_back(
        "stage 3 gathers whole layers on the gpu, but neither model.largest_layer "
        "nor model.hidden_size is given: the gathered layers are not counted");
  else if (c.zero.stage == 3 && rt.layer_estimated)
    p.notes.push_back(
        "stage 3: the gathered layer is estimated from model.hidden_size as one "
        "transformer block (12h^2 + 13h = " +
        format_count(rt.layer) +
        " parameters); give model.largest_layer if a larger layer (an embedding) is "
        "gathered whole");
  if (rt.bucket_count > 0 && rt.buckets + rt.receive > p.configured.on_gpu.total() / 4)
    p.notes.push_back("the gradient buckets and their receive buffers take " +
                      format_bytes(rt.buckets + rt.receive) + " of gpu memory per rank (" +
                      std::to_string(rt.bucket_count) + " + " + std::to_string(rt.receive_count) +
                      " buffers of zero.reduce_bucket_size elements); a smaller "
                      "zero.reduce_bucket_size shrinks them");
  note_overlap_in_one_bucket(c, p);
  return p;
}

}  // namespace strata
