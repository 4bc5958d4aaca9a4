#pragma once
// Kernels that read the GPTQ checkpoint layout directly, for every width (2/3/4/8 bits):
//   dequantize  W [out, in] (float / fp16 / bf16) from qweight, qzeros, scales, g_idx
//   gemv        y [M, out] = x [M, in] * W^T for small M (the 3-bit and 8-bit path, and any g_idx)
// One element function (gptq_weight) holds the math; CPU and CUDA launchers apply it.
//   W[o, i] = scale[g, o] * (q[i, o] - zero[g, o]),  g = g_idx[i],  zero = stored + 1 (v1)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "squeeze/dtype.hpp"

#include "squeeze/kernels/quant/bitstream.cuh"

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
  // g_idx out of order (act-order): dequantize_cuda then takes a kernel for scattered groups (a shared-memory table of
  // the groups' constants where `groups` is given and at most kDeqMaxTableGroups, else lookups four elements at a time).
  // act_order is only a speed hint: every kernel is right for any g_idx.
  bool act_order = false;
  std::int64_t groups = 0;  // rows of scales / qzeros: 0 (not given) or the true count (the table holds that many)
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
// Dequantize in tiles of W [64 out][64 in], kDeqTilesPerBlock tiles along in per block. The per-element form (one
// thread per W element; bench_dequant keeps it as the peer) read qweight across its rows (stride out) and ran at a
// small fraction of the copy bandwidth (measured: docs/results.md, GPTQ dequantize). Per tile a block
//   1. copies the tile's qweight words, 2 BITS rows x 64 outs, coalesced along out (64 in x BITS is a whole number of
//      words for every width, so tiles start on word boundaries and 3-bit codes straddle only inside one); the next
//      tile's words are loaded into registers while this one is decoded and stored;
//   2. decodes with one thread per out column and runs of 8 consecutive in (shared-memory reads conflict-free: a
//      warp's threads read 32 consecutive columns of one word row), into a [64 out][64 in] tile of T in shared memory;
//      a run's scale and zero point are loaded when its group differs from the one it had (act-order, or groups of
//      fewer than 8, change groups inside a run);
//   3. writes W's rows 16 bytes a thread (a row's 64 in are 128 / 256 contiguous bytes), or element by element where
//      the row pitch (in * sizeof T) is not a multiple of 16 bytes or the tile is cut by in.
// The element math is gptq_weight's, bit-identical to the CPU twin: q - z is exact in fp32 (taken as (2^23 + q) -
// (2^23 + z), the code OR-ed into the float 2^23's mantissa), one fp32 product with the scale, one rounding to T.
// The width is a template parameter and the group constants come with the copy (with a run-time width the block's
// set-up and index arithmetic outweighed its 16 elements a thread); four tiles a block (faster again). Six blocks of
// 40 registers per SM (at 8 bits five, whose four prefetched words a thread spilled at 40).
constexpr int kDeqTile = 64, kDeqThreads = 256, kDeqTilesPerBlock = 4;
// How a kernel finds a run's group constants (GptqView::act_order picks one of the last two):
//   kDeqInOrder   kept in registers while a run's group stays the one it had; looked up one group change at a time;
//   kDeqActLookup where a run's groups change, the constants of four elements looked up at once (independent loads in
//                 flight together), faster on act-order layers than one lookup at a time. A kernel of its own: in the
//                 in-order one the batched lookups raised the register pressure past the 40 a thread that six blocks
//                 per SM allow, and every width took longer; this one runs five;
//   kDeqActTable  the block's 64 columns' constants of every group in shared memory first ([groups][64] words: the
//                 scale's fp16 bits | zero point << 16; up to kDeqMaxTableGroups groups, 32 KB), then one shared-memory
//                 read per element, close to the in-order kernel on in-order layers. Tiles a block: groups / 4 within
//                 8..16 (deq_table_tiles), so that the table's fill stays near 1/16 of the block's elements (the best
//                 counts measured at 32..86 groups); the in-order kernel's 4 were close to the best count everywhere
//                 (measured: docs/results.md, GPTQ dequantize).
enum : int { kDeqInOrder, kDeqActLookup, kDeqActTable };
constexpr int kDeqMaxTableGroups = 128;
inline int deq_table_tiles(std::int64_t groups) { return int(std::clamp<std::int64_t>(groups / 4, 8, 16)); }
template <class T, int BITS, int MODE = kDeqInOrder>
__global__ void __launch_bounds__(kDeqThreads, BITS == 8 || MODE == kDeqActLookup ? 5 : 6)
    dequantize_kernel(GptqView v, T* __restrict__ w, int tiles_per_block) {
  constexpr bool ACT = MODE == kDeqActLookup;
  constexpr int kChunk = 16 / int(sizeof(T));           // elements per 16-byte store
  constexpr int kWordRows = 2 * BITS;                   // qweight rows of a 64-in tile
  constexpr int kWordsPerThread = (kWordRows + 3) / 4;  // rows r4, r4 + 4, ... of column c
  constexpr int kChunksPerRow = kDeqTile / kChunk;
  constexpr std::uint32_t kMaxq = (1u << BITS) - 1u;
  __shared__ std::uint32_t words[kWordRows][kDeqTile];
  __shared__ alignas(16) int groups[kDeqTile];
  __shared__ alignas(16) T tile[kDeqTile][kDeqTile + kChunk];  // [out][in], one chunk of padding a row (banks)
  // this thread: column c (decode, copies) and runs r4, r4 + 4 of 8 in
  const int c = threadIdx.x % kDeqTile, r4 = threadIdx.x / kDeqTile;
  const std::int64_t o0 = std::int64_t(blockIdx.x) * kDeqTile, o = o0 + c;
  const bool column = o < v.out;
  const std::int64_t first = std::int64_t(blockIdx.y) * tiles_per_block, in_tiles = (v.in + kDeqTile - 1) / kDeqTile;
  const int tiles = int(min(std::int64_t(tiles_per_block), in_tiles - first));
  const std::int64_t qrows = (v.in * BITS + 31) / 32, zcols = (v.out * BITS + 31) / 32;
  const std::int32_t* const qcol = v.qweight + o;
  auto load_words = [&](std::int64_t t, std::uint32_t(&reg)[kWordsPerThread]) {
#pragma unroll
    for (int m = 0; m < kWordsPerThread; ++m) {
      const std::int64_t row = t * kWordRows + r4 + 4 * m;
      reg[m] = r4 + 4 * m < kWordRows && row < qrows && column ? std::uint32_t(qcol[row * v.out]) : 0u;
    }
  };
  const bool vector_rows = (v.in * std::int64_t(sizeof(T))) % 16 == 0 && reinterpret_cast<std::uintptr_t>(w) % 16 == 0;
  int run_group[2] = {-1, -1};
  float run_scale[2] = {0.f, 0.f}, run_zero[2] = {0.f, 0.f};
  auto group_constants = [&](int g, float& scale, float& zero_magic) {
    scale = to_float(v.scales[std::int64_t(g) * v.out + o]);
    zero_magic = 8388608.f + float((stream_get(v.qzeros + std::int64_t(g) * zcols, 1, o, BITS) + 1u) & kMaxq);
  };
  [[maybe_unused]] extern __shared__ std::uint32_t table[];  // kDeqActTable: [groups][64], dynamic
  if constexpr (MODE == kDeqActTable) {
    for (int u = threadIdx.x; u < int(v.groups) * kDeqTile; u += kDeqThreads) {
      const std::int64_t g = u / kDeqTile, oc = o0 + u % kDeqTile;
      std::uint32_t entry = 0;
      if (oc < v.out)
        entry = std::uint32_t(__half_as_ushort(v.scales[g * v.out + oc])) | ((stream_get(v.qzeros + g * zcols, 1, oc, BITS) + 1u) & kMaxq)
                                                                                << 16;
      table[u] = entry;
    }  // read after the tile loop's first barrier
  }
  std::uint32_t next[kWordsPerThread];
  load_words(first, next);
  for (int k = 0; k < tiles; ++k) {
    const std::int64_t t = first + k, i0 = t * kDeqTile;
#pragma unroll
    for (int m = 0; m < kWordsPerThread; ++m)
      if (r4 + 4 * m < kWordRows) words[r4 + 4 * m][c] = next[m];
    if (threadIdx.x < kDeqTile) groups[threadIdx.x] = i0 + threadIdx.x < v.in ? v.g_idx[i0 + threadIdx.x] : 0;
    if (k + 1 < tiles) load_words(t + 1, next);
    __syncthreads();  // the words and groups are in (and the previous tile's stores have read `tile`)
    if (column) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = r4 + 4 * h;
        // the run's 8 BITS bits, from bit 8 BITS j of the column's words
        const int bit0 = 8 * BITS * j;
        std::uint64_t run = words[bit0 >> 5][c];
        if ((bit0 & 31) + 8 * BITS > 32) run |= std::uint64_t(words[(bit0 >> 5) + 1][c]) << 32;
        run >>= (bit0 & 31);
        const int4 g_lo = *reinterpret_cast<const int4*>(&groups[8 * j]), g_hi = *reinterpret_cast<const int4*>(&groups[8 * j + 4]);
        const int g_run[8] = {g_lo.x, g_lo.y, g_lo.z, g_lo.w, g_hi.x, g_hi.y, g_hi.z, g_hi.w};
        float vals[8];
        if constexpr (MODE == kDeqActTable) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const std::uint32_t entry = table[g_run[e] * kDeqTile + c];
            vals[e] =
                __half2float(__ushort_as_half(std::uint16_t(entry & 0xFFFFu))) *
                (__uint_as_float(0x4B000000u | (std::uint32_t(run >> (BITS * e)) & kMaxq)) - __uint_as_float(0x4B000000u | entry >> 16));
          }
        } else if (g_run[0] == run_group[h] && g_run[7] == run_group[h] &&
                   ((g_run[1] ^ g_run[0]) | (g_run[2] ^ g_run[0]) | (g_run[3] ^ g_run[0]) | (g_run[4] ^ g_run[0]) | (g_run[5] ^ g_run[0]) |
                    (g_run[6] ^ g_run[0])) == 0) {
          const float scale = run_scale[h], zero_magic = run_zero[h];  // one group, the run's constants at hand
#pragma unroll
          for (int e = 0; e < 8; ++e)
            vals[e] = scale * (__uint_as_float(0x4B000000u | (std::uint32_t(run >> (BITS * e)) & kMaxq)) - zero_magic);
        } else if constexpr (ACT) {
#pragma unroll
          for (int e0 = 0; e0 < 8; e0 += 4) {  // groups change (or a new one starts): four elements' constants at a time
            float scale[4], zero_magic[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) group_constants(g_run[e0 + e], scale[e], zero_magic[e]);
#pragma unroll
            for (int e = 0; e < 4; ++e)
              vals[e0 + e] = scale[e] * (__uint_as_float(0x4B000000u | (std::uint32_t(run >> (BITS * (e0 + e))) & kMaxq)) - zero_magic[e]);
            run_scale[h] = scale[3];
            run_zero[h] = zero_magic[3];
          }
          run_group[h] = g_run[7];
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) {  // a group changes: look its constants up
            if (g_run[e] != run_group[h]) {
              run_group[h] = g_run[e];
              group_constants(g_run[e], run_scale[h], run_zero[h]);
            }
            vals[e] = run_scale[h] * (__uint_as_float(0x4B000000u | (std::uint32_t(run >> (BITS * e)) & kMaxq)) - run_zero[h]);
          }
        }
        alignas(16) T out[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = from_float<T>(vals[e]);
#pragma unroll
        for (int q = 0; q < 8; q += kChunk) *reinterpret_cast<uint4*>(&tile[c][8 * j + q]) = *reinterpret_cast<const uint4*>(&out[q]);
      }
    }
    __syncthreads();  // the tile is decoded (and every thread is done with words and groups)
    // store: thread -> row / kChunksPerRow, chunk % kChunksPerRow
    for (int u = threadIdx.x; u < kDeqTile * kChunksPerRow; u += kDeqThreads) {
      const int r = u / kChunksPerRow, q = (u % kChunksPerRow) * kChunk;
      if (o0 + r >= v.out) continue;
      T* const dst = w + (o0 + r) * v.in + i0 + q;
      if (vector_rows && i0 + q + kChunk <= v.in) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&tile[r][q]);
      } else {
        for (int e = 0; e < kChunk && i0 + q + e < v.in; ++e) dst[e] = tile[r][q + e];
      }
    }
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

