// bench_adamw: squeeze's fused AdamW against PyTorch's at::_fused_adamw_ on the same data in the same run,
// and against the device-to-device copy bandwidth measured in the same run.
//
//   bench_adamw [--out FILE] [--n PARAMS] [--tensors 64] [--iters 20] [--cpu-n PARAMS] [--cpu-only] [--gpu-only]
//
// GPU cases (1 Gi parameters by default; as one flat buffer and as 64 tensors in one launch):
//   fp32        params, grads, m, v fp32                      28 B/param (read 16, write 12)
//   bf16-mixed  bf16 params + fp32 master, bf16 grads         28 B/param (read 4+2+4+4, write 4+4+4+2)
//   fp32-scaled as fp32, with the loss-scaling inputs live: ours reads inv_scale / found_inf / clip_coef
//               from device memory, the peer gets grad_scale / found_inf tensors (values 1 and 0)
//   bf16-mixed-adam8  as bf16-mixed with 8-bit m, v (kernels/adamw8.cuh: uint8 codes + fp32 absmax per 256):
//               16 B/param + 16 B per 256 (read 4+2+1+1 + 8 of scales, write 4+1+1+2 + 8); peer as bf16-mixed
//               (fp32 state). Also measured in the same case: torch's fused fp32 AdamW alone on the same n
//               (peer_fp32_time_ms, ratio_vs_fused_fp32) and the copy bound of the same bytes, a cudaMemcpy D2D that
//               reads and writes as many bytes as the kernel moves (copy_same_bytes_GBps, roofline_fraction_same_bytes).
//               One row per kernel shape (adamw8_shapes.cuh's Shapes; field `variant`, the policy's name, and
//               `default_variant` true on the shape adamw8_cuda launches), each measured as above in the same run.
// Peer: at::_fused_adamw_ over the same tensors (flat: a list of one; 64 tensors: a list of 64). For
// bf16-mixed PyTorch has no master-weight fused AdamW, so the peer is the usual recipe: _fused_adamw_ on the
// fp32 master with fp32 grads (cast outside the timed region, in the peer's favour) + copy_ into the bf16
// params. Times: CUDA events around each step, ours and the peer alternating, warm-up 3, median of --iters.
// roofline_fraction = our bytes/s over the cudaMemcpy D2D bandwidth (2 x bytes / time) measured here.
// bf16-compact-adam8 (CPU only): as bf16-mixed-adam8 without the master, the bf16 weights rounded stochastically
//               (the compact host state of Offload<Host, Streamed> + Precision<bf16, bf16>): 10 B/param + 16 per 256.
// CPU cases: squeeze's CPU AdamW (all cores; OMP_NUM_THREADS) vs at::_fused_adamw_ on CPU tensors, params/s, and
// against the host's bound for the same bytes on the same cores: a vectorised pass reading four float streams and
// rewriting three in place, the fp32 update's traffic, over as many bytes (copy_same_bytes_GBps,
// roofline_fraction_same_bytes; host_stream_GBps).
//
// Output: one JSON object per case to --out (written as each case finishes, so a failure later keeps the
// earlier results), a readable table on stdout. A failing case writes {"bench","case","error"} and the run
// goes on. device/date/commit come from SQUEEZE_DEVICE / SQUEEZE_DATE / SQUEEZE_COMMIT.
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_adamw_kernels.hpp"
#include "../cuda_timing.hpp"
#include "squeeze/error.hpp"
#include "squeeze/kernels/adamw.hpp"
#include "squeeze/kernels/adamw8.hpp"
#include "squeeze/kernels/cpu_parallel.hpp"

