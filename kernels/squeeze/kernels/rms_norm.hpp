#pragma once
// Fused RMSNorm (optionally after a residual add): the element functor, shared with the CUDA kernels of
// rms_norm.cuh, and the CPU twin. Plain C++.
//
//   forward   v = x (+ residual, rounded to T and written to `sum`)          per row of h elements
//             r = 1 / sqrt(sum(v^2) / h + eps)                               fp32 (double for double), one pass
//             y = v * r * weight                                              rounded to T once
//   backward  g = dy * weight, c = r^3 * sum(g * v) / h
//             dx = r * g - c * v (+ dsum: the gradient reaching the residual sum directly)
//             dweight = sum over rows of dy * v * r                           fp32, rows reduced in a fixed order
// Saved between the passes: v (the input, or the sum) and r [rows] in fp32: nothing [rows, h] in fp32.
// On request forward also writes amax = max |y| as stored, and backward max |dx| (the scales of their FP8 casts, without
// a pass of their own).
// Types: T in {float, half, bf16} (CPU and CUDA) and double (CPU only); weight has x's type.
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "squeeze/kernels/fused_common.hpp"

namespace squeeze::kernels {

template <class Acc>
struct RmsNormOp {
  SQUEEZE_HD static Acc rrms(Acc sum_sq, std::int64_t h, Acc eps) { return Acc(1) / acc_sqrt(sum_sq / Acc(h) + eps); }
  SQUEEZE_HD static Acc y(Acc v, Acc r, Acc w) { return v * r * w; }
  SQUEEZE_HD static Acc coef(Acc dot, Acc r, std::int64_t h) { return dot * r * r * r / Acc(h); }  // c above
  SQUEEZE_HD static Acc dx(Acc v, Acc g, Acc r, Acc c) { return r * g - c * v; }
  SQUEEZE_HD static Acc dweight(Acc dy, Acc v, Acc r) { return dy * v * r; }
};

// The normalised value v of element i: x, or x + residual rounded to T (the sum as stored).
template <class T>
SQUEEZE_HD acc_t<T> rms_norm_input(const T* x, const T* residual, std::int64_t i) {
  if (residual == nullptr) return load_acc(x[i]);
  return round_acc<T>(load_acc(x[i]) + load_acc(residual[i]));
}

template <FusedElement T>
struct RmsNormForward {
  const T* x = nullptr;         // [rows, h]
  const T* residual = nullptr;  // [rows, h] or null: normalise x + residual
  const T* weight = nullptr;    // [h]
  T* y = nullptr;               // [rows, h]
  T* sum = nullptr;             // [rows, h]: x + residual; required with residual, ignored without
  acc_t<T>* rrms = nullptr;     // [rows]: r, kept for backward (may be null when no backward follows)
  std::int64_t rows = 0, h = 0;
  double eps = 1e-5;
  float* amax = nullptr;  // [] or null: max |y| as stored, NaN if any y is NaN (for y's FP8 cast)
};

template <FusedElement T>
struct RmsNormBackward {
  const T* v = nullptr;            // [rows, h]: what forward normalised (x, or the sum under a residual)
  const T* weight = nullptr;       // [h]
  const acc_t<T>* rrms = nullptr;  // [rows]: forward's r
  const T* dy = nullptr;           // [rows, h]
  const T* dsum = nullptr;         // [rows, h] or null: added to dx (the residual sum's own gradient)
  T* dx = nullptr;                 // [rows, h]
  acc_t<T>* dweight = nullptr;     // [h] or null (frozen weight)
  std::int64_t rows = 0, h = 0;
  float* amax = nullptr;  // [] or null: max |dx| as stored, NaN if any dx is NaN (for dx's FP8 cast)
};

template <class T>
void validate(const RmsNormForward<T>& a, const std::string& what = "rms_norm forward") {
  check(a.rows >= 0 && a.h > 0,
        what + ": need rows >= 0 and hidden > 0, got rows " + std::to_string(a.rows) + ", hidden " + std::to_string(a.h));
  check(a.eps >= 0, what + ": eps must be >= 0, got " + std::to_string(a.eps));
  if (a.rows == 0) return;
  check(a.x != nullptr && a.weight != nullptr && a.y != nullptr, what + ": x, weight and y must not be null");
  check(a.residual == nullptr || a.sum != nullptr, what + ": a residual needs the sum output (x + residual, kept for backward)");
}

template <class T>
void validate(const RmsNormBackward<T>& a, const std::string& what = "rms_norm backward") {
  check(a.rows >= 0 && a.h > 0,
        what + ": need rows >= 0 and hidden > 0, got rows " + std::to_string(a.rows) + ", hidden " + std::to_string(a.h));
  if (a.rows == 0) return;
  check(a.v != nullptr && a.weight != nullptr && a.rrms != nullptr && a.dy != nullptr && a.dx != nullptr,
        what + ": v, weight, rrms, dy and dx must not be null");
}

// ---- CPU twin -------------------------------------------------------------------------------------------
namespace cpu {

// Returns max |y| over the rows, as stored.
template <class T>
float rms_norm_forward_rows(const RmsNormForward<T>& a, std::int64_t r0, std::int64_t r1) {
  using Acc = acc_t<T>;
  using Op = RmsNormOp<Acc>;
  const std::int64_t h = a.h;
  float m = 0;
  for (std::int64_t r = r0; r < r1; ++r) {
    const std::int64_t base = r * h;
    const T* res = a.residual ? a.residual + base : nullptr;
    Acc ss = 0;
    for (std::int64_t j = 0; j < h; ++j) {
      const Acc v = rms_norm_input(a.x + base, res, j);
      if (res) a.sum[base + j] = store_acc<T>(v);
      ss += v * v;
    }
    const Acc rr = Op::rrms(ss, h, Acc(a.eps));
    if (a.rrms) a.rrms[r] = rr;
    const T* src = res ? a.sum + base : a.x + base;
    for (std::int64_t j = 0; j < h; ++j) {
      a.y[base + j] = store_acc<T>(Op::y(load_acc(src[j]), rr, load_acc(a.weight[j])));
      m = amax_of(std::fabs(float(load_acc(a.y[base + j]))), m);
    }
  }
  return m;
}

// dweight partial of rows [r0, r1) added to part[h]; returns max |dx| over the rows, as stored.
template <class T>
float rms_norm_backward_rows(const RmsNormBackward<T>& a, std::int64_t r0, std::int64_t r1, acc_t<T>* part) {
  using Acc = acc_t<T>;
  using Op = RmsNormOp<Acc>;
  const std::int64_t h = a.h;
  float m = 0;
  for (std::int64_t r = r0; r < r1; ++r) {
    const std::int64_t base = r * h;
    const Acc rr = a.rrms[r];
    Acc dot = 0;
    for (std::int64_t j = 0; j < h; ++j) dot += load_acc(a.dy[base + j]) * load_acc(a.weight[j]) * load_acc(a.v[base + j]);
    const Acc c = Op::coef(dot, rr, h);
    for (std::int64_t j = 0; j < h; ++j) {
      const Acc dy = load_acc(a.dy[base + j]), v = load_acc(a.v[base + j]);
      Acc dx = Op::dx(v, dy * load_acc(a.weight[j]), rr, c);
      if (a.dsum) dx += load_acc(a.dsum[base + j]);
      a.dx[base + j] = store_acc<T>(dx);
      m = amax_of(std::fabs(float(load_acc(a.dx[base + j]))), m);
      if (part) part[j] += Op::dweight(dy, v, rr);
    }
  }
  return m;
}

}  // namespace cpu

template <FusedElement T>
void rms_norm_forward_cpu(const RmsNormForward<T>& a) {
  validate(a, "rms_norm forward (CPU)");
  std::vector<float> m(std::size_t(cpu::row_threads(a.rows, a.h)), 0.0f);
  cpu::parallel_rows(a.rows, a.h,
                     [&](int t, std::int64_t r0, std::int64_t r1) { m[std::size_t(t)] = cpu::rms_norm_forward_rows(a, r0, r1); });
  if (a.amax != nullptr) *a.amax = std::accumulate(m.begin(), m.end(), 0.0f, amax_of);
}

// dweight: per-thread fp32 partials over contiguous row ranges, summed in thread order (deterministic for a thread count).
template <FusedElement T>
void rms_norm_backward_cpu(const RmsNormBackward<T>& a) {
  validate(a, "rms_norm backward (CPU)");
  using Acc = acc_t<T>;
  const int threads = cpu::row_threads(a.rows, a.h);
  std::vector<Acc> parts(a.dweight ? std::size_t(threads) * std::size_t(a.h) : 0, Acc(0));
  std::vector<float> m(std::size_t(threads), 0.0f);
  cpu::parallel_rows(a.rows, a.h, [&](int t, std::int64_t r0, std::int64_t r1) {
    m[std::size_t(t)] = cpu::rms_norm_backward_rows(a, r0, r1, a.dweight ? parts.data() + std::size_t(t) * std::size_t(a.h) : nullptr);
  });
  if (a.amax != nullptr) *a.amax = std::accumulate(m.begin(), m.end(), 0.0f, amax_of);
  if (!a.dweight) return;
  for (std::int64_t j = 0; j < a.h; ++j) {
    Acc s = 0;
    for (int t = 0; t < threads; ++t) s += parts[std::size_t(t) * std::size_t(a.h) + std::size_t(j)];
    a.dweight[j] = s;
  }
}

}  // namespace squeeze::kernels
