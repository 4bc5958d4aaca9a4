#pragma once
// LoRA<Rank, Alpha>: trainable low-rank adapters W + (Alpha/Rank)·B·A on the attention projections
// (q and v by default, as in the QLoRA and LoRA papers); the base weights are frozen.
#include "squeeze/policy/family.hpp"

namespace squeeze {

// Which linear layers of a LLaMA block get adapters (bit mask).
enum class LoraTargets : unsigned { q = 1, k = 2, v = 4, o = 8, gate = 16, up = 32, down = 64 };
constexpr unsigned operator|(LoraTargets a, LoraTargets b) { return unsigned(a) | unsigned(b); }
constexpr unsigned operator|(unsigned a, LoraTargets b) { return a | unsigned(b); }
// Every linear layer of a block: the QLoRA paper's setting, which it needs to match full fine-tuning.
inline constexpr unsigned all_linears =
    LoraTargets::q | LoraTargets::k | LoraTargets::v | LoraTargets::o | LoraTargets::gate | LoraTargets::up | LoraTargets::down;

template <int Rank, int Alpha = 2 * Rank, unsigned Targets = LoraTargets::q | LoraTargets::v>
struct LoRA {
  static_assert(Rank >= 1, "LoRA<Rank, Alpha> needs Rank >= 1: write e.g. LoRA<8, 16> (rank 8, alpha 16)");
  static_assert(Alpha >= 1, "LoRA's Alpha must be positive: write e.g. LoRA<8, 16>");
  static_assert(Targets != 0 && Targets < 128, "LoRA needs at least one target projection: e.g. LoraTargets::q | LoraTargets::v");
  using family = lora_family;
  static constexpr int rank = Rank;
  static constexpr int alpha = Alpha;
  static constexpr unsigned targets = Targets;
  static constexpr float scaling = float(Alpha) / float(Rank);
};

template <class P>
concept LoraPolicy = PolicyOf<P, lora_family> && requires {
  { P::rank } -> std::convertible_to<int>;
};
static_assert(LoraPolicy<LoRA<8, 32>>);

}  // namespace squeeze
