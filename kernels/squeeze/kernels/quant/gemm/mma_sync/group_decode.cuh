#pragma once
// The mma.sync family (gemm/mma_sync.cuh): the groups' constants and the decode of a chunk's codes into fragments.
#if !defined(__CUDACC__)
#error "gemm/mma_sync/group_decode.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include "squeeze/kernels/quant/gemm/mma_sync/mainloop.cuh"

namespace squeeze::kernels::quant {
namespace detail {

// ==== decode ===========================================================================================================
// Per-group constants: zero points of the B columns (8j + g4), scales of the C columns (8j + 2c4 + {0,1}).
// Raw group data of this warp's columns: B-column zero points, C-column zero point pairs (folding), scales.
template <int NT>
struct QGemmGroupRaw {
  std::uint32_t zb[NT][2], zc[NT][2], s[NT][2], sb[NT][2];  // sb: scale of the B column (SCALEB)
};
// Group gg from the group table (row r holds group tbl_g0 + r).
template <class T, int BITS, class C>
__device__ __forceinline__ QGemmGroupRaw<C::NT> qgemm_fetch_group(const half* tbl_s, const std::uint8_t* tbl_z, int tbl_g0, int gg,
                                                                  int warp, int g4, int c4) {
  using K = QGemmTraits<T, BITS, C>;
  QGemmGroupRaw<C::NT> r;
  const int row = (gg - tbl_g0) * C::STRIP + warp * C::NT * kTileN;
#pragma unroll
  for (int t = 0; t < C::NT; ++t)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int n = row + t * kTileN + 8 * j;
      r.zb[t][j] = tbl_z[n + g4];
      if constexpr (K::kFold && !K::kSwap) r.zc[t][j] = std::uint32_t(tbl_z[n + 2 * c4]) | (std::uint32_t(tbl_z[n + 2 * c4 + 1]) << 8);
      if constexpr (C::SCALEB)
        r.sb[t][j] = *reinterpret_cast<const std::uint16_t*>(tbl_s + n + g4);
      else if constexpr (K::kSwap)
        r.s[t][j] = *reinterpret_cast<const std::uint16_t*>(tbl_s + n + g4);  // C row n = B column
      else
        r.s[t][j] = *reinterpret_cast<const std::uint32_t*>(tbl_s + n + 2 * c4);
    }
  return r;
}
// The current group's decode operands and scales, as the decode and the flush read them.
template <class T, int BITS, class C>
struct QGemmGroupConsts {
  using K = QGemmTraits<T, BITS, C>;
  static constexpr int NT = C::NT;
  // (members in reverse order of use: nvcc then numbers their registers as it did local arrays, and the code is the same)
  std::uint32_t sb2[NT][2];                      // SCALEB: the B column's scale as a T pair
  float zc2[NT][2][2], sc[NT][2][2], zf[NT][2];  // zc2 (folding): magic + z of the C columns
  std::uint32_t zhi[NT][2], zlo[NT][2];
  __device__ __forceinline__ void apply(const QGemmGroupRaw<NT>& r) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int zc = int(r.zb[t][j]);
        if constexpr (K::kFold && K::kSwap) {
          constexpr float kMagic = std::is_same_v<T, bf16> ? 128.f : 1024.f;
          zc2[t][j][0] = kMagic + float(zc);  // column 8 j + g4 (the A rows)
        } else if constexpr (K::kFold) {
          constexpr float kMagic = std::is_same_v<T, bf16> ? 128.f : 1024.f;
          zc2[t][j][0] = kMagic + float(r.zc[t][j] & 0xFFu);
          zc2[t][j][1] = kMagic + float(r.zc[t][j] >> 8);
        } else if constexpr (BITS == 8) {
          zf[t][j] = 8388608.f + float(zc);
          zlo[t][j] = (0x6400u + zc) * 0x00010001u;  // fp16 1024 + z
        } else {
          zero_operands<T>(std::uint32_t(zc), zlo[t][j], zhi[t][j]);
        }
        if constexpr (C::SCALEB) {
          if constexpr (std::is_same_v<T, bf16>) {
            const __nv_bfloat16 b = __float2bfloat16_rn(__half2float(__ushort_as_half(static_cast<unsigned short>(r.sb[t][j]))));
            sb2[t][j] = u32(__halves2bfloat162(b, b));
          } else {
            sb2[t][j] = r.sb[t][j] * 0x00010001u;
          }
        } else if constexpr (K::kSwap) {
          sc[t][j][0] = sc[t][j][1] = __half2float(__ushort_as_half(static_cast<unsigned short>(r.s[t][j])));  // column 8 j + g4
        } else {
          const __half2 s2 = as_vec2<__half2>(r.s[t][j]);
          sc[t][j][0] = __low2float(s2);
          sc[t][j][1] = __high2float(s2);
        }
      }
  }
};
// Fragment registers of k-step ks of the chunk, every tile: b[t][j][r] (n8 half j, register r); with folded zero
// points magic + q, otherwise q - z (scaled B: times the B column's scale).
template <class T, int BITS, class C>
__device__ __forceinline__ void qgemm_decode_kstep(const QGemmChunk<C::NT, lane_words(BITS)>& ch, int ks,
                                                   const QGemmGroupConsts<T, BITS, C>& gc, std::uint32_t (&b)[C::NT][2][2]) {
  using K = QGemmTraits<T, BITS, C>;
#pragma unroll
  for (int t = 0; t < C::NT; ++t) {
    if constexpr (K::kFold) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if constexpr (BITS == 8)
            b[t][j][r] = magic8_pair_f16(ch.w[t][2 * ks + j], r);
          else if constexpr (BITS == 3)
            b[t][j][r] = magic3_pair<T>(ch.w[t][0], ch.w[t][1], ch.w[t][2], 4 * ks + 2 * j + r);
          else
            b[t][j][r] = and_or<0x000F000Fu, (std::is_same_v<T, bf16> ? 0x43004300u : 0x64006400u)>(ch.w[t][ks] >> (4 * (2 * j + r)));
        }
    } else if constexpr (BITS == 8) {
      decode_word8<T>(ch.w[t][2 * ks], ch.w[t][2 * ks + 1], gc.zlo[t], gc.zf[t], b[t]);
    } else if constexpr (BITS == 3) {
      decode_word3<T>(ch.w[t][0], ch.w[t][1], ch.w[t][2], ks, gc.zlo[t], b[t]);
    } else {
      decode_word<T>(ch.w[t][ks], gc.zlo[t], gc.zhi[t], b[t]);
    }
    if constexpr (C::SCALEB) {
      using V = typename Vec2<T>::type;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) b[t][j][r] = u32(__hmul2(as_vec2<V>(b[t][j][r]), as_vec2<V>(gc.sb2[t][j])));
    }
  }
}

}  // namespace detail
}  // namespace squeeze::kernels::quant
