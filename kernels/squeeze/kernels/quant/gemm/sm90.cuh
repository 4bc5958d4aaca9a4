#pragma once
// The sm90 family of the quantized GEMM (4-bit weights, Hopper, sm_90a builds): y [M, N] = x [M, K] * W^T computed
// transposed, Y^T [N, M] = W [N, K] * X^T [K, M], so the large N is wgmma's M dimension (64 per instruction) and the
// batch is wgmma's N (BN = 16, 32, 64 or 128): one m64nBNk16 wgmma covers 64 output features x the batch slice x 16 k.
// Below 9 batch rows mma.sync consumers (Sm90Knobs::mma_sync) run in the same warp-specialised ring. Why a second
// family: the mma.sync kernel re-reads x per strip and runs far below the tensor-core rate from M = 64 on.
// The kernel is composed of device functions along CUTLASS's seams: tile scheduler (sm90_tile), mainloop loads
// (sm90_load_chunk, sm90_produce), decode and mma (sm90_mma_chunk, sm90_retire, sm90_scale_group), epilogue with the
// K-split reductions (sm90_epilogue, sm90_store_tile, sm90_store_sums); its launchers (capacity query, tensor map,
// checks) follow it. A few small helpers are `inline`, not forced (sm90_group_of, sm90_retire, sm90_scale_group, the
// store helpers), and sm90_mma_chunk takes the kernel's values by reference as the lambda it replaces captured them:
// nvcc then inlines and folds them as it did the lambdas, and the kernels' code is unchanged (forced, or by value, the
// address arithmetic and the reduction loops came out differently).
//
// Operands:
//   A (weights) from registers. The tile layout (layout.hpp) already holds, in 32-bit word ks of lane l of a tile, the
//     eight codes of that lane's A fragment for k-step ks: pairs 0 / 2 / 1 / 3 of the word are the fragment's
//     registers a0..a3 (rows n = l/4, l/4 + 8; k = 2 (l%4), 2 (l%4) + 8). wgmma's register A fragment is the
//     mma.m16n8k16 one per warp, warp w of the warpgroup taking rows 16 w .. 16 w + 15, so warp w decodes tile w of
//     four consecutive tiles and the four warps form the m64 operand. Decode: magic + q minus (magic + z) is the exact
//     q - z, times the group's scale gives the weight, rounded to T once (fp16: 2^-11 relative; bf16: the fp16 scale
//     rounded to bf16 and the product rounded, ~2^-8); with group_scale the exact q - z, each group's fp32 sums scaled.
//   B (x^T) from shared memory, K-major, 128-byte swizzle: a stage holds x [BN rows][64 k] (128 B per row, 8-row atoms
//     of 1024 B, 16-byte chunk c of row r at chunk c ^ (r % 8)); the descriptor of k-step ks starts 32 B further into
//     the atom (the hardware applies the swizzle to the address bits).
// Block: WGS consumer warpgroups take a strip of 64 WM WGS output features x BN batch rows x one K range of cps 64-k
// chunks through a STAGES-deep ring; one stage = x [BN][64] (swizzled), the strip's weight tiles of the chunk and the
// scale / zero-point rows of the (at most four) groups the chunk touches. Per chunk and k-step a consumer decodes its
// WM A fragments, fences and queues WM wgmma, then waits for the chunk's wgmma before the stage is refilled. The ring is
// filled either block-synchronously (every thread's cp.async, a block barrier per chunk) or, in what the dispatch runs,
// warp-specialised: one producer warp queues a chunk as one TMA copy of x (zeros past M and K) plus bulk copies of the
// tiles and group rows on a full mbarrier, and each consumer warp releases a stage on its empty mbarrier (much faster
// than block-synchronous; measured: docs/kernels/quant-gemm.md).
// K splits (plan.hpp): summed in a cluster's distributed shared memory, or through global memory by every block of a
// tile (spread) or by its last block; all in K-range order (deterministic).
//
// Limits (qgemm_sm90_reason; qgemm_cuda serves the rest): 4-bit tiles, K % 8 == 0 (16-byte x copies; the tensor map's
// row pitch), 16-byte aligned x / tiles / scales / zeros, group % 16 == 0. Any M, N and K (more batch slices past BN;
// zero-filled copies and predicated stores at the edges). Act-order: the caller gathers x by QTiles::perm. Compiled
// for another target than sm_90a the kernel is empty and the launcher returns cudaErrorNotSupported
// (qgemm_sm90_supported() says so without launching the GEMM).
#if !defined(__CUDACC__)
#error "gemm/sm90.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda.h>  // CUtensorMap (the type only: the encoder is reached through the runtime, no libcuda link)
#include <cudaTypedefs.h>
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

// Group constants of one thread's two A rows (r = 0: row l/4, r = 1: row l/4 + 8) of one tile, as T2 patterns:
// zc = magic + z (fp16 1024 + z, bf16 128 + z), zo = -(64 + z) (fp16 odd pairs, which read as 1024 + 16 q),
// sc = the scale (bf16: rounded from fp16).
struct Sm90Group {
  std::uint32_t zc[2], zo[2], sc[2];
  float scale[2];  // GSCALE: the rows' fp16 scales as fp32 (exact)
};
template <class T>
__device__ __forceinline__ Sm90Group sm90_group(const half* srow, const std::uint8_t* zrow, int n_lo) {
  Sm90Group g;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::uint32_t z = zrow[n_lo + 8 * r];
    const float s = __half2float(srow[n_lo + 8 * r]);
    g.scale[r] = s;
    if constexpr (std::is_same_v<T, bf16>) {
      g.zc[r] = sm90_bf16_magic_zero(z);
      g.zo[r] = 0;
      g.sc[r] = u32(__float2bfloat162_rn(s));
    } else {
      g.zc[r] = sm90_half_magic_zero(z);
      g.zo[r] = sm90_half_odd_zero(z);
      g.sc[r] = u32(__float2half2_rn(s));  // exact: s is fp16
    }
  }
  return g;
}
// One tile word (k-step) -> the wgmma A fragment: pair i (nibbles i, i + 4) covers row l/4 + 8 (i >> 1) and
// k 2 (l%4) + 8 (i & 1) (+1), i.e. register a[2 (i & 1) + (i >> 1)]; value (q - z) * scale rounded to T, or with
// SCALE false the exact q - z (the scale is applied to the group's fp32 sums, GSCALE).
template <class T, bool SCALE = true>
__device__ __forceinline__ void sm90_decode(std::uint32_t w, const Sm90Group& g, std::uint32_t (&a)[4]) {
  using V = typename Vec2<T>::type;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = i >> 1;
    const V pair = as_vec2<V>(magic_pair<T>(w, i));
    V v;
    if constexpr (std::is_same_v<T, bf16>) {
      v = __hsub2(pair, as_vec2<V>(g.zc[r]));  // exact small integer q - z
    } else if (i & 1) {
      v = __hfma2(pair, __float2half2_rn(1.f / 16.f), as_vec2<V>(g.zo[r]));  // (1024 + 16 q) / 16 - (64 + z), exact
    } else {
      v = __hsub2(pair, as_vec2<V>(g.zc[r]));
    }
    if constexpr (SCALE)
      a[2 * (i & 1) + r] = u32(__hmul2(v, as_vec2<V>(g.sc[r])));
    else
      a[2 * (i & 1) + r] = u32(v);
  }
}

