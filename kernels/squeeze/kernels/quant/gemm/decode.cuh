#pragma once
// Device side of the decode: a tile word -> the mma.m16n8k16 fragment registers (q - z) of one k-step, for the
// mma.sync GEMM and the streaming GEMV experiment (bench/quant/qgemv.cuh). The bit tricks are decode.hpp's, shared with the CPU twin.
#if !defined(__CUDACC__)
#error "gemm/decode.cuh is a CUDA header: compile this translation unit with nvcc (the host decode: gemm/decode.hpp)"
#endif

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "squeeze/kernels/quant/gemm/decode.hpp"

namespace squeeze::kernels::quant::detail {

template <class T>
struct Vec2;
template <>
struct Vec2<half> {
  using type = __half2;
};
template <>
struct Vec2<bf16> {
  using type = __nv_bfloat162;
};

__device__ __forceinline__ std::uint32_t u32(__half2 v) { return *reinterpret_cast<std::uint32_t*>(&v); }
__device__ __forceinline__ std::uint32_t u32(__nv_bfloat162 v) { return *reinterpret_cast<std::uint32_t*>(&v); }
template <class V>
__device__ __forceinline__ V as_vec2(std::uint32_t u) {
  return *reinterpret_cast<V*>(&u);
}

// The zero-point operands of decode_word for zero point z: zlo = (magic + z) as a T pair (bf16 128 + z, fp16 1024 + z);
// zhi (fp16 only; 0 for bf16) = -(64 + z), for the pairs that read as 1024 + 16 v.
template <class T>
__device__ __forceinline__ void zero_operands(std::uint32_t z, std::uint32_t& zlo, std::uint32_t& zhi) {
  if constexpr (std::is_same_v<T, bf16>) {
    zlo = (0x4300u + z) * 0x00010001u;
    zhi = 0u;
  } else {
    zlo = (0x6400u + z) * 0x00010001u;
    zhi = u32(__float2half2_rn(float(-64 - int(z))));
  }
}

// 4-bit: B registers (q - z) of one k-step for both n8 halves j: b[j][r].
template <class T>
__device__ __forceinline__ void decode_word(std::uint32_t w, const std::uint32_t (&zlo)[2], const std::uint32_t (&zhi)[2],
                                            std::uint32_t (&b)[2][2]) {
  using V = typename Vec2<T>::type;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const V lo = as_vec2<V>(magic_pair<T>(w, 2 * j)), hi = as_vec2<V>(magic_pair<T>(w, 2 * j + 1));
    if constexpr (std::is_same_v<T, bf16>) {
      b[j][0] = u32(__hsub2(lo, as_vec2<V>(zlo[j])));
      b[j][1] = u32(__hsub2(hi, as_vec2<V>(zlo[j])));
    } else {
      b[j][0] = u32(__hsub2(lo, as_vec2<V>(zlo[j])));
      b[j][1] = u32(__hfma2(hi, __float2half2_rn(1.f / 16.f), as_vec2<V>(zhi[j])));
    }
  }
}

// 8-bit: B registers of one k-step from words w0 (n8 half 0) and w1 (half 1). fp16: 1024 + v magic, minus (1024 + z).
// bf16 (7 mantissa bits cannot hold 8-bit codes): fp32 magic 2^23 + v minus (2^23 + z), then pairs to bf16
// (|q - z| <= 255 is exact in bf16).
template <class T>
__device__ __forceinline__ void decode_word8(std::uint32_t w0, std::uint32_t w1, const std::uint32_t (&zlo)[2], const float (&zf)[2],
                                             std::uint32_t (&b)[2][2]) {
  const std::uint32_t w[2] = {w0, w1};
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (std::is_same_v<T, bf16>) {
        const std::uint32_t s = w[j] >> (16 * r);
        const float lo = __uint_as_float(0x4B000000u | (s & 0xFFu)) - zf[j];
        const float hi = __uint_as_float(0x4B000000u | ((s >> 8) & 0xFFu)) - zf[j];
        b[j][r] = u32(__floats2bfloat162_rn(lo, hi));
      } else {
        b[j][r] = u32(__hsub2(as_vec2<__half2>(magic8_pair_f16(w[j], r)), as_vec2<__half2>(zlo[j])));
      }
    }
}

// 3-bit: B registers of k-step ks (pairs 4 ks .. 4 ks + 3) for both n8 halves: value - (magic + z).
template <class T>
__device__ __forceinline__ void decode_word3(std::uint32_t w0, std::uint32_t w1, std::uint32_t w2, int ks, const std::uint32_t (&zlo)[2],
                                             std::uint32_t (&b)[2][2]) {
  using V = typename Vec2<T>::type;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) b[j][r] = u32(__hsub2(as_vec2<V>(magic3_pair<T>(w0, w1, w2, 4 * ks + 2 * j + r)), as_vec2<V>(zlo[j])));
}

}  // namespace squeeze::kernels::quant::detail
