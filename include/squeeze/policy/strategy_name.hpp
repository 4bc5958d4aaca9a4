#pragma once
// strategy_name<S>(): a Strategy spelled as a user writes it, in one fixed order (the order of
// Strategy::canonical's policies), e.g. "Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>,
// Checkpointed>". Checkpoints record it; the strategy table prints it.
#include <string>
#include <type_traits>
#include <vector>

#include "strategy.hpp"

namespace squeeze {

template <StrategyType S>
std::string strategy_name() {
  std::vector<std::string> parts;
  if constexpr (S::stage > 0) parts.push_back("Sharded<Stage" + std::to_string(S::stage) + ">");
  if constexpr (S::offload_to_host) parts.push_back("Offload<Host>");
  if constexpr (S::quantized_weights) {
    using Q = typename S::weight_quantization;
    constexpr bool nf4 = std::is_same_v<typename Q::method, NF4>;
    std::string q = "Quantized<" + std::to_string(Q::bits) + ", " + (nf4 ? "NF4" : std::is_same_v<typename Q::method, GPTQ> ? "GPTQ" : "RTN");
    if constexpr (!nf4) q += Q::group > 0 ? ", Group<" + std::to_string(Q::group) + ">" : ", PerChannel";
    if constexpr (Q::double_quant) q += ", DoubleQuant";
    parts.push_back(q + ">");
  }
  if constexpr (S::has_lora) parts.push_back("LoRA<" + std::to_string(S::lora_rank) + ", " + std::to_string(S::lora::alpha) + ">");
  if constexpr (S::accumulation_steps > 1) parts.push_back("Accumulate<" + std::to_string(S::accumulation_steps) + ">");
  if constexpr (!std::is_same_v<typename S::compute_type, float>)
    parts.push_back(std::is_same_v<typename S::compute_type, bf16> ? "Precision<bf16, float>" : "Precision<half, float>");
  if constexpr (S::checkpoint_every == 1) parts.push_back("Checkpointed");
  else if constexpr (S::checkpoint_every > 1) parts.push_back("CheckpointEvery<" + std::to_string(S::checkpoint_every) + ">");
  if constexpr (S::state_bits == 8) parts.push_back("Quantized<8, Blockwise8>");
  std::string s = "Strategy<";
  for (size_t i = 0; i < parts.size(); ++i) s += (i ? ", " : "") + parts[i];
  return s + ">";
}

}  // namespace squeeze
