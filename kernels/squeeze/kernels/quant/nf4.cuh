#pragma once
// CUDA launchers of the NF4 codec (math, layout and CPU twins: nf4.hpp). Same element functions, so
// dequantise and quantise agree with the CPU twin bit for bit (the DoubleQuant mean is summed in float64
// in a different order; it can differ from the twin's in its last bit only).
//   nf4_dequantize_cuda(view, out, stream)            out [n] in float / half / bf16
//   nf4_quantize_cuda(w, n, block, dq, bufs, stream)  absmax per block -> codes -> (DoubleQuant of the absmax)
// All pointers are device pointers; returns cudaError_t (launch errors), squeeze::Error on bad arguments.
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>

#include "squeeze/kernels/quant/nf4.hpp"

#if !defined(__CUDACC__)
#error "nf4.cuh is a CUDA header: compile this translation unit with nvcc, or include nf4.hpp (the CPU twin)"
#endif

namespace squeeze::kernels::quant {

inline constexpr int kNf4Threads = 256;

namespace detail {

inline int nf4_grid(std::int64_t work, int threads) {
  const std::int64_t g = (work + threads - 1) / threads;
  return int(g < 65535 * 16 ? (g > 0 ? g : 1) : 65535 * 16);
}

// One thread per code byte: the two values it holds. The code table sits in shared memory (a local array
// indexed by data would live in local memory); its values are nf4_code_value's, so the math is the twin's.
// The general path: any block size, any alignment.
template <class T>
__global__ void __launch_bounds__(kNf4Threads) nf4_dequantize_kernel(const Nf4View v, T* __restrict__ out) {
  __shared__ float codes[16];
  if (threadIdx.x < 16) codes[threadIdx.x] = nf4_code_value(int(threadIdx.x));
  __syncthreads();
  const std::int64_t bytes = (v.n + 1) / 2;
  for (std::int64_t j = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; j < bytes; j += std::int64_t(gridDim.x) * blockDim.x) {
    const std::uint8_t byte = v.codes[j];
    const std::int64_t i = 2 * j;
    const float a0 = nf4_block_absmax(v, i / v.block);
    out[i] = from_float<T>(codes[byte >> 4] * a0);
    if (i + 1 < v.n) {
      const float a1 = (i + 1) % v.block == 0 ? nf4_block_absmax(v, (i + 1) / v.block) : a0;
      out[i + 1] = from_float<T>(codes[byte & 15] * a1);
    }
  }
}

// Sixteen values a thread: one 8-byte load of codes, one absmax (blocks are multiples of 16), the values stored 16
// bytes at a time. The output is 4x (bf16) to 8x (float) the bytes read, and only 16-byte stores bring its write to
// the copy bandwidth; the per-byte kernel above stores 2 bytes at a time. The last n % 16 values: the first thread.
inline constexpr int kNf4Values = 16;
template <class T>
__global__ void __launch_bounds__(kNf4Threads) nf4_dequantize16_kernel(const Nf4View v, T* __restrict__ out) {
  __shared__ float codes[16];
  if (threadIdx.x < 16) codes[threadIdx.x] = nf4_code_value(int(threadIdx.x));
  __syncthreads();
  const std::int64_t groups = v.n / kNf4Values;
  const auto* packed = reinterpret_cast<const uint2*>(v.codes);  // 8 code bytes = 16 values
  for (std::int64_t g = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; g < groups; g += std::int64_t(gridDim.x) * blockDim.x) {
    const uint2 word = packed[g];
    const float a = nf4_block_absmax(v, g * kNf4Values / v.block);
    alignas(16) T values[kNf4Values];
#pragma unroll
    for (int k = 0; k < kNf4Values / 2; ++k) {
      const unsigned byte = ((k < 4 ? word.x : word.y) >> (8 * (k & 3))) & 0xffu;  // little-endian: byte k of the 8
      values[2 * k] = from_float<T>(codes[byte >> 4] * a);
      values[2 * k + 1] = from_float<T>(codes[byte & 15] * a);
    }
    auto* dst = reinterpret_cast<uint4*>(out + g * kNf4Values);
    const auto* src = reinterpret_cast<const uint4*>(values);
#pragma unroll
    for (int q = 0; q < int(sizeof(values) / sizeof(uint4)); ++q) dst[q] = src[q];
  }
  if (blockIdx.x == 0 && threadIdx.x == 0)
    for (std::int64_t i = groups * kNf4Values; i < v.n; ++i)
      out[i] = from_float<T>(codes[nf4_code_at(v.codes, i)] * nf4_block_absmax(v, i / v.block));
}

// Whether the sixteen-a-thread kernel may run: a block holds whole groups of 16, codes 8-byte and out 16-byte aligned.
template <class T>
bool nf4_dequantize16_fits(const Nf4View& v, const T* out) {
  return v.block % kNf4Values == 0 && v.n >= kNf4Values && reinterpret_cast<std::uintptr_t>(v.codes) % 8 == 0 &&
         reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
}

// One thread per block of values (the same serial max as the twin).
template <class T>
__global__ void __launch_bounds__(kNf4Threads)
    nf4_absmax_kernel(const T* __restrict__ w, std::int64_t n, int block, float* __restrict__ absmax) {
  const std::int64_t blocks = (n + block - 1) / block;
  for (std::int64_t b = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; b < blocks; b += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t end = (b + 1) * block < n ? (b + 1) * block : n;
    float m = 0.f;
    for (std::int64_t i = b * block; i < end; ++i) {
      const float a = fabsf(to_float(w[i]));
      m = (a > m || a != a) ? a : m;
    }
    absmax[b] = m;
  }
}

// One CUDA block: the mean of absmax in float64 -> *offset.
template <int Threads>
__global__ void __launch_bounds__(Threads) nf4_mean_kernel(const float* __restrict__ absmax, std::int64_t blocks, float* offset) {
  double s = 0;
  for (std::int64_t b = threadIdx.x; b < blocks; b += Threads) s += absmax[b];
  using Reduce = cub::BlockReduce<double, Threads>;
  __shared__ typename Reduce::TempStorage tmp;
  const double total = Reduce(tmp).Sum(s);
  if (threadIdx.x == 0) *offset = float(total / double(blocks));
}

// One CUDA block of 256 threads per DoubleQuant group: nested_absmax = max|absmax - mean|, then each absmax value's
// code in the map (held in shared memory for the search).
template <int Threads>  // a template so the header can be included by many .cu files
__global__ void __launch_bounds__(Threads)
    nf4_dq_kernel(const float* __restrict__ absmax, std::int64_t blocks, const float* offset_ptr, const float* __restrict__ map,
                  std::uint8_t* __restrict__ absmax_code, float* __restrict__ nested_absmax) {
  static_assert(Threads == kNf4DqBlock, "one thread per absmax value of a DoubleQuant group");
  __shared__ float s_map[256];
  for (int i = threadIdx.x; i < 256; i += Threads) s_map[i] = map[i];
  const float mean = *offset_ptr;
  const std::int64_t b = std::int64_t(blockIdx.x) * Threads + threadIdx.x;
  const float centred = b < blocks ? absmax[b] - mean : 0.f;
  using Reduce = cub::BlockReduce<float, Threads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ float s_nested;
  const float m = Reduce(tmp).Reduce(fabsf(centred), [](float a, float c) { return fmaxf(a, c); });
  if (threadIdx.x == 0) {
    s_nested = m;
    nested_absmax[blockIdx.x] = m;
  }
  __syncthreads();
  if (b < blocks) absmax_code[b] = nf4_nested_code(s_map, centred * (1.0f / s_nested));
}

// One thread per code byte (the twin's loop body), against the exact block absmax.
template <class T>
__global__ void __launch_bounds__(kNf4Threads) nf4_encode_kernel(const T* __restrict__ w, std::int64_t n, int block,
                                                                 const float* __restrict__ absmax, std::uint8_t* __restrict__ codes) {
  const std::int64_t bytes = (n + 1) / 2;
  for (std::int64_t j = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; j < bytes; j += std::int64_t(gridDim.x) * blockDim.x)
    codes[j] = nf4_code_byte(w, n, block, absmax, j);
}

}  // namespace detail

template <FloatingElement T>
cudaError_t nf4_dequantize_cuda(const Nf4View& v, T* out /*[n], device*/, cudaStream_t stream = nullptr) {
  nf4_validate(v, "nf4_dequantize_cuda");
  check(out != nullptr, "nf4_dequantize_cuda: output pointer is null");
  if (detail::nf4_dequantize16_fits(v, out))
    detail::nf4_dequantize16_kernel<T><<<detail::nf4_grid(v.n / detail::kNf4Values, kNf4Threads), kNf4Threads, 0, stream>>>(v, out);
  else
    detail::nf4_dequantize_kernel<T><<<detail::nf4_grid(nf4_code_bytes(v.n), kNf4Threads), kNf4Threads, 0, stream>>>(v, out);
  return cudaGetLastError();
}

// Device buffers of nf4_quantize_cuda (sizes as in nf4.hpp's layout). absmax is written in both modes (under
// DoubleQuant it is scratch: the decoder uses absmax_code / nested_absmax / offset); nested_map is read.
struct Nf4DeviceBuffers {
  std::uint8_t* codes = nullptr;        // [ceil(n/2)]
  float* absmax = nullptr;              // [blocks]
  std::uint8_t* absmax_code = nullptr;  // [blocks]            (DoubleQuant)
  float* nested_absmax = nullptr;       // [ceil(blocks/256)]  (DoubleQuant)
  const float* nested_map = nullptr;    // [256], an input     (DoubleQuant)
  float* absmax_offset = nullptr;       // [1]                 (DoubleQuant)
};

// Quantises w [n] (device) into bufs, all on `stream` (no host synchronisation).
template <FloatingElement T>
cudaError_t nf4_quantize_cuda(const T* w, std::int64_t n, int block, bool double_quant, const Nf4DeviceBuffers& bufs,
                              cudaStream_t stream = nullptr) {
  nf4_validate(n, block, "nf4_quantize_cuda");
  check(w != nullptr && bufs.codes != nullptr && bufs.absmax != nullptr, "nf4_quantize_cuda: weight / codes / absmax pointer is null");
  check(!double_quant ||
            (bufs.absmax_code != nullptr && bufs.nested_absmax != nullptr && bufs.nested_map != nullptr && bufs.absmax_offset != nullptr),
        "nf4_quantize_cuda: DoubleQuant needs absmax_code, nested_absmax, nested_map and absmax_offset buffers");
  const std::int64_t blocks = nf4_blocks(n, block);
  detail::nf4_absmax_kernel<T><<<detail::nf4_grid(blocks, kNf4Threads), kNf4Threads, 0, stream>>>(w, n, block, bufs.absmax);
  detail::nf4_encode_kernel<T>
      <<<detail::nf4_grid(nf4_code_bytes(n), kNf4Threads), kNf4Threads, 0, stream>>>(w, n, block, bufs.absmax, bufs.codes);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (double_quant) {
    detail::nf4_mean_kernel<1024><<<1, 1024, 0, stream>>>(bufs.absmax, blocks, bufs.absmax_offset);
    detail::nf4_dq_kernel<kNf4DqBlock><<<unsigned(nf4_dq_groups(blocks)), kNf4DqBlock, 0, stream>>>(
        bufs.absmax, blocks, bufs.absmax_offset, bufs.nested_map, bufs.absmax_code, bufs.nested_absmax);
  }
  return cudaGetLastError();
}

}  // namespace squeeze::kernels::quant
