#pragma once
// The mma.sync family of the quantized GEMM (3-, 4- and 8-bit weights, fp16 / bf16 activations, any sm_80+ GPU):
// y [M, N] = x [M, K] * W^T on mma.sync.m16n8k16 from the tiles of layout.hpp. It serves what the sm90 kernel does not
// take (3 and 8 bits, other GPUs, builds without sm_90a).
//
// The mma multiplies x by the exact small integers (q - z) (decode.cuh), or with folded zero points by magic + q
// corrected once per group, into an fp32 group sum that is multiplied by the group's scale and added to the result:
// fp16 and bf16 activations get fp32-accurate products (w is never rounded), except with scaled B.
// Work split (plan.hpp, plan_qgemm): a block = W warps, each owning NT 16-column tiles, times `rows` x rows, times one
// K range of cps 64-k chunks. The block stages its x slice and its group table in shared memory once (one barrier),
// then every warp streams its own tiles with PF chunks in flight and no further barrier. K ranges write fp32 partials;
// the last block of a (z slice, strip) to finish sums them in split order (deterministic), writes y and resets its
// counter, so one launch does everything and the counters stay zero between launches.
// Weight loaders (QGemmKnobs::loader): each lane's loads into registers, per-thread cp.async into a shared ring, or
// (sm_90) one producer warp per block copying each chunk's whole strip (its tiles are contiguous) plus the group rows
// starting in it with bulk copies into a ring of mbarrier-guarded slots; with a persistent grid a block walks
// consecutive work items and the producer streams across them.
// The kernel is composed of device functions along CUTLASS's seams: tile scheduler (qgemm_item), mainloop loads
// (qgemm_bulk_producer, qgemm_load_chunk / qgemm_issue_chunk / qgemm_read_slot, qgemm_stage_x, qgemm_stage_groups),
// decode (QGemmGroupConsts, qgemm_decode_kstep), mma (QGemmAccumulators, qgemm_mma_kstep) and epilogue with the split-K
// reduction (qgemm_epilogue).
#if !defined(__CUDACC__)
#error "gemm/mma_sync.cuh is a CUDA header: compile this translation unit with nvcc"
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

// ==== tile scheduler ===================================================================================================
// Work items (z slice, strip, K range of cps chunks); a block takes items_per_block consecutive ones. Order: the
// register / cp.async loaders (one item per block) put the z slice fastest, so the blocks that read the same weights
// run together and share them in L2; Bulk puts the strip fastest, so a block's consecutive items share their x slice
// (staged once per run) while the blocks of other z slices walk the same strips at the same time.
struct QGemmItem {
  int z, strip, split, kc0, nck;
};
template <bool kBulk>
__device__ __forceinline__ QGemmItem qgemm_item(const QGemmParams& p, int kchunks, int i) {
  QGemmItem it;
  if constexpr (kBulk) {
    it.strip = i % p.strips;
    i /= p.strips;
    it.z = i % p.zslices;
    it.split = i / p.zslices;
  } else {
    it.z = i % p.zslices;
    i /= p.zslices;
    it.strip = i % p.strips;
    it.split = i / p.strips;
  }
  it.kc0 = it.split * p.cps;
  it.nck = min(kchunks, it.kc0 + p.cps) - it.kc0;
  return it;
}

// ==== mainloop: the weight stream ======================================================================================
template <int NT, int LW>
struct QGemmChunk {  // one chunk (64 k) of a warp's NT tiles, this lane's words
  std::uint32_t w[NT][LW];
};

