#pragma once
// Global gradient norm (L2 or inf) over a list of gradient buffers, and the clip coefficient it feeds.
// Plain C++; CUDA launchers (CUB block reductions, no host sync) in grad_norm.cuh.
//
//   norm      = ||g||_2 = sqrt(sum g^2)   or   ||g||_inf = max |g|       (accumulated in double)
//   norm     *= inv_scale                  (optional: the norm of the unscaled gradient under loss scaling)
//   clip_coef = min(1, max_norm / (norm + 1e-6))   (PyTorch's clip_grad_norm_; 1 when max_norm <= 0)
//   found_inf = 1 if the norm is not finite         (optional: any inf/NaN gradient makes the L2 sum and
//                                                     the max non-finite, so this pass is also the overflow check)
// Non-finite propagation: in double, squares of finite floats (< 1.2e77) cannot overflow the sum, so the
// L2 sum is non-finite exactly when some element is. The max rule below keeps NaN sticky.
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"
#include "squeeze/kernels/cpu_parallel.hpp"
#include "squeeze/kernels/loss_scale.hpp"
#include "squeeze/kernels/tensor_list.hpp"

namespace squeeze::kernels {

enum class NormType { L2, Inf };

// Accumulation rule of each norm, shared by the CPU loop, the CUDA threads and the CUB block reduction.
template <NormType N>
struct NormOp {
  SQUEEZE_HD static double element(double acc, float x) {
    if constexpr (N == NormType::L2) {
      return acc + double(x) * double(x);
    } else {
      const double a = fabs(double(x));
      return (a > acc || a != a) ? a : acc;  // NaN wins and stays
    }
  }
  SQUEEZE_HD double operator()(double a, double b) const {
    if constexpr (N == NormType::L2)
      return a + b;
    else
      return (b > a || b != b) ? b : a;
  }
};

// Where the results go (null = not wanted). Device pointers for CUDA, host pointers for CPU.
struct GradNormOut {
  float* norm = nullptr;
  float* clip_coef = nullptr;
  float* found_inf = nullptr;  // set to 1 when the norm is not finite; never cleared here
  double* reduced = nullptr;   // the accumulator itself, unscaled (L2: the sum of squares; Inf: the largest |g|)
};

// From the reduced accumulator to norm, clip coefficient and overflow flag.
SQUEEZE_HD void grad_norm_finalize(double acc, NormType type, float max_norm, const float* inv_scale, const GradNormOut& out) {
  if (out.reduced != nullptr) *out.reduced = acc;
  double norm = type == NormType::L2 ? sqrt(acc) : acc;
  if (inv_scale != nullptr) norm *= double(*inv_scale);
  const bool finite = norm - norm == 0.0;  // false for inf and NaN
  if (out.norm != nullptr) *out.norm = float(norm);
  if (out.found_inf != nullptr && !finite) *out.found_inf = 1.0f;
  if (out.clip_coef != nullptr) {
    double coef = 1.0;
    if (max_norm > 0 && finite) {
      coef = double(max_norm) / (norm + 1e-6);
      if (coef > 1.0) coef = 1.0;
    }
    *out.clip_coef = float(coef);
  }
}

inline void check_max_norm(float max_norm) {
  check(!std::isnan(max_norm), "grad norm: max_norm is NaN (use 0 or a negative value for no clipping)");
}

// CPU twin: norm of host gradient buffers, all cores. Returns the norm (also written to out.norm).
template <class G>
float grad_norm_cpu(std::span<const Buffer<const G>> grads, NormType type, float max_norm = 0, const float* inv_scale = nullptr,
                    const GradNormOut& out = {}) {
  check_max_norm(max_norm);
  for (std::size_t i = 0; i < grads.size(); ++i) validate(grads[i], "grad norm (CPU): gradient " + std::to_string(i));
  auto run = [&]<NormType N>() {
    double total = 0;
    for (const auto& b : grads) {
      std::vector<double> part(std::size_t(cpu::ranges_for(b.n)), 0.0);
      cpu::parallel_ranges(b.n, [&](int t, std::int64_t begin, std::int64_t end) {
        double acc = 0;
        const G* __restrict__ p = b.data;
        for (std::int64_t k = begin; k < end; ++k) acc = NormOp<N>::element(acc, to_float(p[k]));
        part[std::size_t(t)] = acc;
      });
      for (double x : part) total = NormOp<N>{}(total, x);  // fixed order: deterministic
    }
    return total;
  };
  const double acc = type == NormType::L2 ? run.template operator()<NormType::L2>() : run.template operator()<NormType::Inf>();
  float norm = 0;
  GradNormOut o = out;
  if (o.norm == nullptr) o.norm = &norm;
  grad_norm_finalize(acc, type, max_norm, inv_scale, o);
  return *o.norm;
}

}  // namespace squeeze::kernels
