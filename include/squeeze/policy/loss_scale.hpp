#pragma once
// Loss scaling. The default follows Precision: DynamicLossScale for half compute, none otherwise.
// Spell it only to override (e.g. a fixed scale for fp16); bf16 and float never need it.
#include "squeeze/policy/family.hpp"

namespace squeeze {

struct DynamicLossScale {
  using family = loss_scale_family;
  static constexpr bool enabled = true;
  static constexpr bool dynamic = true;
};
template <int Log2Scale>
struct StaticLossScale {
  static_assert(Log2Scale >= 0 && Log2Scale <= 24,
                "StaticLossScale<K> scales the loss by 2^K with K in 0..24: write e.g. StaticLossScale<10>");
  using family = loss_scale_family;
  static constexpr bool enabled = true;
  static constexpr bool dynamic = false;
  static constexpr int log2_scale = Log2Scale;
};
struct NoLossScale {
  using family = loss_scale_family;
  static constexpr bool enabled = false;
  static constexpr bool dynamic = false;
};

template <class P>
concept LossScalePolicy = PolicyOf<P, loss_scale_family> && requires {
  { P::enabled } -> std::convertible_to<bool>;
};
static_assert(LossScalePolicy<DynamicLossScale>);

}  // namespace squeeze
