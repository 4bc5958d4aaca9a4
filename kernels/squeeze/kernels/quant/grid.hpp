#pragma once
// The uniform quantization grid (shared by RTN, the GPTQ solve and its CUDA kernel), host and device. Plain C++.
//
// Grid of one group of weights (the GPTQ reference quantizer's rule):
//   lo = min(min x, 0), hi = max(max x, 0)
//   symmetric:  hi = max(-lo, hi), lo = -hi when lo < 0;   zero = (maxq + 1) / 2
//   asymmetric: zero = round(-lo / scale)
//   scale = (hi - lo) / maxq,  lo == hi == 0 -> [-1, 1]
// Two deviations that make the grid exactly what the v1 checkpoint stores: the scale is rounded to fp16 before codes
// are chosen (the file holds fp16 scales), and an asymmetric zero of 0 (all weights >= 0) is moved to 1 with the scale
// widened to hi / (maxq - 1), because v1 stores zero - 1 and cannot hold -1.
#include <cmath>
#include <cstdint>

#include "squeeze/dtype.hpp"

namespace squeeze::kernels::quant {

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

}  // namespace squeeze::kernels::quant
