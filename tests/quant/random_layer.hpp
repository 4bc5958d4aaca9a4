#pragma once
// Random GPTQ layers and activations for the quant kernel tests (CPU twins and CUDA kernels alike).
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include <squeeze/dtype.hpp>
#include <squeeze/quant/rtn.hpp>

namespace squeeze::test {

// A random packed layer (RTN of normal weights, asymmetric); act_order shuffles g_idx into equal-size groups
// (what GPTQ writes).
inline quant::PackedLinear random_layer(std::int64_t out, std::int64_t in, int bits, int group, bool act_order, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 0.02f);
  std::vector<float> w(out * in);
  for (auto& v : w) v = nd(rng);
  auto p = quant::rtn_quantize(w, out, in, {.bits = bits, .group_size = group, .sym = false});
  if (act_order && group > 0) {
    std::vector<std::int32_t> perm(in);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (std::int64_t j = 0; j < in; ++j) p.g_idx[perm[j]] = std::int32_t(j / group);
  }
  return p;
}
// n standard-normal activations rounded to T
template <class T>
std::vector<T> random_x(std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<T> x(n);
  for (auto& v : x) v = from_float<T>(nd(rng));
  return x;
}

}  // namespace squeeze::test