// dequantize_cuda with tiles_per_block 64-in tiles a block (0: the kernel's own, kDeqTilesPerBlock or deq_table_tiles;
// bench_dequant --tiles sweeps it). cudaErrorInvalidValue where the grid would pass its y limit.
template <FloatingElement T>
cudaError_t launch_dequantize(const GptqView& v, T* w, cudaStream_t stream, int tiles_per_block) {
  if (v.in <= 0 || v.out <= 0 || !(v.bits == 2 || v.bits == 3 || v.bits == 4 || v.bits == 8) || tiles_per_block < 0)
    return cudaErrorInvalidValue;
  const std::int64_t out_tiles = (v.out + kDeqTile - 1) / kDeqTile, in_tiles = (v.in + kDeqTile - 1) / kDeqTile;
  if ((in_tiles + kDeqTilesPerBlock - 1) / kDeqTilesPerBlock > 65535 || out_tiles > 0x7fffffff)
    return cudaErrorInvalidValue;  // one rule for all
  auto launch = [&](auto mode) -> cudaError_t {
    constexpr int MODE = decltype(mode)::value;
    const int tpb = tiles_per_block > 0 ? tiles_per_block : MODE == kDeqActTable ? deq_table_tiles(v.groups) : kDeqTilesPerBlock;
    const std::int64_t in_blocks = (in_tiles + tpb - 1) / tpb;
    if (in_blocks > 65535) return cudaErrorInvalidValue;
    const dim3 g{unsigned(out_tiles), unsigned(in_blocks)};
    const int smem = MODE == kDeqActTable ? int(v.groups) * kDeqTile * 4 : 0;
    auto run = [&](auto bits) -> cudaError_t {  // one instantiation (and one attribute call) per kernel
      const auto kernel = dequantize_kernel<T, decltype(bits)::value, MODE>;
      if constexpr (MODE == kDeqActTable) {  // the table's 32 KB at most, past the default with the static arrays
        static const cudaError_t allowed =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kDeqMaxTableGroups * kDeqTile * 4);
        if (allowed != cudaSuccess) return allowed;
      }
      kernel<<<g, kDeqThreads, smem, stream>>>(v, w, tpb);
      return cudaGetLastError();
    };
    switch (v.bits) {
      case 2:
        return run(std::integral_constant<int, 2>{});
      case 3:
        return run(std::integral_constant<int, 3>{});
      case 4:
        return run(std::integral_constant<int, 4>{});
      default:
        return run(std::integral_constant<int, 8>{});
    }
  };
  if (!v.act_order) return launch(std::integral_constant<int, kDeqInOrder>{});
  if (v.groups >= 1 && v.groups <= kDeqMaxTableGroups) return launch(std::integral_constant<int, kDeqActTable>{});
  return launch(std::integral_constant<int, kDeqActLookup>{});
}
}  // namespace detail

// W [out, in] in T from a GPTQ layer, all on the device. cudaErrorInvalidValue for a bad width or shape (in tiles
// of 64 x kDeqTilesPerBlock past the grid's y limit, in > 16,776,960).
template <FloatingElement T>
cudaError_t dequantize_cuda(const GptqView& v, T* w, cudaStream_t stream) {
  return detail::launch_dequantize(v, w, stream, 0);
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
