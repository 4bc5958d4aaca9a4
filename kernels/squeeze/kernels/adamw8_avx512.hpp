#pragma once
// The CPU block update of 8-bit AdamW by AVX-512 intrinsics (F, BW, DQ, VL, VBMI: Ice Lake, Sapphire Rapids, Zen 4
// and later), picked at run time by adamw8_cpu; other CPUs run the generic clones of adamw8.hpp. Same bits as those:
// the codes come from the same bucket table by the same integer rule (kernels::bucket_code), the values from the same
// map, and the AdamW math is adamw8.hpp's own loop, compiled here for 16 lanes.
// Part of adamw8.hpp (it includes this file after the maps, AdamW8Tensor and the block math); not for direct use.
//
// Decode, 64 codes at a time without gathers: each of a value's four bytes comes from two 128-byte permutes (VBMI's
// vpermi2b over the map's byte planes) and a blend on the code's top bit; byte unpacks assemble the floats. The codes
// are permuted first so that the unpacks' in-lane interleaving leaves the floats in order.
// Encode, 16 values at a time: one 32-bit gather from the bucket table (12 KB, stays in L1) and integer arithmetic.
// Several times the generic clones' block rate, which need a gather per value and per table (measured: docs/results.md,
// Fused AdamW, the CPU update).
#include <atomic>
#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(SQUEEZE_NO_AVX512_CODEC)
#define SQUEEZE_AVX512_CODEC 1
#include <immintrin.h>
#if defined(__clang__)
#define SQUEEZE_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx512vbmi")))
#else
// prefer-vector-width=512: the math loop in 16 lanes (g++ picks 8 for x86-64-v4 code by default).
#define SQUEEZE_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx512vbmi,prefer-vector-width=512")))
#endif
#else
#define SQUEEZE_AVX512_CODEC 0
#endif

namespace squeeze::kernels::cpu::avx512 {

#if SQUEEZE_AVX512_CODEC
inline bool cpu_has_codec() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi");
}
#else
inline bool cpu_has_codec() { return false; }
#endif

inline std::atomic<bool>& codec_switch() {
  static std::atomic<bool> on{cpu_has_codec()};
  return on;
}
// Whether adamw8_cpu takes this path. use_codec(false) makes it run the generic clones (tests compare the two).
inline bool codec_available() { return codec_switch().load(std::memory_order_relaxed); }
inline void use_codec(bool on) { codec_switch().store(on && cpu_has_codec(), std::memory_order_relaxed); }

#if SQUEEZE_AVX512_CODEC
namespace detail {

struct Permutes {
  alignas(64) std::uint8_t decode[64];  // codes in the order the byte unpacks undo
  alignas(64) std::uint8_t pack[64];    // byte 0 of the dwords of two vectors: first's into bytes 0-15 and 32-47,
                                        // second's into 16-31 and 48-63
};
// Unpacking byte planes B0..B3 (lo/hi 8, then lo/hi 16) puts element 16L + 4q + i of the input (128-bit lane L)
// at dword 4L + i of output q; so input byte 16L + 4q + i must hold code 16q + 4L + i for output q to be in order.
constexpr Permutes make_permutes() {
  Permutes p{};
  for (int L = 0; L < 4; ++L)
    for (int q = 0; q < 4; ++q)
      for (int i = 0; i < 4; ++i) p.decode[16 * L + 4 * q + i] = std::uint8_t(16 * q + 4 * L + i);
  for (int k = 0; k < 64; ++k) p.pack[k] = std::uint8_t(4 * (k % 16) + 64 * ((k / 16) & 1));
  return p;
}
inline constexpr Permutes kPermutes = make_permutes();

// The four byte planes of a map's values, in registers for a run of blocks.
struct Planes {
  __m512i t[4][4];
};
SQUEEZE_AVX512_TARGET inline Planes load_planes(const StateCodeMap& map) {
  Planes p;
  for (int b = 0; b < 4; ++b)
    for (int k = 0; k < 4; ++k) p.t[b][k] = _mm512_loadu_si512(map.value_bytes[b] + 64 * k);
  return p;
}

inline std::uint64_t byte_mask(int count) { return count >= 64 ? ~std::uint64_t(0) : (std::uint64_t(1) << count) - 1; }
inline __mmask16 lane_mask(int count) { return count >= 16 ? __mmask16(0xffff) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1); }

