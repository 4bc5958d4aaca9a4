// The strategy table: LLaMA training steps at TinyLlama-1.1B geometry (B=8, T=2048 by default) under each
// strategy compiled into the LLaMA example, beside a plain-libtorch peer (the same model, float weights,
// bf16 autocast, torch AdamW) measured in the same run. Per row: peak device memory (CUDA caching-allocator
// statistics, from construction to the last step), time per optimizer step, tokens/s, and the planner's
// prediction. A row that runs out of memory is recorded as such and the table goes on.
//
//   bench_table --out table.jsonl [--preset tinyllama-1.1b] [--batch 8] [--seq 2048] [--rows fp32,bf16,...]
//
// JSON lines: bench "table", case, time_ms, peer, ratio_vs_peer (tokens/s over the peer's: > 1 is faster),
// mem_ratio_vs_peer (peer's peak over ours: > 1 is smaller), peak_gb, planned_gb, plan_error, tokens_per_s,
// iters_per_s, final_loss, oom / error, device, date, commit (SQUEEZE_DEVICE / SQUEEZE_DATE / SQUEEZE_COMMIT).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "trainer.hpp"

using namespace squeeze;
using squeeze::llama::Trainer;
using json = nlohmann::json;

namespace {

constexpr const char* kPeer = "libtorch-autocast-bf16";

struct Options {
  std::string out, preset = "tinyllama-1.1b", device = "cuda", rows;
  int64_t batch = 8, seq = 2048, steps = 2, warmup = 1, layers = 0;
  double lr = 3e-4;
};

struct Row {
  std::string name;
  std::optional<double> time_ms, peak_gb, reserved_gb, planned_gb, final_loss;
  bool oom = false;
  std::string error;
};

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

void synchronize(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

void release_cached_memory(const torch::Device& d) {
#if defined(SQUEEZE_TORCH_CUDA)
  if (d.is_cuda()) {
    llama::cuda_allocator_ready(d);
    c10::cuda::CUDACachingAllocator::emptyCache();
  }
#endif
  (void)d;
}

// Runs warmup + timed steps of `step(x, y) -> loss` on fixed random batches; fills time, peak and loss.
template <class Step>
void time_steps(const Options& o, const nn::LlamaConfig& config, const torch::Device& device, Row& row, Step&& step) {
  auto gen = at::detail::createCPUGenerator(4242);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int64_t i = 0; i < o.warmup + o.steps; ++i) {
    const torch::Tensor w = torch::randint(0, config.vocab, {o.batch, o.seq + 1}, gen, torch::kLong).to(device);  // [B, T+1]
    batches.emplace_back(w.narrow(1, 0, o.seq), w.narrow(1, 1, o.seq));
  }
  double loss = 0;
  for (int64_t i = 0; i < o.warmup; ++i) loss = step(batches[i].first, batches[i].second);
  synchronize(device);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = o.warmup; i < o.warmup + o.steps; ++i) loss = step(batches[i].first, batches[i].second);
  synchronize(device);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  row.time_ms = 1e3 * s / double(o.steps);
  row.final_loss = loss;
  const auto m = llama::memory_use(device);
  row.peak_gb = m.peak_gb;
  row.reserved_gb = m.reserved_peak_gb;
}

// Catches what a row can throw: out of memory is a result, anything else an error; both keep the table going.
template <class F>
void guarded(Row& row, const torch::Device& device, F&& f) {
  try {
    f();
  } catch (const c10::OutOfMemoryError& e) {
    row.oom = true;
    row.error = "out of memory";
  } catch (const c10::Error& e) {
    row.error = e.what_without_backtrace();
    row.oom = row.error.find("out of memory") != std::string::npos;  // rethrown across the autograd engine
  } catch (const std::exception& e) {
    row.error = e.what();
  }
  if (!row.error.empty()) row.error = row.error.substr(0, row.error.find('\n'));
  release_cached_memory(device);
}

