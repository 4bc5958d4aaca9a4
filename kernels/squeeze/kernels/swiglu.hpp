#pragma once
// SwiGLU, h = silu(g) * u: the element functor, shared with swiglu.cuh, and the CPU twin.
//   forward   h = g * sigmoid(g) * u
//   backward  s = sigmoid(g) (recomputed from g):  du = dh * g * s,  dg = dh * u * s * (1 + g * (1 - s))
// Saved between the passes: g and u only (the unfused path keeps silu(g) as well). fp32 math, one rounding.
// On request forward also writes amax = max |h| as stored, and backward max |dg| and max |du| (the scales of their FP8
// casts, without a pass of their own).
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>
#include <string>

#include "squeeze/kernels/fused_common.hpp"

namespace squeeze::kernels {

template <class Acc>
struct SwigluOp {
  SQUEEZE_HD static Acc sigmoid(Acc g) { return Acc(1) / (Acc(1) + acc_exp(-g)); }
  SQUEEZE_HD static Acc forward(Acc g, Acc u) { return g * sigmoid(g) * u; }
  SQUEEZE_HD static void backward(Acc g, Acc u, Acc dh, Acc& dg, Acc& du) {
    const Acc s = sigmoid(g);
    du = dh * g * s;
    dg = dh * u * s * (Acc(1) + g * (Acc(1) - s));
  }
};

template <FusedElement T>
struct SwigluArgs {
  const T* g = nullptr;   // [n] gate projection
  const T* u = nullptr;   // [n] up projection
  T* h = nullptr;         // [n] forward output (forward only)
  const T* dh = nullptr;  // [n] incoming gradient (backward only)
  T* dg = nullptr;        // [n] (backward only)
  T* du = nullptr;        // [n] (backward only)
  std::int64_t n = 0;
  float* amax = nullptr;     // [] or null, forward only: max |h| as stored, NaN if any h is NaN (for h's FP8 cast)
  float* amax_dg = nullptr;  // [] or null, backward only: max |dg| as stored
  float* amax_du = nullptr;  // [] or null, backward only: max |du| as stored
};

template <class T>
void validate(const SwigluArgs<T>& a, bool backward, const std::string& what) {
  check(a.n >= 0, what + ": negative element count " + std::to_string(a.n));
  if (a.n == 0) return;
  check(a.g != nullptr && a.u != nullptr, what + ": g and u must not be null");
  if (backward)
    check(a.dh != nullptr && a.dg != nullptr && a.du != nullptr, what + ": dh, dg and du must not be null");
  else
    check(a.h != nullptr, what + ": the output h must not be null");
}

// Returns |h[i]| as stored.
template <class T>
SQUEEZE_HD float swiglu_forward_at(const SwigluArgs<T>& a, std::int64_t i) {
  a.h[i] = store_acc<T>(SwigluOp<acc_t<T>>::forward(load_acc(a.g[i]), load_acc(a.u[i])));
  return fabs(float(load_acc(a.h[i])));
}
// Folds |dg[i]| and |du[i]| as stored into mg and mu.
template <class T>
SQUEEZE_HD void swiglu_backward_at(const SwigluArgs<T>& a, std::int64_t i, float& mg, float& mu) {
  acc_t<T> dg, du;
  SwigluOp<acc_t<T>>::backward(load_acc(a.g[i]), load_acc(a.u[i]), load_acc(a.dh[i]), dg, du);
  a.dg[i] = store_acc<T>(dg);
  a.du[i] = store_acc<T>(du);
  mg = amax_of(fabs(float(load_acc(a.dg[i]))), mg);
  mu = amax_of(fabs(float(load_acc(a.du[i]))), mu);
}

template <FusedElement T>
void swiglu_forward_cpu(const SwigluArgs<T>& a) {
  validate(a, false, "swiglu forward (CPU)");
  std::vector<float> m(std::size_t(cpu::ranges_for(a.n)), 0.0f);
  cpu::parallel_ranges(a.n, [&](int t, std::int64_t b, std::int64_t e) {
    float mt = 0;
    for (std::int64_t i = b; i < e; ++i) mt = amax_of(swiglu_forward_at(a, i), mt);
    m[std::size_t(t)] = mt;
  });
  if (a.amax != nullptr) *a.amax = std::accumulate(m.begin(), m.end(), 0.0f, amax_of);
}
template <FusedElement T>
void swiglu_backward_cpu(const SwigluArgs<T>& a) {
  validate(a, true, "swiglu backward (CPU)");
  std::vector<float> mg(std::size_t(cpu::ranges_for(a.n)), 0.0f), mu(mg);
  cpu::parallel_ranges(a.n, [&](int t, std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) swiglu_backward_at(a, i, mg[std::size_t(t)], mu[std::size_t(t)]);
  });
  if (a.amax_dg != nullptr) *a.amax_dg = std::accumulate(mg.begin(), mg.end(), 0.0f, amax_of);
  if (a.amax_du != nullptr) *a.amax_du = std::accumulate(mu.begin(), mu.end(), 0.0f, amax_of);
}

}  // namespace squeeze::kernels