namespace {
using squeeze::bench::Events;
using squeeze::bench::median;

using squeeze::bf16;
namespace sk = squeeze::kernels;

constexpr double kBytesPerParam = 28.0;
constexpr double kBytesPerParam8 = 16.0 + 16.0 / 256;  // 8-bit state: codes 1+1 read and written, absmax 4+4 per block
// The compact host state: bf16 weights that are their own master (read 2, written 2), grad 2, codes 1+1 each way.
constexpr double kBytesPerParamCompact8 = 10.0 + 16.0 / 256;
double bytes_per_param(const std::string& precision) {
  if (precision == "bf16-compact-adam8") return kBytesPerParamCompact8;
  return precision.find("adam8") != std::string::npos ? kBytesPerParam8 : kBytesPerParam;
}
constexpr float kLr = 1e-4f, kBeta1 = 0.9f, kBeta2 = 0.999f, kEps = 1e-8f, kWd = 0.01f;

struct Options {
  std::string out;
  std::int64_t n = std::int64_t(1) << 30;
  int tensors = 64;
  int iters = 20;
  std::int64_t cpu_n = std::int64_t(1) << 26;
  bool cpu = true, gpu = true;
};

struct Result {
  std::string name, peer;
  std::string variant;  // the 8-bit kernel's shape; empty for the other cases
  bool default_variant = false;
  double time_ms = -1, peer_time_ms = -1, bandwidth_GBps = -1, roofline = -1, params_per_s = -1, copy_GBps = -1;
  double peer_fp32_time_ms = -1, copy_same_GBps = -1, roofline_same = -1, bytes_per_param = kBytesPerParam;
  std::int64_t params = 0;
  int threads = 0;
  std::string error;
};

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\')
      o += '\\', o += c;
    else if (static_cast<unsigned char>(c) < 0x20)
      o += ' ';
    else
      o += c;
  }
  return o + "\"";
}

// One JSON line. Numbers that were not measured are left out (readers default them), never written as null.
void emit(std::ofstream* out, const Result& r) {
  std::ostringstream j;
  j.precision(6);
  j << "{\"bench\":\"adamw\",\"case\":" << json_str(r.name);
  if (!r.variant.empty()) j << ",\"variant\":" << json_str(r.variant) << ",\"default_variant\":" << (r.default_variant ? "true" : "false");
  auto num = [&](const char* k, double v) {
    if (v >= 0) j << ",\"" << k << "\":" << v;
  };
  if (r.error.empty()) {
    num("time_ms", r.time_ms);
    j << ",\"peer\":" << json_str(r.peer);
    num("peer_time_ms", r.peer_time_ms);
    if (r.peer_time_ms > 0 && r.time_ms > 0) num("ratio_vs_peer", r.peer_time_ms / r.time_ms);
    num("roofline_fraction", r.roofline);
    num("bandwidth_GBps", r.bandwidth_GBps);
    num("copy_bandwidth_GBps", r.copy_GBps);
    num("params_per_s", r.params_per_s);
    num("peer_fp32_time_ms", r.peer_fp32_time_ms);
    if (r.peer_fp32_time_ms > 0 && r.time_ms > 0) num("ratio_vs_fused_fp32", r.peer_fp32_time_ms / r.time_ms);
    num("copy_same_bytes_GBps", r.copy_same_GBps);
    num("roofline_fraction_same_bytes", r.roofline_same);
    j << ",\"params\":" << r.params << ",\"bytes_per_param\":" << r.bytes_per_param;
    if (r.threads > 0) j << ",\"cpu_threads\":" << r.threads;
  } else {
    j << ",\"error\":" << json_str(r.error);
  }
  j << ",\"device\":" << json_str(env_or("SQUEEZE_DEVICE", "unknown")) << ",\"date\":" << json_str(env_or("SQUEEZE_DATE", "unknown"))
    << ",\"commit\":" << json_str(env_or("SQUEEZE_COMMIT", "unknown")) << "}";
  if (out && *out) {
    *out << j.str() << "\n";
    out->flush();
  }
  if (r.error.empty()) {
    const std::string label = r.variant.empty() ? r.name : r.name + " [" + r.variant + "]";
    std::printf("%-34s %10.3f ms  peer %10.3f ms  x%5.2f  %8.1f GB/s  roof %5.3f", label.c_str(), r.time_ms, r.peer_time_ms,
                r.peer_time_ms > 0 ? r.peer_time_ms / r.time_ms : 0.0, r.bandwidth_GBps, r.roofline > 0 ? r.roofline : 0.0);
    if (r.params_per_s > 0) std::printf("  %.3g params/s (%d threads)", r.params_per_s, r.threads);
    if (r.copy_same_GBps > 0) std::printf("  same-bytes copy %.1f GB/s, fraction %.3f", r.copy_same_GBps, r.roofline_same);
    if (r.peer_fp32_time_ms > 0) std::printf("; fused fp32 %.3f ms (x%.2f)", r.peer_fp32_time_ms, r.peer_fp32_time_ms / r.time_ms);
    std::printf("\n");
  } else {
    std::printf("%-34s ERROR: %s\n", r.name.c_str(), r.error.c_str());
  }
  std::fflush(stdout);
}

// ---- GPU -------------------------------------------------------------------------------------------------

