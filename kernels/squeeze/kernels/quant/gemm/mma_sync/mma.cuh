#pragma once
// The mma.sync family (gemm/mma_sync.cuh): the accumulators and the mma of one k-step.
#if !defined(__CUDACC__)
#error "gemm/mma_sync/mma.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include "squeeze/kernels/quant/gemm/mma_sync/group_decode.cuh"

namespace squeeze::kernels::quant {
namespace detail {

// ==== mma ==============================================================================================================
// The accumulators: acc, the result so far; tmp, this group's sum of x * (q - z), folded into acc with the group's
// scales (flush); xacc (folding), this group's row sums of x (rows g4, g4 + 8 in elements 0 / 2; SWAP: [batch block][e],
// batch row 2 c4 + (e & 1) in every element, as C is the same in all 16 rows).
template <class T, int BITS, class C>
struct QGemmAccumulators {
  using K = QGemmTraits<T, BITS, C>;
  static constexpr int MT = C::MT, NT = C::NT, NJ = K::NJ, XA = K::XA;
  // (members in reverse order: nvcc then numbers their registers as it did local arrays, and the code is the same)
  float xacc[XA][4];
  float tmp[MT][NT][NJ][4], acc[MT][NT][NJ][4];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int mt = 0; mt < XA; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) xacc[mt][e] = 0.f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][t][j][e] = tmp[mt][t][j][e] = 0.f;
  }
  // The group's sums, scaled, into acc (scaled B: the mma accumulated straight into acc).
  __device__ __forceinline__ void flush(const QGemmGroupConsts<T, BITS, C>& gc) {
    if constexpr (!C::SCALEB) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float v = tmp[mt][t][j][e];
              // minus (magic + z) * sum(x) of the row (SWAP: z of the column n = 8 (e >> 1) + g4, sum of batch row j, e)
              if constexpr (K::kFold && K::kSwap)
                v = fmaf(-gc.zc2[t][e >> 1][0], xacc[j][e], v);
              else if constexpr (K::kFold)
                v = fmaf(-gc.zc2[t][j][e & 1], xacc[mt][e & 2], v);
              // scale of the element's column: swapped, C row n = 8 (e >> 1) + g4 of the tile
              const float scale = K::kSwap ? gc.sc[t][e >> 1][0] : gc.sc[t][j][e & 1];
              acc[mt][t][j][e] = fmaf(v, scale, acc[mt][t][j][e]);
              tmp[mt][t][j][e] = 0.f;
            }
      if constexpr (K::kFold)
#pragma unroll
        for (int mt = 0; mt < XA; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) xacc[mt][e] = 0.f;
    }
  }
};
// The mma of k-step ks of the chunk at local k kl of the x slice: load the x fragments (ldmatrix) and multiply them by
// the decoded fragments b, MT * NT * 2 mma (SWAP: NT * NJ mma, x as B). a8 (8 rows): the A fragments of two k-steps,
// loaded at even ks.
template <class T, int BITS, class C>
__device__ __forceinline__ void qgemm_mma_kstep(const std::uint16_t* xs, int xstride, int XR, int kl, int ks, int lane,
                                                std::uint32_t (&a8)[4], const std::uint32_t (&b)[C::NT][2][2],
                                                QGemmAccumulators<T, BITS, C>& ac) {
  using K = QGemmTraits<T, BITS, C>;
  constexpr int MT = C::MT, NT = C::NT, NJ = K::NJ;
  if constexpr (K::kSwap) {
    // x as B: register 0 = (k 2 c4, 2 c4 + 1; batch g4), register 1 = k + 8. ldmatrix (not transposed) hands
    // lane l the pair at row l / 4, columns 2 (l % 4) of each 8 x 8 matrix: rows = batch, columns = k.
    std::uint32_t xb[NJ][2];
    if constexpr (NJ == 1) {
      // lanes 8i..8i+7 address rows 0..7 at k 8i of a 32-k window: matrices (ks, lo), (ks, hi), (ks+1, lo), (ks+1, hi)
      if (ks % 2 == 0) ldmatrix_x4(a8, xs + min(lane & 7, XR - 1) * xstride + kl + ks * 16 + 8 * (lane >> 3));
      xb[0][0] = a8[(ks & 1) * 2];
      xb[0][1] = a8[(ks & 1) * 2 + 1];
    } else {
      // matrices (rows 0..7, k lo), (rows 0..7, k hi), (rows 8..15, k lo), (rows 8..15, k hi)
      std::uint32_t x4[4];
      ldmatrix_x4(x4, xs + min((lane & 7) + 8 * (lane >> 4), XR - 1) * xstride + kl + ks * 16 + 8 * ((lane >> 3) & 1));
      xb[0][0] = x4[0];
      xb[0][1] = x4[1];
      xb[1][0] = x4[2];
      xb[1][1] = x4[3];
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      // A = the decoded word: a0 (n g4, k lo) = b[t][0][0], a1 (n g4 + 8, k lo) = b[t][1][0], a2, a3: k hi
      const std::uint32_t aw[4] = {b[t][0][0], b[t][1][0], b[t][0][1], b[t][1][1]};
#pragma unroll
      for (int nb = 0; nb < NJ; ++nb) mma16816<T>(C::SCALEB ? ac.acc[0][t][nb] : ac.tmp[0][t][nb], aw, xb[nb][0], xb[nb][1]);
    }
    if constexpr (K::kFold) {  // column sums of x: A = 1
      constexpr std::uint32_t kOnes = std::is_same_v<T, bf16> ? 0x3F803F80u : 0x3C003C00u;
      const std::uint32_t ones[4] = {kOnes, kOnes, kOnes, kOnes};
#pragma unroll
      for (int nb = 0; nb < NJ; ++nb) mma16816<T>(ac.xacc[nb], ones, xb[nb][0], xb[nb][1]);
    }
  } else {
    std::uint32_t a[MT][4];
    if constexpr (C::ROWS8 == 1) {
      // lanes 8i..8i+7 address rows 0..7 at k 8i..8i+7 of a 32-k window: matrices (ks, lo), (ks, hi), (ks+1, lo), (ks+1, hi)
      if (ks % 2 == 0) ldmatrix_x4(a8, xs + (lane & 7) * xstride + kl + ks * 16 + 8 * (lane >> 3));
      a[0][0] = a8[(ks & 1) * 2];
      a[0][2] = a8[(ks & 1) * 2 + 1];
      a[0][1] = a[0][3] = 0u;
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldmatrix_x4(a[mt], xs + (mt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * xstride + kl + ks * 16 + 8 * (lane >> 4));
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int j = 0; j < 2; ++j) mma16816<T>(C::SCALEB ? ac.acc[mt][t][j] : ac.tmp[mt][t][j], a[mt], b[t][j][0], b[t][j][1]);
      if constexpr (K::kFold) {
        constexpr std::uint32_t kOnes = std::is_same_v<T, bf16> ? 0x3F803F80u : 0x3C003C00u;
        mma16816<T>(ac.xacc[mt], a[mt], kOnes, kOnes);
      }
    }
  }
}

}  // namespace detail
}  // namespace squeeze::kernels::quant