// out[j] = value[codes[j]] * scale for j < count (<= 64).
SQUEEZE_AVX512_TARGET inline void decode64(const Planes& p, const std::uint8_t* codes, int count, __m512 scale, float* out) {
  const __m512i idx = _mm512_permutexvar_epi8(_mm512_load_si512(kPermutes.decode), _mm512_maskz_loadu_epi8(byte_mask(count), codes));
  const __mmask64 high = _mm512_movepi8_mask(idx);  // codes 128-255 from the second pair of 64-byte tables
  __m512i b[4];
  for (int k = 0; k < 4; ++k)
    b[k] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(p.t[k][0], idx, p.t[k][1]),
                                  _mm512_permutex2var_epi8(p.t[k][2], idx, p.t[k][3]));
  const __m512i l01 = _mm512_unpacklo_epi8(b[0], b[1]), h01 = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i l23 = _mm512_unpacklo_epi8(b[2], b[3]), h23 = _mm512_unpackhi_epi8(b[2], b[3]);
  const __m512i v[4] = {_mm512_unpacklo_epi16(l01, l23), _mm512_unpackhi_epi16(l01, l23), _mm512_unpacklo_epi16(h01, h23),
                        _mm512_unpackhi_epi16(h01, h23)};
  for (int q = 0; q < 4; ++q)
    _mm512_mask_storeu_ps(out + 16 * q, lane_mask(count - 16 * q), _mm512_mul_ps(_mm512_castsi512_ps(v[q]), scale));
}

// codes[j] = bucket_code(map, x[j] * inv) for j < count (<= 64): bucket_code in 16 lanes.
template <bool kSigned>
SQUEEZE_AVX512_TARGET inline void encode64(const std::int32_t* bucket, const float* x, int count, __m512 inv, std::uint8_t* codes) {
  // The gather's base is bucket - kBucketKeyLo, so the clamped key indexes it directly (integer arithmetic: no
  // out-of-range pointer is formed).
  const auto* base = reinterpret_cast<const int*>(reinterpret_cast<std::uintptr_t>(bucket) - std::uintptr_t(kBucketKeyLo) * 4);
  const __m512i lo = _mm512_set1_epi32(kBucketKeyLo), hi = _mm512_set1_epi32(kBucketKeyHi), low16 = _mm512_set1_epi32(0xffff);
  __m512i c[4];
  for (int q = 0; q < 4; ++q) {
    // NaN becomes -inf (max returns its second operand for NaN), whose code, 0, is NaN's.
    const __m512 y = _mm512_max_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(lane_mask(count - 16 * q), x + 16 * q), inv),
                                   _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
    __m512i bits = _mm512_castps_si512(y), key;
    __mmask16 neg = 0;
    if constexpr (kSigned) {
      neg = _mm512_movepi32_mask(bits);
      bits = _mm512_mask_add_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), neg,
                                   _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(1));
      key = _mm512_srli_epi32(bits, 16);
    } else {
      key = _mm512_srai_epi32(bits, 16);
    }
    key = _mm512_min_epi32(_mm512_max_epi32(key, lo), hi);
    __m512i code = _mm512_srli_epi32(_mm512_add_epi32(_mm512_i32gather_epi32(key, base, 4), _mm512_and_si512(bits, low16)), 16);
    if constexpr (kSigned) {
      code = _mm512_add_epi32(code, _mm512_set1_epi32(127));
      code = _mm512_max_epi32(_mm512_mask_sub_epi32(code, neg, _mm512_set1_epi32(254), code), _mm512_setzero_si512());
    }
    c[q] = code;
  }
  const __m512i pack = _mm512_load_si512(kPermutes.pack);
  const __m512i packed =
      _mm512_mask_blend_epi8(0xffffffff00000000ull, _mm512_permutex2var_epi8(c[0], pack, c[1]), _mm512_permutex2var_epi8(c[2], pack, c[3]));
  _mm512_mask_storeu_epi8(codes, byte_mask(count), packed);
}

}  // namespace detail

