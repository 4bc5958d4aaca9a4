#pragma once
// Element types named in policies: float, squeeze::half (IEEE fp16), squeeze::bf16 (bfloat16).
// Where the CUDA toolkit's headers are available they ARE CUDA's __half / __nv_bfloat16 (CUDA's
// headers also declare a global `half`; one entity keeps `using namespace squeeze` unambiguous), and
// the conversions are CUDA's host/device intrinsics. Without the toolkit they are 2-byte storage
// types with the same bits and software conversions, so policy/plan/CPU code builds anywhere.
#include <bit>
#include <concepts>
#include <cstdint>
#include <string_view>

#if __has_include(<cuda_fp16.h>) && __has_include(<cuda_bf16.h>) && !defined(SQUEEZE_NO_CUDA_TYPES)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define SQUEEZE_CUDA_TYPES 1
#endif

#if defined(__CUDACC__)
#define SQUEEZE_HD __host__ __device__ __forceinline__
#else
#define SQUEEZE_HD inline
#endif

namespace squeeze {

#if SQUEEZE_CUDA_TYPES
using half = ::__half;
using bf16 = ::__nv_bfloat16;
#else
struct half {
  std::uint16_t bits = 0;
};
struct bf16 {
  std::uint16_t bits = 0;
};
#endif
static_assert(sizeof(half) == 2 && sizeof(bf16) == 2);

template <class T>
concept FloatingElement = std::same_as<T, float> || std::same_as<T, half> || std::same_as<T, bf16>;

template <FloatingElement T>
constexpr std::string_view dtype_name() {
  if constexpr (std::same_as<T, float>)
    return "float";
  else if constexpr (std::same_as<T, half>)
    return "half";
  else
    return "bf16";
}

// ---- conversions (round to nearest even; NaN stays NaN; overflow goes to inf) --------------------
SQUEEZE_HD constexpr float to_float(float x) { return x; }
template <FloatingElement T>
SQUEEZE_HD T from_float(float f);
template <>
SQUEEZE_HD float from_float<float>(float f) {
  return f;
}

#if SQUEEZE_CUDA_TYPES
SQUEEZE_HD float to_float(half x) { return __half2float(x); }
SQUEEZE_HD float to_float(bf16 x) { return __bfloat162float(x); }
template <>
SQUEEZE_HD half from_float<half>(float f) {
  return __float2half_rn(f);
}
template <>
SQUEEZE_HD bf16 from_float<bf16>(float f) {
  return __float2bfloat16_rn(f);
}
#else
inline float to_float(bf16 x) { return std::bit_cast<float>(std::uint32_t(x.bits) << 16); }
inline float to_float(half x) {
  const std::uint32_t sign = std::uint32_t(x.bits & 0x8000u) << 16;
  std::uint32_t exp = (x.bits >> 10) & 0x1fu, man = x.bits & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return std::bit_cast<float>(sign);  // +-0
    int e = -1;                                       // subnormal: normalise
    do {
      ++e;
      man <<= 1;
    } while ((man & 0x400u) == 0);
    return std::bit_cast<float>(sign | std::uint32_t(127 - 15 - e) << 23 | (man & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(sign | (exp + 127 - 15) << 23 | man << 13);
}

template <>
inline bf16 from_float<bf16>(float f) {
  {
    std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{std::uint16_t((u >> 16) | 0x40u)};  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return bf16{std::uint16_t(u >> 16)};
  }
}
template <>
inline half from_float<half>(float f) {
  {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    const std::uint16_t sign = std::uint16_t((u >> 16) & 0x8000u);
    const std::uint32_t au = u & 0x7fffffffu;
    if (au > 0x7f800000u) return half{std::uint16_t(sign | 0x7e00u)};   // NaN
    if (au >= 0x477ff000u) return half{std::uint16_t(sign | 0x7c00u)};  // >= 65520 rounds to inf
    if (au < 0x38800000u) {                                             // subnormal half (or 0)
      if (au < 0x33000000u) return half{sign};                          // below half of min subnormal
      const std::uint32_t man = (au & 0x7fffffu) | 0x800000u;
      const int shift = 126 - int(au >> 23);  // 14..24
      std::uint32_t h = man >> shift;
      const std::uint32_t rem = man & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
      if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
      return half{std::uint16_t(sign | h)};
    }
    std::uint32_t h = ((au >> 23) - 112u) << 10 | ((au >> 13) & 0x3ffu);
    const std::uint32_t rem = au & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return half{std::uint16_t(sign | h)};
  }
}

#endif

}  // namespace squeeze
