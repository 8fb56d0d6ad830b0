// The loss scale (see loss_scaler.hpp).
#include "zero/loss_scaler.hpp"

#include <algorithm>

namespace strata::zero {

LossScaler::LossScaler(const PrecisionConfig& precision)
    : cfg_(precision.loss_scale), scaling_(precision.loss_scaling()) {
  state_.scale = scaling_ ? cfg_.initial : 1.0;
}

double LossScaler::on_overflow() {
  state_.good_steps = 0;
  if (scaling_ && cfg_.dynamic)
    state_.scale = std::max(cfg_.min_scale, state_.scale * cfg_.backoff_factor);
  return state_.scale;
}

void LossScaler::on_applied() {
  if (scaling_ && cfg_.dynamic && ++state_.good_steps >= cfg_.growth_interval) {
    state_.scale *= cfg_.growth_factor;
    state_.good_steps = 0;
  }
}

}  // namespace strata::zero
