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
// and of v, encode each value as the nearest code of value / absmax. Zeroed codes and absmax are the zero
// state (absmax 0 decodes every code to 0), so fresh state is memset(0).
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

// The CPU's shortcut to the nearest code: a table indexed by the magnitude's exponent and top 8 mantissa bits
// (buckets 1/256 of an octave wide) gives, per sign, the code below the bucket; one or two compares with the
// midpoints finish the search. Exactly nearest_code's answer (tests check it), ~10x faster on a CPU than 8
// dependent binary-search steps. Magnitudes below 2^-24 share bucket 0 (no midpoint is that small), those
// from 2 up the last bucket.
inline constexpr int kCodeBucketBits = 8;
inline constexpr std::uint32_t kCodeBucketLow = (127u - 24u) << kCodeBucketBits;  // bits of 2^-24, >> (23 - 8)
inline constexpr int kCodeBuckets = 25 * (1 << kCodeBucketBits) + 2;                    // [0, 2^-24), 25 octaves, [2, inf)

// A code map: 256 sorted values in [-1, 1], and the midpoints between neighbours that quantization searches.
struct StateCodeMap {
  float value[kStateCodes];  // ascending, distinct
  float mid[kStateCodes];    // mid[i] = (value[i] + value[i + 1]) / 2; mid[255] = +inf (a sentinel for the CPU search)
  // below[k]: bucket k = [lo, hi) of x >= 0: midpoints < lo; below[kCodeBuckets + k]: x < 0, x in (-hi, -lo]:
  // midpoints <= -hi. Indexed by the sign bit without a branch (random signs would mispredict half the time).
  // int32, not uint8: AVX2 gathers 32-bit lanes.
  std::int32_t below[2 * kCodeBuckets];
};

// Bucket of |x| (bits: x's bit pattern).
SQUEEZE_HD int code_bucket(std::uint32_t bits) {
  const std::int32_t k = std::int32_t((bits & 0x7fffffffu) >> (23 - kCodeBucketBits)) - std::int32_t(kCodeBucketLow) + 1;
  return k < 0 ? 0 : k > kCodeBuckets - 1 ? kCodeBuckets - 1 : k;
}

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
  for (int c = 0; c < kStateCodes; ++c) map.value[c] = float(v[std::size_t(c)]);
  for (int c = 0; c + 1 < kStateCodes; ++c) map.mid[c] = 0.5f * (map.value[c] + map.value[c + 1]);
  map.mid[kStateCodes - 1] = std::numeric_limits<float>::infinity();
  // The bucket table: bucket k covers magnitudes [lo, hi).
  const auto bound = [](int k) -> float {  // lower end of bucket k
    if (k == 0) return 0.0f;
    if (k == kCodeBuckets) return std::numeric_limits<float>::infinity();
    const std::uint32_t bits = (std::uint32_t(k - 1) + kCodeBucketLow) << (23 - kCodeBucketBits);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  };
  for (int k = 0; k < kCodeBuckets; ++k) {
    const float lo = bound(k), hi = bound(k + 1);
    int pos = 0, neg = 0, in_pos = 0, in_neg = 0;
    for (int c = 0; c + 1 < kStateCodes; ++c) {
      const float m = map.mid[c];
      pos += m < lo;
      neg += m <= -hi;
      in_pos += m >= lo && m < hi;
      in_neg += m > -hi && m <= -lo;
    }
    check(in_pos <= 2 && in_neg <= 2, "make_dynamic_map: a code bucket holds more than 2 midpoints");
    map.below[k] = pos;
    map.below[kCodeBuckets + k] = neg;
  }
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

// Nearest code to x (already divided by the block's absmax): the number of midpoints below x (a tie goes to
// the lower code). Branch-free binary search over the 255 sorted midpoints: 8 steps.
SQUEEZE_HD std::uint8_t nearest_code(const float* mid, float x) {
  int lo = 0;
  for (int s = kStateCodes / 2; s >= 1; s >>= 1) lo += (mid[lo + s - 1] < x) ? s : 0;
  return std::uint8_t(lo);
}

// The same code by the bucket table (CPU): at most two midpoints lie in a bucket, so two compares finish.
inline std::uint8_t nearest_code_cpu(const StateCodeMap& map, float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);  // (memcpy here stops g++ vectorising the loops)
  const int k = code_bucket(bits);
  int c = map.below[int(bits >> 31) * kCodeBuckets + k];
  c += map.mid[c] < x ? 1 : 0;
  c += map.mid[c] < x ? 1 : 0;
  return std::uint8_t(c);
}

