// GPTQ dequantize benchmark (GPU, no libtorch): W [N, K] from a packed GPTQ layer (qweight / qzeros / scales / g_idx),
// the kernel QuantizedLinear runs for its large-batch forward and for every backward (dX = dY W, LoRA on a GPTQ base).
// For each of the four LLaMA (K, N), in the same run, cold L2, median of --reps:
//   dequant      kq::dequantize_cuda (tiled, kernels/quant/dequant.cuh) at 4 bits into bf16, fp16 and
//                float, with act-order g_idx (4 bits, bf16), and at 2 / 3 / 8 bits into bf16
//   elementwise  the per-element kernel dequantize_cuda replaced (one thread per W element), the peer;
//                every output is compared with it byte for byte ("BAD" otherwise)
//   roofline     (qweight + qzeros + scales + g_idx + W bytes) / time over a device-to-device copy's bandwidth
//                measured in the same run
//   crossover    (4, 3 and 8 bits, bf16, --m batches; 3 and 8 bits up to 512) the fused GEMM as the library dispatches
//                it (kq::quant_gemm_cuda: the Hopper kernel at 4 bits on sm_90a, the mma.sync kernel otherwise) against
//                dequantize + cuBLAS bf16 (cublasGemmEx on the fresh W) and cuBLAS alone on resident bf16 weights; at
//                4 bits also the mma.sync kernel (qgemm_cuda, what other GPUs run) up to 512: the batch from which
//                QuantizedLinear's dequantize path pays (its max_fused_rows)
//   tiles        (--tiles LIST) the 4-bit bf16 dequantize, in order and act-order, at each count of 64-in tiles a block
//                (detail::launch_dequantize), every output compared with the default's
//   nf4          kq::nf4_dequantize_cuda (NF4 + DoubleQuant, block 64, into bf16: QLoRA's base in every pass) against
//                its one-byte-a-thread kernel (the general path), byte for byte, with its roofline
// Weights are random codes, zero points and scales (group 128): only time is measured here; the GPU tests check the
// numbers against the CPU twin.
// Usage: bench_dequant [--out FILE] [--reps N] [--only CASE-SUBSTRING] [--m LIST] [--shapes KxN,...] [--tiles LIST]
//   (env SQUEEZE_DEVICE, SQUEEZE_COMMIT)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <squeeze/error.hpp>
#include <squeeze/kernels/quant/dequant.cuh>
#include <squeeze/kernels/quant/gemm.cuh>
#include <squeeze/kernels/quant/nf4.cuh>

#include "gemm_timing.cuh"

namespace kq = squeeze::kernels::quant;
using squeeze::bf16;
using squeeze::half;
using squeeze::bench::comma_list;
using squeeze::bench::DevBuf;
using squeeze::bench::time_ms;
using squeeze::bench::watchdog_note;

namespace {

void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLAS: ") + what + " failed (status " + std::to_string(int(s)) + ")");
}

// The per-element dequantize the tiled kernel replaced, kept here as the peer: one thread per W element, qweight read
// across its rows.
template <class T>
__global__ void elementwise_dequantize_kernel(kq::GptqView v, T* __restrict__ w) {
  const std::int64_t total = v.in * v.out;
  for (std::int64_t idx = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; idx < total; idx += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t o = idx / v.in, i = idx % v.in;
    w[idx] = squeeze::from_float<T>(kq::gptq_weight(v, i, o));
  }
}
template <class T>
void elementwise_dequantize(const kq::GptqView& v, T* w) {
  const unsigned blocks = unsigned(std::min<std::int64_t>((v.in * v.out + 255) / 256, 65535));
  elementwise_dequantize_kernel<T><<<blocks, 256>>>(v, w);
  SQUEEZE_CUDA_CHECK(cudaGetLastError());
}

