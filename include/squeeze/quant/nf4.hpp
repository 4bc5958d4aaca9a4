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

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"
#include "squeeze/policy/quantization.hpp"
#include "squeeze/quant/bnb_dynamic_map.hpp"
#include "squeeze/kernels/quant/nf4.hpp"

namespace squeeze::quant {

struct Nf4Options {
  int block = 64;             // values per absmax (Group<G>)
  bool double_quant = false;  // bitsandbytes' nested absmax: 8-bit dynamic-map codes, one fp32 absmax per 256 blocks, one offset
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
  std::vector<std::uint8_t> codes;        // [ceil(n/2)], value 2j in the high nibble
  std::vector<float> absmax;              // [blocks] (plain)
  std::vector<std::uint8_t> absmax_code;  // [blocks] (DoubleQuant)
  std::vector<float> nested_absmax;       // [ceil(blocks/256)] (DoubleQuant)
  std::vector<float> nested_map;          // [256] (DoubleQuant: bnb_dynamic_map(), or a file's own map)
  float absmax_offset = 0.f;              // (DoubleQuant)

  std::int64_t blocks() const { return kernels::quant::nf4_blocks(n, block); }
  // Bytes of storage: codes + scales (+ DoubleQuant's nested absmax, offset and map, which each weight holds as in
  // bitsandbytes).
  std::int64_t bytes() const {
    if (double_quant)
      return std::int64_t(codes.size()) + std::int64_t(absmax_code.size()) + 4 * std::int64_t(nested_absmax.size()) + 4 +
             4 * std::int64_t(nested_map.size());
    return std::int64_t(codes.size()) + 4 * std::int64_t(absmax.size());
  }
  kernels::quant::Nf4View view() const {
    if (!double_quant) return {.codes = codes.data(), .absmax = absmax.data(), .n = n, .block = block};
    return {.codes = codes.data(),
            .absmax_code = absmax_code.data(),
            .nested_absmax = nested_absmax.data(),
            .nested_map = nested_map.data(),
            .absmax_offset = &absmax_offset,
            .n = n,
            .block = block,
            .double_quant = true};
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
    check(std::isfinite(to_float(w[i])),
          "nf4_quantize: weight " + std::to_string(i) + " is not finite (" + std::to_string(to_float(w[i])) + ")");
  Nf4Packed p;
  p.n = n;
  p.block = o.block;
  p.double_quant = o.double_quant;
  const std::int64_t blocks = p.blocks();
  p.absmax.resize(std::size_t(blocks));
  kq::nf4_absmax_cpu(w, n, o.block, p.absmax.data());
  p.codes.resize(std::size_t(kq::nf4_code_bytes(n)));
  kq::nf4_encode_cpu(w, n, o.block, p.absmax.data(), p.codes.data());  // against the exact absmax, as bitsandbytes
  if (o.double_quant) {
    p.absmax_code.resize(std::size_t(blocks));
    p.nested_absmax.resize(std::size_t(kq::nf4_dq_groups(blocks)));
    p.nested_map.assign(bnb_dynamic_map().begin(), bnb_dynamic_map().end());
    kq::nf4_double_quantize_cpu(p.absmax.data(), blocks, p.nested_map.data(), p.absmax_code.data(), p.nested_absmax.data(),
                                &p.absmax_offset);
    p.absmax = {};  // the decoder uses absmax' only
  }
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
