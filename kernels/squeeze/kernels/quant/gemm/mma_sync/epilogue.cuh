#pragma once
// The mma.sync family (gemm/mma_sync.cuh): the epilogue, stores and the deterministic split-K reduction.
#if !defined(__CUDACC__)
#error "gemm/mma_sync/epilogue.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include "squeeze/kernels/quant/gemm/mma_sync/mma.cuh"

namespace squeeze::kernels::quant {
namespace detail {

// ==== epilogue =========================================================================================================
// Where this warp's item lands: batch rows m0.. (rows of them), strip columns col0.., the warp's first tile nt0
// (active: inside N).
struct QGemmOut {
  int m0, rows, col0, nt0;
  bool active;
};
// The item's accumulators out: straight to y with one K range; else fp32 partials, and the last block of the (z slice,
// strip) to finish sums them in split order (deterministic), writes y and resets its counter. C fragment rows g4 / g4 +
// 8, columns 2 c4, 2 c4 + 1 of each n8 half (SWAP: rows are the columns n, columns the batch rows).
template <class T, int BITS, class C>
__device__ __forceinline__ void qgemm_epilogue(const QGemmParams& p, const QGemmAccumulators<T, BITS, C>& ac, const QGemmItem& it,
                                               const QGemmOut& o, int ntiles, int tid, int g4, int c4, int& last_flag) {
  using K = QGemmTraits<T, BITS, C>;
  constexpr int MT = C::MT, NT = C::NT, NJ = K::NJ, STRIP = C::STRIP;
  T* y = static_cast<T*>(p.y);
  float* const mine = p.splits > 1 ? p.partial + (std::int64_t(it.split) * p.M + o.m0) * p.Npad : nullptr;  // fp32 partials
  if constexpr (K::kSwap) {
    if (o.active)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int nb = 0; nb < NJ; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int m = 8 * nb + 2 * c4 + (e & 1), n = (o.nt0 + t) * kTileN + g4 + 8 * (e >> 1);
            if (m >= o.rows) continue;
            if (p.splits == 1) {
              if (n < p.N) y[std::int64_t(o.m0 + m) * p.N + n] = from_float<T>(ac.acc[0][t][nb][e]);
            } else if (o.nt0 + t < ntiles) {
              mine[std::int64_t(m) * p.Npad + n] = ac.acc[0][t][nb][e];
            }
          }
    if (p.splits == 1) return;
  } else if (p.splits == 1) {
    if (o.active)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int m = mt * 16 + g4 + 8 * (e >> 1), n = (o.nt0 + t) * kTileN + 8 * j + 2 * c4 + (e & 1);
              if (m < o.rows && n < p.N) y[std::int64_t(o.m0 + m) * p.N + n] = from_float<T>(ac.acc[mt][t][j][e]);
            }
    return;
  } else if (o.active) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int m = mt * 16 + g4 + 8 * h, n = (o.nt0 + t) * kTileN + 8 * j + 2 * c4;
            if (m < o.rows && o.nt0 + t < ntiles)
              *reinterpret_cast<float2*>(mine + std::int64_t(m) * p.Npad + n) =
                  make_float2(ac.acc[mt][t][j][2 * h], ac.acc[mt][t][j][2 * h + 1]);
          }
  }
  // split-K: the last block of the (z slice, strip) sums the partials
  __threadfence();
  qgemm_sync_compute<K::kBulk, K::NC>();
  int* counter = p.counters + std::int64_t(it.z) * p.strips + it.strip;
  if (tid == 0) last_flag = atomicAdd(counter, 1) == p.splits - 1;
  qgemm_sync_compute<K::kBulk, K::NC>();
  if (!last_flag) return;  // (uniform: the flag is read by every thread before anyone can write it again)
  __threadfence();
  for (int i = tid; i < o.rows * STRIP; i += K::NC) {
    const int m = i / STRIP, n = o.col0 + (i - m * STRIP);
    if (n >= p.N) continue;
    float s = 0.f;
    for (int sp = 0; sp < p.splits; ++sp) s += __ldcg(p.partial + (std::int64_t(sp) * p.M + o.m0 + m) * p.Npad + n);
    y[std::int64_t(o.m0 + m) * p.N + n] = from_float<T>(s);
  }
  if (tid == 0) *counter = 0;  // ready for the next launch
}

}  // namespace detail
}  // namespace squeeze::kernels::quant
