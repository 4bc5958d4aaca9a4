// bench_fused: the fused LLaMA ops (nn/fused_ops.hpp: rms_norm, add_rms_norm, rope, swiglu CUDA kernels) against the
// eager torch ops nn::Llama runs without them (its unfused RMSNorm, apply_rope, silu(g) * u), same data, same run.
//
//   bench_fused [--out FILE] [--rows N] [--iters 20] [--quick]
//
// Cases: op x dtype (bf16, fp32) x hidden (4096, 8192; rope: 32 heads of 128) x pass (fwd: no grad; fwdbwd: forward
// then backward of a fixed gradient through autograd). rows = B * T tokens (16384 by default).
// Bytes moved (the minimum either side must move; [rows, h] tensors of the storage type, weights and tables ignored):
//   rms_norm      fwd: read x, write y (2)                      fwdbwd: + read x, dy, write dx (5)
//   add_rms_norm  fwd: read x, residual, write sum, y (4)       fwdbwd: + read sum, dy, dsum, write dx (8)
//   rope          fwd: read x, write x in place (2)             fwdbwd: + read dy, write dx (4), plus x's clone (2)
//   swiglu        fwd: read g, u, write h (3)                   fwdbwd: + read g, u, dh, write dg, du (8)
// Times: CUDA events on the current stream around each call, ours and the peer alternating, warm-up 3, median of
// --iters. GB/s = bytes / time; roofline_fraction = GB/s over the cudaMemcpy device-to-device bandwidth measured
// here (2 x bytes / time); ratio_vs_peer = peer time / our time (> 1: ours faster).
// Output: one JSON object per case to --out (fields as docs/architecture.md says), a table on stdout.
#include <cuda_runtime_api.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "../cuda_timing.hpp"
#include <squeeze/nn/fused_ops.hpp>
#include <squeeze/nn/llama.hpp>

namespace {

namespace nn = squeeze::nn;

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

double time_ms(const std::function<void()>& f, int iters, cudaStream_t stream) {
  squeeze::bench::Events ev;
  for (int i = 0; i < 3; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) t.push_back(ev.time(f, stream));
  return squeeze::bench::median(t);
}

// The unfused math of nn::Llama (llama.hpp): RMSNormImpl::forward, apply_rope, silu(g) * u.
torch::Tensor eager_rms(const torch::Tensor& x, const torch::Tensor& w) {
  const torch::Tensor xf = x.to(torch::kFloat32);
  return (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + 1e-5)).to(w.scalar_type()) * w;
}

struct Case {
  std::string name;
  double bytes;
  std::function<void()> ours, peer;
};

}  // namespace

