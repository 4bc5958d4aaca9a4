#pragma once
// The sm90 family (gemm/sm90.cuh): the mainloop's loads, the producer filling the ring.
#if !defined(__CUDACC__)
#error "gemm/sm90/mainloop.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include "squeeze/kernels/quant/gemm/sm90/scheduler.cuh"

namespace squeeze::kernels::quant {
namespace detail {

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

}  // namespace detail
}  // namespace squeeze::kernels::quant
