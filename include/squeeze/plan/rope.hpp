#pragma once
// RoPE scaling parameters and the inverse frequencies they give, torch-free and JSON-free, so both the
// config.json reader (io/hf_config.hpp) and the model (nn/llama.hpp) use the one formula.
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <string_view>
#include <vector>

#include "squeeze/error.hpp"

namespace squeeze::plan {

enum class RopeType { Default, Linear, Llama3 };

inline std::string_view rope_type_name(RopeType t) {
  switch (t) {
    case RopeType::Linear:
      return "linear";
    case RopeType::Llama3:
      return "llama3";
    default:
      return "default";
  }
}

struct RopeScaling {
  RopeType type = RopeType::Default;
  double factor = 1.0;                                   // linear and llama3
  double low_freq_factor = 1.0;                          // llama3
  double high_freq_factor = 4.0;                         // llama3
  std::int64_t original_max_position_embeddings = 8192;  // llama3: the context the model was pretrained with
  bool operator==(const RopeScaling&) const = default;
};

// ---- inverse frequencies --------------------------------------------------------------------------------------
// The head_dim / 2 inverse frequencies theta^(-2i / head_dim), i = 0 .. head_dim/2 - 1, after scaling:
//   linear: each divided by factor.
//   llama3 (Llama 3.1): with L = original_max_position_embeddings and wavelength w = 2 pi / f, frequencies
//     whose wavelength is shorter than L / high_freq_factor are kept, those longer than L / low_freq_factor
//     are divided by factor, and in between the two are blended: with s = (L / w - low_freq_factor) /
//     (high_freq_factor - low_freq_factor), f' = (1 - s) f / factor + s f.
// Double precision (transformers computes the same in float32: they agree to about 1e-7 relative). Neither
// type rescales attention (its attention factor is 1).
inline std::vector<double> rope_inv_freq(std::int64_t head_dim, double theta, const RopeScaling& scaling) {
  check(head_dim > 0 && head_dim % 2 == 0, "rope_inv_freq: head_dim must be positive and even, got " + std::to_string(head_dim));
  check(theta > 0, "rope_inv_freq: theta must be positive");
  std::vector<double> f(std::size_t(head_dim / 2));
  for (std::size_t i = 0; i < f.size(); ++i) f[i] = std::pow(theta, -double(2 * i) / double(head_dim));
  if (scaling.type == RopeType::Linear) {
    for (auto& x : f) x /= scaling.factor;
  } else if (scaling.type == RopeType::Llama3) {
    check(scaling.high_freq_factor > scaling.low_freq_factor, "rope_inv_freq: llama3 needs high_freq_factor > low_freq_factor");
    const double L = double(scaling.original_max_position_embeddings);
    const double short_wavelen = L / scaling.high_freq_factor;  // shorter than this: unchanged
    const double long_wavelen = L / scaling.low_freq_factor;    // longer than this: divided by factor
    for (auto& x : f) {
      const double w = 2.0 * std::numbers::pi / x;
      if (w < short_wavelen) continue;
      if (w > long_wavelen) {
        x /= scaling.factor;
        continue;
      }
      const double s = (L / w - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor);
      x = (1.0 - s) * x / scaling.factor + s * x;
    }
  }
  return f;
}

}  // namespace squeeze::plan
