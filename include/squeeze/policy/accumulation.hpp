#pragma once
// Gradient accumulation: N micro-batches per optimizer step. The per-step batch stays the same and
// each micro-batch is 1/N of it, so activations shrink while the update is the one-big-batch update.
#include "squeeze/policy/family.hpp"

namespace squeeze {

template <int N>
struct Accumulate {
  static_assert(N >= 1, "Accumulate<N> needs N >= 1 micro-batches per step: write Accumulate<1> (or leave it out) for no accumulation");
  using family = accumulation_family;
  static constexpr int steps = N;
};

template <class P>
concept AccumulationPolicy = PolicyOf<P, accumulation_family> && requires {
  { P::steps } -> std::convertible_to<int>;
};
static_assert(AccumulationPolicy<Accumulate<4>>);

}  // namespace squeeze
