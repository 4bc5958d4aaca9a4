#pragma once
// CUDA launcher of the in-place RoPE (math, functor and CPU twin: rope.hpp). Bytes moved: one read and one write of
// x, plus the tables (T x D/2 x 2 fp32, cached). Four pairs a thread where head_dim / 2 is a multiple of 4 and the
// pointers allow vector accesses (the LLaMA heads), else one pair a thread; either way consecutive threads take
// consecutive i of a head, so both halves' accesses are contiguous per warp.
#include "squeeze/kernels/fused_common.cuh"
#include "squeeze/kernels/rope.hpp"

namespace squeeze::kernels {

namespace detail {
template <class T>
__global__ void __launch_bounds__(256) rope_kernel(const RopeArgs<T> a, const std::int64_t pairs) {
  for (std::int64_t p = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs; p += std::int64_t(gridDim.x) * blockDim.x)
    rope_pair(a, p);
}

// Four consecutive pairs (i .. i+3 of one head): one quad load and store per half of x (load4 / store4) and one float4
// per table, and one index computation for the four (64-bit divisions are most of a one-pair thread's work). The same
// rotation per element as rope_pair.
template <class T>
__global__ void __launch_bounds__(256) rope4_kernel(const RopeArgs<T> a, const std::int64_t quads) {
  const std::int64_t half = a.head_dim / 2, quads_per_head = half / kQuad;
  const float sign = a.inverse ? -1.0f : 1.0f;
  for (std::int64_t q = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < quads; q += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t head_row = q / quads_per_head, i = (q - head_row * quads_per_head) * kQuad;  // head_row = row * heads + head
    const std::int64_t pos = (head_row / a.heads) % a.seq;
    T* base = a.x + head_row * a.head_dim;
    const T* src = a.in ? a.in + head_row * a.head_dim : base;
    float x1[kQuad], x2[kQuad];
    load4(src + i, x1);
    load4(src + i + half, x2);
    const float4 c = *reinterpret_cast<const float4*>(a.cos + pos * a.table_stride + i);
    const float4 s = *reinterpret_cast<const float4*>(a.sin + pos * a.table_stride + i);
    const float cs[kQuad] = {c.x, c.y, c.z, c.w}, ss[kQuad] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int k = 0; k < kQuad; ++k) RopeOp<float>::rotate(x1[k], x2[k], cs[k], ss[k], sign);
    store4(base + i, x1);
    store4(base + i + half, x2);
  }
}

// Whether rope4_kernel may run: whole quads per half head, x (and in) by quads, the fp32 tables by float4.
template <class T>
bool rope4_fits(const RopeArgs<T>& a) {
  return (a.head_dim / 2) % kQuad == 0 && a.table_stride % kQuad == 0 && quad_aligned(a.x) && (a.in == nullptr || quad_aligned(a.in)) &&
         quad_aligned(a.cos) && quad_aligned(a.sin);
}
}  // namespace detail

// x, cos and sin are device pointers. Returns the launch status.
template <FloatingElement T>
cudaError_t rope_cuda(const RopeArgs<T>& a, cudaStream_t stream = nullptr) {
  validate(a, "rope (CUDA)");
  const std::int64_t pairs = a.rows * a.heads * (a.head_dim / 2);
  if (pairs == 0) return cudaSuccess;
  const bool quads = detail::rope4_fits(a);
  const std::int64_t work = quads ? pairs / kQuad : pairs;
  int blocks = 0;
  if (const cudaError_t e = fused_grid(work, 256, blocks); e != cudaSuccess) return e;
  if (quads)
    detail::rope4_kernel<T><<<blocks, 256, 0, stream>>>(a, work);
  else
    detail::rope_kernel<T><<<blocks, 256, 0, stream>>>(a, pairs);
  return cudaGetLastError();
}

}  // namespace squeeze::kernels