// The peer: float weights and AdamW, forward under bf16 autocast, backward and update outside it.
Row run_peer(const Options& o, const nn::LlamaConfig& config, const torch::Device& device, const llama::TrainOptions& topt) {
  Row row{kPeer};
  guarded(row, device, [&] {
    llama::reset_peak_memory(device);
    torch::manual_seed(1);
    nn::Llama model(config);
    model->to(device);
    model->train();
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(topt.lr)
                                                     .betas({topt.beta1, topt.beta2})
                                                     .eps(topt.eps)
                                                     .weight_decay(topt.weight_decay));
    const auto type = device.type();
    time_steps(o, config, device, row, [&](const torch::Tensor& x, const torch::Tensor& y) {
      at::autocast::set_autocast_dtype(type, torch::kBFloat16);
      at::autocast::set_autocast_enabled(type, true);
      torch::Tensor loss;
      try {
        loss = model->loss(x, y);
      } catch (...) {
        at::autocast::set_autocast_enabled(type, false);
        at::autocast::clear_cache();
        throw;
      }
      at::autocast::set_autocast_enabled(type, false);
      at::autocast::clear_cache();
      loss.backward();
      torch::nn::utils::clip_grad_norm_(model->parameters(), topt.clip);
      opt.step();
      opt.zero_grad();
      return loss.item<double>();
    });
  });
  return row;
}

