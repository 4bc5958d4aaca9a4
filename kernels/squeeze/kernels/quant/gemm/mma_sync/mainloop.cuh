#pragma once
// The mma.sync family (gemm/mma_sync.cuh): the mainloop's loads, the weight stream (registers, a cp.async ring,
// or a producer warp's bulk copies), the x slice and the group table.
#if !defined(__CUDACC__)
#error "gemm/mma_sync/mainloop.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include "squeeze/kernels/quant/gemm/mma_sync/scheduler.cuh"

namespace squeeze::kernels::quant {
namespace detail {

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

}  // namespace detail
}  // namespace squeeze::kernels::quant
