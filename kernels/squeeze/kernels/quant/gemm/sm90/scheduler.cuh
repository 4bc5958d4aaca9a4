#pragma once
// The sm90 family (gemm/sm90.cuh): the tile scheduler, which tile a block takes.
#if !defined(__CUDACC__)
#error "gemm/sm90/scheduler.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include "squeeze/kernels/quant/gemm/sm90/params.cuh"

namespace squeeze::kernels::quant {
namespace detail {

// ==== tile scheduler ===================================================================================================
// This block's work: batch slice z, strip, chunks [kc0, kc0 + nck), K range `split` of p.splits (1: y stored directly).
// The batch slices of a strip are neighbouring blocks, so they run at the same time and the slices after the first find
// the strip's weights in L2.
struct Sm90Tile {
  int z, strip, split, n0, tile0, m0, kc0, nck;
};
template <class C>
__device__ __forceinline__ Sm90Tile sm90_tile(const Sm90Params& p) {
  Sm90Tile t;
  t.z = int(blockIdx.x % p.zslices), t.strip = int(blockIdx.x / p.zslices), t.split = int(blockIdx.z);
  t.n0 = t.strip * C::STRIP, t.tile0 = t.strip * C::TILES, t.m0 = t.z * C::BN;
  const Sm90Range range = sm90_k_range(t.split, p.kchunks, p.cps, p.lead, p.cps_tail);
  t.kc0 = range.kc0, t.nck = range.nck;
  return t;
}
// The group of k: padded k rows (k >= K) belong to the last group (x is zero there), as in the CPU twin.
__device__ inline int sm90_group_of(const Sm90Params& p, int k) { return min(k, p.K - 1) / p.group; }

}  // namespace detail
}  // namespace squeeze::kernels::quant
