// How much faster FP8 GEMMs can make a training step: the block linears' GEMMs of one step at a preset's geometry, in
// bf16 (torch::mm, cuBLAS) and in FP8 (at::_scaled_mm on operands already cast, cuBLASLt), and the least memory traffic
// the casts need at the device's copy bandwidth measured in the same run:
//   forward   each distinct linear input (q/k/v share one, gate/up one): read bf16, write e4m3 and its transpose (3 B a value)
//   backward  each linear's output gradient: read bf16, write e5m2 and its transpose (4 B a value)
//   weights   each, forward and backward: read bf16, write e4m3 (3 B a value)
// (the amax reductions fused into the producing kernels, so no read of their own). Beside them, the casts as
// nn/fp8_linear.hpp does them today (to_fp8 on each distinct input and gradient with its transpose, each weight
// twice): on the GPU machine this is an nvcc translation unit, so they are the CUDA kernels of kernels/fp8_cast.cuh.
// With --step-ms (the bf16 row's step time from the same call), the step-time bound of FP8 GEMMs:
//   step - bf16 GEMMs + FP8 GEMMs + least cast traffic,  and the speedup bound step / that.
// --ckpt: recomputation runs each forward GEMM and forward cast twice. On the CPU (a smoke run) the figures mean nothing.
//   bench_fp8_bound --out FILE.jsonl [--preset tinyllama-1.1b] [--batch 8] [--seq 2048] [--ckpt] [--step-ms MS] [--iters 10]
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <squeeze/nn/fp8_linear.hpp>
#include <squeeze/nn/llama.hpp>

