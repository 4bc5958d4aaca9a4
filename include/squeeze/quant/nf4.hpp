#pragma once
// NF4 codec on host memory (torch-free): quantise a weight tensor of fp32 / fp16 / bf16 values into the
// packed layout of squeeze/kernels/quant/nf4.hpp (codes, block absmax, DoubleQuant), dequantise it, and
// count its bytes (== plan::quantized_matrix_bytes<Quantized<4, NF4, ...>> for an even element count; an odd
// count needs one more code byte, which the planner leaves out).
//
//   auto p = quant::nf4_quantize<Quantized<4, NF4, DoubleQuant>>(w.data(), w.size());
//   std::vector<bf16> back(p.n);  quant::nf4_dequantize(p, back.data());
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../dtype.hpp"
#include "../error.hpp"
#include "../policy/quantization.hpp"
#include "squeeze/kernels/quant/nf4.hpp"

namespace squeeze::quant {

struct Nf4Options {
  int block = 64;             // values per absmax (Group<G>)
  bool double_quant = false;  // 8-bit absmax, one fp32 scale per 256 blocks + one fp32 offset
};

// Options of a Quantized<4, NF4, ...> policy.
template <class Q>
constexpr Nf4Options nf4_options() {
  static_assert(std::is_same_v<typename Q::method, NF4>, "nf4_options<Q> takes a Quantized<4, NF4[, DoubleQuant][, Group<G>]> policy");
  return Nf4Options{Q::group, Q::double_quant};
}

// One packed tensor on the host (see kernels/quant/nf4.hpp for the layout).
struct Nf4Packed {
  std::int64_t n = 0;
  int block = 64;
  bool double_quant = false;
  std::vector<std::uint8_t> codes;       // [ceil(n/2)], value 2j in the high nibble
  std::vector<float> absmax;             // [blocks] (plain)
  std::vector<std::int8_t> absmax_q;     // [blocks] (DoubleQuant)
  std::vector<float> absmax_scale;       // [ceil(blocks/256)] (DoubleQuant)
  float absmax_offset = 0.f;             // (DoubleQuant)

  std::int64_t blocks() const { return kernels::quant::nf4_blocks(n, block); }
  // Bytes of storage: codes + scales (+ DoubleQuant's scales and offset).
  std::int64_t bytes() const {
    if (double_quant) return std::int64_t(codes.size()) + std::int64_t(absmax_q.size()) + 4 * std::int64_t(absmax_scale.size()) + 4;
    return std::int64_t(codes.size()) + 4 * std::int64_t(absmax.size());
  }
  kernels::quant::Nf4View view() const {
    return {codes.data(), double_quant ? nullptr : absmax.data(), double_quant ? absmax_q.data() : nullptr,
            double_quant ? absmax_scale.data() : nullptr, absmax_offset, n, block, double_quant};
  }
};

// Quantises w [n] (any shape, flattened row-major). Throws squeeze::Error on n <= 0, a bad block size,
// a null pointer, or a non-finite weight (naming its index).
template <FloatingElement T>
Nf4Packed nf4_quantize(const T* w, std::int64_t n, const Nf4Options& o = {}) {
  namespace kq = kernels::quant;
  kq::nf4_validate(n, o.block, "nf4_quantize");
  check(w != nullptr, "nf4_quantize: weight pointer is null");
  for (std::int64_t i = 0; i < n; ++i)
    check(std::isfinite(to_float(w[i])), "nf4_quantize: weight " + std::to_string(i) + " is not finite (" + std::to_string(to_float(w[i])) + ")");
  Nf4Packed p;
  p.n = n;
  p.block = o.block;
  p.double_quant = o.double_quant;
  const std::int64_t blocks = p.blocks();
  p.absmax.resize(std::size_t(blocks));
  kq::nf4_absmax_cpu(w, n, o.block, p.absmax.data());
  if (o.double_quant) {
    p.absmax_q.resize(std::size_t(blocks));
    p.absmax_scale.resize(std::size_t(kq::nf4_dq_groups(blocks)));
    kq::nf4_double_quantize_cpu(p.absmax.data(), blocks, p.absmax_q.data(), p.absmax_scale.data(), &p.absmax_offset);
    p.absmax = {};  // the decoder (and the encoder below) use absmax' only
  }
  p.codes.resize(std::size_t(kq::nf4_code_bytes(n)));
  kq::nf4_encode_cpu(p.view(), w, p.codes.data());
  return p;
}

template <class Q, FloatingElement T>
Nf4Packed nf4_quantize(const T* w, std::int64_t n) {
  return nf4_quantize(w, n, nf4_options<Q>());
}

// out [n] = dequantised values.
template <FloatingElement T>
void nf4_dequantize(const Nf4Packed& p, T* out) {
  kernels::quant::nf4_dequantize_cpu(p.view(), out);
}

}  // namespace squeeze::quant
