#pragma once
// The mma.sync family (gemm/mma_sync.cuh): the tile scheduler, which work items a block takes.
#if !defined(__CUDACC__)
#error "gemm/mma_sync/scheduler.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include "squeeze/kernels/quant/gemm/mma_sync/params.cuh"

namespace squeeze::kernels::quant {
namespace detail {

// ==== tile scheduler ===================================================================================================
// Work items (z slice, strip, K range of cps chunks); a block takes items_per_block consecutive ones. Order: the
// register / cp.async loaders (one item per block) put the z slice fastest, so the blocks that read the same weights
// run together and share them in L2; Bulk puts the strip fastest, so a block's consecutive items share their x slice
// (staged once per run) while the blocks of other z slices walk the same strips at the same time.
struct QGemmItem {
  int z, strip, split, kc0, nck;
};
template <bool kBulk>
__device__ __forceinline__ QGemmItem qgemm_item(const QGemmParams& p, int kchunks, int i) {
  QGemmItem it;
  if constexpr (kBulk) {
    it.strip = i % p.strips;
    i /= p.strips;
    it.z = i % p.zslices;
    it.split = i / p.zslices;
  } else {
    it.z = i % p.zslices;
    i /= p.zslices;
    it.strip = i % p.strips;
    it.split = i / p.strips;
  }
  it.kc0 = it.split * p.cps;
  it.nck = min(kchunks, it.kc0 + p.cps) - it.kc0;
  return it;
}

}  // namespace detail
}  // namespace squeeze::kernels::quant