struct Sm90Params {
  const void* x;               // T [M, K]
  const std::uint32_t* tiles;  // [Kpad/64][Npad/16] tiles
  const half* scales;          // [groups, Npad]
  const std::uint8_t* zeros;   // [groups, Npad]
  void* y;                     // T [M, N]
  float* partial;              // [splits, M, Npad] (K splits through global memory)
  int* counters;               // [zslices, strips], zero between launches (K splits through global memory)
  int M, N, K, Npad, group;
  int kchunks, cps, lead, cps_tail, strips, splits, zslices;  // K ranges: sm90_k_range
  int spread;                 // K splits through global memory: every block sums a share (Sm90Plan::spread; a cooperative launch)
  void* work_data = nullptr;  // the Work policy's own buffer (a measuring policy's timeline; the GEMM's has none)
};

// ---- the work done on each stage ------------------------------------------------------------------------------------
// Points of a block's timeline, in program order, where the kernel calls Work::at (consumer thread 0, or the producer
// lane for Producer*). Epilogue*: after the consumers' first barrier (every warpgroup's last chunk done; global: the
// partials written), after the next (one K range: the tile staged; cluster: every block's sums in place; spread: the
// other shares written and every block of the tile arrived; last block: the counter read), after the stores (reached
// only by the block that stores).
enum class Sm90Point {
  Entry,
  SetUp,
  FirstChunk,
  LoopEnd,
  End,
  EpilogueWaited,
  EpilogueStaged,
  EpilogueStored,
  ProducerStart,
  ProducerX,
  QueuedFirst,
  QueuedLast
};
// The GEMM's work: load each group's constants, decode, multiply, store; observe nothing. A configuration may name
// another as C::Work (config.hpp's WorkOf): the measuring policies of bench/quant/gemm_configs.cuh skip the decode or
// the consumers' work, or record a timeline at the Sm90Points.
struct Sm90Work {
  static constexpr bool kGroupConstants = true;  // each group's scale and zero-point rows read from the stage
  static constexpr bool kConsume = true;         // the consumers decode and multiply each stage (else only hand it back)
  template <class T, bool SCALE>
  __device__ __forceinline__ static void decode(std::uint32_t w, const Sm90Group& g, std::uint32_t (&a)[4]) {
    sm90_decode<T, SCALE>(w, g, a);
  }
  __device__ __forceinline__ static void at(const Sm90Params&, Sm90Point) {}
};

// ==== tile scheduler ===================================================================================================
// This block's work: batch slice z, strip, chunks [kc0, kc0 + nck), K range `split` of p.splits (1: y stored directly).
// The batch slices of a strip are neighbouring blocks, so they run at the same time and the slices after the first find
// the strip's weights in L2.
struct Sm90Tile {
  int z, strip, split, n0, tile0, m0, kc0, nck;
};
template <class C>
__device__ __forceinline__ Sm90Tile sm90_tile(const Sm90Params& p) {
  Sm90Tile t;
  t.z = int(blockIdx.x % p.zslices), t.strip = int(blockIdx.x / p.zslices), t.split = int(blockIdx.z);
  t.n0 = t.strip * C::STRIP, t.tile0 = t.strip * C::TILES, t.m0 = t.z * C::BN;
  const Sm90Range range = sm90_k_range(t.split, p.kchunks, p.cps, p.lead, p.cps_tail);
  t.kc0 = range.kc0, t.nck = range.nck;
  return t;
}
// The group of k: padded k rows (k >= K) belong to the last group (x is zero there), as in the CPU twin.
__device__ inline int sm90_group_of(const Sm90Params& p, int k) { return min(k, p.K - 1) / p.group; }

// ==== mainloop: loads ==================================================================================================
// Block-synchronous ring: one chunk (64 k) into stage s; every thread queues its share of 16-byte cp.async (0 source
// bytes = zero fill: rows past M, k past K, tiles / columns past Npad).
template <class T, class C>
__device__ __forceinline__ void sm90_load_chunk(const Sm90Params& p, unsigned char* smem, const Sm90Tile& b, int ntiles, int tid, int kc,
                                                int s) {
  constexpr int BN = C::BN, STRIP = C::STRIP, TILES = C::TILES, XB = C::X_BYTES, WB = C::W_BYTES, SB = C::S_BYTES;
  const T* const x = static_cast<const T*>(p.x);
  unsigned char* const st = smem + s * C::STAGE_BYTES;
  for (int i = tid; i < BN * 8; i += C::THREADS) {  // x [BN][64], 128B-swizzled
    const int r = i >> 3, c = i & 7, m = b.m0 + r, k = kc * kTileK + c * 8;
    const bool ok = m < p.M && k < p.K;
    cp_async16(st + r * 128 + ((c ^ (r & 7)) << 4), ok ? x + std::int64_t(m) * p.K + k : x, ok ? 16 : 0);
  }
  const std::uint32_t* const wsrc = p.tiles + (std::int64_t(kc) * ntiles + b.tile0) * (kTileK * kTileN / 8);
  for (int i = tid; i < TILES * 32; i += C::THREADS) {  // the strip's tiles of this chunk: contiguous
    const bool ok = b.tile0 + (i >> 5) < ntiles;
    cp_async16(st + XB + i * 16, ok ? wsrc + i * 4 : p.tiles, ok ? 16 : 0);
  }
  const int g0 = sm90_group_of(p, kc * kTileK), rows = sm90_group_of(p, kc * kTileK + 48) - g0 + 1;
  for (int i = tid; i < rows * (STRIP / 8); i += C::THREADS) {  // scales [rows][STRIP]
    const int r = i / (STRIP / 8), n = b.n0 + (i % (STRIP / 8)) * 8;
    const bool ok = n < p.Npad;
    cp_async16(st + XB + WB + (r * STRIP + n - b.n0) * 2, ok ? p.scales + std::int64_t(g0 + r) * p.Npad + n : p.scales, ok ? 16 : 0);
  }
  for (int i = tid; i < rows * (STRIP / 16); i += C::THREADS) {  // zero points [rows][STRIP]
    const int r = i / (STRIP / 16), n = b.n0 + (i % (STRIP / 16)) * 16;
    const bool ok = n < p.Npad;
    cp_async16(st + XB + WB + SB + r * STRIP + n - b.n0, ok ? p.zeros + std::int64_t(g0 + r) * p.Npad + n : p.zeros, ok ? 16 : 0);
  }
}
// Warp-specialised ring, the producer warp: chunk c of the K range into stage c % S, once every consumer warp released
// the stage's previous chunk; lane 0 queues x (one TMA copy; it counts the whole box, zero-filled parts included),
// the tiles and the group rows on the stage's full barrier.
template <class T, class C, class Work>
__device__ __forceinline__ void sm90_produce(const Sm90Params& p, const CUtensorMap& x_map, unsigned char* smem, std::uint64_t* full_bar,
                                             std::uint64_t* empty_bar, const Sm90Tile& b, int ntiles, int lane) {
  constexpr int S = C::STAGES, STRIP = C::STRIP, XB = C::X_BYTES, WB = C::W_BYTES, SB = C::S_BYTES;
  const int cols = min(STRIP, p.Npad - b.n0);  // features of this strip (multiple of 16)
  const unsigned wbytes = unsigned(cols / kTileN) * 512u;
  for (int c = 0; c < b.nck; ++c) {
    const int ring = c % S, kc = b.kc0 + c;
    if (c >= S) mbar_wait(empty_bar + ring, unsigned(c / S - 1) & 1u);
    unsigned char* const st = smem + ring * C::STAGE_BYTES;
    const int g0 = sm90_group_of(p, kc * kTileK), rows = sm90_group_of(p, kc * kTileK + 48) - g0 + 1;
    if (lane == 0) {
      if (c == 0) Work::at(p, Sm90Point::ProducerStart);
      mbar_arrive_expect_tx(full_bar + ring, unsigned(XB) + wbytes + unsigned(rows * cols * 3));
      tma_load_x(st, x_map, kc * kTileK, b.m0, full_bar + ring);
      if (c == 0) Work::at(p, Sm90Point::ProducerX);
      bulk_copy_g2s(st + XB, p.tiles + (std::int64_t(kc) * ntiles + b.tile0) * (kTileK * kTileN / 8), wbytes, full_bar + ring);
      for (int r = 0; r < rows; ++r) {
        const std::int64_t off = std::int64_t(g0 + r) * p.Npad + b.n0;
        bulk_copy_g2s(st + XB + WB + r * STRIP * 2, p.scales + off, unsigned(cols * 2), full_bar + ring);
        bulk_copy_g2s(st + XB + WB + SB + r * STRIP, p.zeros + off, unsigned(cols), full_bar + ring);
      }
      if (c == 0) Work::at(p, Sm90Point::QueuedFirst);
      if (c + 1 == b.nck) Work::at(p, Sm90Point::QueuedLast);
    }
    __syncwarp();
  }
}

