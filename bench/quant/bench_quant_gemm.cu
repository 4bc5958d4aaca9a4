// 4-bit GEMM benchmark (GPU): y [M, N] = x [M, K] bf16 * W^T with W 4-bit GPTQ (group 128, asymmetric).
// For each (K, N) and batch M it measures, in the same run:
//   ours       squeeze int4 tensor-core GEMM as the library dispatches it (kq::quant_gemm_cuda: the sm90 kernel
//              for 4-bit layers on sm_90a builds, qgemm_cuda otherwise)
//   variants   every configuration of TuningCfgs (gemm_configs.cuh) (rows per block, warps, tiles per warp, loads
//              in flight, register / cp.async / bulk loader, persistent grid, scaled B, register caps; names
//              spelled by kq::detail::cfg_name) at several K-range lengths (cps, 64-k chunks), with
//              its error; the fastest is reported beside the library's choice (to pick the dispatch table)
//   diag       the same weight stream with the math removed (load only) and with decode but no mma: how
//              far each stage is from the copy bandwidth
//   peer       cuBLAS bf16 GEMM through libtorch (at::mm on bf16 CUDA tensors, W [N, K] as nn.Linear stores it)
//   peer2      PyTorch's int4 weight-only GEMM at::_weight_int4pack_mm (group 128), when it runs here
//   deq+cublas dequantize the GPTQ layer to bf16, then cuBLAS (QuantizedLinear's path for large batches)
//   sm90       (last section) the Hopper GEMM (gemm/sm90.cuh) at batch 16..128: every configuration of
//              Sm90TuningCfgs at several K split counts, and qgemm_sm90_cuda as it would be
//              dispatched, beside the library's dispatch and cuBLAS bf16 (needs sm_90a device code)
//   roofline   bytes our kernel must read (weights + scales + zeros + x) / time, over the bandwidth of a
//              device-to-device copy measured in the same run
// Times: CUDA events around each launch, median of --reps, L2 flushed before each launch; every batch of
// launches is queued behind a spin kernel so CPU launch overhead never shows as GPU time.
// Correctness: ours and every variant vs dequantize + fp32 matmul on the same weights (max error relative
// to max |y|), per case.
// Per configuration, once: registers per thread, threads, shared memory of its plan, local (spill) bytes and
// the blocks per SM the occupancy calculator allows ("cfg" lines; per case in the JSON's variants_info).
// A watchdog ends the process (exit code 3, naming the configuration) when nothing progresses for 150 s.
// Usage: bench_quant_gemm [--out FILE] [--reps N] [--only CASE] [--no-checks] [--no-variants] [--no-sm90 | --sm90-only]
//                         [--l2-flush clean|dirty]   (how L2 is swept before each timed launch: gemm_timing.cuh)
//   (env SQUEEZE_DEVICE, SQUEEZE_DATE, SQUEEZE_COMMIT)
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <chrono>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include <squeeze/error.hpp>
#include <squeeze/kernels/quant/dequant.cuh>
#include <squeeze/kernels/quant/gemm.cuh>
#include <squeeze/nn/quantized_linear.hpp>
#include <squeeze/quant/tiles.hpp>
#include <squeeze/quant/rtn.hpp>

#include "gemm_configs.cuh"
#include "gemm_timing.cuh"

namespace kq = squeeze::kernels::quant;
namespace bg = squeeze::bench::gemm;
using squeeze::bf16;
using squeeze::half;