Row run_strategy(const std::string& name, const Options& o, const nn::LlamaConfig& config, const torch::Device& device,
                 const llama::TrainOptions& topt) {
  Row row{name};
  guarded(row, device, [&] {
    llama::with_strategy(name, [&]<StrategyType S>() {
      row.planned_gb = double(plan::plan_memory<S>(config.shape(), {o.batch / S::accumulation_steps, o.seq}, 1).total().device) / 1e9;
      llama::reset_peak_memory(device);
      torch::manual_seed(1);
      Trainer<S> trainer(config, topt, device);
      time_steps(o, config, device, row, [&](const torch::Tensor& x, const torch::Tensor& y) { return trainer.step(x, y).loss; });
    });
  });
  return row;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"squeeze strategy table: memory and speed of LLaMA training per strategy, beside plain libtorch"};
  app.add_option("--out", o.out, "append JSON lines here")->required();
  app.add_option("--preset", o.preset, "model geometry")->check(CLI::IsMember(nn::LlamaConfig::preset_names()))->capture_default_str();
  app.add_option("--layers", o.layers, "override the preset's layer count (smaller runs)");
  app.add_option("--batch", o.batch, "sequences per optimizer step")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seq", o.seq, "tokens per sequence")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--steps", o.steps, "timed optimizer steps per row")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed steps first")->capture_default_str();
  app.add_option("--device", o.device, "cuda (the table) or cpu (a smoke test)")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  std::string default_rows = std::string(kPeer) + ",fp32,bf16,fp16,accum4,ckpt,bf16-ckpt,zero3-offload,zero3-offload-fp16-accum4,zero3-offload-bf16-ckpt";
  app.add_option("--rows", o.rows, "comma-separated rows: " + std::string(kPeer) + " and strategy names (default: " + default_rows + ")");
  CLI11_PARSE(app, argc, argv);
  if (o.rows.empty()) o.rows = default_rows;

  const torch::Device device(o.device == "cuda" ? torch::kCUDA : torch::kCPU);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    std::cerr << "bench_table: no CUDA device (this libtorch sees none); run it on the GPU machine or pass --device cpu\n";
    return 1;
  }
  nn::LlamaConfig config = nn::LlamaConfig::preset(o.preset);
  if (o.layers > 0) config.layers = o.layers;
  llama::TrainOptions topt;
  topt.lr = o.lr;

  const auto known = llama::strategy_names();
  for (const auto& r : split(o.rows))
    if (r != kPeer && std::find(known.begin(), known.end(), r) == known.end()) {
      std::cerr << "bench_table: unknown row '" << r << "'\n";
      return 1;
    }

  std::ofstream out(o.out, std::ios::app);
  if (!out) {
    std::cerr << "bench_table: cannot write " << o.out << "\n";
    return 1;
  }
  const std::string dev_name = env_or("SQUEEZE_DEVICE", device.is_cuda() ? "cuda" : "cpu");
  const double tokens_per_step = double(o.batch * o.seq);
  std::printf("LLaMA %s (%lld layers), B=%lld, T=%lld, %lld timed steps per row on %s\n", o.preset.c_str(),
              (long long)config.layers, (long long)o.batch, (long long)o.seq, (long long)o.steps, dev_name.c_str());
  std::printf("%-22s %9s %9s %8s %10s %8s %8s  %s\n", "case", "peak GB", "plan GB", "it/s", "tok/s", "x peer", "mem x", "note");

  std::optional<Row> peer;
  for (const auto& name : split(o.rows)) {
    const Row row = name == kPeer ? run_peer(o, config, device, topt) : run_strategy(name, o, config, device, topt);
    if (name == kPeer && row.time_ms) peer = row;

    json j = {{"bench", "table"}, {"case", row.name}, {"peer", kPeer}, {"preset", o.preset}, {"layers", config.layers},
              {"batch", o.batch}, {"seq", o.seq}, {"device", dev_name}, {"date", env_or("SQUEEZE_DATE", "")},
              {"commit", env_or("SQUEEZE_COMMIT", "")}, {"oom", row.oom}};
    // Keys are left out (not null) when unknown: consumers read missing numbers as 0.
    double tps = 0, ratio = 0, mem_ratio = 0;
    if (row.time_ms) {
      tps = tokens_per_step / (*row.time_ms / 1e3);
      j["time_ms"] = *row.time_ms;
      j["iters_per_s"] = 1e3 / *row.time_ms;
      j["tokens_per_s"] = tps;
      j["peak_gb"] = *row.peak_gb;
      j["reserved_gb"] = *row.reserved_gb;
      j["final_loss"] = *row.final_loss;
      if (peer) {
        ratio = tps / (tokens_per_step / (*peer->time_ms / 1e3));
        mem_ratio = *peer->peak_gb / std::max(1e-9, *row.peak_gb);
        j["ratio_vs_peer"] = ratio;
        j["mem_ratio_vs_peer"] = mem_ratio;
      }
    }
    if (row.planned_gb) {
      j["planned_gb"] = *row.planned_gb;
      if (row.peak_gb) j["plan_error"] = *row.peak_gb / *row.planned_gb - 1;
    }
    if (!row.error.empty()) j["error"] = row.error;
    out << j.dump() << "\n" << std::flush;

    if (row.time_ms)
      std::printf("%-22s %9.2f %9s %8.3f %10.0f %8s %8s  %s\n", row.name.c_str(), *row.peak_gb,
                  row.planned_gb ? std::to_string(*row.planned_gb).substr(0, 6).c_str() : "-", 1e3 / *row.time_ms, tps,
                  peer ? std::to_string(ratio).substr(0, 5).c_str() : "-", peer ? std::to_string(mem_ratio).substr(0, 5).c_str() : "-",
                  "");
    else
      std::printf("%-22s %9s %9s %8s %10s %8s %8s  %s\n", row.name.c_str(), "-",
                  row.planned_gb ? std::to_string(*row.planned_gb).substr(0, 6).c_str() : "-", "-", "-", "-", "-", row.error.c_str());
    std::fflush(stdout);
  }
  if (o.preset == "tinyllama-1.1b" && o.batch == 8 && o.seq == 2048 && config.layers == 22)
    std::printf("reference (PyTorch + transformers, this GPU type, TinyLlama-1.1B B=8 T=2048): bf16 autocast 60.8 GB 48.7k tok/s;\n"
                "  + checkpointing 24.1 GB 35.2k tok/s; accumulation 4x2 31.2 GB 38.4k tok/s\n");
  return 0;
}
