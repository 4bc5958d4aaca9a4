#pragma once
// The few example strategies the checkpoint and load benchmarks run, by the example's --strategy names (each one
// compiled here costs build time): run.template operator()<S>() for the one named.
#include <nlohmann/json.hpp>

#include <exception>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <utility>

#include <squeeze/policy.hpp>

namespace squeeze::bench {

inline constexpr const char* kBenchStrategies = "zero3-offload-bf16-ckpt, zero3-offload-bf16-ckpt-adam8, zero3-bf16-ckpt or bf16-ckpt";

template <class F>
nlohmann::json run_named_strategy(const std::string& name, F&& run) {
  if (name == "zero3-offload-bf16-ckpt") return run.template operator()<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed>>();
  if (name == "zero3-offload-bf16-ckpt-adam8")
    return run.template operator()<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed, QuantizedState<8>>>();
  if (name == "zero3-bf16-ckpt") return run.template operator()<Strategy<Sharded<Stage3>, Precision<bf16, float>, Checkpointed>>();
  if (name == "bf16-ckpt") return run.template operator()<Strategy<Precision<bf16, float>, Checkpointed>>();
  throw std::runtime_error("--strategy: one of " + std::string(kBenchStrategies) + ", got '" + name + "'");
}

// main()'s body after parsing: the named strategy's row appended to `out` as a JSON line and printed; an error
// is printed under the program's name and exits 1.
template <class F>
int append_named_strategy_row(const char* program, const std::string& name, const std::string& out, F&& run) {
  try {
    const nlohmann::json row = run_named_strategy(name, std::forward<F>(run));
    std::ofstream(out, std::ios::app) << row.dump() << "\n";
    std::cout << row.dump(1) << "\n";
  } catch (const std::exception& e) {
    std::cerr << program << ": " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace squeeze::bench