namespace {
using squeeze::bench::time_ms;
using squeeze::bench::watchdog_note;
using squeeze::bench::start_watchdog;

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

// A random GPTQ layer [N out, K in] of `bits` bits, group 128: random codes, zeros in [1, 2^bits - 1],
// scales ~ 1e-2.
squeeze::quant::PackedLinear random_layer(int bits, std::int64_t K, std::int64_t N, std::uint32_t seed) {
  std::mt19937 rng(seed);
  squeeze::quant::PackedLinear p;
  p.bits = bits;
  p.group_size = 128;
  p.in = K;
  p.out = N;
  p.qweight.resize(p.qweight_rows() * N);
  for (auto& w : p.qweight) w = std::int32_t(rng());
  p.qzeros.assign(p.groups() * p.qzeros_cols(), 0);
  const std::uint32_t maxq = (1u << bits) - 1u;
  for (std::int64_t g = 0; g < p.groups(); ++g)  // stored as zero - 1 (GPTQ v1)
    for (std::int64_t o = 0; o < N; ++o) kq::stream_put(p.qzeros.data() + g * p.qzeros_cols(), 1, o, bits, rng() % maxq);
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
          torch::Tensor yg;
          try {
            yg = gpu->forward(x.cuda()).to(torch::kCPU, torch::kFloat32);
          } catch (const std::exception& e) {  // report and go on: the benchmark still runs
            std::printf("module check bits %d M %lld: %s\n", bits, (long long)M, std::string(e.what()).substr(0, 400).c_str());
            ok = false;
            ++checks;
            continue;
          }
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

// Times every configuration of a CfgList at several K-range lengths; fills {name: {cps: ms}} and
// {name: rel err} (at the plan's own cps), and tracks the fastest correct one.
struct VariantResult {
  nlohmann::json times = nlohmann::json::object(), errors = nlohmann::json::object();
  nlohmann::json info = nlohmann::json::object();  // {name: {regs, threads, smem, blocks_per_sm, blocks, splits, cps}} of the plan's own cps
  std::string best_name;
  int best_cps = 0;
  double best_ms = 0;
};
struct GemmBuffers {
  const bf16* x;
  const std::uint32_t* tiles;
  const half* scales;
  const std::uint8_t* zeros;
  bf16* y;
  torch::Tensor y_tensor, ref;  // y as a tensor, reference fp32 [M, N]
};
template <int BITS, class C>
void time_variant(const GemmBuffers& b, const kq::QGemmShape& shape, int sm, int reps, bool diagnostic, VariantResult& r) {
  if constexpr (BITS == 3 && C::LOADER == kq::QGemmLoader::CpAsync) {
    return;  // 3-bit tiles take the register loader only
  } else {
  constexpr int rows = C::ROWS;
  if (rows > std::max<std::int64_t>(16, shape.M) || rows * 8 < shape.M) return;  // far from this batch: skip
  if (C::SWAP && shape.M > 2 * rows) return;  // weights-as-A configurations are for batch 1..16
  const auto cuda = torch::TensorOptions().device(torch::kCUDA, 0);
  nlohmann::json t = nlohmann::json::object();
  int last_splits = -1;
  for (int cps : {0, 4, 8, 16, 32}) {
    const auto plan = kq::plan_qgemm(shape, kq::qgemm_geometry<C, BITS>(), sm, cps);
    if (cps > 0 && plan.splits == last_splits) continue;  // clamped to a plan already timed
    watchdog_note(kq::detail::cfg_name<C>() + " (" + std::to_string(BITS) + "-bit, " + kq::describe(plan) + ")");
    auto partial = torch::empty({std::max<std::int64_t>(plan.partial_elems, 1)}, cuda.dtype(torch::kFloat32));
    auto counters = torch::zeros({std::max<std::int64_t>(plan.counter_elems, 1)}, cuda.dtype(torch::kInt32));
    const kq::QGemmWorkspace ws{partial.data_ptr<float>(), plan.partial_elems, counters.data_ptr<int>(), plan.counter_elems};
    auto run = [&] { SQUEEZE_CUDA_CHECK((kq::detail::launch_qgemm_cfg<bf16, BITS, C>(b.x, b.tiles, b.scales, b.zeros, b.y, shape, plan, ws, nullptr))); };
    if (cps == 0) last_splits = plan.splits;
    if (const cudaError_t e = kq::detail::launch_qgemm_cfg<bf16, BITS, C>(b.x, b.tiles, b.scales, b.zeros, b.y, shape, plan, ws, nullptr);
        e != cudaSuccess) {  // a configuration that cannot launch here is reported, not fatal
      std::printf("  variant %s (%s): %s\n", kq::detail::cfg_name<C>().c_str(), kq::describe(plan).c_str(), cudaGetErrorString(e));
      cudaGetLastError();
      continue;
    }
    if (cps == 0) {  // registers and occupancy: what limits the warps in flight (printed once per configuration)
      cudaFuncAttributes fa{};
      int per_sm = 0;
      const auto kernel = kq::detail::qgemm_kernel<bf16, BITS, C>;
      if (cudaFuncGetAttributes(&fa, kernel) == cudaSuccess &&
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, C::THREADS, std::size_t(plan.smem_bytes)) == cudaSuccess) {
        r.info[kq::detail::cfg_name<C>()] = {{"regs", fa.numRegs}, {"threads", C::THREADS}, {"smem", plan.smem_bytes + int(fa.sharedSizeBytes)},
                                             {"local_bytes", int(fa.localSizeBytes)}, {"blocks_per_sm", per_sm}, {"blocks", plan.blocks()},
                                             {"splits", plan.splits}, {"cps", plan.cps}};
        static std::set<std::string> printed;
        if (printed.insert(std::to_string(BITS) + kq::detail::cfg_name<C>()).second)
          std::printf("  cfg %-16s %d-bit: %3d regs/thread, %3d threads, %6d B shared (plan at %s), local %d B, %d blocks/SM = %2d warps/SM\n",
                      kq::detail::cfg_name<C>().c_str(), BITS, fa.numRegs, C::THREADS, plan.smem_bytes + int(fa.sharedSizeBytes),
                      kq::describe(plan).c_str(), int(fa.localSizeBytes), per_sm, per_sm * C::THREADS / 32);
      }
      cudaGetLastError();
    }
    if (cps == 0 && !diagnostic) {
      run();
      SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
      const double err = ((b.y_tensor.to(torch::kFloat32) - b.ref).abs().max() / b.ref.abs().max().clamp_min(1e-30)).item<double>();
      r.errors[kq::detail::cfg_name<C>()] = err;
      if (!(err < 2e-2)) {  // a wrong kernel never wins
        std::printf("  variant %s: rel err %.2e FAILED\n", kq::detail::cfg_name<C>().c_str(), err);
        return;
      }
    }
    const double ms = time_ms(run, reps);
    t[std::to_string(plan.cps)] = ms;
    if (!diagnostic && (r.best_ms == 0 || ms < r.best_ms)) {
      r.best_ms = ms;
      r.best_name = kq::detail::cfg_name<C>();
      r.best_cps = plan.cps;
    }
  }
  r.times[kq::detail::cfg_name<C>()] = t;
  }
}
template <int BITS, class... Cs>
void time_variants(bg::CfgList<Cs...>, const GemmBuffers& b, const kq::QGemmShape& shape, int sm, int reps, bool diagnostic,
                   VariantResult& r) {
  (time_variant<BITS, Cs>(b, shape, sm, reps, diagnostic, r), ...);
}
double min_time(const nlohmann::json& times) {  // fastest entry of {name: {cps: ms}}
  double best = 0;
  for (const auto& [name, per] : times.items())
    for (const auto& [cps, ms] : per.items())
      if (best == 0 || ms.get<double>() < best) best = ms.get<double>();
  return best;
}

// A layer on the device: kernel tiles, the GPTQ-layout tensors (for the GEMV and dequantize peers) and the
// exact fp32 dequantized weights (fp16 scale * small integer) the correctness check multiplies by.
struct DeviceLayer {
  torch::Tensor tiles, scales, zeros, qweight, qzeros, gptq_scales, g_idx, w_deq;  // w_deq: fp32 [N, K]
  kq::GptqView view;
};
DeviceLayer upload_layer(const squeeze::quant::PackedLinear& p, const squeeze::quant::QTiles& t, std::int64_t K, std::int64_t N, int bits,
                         const torch::TensorOptions& cuda) {
  auto up = [&](const auto& v, torch::ScalarType type) {
    using E = typename std::decay_t<decltype(v)>::value_type;
    return torch::from_blob(const_cast<E*>(v.data()), {std::int64_t(v.size())}, type).to(cuda.device());
  };
  DeviceLayer d{up(t.tiles, torch::kInt32), up(t.scales, torch::kHalf), up(t.zeros, torch::kUInt8), up(p.qweight, torch::kInt32),
                up(p.qzeros, torch::kInt32), up(p.scales, torch::kHalf), up(p.g_idx, torch::kInt32),
                torch::empty({N, K}, cuda.dtype(torch::kFloat32)), {}};
  d.view = kq::GptqView{d.qweight.data_ptr<std::int32_t>(), d.qzeros.data_ptr<std::int32_t>(), reinterpret_cast<const half*>(d.gptq_scales.data_ptr()),
                        d.g_idx.data_ptr<std::int32_t>(), K, N, bits};
  SQUEEZE_CUDA_CHECK(kq::dequantize_cuda<float>(d.view, d.w_deq.data_ptr<float>(), nullptr));
  return d;
}

// One batch size: activations, output, the library's workspace and the fp32 reference; the library's
// dispatch runs once and its error against the reference is measured (a failing launch names its plan).
struct GemmCase {
  torch::Tensor x, y, partial, counters;
  kq::QGemmShape shape;
  kq::QGemmWorkspace ws;
  GemmBuffers buf;
  double rel_err;
  void run_ours(int sm) const { SQUEEZE_CUDA_CHECK(kq::quant_gemm_cuda<bf16>(buf.x, buf.tiles, buf.scales, buf.zeros, buf.y, shape, ws, sm, nullptr)); }
};
GemmCase prepare_case(std::int64_t M, std::int64_t K, std::int64_t N, const squeeze::quant::QTiles& t, const DeviceLayer& d, int sm,
                      const torch::TensorOptions& cuda) {
  GemmCase c;
  c.x = torch::randn({M, K}, cuda.dtype(torch::kBFloat16));
  c.y = torch::empty({M, N}, cuda.dtype(torch::kBFloat16));
  c.shape = t.shape(M);
  const auto need = kq::quant_gemm_workspace_size(c.shape, sm);
  c.partial = torch::empty({std::max<std::int64_t>(need.partial_elems, 1)}, cuda.dtype(torch::kFloat32));
  c.counters = torch::zeros({std::max<std::int64_t>(need.counter_elems, 1)}, cuda.dtype(torch::kInt32));
  c.ws = kq::QGemmWorkspace{c.partial.data_ptr<float>(), need.partial_elems, c.counters.data_ptr<int>(), need.counter_elems};
  c.buf = GemmBuffers{reinterpret_cast<const bf16*>(c.x.data_ptr()), reinterpret_cast<const std::uint32_t*>(d.tiles.data_ptr()),
                      reinterpret_cast<const half*>(d.scales.data_ptr()), d.zeros.data_ptr<std::uint8_t>(),
                      reinterpret_cast<bf16*>(c.y.data_ptr()), c.y, c.x.to(torch::kFloat32).matmul(d.w_deq.t())};
  if (const cudaError_t e = kq::quant_gemm_cuda<bf16>(c.buf.x, c.buf.tiles, c.buf.scales, c.buf.zeros, c.buf.y, c.shape, c.ws, sm, nullptr); e != cudaSuccess)
    throw std::runtime_error(std::string("quant_gemm_cuda (") + kq::quant_gemm_describe(c.shape, sm) + "): " + cudaGetErrorString(e));
  SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
  c.rel_err = ((c.y.to(torch::kFloat32) - c.buf.ref).abs().max() / c.buf.ref.abs().max().clamp_min(1e-30)).item<double>();
  return c;
}

// ---- the sm_90 wgmma GEMM: configuration C at K split counts (the plan's own first), error once, then times
struct Sm90Result {
  nlohmann::json times = nlohmann::json::object(), errors = nlohmann::json::object(), info = nlohmann::json::object();
  std::string best_name;
  int best_splits = 0;
  double best_ms = 0;
};
template <class C>
void time_sm90_cfg(const GemmBuffers& b, const kq::QGemmShape& shape, int sm, int reps, Sm90Result& r) {
  const std::string name = kq::detail::sm90_cfg_name<C>();
  nlohmann::json t = nlohmann::json::object();
  std::set<int> seen;
  for (int sp : {0, 1, 2, 4, 8}) {
    const auto plan = kq::plan_qgemm_sm90<C>(shape, kq::detail::sm90_capacity<C>(sm), sp);
    if (!seen.insert(plan.splits).second) continue;  // clamped to a plan already timed
    watchdog_note(name + " (" + kq::describe(plan) + ")");
    const auto cuda = torch::TensorOptions().device(torch::kCUDA, 0);
    torch::Tensor partial = torch::empty({std::max<std::int64_t>(plan.partial_elems, 1)}, cuda.dtype(torch::kFloat32));
    torch::Tensor counters = torch::zeros({std::max<std::int64_t>(plan.counter_elems, 1)}, cuda.dtype(torch::kInt32));
    const kq::QGemmWorkspace ws{partial.data_ptr<float>(), plan.partial_elems, counters.data_ptr<int>(), plan.counter_elems};
    auto launch = [&] { return kq::detail::launch_qgemm_sm90_cfg<bf16, C>(b.x, b.tiles, b.scales, b.zeros, b.y, shape, plan, ws, nullptr); };
    if (const cudaError_t e = launch(); e != cudaSuccess) {  // reported, not fatal
      std::printf("  sm90 %s (%s): %s\n", name.c_str(), kq::describe(plan).c_str(), cudaGetErrorString(e));
      cudaGetLastError();
      return;
    }
    SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
    const double err = ((b.y_tensor.to(torch::kFloat32) - b.ref).abs().max() / b.ref.abs().max().clamp_min(1e-30)).item<double>();
    if (sp == 0) {
      r.errors[name] = err;
      cudaFuncAttributes fa{};
      int per_sm = 0;
      const auto kernel = plan.cluster ? kq::detail::qgemm_sm90_kernel<bf16, C, true> : kq::detail::qgemm_sm90_kernel<bf16, C, false>;
      if (cudaFuncGetAttributes(&fa, kernel) == cudaSuccess &&
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, C::THREADS, std::size_t(C::SMEM_BYTES)) == cudaSuccess) {
        r.info[name] = {{"regs", fa.numRegs}, {"threads", C::THREADS}, {"smem", C::SMEM_BYTES + int(fa.sharedSizeBytes)},
                        {"local_bytes", int(fa.localSizeBytes)}, {"blocks_per_sm", per_sm}, {"blocks", plan.blocks()},
                        {"splits", plan.splits}, {"cps", plan.cps}};
        static std::set<std::string> printed;
        if (printed.insert(name).second)
          std::printf("  cfg %-14s %3d regs/thread, %3d threads, %6d B shared, local %d B, %d blocks/SM\n", name.c_str(), fa.numRegs, C::THREADS,
                      C::SMEM_BYTES + int(fa.sharedSizeBytes), int(fa.localSizeBytes), per_sm);
      }
      cudaGetLastError();
    }
    if (!(err < 2e-2)) {  // a wrong kernel never wins
      std::printf("  sm90 %s (%s): rel err %.2e FAILED\n", name.c_str(), kq::describe(plan).c_str(), err);
      r.errors[name + "@" + std::to_string(plan.splits)] = err;
      continue;
    }
    const double ms = time_ms([&] { SQUEEZE_CUDA_CHECK(launch()); }, reps);
    t[std::to_string(plan.splits)] = ms;
    if (r.best_ms == 0 || ms < r.best_ms) {
      r.best_ms = ms;
      r.best_name = name;
      r.best_splits = plan.splits;
    }
  }
  r.times[name] = t;
}
template <class... Cs>
void time_sm90_cfgs(bg::CfgList<Cs...>, const GemmBuffers& b, const kq::QGemmShape& shape, int sm, int reps, Sm90Result& r) {
  (time_sm90_cfg<Cs>(b, shape, sm, reps, r), ...);
}

