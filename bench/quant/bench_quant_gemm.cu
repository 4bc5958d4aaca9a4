// 4-bit GEMM benchmark (GPU): y [M, N] = x [M, K] bf16 * W^T with W 4-bit GPTQ (group 128, asymmetric).
// For each (K, N) and batch M it measures, in the same run:
//   ours       squeeze int4 tensor-core GEMM (kernels/squeeze/kernels/quant/qgemm.cuh)
//   peer       cuBLAS bf16 GEMM through libtorch (at::mm on bf16 CUDA tensors, W [N, K] as nn.Linear stores it)
//   peer2      PyTorch's int4 weight-only GEMM at::_weight_int4pack_mm (group 128), when it runs here
//   roofline   bytes our kernel must read (weights + scales + zeros + x) / time, over the bandwidth of a
//              device-to-device copy measured in the same run
// Times: CUDA events around each launch, median of --reps, L2 flushed before each launch; every batch of
// launches is queued behind a spin kernel so CPU launch overhead never shows as GPU time.
// Correctness: ours vs dequantize + fp32 matmul on the same weights (max error relative to max |y|), per case.
// Usage: bench_quant_gemm [--out FILE] [--reps N]   (env SQUEEZE_DEVICE, SQUEEZE_DATE, SQUEEZE_COMMIT)
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <squeeze/error.hpp>
#include <squeeze/kernels/quant/dequant.cuh>
#include <squeeze/kernels/quant/qgemm.cuh>
#include <squeeze/nn/quantized_linear.hpp>
#include <squeeze/quant/tiles.hpp>
#include <squeeze/quant/rtn.hpp>

namespace kq = squeeze::kernels::quant;
using squeeze::bf16;
using squeeze::half;

