#pragma once
// Codes -> fp16 / bf16 bit patterns by the magic-number trick, shared by both kernel families and the CPU twin (plain
// C++ on the host, one LOP3 per pair on the device). (w & mask) | exponent bits reads as magic + code in T, so one
// logic op turns two codes into a half2 / bfloat162 and one subtraction of (magic + zero) gives the exact small
// integer q - z (all values are small integers, so fp16 / bf16 arithmetic on them is exact).
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "squeeze/dtype.hpp"

namespace squeeze::kernels::quant {

// (a & MASK) | MAGIC. On the device one LOP3 (0xEA = (a & b) | c): written as C, the compiler keeps the AND and the OR
// apart (two instructions per pair), and with both constants as operands of one lop3 ptxas keeps one in a register.
template <std::uint32_t MASK, std::uint32_t MAGIC>
SQUEEZE_HD std::uint32_t and_or(std::uint32_t a) {
#if defined(__CUDA_ARCH__)
  std::uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "n"(MASK), "n"(MAGIC));
  return r;
#else
  return (a & MASK) | MAGIC;
#endif
}

// Pair i (0..3) of a 4-bit word: two 16-bit patterns (low half = nibble i, high half = nibble i + 4) that read as fp16
// 1024 + v (even i) / 1024 + 16 v (odd i), or as bf16 128 + v (every i).
//   pair 0: nibbles 0,4   pair 1: nibbles 1,5   pair 2: nibbles 2,6   pair 3: nibbles 3,7
template <class T>
SQUEEZE_HD std::uint32_t magic_pair(std::uint32_t w, int i) {
  if constexpr (std::is_same_v<T, bf16>) {
    return and_or<0x000F000Fu, 0x43004300u>(w >> (4 * i));  // bf16 has 7 mantissa bits: shift every nibble down
  } else {
    const std::uint32_t s = w >> (8 * (i >> 1));
    return (i & 1) ? and_or<0x00F000F0u, 0x64006400u>(s) : and_or<0x000F000Fu, 0x64006400u>(s);
  }
}
// 8-bit: half r (0, 1) of a word = bytes (2r, 2r + 1), as fp16 1024 + v (bf16 cannot hold 128 + 255: see decode.cuh).
SQUEEZE_HD std::uint32_t magic8_pair_f16(std::uint32_t w, int r) {
  const std::uint32_t s = w >> (16 * r);
  return (s & 0xFFu) | ((s & 0xFF00u) << 8) | 0x64006400u;
}

// 3-bit: pair q of a lane's words (w0, w1, w2) as two fp16 1024 + v / bf16 128 + v patterns.
template <class T>
SQUEEZE_HD std::uint32_t magic3_pair(std::uint32_t w0, std::uint32_t w1, std::uint32_t w2, int q) {
  constexpr std::uint32_t kMagic = std::is_same_v<T, bf16> ? 0x43004300u : 0x64006400u;
  if (q == 15) return ((w0 >> 15) & 0x00010001u) | ((w1 >> 14) & 0x00020002u) | ((w2 >> 13) & 0x00040004u) | kMagic;
  const std::uint32_t w = q < 5 ? w0 : q < 10 ? w1 : w2;
  return and_or<0x00070007u, kMagic>(w >> (3 * (q % 5)));
}

// Host reading of one 16-bit half of magic_pair: the code value minus zero, exactly as the device's half2 arithmetic
// computes it.
template <class T>
inline float magic_value_minus_zero(std::uint16_t bits, int i, int zero) {
  if constexpr (std::is_same_v<T, bf16>) {
    return std::bit_cast<float>(std::uint32_t(bits) << 16) - float(128 + zero);
  } else {
    half h;
    std::memcpy(&h, &bits, 2);
    const float v = to_float(h);
    return (i & 1) ? v * (1.f / 16.f) + float(-64 - zero) : v - float(1024 + zero);
  }
}

namespace detail {
// The zero point's patterns put together as bits, both halves (one integer op each instead of a conversion to float,
// an add, a rounding and a pack): z (< 64) is the low mantissa bits of 128 + z in bf16 (exponent 7), of 1024 + z in
// fp16 (exponent 10), and z << 4 those of -(64 + z) in fp16 (exponent 6). The sm90 kernel's group constants.
SQUEEZE_HD constexpr std::uint32_t sm90_bf16_magic_zero(std::uint32_t z) { return 0x43004300u | z * 0x10001u; }
SQUEEZE_HD constexpr std::uint32_t sm90_half_magic_zero(std::uint32_t z) { return 0x64006400u | z * 0x10001u; }
SQUEEZE_HD constexpr std::uint32_t sm90_half_odd_zero(std::uint32_t z) { return 0xD400D400u | z * 0x10001u << 4; }
}  // namespace detail

}  // namespace squeeze::kernels::quant
