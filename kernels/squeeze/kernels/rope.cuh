#pragma once
// CUDA launcher of the in-place RoPE (math, functor and CPU twin: rope.hpp). One thread per rotated pair,
// grid-stride: consecutive threads take consecutive i of a head, so both halves' accesses are contiguous per warp.
// Bytes moved: one read and one write of x, plus the tables (T x D/2 x 2 fp32, cached).
#include "squeeze/kernels/fused_common.cuh"
#include "squeeze/kernels/rope.hpp"

namespace squeeze::kernels {

namespace detail {
template <class T>
__global__ void __launch_bounds__(256) rope_kernel(const RopeArgs<T> a, const std::int64_t pairs) {
  for (std::int64_t p = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs; p += std::int64_t(gridDim.x) * blockDim.x)
    rope_pair(a, p);
}
}  // namespace detail

// x, cos and sin are device pointers. Returns the launch status.
template <FloatingElement T>
cudaError_t rope_cuda(const RopeArgs<T>& a, cudaStream_t stream = nullptr) {
  validate(a, "rope (CUDA)");
  const std::int64_t pairs = a.rows * a.heads * (a.head_dim / 2);
  if (pairs == 0) return cudaSuccess;
  int blocks = 0;
  if (const cudaError_t e = fused_grid(pairs, 256, blocks); e != cudaSuccess) return e;
  detail::rope_kernel<T><<<blocks, 256, 0, stream>>>(a, pairs);
  return cudaGetLastError();
}

}  // namespace squeeze::kernels