// Bulk: slot s of the ring (p.slot_bytes) holds one chunk of an item's strip, its W * NT tiles in memory order (fewer
// in the last strip), then the scale rows [slot_rows][STRIP] and zero-point rows [slot_rows][STRIP] of the groups that
// start in the chunk (the first chunk of an item: from the group it begins in), so the group constants arrive with the
// weights, as far ahead. Producer lane: wait until every compute warp released the slot's previous chunk, announce the
// bytes, copy. Compute warp: wait until the chunk landed, copy its lanes' words into registers (lanes 16 B / 4 B
// apart: no bank conflicts at 3/4 bits), compute, release the slot. Every compute warp takes part in every chunk (warps
// past N only skip the math), so the empty barriers count W arrivals. q numbers the chunks of the block's whole item
// sequence: slot q % PF, phase q / PF.
// Group rows of chunk kcc (first: the first chunk of an item): first group -> glo, returns the row count.
__device__ __forceinline__ int qgemm_slot_groups(const QGemmParams& p, int kcc, bool first, int& glo) {
  const int k_lo = kcc * kTileK, k_hi = min(k_lo + kTileK, p.K) - 1;
  glo = first ? k_lo / p.group : (k_lo + p.group - 1) / p.group;
  return max(0, min(p.slot_rows, k_hi / p.group - glo + 1));
}
// The producer lane: every chunk of the block's items [item0, item_end) into the ring.
template <class T, int BITS, class C>
__device__ __forceinline__ void qgemm_bulk_producer(const QGemmParams& p, unsigned char* bring, std::uint64_t* full, std::uint64_t* empty,
                                                    int item0, int item_end, int kchunks, int ntiles, std::int64_t cstride) {
  using K = QGemmTraits<T, BITS, C>;
  constexpr int W = C::W, NT = C::NT, PF = C::PF, STRIP = C::STRIP;
  int q = 0;
  for (int i = item0; i < item_end; ++i) {
    const QGemmItem it = qgemm_item<true>(p, kchunks, i);
    const int tile0 = it.strip * W * NT;
    const int cols = min(W * NT, ntiles - tile0) * kTileN;
    const unsigned wbytes = unsigned(cols / kTileN) * K::kTileBytes;
    const std::uint32_t* src = p.tiles + std::int64_t(it.kc0) * cstride + std::int64_t(tile0) * K::TW;
    for (int c = 0; c < it.nck; ++c, ++q) {
      const int slot = q % PF;
      int glo;
      const int grows = qgemm_slot_groups(p, it.kc0 + c, c == 0, glo);
      unsigned char* dst = bring + slot * p.slot_bytes;
      if (q >= PF) mbar_wait(empty + slot, unsigned(q / PF - 1) & 1u);
      mbar_arrive_expect_tx(full + slot, wbytes + unsigned(grows * cols * 3));
      bulk_copy_g2s(dst, src + c * cstride, wbytes, full + slot);
      for (int r = 0; r < grows; ++r) {
        const std::int64_t off = std::int64_t(glo + r) * p.Npad + std::int64_t(tile0) * kTileN;
        bulk_copy_g2s(dst + K::kSlotBytes + r * STRIP * 2, p.scales + off, unsigned(cols * 2), full + slot);
        bulk_copy_g2s(dst + K::kSlotBytes + p.slot_rows * STRIP * 2 + r * STRIP, p.zeros + off, unsigned(cols), full + slot);
      }
    }
  }
}
// A compute warp's words of the chunk in a ring slot (Bulk).
template <class T, int BITS, class C>
__device__ __forceinline__ QGemmChunk<C::NT, lane_words(BITS)> qgemm_bulk_read(const unsigned char* slot_base, int warp, int lane) {
  using K = QGemmTraits<T, BITS, C>;
  constexpr int NT = C::NT;
  QGemmChunk<NT, K::LW> ch;
  const unsigned char* sp = slot_base + warp * NT * K::kTileBytes;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if constexpr (BITS == 3) {
#pragma unroll
      for (int r = 0; r < 3; ++r) ch.w[t][r] = lds32(sp + t * K::kTileBytes + (32 * r + lane) * 4);
    } else {
#pragma unroll
      for (int l = 0; l < K::LV; ++l) {
        const uint4 v = lds128(sp + t * K::kTileBytes + lane * K::LW * 4 + l * 16);
        ch.w[t][4 * l] = v.x;
        ch.w[t][4 * l + 1] = v.y;
        ch.w[t][4 * l + 2] = v.z;
        ch.w[t][4 * l + 3] = v.w;
      }
    }
  }
  return ch;
}
// This warp's weight stream of one item (register and cp.async loaders): tile (kc, nt) at words (kc * ntiles + nt) *
// TW from wbase, the item's first chunk of this lane; toff[t] the offset of tile t (tiles past N read the last tile,
// never stored). 4/8-bit: a lane's words are contiguous (16-byte loads); 3-bit: word-major.
// Chunk c straight into registers.
template <class T, int BITS, class C>
__device__ __forceinline__ QGemmChunk<C::NT, lane_words(BITS)> qgemm_load_chunk(const std::uint32_t* wbase, std::int64_t cstride,
                                                                                const int (&toff)[C::NT], int c) {
  using K = QGemmTraits<T, BITS, C>;
  QGemmChunk<C::NT, K::LW> ch;
#pragma unroll
  for (int t = 0; t < C::NT; ++t) {
    const std::uint32_t* src = wbase + c * cstride + toff[t];
    if constexpr (BITS == 3) {
#pragma unroll
      for (int r = 0; r < 3; ++r) ch.w[t][r] = ldg_stream32(src + 32 * r);
    } else {
#pragma unroll
      for (int l = 0; l < K::LW / 4; ++l) {
        const uint4 v = ldg_stream(reinterpret_cast<const uint4*>(src) + l);
        ch.w[t][4 * l] = v.x;
        ch.w[t][4 * l + 1] = v.y;
        ch.w[t][4 * l + 2] = v.z;
        ch.w[t][4 * l + 3] = v.w;
      }
    }
  }
  return ch;
}
// Chunk c into slot `slot` of this thread's cp.async ring, [PF][W*32][NV] (4/8 bits).
template <class T, int BITS, class C>
__device__ __forceinline__ void qgemm_issue_chunk(uint4* ring, int tid, const std::uint32_t* wbase, std::int64_t cstride,
                                                  const int (&toff)[C::NT], int c, int slot) {
  using K = QGemmTraits<T, BITS, C>;
  uint4* d = ring + (std::int64_t(slot) * C::W * 32 + tid) * K::NV;
#pragma unroll
  for (int t = 0; t < C::NT; ++t)
#pragma unroll
    for (int l = 0; l < K::LV; ++l) cp_async16(d + t * K::LV + l, reinterpret_cast<const uint4*>(wbase + c * cstride + toff[t]) + l, 16);
}
// The chunk in slot `slot` of this thread's cp.async ring.
template <class T, int BITS, class C>
__device__ __forceinline__ QGemmChunk<C::NT, lane_words(BITS)> qgemm_read_slot(const uint4* ring, int tid, int slot) {
  using K = QGemmTraits<T, BITS, C>;
  QGemmChunk<C::NT, K::LW> ch;
  const uint4* sp = ring + (std::int64_t(slot) * C::W * 32 + tid) * K::NV;
#pragma unroll
  for (int t = 0; t < C::NT; ++t)
#pragma unroll
    for (int l = 0; l < K::LV; ++l) {
      const uint4 v = lds128(sp + t * K::LV + l);
      ch.w[t][4 * l] = v.x;
      ch.w[t][4 * l + 1] = v.y;
      ch.w[t][4 * l + 2] = v.z;
      ch.w[t][4 * l + 3] = v.w;
    }
  return ch;
}

