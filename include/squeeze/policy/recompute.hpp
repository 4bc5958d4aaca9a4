#pragma once
// Activation checkpointing: keep only each segment's input and recompute the segment in backward.
// Checkpointed = every layer is a segment; CheckpointEvery<N> groups N layers per segment.
// CheckpointOffload<Host>: those inputs wait for backward in pinned host memory, copied out as the forward goes and
// brought back ahead of each segment's recomputation; CheckpointOffload<Host or Device, Int8> stores them in 8 bits
// (docs/architecture.md, "Offloaded checkpoints").
#include <type_traits>

#include "squeeze/policy/family.hpp"
#include "squeeze/policy/offload.hpp"

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

// How a checkpointed segment input is stored: as it is, or in 8 bits (blockwise absmax over 256 values, an fp32 scale
// each: the recomputation starts from values within absmax / 254 of the exact ones).
struct Exact {};
struct Int8 {};

template <class Where, class Format = Exact>
struct CheckpointOffload {
  static_assert(std::is_same_v<Where, Host> || std::is_same_v<Where, Device>,
                "CheckpointOffload takes a place: write CheckpointOffload<Host> (checkpointed inputs in host memory) or leave it out");
  static_assert(std::is_same_v<Format, Exact> || std::is_same_v<Format, Int8>,
                "CheckpointOffload's second argument is the stored format: write Exact (the default) or Int8");
  using family = checkpoint_offload_family;
  static constexpr bool to_host = std::is_same_v<Where, Host>;
  static constexpr int bits = std::is_same_v<Format, Int8> ? 8 : 0;  // 0: as computed
  static constexpr bool stores = to_host || bits != 0;               // anything but plain checkpointing
};

template <class P>
concept CheckpointPolicy = PolicyOf<P, checkpoint_family> && requires {
  { P::every } -> std::convertible_to<int>;
};
static_assert(CheckpointPolicy<Checkpointed>);

}  // namespace squeeze
