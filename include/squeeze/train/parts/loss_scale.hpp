#pragma once
// The loss scale part of a trainer (docs/architecture.md): none, a static power of two (Static<k>), or the dynamic
// scaler (kernels/loss_scale.hpp), chosen by the Strategy's loss_scale policy.
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "squeeze/policy/strategy.hpp"
#include "squeeze/kernels/loss_scale.hpp"

namespace squeeze::train {

template <StrategyType S>
class LossScale {
 public:
  explicit LossScale(const kernels::LossScaleOptions& o) : scaler_(o) {
    if constexpr (S::loss_scaling && !S::dynamic_loss_scaling) static_scale_ = std::ldexp(1.0f, S::loss_scale::log2_scale);
  }
  float scale() const {
    if constexpr (S::dynamic_loss_scaling)
      return scaler_.scale();
    else
      return static_scale_;
  }
  // An overflow on some rank: the step is skipped and a dynamic scale backs off.
  void overflowed() {
    if constexpr (S::dynamic_loss_scaling) {
      *scaler_.found_inf() = 1.0f;
      scaler_.update();
    }
  }
  // A clean step: a dynamic scale counts it towards growing.
  void applied() {
    if constexpr (S::dynamic_loss_scaling) scaler_.update();
  }
  // Resuming: the saved dynamic scale and its clean steps since the last change (ignored for a static or no scale).
  void restore(float scale, int64_t good_steps) {
    TORCH_CHECK(good_steps >= 0 && good_steps <= std::numeric_limits<std::int32_t>::max(),
                "Trainer::restore_counters: good_steps out of range: ", good_steps);
    if constexpr (S::dynamic_loss_scaling) {
      try {
        scaler_.restore(scale, std::int32_t(good_steps));
      } catch (const squeeze::Error& e) {
        TORCH_CHECK(false, "Trainer::restore_counters: ", e.what());
      }
    }
  }
  const kernels::LossScaler& scaler() const { return scaler_; }

 private:
  kernels::LossScaler scaler_;
  float static_scale_ = 1.0f;
};

}  // namespace squeeze::train
