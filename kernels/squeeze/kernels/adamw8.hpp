#pragma once
// AdamW with 8-bit block-wise quantized moments (Dettmers et al., "8-bit Optimizers via Block-wise
// Quantization"): the code maps, the block update and its CPU launcher. The CUDA launcher is in adamw8.cuh.
// Plain C++: Offload<Host> runs the CPU launcher for real; the GPU kernel is tested against it.
//
// State of one moment over a tensor of n elements:
//   codes  [n]                       uint8, an index into a 256-entry code map
//   absmax [ceil(n / kStateBlock)]   float, the largest |value| of the block (blocks never straddle tensors)
//   value  = map[code] * absmax[i / kStateBlock]
// m uses the signed "dynamic" map, v (never negative) the unsigned one, which spends all 8 bits on magnitude.
//
// The update of one block (256 elements): decode m and v, run adamw_element (adamw.hpp: the same fp32
// math, gradient unscale/clip and found_inf skip as the fp32-state AdamW), take the block's new absmax of m
// and of v, encode each value as the nearest code of value / absmax (nearest_code: the count of midpoints below it,
// computed as bucket_code by one table read on the CPU and the GPU). Zeroed codes and absmax are the zero state
// (absmax 0 decodes every code to 0), so fresh state is memset(0).
//
// Bytes per parameter (bf16 param + fp32 master, bf16 grad): read master 4, grad 2, m 1, v 1; write master 4,
// m 1, v 1, param 2: 16 (+ 16 bytes of absmax per 256), against 28 with fp32 moments.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "squeeze/kernels/adamw.hpp"
#include "squeeze/kernels/cpu_parallel.hpp"
#include "squeeze/kernels/tensor_list.hpp"

namespace squeeze::kernels {

inline constexpr std::int64_t kStateBlock = 256;  // elements per absmax
inline constexpr int kStateCodes = 256;
SQUEEZE_HD constexpr std::int64_t state_blocks(std::int64_t n) { return (n + kStateBlock - 1) / kStateBlock; }

// The encoder's shortcut to the nearest code (CPU and GPU alike): a bucket per value of the top 16 bits of |x| (sign,
// exponent, 7 mantissa bits) over [2^-24, 1], smaller magnitudes in the first bucket, larger ones in the last. No
// bucket holds two midpoints (make_dynamic_map checks it), so a bucket's entry says how many midpoints lie below it and,
// if one lies inside, its low 16 bits: one table read and integer arithmetic give nearest_code's answer exactly
// (bucket_code; tests compare the two on every float).
inline constexpr int kBucketKeyLo = 103 << 7;  // bits of 2^-24 >> 16
inline constexpr int kBucketKeyHi = 127 << 7;  // bits of 1.0f >> 16
inline constexpr int kCodeBuckets = kBucketKeyHi - kBucketKeyLo + 1;

// A code map: 256 sorted values in [-1, 1], the midpoints between neighbours (the nearest-code rule) and the tables
// derived from them.
struct StateCodeMap {
  float value[kStateCodes];  // ascending, distinct
  float mid[kStateCodes];    // mid[i] = (value[i] + value[i + 1]) / 2; mid[255] = +inf (never read by the rule)
  // bucket_entry for each bucket: (positive midpoints below it) << 16 | (0xffff - low 16 bits of the one inside, or 0).
  std::int32_t bucket[kCodeBuckets];
  std::uint8_t value_bytes[4][kStateCodes];  // byte b of value[c]: the AVX-512 decoder's four 256-byte tables
  bool is_signed;
};

SQUEEZE_HD std::uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return std::bit_cast<std::uint32_t>(x);
#endif
}
SQUEEZE_HD float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

// The nearest code to x (already divided by the block's absmax): the number of midpoints below x, so a tie goes to
// the lower code and NaN to code 0. This is the rule's definition; bucket_code computes the same faster.
SQUEEZE_HD std::uint8_t nearest_code(const float* mid, float x) {
  int lo = 0;
  for (int s = kStateCodes / 2; s >= 1; s >>= 1) lo += (mid[lo + s - 1] < x) ? s : 0;
  return std::uint8_t(lo);
}

