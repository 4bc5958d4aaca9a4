#pragma once
// CUDA launchers of the FP8 casts (math and CPU twin: fp8_cast.hpp). Two passes over x, no host synchronisation:
//   fp8_amax_cuda   max |x| into one device float (a block reduction per block, then an integer atomicMax:
//                   block_amax_into; the RMSNorm and SwiGLU kernels reduce their outputs' amax the same way)
//   fp8_cast_cuda   each block scales and encodes a 64 x 64 tile of x, writes it to out row by row and, through shared
//                   memory, to out_t column by column: the value and its transpose from one read of x; four values a
//                   thread where the sizes and pointers allow (one vector load, 4-byte stores), else one
// Bytes moved: amax reads x (2 n for bf16); the cast reads x and writes n per output asked for.
#include <cub/block/block_reduce.cuh>

#include "squeeze/kernels/fp8_cast.hpp"
#include "squeeze/kernels/fused_common.cuh"

namespace squeeze::kernels {

namespace detail {
inline constexpr int kFp8Tile = 64, kFp8Threads = 256;

template <class T>
__global__ void __launch_bounds__(kFp8Threads) fp8_amax_kernel(const T* __restrict__ x, const std::int64_t n, float* amax) {
  float m = 0;
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) m = amax_of(fabsf(to_float(x[i])), m);
  block_amax_into<kFp8Threads>(m, amax);
}

// Quads: four consecutive values a thread, one vector load of x and one 4-byte store of their codes (cols a multiple
// of 4, x and out quad-aligned); the transpose likewise four rows of a column a thread from shared memory (rows a
// multiple of 4, out_t 4-byte aligned). Otherwise one value a thread. Same bytes either way.
template <class T, bool Quads>
__global__ void __launch_bounds__(kFp8Threads) fp8_cast_kernel(const Fp8CastArgs<T> a) {
  __shared__ alignas(4) std::uint8_t tile[kFp8Tile][kFp8Tile + 4];  // padded: the column reads fall in different banks
  const float s = fp8_scale(*a.amax, a.format);
  if (blockIdx.x == 0 && threadIdx.x == 0 && a.inverse_scale != nullptr) *a.inverse_scale = 1.0f / s;
  const std::int64_t tiles_c = (a.cols + kFp8Tile - 1) / kFp8Tile, tiles = tiles_c * ((a.rows + kFp8Tile - 1) / kFp8Tile);
  // Scalar: 64 columns x 4 rows a pass. Quads: 16 quads x 16 rows a pass (threads of a warp cover two 64-byte rows).
  constexpr int kLanes = Quads ? kFp8Tile / kQuad : kFp8Tile, kRowsPerPass = kFp8Threads / kLanes, kWidth = Quads ? kQuad : 1;
  const int tx = (threadIdx.x % kLanes) * kWidth, ty = threadIdx.x / kLanes;
  for (std::int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const std::int64_t r0 = (t / tiles_c) * kFp8Tile, c0 = (t % tiles_c) * kFp8Tile;
    for (int i = ty; i < kFp8Tile; i += kRowsPerPass) {
      const std::int64_t r = r0 + i, c = c0 + tx;
      if (r >= a.rows || c >= a.cols) continue;
      if constexpr (Quads) {  // c + 3 < cols: cols is a multiple of 4
        float v[kQuad];
        load4(a.x + r * a.cols + c, v);
        std::uint32_t q = 0;
#pragma unroll
        for (int k = 0; k < kQuad; ++k) q |= std::uint32_t(fp8_encode(v[k] * s, a.format)) << (8 * k);
        if (a.out != nullptr) *reinterpret_cast<std::uint32_t*>(a.out + r * a.cols + c) = q;
        *reinterpret_cast<std::uint32_t*>(&tile[i][tx]) = q;
      } else {
        const std::uint8_t q = fp8_encode(to_float(a.x[r * a.cols + c]) * s, a.format);
        if (a.out != nullptr) a.out[r * a.cols + c] = q;
        tile[i][tx] = q;
      }
    }
    if (a.out_t == nullptr) continue;
    __syncthreads();
    for (int i = ty; i < kFp8Tile; i += kRowsPerPass) {  // row i of the transposed tile: column c0 + i of x
      const std::int64_t c = c0 + i, r = r0 + tx;
      if (c >= a.cols || r >= a.rows) continue;
      if constexpr (Quads) {  // rows r .. r + 3 of column c, gathered from the tile's column
        const std::uint32_t q = std::uint32_t(tile[tx][i]) | std::uint32_t(tile[tx + 1][i]) << 8 | std::uint32_t(tile[tx + 2][i]) << 16 |
                                std::uint32_t(tile[tx + 3][i]) << 24;
        *reinterpret_cast<std::uint32_t*>(a.out_t + c * a.rows + r) = q;
      } else {
        a.out_t[c * a.rows + r] = tile[tx][i];
      }
    }
    __syncthreads();
  }
}
}  // namespace detail

// *amax = max |x| over n values (NaN if any is NaN), on `stream`.
template <FloatingElement T>
cudaError_t fp8_amax_cuda(const T* x, std::int64_t n, float* amax, cudaStream_t stream = nullptr) {
  if (amax == nullptr) throw Error("fp8 amax (CUDA): amax is null");
  if (const cudaError_t e = cudaMemsetAsync(amax, 0, sizeof(float), stream); e != cudaSuccess) return e;
  if (n == 0) return cudaSuccess;
  int blocks = 0;
  if (const cudaError_t e = fused_grid(n, detail::kFp8Threads, blocks); e != cudaSuccess) return e;
  detail::fp8_amax_kernel<T><<<blocks, detail::kFp8Threads, 0, stream>>>(x, n, amax);
  return cudaGetLastError();
}

template <FloatingElement T>
cudaError_t fp8_cast_cuda(const Fp8CastArgs<T>& a, cudaStream_t stream = nullptr) {
  validate(a, "fp8 cast (CUDA)");
  const std::int64_t tiles = ((a.rows + detail::kFp8Tile - 1) / detail::kFp8Tile) * ((a.cols + detail::kFp8Tile - 1) / detail::kFp8Tile);
  int blocks = 0;
  if (const cudaError_t e = fused_grid(tiles * detail::kFp8Threads, detail::kFp8Threads, blocks); e != cudaSuccess) return e;
  const bool quads = a.cols % kQuad == 0 && quad_aligned(a.x) && (a.out == nullptr || quad_aligned(a.out)) &&
                     (a.out_t == nullptr || (a.rows % kQuad == 0 && quad_aligned(a.out_t)));
  if (quads)  // also with no tiles: the inverse scale
    detail::fp8_cast_kernel<T, true><<<blocks, detail::kFp8Threads, 0, stream>>>(a);
  else
    detail::fp8_cast_kernel<T, false><<<blocks, detail::kFp8Threads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace squeeze::kernels
