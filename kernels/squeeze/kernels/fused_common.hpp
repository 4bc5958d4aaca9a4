#pragma once
// Shared pieces of the fused LLaMA kernels (rms_norm, rope, swiglu): the accumulation type of a storage type,
// loads and stores through it, and the row-parallel CPU loop. Plain C++ (SQUEEZE_HD: host and device).
//   storage T  : float, squeeze::half, squeeze::bf16 (the GPU kernels' types) and double (CPU twins only: the
//                float64 instance is what the finite-difference tests check)
//   acc_t<T>   : float for float / half / bf16 (fp32 math), double for double
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"
#include "squeeze/kernels/cpu_parallel.hpp"

namespace squeeze::kernels {

template <class T>
concept FusedElement = FloatingElement<T> || std::is_same_v<T, double>;

template <FusedElement T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T>
SQUEEZE_HD acc_t<T> load_acc(const T& x) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>)
    return x;
  else
    return to_float(x);
}
template <class T>
SQUEEZE_HD T store_acc(acc_t<T> v) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>)
    return v;
  else
    return from_float<T>(v);
}
// Rounds v to T's precision and back (what a value stored as T and read again is).
template <class T>
SQUEEZE_HD acc_t<T> round_acc(acc_t<T> v) {
  return load_acc<T>(store_acc<T>(v));
}

// The larger magnitude, keeping a NaN (a NaN in either wins): the reduction of an FP8 cast's amax (fp8_cast.hpp), which
// the producing kernels (RMSNorm, SwiGLU) compute of their outputs on request.
SQUEEZE_HD float amax_of(float a, float b) { return (a > b || a != a) ? a : b; }

SQUEEZE_HD float acc_sqrt(float x) { return sqrtf(x); }
SQUEEZE_HD double acc_sqrt(double x) { return sqrt(x); }
SQUEEZE_HD float acc_exp(float x) { return expf(x); }
SQUEEZE_HD double acc_exp(double x) { return exp(x); }

template <FusedElement T>
constexpr const char* fused_dtype_name() {
  if constexpr (std::is_same_v<T, double>)
    return "double";
  else
    return dtype_name<T>().data();
}

}  // namespace squeeze::kernels
