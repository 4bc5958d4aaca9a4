#pragma once
// Kernels that read the GPTQ checkpoint layout directly, for every width (2/3/4/8 bits):
//   dequantize  W [out, in] (float / fp16 / bf16) from qweight, qzeros, scales, g_idx
//   gemv        y [M, out] = x [M, in] * W^T for small M (the 3-bit and 8-bit path, and any g_idx)
// One element function (gptq_weight) holds the math; CPU and CUDA launchers apply it.
//   W[o, i] = scale[g, o] * (q[i, o] - zero[g, o]),  g = g_idx[i],  zero = stored + 1 (v1)
#include <algorithm>
#include <cmath>
#include <cstdint>

#include <squeeze/dtype.hpp>

#include "bitstream.cuh"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif

namespace squeeze::kernels::quant {

// Raw pointers to one packed layer (host or device memory, matching the launcher).
struct GptqView {
  const std::int32_t* qweight;  // [ceil(in*bits/32), out]
  const std::int32_t* qzeros;   // [groups, ceil(out*bits/32)]
  const half* scales;           // [groups, out]
  const std::int32_t* g_idx;    // [in]
  std::int64_t in, out;
  int bits;
};

SQUEEZE_HD float gptq_weight(const GptqView& v, std::int64_t i, std::int64_t o) {
  const std::uint32_t maxq = (1u << v.bits) - 1u;
  const std::int64_t g = v.g_idx[i];
  const std::int64_t zcols = (v.out * v.bits + 31) / 32;
  const std::uint32_t q = stream_get(v.qweight + o, v.out, i, v.bits);
  const std::uint32_t z = (stream_get(v.qzeros + g * zcols, 1, o, v.bits) + 1u) & maxq;
  return to_float(v.scales[g * v.out + o]) * (float(q) - float(z));
}

// ---- CPU launchers -------------------------------------------------------------------------------------------
template <FloatingElement T>
void dequantize_cpu(const GptqView& v, T* w /*[out, in]*/) {
#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
  for (std::int64_t o = 0; o < v.out; ++o)
    for (std::int64_t i = 0; i < v.in; ++i) w[o * v.in + i] = from_float<T>(gptq_weight(v, i, o));
}

// CPU twin of gemv_cuda: fp32 accumulation over i in order, per output.
template <FloatingElement T>
void gemv_cpu(const GptqView& v, const T* x /*[M, in]*/, T* y /*[M, out]*/, std::int64_t M) {
#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
  for (std::int64_t o = 0; o < v.out; ++o)
    for (std::int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (std::int64_t i = 0; i < v.in; ++i) acc = fmaf(to_float(x[m * v.in + i]), gptq_weight(v, i, o), acc);
      y[m * v.out + o] = from_float<T>(acc);
    }
}

#if defined(__CUDACC__)
namespace detail {
template <class T>
__global__ void dequantize_kernel(GptqView v, T* __restrict__ w) {
  const std::int64_t total = v.in * v.out;
  for (std::int64_t idx = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; idx < total; idx += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t o = idx / v.in, i = idx % v.in;
    w[idx] = from_float<T>(gptq_weight(v, i, o));
  }
}

// One thread per output column (qweight reads coalesce along out), grid.y splits `in`; partial sums go
// to an fp32 buffer with atomics, a second kernel rounds them to T.
constexpr int kGemvRows = 8;
template <class T>
__global__ void gemv_kernel(GptqView v, const T* __restrict__ x, float* __restrict__ acc, int M, int rows_per_split) {
  const std::int64_t o = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x;
  const std::int64_t i0 = std::int64_t(blockIdx.y) * rows_per_split, i1 = min(v.in, i0 + rows_per_split);
  if (o >= v.out) return;
  for (int m0 = 0; m0 < M; m0 += kGemvRows) {
    float a[kGemvRows] = {};
    for (std::int64_t i = i0; i < i1; ++i) {
      const float w = gptq_weight(v, i, o);
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r)
        if (m0 + r < M) a[r] = fmaf(to_float(x[(m0 + r) * v.in + i]), w, a[r]);
    }
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r)
      if (m0 + r < M) atomicAdd(acc + (m0 + r) * v.out + o, a[r]);
  }
}
template <class T>
__global__ void round_kernel(const float* __restrict__ acc, T* __restrict__ y, std::int64_t n) {
  for (std::int64_t idx = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; idx < n; idx += std::int64_t(gridDim.x) * blockDim.x)
    y[idx] = from_float<T>(acc[idx]);
}
}  // namespace detail

template <FloatingElement T>
cudaError_t dequantize_cuda(const GptqView& v, T* w, cudaStream_t stream) {
  if (v.in <= 0 || v.out <= 0 || !(v.bits == 2 || v.bits == 3 || v.bits == 4 || v.bits == 8)) return cudaErrorInvalidValue;
  const std::int64_t total = v.in * v.out;
  const unsigned blocks = unsigned(std::min<std::int64_t>((total + 255) / 256, 65535));
  detail::dequantize_kernel<T><<<blocks, 256, 0, stream>>>(v, w);
  return cudaGetLastError();
}

// acc: fp32 workspace of M * out elements (contents ignored; zeroed here).
template <FloatingElement T>
cudaError_t gemv_cuda(const GptqView& v, const T* x, T* y, int M, float* acc, cudaStream_t stream) {
  if (v.in <= 0 || v.out <= 0 || M <= 0 || !(v.bits == 2 || v.bits == 3 || v.bits == 4 || v.bits == 8)) return cudaErrorInvalidValue;
  if (auto e = cudaMemsetAsync(acc, 0, sizeof(float) * std::size_t(M) * std::size_t(v.out), stream); e != cudaSuccess) return e;
  const unsigned bx = unsigned((v.out + 255) / 256);
  const int splits = int(std::max<std::int64_t>(1, std::min<std::int64_t>(v.in / 128, (132 * 8 + bx - 1) / bx)));
  const int rows = int((v.in + splits - 1) / splits);
  detail::gemv_kernel<T><<<dim3(bx, unsigned(splits)), 256, 0, stream>>>(v, x, acc, M, rows);
  if (auto e = cudaGetLastError(); e != cudaSuccess) return e;
  const std::int64_t n = std::int64_t(M) * v.out;
  detail::round_kernel<T><<<unsigned(std::min<std::int64_t>((n + 255) / 256, 65535)), 256, 0, stream>>>(acc, y, n);
  return cudaGetLastError();
}
#endif  // __CUDACC__

}  // namespace squeeze::kernels::quant
