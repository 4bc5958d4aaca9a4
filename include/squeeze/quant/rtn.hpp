#pragma once
// Round-to-nearest quantization, torch-free. The grid (find_grid, quantize_code, ...) is kernels/quant/grid.hpp's,
// which the GPTQ solve kernel shares.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "squeeze/kernels/quant/grid.hpp"

#include "squeeze/quant/pack.hpp"

namespace squeeze::quant {

using kernels::quant::dequantize_code;
using kernels::quant::find_grid;
using kernels::quant::Grid;
using kernels::quant::quantize_code;
using kernels::quant::round_to_half;

struct RtnOptions {
  int bits = 4;
  int group_size = 128;  // 0: one group per output channel
  bool sym = false;
};

// Round-to-nearest: W [out, in] row-major floats -> packed GPTQ layout (g_idx = i / group_size).
inline PackedLinear rtn_quantize(std::span<const float> w, std::int64_t out, std::int64_t in, const RtnOptions& opt) {
  check_bits(opt.bits);
  check(opt.group_size >= 0, "rtn: group_size must be >= 0 (0 = per channel)");
  check(out > 0 && in > 0 && std::int64_t(w.size()) == out * in, "rtn: weights must be [out, in] with out, in > 0");
  const std::int64_t gs = opt.group_size > 0 ? opt.group_size : in;
  const std::int64_t groups = (in + gs - 1) / gs;
  std::vector<std::uint8_t> q(out * in), zeros(groups * out);
  std::vector<float> scales(groups * out);
  for (std::int64_t o = 0; o < out; ++o)
    for (std::int64_t g = 0; g < groups; ++g) {
      const std::int64_t i0 = g * gs, i1 = std::min(in, i0 + gs);
      float mn = w[o * in + i0], mx = mn;
      for (std::int64_t i = i0; i < i1; ++i) {
        check(std::isfinite(w[o * in + i]), "rtn: weight is not finite (NaN or inf)");
        mn = std::min(mn, w[o * in + i]);
        mx = std::max(mx, w[o * in + i]);
      }
      const Grid grid = find_grid(mn, mx, opt.bits, opt.sym);
      check(std::isfinite(grid.scale) && grid.scale <= 65504.f, "rtn: weight range too large for an fp16 scale");
      for (std::int64_t i = i0; i < i1; ++i) q[o * in + i] = std::uint8_t(quantize_code(w[o * in + i], grid, opt.bits));
      zeros[g * out + o] = std::uint8_t(grid.zero);
      scales[g * out + o] = grid.scale;
    }
  const auto g_idx = default_g_idx(in, opt.group_size);
  return pack(q, zeros, scales, g_idx, out, in, opt.bits, opt.group_size);
}

}  // namespace squeeze::quant