// A random GPTQ layer [N out, K in] on the device: codes, zero points and fp16 scales (group 128); act_order shuffles
// g_idx into equal groups, as GPTQ's act-order writes it.
struct GptqLayer {
  std::int64_t K, N;
  int bits;
  DevBuf<std::int32_t> qweight, qzeros, g_idx;
  DevBuf<half> scales;
  static std::vector<std::int32_t> random_words(std::size_t n, std::mt19937& rng) {
    std::vector<std::int32_t> v(n);
    for (auto& w : v) w = std::int32_t(rng());
    return v;
  }
  static std::vector<half> random_scales(std::size_t n, std::mt19937& rng) {
    std::uniform_real_distribution<float> u(0.002f, 0.02f);
    std::vector<half> v(n);
    for (auto& s : v) s = __float2half(u(rng));
    return v;
  }
  static std::vector<std::int32_t> group_index(std::int64_t K, bool act_order, std::mt19937& rng) {
    std::vector<std::int32_t> g(K);
    for (std::int64_t i = 0; i < K; ++i) g[i] = std::int32_t(i / 128);
    if (act_order) std::shuffle(g.begin(), g.end(), rng);
    return g;
  }
  GptqLayer(std::int64_t k, std::int64_t n, int b, bool act_order, std::mt19937& rng)
      : K(k),
        N(n),
        bits(b),
        qweight(random_words(std::size_t((k * b + 31) / 32 * n), rng)),
        qzeros(random_words(std::size_t((k + 127) / 128 * ((n * b + 31) / 32)), rng)),
        g_idx(group_index(k, act_order, rng)),
        scales(random_scales(std::size_t((k + 127) / 128 * n), rng)),
        act(act_order) {}
  bool act;
  kq::GptqView view() const { return {qweight.p, qzeros.p, scales.p, g_idx.p, K, N, bits, act, (K + 127) / 128}; }
  double packed_bytes() const { return double(qweight.n) * 4 + double(qzeros.n) * 4 + double(scales.n) * 2 + double(g_idx.n) * 4; }
};

// A random NF4 + DoubleQuant layer of n values (block 64): codes, absmax codes, nested absmax, a map and an offset.
struct Nf4Layer {
  std::int64_t n;
  DevBuf<std::uint8_t> codes, absmax_code;
  DevBuf<float> nested, map, offset;
  static std::vector<std::uint8_t> random_bytes(std::size_t count, std::mt19937& rng) {
    std::vector<std::uint8_t> v(count);
    for (auto& b : v) b = std::uint8_t(rng());
    return v;
  }
  static std::vector<float> uniform(std::size_t count, float lo, float hi, std::mt19937& rng) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> v(count);
    for (auto& x : v) x = u(rng);
    return v;
  }
  Nf4Layer(std::int64_t count, std::mt19937& rng)
      : n(count),
        codes(random_bytes(std::size_t(kq::nf4_code_bytes(count)), rng)),
        absmax_code(random_bytes(std::size_t(kq::nf4_blocks(count, 64)), rng)),
        nested(uniform(std::size_t(kq::nf4_dq_groups(kq::nf4_blocks(count, 64))), 0.01f, 0.02f, rng)),
        map(uniform(256, -1.f, 1.f, rng)),
        offset(std::vector<float>{0.03f}) {}
  kq::Nf4View view() const {
    kq::Nf4View v;
    v.codes = codes.p, v.absmax_code = absmax_code.p, v.nested_absmax = nested.p, v.nested_map = map.p, v.absmax_offset = offset.p;
    v.n = n, v.block = 64, v.double_quant = true;
    return v;
  }
  double packed_bytes() const { return double(codes.n) + double(absmax_code.n) + double(nested.n) * 4; }
};

bool same_bytes(const void* a, const void* b, std::size_t bytes) {
  std::vector<unsigned char> ha(bytes), hb(bytes);
  SQUEEZE_CUDA_CHECK(cudaMemcpy(ha.data(), a, bytes, cudaMemcpyDeviceToHost));
  SQUEEZE_CUDA_CHECK(cudaMemcpy(hb.data(), b, bytes, cudaMemcpyDeviceToHost));
  return std::memcmp(ha.data(), hb.data(), bytes) == 0;
}

const char* type_name(int bytes, bool bf) { return bytes == 4 ? "fp32" : bf ? "bf16" : "fp16"; }

}  // namespace

