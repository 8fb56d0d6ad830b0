// The planner: what a configuration puts in each tier, what crosses each link per optimizer step,
// and whether it fits the tier budgets. A pure function of a Config (no I/O, no devices).
//
// Model state only: activations are estimated separately (when the model shape is given);
// temporarily gathered stage-3 parameters, allocator overhead and runtime buffers are not
// counted (Plan::assumptions says so in words). Formulas: docs/config.md "The plan".
//
// Thread-safety: make_plan() is reentrant; Plan is a plain value.
// Failure: make_plan() expects a validated Config (load_config/parse_config); it does not throw
// for any Config those accept.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "strata/config.hpp"

namespace strata {

// Bytes of model state per parameter, from the dtypes. The optimizer state is an FP32 master copy
// (4 B, omitted when precision.params is fp32: the parameters are then the master) plus Adam's two
// FP32 moments (2 x 4 B). fp16/fp16: 2 + 2 + 12 = 16; bf16/fp32: 2 + 4 + 12 = 18; fp32/fp32:
// 4 + 4 + 8 = 16.
struct BytesPerParam {
  std::uint64_t params = 0;
  std::uint64_t grads = 0;
  std::uint64_t master = 0;
  std::uint64_t moments = 0;
  std::uint64_t optimizer() const { return master + moments; }
  std::uint64_t total() const { return params + grads + optimizer(); }
};
BytesPerParam bytes_per_param(const PrecisionConfig& precision);

// Bytes of each kind of model state (per rank unless said otherwise).
struct StateBytes {
  std::uint64_t params = 0;
  std::uint64_t grads = 0;
  std::uint64_t optimizer = 0;
  std::uint64_t total() const { return params + grads + optimizer; }
};

// Bytes in each tier. Host memory is split into page-locked (pinned) and pageable.
struct TierBytes {
  std::uint64_t gpu = 0;
  std::uint64_t pinned_host = 0;
  std::uint64_t pageable_host = 0;
  std::uint64_t nvme = 0;
  std::uint64_t host() const { return pinned_host + pageable_host; }
  std::uint64_t total() const { return gpu + host() + nvme; }
  TierBytes& operator+=(const TierBytes& o);
};

// One ZeRO stage's per-rank model state, nothing offloaded. Elements per rank: the sharded kinds
// hold ceil(parameters / ranks) elements (stage >= 1: optimizer, >= 2: gradients, 3: params).
struct StageFootprint {
  int stage = 0;
  std::uint64_t param_elements = 0;
  std::uint64_t grad_elements = 0;
  std::uint64_t optimizer_elements = 0;
  StateBytes bytes;
};
StageFootprint stage_footprint(const Config& config, int stage);

// Bytes crossing each link per optimizer step, for one rank.
struct LinkTraffic {
  std::uint64_t nvme_read = 0;
  std::uint64_t nvme_write = 0;
  std::uint64_t host_to_device = 0;
  std::uint64_t device_to_host = 0;
  std::uint64_t network = 0;  // sent by one rank in the collectives (ZeRO paper volume)
};

// One tier's use against its budget.
struct TierVerdict {
  std::string tier;   // "gpu" | "host" | "pinned_host" | "nvme"
  std::string scope;  // "rank" (gpu) or "node" (host, pinned_host, nvme)
  std::uint64_t used = 0;
  std::uint64_t budget = 0;  // 0 with limited == false: no budget (nvme without tiers.nvme.budget)
  bool limited = true;
  bool fits() const { return !limited || used <= budget; }
  std::uint64_t overflow() const { return fits() ? 0 : used - budget; }
};

// A stage + offload choice worked out in full.
struct Layout {
  int stage = 0;
  OffloadConfig offload;
  StageFootprint footprint;
  StateBytes on_gpu, on_host, on_nvme;  // per rank, by kind of state
  std::uint64_t swap_pool = 0;          // pinned swap buffers per rank (only when nvme is used)
  TierBytes per_rank;                   // state + swap pool
  TierBytes per_node;                   // per_rank x ranks on the fullest node
  LinkTraffic traffic;                  // per rank per optimizer step
  std::vector<TierVerdict> verdicts;    // gpu, host, pinned_host, nvme
  bool fits() const;
  std::string describe() const;  // "stage 2, optimizer on cpu"
};
Layout plan_layout(const Config& config, int stage, const OffloadConfig& offload);

// Activation memory per rank, Korthikanti et al. 2022 (16-bit activations, no tensor or sequence
// parallelism): per layer s*b*h*(34 + 5*a*s/h) bytes. With full checkpointing only each layer's
// input (2*s*b*h bytes) is kept, plus one layer's full activations during recomputation.
struct ActivationEstimate {
  bool available = false;  // model shape given
  std::uint64_t per_layer = 0;
  std::uint64_t without_checkpointing = 0;
  std::uint64_t with_checkpointing = 0;
  bool fits_without_checkpointing = false;  // with the configured layout's gpu model state
  bool fits_with_checkpointing = false;
};
ActivationEstimate estimate_activations(const Config& config, std::uint64_t gpu_model_state);

// One rung of the recommendation ladder: a stage + offload choice, its model state (the Layout)
// and what the GPU must also hold: activations (when the model shape is given; with full
// activation checkpointing when that is what it takes to fit) and, at stage 3, the largest
// layer's gathered parameters (model.largest_layer x param bytes, when given).
struct Rung {
  Layout layout;
  std::uint64_t activations = 0;      // per rank, as counted (0 without a model shape)
  bool checkpointing = false;         // activations counted with full checkpointing
  std::uint64_t gathered = 0;         // stage 3: largest layer's parameters on the gpu
  std::uint64_t gpu_total = 0;        // layout.per_rank.gpu + activations + gathered
  bool fits = false;                  // every budget, the gpu one with gpu_total
  std::string verdict;                // "fits" or which budget overflows, by how much
};

// The ladder, in order (docs/config.md "Recommendation"): lowest stage first, then least offload;
// every rung that keeps all state off NVMe comes before any rung that uses NVMe:
//   stage 0; stage 1; stage 2, + optimizer on cpu, + gradients on cpu; stage 3, + optimizer on
//   cpu, + gradients on cpu, + params on cpu; then stage 2 optimizer on nvme (+ gradients on cpu);
//   stage 3 optimizer on nvme (+ gradients on cpu, + params on cpu); stage 3 everything on nvme.
// Stage 1 with offload is not a rung: stage 2 with the same offload moves the same bytes and needs
// less GPU memory. Fractions are 1 and host memory pageable on every rung.
std::vector<std::pair<int, OffloadConfig>> ladder_rungs();
Rung evaluate_rung(const Config& config, int stage, const OffloadConfig& offload);

struct Recommendation {
  bool found = false;
  Layout layout;              // valid when found
  bool checkpointing = false;  // the recommended rung needs full activation checkpointing
  std::string reason;          // why this one (or why nothing fits)
  std::vector<Rung> ladder;    // every rung, in ladder order, with its verdict
};
// The one recommender (`strata plan` and `strata profile`): the first rung of the ladder that
// fits. Pure; never throws for a validated Config.
Recommendation recommend(const Config& config);

struct Plan {
  std::uint64_t parameters = 0;
  std::uint32_t ranks = 1;
  std::uint32_t ranks_per_node = 1;  // ranks on the fullest node
  std::uint32_t nodes = 1;
  BytesPerParam bytes_per_param;
  std::array<StageFootprint, 4> stages;  // stages 0-3 side by side, nothing offloaded
  Layout configured;                     // the configured stage and offload
  ActivationEstimate activations;
  // The configured layout fits: model state within every budget and, when the model shape is
  // given, model state + activations on the gpu (with checkpointing if needed); stage 3 adds the
  // largest layer's gathered parameters when model.largest_layer is given. `strata plan --check`
  // exits 3 when false.
  Rung configured_rung;
  bool configured_fits() const { return configured_rung.fits; }
  Recommendation recommendation;
  std::vector<std::string> assumptions;
  std::vector<std::string> notes;  // e.g. activations, not model state, do not fit
};
Plan make_plan(const Config& config);

}  // namespace strata