// Slices of a flat tensor: the peer's tensor list (views share memory with ours).
std::vector<at::Tensor> slices(const at::Tensor& flat, int k) {
  std::vector<at::Tensor> out;
  const std::int64_t n = flat.numel(), per = n / k;
  for (int i = 0; i < k; ++i) out.push_back(flat.narrow(0, i * per, i + 1 == k ? n - i * per : per));
  return out;
}

std::vector<at::Tensor> steps_for(int k, const at::Device& dev) {
  std::vector<at::Tensor> s;
  for (int i = 0; i < k; ++i) s.push_back(at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(dev)));
  return s;
}

void peer_fused_adamw(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g, const std::vector<at::Tensor>& m,
                      const std::vector<at::Tensor>& v, const std::vector<at::Tensor>& steps,
                      const std::optional<at::Tensor>& grad_scale = std::nullopt,
                      const std::optional<at::Tensor>& found_inf = std::nullopt) {
  at::_fused_adamw_(p, g, m, v, {}, steps, kLr, kBeta1, kBeta2, kWd, kEps, /*amsgrad=*/false, /*maximize=*/false, grad_scale, found_inf);
}

// Times ours and the peer alternately; fills time_ms / peer_time_ms.
void time_pair(Result& r, int iters, const std::function<void(int)>& ours, const std::function<void()>& peer) {
  Events ev;
  std::vector<double> a, b;
  for (int i = 0; i < 3; ++i) ours(i + 1), peer();
  SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
  for (int i = 0; i < iters; ++i) {
    a.push_back(ev.time([&] { ours(i + 4); }));
    b.push_back(ev.time(peer));
  }
  r.time_ms = median(a);
  r.peer_time_ms = median(b);
}