// The item's x slice, [XR rows][cps * 64 k] at xs (rows past M, k past K: zero), by 16-byte cp.async where x allows;
// commits the copies as one group.
template <class T, int NC>
__device__ __forceinline__ void qgemm_stage_x(const QGemmParams& p, std::uint16_t* xs, int xstride, int XR, int rows, int m0, int kb,
                                              int tid) {
  const T* x = static_cast<const T*>(p.x) + std::int64_t(m0) * p.K;
  const bool vec_ok = (p.K % 8 == 0) && ((reinterpret_cast<std::uintptr_t>(p.x) & 15) == 0);
  const int segs = p.cps * (kTileK / 8);  // 8-element segments per row
  for (int i = tid; i < XR * segs; i += NC) {
    const int r = i / segs, sg = i - r * segs, k = kb + sg * 8;
    std::uint16_t* d = xs + r * xstride + sg * 8;
    if (r < rows && k < p.K && vec_ok) {
      cp_async16(d, x + std::int64_t(r) * p.K + k, 16);
    } else if (r < rows && k < p.K) {
      alignas(16) std::uint16_t e[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const T tv = k + q < p.K ? x[std::int64_t(r) * p.K + k + q] : from_float<T>(0.f);
        e[q] = *reinterpret_cast<const std::uint16_t*>(&tv);
      }
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(e);
    } else {
      *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);  // rows past M, k past K: zero
    }
  }
  cp_async_commit();
}
// The item's group table (register / cp.async loaders; Bulk: the rows come with the weights in the ring): scales and
// zero points of groups g_first..g_last over the strip, [ngroups][STRIP].
template <int STRIP, int NC>
__device__ __forceinline__ void qgemm_stage_groups(const QGemmParams& p, half* ss, std::uint8_t* zs, int g_first, int g_last, int col0,
                                                   int tid) {
  for (int i = tid; i < p.ngroups * STRIP; i += NC) {
    const int gi = i / STRIP, col = col0 + (i - gi * STRIP);
    const bool in = g_first + gi <= g_last && col < p.Npad;
    const std::int64_t src = std::int64_t(g_first + gi) * p.Npad + col;
    ss[i] = in ? p.scales[src] : from_float<half>(1.f);
    zs[i] = in ? p.zeros[src] : std::uint8_t(0);
  }
}

// ==== decode ===========================================================================================================
// Per-group constants: zero points of the B columns (8j + g4), scales of the C columns (8j + 2c4 + {0,1}).
// Raw group data of this warp's columns: B-column zero points, C-column zero point pairs (folding), scales.
template <int NT>
struct QGemmGroupRaw {
  std::uint32_t zb[NT][2], zc[NT][2], s[NT][2], sb[NT][2];  // sb: scale of the B column (SCALEB)
};
// Group gg from the group table (row r holds group tbl_g0 + r).
template <class T, int BITS, class C>
__device__ __forceinline__ QGemmGroupRaw<C::NT> qgemm_fetch_group(const half* tbl_s, const std::uint8_t* tbl_z, int tbl_g0, int gg,
                                                                  int warp, int g4, int c4) {
  using K = QGemmTraits<T, BITS, C>;
  QGemmGroupRaw<C::NT> r;
  const int row = (gg - tbl_g0) * C::STRIP + warp * C::NT * kTileN;
#pragma unroll
  for (int t = 0; t < C::NT; ++t)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int n = row + t * kTileN + 8 * j;
      r.zb[t][j] = tbl_z[n + g4];
      if constexpr (K::kFold && !K::kSwap) r.zc[t][j] = std::uint32_t(tbl_z[n + 2 * c4]) | (std::uint32_t(tbl_z[n + 2 * c4 + 1]) << 8);
      if constexpr (C::SCALEB)
        r.sb[t][j] = *reinterpret_cast<const std::uint16_t*>(tbl_s + n + g4);
      else if constexpr (K::kSwap)
        r.s[t][j] = *reinterpret_cast<const std::uint16_t*>(tbl_s + n + g4);  // C row n = B column
      else
        r.s[t][j] = *reinterpret_cast<const std::uint32_t*>(tbl_s + n + 2 * c4);
    }
  return r;
}
// The current group's decode operands and scales, as the decode and the flush read them.
template <class T, int BITS, class C>
struct QGemmGroupConsts {
  using K = QGemmTraits<T, BITS, C>;
  static constexpr int NT = C::NT;
  // (members in reverse order of use: nvcc then numbers their registers as it did local arrays, and the code is the same)
  std::uint32_t sb2[NT][2];                      // SCALEB: the B column's scale as a T pair
  float zc2[NT][2][2], sc[NT][2][2], zf[NT][2];  // zc2 (folding): magic + z of the C columns
  std::uint32_t zhi[NT][2], zlo[NT][2];
  __device__ __forceinline__ void apply(const QGemmGroupRaw<NT>& r) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int zc = int(r.zb[t][j]);
        if constexpr (K::kFold && K::kSwap) {
          constexpr float kMagic = std::is_same_v<T, bf16> ? 128.f : 1024.f;
          zc2[t][j][0] = kMagic + float(zc);  // column 8 j + g4 (the A rows)
        } else if constexpr (K::kFold) {
          constexpr float kMagic = std::is_same_v<T, bf16> ? 128.f : 1024.f;
          zc2[t][j][0] = kMagic + float(r.zc[t][j] & 0xFFu);
          zc2[t][j][1] = kMagic + float(r.zc[t][j] >> 8);
        } else if constexpr (BITS == 8) {
          zf[t][j] = 8388608.f + float(zc);
          zlo[t][j] = (0x6400u + zc) * 0x00010001u;  // fp16 1024 + z
        } else {
          zero_operands<T>(std::uint32_t(zc), zlo[t][j], zhi[t][j]);
        }
        if constexpr (C::SCALEB) {
          if constexpr (std::is_same_v<T, bf16>) {
            const __nv_bfloat16 b = __float2bfloat16_rn(__half2float(__ushort_as_half(static_cast<unsigned short>(r.sb[t][j]))));
            sb2[t][j] = u32(__halves2bfloat162(b, b));
          } else {
            sb2[t][j] = r.sb[t][j] * 0x00010001u;
          }
        } else if constexpr (K::kSwap) {
          sc[t][j][0] = sc[t][j][1] = __half2float(__ushort_as_half(static_cast<unsigned short>(r.s[t][j])));  // column 8 j + g4
        } else {
          const __half2 s2 = as_vec2<__half2>(r.s[t][j]);
          sc[t][j][0] = __low2float(s2);
          sc[t][j][1] = __high2float(s2);
        }
      }
  }
};
// Fragment registers of k-step ks of the chunk, every tile: b[t][j][r] (n8 half j, register r); with folded zero
// points magic + q, otherwise q - z (scaled B: times the B column's scale).
template <class T, int BITS, class C>
__device__ __forceinline__ void qgemm_decode_kstep(const QGemmChunk<C::NT, lane_words(BITS)>& ch, int ks,
                                                   const QGemmGroupConsts<T, BITS, C>& gc, std::uint32_t (&b)[C::NT][2][2]) {
  using K = QGemmTraits<T, BITS, C>;
#pragma unroll
  for (int t = 0; t < C::NT; ++t) {
    if constexpr (K::kFold) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if constexpr (BITS == 8)
            b[t][j][r] = magic8_pair_f16(ch.w[t][2 * ks + j], r);
          else if constexpr (BITS == 3)
            b[t][j][r] = magic3_pair<T>(ch.w[t][0], ch.w[t][1], ch.w[t][2], 4 * ks + 2 * j + r);
          else
            b[t][j][r] = and_or<0x000F000Fu, (std::is_same_v<T, bf16> ? 0x43004300u : 0x64006400u)>(ch.w[t][ks] >> (4 * (2 * j + r)));
        }
    } else if constexpr (BITS == 8) {
      decode_word8<T>(ch.w[t][2 * ks], ch.w[t][2 * ks + 1], gc.zlo[t], gc.zf[t], b[t]);
    } else if constexpr (BITS == 3) {
      decode_word3<T>(ch.w[t][0], ch.w[t][1], ch.w[t][2], ks, gc.zlo[t], b[t]);
    } else {
      decode_word<T>(ch.w[t][ks], gc.zlo[t], gc.zhi[t], b[t]);
    }
    if constexpr (C::SCALEB) {
      using V = typename Vec2<T>::type;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) b[t][j][r] = u32(__hmul2(as_vec2<V>(b[t][j][r]), as_vec2<V>(gc.sb2[t][j])));
    }
  }
}