// ==== mainloop: decode and mma =========================================================================================
// One chunk (stage st holds chunk kc): per k-step decode WM A fragments into a and queue WM wgmma (SYNC: mma.sync per
// warp), then commit. grp: the group constants of this thread's rows, reloaded where a k-step enters a new group
// (next_group_k: the first k of the group after the one grp holds; a compare replaces a division per k-step).
// after_first(): run once the first k-step is queued. The kernel's values by reference, as its lambda captured them
// (see the header).
template <class T, class C, class Work, class AfterFirst>
__device__ __forceinline__ void sm90_mma_chunk(const Sm90Params& p, unsigned char* const& smem, const unsigned char* st, int kc,
                                               const std::uint64_t& x_desc0, const int& wg, const int& wq, const int& lane, const int& nl,
                                               int& next_group_k, Sm90Group (&grp)[C::WM], float (&mma_acc)[C::WM][C::BN / 2],
                                               std::uint32_t (&a)[4][C::WM][4], AfterFirst&& after_first) {
  constexpr int BN = C::BN, WM = C::WM, STRIP = C::STRIP, XB = C::X_BYTES, WB = C::W_BYTES, SB = C::S_BYTES;
  uint4 wv[WM];  // this lane's 4 words (4 k-steps) of each of its tiles
#pragma unroll
  for (int t = 0; t < WM; ++t) wv[t] = lds128(st + XB + ((wg * 4 * WM + 4 * t + wq) * 32 + lane) * 16);
  [[maybe_unused]] const std::uint64_t x_desc = x_desc0 + std::uint64_t((st - smem) >> 4);
  // SYNC: x's B fragments of k-steps 2 kp and 2 kp + 1 (kp = ks / 2), n8 slice j: ldmatrix.x4 of the 8 x 8 matrices
  // (batch rows 8 j.., k 32 kp + 8 i..), lane L addressing row 8 j + L % 8 of matrix L / 8; x's 16-byte unit u of row
  // r lies at (u ^ r % 8) << 4 (the TMA's 128-byte swizzle). Register i = matrix i: (b0, b1) of k-step 2 kp are
  // registers 0, 1, of k-step 2 kp + 1 registers 2, 3. Loaded a pair of k-steps at a time (registers).
  [[maybe_unused]] std::uint32_t bx[C::SYNC ? BN / 8 : 1][4];
  int grow = 0;  // the stage's group row of the group grp holds (row 0: the group of the chunk's first k)
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    // a new group (uniform across the block)
    if (Work::kGroupConstants && min(kc * kTileK + 16 * ks, p.K - 1) >= next_group_k) {
      next_group_k += p.group;
      if (ks > 0) ++grow;
      const half* srow = reinterpret_cast<const half*>(st + XB + WB) + grow * STRIP;
      const std::uint8_t* zrow = st + XB + WB + SB + grow * STRIP;
#pragma unroll
      for (int t = 0; t < WM; ++t) grp[t] = sm90_group<T>(srow, zrow, nl + 64 * t);
    }
    if constexpr (C::SYNC) {
      if (ks % 2 == 0)
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const int r = 8 * j + (lane & 7), u = 2 * ks + (lane >> 3);
          ldmatrix_x4(bx[j], st + r * 128 + ((u ^ (r & 7)) << 4));
        }
#pragma unroll
      for (int t = 0; t < WM; ++t) {
        const std::uint32_t w = ks == 0 ? wv[t].x : ks == 1 ? wv[t].y : ks == 2 ? wv[t].z : wv[t].w;
        std::uint32_t af[4];
        Work::template decode<T, !C::GSCALE>(w, grp[t], af);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
          mma16816<T>(*reinterpret_cast<float(*)[4]>(&mma_acc[t][4 * j]), af, bx[j][2 * (ks & 1)], bx[j][2 * (ks & 1) + 1]);
      }
    } else {
#pragma unroll
      for (int t = 0; t < WM; ++t) {
        const std::uint32_t w = ks == 0 ? wv[t].x : ks == 1 ? wv[t].y : ks == 2 ? wv[t].z : wv[t].w;
        Work::template decode<T, !C::GSCALE>(w, grp[t], a[ks][t]);
      }
      wgmma_fence();
#pragma unroll
      for (int t = 0; t < WM; ++t) wgmma_rs<T>(mma_acc[t], a[ks][t], x_desc + 2 * ks);  // + 32 B per k-step
    }
    if (ks == 0) after_first();
  }
  if constexpr (!C::SYNC) wgmma_commit();
}
// After sm90_mma_chunk(a_cur): wait for the chunk before (OVERLAP; its set a_other is free again) or for this one.
template <class C, class A>
__device__ inline void sm90_retire(A& a_cur, A& a_other, float (&mma_acc)[C::WM][C::BN / 2]) {
  if constexpr (C::SYNC) {
    // mma.sync: the results are in registers when the next instruction reads them; nothing in flight
  } else if constexpr (C::OVERLAP) {
    wgmma_wait<1>();
    pin_a(a_other);
  } else {
    wgmma_wait<0>();
    pin_operands(a_cur, mma_acc);
  }
}
// GSCALE, after the wait for a group's last chunk: its sums, times the rows' scales, into acc.
template <class C>
__device__ inline void sm90_scale_group(float (&acc)[C::WM][C::BN / 2], float (&acc_group)[C::WM][C::BN / 2],
                                        const Sm90Group (&grp)[C::WM]) {
#pragma unroll
  for (int t = 0; t < C::WM; ++t)
#pragma unroll
    for (int i = 0; i < C::BN / 2; ++i) {
      acc[t][i] = fmaf(grp[t].scale[(i >> 1) & 1], acc_group[t][i], acc[t][i]);
      acc_group[t][i] = 0.f;
    }
}

