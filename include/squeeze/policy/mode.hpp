#pragma once
// Train (default) or Inference. Inference keeps no gradients or optimizer state: it is how a
// post-training-quantized model (Quantized<4, GPTQ, Group<128>>) is planned and run.
#include "squeeze/policy/family.hpp"

namespace squeeze {

struct Train {
  using family = mode_family;
  static constexpr bool training = true;
};
struct Inference {
  using family = mode_family;
  static constexpr bool training = false;
};

template <class P>
concept ModePolicy = PolicyOf<P, mode_family> && requires {
  { P::training } -> std::convertible_to<bool>;
};
static_assert(ModePolicy<Inference>);

}  // namespace squeeze
