#pragma once
// GPTQ 4-bit / 8-bit checkpoint layout -> the tensor-core GEMM's tile layout (kernels/.../qgemm.cuh),
// once at load. Act-order checkpoints (g_idx not i / group) are served by sorting the input rows by group:
// `perm` then names, for each kernel row k, the checkpoint input row it came from, and callers gather
// x[:, perm] before the GEMM. That works when every group is `group_size` rows (what GPTQ's act-order
// writes); any other g_idx is rejected with an error naming the problem (dequantize() still serves it).
#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include <squeeze/kernels/quant/qgemm.cuh>

#include "pack.hpp"

namespace squeeze::quant {

struct QTiles {
  std::int64_t N = 0, K = 0, Npad = 0, Kpad = 0, group = 0;  // group: k per group in kernel order (Kpad if per channel)
  int bits = 4;
  std::vector<std::uint32_t> tiles;  // [Kpad/64][Npad/16][tile_words(bits)]
  std::vector<half> scales;          // [groups, Npad]
  std::vector<std::uint8_t> zeros;   // [groups, Npad]
  std::vector<std::int32_t> perm;    // [K]: kernel row k reads checkpoint row perm[k]; empty = identity

  std::int64_t groups() const { return group == Kpad ? 1 : (K + group - 1) / group; }
  kernels::quant::QGemmShape shape(std::int64_t M) const { return {M, N, K, Kpad, Npad, group, bits}; }
};

inline QTiles to_tiles(const PackedLinear& p) {
  namespace kq = kernels::quant;
  p.validate();
  check(p.bits == 4 || p.bits == 8, "tiles: the fused GEMM takes 4- or 8-bit weights, this layer has " + std::to_string(p.bits) + " bits");
  check(p.group_size == 0 || p.group_size % 16 == 0,
        "tiles: group_size must be a multiple of 16 (or per channel), got " + std::to_string(p.group_size));
  QTiles t;
  t.bits = p.bits;
  t.N = p.out;
  t.K = p.in;
  t.Kpad = kq::pad_to(p.in, kq::kTileK);
  t.Npad = kq::pad_to(p.out, kq::kTileN);
  t.group = p.group_size > 0 ? p.group_size : t.Kpad;
  const std::int64_t G = p.groups();

  // kernel row order: natural when g_idx == i / group, else rows sorted (stably) by group
  std::vector<std::int32_t> order(p.in);
  std::iota(order.begin(), order.end(), 0);
  bool natural = true;
  for (std::int64_t i = 0; i < p.in; ++i) natural = natural && p.g_idx[i] == (p.group_size > 0 ? i / p.group_size : 0);
  if (!natural) {
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return p.g_idx[a] < p.g_idx[b]; });
    for (std::int64_t k = 0; k < p.in; ++k)
      check(p.g_idx[order[k]] == k / t.group,
            "tiles: g_idx does not split the inputs into groups of exactly group_size rows (input row " +
                std::to_string(order[k]) + " is in group " + std::to_string(p.g_idx[order[k]]) + "); dequantize this layer instead");
    t.perm = order;
  }

  const std::int64_t ntiles = t.Npad / kq::kTileN, kchunks = t.Kpad / kq::kTileK;
  const int tw = kq::tile_words(p.bits), lw = kq::lane_words(p.bits), per_word = 32 / p.bits;
  t.tiles.assign(ntiles * kchunks * tw, 0u);
  for (std::int64_t nt = 0; nt < ntiles; ++nt)
    for (std::int64_t kc = 0; kc < kchunks; ++kc) {
      std::uint32_t* tile = t.tiles.data() + (kc * ntiles + nt) * tw;
      for (int lane = 0; lane < 32; ++lane)
        for (int wi = 0; wi < lw; ++wi) {
          std::uint32_t w = 0;
          for (int c = 0; c < per_word; ++c) {
            const auto tc = kq::tile_coord(p.bits, lane, wi, c);
            const std::int64_t k = kc * kq::kTileK + tc.k, n = nt * kq::kTileN + tc.n;
            if (k < p.in && n < p.out) w |= p.code(order[k], n) << (p.bits * c);
          }
          tile[lane * lw + wi] = w;
        }
    }
  // The kernel keeps its accumulators in units of the current scale, so every scale must be nonzero:
  // padded columns get 1, and a group whose scale is 0 (all its weights 0) gets scale 1 with every
  // code set to its zero point, which is exactly 0 again.
  t.scales.assign(G * t.Npad, from_float<half>(1.f));
  t.zeros.assign(G * t.Npad, 0);
  for (std::int64_t g = 0; g < G; ++g)
    for (std::int64_t n = 0; n < p.out; ++n) {
      t.zeros[g * t.Npad + n] = std::uint8_t(p.zero(g, n));
      if (to_float(p.scales[g * p.out + n]) != 0.f) {
        t.scales[g * t.Npad + n] = p.scales[g * p.out + n];
        continue;
      }
      const std::uint32_t z = p.zero(g, n), mask = (1u << p.bits) - 1u;
      for (std::int64_t nt = n / kq::kTileN, kc = 0; kc < kchunks; ++kc)  // rewrite this column's codes in group g
        for (int lane = 0; lane < 32; ++lane)
          for (int wi = 0; wi < lw; ++wi)
            for (int c = 0; c < per_word; ++c) {
              const auto tc = kq::tile_coord(p.bits, lane, wi, c);
              const std::int64_t k = kc * kq::kTileK + tc.k;
              if (nt * kq::kTileN + tc.n != n || k >= p.in || p.g_idx[order[k]] != g) continue;
              std::uint32_t& w = t.tiles[(kc * ntiles + nt) * tw + lane * lw + wi];
              w = (w & ~(mask << (p.bits * c))) | (z << (p.bits * c));
            }
    }
  return t;
}

}  // namespace squeeze::quant
