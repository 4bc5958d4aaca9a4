#pragma once
// NF4 (4-bit NormalFloat, QLoRA paper, Dettmers et al. 2023): element math + CPU launchers.
// The CUDA launchers are in nf4.cuh and apply the same functions, so the CPU twin checks the GPU math.
//
// Layout of one packed tensor of n values (flattened row-major), block size B (Group<G>, default 64):
//   codes   uint8 [ceil(n/2)]   two 4-bit code indices per byte: value 2j in the HIGH nibble, value 2j+1
//                               in the LOW nibble (the bitsandbytes order); a padding nibble (odd n) is
//                               code 7 (exactly 0).
//   plain:        absmax     float [blocks]                 blocks = ceil(n/B); the last block may be short
//   DoubleQuant:  absmax_q   int8  [blocks]                 absmax' = absmax_q * scale[b / 256] + offset
//                 scale      float [ceil(blocks/256)]       (fmaf, so host and device agree bit for bit)
//                 offset     float (one)                    offset = mean of all block absmax values
//     i.e. the absmax values minus their mean, symmetric 8-bit (round to nearest, [-127, 127]) with one fp32
//     scale = max|absmax - mean| / 127 per 256 consecutive blocks.
//   value i = kNf4Codes[code_i] * absmax'(i / B)
// Quantisation: block absmax (over the valid values of the block); under DoubleQuant the absmax values are
// compressed first and the codes are chosen against the DEQUANTISED absmax' the decoder will use; each value
// goes to the nearest code of w / absmax' (clamped to [-1, 1]). Nearest: the count of code midpoints below x.
#include <cmath>
#include <cstdint>
#include <string>

#include <squeeze/dtype.hpp>
#include <squeeze/error.hpp>

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

// Nearest code index of x in [-1, 1] (values outside clamp to the ends; NaN goes to 0 = code 7).
SQUEEZE_HD std::uint8_t nf4_encode(float x) {
  if (!(x == x)) return kNf4ZeroCode;
  int c = 0;
#pragma unroll
  for (int k = 0; k < 15; ++k) c += x > 0.5f * (nf4_code_value(k) + nf4_code_value(k + 1)) ? 1 : 0;
  return std::uint8_t(c);
}

// Raw view of one packed tensor (host or device pointers, matching the launcher).
struct Nf4View {
  const std::uint8_t* codes = nullptr;  // [ceil(n/2)]
  const float* absmax = nullptr;        // [blocks]                (plain; null under DoubleQuant)
  const std::int8_t* absmax_q = nullptr;// [blocks]                (DoubleQuant)
  const float* absmax_scale = nullptr;  // [ceil(blocks/256)]      (DoubleQuant)
  float absmax_offset = 0.f;            //                         (DoubleQuant)
  std::int64_t n = 0;
  int block = 64;
  bool double_quant = false;
};

// absmax' of block b as the decoder sees it.
SQUEEZE_HD float nf4_dq_absmax(std::int8_t q, float scale, float offset) { return fmaf(float(q), scale, offset); }
SQUEEZE_HD float nf4_block_absmax(const Nf4View& v, std::int64_t b) {
  return v.double_quant ? nf4_dq_absmax(v.absmax_q[b], v.absmax_scale[b / kNf4DqBlock], v.absmax_offset) : v.absmax[b];
}
SQUEEZE_HD std::uint8_t nf4_code_at(const std::uint8_t* codes, std::int64_t i) {
  const std::uint8_t byte = codes[i >> 1];
  return (i & 1) ? std::uint8_t(byte & 15u) : std::uint8_t(byte >> 4);
}
// Value i (the dequantise element functor).
SQUEEZE_HD float nf4_value(const Nf4View& v, std::int64_t i) {
  return nf4_code_value(nf4_code_at(v.codes, i)) * nf4_block_absmax(v, i / v.block);
}
// The code of w in a block whose decoder scale is absmax (absmax <= 0 or non-finite: everything -> 0).
SQUEEZE_HD std::uint8_t nf4_quantize_element(float w, float absmax) {
  return absmax > 0.f && absmax < INFINITY ? nf4_encode(w / absmax) : kNf4ZeroCode;
}
// DoubleQuant of one absmax value given its 256-block's scale and the mean (scale 0: every q is 0).
SQUEEZE_HD std::int8_t nf4_dq_encode(float absmax, float scale, float offset) {
  if (!(scale > 0.f)) return 0;
  float q = rintf((absmax - offset) / scale);
  q = q > 127.f ? 127.f : q < -127.f ? -127.f : q;
  return std::int8_t(q);
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
    check(v.absmax_q != nullptr && v.absmax_scale != nullptr, std::string(who) + ": DoubleQuant absmax_q / scale pointer is null");
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

// DoubleQuant of absmax [blocks] into absmax_q [blocks], scale [groups], *offset. Mean in float64.
inline void nf4_double_quantize_cpu(const float* absmax, std::int64_t blocks, std::int8_t* absmax_q, float* scale, float* offset) {
  double sum = 0;
  for (std::int64_t b = 0; b < blocks; ++b) sum += absmax[b];
  const float mean = float(sum / double(blocks));
  *offset = mean;
  for (std::int64_t g = 0; g < nf4_dq_groups(blocks); ++g) {
    const std::int64_t end = (g + 1) * kNf4DqBlock < blocks ? (g + 1) * kNf4DqBlock : blocks;
    float m = 0.f;
    for (std::int64_t b = g * kNf4DqBlock; b < end; ++b) m = std::fmax(m, std::fabs(absmax[b] - mean));
    scale[g] = m / 127.f;
    for (std::int64_t b = g * kNf4DqBlock; b < end; ++b) absmax_q[b] = nf4_dq_encode(absmax[b], scale[g], mean);
  }
}

// Codes of w given the decoder's block scales (v.absmax or v.absmax_q/scale/offset already filled):
// writes codes [ceil(n/2)] (v.codes is ignored; codes is the output).
template <FloatingElement T>
void nf4_encode_cpu(const Nf4View& v, const T* w, std::uint8_t* codes) {
  const std::int64_t bytes = nf4_code_bytes(v.n);
  cpu::parallel_ranges(bytes, [&](int, std::int64_t j0, std::int64_t j1) {
    for (std::int64_t j = j0; j < j1; ++j) {
      const std::int64_t i = 2 * j;
      const std::uint8_t hi = nf4_quantize_element(to_float(w[i]), nf4_block_absmax(v, i / v.block));
      const std::uint8_t lo = i + 1 < v.n ? nf4_quantize_element(to_float(w[i + 1]), nf4_block_absmax(v, (i + 1) / v.block)) : kNf4ZeroCode;
      codes[j] = std::uint8_t(hi << 4 | lo);
    }
  });
}

}  // namespace squeeze::kernels::quant