// The two passes on their own, as cpu::encode_block / decode_block (tests compare them). Only where cpu_has_codec().
SQUEEZE_AVX512_TARGET inline void encode_block(const StateCodeMap& map, const float* x, float inv, int len, std::uint8_t* out) {
  const __m512 vi = _mm512_set1_ps(inv);
  for (int j = 0; j < len; j += 64) {
    if (map.is_signed)
      detail::encode64<true>(map.bucket, x + j, len - j, vi, out + j);
    else
      detail::encode64<false>(map.bucket, x + j, len - j, vi, out + j);
  }
}
SQUEEZE_AVX512_TARGET inline void decode_block(const StateCodeMap& map, const std::uint8_t* codes, float scale, int len, float* out) {
  const detail::Planes p = detail::load_planes(map);
  for (int j = 0; j < len; j += 64) detail::decode64(p, codes + j, len - j, _mm512_set1_ps(scale), out + j);
}

// Blocks [b, e) of tensor t: adamw8.hpp's adamw8_block with the decode and encode passes above. (Measured and dropped:
// interleaving block k's math with block k - 1's encode chunk by chunk, slower: both compete for the same two
// vector ports; software prefetch of the blocks ahead, no gain over the hardware prefetcher.)
template <class P, class G>
SQUEEZE_AVX512_TARGET void adamw8_blocks(const AdamW8Tensor<P, G>& t, std::int64_t b, std::int64_t e, const AdamWScalars& s,
                                         const StateCodeMap& mmap, const StateCodeMap& vmap) {
  const detail::Planes mp = detail::load_planes(mmap), vp = detail::load_planes(vmap);
  const bool own_master = !std::is_same_v<P, float> && t.master == nullptr;  // bf16, its own master: rounded stochastically
  float* w0 = std::is_same_v<P, float> ? reinterpret_cast<float*>(t.param) : t.master;
  for (std::int64_t k = b; k < e; ++k) {
    const std::int64_t lo = k * kStateBlock;
    const int len = int(std::min(kStateBlock, t.n - lo));
    std::uint8_t* mc = t.exp_avg + lo;
    std::uint8_t* vc = t.exp_avg_sq + lo;
    alignas(64) float m[kStateBlock], v[kStateBlock], gf[kStateBlock], own[kStateBlock];
    float* w = own_master ? own : w0 + lo;
    if (own_master)
      for (int j = 0; j < len; ++j) own[j] = to_float(t.param[lo + j]);
    const G* g = t.grad + lo;
    for (int j = 0; j < len; ++j) gf[j] = to_float(g[j]);
    const __m512 ms = _mm512_set1_ps(t.exp_avg_absmax[k]), vs = _mm512_set1_ps(t.exp_avg_sq_absmax[k]);
    for (int j = 0; j < len; j += 64) {
      detail::decode64(mp, mc + j, len - j, ms, m + j);
      detail::decode64(vp, vc + j, len - j, vs, v + j);
    }
    float m_max, v_max;
    adamw8_block_math(w, t.param + lo, m, v, gf, len, s, m_max, v_max);
    if constexpr (std::is_same_v<P, bf16>)
      if (own_master) round_stochastic_run(w, t.param + lo, len, s.rounding_seed, t.rounding_index + std::uint64_t(lo));
    const __m512 mi = _mm512_set1_ps(inverse_absmax(m_max)), vi = _mm512_set1_ps(inverse_absmax(v_max));
    for (int j = 0; j < len; j += 64) {
      detail::encode64<true>(mmap.bucket, m + j, len - j, mi, mc + j);
      detail::encode64<false>(vmap.bucket, v + j, len - j, vi, vc + j);
    }
    t.exp_avg_absmax[k] = m_max;
    t.exp_avg_sq_absmax[k] = v_max;
  }
}
#else
// Never called (codec_available() is false): the generic passes, so the names exist everywhere.
inline void encode_block(const StateCodeMap& map, const float* x, float inv, int len, std::uint8_t* out) {
  cpu::encode_block(map, x, inv, len, out);
}
inline void decode_block(const StateCodeMap& map, const std::uint8_t* codes, float scale, int len, float* out) {
  cpu::decode_block(map, codes, scale, len, out);
}
template <class P, class G>
void adamw8_blocks(const AdamW8Tensor<P, G>& t, std::int64_t b, std::int64_t e, const AdamWScalars& s, const StateCodeMap& mmap,
                   const StateCodeMap& vmap) {
  for (std::int64_t k = b; k < e; ++k) cpu::adamw8_block(t, k, s, mmap, vmap);
}
#endif

}  // namespace squeeze::kernels::cpu::avx512