// The wgmma section: for each 4-bit shape and batch, the library's dispatch, cuBLAS bf16, qgemm_sm90_cuda and
// every wgmma configuration. Returns false when a case failed.
bool sm90_section(const std::vector<std::pair<std::int64_t, std::int64_t>>& shapes, int sm, int reps, const std::string& only, double copy_gbs,
                  std::ofstream& out, const std::string& device, const std::string& date, const std::string& commit) {
  if (!kq::qgemm_sm90_supported()) {
    std::printf("\nwgmma GEMM: not run (needs an sm_90 device and sm_90a device code: configure with -DCMAKE_CUDA_ARCHITECTURES=90a)\n");
    return true;
  }
  bool ok = true;
  const auto cuda = torch::TensorOptions().device(torch::kCUDA, 0);
  std::printf("\nwgmma GEMM (gemm/sm90.cuh): ours = the library's dispatch (quant_gemm_cuda); sm90 = qgemm_sm90_cuda; best = fastest wgmma configuration\n");
  std::printf("%-18s %8s %8s %6s | %8s %6s %6s | %-14s %3s %8s %6s | %5s | %8s\n", "case", "ours ms", "cublas", "x cub", "sm90 ms", "x cub", "splits",
              "best sm90", "sp", "best ms", "x cub", "roof", "rel err");
  for (auto [K, N] : shapes) {
    watchdog_note("sm90: preparing the 4-bit layer " + std::to_string(K) + " x " + std::to_string(N));
    const auto p = random_layer(4, K, N, std::uint32_t(K * 31 + N));
    const auto t = squeeze::quant::to_tiles(p);
    const DeviceLayer d = upload_layer(p, t, K, N, 4, cuda);
    auto w_bf16 = torch::randn({N, K}, cuda.dtype(torch::kBFloat16)) * 0.02;
    const double weight_bytes = double(K) * N / 2 + double(t.groups()) * N * 3;
    for (std::int64_t M : {16, 33, 64, 128}) {
      const std::string cs = "K" + std::to_string(K) + "_N" + std::to_string(N) + "_M" + std::to_string(M);
      if (!only.empty() && cs.find(only) == std::string::npos) continue;
      watchdog_note("sm90 " + cs);
      try {
        const GemmCase gc = prepare_case(M, K, N, t, d, sm, cuda);
        const double t_ours = time_ms([&] { gc.run_ours(sm); }, reps);
        torch::Tensor yc;
        const double t_cublas = time_ms([&] { yc = at::mm(gc.x, w_bf16.t()); }, reps);
        // qgemm_sm90_cuda: its own configuration and plan
        const auto need = kq::qgemm_sm90_workspace_size(gc.shape, sm);
        auto partial = torch::empty({std::max<std::int64_t>(need.partial_elems, 1)}, cuda.dtype(torch::kFloat32));
        auto counters = torch::zeros({std::max<std::int64_t>(need.counter_elems, 1)}, cuda.dtype(torch::kInt32));
        const kq::QGemmWorkspace ws{partial.data_ptr<float>(), need.partial_elems, counters.data_ptr<int>(), need.counter_elems};
        const auto& b = gc.buf;
        auto run_sm90 = [&] { SQUEEZE_CUDA_CHECK(kq::qgemm_sm90_cuda<bf16>(b.x, b.tiles, b.scales, b.zeros, b.y, gc.shape, ws, sm, nullptr)); };
        run_sm90();
        SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
        const double err = ((b.y_tensor.to(torch::kFloat32) - b.ref).abs().max() / b.ref.abs().max().clamp_min(1e-30)).item<double>();
        const bool good = err < 2e-2;
        const double t_sm90 = good ? time_ms(run_sm90, reps) : 0.0;
        Sm90Result r;
        time_sm90_cfgs(bg::Sm90TuningCfgs{}, b, gc.shape, sm, std::max(10, reps / 2), r);
        const double bytes = weight_bytes + double(M) * K * 2 + double(M) * N * 2;
        const auto plan = kq::qgemm_sm90_plan(gc.shape, sm);
        std::printf("%-18s %8.4f %8.4f %6.2f | %8.4f %6.2f %6d | %-14s %3d %8.4f %6.2f | %5.2f | %8.1e%s\n", cs.c_str(), t_ours, t_cublas, t_cublas / t_ours,
                    t_sm90, t_sm90 > 0 ? t_cublas / t_sm90 : 0.0, plan.splits, r.best_name.c_str(), r.best_splits, r.best_ms,
                    r.best_ms > 0 ? t_cublas / r.best_ms : 0.0, t_sm90 > 0 ? bytes / (t_sm90 * 1e6) / copy_gbs : 0.0, err, good ? "" : " FAILED");
        std::fflush(stdout);
        ok = ok && good;
        if (out) {
          nlohmann::json j = {{"bench", "gemm4_sm90"},
                              {"case", cs},
                              {"time_ms", good ? nlohmann::json(t_sm90) : nlohmann::json(nullptr)},
                              {"peer", "cublas_bf16"},
                              {"peer_time_ms", t_cublas},
                              {"ratio_vs_peer", good ? nlohmann::json(t_cublas / t_sm90) : nlohmann::json(nullptr)},
                              {"ours_time_ms", t_ours},
                              {"ours_ratio_vs_peer", t_cublas / t_ours},
                              {"max_rel_err", err},
                              {"plan", kq::describe(plan)},
                              {"best_variant", r.best_name},
                              {"best_splits", r.best_splits},
                              {"best_time_ms", r.best_ms > 0 ? nlohmann::json(r.best_ms) : nlohmann::json(nullptr)},
                              {"best_ratio_vs_peer", r.best_ms > 0 ? nlohmann::json(t_cublas / r.best_ms) : nlohmann::json(nullptr)},
                              {"variants_ms", r.times},
                              {"variants_err", r.errors},
                              {"variants_info", r.info},
                              {"copy_gbs", copy_gbs},
                            {"l2_flush", squeeze::bench::l2_flush_name()},
                              {"device", device},
                              {"date", date},
                              {"commit", commit}};
          out << j.dump() << "\n";
          out.flush();
        }
      } catch (const std::exception& e) {
        std::printf("sm90 %s: FAILED: %s\n", cs.c_str(), std::string(e.what()).substr(0, 400).c_str());
        ok = false;
      }
    }
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path;
  int reps = 50;
  bool checks = true, variants = true, sm90 = true, sm90_only = false;
  std::string only;  // run only cases whose name contains this (e.g. for a profiler)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else if (a == "--no-checks") checks = false;
    else if (a == "--no-variants") variants = false;
    else if (a == "--no-sm90") sm90 = false;
    else if (a == "--sm90-only") sm90_only = true;
    else if (a == "--l2-flush" && i + 1 < argc) {
      if (!squeeze::bench::set_l2_flush(argv[0], argv[++i])) return 2;
    }
    else {
      std::fprintf(stderr, "usage: %s [--out FILE] [--reps N] [--only CASE-SUBSTRING] [--no-checks] [--no-variants] [--no-sm90 | --sm90-only] [--l2-flush clean|dirty]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop{};
  if (!squeeze::bench::first_device("bench_quant_gemm", prop)) return 1;
  const int sm = prop.multiProcessorCount;
  const std::string device = env_or("SQUEEZE_DEVICE", prop.name), date = env_or("SQUEEZE_DATE", ""),
                    commit = env_or("SQUEEZE_COMMIT", "unknown");
  std::ofstream out;
  if (!out_path.empty()) out.open(out_path);
  torch::NoGradGuard ng;
  start_watchdog("bench_quant_gemm");
  watchdog_note("module checks");
  const bool modules_ok = !checks || sm90_only || module_checks();
  watchdog_note("copy bandwidth");
  bool any_failed = false;
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
  // --sm90-only: just the wgmma section (no module checks, no 4- and 3-bit tables)
  const std::vector<std::pair<std::int64_t, std::int64_t>> main_shapes = sm90_only ? decltype(shapes){} : shapes;
  std::printf("ours: the library's dispatch; best: fastest variant (name, cps) of this run; load/decode: diagnostics (no math / no mma);\n"
              "roof: fraction of copy bandwidth for ours / best / load-only\n");
  std::printf("%-18s %8s %8s %6s | %-14s %4s %8s %6s | %8s %8s | %8s %6s | %5s %5s %5s | %8s\n", "case", "ours ms", "cublas", "x cub", "best variant",
              "cps", "best ms", "x cub", "load ms", "decode", "int4pk", "x i4", "roof", "best", "load", "rel err");
  for (auto [K, N] : main_shapes) {
    watchdog_note("preparing the 4-bit layer " + std::to_string(K) + " x " + std::to_string(N));
    const auto p = random_layer(4, K, N, std::uint32_t(K * 31 + N));
    const auto t = squeeze::quant::to_tiles(p);
    const DeviceLayer d = upload_layer(p, t, K, N, 4, cuda);
    const kq::GptqView& view = d.view;
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
      watchdog_note(cs + " (ours, cuBLAS, peers)");
      try {
      const GemmCase gc = prepare_case(M, K, N, t, d, sm, cuda);
      const torch::Tensor& x = gc.x;
      const kq::QGemmShape& shape = gc.shape;
      const GemmBuffers& buf = gc.buf;
      const double rel_err = gc.rel_err;
      auto ours = [&] { gc.run_ours(sm); };

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
      // dequantize (GPTQ layout -> bf16) + cuBLAS: the alternative for large batches
      double t_deq = 0;
      if (M >= 16) {
        auto wb = torch::empty({N, K}, cuda.dtype(torch::kBFloat16));
        t_deq = time_ms(
            [&] {
              SQUEEZE_CUDA_CHECK(kq::dequantize_cuda<bf16>(view, reinterpret_cast<bf16*>(wb.data_ptr()), nullptr));
              yc = at::mm(x, wb.t());
            },
            reps);
      }
      VariantResult var, diag;
      if (variants) {
        time_variants<4>(bg::TuningCfgs{}, buf, shape, sm, std::max(10, reps / 2), false, var);
        time_variants<4>(bg::DiagnosticCfgs{}, buf, shape, sm, std::max(10, reps / 2), true, diag);
      }
      const auto plan = kq::qgemm_plan(shape, sm);
      const double bytes = weight_bytes + double(M) * K * 2 + double(M) * N * 2;
      const double roof = bytes / (t_ours * 1e6) / copy_gbs;
      const double t_load = min_time(diag.times);
      double t_load_only = 0, t_decode = 0;
      for (const auto& [name, per] : diag.times.items()) {
        const double m = min_time(nlohmann::json{{name, per}});
        double& slot = name.find("-load") != std::string::npos ? t_load_only : t_decode;
        if (slot == 0 || m < slot) slot = m;
      }
      (void)t_load;
      std::printf("%-18s %8.4f %8.4f %6.2f | %-14s %4d %8.4f %6.2f | %8.4f %8.4f | %8.4f %6.2f | %5.2f %5.2f %5.2f | %8.1e\n", cs.c_str(), t_ours, t_cublas,
                  t_cublas / t_ours, var.best_name.c_str(), var.best_cps, var.best_ms, var.best_ms > 0 ? t_cublas / var.best_ms : 0.0, t_load_only,
                  t_decode, t_int4, t_int4 > 0 ? t_int4 / t_ours : 0.0, roof, var.best_ms > 0 ? bytes / (var.best_ms * 1e6) / copy_gbs : 0.0,
                  t_load_only > 0 ? bytes / (t_load_only * 1e6) / copy_gbs : 0.0, rel_err);
      if (t_deq > 0) std::printf("%-18s   dequantize + cuBLAS %.4f ms (%.2fx cuBLAS)\n", "", t_deq, t_cublas / t_deq);
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
                            {"l2_flush", squeeze::bench::l2_flush_name()},
                            {"splits", plan.splits},  // the mma.sync kernel's plan (at M > 32 on sm_90a, "dispatch" says what ran)
                            {"cps", plan.cps},
                            {"rows_per_block", plan.rows},
                            {"default_cfg", kq::qgemm_cfg_name(shape)},
                            {"dispatch", kq::quant_gemm_describe(shape, sm)},
                            {"best_variant", var.best_name},
                            {"best_cps", var.best_cps},
                            {"best_time_ms", var.best_ms > 0 ? nlohmann::json(var.best_ms) : nlohmann::json(nullptr)},
                            {"best_ratio_vs_peer", var.best_ms > 0 ? nlohmann::json(t_cublas / var.best_ms) : nlohmann::json(nullptr)},
                            {"load_only_ms", t_load_only > 0 ? nlohmann::json(t_load_only) : nlohmann::json(nullptr)},
                            {"load_decode_ms", t_decode > 0 ? nlohmann::json(t_decode) : nlohmann::json(nullptr)},
                            {"deq_cublas_ms", t_deq > 0 ? nlohmann::json(t_deq) : nlohmann::json(nullptr)},
                            {"variants_ms", var.times},
                            {"variants_err", var.errors},
                            {"variants_info", var.info},
                            {"diagnostics_ms", diag.times},
                            {"device", device},
                            {"date", date},
                            {"commit", commit}};
        if (!int4_error.empty()) j["peer2_error"] = int4_error;
        out << j.dump() << "\n";
        out.flush();
      }
      } catch (const std::exception& e) {  // a failing case is reported; the others still run
        std::printf("%s: FAILED: %s\n", cs.c_str(), std::string(e.what()).substr(0, 400).c_str());
        any_failed = true;
      }
    }
    if (!int4_error.empty()) std::printf("  aten::_weight_int4pack_mm unavailable: %s\n", int4_error.c_str());
  }

  // ---- 3-bit (group 128) at batch 1..8: the tile kernel (weights repacked at load) against cuBLAS bf16, the
  // GEMV that reads the GPTQ layout directly, and the copy bandwidth
  std::printf("\n3-bit: %-18s %8s %8s %6s | %-14s %4s %8s %6s | %8s %6s | %5s | %8s\n", "case", "ours ms", "cublas", "x cub", "best variant", "cps",
              "best ms", "x cub", "gptq gemv", "x ours", "roof", "rel err");
  for (auto [K, N] : sm90_only ? std::vector<std::pair<std::int64_t, std::int64_t>>{}
                                : std::vector<std::pair<std::int64_t, std::int64_t>>{{4096, 11008}, {11008, 4096}, {8192, 28672}}) {
    watchdog_note("preparing the 3-bit layer " + std::to_string(K) + " x " + std::to_string(N));
    const auto p = random_layer(3, K, N, std::uint32_t(K * 17 + N));
    const auto t = squeeze::quant::to_tiles(p);
    const DeviceLayer d = upload_layer(p, t, K, N, 3, cuda);
    const kq::GptqView& view = d.view;
    auto w_bf16 = torch::randn({N, K}, cuda.dtype(torch::kBFloat16)) * 0.02;
    const double weight_bytes = double(K) * N * 3 / 8 + double(t.groups()) * N * 3;
    for (std::int64_t M : {1, 4, 8}) {
      const std::string cs = "K" + std::to_string(K) + "_N" + std::to_string(N) + "_M" + std::to_string(M);
      if (!only.empty() && cs.find(only) == std::string::npos) continue;
      watchdog_note(cs + " (ours, cuBLAS, peers)");
      try {
      const GemmCase gc = prepare_case(M, K, N, t, d, sm, cuda);
      const torch::Tensor& x = gc.x;
      const kq::QGemmShape& shape = gc.shape;
      const GemmBuffers& buf = gc.buf;
      const double rel_err = gc.rel_err;
      auto ours = [&] { gc.run_ours(sm); };
      const double t_ours = time_ms(ours, reps);
      torch::Tensor yc;
      const double t_cublas = time_ms([&] { yc = at::mm(x, w_bf16.t()); }, reps);
      auto acc = torch::empty({M, N}, cuda.dtype(torch::kFloat32));
      const double t_gemv = time_ms(
          [&] {
            SQUEEZE_CUDA_CHECK(kq::gemv_cuda<bf16>(view, buf.x, buf.y, int(M), acc.data_ptr<float>(), nullptr));
          },
          std::max(5, reps / 5));
      VariantResult var;
      if (variants) time_variants<3>(bg::TuningCfgs{}, buf, shape, sm, std::max(10, reps / 2), false, var);
      const double bytes = weight_bytes + double(M) * K * 2 + double(M) * N * 2;
      const double roof = bytes / (t_ours * 1e6) / copy_gbs;
      std::printf("3-bit: %-18s %8.4f %8.4f %6.2f | %-14s %4d %8.4f %6.2f | %8.4f %6.2f | %5.2f | %8.1e\n", cs.c_str(), t_ours, t_cublas,
                  t_cublas / t_ours, var.best_name.c_str(), var.best_cps, var.best_ms, var.best_ms > 0 ? t_cublas / var.best_ms : 0.0, t_gemv,
                  t_gemv / t_ours, roof, rel_err);
      std::fflush(stdout);
      if (out) {
        nlohmann::json j = {{"bench", "gemv3"},
                            {"case", cs},
                            {"time_ms", t_ours},
                            {"peer", "cublas_bf16"},
                            {"peer_time_ms", t_cublas},
                            {"ratio_vs_peer", t_cublas / t_ours},
                            {"roofline_fraction", roof},
                            {"gptq_layout_gemv_ms", t_gemv},
                            {"max_rel_err", rel_err},
                            {"copy_gbs", copy_gbs},
                            {"l2_flush", squeeze::bench::l2_flush_name()},
                            {"best_variant", var.best_name},
                            {"best_cps", var.best_cps},
                            {"best_time_ms", var.best_ms > 0 ? nlohmann::json(var.best_ms) : nlohmann::json(nullptr)},
                            {"variants_ms", var.times},
                            {"variants_err", var.errors},
                            {"variants_info", var.info},
                            {"device", device},
                            {"date", date},
                            {"commit", commit}};
        out << j.dump() << "\n";
        out.flush();
      }
      } catch (const std::exception& e) {
        std::printf("3-bit %s: FAILED: %s\n", cs.c_str(), std::string(e.what()).substr(0, 400).c_str());
        any_failed = true;
      }
    }
  }
  // last: a wgmma kernel that faults cannot take the tables above with it
  if (sm90 || sm90_only) any_failed = !sm90_section(shapes, sm, reps, only, copy_gbs, out, device, date, commit) || any_failed;
  return modules_ok && !any_failed ? 0 : 1;
}
