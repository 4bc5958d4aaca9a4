#pragma once
// The quantized GEMM's CPU twin: the same tiles, the same decode (decode.hpp), the same per-group accumulation (in
// double here), the result rounded to T. The GPU tests check every kernel configuration against it. Plain C++.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "squeeze/kernels/quant/gemm/decode.hpp"
#include "squeeze/kernels/quant/gemm/layout.hpp"

namespace squeeze::kernels::quant {

// 8-bit codes: the device's decode is exact (q - z as a small integer), so the twin reads q - z directly.
template <class T>
void qgemm_cpu(const T* x /*[M, K]*/, const std::uint32_t* tiles, const half* scales /*[groups, Npad]*/,
               const std::uint8_t* zeros /*[groups, Npad]*/, T* y /*[M, N]*/, const QGemmShape& s) {
  const std::int64_t ntiles = s.Npad / kTileN, kchunks = s.Kpad / kTileK;
  std::vector<double> acc(s.M * kTileN), gacc(s.M * kTileN);
#if defined(_OPENMP)
#pragma omp parallel for firstprivate(acc, gacc) schedule(static)
#endif
  for (std::int64_t nt = 0; nt < ntiles; ++nt) {
    std::fill(acc.begin(), acc.end(), 0.0);
    std::fill(gacc.begin(), gacc.end(), 0.0);
    std::int64_t cur_group = 0;
    auto flush = [&](std::int64_t g) {
      for (std::int64_t m = 0; m < s.M; ++m)
        for (int n = 0; n < kTileN; ++n) {
          acc[m * kTileN + n] += gacc[m * kTileN + n] * double(to_float(scales[g * s.Npad + nt * kTileN + n]));
          gacc[m * kTileN + n] = 0;
        }
    };
    const int tw = tile_words(s.bits), lw = lane_words(s.bits);
    for (std::int64_t kc = 0; kc < kchunks; ++kc) {
      const std::uint32_t* tile = tiles + (kc * ntiles + nt) * tw;
      for (int ks = 0; ks < 4; ++ks) {
        const std::int64_t k0 = kc * kTileK + ks * 16;
        const std::int64_t g = std::min(k0, s.K - 1) / s.group;  // padded rows use the last group (x is 0 there)
        if (g != cur_group) {
          flush(cur_group);
          cur_group = g;
        }
        for (int lane = 0; lane < 32; ++lane) {
          auto add = [&](const TileCoord& c, auto value_minus_zero) {
            const std::int64_t k = kc * kTileK + c.k, n = nt * kTileN + c.n;
            if (k >= s.K) return;  // padded rows meet zero activations
            const double v = value_minus_zero(int(zeros[g * s.Npad + n]));
            for (std::int64_t m = 0; m < s.M; ++m) gacc[m * kTileN + c.n] += double(to_float(x[m * s.K + k])) * v;
          };
          if (s.bits == 3) {
            const std::uint32_t* lw3 = tile + lane;  // word r at 32 r + lane
            for (int pi = 0; pi < 4; ++pi) {
              const int q = 4 * ks + pi;
              const std::uint32_t bits = magic3_pair<T>(lw3[0], lw3[32], lw3[64], q);
              for (int e = 0; e < 2; ++e)
                add(tile3_coord(lane, q, e),
                    [&](int z) { return double(magic_value_minus_zero<T>(std::uint16_t(bits >> (16 * e)), 0, z)); });
            }
          } else if (s.bits == 8) {
            for (int j = 0; j < 2; ++j) {
              const std::uint32_t w = tile[lane * lw + 2 * ks + j];
              for (int b = 0; b < 4; ++b)
                add(tile_coord(8, lane, 2 * ks + j, b), [&](int z) { return double((w >> (8 * b)) & 0xFFu) - z; });
            }
          } else {
            const std::uint32_t w = tile[lane * lw + ks];
            for (int pair = 0; pair < 4; ++pair) {
              const std::uint32_t bits = magic_pair<T>(w, pair);
              for (int e = 0; e < 2; ++e)
                add(tile_coord(4, lane, ks, pair + 4 * e),
                    [&](int z) { return double(magic_value_minus_zero<T>(std::uint16_t(bits >> (16 * e)), pair, z)); });
            }
          }
        }
      }
    }
    flush(cur_group);
    for (std::int64_t m = 0; m < s.M; ++m)
      for (int n = 0; n < kTileN; ++n)
        if (nt * kTileN + n < s.N) y[m * s.N + nt * kTileN + n] = from_float<T>(float(acc[m * kTileN + n]));
  }
}

}  // namespace squeeze::kernels::quant