int main(int argc, char** argv) {
  std::string out;
  std::int64_t rows = 16384;
  int iters = 20;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_fused: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::string(argv[++i]);
    };
    if (a == "--out") out = next();
    else if (a == "--rows") rows = std::stoll(next());
    else if (a == "--iters") iters = std::stoi(next());
    else if (a == "--quick") quick = true;
    else {
      std::fprintf(stderr, "bench_fused: unknown argument %s (use --out FILE --rows N --iters I --quick)\n", a.c_str());
      return 2;
    }
  }
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_fused: no CUDA device (or libtorch without CUDA)\n");
    return 1;
  }
  const torch::Tensor probe = torch::empty({1}, torch::kCUDA);
  const cudaStream_t stream = nn::fused_detail::stream_of(probe);
  const double copy = squeeze::bench::copy_GBps(std::int64_t(1) << 30, stream);
  std::printf("copy bandwidth (D2D): %.0f GB/s\n", copy);
  std::ofstream jout;
  if (!out.empty()) jout.open(out);
  std::printf("%-34s %10s %10s %8s %8s %8s\n", "case", "ours ms", "eager ms", "ratio", "GB/s", "of copy");

  const std::vector<torch::ScalarType> dtypes = quick ? std::vector{torch::kBFloat16} : std::vector{torch::kBFloat16, torch::kFloat32};
  const std::vector<std::int64_t> hiddens = quick ? std::vector<std::int64_t>{4096} : std::vector<std::int64_t>{4096, 8192};
  for (const auto dt : dtypes)
    for (const std::int64_t h : hiddens) {
      const auto opt = torch::TensorOptions().dtype(dt).device(torch::kCUDA);
      const double es = double(c10::elementSize(dt)), mat = double(rows) * double(h) * es;
      const std::string suffix = std::string("-") + (dt == torch::kBFloat16 ? "bf16" : "fp32") + "-" + std::to_string(rows) + "x" + std::to_string(h);
      torch::manual_seed(0);
      const torch::Tensor x = torch::randn({rows, h}, opt), r = torch::randn({rows, h}, opt), w = torch::randn({h}, opt);
      const torch::Tensor dy = torch::randn({rows, h}, opt);
      const torch::Tensor xl = x.detach().requires_grad_(true), rl = r.detach().requires_grad_(true), wl = w.detach().requires_grad_(true);
      // rope: heads of 128 over the same [rows, h] buffer, T = 2048 positions
      const std::int64_t D = 128, T = std::min<std::int64_t>(2048, rows), B = rows / T;
      const auto [cos, sin] = nn::rope_tables(T, D, 10000.0, torch::kCUDA);
      torch::Tensor q = torch::randn({B, T, h}, opt);
      const torch::Tensor ql = q.detach().requires_grad_(true), dq = torch::randn({B, T, h}, opt);
      const auto eager_rope = [&, D = D, T = T, B = B](const torch::Tensor& t) {
        return nn::apply_rope(t.view({B, T, h / D, D}).transpose(1, 2), cos, sin);
      };
      std::vector<Case> cases = {
          {"rms_norm-fwd", 2 * mat, [&] { torch::NoGradGuard g; (void)nn::fused_rms_norm(x, w); },
           [&] { torch::NoGradGuard g; (void)eager_rms(x, w); }},
          {"rms_norm-fwdbwd", 5 * mat, [&] { nn::fused_rms_norm(xl, wl).backward(dy); }, [&] { eager_rms(xl, wl).backward(dy); }},
          {"add_rms_norm-fwd", 4 * mat, [&] { torch::NoGradGuard g; (void)nn::fused_add_rms_norm(x, r, w); },
           [&] { torch::NoGradGuard g; const torch::Tensor s = x + r; (void)eager_rms(s, w); }},
          {"add_rms_norm-fwdbwd", 8 * mat,
           [&] {
             const auto [s, y] = nn::fused_add_rms_norm(xl, rl, wl);
             torch::autograd::backward({s, y}, {dy, dy});
           },
           [&] {
             const torch::Tensor s = xl + rl;
             torch::autograd::backward({s, eager_rms(s, wl)}, {dy, dy});
           }},
          {"rope-fwd", 2 * mat, [&] { torch::NoGradGuard g; (void)nn::fused_rope_(q, cos, sin, D); },
           [&] { torch::NoGradGuard g; (void)eager_rope(q); }},
          {"rope-fwdbwd", 6 * mat, [&] { nn::fused_rope_(ql.clone(), cos, sin, D).backward(dq); },
           [&, B = B, T = T] { eager_rope(ql.clone()).backward(dq.view({B, T, h / D, D}).transpose(1, 2)); }},
          {"swiglu-fwd", 3 * mat, [&] { torch::NoGradGuard g; (void)nn::fused_swiglu(x, r); },
           [&] { torch::NoGradGuard g; (void)(torch::silu(x) * r); }},
          {"swiglu-fwdbwd", 8 * mat, [&] { nn::fused_swiglu(xl, rl).backward(dy); }, [&] { (torch::silu(xl) * rl).backward(dy); }},
      };
      for (const Case& c : cases) {
        std::ostringstream j;
        j << "{\"bench\":\"fused\",\"case\":\"" << c.name << suffix << "\"";
        try {
          double ours = 1e300, peer = 1e300;
          for (int round = 0; round < 2; ++round) {  // alternate: each side measured twice, best median kept
            ours = std::min(ours, time_ms(c.ours, iters, stream));
            peer = std::min(peer, time_ms(c.peer, iters, stream));
          }
          xl.mutable_grad() = torch::Tensor(), rl.mutable_grad() = torch::Tensor(), wl.mutable_grad() = torch::Tensor(), ql.mutable_grad() = torch::Tensor();
          const double gbps = c.bytes / (ours * 1e-3) / 1e9;
          std::printf("%-34s %10.3f %10.3f %8.2f %8.0f %8.2f\n", (c.name + suffix).c_str(), ours, peer, peer / ours, gbps, gbps / copy);
          j << ",\"time_ms\":" << ours << ",\"peer\":\"torch eager (nn::Llama unfused)\",\"peer_time_ms\":" << peer
            << ",\"ratio_vs_peer\":" << peer / ours << ",\"bytes\":" << c.bytes << ",\"GBps\":" << gbps << ",\"copy_GBps\":" << copy
            << ",\"roofline_fraction\":" << gbps / copy;
        } catch (const std::exception& e) {
          std::printf("%-34s error: %s\n", (c.name + suffix).c_str(), e.what());
          std::string msg = e.what();
          std::replace(msg.begin(), msg.end(), '"', '\'');
          std::replace(msg.begin(), msg.end(), '\\', '/');
          std::replace(msg.begin(), msg.end(), '\n', ' ');
          j << ",\"error\":\"" << msg << "\"";
        }
        j << ",\"device\":\"" << env_or("SQUEEZE_DEVICE", "unknown") << "\",\"date\":\"" << env_or("SQUEEZE_DATE", "unknown")
          << "\",\"commit\":\"" << env_or("SQUEEZE_COMMIT", "unknown") << "\"}";
        if (jout) jout << j.str() << "\n" << std::flush;
      }
    }
  return 0;
}
