// plan: what each training strategy costs in GPU and host memory, before you run it.
//   plan --preset llama-7b --world 8 --batch 8 --seq 2048 --format table|csv|json
// Every figure comes from squeeze::plan::plan_memory<Strategy>, the same constexpr function the
// trainer reports beside its measured bytes. Formulas: README.md, section "Memory model".
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include <squeeze/squeeze.hpp>

using namespace squeeze;
using plan::i64;

namespace {

struct Row {
  std::string name;
  std::string strategy;     // how to write it
  plan::MemoryPlan memory;
  std::optional<double> claimed_gb;  // the widely shared LLaMA-7B / B=8 / T=2048 / A100-80GB figure
};

// One row per strategy people compare. Accumulation rows keep the tokens per optimizer step: each
// micro-batch is batch / N sequences.
template <class S>
Row make_row(std::string name, std::string spelled, const plan::ModelShape& m, i64 batch, i64 seq, int world,
             std::optional<double> claim = std::nullopt) {
  const i64 micro = std::max<i64>(1, batch / S::accumulation_steps);
  return {std::move(name), std::move(spelled), plan::plan_memory<S>(m, {micro, seq}, world), claim};
}

std::vector<Row> strategy_rows(const plan::ModelShape& m, i64 batch, i64 seq, int world, bool claims) {
  auto c = [claims](double gb) { return claims ? std::optional<double>(gb) : std::nullopt; };
  using Fp16 = Precision<half, float>;
  return {
      make_row<Strategy<>>("fp32-baseline", "Strategy<>", m, batch, seq, world, c(72.3)),
      make_row<Strategy<Sharded<Stage3>>>("zero3", "Strategy<Sharded<Stage3>>", m, batch, seq, world, c(21.5)),
      make_row<Strategy<Sharded<Stage3>, Offload<Host>>>("zero3-offload", "Strategy<Sharded<Stage3>, Offload<Host>>", m, batch, seq, world),
      make_row<Strategy<Accumulate<4>>>("accumulate-4", "Strategy<Accumulate<4>>", m, batch, seq, world, c(18.9)),
      make_row<Strategy<Fp16>>("fp16-mixed", "Strategy<Precision<half, float>>", m, batch, seq, world, c(38.2)),
      make_row<Strategy<Sharded<Stage3>, Fp16>>("zero3-fp16", "Strategy<Sharded<Stage3>, Precision<half, float>>", m, batch, seq, world, c(16.1)),
      make_row<Strategy<Sharded<Stage3>, Fp16, Accumulate<4>>>("zero3-fp16-accumulate-4",
          "Strategy<Sharded<Stage3>, Precision<half, float>, Accumulate<4>>", m, batch, seq, world),
      make_row<Strategy<Checkpointed>>("checkpointed", "Strategy<Checkpointed>", m, batch, seq, world),
      make_row<Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>>>("qlora-nf4-r8",
          "Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>>", m, batch, seq, world),
      make_row<Strategy<Quantized<4, GPTQ, Group<128>>, Inference, Precision<half, half>>>("gptq-4bit-inference",
          "Strategy<Quantized<4, GPTQ, Group<128>>, Inference, Precision<half, half>>", m, batch, seq, world),
  };
}

double gb(i64 bytes) { return double(bytes) / 1e9; }

nlohmann::json to_json(const Row& r) {
  const auto& p = r.memory;
  auto place = [](plan::Placement x) { return nlohmann::json{{"device", x.device}, {"host", x.host}}; };
  nlohmann::json j{{"strategy", r.name},
                   {"spelled", r.strategy},
                   {"parameters", place(p.parameters)},
                   {"gradients", place(p.gradients)},
                   {"master_weights", place(p.master_weights)},
                   {"optimizer_state", place(p.optimizer_state)},
                   {"activations", place(p.activations)},
                   {"communication", place(p.communication)},
                   {"model_state", place(p.model_state())},
                   {"total", place(p.total())},
                   {"total_params", p.total_params},
                   {"trainable_params", p.trainable_params}};
  if (r.claimed_gb) j["claimed_gb"] = *r.claimed_gb;
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"squeeze plan: memory per GPU and per host for each training strategy"};
  std::string preset = "llama-7b", format = "table";
  plan::ModelShape shape;
  i64 batch = 8, seq = 2048;
  int world = 1;
  bool check_zero3 = false;
  app.add_option("--preset", preset, "model geometry: llama-7b (default), llama-13b, llama3-8b, llama-70b, llama-175b, tinyllama-1.1b");
  app.add_option("--vocab", shape.vocab, "custom shape: vocabulary size")->check(CLI::PositiveNumber);
  app.add_option("--hidden", shape.hidden, "custom shape: hidden size")->check(CLI::PositiveNumber);
  app.add_option("--layers", shape.layers, "custom shape: transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--heads", shape.heads, "custom shape: attention heads")->check(CLI::PositiveNumber);
  app.add_option("--kv-heads", shape.kv_heads, "custom shape: key/value heads (GQA)")->check(CLI::PositiveNumber);
  app.add_option("--ffn", shape.ffn, "custom shape: SwiGLU inner size")->check(CLI::PositiveNumber);
  app.add_option("--world", world, "data-parallel ranks (GPUs)")->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "sequences per optimizer step per rank")->check(CLI::PositiveNumber);
  app.add_option("--seq", seq, "tokens per sequence")->check(CLI::PositiveNumber);
  app.add_option("--format", format, "table, csv or json")->check(CLI::IsMember({"table", "csv", "json"}));
  app.add_flag("--check-zero3", check_zero3, "exit non-zero unless the ZeRO-3 fp16 row's model state is 16Ψ/N");
  CLI11_PARSE(app, argc, argv);

  const bool custom = app.count("--vocab") + app.count("--hidden") + app.count("--layers") + app.count("--heads") +
                          app.count("--kv-heads") + app.count("--ffn") > 0;
  if (custom && app.count("--preset") > 0) {
    fmt::print(stderr, "plan: give either --preset or an explicit shape (--vocab --hidden --layers --heads --kv-heads --ffn), not both\n");
    return 2;
  }
  if (custom) {
    preset = "custom";
  } else {
    const auto found = plan::find_preset(preset);
    if (!found) {
      std::string names;
      for (const auto& p : plan::presets) names += std::string(names.empty() ? "" : ", ") + std::string(p.name);
      fmt::print(stderr, "plan: unknown preset '{}'; choose one of {} (or give --hidden/--layers/... for a custom shape)\n",
                 preset, names);
      return 2;
    }
    shape = *found;
  }
  if (shape.hidden % shape.heads != 0 || shape.heads % shape.kv_heads != 0) {
    fmt::print(stderr, "plan: hidden ({}) must be a multiple of heads ({}), and heads of kv-heads ({})\n", shape.hidden,
               shape.heads, shape.kv_heads);
    return 2;
  }

  const bool claims = preset == "llama-7b" && batch == 8 && seq == 2048;  // the claims name no world size
  const auto rows = strategy_rows(shape, batch, seq, world, claims);

  if (format == "json") {
    nlohmann::json out{{"preset", preset},   {"world", world},        {"batch", batch},
                       {"seq", seq},         {"params", shape.params()}, {"rows", nlohmann::json::array()}};
    for (const auto& r : rows) out["rows"].push_back(to_json(r));
    fmt::print("{}\n", out.dump(2));
  } else if (format == "csv") {
    fmt::print("strategy,parameters,gradients,master_weights,optimizer_state,activations,communication,model_state,"
               "device_total,host_total,claimed_gb\n");
    for (const auto& r : rows) {
      const auto& p = r.memory;
      fmt::print("{},{},{},{},{},{},{},{},{},{},{}\n", r.name, p.parameters.device, p.gradients.device,
                 p.master_weights.device, p.optimizer_state.device, p.activations.device, p.communication.device,
                 p.model_state().device, p.total().device, p.total().host,
                 r.claimed_gb ? fmt::format("{}", *r.claimed_gb) : "");
    }
  } else {
    fmt::print("{}: {:.3f} B parameters, world {}, batch {} x seq {} per rank (GB = 1e9 bytes, per GPU unless 'host')\n\n",
               preset, shape.params() / 1e9, world, batch, seq);
    fmt::print("{:<24} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>9} {:>8} {:>8}\n", "strategy", "params", "grads", "master",
               "optim", "activ", "comm", "GPU", "host", "claimed");
    for (const auto& r : rows) {
      const auto& p = r.memory;
      fmt::print("{:<24} {:>8.2f} {:>8.2f} {:>8.2f} {:>8.2f} {:>8.2f} {:>7.2f} {:>9.2f} {:>8.2f} {:>8}\n", r.name,
                 gb(p.parameters.device), gb(p.gradients.device), gb(p.master_weights.device),
                 gb(p.optimizer_state.device), gb(p.activations.device), gb(p.communication.device),
                 gb(p.total().device), gb(p.total().host), r.claimed_gb ? fmt::format("{:.1f}", *r.claimed_gb) : "");
    }
    if (claims) {
      fmt::print("\n'claimed': a widely shared benchmark's figures for LLaMA-7B, B=8, T=2048 on an 80 GB A100. They cannot\n"
                 "all be right: fp32 Adam model state alone for {:.2f} B parameters is 16 B x Ψ = {:.1f} GB, more than the\n"
                 "GPU holds, so a 72.3 GB fp32 baseline is impossible, and ZeRO-3 shards nothing on one GPU. See README.md.\n",
                 shape.params() / 1e9, gb(16 * shape.params()));
    }
  }

  if (check_zero3) {
    const auto& z3 = rows[5].memory;  // zero3-fp16
    const i64 expected = 16 * plan::ceil_div(shape.params(), world);
    if (z3.model_state().device != expected) {
      fmt::print(stderr, "ZeRO-3 fp16 model state {} != 16Ψ/N = {}\n", z3.model_state().device, expected);
      return 1;
    }
  }
  return 0;
}
