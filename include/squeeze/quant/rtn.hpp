#pragma once
// Round-to-nearest quantization, torch-free. The grid (find_grid, quantize_code, ...) is kernels/quant/grid.hpp's,
// which the GPTQ solve kernel shares.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "squeeze/kernels/cpu_parallel.hpp"
#include "squeeze/kernels/quant/grid.hpp"

#include "squeeze/quant/pack.hpp"

namespace squeeze::quant {

using kernels::quant::dequantize_code;
using kernels::quant::find_grid;
using kernels::quant::Grid;
using kernels::quant::quantize_code;
using kernels::quant::round_to_half;

namespace detail {
// One group's values [x, x + n): their min and max, and whether all are finite (x - x is 0 only for finite x). The loops
// are compiled for the host's vector width (SQUEEZE_CPU_CLONES: AVX2 rounds 8 floats an instruction, the baseline calls
// rintf); the same IEEE operations in any width, so the same bits.
SQUEEZE_CPU_CLONES inline bool group_range(const float* x, std::int64_t n, float& mn, float& mx) {
  float lo = x[0], hi = x[0], nonfinite = 0.f;
  for (std::int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    nonfinite += x[i] - x[i];  // NaN as soon as one value is NaN or infinite
  }
  mn = lo, mx = hi;
  return nonfinite == 0.f;
}
// quantize_code of each value on grid g, as bytes (inlined into the vector loop).
SQUEEZE_CPU_CLONES inline void group_codes(const float* x, std::int64_t n, Grid g, int bits, std::uint8_t* codes) {
  for (std::int64_t i = 0; i < n; ++i) codes[i] = std::uint8_t(quantize_code(x[i], g, bits));
}
}  // namespace detail

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
  // Rows are independent: each thread rounds a range of output rows (a 70B block is 0.86 G values). A row records its
  // first failure; the first failing row is reported, as a serial pass would.
  enum Failure : std::uint8_t { none, not_finite, too_wide };
  std::vector<Failure> failure(out, none);
  kernels::cpu::parallel_rows(out, in, [&](int, std::int64_t r0, std::int64_t r1) {
    for (std::int64_t o = r0; o < r1; ++o) {
      const float* row = w.data() + o * in;
      std::uint8_t* codes = q.data() + o * in;
      for (std::int64_t g = 0; g < groups; ++g) {
        const std::int64_t i0 = g * gs, i1 = std::min(in, i0 + gs);
        float mn, mx;
        const bool finite = detail::group_range(row + i0, i1 - i0, mn, mx);
        const Grid grid = find_grid(mn, mx, opt.bits, opt.sym);
        failure[o] = !finite ? not_finite : !(std::isfinite(grid.scale) && grid.scale <= 65504.f) ? too_wide : none;
        if (failure[o] != none) break;
        detail::group_codes(row + i0, i1 - i0, grid, opt.bits, codes + i0);
        zeros[g * out + o] = std::uint8_t(grid.zero);
        scales[g * out + o] = grid.scale;
      }
    }
  });
  for (const Failure f : failure) {
    check(f != not_finite, "rtn: weight is not finite (NaN or inf)");
    check(f != too_wide, "rtn: weight range too large for an fp16 scale");
  }
  const auto g_idx = default_g_idx(in, opt.group_size);
  return pack(q, zeros, scales, g_idx, out, in, opt.bits, opt.group_size);
}

}  // namespace squeeze::quant
