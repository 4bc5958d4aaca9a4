#pragma once
// The mma.sync family (gemm/mma_sync.cuh): the kernel's parameters, the work policy (C::Work), each
// configuration's compile-time shape and the compute threads' barrier.
#if !defined(__CUDACC__)
#error "gemm/mma_sync/params.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include "squeeze/kernels/quant/gemm/config.hpp"
#include "squeeze/kernels/quant/gemm/decode.cuh"
#include "squeeze/kernels/quant/gemm/layout.hpp"
#include "squeeze/kernels/quant/gemm/launch_plan.hpp"
#include "squeeze/kernels/quant/gemm/ptx.cuh"

namespace squeeze::kernels::quant {
namespace detail {

struct QGemmParams {
  const void* x;               // T [M, K]
  const std::uint32_t* tiles;  // [Kpad/64][Npad/16] tiles
  const half* scales;          // [groups, Npad]
  const std::uint8_t* zeros;
  void* y;         // T [M, N]
  float* partial;  // [splits, M, Npad] (splits > 1)
  int* counters;   // [zslices, strips], zero between launches
  int M, N, K, Npad, Kpad, group;
  int cps, strips, splits, zslices, ngroups;
  int items_per_block;        // consecutive work items per block (Bulk with a persistent grid; else 1)
  int slot_bytes, slot_rows;  // Bulk: ring slot bytes, group rows per slot
};

// ---- the work done on the streamed weights ----------------------------------------------------------------------------
// The GEMM's: group constants, decode, mma, epilogue. A configuration may name another as C::Work (config.hpp's WorkOf):
// the measuring policies of bench/quant/gemm_configs.cuh stop after the loads or the decode, handing what they skip to
// keep() so that the compiler does not remove the work they time.
struct QGemmWork {
  static constexpr bool kDecode = true;    // group constants and decode
  static constexpr bool kMultiply = true;  // mma and epilogue
  struct Sink {};
  template <class Words>
  __device__ __forceinline__ static void keep(Sink&, const Words&) {}
  template <class T>
  __device__ __forceinline__ static void finish(const Sink&, const QGemmParams&) {}
};

// Compile-time shape of configuration C's kernel for T and BITS.
template <class T, int BITS, class C>
struct QGemmTraits {
  static constexpr int W = C::W, NT = C::NT, PF = C::PF, MT = C::MT, ROWS = C::ROWS, STRIP = C::STRIP;
  static constexpr int LW = lane_words(BITS), TW = tile_words(BITS);  // 32-bit words per lane / per tile
  static constexpr int LV = LW / 4;                                   // 16-byte vectors per lane (4/8 bits)
  static constexpr int NV = NT * LV;
  static constexpr int NC = W * 32;  // threads that compute (Bulk adds one producer warp)
  static constexpr bool kBulk = C::LOADER == QGemmLoader::Bulk;
  static constexpr bool kFold = C::ZFOLD && !(BITS == 8 && std::is_same_v<T, bf16>);  // bf16 cannot hold 128 + 255
  // SWAP: weights as A; accumulators [NT][NJ = batch blocks of 8][4], element e at (n = g4 + 8 (e >> 1), batch 2 c4 + (e & 1))
  // of the tile; otherwise [MT][NT][NJ = n8 halves][4], element e at (row g4 + 8 (e >> 1), n 8 j + 2 c4 + (e & 1))
  static constexpr bool kSwap = C::SWAP;
  static constexpr int NJ = kSwap ? C::ROWS8 : 2;
  static constexpr int XA = kSwap ? NJ : MT;  // row-sum accumulators of the folded zero points
  static constexpr int kTileBytes = TW * 4, kSlotBytes = W * NT * kTileBytes;
  static_assert(BITS == 3 || BITS == 4 || BITS == 8, "3, 4 or 8 bits");
  static_assert(BITS != 3 || C::LOADER != QGemmLoader::CpAsync, "3-bit tiles (12 bytes per lane) use the register or bulk loader");
};

// Block barrier of the threads that compute: the producer warp (Bulk) never waits on them. The compiler does not know
// the inline barrier is one, so nothing guarantees the warp reconverged before it (after `if (tid == 0) ...` or a loop
// with a per-thread trip count): __syncwarp first, and the non-.aligned form, else lanes that arrive early could
// complete the barrier for their whole warp (with a bare bar.sync the bulk configurations gave wrong results on large
// shapes: the split-K "last block" flag read before it was written).
template <bool kBulk, int NC>
__device__ __forceinline__ void qgemm_sync_compute() {
  if constexpr (kBulk) {
    __syncwarp();
    asm volatile("barrier.sync 1, %0;\n" ::"n"(NC) : "memory");
  } else {
    __syncthreads();
  }
}

}  // namespace detail
}  // namespace squeeze::kernels::quant