// ==== mma ==============================================================================================================
// The accumulators: acc, the result so far; tmp, this group's sum of x * (q - z), folded into acc with the group's
// scales (flush); xacc (folding), this group's row sums of x (rows g4, g4 + 8 in elements 0 / 2; SWAP: [batch block][e],
// batch row 2 c4 + (e & 1) in every element, as C is the same in all 16 rows).
template <class T, int BITS, class C>
struct QGemmAccumulators {
  using K = QGemmTraits<T, BITS, C>;
  static constexpr int MT = C::MT, NT = C::NT, NJ = K::NJ, XA = K::XA;
  // (members in reverse order: nvcc then numbers their registers as it did local arrays, and the code is the same)
  float xacc[XA][4];
  float tmp[MT][NT][NJ][4], acc[MT][NT][NJ][4];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int mt = 0; mt < XA; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) xacc[mt][e] = 0.f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][t][j][e] = tmp[mt][t][j][e] = 0.f;
  }
  // The group's sums, scaled, into acc (scaled B: the mma accumulated straight into acc).
  __device__ __forceinline__ void flush(const QGemmGroupConsts<T, BITS, C>& gc) {
    if constexpr (!C::SCALEB) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float v = tmp[mt][t][j][e];
              // minus (magic + z) * sum(x) of the row (SWAP: z of the column n = 8 (e >> 1) + g4, sum of batch row j, e)
              if constexpr (K::kFold && K::kSwap)
                v = fmaf(-gc.zc2[t][e >> 1][0], xacc[j][e], v);
              else if constexpr (K::kFold)
                v = fmaf(-gc.zc2[t][j][e & 1], xacc[mt][e & 2], v);
              // scale of the element's column: swapped, C row n = 8 (e >> 1) + g4 of the tile
              const float scale = K::kSwap ? gc.sc[t][e >> 1][0] : gc.sc[t][j][e & 1];
              acc[mt][t][j][e] = fmaf(v, scale, acc[mt][t][j][e]);
              tmp[mt][t][j][e] = 0.f;
            }
      if constexpr (K::kFold)
