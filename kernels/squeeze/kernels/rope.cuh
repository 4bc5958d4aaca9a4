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

// Four consecutive pairs (i .. i+3 of one head): one vector load and store per half of x and one float4 per table, and
// one index computation for the four (64-bit divisions are most of a one-pair thread's work). The same rotation per
// element as rope_pair.
inline constexpr int kRopePairs = 4;
template <class T>
struct alignas(sizeof(T) * kRopePairs) RopeQuad {
  T v[kRopePairs];
};
template <class T>
__global__ void __launch_bounds__(256) rope4_kernel(const RopeArgs<T> a, const std::int64_t quads) {
  using Acc = acc_t<T>;
  const std::int64_t half = a.head_dim / 2, quads_per_head = half / kRopePairs;
  const Acc sign = a.inverse ? Acc(-1) : Acc(1);
  for (std::int64_t q = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < quads; q += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t head_row = q / quads_per_head, i = (q - head_row * quads_per_head) * kRopePairs;  // head_row = row * heads + head
    const std::int64_t pos = (head_row / a.heads) % a.seq;
    T* base = a.x + head_row * a.head_dim;
    const T* src = a.in ? a.in + head_row * a.head_dim : base;
    RopeQuad<T> x1 = *reinterpret_cast<const RopeQuad<T>*>(src + i), x2 = *reinterpret_cast<const RopeQuad<T>*>(src + i + half);
    const float4 c = *reinterpret_cast<const float4*>(a.cos + pos * a.table_stride + i);
    const float4 s = *reinterpret_cast<const float4*>(a.sin + pos * a.table_stride + i);
    const float cs[kRopePairs] = {c.x, c.y, c.z, c.w}, ss[kRopePairs] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int k = 0; k < kRopePairs; ++k) {
      Acc u = load_acc(x1.v[k]), w = load_acc(x2.v[k]);
      RopeOp<Acc>::rotate(u, w, cs[k], ss[k], sign);
      x1.v[k] = store_acc<T>(u);
      x2.v[k] = store_acc<T>(w);
    }
    *reinterpret_cast<RopeQuad<T>*>(base + i) = x1;
    *reinterpret_cast<RopeQuad<T>*>(base + i + half) = x2;
  }
}

// Whether rope4_kernel may run: whole quads per half head, aligned vectors (the tables are fp32 for every T here).
template <class T>
bool rope4_fits(const RopeArgs<T>& a) {
  auto aligned = [](const void* p, std::size_t n) { return reinterpret_cast<std::uintptr_t>(p) % n == 0; };
  return (a.head_dim / 2) % kRopePairs == 0 && a.table_stride % kRopePairs == 0 && aligned(a.x, sizeof(RopeQuad<T>)) &&
         (a.in == nullptr || aligned(a.in, sizeof(RopeQuad<T>))) && aligned(a.cos, 16) && aligned(a.sin, 16);
}
}  // namespace detail

// x, cos and sin are device pointers. Returns the launch status.
template <FloatingElement T>
cudaError_t rope_cuda(const RopeArgs<T>& a, cudaStream_t stream = nullptr) {
  validate(a, "rope (CUDA)");
  const std::int64_t pairs = a.rows * a.heads * (a.head_dim / 2);
  if (pairs == 0) return cudaSuccess;
  const bool quads = detail::rope4_fits(a);
  const std::int64_t work = quads ? pairs / detail::kRopePairs : pairs;
  int blocks = 0;
  if (const cudaError_t e = fused_grid(work, 256, blocks); e != cudaSuccess) return e;
  if (quads)
    detail::rope4_kernel<T><<<blocks, 256, 0, stream>>>(a, work);
  else
    detail::rope_kernel<T><<<blocks, 256, 0, stream>>>(a, pairs);
  return cudaGetLastError();
}

}  // namespace squeeze::kernels