// Entry of bucket key (kBucketKeyLo..kBucketKeyHi) from the midpoints, by nearest_code (the host's map and the GPU's
// shared-memory copy are built by this one function). Signed maps count only their positive midpoints (127..254):
// the negative ones mirror them (mid[j] = -mid[253 - j] exactly, as value[] is symmetric but for 1).
SQUEEZE_HD std::int32_t bucket_entry(const float* mid, int key, bool is_signed) {
  const float lo = key == kBucketKeyLo ? 0.0f : bits_float(std::uint32_t(key) << 16);
  const float hi = bits_float(std::uint32_t(key + 1) << 16);
  const int first = is_signed ? 127 : 0;                                            // midpoints of negative values lie below any bucket
  const int below = int(nearest_code(mid, lo)), upto = int(nearest_code(mid, hi));  // midpoints < lo, < hi
  const std::int32_t inside = upto > below ? std::int32_t(0xffff - (float_bits(mid[below]) & 0xffffu)) : 0;
  return std::int32_t(below - first) << 16 | inside;
}

// The nearest code to y by the bucket table: nearest_code's answer for every float (NaN, infinities, |y| > 1 included).
// x = |y| past the bucket's lower end by its low 16 bits; adding them to 0xffff - low16(mid) carries exactly when x > mid.
// Negative y counts midpoints <= x (x's successor's count): by the mirror, code = 127 - that.
SQUEEZE_HD int bucket_code(const std::int32_t* bucket, float y, bool is_signed) {
  std::uint32_t bits = float_bits(y);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0;  // NaN
  if (is_signed) {
    const std::uint32_t neg = bits >> 31;
    bits = (bits & 0x7fffffffu) + neg;
    const int key = int(bits >> 16);
    const int c =
        (bucket[(key < kBucketKeyHi ? (key > kBucketKeyLo ? key : kBucketKeyLo) : kBucketKeyHi) - kBucketKeyLo] + int(bits & 0xffffu)) >>
        16;
    return neg ? (127 - c > 0 ? 127 - c : 0) : 127 + c;
  }
  const int key = std::int32_t(bits) >> 16;  // negative y: below the first bucket
  return (bucket[(key < kBucketKeyHi ? (key > kBucketKeyLo ? key : kBucketKeyLo) : kBucketKeyHi) - kBucketKeyLo] + int(bits & 0xffffu)) >>
         16;
}

// bucket_code's answer for every float, spelled without a branch: the NaN test and the sign's two formulas become
// selects (a NaN still reads a valid, clamped bucket, then gives 0). The GPU's branch-free shapes (adamw8.cuh) encode
// with it so a warp's lanes never split on a value; tests compare it with bucket_code and nearest_code.
SQUEEZE_HD int bucket_code_branch_free(const std::int32_t* bucket, float y, bool is_signed) {
  const std::uint32_t bits = float_bits(y);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  int code;
  if (is_signed) {
    const std::uint32_t neg = bits >> 31;
    const std::uint32_t mag = (bits & 0x7fffffffu) + neg;  // -NaN's 0x7fffffff + 1 still clamps to the last bucket
    const int key = int(mag >> 16);
    const int c =
        (bucket[(key < kBucketKeyHi ? (key > kBucketKeyLo ? key : kBucketKeyLo) : kBucketKeyHi) - kBucketKeyLo] + int(mag & 0xffffu)) >> 16;
    const int below = 127 - c;
    code = neg ? (below > 0 ? below : 0) : 127 + c;
  } else {
    const int key = std::int32_t(bits) >> 16;
    code = (bucket[(key < kBucketKeyHi ? (key > kBucketKeyLo ? key : kBucketKeyLo) : kBucketKeyHi) - kBucketKeyLo] + int(bits & 0xffffu)) >>
           16;
  }
  return nan ? 0 : code;
}

