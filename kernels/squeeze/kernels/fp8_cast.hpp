#pragma once
// FP8 casts with one tensor-wise power-of-two scale (nn/fp8_linear.hpp, "current scaling"): the math shared by the
// CUDA kernels (fp8_cast.cuh) and the CPU twin here.
//   fp8_scale(amax, format)    the power of two s with amax·s <= the format's largest finite value, amax·s > half of it
//                              (exact, from the exponents: no log2 rounding; at most 2^126); 1 for amax 0 or NaN, 0 for inf
//   fp8_encode(v, format)      float -> the format's byte, round-to-nearest-even, as torch's own cast: beyond the
//                              largest finite value e4m3fn (which has no inf) saturates to it, e5m2 gives inf
//   fp8_cast_cpu(args)         x [rows, cols] -> out [rows, cols] and / or out_t [cols, rows], scaled by fp8_scale(amax)
#include <cmath>
#include <cstdint>
#include <cstring>

#include "squeeze/error.hpp"
#include "squeeze/kernels/fused_common.hpp"

namespace squeeze::kernels {

enum class Fp8Format : std::uint8_t { e4m3, e5m2 };

// Largest finite value: 448 (e4m3fn), 57344 (e5m2).
SQUEEZE_HD float fp8_max(Fp8Format f) { return f == Fp8Format::e4m3 ? 448.0f : 57344.0f; }

SQUEEZE_HD std::uint32_t fp8_bits_of(float v) {
  std::uint32_t b;
  memcpy(&b, &v, sizeof b);
  return b;
}
SQUEEZE_HD float fp8_float_of(std::uint32_t b) {
  float v;
  memcpy(&v, &b, sizeof v);
  return v;
}

// 2^e for e in [-149, 127] (subnormal powers too), exactly.
SQUEEZE_HD float fp8_pow2(int e) {
  if (e >= -126) return fp8_float_of(std::uint32_t(e + 127) << 23);
  return fp8_float_of(std::uint32_t(1) << (e + 149));
}

SQUEEZE_HD float fp8_scale(float amax, Fp8Format f) {
  if (!(amax > 0)) return 1.0f;  // 0 or NaN (NaN values stay NaN whatever the scale)
  if (amax == INFINITY) return 0.0f;
  // amax = ma·2^ea, top = mt·2^et with ma, mt in [1, 2): top/amax >= 2^k for k = et - ea - (ma > mt).
  std::uint32_t b = fp8_bits_of(amax);
  int ea = int(b >> 23) - 127;
  if ((b >> 23) == 0) {  // subnormal: normalise the mantissa
    int shift = 0;
    while ((b & 0x00800000u) == 0) b <<= 1, ++shift;
    ea = -126 - shift;
  }
  const std::uint32_t ma = b & 0x007FFFFFu, mt = fp8_bits_of(fp8_max(f)) & 0x007FFFFFu;
  const int et = int(fp8_bits_of(fp8_max(f)) >> 23) - 127;
  const int k = et - ea - (ma > mt ? 1 : 0);
  if (k > 126) return fp8_pow2(126);  // as large as a power-of-two float scale goes
  if (k < -149) return 0.0f;
  return fp8_pow2(k);
}

// Round-to-nearest-even into a format of E exponent and M mantissa bits (bias 2^(E-1) - 1): normal values by adding
// half an ulp less one (plus the kept mantissa's low bit, for ties to even) and truncating, subnormal ones by adding
// the float whose ulp is the format's smallest subnormal step and subtracting its bits.
SQUEEZE_HD std::uint8_t fp8_encode(float v, Fp8Format f) {
  const bool e4m3 = f == Fp8Format::e4m3;
  const int M = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const std::uint32_t bits = fp8_bits_of(v), sign = (bits >> 24) & 0x80u, a = bits & 0x7FFFFFFFu;
  // The first magnitude that no longer rounds to a finite value: 480 (e4m3fn), 61440 (e5m2).
  const std::uint32_t overflow = e4m3 ? 0x43F00000u : 0x47700000u;
  if (a > 0x7F800000u) return std::uint8_t(sign | 0x7Fu);                 // NaN
  if (a >= overflow) return std::uint8_t(sign | (e4m3 ? 0x7Eu : 0x7Cu));  // e4m3fn: its largest (no inf); e5m2: inf
  const std::uint32_t min_normal = std::uint32_t(127 - bias + 1) << 23;   // 2^(1 - bias)
  std::uint32_t r;
  if (a < min_normal) {
    // a + 2^(1 - bias + 23 - M): the float's ulp there is the format's subnormal step, so the add rounds (to even).
    const std::uint32_t magic = std::uint32_t(127 - bias + 1 + 23 - M) << 23;
    r = fp8_bits_of(fp8_float_of(a) + fp8_float_of(magic)) - magic;
  } else {
    const int drop = 23 - M;
    const std::uint32_t odd = (a >> drop) & 1u;
    r = (a + (std::uint32_t(bias - 127) << 23) + ((1u << (drop - 1)) - 1) + odd) >> drop;  // rebiased, rounded
    if (e4m3 && r == 0x7Fu) r = 0x7Eu;  // rounded up into e4m3fn's NaN code: the largest finite value, as torch's cast
  }
  return std::uint8_t(sign | r);
}

// x [rows, cols] row-major (T: float, bf16 or half) -> out [rows, cols] and / or out_t [cols, rows] (either may be
// null), each value x·scale encoded, scale = fp8_scale(*amax); inverse_scale (if set) gets 1 / scale.
template <class T>
struct Fp8CastArgs {
  const T* x = nullptr;
  std::int64_t rows = 0, cols = 0;
  const float* amax = nullptr;
  std::uint8_t* out = nullptr;
  std::uint8_t* out_t = nullptr;
  float* inverse_scale = nullptr;
  Fp8Format format = Fp8Format::e4m3;
};

template <class T>
void validate(const Fp8CastArgs<T>& a, const char* what) {
  if (a.rows < 0 || a.cols < 0) throw Error(std::string(what) + ": negative size");
  if (a.x == nullptr && a.rows * a.cols > 0) throw Error(std::string(what) + ": x is null");
  if (a.amax == nullptr) throw Error(std::string(what) + ": amax is null");
  if (a.out == nullptr && a.out_t == nullptr) throw Error(std::string(what) + ": neither out nor out_t is set");
}

// max |x| over n values; NaN if any is NaN.
template <class T>
float fp8_amax_cpu(const T* x, std::int64_t n) {
  float m = 0;
  for (std::int64_t i = 0; i < n && !std::isnan(m); ++i) m = amax_of(std::fabs(to_float(x[i])), m);
  return m;
}

template <class T>
void fp8_cast_cpu(const Fp8CastArgs<T>& a) {
  validate(a, "fp8 cast (CPU)");
  const float s = fp8_scale(*a.amax, a.format);
  if (a.inverse_scale != nullptr) *a.inverse_scale = 1.0f / s;
  for (std::int64_t r = 0; r < a.rows; ++r)
    for (std::int64_t c = 0; c < a.cols; ++c) {
      const std::uint8_t q = fp8_encode(to_float(a.x[r * a.cols + c]) * s, a.format);
      if (a.out != nullptr) a.out[r * a.cols + c] = q;
      if (a.out_t != nullptr) a.out_t[c * a.rows + r] = q;
    }
}

}  // namespace squeeze::kernels
