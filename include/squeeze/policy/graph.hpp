#pragma once
// CUDA graphs. Graphed: each micro-batch's forward and backward are captured once into a CUDA graph, after a few eager
// micro-batches, and replayed from then on: one launch instead of thousands where the kernels are many and small
// (short sequences, small batches). From the capture on, the inputs' shapes, the buffers they are copied into and every
// kernel's arguments stay fixed (docs/architecture.md, "CUDA graphs"). Eager, the default, launches every kernel.
#include "squeeze/policy/family.hpp"

namespace squeeze {

struct Eager {
  using family = graph_family;
  static constexpr bool graphed = false;
};
struct Graphed {
  using family = graph_family;
  static constexpr bool graphed = true;
};

template <class P>
concept GraphPolicy = PolicyOf<P, graph_family> && requires {
  { P::graphed } -> std::convertible_to<bool>;
};
static_assert(GraphPolicy<Graphed>);

}  // namespace squeeze
