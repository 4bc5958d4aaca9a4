#pragma once
// Round-to-nearest quantization and the GPTQ v1 bit packing on libtorch tensors, on the tensors' own device (CPU or
// CUDA: plain torch ops, no kernels of their own). They compute what the torch-free quant::rtn_quantize and
// quant::pack compute, bit for bit (tests/quant/test_gptq.cpp, RtnOnTensors.*), without a host round trip of the
// float weights:
//   grid_from_range  quant::find_grid on tensors of group minima and maxima. Every step is one IEEE float op, as in
//                    find_grid; divisions are by tensors, never by a scalar (CUDA turns a division by a scalar into a
//                    multiplication by its reciprocal, which rounds differently)
//   rtn_quantize     W [out, in] -> codes, grids and W_hat, one grid per output row and group of group_size inputs
//   pack_linear      codes, zero points, scales and g_idx -> quant::PackedLinear: on a GPU the bit streams are built
//                    on the device a piece of rows at a time and only the packed words come to the host; CPU tensors
//                    go to quant::pack
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "squeeze/quant/pack.hpp"
#include "squeeze/quant/rtn.hpp"

namespace squeeze::nn {

// The grid of quant::find_grid, elementwise: scale (fp16-representable) and zero point, float tensors of one shape.
struct TensorGrid {
  torch::Tensor scale, zero;
};

inline constexpr double kSmallestHalfSubnormal = 5.9604645e-8;  // find_grid's floor on the scale

inline TensorGrid grid_from_range(const torch::Tensor& xmin, const torch::Tensor& xmax, int bits, bool sym) {
  TORCH_CHECK(quant::supported_bits(bits), "grid_from_range: bits must be 2, 3, 4 or 8, got ", bits);
  TORCH_CHECK(xmin.sizes() == xmax.sizes(), "grid_from_range: minima ", xmin.sizes(), " and maxima ", xmax.sizes(), " differ in shape");
  const auto round_to_half = [](const torch::Tensor& t) { return t.to(torch::kHalf).to(torch::kFloat32); };
  const double maxq = double((1u << bits) - 1u);
  torch::Tensor lo = xmin.to(torch::kFloat32).clamp_max(0.0), hi = xmax.to(torch::kFloat32).clamp_min(0.0);
  if (sym) {
    hi = torch::maximum(-lo, hi);
    lo = torch::where(lo < 0, -hi, lo);
  }
  const torch::Tensor all_zero = (lo == 0) & (hi == 0);
  lo = torch::where(all_zero, -1.0, lo);
  hi = torch::where(all_zero, 1.0, hi);
  const torch::Tensor maxq_t = torch::full_like(lo, maxq);  // a tensor divisor: see the header comment
  torch::Tensor scale = round_to_half((hi - lo) / maxq_t).clamp_min(kSmallestHalfSubnormal);
  torch::Tensor zero;
  if (sym) {
    zero = torch::full_like(lo, (maxq + 1) / 2);
  } else {
    zero = torch::round(-lo / scale).clamp(0.0, maxq);  // round: half to even, as rintf
    // v1 stores zero - 1 and cannot hold -1: a zero of 0 (all values >= 0) becomes 1, the scale stretched over [.., hi]
    const torch::Tensor no_zero = zero == 0;
    const torch::Tensor stretched = round_to_half(hi / (maxq_t - 1.0)).clamp_min(kSmallestHalfSubnormal);
    zero = torch::where(no_zero, 1.0, zero);
    scale = torch::where(no_zero, stretched, scale);
  }
  return {scale, zero};
}

// quant::grid_fits_half on every grid: a scale past fp16's range (the weights' range too wide) cannot be stored.
inline void check_grid_fits_half(const TensorGrid& g, const char* what) {
  TORCH_CHECK(!(g.scale > 65504.0).any().item<bool>(), what, ": weight range too large for an fp16 scale");
}

// Codes q = clamp(round(x / scale) + zero, 0, maxq) and their values scale * (q - zero) (quantize_code,
// dequantize_code), the grid broadcast against x.
inline std::pair<torch::Tensor, torch::Tensor> quantize_on_grid(const torch::Tensor& x, const TensorGrid& g, int bits) {
  const double maxq = double((1u << bits) - 1u);
  // in place after the first op of each: two tensors of x's size allocated, not six (the same IEEE ops either way)
  torch::Tensor codes = x / g.scale;
  codes.round_().add_(g.zero).clamp_(0.0, maxq);
  torch::Tensor values = codes - g.zero;
  values.mul_(g.scale);
  return {codes, values};
}

// ---- packing ---------------------------------------------------------------------------------------------
// On a device, layers are quantized and packed a piece of output rows at a time (a multiple of 32, at most
// kRtnPieceValues values), so the temporaries stay those of one piece whatever the layer's size.
inline constexpr std::int64_t kRtnPieceValues = std::int64_t(1) << 25;  // about 0.7 GB of temporaries a piece
// Device bytes a value of a piece takes at most while it is packed: the float copy, codes and values (4 each) and the
// uint8 codes of rtn_quantize, then the packing's int64 codes (8) and a word's shifted fields beside the kept result.
inline constexpr std::int64_t kRtnDeviceBytesPerValue = 20;
inline std::int64_t rtn_piece_rows(std::int64_t in) { return std::max<std::int64_t>(32, kRtnPieceValues / in / 32 * 32); }

// quant::concat_outputs with a torch error, as the rest of this file reports; a single piece is moved out, not copied
// (most layers are one piece).
inline quant::PackedLinear join_pieces(std::vector<quant::PackedLinear>&& pieces, const char* what) {
  if (pieces.size() == 1) return std::move(pieces.front());
  quant::PackedLinear whole;
  try {
    whole = quant::concat_outputs(pieces);
  } catch (const squeeze::Error& e) {
    TORCH_CHECK(false, what, ": ", e.what());
  }
  return whole;
}

// Codes [rows, n] (any integer or float dtype holding values < 2^bits) as the format's little-endian bit stream along
// each row: int32 [rows, packed_words(n, bits)], the unused high bits of a row's last word zero (quant::stream_put's
// words). 32 codes fill `bits` words exactly; word k of such a run holds the codes whose bits overlap [32k, 32k + 32),
// the first shifted right where it started in word k - 1 (3 bits) and the last cut where it goes on into word k + 1.
inline torch::Tensor pack_bit_stream(const torch::Tensor& codes, int bits) {
  TORCH_CHECK(quant::supported_bits(bits), "pack_bit_stream: bits must be 2, 3, 4 or 8, got ", bits);
  TORCH_CHECK(codes.dim() == 2, "pack_bit_stream: codes must be [rows, n], got ", codes.sizes());
  const std::int64_t rows = codes.size(0), n = codes.size(1), runs = (n + 31) / 32;
  const auto i64 = codes.options().dtype(torch::kInt64);
  torch::Tensor c = torch::zeros({rows, runs * 32}, i64);
  c.narrow(1, 0, n).copy_(codes);
  c = c.view({rows, runs, 32});
  std::vector<torch::Tensor> words;  // word k of every run: [rows, runs]
  for (int k = 0; k < bits; ++k) {
    const int first = (32 * k) / bits, last = (32 * k + 31) / bits;  // the codes that overlap word k
    std::vector<std::int64_t> left, right;
    for (int j = first; j <= last; ++j) {
      const int shift = j * bits - 32 * k;  // where code j starts in word k (negative: it started in word k - 1)
      left.push_back(shift > 0 ? shift : 0);
      right.push_back(shift < 0 ? -shift : 0);
    }
    const torch::Tensor part = c.narrow(2, first, last - first + 1);
    const torch::Tensor l = torch::tensor(left, i64), r = torch::tensor(right, i64);
    // disjoint bit fields: their sum is their OR
    words.push_back(torch::bitwise_and(torch::bitwise_left_shift(torch::bitwise_right_shift(part, r), l), 0xffffffffLL).sum(2));
  }
  torch::Tensor w = torch::stack(words, 2).view({rows, runs * bits}).narrow(1, 0, quant::packed_words(n, bits));
  w = torch::where(w >= (std::int64_t(1) << 31), w - (std::int64_t(1) << 32), w);  // the words' bits as int32
  return w.to(torch::kInt32);
}

namespace detail {
inline void check_pack_shapes(const torch::Tensor& codes, const torch::Tensor& zeros, const torch::Tensor& scales,
                              const torch::Tensor& g_idx, int bits, int group_size) {
  TORCH_CHECK(quant::supported_bits(bits), "pack_linear: bits must be 2, 3, 4 or 8, got ", bits);
  TORCH_CHECK(group_size >= 0, "pack_linear: group_size must be >= 0 (0 = per channel), got ", group_size);
  TORCH_CHECK(codes.dim() == 2, "pack_linear: codes must be [out, in], got ", codes.sizes());
  const std::int64_t out = codes.size(0), in = codes.size(1), groups = group_size > 0 ? (in + group_size - 1) / group_size : 1;
  TORCH_CHECK(zeros.dim() == 2 && zeros.size(0) == groups && zeros.size(1) == out && scales.sizes() == zeros.sizes(), "pack_linear: zeros ",
              zeros.sizes(), " and scales ", scales.sizes(), " must be [groups, out] = [", groups, ", ", out, "]");
  TORCH_CHECK(g_idx.dim() == 1 && g_idx.size(0) == in, "pack_linear: g_idx must be [in] = [", in, "], got ", g_idx.sizes());
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && zeros.scalar_type() == torch::kUInt8,
              "pack_linear: codes and zero points must be uint8, got ", codes.scalar_type(), " and ", zeros.scalar_type());
  const std::int64_t maxq = (std::int64_t(1) << bits) - 1;
  TORCH_CHECK(codes.max().item<std::int64_t>() <= maxq, "pack_linear: a code is outside [0, ", maxq, "] for ", bits, " bits");
  TORCH_CHECK(zeros.max().item<std::int64_t>() <= maxq, "pack_linear: a zero point is outside [0, ", maxq, "] for ", bits, " bits");
}

// pack_linear's device path: the bit streams by torch ops where the tensors are, only the packed words to the host.
// The words of tensors check_pack_shapes has accepted (each check reads the codes' maximum back: once a layer).
inline quant::PackedLinear pack_checked_by_tensor_ops(const torch::Tensor& codes, const torch::Tensor& zeros, const torch::Tensor& scales,
                                                      const torch::Tensor& g_idx, int bits, int group_size) {
  quant::PackedLinear p;
  p.bits = bits;
  p.group_size = group_size;
  p.out = codes.size(0);
  p.in = codes.size(1);
  const std::int64_t maxq = (std::int64_t(1) << bits) - 1;
  // Each tensor made contiguous where it is, then copied straight into the host vector that keeps it.
  const auto to_host = [](const torch::Tensor& t, auto& v, torch::ScalarType host_type) {
    const torch::Tensor d = t.contiguous();
    v.resize(std::size_t(d.numel()));
    torch::from_blob(v.data(), d.sizes(), torch::TensorOptions().dtype(host_type)).copy_(d);
  };
  static_assert(sizeof(half) == sizeof(at::Half), "squeeze::half and at::Half must both be the 16 bits of an IEEE binary16");
  to_host(pack_bit_stream(codes, bits).t(), p.qweight, torch::kInt32);                                             // [words(in), out]
  to_host(pack_bit_stream(torch::bitwise_and(zeros.to(torch::kInt64) - 1, maxq), bits), p.qzeros, torch::kInt32);  // v1: zero - 1
  to_host(scales.to(torch::kFloat32).to(torch::kHalf), p.scales, torch::kHalf);
  to_host(g_idx.to(torch::kInt32), p.g_idx, torch::kInt32);
  p.validate();
  return p;
}
inline quant::PackedLinear pack_linear_by_tensor_ops(const torch::Tensor& codes, const torch::Tensor& zeros, const torch::Tensor& scales,
                                                     const torch::Tensor& g_idx, int bits, int group_size) {
  check_pack_shapes(codes, zeros, scales, g_idx, bits, group_size);
  return pack_checked_by_tensor_ops(codes, zeros, scales, g_idx, bits, group_size);
}

// pack_linear_by_tensor_ops on `rows` output rows at a time (a multiple of 32), joined on the host: the device's
// temporaries are those of one piece. The same words as the whole layer packed at once.
inline quant::PackedLinear pack_linear_in_pieces(const torch::Tensor& codes, const torch::Tensor& zeros, const torch::Tensor& scales,
                                                 const torch::Tensor& g_idx, int bits, int group_size, std::int64_t rows) {
  TORCH_CHECK(rows > 0 && rows % 32 == 0, "pack_linear: rows a piece must be a positive multiple of 32, got ", rows);
  check_pack_shapes(codes, zeros, scales, g_idx, bits, group_size);
  std::vector<quant::PackedLinear> pieces;
  for (std::int64_t r0 = 0; r0 < codes.size(0); r0 += rows) {
    const std::int64_t n = std::min(rows, codes.size(0) - r0);
    pieces.push_back(
        pack_checked_by_tensor_ops(codes.narrow(0, r0, n), zeros.narrow(1, r0, n), scales.narrow(1, r0, n), g_idx, bits, group_size));
  }
  return join_pieces(std::move(pieces), "pack_linear");
}
}  // namespace detail

