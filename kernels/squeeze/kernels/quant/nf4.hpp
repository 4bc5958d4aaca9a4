#pragma once
// NF4 (4-bit NormalFloat, QLoRA paper, Dettmers et al. 2023): element math + CPU launchers.
// The CUDA launchers are in nf4.cuh and apply the same functions, so the CPU twin checks the GPU math.
//
// Layout of one packed tensor of n values (flattened row-major), block size B (Group<G>, default 64), exactly
// bitsandbytes' Linear4bit weight (io/bnb_nf4.hpp names its state-dict keys):
//   codes   uint8 [ceil(n/2)]   two 4-bit code indices per byte: value 2j in the HIGH nibble, value 2j+1
//                               in the LOW nibble (the bitsandbytes order); a padding nibble (odd n) is
//                               code 7 (exactly 0).
//   plain:        absmax        float [blocks]            blocks = ceil(n/B); the last block may be short
//   DoubleQuant (bitsandbytes' nested statistics):
//                 absmax_code   uint8 [blocks]            absmax'(b) = nested_map[absmax_code[b]] * nested_absmax[b / 256]
//                 nested_absmax float [ceil(blocks/256)]               + offset   (product and sum each rounded,
//                 nested_map    float [256]               bitsandbytes' dynamic map   as bitsandbytes computes them)
//                 offset        float [1]                 the mean of all block absmax values
//   value i = kNf4Codes[code_i] * absmax'(i / B)
// Quantisation, as bitsandbytes' quantize_4bit: block absmax over the valid values; each value goes to the nearest
// code of w * (1 / absmax) (clamped to [-1, 1]; bitsandbytes' thresholds between codes); under DoubleQuant the exact absmax values are then
// compressed: offset = mean, nested_absmax = max |absmax - offset| per 256 blocks, absmax_code = the nearest map entry of (absmax - offset)
// * (1 / nested_absmax). (A block of zeros gets code 7 where bitsandbytes computes 0 * inf and stores code 0: both decode to zero.)
#include <cmath>
#include <cstdint>
#include <string>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"

#include "squeeze/kernels/cpu_parallel.hpp"

namespace squeeze::kernels::quant {

inline constexpr int kNf4DqBlock = 256;  // absmax values per DoubleQuant scale
inline constexpr std::uint8_t kNf4ZeroCode = 7;

// The 16 NF4 values as published with QLoRA (quantiles of N(0, 1) normalised to [-1, 1], exact 0 at
// index 7; 8 positive and 7 negative non-zero values).
SQUEEZE_HD float nf4_code_value(int c) {
  constexpr float table[16] = {-1.0f,
                               -0.6961928009986877f,
                               -0.5250730514526367f,
                               -0.39491748809814453f,
                               -0.28444138169288635f,
                               -0.18477343022823334f,
                               -0.09105003625154495f,
                               0.0f,
                               0.07958029955625534f,
                               0.16093020141124725f,
                               0.24611230194568634f,
                               0.33791524171829224f,
                               0.44070982933044434f,
                               0.5626170039176941f,
                               0.7229568362236023f,
                               1.0f};
  return table[c & 15];
}

// The threshold between codes k and k + 1: bitsandbytes' (its quantizer's decision tree), the midpoints of the NF4
// values in float64 before those were rounded to float32, so a few differ in the last bit from midpoints of the
// float32 table above.
SQUEEZE_HD float nf4_midpoint(int k) {
  constexpr float table[15] = {-0.8480964004993439f,  -0.6106329262256622f,  -0.4599952697753906f,   -0.33967943489551544f,
                               -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
                               0.1202552504837513f,   0.2035212516784668f,   0.2920137718319893f,    0.3893125355243683f,
                               0.5016634166240692f,   0.6427869200706482f,   0.8614784181118011f};
  return table[k < 0 ? 0 : k > 14 ? 14 : k];
}

// Nearest code index of x in [-1, 1] (values outside clamp to the ends; a tie goes to the lower code; NaN goes
// to 0 = code 7).
SQUEEZE_HD std::uint8_t nf4_encode(float x) {
  if (!(x == x)) return kNf4ZeroCode;
  int c = 0;
#pragma unroll
  for (int k = 0; k < 15; ++k) c += x > nf4_midpoint(k) ? 1 : 0;
  return std::uint8_t(c);
}

// Index of the entry of the sorted 256-entry `map` nearest x, as bitsandbytes' blockwise quantizer picks it: an exact
// tie between two entries goes to the even index, x below the first entry to 0, above the last to 255, NaN to 0.
SQUEEZE_HD std::uint8_t nf4_nested_code(const float* map, float x) {
  if (!(x == x) || x <= map[0]) return 0;
  if (x > map[255]) return 255;
  int lo = 0, hi = 255;  // map[lo] < x <= map[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (x <= map[mid])
      hi = mid;
    else
      lo = mid;
  }
  const float m = (map[lo] + map[hi]) * 0.5f;
  return std::uint8_t(x > m ? hi : x < m ? lo : (lo % 2 == 0 ? lo : hi));
}

