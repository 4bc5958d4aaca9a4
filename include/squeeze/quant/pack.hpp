#pragma once
// GPTQ packed layout, compatible with AutoGPTQ / GPTQModel "v1" checkpoints.
//
// A linear layer y = x W^T with W [out, in] is stored transposed and bit-packed:
//   qweight int32 [ceil(in*bits/32), out]      codes q in [0, 2^bits), packed along the INPUT dim
//   qzeros  int32 [groups, ceil(out*bits/32)]  zero points, stored as (zero - 1) (the v1 format),
//                                              packed along the OUTPUT dim
//   scales  fp16  [groups, out]
//   g_idx   int32 [in]                         group of each input row (act-order permutes it)
//   W[o, i] = scales[g, o] * (q[i, o] - zero[g, o]),  g = g_idx[i]
//
// Packing rule (all widths, including 3 bits): along the packed dimension the codes form one
// little-endian bit stream; code j occupies bits [j*bits, (j+1)*bits) of it and word w holds stream
// bits [32w, 32w+32). For 2/4/8 bits a code never crosses a word; 3-bit codes 10 and 21 of every 32
// straddle two words, exactly as AutoGPTQ's 3-bit packer lays them out. When the dimension does not
// fill the last word (odd shapes) the unused high bits are zero.
//
// In memory qzeros hold (zero - 1) mod 2^bits per field, read back as ((field + 1) mod 2^bits). Files differ
// only where a zero point is 0: GPTQModel's v1 subtracts the constant from whole words, borrowing from the
// field above; quant/v1_zeros.hpp converts (gptq_file.hpp and io/hf_gptq.hpp read and write files that way).
// quant/rtn.hpp's grid keeps zero >= 1, where both forms are the same words.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"
#include "squeeze/kernels/cpu_parallel.hpp"
#include "squeeze/kernels/quant/bitstream.cuh"

namespace squeeze::quant {

inline bool supported_bits(int bits) { return bits == 2 || bits == 3 || bits == 4 || bits == 8; }
inline void check_bits(int bits) { check(supported_bits(bits), "GPTQ packing supports 2, 3, 4 or 8 bits, got " + std::to_string(bits)); }

// Number of int32 words holding `count` codes of `bits` bits.
constexpr std::int64_t packed_words(std::int64_t count, int bits) { return (count * bits + 31) / 32; }

using kernels::quant::stream_get;  // the bit stream of the format (squeeze/kernels/quant/bitstream.cuh)
using kernels::quant::stream_put;

// Word w of the bit stream of codes[0, count) (each masked to Bits): the codes that touch stream bits [32w, 32w + 32),
// the first and the last of them possibly straddling into the neighbouring words (3 bits); unused high bits zero.
template <int Bits>
inline std::uint32_t stream_word(const std::uint8_t* codes, std::int64_t count, std::int64_t w) {
  constexpr std::uint64_t mask = (1u << Bits) - 1u;
  const std::int64_t first_bit = w * 32;
  if constexpr (32 % Bits == 0) {  // whole codes only: 32 / Bits of them from code 32w / Bits on
    constexpr int per_word = 32 / Bits;
    const std::int64_t j0 = first_bit / Bits;
    std::uint32_t word = 0;
    if (j0 + per_word <= count) {
      for (int k = 0; k < per_word; ++k) word |= std::uint32_t(codes[j0 + k] & mask) << (k * Bits);
    } else {
      for (std::int64_t j = j0; j < count; ++j) word |= std::uint32_t(codes[j] & mask) << ((j - j0) * Bits);
    }
    return word;
  } else {
    const std::int64_t end = std::min(count, (first_bit + 32 + Bits - 1) / Bits);
    std::uint64_t word = 0;
    for (std::int64_t j = first_bit / Bits; j < end; ++j) {
      const std::int64_t shift = j * Bits - first_bit;  // > -Bits: a code straddling in from word w - 1 has a negative one
      const std::uint64_t c = codes[j] & mask;
      word |= shift >= 0 ? c << shift : c >> -shift;
    }
    return std::uint32_t(word);
  }
}

// ---- the packed tensors of one layer ----------------------------------------------------------------------
struct PackedLinear {
  int bits = 4;
  int group_size = 128;               // 0: one group (per output channel)
  std::int64_t in = 0, out = 0;       // W is [out, in]
  std::vector<std::int32_t> qweight;  // [packed_words(in, bits), out]
  std::vector<std::int32_t> qzeros;   // [groups, packed_words(out, bits)]
  std::vector<half> scales;           // [groups, out]
  std::vector<std::int32_t> g_idx;    // [in]
  std::vector<half> bias;             // [out] or empty