// The codes whose value is exactly 0 (make_dynamic_map checks them): padding lanes of a partial state block hold
// them, so they decode to 0 (or NaN for an infinite scale) and never raise the block's absmax.
inline constexpr std::uint8_t kZeroCodeSigned = 127, kZeroCodeUnsigned = 0;

// The "dynamic" (dynamic-exponent) map. For exponent level i = 0..6 the midpoints of equally spaced points in
// [0.1, 1] (2^i + 1 points signed, 2^(i+1) + 1 unsigned), scaled by 10^(i-6); the signed map takes them with
// both signs. Plus 0 and 1: 2 * 127 + 2 = 256 values signed, 254 + 2 unsigned. Each level covers a decade,
// with more codes the larger the magnitude, so the relative error stays bounded over 7 orders of magnitude.
inline StateCodeMap make_dynamic_map(bool is_signed) {
  std::vector<double> v;
  v.reserve(kStateCodes);
  for (int i = 0; i <= 6; ++i) {
    const int mids = is_signed ? (1 << i) : (1 << (i + 1));
    const double scale = std::pow(10.0, double(i - 6));
    const double step = 0.9 / mids;  // mids + 1 points from 0.1 to 1
    for (int k = 0; k < mids; ++k) {
      const double mid = (0.1 + step * k + 0.1 + step * (k + 1)) / 2;
      v.push_back(mid * scale);
      if (is_signed) v.push_back(-mid * scale);
    }
  }
  v.push_back(0.0);
  v.push_back(1.0);
  std::sort(v.begin(), v.end());
  check(v.size() == std::size_t(kStateCodes), "make_dynamic_map: built " + std::to_string(v.size()) + " values, not 256");
  StateCodeMap map{};
  map.is_signed = is_signed;
  for (int c = 0; c < kStateCodes; ++c) map.value[c] = float(v[std::size_t(c)]);
  for (int c = 0; c + 1 < kStateCodes; ++c) map.mid[c] = 0.5f * (map.value[c] + map.value[c + 1]);
  map.mid[kStateCodes - 1] = std::numeric_limits<float>::infinity();
  for (int c = 0; c < kStateCodes; ++c)
    for (int b = 0; b < 4; ++b) map.value_bytes[b][c] = std::uint8_t(std::bit_cast<std::uint32_t>(map.value[c]) >> (8 * b));
  // The bucket rule's premises: one midpoint per bucket at most, none in the first and last buckets (the clamped
  // magnitudes below 2^-24 and from 1 on share them) and, for the signed map, the mirror.
  for (int key = kBucketKeyLo; key <= kBucketKeyHi; ++key) {
    const float lo = key == kBucketKeyLo ? 0.0f : bits_float(std::uint32_t(key) << 16);
    const float hi = bits_float(std::uint32_t(key + 1) << 16);
    int inside = 0;
    for (int c = 0; c + 1 < kStateCodes; ++c) inside += map.mid[c] >= lo && map.mid[c] < hi;
    check(inside <= 1, "make_dynamic_map: a code bucket holds more than one midpoint");
    check(inside == 0 || (key != kBucketKeyLo && key != kBucketKeyHi), "make_dynamic_map: a midpoint in a clamped bucket");
    map.bucket[key - kBucketKeyLo] = bucket_entry(map.mid, key, is_signed);
  }
  if (is_signed)
    for (int j = 0; j < 127; ++j) check(map.mid[j] == -map.mid[253 - j], "make_dynamic_map: the signed map's midpoints are not symmetric");
  check(map.value[is_signed ? kZeroCodeSigned : kZeroCodeUnsigned] == 0.0f, "make_dynamic_map: the zero code does not decode to 0");
  return map;
}

// The maps of the two moments, built once.
inline const StateCodeMap& signed_state_map() {
  static const StateCodeMap m = make_dynamic_map(true);
  return m;
}
inline const StateCodeMap& unsigned_state_map() {
  static const StateCodeMap m = make_dynamic_map(false);
  return m;
}

