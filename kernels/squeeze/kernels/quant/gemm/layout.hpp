#pragma once
// The quantized GEMM's weight layout ("tiles") and the shape of one call. Plain C++ (any compiler): quant/tiles.hpp
// builds the tiles from a GPTQ checkpoint with these functions, and both kernel families read them.
//
// One tile = 64 k x 16 n codes, shaped for mma.sync.m16n8k16: per lane one (4-bit) or two (8-bit) 16-byte loads, or
// three 4-byte loads (3-bit). The words of lane l hold exactly the codes that lane needs as the B operand (mma.sync
// family) or A operand (wgmma, weights as A) of the four k-steps ks, for both n8 halves j:
//   4-bit: word ks, nibble p:      k = 16 ks + 2 (l % 4) + (p >> 2) + 8 (p & 1),  n = 8 ((p >> 1) & 1) + l / 4
//   8-bit: word 2 ks + j, byte b:  k = 16 ks + 2 (l % 4) + (b & 1) + 8 (b >> 1),  n = 8 j + l / 4
//   3-bit: see tile3_coord / tile3_bit (pairs of codes 16 bits apart, so one shift + mask decodes two)
// so nibbles (p, p + 4) / bytes (2r, 2r + 1) are the two 16-bit halves of one fragment register (decode.hpp).
// Tiles are stored k-chunk-major ([Kpad/64][Npad/16] tiles): the warps of a block read neighbouring tiles. K is padded
// to a multiple of 64 and N to a multiple of 16 with code 0; padded k rows meet zero activations, padded n columns
// are never stored.
#include <cstdint>

#include "squeeze/dtype.hpp"

namespace squeeze::kernels::quant {

inline constexpr int kTileK = 64, kTileN = 16;
// 32-bit words per tile and per lane
SQUEEZE_HD constexpr int tile_words(int bits) { return bits == 8 ? 256 : bits == 3 ? 96 : 128; }
SQUEEZE_HD constexpr int lane_words(int bits) { return tile_words(bits) / 32; }
SQUEEZE_HD std::int64_t pad_to(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

struct TileCoord {
  int k, n;  // within the 64 x 16 tile
};
// Element function of the layout: (bits, lane, word w of the lane, code p of the word) -> (k, n) in a tile.
SQUEEZE_HD TileCoord tile_coord(int bits, int lane, int w, int p) {
  if (bits == 8) return {16 * (w >> 1) + 2 * (lane & 3) + (p & 1) + 8 * (p >> 1), 8 * (w & 1) + (lane >> 2)};
  return {16 * w + 2 * (lane & 3) + (p >> 2) + 8 * (p & 1), 8 * ((p >> 1) & 1) + (lane >> 2)};
}

// 3-bit tiles: lane l holds 3 words, stored word-major (word r of lane l at tile word 32 r + l, so each of the three
// loads of a warp reads 128 contiguous bytes). Its 32 codes form 16 pairs q = 4 ks + 2 j + r (k-step ks, n8 half j,
// register r); half e (0 low, 1 high) of pair q is the code at
//   k = 16 ks + 2 (l % 4) + 8 r + e,  n = 8 j + l / 4            (tile3_coord)
// Pairs 0..14 sit in word q / 5 at bits 3 (q % 5) + 16 e, so one shift and one mask give both halves; pair 15 uses
// the spare bits 15 / 31 of the three words (bit b of the code in word b).
SQUEEZE_HD TileCoord tile3_coord(int lane, int q, int e) {
  const int ks = q >> 2, j = (q >> 1) & 1, r = q & 1;
  return {16 * ks + 2 * (lane & 3) + 8 * r + e, 8 * j + (lane >> 2)};
}
// (word 0..2 of the lane, bit in the word) of bit b of the code in half e of pair q
struct BitPos {
  int word, bit;
};
SQUEEZE_HD BitPos tile3_bit(int q, int e, int b) {
  if (q < 15) return {q / 5, 3 * (q % 5) + 16 * e + b};
  return {b, 15 + 16 * e};
}

// One GEMM call: y [M, N] = x [M, K] * W^T with W in tiles. Groups: zero points (uint8 [groups, Npad]) and fp16 scales
// ([groups, Npad]) per `group` consecutive k (group % 16 == 0; per channel: one group of Kpad). Act-order checkpoints
// are handled at load: k rows sorted by group, x gathered by QTiles::perm.
struct QGemmShape {
  std::int64_t M, N, K;     // logical sizes
  std::int64_t Kpad, Npad;  // tile-padded
  std::int64_t group;       // k per group (multiple of 16; per channel: Kpad)
  int bits = 4;             // 3, 4 or 8
};

}  // namespace squeeze::kernels::quant