// variant: the 8-bit kernel's shape (bench_adamw_kernels.hpp's adamw8_variants()), unused by the other precisions.
Result gpu_case(const std::string& precision, int tensors, const Options& o, double copy_GBps, const std::string& variant = "") {
  Result r;
  r.name = "gpu/" + precision + "/" + (tensors == 1 ? std::string("flat") : std::to_string(tensors) + "-tensors") + "/" +
           std::to_string(o.n >> 20) + "Mi";
  r.params = o.n;
  r.copy_GBps = copy_GBps;
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
  const auto b16 = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  const at::Device dev(at::kCUDA);
  auto m = at::zeros({o.n}, f32), v = at::zeros({o.n}, f32);
  // fp32-scaled: the loss-scaling path, ours with device inv_scale / found_inf / clip_coef, the peer with
  // grad_scale / found_inf tensors (1 and 0: every step applies, both read the flags).
  const bool scaled = precision == "fp32-scaled";
  auto dyn_mem = at::tensor({1.0f, 0.0f, 1.0f}, f32);  // [inv_scale, found_inf, clip_coef]
  const float* dm = dyn_mem.data_ptr<float>();
  const sk::AdamWDynamic dyn = scaled ? sk::AdamWDynamic{dm, dm + 1, dm + 2, nullptr} : sk::AdamWDynamic{};
  const auto grad_scale = at::ones({}, f32), found_inf = at::zeros({}, f32);
  auto ours_step = [&](sk::AdamWCoeffs c, squeeze::bench::AdamWLauncher& l) { SQUEEZE_CUDA_CHECK(l.run(c, dyn, nullptr)); };
  if (precision == "fp32" || scaled) {
    auto p = at::randn({o.n}, f32).mul_(0.02), g = at::randn({o.n}, f32).mul_(1e-3);
    auto ours =
        squeeze::bench::make_fp32_adamw(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), o.n, tensors);
    const auto P = slices(p, tensors), G = slices(g, tensors), M = slices(m, tensors), V = slices(v, tensors);
    const auto S = steps_for(tensors, dev);
    r.peer = scaled ? "at::_fused_adamw_(grad_scale, found_inf)" : "at::_fused_adamw_";
    time_pair(
        r, o.iters, [&](int t) { ours_step(sk::adamw_coeffs(kLr, kBeta1, kBeta2, kEps, kWd, t), *ours); },
        [&] {
          if (scaled)
            peer_fused_adamw(P, G, M, V, S, grad_scale, found_inf);
          else
            peer_fused_adamw(P, G, M, V, S);
        });
  } else {
    auto master = at::randn({o.n}, f32).mul_(0.02);
    auto p = master.to(at::kBFloat16), g = at::randn({o.n}, b16).mul_(1e-3);
    auto g32 = g.to(at::kFloat);  // the peer's fp32 grads, cast outside the timed region
    auto* pp = reinterpret_cast<bf16*>(p.data_ptr());
    std::unique_ptr<squeeze::bench::AdamWLauncher> ours;
    at::Tensor m8, v8, ma, va;  // 8-bit state
    if (precision == "bf16-mixed-adam8") {
      const auto u8 = at::TensorOptions().dtype(at::kByte).device(at::kCUDA);
      m8 = at::zeros({o.n}, u8), v8 = at::zeros({o.n}, u8);
      ma = at::zeros({sk::state_blocks(o.n)}, f32), va = at::zeros({sk::state_blocks(o.n)}, f32);
      r.variant = variant;
      r.default_variant = variant == squeeze::bench::adamw8_default_variant();
      ours = squeeze::bench::make_bf16_mixed_adamw8(variant, pp, master.data_ptr<float>(), reinterpret_cast<const bf16*>(g.data_ptr()),
                                                    m8.data_ptr<std::uint8_t>(), ma.data_ptr<float>(), v8.data_ptr<std::uint8_t>(),
                                                    va.data_ptr<float>(), o.n, tensors);
    } else {
      ours = squeeze::bench::make_bf16_mixed_adamw(pp, master.data_ptr<float>(), reinterpret_cast<const bf16*>(g.data_ptr()),
                                                   m.data_ptr<float>(), v.data_ptr<float>(), o.n, tensors);
    }
    const auto PM = slices(master, tensors), G = slices(g32, tensors), M = slices(m, tensors), V = slices(v, tensors);
    const auto PB = slices(p, tensors);
    const auto S = steps_for(tensors, dev);
    r.peer = "at::_fused_adamw_(fp32 master, fp32 grads) + bf16 copy_";
    time_pair(
        r, o.iters, [&](int t) { ours_step(sk::adamw_coeffs(kLr, kBeta1, kBeta2, kEps, kWd, t), *ours); },
        [&] {
          peer_fused_adamw(PM, G, M, V, S);
          for (int i = 0; i < tensors; ++i) PB[std::size_t(i)].copy_(PM[std::size_t(i)]);
        });
    if (precision == "bf16-mixed-adam8") {
      // torch's fused fp32 AdamW alone (fp32 params, grads and state: 28 B/param), then the copy bound of this
      // kernel's bytes: a copy of half of them reads and writes them all.
      Events ev;
      std::vector<double> ms;
      for (int i = 0; i < o.iters + 3; ++i) {
        const double t = ev.time([&] { peer_fused_adamw(PM, G, M, V, S); });
        if (i >= 3) ms.push_back(t);
      }
      r.peer_fp32_time_ms = median(ms);
      r.copy_same_GBps = squeeze::bench::copy_GBps(std::int64_t(bytes_per_param(precision) * double(o.n) / 2));
    }
  }
  SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
  r.bytes_per_param = bytes_per_param(precision);
  r.bandwidth_GBps = r.bytes_per_param * double(o.n) / (r.time_ms * 1e-3) / 1e9;
  if (copy_GBps > 0) r.roofline = r.bandwidth_GBps / copy_GBps;
  if (r.copy_same_GBps > 0) r.roofline_same = r.bandwidth_GBps / r.copy_same_GBps;
  return r;
}

// ---- CPU -------------------------------------------------------------------------------------------------