// ==== epilogue =========================================================================================================
// Accumulator i of tile t holds (feature nl + 64 t + 8 ((i >> 1) & 1), batch row 8 (i >> 2) + 2 c4 + (i & 1)). y is
// written 8 features (16 bytes) per store where rows of y are 16-byte aligned: the accumulators' own layout would store
// 2 bytes per thread, 16 contiguous bytes per 8 lanes (a store loop several times slower).
struct Sm90Out {
  int rows, cols;  // of the tile inside y
  bool y_vec;      // 16-byte stores
};
// Features cc..cc + 7 of row r of the tile, from fp32 sums.
template <class T>
__device__ inline void sm90_write8(const Sm90Params& p, const Sm90Tile& b, const Sm90Out& o, int r, int cc, const float (&v)[8]) {
  T* const dst = static_cast<T*>(p.y) + std::int64_t(b.m0 + r) * p.N + b.n0 + cc;
  if (o.y_vec && cc + 8 <= o.cols) {
    uint4 packed;
    T* const h = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] = from_float<T>(v[j]);
    *reinterpret_cast<uint4*>(dst) = packed;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (cc + j < o.cols) dst[j] = from_float<T>(v[j]);
  }
}
// Lanes 2j and 2j + 1 hold features cc..cc + 3 and cc + 4..cc + 7 of one row: the even lane stores all eight.
template <class T>
__device__ inline void sm90_store_pairs(const Sm90Params& p, const Sm90Tile& b, const Sm90Out& o, bool valid, int lane, int r, int cc,
                                        const float4& sum) {
  const float v[8] = {sum.x,
                      sum.y,
                      sum.z,
                      sum.w,
                      __shfl_down_sync(0xffffffffu, sum.x, 1),
                      __shfl_down_sync(0xffffffffu, sum.y, 1),
                      __shfl_down_sync(0xffffffffu, sum.z, 1),
                      __shfl_down_sync(0xffffffffu, sum.w, 1)};
  if (valid && (lane & 1) == 0) sm90_write8<T>(p, b, o, r, cc, v);
}
__device__ inline void sm90_add4(float4& sum, const float4& v) {
  sum.x += v.x;
  sum.y += v.y;
  sum.z += v.z;
  sum.w += v.w;
}
// The output loop of every K-split reduction: float4 units [u_begin, u_end) of the tile (row r, features cc..cc + 3),
// each the sum of its K ranges in K-range order: from the cluster's shared memory (buf in every block), from the fp32
// partials with this block's own range from buf (spread), or from the partials alone (the last block); stored 8
// features a lane (sm90_store_pairs). (Loading 8 features a lane, two float4 32 bytes apart, ran the cluster reduction
// slower: the lanes' loads no longer contiguous.) The loop runs whole warps (the shuffle).
enum class Sm90SumFrom { Cluster, Spread, Last };
template <class T, class C, Sm90SumFrom FROM>
__device__ __forceinline__ void sm90_store_sums(const Sm90Params& p, const Sm90Tile& b, const Sm90Out& o, int u_begin, int u_end, int tid,
                                                int lane, const float* buf, std::int64_t split_stride) {
  constexpr int STRIP = C::STRIP, PITCH = C::SPLIT_PITCH;
  [[maybe_unused]] const unsigned base = FROM == Sm90SumFrom::Cluster ? smem_addr(buf) : 0u;
  for (int w0 = u_begin + (tid & ~31); w0 < u_end; w0 += C::CONSUMERS) {
    const int u = w0 + lane, r = u / (STRIP / 4), cc = (u % (STRIP / 4)) * 4;
    const bool valid = u < u_end && cc < o.cols;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    if (valid) {
      if constexpr (FROM == Sm90SumFrom::Cluster) {
        const unsigned off = base + unsigned(r * PITCH + cc) * 4u;
        float4 v[kSm90MaxClusterSplits];
#pragma unroll
        for (int sp = 0; sp < kSm90MaxClusterSplits; ++sp)
          if (sp < p.splits) v[sp] = ld_cluster_f4(map_cluster(off, sp));
        sum = v[0];
#pragma unroll
        for (int sp = 1; sp < kSm90MaxClusterSplits; ++sp)
          if (sp < p.splits) sm90_add4(sum, v[sp]);
      } else if constexpr (FROM == Sm90SumFrom::Spread) {
        const float* const src = p.partial + std::int64_t(b.m0 + r) * p.Npad + b.n0 + cc;
        const float4 own = *reinterpret_cast<const float4*>(buf + r * PITCH + cc);
        // 8 K ranges' loads in flight at a time
        for (int sp0 = 0; sp0 < p.splits; sp0 += 8) {
          float4 v[8];
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (sp0 + j < p.splits)
              v[j] = sp0 + j == b.split ? own : __ldcg(reinterpret_cast<const float4*>(src + (sp0 + j) * split_stride));
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (sp0 + j < p.splits) {
              if (sp0 + j == 0)
                sum = v[j];
              else
                sm90_add4(sum, v[j]);
            }
        }
      } else {
        // 4 K ranges' loads in flight at a time (Npad and n0 are multiples of 16: the float4 loads are aligned; batches
        // of 8 predicated loads, as in the cluster form, were slower)
        const float* src = p.partial + std::int64_t(b.m0 + r) * p.Npad + b.n0 + cc;
        int sp = 0;
        for (; sp + 4 <= p.splits; sp += 4) {
          float4 v[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) v[j] = __ldcg(reinterpret_cast<const float4*>(src + (sp + j) * split_stride));
#pragma unroll
          for (int j = 0; j < 4; ++j) sm90_add4(sum, v[j]);
        }
        for (; sp < p.splits; ++sp) sm90_add4(sum, __ldcg(reinterpret_cast<const float4*>(src + sp * split_stride)));
      }
    }
    sm90_store_pairs<T>(p, b, o, valid, lane, r, cc, sum);
  }
}
// One K range: the tile as T through the ring, [BN][PITCH] (after the barrier every warpgroup's wgmma finished reading
// the ring; every copy landed), then 16-byte rows out. +8 elements a row: the four rows one store writes, 2 apart, fall
// in different banks.
template <class T, class C, class Work>
__device__ __forceinline__ void sm90_store_tile(const Sm90Params& p, unsigned char* smem, const Sm90Tile& b, const Sm90Out& o,
                                                const float (&acc)[C::WM][C::BN / 2], int tid, int c4, int nl) {
  constexpr int BN = C::BN, WM = C::WM, STRIP = C::STRIP, NACC = BN / 2, PITCH = STRIP + 8;
  static_assert(BN * PITCH * int(sizeof(T)) <= C::STAGES * C::STAGE_BYTES, "the output tile must fit in the ring");
  T* const y = static_cast<T*>(p.y);
  T* const out = reinterpret_cast<T*>(smem);
  consumer_bar_sync(C::CONSUMERS);
  if (tid == 0) Work::at(p, Sm90Point::EpilogueWaited);
#pragma unroll
  for (int t = 0; t < WM; ++t)
#pragma unroll
    for (int i = 0; i < NACC; ++i)
      out[(8 * (i >> 2) + 2 * c4 + (i & 1)) * PITCH + nl + 64 * t + 8 * ((i >> 1) & 1)] = from_float<T>(acc[t][i]);
  consumer_bar_sync(C::CONSUMERS);
  if (tid == 0) Work::at(p, Sm90Point::EpilogueStaged);
  for (int u = tid; u < o.rows * (STRIP / 8); u += C::CONSUMERS) {
    const int r = u / (STRIP / 8), cc = (u % (STRIP / 8)) * 8;
    if (cc >= o.cols) continue;
    const T* const src = out + r * PITCH + cc;
    T* const dst = y + std::int64_t(b.m0 + r) * p.N + b.n0 + cc;
    if (o.y_vec && cc + 8 <= o.cols) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int j = 0; j < 8 && cc + j < o.cols; ++j) dst[j] = src[j];
    }
  }
  if (tid == 0) Work::at(p, Sm90Point::EpilogueStored);
}
// K splits reduced by share (in a cluster, or spread through global memory): this block's sums into its shared memory,
// [BN][SPLIT_PITCH] fp32 over the ring (every copy landed, and after the barrier every warpgroup's wgmma finished
// reading it).
template <class C, class Work>
__device__ __forceinline__ void sm90_stage_sums(const Sm90Params& p, float* buf, const float (&acc)[C::WM][C::BN / 2], int tid, int c4,
                                                int nl) {
  constexpr int PITCH = C::SPLIT_PITCH;
  consumer_bar_sync(C::CONSUMERS);
  if (tid == 0) Work::at(p, Sm90Point::EpilogueWaited);
#pragma unroll
  for (int t = 0; t < C::WM; ++t)
#pragma unroll
    for (int i = 0; i < C::BN / 2; ++i) buf[(8 * (i >> 2) + 2 * c4 + (i & 1)) * PITCH + nl + 64 * t + 8 * ((i >> 1) & 1)] = acc[t][i];
}
// After the last chunk (consumer threads only; every thread when not WS): y from the accumulators, directly (one K
// range) or through a K-split reduction, all in K-range order (deterministic): in the cluster's distributed shared
// memory, through global memory by every block of the tile (spread), or by its last block.
template <class T, class C, bool CLUSTER, class Work>
__device__ __forceinline__ void sm90_epilogue(const Sm90Params& p, unsigned char* smem, const Sm90Tile& b,
                                              const float (&acc)[C::WM][C::BN / 2], int tid, int lane, int c4, int nl, int& last_flag) {
  constexpr int BN = C::BN, WM = C::WM, STRIP = C::STRIP, NACC = BN / 2;
  const Sm90Out o{min(BN, p.M - b.m0), min(STRIP, p.N - b.n0), p.N % 8 == 0 && (reinterpret_cast<std::uintptr_t>(p.y) & 15) == 0};
  if (p.splits == 1) {
    sm90_store_tile<T, C, Work>(p, smem, b, o, acc, tid, c4, nl);
    return;
  }
  // each block sums its share of the tile, float4 units [u_begin, u_end) (whole 8-feature units: lanes 2j and 2j + 1
  // hold one)
  constexpr int PITCH = C::SPLIT_PITCH;
  float* const buf = reinterpret_cast<float*>(smem);
  const int units8 = o.rows * (STRIP / 8);
  const int u_begin = 2 * int(std::int64_t(units8) * b.split / p.splits), u_end = 2 * int(std::int64_t(units8) * (b.split + 1) / p.splits);
  if constexpr (CLUSTER) {
    // in the cluster: the shares summed over the cluster's buffers (distributed shared memory); the cost is these
    // loads
    sm90_stage_sums<C, Work>(p, buf, acc, tid, c4, nl);
    cluster_sync();  // every K range's sums are in its block's shared memory
    if (tid == 0) Work::at(p, Sm90Point::EpilogueStaged);
    sm90_store_sums<T, C, Sm90SumFrom::Cluster>(p, b, o, u_begin, u_end, tid, lane, buf, 0);
    if (tid == 0) Work::at(p, Sm90Point::EpilogueStored);
    cluster_sync();  // no block leaves (its shared memory) while another still reads it
    return;
  }
  int* const counter = p.counters + b.z * p.strips + b.strip;
  const std::int64_t split_stride = std::int64_t(p.M) * p.Npad;
  if (p.spread) {
    // Through global memory, spread: every block of the tile sums its share, as in a cluster, from fp32 partials in L2
    // (the last block summing all of them alone is bound by one SM's loads from L2; measured: docs/kernels/quant-gemm.md).
    // Each block writes the other blocks' shares of its sums (16-byte stores from the staged tile; its own
    // share stays in shared memory), waits for the tile's other blocks (the cooperative launch makes every block
    // resident), then adds the K ranges of its share in order, its own from shared memory. The counter counts arrivals
    // (up to splits), then departures; the last to leave sets it to zero for the next launch.
    sm90_stage_sums<C, Work>(p, buf, acc, tid, c4, nl);
    consumer_bar_sync(C::CONSUMERS);
    float* const part = p.partial + b.split * split_stride;
    const int units = o.rows * (STRIP / 4);
    for (int u = tid; u < units; u += C::CONSUMERS) {
      const int r = u / (STRIP / 4), cc = (u % (STRIP / 4)) * 4;
      if ((u < u_begin || u >= u_end) && cc < o.cols)
        __stcg(reinterpret_cast<float4*>(part + std::int64_t(b.m0 + r) * p.Npad + b.n0 + cc),
               *reinterpret_cast<const float4*>(buf + r * PITCH + cc));
    }
    consumer_bar_sync(C::CONSUMERS);  // every share written, then released by thread 0's arrival
    if (tid == 0) {
      atom_add_acq_rel_gpu(counter, 1);
      while (ld_acquire_gpu(counter) < p.splits) __nanosleep(64);
    }
    consumer_bar_sync(C::CONSUMERS);  // the other blocks' shares, acquired by thread 0, for every thread
    if (tid == 0) Work::at(p, Sm90Point::EpilogueStaged);
    sm90_store_sums<T, C, Sm90SumFrom::Spread>(p, b, o, u_begin, u_end, tid, lane, buf, split_stride);
    if (tid == 0) Work::at(p, Sm90Point::EpilogueStored);
    if (tid == 0 && atomicAdd(counter, 1) == 2 * p.splits - 1) *counter = 0;  // every block has left the wait
    return;
  }
  // through global memory, the last block: fp32 partials, and the last block of the tile to finish (a counter each)
  // sums them
  float* const part = p.partial + std::int64_t(b.split) * p.M * p.Npad;
#pragma unroll
  for (int t = 0; t < WM; ++t)
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
      const int n = b.n0 + nl + 64 * t + 8 * ((i >> 1) & 1), m = b.m0 + 8 * (i >> 2) + 2 * c4 + (i & 1);
      if (m < p.M && n < p.Npad) part[std::int64_t(m) * p.Npad + n] = acc[t][i];
    }
  consumer_bar_sync(C::CONSUMERS);  // every partial written, then released by thread 0's arrival
  if (tid == 0) Work::at(p, Sm90Point::EpilogueWaited);
  if (tid == 0) last_flag = atom_add_acq_rel_gpu(counter, 1) == p.splits - 1;  // the last: the others' partials acquired
  consumer_bar_sync(C::CONSUMERS);
  if (tid == 0) Work::at(p, Sm90Point::EpilogueStaged);
  if (!last_flag) return;
  // the last block sums every K range
  sm90_store_sums<T, C, Sm90SumFrom::Last>(p, b, o, 0, o.rows * (STRIP / 4), tid, lane, buf, split_stride);
  if (tid == 0) Work::at(p, Sm90Point::EpilogueStored);
  if (tid == 0) *counter = 0;  // ready for the next launch
}