#pragma unroll
        for (int mt = 0; mt < XA; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) xacc[mt][e] = 0.f;
    }
  }
};
// The mma of k-step ks of the chunk at local k kl of the x slice: load the x fragments (ldmatrix) and multiply them by
// the decoded fragments b, MT * NT * 2 mma (SWAP: NT * NJ mma, x as B). a8 (8 rows): the A fragments of two k-steps,
// loaded at even ks.
template <class T, int BITS, class C>
__device__ __forceinline__ void qgemm_mma_kstep(const std::uint16_t* xs, int xstride, int XR, int kl, int ks, int lane,
                                                std::uint32_t (&a8)[4], const std::uint32_t (&b)[C::NT][2][2],
                                                QGemmAccumulators<T, BITS, C>& ac) {
  using K = QGemmTraits<T, BITS, C>;
  constexpr int MT = C::MT, NT = C::NT, NJ = K::NJ;
  if constexpr (K::kSwap) {
    // x as B: register 0 = (k 2 c4, 2 c4 + 1; batch g4), register 1 = k + 8. ldmatrix (not transposed) hands
    // lane l the pair at row l / 4, columns 2 (l % 4) of each 8 x 8 matrix: rows = batch, columns = k.
    std::uint32_t xb[NJ][2];
    if constexpr (NJ == 1) {
      // lanes 8i..8i+7 address rows 0..7 at k 8i of a 32-k window: matrices (ks, lo), (ks, hi), (ks+1, lo), (ks+1, hi)
      if (ks % 2 == 0) ldmatrix_x4(a8, xs + min(lane & 7, XR - 1) * xstride + kl + ks * 16 + 8 * (lane >> 3));
      xb[0][0] = a8[(ks & 1) * 2];
      xb[0][1] = a8[(ks & 1) * 2 + 1];
    } else {
      // matrices (rows 0..7, k lo), (rows 0..7, k hi), (rows 8..15, k lo), (rows 8..15, k hi)
      std::uint32_t x4[4];
      ldmatrix_x4(x4, xs + min((lane & 7) + 8 * (lane >> 4), XR - 1) * xstride + kl + ks * 16 + 8 * ((lane >> 3) & 1));
      xb[0][0] = x4[0];
      xb[0][1] = x4[1];
      xb[1][0] = x4[2];
      xb[1][1] = x4[3];
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      // A = the decoded word: a0 (n g4, k lo) = b[t][0][0], a1 (n g4 + 8, k lo) = b[t][1][0], a2, a3: k hi
      const std::uint32_t aw[4] = {b[t][0][0], b[t][1][0], b[t][0][1], b[t][1][1]};
#pragma unroll
      for (int nb = 0; nb < NJ; ++nb) mma16816<T>(C::SCALEB ? ac.acc[0][t][nb] : ac.tmp[0][t][nb], aw, xb[nb][0], xb[nb][1]);
    }
    if constexpr (K::kFold) {  // column sums of x: A = 1
      constexpr std::uint32_t kOnes = std::is_same_v<T, bf16> ? 0x3F803F80u : 0x3C003C00u;
      const std::uint32_t ones[4] = {kOnes, kOnes, kOnes, kOnes};
#pragma unroll
      for (int nb = 0; nb < NJ; ++nb) mma16816<T>(ac.xacc[nb], ones, xb[nb][0], xb[nb][1]);
    }
  } else {
    std::uint32_t a[MT][4];
    if constexpr (C::ROWS8 == 1) {
      // lanes 8i..8i+7 address rows 0..7 at k 8i..8i+7 of a 32-k window: matrices (ks, lo), (ks, hi), (ks+1, lo), (ks+1, hi)
      if (ks % 2 == 0) ldmatrix_x4(a8, xs + (lane & 7) * xstride + kl + ks * 16 + 8 * (lane >> 3));
      a[0][0] = a8[(ks & 1) * 2];
      a[0][2] = a8[(ks & 1) * 2 + 1];
      a[0][1] = a[0][3] = 0u;
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldmatrix_x4(a[mt], xs + (mt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * xstride + kl + ks * 16 + 8 * (lane >> 4));
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int j = 0; j < 2; ++j) mma16816<T>(C::SCALEB ? ac.acc[mt][t][j] : ac.tmp[mt][t][j], a[mt], b[t][j][0], b[t][j][1]);
      if constexpr (K::kFold) {
        constexpr std::uint32_t kOnes = std::is_same_v<T, bf16> ? 0x3F803F80u : 0x3C003C00u;
        mma16816<T>(ac.xacc[mt], a[mt], kOnes, kOnes);
      }
    }
  }
}