template <class F>
double cpu_time_ms(F&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The host's bound for an update moving `bytes`: a pass with the fp32 update's traffic (four float streams read, three of
// them rewritten in place: 28 bytes an element, no read for ownership) over bytes/28 elements on every core, compiled
// for the same ISA levels as the update. Each thread first touches the ranges it walks, so the pages sit on its own
// memory node (a serial fill would put them all on one), and page faults are not timed.
SQUEEZE_CPU_CLONES void stream_28_bytes(float* a, const float* b, float* c, float* d, std::int64_t lo, std::int64_t hi) {
#pragma omp simd
  for (std::int64_t i = lo; i < hi; ++i) {
    const float x = b[i];
    a[i] += x, c[i] += x, d[i] += x;
  }
}

double host_stream_GBps(double bytes, int iters) {
  const std::int64_t n = std::int64_t(bytes / 28.0);
  std::unique_ptr<float[]> buf(new float[4 * n]);  // uninitialised: first touched below
  float *a = buf.get(), *b = a + n, *c = b + n, *d = c + n;
  sk::cpu::parallel_ranges(n, [=](int, std::int64_t lo, std::int64_t hi) {
    for (float* p : {a, b, c, d}) std::fill(p + lo, p + hi, 1.0f);
  });
  auto pass = [=] { sk::cpu::parallel_ranges(n, [=](int, std::int64_t lo, std::int64_t hi) { stream_28_bytes(a, b, c, d, lo, hi); }); };
  pass();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) t.push_back(cpu_time_ms(pass));
  return 28.0 * double(n) / (median(t) * 1e-3) / 1e9;
}

Result cpu_case(const std::string& precision, const Options& o) {
  Result r;
  const std::int64_t n = o.cpu_n;
  r.name = "cpu/" + precision + "/flat/" + std::to_string(n >> 20) + "Mi";
  r.params = n;
  r.threads = sk::cpu::max_threads();
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  auto master = at::randn({n}, f32).mul_(0.02), m = at::zeros({n}, f32), v = at::zeros({n}, f32);
  auto g32 = at::randn({n}, f32).mul_(1e-3);
  std::vector<double> a, b;
  const int iters = std::max(3, o.iters / 4);
  const std::vector<at::Tensor> S = {at::zeros({}, f32)};
  std::function<void(int)> ours;
  std::function<void()> peer;
  at::Tensor pb, gb, m8, v8, ma, va;
  if (precision == "fp32") {
    sk::AdamWTensor<float, float> t{master.data_ptr<float>(), nullptr, g32.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n};
    ours = [t](int step) { sk::adamw_cpu(t, sk::adamw_coeffs(kLr, kBeta1, kBeta2, kEps, kWd, step)); };
    peer = [&] { peer_fused_adamw({master}, {g32}, {m}, {v}, S); };
    r.peer = "at::_fused_adamw_ (CPU)";
  } else if (precision == "bf16-mixed-adam8" || precision == "bf16-compact-adam8") {
    pb = master.to(at::kBFloat16);
    gb = g32.to(at::kBFloat16);
    m8 = at::zeros({n}, at::kByte), v8 = at::zeros({n}, at::kByte);
    ma = at::zeros({sk::state_blocks(n)}, f32), va = at::zeros({sk::state_blocks(n)}, f32);
    float* own_master = precision == "bf16-compact-adam8" ? nullptr : master.data_ptr<float>();  // null: rounded stochastically
    sk::AdamW8Tensor<bf16, bf16> t{reinterpret_cast<bf16*>(pb.data_ptr()),
                                   own_master,
                                   reinterpret_cast<const bf16*>(gb.data_ptr()),
                                   m8.data_ptr<std::uint8_t>(),
                                   ma.data_ptr<float>(),
                                   v8.data_ptr<std::uint8_t>(),
                                   va.data_ptr<float>(),
                                   n};
    ours = [t](int step) { sk::adamw8_cpu(t, sk::adamw_coeffs(kLr, kBeta1, kBeta2, kEps, kWd, step)); };
    peer = [&] {
      peer_fused_adamw({master}, {g32}, {m}, {v}, S);
      pb.copy_(master);
    };
    r.peer = "at::_fused_adamw_(fp32 master, fp32 grads, fp32 state) + bf16 copy_ (CPU)";
  } else {
    pb = master.to(at::kBFloat16);
    gb = g32.to(at::kBFloat16);
    sk::AdamWTensor<bf16, bf16> t{reinterpret_cast<bf16*>(pb.data_ptr()),
                                  master.data_ptr<float>(),
                                  reinterpret_cast<const bf16*>(gb.data_ptr()),
                                  m.data_ptr<float>(),
                                  v.data_ptr<float>(),
                                  n};
    ours = [t](int step) { sk::adamw_cpu(t, sk::adamw_coeffs(kLr, kBeta1, kBeta2, kEps, kWd, step)); };
    peer = [&] {
      peer_fused_adamw({master}, {g32}, {m}, {v}, S);
      pb.copy_(master);
    };
    r.peer = "at::_fused_adamw_(fp32 master, fp32 grads) + bf16 copy_ (CPU)";
  }
  ours(1);
  for (int i = 0; i < iters; ++i) a.push_back(cpu_time_ms([&] { ours(i + 2); }));
  r.time_ms = median(a);
  try {
    peer();
    for (int i = 0; i < iters; ++i) b.push_back(cpu_time_ms(peer));
    r.peer_time_ms = median(b);
  } catch (const std::exception& e) {
    r.peer += " (unavailable: " + std::string(e.what()).substr(0, 120) + ")";
  }
  r.bytes_per_param = bytes_per_param(precision);
  r.bandwidth_GBps = r.bytes_per_param * double(n) / (r.time_ms * 1e-3) / 1e9;
  r.params_per_s = double(n) / (r.time_ms * 1e-3);
  r.copy_same_GBps = host_stream_GBps(r.bytes_per_param * double(n), iters);
  r.roofline_same = r.bandwidth_GBps / r.copy_same_GBps;
  return r;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      squeeze::check(i + 1 < argc, "bench_adamw: " + a + " needs a value");
      return argv[++i];
    };
    if (a == "--out")
      o.out = next();
    else if (a == "--n")
      o.n = std::stoll(next());
    else if (a == "--tensors")
      o.tensors = std::stoi(next());
    else if (a == "--iters")
      o.iters = std::stoi(next());
    else if (a == "--cpu-n")
      o.cpu_n = std::stoll(next());
    else if (a == "--cpu-only")
      o.gpu = false;
    else if (a == "--gpu-only")
      o.cpu = false;
    else
      squeeze::check(
          false, "bench_adamw: unknown argument " + a + " (use --out FILE --n N --tensors K --iters I --cpu-n N --cpu-only --gpu-only)");
  }
  squeeze::check(o.n >= o.tensors && o.tensors >= 1 && o.iters >= 1 && o.cpu_n >= 1, "bench_adamw: need n >= tensors >= 1, iters >= 1");
  return o;
}

