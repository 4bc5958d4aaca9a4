// The LM head's loss, forward + backward, three ways at a model's head geometry (bf16 on CUDA):
//   unfused   torch's own ops: logits = x W^T [N, V] at once, cross_entropy in fp32 (the peer)
//   chunked   nn::Llama's default: chunks of --chunk rows, each checkpointed (its head GEMM recomputed in backward)
//   fused     nn::fused_linear_cross_entropy: chunks, both gradients in the forward pass, no recomputation
// For each: milliseconds per forward + backward (median of --iters after warm-up), the peak memory above the
// inputs' and gradients' own (allocator statistics), and the head's GEMM time bound: 3 GEMMs of 2 N V h flops at
// the rate cuBLAS reaches on one of them in the same run.
//   bench_loss --out FILE.jsonl [--preset tinyllama-1.1b] [--tokens 16384] [--chunk 4096] [--iters 20]
#include <CLI/CLI.hpp>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include <squeeze/nn/activation_checkpoint.hpp>
#include <squeeze/nn/fused_linear_cross_entropy.hpp>
#include <squeeze/nn/llama.hpp>

namespace {

using namespace squeeze;
namespace F = torch::nn::functional;

double peak_gb() { return double(c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak) / 1e9; }
double current_gb() { return double(c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current) / 1e9; }

// Median milliseconds of f over iters runs (each ends with a device sync), after 3 warm-up runs.
double median_ms(const std::function<void()>& f, int iters) {
  for (int i = 0; i < 3; ++i) f();
  c10::cuda::device_synchronize();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    c10::cuda::device_synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_loss: the LM head's loss (unfused, chunked, fused) on CUDA"};
  std::string out, preset = "tinyllama-1.1b";
  int64_t tokens = 16384, chunk = 4096;
  int iters = 20;
  app.add_option("--out", out, "append JSON lines here")->required();
  app.add_option("--preset", preset)->capture_default_str();
  app.add_option("--tokens", tokens, "rows N (B x T)")->capture_default_str();
  app.add_option("--chunk", chunk, "rows per chunk (chunked and fused)")->capture_default_str();
  app.add_option("--iters", iters)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (!torch::cuda::is_available()) {
    std::cerr << "bench_loss: needs a CUDA device\n";
    return 1;
  }
  const nn::LlamaConfig cfg = nn::LlamaConfig::preset(preset);
  const int64_t V = cfg.vocab, h = cfg.hidden;
  const auto bf = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  torch::manual_seed(0);
  const torch::Tensor x = (torch::randn({tokens, h}, bf)).requires_grad_(true);         // [N, h]
  const torch::Tensor w = (torch::randn({V, h}, bf) * 0.02).requires_grad_(true);       // [V, h]
  const torch::Tensor t = torch::randint(V, {tokens}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kLong));  // [N]

  const std::map<std::string, std::function<torch::Tensor()>> ways = {
      {"unfused", [&] { return F::cross_entropy(F::linear(x, w).to(torch::kFloat32), t); }},
      {"chunked",
       [&] {
         const nn::BlockFn chunk_loss = [](const std::vector<torch::Tensor>& in) {
           return F::cross_entropy(F::linear(in[0], in[2]).to(torch::kFloat32), in[1], F::CrossEntropyFuncOptions().reduction(torch::kSum));
         };
         return nn::checkpoint_chunked_sum(chunk, {x, t}, {w}, chunk_loss, /*recompute=*/true) / double(tokens);
       }},
      {"fused", [&] { return nn::fused_linear_cross_entropy(x, w, t, chunk); }},
  };
  // One GEMM of the head [N, h] x [h, V] in bf16, the rate the three-GEMM bound uses.
  const double gemm_ms = median_ms([&] { torch::NoGradGuard ng; (void)torch::mm(x, w.t()); }, iters);
  const double flops = 2.0 * double(tokens) * double(V) * double(h);
  const char* commit = std::getenv("SQUEEZE_COMMIT");
  const char* date = std::getenv("SQUEEZE_DATE");
  std::map<std::string, nlohmann::json> rows;
  for (const auto& [name, loss_of] : ways) {
    auto run = [&] {
      x.mutable_grad() = torch::Tensor();
      w.mutable_grad() = torch::Tensor();
      loss_of().backward();
    };
    run();
    c10::cuda::device_synchronize();
    x.mutable_grad() = torch::Tensor(), w.mutable_grad() = torch::Tensor();
    const double base = current_gb();
    c10::cuda::CUDACachingAllocator::resetPeakStats(0);
    run();
    c10::cuda::device_synchronize();
    const double extra = peak_gb() - base;
    const double ms = median_ms(run, iters);
    rows[name] = {{"bench", "loss"}, {"case", name + "/" + preset}, {"preset", preset}, {"tokens", tokens}, {"vocab", V}, {"hidden", h},
                  {"chunk", chunk}, {"ms", ms}, {"peak_extra_gb", extra}, {"gemm_ms", gemm_ms}, {"gemm_tflops", flops / gemm_ms / 1e9},
                  {"three_gemm_bound_ms", 3 * gemm_ms}, {"vs_bound", 3 * gemm_ms / ms},
                  {"commit", commit ? commit : "unknown"}, {"date", date ? date : ""}};
  }
  for (auto& [name, r] : rows) {
    r["speed_vs_unfused"] = rows["unfused"]["ms"].get<double>() / r["ms"].get<double>();
    r["mem_vs_unfused"] = rows["unfused"]["peak_extra_gb"].get<double>() / r["peak_extra_gb"].get<double>();
    std::ofstream(out, std::ios::app) << r.dump() << "\n";
    std::cout << r.dump() << "\n";
  }
  return 0;
}