  std::int64_t groups() const { return group_size > 0 ? (in + group_size - 1) / group_size : 1; }
  std::int64_t qweight_rows() const { return packed_words(in, bits); }
  std::int64_t qzeros_cols() const { return packed_words(out, bits); }

  // Shape and content consistency; throws squeeze::Error naming the first problem.
  void validate() const {
    check_bits(bits);
    check(in > 0 && out > 0, "packed linear: in and out must be positive");
    check(group_size >= 0, "packed linear: group_size must be >= 0 (0 = per channel)");
    const auto g = groups();
    auto expect = [](std::size_t got, std::int64_t want, const char* what) {
      check(std::int64_t(got) == want,
            std::string("packed linear: ") + what + " has " + std::to_string(got) + " elements, expected " + std::to_string(want));
    };
    expect(qweight.size(), qweight_rows() * out, "qweight");
    expect(qzeros.size(), g * qzeros_cols(), "qzeros");
    expect(scales.size(), g * out, "scales");
    expect(g_idx.size(), in, "g_idx");
    check(bias.empty() || std::int64_t(bias.size()) == out, "packed linear: bias must be empty or [out]");
    for (std::int64_t i = 0; i < in; ++i)
      check(g_idx[i] >= 0 && g_idx[i] < g,
            "packed linear: g_idx[" + std::to_string(i) + "] = " + std::to_string(g_idx[i]) + " is outside [0, " + std::to_string(g) + ")");
  }

  std::uint32_t code(std::int64_t i, std::int64_t o) const { return stream_get(qweight.data() + o, out, i, bits); }
  // The real zero point (the stored field + 1, wrapped to the code range).
  std::uint32_t zero(std::int64_t g, std::int64_t o) const {
    return (stream_get(qzeros.data() + g * qzeros_cols(), 1, o, bits) + 1u) & ((1u << bits) - 1u);
  }
  float scale(std::int64_t g, std::int64_t o) const { return to_float(scales[g * out + o]); }
};

// Default g_idx: row i belongs to group i / group_size (no act-order).
inline std::vector<std::int32_t> default_g_idx(std::int64_t in, int group_size) {
  std::vector<std::int32_t> g(in);
  for (std::int64_t i = 0; i < in; ++i) g[i] = group_size > 0 ? std::int32_t(i / group_size) : 0;
  return g;
}

// Packs codes q [out, in] (row-major, the nn.Linear orientation), zero points and scales [groups, out]
// (floats, scales rounded to fp16 here) and g_idx [in] into the GPTQ v1 layout.
inline PackedLinear pack(std::span<const std::uint8_t> q, std::span<const std::uint8_t> zeros, std::span<const float> scales,
                         std::span<const std::int32_t> g_idx, std::int64_t out, std::int64_t in, int bits, int group_size) {
  check_bits(bits);
  PackedLinear p;
  p.bits = bits;
  p.group_size = group_size;
  p.in = in;
  p.out = out;
  const auto g = p.groups();
  check(std::int64_t(q.size()) == out * in, "pack: codes must be [out, in]");
  check(std::int64_t(zeros.size()) == g * out && std::int64_t(scales.size()) == g * out,
        "pack: zeros and scales must be [groups, out] with groups = ceil(in / group_size)");
  check(std::int64_t(g_idx.size()) == in, "pack: g_idx must be [in]");
  const std::uint32_t maxq = (1u << bits) - 1u;
  p.qweight.assign(p.qweight_rows() * out, 0);
  p.qzeros.assign(g * p.qzeros_cols(), 0);
  p.scales.resize(g * out);
  p.g_idx.assign(g_idx.begin(), g_idx.end());
  // Output row o fills column o of qweight alone: threads take ranges of rows. Each word is assembled whole from its
  // row's codes and written once, for kTile rows side by side (one cache line of qweight), not code by code down a
  // column whose words lie `out` apart.
  constexpr std::int64_t kTile = 16;
  std::atomic<bool> out_of_range{false};
  std::int32_t* const qweight = p.qweight.data();
  const std::int64_t words = p.qweight_rows();
  kernels::cpu::parallel_rows(out, in, [&, codes = q.data()](int, std::int64_t r0, std::int64_t r1) {
    std::uint8_t widest = 0;
    for (std::int64_t i = r0 * in; i < r1 * in; ++i) widest = std::max(widest, codes[i]);
    if (widest > maxq) out_of_range = true;
    const auto fill = [&]<int Bits>() {
      for (std::int64_t t0 = r0; t0 < r1; t0 += kTile) {
        const std::int64_t t1 = std::min(r1, t0 + kTile);
        for (std::int64_t w = 0; w < words; ++w)
          for (std::int64_t o = t0; o < t1; ++o) qweight[w * out + o] = std::int32_t(stream_word<Bits>(codes + o * in, in, w));
      }
    };
    switch (bits) {  // check_bits above: one of these
      case 2:
        fill.template operator()<2>();
        break;
      case 3:
        fill.template operator()<3>();
        break;
      case 4:
        fill.template operator()<4>();
        break;
      default:
        fill.template operator()<8>();
        break;
    }
  });
  check(!out_of_range, "pack: code out of range for the bit width");
  for (std::int64_t gi = 0; gi < g; ++gi)
    for (std::int64_t o = 0; o < out; ++o) {
      const std::uint32_t z = zeros[gi * out + o];
      check(z <= maxq, "pack: zero point out of range for the bit width");
      stream_put(p.qzeros.data() + gi * p.qzeros_cols(), 1, o, bits, (z - 1u) & maxq);  // v1: zero - 1
      p.scales[gi * out + o] = from_float<half>(scales[gi * out + o]);
    }
  p.validate();
  return p;
}

// The layer whose output rows are those of `pieces` in order ([out_0 + out_1 + ..., in]): what pack gives for the whole
// codes, zero points and scales. Every piece has the same bits, group, in and g_idx, no bias, and all but the last
// a multiple of 32 outputs (the zero points' bit stream runs along the outputs: 32 fill whole words).
inline PackedLinear concat_outputs(std::span<const PackedLinear> pieces) {
  check(!pieces.empty(), "concat_outputs: no pieces");
  PackedLinear p;
  const PackedLinear& first = pieces.front();
  p.bits = first.bits;
  p.group_size = first.group_size;
  p.in = first.in;
  p.g_idx = first.g_idx;
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    const PackedLinear& q = pieces[k];
    const std::string at = "concat_outputs: piece " + std::to_string(k);
    check(q.bits == p.bits && q.group_size == p.group_size && q.in == p.in && q.g_idx == p.g_idx,
          at + " differs in bits, group, inputs or g_idx from the first");
    check(q.bias.empty(), at + " has a bias: set the whole layer's after concatenating");
    check(k + 1 == pieces.size() || q.out % 32 == 0, at + " has " + std::to_string(q.out) + " outputs, not a multiple of 32");
    p.out += q.out;
  }
  const std::int64_t g = p.groups(), words = p.qweight_rows(), zero_words = p.qzeros_cols();
  p.qweight.resize(std::size_t(words * p.out));
  p.qzeros.resize(std::size_t(g * zero_words));
  p.scales.resize(std::size_t(g * p.out));
  std::int64_t o0 = 0, z0 = 0;  // where the piece's outputs and zero-point words start
  for (const PackedLinear& q : pieces) {
    const std::int64_t zw = q.qzeros_cols();
    for (std::int64_t w = 0; w < words; ++w) std::copy_n(q.qweight.data() + w * q.out, q.out, p.qweight.data() + w * p.out + o0);
    for (std::int64_t gi = 0; gi < g; ++gi) {
      std::copy_n(q.qzeros.data() + gi * zw, zw, p.qzeros.data() + gi * zero_words + z0);
      std::copy_n(q.scales.data() + gi * q.out, q.out, p.scales.data() + gi * p.out + o0);
    }
    o0 += q.out;
    z0 += zw;
  }
  p.validate();
  return p;
}