template <class F>
void guarded(std::ofstream* out, const std::string& name, F&& f) {
  try {
    emit(out, f());
  } catch (const std::exception& e) {
    Result r;
    r.name = name;
    r.error = e.what();
    emit(out, r);
    cudaGetLastError();  // clear a sticky launch error so later cases can still run
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  std::ofstream file;
  if (!o.out.empty()) {
    file.open(o.out, std::ios::app);
    if (!file) std::fprintf(stderr, "bench_adamw: cannot write %s\n", o.out.c_str());
  }
  std::ofstream* out = file.is_open() ? &file : nullptr;
  std::printf("bench_adamw: %s, %s, commit %s\n", env_or("SQUEEZE_DEVICE", "unknown").c_str(), env_or("SQUEEZE_DATE", "unknown").c_str(),
              env_or("SQUEEZE_COMMIT", "unknown").c_str());

  if (o.gpu) {
    int devices = 0;
    const bool gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
    if (!gpu) {
      std::printf("no CUDA device: GPU cases skipped\n");
    } else if (!torch::cuda::is_available()) {
      guarded(out, "gpu/setup",
              []() -> Result { throw squeeze::Error("libtorch sees no CUDA (torch_cuda not linked?): peer unavailable"); });
    } else {
      double copy = -1;
      guarded(out, "gpu/copy-d2d/4GiB", [&] {
        copy = squeeze::bench::copy_GBps(std::int64_t(4) << 30);  // the roofline
        Result r;
        r.name = "gpu/copy-d2d/4GiB";
        r.peer = "none (the roofline itself)";
        r.bandwidth_GBps = copy;
        r.roofline = 1.0;
        r.time_ms = 2.0 * double(std::int64_t(4) << 30) / (copy * 1e9) * 1e3;
        r.params = 0;
        return r;
      });
      for (const char* prec : {"fp32", "bf16-mixed", "fp32-scaled"})
        for (int k : {1, o.tensors}) {
          const std::string name = std::string("gpu/") + prec + "/" + (k == 1 ? "flat" : std::to_string(k) + "-tensors");
          guarded(out, name, [&] { return gpu_case(prec, k, o, copy); });
        }
      for (int k : {1, o.tensors})
        for (const std::string& variant : squeeze::bench::adamw8_variants()) {
          const std::string name =
              std::string("gpu/bf16-mixed-adam8/") + (k == 1 ? "flat" : std::to_string(k) + "-tensors") + " [" + variant + "]";
          guarded(out, name, [&] { return gpu_case("bf16-mixed-adam8", k, o, copy, variant); });
        }
    }
  }
  if (o.cpu)
    for (const char* prec : {"fp32", "bf16-mixed", "bf16-mixed-adam8", "bf16-compact-adam8"})
      guarded(out, std::string("cpu/") + prec, [&] { return cpu_case(prec, o); });
  return 0;
}