// ==== the kernel =======================================================================================================
// grid (zslices x strips, 1, splits); C::THREADS threads, C::SMEM_BYTES dynamic shared memory.
// CLUSTER: K splits reduce within clusters of (1, 1, splits) blocks; otherwise K splits (if any) go through global
// memory. Two kernels rather than a flag, so that the global one carries no cluster code (one kernel holding both ran
// the global plans slower).
// x_map: (WS) x as a TMA tensor map, box [64 k] x [BN rows], 128-byte swizzle (unused otherwise)
template <class T, class C, bool CLUSTER>
__global__ void __launch_bounds__(C::THREADS, C::MINB) qgemm_sm90_kernel(const Sm90Params p, const __grid_constant__ CUtensorMap x_map) {
#if SQUEEZE_SM90_WGMMA
  using Work = typename WorkOf<C, Sm90Work>::type;
  constexpr int BN = C::BN, WM = C::WM, S = C::STAGES, STRIP = C::STRIP, NACC = BN / 2;
  constexpr int XB = C::X_BYTES, WB = C::W_BYTES, SB = C::S_BYTES;
  extern __shared__ unsigned char smem_raw[];
  __shared__ int last_flag;  // K splits through global memory: this block is the tile's last
  // the 128B swizzle repeats every 1024 B of address: align the ring to it
  unsigned char* const smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);

  // the warp index through a shuffle: the compiler then knows it is warp-uniform, so a branch on it (the
  // producer's) is not a divergent path around the wgmma (which would serialize them)
  const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0), wg = warp >> 2, wq = warp & 3;
  if (tid == 0) Work::at(p, Sm90Point::Entry);
  const int g4 = lane >> 2, c4 = lane & 3;
  const int ntiles = p.Npad / kTileN;
  const Sm90Tile b = sm90_tile<C>(p);
  const int kc0 = b.kc0, nck = b.nck;

  float acc[WM][NACC];
  // GSCALE: the wgmma accumulate the current group's unscaled sums here; sm90_scale_group adds them, scaled, to acc
  float acc_group[WM][NACC];
  float(&mma_acc)[WM][NACC] = C::GSCALE ? acc_group : acc;

  // this thread's A rows: tile (wg * 4 WM + 4 t + wq) of the strip, rows l/4 and l/4 + 8 of it
  const int nl = wg * 64 * WM + wq * 16 + g4;  // feature of row l/4 of tile t = 0, relative to the strip
  // The first k of the group after the one grp holds. Starts at the first k-step's own group, so that the first k-step
  // loads its constants.
  int next_group_k = sm90_group_of(p, kc0 * kTileK) * p.group;
