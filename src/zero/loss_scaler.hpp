// LossScaler: the loss scale (precision.loss_scale) and the step counters that go with it. fp16
// gradients are scaled unless precision.loss_scale.enabled says otherwise; bf16 and fp32 are not
// (scale 1, as torch AMP and DeepSpeed). An overflow (inf/NaN anywhere, agreed by every rank)
// skips the step and backs a dynamic scale off; growth_interval applied steps in a row grow it.
//
// Thread-safety: one thread (the engine's).
#pragma once

#include <cstdint>

#include "strata/config.hpp"

namespace strata::zero {

struct ScalerState {  // what a checkpoint saves and restores
  double scale = 1;
  std::uint32_t good_steps = 0;
};

class LossScaler {
 public:
  explicit LossScaler(const PrecisionConfig& precision);

  double scale() const { return state_.scale; }
  bool scaling() const { return scaling_; }  // the loss is scaled (fp16, or enabled)
  // An overflow: the step is skipped; a dynamic scale backs off. Returns the new scale.
  double on_overflow();
  // An applied step: a dynamic scale grows after growth_interval of them in a row.
  void on_applied();

  ScalerState state() const { return state_; }
  void restore(const ScalerState& s) { state_ = s; }

 private:
  const LossScaleConfig cfg_;
  const bool scaling_;
  ScalerState state_;
};

}  // namespace strata::zero