namespace {

using namespace squeeze;

void sync(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

// Median milliseconds of f over iters runs (each ends with a device sync), after 2 warm-up runs.
double median_ms(const std::function<void()>& f, int iters, const torch::Device& d) {
  for (int i = 0; i < 2; ++i) f();
  sync(d);
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    sync(d);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct LinearTimes {
  double bf16 = 0, fp8 = 0, cast_ours = 0;  // ms: the three GEMMs in each type; today's casts of its gradient and weight
};

// One linear [in -> out] over M tokens: its forward, input-gradient and weight-gradient GEMMs in bf16 and in FP8, and
// today's cast of what only this linear casts (its output gradient and the transposes; its weight forward and backward).
LinearTimes time_linear(int64_t M, int64_t in, int64_t out, int iters, const torch::Device& d) {
  torch::NoGradGuard no_grad;
  const auto bf = torch::TensorOptions().device(d).dtype(torch::kBFloat16);
  const torch::Tensor x = torch::randn({M, in}, bf), w = torch::randn({out, in}, bf) * 0.02, g = torch::randn({M, out}, bf) * 1e-3;
  LinearTimes t;
  t.bf16 = median_ms(
      [&] {
        (void)torch::mm(x, w.t());  // y = x W^T  [M, out]
        (void)torch::mm(g, w);      // dX = dY W  [M, in]
        (void)torch::mm(g.t(), x);  // dW = dY^T x [out, in]
      },
      iters, d);
  const nn::Fp8Operand x8 = nn::to_fp8(x, torch::kFloat8_e4m3fn, nn::Fp8Layout::both),
                       w8 = nn::to_fp8(w, torch::kFloat8_e4m3fn, nn::Fp8Layout::both),
                       g8 = nn::to_fp8(g, torch::kFloat8_e5m2, nn::Fp8Layout::both);
  const nn::Fp8Operand wt{w8.transposed, w8.inverse_scale}, gt{g8.transposed, g8.inverse_scale}, xt{x8.transposed, x8.inverse_scale};
  t.fp8 = median_ms(
      [&] {
        (void)nn::fp8_mm(x8, w8, torch::kBFloat16);
        (void)nn::fp8_mm(g8, wt, torch::kBFloat16);
        (void)nn::fp8_mm(gt, xt, torch::kBFloat16);
      },
      iters, d);
  t.cast_ours = median_ms(
      [&] {
        (void)nn::to_fp8(g, torch::kFloat8_e5m2, nn::Fp8Layout::both);          // dY and dY^T
        (void)nn::to_fp8(w, torch::kFloat8_e4m3fn);                             // W, forward
        (void)nn::to_fp8(w, torch::kFloat8_e4m3fn, nn::Fp8Layout::transposed);  // W^T, backward
      },
      iters, d);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_fp8_bound: the block linears' GEMMs in bf16 and FP8 and the least cast traffic, per training step"};
  std::string out, preset = "tinyllama-1.1b", device_name = "cuda";
  int64_t batch = 8, seq = 2048;
  bool ckpt = false;
  double step_ms = 0;
  int iters = 10;
  app.add_option("--out", out, "append one JSON line here")->required();
  app.add_option("--preset", preset)->capture_default_str();
  app.add_option("--batch", batch)->capture_default_str();
  app.add_option("--seq", seq)->capture_default_str();
  app.add_flag("--ckpt", ckpt, "checkpointing: forward GEMMs and casts twice");
  app.add_option("--step-ms", step_ms, "the bf16 row's step time (ms) from the same call: the step-time bound");
  app.add_option("--iters", iters)->capture_default_str();
  app.add_option("--device", device_name, "cuda, or cpu for a smoke run")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const torch::Device d(device_name);
  if (d.is_cuda() && !torch::cuda::is_available()) {
    std::cerr << "bench_fp8_bound: no CUDA device (--device cpu runs a smoke test)\n";
    return 1;
  }
  const plan::ModelShape m = nn::LlamaConfig::preset(preset).shape();  // an unknown name throws, naming the presets
  const int64_t M = batch * seq;
  const double forwards = ckpt ? 2 : 1;
  torch::manual_seed(0);

  // The copy bandwidth: bytes read + written by a clone of 1 GiB (64 MiB on the CPU).
  const int64_t copy_n = d.is_cuda() ? (int64_t(1) << 29) : (int64_t(1) << 25);
  const torch::Tensor big = torch::empty({copy_n}, torch::TensorOptions().device(d).dtype(torch::kBFloat16)).fill_(1);
  const double copy_ms = median_ms([&] { (void)big.clone(); }, iters, d);
  const double copy_gbps = 2.0 * double(copy_n) * 2 / (copy_ms * 1e6);

  // Each distinct linear shape once; the step sums them over the block's seven linears and the layers.
  std::map<std::pair<int64_t, int64_t>, LinearTimes> by_shape;
  double gemm_bf16 = 0, gemm_fp8 = 0, cast_ours = 0;
  for (const auto& l : m.block_linears()) {
    auto [it, fresh] = by_shape.try_emplace({l.in, l.out});
    if (fresh) it->second = time_linear(M, l.in, l.out, iters, d);
    const LinearTimes& t = it->second;
    // The forward GEMM is a third of the three (equal FLOPs); under recomputation it runs twice.
    gemm_bf16 += t.bf16 * (2 + forwards) / 3;
    gemm_fp8 += t.fp8 * (2 + forwards) / 3;
    cast_ours += t.cast_ours;
  }
  // Today's forward casts: one to_fp8 per distinct input (q/k/v share, gate/up share).
  {
    torch::NoGradGuard no_grad;
    const auto bf = torch::TensorOptions().device(d).dtype(torch::kBFloat16);
    for (int64_t width : {m.hidden, m.q_dim(), m.hidden, m.ffn}) {
      const torch::Tensor x = torch::randn({M, width}, bf);
      cast_ours += forwards * median_ms([&] { (void)nn::to_fp8(x, torch::kFloat8_e4m3fn, nn::Fp8Layout::both); }, iters, d);
    }
  }
  gemm_bf16 *= double(m.layers), gemm_fp8 *= double(m.layers), cast_ours *= double(m.layers);

  // The least cast traffic of one step (bytes), at the copy bandwidth.
  double bytes = 0;
  for (int64_t width : {m.hidden, m.q_dim(), m.hidden, m.ffn}) bytes += forwards * 3.0 * double(M) * double(width);  // inputs
  for (const auto& l : m.block_linears()) {
    bytes += 4.0 * double(M) * double(l.out);              // output gradients, e5m2 and transposed
    bytes += (forwards + 1) * 3.0 * double(l.in * l.out);  // weights
  }
  bytes *= double(m.layers);
  const double cast_bound = bytes / (copy_gbps * 1e6);

  const char* commit = std::getenv("SQUEEZE_COMMIT");
  const char* date = std::getenv("SQUEEZE_DATE");
  const char* device = std::getenv("SQUEEZE_DEVICE");
  nlohmann::json r = {{"bench", "fp8_bound"},
                      {"case", preset + (ckpt ? "/ckpt" : "")},
                      {"preset", preset},
                      {"batch", batch},
                      {"seq", seq},
                      {"ckpt", ckpt},
                      {"gemm_bf16_ms", gemm_bf16},
                      {"gemm_fp8_ms", gemm_fp8},
                      {"gemm_speedup", gemm_bf16 / gemm_fp8},
                      {"copy_gbps", copy_gbps},
                      {"cast_bytes", bytes},
                      {"cast_bound_ms", cast_bound},
                      {"cast_ours_ms", cast_ours},
                      {"commit", commit ? commit : "unknown"},
                      {"date", date ? date : ""},
                      {"device", device ? device : d.str()}};
  if (step_ms > 0) {
    const double bound = step_ms - gemm_bf16 + gemm_fp8 + cast_bound, today = step_ms - gemm_bf16 + gemm_fp8 + cast_ours;
    r["step_bf16_ms"] = step_ms;
    r["step_bound_ms"] = bound;
    r["speedup_bound"] = step_ms / bound;
    r["step_with_todays_casts_ms"] = today;
    r["speedup_with_todays_casts"] = step_ms / today;
  }
  std::ofstream(out, std::ios::app) << r.dump() << "\n";
  std::cout << r.dump(1) << "\n";
  return 0;
}
