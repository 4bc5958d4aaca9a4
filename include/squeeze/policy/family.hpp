#pragma once
// A policy is a small tag type that names its family (`using family = ...`) and carries constexpr
// traits. Each family has a concept that recognises its members; Strategy<Ps...> composes them.
#include <concepts>

namespace squeeze {

struct sharding_family {};
struct offload_family {};
struct accumulation_family {};
struct precision_family {};
struct weight_quantization_family {};
struct state_quantization_family {};
struct lora_family {};
struct checkpoint_family {};
struct checkpoint_offload_family {};
struct loss_scale_family {};
struct mode_family {};
struct graph_family {};

template <class P, class Family>
concept PolicyOf = requires {
  typename P::family;
}
&&std::same_as<typename P::family, Family>;

template <class P>
concept Policy = requires {
  typename P::family;
};

}  // namespace squeeze
