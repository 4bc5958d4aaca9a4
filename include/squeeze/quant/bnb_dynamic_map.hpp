#pragma once
// bitsandbytes' 8-bit "dynamic" code (create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)) and
// its blockwise quantization (quantize_blockwise / dequantize_blockwise), which DoubleQuant applies to the
// NF4 absmax values: per block of 256, absmax2 = max|x|, code = the entry nearest x / absmax2, value =
// map[code] * absmax2.
// The map: for e = 0..6, the 2^e midpoints of linspace(0.1, 1, 2^e + 1) times 10^(e-6), with both signs,
// plus 0 and 1, sorted (127 negative, 0 at index 127, 127 positive below 1, 1 at index 255). Computed in
// float32 the way torch does (linspace from both ends, midpoint, then the product), so entries match.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../error.hpp"

namespace squeeze::quant {

inline constexpr int kBnbNestedBlock = 256;  // absmax values per nested absmax (bitsandbytes' default)

namespace detail {
// torch.linspace(start, end, steps) in float32: the first half counted from start, the rest from end.
inline std::vector<float> linspace_f32(float start, float end, int steps) {
  std::vector<float> v(static_cast<std::size_t>(steps));
  const float step = (end - start) / float(steps - 1);
  for (int i = 0; i < steps; ++i) v[i] = i < steps / 2 ? start + step * float(i) : end - step * float(steps - i - 1);
  return v;
}
}  // namespace detail

inline const std::array<float, 256>& bnb_dynamic_map() {
  static const std::array<float, 256> map = [] {
    std::vector<float> data;
    for (int e = 0; e < 7; ++e) {
      const auto b = detail::linspace_f32(0.1f, 1.0f, (1 << e) + 1);
      const float scale = float(std::pow(10.0, e - 6));
      for (std::size_t i = 0; i + 1 < b.size(); ++i) data.push_back((b[i] + b[i + 1]) / 2.0f * scale);
      for (std::size_t i = 0; i + 1 < b.size(); ++i) data.push_back((b[i] + b[i + 1]) / 2.0f * -scale);
    }
    data.push_back(0.0f);
    data.push_back(1.0f);
    std::sort(data.begin(), data.end());
    std::array<float, 256> a{};
    std::copy(data.begin(), data.end(), a.begin());
    return a;
  }();
  return map;
}

// Index of the entry of a sorted `map` nearest x (ties go to the larger entry).
inline std::uint8_t nearest_code(std::span<const float> map, float x) {
  const auto it = std::lower_bound(map.begin(), map.end(), x);
  if (it == map.begin()) return 0;
  if (it == map.end()) return std::uint8_t(map.size() - 1);
  return std::uint8_t((x - *(it - 1) < *it - x ? it - 1 : it) - map.begin());
}

struct BlockwiseCodes {
  std::vector<std::uint8_t> codes;  // [n]
  std::vector<float> absmax;        // [ceil(n / block)]
};

// quantize_blockwise of x [n] against the dynamic map. A block of zeros has absmax 0 and codes of 0.0.
inline BlockwiseCodes bnb_quantize_blockwise(std::span<const float> x, int block = kBnbNestedBlock) {
  check(block > 0 && !x.empty(), "bnb_quantize_blockwise: needs values and a positive block size");
  const auto& map = bnb_dynamic_map();
  const std::size_t blocks = (x.size() + block - 1) / block;
  BlockwiseCodes r{std::vector<std::uint8_t>(x.size()), std::vector<float>(blocks)};
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::size_t lo = b * block, hi = std::min(x.size(), lo + block);
    float m = 0.f;
    for (std::size_t i = lo; i < hi; ++i) m = std::max(m, std::fabs(x[i]));
    r.absmax[b] = m;
    for (std::size_t i = lo; i < hi; ++i) r.codes[i] = nearest_code(map, m > 0.f ? x[i] / m : 0.f);
  }
  return r;
}

// dequantize_blockwise: value i = map[code i] * absmax[i / block] (`map`: 256 entries; the dynamic map by default).
inline std::vector<float> bnb_dequantize_blockwise(std::span<const std::uint8_t> codes, std::span<const float> absmax, int block = kBnbNestedBlock,
                                                   std::span<const float> map = bnb_dynamic_map()) {
  check(block > 0 && std::int64_t(absmax.size()) == (std::int64_t(codes.size()) + block - 1) / block,
        "bnb_dequantize_blockwise: " + std::to_string(codes.size()) + " codes need " +
            std::to_string((codes.size() + block - 1) / block) + " absmax values at block " + std::to_string(block) + ", got " +
            std::to_string(absmax.size()));
  check(map.size() == 256, "bnb_dequantize_blockwise: the code map needs 256 entries, got " + std::to_string(map.size()));
  std::vector<float> v(codes.size());
  for (std::size_t i = 0; i < codes.size(); ++i) v[i] = map[codes[i]] * absmax[i / block];
  return v;
}

}  // namespace squeeze::quant
