#pragma once
// Mixed precision: forward/backward in Compute, optimizer update on Master weights.
// Precision<half, float> needs dynamic loss scaling (fp16 underflows small gradients);
// bf16 has float's exponent range and needs none.
#include "squeeze/dtype.hpp"
#include "squeeze/policy/family.hpp"

namespace squeeze {

template <class Compute, class Master = float>
struct Precision {
  static_assert(FloatingElement<Compute>,
                "Precision's compute type must be float, squeeze::half or squeeze::bf16: write e.g. Precision<bf16, float>");
  static_assert(FloatingElement<Master>,
                "Precision's master type must be float, squeeze::half or squeeze::bf16: write e.g. Precision<half, float>");
  static_assert(sizeof(Master) >= sizeof(Compute),
                "master weights must be at least as precise as the compute copy: write Precision<half, float> or Precision<bf16, float>");
  static_assert(!(std::is_same_v<Compute, half> && std::is_same_v<Master, bf16>)&&!(std::is_same_v<Compute, bf16> &&
                                                                                    std::is_same_v<Master, half>),
                "half and bf16 do not hold each other's values: keep master weights in float, e.g. Precision<half, float>");
  using family = precision_family;
  using compute_type = Compute;
  using master_type = Master;
  // A separate master copy exists only when it differs from the compute copy.
  static constexpr bool has_master_copy = !std::is_same_v<Compute, Master>;
  static constexpr bool needs_loss_scaling = std::is_same_v<Compute, half>;
};

template <class P>
concept PrecisionPolicy = PolicyOf<P, precision_family> && requires {
  typename P::compute_type;
  typename P::master_type;
};
static_assert(PrecisionPolicy<Precision<bf16, float>>);

}  // namespace squeeze
