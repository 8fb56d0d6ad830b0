// Activation memory per rank (Korthikanti et al., "Reducing Activation Recomputation in Large
// Transformer Models", 2022, eq. 1 without tensor parallelism).
#include "core/checked_math.hpp"
#include "strata/plan.hpp"

namespace strata {

ActivationEstimate estimate_activations(const Config& c, std::uint64_t gpu_bytes) {
  ActivationEstimate a;
  if (!c.model.has_shape()) return a;
  a.available = true;
  const std::uint64_t s = c.model.sequence_length, b = c.model.micro_batch, h = c.model.hidden_size,
                      heads = c.model.heads, L = c.model.layers;
  // s*b*h*(34 + 5*a*s/h) = 34*s*b*h + 5*a*s^2*b, exact in integers; a figure beyond 2^64 bytes
  // saturates (core/checked_math.hpp) and never fits.
  a.per_layer = sat_add(sat_mul(34, s, b, h), sat_mul(5, heads, s, s, b));
  a.without_checkpointing = sat_mul(L, a.per_layer);
  a.with_checkpointing = sat_add(sat_mul(L, 2, s, b, h), a.per_layer);
  const std::uint64_t budget = c.tiers.gpu.budget;
  a.fits_without_checkpointing = fits_budget(sat_add(gpu_bytes, a.without_checkpointing), budget);
  a.fits_with_checkpointing = fits_budget(sat_add(gpu_bytes, a.with_checkpointing), budget);
  return a;
}

}  // namespace strata
