#pragma once
// Quantized<Bits, Method, Options...>: frozen weights in Bits bits: GPTQ (Hessian-based, bits 2/3/4/8), RTN (round to
//   nearest, 2/3/4/8), NF4 (4-bit normal-float codebook, optional DoubleQuant of its block scales).
// QuantizedState<8>: optimizer state, Blockwise8 (8-bit blockwise-quantized Adam moments; weights stay trainable).
// Options: Group<G> (values per scale; GPTQ/RTN default per output channel, NF4 default 64,
// Blockwise8 default 256, the block of kernels/adamw8.hpp), PerChannel, DoubleQuant (NF4 only), ActOrder (GPTQ only).
#include <type_traits>

#include "squeeze/policy/family.hpp"

namespace squeeze {

struct GPTQ {
  static constexpr bool frozen_weights = true;
};
struct RTN {
  static constexpr bool frozen_weights = true;
};
struct NF4 {
  static constexpr bool frozen_weights = true;
};
struct Blockwise8 {
  static constexpr bool frozen_weights = false;
};

template <class M>
concept QuantMethod = std::is_same_v<M, GPTQ> || std::is_same_v<M, RTN> || std::is_same_v<M, NF4> || std::is_same_v<M, Blockwise8>;

template <int G>
struct Group {
  static_assert(
      G > 0 && (G & (G - 1)) == 0,
      "Group<G> needs a power-of-two group size such as Group<64> or Group<128>; write PerChannel for one scale per output channel");
  static constexpr int size = G;
};
struct PerChannel {
  static constexpr int size = 0;
};
struct DoubleQuant {};
struct ActOrder {};

namespace detail {
template <class T>
inline constexpr bool is_group_v = false;
template <int G>
inline constexpr bool is_group_v<Group<G>> = true;
template <>
inline constexpr bool is_group_v<PerChannel> = true;
template <class T>
inline constexpr bool is_quant_option_v = is_group_v<T> || std::is_same_v<T, DoubleQuant> || std::is_same_v<T, ActOrder>;

template <class... Os>
constexpr int group_of() {  // the Group<G>/PerChannel option's size, or -1 for the method's default
  int size = -1;
  (
      [&] {
        if constexpr (is_group_v<Os>) size = Os::size;
      }(),
      ...);
  return size;
}
}  // namespace detail

namespace detail {
// What Quantized and QuantizedState share: the checks of the spelling and the traits.
template <int Bits, QuantMethod Method, class... Options>
struct QuantizedPolicy {
  static_assert(((sizeof(Options) > 0) && ... && true), "");  // completes Group<G> so its own checks run
  static_assert((detail::is_quant_option_v<Options> && ...),
                "Quantized's options are Group<G>, PerChannel, DoubleQuant and ActOrder: e.g. Quantized<4, GPTQ, Group<128>, ActOrder>");
  static_assert((int(detail::is_group_v<Options>) + ... + 0) <= 1, "give Quantized one group size: Group<G> or PerChannel, not both");
  static_assert(!std::is_same_v<Method, GPTQ> || Bits == 2 || Bits == 3 || Bits == 4 || Bits == 8,
                "GPTQ quantizes to 2, 3, 4 or 8 bits: write e.g. Quantized<4, GPTQ, Group<128>>");
  static_assert(!std::is_same_v<Method, RTN> || Bits == 2 || Bits == 3 || Bits == 4 || Bits == 8,
                "RTN quantizes to 2, 3, 4 or 8 bits: write e.g. Quantized<4, RTN, Group<128>>");
  static_assert(!std::is_same_v<Method, NF4> || Bits == 4,
                "NF4 is a 4-bit code: write Quantized<4, NF4> (or Quantized<4, NF4, DoubleQuant>)");
  static_assert(!std::is_same_v<Method, Blockwise8> || Bits == 8, "Blockwise8 stores optimizer state in 8 bits: write QuantizedState<8>");
  static_assert(std::is_same_v<Method, NF4> || !(std::is_same_v<Options, DoubleQuant> || ...),
                "DoubleQuant quantizes NF4's block scales; other methods have none: drop it, or write Quantized<4, NF4, DoubleQuant>");
  static_assert(std::is_same_v<Method, GPTQ> || !(std::is_same_v<Options, ActOrder> || ...),
                "ActOrder orders GPTQ's columns by Hessian diagonal; it means nothing for other methods: drop it, or use GPTQ");
  static_assert(!std::is_same_v<Method, NF4> || !(std::is_same_v<Options, PerChannel> || ...),
                "NF4 scales blocks of consecutive weights: write Group<64> (the default) instead of PerChannel");

  using family = std::conditional_t<std::is_same_v<Method, Blockwise8>, state_quantization_family, weight_quantization_family>;
  using method = Method;
  static constexpr int bits = Bits;
  static constexpr int default_group = std::is_same_v<Method, NF4> ? 64 : std::is_same_v<Method, Blockwise8> ? 256 : 0;
  // Values per scale; 0 means one scale per output channel.
  static constexpr int group = detail::group_of<Options...>() >= 0 ? detail::group_of<Options...>() : default_group;
  static constexpr bool double_quant = (std::is_same_v<Options, DoubleQuant> || ...);
  static constexpr bool act_order = (std::is_same_v<Options, ActOrder> || ...);
  static constexpr bool frozen_weights = Method::frozen_weights;
};
// Quantized<8, Blockwise8> spells optimizer state with the weights' policy; it still works, with a warning.
template <class M>
constexpr bool weights_spelling(M*) {
  return true;
}
[[deprecated("Quantized<8, Blockwise8> quantizes optimizer state, not weights: write QuantizedState<8>")]] constexpr bool weights_spelling(
    Blockwise8*) {
  return true;
}
}  // namespace detail

// Frozen weights stored in Bits bits (GPTQ, RTN, NF4).
template <int Bits, QuantMethod Method, class... Options>
struct Quantized : detail::QuantizedPolicy<Bits, Method, Options...> {
  static_assert(detail::weights_spelling(static_cast<Method*>(nullptr)));
};

// Adam's moments stored in Bits bits (Blockwise8: uint8 codes with one fp32 absmax per block of 256); the weights
// stay trainable. Named apart from Quantized, which quantizes and freezes weights.
template <int Bits, QuantMethod Method = Blockwise8, class... Options>
struct QuantizedState : detail::QuantizedPolicy<Bits, Method, Options...> {
  static_assert(
      std::is_same_v<Method, Blockwise8>,
      "QuantizedState<8> stores optimizer moments (Blockwise8); weights are quantized by Quantized<4, NF4>, Quantized<4, GPTQ>, ...");
};

template <class P>
concept WeightQuantizationPolicy = PolicyOf<P, weight_quantization_family> && requires {
  typename P::method;
  { P::bits } -> std::convertible_to<int>;
};
template <class P>
concept StateQuantizationPolicy = PolicyOf<P, state_quantization_family> && requires {
  { P::bits } -> std::convertible_to<int>;
};
static_assert(WeightQuantizationPolicy<Quantized<4, GPTQ, Group<128>>>);
static_assert(StateQuantizationPolicy<QuantizedState<8>>);

}  // namespace squeeze