// The CPU block passes are multiversioned (SQUEEZE_CPU_CLONES, cpu_parallel.hpp: x86-64-v4, v3 and the baseline,
// picked at run time); the AdamW math in them writes its FMAs explicitly, so every clone gives the same bits. On
// CPUs with AVX-512 VBMI adamw8_cpu runs the hand-vectorised block of adamw8_avx512.hpp instead (same bits).
// g++ vectorises the two table loops below with its gathers emulated lane by lane (its generic tuning avoids vpgather),
// which runs slower than the scalar loops (179 against 131 M params/s per core for the whole update here).
#if defined(__GNUC__) && !defined(__clang__)
#define SQUEEZE_CPU_SCALAR __attribute__((optimize("no-tree-vectorize")))
#else
#define SQUEEZE_CPU_SCALAR
#endif

namespace cpu {
// out[j] = bucket_code(map, x[j] * inv), j < len, spelled out over restrict pointers.
SQUEEZE_CPU_SCALAR SQUEEZE_CPU_CLONES inline void encode_block(const StateCodeMap& map, const float* __restrict__ x, float inv, int len,
                                                               std::uint8_t* __restrict__ out) {
  const std::int32_t* __restrict__ bucket = map.bucket;
  if (map.is_signed) {
    for (int j = 0; j < len; ++j) {
      std::uint32_t bits = std::bit_cast<std::uint32_t>(x[j] * inv);
      const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
      const std::uint32_t neg = bits >> 31;
      bits = (bits & 0x7fffffffu) + neg;
      int key = int(bits >> 16);
      key = key < kBucketKeyHi ? (key > kBucketKeyLo ? key : kBucketKeyLo) : kBucketKeyHi;
      const int c = (bucket[key - kBucketKeyLo] + int(bits & 0xffffu)) >> 16;
      // 127 + c, or max(127 - c, 0) for negative values, and 0 for NaN: arithmetic, not branches (random signs).
      const int sign = -int(neg);
      int code = 127 + ((c ^ sign) - sign);
      code &= ~(code >> 31);
      out[j] = std::uint8_t(code & -int(!nan));
    }
  } else {
    for (int j = 0; j < len; ++j) {
      const std::uint32_t bits = std::bit_cast<std::uint32_t>(x[j] * inv);
      const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
      int key = std::int32_t(bits) >> 16;
      key = key < kBucketKeyHi ? (key > kBucketKeyLo ? key : kBucketKeyLo) : kBucketKeyHi;
      const int code = (bucket[key - kBucketKeyLo] + int(bits & 0xffffu)) >> 16;
      out[j] = std::uint8_t(code & -int(!nan));
    }
  }
}
// out[j] = map.value[codes[j]] * scale, j < len.
SQUEEZE_CPU_SCALAR SQUEEZE_CPU_CLONES inline void decode_block(const StateCodeMap& map, const std::uint8_t* __restrict__ codes, float scale,
                                                               int len, float* __restrict__ out) {
  for (int j = 0; j < len; ++j) out[j] = map.value[codes[j]] * scale;
}
}  // namespace cpu

// 1 / absmax, or 0 for an all-zero block (every value then encodes as the code of 0).
SQUEEZE_HD float inverse_absmax(float absmax) { return absmax > 0.0f ? 1.0f / absmax : 0.0f; }

// Block-wise quantization of a plain array (tests, checkpoint conversion): x [n] -> codes [n], absmax [blocks].
inline void quantize_blockwise(const StateCodeMap& map, const float* x, std::int64_t n, std::uint8_t* codes, float* absmax) {
  for (std::int64_t b = 0; b < state_blocks(n); ++b) {
    const std::int64_t lo = b * kStateBlock, hi = std::min(n, lo + kStateBlock);
    float a = 0.0f;
    for (std::int64_t i = lo; i < hi; ++i) a = fabsf(x[i]) > a ? fabsf(x[i]) : a;
    cpu::encode_block(map, x + lo, inverse_absmax(a), int(hi - lo), codes + lo);
    absmax[b] = a;
  }
}
inline void dequantize_blockwise(const StateCodeMap& map, const std::uint8_t* codes, const float* absmax, std::int64_t n, float* x) {
  for (std::int64_t i = 0; i < n; ++i) x[i] = map.value[codes[i]] * absmax[i / kStateBlock];
}

