#pragma once
// The uniform quantization grid (shared by RTN and GPTQ) and round-to-nearest quantization, torch-free.
//
// Grid of one group of weights (the GPTQ reference quantizer's rule):
//   lo = min(min x, 0), hi = max(max x, 0)
//   symmetric:  hi = max(-lo, hi), lo = -hi when lo < 0;   zero = (maxq + 1) / 2
//   asymmetric: zero = round(-lo / scale)
//   scale = (hi - lo) / maxq,  lo == hi == 0 -> [-1, 1]
// Two deviations that make the grid exactly what the v1 checkpoint stores: the scale is rounded to fp16
// before codes are chosen (the file holds fp16 scales), and an asymmetric zero of 0 (all weights >= 0) is
// moved to 1 with the scale widened to hi / (maxq - 1), because v1 stores zero - 1 and cannot hold -1.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "pack.hpp"

namespace squeeze::quant {

struct Grid {
  float scale;         // fp16-representable, > 0
  std::uint32_t zero;  // in [0, maxq]
};

SQUEEZE_HD float round_to_half(float x) { return to_float(from_float<half>(x)); }

// Grid for a group whose values span [xmin, xmax].
SQUEEZE_HD Grid find_grid(float xmin, float xmax, int bits, bool sym) {
  const float maxq = float((1u << bits) - 1u);
  float lo = fminf(xmin, 0.f), hi = fmaxf(xmax, 0.f);
  if (sym) {
    hi = fmaxf(-lo, hi);
    if (lo < 0.f) lo = -hi;
  }
  if (lo == 0.f && hi == 0.f) {
    lo = -1.f;
    hi = 1.f;
  }
  float scale = fmaxf(round_to_half((hi - lo) / maxq), 5.9604645e-8f);  // >= fp16's smallest subnormal
  float zero;
  if (sym) {
    zero = (maxq + 1.f) * 0.5f;
  } else {
    zero = fminf(fmaxf(rintf(-lo / scale), 0.f), maxq);
    if (zero == 0.f) {  // v1 cannot store zero 0: use zero 1 and stretch the scale over [.., hi]
      zero = 1.f;
      scale = fmaxf(round_to_half(hi / (maxq - 1.f)), 5.9604645e-8f);
    }
  }
  return {scale, std::uint32_t(zero)};
}

// Code of x on the grid, and its value.
SQUEEZE_HD std::uint32_t quantize_code(float x, Grid g, int bits) {
  const float maxq = float((1u << bits) - 1u);
  return std::uint32_t(fminf(fmaxf(rintf(x / g.scale) + float(g.zero), 0.f), maxq));
}
SQUEEZE_HD float dequantize_code(std::uint32_t q, Grid g) { return g.scale * (float(q) - float(g.zero)); }

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