// ==== epilogue =========================================================================================================
// Where this warp's item lands: batch rows m0.. (rows of them), strip columns col0.., the warp's first tile nt0
// (active: inside N).
struct QGemmOut {
  int m0, rows, col0, nt0;
  bool active;
};
// The item's accumulators out: straight to y with one K range; else fp32 partials, and the last block of the (z slice,
// strip) to finish sums them in split order (deterministic), writes y and resets its counter. C fragment rows g4 / g4 +
// 8, columns 2 c4, 2 c4 + 1 of each n8 half (SWAP: rows are the columns n, columns the batch rows).
template <class T, int BITS, class C>
__device__ __forceinline__ void qgemm_epilogue(const QGemmParams& p, const QGemmAccumulators<T, BITS, C>& ac, const QGemmItem& it,
                                               const QGemmOut& o, int ntiles, int tid, int g4, int c4, int& last_flag) {
  using K = QGemmTraits<T, BITS, C>;
  constexpr int MT = C::MT, NT = C::NT, NJ = K::NJ, STRIP = C::STRIP;
  T* y = static_cast<T*>(p.y);
  float* const mine = p.splits > 1 ? p.partial + (std::int64_t(it.split) * p.M + o.m0) * p.Npad : nullptr;  // fp32 partials
  if constexpr (K::kSwap) {
    if (o.active)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int nb = 0; nb < NJ; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int m = 8 * nb + 2 * c4 + (e & 1), n = (o.nt0 + t) * kTileN + g4 + 8 * (e >> 1);
            if (m >= o.rows) continue;
            if (p.splits == 1) {
              if (n < p.N) y[std::int64_t(o.m0 + m) * p.N + n] = from_float<T>(ac.acc[0][t][nb][e]);
            } else if (o.nt0 + t < ntiles) {
              mine[std::int64_t(m) * p.Npad + n] = ac.acc[0][t][nb][e];
            }
          }
    if (p.splits == 1) return;
  } else if (p.splits == 1) {
    if (o.active)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int m = mt * 16 + g4 + 8 * (e >> 1), n = (o.nt0 + t) * kTileN + 8 * j + 2 * c4 + (e & 1);
              if (m < o.rows && n < p.N) y[std::int64_t(o.m0 + m) * p.N + n] = from_float<T>(ac.acc[mt][t][j][e]);
            }
    return;
  } else if (o.active) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int m = mt * 16 + g4 + 8 * h, n = (o.nt0 + t) * kTileN + 8 * j + 2 * c4;
            if (m < o.rows && o.nt0 + t < ntiles)
              *reinterpret_cast<float2*>(mine + std::int64_t(m) * p.Npad + n) =
                  make_float2(ac.acc[mt][t][j][2 * h], ac.acc[mt][t][j][2 * h + 1]);
          }
  }
  // split-K: the last block of the (z slice, strip) sums the partials
  __threadfence();
  qgemm_sync_compute<K::kBulk, K::NC>();
  int* counter = p.counters + std::int64_t(it.z) * p.strips + it.strip;
  if (tid == 0) last_flag = atomicAdd(counter, 1) == p.splits - 1;
  qgemm_sync_compute<K::kBulk, K::NC>();
  if (!last_flag) return;  // (uniform: the flag is read by every thread before anyone can write it again)
  __threadfence();
  for (int i = tid; i < o.rows * STRIP; i += K::NC) {
    const int m = i / STRIP, n = o.col0 + (i - m * STRIP);
    if (n >= p.N) continue;
    float s = 0.f;
    for (int sp = 0; sp < p.splits; ++sp) s += __ldcg(p.partial + (std::int64_t(sp) * p.M + o.m0 + m) * p.Npad + n);
    y[std::int64_t(o.m0 + m) * p.N + n] = from_float<T>(s);
  }
  if (tid == 0) *counter = 0;  // ready for the next launch
}

