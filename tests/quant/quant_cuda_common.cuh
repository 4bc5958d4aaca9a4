#pragma once
// Shared by the CUDA quant tests (test_quant_cuda.cu: GEMV, the mma.sync GEMM; test_dequant_cuda.cu: dequantize;
// test_quant_sm90.cu: the wgmma GEMM and the library entry; test_qgemv_cuda.cu: the streaming GEMM): random GPTQ
// layers and activations, the twin's error scale, one layer and batch on the device with the CPU twin's result. One
// binary each, so the GPU machine can build (and rebuild) one without the others.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>
#include <squeeze/error.hpp>
#include <squeeze/kernels/quant/dequant.cuh>
#include <squeeze/kernels/quant/gemm.cuh>
#include <squeeze/kernels/quant/gemm/cpu.hpp>
#include <squeeze/quant/tiles.hpp>
#include <squeeze/quant/rtn.hpp>

#include "random_layer.hpp"

// the configurations the benchmarks time, which the GPU tests check against the CPU twin
#include "../../bench/quant/gemm_configs.cuh"

#include "../cuda_buffer.hpp"

using namespace squeeze;
namespace kq = squeeze::kernels::quant;
namespace bg = squeeze::bench::gemm;

namespace {
using test::Dev;
using test::random_layer;
using test::random_x;

// A GPTQ-layout layer on the device (the dequantize and GEMV kernels read it as is).
struct DevLayer {
  Dev<std::int32_t> qw, qz, gi;
  Dev<half> sc;
  explicit DevLayer(const quant::PackedLinear& p) : qw(p.qweight), qz(p.qzeros), gi(p.g_idx), sc(p.scales) {}
  kq::GptqView view(const quant::PackedLinear& p) const { return {qw.p, qz.p, sc.p, gi.p, p.in, p.out, p.bits}; }
};

template <class T>
double ulp(double y) {
  return std::ldexp(std::abs(y), std::is_same_v<T, half> ? -10 : -7) + 1e-30;
}
int sm_count() {
  int sm = 0;
  SQUEEZE_CUDA_CHECK(cudaDeviceGetAttribute(&sm, cudaDevAttrMultiProcessorCount, 0));
  return sm;
}
// sum |x w| per output [M, N] (float64), the scale of the accumulation error
template <class T>
std::vector<double> magnitudes(const quant::PackedLinear& p, const quant::QTiles& t, const std::vector<T>& x, std::int64_t M) {
  const auto wdq = quant::dequantize(p);
  std::vector<double> mag(M * p.out, 0.0);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < p.out; ++n)
      for (std::int64_t k = 0; k < p.in; ++k)
        mag[m * p.out + n] += std::abs(double(to_float(x[m * p.in + k])) * wdq[n * p.in + (t.perm.empty() ? k : t.perm[k])]);
  return mag;
}
// |gpu - twin| per output, bounded by rel * sum |x w| + one ulp of T; rel 1e-5: fp32 accumulation in another
// order (the exact modes)
template <class T>
void expect_close_to_twin(const std::vector<double>& mag, const std::vector<T>& ref, const std::vector<T>& got, const std::string& what,
                          double rel = 1e-5) {
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double r = to_float(ref[i]), g = to_float(got[i]);
    ASSERT_LE(std::abs(g - r), rel * mag[i] + ulp<T>(r)) << what << " at flat index " << i << ": gpu " << g << " twin " << r;
  }
}
// x in kernel row order (gathered by perm, as the torch layer does) and the twin's result
template <class T>
std::vector<T> kernel_order_x(const quant::QTiles& t, std::int64_t M, std::int64_t K, std::uint32_t seed) {
  auto x = random_x<T>(M * K, seed);
  if (t.perm.empty()) return x;
  auto xg = x;
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t k = 0; k < K; ++k) xg[m * K + k] = x[m * K + t.perm[k]];
  return xg;
}

// One layer and batch on the device with the twin's result and the error scale (computed once, shared by
// every configuration checked on it).
template <class T>
struct TwinCase {
  kq::QGemmShape shape;
  std::int64_t M;
  std::vector<T> ref;
  std::vector<double> mag;
  Dev<T> dx, dy;
  Dev<std::uint32_t> dt;
  Dev<half> ds;
  Dev<std::uint8_t> dz;
  TwinCase(const quant::PackedLinear& p, const quant::QTiles& t, std::int64_t rows, const std::vector<T>& x)
      : shape(t.shape(rows)),
        M(rows),
        ref(std::size_t(rows * p.out)),
        mag(magnitudes(p, t, x, rows)),
        dx(x),
        dy(ref.size()),
        dt(t.tiles),
        ds(t.scales),
        dz(t.zeros) {
    kq::qgemm_cpu(x.data(), t.tiles.data(), t.scales.data(), t.zeros.data(), ref.data(), shape);
  }
  TwinCase(const quant::PackedLinear& p, const quant::QTiles& t, std::int64_t rows)
      : TwinCase(p, t, rows, kernel_order_x<T>(t, rows, p.in, 23)) {}
};
// reps launches of launch(ws) on one workspace of the given sizes (counters zeroed once: the kernels leave them
// zero), each result against the twin (bound rel * sum |x w| + one ulp); the counters must be zero at the end.
template <class T, class Launch>
void launches_match_twin(const TwinCase<T>& tc, std::int64_t partial_elems, std::int64_t counter_elems, int reps, const std::string& what,
                         double rel, Launch launch) {
  Dev<float> part(std::size_t(std::max<std::int64_t>(partial_elems, 1)));
  Dev<int> cnt(std::vector<int>(std::size_t(std::max<std::int64_t>(counter_elems, 1)), 0));
  const kq::QGemmWorkspace ws{part.p, partial_elems, cnt.p, counter_elems};
  for (int rep = 0; rep < reps; ++rep) {
    SQUEEZE_CUDA_CHECK(cudaMemset(tc.dy.p, 0xff, tc.dy.n * sizeof(T)));
    SQUEEZE_CUDA_CHECK(launch(ws));
    SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
    expect_close_to_twin(tc.mag, tc.ref, tc.dy.get(),
                         what + " M " + std::to_string(tc.M) + " N " + std::to_string(tc.shape.N) + " K " + std::to_string(tc.shape.K) +
                             " rep " + std::to_string(rep),
                         rel);
    if (::testing::Test::HasFatalFailure()) return;
  }
  const auto counters = cnt.get();
  EXPECT_TRUE(std::all_of(counters.begin(), counters.end(), [](int v) { return v == 0; })) << what << ": counters left non-zero";
}
}  // namespace