// Raw view of one packed tensor (host or device pointers, matching the launcher).
struct Nf4View {
  const std::uint8_t* codes = nullptr;        // [ceil(n/2)]
  const float* absmax = nullptr;              // [blocks]            (plain; null under DoubleQuant)
  const std::uint8_t* absmax_code = nullptr;  // [blocks]            (DoubleQuant)
  const float* nested_absmax = nullptr;       // [ceil(blocks/256)]  (DoubleQuant)
  const float* nested_map = nullptr;          // [256]               (DoubleQuant)
  const float* absmax_offset = nullptr;       // [1]                 (DoubleQuant)
  std::int64_t n = 0;
  int block = 64;
  bool double_quant = false;
};

// absmax' of a block from its nested code: the product rounded, then the sum (bitsandbytes' dequantize_blockwise,
// then its `+ offset`; never one fused multiply-add, which would round once).
SQUEEZE_HD float nf4_nested_absmax(const float* map, std::uint8_t code, float nested_absmax, float offset) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(__fmul_rn(map[code], nested_absmax), offset);
#else
  const float product = map[code] * nested_absmax;  // host builds do not contract this (no -ffp-contract=fast with FMA)
  return product + offset;
#endif
}
SQUEEZE_HD float nf4_block_absmax(const Nf4View& v, std::int64_t b) {
  return v.double_quant ? nf4_nested_absmax(v.nested_map, v.absmax_code[b], v.nested_absmax[b / kNf4DqBlock], *v.absmax_offset)
                        : v.absmax[b];
}
SQUEEZE_HD std::uint8_t nf4_code_at(const std::uint8_t* codes, std::int64_t i) {
  const std::uint8_t byte = codes[i >> 1];
  return (i & 1) ? std::uint8_t(byte & 15u) : std::uint8_t(byte >> 4);
}
// Value i (the dequantise element functor).
SQUEEZE_HD float nf4_value(const Nf4View& v, std::int64_t i) {
  return nf4_code_value(nf4_code_at(v.codes, i)) * nf4_block_absmax(v, i / v.block);
}
// The code of w in a block of absmax `absmax`: w * (1 / absmax), as bitsandbytes scales it (absmax <= 0 or
// non-finite: code 7).
SQUEEZE_HD std::uint8_t nf4_quantize_element(float w, float absmax) {
  return absmax > 0.f && absmax < INFINITY ? nf4_encode(w * (1.0f / absmax)) : kNf4ZeroCode;
}
// Code byte j of w [n] against the exact block absmax (the encode loops' body on both sides).
template <class T>
SQUEEZE_HD std::uint8_t nf4_code_byte(const T* w, std::int64_t n, int block, const float* absmax, std::int64_t j) {
  const std::int64_t i = 2 * j;
  const std::uint8_t hi = nf4_quantize_element(to_float(w[i]), absmax[i / block]);
  const std::uint8_t lo = i + 1 < n ? nf4_quantize_element(to_float(w[i + 1]), absmax[(i + 1) / block]) : kNf4ZeroCode;
  return std::uint8_t(hi << 4 | lo);
}

inline std::int64_t nf4_blocks(std::int64_t n, int block) { return (n + block - 1) / block; }
inline std::int64_t nf4_dq_groups(std::int64_t blocks) { return (blocks + kNf4DqBlock - 1) / kNf4DqBlock; }
inline std::int64_t nf4_code_bytes(std::int64_t n) { return (n + 1) / 2; }