// ==== the kernel =======================================================================================================
// Per item: stage x and the group table (one barrier), then every warp streams its own tiles through the mainloop (the
// chunk's decode and mma, group constants advanced as K crosses groups) and the epilogue stores or reduces.
template <class T, int BITS, class C>
__global__ void __launch_bounds__(C::THREADS, C::MINB) qgemm_kernel(const QGemmParams p) {
  using K = QGemmTraits<T, BITS, C>;
  using Work = typename WorkOf<C, QGemmWork>::type;
  using Chunk = QGemmChunk<C::NT, K::LW>;
  constexpr int W = C::W, PF = C::PF, ROWS = C::ROWS, STRIP = C::STRIP, NC = K::NC;
  constexpr bool kBulk = K::kBulk;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int last_flag;
  __shared__ __align__(8) std::uint64_t bars[kBulk ? 2 * PF : 1];  // Bulk: full[PF], empty[PF]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g4 = lane >> 2, c4 = lane & 3;
  const int kchunks = p.Kpad / kTileK, ntiles = p.Npad / kTileN;
  const std::int64_t cstride = std::int64_t(ntiles) * K::TW;  // words between chunks
  const int xstride = p.cps * kTileK + 8;
  // x rows in shared memory (as plan_qgemm counts them): SWAP stages min(ROWS, M) rows, the B columns past them
  // read the last staged row (their results are never stored)
  const int XR = K::kSwap ? min(ROWS, p.M) : ROWS;
  const QGemmSmem lay = qgemm_smem(XR, p.cps, p.ngroups, STRIP, C::template kRingBytes<BITS>);
  std::uint16_t* xs = reinterpret_cast<std::uint16_t*>(smem + lay.x);
  half* ss = reinterpret_cast<half*>(smem + lay.scales);
  std::uint8_t* zs = smem + lay.zeros;

  const int n_items = p.zslices * p.strips * p.splits;
  const int item0 = blockIdx.x * p.items_per_block, item_end = min(n_items, item0 + p.items_per_block);

  unsigned char* bring = smem + lay.ring;  // Bulk: [PF][slot_bytes]
  std::uint64_t* const full = bars;
  std::uint64_t* const empty = bars + (kBulk ? PF : 0);
  if constexpr (kBulk) {
    if (warp == W && lane == 0) {
#pragma unroll
      for (int sl = 0; sl < PF; ++sl) {
        mbar_init(full + sl, 1);
        mbar_init(empty + sl, W);
      }
      mbar_init_fence();
    }
    __syncthreads();  // the only barrier the producer takes part in
    if (warp == W) {
      if (lane == 0) qgemm_bulk_producer<T, BITS, C>(p, bring, full, empty, item0, item_end, kchunks, ntiles, cstride);
      return;
    }
  }

  typename Work::Sink sink{};  // what a measuring Work skips
  int q_next = 0;              // Bulk: sequence number of the next chunk to read
  int x_key = -1;              // Bulk: (z, K range) of the staged x slice
  for (int item = item0; item < item_end; ++item) {
    const QGemmItem it = qgemm_item<kBulk>(p, kchunks, item);
    const int z = it.z, split = it.split, kc0 = it.kc0, nck = it.nck;
    const int kb = kc0 * kTileK;  // first k of this item
    const int m0 = z * ROWS, rows = min(ROWS, p.M - m0);
    const int col0 = it.strip * STRIP;
    const int nt0 = col0 / kTileN + warp * C::NT;  // this warp's first tile
    const bool active = nt0 < ntiles;              // warp-uniform

    const std::uint32_t* wbase = p.tiles + std::int64_t(kc0) * cstride + (BITS == 3 ? lane : lane * K::LW);  // this warp's weight stream
    int toff[C::NT];
#pragma unroll
    for (int t = 0; t < C::NT; ++t) toff[t] = min(nt0 + t, ntiles - 1) * K::TW;
    uint4* ring = reinterpret_cast<uint4*>(smem + lay.ring);  // [PF][W*32][NV] (CpAsync loader, 4/8 bits)

    // ---- prologue: weight loads first (the longest latency), then x and the group table ----
    Chunk bq[C::LOADER == QGemmLoader::Registers ? PF : 1];
    if constexpr (C::LOADER == QGemmLoader::Registers) {
#pragma unroll
      for (int c = 0; c < PF; ++c)
        if (active && c < nck) bq[c] = qgemm_load_chunk<T, BITS, C>(wbase, cstride, toff, c);
    }
    const int key = z + p.zslices * split;
    const bool stage_x = !kBulk || key != x_key;
    if (stage_x) {
      if (kBulk && item != item0) qgemm_sync_compute<kBulk, NC>();  // every warp is done with the previous x slice
      x_key = key;
      qgemm_stage_x<T, NC>(p, xs, xstride, XR, rows, m0, kb, tid);
    }
    const int g_first = kb / p.group;
    const int g_last = (min(kb + nck * kTileK, p.K) - 1) / p.group;
    if constexpr (!kBulk) qgemm_stage_groups<STRIP, NC>(p, ss, zs, g_first, g_last, col0, tid);
    if constexpr (C::LOADER == QGemmLoader::CpAsync) {
#pragma unroll
      for (int c = 0; c < PF - 1; ++c) {
        if (active && c < nck) qgemm_issue_chunk<T, BITS, C>(ring, tid, wbase, cstride, toff, c, c);
        cp_async_commit();
      }
      cp_async_wait<PF - 2>();  // x (the oldest group) has landed
    } else {
      cp_async_wait<0>();
    }
    if (stage_x) qgemm_sync_compute<kBulk, NC>();

    // ---- group constants: the table staged for the item (register / cp.async loaders), or the rows that came with
    // the current chunk's ring slot (Bulk); row r holds group tbl_g0 + r
    const half* tbl_s = ss;
    const std::uint8_t* tbl_z = zs;
    int tbl_g0 = g_first;
    QGemmGroupConsts<T, BITS, C> gc;
    int g = g_first;
    int next_k = (g + 1) * p.group < p.K ? (g + 1) * p.group : 0x7fffffff;  // k where the next group starts
    QGemmAccumulators<T, BITS, C> ac;
    ac.zero();
    if constexpr (Work::kDecode && !kBulk)
      gc.apply(qgemm_fetch_group<T, BITS, C>(tbl_s, tbl_z, tbl_g0, g, warp, g4, c4));  // (Bulk: with the first chunk's slot)
    auto advance_group = [&]() {
      if constexpr (Work::kMultiply) ac.flush(gc);
      ++g;
      next_k = (g + 1) * p.group < p.K ? (g + 1) * p.group : 0x7fffffff;
      gc.apply(qgemm_fetch_group<T, BITS, C>(tbl_s, tbl_z, tbl_g0, g, warp, g4, c4));
    };
    // One chunk: 4 k-steps of 16; per k-step decode NT * 2 B fragments and multiply (SWAP: NT A fragments). Groups that
    // end inside the chunk (group % 64 != 0) take the checked copy of the chunk body (k-steps never straddle groups:
    // group % 16 == 0).
    auto chunk_body = [&](const Chunk& ch, int kl, auto check_groups) {
      [[maybe_unused]] std::uint32_t a8[4];  // ROWS8 == 1: A of two k-steps (rows 0..7)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        if constexpr (decltype(check_groups)::value) {
          if (ks > 0 && kb + kl + ks * 16 >= next_k) advance_group();
        }
        std::uint32_t b[C::NT][2][2];
        qgemm_decode_kstep<T, BITS, C>(ch, ks, gc, b);
        if constexpr (!Work::kMultiply) {
          Work::keep(sink, b);
          continue;
        }
        qgemm_mma_kstep<T, BITS, C>(xs, xstride, XR, kl, ks, lane, a8, b, ac);
      }
    };
    auto compute = [&](const Chunk& ch, int c) {
      if constexpr (!Work::kDecode) {
        Work::keep(sink, ch.w);
        return;
      }
      const int kl = c * kTileK;               // local k in xs
      if (kb + kl >= next_k) advance_group();  // a group starting with this chunk (every group % 64 == 0 case)
      if (kb + kl + kTileK > next_k)
        chunk_body(ch, kl, std::true_type{});
      else
        chunk_body(ch, kl, std::false_type{});
    };

    // ---- mainloop: no block barriers; each warp keeps PF chunks of its own weights in flight (Bulk: the
    // producer keeps PF chunks of the block's strips in flight, across items) ----
    if constexpr (kBulk) {
      // every compute warp takes part in every chunk; warps past N skip the math
      for (int c = 0; c < nck; ++c) {
        const int q = q_next + c, slot = q % PF;
        mbar_wait(full + slot, unsigned(q / PF) & 1u);
        __syncwarp();  // lanes leave the wait loop separately; ldmatrix / mma.sync need the whole warp
        const unsigned char* sb = bring + slot * p.slot_bytes;
        const Chunk ch = qgemm_bulk_read<T, BITS, C>(sb, warp, lane);
        tbl_s = reinterpret_cast<const half*>(sb + K::kSlotBytes);
        tbl_z = sb + K::kSlotBytes + p.slot_rows * STRIP * 2;
        qgemm_slot_groups(p, kc0 + c, c == 0, tbl_g0);
        if (Work::kDecode && c == 0) gc.apply(qgemm_fetch_group<T, BITS, C>(tbl_s, tbl_z, tbl_g0, g, warp, g4, c4));
        if (active) compute(ch, c);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + slot);  // this warp is done with the slot
      }
      q_next += nck;
    } else if (active) {
      if constexpr (C::LOADER == QGemmLoader::Registers) {
        for (int base = 0; base < nck; base += PF) {
#pragma unroll
          for (int q = 0; q < PF; ++q) {
            const int c = base + q;
            if (c < nck) {
              const Chunk cur = bq[q];
              if (c + PF < nck) bq[q] = qgemm_load_chunk<T, BITS, C>(wbase, cstride, toff, c + PF);
              compute(cur, c);
            }
          }
        }
      } else {
        for (int c = 0; c < nck; ++c) {
          // slot (c + PF - 1) % PF was read (and consumed) in iteration c - 1
          if (c + PF - 1 < nck) qgemm_issue_chunk<T, BITS, C>(ring, tid, wbase, cstride, toff, c + PF - 1, (c + PF - 1) % PF);
          cp_async_commit();
          cp_async_wait<PF - 1>();  // chunk c has landed
          compute(qgemm_read_slot<T, BITS, C>(ring, tid, c % PF), c);
        }
      }
    }

    if constexpr (!Work::kMultiply) continue;
    ac.flush(gc);
    qgemm_epilogue<T, BITS, C>(p, ac, it, QGemmOut{m0, rows, col0, nt0, active}, ntiles, tid, g4, c4, last_flag);
  }  // items

  Work::template finish<T>(sink, p);
}