// quant::pack on tensors: codes uint8 [out, in], zeros uint8 and scales [groups, out] (true zero points; scales
// rounded to fp16 here), g_idx [in], on any one device. Values out of range are refused as quant::pack refuses them. CPU tensors go to
// quant::pack itself (its loops beat a dozen passes of int64 tensor ops there); on a GPU the bit streams are built
// on the device, so only the packed words cross to the host.
inline quant::PackedLinear pack_linear(const torch::Tensor& codes, const torch::Tensor& zeros, const torch::Tensor& scales,
                                       const torch::Tensor& g_idx, int bits, int group_size) {
  if (!codes.is_cpu())
    return detail::pack_linear_in_pieces(codes, zeros, scales, g_idx, bits, group_size,
                                         rtn_piece_rows(std::max<std::int64_t>(1, codes.size(-1))));
  detail::check_pack_shapes(codes, zeros, scales, g_idx, bits, group_size);
  const torch::Tensor c = codes.contiguous(), z = zeros.contiguous();
  const torch::Tensor s = scales.to(torch::kCPU, torch::kFloat32).contiguous(), g = g_idx.to(torch::kCPU, torch::kInt32).contiguous();
  return quant::pack({c.data_ptr<std::uint8_t>(), std::size_t(c.numel())}, {z.data_ptr<std::uint8_t>(), std::size_t(z.numel())},
                     {s.data_ptr<float>(), std::size_t(s.numel())}, {g.data_ptr<std::int32_t>(), std::size_t(g.numel())}, c.size(0),
                     c.size(1), bits, group_size);
}