// Throws squeeze::Error naming what is wrong with a (n, block) pair.
inline void nf4_validate(std::int64_t n, int block, const char* who) {
  check(n > 0, std::string(who) + ": NF4 needs at least one value, got n = " + std::to_string(n));
  check(block >= 2 && (block & (block - 1)) == 0,
        std::string(who) + ": NF4 block size must be a power of two >= 2 (e.g. 64), got " + std::to_string(block));
}
inline void nf4_validate(const Nf4View& v, const char* who) {
  nf4_validate(v.n, v.block, who);
  check(v.codes != nullptr, std::string(who) + ": codes pointer is null");
  if (v.double_quant)
    check(v.absmax_code != nullptr && v.nested_absmax != nullptr && v.nested_map != nullptr && v.absmax_offset != nullptr,
          std::string(who) + ": DoubleQuant absmax_code / nested_absmax / nested_map / offset pointer is null");
  else
    check(v.absmax != nullptr, std::string(who) + ": absmax pointer is null");
}

// ---- CPU launchers ---------------------------------------------------------------------------------------

// out[i] = value i, i < n (host pointers).
template <FloatingElement T>
void nf4_dequantize_cpu(const Nf4View& v, T* out /*[n]*/) {
  nf4_validate(v, "nf4_dequantize_cpu");
  check(out != nullptr, "nf4_dequantize_cpu: output pointer is null");
  cpu::parallel_ranges(v.n, [&](int, std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) out[i] = from_float<T>(nf4_value(v, i));
  });
}

// Block absmax of w (valid values only): absmax[b] = max |w| over block b; a NaN in a block gives NaN.
template <FloatingElement T>
void nf4_absmax_cpu(const T* w, std::int64_t n, int block, float* absmax /*[blocks]*/) {
  const std::int64_t blocks = nf4_blocks(n, block);
  cpu::parallel_ranges(blocks, [&](int, std::int64_t b0, std::int64_t b1) {
    for (std::int64_t b = b0; b < b1; ++b) {
      const std::int64_t end = (b + 1) * block < n ? (b + 1) * block : n;
      float m = 0.f;
      for (std::int64_t i = b * block; i < end; ++i) {
        const float a = std::fabs(to_float(w[i]));
        m = (a > m || a != a) ? a : m;
      }
      absmax[b] = m;
    }
  });
}

// The nested statistics of the exact absmax [blocks] around a given offset, against `map` [256]: nested_absmax
// [ceil(blocks/256)] = max |absmax - offset| per group, absmax_code [blocks].
inline void nf4_nested_quantize_cpu(const float* absmax, std::int64_t blocks, const float* map, float offset, std::uint8_t* absmax_code,
                                    float* nested_absmax) {
  for (std::int64_t g = 0; g < nf4_dq_groups(blocks); ++g) {
    const std::int64_t end = (g + 1) * kNf4DqBlock < blocks ? (g + 1) * kNf4DqBlock : blocks;
    float m = 0.f;
    for (std::int64_t b = g * kNf4DqBlock; b < end; ++b) m = std::fmax(m, std::fabs(absmax[b] - offset));
    nested_absmax[g] = m;
    const float inv = 1.0f / m;  // m == 0: inf, and 0 * inf = NaN takes code 0, as in bitsandbytes
    for (std::int64_t b = g * kNf4DqBlock; b < end; ++b) absmax_code[b] = nf4_nested_code(map, (absmax[b] - offset) * inv);
  }
}

// DoubleQuant of the exact absmax [blocks]: *offset = their mean (summed in float64), then the nested statistics.
inline void nf4_double_quantize_cpu(const float* absmax, std::int64_t blocks, const float* map, std::uint8_t* absmax_code,
                                    float* nested_absmax, float* offset) {
  double sum = 0;
  for (std::int64_t b = 0; b < blocks; ++b) sum += absmax[b];
  *offset = float(sum / double(blocks));
  nf4_nested_quantize_cpu(absmax, blocks, map, *offset, absmax_code, nested_absmax);
}

// Codes of w [n] against the exact block absmax [blocks] (both modes: DoubleQuant compresses absmax afterwards).
template <FloatingElement T>
void nf4_encode_cpu(const T* w, std::int64_t n, int block, const float* absmax, std::uint8_t* codes /*[ceil(n/2)]*/) {
  const std::int64_t bytes = nf4_code_bytes(n);
  cpu::parallel_ranges(bytes, [&](int, std::int64_t j0, std::int64_t j1) {
    for (std::int64_t j = j0; j < j1; ++j) codes[j] = nf4_code_byte(w, n, block, absmax, j);
  });
}

}  // namespace squeeze::kernels::quant