#pragma unroll
  for (int t = 0; t < WM; ++t)
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[t][i] = acc_group[t][i] = 0.f;
  Sm90Group grp[WM];
  // x's descriptor at the ring's base: a stage's and k-step's descriptor adds their byte offset / 16 (the start
  // address field; the ring lies below 2^18 bytes, so the sum stays within it)
  const std::uint64_t x_desc0 = sw128_desc(smem_addr(smem));
  // A fragments, two sets used by alternate chunks: a wgmma reads its A registers until it completes, so with
  // OVERLAP (chunk c in flight while chunk c + 1 is decoded) chunk c + 1 must decode into the other set. Each set
  // is pinned after the wait that retires its chunk, which keeps its registers reserved until then (a rolled loop
  // with one set would decode chunk c + 1 into the registers chunk c's wgmma is still reading).
  std::uint32_t a0[4][WM][4] = {}, a1[4][WM][4] = {};
  auto mma_chunk = [&](const unsigned char* st, int kc, auto& a, auto&& after_first) {
    sm90_mma_chunk<T, C, Work>(p, smem, st, kc, x_desc0, wg, wq, lane, nl, next_group_k, grp, mma_acc, a, after_first);
  };
  auto epilogue = [&] {
    if constexpr (C::OVERLAP) {  // the last chunk's wgmma; accumulators are read only after this
      wgmma_wait<0>();
      pin_operands(a0, mma_acc);
      pin_a(a1);
    }
    sm90_epilogue<T, C, CLUSTER, Work>(p, smem, b, acc, tid, lane, c4, nl, last_flag);
  };

  if constexpr (C::WS) {
    // full[s]: the producer's expect-tx arrive + the TMA / bulk bytes;
    // empty[s]: one arrive per consumer warp once the wgmma reading stage s finished
    __shared__ std::uint64_t full_bar[S], empty_bar[S];
    // the producer's first TMA copy needs x's tensor map: fetch it while the barriers are set up
    if (warp == C::CONSUMERS / 32 && lane == 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"(&x_map) : "memory");
    if (tid == 0) {
#pragma unroll
      for (int sl = 0; sl < S; ++sl) {
        mbar_init(full_bar + sl, 1);
        mbar_init(empty_bar + sl, C::CONSUMERS / 32);
      }
      mbar_init_fence();
    }
    __syncthreads();
    if (tid == 0) Work::at(p, Sm90Point::SetUp);
    if (warp >= C::CONSUMERS / 32) {  // the producer (warp CONSUMERS / 32; with WGS = 4 the rest of its warpgroup idles)
      if constexpr (C::PRODUCERS == 128) set_max_regs_dec<C::PRODUCER_REGS>();
      // the cluster barriers of the K-split reduction count every thread: the producer's take part, idle
      if (warp > C::CONSUMERS / 32) {
        if (CLUSTER && p.splits > 1) {
          cluster_sync();
          cluster_sync();
        }
        return;
      }
      sm90_produce<T, C, Work>(p, x_map, smem, full_bar, empty_bar, b, ntiles, lane);
      if (CLUSTER && p.splits > 1) {  // the reduction's two cluster barriers (see sm90_epilogue)
        cluster_sync();
        cluster_sync();
      }
      return;  // the consumers wait for every copy it queued (full barriers) before they leave
    } else {
      if constexpr (C::PRODUCERS == 128) set_max_regs_inc<C::CONSUMER_REGS>();
      auto consume = [&](int c, auto& a_cur, auto& a_other) {  // chunk c of the K range, from ring stage c % S
        const int ring = c % S;
        mbar_wait(full_bar + ring, unsigned(c / S) & 1u);
        if (c == 0 && tid == 0) Work::at(p, Sm90Point::FirstChunk);
        __syncwarp();  // converged again before the .aligned wgmma operations
        if constexpr (!Work::kConsume) {
          if (lane == 0) mbar_arrive(empty_bar + ring);
          __syncwarp();
          return;
        }
        mma_chunk(smem + ring * C::STAGE_BYTES, kc0 + c, a_cur, [] {});
        sm90_retire<C>(a_cur, a_other, mma_acc);
        // GSCALE: the group ends with this chunk (the K range's last, or the next chunk starts the group after:
        // groups are whole chunks, and next_group_k is where the one grp holds ends)
        if constexpr (C::GSCALE)
          if (c + 1 == nck || (kc0 + c + 1) * kTileK >= next_group_k) sm90_scale_group<C>(acc, acc_group, grp);
        // the stage the finished wgmma read goes back to the producer (OVERLAP: the chunk before's)
        if (lane == 0 && (!C::OVERLAP || c > 0)) mbar_arrive(empty_bar + (C::OVERLAP ? (c + S - 1) % S : ring));
        __syncwarp();
      };
      for (int c = 0; c < nck; c += 2) {  // pairs: the two A sets alternate with static names
        consume(c, a0, a1);
        if (c + 1 < nck) consume(c + 1, a1, a0);
      }
      if (tid == 0) Work::at(p, Sm90Point::LoopEnd);
      epilogue();
      if (tid == 0) Work::at(p, Sm90Point::End);
    }
  } else {
    constexpr int AHEAD = C::AHEAD;
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {  // prologue: AHEAD chunks in flight (a group per stage, empty ones too)
      if (s < nck) sm90_load_chunk<T, C>(p, smem, b, ntiles, tid, kc0 + s, s);
      cp_async_commit();
    }
    auto step = [&](int c, auto& a_cur, auto& a_other) {
      cp_async_wait<AHEAD - 1>();  // this thread's copies of chunk c landed
      fence_proxy_async();
      // everyone's copies landed; every wgmma of chunk c - 1 (OVERLAP: c - 2) finished (retired below), so the
      // stage it read may be refilled
      __syncthreads();
      mma_chunk(smem + (c % S) * C::STAGE_BYTES, kc0 + c, a_cur, [&] {  // refill the stage chunk c - 1 (OVERLAP: c - 2) used
        const int nx = c + AHEAD;
        if (nx < nck) sm90_load_chunk<T, C>(p, smem, b, ntiles, tid, kc0 + nx, nx % S);
        cp_async_commit();
        __syncwarp();  // the copy loops' trip counts differ per thread: reconverge before the .aligned wgmma ops
      });
      sm90_retire<C>(a_cur, a_other, mma_acc);
    };
    for (int c = 0; c < nck; c += 2) {
      step(c, a0, a1);
      if (c + 1 < nck) step(c + 1, a1, a0);
    }
    cp_async_wait<0>();  // no copy may land after the block exits
    epilogue();
  }
#endif
}

