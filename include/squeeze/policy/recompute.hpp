#pragma once
// Activation checkpointing: keep only each segment's input and recompute the segment in backward.
// Checkpointed = every layer is a segment; CheckpointEvery<N> groups N layers per segment.
#include "squeeze/policy/family.hpp"

namespace squeeze {

template <int N>
struct CheckpointEvery {
  static_assert(N >= 1, "CheckpointEvery<N> needs N >= 1 layers per segment: write Checkpointed for every layer");
  using family = checkpoint_family;
  static constexpr int every = N;  // 0 would mean "off", which is the default (NoCheckpoint)
};
using Checkpointed = CheckpointEvery<1>;

struct NoCheckpoint {
  using family = checkpoint_family;
  static constexpr int every = 0;
};

template <class P>
concept CheckpointPolicy = PolicyOf<P, checkpoint_family> && requires {
  { P::every } -> std::convertible_to<int>;
};
static_assert(CheckpointPolicy<Checkpointed>);

}  // namespace squeeze
