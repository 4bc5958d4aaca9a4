#pragma once
// The few example strategies the checkpoint and load benchmarks run, by the example's --strategy names (each one
// compiled here costs build time): run.template operator()<S>() for the one named.
#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>

#include <squeeze/policy.hpp>

namespace squeeze::bench {

inline constexpr const char* kBenchStrategies = "zero3-offload-bf16-ckpt, zero3-offload-bf16-ckpt-adam8, zero3-bf16-ckpt or bf16-ckpt";

template <class F>
nlohmann::json run_named_strategy(const std::string& name, F&& run) {
  if (name == "zero3-offload-bf16-ckpt") return run.template operator()<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed>>();
  if (name == "zero3-offload-bf16-ckpt-adam8")
    return run.template operator()<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed, Quantized<8, Blockwise8>>>();
  if (name == "zero3-bf16-ckpt") return run.template operator()<Strategy<Sharded<Stage3>, Precision<bf16, float>, Checkpointed>>();
  if (name == "bf16-ckpt") return run.template operator()<Strategy<Precision<bf16, float>, Checkpointed>>();
  throw std::runtime_error("--strategy: one of " + std::string(kBenchStrategies) + ", got '" + name + "'");
}

}  // namespace squeeze::bench