// Writes 1 when this build's device code has wgmma (compiled for sm_90a), 0 otherwise. A template, so that several
// translation units of one program may include this header.
template <int = 0>
__global__ void sm90_wgmma_available(int* out) {
  *out = SQUEEZE_SM90_WGMMA;
}

}  // namespace detail

// ---- host launchers ------------------------------------------------------------------------------------
// True when the current device is sm_90 and this build's device code has wgmma (sm_90a). The first call
// launches a one-thread probe and synchronizes; the answer is cached for the process.
inline bool qgemm_sm90_supported() {
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess || major != 9 || minor != 0) {
      cudaGetLastError();
      return false;
    }
    int* flag = nullptr;
    int host = 0;
    bool good = cudaMalloc(&flag, sizeof(int)) == cudaSuccess;
    if (good) {
      detail::sm90_wgmma_available<><<<1, 1>>>(flag);
      good = cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess && host == 1;
      cudaFree(flag);
    }
    cudaGetLastError();  // a launch without a kernel image for this device is an answer, not a sticky error
    return good;
  }();
  return ok;
}

namespace detail {
// x [M, K] (fp16 / bf16, row-major, K % 8 == 0, 16-byte aligned) as a TMA tensor map: boxes of [64 k] x [box_rows]
// rows, 128-byte swizzle (the layout sw128_desc describes), zeros past M and K. The driver's encoder is looked up
// once through the runtime (no link against libcuda); cudaErrorNotSupported when the driver has none.
inline cudaError_t make_x_tensor_map(CUtensorMap& map, const void* x, std::int64_t M, std::int64_t K, int box_rows, bool bf16_data) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    cudaGetLastError();
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(M)};
  const cuuint64_t row_stride[1] = {cuuint64_t(K) * 2};
  const cuuint32_t box[2] = {cuuint32_t(kTileK), cuuint32_t(box_rows)};
  const cuuint32_t step[2] = {1, 1};
  const CUresult r = encode(&map, bf16_data ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<void*>(x),
                            dims, row_stride, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The launch of a configuration-C kernel over `grid`, in clusters of (1, 1, cluster) blocks (the K ranges of a tile),
// or without a cluster attribute for cluster 0; for cudaLaunchKernelEx and cudaOccupancyMaxActiveClusters (which
// wants the attribute, 1 included). cooperative: every block resident at once, or the launch fails (the spread
// reduction's blocks wait for each other). Not copyable: cfg points at attrs.
template <class C>
struct Sm90Launch {
  cudaLaunchAttribute attrs[2]{};
  cudaLaunchConfig_t cfg{};
  Sm90Launch(dim3 grid, int cluster, cudaStream_t stream, bool cooperative = false) {
    cfg.gridDim = grid;
    cfg.blockDim = dim3(C::THREADS);
    cfg.dynamicSmemBytes = C::SMEM_BYTES;
    cfg.stream = stream;
    cfg.attrs = attrs;
    if (cluster > 0) {
      cudaLaunchAttribute& a = attrs[cfg.numAttrs++];
      a.id = cudaLaunchAttributeClusterDimension;
      a.val.clusterDim.x = 1;
      a.val.clusterDim.y = 1;
      a.val.clusterDim.z = unsigned(cluster);
    }
    if (cooperative) {
      cudaLaunchAttribute& a = attrs[cfg.numAttrs++];
      a.id = cudaLaunchAttributeCooperative;
      a.val.cooperative = 1;
    }
  }
  Sm90Launch(const Sm90Launch&) = delete;
  Sm90Launch& operator=(const Sm90Launch&) = delete;
};

// Lets the kernels of (T, C), both reductions, take C::SMEM_BYTES of dynamic shared memory: once per (T, C), for the
// launcher and the capacity query alike.
template <class T, class C>
cudaError_t sm90_allow_smem() {
  static const cudaError_t attr = [] {
    const cudaError_t a = cudaFuncSetAttribute(qgemm_sm90_kernel<T, C, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM_BYTES);
    return a != cudaSuccess
               ? a
               : cudaFuncSetAttribute(qgemm_sm90_kernel<T, C, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM_BYTES);
  }();
  return attr;
}

// The current device's capacity for configuration C: blocks per SM x SMs, and cudaOccupancyMaxActiveClusters per
// cluster size; asked once per configuration. Where the device cannot say (no sm_90a code, not an sm_90 device), the
// even capacity of sm_count SMs.
template <class C>
Sm90Capacity sm90_capacity(int sm_count) {
  static const Sm90Capacity asked = [] {
    Sm90Capacity c;
    c.slots = 0;
    if (!qgemm_sm90_supported()) return c;
    const auto kernel = qgemm_sm90_kernel<bf16, C, true>;  // the cluster kernels (fp16 takes the same resources)
    int dev = 0, sms = 0, per_sm = 0, per_sm_bf16 = 0, per_sm_half = 0;
    if (sm90_allow_smem<bf16, C>() != cudaSuccess || sm90_allow_smem<half, C>() != cudaSuccess || cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, C::THREADS, C::SMEM_BYTES) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_bf16, qgemm_sm90_kernel<bf16, C, false>, C::THREADS, C::SMEM_BYTES) !=
            cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_half, qgemm_sm90_kernel<half, C, false>, C::THREADS, C::SMEM_BYTES) !=
            cudaSuccess) {
      cudaGetLastError();
      return c;
    }
    c.slots = per_sm * sms;
    c.spread_slots = std::min(per_sm_bf16, per_sm_half) * sms;
    for (int k = 1; k <= kSm90MaxClusterSplits; ++k) {
      const Sm90Launch<C> launch(dim3(1, 1, unsigned(k)), k, nullptr);
      if (cudaOccupancyMaxActiveClusters(&c.clusters[k], kernel, &launch.cfg) != cudaSuccess) {
        cudaGetLastError();
        c.clusters[k] = 0;
      }
    }
    return c;
  }();
  return asked.slots > 0 ? asked : sm90_even_capacity<C>(sm_count);
}

