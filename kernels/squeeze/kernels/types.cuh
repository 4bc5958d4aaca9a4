#pragma once
// Device-side element-type helpers shared by squeeze's CUDA kernels.
//   * squeeze::half / squeeze::bf16 are CUDA's __half / __nv_bfloat16 (see squeeze/dtype.hpp), so
//     to_float / from_float<T> are CUDA's conversion intrinsics on the device.
//   * 16-byte vector loads/stores that convert to/from float registers: every streaming kernel moves
//     memory in 16-byte transactions (LDG.128 / STG.128), whatever the element type.
//   * Launch-size helpers (SM count per device, cached).
// CUDA-only header: include it from .cu translation units built by nvcc.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"

#if !defined(__CUDACC__)
#error "squeeze/kernels/*.cuh are CUDA headers: compile this translation unit with nvcc (a .cu file), or include the .hpp CPU twin instead"
#endif

#define SQUEEZE_DEVICE __device__ __forceinline__

namespace squeeze::kernels {

// Bytes moved by one vector load or store.
inline constexpr int kVecBytes = 16;

// Elements of T in one 16-byte vector: 4 floats, 8 halves/bf16s.
template <class T>
inline constexpr int kVecElems = kVecBytes / int(sizeof(T));

// 16 bytes of T, aligned so that one load/store is a single 128-bit transaction.
template <class T>
struct alignas(kVecBytes) Pack16 {
  T v[kVecElems<T>];
};

// True when p can be read/written with 16-byte vectors (cudaMalloc gives 256-byte alignment; views
// at offsets that are not a multiple of 16 bytes fall back to scalar code).
template <class T>
SQUEEZE_HD bool vec_aligned(const T* p) {
  return (reinterpret_cast<std::uintptr_t>(p) % kVecBytes) == 0;
}

// Loads N consecutive elements of T at p (16-byte aligned) into float registers.
// N * sizeof(T) must be a multiple of 16: e.g. N = 8 is two LDG.128 for float, one for bf16.
template <int N, class T>
SQUEEZE_DEVICE void load_float(const T* __restrict__ p, float (&out)[N]) {
  constexpr int E = kVecElems<T>;
  static_assert(N % E == 0, "load_float<N, T>: N elements of T must fill whole 16-byte vectors");
#pragma unroll
  for (int k = 0; k < N / E; ++k) {
    const Pack16<T> pk = reinterpret_cast<const Pack16<T>*>(p)[k];
#pragma unroll
    for (int j = 0; j < E; ++j) out[k * E + j] = to_float(pk.v[j]);
  }
}

// Stores N float registers to N consecutive elements of T at p (16-byte aligned), rounding to nearest even.
template <int N, class T>
SQUEEZE_DEVICE void store_float(T* __restrict__ p, const float (&in)[N]) {
  constexpr int E = kVecElems<T>;
  static_assert(N % E == 0, "store_float<N, T>: N elements of T must fill whole 16-byte vectors");
#pragma unroll
  for (int k = 0; k < N / E; ++k) {
    Pack16<T> pk;
#pragma unroll
    for (int j = 0; j < E; ++j) pk.v[j] = from_float<T>(in[k * E + j]);
    reinterpret_cast<Pack16<T>*>(p)[k] = pk;
  }
}

// Number of SMs of the current device, cached per device id (the attribute query is not free).
// Returns the CUDA status; `n` is left unchanged on failure.
inline cudaError_t sm_count(int& n) {
  constexpr int kMaxDevices = 64;
  static int cache[kMaxDevices] = {};
  int dev = 0;
  if (const cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (dev < kMaxDevices && cache[dev] != 0) {
    n = cache[dev];
    return cudaSuccess;
  }
  int count = 0;
  if (const cudaError_t e = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev); e != cudaSuccess) return e;
  if (dev < kMaxDevices) cache[dev] = count;
  n = count;
  return cudaSuccess;
}

}  // namespace squeeze::kernels