// Codes back as [out, in] (the inverse of pack's first argument).
inline std::vector<std::uint8_t> unpack_codes(const PackedLinear& p) {
  std::vector<std::uint8_t> q(p.out * p.in);
  for (std::int64_t o = 0; o < p.out; ++o)
    for (std::int64_t i = 0; i < p.in; ++i) q[o * p.in + i] = std::uint8_t(p.code(i, o));
  return q;
}
// Zero points back as [groups, out] (true zeros, the +1 of v1 undone).
inline std::vector<std::uint8_t> unpack_zeros(const PackedLinear& p) {
  std::vector<std::uint8_t> z(p.groups() * p.out);
  for (std::int64_t g = 0; g < p.groups(); ++g)
    for (std::int64_t o = 0; o < p.out; ++o) z[g * p.out + o] = std::uint8_t(p.zero(g, o));
  return z;
}

// Dequantized weights W [out, in] in float (the reference every kernel is tested against).
inline std::vector<float> dequantize(const PackedLinear& p) {
  p.validate();
  std::vector<float> w(p.out * p.in);
  for (std::int64_t i = 0; i < p.in; ++i) {
    const std::int64_t g = p.g_idx[i];
    for (std::int64_t o = 0; o < p.out; ++o) w[o * p.in + i] = p.scale(g, o) * (float(p.code(i, o)) - float(p.zero(g, o)));
  }
  return w;
}

}  // namespace squeeze::quant