namespace {

__global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// L2 flush buffer (256 MiB, larger than any Hopper L2): overwritten before every timed launch so each
// launch reads its weights from DRAM, as a real model whose layers do not fit in L2 does.
void* g_flush = nullptr;
constexpr std::size_t kFlushBytes = 256ull << 20;

// Median GPU time (ms) of fn over reps, cold L2, launched in groups queued behind a spin kernel.
double time_ms(const std::function<void()>& fn, int reps) {
  if (!g_flush) SQUEEZE_CUDA_CHECK(cudaMalloc(&g_flush, kFlushBytes));
  for (int i = 0; i < 3; ++i) fn();  // warm-up
  SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) SQUEEZE_CUDA_CHECK(cudaEventCreate(&e));
  constexpr int kGroup = 10;
  for (int r0 = 0; r0 < reps; r0 += kGroup) {
    spin_kernel<<<1, 1>>>(2'000'000);  // ~1 ms: the CPU queues the group meanwhile
    for (int r = r0; r < std::min(reps, r0 + kGroup); ++r) {
      SQUEEZE_CUDA_CHECK(cudaMemsetAsync(g_flush, r & 0xff, kFlushBytes, nullptr));
      SQUEEZE_CUDA_CHECK(cudaEventRecord(ev[2 * r], nullptr));
      fn();
      SQUEEZE_CUDA_CHECK(cudaEventRecord(ev[2 * r + 1], nullptr));
    }
  }
  SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> t(reps);
  for (int r = 0; r < reps; ++r) SQUEEZE_CUDA_CHECK(cudaEventElapsedTime(&t[r], ev[2 * r], ev[2 * r + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[reps / 2];
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

// A random 4-bit GPTQ layer [N out, K in], group 128: random codes, zeros in [1, 15], scales ~ 1e-2.
squeeze::quant::PackedLinear random_int4(std::int64_t K, std::int64_t N, std::uint32_t seed) {
  std::mt19937 rng(seed);
  squeeze::quant::PackedLinear p;
  p.bits = 4;
  p.group_size = 128;
  p.in = K;
  p.out = N;
  p.qweight.resize(p.qweight_rows() * N);
  for (auto& w : p.qweight) w = std::int32_t(rng());
  p.qzeros.resize(p.groups() * p.qzeros_cols());
  for (auto& z : p.qzeros) {  // nibbles in [0, 14] -> zeros in [1, 15]
    std::uint32_t v = 0;
    for (int i = 0; i < 8; ++i) v |= (rng() % 15u) << (4 * i);
    z = std::int32_t(v);
  }
  p.scales.resize(p.groups() * N);
  std::uniform_real_distribution<float> ud(0.005f, 0.02f);
  for (auto& s : p.scales) s = squeeze::from_float<half>(ud(rng));
  p.g_idx = squeeze::quant::default_g_idx(K, 128);
  return p;
}

// QuantizedLinear on CUDA (every path: int4 GEMM, GEMV, dequantize + cuBLAS) against its CPU path
// (dequantize twin + float matmul) on the same rounded inputs. Tolerance: output rounding of the
// activation dtype (bf16 1e-2, fp16 2e-3) relative to max |y|. Returns false on any failure.
bool module_checks() {
  bool ok = true;
  int checks = 0;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 0.05f);
  const std::int64_t out = 300, in = 520;
  for (int bits : {4, 3, 8})
    for (bool act_order : {false, true}) {
      std::vector<float> w(out * in);
      for (auto& v : w) v = nd(rng);
      auto p = squeeze::quant::rtn_quantize(w, out, in, {.bits = bits, .group_size = 128, .sym = false});
      if (act_order) {  // equal groups of 128 in a shuffled order, as GPTQ's act-order writes them
        std::vector<std::int32_t> perm(in);
        for (std::int64_t i = 0; i < in; ++i) perm[i] = std::int32_t(i);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (std::int64_t j = 0; j < in; ++j) p.g_idx[perm[j]] = std::int32_t(j / 128);
      }
      p.bias.assign(out, squeeze::from_float<half>(0.5f));
      squeeze::nn::QuantizedLinear cpu(p), gpu(p);
      gpu->to(torch::kCUDA);
      for (std::int64_t M : {1, 5, 40, 300})
        for (auto dt : {torch::kBFloat16, torch::kHalf}) {
          auto x = torch::randn({M, in}).to(dt);
          const auto path = gpu->path_for(x.cuda());
          auto yg = gpu->forward(x.cuda()).to(torch::kCPU, torch::kFloat32);
          auto yr = cpu->forward(x.to(torch::kFloat32));
          const double err = ((yg - yr).abs().max() / yr.abs().max()).item<double>();
          const double tol = dt == torch::kBFloat16 ? 1e-2 : 2e-3;
          const char* names[] = {"cpu", "tc_gemm", "gemv", "dequant_matmul"};
          const bool pass = err <= tol;
          ok = ok && pass;
          ++checks;
          if (!pass) std::printf("module check bits %d act_order %d M %3lld %-5s path %-14s rel err %.2e %s\n", bits, int(act_order), (long long)M,
                      dt == torch::kBFloat16 ? "bf16" : "fp16", names[int(path)], err, pass ? "ok" : "FAILED");
        }
    }
  std::printf("module checks: %d cases (bits 4/3/8, act-order on/off, M 1/5/40/300, bf16/fp16)\n", checks);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path;
  int reps = 50;
  bool checks = true;
  std::string only;  // run only cases whose name contains this (e.g. for a profiler)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else if (a == "--no-checks") checks = false;
    else {
      std::fprintf(stderr, "usage: %s [--out FILE] [--reps N] [--only CASE-SUBSTRING] [--no-checks]\n", argv[0]);
      return 2;
    }
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::fprintf(stderr, "bench_quant_gemm: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  SQUEEZE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sm = prop.multiProcessorCount;
  const std::string device = env_or("SQUEEZE_DEVICE", prop.name), date = env_or("SQUEEZE_DATE", ""),
                    commit = env_or("SQUEEZE_COMMIT", "unknown");
  std::ofstream out;
  if (!out_path.empty()) out.open(out_path);
  torch::NoGradGuard ng;
  const bool modules_ok = !checks || module_checks();
  if (checks) std::printf("QuantizedLinear CUDA paths vs CPU: %s\n", modules_ok ? "all ok" : "SOME FAILED");
  const auto cuda = torch::TensorOptions().device(torch::kCUDA, 0);

  // memory roofline: device-to-device copy of 2 GiB (read + write)
  double copy_gbs = 0;
  {
    const std::size_t bytes = 2ull << 30;
    auto a = torch::empty({std::int64_t(bytes)}, cuda.dtype(torch::kUInt8)), b = torch::empty_like(a);
    const double ms = time_ms([&] { SQUEEZE_CUDA_CHECK(cudaMemcpyAsync(b.data_ptr(), a.data_ptr(), bytes, cudaMemcpyDeviceToDevice, nullptr)); },
                              10);
    copy_gbs = 2.0 * double(bytes) / (ms * 1e6);
    std::printf("device %s, %d SMs, device-to-device copy %.0f GB/s\n", device.c_str(), sm, copy_gbs);
  }

  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{4096, 4096}, {4096, 11008}, {11008, 4096}, {8192, 28672}};
  const std::vector<std::int64_t> batches = {1, 16, 64, 128};
  std::printf("%-22s %10s %10s %8s %10s %8s %6s %9s\n", "case", "ours ms", "cublas ms", "x cublas", "int4pk ms", "x int4pk", "roof", "rel err");
  for (auto [K, N] : shapes) {
    const auto p = random_int4(K, N, std::uint32_t(K * 31 + N));
    const auto t = squeeze::quant::to_tiles(p);
    auto d_tiles = torch::from_blob(const_cast<std::uint32_t*>(t.tiles.data()), {std::int64_t(t.tiles.size())}, torch::kInt32).to(cuda);
    auto d_scales = torch::from_blob(const_cast<half*>(t.scales.data()), {std::int64_t(t.scales.size())}, torch::kHalf).to(cuda);
    auto d_zeros = torch::from_blob(const_cast<std::uint8_t*>(t.zeros.data()), {std::int64_t(t.zeros.size())}, torch::kUInt8).to(cuda);
    // the same weights dequantized (for the correctness check) and the GPTQ-layout tensors
    auto d_qw = torch::from_blob(const_cast<std::int32_t*>(p.qweight.data()), {std::int64_t(p.qweight.size())}, torch::kInt32).to(cuda);
    auto d_qz = torch::from_blob(const_cast<std::int32_t*>(p.qzeros.data()), {std::int64_t(p.qzeros.size())}, torch::kInt32).to(cuda);
    auto d_sc = torch::from_blob(const_cast<half*>(p.scales.data()), {std::int64_t(p.scales.size())}, torch::kHalf).to(cuda);
    auto d_gi = torch::from_blob(const_cast<std::int32_t*>(p.g_idx.data()), {K}, torch::kInt32).to(cuda);
    auto w_deq = torch::empty({N, K}, cuda.dtype(torch::kFloat32));  // exact: fp16 scale * small integer
    const kq::GptqView view{d_qw.data_ptr<std::int32_t>(), d_qz.data_ptr<std::int32_t>(), reinterpret_cast<const half*>(d_sc.data_ptr()),
                            d_gi.data_ptr<std::int32_t>(), K, N, 4};
    SQUEEZE_CUDA_CHECK(kq::dequantize_cuda<float>(view, w_deq.data_ptr<float>(), nullptr));
    auto w_bf16 = torch::randn({N, K}, cuda.dtype(torch::kBFloat16)) * 0.02;  // the cuBLAS peer's weights

    // PyTorch's int4 weight-only GEMM (its own packing), when available on this build/GPU
    std::string int4_error;
    torch::Tensor pk, sz;
    try {
      auto wq = torch::randint(0, 256, {N, K / 2}, cuda.dtype(torch::kUInt8));
      pk = at::_convert_weight_to_int4pack(wq, 8);
      sz = torch::rand({K / 128, N, 2}, cuda.dtype(torch::kBFloat16));
    } catch (const std::exception& e) {
      int4_error = std::string(e.what()).substr(0, 200);
    }

    const double weight_bytes = double(K) * N / 2 + double(t.groups()) * N * 3;
    for (std::int64_t M : batches) {
      const std::string cs = "K" + std::to_string(K) + "_N" + std::to_string(N) + "_M" + std::to_string(M);
      if (!only.empty() && cs.find(only) == std::string::npos) continue;
      auto x = torch::randn({M, K}, cuda.dtype(torch::kBFloat16));
      auto y = torch::empty({M, N}, cuda.dtype(torch::kBFloat16));
      const auto shape = t.shape(M);
      const auto need = kq::qgemm_workspace_size<bf16>(M, shape, sm);
      auto partial = torch::empty({std::max<std::int64_t>(need.partial_elems, 1)}, cuda.dtype(torch::kFloat32));
      auto counters = torch::zeros({std::max<std::int64_t>(need.counter_elems, 1)}, cuda.dtype(torch::kInt32));
      const kq::QGemmWorkspace ws{partial.data_ptr<float>(), need.partial_elems, counters.data_ptr<int>(), need.counter_elems};
      auto ours = [&] {
        SQUEEZE_CUDA_CHECK(kq::qgemm_cuda<bf16>(reinterpret_cast<const bf16*>(x.data_ptr()),
                                                    reinterpret_cast<const std::uint32_t*>(d_tiles.data_ptr()),
                                                    reinterpret_cast<const half*>(d_scales.data_ptr()), d_zeros.data_ptr<std::uint8_t>(),
                                                    reinterpret_cast<bf16*>(y.data_ptr()), shape, ws, sm, nullptr));
      };
      ours();
      SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
      const auto ref = x.to(torch::kFloat32).matmul(w_deq.t());
      const double rel_err = ((y.to(torch::kFloat32) - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item<double>();

      const double t_ours = time_ms(ours, reps);
      torch::Tensor yc;
      const double t_cublas = time_ms([&] { yc = at::mm(x, w_bf16.t()); }, reps);
      double t_int4 = 0;
      if (int4_error.empty()) {
        try {
          torch::Tensor yi;
          t_int4 = time_ms([&] { yi = at::_weight_int4pack_mm(x, pk, 128, sz); }, reps);
        } catch (const std::exception& e) {
          int4_error = std::string(e.what()).substr(0, 200);
        }
      }
      // split-K sweep on the larger shapes (recorded in the JSON for tuning the plan's heuristic)
      nlohmann::json sweep = nlohmann::json::object();
      if (K * N >= 4096ll * 11008)
        for (int sp : {1, 2, 3, 4, 6, 8, 12, 16}) {
          const auto need_sp = kq::qgemm_workspace_size<bf16>(M, shape, sm, sp);
          auto partial_sp = torch::empty({std::max<std::int64_t>(need_sp.partial_elems, 1)}, cuda.dtype(torch::kFloat32));
          auto counters_sp = torch::zeros({std::max<std::int64_t>(need_sp.counter_elems, 1)}, cuda.dtype(torch::kInt32));
          const kq::QGemmWorkspace ws_sp{partial_sp.data_ptr<float>(), need_sp.partial_elems, counters_sp.data_ptr<int>(), need_sp.counter_elems};
          sweep[std::to_string(sp)] = time_ms(
              [&] {
                SQUEEZE_CUDA_CHECK(kq::qgemm_cuda<bf16>(reinterpret_cast<const bf16*>(x.data_ptr()),
                                                        reinterpret_cast<const std::uint32_t*>(d_tiles.data_ptr()),
                                                        reinterpret_cast<const half*>(d_scales.data_ptr()), d_zeros.data_ptr<std::uint8_t>(),
                                                        reinterpret_cast<bf16*>(y.data_ptr()), shape, ws_sp, sm, nullptr, sp));
              },
              20);
        }
      const int auto_splits = kq::detail::plan_for_device<bf16>(std::min<std::int64_t>(M, 128), shape, sm).splits;
      const double bytes = weight_bytes + double(M) * K * 2 + double(M) * N * 2;
      const double roof = bytes / (t_ours * 1e6) / copy_gbs;
      std::printf("%-22s %10.4f %10.4f %8.2f %10.4f %8.2f %6.2f %9.2e\n", cs.c_str(), t_ours, t_cublas, t_cublas / t_ours, t_int4,
                  t_int4 > 0 ? t_int4 / t_ours : 0.0, roof, rel_err);
      std::fflush(stdout);
      if (out) {
        nlohmann::json j = {{"bench", "gemm4"},
                            {"case", cs},
                            {"time_ms", t_ours},
                            {"peer", "cublas_bf16"},
                            {"peer_time_ms", t_cublas},
                            {"ratio_vs_peer", t_cublas / t_ours},
                            {"roofline_fraction", roof},
                            {"peer2", "aten_weight_int4pack_mm"},
                            {"peer2_time_ms", t_int4 > 0 ? nlohmann::json(t_int4) : nlohmann::json(nullptr)},
                            {"ratio_vs_peer2", t_int4 > 0 ? nlohmann::json(t_int4 / t_ours) : nlohmann::json(nullptr)},
                            {"max_rel_err", rel_err},
                            {"copy_gbs", copy_gbs},
                            {"splits", auto_splits},
                            {"splits_sweep_ms", sweep},
                            {"device", device},
                            {"date", date},
                            {"commit", commit}};
        if (!int4_error.empty()) j["peer2_error"] = int4_error;
        out << j.dump() << "\n";
        out.flush();
      }
    }
    if (!int4_error.empty()) std::printf("  aten::_weight_int4pack_mm unavailable: %s\n", int4_error.c_str());

  }
  return modules_ok ? 0 : 1;
}