// Configuration C with an explicit plan (benchmarks, tests). K splits reduced in a cluster launch as clusters of
// (1, 1, splits) blocks; reduced through global memory they need the plan's workspace. work_data: Sm90Params::work_data
// (a measuring Work's buffer; the GEMM's takes none).
template <class T, class C>
cudaError_t launch_qgemm_sm90_cfg(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y,
                                  const QGemmShape& s, const Sm90Plan& p, const QGemmWorkspace& ws, cudaStream_t stream,
                                  void* work_data = nullptr) {
  static_assert(std::is_same_v<T, half> || std::is_same_v<T, bf16>, "the quantized GEMM takes fp16 or bf16 activations");
  if (!qgemm_sm90_reason(s).empty()) return cudaErrorInvalidValue;
  if ((reinterpret_cast<std::uintptr_t>(x) | reinterpret_cast<std::uintptr_t>(tiles) | reinterpret_cast<std::uintptr_t>(scales) |
       reinterpret_cast<std::uintptr_t>(zeros)) &
      15)
    return cudaErrorInvalidValue;                                                     // 16-byte copies
  if (std::int64_t(p.zslices) * p.strips > 0x7fffffff) return cudaErrorInvalidValue;  // the grid's x dimension
  if (p.splits < 1 || p.splits > (p.cluster ? kSm90MaxClusterSplits : kSm90MaxSplits)) return cudaErrorInvalidValue;  // a portable cluster
  if (!sm90_ranges_cover(p, s.Kpad / kTileK) || (p.cluster && p.lead < p.splits)) return cudaErrorInvalidValue;
  if (C::GSCALE && s.group % kTileK) return cudaErrorInvalidValue;  // per-group scaling: groups of whole chunks
  const bool global = p.splits > 1 && !p.cluster;
  if (global &&
      (ws.partial == nullptr || ws.partial_elems < p.partial_elems || ws.counters == nullptr || ws.counter_elems < p.counter_elems))
    return cudaErrorInvalidValue;
  if (global && (reinterpret_cast<std::uintptr_t>(ws.partial) & 15)) return cudaErrorInvalidValue;  // float4 sums
  if (!qgemm_sm90_supported()) return cudaErrorNotSupported;
  const auto kernel = p.cluster ? qgemm_sm90_kernel<T, C, true> : qgemm_sm90_kernel<T, C, false>;
  if (const cudaError_t attr = sm90_allow_smem<T, C>(); attr != cudaSuccess) return attr;
  CUtensorMap x_map{};
  if constexpr (C::WS)
    if (const cudaError_t e = make_x_tensor_map(x_map, x, s.M, s.K, C::BN, std::is_same_v<T, bf16>); e != cudaSuccess) return e;
  const Sm90Params prm{x,
                       tiles,
                       scales,
                       zeros,
                       y,
                       ws.partial,
                       ws.counters,
                       int(s.M),
                       int(s.N),
                       int(s.K),
                       int(s.Npad),
                       int(s.group),
                       int(s.Kpad / kTileK),
                       p.cps,
                       p.lead,
                       p.cps_tail,
                       p.strips,
                       p.splits,
                       p.zslices,
                       int(global && p.spread),
                       work_data};
  const Sm90Launch<C> launch(dim3(unsigned(p.zslices * p.strips), 1, unsigned(p.splits)), p.cluster ? p.splits : 0, stream,
                             global && p.spread);
  return cudaLaunchKernelEx(&launch.cfg, kernel, prm, x_map);
}
}  // namespace detail

// The plan qgemm_sm90_cuda uses for s on this device (splits_override > 0 forces the K splits), and its workspace.
inline Sm90Plan qgemm_sm90_plan(const QGemmShape& s, int sm_count, int splits_override = 0) {
  return with_sm90_cfg(s, [&](auto c) {
    using C = decltype(c);
    return plan_qgemm_sm90<C>(s, detail::sm90_capacity<C>(sm_count), splits_override);
  });
}

inline QGemmWorkspace qgemm_sm90_workspace_size(const QGemmShape& s, int sm_count, int splits_override = 0) {
  const Sm90Plan p = qgemm_sm90_plan(s, sm_count, splits_override);
  return {nullptr, p.partial_elems, nullptr, p.counter_elems};
}

// y [M, N] = x [M, K] * W^T with the same arguments as qgemm_cuda (4-bit tiles). cudaErrorInvalidValue: a shape
// qgemm_sm90_reason rejects, misaligned pointers or a short workspace; cudaErrorNotSupported: no sm_90a device
// code or not an sm_90 device (qgemm_sm90_supported).
template <class T>
cudaError_t qgemm_sm90_cuda(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y,
                            const QGemmShape& s, const QGemmWorkspace& ws, int sm_count, cudaStream_t stream, int splits_override = 0) {
  return with_sm90_cfg(s, [&](auto c) {
    using C = decltype(c);
    const Sm90Plan p = plan_qgemm_sm90<C>(s, detail::sm90_capacity<C>(sm_count), splits_override);
    return detail::launch_qgemm_sm90_cfg<T, C>(x, tiles, scales, zeros, y, s, p, ws, stream);
  });
}

}  // namespace squeeze::kernels::quant
