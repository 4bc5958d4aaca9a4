#pragma once
// CUDA launchers of SwiGLU (math, functor and CPU twin: swiglu.hpp). Elementwise, grid-stride; each thread moves
// 4 elements per array with one vector access when every pointer is aligned, the tail with the scalar functor.
// Forward reduces max |h| into a.amax on request, backward max |dg| and |du| (block_amax_into: one atomic a block).
// Bytes moved: forward reads g, u and writes h (3 n elements); backward reads g, u, dh and writes dg, du (5 n).
#include <array>

#include "squeeze/kernels/fused_common.cuh"
#include "squeeze/kernels/swiglu.hpp"

namespace squeeze::kernels {

namespace detail {
template <class T, bool Backward>
__global__ void __launch_bounds__(256) swiglu_kernel(const SwigluArgs<T> a, const bool vec) {
  using Op = SwigluOp<float>;
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x, first = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  std::int64_t scalar_begin = 0;
  float m = 0, mu = 0;  // max |h| (forward) or |dg| and |du| (backward) as stored, over this thread's elements
  if (vec) {
    const std::int64_t quads = a.n / kQuad;
    for (std::int64_t q = first; q < quads; q += stride) {
      float g[kQuad], u[kQuad];
      load4(a.g + q * kQuad, g);
      load4(a.u + q * kQuad, u);
      if constexpr (Backward) {
        float dh[kQuad], dg[kQuad], du[kQuad];
        load4(a.dh + q * kQuad, dh);
#pragma unroll
        for (int k = 0; k < kQuad; ++k) {
          Op::backward(g[k], u[k], dh[k], dg[k], du[k]);
          m = amax_of(fabsf(round_acc<T>(dg[k])), m);
          mu = amax_of(fabsf(round_acc<T>(du[k])), mu);
        }
        store4(a.dg + q * kQuad, dg);
        store4(a.du + q * kQuad, du);
      } else {
        float h[kQuad];
#pragma unroll
        for (int k = 0; k < kQuad; ++k) {
          h[k] = Op::forward(g[k], u[k]);
          m = amax_of(fabsf(round_acc<T>(h[k])), m);
        }
        store4(a.h + q * kQuad, h);
      }
    }
    scalar_begin = quads * kQuad;
  }
  for (std::int64_t i = scalar_begin + first; i < a.n; i += stride) {
    if constexpr (Backward)
      swiglu_backward_at(a, i, m, mu);
    else
      m = amax_of(swiglu_forward_at(a, i), m);
  }
  if constexpr (Backward) {
    if (a.amax_dg != nullptr) block_amax_into<256>(m, a.amax_dg);
    if (a.amax_du != nullptr) block_amax_into<256>(mu, a.amax_du);
  } else if (a.amax != nullptr) {
    block_amax_into<256>(m, a.amax);
  }
}

template <bool Backward, class T>
cudaError_t swiglu_launch(const SwigluArgs<T>& a, cudaStream_t stream) {
  if (a.n == 0) return cudaSuccess;
  bool vec = quad_aligned(a.g) && quad_aligned(a.u);
  if constexpr (Backward)
    vec = vec && quad_aligned(a.dh) && quad_aligned(a.dg) && quad_aligned(a.du);
  else
    vec = vec && quad_aligned(a.h);
  int blocks = 0;
  if (const cudaError_t e = fused_grid(vec ? (a.n + kQuad - 1) / kQuad : a.n, 256, blocks); e != cudaSuccess) return e;
  swiglu_kernel<T, Backward><<<blocks, 256, 0, stream>>>(a, vec);
  return cudaGetLastError();
}
}  // namespace detail

template <FloatingElement T>
cudaError_t swiglu_forward_cuda(const SwigluArgs<T>& a, cudaStream_t stream = nullptr) {
  validate(a, false, "swiglu forward (CUDA)");
  if (a.amax != nullptr)
    if (const cudaError_t e = cudaMemsetAsync(a.amax, 0, sizeof(float), stream); e != cudaSuccess) return e;
  return detail::swiglu_launch<false>(a, stream);
}
template <FloatingElement T>
cudaError_t swiglu_backward_cuda(const SwigluArgs<T>& a, cudaStream_t stream = nullptr) {
  validate(a, true, "swiglu backward (CUDA)");
  for (float* amax : std::array<float*, 2>{a.amax_dg, a.amax_du})
    if (amax != nullptr)
      if (const cudaError_t e = cudaMemsetAsync(amax, 0, sizeof(float), stream); e != cudaSuccess) return e;
  return detail::swiglu_launch<true>(a, stream);
}

}  // namespace squeeze::kernels