// ---- round to nearest --------------------------------------------------------------------------------------
struct RtnResult {
  torch::Tensor codes;        // uint8 [out, in]
  torch::Tensor scales;       // float [groups, out] (fp16-representable)
  torch::Tensor zeros;        // uint8 [groups, out] (true zero points)
  torch::Tensor g_idx;        // int32 [in]: i / group_size
  torch::Tensor dequantized;  // float [out, in]: W_hat
  int bits = 4, group_size = 0;
  quant::PackedLinear pack() const { return pack_linear(codes, zeros, scales, g_idx, bits, group_size); }
};

// quant::rtn_quantize on W [out, in] on its device: one grid per output row and group of group_size consecutive inputs
// (0: the whole row), the last group shorter where group_size does not divide in.
inline RtnResult rtn_quantize(const torch::Tensor& weight, int bits, int group_size, bool sym) {
  TORCH_CHECK(quant::supported_bits(bits), "rtn: bits must be 2, 3, 4 or 8, got ", bits);
  TORCH_CHECK(group_size >= 0, "rtn: group_size must be >= 0 (0 = per channel), got ", group_size);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) > 0 && weight.size(1) > 0, "rtn: weights must be [out, in] with out, in > 0, got ",
              weight.sizes());
  const torch::Tensor W = weight.detach().to(torch::kFloat32).contiguous();
  TORCH_CHECK(W.isfinite().all().item<bool>(), "rtn: weight is not finite (NaN or inf)");
  const std::int64_t out = W.size(0), in = W.size(1), gs = group_size > 0 ? group_size : in, groups = (in + gs - 1) / gs;
  // [out, groups, gs]: a short last group padded with its own first value, which leaves its minimum and maximum as they are
  torch::Tensor grouped = W;
  if (groups * gs != in) {
    const torch::Tensor fill = W.narrow(1, (groups - 1) * gs, 1).expand({out, groups * gs - in});
    grouped = torch::cat({W, fill}, 1);
  }
  grouped = grouped.view({out, groups, gs});
  const TensorGrid grid = grid_from_range(grouped.amin(2, /*keepdim=*/true), grouped.amax(2, /*keepdim=*/true), bits, sym);
  check_grid_fits_half(grid, "rtn");
  auto [codes, dequantized] = quantize_on_grid(grouped, grid, bits);
  RtnResult r;
  r.bits = bits;
  r.group_size = group_size;
  r.codes = codes.view({out, groups * gs}).narrow(1, 0, in).to(torch::kUInt8);
  r.dequantized = dequantized.view({out, groups * gs}).narrow(1, 0, in).contiguous();
  r.scales = grid.scale.view({out, groups}).t().contiguous();
  r.zeros = grid.zero.view({out, groups}).t().to(torch::kUInt8).contiguous();
  r.g_idx = torch::div(torch::arange(in, W.options().dtype(torch::kInt64)), gs, "floor").to(torch::kInt32);
  return r;
}

// The packed layer quant::rtn_quantize gives for W [out, in], computed on W's device `rows` output rows at a time (a
// multiple of 32): each piece quantized and packed there, the pieces joined on the host (quant::concat_outputs), so
// the device's temporaries (kRtnDeviceBytesPerValue a value) stay those of rows x in values. Bit for bit
// quant::rtn_quantize.
inline quant::PackedLinear rtn_pack(const torch::Tensor& weight, const quant::RtnOptions& o, std::int64_t rows) {
  TORCH_CHECK(rows > 0 && rows % 32 == 0, "rtn_pack: rows must be a positive multiple of 32, got ", rows);
  TORCH_CHECK(weight.dim() == 2 && weight.numel() > 0, "rtn_pack: weights must be a non-empty [out, in], got ", weight.sizes());
  std::vector<quant::PackedLinear> pieces;
  for (std::int64_t r0 = 0; r0 < weight.size(0); r0 += rows)
    pieces.push_back(rtn_quantize(weight.narrow(0, r0, std::min(rows, weight.size(0) - r0)), o.bits, o.group_size, o.sym).pack());
  return join_pieces(std::move(pieces), "rtn_pack");
}

}  // namespace squeeze::nn
