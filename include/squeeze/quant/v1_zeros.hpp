#pragma once
// GPTQ "v1" zero points (checkpoint_format "gptq"): qzeros [groups, packed_words(out, bits)] hold zero - 1.
// Two writers disagree on what "minus one" means when a zero point is 0:
//   ZeroArithmetic::word   GPTQModel's v2 <-> v1 conversion. At 2, 4 and 8 bits the packed row is built from the
//                          true zeros, then every 32-bit word has the constant "1 at each field's lowest bit"
//                          (0x11111111 at 4 bits) subtracted as one int32, so a zero of 0 borrows from the field
//                          above it (and a borrow out of the top field is lost); only the word-wise inverse (add the
//                          constant back, carry included, then unpack) reads every field right. At 3 bits, where
//                          fields 10 and 21 of every 32 straddle two words, GPTQModel shifts each field on its own
//                          ((zero - 1) mod 8 written, (field + 1) mod 8 read), so `word` is `field` there.
//   ZeroArithmetic::field  each field on its own: (zero - 1) mod 2^bits (squeeze's PackedLinear, AutoGPTQ's
//                          pack() when no zero is 0). Identical to `word` whenever no zero point is 0.
// Encode and decode are exact inverses for every zero point. Fields are laid out as in pack.hpp's bit stream.
#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "squeeze/quant/pack.hpp"

namespace squeeze::quant {

enum class ZeroArithmetic { word, field };

// Whether `how` at `bits` is the whole-word arithmetic (GPTQModel at 2, 4, 8 bits) rather than per field.
constexpr bool v1_word_wise(ZeroArithmetic how, int bits) { return how == ZeroArithmetic::word && bits != 3; }

// The constant of word w of a packed row of `out` fields: a 1 at the lowest bit of every field j < out that
// starts in word w (2 bits: 0x55555555, 4: 0x11111111, 8: 0x01010101; 3: 0x49249249, 0x92492492,
// 0x24924924 in turn). Padding fields past `out` get none, so padding bits a reader ignores stay apart.
inline std::uint32_t v1_word_constant(std::int64_t w, std::int64_t out, int bits) {
  std::uint32_t k = 0;
  for (std::int64_t j = (32 * w + bits - 1) / bits; j < out && j * bits < 32 * (w + 1); ++j) k |= 1u << (j * bits - 32 * w);
  return k;
}

namespace detail {
// `got` elements of `what` must be [groups, per_row].
inline void check_zero_shapes(std::int64_t groups, std::int64_t out, int bits, std::int64_t per_row, std::size_t got, const char* what,
                              const char* who) {
  check_bits(bits);
  check(groups > 0 && out > 0, std::string(who) + ": groups and out must be positive");
  const std::int64_t want = groups * per_row;
  check(std::int64_t(got) == want, std::string(who) + ": " + what + " has " + std::to_string(got) + " elements, expected " +
                                       std::to_string(want) + " for [" + std::to_string(groups) + " groups, " + std::to_string(out) +
                                       " outputs] at " + std::to_string(bits) + " bits");
}
// row[0, cols) += sign * constant, word by word as int32 arithmetic (wrapping; nothing crosses a word).
inline void v1_offset_row(std::int32_t* row, std::int64_t cols, std::int64_t out, int bits, int sign) {
  for (std::int64_t w = 0; w < cols; ++w) {
    const std::uint32_t k = v1_word_constant(w, out, bits);
    row[w] = std::int32_t(sign > 0 ? std::uint32_t(row[w]) + k : std::uint32_t(row[w]) - k);
  }
}
}  // namespace detail

// True zero points [groups, out] -> v1 qzeros [groups, packed_words(out, bits)].
inline std::vector<std::int32_t> encode_v1_qzeros(std::span<const std::uint8_t> zeros, std::int64_t groups, std::int64_t out, int bits,
                                                  ZeroArithmetic how = ZeroArithmetic::word) {
  detail::check_zero_shapes(groups, out, bits, out, zeros.size(), "zeros", "encode_v1_qzeros");
  const std::uint32_t maxq = (1u << bits) - 1u;
  const std::int64_t cols = packed_words(out, bits);
  const bool word_wise = v1_word_wise(how, bits);
  std::vector<std::int32_t> q(std::size_t(groups * cols), 0);
  for (std::int64_t g = 0; g < groups; ++g) {
    std::int32_t* row = q.data() + g * cols;
    for (std::int64_t o = 0; o < out; ++o) {
      const std::uint32_t z = zeros[g * out + o];
      check(z <= maxq, "encode_v1_qzeros: zero point " + std::to_string(z) + " at [" + std::to_string(g) + ", " + std::to_string(o) +
                           "] does not fit " + std::to_string(bits) + " bits");
      stream_put(row, 1, o, bits, word_wise ? z : (z - 1u) & maxq);
    }
    if (word_wise) detail::v1_offset_row(row, cols, out, bits, -1);
  }
  return q;
}

// v1 qzeros [groups, packed_words(out, bits)] -> true zero points [groups, out].
inline std::vector<std::uint8_t> decode_v1_qzeros(std::span<const std::int32_t> qzeros, std::int64_t groups, std::int64_t out, int bits,
                                                  ZeroArithmetic how = ZeroArithmetic::word) {
  detail::check_zero_shapes(groups, out, bits, packed_words(out, bits), qzeros.size(), "qzeros", "decode_v1_qzeros");
  const std::uint32_t maxq = (1u << bits) - 1u;
  const std::int64_t cols = packed_words(out, bits);
  const bool word_wise = v1_word_wise(how, bits);
  std::vector<std::uint8_t> z(std::size_t(groups * out));
  std::vector<std::int32_t> row(static_cast<std::size_t>(cols));
  for (std::int64_t g = 0; g < groups; ++g) {
    std::copy_n(qzeros.data() + g * cols, cols, row.data());
    if (word_wise) detail::v1_offset_row(row.data(), cols, out, bits, +1);
    for (std::int64_t o = 0; o < out; ++o) {
      const std::uint32_t f = stream_get(row.data(), 1, o, bits);
      z[g * out + o] = std::uint8_t(word_wise ? f : (f + 1u) & maxq);
    }
  }
  return z;
}

// A file's v1 qzeros (written with `how`) in PackedLinear's per-field form, and back; the same words when no
// zero point is 0.
inline std::vector<std::int32_t> qzeros_to_packed(std::span<const std::int32_t> file, std::int64_t groups, std::int64_t out, int bits,
                                                  ZeroArithmetic how) {
  return encode_v1_qzeros(decode_v1_qzeros(file, groups, out, bits, how), groups, out, bits, ZeroArithmetic::field);
}
inline std::vector<std::int32_t> qzeros_from_packed(const PackedLinear& p, ZeroArithmetic how) {
  return encode_v1_qzeros(unpack_zeros(p), p.groups(), p.out, p.bits, how);
}

}  // namespace squeeze::quant
