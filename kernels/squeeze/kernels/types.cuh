#pragma once
// Device-side element-type helpers shared by squeeze's CUDA kernels.
//   * squeeze::half / squeeze::bf16 are CUDA's __half / __nv_bfloat16 (see squeeze/dtype.hpp), so
//     to_float / from_float<T> are CUDA's conversion intrinsics on the device.
//   * quad (4-element) vector loads/stores that convert to/from float registers, in the warp-contiguous
//     tile layout of tensor_list.hpp.
//   * Launch-size helpers (SM count per device, cached).
// CUDA-only header: include it from .cu translation units built by nvcc.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"
#include "squeeze/kernels/tensor_list.hpp"

#if !defined(__CUDACC__)
#error "squeeze/kernels/*.cuh are CUDA headers: compile this translation unit with nvcc (a .cu file), or include the .hpp CPU twin instead"
#endif

#define SQUEEZE_DEVICE __device__ __forceinline__

namespace squeeze::kernels {

// Four consecutive elements of T, aligned so one load/store is a single transaction: 16 bytes for float
// (LDG.128), 8 for half/bf16 (LDG.64). The streaming kernels move quads in the tile layout of
// tensor_list.hpp (quad_start), so every warp-wide access is contiguous.
template <class T>
struct alignas(kQuad * sizeof(T)) Quad {
  T v[kQuad];
};

// True when p can be accessed by quads (cudaMalloc gives 256-byte alignment; views at odd offsets fall
// back to the scalar path).
template <class T>
SQUEEZE_HD bool quad_aligned(const T* p) {
  return (reinterpret_cast<std::uintptr_t>(p) % (kQuad * sizeof(T))) == 0;
}

// The quad moved as one built-in vector (uint2 / uint4) with explicit global-memory vector instructions
// (__ldcg: ld.global.cg, __stwb: st.global.wb). With pointers read from a tensor table nvcc sees generic
// pointers of unknown alignment and would otherwise split quad stores into 2- or 4-byte stores.
template <class T>
using QuadBits = std::conditional_t<sizeof(Quad<T>) == 16, uint4, uint2>;
static_assert(sizeof(QuadBits<float>) == sizeof(Quad<float>) && sizeof(QuadBits<bf16>) == sizeof(Quad<bf16>));

// Loads this thread's Q quads of a tile: p points at quad 0 (quad_start(base, t, 0, threads)), quad q is
// q * threads * 4 elements further. Converts to float registers out[4 * Q].
template <int Q, class T>
SQUEEZE_DEVICE void load_quads(const T* __restrict__ p, int threads, float (&out)[kQuad * Q]) {
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    const QuadBits<T> bits = __ldcg(reinterpret_cast<const QuadBits<T>*>(p + std::int64_t(q) * threads * kQuad));
    Quad<T> v;
    memcpy(&v, &bits, sizeof v);
#pragma unroll
    for (int j = 0; j < kQuad; ++j) out[q * kQuad + j] = to_float(v.v[j]);
  }
}

// Stores float registers in[4 * Q] to this thread's Q quads of a tile, rounding to nearest even.
template <int Q, class T>
SQUEEZE_DEVICE void store_quads(T* __restrict__ p, int threads, const float (&in)[kQuad * Q]) {
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    Quad<T> v;
#pragma unroll
    for (int j = 0; j < kQuad; ++j) v.v[j] = from_float<T>(in[q * kQuad + j]);
    QuadBits<T> bits;
    memcpy(&bits, &v, sizeof bits);
    __stwb(reinterpret_cast<QuadBits<T>*>(p + std::int64_t(q) * threads * kQuad), bits);
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
