#pragma once
// GPTQ 3-, 4- and 8-bit checkpoint layout -> the tensor-core GEMM's tile layout (kernels/quant/gemm/layout.hpp),
// once at load. Act-order checkpoints (g_idx not i / group) are served by sorting the input rows by group:
// `perm` then names, for each kernel row k, the checkpoint input row it came from, and callers gather
// x[:, perm] before the GEMM. That works when every group is `group_size` rows (what GPTQ's act-order
// writes); any other g_idx is rejected with an error naming the problem (dequantize() still serves it).
#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "squeeze/kernels/quant/gemm/layout.hpp"

#include "squeeze/quant/pack.hpp"

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
  check(p.bits == 3 || p.bits == 4 || p.bits == 8,
        "tiles: the fused GEMM takes 3-, 4- or 8-bit weights, this layer has " + std::to_string(p.bits) + " bits");
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
      check(p.g_idx[order[k]] == k / t.group, "tiles: g_idx does not split the inputs into groups of exactly group_size rows (input row " +
                                                  std::to_string(order[k]) + " is in group " + std::to_string(p.g_idx[order[k]]) +
                                                  "); dequantize this layer instead");
    t.perm = order;
  }

  const std::int64_t ntiles = t.Npad / kq::kTileN, kchunks = t.Kpad / kq::kTileK;
  const int tw = kq::tile_words(p.bits), lw = kq::lane_words(p.bits), per_word = 32 / p.bits;
  t.tiles.assign(ntiles * kchunks * tw, 0u);
  for (std::int64_t nt = 0; nt < ntiles; ++nt)
    for (std::int64_t kc = 0; kc < kchunks; ++kc) {
      std::uint32_t* tile = t.tiles.data() + (kc * ntiles + nt) * tw;
      auto code_at = [&](const kq::TileCoord& tc) -> std::uint32_t {  // padding: code 0
        const std::int64_t k = kc * kq::kTileK + tc.k, n = nt * kq::kTileN + tc.n;
        return k < p.in && n < p.out ? p.code(order[k], n) : 0u;
      };
      for (int lane = 0; lane < 32; ++lane) {
        if (p.bits == 3) {
          for (int q = 0; q < 16; ++q)
            for (int e = 0; e < 2; ++e) {
              const std::uint32_t v = code_at(kq::tile3_coord(lane, q, e));
              for (int b = 0; b < 3; ++b) {
                const auto pos = kq::tile3_bit(q, e, b);
                tile[32 * pos.word + lane] |= ((v >> b) & 1u) << pos.bit;
              }
            }
          continue;
        }
        for (int wi = 0; wi < lw; ++wi) {
          std::uint32_t w = 0;
          for (int c = 0; c < per_word; ++c) w |= code_at(kq::tile_coord(p.bits, lane, wi, c)) << (p.bits * c);
          tile[lane * lw + wi] = w;
        }
      }
    }
  // Scales as stored (a zero scale makes its group's weights exactly 0: the kernel multiplies each group's
  // integer sum by its scale); padded columns get 1.
  t.scales.assign(G * t.Npad, from_float<half>(1.f));
  t.zeros.assign(G * t.Npad, 0);
  for (std::int64_t g = 0; g < G; ++g)
    for (std::int64_t n = 0; n < p.out; ++n) {
      t.zeros[g * t.Npad + n] = std::uint8_t(p.zero(g, n));
      t.scales[g * t.Npad + n] = p.scales[g * p.out + n];
    }
  return t;
}

}  // namespace squeeze::quant