// The CPU block passes that gather from tables are multiversioned (SQUEEZE_CPU_CLONES, cpu_parallel.hpp: x86-64-v4,
// v3 and the baseline, picked at run time); the AdamW math in them writes its FMAs explicitly, so every clone gives
// the same bits. (Hand-written AVX2 gathers were slower than g++'s code on the EPYC here: 178 vs 221 Mparam/s per core.)
namespace cpu {
// out[j] = nearest_code_cpu(map, x[j] * inv), j < len.
SQUEEZE_CPU_CLONES inline void encode_block(const StateCodeMap& map, const float* __restrict__ x, float inv, int len,
                                            std::uint8_t* __restrict__ out) {
  const std::int32_t* __restrict__ below = map.below;
  const float* __restrict__ mid = map.mid;
  for (int j = 0; j < len; ++j) {  // nearest_code_cpu, spelled out over restrict pointers so g++ vectorises it
    const float y = x[j] * inv;
    const std::uint32_t bits = std::bit_cast<std::uint32_t>(y);
    int c = below[int(bits >> 31) * kCodeBuckets + code_bucket(bits)];
    c += mid[c] < y ? 1 : 0;
    c += mid[c] < y ? 1 : 0;
    out[j] = std::uint8_t(c);
  }
}
// out[j] = map.value[codes[j]] * scale, j < len.
SQUEEZE_CPU_CLONES inline void decode_block(const StateCodeMap& map, const std::uint8_t* __restrict__ codes, float scale,
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
  P* param = nullptr;                    // [n]
  float* master = nullptr;               // [n] or null
  const G* grad = nullptr;               // [n]
  std::uint8_t* exp_avg = nullptr;       // [n] m codes (signed map)
  float* exp_avg_absmax = nullptr;       // [state_blocks(n)]
  std::uint8_t* exp_avg_sq = nullptr;    // [n] v codes (unsigned map)
  float* exp_avg_sq_absmax = nullptr;    // [state_blocks(n)]
  std::int64_t n = 0;
};

template <class P, class G>
void validate(const AdamW8Tensor<P, G>& t, const std::string& what = "AdamW8 tensor") {
  if (!validate_weights(t.n, t.param, t.master, t.grad, what)) return;
  check(t.exp_avg != nullptr && t.exp_avg_sq != nullptr, what + ": exp_avg / exp_avg_sq (m, v codes) pointer is null");
  check(t.exp_avg_absmax != nullptr && t.exp_avg_sq_absmax != nullptr,
        what + ": exp_avg_absmax / exp_avg_sq_absmax (block scales) pointer is null");
}

// ---- CPU launcher ---------------------------------------------------------------------------------------
namespace cpu {

// State block b of tensor t, in three passes over the block so the middle one (the AdamW math) vectorises
// like adamw_range: decode (table gathers) and read the gradient, update + absmax, encode (bucket table).
// grad may be param's own buffer (Offload<Host> stages the rounded 16-bit parameters over the gradient):
// the block's gradient is read whole before any parameter is written.
template <class P, class G>
SQUEEZE_CPU_CLONES void adamw8_block(const AdamW8Tensor<P, G>& t, std::int64_t b, const AdamWScalars& s,
                                     const StateCodeMap& mmap, const StateCodeMap& vmap) {
  const std::int64_t lo = b * kStateBlock;
  const int len = int(std::min(kStateBlock, t.n - lo));
  float* __restrict__ w = (std::is_same_v<P, float> ? reinterpret_cast<float*>(t.param) : t.master) + lo;
  P* __restrict__ param = t.param + lo;
  const G* g = t.grad + lo;
  std::uint8_t* __restrict__ mc = t.exp_avg + lo;
  std::uint8_t* __restrict__ vc = t.exp_avg_sq + lo;
  const float m_scale = t.exp_avg_absmax[b], v_scale = t.exp_avg_sq_absmax[b];
  alignas(64) float m[kStateBlock], v[kStateBlock], gf[kStateBlock];
  for (int j = 0; j < len; ++j) gf[j] = to_float(g[j]);
  decode_block(mmap, mc, m_scale, len, m);
  decode_block(vmap, vc, v_scale, len, v);
  float m_max = 0.0f, v_max = 0.0f;  // (a > b ? a : b, not fmaxf: g++ calls libm's fmaxf and stops vectorising)
#pragma omp simd reduction(max : m_max, v_max)
  for (int j = 0; j < len; ++j) {
    float wj = w[j];
    adamw_element(wj, m[j], v[j], gf[j], s);
    w[j] = wj;
    if constexpr (!std::is_same_v<P, float>) param[j] = from_float<P>(wj);
    const float am = fabsf(m[j]), av = fabsf(v[j]);
    m_max = am > m_max ? am : m_max;
    v_max = av > v_max ? av : v_max;
  }
  const float m_inv = inverse_absmax(m_max), v_inv = inverse_absmax(v_max);
  encode_block(mmap, m, m_inv, len, mc);
  encode_block(vmap, v, v_inv, len, vc);
  t.exp_avg_absmax[b] = m_max;
  t.exp_avg_sq_absmax[b] = v_max;
}

}  // namespace cpu

// AdamW over a list of host tensors with 8-bit state, all cores (whole state blocks per thread).
// Dynamic values are host pointers. A skipped step (found_inf) touches nothing.
template <class P, class G>
void adamw8_cpu(std::span<const AdamW8Tensor<P, G>> tensors, const AdamWCoeffs& c, const AdamWDynamic& d = {}) {
  for (std::size_t i = 0; i < tensors.size(); ++i) validate(tensors[i], "AdamW8 (CPU) tensor " + std::to_string(i));
  const AdamWScalars s = adamw_scalars(c, d);
  if (s.skip) return;
  const StateCodeMap& mmap = signed_state_map();
  const StateCodeMap& vmap = unsigned_state_map();
  for (const auto& t : tensors) {
    // Whole state blocks, handed out in pieces of cpu::kPiece elements (blocks are independent: any split, same bits).
    cpu::parallel_pieces(state_blocks(t.n), cpu::kPiece / kStateBlock, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t k = b; k < e; ++k) cpu::adamw8_block(t, k, s, mmap, vmap);
    });
  }
}

template <class P, class G>
void adamw8_cpu(const AdamW8Tensor<P, G>& t, const AdamWCoeffs& c, const AdamWDynamic& d = {}) {
  adamw8_cpu(std::span<const AdamW8Tensor<P, G>>(&t, 1), c, d);
}

}  // namespace squeeze::kernels
