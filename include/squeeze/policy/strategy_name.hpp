#pragma once
// strategy_name<S>(): a Strategy spelled as a user writes it, every policy that is not its family's default, in the
// order of Strategy::canonical's policies, e.g. "Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>,
// Checkpointed>". Two strategies with different canonical forms get different names. Checkpoints record it; the
// strategy table prints it.
#include <string>
#include <type_traits>
#include <vector>

#include "squeeze/policy/strategy.hpp"

namespace squeeze {

namespace detail {

template <class T>
constexpr const char* element_name() {
  if constexpr (std::is_same_v<T, float>)
    return "float";
  else if constexpr (std::is_same_v<T, bf16>)
    return "bf16";
  else
    return "half";
}

inline std::string lora_targets_name(unsigned targets) {
  if (targets == all_linears) return "all_linears";
  static constexpr const char* names[] = {"q", "k", "v", "o", "gate", "up", "down"};
  std::string s;
  for (unsigned i = 0; i < 7; ++i)
    if (targets & (1u << i)) s += (s.empty() ? "LoraTargets::" : " | LoraTargets::") + std::string(names[i]);
  return s;
}

// One policy as written, or "" where it is its family's default under strategy S.
template <class S, class P>
std::string policy_name() {
  using F = typename P::family;
  if constexpr (std::is_same_v<F, sharding_family>) {
    return P::stage > 0 ? "Sharded<Stage" + std::to_string(P::stage) + ">" : "";
  } else if constexpr (std::is_same_v<F, offload_family>) {
    return P::params_on_host ? "Offload<Host, Streamed>" : P::to_host ? "Offload<Host>" : "";
  } else if constexpr (std::is_same_v<F, accumulation_family>) {
    return P::steps > 1 ? "Accumulate<" + std::to_string(P::steps) + ">" : "";
  } else if constexpr (std::is_same_v<F, precision_family>) {
    using C = typename P::compute_type;
    using M = typename P::master_type;
    if constexpr (std::is_same_v<C, float> && std::is_same_v<M, float>)
      return "";
    else
      return std::string("Precision<") + (P::fp8_gemms ? "fp8, " : "") + element_name<C>() + ", " + element_name<M>() + ">";
  } else if constexpr (std::is_same_v<F, weight_quantization_family> || std::is_same_v<F, state_quantization_family>) {
    if constexpr (P::bits == 0 || std::is_same_v<P, NoStateQuantization>) {
      return "";
    } else if constexpr (std::is_same_v<F, state_quantization_family>) {
      std::string q = "QuantizedState<" + std::to_string(P::bits);
      if constexpr (P::group != P::default_group) q += ", Blockwise8, Group<" + std::to_string(P::group) + ">";
      return q + ">";
    } else {
      using Me = typename P::method;
      std::string q = "Quantized<" + std::to_string(P::bits) + ", ";
      q += std::is_same_v<Me, NF4> ? "NF4" : std::is_same_v<Me, GPTQ> ? "GPTQ" : "RTN";
      if constexpr (P::group != P::default_group) q += P::group > 0 ? ", Group<" + std::to_string(P::group) + ">" : ", PerChannel";
      if constexpr (P::double_quant) q += ", DoubleQuant";
      if constexpr (P::act_order) q += ", ActOrder";
      return q + ">";
    }
  } else if constexpr (std::is_same_v<F, lora_family>) {
    if constexpr (P::rank == 0) {
      return "";
    } else {
      std::string l = "LoRA<" + std::to_string(P::rank) + ", " + std::to_string(P::alpha);
      if constexpr (P::targets != (LoraTargets::q | LoraTargets::v)) l += ", " + lora_targets_name(P::targets);
      return l + ">";
    }
  } else if constexpr (std::is_same_v<F, checkpoint_family>) {
    return P::every == 0 ? "" : P::every == 1 ? "Checkpointed" : "CheckpointEvery<" + std::to_string(P::every) + ">";
  } else if constexpr (std::is_same_v<F, checkpoint_offload_family>) {
    if constexpr (!P::stores)
      return "";
    else
      return std::string(P::to_host ? "CheckpointOffload<Host" : "CheckpointOffload<Device") + (P::bits == 8 ? ", Int8>" : ">");
  } else if constexpr (std::is_same_v<F, mode_family>) {
    return P::training ? "" : "Inference";
  } else if constexpr (std::is_same_v<F, graph_family>) {
    return P::graphed ? "Graphed" : "";
  } else {
    static_assert(std::is_same_v<F, loss_scale_family>, "strategy_name: a policy family without a name: add it here");
    using Default = std::conditional_t<S::precision::needs_loss_scaling, DynamicLossScale, NoLossScale>;
    if constexpr (std::is_same_v<P, Default>)
      return "";
    else if constexpr (!P::enabled)
      return "NoLossScale";
    else if constexpr (P::dynamic)
      return "DynamicLossScale";
    else
      return "StaticLossScale<" + std::to_string(P::log2_scale) + ">";
  }
}

template <class S, class... Ps>
std::vector<std::string> policy_names(Strategy<Ps...>*) {
  return {policy_name<S, Ps>()...};
}

}  // namespace detail

template <StrategyType S>
std::string strategy_name() {
  std::string s = "Strategy<";
  bool first = true;
  for (const std::string& p : detail::policy_names<S>(static_cast<typename S::canonical*>(nullptr))) {
    if (p.empty()) continue;
    s += (first ? "" : ", ") + p;
    first = false;
  }
  return s + ">";
}

}  // namespace squeeze
