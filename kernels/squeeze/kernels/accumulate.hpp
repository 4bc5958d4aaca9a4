#pragma once
// Gradient accumulation: cast-and-add micro-batch gradients (G = float, half or bf16) into fp32 buffers.
//   acc = scale * g            (first micro-batch: overwrite, no separate zero fill)
//   acc = acc + scale * g      (the others)
// Plain C++; the CUDA launchers are in accumulate.cuh and apply the same element functor.
//
// Choosing `scale` so that accumulation gives the one-big-batch gradient. Let the big batch of T tokens
// be split into micro-batches i = 1..k with T_i tokens (sum T_i = T), and let each micro-batch loss be the
// mean over its own tokens, L_i = (1/T_i) sum_{j in i} l_j, with gradient g_i. The big-batch mean loss is
//   L = (1/T) sum_j l_j = sum_i (T_i / T) L_i,   so   grad L = sum_i (T_i / T) g_i.
// Hence scale_i = T_i / T (token-weighted), which is 1/k only when every micro-batch has the same number of
// tokens. A plain 1/k average of per-micro-batch means over-weights short micro-batches (padding, packed
// sequences of different lengths). If the loss is a sum over tokens instead of a mean, scale_i = 1/T.
// Summation order differs from the big batch, so results agree to float rounding, not bitwise.
#include <cstdint>
#include <span>
#include <string>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"
#include "squeeze/kernels/cpu_parallel.hpp"
#include "squeeze/kernels/tensor_list.hpp"

namespace squeeze::kernels {

// One tensor: acc [n] fp32 accumulation buffer, grad [n] micro-batch gradient.
template <class G>
struct AccumTensor {
  float* acc = nullptr;
  const G* grad = nullptr;
  std::int64_t n = 0;
};

template <class G>
void validate(const AccumTensor<G>& t, const std::string& what = "accumulate tensor") {
  static_assert(FloatingElement<G>, "accumulate: gradients must be float, squeeze::half or squeeze::bf16");
  check(t.n >= 0, what + ": negative element count " + std::to_string(t.n));
  if (t.n == 0) return;
  check(t.acc != nullptr, what + ": fp32 accumulation buffer pointer is null");
  check(t.grad != nullptr, what + ": gradient pointer is null");
}

// The element functor.
SQUEEZE_HD float accumulate_element(float acc, float g, float scale, bool overwrite) { return overwrite ? scale * g : acc + scale * g; }

inline void check_accumulate_scale(float scale) {
  check(std::isfinite(scale), "accumulate: scale must be finite, got " + std::to_string(scale));
}

// CPU twin over host buffers, all cores.
template <class G>
void accumulate_cpu(std::span<const AccumTensor<G>> tensors, float scale, bool overwrite) {
  check_accumulate_scale(scale);
  for (std::size_t i = 0; i < tensors.size(); ++i) validate(tensors[i], "accumulate (CPU) tensor " + std::to_string(i));
  for (const auto& t : tensors)
    cpu::parallel_ranges(t.n, [&](int, std::int64_t b, std::int64_t e) {
      float* __restrict__ acc = t.acc;
      const G* __restrict__ g = t.grad;
#pragma omp simd
      for (std::int64_t k = b; k < e; ++k) acc[k] = accumulate_element(acc[k], to_float(g[k]), scale, overwrite);
    });
}

template <class G>
void accumulate_cpu(const AccumTensor<G>& t, float scale, bool overwrite) {
  accumulate_cpu(std::span<const AccumTensor<G>>(&t, 1), scale, overwrite);
}

}  // namespace squeeze::kernels
