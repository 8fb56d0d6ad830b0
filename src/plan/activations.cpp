// Activation memory per rank (Korthikanti et al., "Reducing Activation Recomputation in Large
// Transformer Models", 2022, eq. 1 without tensor parallelism).
#include "strata/plan.hpp"

namespace strata {

ActivationEstimate estimate_activations(const Config& c, std::uint64_t gpu_model_state) {
  ActivationEstimate a;
  if (!c.model.has_shape()) return a;
  a.available = true;
  const std::uint64_t s = c.model.sequence_length, b = c.model.micro_batch,
                      h = c.model.hidden_size, heads = c.model.heads, L = c.model.layers;
  // s*b*h*(34 + 5*a*s/h) = 34*s*b*h + 5*a*s^2*b, exact in integers.
  a.per_layer = 34 * s * b * h + 5 * heads * s * s * b;
  a.without_checkpointing = L * a.per_layer;
  a.with_checkpointing = L * 2 * s * b * h + a.per_layer;
  const std::uint64_t budget = c.tiers.gpu.budget;
  a.fits_without_checkpointing = gpu_model_state + a.without_checkpointing <= budget;
  a.fits_with_checkpointing = gpu_model_state + a.with_checkpointing <= budget;
  return a;
}

}  // namespace strata
