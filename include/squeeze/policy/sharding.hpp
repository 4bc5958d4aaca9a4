#pragma once
// ZeRO stages: what each data-parallel rank keeps a 1/N shard of.
//   Stage0: nothing (plain data parallel)   Stage1: optimizer state + fp32 master weights
//   Stage2: + gradients                      Stage3: + parameters (gathered per layer, then freed)
#include "squeeze/policy/family.hpp"

namespace squeeze {

template <int N>
struct Stage {
  static_assert(N >= 0 && N <= 3, "ZeRO has stages 0..3: write Sharded<Stage0>, Sharded<Stage1>, Sharded<Stage2> or Sharded<Stage3>");
  static constexpr int value = N;
};
using Stage0 = Stage<0>;
using Stage1 = Stage<1>;
using Stage2 = Stage<2>;
using Stage3 = Stage<3>;

template <class T>
inline constexpr bool is_stage_v = false;
template <int N>
inline constexpr bool is_stage_v<Stage<N>> = true;

template <class S>
struct Sharded {
  static_assert(is_stage_v<S>, "Sharded takes a stage tag: write Sharded<Stage1>, Sharded<Stage2> or Sharded<Stage3> (not a number)");
  using family = sharding_family;
  static constexpr int stage = S::value;
};

template <class P>
concept ShardingPolicy = PolicyOf<P, sharding_family> && requires {
  { P::stage } -> std::convertible_to<int>;
};
static_assert(ShardingPolicy<Sharded<Stage3>>);

}  // namespace squeeze