// One tensor's buffers. For float params master is null (the param is its own master); otherwise master
// holds the fp32 weights and param receives their rounded copy (as AdamWTensor).
template <class P, class G>
struct AdamW8Tensor {
  P* param = nullptr;                  // [n]
  float* master = nullptr;             // [n] or null
  const G* grad = nullptr;             // [n]
  std::uint8_t* exp_avg = nullptr;     // [n] m codes (signed map)
  float* exp_avg_absmax = nullptr;     // [state_blocks(n)]
  std::uint8_t* exp_avg_sq = nullptr;  // [n] v codes (unsigned map)
  float* exp_avg_sq_absmax = nullptr;  // [state_blocks(n)]
  std::int64_t n = 0;
  std::uint64_t rounding_index = 0;  // no master (bf16, CPU): element 0's index in its stochastic-rounding stream
};

template <class P, class G>
void validate(const AdamW8Tensor<P, G>& t, const std::string& what = "AdamW8 tensor", bool own_master = false) {
  if (!validate_weights(t.n, t.param, t.master, t.grad, what, own_master)) return;
  check(t.exp_avg != nullptr && t.exp_avg_sq != nullptr, what + ": exp_avg / exp_avg_sq (m, v codes) pointer is null");
  check(t.exp_avg_absmax != nullptr && t.exp_avg_sq_absmax != nullptr,
        what + ": exp_avg_absmax / exp_avg_sq_absmax (block scales) pointer is null");
}

// ---- CPU launcher ---------------------------------------------------------------------------------------
#if defined(__GNUC__)
#define SQUEEZE_CPU_INLINE inline __attribute__((always_inline))
#else
#define SQUEEZE_CPU_INLINE inline
#endif

namespace cpu {

// from_float<P>, spelled so that g++ vectorises it in 16 lanes for bf16 (round to nearest even; NaN as from_float
// gives it: CUDA's 0x7fff with the toolkit's types, else the quiet NaN of dtype.hpp); other types are from_float's.
template <class P>
SQUEEZE_CPU_INLINE P round_param(float w) {
  if constexpr (std::is_same_v<P, bf16>) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(w);
#if SQUEEZE_CUDA_TYPES
    const std::uint32_t nan_bits = 0x7fffu;
#else
    const std::uint32_t nan_bits = (u >> 16) | 0x40u;
#endif
    const std::uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return std::bit_cast<bf16>(std::uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan_bits : r));
  } else {
    return from_float<P>(w);
  }
}

// The AdamW pass of a block: gf [len] the widened gradient, m, v [len] decoded; updates w (and param), leaves the new
// m, v in place and their largest magnitudes in m_max, v_max. The float loop vectorises like adamw_range; the
// rounded copy is a second loop over the block (in L1), so the float loop keeps the full vector width.
template <class P>
SQUEEZE_CPU_INLINE void adamw8_block_math(float* __restrict__ w, P* __restrict__ param, float* __restrict__ m, float* __restrict__ v,
                                          const float* __restrict__ gf, int len, const AdamWScalars& s, float& m_max_out,
                                          float& v_max_out) {
  float m_max = 0.0f, v_max = 0.0f;  // (a > b ? a : b, not fmaxf: g++ calls libm's fmaxf and stops vectorising)
#pragma omp simd reduction(max : m_max, v_max)
  for (int j = 0; j < len; ++j) {
    float wj = w[j];
    adamw_element(wj, m[j], v[j], gf[j], s);
    w[j] = wj;
    const float am = fabsf(m[j]), av = fabsf(v[j]);
    m_max = am > m_max ? am : m_max;
    v_max = av > v_max ? av : v_max;
  }
  if constexpr (!std::is_same_v<P, float>)
    for (int j = 0; j < len; ++j) param[j] = round_param<P>(w[j]);
  m_max_out = m_max;
  v_max_out = v_max;
}