int main(int argc, char** argv) {
  std::string out_path, only;
  int reps = 30;
  std::vector<std::int64_t> batches = {16, 32, 64, 128, 256, 384, 512, 1024, 1536, 2048};
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{4096, 4096}, {4096, 11008}, {11008, 4096}, {8192, 28672}};
  std::vector<int> tile_counts;  // --tiles: 64-in tiles a block to sweep (none: no sweep)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc)
      out_path = argv[++i];
    else if (a == "--reps" && i + 1 < argc)
      reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--only" && i + 1 < argc)
      only = argv[++i];
    else if (a == "--m" && i + 1 < argc) {
      batches.clear();
      for (const std::string& item : comma_list(argv[++i])) {
        const long long m = squeeze::bench::positive(item);
        if (m == 0) {
          std::fprintf(stderr, "%s: --m: expected a comma-separated list of positive integers, got '%s'\n", argv[0], item.c_str());
          return 2;
        }
        batches.push_back(m);
      }
    } else if (a == "--tiles" && i + 1 < argc) {
      for (const std::string& item : comma_list(argv[++i])) {
        const long long t = squeeze::bench::positive(item);
        if (t == 0 || t > 64) {
          std::fprintf(stderr, "%s: --tiles: expected a comma-separated list of integers 1..64, got '%s'\n", argv[0], item.c_str());
          return 2;
        }
        tile_counts.push_back(int(t));
      }
    } else if (a == "--shapes" && i + 1 < argc) {
      if (const std::string bad = squeeze::bench::parse_shapes(argv[++i], shapes); !bad.empty()) {
        std::fprintf(stderr, "%s: --shapes: expected KxN pairs with K a multiple of 8 and K, N >= 16, got '%s'\n", argv[0], bad.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--out FILE] [--reps N] [--only CASE-SUBSTRING] [--m LIST] [--shapes KxN,...] [--tiles LIST]\n",
                   argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop{};
  if (!squeeze::bench::first_device("bench_dequant", prop)) return 1;
  const int sm = prop.multiProcessorCount;
  squeeze::bench::start_watchdog("bench_dequant", 120);
  std::ofstream out;
  if (!out_path.empty()) out.open(out_path);
  const char* commit = std::getenv("SQUEEZE_COMMIT");
  const std::string device = prop.name;

  const double copy_gbs = squeeze::bench::copy_bandwidth_gbs();  // the roofline
  std::printf("device %s, %d SMs, device-to-device copy %.0f GB/s\n", device.c_str(), sm, copy_gbs);
  std::printf("%-28s %9s %9s %6s %6s %s\n", "case", "ms", "elemwise", "x peer", "roof", "check");
  std::mt19937 rng(20261201);
  cublasHandle_t handle;
  cublas_check(cublasCreate(&handle), "create");
  auto emit = [&](const std::string& json) {
    if (out) out << json << "\n" << std::flush;
  };
  auto common = [&] {
    return std::string(", \"device\": \"") + device + "\", \"commit\": \"" + (commit ? commit : "unknown") + "\", \"l2_flush\": \"" +
           squeeze::bench::l2_flush_name() + "\", \"copy_gbs\": " + std::to_string(copy_gbs) + "}";
  };

  for (const auto& [K, N] : shapes) {
    // ---- dequantize: the tiled kernel against the per-element one ----
    struct Variant {
      int bits, type_bytes;
      bool bf, act_order;
    };
    for (const Variant var :
         {Variant{4, 2, true, false}, Variant{4, 2, false, false}, Variant{4, 4, false, false}, Variant{4, 2, true, true},
          Variant{3, 2, true, false}, Variant{8, 2, true, false}, Variant{2, 2, true, false}}) {
      const std::string cs = "K" + std::to_string(K) + "_N" + std::to_string(N) + "_b" + std::to_string(var.bits) + "_" +
                             type_name(var.type_bytes, var.bf) + (var.act_order ? "_actorder" : "");
      if (!only.empty() && cs.find(only) == std::string::npos) continue;
      watchdog_note(cs);
      const GptqLayer L(K, N, var.bits, var.act_order, rng);
      const std::size_t w_bytes = std::size_t(K * N) * std::size_t(var.type_bytes);
      DevBuf<unsigned char> w(w_bytes), w_ref(w_bytes);
      const kq::GptqView v = L.view();
      auto tiled = [&] {
        if (var.type_bytes == 4)
          SQUEEZE_CUDA_CHECK(kq::dequantize_cuda(v, reinterpret_cast<float*>(w.p), nullptr));
        else if (var.bf)
          SQUEEZE_CUDA_CHECK(kq::dequantize_cuda(v, reinterpret_cast<bf16*>(w.p), nullptr));
        else
          SQUEEZE_CUDA_CHECK(kq::dequantize_cuda(v, reinterpret_cast<half*>(w.p), nullptr));
      };
      auto elementwise = [&] {
        if (var.type_bytes == 4)
          elementwise_dequantize(v, reinterpret_cast<float*>(w_ref.p));
        else if (var.bf)
          elementwise_dequantize(v, reinterpret_cast<bf16*>(w_ref.p));
        else
          elementwise_dequantize(v, reinterpret_cast<half*>(w_ref.p));
      };
      tiled();
      elementwise();
      SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
      const bool same = same_bytes(w.p, w_ref.p, w_bytes);
      const double t = time_ms(tiled, reps), t_peer = time_ms(elementwise, std::max(5, reps / 3));
      const double bytes = L.packed_bytes() + double(w_bytes), roof = bytes / (t * 1e6) / copy_gbs;
      std::printf("%-28s %9.4f %9.4f %6.2f %6.2f %s\n", cs.c_str(), t, t_peer, t_peer / t, roof,
                  same ? "same bytes" : "BAD: differs from the peer");
      std::fflush(stdout);
      std::ostringstream j;
      j << "{\"bench\": \"dequant\", \"case\": \"" << cs << "\", \"bits\": " << var.bits << ", \"out_type\": \""
        << type_name(var.type_bytes, var.bf) << "\", \"act_order\": " << (var.act_order ? "true" : "false") << ", \"time_ms\": " << t
        << ", \"peer\": \"elementwise_dequantize\", \"peer_time_ms\": " << t_peer << ", \"ratio_vs_peer\": " << t_peer / t
        << ", \"bytes\": " << bytes << ", \"roofline_fraction\": " << roof << ", \"same_bytes_as_peer\": " << (same ? "true" : "false")
        << common();
      emit(j.str());
    }

    // ---- NF4 + DoubleQuant into bf16: the library's launcher against the one-byte-a-thread kernel ----
    if (const std::string cs = "K" + std::to_string(K) + "_N" + std::to_string(N) + "_nf4dq_bf16";
        only.empty() || cs.find(only) != std::string::npos) {
      watchdog_note(cs);
      const Nf4Layer L(K * N, rng);
      DevBuf<bf16> w(std::size_t(K * N)), w_ref(std::size_t(K * N));
      const kq::Nf4View v = L.view();
      auto library = [&] { SQUEEZE_CUDA_CHECK(kq::nf4_dequantize_cuda(v, w.p, nullptr)); };
      auto per_byte = [&] {
        kq::detail::nf4_dequantize_kernel<bf16>
            <<<kq::detail::nf4_grid(kq::nf4_code_bytes(v.n), kq::kNf4Threads), kq::kNf4Threads>>>(v, w_ref.p);
        SQUEEZE_CUDA_CHECK(cudaGetLastError());
      };
      library();
      per_byte();
      SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
      const bool same = same_bytes(w.p, w_ref.p, std::size_t(K * N) * 2);
      const double t = time_ms(library, reps), t_peer = time_ms(per_byte, reps);
      const double bytes = L.packed_bytes() + double(K * N) * 2, roof = bytes / (t * 1e6) / copy_gbs;
      std::printf("%-28s %9.4f %9.4f %6.2f %6.2f %s\n", cs.c_str(), t, t_peer, t_peer / t, roof,
                  same ? "same bytes" : "BAD: differs from the peer");
      std::fflush(stdout);
      std::ostringstream j;
      j << "{\"bench\": \"dequant_nf4\", \"case\": \"" << cs
        << "\", \"out_type\": \"bf16\", \"block\": 64, \"double_quant\": true, \"time_ms\": " << t
        << ", \"peer\": \"nf4_dequantize_kernel (one code byte a thread)\", \"peer_time_ms\": " << t_peer
        << ", \"ratio_vs_peer\": " << t_peer / t << ", \"bytes\": " << bytes << ", \"roofline_fraction\": " << roof
        << ", \"peer_roofline_fraction\": " << bytes / (t_peer * 1e6) / copy_gbs
        << ", \"same_bytes_as_peer\": " << (same ? "true" : "false") << common();
      emit(j.str());
    }

    // ---- tiles a block: 4-bit bf16, in order and act-order ----
    for (const bool act : {false, true}) {
      if (tile_counts.empty()) break;
      const std::string cs = "K" + std::to_string(K) + "_N" + std::to_string(N) + "_b4_bf16" + (act ? "_actorder" : "") + "_tiles";
      if (!only.empty() && cs.find(only) == std::string::npos) continue;
      watchdog_note(cs);
      const GptqLayer L(K, N, 4, act, rng);
      const kq::GptqView v = L.view();
      DevBuf<bf16> w(std::size_t(K * N)), w_ref(std::size_t(K * N));
      SQUEEZE_CUDA_CHECK(kq::dequantize_cuda(v, w_ref.p, nullptr));
      const double bytes = L.packed_bytes() + double(K * N) * 2;
      std::printf("%-28s", cs.c_str());
      for (const int tpb : tile_counts) {
        auto run = [&] { SQUEEZE_CUDA_CHECK(kq::detail::launch_dequantize(v, w.p, nullptr, tpb)); };
        run();
        SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
        const bool same = same_bytes(w.p, w_ref.p, std::size_t(K * N) * 2);
        const double t = time_ms(run, reps);
        std::printf("  %d: %.4f%s", tpb, t, same ? "" : " BAD");
        std::ostringstream j;
        j << "{\"bench\": \"dequant_tiles\", \"case\": \"" << cs << "\", \"act_order\": " << (act ? "true" : "false")
          << ", \"tiles_per_block\": " << tpb << ", \"time_ms\": " << t << ", \"roofline_fraction\": " << bytes / (t * 1e6) / copy_gbs
          << ", \"same_bytes_as_default\": " << (same ? "true" : "false") << common();
        emit(j.str());
      }
      std::printf("\n");
      std::fflush(stdout);
    }

    // ---- crossover: fused GEMM against dequantize + cuBLAS (bf16) ----
    for (const int bits : {4, 3, 8}) {
      const GptqLayer L(K, N, bits, false, rng);
      const std::int64_t Kpad = (K + kq::kTileK - 1) / kq::kTileK * kq::kTileK, Npad = (N + kq::kTileN - 1) / kq::kTileN * kq::kTileN;
      // the fused kernel's tiles (constant codes: its time does not depend on them) and resident bf16 weights for cuBLAS
      // alone
      DevBuf<std::uint32_t> tiles(std::size_t(Kpad / kq::kTileK * (Npad / kq::kTileN) * kq::tile_words(bits)));
      SQUEEZE_CUDA_CHECK(cudaMemset(tiles.p, 0x5a, tiles.n * 4));
      const DevBuf<half> tile_scales(GptqLayer::random_scales(std::size_t((Kpad + 127) / 128 * Npad), rng));
      std::vector<std::uint8_t> zs(std::size_t((Kpad + 127) / 128 * Npad));
      for (auto& z : zs) z = std::uint8_t(1 + rng() % ((1u << bits) - 1));
      const DevBuf<std::uint8_t> tile_zeros(zs);
      DevBuf<bf16> w(std::size_t(K * N)), w_resident(std::size_t(K * N));
      SQUEEZE_CUDA_CHECK(kq::dequantize_cuda(L.view(), w_resident.p, nullptr));
      for (const std::int64_t M : batches) {
        // 3 and 8 bits run the mma.sync kernel, whose crossover comes early: batches up to 512
        if (bits != 4 && M > 512) continue;
        const std::string cs = "K" + std::to_string(K) + "_N" + std::to_string(N) + "_b" + std::to_string(bits) + "_M" + std::to_string(M);
        if (!only.empty() && cs.find(only) == std::string::npos) continue;
        watchdog_note("crossover " + cs);
        std::vector<bf16> hx(std::size_t(M * K));
        std::normal_distribution<float> g(0.f, 1.f);
        for (auto& e : hx) e = __float2bfloat16(g(rng));
        const DevBuf<bf16> x(hx);
        DevBuf<bf16> y(std::size_t(M * N));
        const kq::QGemmShape s{M, N, K, Kpad, Npad, 128, bits};
        // workspace for the library's dispatch and for the mma.sync kernel (4 bits: what a GPU without sm_90a runs)
        const kq::QGemmWorkspace need = kq::quant_gemm_workspace_size(s, sm), need_mma = kq::qgemm_workspace_size(s, sm);
        const std::int64_t partial_elems = std::max<std::int64_t>({need.partial_elems, need_mma.partial_elems, 1}),
                           counter_elems = std::max<std::int64_t>({need.counter_elems, need_mma.counter_elems, 1});
        DevBuf<float> partial{std::size_t(partial_elems)};
        DevBuf<int> counters{std::size_t(counter_elems)};
        SQUEEZE_CUDA_CHECK(cudaMemset(counters.p, 0, counters.n * sizeof(int)));
        const kq::QGemmWorkspace ws{partial.p, partial_elems, counters.p, counter_elems};
        auto fused = [&] {
          SQUEEZE_CUDA_CHECK(kq::quant_gemm_cuda<bf16>(x.p, tiles.p, tile_scales.p, tile_zeros.p, y.p, s, ws, sm, nullptr));
        };
        auto mma = [&] { SQUEEZE_CUDA_CHECK(kq::qgemm_cuda<bf16>(x.p, tiles.p, tile_scales.p, tile_zeros.p, y.p, s, ws, sm, nullptr)); };
        const float one = 1.f, zero = 0.f;
        auto cublas_on = [&](const bf16* weights) {
          cublas_check(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M), int(K), &one, weights, CUDA_R_16BF, int(K), x.p,
                                    CUDA_R_16BF, int(K), &zero, y.p, CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                       "GemmEx");
        };
        auto deq_cublas = [&] {
          SQUEEZE_CUDA_CHECK(kq::dequantize_cuda(L.view(), w.p, nullptr));
          cublas_on(w.p);
        };
        const bool sm90 = kq::quant_gemm_uses_sm90(s);
        const double t_fused = time_ms(fused, reps), t_deq = time_ms(deq_cublas, reps),
                     t_cub = time_ms([&] { cublas_on(w_resident.p); }, reps);
        const double t_mma = sm90 && M <= 512 ? time_ms(mma, reps) : 0.0;
        std::printf("%-28s fused %.4f ms | dequantize + cuBLAS %.4f (fused %.2fx) | cuBLAS alone %.4f | %s", cs.c_str(), t_fused, t_deq,
                    t_deq / t_fused, t_cub, t_fused <= t_deq ? "fused" : "dequantize");
        if (t_mma > 0) std::printf(" | mma.sync kernel %.4f (%.2fx)", t_mma, t_deq / t_mma);
        std::printf("\n");
        std::fflush(stdout);
        std::ostringstream j;
        j << "{\"bench\": \"dequant_crossover\", \"case\": \"" << cs << "\", \"bits\": " << bits << ", \"M\": " << M
          << ", \"time_ms\": " << t_fused << ", \"dispatch\": \"" << kq::quant_gemm_describe(s, sm)
          << "\", \"peer\": \"dequantize+cublas_bf16\", \"peer_time_ms\": " << t_deq << ", \"ratio_vs_peer\": " << t_deq / t_fused
          << ", \"cublas_resident_ms\": " << t_cub;
        if (t_mma > 0) j << ", \"mma_sync_ms\": " << t_mma << ", \"mma_sync_ratio_vs_peer\": " << t_deq / t_mma;
        j << common();
        emit(j.str());
      }
    }
  }
  cublasDestroy(handle);
  return 0;
}