// Launch one configuration. Returns cudaErrorInvalidValue when the workspace is smaller than the plan.
template <class T, int BITS, class C>
cudaError_t launch_qgemm_cfg(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y,
                             const QGemmShape& s, const QGemmPlan& p, const QGemmWorkspace& ws, cudaStream_t stream) {
  if (p.splits > 1 && (ws.partial == nullptr || ws.partial_elems < p.partial_elems)) return cudaErrorInvalidValue;
  if (p.counter_elems > 0 && p.splits > 1 && (ws.counters == nullptr || ws.counter_elems < p.counter_elems)) return cudaErrorInvalidValue;
  // bulk copies need 16-byte aligned sources
  if (C::LOADER == QGemmLoader::Bulk &&
      ((reinterpret_cast<std::uintptr_t>(tiles) | reinterpret_cast<std::uintptr_t>(scales) | reinterpret_cast<std::uintptr_t>(zeros)) & 15))
    return cudaErrorInvalidValue;
  // Dynamic shared memory above 48 KB must be allowed per kernel; the limit counts static + dynamic
  // bytes, so allow the device's opt-in maximum minus this kernel's static shared memory (once per
  // instantiation). A refusal is cleared from the runtime's last error and leaves the 48 KB default.
  static const int max_dynamic = [] {
    int dev = 0, optin = 48 * 1024;
    cudaFuncAttributes fa{};
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
        cudaFuncGetAttributes(&fa, qgemm_kernel<T, BITS, C>) != cudaSuccess) {
      cudaGetLastError();
      return 48 * 1024 - 64;
    }
    const int bytes = optin - int(fa.sharedSizeBytes);
    if (cudaFuncSetAttribute(qgemm_kernel<T, BITS, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess) {
      cudaGetLastError();
      return 48 * 1024 - int(fa.sharedSizeBytes);
    }
    return bytes;
  }();
  if (p.smem_bytes > max_dynamic) return cudaErrorInvalidConfiguration;
  QGemmParams prm{
      x,           tiles,       scales,       zeros, y,        ws.partial, ws.counters, int(s.M),  int(s.N),          int(s.K),
      int(s.Npad), int(s.Kpad), int(s.group), p.cps, p.strips, p.splits,   p.zslices,   p.ngroups, p.items_per_block, p.slot_bytes,
      p.slot_rows};
  qgemm_kernel<T, BITS, C><<<unsigned(p.blocks()), C::THREADS, p.smem_bytes, stream>>>(prm);
  return cudaGetLastError();
}
}  // namespace detail

// y [M, N] = x [M, K] * W^T on `stream` (s.bits 3, 4 or 8) with the configuration and plan qgemm_plan names.
// cudaErrorInvalidValue for unsupported arguments or a workspace smaller than qgemm_workspace_size.
template <class T>
cudaError_t qgemm_cuda(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y, const QGemmShape& s,
                       const QGemmWorkspace& ws, int sm_count, cudaStream_t stream, int cps_override = 0) {
  static_assert(std::is_same_v<T, half> || std::is_same_v<T, bf16>, "the quantized GEMM takes fp16 or bf16 activations");
  if (s.M <= 0 || s.N <= 0 || s.K <= 0 || s.Kpad % kTileK || s.Npad % kTileN || s.Kpad < s.K || s.Kpad >= s.K + kTileK || s.Npad < s.N ||
      s.group <= 0 || s.group % 16 || s.K > (1ll << 30) || s.N > (1ll << 30) || s.M > (1ll << 24) ||
      !(s.bits == 3 || s.bits == 4 || s.bits == 8))
    return cudaErrorInvalidValue;
  return with_qgemm_cfg(s, [&](auto bits, auto c) {
    constexpr int BITS = decltype(bits)::value;
    using C = decltype(c);
    const QGemmPlan p = plan_qgemm(s, qgemm_geometry<C, BITS>(), sm_count, cps_override);
    return detail::launch_qgemm_cfg<T, BITS, C>(x, tiles, scales, zeros, y, s, p, ws, stream);
  });
}

}  // namespace squeeze::kernels::quant
