#pragma once
// Device helpers of the fused LLaMA kernels: four consecutive elements loaded to / stored from fp32 registers
// with one vector access (16 bytes for float, 8 for half / bf16), with L1 caching (a row is read twice).
#include <cub/block/block_reduce.cuh>

#include "squeeze/kernels/fused_common.hpp"
#include "squeeze/kernels/types.cuh"

namespace squeeze::kernels {

template <class T>
SQUEEZE_DEVICE void load4(const T* p, float (&out)[kQuad]) {
  const QuadBits<T> bits = *reinterpret_cast<const QuadBits<T>*>(p);
  Quad<T> v;
  memcpy(&v, &bits, sizeof v);
#pragma unroll
  for (int k = 0; k < kQuad; ++k) out[k] = to_float(v.v[k]);
}

template <class T>
SQUEEZE_DEVICE void store4(T* p, const float (&in)[kQuad]) {
  Quad<T> v;
#pragma unroll
  for (int k = 0; k < kQuad; ++k) v.v[k] = from_float<T>(in[k]);
  QuadBits<T> bits;
  memcpy(&bits, &v, sizeof bits);
  *reinterpret_cast<QuadBits<T>*>(p) = bits;
}

// Every thread's amax_of reduced over the block, then into *amax (zeroed before the launch) with an integer atomicMax:
// the bits of non-negative floats order as integers, and a NaN's bits exceed inf's, so a NaN wins. Every thread of the
// block calls it; one call may follow another (the shared scratch is waited for).
template <int Threads>
SQUEEZE_DEVICE void block_amax_into(float m, float* amax) {
  struct Max {
    SQUEEZE_DEVICE float operator()(float a, float b) const { return amax_of(a, b); }
  };
  using Reduce = cub::BlockReduce<float, Threads>;
  __shared__ typename Reduce::TempStorage temp;
  __syncthreads();  // a previous call's reduction is done with temp
  m = Reduce(temp).Reduce(m, Max{});
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));
}

// Block size of the row kernels: 128 threads up to 1024-element rows (tiny and 1B-class hidden sizes), else 256.
inline int fused_row_threads(std::int64_t h) { return h <= 1024 ? 128 : 256; }

// Blocks for a grid-stride launch over `work` items at `threads` per block: enough to fill the device.
inline cudaError_t fused_grid(std::int64_t work, int threads, int& blocks) {
  int sms = 0;
  if (const cudaError_t e = sm_count(sms); e != cudaSuccess) return e;
  const std::int64_t want = (work + threads - 1) / threads, cap = std::int64_t(sms) * (2048 / threads) * 4;
  blocks = int(want < cap ? (want > 0 ? want : 1) : cap);
  return cudaSuccess;
}

}  // namespace squeeze::kernels
