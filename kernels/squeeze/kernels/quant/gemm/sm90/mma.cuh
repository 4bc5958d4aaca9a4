#pragma once
// The sm90 family (gemm/sm90.cuh): the mainloop's decode and wgmma / mma.sync of a chunk, the group scaling.
#if !defined(__CUDACC__)
#error "gemm/sm90/mma.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include "squeeze/kernels/quant/gemm/sm90/mainloop.cuh"

namespace squeeze::kernels::quant {
namespace detail {

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

}  // namespace detail
}  // namespace squeeze::kernels::quant
