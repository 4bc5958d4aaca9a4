#pragma once
// The sm90 family (gemm/sm90.cuh): the groups' constants, the kernel's parameters and the work policy (C::Work).
#if !defined(__CUDACC__)
#error "gemm/sm90/params.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <cuda.h>  // CUtensorMap (the type only: the encoder is reached through the runtime, no libcuda link)
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include "squeeze/kernels/quant/gemm/config.hpp"
#include "squeeze/kernels/quant/gemm/decode.cuh"
#include "squeeze/kernels/quant/gemm/layout.hpp"
#include "squeeze/kernels/quant/gemm/launch_plan.hpp"
#include "squeeze/kernels/quant/gemm/ptx.cuh"

namespace squeeze::kernels::quant {
namespace detail {

// Group constants of one thread's two A rows (r = 0: row l/4, r = 1: row l/4 + 8) of one tile, as T2 patterns:
// zc = magic + z (fp16 1024 + z, bf16 128 + z), zo = -(64 + z) (fp16 odd pairs, which read as 1024 + 16 q),
// sc = the scale (bf16: rounded from fp16).
struct Sm90Group {
  std::uint32_t zc[2], zo[2], sc[2];
  float scale[2];  // GSCALE: the rows' fp16 scales as fp32 (exact)
};
template <class T>
__device__ __forceinline__ Sm90Group sm90_group(const half* srow, const std::uint8_t* zrow, int n_lo) {
  Sm90Group g;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::uint32_t z = zrow[n_lo + 8 * r];
    const float s = __half2float(srow[n_lo + 8 * r]);
    g.scale[r] = s;
    if constexpr (std::is_same_v<T, bf16>) {
      g.zc[r] = sm90_bf16_magic_zero(z);
      g.zo[r] = 0;
      g.sc[r] = u32(__float2bfloat162_rn(s));
    } else {
      g.zc[r] = sm90_half_magic_zero(z);
      g.zo[r] = sm90_half_odd_zero(z);
      g.sc[r] = u32(__float2half2_rn(s));  // exact: s is fp16
    }
  }
  return g;
}
// One tile word (k-step) -> the wgmma A fragment: pair i (nibbles i, i + 4) covers row l/4 + 8 (i >> 1) and
// k 2 (l%4) + 8 (i & 1) (+1), i.e. register a[2 (i & 1) + (i >> 1)]; value (q - z) * scale rounded to T, or with
// SCALE false the exact q - z (the scale is applied to the group's fp32 sums, GSCALE).
template <class T, bool SCALE = true>
__device__ __forceinline__ void sm90_decode(std::uint32_t w, const Sm90Group& g, std::uint32_t (&a)[4]) {
  using V = typename Vec2<T>::type;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = i >> 1;
    const V pair = as_vec2<V>(magic_pair<T>(w, i));
    V v;
    if constexpr (std::is_same_v<T, bf16>) {
      v = __hsub2(pair, as_vec2<V>(g.zc[r]));  // exact small integer q - z
    } else if (i & 1) {
      v = __hfma2(pair, __float2half2_rn(1.f / 16.f), as_vec2<V>(g.zo[r]));  // (1024 + 16 q) / 16 - (64 + z), exact
    } else {
      v = __hsub2(pair, as_vec2<V>(g.zc[r]));
    }
    if constexpr (SCALE)
      a[2 * (i & 1) + r] = u32(__hmul2(v, as_vec2<V>(g.sc[r])));
    else
      a[2 * (i & 1) + r] = u32(v);
  }
}

struct Sm90Params {
  const void* x;               // T [M, K]
  const std::uint32_t* tiles;  // [Kpad/64][Npad/16] tiles
  const half* scales;          // [groups, Npad]
  const std::uint8_t* zeros;   // [groups, Npad]
  void* y;                     // T [M, N]
  float* partial;              // [splits, M, Npad] (K splits through global memory)
  int* counters;               // [zslices, strips], zero between launches (K splits through global memory)
  int M, N, K, Npad, group;
  int kchunks, cps, lead, cps_tail, strips, splits, zslices;  // K ranges: sm90_k_range
  int spread;                 // K splits through global memory: every block sums a share (Sm90Plan::spread; a cooperative launch)
  void* work_data = nullptr;  // the Work policy's own buffer (a measuring policy's timeline; the GEMM's has none)
};

// ---- the work done on each stage ------------------------------------------------------------------------------------
// Points of a block's timeline, in program order, where the kernel calls Work::at (consumer thread 0, or the producer
// lane for Producer*). Epilogue*: after the consumers' first barrier (every warpgroup's last chunk done; global: the
// partials written), after the next (one K range: the tile staged; cluster: every block's sums in place; spread: the
// other shares written and every block of the tile arrived; last block: the counter read), after the stores (reached
// only by the block that stores).
enum class Sm90Point {
  Entry,
  SetUp,
  FirstChunk,
  LoopEnd,
  End,
  EpilogueWaited,
  EpilogueStaged,
  EpilogueStored,
  ProducerStart,
  ProducerX,
  QueuedFirst,
  QueuedLast
};
// The GEMM's work: load each group's constants, decode, multiply, store; observe nothing. A configuration may name
// another as C::Work (config.hpp's WorkOf): the measuring policies of bench/quant/gemm_configs.cuh skip the decode or
// the consumers' work, or record a timeline at the Sm90Points.
struct Sm90Work {
  static constexpr bool kGroupConstants = true;  // each group's scale and zero-point rows read from the stage
  static constexpr bool kConsume = true;         // the consumers decode and multiply each stage (else only hand it back)
  template <class T, bool SCALE>
  __device__ __forceinline__ static void decode(std::uint32_t w, const Sm90Group& g, std::uint32_t (&a)[4]) {
    sm90_decode<T, SCALE>(w, g, a);
  }
  __device__ __forceinline__ static void at(const Sm90Params&, Sm90Point) {}
};

}  // namespace detail
}  // namespace squeeze::kernels::quant