// State block b of tensor t, in three passes over the block so the middle one (the AdamW math) vectorises
// like adamw_range: decode (value table) and read the gradient, update + absmax, encode (bucket table).
// grad may be param's own buffer (Offload<Host> stages the rounded 16-bit parameters over the gradient):
// the block's gradient is read whole before any parameter is written.
template <class P, class G>
SQUEEZE_CPU_CLONES void adamw8_block(const AdamW8Tensor<P, G>& t, std::int64_t b, const AdamWScalars& s, const StateCodeMap& mmap,
                                     const StateCodeMap& vmap) {
  const std::int64_t lo = b * kStateBlock;
  const int len = int(std::min(kStateBlock, t.n - lo));
  alignas(64) float m[kStateBlock], v[kStateBlock], gf[kStateBlock], own[kStateBlock];
  const bool own_master = !std::is_same_v<P, float> && t.master == nullptr;  // bf16, its own master: rounded stochastically
  float* w = own_master ? own : (std::is_same_v<P, float> ? reinterpret_cast<float*>(t.param) : t.master) + lo;
  if (own_master)
    for (int j = 0; j < len; ++j) own[j] = to_float(t.param[lo + j]);
  const G* g = t.grad + lo;
  for (int j = 0; j < len; ++j) gf[j] = to_float(g[j]);
  decode_block(mmap, t.exp_avg + lo, t.exp_avg_absmax[b], len, m);
  decode_block(vmap, t.exp_avg_sq + lo, t.exp_avg_sq_absmax[b], len, v);
  float m_max, v_max;
  adamw8_block_math(w, t.param + lo, m, v, gf, len, s, m_max, v_max);
  if constexpr (std::is_same_v<P, bf16>)
    if (own_master)  // over the nearest rounding adamw8_block_math wrote
      round_stochastic_run(w, t.param + lo, len, s.rounding_seed, t.rounding_index + std::uint64_t(lo));
  encode_block(mmap, m, inverse_absmax(m_max), len, t.exp_avg + lo);
  encode_block(vmap, v, inverse_absmax(v_max), len, t.exp_avg_sq + lo);
  t.exp_avg_absmax[b] = m_max;
  t.exp_avg_sq_absmax[b] = v_max;
}

}  // namespace cpu

}  // namespace squeeze::kernels

#include "squeeze/kernels/adamw8_avx512.hpp"

namespace squeeze::kernels {

// AdamW over a list of host tensors with 8-bit state, all cores (whole state blocks per thread).
// Dynamic values are host pointers. A skipped step (found_inf) touches nothing.
template <class P, class G>
void adamw8_cpu(std::span<const AdamW8Tensor<P, G>> tensors, const AdamWCoeffs& c, const AdamWDynamic& d = {}) {
  for (std::size_t i = 0; i < tensors.size(); ++i) validate(tensors[i], "AdamW8 (CPU) tensor " + std::to_string(i), /*own_master=*/true);
  const AdamWScalars s = adamw_scalars(c, d);
  if (s.skip) return;
  const StateCodeMap& mmap = signed_state_map();
  const StateCodeMap& vmap = unsigned_state_map();
  const bool avx512 = cpu::avx512::codec_available();
  for (const auto& t : tensors) {
    // Whole state blocks, handed out in pieces of cpu::kPiece elements (blocks are independent: any split, same bits).
    cpu::parallel_pieces(state_blocks(t.n), cpu::kPiece / kStateBlock, [&](std::int64_t b, std::int64_t e) {
      if (avx512)
        cpu::avx512::adamw8_blocks(t, b, e, s, mmap, vmap);
      else
        for (std::int64_t k = b; k < e; ++k) cpu::adamw8_block(t, k, s, mmap, vmap);
    });
  }
}

template <class P, class G>
void adamw8_cpu(const AdamW8Tensor<P, G>& t, const AdamWCoeffs& c, const AdamWDynamic& d = {}) {
  adamw8_cpu(std::span<const AdamW8Tensor<P, G>>(&t, 1), c, d);
}

}  // namespace squeeze::kernels
