// GPTQ quantization time on the LLaMA-7B geometry (random weights and activations), on the GPU when
// libtorch sees one: one decoder layer (q, k, v, o: 4096x4096; gate, up: 11008x4096; down: 4096x11008),
// Hessians from --tokens calibration tokens (default 128 x 2048), 4 bits, group 128, act-order.
// Reports the layer's time and the 32-layer estimate against the target (<= 5 minutes).
// Usage: bench_gptq [--out FILE] [--tokens N] [--layers L]   (env SQUEEZE_DEVICE, SQUEEZE_DATE, SQUEEZE_COMMIT)
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include <squeeze/nn/gptq.hpp>

namespace {
std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

int main(int argc, char** argv) {
  std::string out_path;
  std::int64_t tokens = 128 * 2048, layers = 32;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--tokens" && i + 1 < argc) tokens = std::atoll(argv[++i]);
    else if (a == "--layers" && i + 1 < argc) layers = std::atoll(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--out FILE] [--tokens N] [--layers L]\n", argv[0]);
      return 2;
    }
  }
  const bool gpu = torch::cuda::is_available();
  const torch::Device dev = gpu ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (!gpu) std::fprintf(stderr, "bench_gptq: no CUDA device, running on CPU (slow)\n");
  torch::NoGradGuard ng;
  torch::manual_seed(0);
  auto sync = [&] {
    if (gpu) torch::cuda::synchronize();
  };
  const std::int64_t hidden = 4096, inter = 11008, chunk = 8192;

  // Hessians: activations streamed in chunks (bf16, as a model would produce them). A LLaMA decoder layer
  // needs four: three of width 4096 (attention input, o_proj input, mlp input) and one of 11008 (down_proj).
  auto hessian = [&](squeeze::nn::Hessian& h, std::int64_t width) {
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t n = 0; n < tokens; n += chunk)
      h.add(torch::randn({std::min(chunk, tokens - n), width}, torch::TensorOptions().device(dev).dtype(torch::kBFloat16)));
    sync();
    return seconds_since(t0);
  };
  squeeze::nn::Hessian h_hidden(hidden, dev), h_inter(inter, dev);
  const double t_h4096 = hessian(h_hidden, hidden), t_h11008 = hessian(h_inter, inter);
  const double t_hessian = 3 * t_h4096 + t_h11008;
  std::printf("Hessians (%lld tokens): width 4096 %.2f s, width 11008 %.2f s\n", (long long)tokens, t_h4096, t_h11008);

  squeeze::nn::GptqOptions opt;
  opt.bits = 4;
  opt.group_size = 128;
  opt.act_order = true;
  struct L {
    const char* name;
    std::int64_t out, in;
  };
  const L geo[] = {{"q_proj", hidden, hidden}, {"k_proj", hidden, hidden}, {"v_proj", hidden, hidden}, {"o_proj", hidden, hidden},
                   {"gate_proj", inter, hidden}, {"up_proj", inter, hidden}, {"down_proj", hidden, inter}};
  double t_solve = 0;
  for (const auto& l : geo) {
    auto W = torch::randn({l.out, l.in}, torch::TensorOptions().device(dev).dtype(torch::kFloat32)) * 0.02;
    sync();
    const auto t1 = std::chrono::steady_clock::now();
    auto r = squeeze::nn::gptq_quantize(W, l.in == hidden ? h_hidden.matrix() : h_inter.matrix(), opt);
    sync();
    const double s = seconds_since(t1);
    t_solve += s;
    std::printf("  %-10s %5lldx%-5lld  %.2f s  damp %.3g  loss %.4g\n", l.name, (long long)l.out, (long long)l.in, s, r.damp_fraction, r.loss);
  }
  const double per_layer = t_solve + t_hessian;
  const double total = per_layer * double(layers);
  std::printf("decoder layer: solve %.2f s + Hessians %.2f s; %lld layers ~ %.1f s (target <= 300 s)\n", t_solve, t_hessian,
              (long long)layers, total);
  if (!out_path.empty()) {
    std::ofstream out(out_path);
    const nlohmann::json j = {{"bench", "gptq"},
                              {"case", "llama7b_4bit_g128_actorder_" + std::to_string(tokens) + "tok"},
                              {"time_ms", total * 1e3},
                              {"peer", "target_5min"},
                              {"peer_time_ms", 300e3},
                              {"ratio_vs_peer", 300.0 / total},
                              {"roofline_fraction", nullptr},
                              {"layer_solve_s", t_solve},
                              {"hessian_s", t_hessian},
                              {"device", env_or("SQUEEZE_DEVICE", gpu ? "cuda" : "cpu")},
                              {"date", env_or("SQUEEZE_DATE", "")},
                              {"commit", env_or("SQUEEZE_COMMIT", "unknown")}};
    out << j.dump() << "\n";
  }
  return 0;
}
